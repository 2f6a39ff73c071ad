"""bf16 autocast against fp32, method by method: is bf16's accuracy within the noise of fp32's?

    .venv/bin/python benchmarks/amp.py                                  # every method, 3 seeds
    .venv/bin/python benchmarks/amp.py --methods fedavg superfed_mm --seeds 0 1

Each (method, seed) runs twice, `engine.amp=off` and `engine.amp=bf16`, same seed (same partition,
initialisation and sampling), through `benchmarks/accuracy.py`'s runner: a full fedpipe run in its own
process. On a CPU bf16 is PyTorch's CPU autocast (slower than fp32, but the same arithmetic as on a GPU:
bf16 matmuls and convolutions, fp32 master weights, optimizer state and aggregation). The table gives
the personalized accuracy under each, the paired difference (bf16 - fp32) and a verdict from a paired
t-test over seeds (scipy): "within noise" (p >= 0.05), "under 1 point" (significant but smaller than one
point), else "bf16 worse" / "bf16 better"; "fp32 anyway" where every seed gave the very same numbers (a
method whose custom per-batch update runs outside autocast). A method worse beyond noise is the evidence
for its `Algorithm.bf16_refusal` (`fedpipe methods` lists them).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy import one_run  # noqa: E402  (the same runner, so the two benchmarks agree)

AMPS = ("off", "bf16")


def verdict(diffs: list[float]) -> str:
    from scipy import stats

    if all(d == 0 for d in diffs):
        return "fp32 anyway"
    mean = float(np.mean(diffs))
    if len(diffs) < 2 or np.std(diffs) == 0 or stats.ttest_1samp(diffs, 0.0).pvalue >= 0.05:
        return "within noise"
    if abs(mean) < 0.01:
        return "under 1 point"
    return "bf16 worse" if mean < 0 else "bf16 better"


def table(rows: list[dict], methods: list[str]) -> str:
    lines = ["| method | fp32 personalized | bf16 personalized | bf16 - fp32 (points) | verdict | seconds fp32 / bf16 |",
             "| --- | ---: | ---: | ---: | --- | ---: |"]
    for m in methods:
        by = {(r["seed"], r["amp"]): r for r in rows if r["method"] == m}
        seeds = sorted({s for s, a in by if all((s, x) in by for x in AMPS)})
        if not seeds:
            lines.append(f"| {m} | n/a | n/a | n/a | failed | |")
            continue
        a = [by[s, "off"]["personalized"] for s in seeds]
        b = [by[s, "bf16"]["personalized"] for s in seeds]
        d = [y - x for x, y in zip(a, b)]
        secs = [np.mean([by[s, x]["seconds"] for s in seeds]) for x in AMPS]
        lines.append(f"| {m} | {100 * np.mean(a):.2f} ± {100 * np.std(a):.2f} | {100 * np.mean(b):.2f} ± {100 * np.std(b):.2f} | "
                     f"{100 * np.mean(d):+.2f} ± {100 * np.std(d):.2f} | {verdict(d)} | {secs[0]:.0f} / {secs[1]:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from fedpipe.algorithms import ALGORITHMS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS), metavar="METHOD")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--split", default="dirichlet", choices=["dirichlet", "pathological"])
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", default="lenet5", help="lenet5 (convolutions and matmuls in bf16) or twonn (the MLP)")
    ap.add_argument("--workers", type=int, default=2, help="parallel processes (one thread each)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for amp.md and amp.json")
    args = ap.parse_args(argv)
    common = ["data.dataset=mnist5k", f"partition.num_clients={args.clients}", f"model.name={args.model}",
              f"train.rounds={args.rounds}", "train.local_epochs=1", "eval.every=0", "engine.clients=sequential"]
    jobs = [(m, s, amp) for m in args.methods for s in args.seeds for amp in AMPS]
    rows, failed = [], []
    with tempfile.TemporaryDirectory() as store, ProcessPoolExecutor(args.workers) as pool:
        # a store per amp: the engine is not part of a run's identity, so one store would resume the other's run
        futures = {pool.submit(one_run, m, args.split, s, [*common, f"engine.amp={amp}"], f"{store}/{amp}"): (m, s, amp)
                   for m, s, amp in jobs}
        for fut in tqdm(as_completed(futures), total=len(futures), desc="runs", unit="run", file=sys.stderr):
            m, s, amp = futures[fut]
            try:
                rows.append({**fut.result(), "amp": amp})
            except Exception as exc:  # one broken run must not throw away the others
                failed.append(f"{m} seed {s} amp {amp}: {type(exc).__name__}: {exc}")
    text = (f"bf16 autocast vs fp32 (engine.amp=bf16 vs off), mnist5k {args.split}, {args.clients} clients, model {args.model}, "
            f"{args.rounds} rounds x 1 local epoch, one by one, seeds {args.seeds}; personalized accuracy in % (mean ± std over "
            f"seeds), paired difference per seed\n\n" + table(rows, args.methods))
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "amp.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": rows}, indent=2))
    (args.out / "amp.md").write_text(text + "\n")
    if failed:
        sys.exit("these runs failed, the table leaves them out:\n" + "\n".join(failed))


if __name__ == "__main__":
    main()
