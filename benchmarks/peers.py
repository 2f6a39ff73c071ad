"""fedpipe against the floor (a bare PyTorch loop) and a peer (Flower's simulation), side by side in one run.

    .venv/bin/python benchmarks/peers.py                 # the peers' setting: 5 local epochs, 2 interleaved repeats
                                                         # of 3 rounds (~15 min on 2 cores; `make bench-peers`)
    .venv/bin/python benchmarks/peers.py --quick         # 1 repeat, 2 rounds: a look in ~5 min
    .venv/bin/python benchmarks/peers.py --skip-flower   # no Flower virtualenv (nothing installed)
    .venv/bin/python benchmarks/peers.py --local-epochs 1 --repeats 3   # shorter rounds, more repeats

Every contender trains the same clients on the same data with the same network and optimiser:

  data       fedpipe's default split: mnist5k, pathological (2 label-sorted shards per client), 20 clients,
             fedpipe's default val/test fractions (140 training samples per client); the split is made once
             by fedpipe here and handed to the bare loop and Flower as a file (tensors and indices), and
             each fedpipe run's own partition manifest is checked against it.
  model      fedpipe's default network (superfed_cnn for 28x28 digits), built by
             fedpipe.nn.networks.build_model in every process, Flower's included (the module's source file is
             imported, not the fedpipe package with its dependencies).
  training   every client every round (client_fraction 1.0), --local-epochs local epochs (default 5, as the
             peers were measured), batch 10, SGD lr 0.01 (x0.999 per round), momentum 0.9, weight
             decay 1e-4 (fedpipe's defaults, which are also the peers' setting), a new shuffle every epoch,
             a new optimiser every round, FedAvg weighted by training samples.

Contenders:

  bare loop                 a plain nn.Module, torch.optim.SGD, a Python loop over the clients, FedAvg by hand,
                            in a fresh process of fedpipe's venv (torch's default threads: all cores);
                            also run with the Flower venv's torch, so a difference between the two torch builds
                            shows (fedpipe's venv has PyPI's CUDA build, the Flower venv the CPU wheel).
  Flower, N cpu/client      flwr[simulation] (Ray) in its own virtualenv (.cache/bench-flower/venv, made by this
                            script with python -m venv + pip; nothing of Flower is imported by fedpipe or its
                            venv): FedAvg, client_resources num_cpus N (1: two 1-thread actors on 2 cores; 2: one
                            2-thread actor), torch.set_num_threads(N) in the client as a careful user would.
  fedpipe <engine>          `fedpipe run` as a subprocess (the whole local Kubeflow pipeline), method fedavg,
                            engine.clients=sequential / batched / auto, and engine.processes=2.
  fedpipe SuPerFed-MM II    `fedpipe run`, method superfed_mm with method.start_fraction=0, so every round is
                            Phase II (personalization: a local and a global model mixed per mini-batch).

The measure is the same for all: training samples processed / wall time of the training rounds. A round's
time covers local training of all clients and the aggregation, not startup, evaluation or checkpoints (fedpipe:
the round records' `seconds`; bare loop: its own clock around each round; Flower: from the strategy's
configure_fit to the end of its aggregate_fit, so Ray's dispatch and the parameter transfers count, as they do
for fedpipe's 2 processes). Round 1 of every run is a warm-up and not counted in samples/s; its
seconds are shown apart (fedpipe's `auto` decides before round 1 from static facts, so its round 1 is the
chosen engine's round 1). Flower's figure from inside the clients' fit (samples / summed fit seconds x
parallel actors) is printed beside it as an upper bound of what Ray's overhead hides.

The contenders run round-robin (repeat 1 of every contender, then repeat 2, ...; the order rotates each repeat),
so a change in the machine's load hits them alike; medians over the repeats are reported, with min-max, the
load average before and after and the 1-minute load at the start of each contender's runs. On a shared 2-core
machine run-to-run noise reaches 30%: compare rows of one table, not across tables.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOWER_DIR = ROOT / ".cache" / "bench-flower"
FLOWER_PY = FLOWER_DIR / "venv" / "bin" / "python"
FEDPIPE = ROOT / ".venv" / "bin" / "fedpipe"
FEDPIPE_ENGINES = {  # contender -> fedpipe overrides
    "fedpipe FedAvg, sequential": ["method.name=fedavg", "engine.clients=sequential", "engine.processes=1"],
    "fedpipe FedAvg, batched": ["method.name=fedavg", "engine.clients=batched", "engine.processes=1"],
    "fedpipe FedAvg, 2 processes": ["method.name=fedavg", "engine.clients=sequential", "engine.processes=2"],
    "fedpipe FedAvg, auto": ["method.name=fedavg", "engine.clients=auto", "engine.processes=auto"],
    "fedpipe SuPerFed-MM Phase II, auto": [
        "method.name=superfed_mm",
        "method.start_fraction=0",
        "engine.clients=auto",
        "engine.processes=auto",
    ],
}
AUTO = "fedpipe FedAvg, auto"
SUPERFED = "fedpipe SuPerFed-MM Phase II, auto"
BARE = "bare PyTorch loop"
BARE_FLOWER_TORCH = "bare PyTorch loop, Flower venv's torch"


# --- the shared setting ---------------------------------------------------------------------------
def setting(args) -> list[str]:
    """fedpipe overrides every contender's setting is read from."""
    return [
        "data.dataset=mnist5k",
        "partition.scheme=pathological",
        f"partition.num_clients={args.clients}",
        f"model.name={args.model}",
        f"train.rounds={args.rounds}",
        f"train.local_epochs={args.local_epochs}",
        f"train.batch_size={args.batch_size}",
        "train.client_fraction=1.0",
        f"run.seed={args.seed}",
        "train.optimizer=sgd",
        "train.lr=0.01",
        "train.lr_decay=0.999",
        "train.momentum=0.9",
        "train.weight_decay=0.0001",
    ]


def export_clients(args, folder: Path) -> dict:
    """Make fedpipe's partition once and write every client's training tensors (and indices) for the others."""
    import numpy as np
    import torch

    from fedpipe.data.datasets import load_dataset
    from fedpipe.data.federated import prepare_data
    from fedpipe.data.partition.make import make_partition
    from fedpipe.run.config import load_config

    cfg = load_config(None, setting(args))
    bundle = load_dataset(cfg.data)
    partition = make_partition(bundle, cfg.partition, cfg.run.seed)
    data = prepare_data(bundle, partition, torch.device("cpu"))
    arrays = {}
    for k, c in enumerate(data.clients):
        arrays[f"x{k}"] = c.train.x.numpy()
        arrays[f"y{k}"] = c.train.y.numpy()
    np.savez(folder / "clients.npz", **arrays)
    indices = {str(c.id): [int(i) for i in c.train] for c in partition.clients}
    (folder / "indices.json").write_text(json.dumps(indices))
    meta = {
        "npz": str(folder / "clients.npz"),
        "clients": len(data.clients),
        "model": cfg.model_name(),
        "input_shape": list(data.input_shape),
        "num_classes": data.num_classes,
        "root": str(ROOT),
        "rounds": args.rounds,
        "local_epochs": args.local_epochs,
        "batch_size": args.batch_size,
        "lr": 0.01,
        "lr_decay": 0.999,
        "momentum": 0.9,
        "weight_decay": 1e-4,
        "seed": args.seed,
        "train_samples": [len(c.train) for c in data.clients],
    }
    (folder / "meta.json").write_text(json.dumps(meta))
    return {"meta": meta, "indices": indices}


# --- (a) the bare loop: runs in a fresh process of either venv (stdlib, torch, numpy, fedpipe's network file) ---
def bare_worker(meta_path: str, out_path: str) -> None:
    import numpy as np
    import torch

    meta = json.loads(Path(meta_path).read_text())
    sys.path.insert(0, meta["root"])
    from fedpipe.nn.networks import build_model

    torch.manual_seed(meta["seed"])
    model = build_model(meta["model"], tuple(meta["input_shape"]), meta["num_classes"])
    arrays = np.load(meta["npz"])
    clients = [(torch.from_numpy(arrays[f"x{k}"]), torch.from_numpy(arrays[f"y{k}"])) for k in range(meta["clients"])]
    g = torch.Generator().manual_seed(meta["seed"])
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    rounds, b = [], meta["batch_size"]
    for r in range(meta["rounds"]):
        lr = meta["lr"] * meta["lr_decay"] ** r
        t0, seen = time.perf_counter(), 0
        total = {k: torch.zeros_like(v) for k, v in global_state.items()}
        weight = 0
        for x, y in clients:
            model.load_state_dict(global_state)
            opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=meta["momentum"], weight_decay=meta["weight_decay"])
            for _ in range(meta["local_epochs"]):
                perm = torch.randperm(len(y), generator=g)
                for i in range(0, len(y), b):
                    idx = perm[i : i + b]
                    loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    seen += len(idx)
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    total[k] += v * len(y)
            weight += len(y)
        global_state = {k: v / weight for k, v in total.items()}
        rounds.append({"seconds": time.perf_counter() - t0, "samples": seen})
    Path(out_path).write_text(json.dumps({"rounds": rounds, "threads": torch.get_num_threads(), "torch": torch.__version__}))


# --- (b) Flower: a ServerApp/ClientApp pair written to .cache and run by the Flower venv's python ------------
FLOWER_APP = '''\
"""Generated by benchmarks/peers.py: Flower FedAvg simulation of the benchmark's clients (run by its own venv)."""
import json, os, sys, time
from pathlib import Path

import numpy as np
import torch

META = json.loads(Path(sys.argv[1]).read_text())
OUT, CPUS = Path(sys.argv[2]), int(sys.argv[3])
sys.path.insert(0, META["root"])
from fedpipe.nn.networks import build_model  # the same module as fedpipe's (its source file only)

from flwr.client import ClientApp, NumPyClient
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.simulation import run_simulation

_cache = {}


def _model():
    if "model" not in _cache:
        torch.set_num_threads(CPUS)
        torch.manual_seed(META["seed"])
        _cache["model"] = build_model(META["model"], tuple(META["input_shape"]), META["num_classes"])
        arrays = np.load(META["npz"])
        _cache["data"] = [(torch.from_numpy(arrays[f"x{k}"]), torch.from_numpy(arrays[f"y{k}"])) for k in range(META["clients"])]
    return _cache["model"], _cache["data"]


class Client(NumPyClient):
    def __init__(self, cid):
        self.cid = cid

    def fit(self, parameters, config):
        t0 = time.perf_counter()
        model, data = _model()
        keys = list(model.state_dict())
        model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in zip(keys, parameters)})
        x, y = data[self.cid]
        g = torch.Generator().manual_seed(META["seed"] * 100003 + int(config["round"]) * 1009 + self.cid)
        opt = torch.optim.SGD(model.parameters(), lr=float(config["lr"]), momentum=META["momentum"], weight_decay=META["weight_decay"])
        seen, b = 0, META["batch_size"]
        for _ in range(META["local_epochs"]):
            perm = torch.randperm(len(y), generator=g)
            for i in range(0, len(y), b):
                idx = perm[i : i + b]
                loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                seen += len(idx)
        out = [v.detach().cpu().numpy().copy() for v in model.state_dict().values()]
        return out, len(y), {"fit_seconds": time.perf_counter() - t0, "samples": seen}


def client_fn(context):
    return Client(int(context.node_config["partition-id"])).to_client()


class TimedFedAvg(FedAvg):
    def configure_fit(self, server_round, parameters, client_manager):
        self._t0 = time.perf_counter()
        return super().configure_fit(server_round, parameters, client_manager)

    def aggregate_fit(self, server_round, results, failures):
        aggregated = super().aggregate_fit(server_round, results, failures)
        wall = time.perf_counter() - self._t0
        row = {"round": server_round, "seconds": wall, "clients": len(results), "failures": len(failures),
               "samples": sum(int(r.metrics["samples"]) for _, r in results),
               "fit_seconds": sum(float(r.metrics["fit_seconds"]) for _, r in results)}
        with OUT.open("a") as f:
            f.write(json.dumps(row) + "\\n")
        return aggregated


def server_fn(context):
    model = build_model(META["model"], tuple(META["input_shape"]), META["num_classes"])
    n = META["clients"]
    strategy = TimedFedAvg(
        fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=n, min_evaluate_clients=0, min_available_clients=n,
        on_fit_config_fn=lambda r: {"round": r, "lr": META["lr"] * META["lr_decay"] ** (r - 1)},
        initial_parameters=ndarrays_to_parameters([v.numpy() for v in model.state_dict().values()]),
    )
    return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=META["rounds"]))


if __name__ == "__main__":
    OUT.write_text("")
    run_simulation(
        server_app=ServerApp(server_fn=server_fn), client_app=ClientApp(client_fn=client_fn), num_supernodes=META["clients"],
        backend_config={"client_resources": {"num_cpus": CPUS, "num_gpus": 0.0}, "init_args": {"num_cpus": os.cpu_count()}},
    )
'''


def flower_venv(torch_version: str, flwr_version: str) -> None:
    """Make the Flower virtualenv once (python -m venv + pip: flwr[simulation] and the same torch version)."""
    marker = FLOWER_DIR / f"ready-flwr{flwr_version}-torch{torch_version}"
    if marker.exists():
        return
    FLOWER_DIR.mkdir(parents=True, exist_ok=True)
    print(
        f"Making Flower's virtualenv in {FLOWER_DIR / 'venv'} (flwr[simulation]=={flwr_version}, torch=={torch_version}; a few minutes once) ...",
        flush=True,
    )
    if not FLOWER_PY.exists():
        subprocess.run([sys.executable, "-m", "venv", str(FLOWER_DIR / "venv")], check=True)
    subprocess.run(
        [str(FLOWER_PY), "-m", "pip", "install", "-q", f"torch=={torch_version}", f"flwr[simulation]=={flwr_version}"], check=True
    )
    marker.write_text("")


TIMEOUT = 900  # seconds a contender's run may take (--timeout)


def call(cmd: list[str], log: Path, **kw) -> int:
    """Run `cmd` in its own process group with output to `log`; on timeout end that group (Ray's actors included)."""
    import signal

    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, **kw)
        try:
            return proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                time.sleep(3)
            proc.wait()
            raise RuntimeError(f"timed out after {TIMEOUT} s (--timeout); see {log}") from None


# --- running the contenders -----------------------------------------------------------------------
def measured(rounds: list[dict]) -> dict:
    """samples/s over rounds 2.. (round 1 warms up), as the sum of samples over the sum of seconds."""
    timed = rounds[1:] or rounds
    seconds = sum(r["seconds"] for r in timed)
    samples = sum(r["samples"] for r in timed)
    return {
        "samples_per_second": samples / seconds,
        "round_seconds": seconds / len(timed),
        "rounds_counted": len(timed),
        "round1_seconds": rounds[0]["seconds"],
    }


def run_bare(python: Path, work: Path, tag: str) -> dict:
    out = work / f"{tag}.json"
    log = work / f"{tag}.log"
    if call([str(python), str(Path(__file__).resolve()), "--bare-worker", str(work / "meta.json"), str(out)], log) != 0:
        raise RuntimeError(f"the bare loop failed; see {log}")
    result = json.loads(out.read_text())
    return {**measured(result["rounds"]), "note": f"{result['threads']} threads, torch {result['torch']}"}


def run_flower(cpus: int, work: Path, tag: str, ncpu: int) -> dict:
    out = work / f"{tag}.jsonl"
    log = work / f"{tag}.log"
    env = {**os.environ, "RAY_DEDUP_LOGS": "0", "PYTHONWARNINGS": "ignore"}
    rc = call([str(FLOWER_PY), str(work / "flower_app.py"), str(work / "meta.json"), str(out), str(cpus)], log, env=env, cwd=work)
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    if rc != 0 or not rows:
        raise RuntimeError(f"Flower exited {rc}; see {log}:\n" + "\n".join(log.read_text().splitlines()[-15:]))
    result = measured(rows)
    timed = rows[1:] or rows
    actors = max(1, ncpu // cpus)
    inside = sum(r["samples"] for r in timed) / (sum(r["fit_seconds"] for r in timed) / actors)
    return {
        **result,
        "inside_fit": inside,
        "note": f"{actors} actor(s) x {cpus} thread(s); inside the clients' fit: {inside:,.0f}/s",
    }


def run_fedpipe(name: str, args, work: Path, tag: str, indices: dict) -> dict:
    store = work / "store"
    run_id = tag
    cmd = [
        str(FEDPIPE),
        "run",
        *[a for o in [*setting(args), *FEDPIPE_ENGINES[name]] for a in ("--set", o)],
        "--set",
        f"run.store={store}",
        "--set",
        f"run.id={run_id}",
        "--set",
        "telemetry.progress=false",
        "--set",
        "eval.every=0",
    ]
    log = work / f"{tag}.log"
    rc = call(cmd, log, cwd=ROOT)
    phase = "personalization" if "SuPerFed" in name else "federation"
    jsonl = store / run_id / "report" / f"rounds-{phase}.jsonl"
    if not jsonl.exists():
        raise RuntimeError(f"fedpipe exited {rc} without {jsonl}; see {log}:\n" + "\n".join(log.read_text().splitlines()[-15:]))
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    rows = [{"seconds": r["seconds"], "samples": r["samples_per_second"] * r["seconds"]} for r in rows]
    manifest = store / run_id / "partition" / "manifest.json"
    same = None
    if manifest.exists():  # the run's own split must be the one the bare loop and Flower trained on
        tree = json.loads(manifest.read_text())
        same = {str(c["id"]): [int(i) for i in c["indices"]["train"]] for c in tree["clients"]} == indices
    if same is False:
        raise RuntimeError(f"{manifest}: fedpipe's partition differs from the one handed to the other contenders")
    note = "" if rc == 0 else f"fedpipe exited {rc} after training (see log)"
    if "auto" in name:
        chose = [ln.strip() for ln in log.read_text().splitlines() if ": clients trained " in ln]
        note = (note + "; " if note else "") + (chose[-1][chose[-1].index("clients trained"):] if chose else "")
    shutil.rmtree(store / run_id, ignore_errors=True)
    return {**measured(rows), "note": note, "split_checked": same}


def main() -> None:
    global TIMEOUT
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--repeats", type=int, default=2, help="runs of every contender, interleaved round-robin (default 2; medians reported)"
    )
    ap.add_argument(
        "--rounds", type=int, default=3, help="federated rounds per run; round 1 is a warm-up, the rest are measured (default 3)"
    )
    ap.add_argument("--local-epochs", type=int, default=5, help="local epochs per round (default 5, the peers' setting)")
    ap.add_argument("--batch-size", type=int, default=10, help="local mini-batch size (default 10, the papers')")
    ap.add_argument("--clients", type=int, default=20, help="clients (all train every round; default 20, fedpipe's default)")
    ap.add_argument("--model", default="auto", help="fedpipe model.name (default auto: superfed_cnn for mnist5k)")
    ap.add_argument("--seed", type=int, default=0, help="run.seed: the split, initial weights and shuffles")
    ap.add_argument("--quick", action="store_true", help="1 repeat of 2 rounds (round 2 measured): a first look, noisier")
    ap.add_argument("--skip-flower", action="store_true", help="leave Flower out (no virtualenv is made)")
    ap.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        help="run only the contenders whose name contains one of these words (e.g. bare auto)",
    )
    ap.add_argument("--flwr-version", default="1.42.0", help="flwr[simulation] version for Flower's virtualenv (default 1.42.0)")
    ap.add_argument("--out", type=Path, help="also write the markdown table here (e.g. benchmarks/results/peers.md)")
    ap.add_argument(
        "--timeout",
        type=int,
        default=TIMEOUT,
        help=f"seconds one run of a contender may take before it is ended (default {TIMEOUT})",
    )
    ap.add_argument(
        "--torch-control",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run the bare loop with the Flower venv's torch build (default: off; a control for a doubt about the two builds)",
    )
    ap.add_argument(
        "--keep", action="store_true", help="keep the work folder (logs, the clients file, Flower's app) and print where it is"
    )
    ap.add_argument("--bare-worker", nargs=2, metavar=("META", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.bare_worker:
        return bare_worker(*args.bare_worker)
    if args.quick:
        args.repeats, args.rounds = 1, 2
    if args.torch_control is None:
        args.torch_control = False

    TIMEOUT = args.timeout
    if args.rounds < 2:
        ap.error("--rounds must be at least 2: round 1 is a warm-up")

    import torch  # fedpipe's venv; Flower's torch must be the same version

    ncpu = os.cpu_count() or 1
    torch_version = torch.__version__.split("+")[0]
    load_before = os.getloadavg()
    started = dt.datetime.now()
    work = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    contenders: list[tuple[str, callable]] = []
    exported = export_clients(args, work)
    meta = exported["meta"]
    contenders.append((BARE, lambda tag: run_bare(Path(sys.executable), work, tag)))
    if not args.skip_flower:
        flower_venv(torch_version, args.flwr_version)
        (work / "flower_app.py").write_text(FLOWER_APP)
        if args.torch_control:
            contenders.append((BARE_FLOWER_TORCH, lambda tag: run_bare(FLOWER_PY, work, tag)))
        for cpus in sorted({1, ncpu}):
            contenders.append((f"Flower FedAvg, num_cpus {cpus} per client", lambda tag, c=cpus: run_flower(c, work, tag, ncpu)))
    for name in FEDPIPE_ENGINES:
        contenders.append((name, lambda tag, n=name: run_fedpipe(n, args, work, tag, exported["indices"])))
    if args.only:
        contenders = [c for c in contenders if any(w.lower() in c[0].lower() for w in args.only)]

    results: dict[str, list[dict]] = {name: [] for name, _ in contenders}
    errors: dict[str, str] = {}
    print(
        f"{len(contenders)} contenders x {args.repeats} repeats, {args.rounds} rounds of {meta['clients']} clients, "
        f"{args.local_epochs} local epoch(s); load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, {ncpu} CPUs; work in {work}",
        flush=True,
    )
    for rep in range(args.repeats):
        order = contenders[rep % len(contenders) :] + contenders[: rep % len(contenders)]
        for name, fn in order:
            tag = f"r{rep}-" + "".join(ch if ch.isalnum() else "_" for ch in name)
            load1 = os.getloadavg()[0]
            t = time.perf_counter()
            try:
                r = fn(tag)
            except Exception as e:  # one contender failing must not lose the others
                errors[name] = str(e)
                print(f"  repeat {rep + 1}: {name}: FAILED: {str(e).splitlines()[0]}", flush=True)
                continue
            r.update(load1=load1, wall=time.perf_counter() - t)
            results[name].append(r)
            print(
                f"  repeat {rep + 1}: {name}: {r['samples_per_second']:,.0f} samples/s, {r['round_seconds']:.2f} s/round "
                f"(load {load1:.2f}, {r['wall']:.0f} s in all) {r.get('note') or ''}",
                flush=True,
            )
    load_after = os.getloadavg()
    text = table(args, meta, results, errors, load_before, load_after, ncpu, started)
    print("\n" + text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"Wrote {args.out}")
    if args.keep:
        print(f"Work folder kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


def table(args, meta, results, errors, load_before, load_after, ncpu, started) -> str:
    med = {n: statistics.median(r["samples_per_second"] for r in rs) for n, rs in results.items() if rs}
    bare = med.get(BARE)
    flowers = {n: v for n, v in med.items() if n.startswith("Flower")}
    flower_best = max(flowers.values()) if flowers else None
    flower_name = max(flowers, key=flowers.get) if flowers else None
    samples = sum(meta["train_samples"]) * args.local_epochs
    cmd = ".venv/bin/python benchmarks/peers.py " + " ".join(sys.argv[1:])
    lines = [
        f"# fedpipe beside a bare PyTorch loop and Flower ({started:%Y-%m-%d %H:%M})",
        "",
        f"Command: `{cmd.strip()}`{' (--quick: 1 repeat, 2 rounds; noisier than the default)' if args.quick else ''}. "
        f"Machine: {platform.machine()} {platform.processor() or ''}, {ncpu} CPUs, Python {platform.python_version()}; "
        f"load average (1/5/15 min) before {load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f}, "
        f"after {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f}.",
        "",
        f"Setting: mnist5k, pathological, {meta['clients']} clients (fedpipe's default split: {min(meta['train_samples'])}-"
        f"{max(meta['train_samples'])} training samples each), model {meta['model']} (fedpipe.nn.networks.build_model in every "
        f"contender), all clients every round, {args.local_epochs} local epoch(s), batch {args.batch_size}, SGD lr 0.01 "
        f"(x0.999 per round), momentum 0.9, weight decay 1e-4, FedAvg. {args.rounds} rounds per run, round 1 a warm-up, "
        f"rounds 2-{args.rounds} measured ({samples:,} training samples a round); {args.repeats} run(s) per contender, "
        "interleaved round-robin. samples/s = training samples / wall time of the training rounds (local training and "
        "aggregation; not startup, not evaluation).",
        "",
        "| contender | samples/s (median) | min-max | s/round | round 1 s | vs bare loop | vs Flower best | runs | load at start (median) | note |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, rs in results.items():
        if not rs:
            lines.append(
                f"| {name} | failed | | | | | | 0 | | {errors.get(name, '').splitlines()[0][:150] if errors.get(name) else ''} |"
            )
            continue
        sps = [r["samples_per_second"] for r in rs]
        m = med[name]
        note = next((r["note"] for r in reversed(rs) if r.get("note")), "").replace("|", "/")
        vs_bare = f"{m / bare:.2f}x" if bare else ""
        vs_flower = f"{m / flower_best:.2f}x" if flower_best else ""
        lines.append(
            f"| {name} | {m:,.0f} | {min(sps):,.0f}-{max(sps):,.0f} | {statistics.median(r['round_seconds'] for r in rs):.2f} | "
            f"{statistics.median(r.get('round1_seconds', float('nan')) for r in rs):.2f} | {vs_bare} | {vs_flower} | {len(rs)} | {statistics.median(r['load1'] for r in rs):.2f} | {note} |"
        )
    lines.append("")
    if flower_best:
        lines.append(f"Flower's best configuration here: {flower_name} ({flower_best:,.0f} samples/s, round wall time).")
    if AUTO in med and SUPERFED in med:
        lines.append(
            f"SuPerFed-MM Phase II / FedAvg (both fedpipe, engine auto, same run): {med[SUPERFED]:,.0f} / {med[AUTO]:,.0f} = "
            f"{med[SUPERFED] / med[AUTO]:.2f}x (Phase II trains a local and a global model on every mini-batch)."
        )
    if AUTO in med and flower_best:
        lines.append(f"fedpipe auto / Flower best: {med[AUTO] / flower_best:.2f}x.")
    if errors:
        lines += ["", "Failures: " + "; ".join(f"{n}: {e.splitlines()[0][:200]}" for n, e in errors.items())]
    lines += [
        "",
        "Every run:",
        "",
        "| contender | repeat | samples/s | s/round | load at start | wall s (with startup) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, rs in results.items():
        for i, r in enumerate(rs):
            lines.append(
                f"| {name} | {i + 1} | {r['samples_per_second']:,.0f} | {r['round_seconds']:.2f} | {r['load1']:.2f} | {r['wall']:.0f} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
