"""What a study costs beyond its trials' training: a local study of 20 three-round trials (2 methods x 10,
mnist5k, 20 clients), its wall time against the sum of its trials' training times (the rounds' own
seconds: local training and aggregation), side by side in one run:

- warm, 1 worker: every trial in this process (torch imported and the data decoded once);
- warm, 2 workers: two warm worker processes (capacity = wall x workers);
- cold: the same trials as separate `fedpipe study trial` processes, as a script looping over
  `fedpipe run` would pay (import, data, everything per trial): 4 of them, scaled to 20.

    .venv/bin/python benchmarks/study_overhead.py [--out benchmarks/results/study_overhead.md]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fedpipe.store import open_store
from fedpipe.study import runner, trials
from fedpipe.study.config import load_study
from fedpipe.study.records import StudyRecords

STUDY = """
study: {{name: overhead-{workers}, store: {store}}}
base:
  data: {{dataset: mnist5k}}
  partition: {{scheme: pathological, num_clients: 20}}
  model: {{name: lenet5}}
  train: {{local_epochs: 1, batch_size: 10}}
  engine: {{clients: sequential}}
methods: [fedavg, fedprox]
budget: {{trials: 10, rounds: 3}}
sampler: random
seeds: [0]
workers: {workers}
"""


def tuned(workers: int, folder: Path) -> dict:
    study, base = load_study(None, text=STUDY.format(workers=workers, store=folder))
    records = StudyRecords(open_store(str(folder)), study)
    records.claim()
    pool = trials.worker_pool(workers)
    started = time.perf_counter()
    try:
        runner.tune(study, base, records, pool, progress=False)
    finally:
        getattr(pool, "shutdown", lambda **_: None)(wait=True)
    wall = time.perf_counter() - started
    done = [r for m in ("fedavg", "fedprox") for r in records.trials(m, "pathological")]
    return {"mode": f"warm, {workers} worker{'s' * (workers > 1)}", "trials": len(done), "wall": wall, "capacity": wall * workers,
            "training": sum(r["seconds"] for r in done), "runs_wall": sum(r.get("wall", 0) for r in done)}


def cold(folder: Path, count: int = 4) -> dict:
    """`count` trials, each a fresh `fedpipe study trial` process (the fixed cost of a process per trial)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "study.yaml"
    path.write_text(STUDY.format(workers=1, store=folder))
    started, training = time.perf_counter(), 0.0
    for i in range(count):
        lr = 0.01 + 0.005 * i
        subprocess.run([sys.executable, "-m", "fedpipe.cli", "study", "trial", "-c", str(path), "--method", "fedavg",
                        "--param", f"train.lr={lr}"], check=True, capture_output=True)
    wall = time.perf_counter() - started
    for key in open_store(str(folder)).list("studies/overhead-1/runs/"):
        if key.endswith("summary.json"):
            training += json.loads(open_store(str(folder)).get(key))["training_seconds"]
    return {"mode": f"cold: a process per trial ({count}, x{20 // count} to 20)", "trials": 20, "wall": wall * 20 / count,
            "capacity": wall * 20 / count, "training": training * 20 / count, "runs_wall": float("nan")}


def table(rows: list[dict]) -> str:
    out = ["| mode | trials | wall s | capacity s (wall x workers) | sum of training s | overhead s | overhead % |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        over = r["capacity"] - r["training"]
        out.append(f"| {r['mode']} | {r['trials']} | {r['wall']:.1f} | {r['capacity']:.1f} | {r['training']:.1f} | {over:.1f} | "
                   f"{100 * over / r['capacity']:.1f} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="Also write the table (Markdown) here.")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for workers in (1, 2):
            rows.append(tuned(workers, Path(tmp) / f"w{workers}"))
            print(table(rows), flush=True)
        rows.append(cold(Path(tmp) / "cold"))
    text = table(rows)
    print(text)
    if args.out:
        args.out.write_text("# Study overhead (benchmarks/study_overhead.py)\n\n" + text + "\n")


if __name__ == "__main__":
    main()
