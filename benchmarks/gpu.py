"""The batched engine on a GPU beside its own step's bound: eager, bf16, CUDA graphs (issue 34).

    .venv/bin/python benchmarks/gpu.py                 # the whole table, under 8 minutes on one H100
    .venv/bin/python benchmarks/gpu.py --quick         # 20 and 1,000 clients only, fewer rounds
    .venv/bin/python benchmarks/gpu.py --device cpu --quick   # the same code paths on a CPU (slow; a smoke test)

Two parts, printed as markdown tables (and written to OUT/gpu.md, OUT/gpu.json):

1. **The step alone**: the vmapped SGD step of McMahan et al.'s CNN (batch 10 per client, K clients
   stacked), as `fedpipe.engine.batched` runs it: eager fp32, eager bf16 autocast, captured as a CUDA
   graph (fp32 and bf16), and the dense bound, one model trained on the same K x 10 samples as one
   batch. Samples per second, and each as a fraction of the bound.
2. **Whole runs** (fedpipe `Run`, mnist5k shared by the clients, 1 local epoch, samples/s over rounds
   2..R, the round's own clock): FedAvg at 20 clients (the peers' setting: pathological, batch 10,
   5 epochs), 1,000 and 10,000 clients of 64 samples; each with engine.clients sequential (20 only),
   batched, batched + bf16, batched + graphs, batched + bf16 + graphs. SuPerFed-MM Phase II at 1,000
   clients (states in memory): wall time of the run beside the rounds' own time.
   A run with graphs is checked against the same run without (global weights, max abs difference),
   so a capture that computed something else shows in the table.

Issue 34's targets on an H100-class GPU: batched >= 150k samples/s at 20 clients, >= 250k at 1,000.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_bound(device: torch.device, clients: int, steps: int) -> dict:
    """Samples/s of the vmapped step alone (eager, bf16, graphs) and of the dense bound."""
    from torch.func import functional_call, vmap

    from fedpipe.engine.batched import _sgd_step
    from fedpipe.nn.networks import McMahanCNN

    model = McMahanCNN((1, 28, 28), 10).to(device)
    names = [n for n, _ in model.named_parameters()]
    stacked = {n: p.detach().unsqueeze(0).repeat(clients, *[1] * p.dim()).clone().requires_grad_(True) for n, p in model.named_parameters()}
    bufs = {n: torch.zeros_like(t) for n, t in stacked.items()}
    x = torch.randn(clients, 10, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (clients, 10), device=device)

    def loss(params, xb, yb):
        return torch.nn.functional.cross_entropy(functional_call(model, params, (xb,)), yb)

    mapped = vmap(loss)

    def step(amp: bool) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            losses = mapped(stacked, x, y)
        grads = torch.autograd.grad(losses.sum(), [stacked[n] for n in names])
        with torch.no_grad():
            for n, g in zip(names, grads):
                _sgd_step(stacked[n], g, bufs[n], None, lr=0.01, momentum=0.9, weight_decay=1e-4)

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        _sync(device)
        return clients * 10 * steps / (time.perf_counter() - t0)

    out = {"clients": clients, "eager": timed(lambda: step(False)), "bf16": timed(lambda: step(True))}
    for amp in (False, True):
        key = "graph_bf16" if amp else "graph"
        if device.type != "cuda":
            out[key] = None
            continue
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step(amp)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(amp)
        out[key] = timed(graph.replay)
    dense = McMahanCNN((1, 28, 28), 10).to(device)
    opt = torch.optim.SGD(dense.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    xd, yd = x.reshape(-1, 1, 28, 28), y.reshape(-1)

    def dense_step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(dense(xd), yd).backward()
        opt.step()

    out["dense_bound"] = timed(dense_step)
    return out


def run_measure(overrides: list[str], store: Path, run_id: str) -> dict:
    """A whole run's training phases: samples/s over rounds 2..R, rounds' own seconds, wall seconds."""
    from fedpipe.run.config import load_config
    from fedpipe.run.run import Run

    cfg = load_config(None, [*overrides, f"run.store={store}", f"run.id={run_id}", "telemetry.progress=false", "eval.every=0"])
    run = Run(cfg)
    t0 = time.perf_counter()
    run.partition()
    state = None
    for phase in run.phases():
        state = run.train(phase.name)
    wall = time.perf_counter() - t0
    lines = [json.loads(line) for p in sorted((store / run_id / "report").glob("rounds-*.jsonl")) for line in p.read_text().splitlines()]
    timed = lines[1:] or lines
    seconds = sum(r["seconds"] for r in timed)
    samples = sum(r["samples_per_second"] * r["seconds"] for r in timed)
    return {"samples_per_second": samples / max(seconds, 1e-9), "rounds_seconds": sum(r["seconds"] for r in lines), "wall": wall,
            "weights": {k: v.detach().float().cpu() for k, v in state.server.global_params.items()}}


SETTINGS = {
    20: ["method.name=fedavg", "partition.scheme=pathological", "partition.num_clients=20", "model.name=mcmahan_cnn",
         "train.batch_size=10", "train.local_epochs=5", "train.client_fraction=1.0", "train.rounds=3"],
    1000: ["method.name=fedavg", "partition.scheme=with_replacement", "partition.num_clients=1000", "partition.samples_per_client=64",
           "model.name=mcmahan_cnn", "train.batch_size=10", "train.client_fraction=1.0", "train.rounds=3", "engine.chunk=250"],
    10000: ["method.name=fedavg", "partition.scheme=with_replacement", "partition.num_clients=10000", "partition.samples_per_client=64",
            "model.name=mcmahan_cnn", "train.batch_size=10", "train.client_fraction=1.0", "train.rounds=2", "engine.chunk=500"],
}
WAYS = {
    "sequential": ["engine.clients=sequential", "engine.amp=off"],
    "batched": ["engine.clients=batched", "engine.amp=off"],
    "batched+bf16": ["engine.clients=batched", "engine.amp=bf16"],
    "batched+graphs": ["engine.clients=batched", "engine.amp=off", "engine.graphs=on"],
    "batched+bf16+graphs": ["engine.clients=batched", "engine.amp=bf16", "engine.graphs=on"],
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="20 and 1,000 clients, step bound at K=20 and 250 only")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("No CUDA device here: run with --device cpu for a smoke test of the same paths.")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    t_start = time.perf_counter()
    ks = [20, 250] if args.quick else [20, 250, 1000]
    steps = [step_bound(device, k, 20 if device.type == "cuda" else 2) for k in ks]
    lines = [f"# The batched engine on {name} (`benchmarks/gpu.py{' --quick' if args.quick else ''}`), {time.strftime('%Y-%m-%d')}", "",
             "## The step alone (McMahan CNN, batch 10 per client), samples/s and fraction of the dense bound", "",
             "| K clients | eager | bf16 | graph | graph + bf16 | dense bound |", "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in steps:
        cell = lambda v, bound=r["dense_bound"]: "n/a" if v is None else f"{v:,.0f} ({v / bound:.2f})"  # noqa: E731
        lines.append(f"| {r['clients']:,} | {cell(r['eager'])} | {cell(r['bf16'])} | {cell(r['graph'])} | {cell(r['graph_bf16'])} | {r['dense_bound']:,.0f} |")
    print("\n".join(lines), file=sys.stderr)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp)
        for clients in ([20, 1000] if args.quick else [20, 1000, 10000]):
            ways = list(WAYS) if clients == 20 else [w for w in WAYS if w != "sequential"]
            base = None
            for way in ways:
                m = run_measure([*SETTINGS[clients], *WAYS[way], f"run.device={args.device}"], store, f"k{clients}-{way}")
                if way == "batched":
                    base = m["weights"]
                diff = None if base is None or "graphs" not in way or "bf16" in way else max(
                    float((m["weights"][k] - base[k]).abs().max()) for k in base)
                runs.append({"clients": clients, "way": way, "samples_per_second": m["samples_per_second"], "graph_vs_eager_max_abs": diff})
                print(f"  {clients:>6} clients {way:22s} {m['samples_per_second']:>10,.0f} samples/s", file=sys.stderr)
        sf = run_measure(["method.name=superfed_mm", "method.start_fraction=0.0", *SETTINGS[1000][1:], "engine.clients=batched",
                          "engine.state_memory_mb=8192", f"run.device={args.device}"], store, "superfed-1000")
    lines += ["", "## Whole runs, training samples/s over rounds 2..R", "",
              "| clients | way | samples/s | vs batched | graphs vs eager (max abs weight diff) |", "| ---: | --- | ---: | ---: | ---: |"]
    base_of = {r["clients"]: r["samples_per_second"] for r in runs if r["way"] == "batched"}
    for r in runs:
        diff = "" if r["graph_vs_eager_max_abs"] is None else f"{r['graph_vs_eager_max_abs']:.2e}"
        lines.append(f"| {r['clients']:,} | {r['way']} | {r['samples_per_second']:,.0f} | {r['samples_per_second'] / base_of[r['clients']]:.2f}x | {diff} |")
    lines += ["", f"SuPerFed-MM Phase II, 1,000 clients (states in memory): {sf['samples_per_second']:,.0f} samples/s; "
              f"wall {sf['wall']:.1f} s for rounds of {sf['rounds_seconds']:.1f} s in all (wall / rounds {sf['wall'] / max(sf['rounds_seconds'], 1e-9):.2f}).",
              "", f"Whole benchmark: {time.perf_counter() - t_start:.0f} s."]
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu.md").write_text(text)
    (args.out / "gpu.json").write_text(json.dumps({"device": name, "steps": steps, "runs": runs,
                                                   "superfed_1000": {k: v for k, v in sf.items() if k != "weights"}}, indent=2))
    print(text)


if __name__ == "__main__":
    main()
