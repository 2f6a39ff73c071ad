"""Running a reproduction (fedpipe.study.reproduction): every point the paper's cells need, on every seed,
one fedpipe run each (fedpipe.run.run.Run: partition, each phase, then the reproduction's scorer), one after
another in this process.

Every finished run appends one record to <out>/runs.jsonl (its point, seed, the `--set` overrides it ran
with, its measures and seconds), so a killed reproduction loses at most the run in flight, and a rerun
skips what is recorded. Records from another machine (`--records`, e.g. a long run on a GPU box) are read
the same way, as hostile input: bounded and type-checked line by line.

Overrides are of two kinds. Those that say where and how a run executes (data.root, data.download, run.*,
engine.*, telemetry.*) change no number. Any other (`--rounds 5`, `--set train.lr=...`) departs from the
paper's setting: the report names it in its title, and only records made with the very same departures are
compared, so a quick look never mixes with a run at the paper's budget.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from fedpipe.config import apply_override
from fedpipe.errors import ConfigError
from fedpipe.run.config import RunConfig, load_config
from fedpipe.safe_load import parse_yaml
from fedpipe.study.config import asks_for_privacy
from fedpipe.study.reproduction import Reproduction

log = logging.getLogger(__name__)

RECORDS = "runs.jsonl"
MAX_RECORD_LINE = 64 * 2**10
MAX_RECORDS_BYTES = 64 * 2**20
NEUTRAL = ("data.root=", "data.download=", "run.", "engine.", "telemetry.")  # where and how, not what


def departures(overrides: Iterable[str]) -> list[str]:
    """The overrides that change what is computed, as PATH=JSON (so `train.select=last` and `train.select="last"`,
    `train.lr=5e-5` and `train.lr=0.00005` are one departure), sorted: the ones a report must name."""
    out = []
    for item in overrides:
        path, _, raw = item.strip().partition("=")
        if item.strip().startswith(NEUTRAL):
            continue
        value = parse_yaml(raw, f"override {path}", "override", invalid_is_text=True) if raw.strip() else ""
        if isinstance(value, str):  # YAML 1.1 reads 5e-5 (no dot) as text; the config's float field reads it as 5e-05
            try:
                value = float(value)
            except ValueError:
                pass
        out.append(f"{path.strip()}={json.dumps(value)}")
    return sorted(out)


def run_overrides(repro: Reproduction, point: dict[str, str], seed: int, extra: list[str]) -> list[str]:
    """The `--set` list of one run: the reproduction's setting and axes at `point`, the seed, then `extra`."""
    return [f"{path}={json.dumps(value)}" for path, value in repro.overrides(point).items()] + [f"run.seed={seed}", *extra]


def run_config(repro: Reproduction, point: dict[str, str], seed: int, extra: list[str]) -> RunConfig:
    overrides, tree = run_overrides(repro, point, seed, extra), {}
    try:
        for assignment in overrides:
            apply_override(tree, assignment)
        private = asks_for_privacy(tree)  # before validation: this refusal comes first, not what a private run needs besides
        cfg = None if private else load_config(None, overrides)
    except ConfigError as e:
        raise ConfigError(f"Reproduction {repro.name}, run {point} seed {seed}: {e}") from None
    if cfg is None or cfg.privacy.enabled:
        # no selection here, but every point and seed is one more training on the same dataset's clients: the
        # releases compose, and each run's ledger counts its own only (issue 40, P5)
        raise ConfigError(f"Reproduction {repro.name}, run {point} seed {seed}: privacy.enabled is set, and a reproduction "
                          "cannot run private configs: it trains every point on every seed on the same clients' data, and "
                          "the privacy spent composes over those runs while each run's epsilon counts its own training only, "
                          "so no reported epsilon would bound what the reproduction releases. Run a private config alone "
                          "with `fedpipe run` (its ledger then accounts everything it released).")
    return cfg


def select_points(repro: Reproduction, only: dict[str, set[str]]) -> list[dict[str, str]]:
    """The cells' points, restricted to the labels in `only` (axis -> labels; `--only p=0.3`)."""
    for axis, labels in only.items():
        if axis not in repro.axes:
            raise ConfigError(f"--only {axis}=...: {repro.name} has no axis {axis!r} (its axes: {', '.join(repro.axes) or 'none'})")
        known = set(repro.axes[axis].overrides())
        if not labels <= known:
            raise ConfigError(f"--only {axis}={','.join(sorted(labels - known))}: not a label of axis {axis} ({', '.join(sorted(known))})")
    return [p for p in repro.points() if all(p[a] in labels for a, labels in only.items())]


# --- scoring one run -----------------------------------------------------------------------------------


def score_run(cfg: RunConfig, scorer: str) -> dict[str, float]:
    """Run `cfg` from scratch in a temporary store and return its measures (fractions, not percent)."""
    from fedpipe.run.compare import compared_model_scores
    from fedpipe.run.run import Run

    with tempfile.TemporaryDirectory(prefix="fedpipe-reproduce-") as store:
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"store": store})})
        run = Run(cfg)
        if scorer == "personalized":
            summary = run.run_all()
            return {"personalized_accuracy": float(summary["personalized_accuracy"]["mean"])}
        run.partition()
        state = None
        for phase in run.phases():
            state = run.train(phase.name)
        return compared_model_scores(run, state)


# --- records ---------------------------------------------------------------------------------------------


def _record(line: str, where: str) -> dict:
    try:
        r = json.loads(line)
    except ValueError as e:
        raise ConfigError(f"{where} is not JSON ({e}); remove the line or the file.") from None
    ok = (isinstance(r, dict) and isinstance(r.get("point"), dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in r["point"].items())
          and isinstance(r.get("seed"), int) and not isinstance(r.get("seed"), bool)
          and isinstance(r.get("overrides"), list) and all(isinstance(o, str) for o in r["overrides"])
          and isinstance(r.get("measures"), dict)
          and all(isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v <= 1
                  for k, v in r["measures"].items()))
    if not ok:
        raise ConfigError(f"{where} is not a reproduction record ({{point: {{axis: label}}, seed: int, overrides: [str], "
                          "measures: {name: fraction 0..1}}); remove the line or the file.")
    return r


def read_records(path: Path) -> list[dict]:
    """The records of a runs.jsonl file (none if it does not exist), each checked. Raises ConfigError."""
    if not path.is_file():
        return []
    if path.stat().st_size > MAX_RECORDS_BYTES:
        raise ConfigError(f"{path} is larger than {MAX_RECORDS_BYTES:,} bytes: not a reproduction's records.")
    records = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            if len(raw) > MAX_RECORD_LINE:
                raise ConfigError(f"{path}, line {number}: longer than {MAX_RECORD_LINE:,} bytes; not a record.")
            text = raw.decode("utf-8", "replace").strip()
            if text:
                records.append(_record(text, f"{path}, line {number}"))
    return records


def matching(records: list[dict], extra: list[str]) -> list[dict]:
    """The records made with the same departures from the paper's setting as `extra`; one per (point, seed),
    the last one written winning."""
    wanted = departures(extra)
    chosen: dict[tuple, dict] = {}
    for r in records:
        if departures(r["overrides"]) == wanted:
            chosen[(tuple(sorted(r["point"].items())), r["seed"])] = r
    return list(chosen.values())


def reproduce(repro: Reproduction, out: Path, seeds: list[int], extra: list[str], only: dict[str, set[str]],
              progress: bool = True) -> list[dict]:
    """Run every (point, seed) not yet recorded in <out>/runs.jsonl with these departures; returns the matching
    records. Every run's config is validated before the first run starts."""
    points = select_points(repro, only)
    configs = {(tuple(sorted(p.items())), s): (p, s, run_config(repro, p, s, extra)) for p in points for s in seeds}
    out.mkdir(parents=True, exist_ok=True)
    done = {(tuple(sorted(r["point"].items())), r["seed"]) for r in matching(read_records(out / RECORDS), extra)}
    todo = [v for k, v in configs.items() if k not in done]
    for i, (point, seed, cfg) in enumerate(todo, 1):
        if progress:
            print(f"[{i}/{len(todo)}] {repro.name} {point} seed {seed}", file=sys.stderr, flush=True)
        started = time.perf_counter()
        measures = score_run(cfg, repro.scorer)
        record = {"point": point, "seed": seed, "overrides": extra, "measures": measures,
                  "seconds": round(time.perf_counter() - started, 1)}
        with (out / RECORDS).open("a") as f:
            f.write(json.dumps(record) + "\n")
    return matching(read_records(out / RECORDS), extra)
