"""A study's configuration: which methods, over which search spaces, with which budget, seeds and splits.

    study: {name: digits-two-methods, store: runs}
    base: {data: {dataset: digits}, partition: {num_clients: 6}}     # a run config (or base_config: FILE)
    methods: [fedavg_ft, {name: superfed_mm, space: {method.nu: {uniform: [0, 3]}}}]
    budget: {trials: 4, rounds: 3}
    seeds: [0, 1]
    splits: {pathological: {scheme: pathological}, dirichlet: {scheme: dirichlet, alpha: 0.3}}

Every method gets the same budget (trials and rounds): a comparison is only fair when no method is
tuned harder than another. Tuning reads validation splits only (`eval.split=validation`). A study of
private configs (privacy.enabled) is refused: nothing accounts its selection or its many runs (PRIVATE_STUDY).
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, TypeAdapter, ValidationError, field_validator, model_validator

from fedpipe.algorithms import ALGORITHMS
from fedpipe.config import (
    MAX_PROCESSES,
    MAX_ROUNDS,
    MAX_URL_CHARS,
    Section,
    apply_override,
    format_validation_error,
    refuse_mlflow_credentials,
    refuse_url_credentials,
)
from fedpipe.data.partition.schemes import SCHEME_CONFIGS
from fedpipe.errors import ConfigError
from fedpipe.run.config import RunConfig
from fedpipe.safe_load import MAX_CONFIG_BYTES, check_size, load_yaml_file, parse_yaml
from fedpipe.search_space import COMMON_SPACE, Dimension, dimension_from_yaml, point_problem

#: Trials per method: 1,000 is far beyond what a TPE search of a few dimensions profits from.
MAX_TRIALS = 1_000
#: Seeds of the final runs: the papers use 3 to 5.
MAX_SEEDS = 100
#: The objectives a study can select on: each is read from a trial's validation-only summary.
OBJECTIVES = ("val_personalized_accuracy", "val_pooled_accuracy", "val_global_accuracy", "val_worst10_accuracy")


class StudySection(Section):
    """The study's identity and where its records go."""

    name: str = Field("study", pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
    """The study's name (a Kubernetes name: lower case, digits, dashes); its records live under <store>/studies/<name>/."""
    store: str = Field("runs", max_length=MAX_URL_CHARS)
    """Folder or s3://bucket/prefix holding the study (its trials' and final runs' folders, records, report)."""

    @field_validator("store")
    @classmethod
    def _no_credentials(cls, v: str) -> str:
        return refuse_url_credentials(v, "study.store", "S3 credentials go in the environment (AWS_ACCESS_KEY_ID, "
                                      "AWS_SECRET_ACCESS_KEY; in a cluster the storage Secret).", bare_is_host=False)


class MethodEntry(Section):
    """One method of the study: its name, fixed settings and its search space (declared defaults, narrowed or widened here)."""

    name: str
    fixed: dict[str, Any] = Field(default_factory=dict)
    """Config paths set for every run of this method (not tuned), e.g. {method.finetune_epochs: 5}."""
    space: dict[str, dict] = Field(default_factory=dict)
    """Config paths to ranges that replace or add to the declared ones: {train.lr: {log_uniform: [0.01, 0.1]}}."""
    tune: bool = True
    """False: run the defaults (and `fixed`) without tuning (the trials' budget is then not spent)."""

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in ALGORITHMS:
            raise ValueError(f"unknown method {v!r}; choose one of: {', '.join(ALGORITHMS)}")
        return v

    def search_space(self) -> dict[str, Dimension]:
        """train.lr and the method's declared dimensions, then this entry's own (which win)."""
        space = {**COMMON_SPACE, **ALGORITHMS[self.name].Params.search_space}
        for path, given in self.space.items():
            space[path] = dimension_from_yaml(path, given)
        for path in self.fixed:
            space.pop(path, None)  # a fixed value is not tuned
        return space if self.tune else {}


class Budget(Section):
    """What every method gets: the same number of trials of the same number of rounds."""

    trials: int = Field(8, ge=1, le=MAX_TRIALS)
    """Tuning trials per method and split (one run each, scored on validation)."""
    rounds: int = Field(30, ge=1, le=MAX_ROUNDS)
    """train.rounds of every trial and every final run."""


class StudyConfig(Section):
    """A whole study: see the module's docstring for an example."""

    study: StudySection = StudySection()
    base_config: str | None = Field(None, max_length=4096)
    """A run config file every run starts from (then `base` on top); paths resolve from the study file's folder."""
    base: dict[str, Any] = Field(default_factory=dict)
    """Run config sections every run starts from (as in `fedpipe run -c`)."""
    methods: list[MethodEntry] = Field(min_length=1, max_length=len(ALGORITHMS) * 4)
    budget: Budget = Budget()
    sampler: Literal["tpe", "random", "grid"] = "tpe"
    """Optuna's sampler for the trials: TPE (default), random, or a grid spread over each range."""
    objective: Literal[OBJECTIVES] = "val_personalized_accuracy"  # type: ignore[valid-type]
    """What tuning maximises, always on the clients' validation splits."""
    seeds: list[int] = Field([0, 1, 2], min_length=1, max_length=MAX_SEEDS)
    """Seeds of the final runs (new partition and initialisation per seed); tuning uses the first."""
    splits: dict[str, dict[str, Any]] = Field(default_factory=dict, max_length=16)
    """Named partitions ({name: partition section}); empty: the base config's partition, named by its scheme."""
    workers: int = Field(2, ge=1, le=MAX_PROCESSES)
    """Trials run at once locally, each in a warm worker process (1: in this process)."""
    target_accuracy: float | None = Field(None, gt=0, le=1)
    """Time-to-accuracy target of the report (None: 95% of the best method's final accuracy)."""
    mlflow: str | None = Field(None, max_length=MAX_URL_CHARS)
    """MLflow tracking URI for the study's parent run and its nested trials (None: env MLFLOW_TRACKING_URI, else off)."""

    @field_validator("mlflow")
    @classmethod
    def _no_mlflow_credentials(cls, v: str | None) -> str | None:
        return refuse_mlflow_credentials(v, "mlflow")

    @field_validator("methods", mode="before")
    @classmethod
    def _names_alone(cls, v: Any) -> Any:
        # `methods: [fedavg, superfed_mm]`: a bare name is an entry with the declared space
        return [{"name": m} if isinstance(m, str) else m for m in v] if isinstance(v, list) else v

    @field_validator("seeds")
    @classmethod
    def _distinct(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v) or any(s < 0 for s in v):
            raise ValueError("seeds must be distinct non-negative integers")
        return v

    @model_validator(mode="after")
    def _one_entry_per_method(self):
        names = [m.name for m in self.methods]
        if len(set(names)) != len(names):
            raise ValueError(f"a method is listed twice: {', '.join(sorted({n for n in names if names.count(n) > 1}))}")
        return self

    def fingerprint(self) -> str:
        """Hash of what decides the study's trials (a changed space or budget is another study)."""
        d = self.model_dump(mode="json", exclude={"workers", "mlflow", "target_accuracy"})
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


def load_study(path: str | Path | None, overrides: list[str] | None = None, *, text: str | None = None) -> tuple[StudyConfig, dict]:
    """The study and its base run config tree (base_config file, then `base`), validated. Raises ConfigError."""
    if text is not None:  # a pipeline parameter (the KFP UI) or a ConfigMap: bounded like a file
        check_size(len(text.encode()), MAX_CONFIG_BYTES, "the study_yaml parameter", "study file")
        tree, folder = parse_yaml(text, "the study_yaml parameter", "study file") or {}, Path.cwd()
    else:
        p = Path(path or "")
        if not p.is_file():
            raise ConfigError(f"Study file {p} does not exist. Write one (see examples/study_*.yaml).")
        tree, folder = load_yaml_file(p) or {}, p.parent
    if not isinstance(tree, dict):
        raise ConfigError("A study file holds a mapping: study, base, methods, budget, seeds, splits (see examples/study_*.yaml).")
    for assignment in overrides or []:
        apply_override(tree, assignment)
    try:
        study = StudyConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None
    base: dict = {}
    if study.base_config and text is not None:
        raise ConfigError("A study given as text (a pipeline parameter, a ConfigMap) cannot name a base_config file: "
                          "inline the run config under `base` (fedpipe study compile and katib do this for you).")
    if study.base_config:
        file = Path(study.base_config)
        file = file if file.is_absolute() else folder / file
        if not file.is_file():
            raise ConfigError(f"base_config {study.base_config} does not exist (looked at {file}).")
        base = load_yaml_file(file) or {}
        if not isinstance(base, dict):
            raise ConfigError(f"base_config {study.base_config} is not a run config (a mapping of sections such as data, train).")
    base = _merge(base, study.base)
    for entry in study.methods:  # every configuration the study will run must be valid before anything runs
        space = entry.search_space()
        for path in space:
            if not (path.startswith(("train.", "method.")) or path == "eval.candidates"):
                raise ConfigError(f"method {entry.name}: search space path {path!r} must be under train. or method. (or be eval.candidates)")
        run_tree(study, base, entry, next(iter(split_names(study, base))), study.seeds[0], {}, tuning=True)
    return study, base


def split_names(study: StudyConfig, base: dict) -> dict[str, dict]:
    """{split name: partition section}: the study's splits, or the base's partition under its scheme's name."""
    if study.splits:
        return study.splits
    partition = base.get("partition") or {}
    return {partition.get("scheme", "pathological"): partition}


def run_tree(study: StudyConfig, base: dict, entry: MethodEntry, split: str, seed: int, params: dict[str, Any],
             *, tuning: bool) -> RunConfig:
    """The run config of one trial (tuning: scored on validation, evaluated only at phase ends) or one final run.
    `params` come from a sampler, a record or a task's input: they may set only the method's tuned paths."""
    problem = point_problem(entry.search_space(), params, partial=True)
    if problem:
        raise ConfigError(f"study {study.study.name}, method {entry.name}: {problem}. A run's hyperparameters must be a point "
                          "of the study's search space.")
    tree = copy.deepcopy(base)  # the overrides below write into nested sections: never into the study's base
    tree["partition"] = _split_partition(base.get("partition") or {}, split_names(study, base)[split])
    # the base's method section carries over only to the method it names (another method's fields would not fit)
    given = base.get("method") or {}
    tree["method"] = {**(given if given.get("name", entry.name) == entry.name else {}), "name": entry.name}
    tree["run"] = {**(tree.get("run") or {}), "seed": seed, "store": f"{study.study.store.rstrip('/')}/studies/{study.study.name}/runs"}
    tree.pop("registry", None)
    tree["train"] = {**(tree.get("train") or {}), "rounds": study.budget.rounds, "init_from": "none"}
    # one process per run: a study runs `workers` runs at once, each worker with its share of the cores
    tree["engine"] = {"processes": 1, **(tree.get("engine") or {})}
    tree["telemetry"] = {**(tree.get("telemetry") or {}), "progress": False, **({"mlflow": study.mlflow} if study.mlflow else {})}
    if tuning:
        tree["eval"] = {**(tree.get("eval") or {}), "split": "validation", "every": 0}
    for path, value in {**entry.fixed, **params}.items():
        apply_override(tree, f"{path}={json.dumps(value)}")
    private = asks_for_privacy(tree)  # before validation: this is the refusal to name, not what a private run needs besides
    try:
        cfg = None if private else RunConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(f"study {study.study.name}, method {entry.name}: {format_validation_error(e)}") from None
    if cfg is None or cfg.privacy.enabled:
        where = f"method {entry.name}'s fixed settings" if any(p.startswith("privacy") for p in entry.fixed) else "the base run config"
        raise ConfigError(f"study {study.study.name}, method {entry.name}: privacy.enabled is set ({where}), and a study "
                          f"cannot run private configs. {PRIVATE_STUDY}")
    return cfg


def asks_for_privacy(tree: dict) -> bool:
    """Whether a run config tree turns privacy on (privacy.enabled read as the config reads a bool: true, yes, on, 1)."""
    section = tree.get("privacy")
    if not isinstance(section, dict):
        return False
    try:
        return TypeAdapter(bool).validate_python(section.get("enabled", False))
    except ValidationError:
        return False  # not a bool: the config's own validation names it


#: Why a study refuses private configs (issue 40, P5), and what to do instead.
PRIVATE_STUDY = (
    "A study ranks its trials on the clients' validation scores and trains many runs on the same clients' data: each "
    "run's epsilon counts its own training only, never the selection nor the sum over the runs, so the study would "
    "release more than any epsilon it reports. Private tuning has to account the whole search (e.g. Papernot and "
    "Steinke 2022, \"Hyperparameter tuning with Renyi differential privacy\", ICLR: a random number of trials, the "
    "best one released, with a bound on the total), which fedpipe does not implement. Run the private config alone with "
    "`fedpipe run`, or tune on public or proxy data with privacy off and then run the chosen settings privately with "
    "`fedpipe run`.")


def _split_partition(base: dict, split: dict) -> dict:
    """A split's partition section over the base's: the base's fields that the split's scheme also has
    (num_clients, val_fraction, ...) carry over; another scheme's own fields do not."""
    scheme = split.get("scheme", base.get("scheme", "pathological"))
    fields = SCHEME_CONFIGS[scheme].model_fields if scheme in SCHEME_CONFIGS else {}
    return {**{k: v for k, v in base.items() if k in fields}, **split, "scheme": scheme}


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
