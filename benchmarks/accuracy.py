"""Personalized and global accuracy of every method, side by side, over seeds.

    .venv/bin/python benchmarks/accuracy.py                  # all methods, pathological + Dirichlet(0.3), 3 seeds
    .venv/bin/python benchmarks/accuracy.py --methods fedavg superfed_mm --seeds 0 --rounds 5

Each (method, split, seed) is a full fedpipe run (partition, every phase, evaluation) in its own
process; runs are spread over --workers processes with one thread each (on a small CPU two
single-threaded processes use the cores better than one two-threaded one). The table gives
mean ± std over seeds of the personalized accuracy (each client's model on its own test split,
mean over clients; SuPerFed's lam chosen on validation) and of the global model's top-1 on the
global test set.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np
from tqdm import tqdm

SPLITS = {
    "pathological": ["partition.scheme=pathological", "partition.shards_per_client=2"],
    "dirichlet": ["partition.scheme=dirichlet", "partition.alpha=0.3", "partition.min_client_size=20"],
}


def one_run(method: str, split: str, seed: int, common: list[str], store: str) -> dict:
    import torch

    torch.set_num_threads(1)
    from fedpipe.config import load_config
    from fedpipe.steps import Run

    cfg = load_config(None, [*common, *SPLITS[split], f"method.name={method}", f"run.seed={seed}", f"run.store={store}", "telemetry.progress=false"])
    t0 = time.perf_counter()
    summary = Run(cfg).run_all()
    g = summary["global_model"]
    return {
        "method": method, "split": split, "seed": seed,
        "personalized": summary["personalized_accuracy"]["mean"],
        "global_top1": None if g is None else g["top1"],
        "seconds": time.perf_counter() - t0,
    }


def fmt(values: list[float | None]) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "n/a"
    return f"{100 * np.mean(vals):.2f} ± {100 * np.std(vals):.2f}"


def table(rows: list[dict], methods: list[str], splits: list[str]) -> str:
    head = "| method | " + " | ".join(f"{s}: personalized | {s}: global top-1" for s in splits) + " |"
    lines = [head, "|" + " --- |" * (1 + 2 * len(splits))]
    for m in methods:
        cells = []
        for s in splits:
            sel = [r for r in rows if r["method"] == m and r["split"] == s]
            cells += [fmt([r["personalized"] for r in sel]), fmt([r["global_top1"] for r in sel])]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from fedpipe.algorithms import ALGORITHMS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=list(ALGORITHMS), help="methods to compare (default: all)")
    ap.add_argument("--splits", nargs="+", default=list(SPLITS), choices=list(SPLITS), help="data splits")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds (partition, init, sampling)")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--local-epochs", type=int, default=2)
    ap.add_argument("--model", default="superfed_cnn")
    ap.add_argument("--set", action="append", default=[], help="extra config override for every run (repeatable)")
    ap.add_argument("--workers", type=int, default=2, help="parallel processes (one thread each)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for results.json and table.md")
    args = ap.parse_args(argv)

    common = [
        "data.dataset=mnist5k", f"partition.num_clients={args.clients}", f"model.name={args.model}",
        f"train.rounds={args.rounds}", f"train.local_epochs={args.local_epochs}", "eval.every=0", *args.set,
    ]
    jobs = [(m, s, seed) for s in args.splits for m in args.methods for seed in args.seeds]
    rows = []
    with tempfile.TemporaryDirectory() as store, ProcessPoolExecutor(args.workers) as pool:
        futures = [pool.submit(one_run, m, s, seed, common, store) for m, s, seed in jobs]
        for fut in tqdm(as_completed(futures), total=len(futures), desc="runs", unit="run", file=sys.stderr):
            rows.append(fut.result())
    text = (
        f"mnist5k, {args.clients} clients, model {args.model}, {args.rounds} rounds x {args.local_epochs} local epochs, "
        f"seeds {args.seeds}; accuracy in % (mean ± std over seeds)\n\n" + table(rows, args.methods, args.splits)
    )
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "accuracy.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": rows}, indent=2))
    (args.out / "accuracy.md").write_text(text + "\n")
    print(f"\nwrote {args.out / 'accuracy.md'} and {args.out / 'accuracy.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
