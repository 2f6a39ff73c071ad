"""Personalized and global accuracy of every method, side by side, over seeds.

    .venv/bin/python benchmarks/accuracy.py                  # all methods, pathological + Dirichlet(0.3), 3 seeds
    .venv/bin/python benchmarks/accuracy.py --methods fedavg superfed_mm --seeds 0 --rounds 5

Each (method, split, seed) is a full fedpipe run (partition, every phase, evaluation) in its own
process; runs are spread over --workers processes with one thread each (on a small CPU two
single-threaded processes use the cores better than one two-threaded one). The table gives
mean ± std over seeds of the personalized accuracy (each client's model on its own test split,
mean over clients; SuPerFed's lam chosen on validation) and of the global model's top-1 on the
global test set.

Every finished run is appended to OUT/runs.jsonl at once, so an interrupted benchmark keeps what it
did: started again with the same settings it skips the runs already there (--fresh starts over),
which also lets a long comparison be done in pieces (--methods a b, then --methods c d, same --out).
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
    from fedpipe.run.config import load_config
    from fedpipe.run.run import Run

    cfg = load_config(None, [*common, *SPLITS[split], f"method.name={method}", f"run.seed={seed}", f"run.store={store}", "telemetry.progress=false"])
    t0 = time.perf_counter()
    summary = Run(cfg).run_all()
    g = summary["global_model"]
    return {
        "method": method, "split": split, "seed": seed,
        "personalized": summary["personalized_accuracy"]["mean"],
        "global_top1": None if g is None else g["top1"],
        "seconds": time.perf_counter() - t0,
        "settings": common,
    }


def fmt(values: list[float | None]) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "n/a"
    return f"{100 * np.mean(vals):.2f} ± {100 * np.std(vals):.2f}"


def table(rows: list[dict], methods: list[str], splits: list[str]) -> str:
    head = "| method | " + " | ".join(f"{s}: personalized | {s}: global top-1" for s in splits) + " | seconds per run |"
    lines = [head, "|" + " --- |" * (2 + 2 * len(splits))]
    for m in methods:
        cells = []
        for s in splits:
            sel = [r for r in rows if r["method"] == m and r["split"] == s]
            cells += [fmt([r["personalized"] for r in sel]), fmt([r["global_top1"] for r in sel])]
        secs = [r["seconds"] for r in rows if r["method"] == m]
        cells.append(f"{np.mean(secs):.0f}" if secs else "n/a")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def finished_runs(path: Path, common: list[str]) -> dict[tuple[str, str, int], dict]:
    """The runs already in OUT/runs.jsonl that were made with these settings."""
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {(r["method"], r["split"], r["seed"]): r for r in rows if r.get("settings") == common}


def main(argv: list[str] | None = None) -> None:
    from fedpipe.algorithms import ALGORITHMS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=list(ALGORITHMS), help="methods to compare (default: all)")
    ap.add_argument("--splits", nargs="+", default=list(SPLITS), choices=list(SPLITS), help="data splits")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds (partition, init, sampling)")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--local-epochs", type=int, default=2)
    ap.add_argument("--model", default="lenet5", help="lenet5: the CNN of pFedMB and the mixture of experts (cheap on a CPU)")
    ap.add_argument("--set", action="append", default=[], help="extra config override for every run (repeatable)")
    ap.add_argument("--workers", type=int, default=2, help="parallel processes (one thread each)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for runs.jsonl, accuracy.json and accuracy.md")
    ap.add_argument("--fresh", action="store_true", help="ignore the runs already in OUT/runs.jsonl")
    args = ap.parse_args(argv)

    common = [
        "data.dataset=mnist5k", f"partition.num_clients={args.clients}", f"model.name={args.model}",
        f"train.rounds={args.rounds}", f"train.local_epochs={args.local_epochs}", "eval.every=0", *args.set,
    ]
    unknown = sorted(set(args.methods) - set(ALGORITHMS))
    if unknown:
        ap.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(ALGORITHMS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "runs.jsonl"
    done = {} if args.fresh else finished_runs(log, common)
    if args.fresh:
        log.unlink(missing_ok=True)
    jobs = [(m, s, seed) for s in args.splits for m in args.methods for seed in args.seeds]
    rows = [done[j] for j in jobs if j in done]
    todo = [j for j in jobs if j not in done]
    if rows:
        print(f"reusing {len(rows)} finished run(s) from {log} (--fresh to redo them)", file=sys.stderr)
    with tempfile.TemporaryDirectory() as store, ProcessPoolExecutor(args.workers) as pool:
        futures = {pool.submit(one_run, m, s, seed, common, store): (m, s, seed) for m, s, seed in todo}
        failed = []
        for fut in tqdm(as_completed(futures), total=len(futures), desc="runs", unit="run", file=sys.stderr):
            try:
                row = fut.result()
            except Exception as exc:  # one broken run must not throw away the others
                failed.append(f"{futures[fut]}: {type(exc).__name__}: {exc}")
                continue
            rows.append(row)
            with log.open("a") as f:
                f.write(json.dumps(row) + "\n")
    text = (
        f"mnist5k, {args.clients} clients, model {args.model}, {args.rounds} rounds x {args.local_epochs} local epochs, "
        f"seeds {args.seeds}; accuracy in % (mean ± std over seeds)\n\n" + table(rows, args.methods, args.splits)
    )
    print(text)
    (args.out / "accuracy.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": rows}, indent=2))
    (args.out / "accuracy.md").write_text(text + "\n")
    print(f"\nwrote {args.out / 'accuracy.md'} and {args.out / 'accuracy.json'}", file=sys.stderr)
    if failed:
        sys.exit("these runs failed (method, split, seed), the table leaves them out:\n" + "\n".join(failed))


if __name__ == "__main__":
    main()
