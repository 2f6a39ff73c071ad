"""The ground of every configuration: the frozen `Section` base and the sections that every layer
reads (the run's identity and seed, training, evaluation, telemetry, the engine), plus the
`--set KEY=VALUE` parser and the plain-words validation message.

The whole run's config (`fedpipe.run.config.RunConfig`) is assembled from these and from the
parameters each dataset, partition scheme, network and method declares beside its code.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedpipe.errors import ConfigError
from fedpipe.safe_load import parse_yaml


class Section(BaseModel):
    """A frozen config section; unknown keys are errors (a typo must not be ignored silently)."""

    # coerce_numbers_to_str: `--set run.id=123` (parsed as YAML, so a number) still names a string field
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True, coerce_numbers_to_str=True)


class RunSection(Section):
    """Identity of the run, its seed, where its artifacts go and what it runs on."""

    id: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    """Name of the run's folder in the store. None: derived from the method, dataset, split and a hash
    of the config, so the same config always lands in (and resumes) the same run."""
    seed: int = Field(0, ge=0)
    """Fixes the partition, the initial weights, client sampling and every local shuffle."""
    store: str = "runs"
    """Where artifacts go: a local folder, or s3://bucket/prefix (endpoint and credentials from the
    environment: FEDPIPE_S3_ENDPOINT, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: the GPU when one is visible, else the CPU."""
    threads: int | None = Field(None, ge=1)
    """CPU threads for PyTorch (None: PyTorch's default)."""


class TrainConfig(Section):
    """Federated rounds and local optimisation, shared by every method."""

    rounds: int = Field(30, ge=1)
    """R: federated rounds (methods with extra phases, such as fine-tuning, add them after)."""
    client_fraction: float = Field(1.0, gt=0, le=1)
    """C: fraction of clients sampled per round, without replacement (at least one)."""
    local_epochs: int = Field(5, ge=1)
    """E: local epochs per round."""
    batch_size: int = Field(10, ge=1)
    """B: local mini-batch size."""
    optimizer: Literal["sgd", "adam"] = "sgd"
    """Local optimiser, rebuilt every round (no optimiser state is kept between rounds)."""
    lr: float = Field(0.01, gt=0)
    """Learning rate at round 1."""
    lr_decay: float = Field(0.999, gt=0, le=1)
    """Multiplied into the learning rate every round: lr_r = lr * lr_decay^(r - 1)."""
    momentum: float = Field(0.9, ge=0, lt=1)
    """SGD momentum."""
    weight_decay: float = Field(1e-4, ge=0)
    """L2 weight decay of the local optimiser."""
    min_clients: int = Field(1, ge=1)
    """A round fails when fewer clients than this report back (a failed client is left out of the round)."""
    keep_checkpoints: int = Field(2, ge=1)
    """Per-round checkpoints kept while a phase runs (older ones are deleted; the phase's final state stays)."""


class EvalConfig(Section):
    """How often and how the models are evaluated."""

    every: int = Field(1, ge=0)
    """Evaluate personalized and global accuracy every this many rounds (and always at a phase's end);
    0 evaluates only at phase ends."""
    ece_bins: int = Field(15, ge=1)
    """Bins of the expected calibration error."""
    batch_size: int = Field(1000, ge=1)
    """Batch size for evaluation (memory only; results do not depend on it)."""
    personalized_on_global_test: bool = False
    """Also score every client's personalized model on the balanced global test set (the mixture-of-
    experts paper's global column: how well specialists generalise); costs clients x test-set forwards."""


class EngineConfig(Section):
    """How a phase is executed. None of it changes the method's math: results agree within float
    tolerance whatever is chosen here (so it is left out of the run's fingerprint)."""

    clients: Literal["auto", "batched", "sequential"] = "auto"
    """How a round's clients are trained in each process: sequential (one after another), batched
    (many at once with torch.func.vmap, one stacked model per chunk), or auto: batched on a GPU, one
    by one on a CPU (decided from the device, never from timings, so a config and seed always compute
    the same numbers; the log says what was chosen and why). The two agree within float tolerance,
    not bit for bit."""
    chunk: int = Field(32, ge=1)
    """Batched mode: at most this many clients share one stacked step (bounds memory)."""
    processes: Literal["auto"] | Annotated[int, Field(ge=1)] = "auto"
    """Worker processes for one phase on this machine (torch.distributed, gloo on CPU): the round's
    clients are spread over them and their uploads all-reduced. auto: on a CPU with 2+ usable cores
    (affinity and container CPU limit) and a round of 5,000+ training samples, one single-threaded
    process per core (at most one per client); else 1 (`fedpipe.engine.choice`). The choice is
    recorded beside the phase's checkpoints (engine.json) and reused by reruns and resumes. Under
    torchrun the world size comes from torchrun instead."""
    state_memory_mb: float = Field(1024, gt=0)
    """Clients' persistent states (SuPerFed's local models, pFedMB's alphas, ...) kept in memory up to
    this size; the least recently used beyond it spill to the store (<run>/phases/<phase>/clients/,
    one immutable object per client and round; checkpoints then refer to them) and come back when
    the client is used again."""
    channels_last: Literal["auto", "on", "off"] = "auto"
    """Images in channels-last memory layout (faster convolutions with oneDNN and cuDNN); auto: on for
    convolutional models."""
    amp: Literal["off", "bf16"] = "off"
    """bf16 autocast of the forward pass on a GPU (ignored on a CPU)."""


class TelemetryConfig(Section):
    """Where per-round metrics go besides the run's JSONL file."""

    pushgateway: str | None = None
    """Prometheus Pushgateway URL for per-round metrics (None: env FEDPIPE_PUSHGATEWAY, else no push)."""
    progress: bool = True
    """Show a progress bar over rounds on the terminal."""
    pipeline: str = "local"
    """The `pipeline` label on pushed metrics (set by the Kubeflow pipeline)."""
    pushgateway_retention_seconds: int = Field(60, ge=0)
    """When the run's evaluation has finished, every Pushgateway group of the run (all its phases) is
    deleted once its newest push is this many seconds old, so that Prometheus has scraped the final
    values first (60: four scrapes at the chart's 15 s interval; 0: delete at once). After deletion
    Prometheus keeps the history in its TSDB and marks the series stale, so the dashboard stops showing
    the finished run as live. An unreachable Pushgateway only logs a warning."""


def apply_override(tree: dict, assignment: str) -> None:
    """Apply one `dotted.key=value` to a nested dict; the value is parsed as YAML (numbers, bools, lists)."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, for example --set train.rounds=50.")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {assignment!r}: {key!r} is not a dotted field name like train.rounds.")
    # YAML (numbers, bools, lists) within bounds; text that is not YAML stays text
    value = parse_yaml(raw, f"--set {key.strip()}", "--set value", invalid_is_text=True) if raw.strip() else ""
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {assignment!r}: {part!r} is a value, not a section.")
        node = child
    node[parts[-1]] = value


def format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith(("tagged-union", "function-")))
        # a discriminated union puts the chosen tag in the path (partition.dirichlet.alpha): keep the field path
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; `fedpipe config --explain` lists the fields)"
        try:
            got = repr(e.get("input"))
        except ValueError:  # an int of more digits than Python prints (0x followed by 5,000 f's)
            got = f"an {type(e.get('input')).__name__} too long to print"
        got = got if len(got) <= 200 else got[:197] + "..."  # a value from a big file stays one line
        lines.append(f"  {loc or '(top level)'}: {msg} (got {got})" if e["type"] != "missing" else f"  {loc}: required")
    return "The configuration is invalid:\n" + "\n".join(lines)

