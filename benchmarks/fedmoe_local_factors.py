"""Why is our Local baseline far above the paper's at p = 0.3? One factor at a time (issue 45).

Listo Zec et al.'s Table 1c/1d (Fashion-MNIST) has Local at 40.65 global / 45.77 local for p = 0.3, where the
reproduction (reproductions/fedmoe_table1_fashion_mnist.yaml) measured 61.9 / 61.8. The Local baseline is cheap
(each client trains alone on its 100 samples, nothing federated), so this script runs it for the reproduction's
exact config with one factor changed at a time and prints Local's global and local test accuracy beside the
paper's. A factor that closes the gap names the reading of the paper the numbers support.

    .venv/bin/python benchmarks/fedmoe_local_factors.py --data-root /usr/share/datasets/fashion-mnist
    .venv/bin/python benchmarks/fedmoe_local_factors.py --data-root ... --only ours,"patience 1" --ps 0.3 0.8 --seeds 0
    .venv/bin/python benchmarks/fedmoe_local_factors.py --data-root ... --report-only --runs OLD.json --ps 0.3 0.8 \\
        --conclusion "what the table says"                               # the table (and the report's appendix) again

Each row is the reproduction's run config at p (`fedpipe.study.reproduce.run_config`, the same config
`fedpipe reproduce` trains) plus the row's overrides, on 20 clients: the paper evaluates 20 random clients (Sec. 4,
Evaluation), and a client's Local model depends on its own data only (the other clients change nothing but which
classes are whose). Only the Local baseline's numbers are read: the run stops after phase 2 (specialists), with
one federation round and a specialist that cannot move (finetune_lr 1e-12, so it stops after `patience` epochs),
both of which leave Local unchanged. One process per row and seed, one thread each. Writes <out>/fedmoe_local_factors.md,
.json (every client's numbers) and .appendix.json (the table as a section of the reproduction's report:
`fedpipe reproduce fedmoe_table1_fashion_mnist --report-only --appendix FILE`).
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
from scipy import stats
from tqdm import tqdm

PAPER = {0.3: (40.65, 45.77), 0.6: (18.07, 55.16), 0.7: (17.57, 65.12), 0.8: (17.69, 74.84), 1.0: (18.11, 94.22)}
"""Table 1c (global) and 1d (local): Local on Fashion-MNIST, q = 0."""

HARNESS = ["partition.num_clients=20", "train.rounds=1", "method.finetune_lr=1e-12", "eval.every=0"]
"""What every row shares beside the reproduction's setting (see the module docstring: none of it moves Local)."""

FACTORS: dict[str, tuple[str, list[str]]] = {
    "ours": ("the reproduction's setting (patience 10, lr 5e-5, pooled standardisation, 100 train / 50 val / 50 test)", []),
    "patience 1": ("stop at the first epoch without a lower validation loss", ["method.patience=1"]),
    "patience 3": ("", ["method.patience=3"]),
    "patience 30": ("", ["method.patience=30"]),
    "no early stopping": ("all 500 epochs, the last epoch's model", ["method.patience=500"]),
    "5 epochs at most": ("", ["method.max_epochs=5"]),
    "lr 1e-5 and patience 1": ("the fine-tuning rate and the shortest patience", ["method.local_lr=1e-5", "method.patience=1"]),
    "lr 1e-5": ("Local at the fine-tuning rate", ["method.local_lr=1e-5"]),
    "lr 5e-4": ("ten times the paper's rate", ["method.local_lr=5e-4"]),
    "inputs 0..1": ("ToTensor only, no standardisation", ["data.input_mean=[0.0]", "data.input_std=[1.0]"]),
    "inputs 0..255": ("raw bytes, never scaled", ["data.input_mean=[0.0]", "data.input_std=[0.00392156862745098]"]),
    "inputs -1..1": ("(x - 0.5) / 0.5, the common Normalize((0.5,), (0.5,))", ["data.standardisation=fixed"]),
    "minority from the pool": ("the non-majority part drawn uniformly from the rest of the pool", ["partition.minority=pool"]),
    "validation 10": ("10 validation samples per client, not 50", ["partition.samples_per_client=160", "partition.val_fraction=0.0625",
                                                                    "partition.test_fraction=0.3125"]),
    "validation 10 and patience 1": ("the noisiest stop", ["partition.samples_per_client=160", "partition.val_fraction=0.0625",
                                                           "partition.test_fraction=0.3125", "method.patience=1"]),
    "local test 500": ("the paper's 500 local test samples", ["partition.samples_per_client=650", "partition.val_fraction=0.0769231",
                                                              "partition.test_fraction=0.7692308"]),
    "batch 32": ("not the paper's 10", ["train.batch_size=32"]),
    "weight decay 1e-4": ("", ["train.weight_decay=1e-4"]),
}


def one(name: str, overrides: list[str], p: float, seed: int, data_root: str) -> dict:
    """Local's per-client accuracy (local and global test sets) for one factor, p and seed."""
    import torch

    torch.set_num_threads(1)
    from fedpipe.data.federated import prepare_data
    from fedpipe.engine.evaluation import evaluate_model
    from fedpipe.run.run import Run
    from fedpipe.study.reproduce import run_config
    from fedpipe.study.reproduction import find_reproduction, load_reproduction

    repro = load_reproduction(find_reproduction("fedmoe_table1_fashion_mnist"))
    label = next(lab for lab in repro.axes["p"].overrides() if float(lab) == p)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedmoe-local-") as store:
        cfg = run_config(repro, {"p": label}, seed, [f"data.root={data_root}", f"run.store={store}", "telemetry.progress=false",
                                                      *HARNESS, *overrides])
        run = Run(cfg)
        run.partition()
        state = None
        for phase in run.phases():
            if phase.name == "gate":
                break
            state = run.train(phase.name)
        algorithm, _ = run.build_algorithm()
        data = prepare_data(run.bundle, run.load_partition(), run.device, run.cfg.standardisation())
        local, glob = [], []
        for client in data.clients:
            params = algorithm.compared_models(state.server, state.clients.get(client.client_id))["local"]
            local.append(evaluate_model(algorithm, params, client.test, 512, 15).accuracy)
            glob.append(evaluate_model(algorithm, params, data.global_test, 512, 15).accuracy)
    return {"factor": name, "p": p, "seed": seed, "local": local, "global": glob, "seconds": round(time.perf_counter() - started, 1)}


def interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and 95% Student-t interval in percent, over every client of every seed (a client's Local model is an
    independent draw given its data; the paper averages 20 clients over 4 runs)."""
    v = 100 * np.asarray(values)
    half = stats.t.ppf(0.975, v.size - 1) * v.std(ddof=1) / np.sqrt(v.size) if v.size > 1 else float("nan")
    return float(v.mean()), float(v.mean() - half), float(v.mean() + half)


def show(i: tuple[float, float, float]) -> str:
    return f"{i[0]:.1f} [{i[1]:.1f}, {i[2]:.1f}]"


def inside(i: tuple[float, float, float], paper: float) -> bool:
    return i[1] <= paper <= i[2]


HEADER = ["factor", "what", "p", "Local global", "paper", "Local local", "paper", "paper's inside ours", "clients x seeds"]


def table_rows(rows: list[dict], ps: list[float]) -> list[list[str]]:
    out = []
    for name, (what, overrides) in FACTORS.items():
        for p in ps:
            sel = [r for r in rows if r["factor"] == name and r["p"] == p]
            if not sel:
                continue
            g, l_ = interval([v for r in sel for v in r["global"]]), interval([v for r in sel for v in r["local"]])
            both = {(True, True): "both", (True, False): "global only", (False, True): "local only", (False, False): "neither"}
            out.append([name, what or ", ".join(overrides), f"{p:g}", show(g), f"{PAPER[p][0]:.2f}", show(l_), f"{PAPER[p][1]:.2f}",
                        both[inside(g, PAPER[p][0]), inside(l_, PAPER[p][1])], f"{len(sel[0]['local'])} x {len(sel)}"])
    return out


def markdown(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + " --- |" * len(header), *("| " + " | ".join(r) + " |" for r in rows)])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-root", required=True, help="Fashion-MNIST's folder (Debian: /usr/share/datasets/fashion-mnist)")
    ap.add_argument("--ps", nargs="+", type=float, default=[0.3], help="majority-class fractions p (the paper's rows)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--only", default="", help="comma-separated factor names (default: all): " + ", ".join(FACTORS))
    ap.add_argument("--workers", type=int, default=2, help="parallel processes (one thread each)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--runs", type=Path, action="append", default=[], help="an earlier fedmoe_local_factors.json: its runs are "
                    "reused, only the missing (factor, p, seed) run (repeatable)")
    ap.add_argument("--report-only", action="store_true", help="run nothing: the table of the --runs files' runs")
    ap.add_argument("--conclusion", action="append", default=[], help="a paragraph after the table in the appendix (repeatable)")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(FACTORS)
    if unknown := [n for n in names if n not in FACTORS]:
        ap.error(f"unknown factor(s) {unknown}; the factors: {', '.join(FACTORS)}")
    if bad := [p for p in args.ps if p not in PAPER]:
        ap.error(f"p {bad} is not a row of the paper's table ({', '.join(map(str, PAPER))})")
    earlier = {}
    for path in args.runs:  # runs made before (this script's .json), one per (factor, p, seed)
        for r in json.loads(path.read_text())["runs"]:
            if r["factor"] in names and r["p"] in args.ps and r["seed"] in args.seeds:
                earlier[r["factor"], r["p"], r["seed"]] = r
    rows, have = list(earlier.values()), set(earlier)
    jobs = [] if args.report_only else [(n, p, s) for n in names for p in args.ps for s in args.seeds if (n, p, s) not in have]
    with ProcessPoolExecutor(args.workers) as pool:
        futures = [pool.submit(one, n, FACTORS[n][1], p, s, args.data_root) for n, p, s in jobs]
        for fut in tqdm(as_completed(futures), total=len(futures), desc="Local runs", unit="run", file=sys.stderr):
            rows.append(fut.result())
    rows.sort(key=lambda r: (list(FACTORS).index(r["factor"]), r["p"], r["seed"]))
    lead = ("The Local baseline of the federated mixture of experts on Fashion-MNIST (benchmarks/fedmoe_local_factors.py): the "
            "reproduction's setting with one factor changed per row, 20 clients, seeds " + ", ".join(map(str, args.seeds)) + "; "
            "accuracy in %, the mean over every client of every seed with its 95% interval; paper: Listo Zec et al., "
            "Table 1c (global) and 1d (local).")
    body = table_rows(rows, args.ps)
    print(lead + "\n\n" + markdown(HEADER, body))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fedmoe_local_factors.md").write_text("\n\n".join([lead, markdown(HEADER, body), *args.conclusion]) + "\n")
    (args.out / "fedmoe_local_factors.json").write_text(json.dumps({"harness": HARNESS, "factors": FACTORS, "runs": rows}, indent=1))
    appendix = {"title": "The p = 0.3 gap: Local, one factor at a time", "paragraphs": [lead], "header": HEADER, "rows": body,
                "after": args.conclusion}
    (args.out / "fedmoe_local_factors.appendix.json").write_text(json.dumps(appendix, indent=1))
    print(f"\nwrote {args.out}/fedmoe_local_factors.md, .json and .appendix.json (fedpipe reproduce ... --appendix)", file=sys.stderr)


if __name__ == "__main__":
    main()
