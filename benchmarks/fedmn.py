"""FedMN against FedAvg-FT (personalized accuracy) and FedAvg (upload bytes per round) on mnist5k with
mixed label and feature skew, over seeds, and what FedMN's architecture clusters look like.

    .venv/bin/python benchmarks/fedmn.py                          # examples/fedmn_mnist5k.yaml, seeds 0 1 2
    .venv/bin/python benchmarks/fedmn.py --seeds 0 --rounds 5     # a quick look

The setting is examples/fedmn_mnist5k.yaml: Dirichlet(0.5) labels over 20 clients, half of them
seeing rotated (90 degrees) or inverted digits; FedMN's pool has LeNet-5 encoders and widths
(120, 84), so each of its paths is the LeNet-5 that FedAvg trains. Per seed, two full fedpipe runs
(partition, every phase, evaluation; each in its own process with one thread), on the same
partition:

- `fedmn` with `finetune_epochs` local epochs of fine-tuning after the federation. Its federation
  phase is exactly a plain fedmn run (the fine-tuning phase comes after it and changes nothing
  before it), so its last federation round gives FedMN's personalized accuracy and upload bytes,
  and its summary FedMN + fine-tuning: the same local fine-tuning FedAvg-FT gets.
- `fedavg_ft`: likewise its federation phase is exactly FedAvg (same model, config and seed), which
  gives FedAvg's personalized accuracy (the global model on each client's test split) and upload
  bytes, and its summary FedAvg-FT.

Upload bytes are what the engine counts (payload_bytes of what each client sends), per round,
averaged over rounds and seeds. Clusters: at the last round, the clients grouped by identical
architecture (FedMN's kept decision), each cluster's make-up by feature shift, the adjusted Rand
index between the clusters and the three feature-shift groups (1: the clusters are exactly the
groups; about 0: unrelated), and which encoders each group's clients use.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fedmn_mnist5k.yaml"


def one_run(method: str, seed: int, overrides: list[str], finetune_epochs: int, store: str) -> dict:
    import torch

    torch.set_num_threads(1)
    from fedpipe.run.config import load_config
    from fedpipe.run.run import Run

    method_override = (["method.name=fedmn", f"method.finetune_epochs={finetune_epochs}"] if method == "fedmn"
                       else [f"method={{name: fedavg_ft, finetune_epochs: {finetune_epochs}}}"])
    cfg = load_config(EXAMPLE, [*overrides, *method_override, f"run.seed={seed}", f"run.store={store}",
                                f"run.id={method}-{seed}", "telemetry.progress=false", "run.threads=1"])
    run = Run(cfg)
    t0 = time.perf_counter()
    summary = run.run_all()
    seconds = time.perf_counter() - t0
    rows = [json.loads(line) for line in run.store.get_text(run.layout.rounds("federation")).splitlines()]
    transforms = {str(c.id): c.transform or "none" for c in run.load_partition().clients}
    algorithm, _ = run.build_algorithm()
    pool_bytes = sum(t.numel() * t.element_size() for t in getattr(algorithm, "inner", algorithm).initial.values()) \
        if method == "fedmn" else None
    return {
        "method": method, "seed": seed, "seconds": seconds,
        "federation_personalized": rows[-1]["personalized_accuracy"],
        "finetuned_personalized": summary["personalized_accuracy"]["mean"],
        "bytes_uploaded_per_round": [r["bytes_uploaded"] for r in rows],
        "clients_per_round": [r["clients"] for r in rows],
        "architectures_per_round": [len(set(r["details"]["architecture"].values())) for r in rows] if method == "fedmn" else None,
        "last_details": rows[-1]["details"] if method == "fedmn" else None,
        "transforms": transforms,
        "pool_bytes": pool_bytes,
    }


def pct(values: list[float]) -> str:
    return f"{100 * np.mean(values):.2f} ± {100 * np.std(values):.2f}"


def mb(x: float) -> str:
    return f"{x / 1e6:.2f} MB"


def accuracy_table(runs: list[dict]) -> str:
    avg = [r for r in runs if r["method"] == "fedavg_ft"]
    mn = [r for r in runs if r["method"] == "fedmn"]
    fedavg_up = float(np.mean([b for r in avg for b in r["bytes_uploaded_per_round"]]))
    fedmn_up = float(np.mean([b for r in mn for b in r["bytes_uploaded_per_round"]]))
    clients = mn[0]["clients_per_round"][0]
    full = clients * mn[0]["pool_bytes"]
    lines = [
        "| method | personalized accuracy (%) | upload per round | per client | vs FedAvg |",
        "| --- | --- | --- | --- | --- |",
        f"| FedAvg (LeNet-5) | {pct([r['federation_personalized'] for r in avg])} | {mb(fedavg_up)} | {fedavg_up / clients / 1e3:.1f} kB | 1.00x |",
        f"| FedAvg-FT | {pct([r['finetuned_personalized'] for r in avg])} | {mb(fedavg_up)} (fine-tuning sends nothing) | | 1.00x |",
        f"| FedMN | {pct([r['federation_personalized'] for r in mn])} | {mb(fedmn_up)} | {fedmn_up / clients / 1e3:.1f} kB | {fedmn_up / fedavg_up:.2f}x |",
        f"| FedMN + FT | {pct([r['finetuned_personalized'] for r in mn])} | {mb(fedmn_up)} | | {fedmn_up / fedavg_up:.2f}x |",
        "",
        f"FedMN's whole pool and router, if every client sent all of it: {mb(full)} per round "
        f"({full / fedavg_up:.2f}x FedAvg); FedMN sent {100 * fedmn_up / full:.0f}% of that.",
    ]
    return "\n".join(lines)


def cluster_report(runs: list[dict]) -> str:
    from sklearn.metrics import adjusted_rand_score

    out = []
    for r in sorted((r for r in runs if r["method"] == "fedmn"), key=lambda r: r["seed"]):
        d, tf = r["last_details"], r["transforms"]
        arch = d["architecture"]
        cids = sorted(arch, key=int)
        ari = adjusted_rand_score([tf[c] for c in cids], [arch[c] for c in cids])
        per_round = r["architectures_per_round"]
        out.append(f"seed {r['seed']}: {len(d['clusters'])} architectures among {len(cids)} clients at the last round "
                   f"(distinct architectures per round: first {per_round[0]}, middle {per_round[len(per_round) // 2]}, "
                   f"last {per_round[-1]}); adjusted Rand index with the feature-shift groups: {ari:.2f}")
        for cl in d["clusters"]:
            mix = Counter(tf[str(c)] for c in cl["clients"])
            out.append(f"  {cl['architecture']}  units {' '.join(cl['units'])}: clients {cl['clients']} -> "
                       + ", ".join(f"{k} {v}" for k, v in sorted(mix.items())))
        groups = sorted(set(tf.values()))
        encoders = sorted({u for cl in d["clusters"] for u in cl["units"] if u.startswith("L1.")})
        unit_of = {str(c): cl["units"] for cl in d["clusters"] for c in cl["clients"]}
        use = []
        for g in groups:
            members = [c for c in cids if tf[c] == g]
            use.append(f"{g} ({len(members)}): " + " ".join(f"{e} {sum(e in unit_of[c] for c in members)}" for e in encoders))
        out.append("  encoders used, by feature-shift group: " + "; ".join(use))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=None, help="override train.rounds of the example (40)")
    ap.add_argument("--finetune-epochs", type=int, default=5, help="local fine-tuning epochs of FedAvg-FT and FedMN + FT")
    ap.add_argument("--set", action="append", default=[], help="extra config override for every run (repeatable)")
    ap.add_argument("--workers", type=int, default=2, help="parallel processes (one thread each)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for fedmn.json and fedmn.md")
    args = ap.parse_args(argv)

    overrides = [*([f"train.rounds={args.rounds}"] if args.rounds else []), "eval.every=0", *args.set]
    jobs = [(m, s) for s in args.seeds for m in ("fedmn", "fedavg_ft")]
    runs = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as store, ProcessPoolExecutor(args.workers) as pool:
        futures = [pool.submit(one_run, m, s, overrides, args.finetune_epochs, store) for m, s in jobs]
        for fut in as_completed(futures):
            r = fut.result()
            runs.append(r)
            print(f"  {r['method']} seed {r['seed']}: {r['seconds']:.0f} s", file=sys.stderr)
    from fedpipe.run.config import load_config

    cfg = load_config(EXAMPLE, overrides)
    text = (
        f"mnist5k, {cfg.partition.num_clients} clients, Dirichlet({cfg.partition.alpha}) labels + feature shift "
        f"{list(cfg.partition.feature_shift)} on {cfg.partition.feature_shift_fraction:.0%} of the clients; "
        f"{cfg.train.rounds} rounds x {cfg.train.local_epochs} local epoch(s), fine-tuning {args.finetune_epochs} epochs; "
        f"seeds {args.seeds}; accuracy: mean ± std over seeds; bytes: mean over rounds and seeds "
        f"({time.perf_counter() - t0:.0f} s wall)\n\n"
        + accuracy_table(runs) + "\n\nFedMN's architecture clusters at the last round:\n\n" + cluster_report(runs)
    )
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fedmn.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": runs}, indent=2))
    (args.out / "fedmn.md").write_text(text + "\n")
    print(f"\nwrote {args.out / 'fedmn.md'} and {args.out / 'fedmn.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
