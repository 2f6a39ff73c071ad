"""Memory at scale: 10,000 clients with persistent state, within a memory budget.

    .venv/bin/python benchmarks/scale.py                         # FedAvg and SuPerFed-MM, 10,000 clients
    .venv/bin/python benchmarks/scale.py --clients 2000 --methods superfed_mm --state-memory-mb 16

Each method is one full fedpipe run (`Run`: partition, every phase, evaluation and report) on
mnist5k split over --clients clients that share samples (`partition.scheme=with_replacement`:
each client draws --samples-per-client distinct samples, Dirichlet(--alpha) label skew), the small
784-200-200-10 MLP (twonn), --fraction of the clients sampled per round. SuPerFed's Phase II starts
after 40% of the rounds, so sampled clients build local models (its persistent state); with a small
engine.state_memory_mb most of them live in the store, not in memory.

Every run is a fresh process, so its peak resident memory (getrusage ru_maxrss, its own and its
children's) is that run's alone. The table gives it beside the wall time, the clients' states at
the end (in memory / spilled to the store), the bytes the spilled states take in the store, and the
personalized accuracy (each client's model on its own test split, mean over clients). Results go to
OUT/scale.md and OUT/scale.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

METHODS = {
    "fedavg": ["method.name=fedavg"],
    "superfed_mm": ["method.name=superfed_mm", "method.start_fraction=0.4"],
}


def settings(args: argparse.Namespace) -> list[str]:
    """The config every run shares (the method's own fields come on top)."""
    alpha = [] if args.alpha is None else [f"partition.alpha={args.alpha}"]
    return [
        "data.dataset=mnist5k", "partition.scheme=with_replacement", f"partition.num_clients={args.clients}",
        f"partition.samples_per_client={args.samples_per_client}", *alpha, "model.name=twonn",
        f"train.rounds={args.rounds}", f"train.client_fraction={args.fraction}", f"train.local_epochs={args.local_epochs}",
        "eval.every=0", f"engine.state_memory_mb={args.state_memory_mb}", "telemetry.progress=false", *args.set,
    ]


def one_run(method: str, common: list[str], store: str) -> dict:
    """Runs in the child process: the whole run, then what it measured, as a dict."""
    import logging

    import torch

    from fedpipe.run.config import load_config
    from fedpipe.run.run import Run

    logging.basicConfig(level=logging.INFO, format=f"  [{method}] %(message)s", stream=sys.stderr)
    torch.set_num_threads(1)
    cfg = load_config(None, [*common, *METHODS[method], f"run.store={store}", f"run.id=scale-{method}"])
    run = Run(cfg)
    t0 = time.perf_counter()
    run.partition()
    stats = {}
    for phase in run.phases():
        state = run.train(phase.name)
        stats[phase.name] = getattr(state.clients, "stats", {"clients": len(state.clients)})
    summary = run.evaluate()
    wall = time.perf_counter() - t0
    peak_kib = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    phases = Path(store) / cfg.run_id() / "phases"
    spilled = sorted(phases.glob("*/clients/*.pt"))
    last = stats[run.phases()[-1].name]
    return {
        "method": method,
        "clients": summary["num_clients"],
        "sampled_per_round": max(1, round(cfg.train.client_fraction * summary["num_clients"])),
        "rounds": cfg.train.rounds,
        "wall_seconds": wall,
        "peak_rss_mib": peak_kib / 1024,  # Linux reports ru_maxrss in KiB
        "states": last.get("clients", 0),
        "states_resident": last.get("resident", last.get("clients", 0)),
        "states_spilled": last.get("spilled", 0),
        "states_resident_bytes": last.get("resident_bytes"),
        "spilled_objects": len(spilled),
        "spilled_store_bytes": sum(p.stat().st_size for p in spilled),
        "final_state_bytes": {p.parent.name: p.stat().st_size for p in sorted(phases.glob("*/final.pt"))},
        "client_state_stats": stats,
        "personalized_accuracy": summary["personalized_accuracy"]["mean"],
        "global_top1": None if summary["global_model"] is None else summary["global_model"]["top1"],
    }


def table(rows: list[dict], budget_mb: float) -> str:
    lines = [
        "| method | clients | sampled/round | rounds | wall s | peak RSS MiB | states resident / spilled | "
        "spilled states in store | personalized acc. |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for r in rows:
        resident = r["states_resident_bytes"]
        mem = "" if resident is None else f" ({resident / 2**20:.1f} of {budget_mb:g} MiB)"
        lines.append(
            f"| {r['method']} | {r['clients']:,} | {r['sampled_per_round']} | {r['rounds']} | {r['wall_seconds']:.0f} | "
            f"{r['peak_rss_mib']:.0f} | {r['states_resident']} / {r['states_spilled']}{mem} | "
            f"{r['spilled_store_bytes'] / 2**20:.1f} MiB ({r['spilled_objects']} objects) | {100 * r['personalized_accuracy']:.2f}% |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS), help="methods to run (default: both)")
    ap.add_argument("--clients", type=int, default=10_000, help="clients K (they share mnist5k's 4,000 pool samples)")
    ap.add_argument("--samples-per-client", type=int, default=20, help="distinct samples per client before its train/val/test split")
    ap.add_argument("--alpha", type=lambda v: None if v.lower() == "none" else float(v), default=0.3,
                    help="Dirichlet label skew of each client (none: IID clients)")
    ap.add_argument("--fraction", type=float, default=0.01, help="clients sampled per round (train.client_fraction)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--local-epochs", type=int, default=5)
    ap.add_argument("--state-memory-mb", type=float, default=64,
                    help="engine.state_memory_mb: clients' states kept in memory; the rest spill to the store")
    ap.add_argument("--set", action="append", default=[], help="extra config override for every run (repeatable)")
    ap.add_argument("--store", type=Path, default=None, help="keep the runs' artifacts here (default: a temporary folder)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for scale.md and scale.json")
    ap.add_argument("--child", nargs=3, metavar=("METHOD", "STORE", "SETTINGS_JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:  # one run in this fresh process; the result is the last line of stdout
        method, store, common = args.child
        print(json.dumps(one_run(method, json.loads(common), store)))
        return

    common = settings(args)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = str(args.store or tmp)
        for i, method in enumerate(args.methods, 1):
            print(f"run {i}/{len(args.methods)}: {method}, {args.clients:,} clients (a fresh process)...", file=sys.stderr)
            started = time.perf_counter()
            child = subprocess.run(
                [sys.executable, __file__, "--child", method, store, json.dumps(common)],
                stdout=subprocess.PIPE, text=True, check=False,
            )
            if child.returncode != 0:
                sys.exit(f"the {method} run failed (exit {child.returncode}); its log is above.")
            row = json.loads(child.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"  done in {time.perf_counter() - started:.0f} s, peak RSS {row['peak_rss_mib']:.0f} MiB", file=sys.stderr)
    machine = (f"{platform.machine()}, {os.cpu_count()} CPUs, torch 1 thread per run, "
               f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, nice {os.nice(0)}, Python {platform.python_version()}")
    alpha = "IID" if args.alpha is None else f"Dirichlet({args.alpha}) labels"
    text = (
        f"mnist5k (with_replacement: {args.samples_per_client} distinct samples per client, {alpha}), twonn, "
        f"{args.rounds} rounds x {args.local_epochs} local epochs, engine.state_memory_mb={args.state_memory_mb:g}; "
        f"each run in its own process ({machine})\n\n" + table(rows, args.state_memory_mb)
        + "\n\nfinal.pt per phase (clients' states as references): "
        + "; ".join(f"{r['method']}: " + ", ".join(f"{ph} {n / 2**20:.2f} MiB" for ph, n in r["final_state_bytes"].items()) for r in rows)
        + f"\n\n`{' '.join(['benchmarks/scale.py', *(argv if argv is not None else sys.argv[1:])])}`"
    )
    print(text)
    (args.out / "scale.json").write_text(json.dumps(
        {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "child"},
         "settings": common, "machine": machine, "runs": rows}, indent=2))
    (args.out / "scale.md").write_text(text + "\n")
    print(f"\nwrote {args.out / 'scale.md'} and {args.out / 'scale.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
