"""Search spaces: the ranges a study tunes a hyperparameter over, declared beside the field itself.

Each method's `Params` class names its tunable fields in `search_space` (a dict of config paths to a
`Dimension`); `COMMON_SPACE` holds what every method shares (the learning rate). A study
(`fedpipe.study`) samples from them with Optuna locally, in KFP trial batches, or as a Katib
Experiment (`fedpipe.k8s.katib`): the same declaration drives all three.

    search_space = {"method.mu": LogUniform(1e-3, 1.0), "method.nu": Uniform(0.0, 2.0)}
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fedpipe.errors import ConfigError


@dataclass(frozen=True)
class Uniform:
    """A float drawn uniformly from [low, high]."""

    low: float
    high: float

    def __post_init__(self):
        if not (math.isfinite(self.low) and math.isfinite(self.high) and self.low < self.high):
            raise ConfigError(f"a uniform range needs finite low < high, got [{self.low}, {self.high}]")

    def grid(self, points: int) -> list[float]:
        # clamped: low + (high - low) * 1.0 can round past high, and a point outside the range is refused when read back
        return [min(self.high, self.low + (self.high - self.low) * i / max(points - 1, 1)) for i in range(points)]


@dataclass(frozen=True)
class LogUniform:
    """A positive float whose logarithm is uniform on [log low, log high] (rates, penalty weights)."""

    low: float
    high: float

    def __post_init__(self):
        if not (0 < self.low < self.high and math.isfinite(self.high)):
            raise ConfigError(f"a log-uniform range needs 0 < low < high, got [{self.low}, {self.high}]")

    def grid(self, points: int) -> list[float]:
        lo, hi = math.log(self.low), math.log(self.high)
        points_ = (float(f"{math.exp(lo + (hi - lo) * i / max(points - 1, 1)):.6g}") for i in range(points))
        return [min(self.high, max(self.low, p)) for p in points_]  # rounded to 6 digits, still inside the range


@dataclass(frozen=True)
class IntRange:
    """An integer in [low, high] (both included)."""

    low: int
    high: int

    def __post_init__(self):
        if not self.low < self.high:
            raise ConfigError(f"an integer range needs low < high, got [{self.low}, {self.high}]")

    def grid(self, points: int) -> list[int]:
        return sorted({round(self.low + (self.high - self.low) * i / max(points - 1, 1)) for i in range(points)})


@dataclass(frozen=True)
class Choice:
    """One of a few values (numbers, strings or booleans)."""

    values: tuple[Any, ...]

    def __post_init__(self):
        if len(self.values) < 2:
            raise ConfigError(f"a choice needs at least two values, got {list(self.values)}")

    def grid(self, points: int) -> list[Any]:
        return list(self.values)


Dimension = Uniform | LogUniform | IntRange | Choice

#: What every method tunes: the clients' learning rate (train.lr). 0.001 to 0.1: with the papers' SGD momentum
#: of 0.9 a rate above 0.1 diverges (a first mnist5k study spent a quarter of its trials there, every one of
#: them failed), and its best rates sat at the bottom of a 0.003 to 0.3 range.
COMMON_SPACE: dict[str, Dimension] = {"train.lr": LogUniform(0.001, 0.1)}

#: Dimension kinds as a study YAML names them: {"log_uniform": [low, high]}, {"uniform": [...]}, {"int": [...]}, {"choice": [...]}
KINDS = {"uniform": Uniform, "log_uniform": LogUniform, "int": IntRange, "choice": Choice}


def dimension_from_yaml(path: str, given: Any) -> Dimension:
    """A dimension from a study file's `{kind: [low, high]}` (or `{choice: [a, b, ...]}`); errors name `path`."""
    if not (isinstance(given, dict) and len(given) == 1):
        raise ConfigError(f"search space {path!r}: write one of {', '.join(f'{{{k}: [...]}}' for k in KINDS)}, got {given!r}")
    (kind, values), = given.items()
    if kind not in KINDS or not isinstance(values, list):
        raise ConfigError(f"search space {path!r}: unknown kind {kind!r} or values not a list; kinds: {', '.join(KINDS)}")
    try:
        if kind == "choice":
            return Choice(tuple(values))
        if len(values) != 2:
            raise ConfigError(f"search space {path!r}: {kind} takes [low, high], got {values!r}")
        return KINDS[kind](*values)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"search space {path!r}: {err}") from None


def parse_value(dim: Dimension, raw: str, where: str) -> Any:
    """A value of `dim` from its text (Katib substitutes Python's str() of the number: 1e-05, 3, true)."""
    try:
        if isinstance(dim, Uniform | LogUniform):
            value = float(raw)
            ok = dim.low <= value <= dim.high
        elif isinstance(dim, IntRange):
            value = int(float(raw))
            ok = dim.low <= value <= dim.high and float(raw) == value
        else:
            value = next((v for v in dim.values if str(v).lower() == raw.strip().lower()), None)
            ok = value is not None
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"{where}={raw!r} is not in its range ({describe(dim)})")
    return value


def describe(dim: Dimension) -> str:
    """A short human description: 'log-uniform [0.001, 1]'."""
    if isinstance(dim, Choice):
        return "one of " + ", ".join(map(str, dim.values))
    word = {Uniform: "uniform", LogUniform: "log-uniform", IntRange: "integer"}[type(dim)]
    return f"{word} [{dim.low:g}, {dim.high:g}]"


def admits(dim: Dimension, value: Any) -> bool:
    """Whether `value` (read back from a record: any JSON) is one `dim` could have drawn: its type, inside its range."""
    if isinstance(value, bool):  # True == 1 in Python: a flag is no number, and 1 is no flag
        return isinstance(dim, Choice) and any(v is value for v in dim.values)
    if isinstance(dim, Uniform | LogUniform):
        return isinstance(value, int | float) and dim.low <= value <= dim.high  # NaN compares false
    if isinstance(dim, IntRange):
        return isinstance(value, int) and dim.low <= value <= dim.high
    return any(type(v) is type(value) and v == value for v in dim.values)


def point_problem(space: dict[str, Dimension], point: Any, *, partial: bool = False) -> str | None:
    """What keeps `point` (hyperparameters read from a record or handed between tasks) from being a point of
    `space`, in plain words; None when it is one. A point sets exactly the space's paths (`partial`: some of
    them), each to a value its dimension admits: a record that sets any other config path is data trying to
    be config (a store writer rewriting a run's model, store or tracking server)."""
    if not isinstance(point, dict):
        return f"its hyperparameters are not a mapping of path to value (got {_shown(point)})"
    foreign = [p for p in point if p not in space]
    if foreign:
        return f"it sets {_shown(foreign[0])}, which the study does not tune; {tuned(space)}"
    missing = [p for p in space if p not in point]
    if missing and not partial:
        return f"it leaves out {missing[0]}; {tuned(space)}"
    for path, value in point.items():
        if not admits(space[path], value):
            return f"{path}={_shown(value)} is outside what the study tunes it over ({describe(space[path])})"
    return None


def tuned(space: dict[str, Dimension]) -> str:
    """'it tunes train.lr (log-uniform [0.001, 0.1]) and ...', or that it tunes nothing."""
    if not space:
        return "it tunes nothing for this method (its runs take the defaults and fixed values)"
    return "it tunes " + ", ".join(f"{p} ({describe(d)})" for p, d in space.items())


def _shown(value: Any, limit: int = 60) -> str:
    """A value of a record as a message quotes it: short (a planted record may hold megabytes, or an int
    too long for repr)."""
    try:
        text = repr(value)
    except ValueError:
        return f"a {type(value).__name__} too long to print"
    return text if len(text) <= limit else text[: limit - 3] + "..."
