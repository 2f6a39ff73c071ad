"""Training throughput of the engine: one by one, batched (vmap) and 2-process distributed, side by side.

    .venv/bin/python benchmarks/throughput.py                      # the whole grid and the peer table (~20 min on 2 cores)
    .venv/bin/python benchmarks/throughput.py --models twonn --clients 10 --no-peers   # a quick look

Every cell is a real fedpipe FedAvg phase (Run: partition, train; the round's own clock, which covers
local training and aggregation, not evaluation or checkpoints), the first round a warm-up, the
later ones measured (3 rounds in the grid, 2 in the peer setting). Ways of training a round's clients:

  one-by-one   engine.clients=sequential, one process with all cores' threads
  batched      engine.clients=batched (torch.func.vmap over a stacked model, engine.chunk clients a step)
  2-process    engine.processes=2, one thread each (torch.distributed, gloo)

Grid: --models x --batch-sizes x --clients, each client holding --samples-per-client samples of
mnist5k drawn with replacement (partition `with_replacement`), 1 local epoch. The SuPerFed CIFAR
CNN needs 3x32x32 images and CIFAR-10 is not available offline: its rows train on mnist5k digits
padded to 32x32 and copied to 3 channels, written in CIFAR-10's on-disk format (speed does not
depend on what the pixels show).

Reported: training samples/s, seconds per round, achieved model GFLOP/s (FLOPs of one forward and
backward per sample counted with torch.utils.flop_counter, times samples/s) and its fraction of
this machine's float32 matmul peak (2048x2048, all threads, best of 5), measured in the same run.

The peer table repeats the peers' setting (docs/speed/index.md, "The peers' setting": mnist5k, 20 clients, pathological,
~200 training samples each, McMahan et al.'s CNN, batch 10, 5 local epochs, lr 0.01, every client
every round) for FedAvg and SuPerFed-MM Phase II, plus a bare PyTorch loop over the same data to
show how fast this machine is against the one the peers were measured on.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
WAYS = {
    "one-by-one": ["engine.clients=sequential", "engine.processes=1"],
    "batched": ["engine.clients=batched", "engine.processes=1"],
    "2-process": ["engine.clients=sequential", "engine.processes=2", "run.threads=1"],
}
PEERS = {  # the peers' setting (docs/speed/index.md), training samples/s on a 2-core machine of this kind
    "PFLlib FedAvg": 1820,
    "Flower 1.41, num-cpus 1 per client (best run)": 3130,
    "SuPerFed official Phase II, as shipped": 205,
    "SuPerFed official Phase II, anomaly detection off": 500,
}


def matmul_peak(threads: int) -> float:
    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(5):
            a @ b
        best = max(best, 5 * 2 * 2048**3 / (time.perf_counter() - t) / 1e9)
    return best


def flops_per_sample(model_name: str, shape: tuple[int, int, int], batch: int) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    from fedpipe.nn.networks import build_model

    model = build_model(model_name, shape, 10)
    x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.cross_entropy(model(x), y).backward()
    return counter.get_total_flops() / batch


def cifar_shaped_root(folder: Path) -> Path:
    """mnist5k digits padded to 32x32 and copied to 3 channels, in CIFAR-10's on-disk format."""
    sys.path.insert(0, str(ROOT / "tests"))
    from dataset_files import write_cifar10

    from fedpipe.data.datasets import DataConfig, load_dataset

    mnist = load_dataset(DataConfig(dataset="mnist5k")).train
    x = np.pad(mnist.x, ((0, 0), (0, 0), (2, 2), (2, 2))).repeat(3, axis=1)
    write_cifar10(folder, (x, mnist.y), (x[:500], mnist.y[:500]), [str(i) for i in range(10)])
    return folder


def measure(overrides: list[str], store: Path, phase: str = "federation") -> dict:
    """Partition and train one phase; the last round's samples/s and seconds."""
    from fedpipe.run.config import load_config
    from fedpipe.run.run import Run

    cfg = load_config(None, [*overrides, f"run.store={store}", "run.id=bench", "telemetry.progress=false", "eval.every=0"])
    run = Run(cfg)
    run.partition()
    for p in run.phases():  # a phase without rounds hands its input state on unchanged
        run.train(p.name)
        if p.name == phase:
            break
    lines = [json.loads(line) for line in (store / "bench" / "report" / f"rounds-{phase}.jsonl").read_text().splitlines()]
    timed = lines[1:] or lines  # the first round warms up
    seconds = sum(r["seconds"] for r in timed)
    samples = sum(r["samples_per_second"] * r["seconds"] for r in timed)
    return {"samples_per_second": samples / seconds, "seconds": seconds / len(timed)}


def bare_loop(threads: int, store: Path, overrides: list[str]) -> float:
    """A plain PyTorch loop (module, torch.optim.SGD, slices) over the peer setting's client data, 1 epoch each."""
    from fedpipe.data.federated import prepare_data
    from fedpipe.run.config import load_config
    from fedpipe.run.run import Run

    torch.set_num_threads(threads)
    run = Run(load_config(None, [*overrides, f"run.store={store}", "run.id=bare", "telemetry.progress=false"]))
    data = prepare_data(run.bundle, run.partition(), torch.device("cpu"))
    model = run.build_algorithm()[0].model
    seen, t0 = 0, time.perf_counter()
    for client in data.clients:
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
        x, y = client.train.x, client.train.y
        for i in range(0, len(y), 10):
            loss = torch.nn.functional.cross_entropy(model(x[i : i + 10]), y[i : i + 10])
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen += len(y[i : i + 10])
    return seen / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["twonn", "mcmahan_cnn", "superfed_cnn"], help="networks of the grid")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[10, 64], help="local mini-batch sizes")
    ap.add_argument("--clients", nargs="+", type=int, default=[10, 50, 100], help="clients per round")
    ap.add_argument("--ways", nargs="+", choices=list(WAYS), default=list(WAYS), help="ways of training a round's clients")
    ap.add_argument("--samples-per-client", type=int, default=64, help="training samples each client holds (grid)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="threads of the one-process ways (default: all)")
    ap.add_argument("--no-peers", action="store_true", help="skip the peer-comparison table")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="where throughput.md / .json go")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from tqdm import tqdm

    threads = args.threads
    peak = matmul_peak(threads)
    rows, peer_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cifar = cifar_shaped_root(tmp / "cifar") if "superfed_cnn" in args.models else None
        cells = [(m, b, k, w) for m in args.models for b in args.batch_sizes for k in args.clients for w in args.ways]
        for i, (model, batch, clients, way) in enumerate(tqdm(cells, desc="grid", unit="cell")):
            data = ["data.dataset=cifar10", f"data.root={cifar}", "data.download=false"] if model == "superfed_cnn" else ["data.dataset=mnist5k"]
            shape = (3, 32, 32) if model == "superfed_cnn" else (1, 28, 28)
            overrides = [
                *data, f"model.name={model}", "method.name=fedavg", "partition.scheme=with_replacement",
                f"partition.num_clients={clients}", f"partition.samples_per_client={round(args.samples_per_client / 0.7) + 1}",
                "partition.val_fraction=0.1", "partition.test_fraction=0.2", "train.rounds=3", "train.local_epochs=1",
                f"train.batch_size={batch}", "train.client_fraction=1", f"run.threads={threads}", *WAYS[way],
            ]
            torch.set_num_threads(threads)
            result = measure(overrides, tmp / f"cell{i}")
            gflops = result["samples_per_second"] * flops_per_sample(model, shape, batch) / 1e9
            rows.append({"model": model, "batch": batch, "clients": clients, "way": way, **result, "gflops": gflops, "of_peak": gflops / peak})

        write(args, rows, [], peak, threads)  # the grid is kept even if the peer runs fail
        if not args.no_peers:
            setting = ["data.dataset=mnist5k", "partition.scheme=pathological", "partition.num_clients=20", "partition.shards_per_client=2",
                       "partition.global_test_fraction=0.01", "partition.val_fraction=0", "partition.test_fraction=0.2",
                       "model.name=mcmahan_cnn", "train.batch_size=10", "train.local_epochs=5", "train.lr=0.01",
                       "train.client_fraction=1", "train.rounds=2", f"run.threads={threads}"]
            runs = [(f"FedAvg, {w}", ["method.name=fedavg", *WAYS[w]], "federation") for w in args.ways]
            runs += [(f"SuPerFed-MM Phase II, {w}", ["method.name=superfed_mm", "method.start_fraction=0", *WAYS[w]], "personalization") for w in args.ways]
            for i, (name, extra, phase) in enumerate(tqdm(runs, desc="peer setting", unit="run")):
                torch.set_num_threads(threads)
                result = measure([*setting, *extra], tmp / f"peer{i}", phase)
                peer_rows.append({"run": name, **result})
            torch.set_num_threads(threads)
            peer_rows.append({"run": f"bare PyTorch loop ({threads} threads, for scale)", "samples_per_second": bare_loop(threads, tmp / "bare", setting), "seconds": None})

    write(args, rows, peer_rows, peak, threads)


def _ratio(cells: dict, cell: tuple, way: str) -> str:
    base, other = cells.get((*cell, "one-by-one")), cells.get((*cell, way))
    return f"{other['samples_per_second'] / base['samples_per_second']:.2f}x" if base and other else "n/a"


def write(args, rows: list[dict], peer_rows: list[dict], peak: float, threads: int) -> None:
    import platform

    lines = [
        f"Training throughput: FedAvg phases through the engine, {args.samples_per_client} training samples per client, "
        f"1 local epoch, every client every round, rounds 2-3 of 3 measured (round 1 warms up). Machine: {platform.processor() or platform.machine()}, "
        f"one-process ways with {threads} threads; float32 matmul peak {peak:.0f} GFLOP/s ({threads} threads). "
        "Command: .venv/bin/python benchmarks/throughput.py " + " ".join(sys.argv[1:]),
        "",
        "| model | batch | clients | " + " | ".join(f"{w} samples/s | {w} s/round | {w} GFLOP/s (of peak)" for w in args.ways)
        + " | batched / one-by-one | 2-process / one-by-one |",
        "| --- | --- | --- | " + " | ".join("---: | ---: | ---:" for _ in args.ways) + " | ---: | ---: |",
    ]
    cells: dict[tuple, dict] = {(r["model"], r["batch"], r["clients"], r["way"]): r for r in rows}
    for model in args.models:
        for batch in args.batch_sizes:
            for clients in args.clients:
                parts = []
                for w in args.ways:
                    r = cells[(model, batch, clients, w)]
                    parts.append(f"{r['samples_per_second']:,.0f} | {r['seconds']:.2f} | {r['gflops']:.1f} ({r['of_peak']:.0%})")
                ratios = [_ratio(cells, (model, batch, clients), w) for w in ("batched", "2-process")]
                lines.append(f"| {model} | {batch} | {clients} | " + " | ".join(parts) + f" | {ratios[0]} | {ratios[1]} |")
    if peer_rows:
        lines += ["", "Peer setting (docs/speed/index.md, \"The peers' setting\"): mnist5k, 20 clients pathological, ~200 training samples each, "
                  "McMahan et al.'s CNN, batch 10, 5 local epochs, lr 0.01, every client every round.", "",
                  "| run | samples/s | s/round | vs PFLlib FedAvg (1,820) | vs Flower best (3,130) | vs SuPerFed official as shipped (205) | vs official, debug off (500) |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in peer_rows:
            sps = r["samples_per_second"]
            superfed = "SuPerFed" in r["run"]
            seconds = "" if r["seconds"] is None else f"{r['seconds']:.1f}"
            lines.append(
                f"| {r['run']} | {sps:,.0f} | {seconds} | "
                + (f" | | {sps / 205:.1f}x | {sps / 500:.1f}x |" if superfed else f"{sps / 1820:.2f}x | {sps / 3130:.2f}x | | |")
            )
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "throughput.md").write_text(text)
    (args.out / "throughput.json").write_text(json.dumps({"peak_gflops": peak, "threads": threads, "grid": rows, "peers": peer_rows}, indent=1))


if __name__ == "__main__":
    main()
