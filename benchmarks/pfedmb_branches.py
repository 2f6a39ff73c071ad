"""pFedMB's personalized accuracy against the number of branches B (Mori et al. 2023, Fig. 5).

    .venv/bin/python benchmarks/pfedmb_branches.py                          # B = 1, 2, 3, 5, 10; a few minutes on 2 cores
    .venv/bin/python benchmarks/pfedmb_branches.py --branches 2 5 10 20 --seeds 0 1 2 --rounds 30

The paper's Fig. 5 is CIFAR-10, random 2 classes, 50 clients; this runs the same split shape on
mnist5k (`classes_per_client`: every client 2 random classes, equal sizes) with the paper's
LeNet-style CNN and local fine-tuning, on a budget that fits a laptop: a client holds 140 training
digits, so the batch is 20 rather than the paper's 64 (7 steps per epoch instead of 3). B = 1 is
FedAvg followed by fine-tuning (the alpha stage has nothing to fit). Each (B, seed) is a full
fedpipe run (partition, federation, fine-tuning, evaluation) in its own single-threaded process.
Prints a table (personalized accuracy, mean ± std over seeds; traffic; time) and writes it with
the figure to --out.
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


def one_run(branches: int, seed: int, common: list[str], store: str) -> dict:
    import torch

    torch.set_num_threads(1)
    from fedpipe.run.config import load_config
    from fedpipe.run.run import Run

    cfg = load_config(None, [*common, f"method.num_branches={branches}", f"run.seed={seed}", f"run.store={store}",
                             f"run.id=pfedmb-b{branches}-s{seed}", "telemetry.progress=false"])
    t0 = time.perf_counter()
    summary = Run(cfg).run_all()
    return {
        "branches": branches, "seed": seed,
        "personalized": summary["personalized_accuracy"]["mean"],
        "mb_uploaded": summary["communication"]["bytes_uploaded"] / 1e6,
        "seconds": time.perf_counter() - t0,
    }


def table(rows: list[dict]) -> str:
    lines = ["| B | personalized accuracy (%) | MB uploaded | seconds per run |", "| --- | --- | --- | --- |"]
    for b in sorted({r["branches"] for r in rows}):
        sel = [r for r in rows if r["branches"] == b]
        acc = 100 * np.array([r["personalized"] for r in sel])
        lines.append(f"| {b} | {acc.mean():.2f} ± {acc.std():.2f} | {np.mean([r['mb_uploaded'] for r in sel]):.1f} | "
                     f"{np.mean([r['seconds'] for r in sel]):.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--branches", nargs="+", type=int, default=[1, 2, 3, 5, 10], help="values of B")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0], help="seeds (partition, init, sampling)")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--client-fraction", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--local-epochs", type=int, default=1, help="E of the alpha stage and of the weight stage")
    ap.add_argument("--finetune-epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=20)
    ap.add_argument("--lr", type=float, default=0.05, help="train.lr (eta_W), the same for every B")
    ap.add_argument("--set", action="append", default=[], help="extra config override for every run (repeatable)")
    ap.add_argument("--workers", type=int, default=2, help="parallel processes (one thread each)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for the table, JSON and figure")
    args = ap.parse_args(argv)

    common = [
        "data.dataset=mnist5k", "partition.scheme=classes_per_client", "partition.classes_per_client=2",
        f"partition.num_clients={args.clients}", "model.name=lenet5", "method.name=pfedmb",
        f"method.finetune_epochs={args.finetune_epochs}", f"train.rounds={args.rounds}",
        f"train.client_fraction={args.client_fraction}", f"train.local_epochs={args.local_epochs}",
        f"train.batch_size={args.batch_size}", f"train.lr={args.lr}", "eval.every=0", *args.set,
    ]
    jobs = [(b, seed) for b in args.branches for seed in args.seeds]
    rows = []
    with tempfile.TemporaryDirectory() as store, ProcessPoolExecutor(args.workers) as pool:
        futures = [pool.submit(one_run, b, seed, common, store) for b, seed in jobs]
        for fut in as_completed(futures):
            rows.append(fut.result())
            print(f"B={rows[-1]['branches']} seed={rows[-1]['seed']}: {100 * rows[-1]['personalized']:.2f}% "
                  f"({rows[-1]['seconds']:.0f} s)", file=sys.stderr)
    text = (
        f"pFedMB on mnist5k, random 2 classes per client, {args.clients} clients (fraction {args.client_fraction}), "
        f"lenet5, {args.rounds} rounds x {args.local_epochs} local epochs (batch {args.batch_size}, lr {args.lr}) + {args.finetune_epochs} fine-tuning epochs, "
        f"seeds {args.seeds}; personalized accuracy in % (mean over clients; mean ± std over seeds)\n\n" + table(rows)
    )
    print(text)
    from fedpipe.plots import accuracy_vs_branches

    args.out.mkdir(parents=True, exist_ok=True)
    results = {b: [r["personalized"] for r in rows if r["branches"] == b] for b in args.branches}
    accuracy_vs_branches(results, args.out / "pfedmb_branches.png",
                         title=f"pFedMB on mnist5k, 2 classes per client, {args.clients} clients")
    (args.out / "pfedmb_branches.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": rows}, indent=2))
    (args.out / "pfedmb_branches.md").write_text(text + "\n")
    print(f"\nwrote {args.out / 'pfedmb_branches.md'}, .json and .png", file=sys.stderr)


if __name__ == "__main__":
    main()
