"""The run configuration: one typed, validated object, read from YAML and overridable field by field.

    cfg = load_config("examples/superfed_mm_mnist5k.yaml", ["train.rounds=50", "method.nu=2"])

Every section is a frozen pydantic model whose attribute docstrings say what each value means;
`fedpipe config --explain` prints them. A pipeline parameter sets the same field as `--set`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, TypeAdapter, ValidationError, field_validator, model_validator

from fedpipe.algorithms import MethodConfig
from fedpipe.data.datasets import DATASETS, DataConfig
from fedpipe.data.partition import PartitionConfig
from fedpipe.errors import ConfigError
from fedpipe.models import MODELS
from fedpipe.safe_load import load_yaml_file, parse_yaml
from fedpipe.schema import Section


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


class ModelConfig(Section):
    """The network every client trains."""

    name: str = "auto"
    """Network: twonn, superfed_cnn, lenet5, mcmahan_cnn; auto picks superfed_cnn for images of 28 pixels
    or more, else twonn."""

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        if v != "auto" and v not in MODELS:
            raise ValueError(f"unknown model {v!r}; choose one of: auto, {', '.join(MODELS)}")
        return v


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
    """How a round's clients are trained in one process: sequential (one after another), batched
    (many at once with torch.func.vmap, one stacked model per chunk), or auto: time both on the first
    round of the phase and keep the faster (the log says which and why). The two agree within float
    tolerance, not bit for bit: name one for bitwise-identical reruns."""
    chunk: int = Field(32, ge=1)
    """Batched mode: at most this many clients share one stacked step (bounds memory)."""
    processes: int = Field(1, ge=1)
    """Worker processes for one phase on this machine (torch.distributed, gloo on CPU): the round's
    clients are spread over them and their uploads all-reduced. Under torchrun the world size comes
    from torchrun instead. On a CPU, 2 single-threaded processes on 2 cores beat 1 process with 2 threads
    for small models."""
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


class RunConfig(Section):
    """A whole run: what to train, on which data, how, and where its artifacts go."""

    run: RunSection = RunSection()
    data: DataConfig = DataConfig()
    partition: PartitionConfig = Field(default_factory=lambda: _validate_partition(DEFAULT_PARTITION))
    model: ModelConfig = ModelConfig()
    method: MethodConfig = Field(default_factory=lambda: _validate_method(DEFAULT_METHOD))
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    engine: EngineConfig = EngineConfig()

    @model_validator(mode="before")
    @classmethod
    def _default_choices(cls, data: Any) -> Any:
        # `--set partition.num_clients=50` alone must keep the default scheme, not ask for one
        if isinstance(data, dict):
            for key, default in (("partition", DEFAULT_PARTITION), ("method", DEFAULT_METHOD)):
                section = data.get(key)
                tag = next(iter(default))
                if isinstance(section, dict) and tag not in section:
                    data = {**data, key: {tag: default[tag], **section}}
        return data

    def model_name(self) -> str:
        if self.model.name != "auto":
            return self.model.name
        side = min(DATASETS[self.data.dataset].input_shape[1:])
        return "superfed_cnn" if side >= 28 else "twonn"

    def fingerprint(self) -> str:
        """Hash of everything that changes results (not where they go or how progress is shown)."""
        d = self.model_dump(mode="json", exclude={"run": {"id", "store", "device", "threads"}, "telemetry": True, "engine": True, "eval": {"batch_size"}})
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()

    def run_id(self) -> str:
        if self.run.id:
            return self.run.id
        return f"{self.method.name}-{self.data.dataset}-{self.partition.scheme}-s{self.run.seed}-{self.fingerprint()[:8]}"

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


DEFAULT_PARTITION = {"scheme": "pathological", "num_clients": 20}
DEFAULT_METHOD = {"name": "superfed_mm"}


def _validate_partition(d: dict) -> Any:
    return TypeAdapter(PartitionConfig).validate_python(d)


def _validate_method(d: dict) -> Any:
    return TypeAdapter(MethodConfig).validate_python(d)


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


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config (None: all defaults), apply `--set` overrides, validate. Raises ConfigError."""
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"Config file {p} does not exist. Pass a YAML file (see examples/) or leave --config out for the defaults.")
        tree = load_yaml_file(p) or {}  # size, encoding, nesting and alias expansion bounded
        if not isinstance(tree, dict):
            raise ConfigError(f"Config file {p} must hold a mapping of sections (run, data, partition, ...), not a {type(tree).__name__}.")
    for assignment in overrides or []:
        apply_override(tree, assignment)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None
