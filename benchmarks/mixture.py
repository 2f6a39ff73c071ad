"""The federated mixture of experts' Table 1 and Fig. 3 (on mnist5k by default; `--dataset fashion_mnist` for the
paper's Table 1c/1d): local and global test accuracy of FedAvg, Local, Fine-tuned and the Mixture, per
majority-class fraction p and opt-out fraction q. The paper's Fashion-MNIST table at its budget, with its numbers
beside ours: `fedpipe reproduce fedmoe_table1_fashion_mnist` (reproductions/).

    .venv/bin/python benchmarks/mixture.py                        # p in {0.2, 0.5, 0.8, 1.0} x q in {0, 0.5, 0.9}, 3 seeds
    .venv/bin/python benchmarks/mixture.py --ps 0.8 --qs 0 --seeds 0 --rounds 5    # one quick cell

Each (p, q, seed) is one fedmoe run (partition, then the phases federation, specialists and gate) in
its own process, with one thread (on a small CPU two single-threaded processes use the cores better
than one two-threaded one). FedAvg, Local, Fine-tuned and Mixture are four models of that one run
(`FedMoE.compared_models`: the global model, the Local baseline and the fine-tuned specialist trained
in phase 2, the mixture of phase 3). Each is scored on every client's local test split (drawn with
the client's own skew: the paper's local test set) and on the balanced global test set shared by all
clients (a stratified hold-out of mnist5k); a cell is the mean over clients, then mean ± std over
seeds. Opt-out clients are among the clients scored (they receive the global model and train their
own specialist, Local model and gate).

The setting is examples/fedmoe_mnist5k.yaml: the paper's, scaled to 5000 digits and 2 busy cores
(`--help` lists every knob). K = 20 clients of 100 samples (60 train / 20 validation / 20 local test),
two majority classes per client forming fraction p; the global test set is a stratified (balanced)
hold-out of 1000 digits; 5 clients per round (the paper's 5, from the opt-in pool: with q = 0.9 only 2
clients are opt-in, so only 2 take part); LeNet-5 (the paper's CNN); Adam throughout, FedAvg with 15
rounds of E = 3 local epochs, batch 20 (the paper: 10), lr 1e-3 (the paper's 5e-5 needs its 1250
rounds); the Local baseline at FedAvg's rate; the fine-tuned specialist and the mixture at lr 1e-4 (the
paper uses a fifth of FedAvg's rate); early stopping with patience 3, at most 15 epochs. Sized so that
the 36 runs of the default grid finish in well under an hour on 2 shared cores.

Writes <out>/mixture.md (the table), mixture.json (every run's numbers) and mixture.png (Fig. 3).
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

METHODS = {"fedavg": "FedAvg", "local": "Local", "finetuned": "Fine-tuned", "mixture": "Mixture"}


def one_run(p: float, q: float, seed: int, common: list[str], store: str) -> dict:
    """One fedmoe run; returns each compared model's mean accuracy over clients on the local test
    splits and on the global test set."""
    import torch

    torch.set_num_threads(1)
    from fedpipe.run.compare import compared_model_scores
    from fedpipe.run.config import load_config
    from fedpipe.run.run import Run

    cfg = load_config(None, [*common, f"partition.p={p}", f"partition.opt_out_fraction={q}", f"run.seed={seed}",
                             f"run.store={store}", "telemetry.progress=false"])
    t0 = time.perf_counter()
    run = Run(cfg)
    run.partition()
    state = None
    for phase in run.phases():
        state = run.train(phase.name)
    scores = compared_model_scores(run, state)
    partition = run.load_partition()
    return {
        "p": p, "q": q, "seed": seed, "clients": len(partition.clients), "opt_out": sum(c.opt_out for c in partition.clients),
        "models": {m: {split: scores[f"{m}.{split}"] for split in ("local", "global")} for m in METHODS if f"{m}.local" in scores},
        "seconds": time.perf_counter() - t0,
    }


def cell(rows: list[dict], method: str, split: str) -> str:
    vals = [r["models"][method][split] for r in rows if method in r["models"]]
    return "n/a" if not vals else f"{100 * np.mean(vals):.1f} ± {100 * np.std(vals):.1f}"


def table(rows: list[dict], ps: list[float], qs: list[float]) -> str:
    head = "| q | p | " + " | ".join(f"{label} local | {label} global" for label in METHODS.values()) + " |"
    lines = [head, "|" + " --- |" * (2 + 2 * len(METHODS))]
    for q in qs:
        for p in ps:
            sel = [r for r in rows if r["p"] == p and r["q"] == q]
            lines.append(f"| {q:g} | {p:g} | " + " | ".join(f"{cell(sel, m, 'local')} | {cell(sel, m, 'global')}" for m in METHODS) + " |")
    return "\n".join(lines)


def figure_rows(rows: list[dict]) -> list[dict]:
    """Means over seeds per (method, p, q), as plots.global_vs_local_accuracy takes them."""
    out = []
    for p, q in sorted({(r["p"], r["q"]) for r in rows}):
        sel = [r for r in rows if r["p"] == p and r["q"] == q]
        for m in METHODS:
            vals = [r["models"][m] for r in sel if m in r["models"]]
            if vals:
                out.append({"method": m, "p": p, "q": q, "local": float(np.mean([v["local"] for v in vals])),
                            "global": float(np.mean([v["global"] for v in vals]))})
    return out


def common_overrides(args: argparse.Namespace) -> list[str]:
    """Every run's config overrides but p, q and the seed (benchmarks/mixture_records.py rebuilds them from mixture.json)."""
    return [
        f"data.dataset={args.dataset}", "method.name=fedmoe", "partition.scheme=majority_class",
        f"partition.num_clients={args.clients}", f"partition.samples_per_client={args.samples_per_client}",
        "partition.val_fraction=0.2", "partition.test_fraction=0.2", f"model.name={args.model}",
        f"train.rounds={args.rounds}", f"train.client_fraction={args.per_round / args.clients}",
        f"train.local_epochs={args.local_epochs}", f"train.batch_size={args.batch_size}", "train.optimizer=adam", f"train.lr={args.lr}",
        "train.lr_decay=1.0", "train.weight_decay=0", f"method.finetune_lr={args.finetune_lr}",
        f"method.max_epochs={args.max_epochs}", f"method.patience={args.patience}", "eval.every=0", *args.set,
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ps", nargs="+", type=float, default=[0.2, 0.5, 0.8, 1.0], help="majority-class fractions p")
    ap.add_argument("--qs", nargs="+", type=float, default=[0.0, 0.5, 0.9], help="opt-out fractions q")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds (partition, init, sampling)")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--samples-per-client", type=int, default=100)
    ap.add_argument("--per-round", type=int, default=5, help="clients per FedAvg round (C = this / clients)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--local-epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate of FedAvg and the Local baseline")
    ap.add_argument("--finetune-lr", type=float, default=1e-4, help="Adam learning rate of the specialist and the mixture")
    ap.add_argument("--max-epochs", type=int, default=15)
    ap.add_argument("--patience", type=int, default=3)
    ap.add_argument("--model", default="lenet5")
    ap.add_argument("--dataset", default="mnist5k", help="data.dataset of every run (fashion_mnist: the paper's Table 1c/1d)")
    ap.add_argument("--set", action="append", default=[], help="extra config override for every run (repeatable)")
    ap.add_argument("--workers", type=int, default=2, help="parallel processes (one thread each)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for mixture.md/.json/.png")
    args = ap.parse_args(argv)
    common = common_overrides(args)
    jobs = [(p, q, seed) for q in args.qs for p in args.ps for seed in args.seeds]
    rows = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as store, ProcessPoolExecutor(args.workers) as pool:
        futures = [pool.submit(one_run, p, q, seed, common, store) for p, q, seed in jobs]
        for fut in tqdm(as_completed(futures), total=len(futures), desc="runs", unit="run", file=sys.stderr):
            rows.append(fut.result())
    rows.sort(key=lambda r: (r["q"], r["p"], r["seed"]))
    text = (
        f"{args.dataset}, majority-class split, {args.clients} clients x {args.samples_per_client} samples, {args.per_round} per "
        f"round, model {args.model}, {args.rounds} rounds x {args.local_epochs} local epochs of batch {args.batch_size} (Adam lr {args.lr:g}), "
        f"specialist and mixture lr {args.finetune_lr:g}, early stopping patience {args.patience} (max {args.max_epochs} "
        f"epochs), seeds {args.seeds}; test accuracy in % (mean ± std over seeds; each a mean over clients): "
        f"local = each client's own skewed test split, global = the balanced global test set; "
        f"{(time.perf_counter() - started) / 60:.0f} min with {args.workers} workers\n\n" + table(rows, args.ps, args.qs)
    )
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mixture.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": rows}, indent=2))
    (args.out / "mixture.md").write_text(text + "\n")
    from fedpipe.plots import global_vs_local_accuracy

    global_vs_local_accuracy(figure_rows(rows), args.out / "mixture.png",
                             title=f"{args.dataset}: global vs local test accuracy (Fig. 3), mean over seeds {args.seeds}")
    print(f"\nwrote {args.out / 'mixture.md'}, {args.out / 'mixture.json'} and {args.out / 'mixture.png'}", file=sys.stderr)


if __name__ == "__main__":
    main()
