"""Accuracy against epsilon: SuPerFed-MM and FedAvg-FT on mnist5k with user-level differential privacy
(DP-FedAvg, the `privacy` section) at epsilon about 1, 4 and 8, against the same methods without privacy and
against Local (epsilon 0: it never uploads).

    nice -n 19 .venv/bin/python benchmarks/privacy.py                    # seeds 0 1 2, writes benchmarks/results/privacy.md
    .venv/bin/python benchmarks/privacy.py --seeds 0 --rounds 5          # a quick look
    nice -n 19 .venv/bin/python benchmarks/privacy.py --reuse-plain      # private rows only; the rows without privacy
                                                                         # (which no privacy change can move) from privacy.jsonl

Every run is a full fedpipe run (partition, every phase, evaluation) in its own process with one thread.
The private runs set privacy.target_epsilon with on_target=calibrate: the run calibrates noise_multiplier
before its first round so that all its planned private rounds (SuPerFed's two communicating phases,
FedAvg-FT's federation; fine-tuning releases nothing) spend at most that epsilon at the default delta
min(1e-5, 0.01/n), by Opacus's RDP accountant under Poisson sampling at rate train.client_fraction. The table reports
the epsilon each run actually spent (from its summary), the calibrated noise multiplier, the share of client
updates the clip cut (mean over rounds), and the personalized accuracy (mean over clients of each client's
own test split; mean and spread over seeds) and the global model's accuracy on the global test set.
The adaptive rows start the clip at --clip and let it follow the target quantile of the update norms (Andrew et al.
2021; the count of clients within the clip released centred, with its own noise, inside the same epsilon).

User-level DP needs many users: the noise on the mean update is sigma * clip / (q * n), so the setting uses
100 clients (mnist5k's 5,000 digits, 2 label shards each) with 20 sampled per round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

BASE = [
    "data.dataset=mnist5k",
    "partition.scheme=pathological",
    "partition.num_clients=100",
    "partition.shards_per_client=2",
    "model.name=twonn",
    "train.client_fraction=0.2",
    "train.local_epochs=2",
    "train.batch_size=10",
    "train.lr=0.05",
    "train.momentum=0.0",
    "eval.every=0",
    "telemetry.progress=false",
    "run.threads=1",
]
METHODS = {
    "superfed_mm": ["method.name=superfed_mm"],
    "fedavg_ft": ["method={name: fedavg_ft, finetune_epochs: 5}"],
    "local": ["method.name=local"],
}


def one_run(method: str, epsilon: float | None, seed: int, rounds: int, clip: float, store: str, adaptive: bool = False) -> dict:
    import torch

    torch.set_num_threads(1)
    from fedpipe.run.config import load_config
    from fedpipe.run.run import Run

    private = [] if epsilon is None else ["privacy.enabled=true", f"privacy.clip={clip}", "privacy.on_target=calibrate",
                                          f"privacy.target_epsilon={epsilon}", f"privacy.adaptive_clip={str(adaptive).lower()}"]
    tag = "none" if epsilon is None else f"eps{epsilon:g}" + ("-adaptive" if adaptive else "")
    cfg = load_config(None, [*BASE, *METHODS[method], *private, f"train.rounds={rounds}", f"run.seed={seed}",
                             f"run.store={store}", f"run.id={method}-{tag}-{seed}"])
    run = Run(cfg)
    t0 = time.perf_counter()
    summary = run.run_all()
    seconds = time.perf_counter() - t0
    clipped = []
    for phase in run.phases():
        key = run.layout.rounds(phase.name)
        if run.store.exists(key):
            for line in run.store.get_text(key).splitlines():
                extra = json.loads(line).get("extra", {})
                if "privacy_clipped_fraction" in extra:
                    clipped.append(extra["privacy_clipped_fraction"])
    p = summary.get("privacy") or {}
    glob = summary["global_model"]
    return {"method": method, "target": epsilon, "seed": seed, "seconds": seconds, "adaptive": adaptive,
            "final_clip": (p.get("adaptive_clip") or {}).get("final_clip"),
            "personalized": summary["personalized_accuracy"]["mean"], "global": glob["top1"] if glob else None,
            "epsilon": p.get("epsilon", 0.0 if method == "local" else None), "sigma": p.get("noise_multiplier"),
            "delta": p.get("delta"), "clipped": statistics.mean(clipped) if clipped else None}


def _mean_sd(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mean = statistics.mean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * mean:.1f} ± {100 * sd:.1f}"


def table(rows: list[dict], args, minutes: float, reused: int = 0) -> str:
    from fedpipe.engine.accounting import default_delta

    lines = [
        "# Accuracy against epsilon: user-level DP (DP-FedAvg) on mnist5k",
        "",
        f"Budget: {args.rounds} rounds, 100 clients (pathological, 2 shards each), 20% sampled per round (Poisson with privacy), "
        f"2 local epochs, batch 10, SGD lr 0.05 without momentum, the 784-200-200-10 MLP (twonn), seeds {' '.join(map(str, args.seeds))}; "
        f"clip {args.clip}; central DP; noise multiplier calibrated to each target epsilon over the planned private rounds "
        f"(privacy.on_target=calibrate), delta = min(1e-5, 0.01/100) = {default_delta(100):.2g} (the default), Opacus RDP accountant; "
        f"private runs standardise inputs with fixed constants (data.standardisation=auto). "
        f"{len(rows)} runs ({reused} without privacy reused from the last full run, which no privacy change moves), {minutes:.0f} "
        "minutes on a shared 2-core CPU (niced). Produced by `benchmarks/privacy.py`.",
        "",
        "Personalized: mean over clients of each client's personalized model on its own test split (mean ± sd over seeds). "
        "Global: the global model on the global test set. Epsilon spent: what the run's accountant reports at the end. "
        "Clipped: share of client updates longer than the clip (mean over rounds and seeds).",
        "",
        "| method | target epsilon | clip | noise multiplier | epsilon spent | clipped | personalized acc. (%) | global acc. (%) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    order = [(m, e, a) for m in ("superfed_mm", "fedavg_ft") for e, a in ((None, False), *((e, False) for e in args.epsilons),
                                                                          *((e, True) for e in args.adaptive_epsilons))]
    for method, eps, adaptive in order + [("local", None, False)]:
        group = [r for r in rows if r["method"] == method and r["target"] == eps and r.get("adaptive", False) == adaptive]
        if not group:
            continue
        finals = [r["final_clip"] for r in group if r.get("final_clip") is not None]
        clip = "-" if eps is None else (f"adaptive from {args.clip:g} (final {statistics.mean(finals):.2f})" if adaptive else f"{args.clip:g}")
        first = group[0]
        sigma = "-" if first["sigma"] is None else f"{first['sigma']:.3f}"
        spent = [r["epsilon"] for r in group if r["epsilon"] is not None]
        spent_text = ("0 (never uploads)" if method == "local" else "∞ (no DP)" if eps is None
                      else f"{statistics.mean(spent):.2f}")
        clipped = [r["clipped"] for r in group if r["clipped"] is not None]
        lines.append(f"| {method} | {'-' if eps is None else eps:} | {clip} | {sigma} | {spent_text} | "
                     f"{(f'{100 * statistics.mean(clipped):.0f}%' if clipped else '-')} | "
                     f"{_mean_sd([r['personalized'] for r in group])} | {_mean_sd([r['global'] for r in group])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 4.0, 8.0])
    ap.add_argument("--clip", type=float, default=0.5)  # near the median update norm (0.6-0.7 in the first rounds): Andrew et al. 2021
    ap.add_argument("--adaptive-epsilons", type=float, nargs="*", default=[4.0], help="targets also run with privacy.adaptive_clip")
    ap.add_argument("--reuse-plain", action="store_true", help="take the runs without privacy (and Local) from the --out's .jsonl")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "privacy.md")
    args = ap.parse_args()
    jobs = [(m, e, s, False) for s in args.seeds for m in ("superfed_mm", "fedavg_ft") for e in (None, *args.epsilons)]
    jobs += [(m, e, s, True) for s in args.seeds for m in ("superfed_mm", "fedavg_ft") for e in args.adaptive_epsilons]
    jobs += [("local", None, s, False) for s in args.seeds]
    rows = []
    if args.reuse_plain:  # privacy off: nothing the privacy code does reaches these runs
        earlier = [json.loads(line) for line in args.out.with_suffix(".jsonl").read_text().splitlines()]
        rows = [r for r in earlier if r["target"] is None and r["seed"] in args.seeds]
        jobs = [j for j in jobs if j[1] is not None]
    reused = len(rows)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as store, ProcessPoolExecutor(args.workers) as pool:
        futures = {pool.submit(one_run, m, e, s, args.rounds, args.clip, store, a): (m, e, s, a) for m, e, s, a in jobs}
        for f in as_completed(futures):
            row = f.result()
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    minutes = (time.perf_counter() - t0) / 60
    args.out.write_text(table(rows, args, minutes, reused))
    args.out.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(table(rows, args, minutes, reused))


if __name__ == "__main__":
    main()
