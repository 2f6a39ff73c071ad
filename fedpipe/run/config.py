"""The run configuration: one typed, validated object, read from YAML and overridable field by field.

    cfg = load_config("examples/superfed_mm_mnist5k.yaml", ["train.rounds=50", "method.nu=2"])

Every section is a frozen pydantic model whose attribute docstrings say what each value means;
`fedpipe config --explain` prints them. A pipeline parameter sets the same field as `--set`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, TypeAdapter, ValidationError, field_validator, model_validator

from fedpipe.algorithms import MethodConfig
from fedpipe.algorithms.robust import PRIVACY_REFUSAL, SECURE_AGGREGATION_REFUSAL
from fedpipe.config import (
    MAX_BATCH,
    MAX_CLIENTS,
    EngineConfig,
    EvalConfig,
    FederationConfig,
    PrivacyConfig,
    RegistryConfig,
    RobustConfig,
    RunSection,
    Section,
    TelemetryConfig,
    TrainConfig,
    apply_override,
    format_validation_error,
)
from fedpipe.data.datasets import DATASETS, FILES, DataConfig
from fedpipe.data.federated import DECLARED, FIXED, POOLED, Standardisation
from fedpipe.data.partition import PartitionConfig
from fedpipe.errors import ConfigError
from fedpipe.nn.imported import MAX_IMPORT_PATH, import_path_problem, is_import_path
from fedpipe.nn.networks import MODELS, auto_model_name
from fedpipe.safe_load import load_yaml_file


class ModelConfig(Section):
    """The network every client trains."""

    name: str = Field("auto", max_length=MAX_IMPORT_PATH)
    """Network: twonn, superfed_cnn, lenet5, mcmahan_cnn (images), bilstm (text), tabular_mlp (tables); auto
    picks superfed_cnn for images of 28 pixels or more, twonn below, bilstm for text, tabular_mlp for tables.
    Or your own, by import path: package.module:function, called as function(input_shape, num_classes) and
    returning a torch nn.Module; the package must be installed where the tasks run (for a pipeline, an image
    FROM fedpipe's; FEDPIPE_MODEL_PACKAGES there lists the packages allowed). See docs/security.md."""

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        if v == "auto" or v in MODELS:
            return v
        if is_import_path(v):
            problem = import_path_problem(v)  # its form and refused packages; importing waits for the run
            if problem:
                raise ValueError(problem)
            return v
        raise ValueError(f"unknown model {v!r}; choose one of: auto, {', '.join(MODELS)}, or name your own as package.module:function")


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
    registry: RegistryConfig = RegistryConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    federation: FederationConfig = FederationConfig()

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

    @model_validator(mode="after")
    def _files_have_a_source(self):
        # in a federation the sites read their own files; the server side (the pipeline's tasks) reads none
        if self.data.dataset == FILES and not self.data.source and self.engine.mode != "federation":
            raise ValueError("data.dataset=files reads your own data: set data.source to its folder or s3://bucket/prefix")
        return self

    @model_validator(mode="after")
    def _bounded_partition(self):
        # the partition schemes' own fields (fedpipe/data/partition/) have lower bounds only; the sizes
        # that scale a partition's work and its manifest are bounded here, where the whole config is known
        for name, bound in PARTITION_BOUNDS.items():
            value = getattr(self.partition, name, None)
            if isinstance(value, int) and value > bound:
                raise ValueError(f"partition.{name}={value:,} is more than fedpipe's bound of {bound:,} "
                                 "(far above real use: check for a typo such as an extra zero)")
        return self

    @model_validator(mode="after")
    def _robust_fits(self):
        # a robust rule needs each update in the clear, without privacy's own bound and accountant (fedpipe.algorithms.robust)
        if self.train.robust.active and self.privacy.enabled:
            raise ValueError(PRIVACY_REFUSAL)
        if self.train.robust.active and self.federation.secure_aggregation.enabled:
            raise ValueError(SECURE_AGGREGATION_REFUSAL)
        return self

    @model_validator(mode="after")
    def _privacy_covers(self):
        # a method whose server uses per-client statistics is refused rather than run with a false epsilon
        if not self.privacy.enabled:
            return self
        from fedpipe.algorithms import ALGORITHMS

        if self.data.standardisation == "pooled":
            # the pooled mean and std are exact statistics of every client's data, baked into each model and exported
            # file: removing one client changes them, and no accountant counts that release (issue 40, P3)
            raise ValueError("data.standardisation=pooled computes the input mean and std exactly from all clients' pooled "
                             "training data and bakes them into every model: a release of the clients' data outside the "
                             "privacy accountant. With privacy.enabled use data.standardisation=fixed (or auto), declaring "
                             "data.input_mean and data.input_std if the fixed defaults do not suit the data")
        refusal = ALGORITHMS[self.method.name].privacy_refusal
        if refusal:
            raise ValueError(f"method {self.method.name} cannot run with privacy.enabled: {refusal}. Choose a method that "
                             "`fedpipe methods` lists as covered, or turn privacy off")
        if self.train.select != "last":
            raise ValueError(f"train.select={self.train.select} picks a round by the clients' validation scores, which uses their "
                             "data outside the privacy accountant: with privacy.enabled use train.select=last")
        if self.privacy.adaptive_clip and self.privacy.mode != "central":
            raise ValueError("privacy.adaptive_clip needs privacy.mode=central: the server estimates the clip from the noised "
                             "count of clients within it (Andrew et al. 2021), which local mode does not release")
        if self.privacy.on_target == "calibrate" and self.privacy.target_epsilon is None:
            raise ValueError("privacy.on_target=calibrate needs privacy.target_epsilon (the budget to calibrate "
                             "noise_multiplier to)")
        return self

    def standardisation(self) -> Standardisation:
        """How raw inputs are standardised (data.standardisation resolved): declared constants when given; else fixed
        when asked for, or under auto with privacy.enabled or engine.mode=federation; else pooled."""
        d = self.data
        if d.input_mean is not None and d.input_std is not None:
            return Standardisation(DECLARED, d.input_mean, d.input_std)
        # a federation's sites never pool their pixels, so auto is fixed there too (fedpipe.federation.own_data)
        if d.standardisation == "fixed" or (d.standardisation == "auto" and (self.privacy.enabled or self.engine.mode == "federation")):
            return Standardisation(FIXED)
        return Standardisation(POOLED)

    def model_name(self, input_shape: tuple[int, ...] | None = None) -> str:
        """model.name, with auto resolved for the data's input shape (a bundled dataset's is known from
        its name; data.dataset=files needs the loaded data's `input_shape`)."""
        if self.model.name != "auto":
            return self.model.name
        if input_shape is None:
            if self.data.dataset == FILES:
                raise ConfigError("model.name=auto for data.dataset=files depends on the data: pass its input shape")
            input_shape = DATASETS[self.data.dataset].input_shape
        return auto_model_name(tuple(input_shape))

    def fingerprint(self) -> str:
        """Hash of everything that changes results (not where they go or how progress is shown)."""
        # the drop policy only picks the drop (the drop read is in data.source and data.snapshot); the decoding
        # budget only bounds memory
        d = self.model_dump(mode="json", exclude={"run": {"id", "store", "device", "threads"}, "telemetry": True, "engine": True, "eval": {"batch_size"},
                                                 "registry": True, "federation": True, "data": {"drop_pattern", "drop_complete", "max_decoded_mb"}})
        # fields added later count only when set, so a config that does not use them keeps its run id
        for section, key, unset in LATER_FIELDS:
            if d[section].get(key, unset) == unset:
                d[section].pop(key, None)
        if self.federation.secure_aggregation.enabled:  # quantised sums: other numbers than the plain aggregate's
            d["secure_aggregation"] = self.federation.secure_aggregation.model_dump(mode="json")
        if not self.privacy.enabled:  # added later, and meaningless while off: a run without it keeps its id
            d.pop("privacy")
        # the standardisation as resolved: pooled (what every run did before the choice existed) keeps the id; fixed or
        # declared constants feed the network other inputs, so they make another run (a private run made before the
        # choice existed trained on pooled inputs: it must not be resumed on fixed ones)
        chosen = self.standardisation()
        for key in ("standardisation", "input_mean", "input_std"):
            d["data"].pop(key, None)
        if chosen.source != POOLED:
            d["data"]["standardisation"] = {"source": chosen.source, "mean": chosen.mean, "std": chosen.std}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()

    def run_id(self) -> str:
        if self.run.id:
            return self.run.id
        return f"{self.method.name}-{self.data.dataset}-{self.partition.scheme}-s{self.run.seed}-{self.fingerprint()[:8]}"

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


log = logging.getLogger(__name__)

DEFAULT_PARTITION = {"scheme": "pathological", "num_clients": 20}

#: (section, field, unset value) of the fields added after runs were first made: left out of the
#: fingerprint while unset, so upgrading fedpipe does not move existing runs to new ids.
LATER_FIELDS = (("data", "source", None), ("data", "image_size", None), ("data", "snapshot", None), ("train", "init_from", "none"),
               ("train", "select", "last"), ("train", "select_every", 1), ("train", "robust", RobustConfig().model_dump(mode="json")),
               ("eval", "candidates", "per_client"), ("eval", "split", "test"))

#: Upper bounds of the partition schemes' size fields: a million clients is cross-device scale (the
#: manifest then is hundreds of MB); per-client counts above a million samples, shards or groups
#: cannot be met by any bundled dataset (all hold under a million training rows).
PARTITION_BOUNDS = {
    "num_clients": MAX_CLIENTS,
    "num_groups": MAX_CLIENTS,
    "shards_per_client": MAX_BATCH,
    "samples_per_client": MAX_BATCH,
    "min_client_size": MAX_BATCH,
    "classes_per_client": MAX_BATCH,
    "majority_classes": MAX_BATCH,
}
DEFAULT_METHOD = {"name": "superfed_mm"}


def _validate_partition(d: dict) -> Any:
    return TypeAdapter(PartitionConfig).validate_python(d)


def _validate_method(d: dict) -> Any:
    return TypeAdapter(MethodConfig).validate_python(d)


def with_data_snapshot(cfg: RunConfig) -> RunConfig:
    """data.dataset=files: the config with data.source resolved (`latest` -> the newest drop) and
    data.snapshot set to what is there now, so the data enters the run's id (new data is a new run, the
    same data resumes) and every later step refuses data that changed. Other datasets: `cfg` as it is."""
    if cfg.data.dataset != FILES or cfg.data.snapshot or not cfg.data.source:  # no source: a federation's sites hold the data
        return cfg
    from fedpipe.data.files import current_snapshot

    snap = current_snapshot(cfg.data.source, cfg.data.drop_policy())
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"source": snap["source"], "snapshot": snap["digest"]})})


def _switch_method(tree: dict, written: str | None) -> None:
    """`--set method.name=X` on a file written for another method: the common sections stay, the other method's
    own fields are dropped, with one warning naming them (they mean nothing to X; X takes its defaults)."""
    method = tree.get("method")
    if not isinstance(method, dict) or written is None or method.get("name") == written:
        return
    from fedpipe.algorithms import ALGORITHMS

    chosen = ALGORITHMS.get(str(method.get("name")))
    if chosen is None:
        return  # an unknown name: validation names the methods that exist
    known = set(chosen.Params.model_fields)
    dropped = sorted(k for k in method if k not in known)
    for key in dropped:
        del method[key]
    if dropped:
        log.warning("method.name=%s replaces the file's %s: its own field(s) %s do not apply to %s and were dropped (%s "
                    "takes its defaults; set its own fields with --set method.FIELD=VALUE).", method["name"], written,
                    ", ".join(f"method.{k}" for k in dropped), method["name"], method["name"])


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
    written = tree.get("method", {}).get("name") if isinstance(tree.get("method"), dict) else None
    for assignment in overrides or []:
        apply_override(tree, assignment)
    _switch_method(tree, written)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None
