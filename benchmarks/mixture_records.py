"""Turn benchmarks/mixture.py outputs (mixture.json, e.g. the paper-budget queue's runs/<select>/p<P>_s<S>/) into
records of a reproduction (runs.jsonl lines for `fedpipe reproduce NAME --records FILE`).

    .venv/bin/python benchmarks/mixture_records.py RUNS/*/*/mixture.json > fedmoe_records.jsonl
    .venv/bin/fedpipe reproduce fedmoe_table1_fashion_mnist --report-only --records fedmoe_records.jsonl \\
        --out benchmarks/results/reproductions/fedmoe_table1_fashion_mnist                     # the paper's setting
    .venv/bin/fedpipe reproduce fedmoe_table1_fashion_mnist --report-only --records fedmoe_records.jsonl \\
        --set train.select=last --out benchmarks/results/reproductions/fedmoe_table1_fashion_mnist_select_last

Each run's config is rebuilt from the arguments mixture.json recorded (as mixture.py built it) and compared, field
by field, with the reproduction's config at the same p and seed; every field that differs (where and how a run
executes aside: data.root, run.*, engine.*, telemetry.*) becomes one of the record's overrides, so the report
names it as a departure and never mixes the runs with those at the paper's setting. Runs with opt-out clients
(q > 0) are left out: the reproduced tables have q = 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mixture import common_overrides  # noqa: E402

from fedpipe.errors import ConfigError  # noqa: E402
from fedpipe.run.config import load_config  # noqa: E402
from fedpipe.safe_load import parse_json  # noqa: E402
from fedpipe.study.reproduce import NEUTRAL, run_config  # noqa: E402
from fedpipe.study.reproduction import find_reproduction, label, load_reproduction  # noqa: E402

MAX_JSON = 16 * 2**20


def _leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        out.update(_leaves(value, path + ".") if isinstance(value, dict) else {path: value})
    return out


def differences(ours: dict, theirs: dict) -> list[str]:
    """PATH=VALUE for every leaf of `ours` that differs from `theirs`, neutral fields aside."""
    a, b = _leaves(ours), _leaves(theirs)
    return sorted(f"{k}={json.dumps(v)}" for k, v in a.items() if b.get(k) != v and not f"{k}=".startswith(NEUTRAL))


def records(path: Path, reproduction: str) -> list[dict]:
    repro = load_reproduction(find_reproduction(reproduction))
    data = parse_json(path.read_bytes()[:MAX_JSON + 1], str(path), "mixture.json", MAX_JSON, ConfigError)
    args = argparse.Namespace(**{k: v for k, v in data["args"].items()})
    out = []
    for row in data["runs"]:
        if row["q"] != 0:
            continue
        point = {"p": label(row["p"])}
        mine = load_config(None, [*common_overrides(args), f"partition.p={row['p']}", "partition.opt_out_fraction=0.0",
                                  f"run.seed={row['seed']}"]).model_dump(mode="json")
        paper = run_config(repro, point, row["seed"], []).model_dump(mode="json")
        out.append({"point": point, "seed": row["seed"], "overrides": differences(mine, paper),
                    "measures": {f"{m}.{split}": v for m, s in row["models"].items() for split, v in s.items()},
                    "seconds": row.get("seconds"), "source": str(path)})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path, help="mixture.json files written by benchmarks/mixture.py")
    ap.add_argument("--reproduction", default="fedmoe_table1_fashion_mnist")
    args = ap.parse_args(argv)
    for path in args.files:
        for record in records(path, args.reproduction):
            print(json.dumps(record))


if __name__ == "__main__":
    main()
