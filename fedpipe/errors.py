"""Errors a user can act on.

Every error raised for bad input is a `FedpipeError`: its message says what is wrong and how to
fix it, in plain words, in one paragraph. The CLI prints that message and exits non-zero without a
traceback; anything else that escapes is a bug in fedpipe.
"""


class FedpipeError(Exception):
    """A problem the user can fix (bad config, missing data, unreachable service, bad artifact)."""


class ConfigError(FedpipeError):
    """The run configuration is invalid."""


class DataError(FedpipeError):
    """A dataset is missing or unreadable, or a split cannot be satisfied."""


class StoreError(FedpipeError):
    """The artifact store cannot be reached, or an object is missing."""


class CorruptArtifactError(StoreError):
    """An artifact's bytes do not match the sha256 recorded when it was written."""


class TrainingError(FedpipeError):
    """Training cannot go on (for example every client of a round failed)."""


class GpuUnusableError(FedpipeError):
    """This process was given a GPU that PyTorch cannot use (an NVIDIA driver too old for torch's CUDA
    build, or none at all): the run stops rather than train on the CPU with the GPU idle."""


class ArtifactSignatureError(CorruptArtifactError):
    """With artifact signing on (FEDPIPE_SIGNING_KEY), an artifact's signature is missing or does not match:
    it was changed, moved to another key, or signed with another key, after it was written."""
