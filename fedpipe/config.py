"""The ground of every configuration: the frozen `Section` base and the sections that every layer
reads (the run's identity and seed, training, evaluation, telemetry, the engine), plus the
`--set KEY=VALUE` parser and the plain-words validation message.

The whole run's config (`fedpipe.run.config.RunConfig`) is assembled from these and from the
parameters each dataset, partition scheme, network and method declares beside its code.
"""

from __future__ import annotations

import re
import typing
from functools import cache
from typing import Annotated, Any, Literal
from urllib.parse import parse_qsl, urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fedpipe.errors import ConfigError
from fedpipe.safe_load import parse_yaml

# --- bounds ------------------------------------------------------------------------------------------
# Every field that sizes work or memory has an upper bound, so that a typo (an extra zero, 1e9) or a
# hostile pipeline parameter is refused when the config is read instead of starting a run that never
# ends or that allocates until the node dies. Each bound is far above any real use; the error names
# the field and the bound (`format_validation_error`).

#: Rounds (and evaluation intervals): the papers run 100 to 2,000 rounds; 100,000 is 50x the most.
MAX_ROUNDS = 100_000
#: Local epochs of any stage (train.local_epochs, a method's fine-tuning or early-stopped epochs):
#: the mixture-of-experts paper's 500 early-stopped epochs is the most any method uses.
MAX_EPOCHS = 10_000
#: Clients (of a round, or a quorum): a million is cross-device scale, beyond what one run's manifest holds.
MAX_CLIENTS = 1_000_000
#: Samples in one batch (train or evaluation): a batch larger than a million samples is a typo.
MAX_BATCH = 1_000_000
#: Worker processes of one phase on one machine: the largest machines have a few hundred cores
#: (and processes are clamped to the usable cores when they start, `engine.distributed.run_ranks`).
MAX_PROCESSES = 1024
#: CPU threads of one process: as for processes.
MAX_THREADS = 1024
#: Width of a layer or an embedding a method adds (FedMN's router, hidden widths): the bundled
#: networks are at most 512 wide; 65,536 is 128x that, and one such square layer is already 16 GiB.
MAX_WIDTH = 65_536
#: Per-round checkpoints kept (each a whole phase state in the store).
MAX_CHECKPOINTS = 1_000
#: Histogram bins (ECE): 15 is usual, hundreds is already noise.
MAX_BINS = 10_000
#: Memory for clients' states, in MiB (1 TiB).
MAX_STATE_MEMORY_MB = 2**20
#: Seconds a finished run waits before it deletes its Pushgateway groups: a scrape interval is at
#: most a few minutes; an hour is plenty and a longer wait would look like a hung task.
MAX_RETENTION_SECONDS = 3_600
#: A URL or a label in the config (store, Pushgateway, pipeline label): URLs rarely pass 200 characters.
MAX_URL_CHARS = 2_048


CREDENTIALS_IN_URL = "contains a user name or password"
CREDENTIAL_IN_QUERY = "carries a credential in its query string"
#: Query parameters that hold a credential (compared lower case, without '-' and '_'): a name holding one of
#: these words (access_token, X-Amz-Signature, X-Amz-Credential, client_secret, api_key, ...) or one of
#: the short names (Azure's sig, Google's key).
_SECRET_WORDS = ("token", "secret", "passw", "signature", "credential", "apikey", "accesskey")
_SECRET_NAMES = ("sig", "key", "pwd", "pass", "auth", "authorization")


def refuse_mlflow_credentials(uri: str | None, where: str) -> str | None:
    """An MLflow tracking URI (None passes) without credentials in it: they go in the environment."""
    return uri if uri is None else refuse_url_credentials(
        uri, where, "set MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, in the "
        "environment instead (they are sent only to MLFLOW_TRACKING_URI's server).", bare_is_host=False)


def refuse_url_credentials(url: str, where: str, instead: str, *, bare_is_host: bool = True) -> str:
    """`url` unchanged, or a ValueError when it carries credentials: a user name or password
    (``scheme://user:pass@host``) or a token or signature in its query string or fragment (``?access_token=``,
    ``X-Amz-Signature``). A URL is printed by `fedpipe config`, stored in the run record and logged, so
    credentials never go there. `instead` says where they go. (The rule of the S3 endpoint in `fedpipe.store.s3`.)
    `bare_is_host`: text without a scheme starts with a host (a Pushgateway's host:port); False: it
    is a local path, where '@' and '?' are just characters."""
    text = str(url).strip()
    if "://" not in text and not bare_is_host:
        return url
    parts = urlsplit(text if "://" in text else "//" + text)
    if "@" in parts.netloc:
        raise ValueError(f"{where} {CREDENTIALS_IN_URL} (the part before '@'); a URL is printed, "
                         f"logged and stored with the run, so it must hold no credentials: {instead}")
    for name, _ in parse_qsl(parts.query, keep_blank_values=True) + parse_qsl(parts.fragment, keep_blank_values=True):
        plain = name.lower().replace("-", "").replace("_", "")
        if plain in _SECRET_NAMES or any(word in plain for word in _SECRET_WORDS):
            raise ValueError(f"{where} {CREDENTIAL_IN_QUERY} (the parameter {name[:40]!r}); a URL is printed, logged and "
                             f"stored with the run, so it must hold no credentials: {instead}")
    return url


class Section(BaseModel):
    """A frozen config section; unknown keys are errors (a typo must not be ignored silently)."""

    # coerce_numbers_to_str: `--set run.id=123` (parsed as YAML, so a number) still names a string field
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True, coerce_numbers_to_str=True)

    @model_validator(mode="before")
    @classmethod
    def _yaml_booleans(cls, data: Any) -> Any:
        """YAML 1.1 (PyYAML, a config file or `--set`) reads on/off/yes/no/true/false as booleans: a
        field whose allowed words include one of them gets the word back (`engine.amp: off`)."""
        if not isinstance(data, dict):
            return data
        words = _boolean_words(cls)
        fixed = {k: words[k][v] for k, v in data.items() if isinstance(v, bool) and v in words.get(k, {})}
        return {**data, **fixed} if fixed else data


#: The words YAML 1.1 resolves to True / False, in the order a field's own spelling is looked for.
_YAML_TRUE, _YAML_FALSE = ("on", "yes", "true"), ("off", "no", "false")


def _literal_words(annotation: Any) -> set[str]:
    """The string values of every Literal inside `annotation` (through unions and Annotated)."""
    if typing.get_origin(annotation) is Literal:
        return {a for a in typing.get_args(annotation) if isinstance(a, str)}
    return set().union(*(_literal_words(a) for a in typing.get_args(annotation)))


@cache
def _boolean_words(section: type[BaseModel]) -> dict[str, dict[bool, str]]:
    """For each field of `section` that allows a word YAML reads as a boolean: {True: word, False: word}."""
    out: dict[str, dict[bool, str]] = {}
    for name, field in section.model_fields.items():
        allowed = _literal_words(field.annotation)
        pick = {flag: next((w for w in words if w in allowed), None) for flag, words in ((True, _YAML_TRUE), (False, _YAML_FALSE))}
        if any(pick.values()):
            out[name] = {flag: w for flag, w in pick.items() if w is not None}
    return out


class RunSection(Section):
    """Identity of the run, its seed, where its artifacts go and what it runs on."""

    id: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    """Name of the run's folder in the store. None: derived from the method, dataset, split and a hash
    of the config, so the same config always lands in (and resumes) the same run."""
    seed: int = Field(0, ge=0, le=2**63 - 1)  # torch.manual_seed takes at most 64 bits
    """Fixes the partition, the initial weights, client sampling and every local shuffle."""
    store: str = Field("runs", max_length=MAX_URL_CHARS)
    """Where artifacts go: a local folder, or s3://bucket/prefix (endpoint and credentials from the
    environment: FEDPIPE_S3_ENDPOINT, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: the GPU when one is visible, else the CPU."""
    threads: int | None = Field(None, ge=1, le=MAX_THREADS)
    """CPU threads for PyTorch (None: PyTorch's default)."""

    @field_validator("store")
    @classmethod
    def _no_credentials(cls, v: str) -> str:
        return refuse_url_credentials(v, "run.store", "S3 credentials go in the environment (AWS_ACCESS_KEY_ID, "
                                      "AWS_SECRET_ACCESS_KEY; in a cluster the storage Secret).", bare_is_host=False)


class RobustConfig(Section):
    """Robust aggregation (`fedpipe.algorithms.robust`): how the server combines a round's uploads when some clients
    may send poisoned ones, for the methods whose aggregate is the plain weighted mean (FedAvg, FedProx, ...; `fedpipe
    methods`). Every rule works on the clients' updates u_k = upload_k - global; median, trimmed mean and multi-Krum are
    unweighted, as in their papers (the clients' reported sample counts do not enter). Off by default: rule=mean with no
    norm_bound is FedAvg's weighted mean, unchanged. Refused with privacy.enabled (its clipping already bounds each
    update, and its accountant assumes the plain noised sum) and with federation.secure_aggregation (the server never
    sees one update)."""

    rule: Literal["mean", "median", "trimmed_mean", "multi_krum"] = "mean"
    """mean: the sample-weighted mean (FedAvg, McMahan et al. 2017, Algorithm 1). median: the coordinate-wise median
    of the updates (Yin et al., ICML 2018, "Byzantine-robust distributed learning: towards optimal statistical rates",
    Sec. 3, Option I). trimmed_mean: per coordinate, the largest and the smallest trim_fraction of the values dropped
    and the rest averaged (Yin et al. 2018, Sec. 3, Option II). multi_krum: the krum_keep updates with the lowest Krum
    scores averaged (Blanchard et al., NeurIPS 2017, "Machine learning with adversaries: Byzantine tolerant gradient
    descent", Sec. 4 and multi-Krum in Sec. 5)."""
    norm_bound: float | None = Field(None, gt=0, le=1e6)
    """M: each update u_k is first scaled by min(1, M / ||u_k||_2), its L2 norm over every uploaded tensor, then
    combined by `rule` (norm bounding, Sun et al. 2019, "Can you really backdoor federated learning?", Sec. 4).
    None: no bound."""
    trim_fraction: float = Field(0.1, ge=0, lt=0.5)
    """beta of rule=trimmed_mean, 0 <= beta < 0.5: floor(beta * n) of the n values are dropped at each end of every
    coordinate (Yin et al. 2018, Definition 2), so at least one value always stays; 0 is the plain unweighted mean."""
    byzantine: int = Field(1, ge=0, le=MAX_CLIENTS)
    """f of rule=multi_krum: the malicious clients tolerated. Each update's score sums its squared L2 distances to its
    n - f - 2 nearest other updates (Blanchard et al. 2017, Sec. 4); a round needs n > 2f + 2 uploads (else it fails,
    naming the counts)."""
    krum_keep: int | None = Field(None, ge=1, le=MAX_CLIENTS)
    """m of rule=multi_krum: how many of the lowest-scored updates are averaged (m = 1 is Krum itself). None: n - f."""

    @property
    def active(self) -> bool:
        """Whether the server aggregates otherwise than FedAvg's weighted mean."""
        return self.rule != "mean" or self.norm_bound is not None

    def describe(self) -> str:
        """The rule as `--set` would write it, e.g. train.robust.rule=median with train.robust.norm_bound=5."""
        parts = [f"train.robust.rule={self.rule}"] if self.rule != "mean" else []
        if self.norm_bound is not None:
            parts.append(f"train.robust.norm_bound={self.norm_bound:g}")
        return " with ".join(parts) or "train.robust.rule=mean"


class TrainConfig(Section):
    """Federated rounds and local optimisation, shared by every method."""

    rounds: int = Field(30, ge=1, le=MAX_ROUNDS)
    """R: federated rounds (methods with extra phases, such as fine-tuning, add them after)."""
    client_fraction: float = Field(1.0, gt=0, le=1)
    """C: fraction of clients sampled per round, without replacement (at least one). With privacy.enabled, Poisson
    sampling instead: each client joins a round with probability C on its own (the privacy accountant assumes it)."""
    local_epochs: int = Field(5, ge=1, le=MAX_EPOCHS)
    """E: local epochs per round."""
    batch_size: int = Field(10, ge=1, le=MAX_BATCH)
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
    min_clients: int = Field(1, ge=1, le=MAX_CLIENTS)
    """A round fails when fewer clients than this report back (a failed client is left out of the round)."""
    keep_checkpoints: int = Field(2, ge=1, le=MAX_CHECKPOINTS)
    """Per-round checkpoints kept while a phase runs (older ones are deleted; the phase's final state stays)."""
    select: Literal["last", "best_val_loss", "best_val_accuracy"] = "last"
    """Which round's server state a federated phase ends with: `last` (the last round's), or the round whose
    global model scored best on the validation splits of that round's participating clients (their mean
    loss, or mean accuracy), checked every `select_every` rounds and at the phase's last: the mixture-of-
    experts paper's model selection (Listo Zec et al., Sec. 4: the FedAvg model with the best mean
    validation loss, checked every 50 rounds). The choice is kept in the checkpoints, so a resumed phase
    selects as an uninterrupted one would. Methods without a global model keep the last round's."""
    select_every: int = Field(1, ge=1, le=MAX_ROUNDS)
    """With select other than last: check every this many rounds of the phase (and at its last round)."""
    init_from: str = Field("none", pattern=r"^(none|promoted|[1-9][0-9]{0,8})$")
    """Warm start from the model line `registry.name`: `promoted` (its promoted version), a version number,
    or `none` (random initial weights). The first phase starts from that version's global model and the
    clients' kept states (matched by client name); a model spec that differs is an error naming both.
    `promoted` is pinned to the version it names when the run starts, so it is part of the run's id."""
    robust: RobustConfig = RobustConfig()
    """Robust aggregation against poisoned uploads (see RobustConfig); off by default (FedAvg's weighted mean)."""


class DropCheckConfig(Section):
    """Before the gate compares, the promoted version is scored on each client's new data: a client whose
    accuracy collapses (a broken or poisoned drop: relabelled folders, swapped images) or whose label mix
    moved far marks the drop as suspect, and the candidate is not promoted whatever its scores."""

    enabled: bool = True
    """Run the check (false: the gate compares scores alone, as a poisoned drop would like)."""
    max_drop: float = Field(0.30, ge=0.0, le=1.0)
    """Flag a client whose promoted model's accuracy on its new test split is more than this below its
    accuracy on that client when it was registered."""
    chance_multiple: float = Field(2.0, ge=0.0, le=100.0)
    """...or falls below this many times chance (1 / number of classes) when it was above it then."""
    max_label_shift: float = Field(0.5, ge=0.0, le=1.0)
    """...or whose label distribution moved by more than this (total variation distance, 0..1) since."""
    min_samples: int = Field(10, ge=1)
    """Clients with fewer test samples in the new drop are reported but never flagged (too few to tell)."""
    relabel_below_chance: float = Field(0.5, ge=0.0, le=1.0)
    """...or on whose NEW test samples (those the promoted version's drop did not hold; at least min_samples) the
    promoted model scores below this many times chance, having scored at least chance_multiple x chance on that
    client at registration: the signature of files moved to other labels and renamed (new samples, so no shared
    sample shows it; the client's whole split falls too little for max_drop). 0: this rule is off."""
    max_seen_drop: float = Field(0.10, ge=0.0, le=1.0)
    """...or on whose test samples the promoted version's own drop held (at least min_samples) the promoted model,
    scored on the new drop's copies of those files and on its own drop's, loses more than this: files relabelled or
    swapped under their old names, however many new files dilute them. 1: this rule is off."""
    max_new_drop: float = Field(0.10, ge=0.0, le=1.0)
    """...or on whose NEW test samples (at least min_samples) the promoted model scores more than this, plus two
    standard errors of sampling, below its accuracy on that client at registration: files moved to other labels
    and renamed, however many unchanged files are renamed with them. 1: this rule is off."""


class KubeflowHubConfig(Section):
    """Kubeflow Hub (Kubeflow Model Registry): where each promoted version is registered as a RegisteredModel
    (the line) / ModelVersion (the version, with the gate's figures and the data snapshot as custom
    properties) / ModelArtifact (the version's folder in the store), so that KServe can name it as
    `model-registry://<model>/<version>`. The token is never part of the config: it comes from the
    environment (FEDPIPE_HUB_TOKEN, or the file FEDPIPE_HUB_TOKEN_FILE names, else the pod's service-account
    token), and is sent only when `url` is the registry FEDPIPE_HUB_URL names. A registration that fails keeps the
    promotion and is retried by the next publication."""

    url: str = Field("", max_length=MAX_URL_CHARS)
    """The registry's REST address, e.g. https://model-registry-service.kubeflow.svc.cluster.local:8443 or
    http://model-registry-service.kubeflow:8080; empty: nothing is registered in Kubeflow Hub."""
    model: str = Field("", pattern=r"^([A-Za-z0-9][A-Za-z0-9._-]{0,127})?$")
    """The RegisteredModel's name; empty: the line's name (registry.name)."""
    author: str = Field("fedpipe", min_length=1, max_length=128)
    """The author (and the new RegisteredModel's owner) the registry records."""

    @field_validator("url")
    @classmethod
    def _http_without_credentials(cls, value: str) -> str:
        text = value.strip()
        if text and not re.fullmatch(r"https?://[^/?#\s]+(/[^?#\s]*)?", text):
            raise ValueError(f"registry.kubeflow_hub.url {text[:80]!r} is not an http:// or https:// address of the registry, "
                             "e.g. https://model-registry-service.kubeflow.svc.cluster.local:8443")
        return refuse_url_credentials(text, "registry.kubeflow_hub.url", "the token goes in FEDPIPE_HUB_TOKEN (or a file "
                                      "named by FEDPIPE_HUB_TOKEN_FILE) in the environment")


class RegistryConfig(Section):
    """The model line a run's models are registered in, and the gate that decides whether a new version is
    promoted (the `models` layer: fedpipe.models)."""

    name: str = Field("", pattern=r"^([a-z0-9][a-z0-9._-]{0,62})?$")
    """The model line (models/<name>/ in the run's store); empty: the run's models are not registered."""
    gate_metric: Literal["personalized_accuracy", "global_accuracy", "worst10_accuracy"] = "personalized_accuracy"
    """What the gate compares, candidate against the promoted version, on data the candidate's drop cannot
    rewrite (the test samples both versions' drops hold, read from the promoted version's drop; or the
    reference set): the clients' mean personalized accuracy, the global model's accuracy, or the mean
    accuracy of the worst 10% of clients."""
    tolerance: float = Field(0.0, ge=0.0, le=1.0)
    """Promote when the candidate's metric is at least the promoted version's minus this."""
    max_client_drop: float = Field(0.05, ge=0.0, le=1.0)
    """...and no client present in both loses more than this accuracy, and no new client falls more than
    this below the promoted version's global (or nearest client's) model on that client's data."""
    drop_check: DropCheckConfig = DropCheckConfig()
    """The drop check: the promoted version on each client's new data (see DropCheckConfig)."""
    reference: str | None = Field(None, max_length=MAX_URL_CHARS)
    """A pinned reference set (a folder or s3://bucket/prefix laid out as your data, with its manifest) the
    gate compares on instead of the shared test samples: every sample of a client there scores that
    client's models, all of them the global models. None: the shared test samples."""
    kubeflow_hub: KubeflowHubConfig = KubeflowHubConfig()
    """Register each promoted version in Kubeflow Hub (see KubeflowHubConfig); off while its url is empty."""

    @field_validator("reference")
    @classmethod
    def _no_credentials(cls, value: str | None) -> str | None:
        if value is None:
            return None
        return refuse_url_credentials(value, "registry.reference", "set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the environment",
                                      bare_is_host=False)


class EvalConfig(Section):
    """How often and how the models are evaluated."""

    every: int = Field(1, ge=0, le=MAX_ROUNDS)
    """Evaluate personalized and global accuracy every this many rounds (and always at a phase's end);
    0 evaluates only at phase ends."""
    ece_bins: int = Field(15, ge=1, le=MAX_BINS)
    """Bins of the expected calibration error."""
    batch_size: int = Field(1000, ge=1, le=MAX_BATCH)
    """Batch size for evaluation (memory only; results do not depend on it)."""
    personalized_on_global_test: bool = False
    """Also score every client's personalized model on the balanced global test set (the mixture-of-
    experts paper's global column: how well specialists generalise); costs clients x test-set forwards."""
    candidates: Literal["per_client", "pooled"] = "per_client"
    """Where a method offers several personalized models per client (SuPerFed's lam grid), which one
    counts: per_client, each client's pick on its own validation split (SuPerFed's protocol, noisy with
    ~20 validation samples); pooled, one candidate for every client, best on the validation splits pooled
    over clients (less noisy, still honest). The summary reports both, and the test-oracle pick, beside."""
    split: Literal["test", "validation"] = "test"
    """Which held-out data evaluation scores. test: each client's test split and the global test set.
    validation: for tuning (a study's trials): the test splits are dropped from memory before training,
    each client is scored on its validation split and the global model on the clients' validation
    splits pooled, so nothing a trial reports has seen test data. Such a run draws no plots (a trial's
    report is its summary and tables: its plots cost more than a short trial's rounds)."""


class EngineConfig(Section):
    """How a phase is executed. None of it changes the method's math: results agree within float
    tolerance whatever is chosen here (so it is left out of the run's fingerprint)."""

    mode: Literal["simulation", "federation"] = "simulation"
    """simulation: every client's data in one store, the federation simulated in the phase task (the research
    path). federation: the phase task runs the server side against a Flower SuperLink and each site trains
    on its own data in its own process (`fedpipe site`); only the method's upload crosses the network
    (the `federation` section; docs/federation.md)."""
    clients: Literal["auto", "batched", "sequential"] = "auto"
    """How a round's clients are trained in each process: sequential (one after another), batched
    (many at once with torch.func.vmap, one stacked model per chunk), or auto: batched on a GPU, one
    by one on a CPU (decided from the device, never from timings, so a config and seed always compute
    the same numbers; the log says what was chosen and why). The two agree within float tolerance,
    not bit for bit."""
    chunk: Literal["auto"] | Annotated[int, Field(ge=1, le=MAX_CLIENTS)] = "auto"
    """Batched mode: at most this many clients share one stacked step (bounds memory). auto: the
    largest chunk whose memory, measured per client from one probe step (its stacked weights,
    gradients, momentum and the activations autograd saves), fits `chunk_memory_fraction` of the
    device's free memory, at most the clients of a round; recorded beside the phase's checkpoints
    (engine.json) and reused on resume (`fedpipe.engine.chunking`)."""
    chunk_memory_fraction: float = Field(0.5, gt=0, le=0.95)
    """engine.chunk=auto: the share of the GPU's free memory (or the CPU's available memory) a chunk may take."""
    processes: Literal["auto"] | Annotated[int, Field(ge=1, le=MAX_PROCESSES)] = "auto"
    """Worker processes for one phase on this machine (torch.distributed, gloo on CPU): the round's
    clients are spread over them and their uploads all-reduced. auto: on a CPU with 2+ usable cores
    (affinity and container CPU limit) and a round of 5,000+ training samples, one single-threaded
    process per core (at most one per client); else 1 (`fedpipe.engine.choice`). The choice is
    recorded beside the phase's checkpoints (engine.json) and reused by reruns and resumes. Under
    torchrun the world size comes from torchrun instead. At most 1024, and never more than the
    usable cores when the processes start (a larger number, configured or recorded, is clamped with a warning)."""
    state_memory_mb: float = Field(1024, gt=0, le=MAX_STATE_MEMORY_MB)
    """Clients' persistent states (SuPerFed's local models, pFedMB's alphas, ...) kept in memory up to
    this size; the least recently used beyond it spill to the store (<run>/phases/<phase>/clients/,
    one immutable object per client and round; checkpoints then refer to them) and come back when
    the client is used again."""
    graphs: Literal["off", "on"] = "off"
    """Batched mode: the steps in which every client of a chunk takes a full batch run on static
    buffers, captured once per chunk and stage as a CUDA graph on a GPU and replayed (no kernel
    launches from Python); an epoch's ragged last batch, masked steps, and a stage whose capture fails
    (an op that syncs with the host: logged) run eagerly. The same numbers as off (on a CPU the static
    step runs uncaptured, which the tests check bit for bit). Off by default until
    `benchmarks/gpu.py` has measured it on a GPU."""
    channels_last: Literal["auto", "on", "off"] = "auto"
    """Images in channels-last memory layout (faster convolutions with oneDNN and cuDNN); auto: on for
    convolutional models."""
    amp: Literal["auto", "off", "bf16"] = "auto"
    """bf16 autocast of the local training's forward and backward (fp32 master weights, optimizer
    state and aggregation). auto: bf16 on a GPU with bf16 tensor cores (compute capability 8.0+),
    off elsewhere; the choice is recorded beside the phase's checkpoints (engine.json) like
    engine.clients and reused on resume. bf16: on any GPU, and on a CPU (CPU autocast: slower than
    fp32 without AMX; for checking a bf16 run's numbers). Evaluation always runs in fp32."""


class SecureAggregationConfig(Section):
    """SecAgg+ (Bell et al. 2020, as Flower 1.42's SecAggPlusWorkflow and secaggplus_mod run it): each site masks
    its weighted upload so that the server learns only the sum over the round's sites, never one site's update."""

    enabled: bool = False
    """On: every round's uploads are summed under SecAgg+ masks (federation mode only, and only for methods whose
    aggregation is a weighted sum: `fedpipe methods`). The server then cannot check one site's values, only the
    sum's: each site checks its own upload (finite, shapes) before masking it."""
    num_shares: Annotated[int, Field(ge=3, le=MAX_CLIENTS)] | Annotated[float, Field(gt=0, le=1)] = 3
    """Shares each site's secrets are split into (an int of at least 3, as Flower's SecAggPlusWorkflow requires, or a
    fraction of the round's sites); Flower's default 3."""
    reconstruction_threshold: Annotated[int, Field(ge=2, le=MAX_CLIENTS)] | float = 2
    """Shares needed to unmask (an int, or a fraction of num_shares): the rounds survive up to
    num_shares - reconstruction_threshold sites dropping out mid-protocol."""
    clipping_range: float = Field(8.0, gt=0, le=1e6)
    """Each value of a site's weighted upload is clipped to +-this before quantisation (Flower's default 8.0)."""
    quantization_range: Annotated[int, Field(ge=2**8, le=2**40)] = 2**22
    """Quantisation levels over [-clipping_range, clipping_range] (Flower's default 2**22: one step ~3.8e-6)."""
    max_weight: float = Field(1000.0, gt=0, le=1e12)
    """The largest sample count a site may weigh its upload with (Flower's max_weight); a site with more
    samples is counted as this many."""


class FederationConfig(Section):
    """engine.mode=federation: the run's server side against a Flower SuperLink, each site a `fedpipe site` process
    next to its own data (docs/federation.md). Where the run's processes find the federation and how long they wait."""

    superlink: str = Field("127.0.0.1:9093", max_length=MAX_URL_CHARS)
    """The SuperLink's host:port (its one TLS port: Fleet, Control and Runtime APIs, Flower 1.42)."""
    root_certificates: str | None = Field(None, max_length=MAX_URL_CHARS)
    """The CA certificate (PEM file) the SuperLink's certificate is checked against; TLS is always on."""
    sites: Annotated[int, Field(ge=1, le=MAX_CLIENTS)] | None = None
    """How many sites the run waits for before its first round (None: partition.num_clients)."""
    site_names: list[Annotated[str, Field(min_length=1, max_length=200)]] = Field(default_factory=list, max_length=MAX_CLIENTS)
    """The sites the run waits for, by the client name each site's data gives it (its fedpipe-data.yaml; `site-K` for
    a try-out folder). The census waits until each has answered, a timeout names the missing ones, and a site not named
    is left out of the run. Empty: any `sites` sites."""
    connect_timeout: float = Field(300, gt=0, le=86_400)
    """Seconds the run waits for the sites to connect and answer the census."""
    round_timeout: float = Field(300, gt=0, le=86_400)
    """Seconds a round waits for each chosen site's reply; a site that has not replied counts as failed
    (the round is kept with at least min(train.min_clients, chosen) sites)."""
    rejoin_wait: float = Field(0, ge=0, le=86_400)
    """Seconds a round waits at its start for a chosen site that is not connected (a site restarting)."""
    secure_aggregation: SecureAggregationConfig = SecureAggregationConfig()

    @model_validator(mode="after")
    def _names_and_count(self):
        twice = sorted({n for n in self.site_names if self.site_names.count(n) > 1})
        if twice:
            raise ValueError(f"federation.site_names names {', '.join(twice)} twice: each site once")
        if self.site_names and self.sites is not None and self.sites != len(self.site_names):
            raise ValueError(f"federation.sites={self.sites} but federation.site_names names {len(self.site_names)} sites: "
                             "give one of them, or make them agree")
        return self


class PrivacyConfig(Section):
    """User-level differential privacy of what clients upload; off by default.

    Plan it with `fedpipe privacy plan` (docs/privacy.md). When on, every communicating round: each client's update (its
    upload minus what it downloaded; never its personal state) is clipped to L2 norm `clip`, Gaussian noise of
    std `noise_multiplier * clip` is added, and the server adds the clipped updates with equal weights over
    the expected cohort (DP-FedAvg, McMahan et al. 2018, Algorithm 1). Clients then join a round by Poisson
    sampling, each independently with probability train.client_fraction (the round's size varies; the
    accountant's amplification by sampling assumes it). Methods whose server uses per-client statistics
    are refused (`fedpipe methods` says which and why)."""

    enabled: bool = False
    """Turn differential privacy on (every other field of this section is ignored while off)."""
    clip: float = Field(1.0, gt=0, le=1e6)
    """C: the L2 norm each client's update is clipped to (the sensitivity of the sum)."""
    per_layer: bool = False
    """Clip each uploaded tensor to clip / sqrt(L) (L tensors) instead of the whole update to clip: the flat
    norm stays within clip (McMahan et al. 2018, Sec. 3, per-layer clipping)."""
    noise_multiplier: float = Field(1.0, ge=0, le=1e4)
    """sigma: the noise std is sigma * clip (on the sum in central mode, on each update in local mode).
    0: clipping only, no privacy guarantee (epsilon is infinite)."""
    mode: Literal["central", "local"] = "central"
    """central: the server (trusted) adds the noise once to the sum of the clipped updates. local: every client
    adds it to its own clipped update before it leaves, so the server never sees an update without noise (the
    sum then carries sqrt(cohort) times the noise; the epsilon reported is the central one, which it bounds)."""
    delta: float | None = Field(None, gt=0, lt=1)
    """delta of (epsilon, delta)-DP; None: min(1e-5, 0.01 / (number of clients)), far below 1/n (fedpipe.engine.accounting.default_delta)."""
    target_epsilon: float | None = Field(None, gt=0, le=1e4)
    """Privacy budget. With on_target=stop (the default) training stops cleanly after the last round whose
    epsilon stays within it (the run then evaluates and reports as usual); with on_target=calibrate the run
    sets noise_multiplier, before its first round, to the smallest that spends at most this over the planned rounds."""
    on_target: Literal["stop", "calibrate"] = "stop"
    """What target_epsilon does: stop training at the budget, or calibrate noise_multiplier to it before the run."""
    accountant: Literal["rdp", "prv"] = "rdp"
    """Opacus's accountant: rdp (Renyi DP of the sampled Gaussian, Mironov et al. 2019) or prv (privacy loss
    random variables, Gopi et al. 2021: tighter)."""
    adaptive_clip: bool = False
    """Adapt clip every round towards the target_quantile of the clients' update norms (Andrew, Thakkar, McMahan
    and Ramaswamy 2021, "Differentially private learning with adaptive clipping", Algorithm 1): clip is the
    starting value. The count of clients within the clip is released with noise too, so the updates' own noise
    multiplier rises to keep the round's privacy at noise_multiplier (their Theorem 1). Central mode only."""
    target_quantile: float = Field(0.5, gt=0, lt=1)
    """gamma: the fraction of updates that should be within the clip (0.5: the median norm, the paper's default)."""
    clip_lr: float = Field(0.2, gt=0, le=10)
    """eta_C: the step of the geometric update clip <- clip * exp(-eta_C * (b - gamma)), b the noised fraction of
    clients within the clip (0.2: the paper's default)."""
    clip_count_stddev: float | None = Field(None, gt=0, le=1e6)
    """sigma_b: the std of the noise on the count of clients within the clip; None: the expected cohort / 20 (the
    paper's choice, Sec. 4). Must exceed noise_multiplier / 2."""
    census_noise_multiplier: float | None = Field(10.0, gt=0, le=1e6)
    """A federation's census: each site releases its label counts (per split and label) with Gaussian noise of this
    std added to each count, rounded and floored at 0 (the Gaussian mechanism on a histogram: one record changes one
    count by 1), so the report's partition heatmap is drawn from noised counts; the accountant counts the release
    once, with this noise multiplier at sample rate 1, before the first round. None: the sites withhold their counts
    (no heatmap, nothing spent). Sites whose data fedpipe exported from a simulation report no counts either way."""
    seeded_noise: bool = False
    """False: the noise and the Poisson sample come from the operating system's entropy (needed for the
    guarantee: anyone who knows run.seed could otherwise subtract the noise). True: from run.seed, so a rerun
    computes the same numbers (experiments and tests; no protection against whoever holds the config)."""
    public_init: bool = False
    """The starting model (train.init_from) was trained on public data only, so starting from it spends no privacy
    of this federation's clients. False (the default): a private run refuses to start from a version that was not
    trained with privacy (its weights may reveal its clients' data, which no epsilon of this run would cover), and
    starts from a private version by continuing its accountant, so epsilon covers both runs. True lifts the refusal
    for a version that is not private (its ledger is not composed: your word that it holds no client's data); a
    private version's ledger is still composed, since its clients' data is in it whatever this flag says."""

    @field_validator("delta", "target_epsilon", "clip_count_stddev", "census_noise_multiplier", mode="before")
    @classmethod
    def _empty_is_unset(cls, v):
        # a pipeline's text parameter leaves these "" for unset (pipelines/builder.py TEXT_PARAMETERS)
        return None if isinstance(v, str) and not v.strip() else v


class TelemetryConfig(Section):
    """Where per-round metrics go besides the run's JSONL file."""

    pushgateway: str | None = Field(None, max_length=MAX_URL_CHARS)
    """Prometheus Pushgateway URL for per-round metrics (None: env FEDPIPE_PUSHGATEWAY, else no push)."""
    progress: bool = True
    """Show a progress bar over rounds on the terminal."""
    pipeline: str = Field("local", max_length=253)  # a Kubernetes name at most
    """The `pipeline` label on pushed metrics (set by the Kubeflow pipeline)."""
    pushgateway_retention_seconds: int = Field(60, ge=0, le=MAX_RETENTION_SECONDS)
    """When the run's evaluation has finished, every Pushgateway group of the run (all its phases) is
    deleted once its newest push is this many seconds old, so that Prometheus has scraped the final
    values first (60: four scrapes at the chart's 15 s interval; 0: delete at once). After deletion
    Prometheus keeps the history in its TSDB and marks the series stale, so the dashboard stops showing
    the finished run as live. An unreachable Pushgateway only logs a warning."""
    mlflow: str | None = Field(None, max_length=MAX_URL_CHARS)
    """MLflow tracking URI for per-round metrics, the config as params and the report as artifacts
    (None: env MLFLOW_TRACKING_URI, else no MLflow tracking). Credentials go in MLflow's own variables
    (MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD), never in the URI.
    An unreachable server only logs a warning."""
    mlflow_experiment: str = Field("fedpipe", min_length=1, max_length=500)
    """The MLflow experiment runs are logged in (created when missing), unless MLFLOW_EXPERIMENT_ID is set."""

    @field_validator("pushgateway")
    @classmethod
    def _no_credentials(cls, v: str | None) -> str | None:
        return v if v is None else refuse_url_credentials(
            v, "telemetry.pushgateway", "a Pushgateway that needs authentication is reached through a proxy or a "
            "service mesh (an Istio sidecar) that adds it, never through the URL.")

    @field_validator("mlflow")
    @classmethod
    def _no_mlflow_credentials(cls, v: str | None) -> str | None:
        return refuse_mlflow_credentials(v, "telemetry.mlflow")


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


_URL_USERINFO = re.compile(r"(://)[^/@\s'\"]*@")


def format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith(("tagged-union", "function-")))
        # a discriminated union puts the chosen tag in the path (partition.dirichlet.alpha): keep the field path
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; `fedpipe config --explain` lists the fields)"
        elif e["type"] in ("less_than_equal", "less_than", "too_long", "string_too_long"):
            msg += " (fedpipe's bound on this field, far above real use: check for a typo such as an extra zero)"
        try:
            got = repr(e.get("input"))
        except ValueError:  # an int of more digits than Python prints (0x followed by 5,000 f's)
            got = f"an {type(e.get('input')).__name__} too long to print"
        got = got if len(got) <= 200 else got[:197] + "..."  # a value from a big file stays one line
        got = _URL_USERINFO.sub(r"\1***@", got)  # an error message is pasted into issues: no password in it
        if CREDENTIALS_IN_URL in msg or CREDENTIAL_IN_QUERY in msg:
            got = "a URL with credentials, not repeated here"
        lines.append(f"  {loc or '(top level)'}: {msg} (got {got})" if e["type"] != "missing" else f"  {loc}: required")
    return "The configuration is invalid:\n" + "\n".join(lines)

