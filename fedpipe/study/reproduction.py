"""A reproduction: one paper table as data (reproductions/<name>.yaml). The setting follows the paper's
section, every value cited; the paper's reported numbers sit beside it, each with its table and cell; the
paper's claims are stated as orderings between two of its numbers. `fedpipe reproduce NAME` runs it
(fedpipe.study.reproduce) and writes the report (fedpipe.study.reproduce_report).

A reproduction file is hostile input like any config: it is read within the config bounds
(fedpipe.safe_load: size, UTF-8, nesting, alias expansion), validated by the Section machinery (unknown keys
are errors), cross-checked (every cell's point names declared axes and labels, every measure is one its
scorer produces, every claim's terms resolve), and every run it describes is validated as a run config before
anything runs. Nothing in it is executed.

The shape (reproductions/fedmoe_table1_fashion_mnist.yaml is a full example):

    name, paper, tables, data          what it is and where its data comes from
    scorer                             how a run is scored: compared_models (each of the method's compared models
                                       on every client's local test split and the global test set, mean over
                                       clients: `<model>.local`, `<model>.global`) or personalized (the run's
                                       report: `personalized_accuracy`)
    setting: {config.path: {value, cite}}          the run config every run shares
    axes: {axis: {key, values, cite} | {sets: {label: {config.path: value}}, cite}}
                                       the table's rows and columns that change the run (p, method, dataset)
    seeds, seeds_cite                  how many runs the paper averages
    specific: [{at: {axis: label}, set: {config.path: value}, cite}]   values for some points only
    cells: [{table, row, column, at: {axis: label}, measure, paper}]   the paper's numbers
    claims: [{says, left, relation, right, tolerance, where, cite}]    the paper's claims as orderings
    departures: [text]                 where this file cannot follow the paper, and why
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from fedpipe.config import Section, format_validation_error
from fedpipe.errors import ConfigError
from fedpipe.safe_load import load_yaml_file

MAX_CELLS = 2000
MAX_AXIS_VALUES = 64
MAX_TEXT = 600
NAME = r"^[a-z0-9][a-z0-9_]{0,63}$"
#: What a reproduction file may set: the paper's setting, and of `data` only the dataset's name. Where the data
#: comes from and how much of it may be decoded (data.*), how the run executes (engine.*), what it starts from
#: (train.init_from), where runs are stored and where their telemetry goes (run.*, telemetry.*, registry.*) are the
#: reader's own (`--set`), never a file's: a shared reproduction file that named data.source or telemetry.mlflow
#: would point every reader's run at another bucket or make it contact that host.
SETTING_SECTIONS = ("partition", "model", "method", "train", "eval")
CONFIG_PATH = r"^((" + "|".join(SETTING_SECTIONS) + r")(\.[a-z_][a-z0-9_]*)+|data\.dataset)$"
NOT_SETTINGS = ("train.init_from",)  # under a setting's section, but the reader's: a version of the reader's own line
NOT_A_SETTING = (f"is not a config path of the paper's setting (under {', '.join(SETTING_SECTIONS)}, like train.rounds, or "
                 "data.dataset); where the data comes from (data.root, data.source, data.download, ...), how the run executes "
                 "(engine.*), what it starts from (train.init_from), run.*, telemetry.* and registry.* are set with --set when "
                 "you run it, never by the file")
Scalar = str | int | float | bool
SCORER_MEASURES = {
    "compared_models": re.compile(r"^[a-z][a-z0-9_]{0,31}\.(local|global)$"),
    "personalized": re.compile(r"^personalized_accuracy$"),
}
TERM = re.compile(r"^\s*([a-z][a-z0-9_.]{0,63})\s*(?:@\s*(.+))?$")


def is_setting(path: str) -> bool:
    """Whether a reproduction file may set the config path `path` (`SETTING_SECTIONS`)."""
    return re.match(CONFIG_PATH, path) is not None and path not in NOT_SETTINGS


def label(value: object) -> str:
    """An axis value as the label cells name it by: numbers as %g (1.0 and 1 are both "1"), the rest as text."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return format(float(value), "g")
    return str(value)


class Cited(Section):
    """One setting of the run config with where in the paper it comes from."""

    value: Any
    cite: str = Field(min_length=1, max_length=MAX_TEXT)


class Axis(Section):
    """A row or column of the paper's table that changes the run: a config path and its values (`key`,
    `values`), or named sets of config values (`sets`, e.g. one per method)."""

    key: str | None = Field(None, max_length=200)
    values: list[Scalar] = Field(default_factory=list, max_length=MAX_AXIS_VALUES)
    sets: dict[str, dict[str, Any]] = Field(default_factory=dict, max_length=MAX_AXIS_VALUES)
    cite: str = Field(min_length=1, max_length=MAX_TEXT)

    @model_validator(mode="after")
    def _one_form(self) -> Axis:
        if (self.key is None) == (not self.sets) or (self.key is not None) != bool(self.values):
            raise ValueError("an axis is either `key` with a list of `values`, or `sets` of config values by label")
        if self.key is not None and not is_setting(self.key):
            raise ValueError(f"key {self.key!r} {NOT_A_SETTING}")
        for name, values in self.sets.items():
            for path in values:
                if not is_setting(path):
                    raise ValueError(f"set {name!r}: {path!r} {NOT_A_SETTING}")
        return self

    def overrides(self) -> dict[str, dict[str, Any]]:
        """{label: {config path: value}}."""
        if self.key is not None:
            return {label(v): {self.key: v} for v in self.values}
        return dict(self.sets)


class Cell(Section):
    """One number the paper reports, and where: its table, row and column, the axis labels of the run it
    comes from, and the measure of that run it corresponds to."""

    table: str = Field(min_length=1, max_length=80)
    row: str = Field(min_length=1, max_length=80)
    column: str = Field(min_length=1, max_length=80)
    at: dict[str, Scalar] = Field(default_factory=dict)
    measure: str = Field(min_length=1, max_length=80)
    paper: float | None = Field(ge=-1e6, le=1e6)
    """The paper's number; null where the paper's copy lost it (say so in `note`): the cell is still run,
    and the claims are still checked on our numbers."""
    note: str = Field("", max_length=MAX_TEXT)

    @model_validator(mode="after")
    def _lost_is_explained(self) -> Cell:
        if self.paper is None and not self.note:
            raise ValueError("a cell without the paper's number (paper: null) needs a `note` saying why it is missing")
        return self

    def point(self) -> dict[str, str]:
        return {axis: label(v) for axis, v in self.at.items()}


class Claim(Section):
    """A claim of the paper as an ordering of two measures, checked at every point of the other axes (or
    those in `where`): left > right, left < right, or left ~ right (within `tolerance` points). A term is a
    measure, optionally at fixed axis labels: `mixture.global`, or `personalized_accuracy @ method=SuPerFed-MM`."""

    says: str = Field(min_length=1, max_length=MAX_TEXT)
    left: str = Field(min_length=1, max_length=200)
    relation: Literal[">", "<", "~"]
    right: str = Field(min_length=1, max_length=200)
    tolerance: float = Field(1.0, ge=0, le=100)
    """For `~`: the largest difference, in the table's unit (percentage points), that still counts as equal."""
    where: dict[str, list[Scalar]] = Field(default_factory=dict)
    cite: str = Field(min_length=1, max_length=MAX_TEXT)

    def terms(self) -> tuple[tuple[str, dict[str, str]], tuple[str, dict[str, str]]]:
        return parse_term(self.left), parse_term(self.right)

    def region(self) -> dict[str, set[str]]:
        return {axis: {label(v) for v in values} for axis, values in self.where.items()}


def parse_term(text: str) -> tuple[str, dict[str, str]]:
    """'measure @ axis=label, axis=label' -> (measure, {axis: label})."""
    m = TERM.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a claim term like `mixture.global` or `personalized_accuracy @ method=FedAvg`")
    fixed: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in (m.group(2) or "").split(","))):
        axis, sep, value = part.partition("=")
        if not sep or not axis.strip() or not value.strip():
            raise ValueError(f"{text!r}: {part!r} is not AXIS=LABEL")
        fixed[axis.strip()] = label(_number_or_text(value.strip()))
    return m.group(1), fixed


def _number_or_text(text: str) -> Scalar:
    try:
        return float(text)
    except ValueError:
        return text


class Specific(Section):
    """Config values for the points that match `at` only (e.g. pFedMB's number of branches per setting)."""

    at: dict[str, Scalar] = Field(min_length=1)
    set: dict[str, Any] = Field(min_length=1, max_length=50)
    cite: str = Field(min_length=1, max_length=MAX_TEXT)

    def point(self) -> dict[str, str]:
        return {axis: label(v) for axis, v in self.at.items()}


class Reproduction(Section):
    """One paper table, its setting and its numbers (see the module's docstring)."""

    name: str = Field(pattern=NAME)
    paper: str = Field(min_length=1, max_length=MAX_TEXT)
    tables: str = Field(min_length=1, max_length=MAX_TEXT)
    data: str = Field(min_length=1, max_length=MAX_TEXT)
    """Where to get the dataset and what data.root to give (`--set data.root=...`)."""
    scorer: Literal["compared_models", "personalized"]
    unit: Literal["percent"] = "percent"
    setting: dict[str, Cited] = Field(max_length=200)
    axes: dict[str, Axis] = Field(default_factory=dict, max_length=8)
    seeds: int = Field(ge=1, le=32)
    seeds_cite: str = Field(min_length=1, max_length=MAX_TEXT)
    specific: list[Specific] = Field(default_factory=list, max_length=200)
    cells: list[Cell] = Field(min_length=1, max_length=MAX_CELLS)
    claims: list[Claim] = Field(default_factory=list, max_length=200)
    departures: list[str] = Field(default_factory=list, max_length=50)

    @field_validator("setting")
    @classmethod
    def _paths(cls, v: dict[str, Cited]) -> dict[str, Cited]:
        for path in v:
            if not is_setting(path):
                raise ValueError(f"{path!r} {NOT_A_SETTING}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Reproduction:
        labels = {name: set(axis.overrides()) for name, axis in self.axes.items()}
        pattern = SCORER_MEASURES[self.scorer]
        for i, cell in enumerate(self.cells):
            where = f"cells[{i}] ({cell.table}, {cell.row}, {cell.column})"
            _check_point(cell.point(), labels, where, complete=True)
            if not pattern.match(cell.measure):
                raise ValueError(f"{where}: measure {cell.measure!r} is not one scorer {self.scorer} gives ({pattern.pattern})")
        for i, extra in enumerate(self.specific):
            _check_point(extra.point(), labels, f"specific[{i}]", complete=False)
            for path in extra.set:
                if not is_setting(path):
                    raise ValueError(f"specific[{i}]: {path!r} {NOT_A_SETTING}")
        measures = {c.measure for c in self.cells}
        for i, claim in enumerate(self.claims):
            where = f"claims[{i}] ({claim.says[:60]})"
            try:
                terms = claim.terms()
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            for measure, fixed in terms:
                if measure not in measures:
                    raise ValueError(f"{where}: measure {measure!r} is none of the cells' ({', '.join(sorted(measures))})")
                _check_point(fixed, labels, where, complete=False)
            _check_point({a: next(iter(v)) for a, v in claim.region().items() if v}, labels, where, complete=False)
            for axis, values in claim.region().items():
                if not values <= labels[axis]:
                    raise ValueError(f"{where}: where.{axis} names {sorted(values - labels[axis])}, not labels of axis {axis}")
        return self

    # --- what to run ------------------------------------------------------------------------------------
    def points(self) -> list[dict[str, str]]:
        """The runs the cells need, one per distinct point (axis -> label), in the order the cells name them."""
        seen: dict[tuple, dict[str, str]] = {}
        for cell in self.cells:
            point = cell.point()
            seen.setdefault(tuple(sorted(point.items())), point)
        return list(seen.values())

    def overrides(self, point: dict[str, str]) -> dict[str, Any]:
        """The run config of a point: the setting, then each axis's values at that point, then the `specific`
        values of every entry whose labels the point has."""
        tree = {path: cited.value for path, cited in self.setting.items()}
        for axis, value in point.items():
            tree.update(self.axes[axis].overrides()[value])
        for extra in self.specific:
            if all(point.get(a) == v for a, v in extra.point().items()):
                tree.update(extra.set)
        return tree


def _check_point(point: dict[str, str], labels: dict[str, set[str]], where: str, complete: bool) -> None:
    for axis, value in point.items():
        if axis not in labels:
            raise ValueError(f"{where}: axis {axis!r} is not declared under axes ({', '.join(labels) or 'none'})")
        if value not in labels[axis]:
            raise ValueError(f"{where}: {axis}={value} is not a label of axis {axis} ({', '.join(sorted(labels[axis]))})")
    if complete and set(point) != set(labels):
        raise ValueError(f"{where}: `at` must name every axis ({', '.join(labels)}), it names {', '.join(point) or 'none'}")


def reproductions_folder() -> Path:
    """reproductions/ of the checkout (the folder beside fedpipe/), else of the working directory."""
    here = Path(__file__).resolve().parents[2] / "reproductions"
    return here if here.is_dir() else Path.cwd() / "reproductions"


def find_reproduction(name_or_path: str, folder: Path | None = None) -> Path:
    """A reproduction by name (reproductions/<name>.yaml) or by path. Raises ConfigError naming the choices."""
    folder = folder or reproductions_folder()
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    if re.match(NAME, name_or_path) and (folder / f"{name_or_path}.yaml").is_file():
        return folder / f"{name_or_path}.yaml"
    names = ", ".join(sorted(p.stem for p in folder.glob("*.yaml"))) or f"none in {folder}"
    raise ConfigError(f"No reproduction {name_or_path!r}: give a name ({names}) or the path of a reproduction file "
                      "(`fedpipe reproduce --list` lists them).")


def load_reproduction(path: Path) -> Reproduction:
    """Read and validate a reproduction file (bounded YAML, then the schema). Raises ConfigError."""
    tree = load_yaml_file(path, "reproduction")
    if not isinstance(tree, dict):
        raise ConfigError(f"Reproduction file {path} must hold a mapping (name, paper, setting, axes, cells, ...), "
                          f"not a {type(tree).__name__}; see reproductions/fedmoe_table1_fashion_mnist.yaml.")
    try:
        return Reproduction.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(f"Reproduction file {path}: " + format_validation_error(e)) from None
