"""Where a run's wall time goes at 1,000-10,000 clients: training rounds, or everything around them.

    .venv/bin/python benchmarks/wall_time.py                        # this tree beside main~ (the code before)
    .venv/bin/python benchmarks/wall_time.py --before d43eb8d --repeat 2
    .venv/bin/python benchmarks/wall_time.py --before none          # this tree only

Two settings, each a fresh process per (code version, setting, repeat):

- **stateful**: SuPerFed-MM, 1,000 clients of 64 samples (mnist5k shared, `with_replacement`, Dirichlet
  0.3), the 784-200-200-10 MLP, 10% of the clients a round, Phase II from the first round on (every
  sampled client keeps a local model: 100 changed client states a round, all in memory), 10 rounds;
- **fedavg**: FedAvg, 10,000 clients, 1% a round, 3 rounds.

For each, the table splits the wall time (partition + every phase; the run's final report is not
part of it) into the rounds' own time (the `seconds` of each round in the run's rounds-*.jsonl:
training and aggregation), checkpoints (`Checkpoints.save_round`/`save_final`, client states
included), evaluation (personalized and global, at the phase ends and every `eval.every`), reading
the partition and preparing the clients' tensors, and the rest; and gives wall / rounds, the number
issue 34 asks to bring to 1.3 or below. `--before REF` runs the same settings on the code of git
revision REF (checked out to a temporary worktree), in the same invocation, so the two columns share
the machine's load (these machines are noisy: read ratios, not seconds). Results go to
OUT/wall_time.md and OUT/wall_time.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = {
    "stateful": ["method.name=superfed_mm", "method.start_fraction=0.0", "partition.num_clients=1000",
                 "train.client_fraction=0.1", "train.rounds=10"],
    "fedavg": ["method.name=fedavg", "partition.num_clients=10000", "train.client_fraction=0.01", "train.rounds=3"],
}
COMMON = ["data.dataset=mnist5k", "partition.scheme=with_replacement", "partition.samples_per_client=64", "partition.alpha=0.3",
          "model.name=twonn", "train.local_epochs=1", "eval.every=0", "telemetry.progress=false", "engine.processes=1",
          "engine.state_memory_mb=4096"]
PARTS = ("rounds", "checkpoints", "evaluation", "data", "other")


def _timed(owner, name: str, bucket: dict, part: str) -> None:
    """Wrap owner.name so that its calls add their seconds to bucket[part]."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            bucket[part] += time.perf_counter() - t0

    setattr(owner, name, wrapper)


def one_run(setting: str, store: str) -> dict:
    """In the child process (on whichever code PYTHONPATH names): the run, timed by part."""
    import torch

    import fedpipe.run.callbacks as callbacks
    import fedpipe.run.run as runmod
    from fedpipe.engine.state import Checkpoints
    from fedpipe.run.config import load_config

    torch.set_num_threads(1)
    spent = dict.fromkeys(PARTS, 0.0)
    for name in ("save_round", "save_final"):
        _timed(Checkpoints, name, spent, "checkpoints")
    for name in ("evaluate_personalized", "evaluate_global"):
        _timed(callbacks, name, spent, "evaluation")
    _timed(runmod, "federated_data", spent, "data")
    _timed(runmod.Run, "load_partition", spent, "data")
    cfg = load_config(None, [*COMMON, *SETTINGS[setting], f"run.store={store}", f"run.id=wall-{setting}"])
    run = runmod.Run(cfg)
    t0 = time.perf_counter()
    run.partition()
    for phase in run.phases():
        run.train(phase.name)
    wall = time.perf_counter() - t0
    reports = [p for p in (Path(store) / cfg.run_id()).rglob("rounds-*.jsonl") if ".sha256" not in p.parts]  # not the hash files
    rounds = [json.loads(line) for path in reports for line in path.read_text().splitlines() if line.strip()]
    spent["rounds"] = sum(r.get("seconds", 0.0) for r in rounds if r.get("event", "round") == "round")
    spent["other"] = wall - sum(spent[p] for p in PARTS if p != "other")
    return {"setting": setting, "wall": wall, **spent, "round_count": len(rounds)}


def run_child(code: Path, setting: str) -> dict:
    with tempfile.TemporaryDirectory() as store:
        env = {**os.environ, "PYTHONPATH": str(code)}
        out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", setting, store],
                             env=env, cwd=code, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{setting} on {code} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    lines = ["| setting | code | wall s | rounds s | checkpoints s | evaluation s | data s | other s | wall / rounds |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['code']} | {r['wall']:.1f} | {r['rounds']:.1f} | {r['checkpoints']:.1f} | "
                     f"{r['evaluation']:.1f} | {r['data']:.1f} | {r['other']:.1f} | {r['wall'] / max(r['rounds'], 1e-9):.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="main~", help="git revision to run beside this tree (none: only this tree)")
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--repeat", type=int, default=1, help="runs of each (version, setting); the table keeps the fastest")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--child", nargs=2, metavar=("SETTING", "STORE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(one_run(*args.child)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        codes = {"this tree": ROOT}
        if args.before != "none":
            rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.before], capture_output=True, text=True, check=True).stdout.strip()
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", f"{tmp}/before", rev], check=True)
            codes = {f"before ({rev})": Path(tmp) / "before", **codes}
        try:
            rows = []
            for setting in args.settings:
                runs: dict[str, list[dict]] = {label: [] for label in codes}
                for _ in range(args.repeat):  # interleaved run by run: both versions see the same load
                    for label, code in codes.items():
                        runs[label].append(run_child(code, setting))
                        r = runs[label][-1]
                        print(f"{setting:9s} {label:22s} wall {r['wall']:6.1f} s, rounds {r['rounds']:6.1f} s", file=sys.stderr)
                rows.extend({**min(found, key=lambda r: r["wall"]), "code": label} for label, found in runs.items())
        finally:
            if args.before != "none":
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", f"{tmp}/before"], check=False)
    args.out.mkdir(parents=True, exist_ok=True)
    head = (f"Wall time by part (`benchmarks/wall_time.py --before {args.before} --repeat {args.repeat}`), one core "
            f"(torch threads 1), {platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d')}.\n\n")
    text = head + table(rows) + "\n"
    (args.out / "wall_time.md").write_text(text)
    (args.out / "wall_time.json").write_text(json.dumps(rows, indent=2))
    print(text)


if __name__ == "__main__":
    main()
