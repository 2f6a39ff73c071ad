"""What the transport costs: per round wall time and bytes for the simulation, fedpipe's loopback federation and
Flower's own FedAvg app, on the same model, data and sites, with and without SecAgg+.

    .venv/bin/python benchmarks/federation.py --quick          # 4 sites, 2 rounds, no SecAgg+ (a few minutes)
    .venv/bin/python benchmarks/federation.py                  # 4 and 16 sites, 3 rounds, with and without SecAgg+
    .venv/bin/python benchmarks/federation.py --sites 4 --only federation,flower --work /tmp/fb   # keep the logs
    .venv/bin/python benchmarks/federation.py --methods all --rounds 3   # every method at 4 sites: federation vs simulation

The same config everywhere: FedAvg, the 2NN (784-200-200-10, `model.name=twonn`), mnist5k split `pathological`
into one client per site, every site every round, 1 local epoch, batch 20, SGD as fedpipe's defaults (lr 0.01,
momentum 0.9, weight decay 1e-4), seed 0, one torch thread per process, clients trained one after another.

- **simulation**: fedpipe's in-process run (`fedpipe.run.run.Run`); per round `seconds`, `bytes_uploaded` and
  `bytes_downloaded` from the run's report/rounds-federation.jsonl (`fedpipe.engine.rounds.RoundResult`).
  No transport: the bytes are what the method would send (the tensors' bytes).
- **federation**: fedpipe's ServerApp and ClientApp on Flower 1.42's deployment engine, on 127.0.0.1 with TLS and
  SuperNode authentication (`fedpipe.federation.tryout.LoopbackFederation`, one site per folder written by `prepare`:
  fedpipe's warm worker and its SuperNode in process isolation); per round from the ServerApp's rounds.jsonl (bytes:
  the ArrayRecords' data); where the round's seconds go, from the sites' own logs (`round_profile`).
- **flower**: Flower's own FedAvg app (benchmarks/flower_fedavg/: `flwr.serverapp.strategy.FedAvg`, and for SecAgg+
  `DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))` with `secaggplus_mod` at the sites) training the same
  model with the same hyperparameters on the same site folders, submitted with `flwr run` to a SuperLink with Flower's
  own SuperNodes (subprocess isolation: fedpipe's sites run no other app); its ServerApp counts every message: array bytes (comparable with fedpipe's) and message bytes
  (the content as serialised protobuf, SecAgg+'s keys, shares and masked vectors included).

A round's wall time: from the round's first message to its aggregate (the simulation: training and aggregation
only). The first round is shown apart: in a federation it includes the ClientApps' first FAB install and, in the
simulation, torch's warm-up; in Flower 1.42's subprocess isolation (Flower's app here) every round starts a fresh
ClientApp process per site and message, so every round pays a Python + torch start at each site (SecAgg+: 4 exchanges
a round, so 4 starts per site); fedpipe's warm worker pays it once. Runs go one after another on one machine: the sites share its cores, so a round's
time is the sites' work summed over the cores, not one site's. Results go to OUT/federation.md and OUT/federation.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOWER_APP = ROOT / "benchmarks" / "flower_fedavg"
SYSTEMS = ("simulation", "federation", "flower")
BASE = ["method.name=fedavg", "data.dataset=mnist5k", "partition.scheme=pathological", "model.name=twonn",
        "train.local_epochs=1", "train.batch_size=20", "train.client_fraction=1.0", "engine.clients=sequential",
        "run.threads=1", "run.seed=0", "telemetry.progress=false", "eval.every=0"]
SECAGG = "federation.secure_aggregation.enabled=true"
NOTES = (
    "up / down MB/round: array bytes (the tensors' data) over all sites. `up per site / model`: one site's upload over "
    "the model's size (FedAvg: 1.000; the .001 is NumPy's header on each array).",
    "SecAgg+: a site uploads its masked vector, integers mod 2^32 held as int64, twice the float32 model. Flower's app "
    "sends it inside a ConfigRecord, so its array bytes up are 0 and its ratio comes from its message bytes.",
    "message MB/round: every message's serialised content (SecAgg+: keys, shares and masked vectors too, over its 4 "
    "exchanges a round). Flower's app: the content as protobuf; fedpipe with SecAgg+: its own count "
    "(rounds.jsonl `secure_aggregation`, metadata included); fedpipe without SecAgg+ counts arrays only.",
    "run s: the whole run; for the federations from submission to result, with the site census, the ServerApp's start "
    "and (fedpipe) the evaluation at the sites.",
    "SuperLink in / out: Flower's own count of the run's bytes through the SuperLink (`flwr ls`), every message of the "
    "run (fedpipe's census and evaluation at the sites included).",
    "train loss: the sites' mean training loss in the last round; the simulation and fedpipe's federation train alike, "
    "so theirs agree; Flower's app shuffles with its own seeds.",
    "fedpipe's sites are its warm workers (fedpipe.federation.worker: one process per site, torch and the site's splits "
    "loaded once, its SuperNode in process isolation); Flower's app runs on Flower's own SuperNodes in their default "
    "subprocess isolation, a new ClientApp process per site and message. The sites share the machine's cores, so a "
    "round's time grows with the number of sites.",
)

#: the same benchmark before the warm worker (2026-11-28, main at b859b60: fedpipe's app on Flower's subprocess
#: isolation, a ClientApp process per site and message, Flower's 3 s pull waits), kept beside the new rows
BEFORE = """
## Before the warm worker (2026-11-28, `benchmarks/federation.py --rounds 2`, same machine kind)

| system | sites | SecAgg+ | first round s | median later round s | run s |
| --- | ---: | --- | ---: | ---: | ---: |
| federation | 4 | off | 26.57 | 26.44 | 104.3 |
| flower | 4 | off | 26.44 | 26.78 | 68.8 |
| federation | 4 | on | 82.36 | 79.97 | 204.7 |
| flower | 4 | on | 73.17 | 66.69 | 149.0 |
| federation | 16 | off | 77.22 | 78.69 | 296.0 |
| flower | 16 | off | 65.75 | 70.33 | 146.6 |
| federation | 16 | on | 202.22 | 183.49 | 484.0 |
| flower | 16 | on | 153.98 | 168.40 | 326.9 |
"""


def targets(rows: list[dict]) -> str:
    """The issue's targets, read off this run: fedpipe's median round at 4 and 16 sites, its ratio to Flower's own app,
    and SecAgg+'s round over the plain round."""
    med = {(r["system"], r["sites"], r["secagg"]): r.get("median_later_s") for r in rows}
    lines = ["## Read off this run", ""]
    for sites in sorted({r["sites"] for r in rows}):
        fed, flower, sec = med.get(("federation", sites, False)), med.get(("flower", sites, False)), med.get(("federation", sites, True))
        if fed:
            line = f"- {sites} sites: fedpipe's median round {fed:.2f} s"
            if flower:
                line += f"; Flower's own FedAvg app {flower:.2f} s ({flower / fed:.1f} times fedpipe's)"
            if sec:
                line += f"; with SecAgg+ {sec:.2f} s ({sec / fed:.1f} times the plain round)"
            lines.append(line)
    return "\n".join(lines) + "\n\n"


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def config(sites: int, rounds: int, store: Path, secagg: bool = False):
    from fedpipe.run.config import load_config

    extra = [SECAGG] if secagg else []
    return load_config(None, [*BASE, f"partition.num_clients={sites}", f"train.rounds={rounds}", f"run.store={store}",
                              f"run.id=bench-{sites}", *extra])


# --- the three systems -----------------------------------------------------------------------------------
def run_simulation(cfg) -> list[dict]:
    import torch

    from fedpipe.run.run import Run

    torch.set_num_threads(1)
    run = Run(cfg)
    run.partition()
    for phase in run.phases():
        run.train(phase.name)
    log = Path(cfg.run.store) / cfg.run_id() / "report" / "rounds-federation.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [{"round": r["round"], "seconds": r["seconds"], "bytes_up": r["bytes_uploaded"], "bytes_down": r["bytes_downloaded"],
             "loss": r["train_loss"]} for r in rows]


def fedpipe_secagg_missing() -> str | None:
    """Why fedpipe's federation would not run SecAgg+ (None: it uses it). The config field exists before the
    federation does anything with it, so a run with the flag would silently be plain FedAvg: look for Flower's
    SecAgg+ in fedpipe's ServerApp/ClientApp code instead of trusting the flag."""
    code = "".join(p.read_text() for p in (ROOT / "fedpipe" / "federation").glob("*.py"))
    if "SecAggPlus" in code or "secaggplus" in code:
        return None
    return "fedpipe/federation/ does not use SecAgg+ yet (federation.secure_aggregation.enabled is not wired)"


def fresh(folder: Path) -> Path:
    """An empty output folder: fedpipe's ServerApp would resume from a checkpoint left there, both apps append."""
    shutil.rmtree(folder, ignore_errors=True)
    return folder


def run_federation(fed, spec_file: Path, out: Path, timeout: float, secagg: bool = False, folders: list[Path] = ()) -> list[dict]:
    fed.run(spec_file, out, timeout=timeout)
    rows = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines() if line.strip()]
    PROFILES[(len(folders), secagg)] = round_profile(rows, folders, out)
    if any(r.get("failed") for r in rows):
        raise RuntimeError(f"failed sites in rounds.jsonl: {[r.get('rejected') for r in rows if r.get('failed')]}")
    if secagg and not all("secure_aggregation" in r for r in rows):
        raise RuntimeError("rounds.jsonl does not report SecAgg+ (no secure_aggregation field): not counted as a SecAgg+ run")
    found = []
    for r in rows:
        found.append({"round": r["round"], "seconds": r["seconds"], "bytes_up": r["bytes_up"], "bytes_down": r["bytes_down"],
                      "loss": r["loss"]})
        if "secure_aggregation" in r:  # fedpipe's own count of the 4 exchanges' messages (fedpipe/federation/secagg.py)
            found[-1].update(message_bytes_up=r["secure_aggregation"]["bytes_up"], message_bytes_down=r["secure_aggregation"]["bytes_down"])
    return found


PROFILES: dict[tuple[int, bool], dict] = {}


def round_profile(rows: list[dict], folders: list[Path], out: Path) -> dict:
    """Where a federated round's seconds go (the rounds after the first), from the server's rounds.jsonl and each site's
    own log (messages.jsonl, fedpipe.federation.site_log: the worker times its pull of the message from its SuperNode,
    its answer and its push): medians over rounds and sites."""
    from fedpipe.federation import site_log

    later = {r["round"] for r in rows[1:]}
    entries = [e for f in folders for e in site_log.read(f)
               if e.get("run") == str(out.resolve()) and e.get("kind") == "train" and e.get("round") in later]
    if not entries:
        return {}
    med = lambda key: statistics.median(float(e.get(key, 0.0)) for e in entries)  # noqa: E731
    rounds = statistics.median(r["seconds"] for r in rows[1:])
    per_round = {}  # the slowest site of each round bounds it
    for e in entries:
        per_round[e["round"]] = max(per_round.get(e["round"], 0.0), float(e["seconds"]))
    slowest = statistics.median(per_round.values())
    return {"round_s": rounds, "pull_s": med("pull_s"), "answer_s": med("answer_s"), "push_s": med("push_s"),
            "site_s": med("seconds"), "slowest_site_s": slowest, "rest_s": max(rounds - slowest, 0.0)}


def cold_start(env: Path) -> float:
    """What every message paid at every site in Flower's subprocess isolation before fedpipe's warm worker: a new
    Python process importing torch and fedpipe's ClientApp (the median of 3 starts; the FAB install comes on top)."""
    import subprocess

    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run([str(env / "bin" / "python"), "-c", "import torch, fedpipe.federation.client_app"], check=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def profile_table(env: Path) -> str:
    if not PROFILES:
        return ""
    lines = ["## Where a round's seconds go (fedpipe's federation, the rounds after the first, medians)", "",
             "| sites | SecAgg+ | round s | a site's pull of its message s | its ClientApp (checks, training, packing) s | "
             "its push s | the slowest site s | the rest s |", "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for (sites, secagg), p in sorted(PROFILES.items()):
        if p:
            lines.append(f"| {sites} | {'on' if secagg else 'off'} | {p['round_s']:.2f} | {p['pull_s']:.3f} | {p['answer_s']:.3f} | "
                         f"{p['push_s']:.3f} | {p['slowest_site_s']:.2f} | {p['rest_s']:.2f} |")
    lines += ["", "The rest: the SuperNodes' pulls from and pushes to the SuperLink (a SuperNode pulls again 50 ms after a message, then a quarter longer each time up to 1 s, "
              "fedpipe.federation.supernode; Flower's own waits 3 s), the server's pulls for replies (every 0.05 s, Flower's "
              "`send_and_receive` 3 s), the aggregation and the checkpoint; with SecAgg+ also its other three exchanges. "
              "The sites share the machine's 2 cores, so the slowest site waits for the others' training.", "",
              f"Before the warm worker every message also paid a new ClientApp process: Python, torch and fedpipe's ClientApp "
              f"imported in {cold_start(env):.2f} s here (median of 3), before the FAB's install and the site's splits read again."]
    return "\n".join(lines) + "\n"


def toml_value(v) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else json.dumps(v) if isinstance(v, str) else repr(v)


def flower_config(cfg, spec, out: Path, secagg: bool, timeout: float) -> dict:
    """Flower's app's run config, from fedpipe's config of the same run: the same work per round."""
    t, s = cfg.train, cfg.federation.secure_aggregation
    if t.optimizer != "sgd":
        raise ValueError(f"Flower's app trains with SGD only, not {t.optimizer}")
    size = 1
    for d in spec.input_shape:
        size *= int(d)
    return {"num-rounds": t.rounds, "num-sites": spec.num_sites, "num-classes": spec.num_classes, "input-size": size,
            "local-epochs": t.local_epochs, "batch-size": t.batch_size, "lr": float(t.lr), "lr-decay": float(t.lr_decay),
            "momentum": float(t.momentum), "weight-decay": float(t.weight_decay), "seed": cfg.run.seed, "timeout": float(timeout),
            "secagg": secagg, "num-shares": float(s.num_shares), "reconstruction-threshold": float(s.reconstruction_threshold),
            "clipping-range": float(s.clipping_range), "quantization-range": int(s.quantization_range),
            "max-weight": float(s.max_weight), "out-dir": str(out.resolve())}


def run_flower(fed, run_config: dict, out: Path, timeout: float) -> list[dict]:
    from fedpipe.federation.tryout import CONNECTION

    overrides = " ".join(f"{k}={toml_value(v)}" for k, v in run_config.items())
    r = fed._cli("run", str(FLOWER_APP), CONNECTION, "--run-config", overrides, "--format", "json")
    if r.returncode != 0:
        raise RuntimeError(f"flwr run {FLOWER_APP.name} failed ({r.returncode}): {r.stdout.strip()} {r.stderr.strip()}")
    fed.wait(out, timeout)  # result.json, or RuntimeError with error.json
    rows = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines() if line.strip()]
    if any(r["failed"] or r["clients"] != run_config["num-sites"] for r in rows):
        raise RuntimeError(f"rounds without every site: {[(r['round'], r['clients'], r['failed']) for r in rows]}")
    return rows


def wait_idle(fed, timeout: float = 120) -> dict:
    """Wait until the SuperLink has no run pending or running, so that one run's ending does not overlap the next's
    rounds (the ServerApp writes result.json before its process ends); returns the latest run's `flwr ls` entry
    (its `network-traffic`: the SuperLink's own count of the run's bytes in and out), {} if unreadable."""
    deadline = time.monotonic() + timeout
    runs: list[dict] = []
    while time.monotonic() < deadline:
        r = fed._cli("ls", "--format", "json")
        try:
            runs = json.loads(r.stdout).get("runs", [])
        except (json.JSONDecodeError, AttributeError):
            return {}  # an `flwr ls` we cannot read: go on rather than hang
        if not any(str(x.get("status", "")).split(":")[0] in ("pending", "starting", "running") for x in runs):
            break
        time.sleep(1.0)
    return max(runs, key=lambda x: str(x.get("pending-at", "")), default={})


# --- one site count --------------------------------------------------------------------------------------
def bench_sites(sites: int, rounds: int, only: set[str], secagg_modes: list[bool], work: Path, env: Path,
                timeout: float) -> list[dict]:
    from fedpipe.federation.spec import FederationSpec
    from fedpipe.federation.tryout import LoopbackFederation, prepare

    rows: list[dict] = []
    cfg = config(sites, rounds, fresh(work / "store"))

    def record(system: str, secagg: bool, fn, fed=None) -> None:
        say(f"{sites} sites, {system}, SecAgg+ {'on' if secagg else 'off'}: running")
        t0 = time.perf_counter()
        try:
            found = fn()
            note = ""
        except Exception as e:  # a row that cannot be measured says why; the benchmark goes on
            found, note = [], f"not available: {first_line(e)}"
            say(f"  {note}")
        wall = time.perf_counter() - t0
        rows.append(summarize(system, sites, secagg, found, wall, note))
        if fed is not None:
            traffic = wait_idle(fed).get("network-traffic", {})  # also after a failure: no overlap with the next run
            rows[-1]["superlink"] = traffic if found else {}
        if found:
            say(f"  {len(found)} rounds, {[round(r['seconds'], 1) for r in found]} s, run {wall:.1f} s")

    if "simulation" in only:
        record("simulation", False, lambda: run_simulation(cfg))
        if True in secagg_modes:
            rows.append(summarize("simulation", sites, True, [], 0.0,
                                  "not applicable: SecAgg+ is a federation's (the simulation's server holds every update)"))
    if not only & {"federation", "flower"}:
        return rows
    say(f"{sites} sites: preparing the site folders")
    spec_file, folders = prepare(cfg, work)
    spec = FederationSpec.read(str(spec_file))
    for system in [s for s in ("federation", "flower") if s in only]:
        # fedpipe's sites are its warm workers, which run fedpipe's own app only; Flower's app runs on Flower's own
        # SuperNodes in their default subprocess isolation (a ClientApp process per message), as Flower ships them
        say(f"{sites} sites: starting a SuperLink and {sites} sites ({'fedpipe workers' if system == 'federation' else 'Flower SuperNodes'})")
        with LoopbackFederation(work / system, env, server_root=work) as fed:
            for folder in folders:
                fed.start_site(folder, worker=system == "federation")
            for secagg in secagg_modes:
                _bench_system(system, secagg, fed, cfg, spec, spec_file, sites, rounds, work, timeout, record, folders)
    return rows


def _bench_system(system, secagg, fed, cfg, spec, spec_file, sites, rounds, work, timeout, record, folders) -> None:
    """One row: `system` (fedpipe's federation or Flower's app) on the sites of `fed`, with or without SecAgg+."""
    from fedpipe.federation.spec import FederationSpec

    tag = "secagg" if secagg else "plain"
    if system == "flower":
        out = fresh(work / f"out-flower-{tag}")
        rc = flower_config(cfg, spec, out, secagg, timeout)
        record("flower", secagg, lambda: run_flower(fed, rc, out, timeout), fed)
        return

    def federation():
        if not secagg:
            return run_federation(fed, spec_file, fresh(work / f"out-federation-{tag}"), timeout, folders=folders)
        if why := fedpipe_secagg_missing():
            raise NotImplementedError(why)
        sec_cfg = config(sites, rounds, work / "store", secagg=True)
        sec_spec = work / "spec-secagg.json"
        sec_spec.write_text(FederationSpec.from_run_config(sec_cfg, spec.input_shape, spec.num_classes, spec.num_sites).to_json())
        return run_federation(fed, sec_spec, fresh(work / f"out-federation-{tag}"), timeout, secagg=True, folders=folders)

    record("federation", secagg, federation, fed)


def summarize(system: str, sites: int, secagg: bool, found: list[dict], wall: float, note: str) -> dict:
    row = {"system": system, "sites": sites, "secagg": secagg, "note": note, "rounds": found, "run_seconds": wall}
    if found:
        secs = [r["seconds"] for r in found]
        row.update(first_round_s=secs[0], median_later_s=statistics.median(secs[1:]) if len(secs) > 1 else None,
                   last_loss=found[-1].get("loss"))
        for key in ("bytes_up", "bytes_down", "message_bytes_up", "message_bytes_down"):
            if key in found[0]:
                row[f"{key}_per_round"] = statistics.mean(r[key] for r in found)
                row[f"{key}_total"] = sum(r[key] for r in found)
    return row


# --- output ----------------------------------------------------------------------------------------------
def mb(v) -> str:
    return "–" if v is None else f"{v / 1e6:.2f}"


def table(rows: list[dict], model_bytes: int) -> str:
    lines = ["| system | sites | SecAgg+ | first round s | median later round s | run s | up MB/round | down MB/round | "
             "up per site / model | message up MB/round | message down MB/round | total up MB | total down MB | "
             "SuperLink in / out MB (run) | train loss, last round | note |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        if not r["rounds"]:
            lines.append(f"| {r['system']} | {r['sites']} | {'on' if r['secagg'] else 'off'} |" + " – |" * 12 + f" {r['note']} |")
            continue
        later = r["median_later_s"]
        loss = "–" if r.get("last_loss") is None else f"{r['last_loss']:.4f}"
        ratio = f"{r['bytes_up_per_round'] / (r['sites'] * model_bytes):.3f}"
        if not r["bytes_up_per_round"] and r.get("message_bytes_up_per_round"):  # Flower's SecAgg+: no ArrayRecord up
            ratio = f"{r['message_bytes_up_per_round'] / (r['sites'] * model_bytes):.3f} (messages)"
        link = r.get("superlink") or {}
        link = f"{mb(link['inbound-bytes'])} / {mb(link['outbound-bytes'])}" if "inbound-bytes" in link else "–"
        lines.append(
            f"| {r['system']} | {r['sites']} | {'on' if r['secagg'] else 'off'} | {r['first_round_s']:.2f} | "
            f"{'–' if later is None else f'{later:.2f}'} | {r['run_seconds']:.1f} | {mb(r['bytes_up_per_round'])} | "
            f"{mb(r['bytes_down_per_round'])} | {ratio} | {mb(r.get('message_bytes_up_per_round'))} | "
            f"{mb(r.get('message_bytes_down_per_round'))} | {mb(r['bytes_up_total'])} | {mb(r['bytes_down_total'])} | {link} | {loss} | {r['note']} |")
    return "\n".join(lines)


def machine(env: Path) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = ""
    try:
        kb = int(next(ln.split()[1] for ln in open("/proc/meminfo") if ln.startswith("MemTotal")))
        mem = f", {kb / 2**20:.0f} GiB memory"
    except (OSError, StopIteration):
        pass
    versions = []
    for pkg in ("flwr", "torch"):
        found = sorted((env / "lib").glob(f"python3*/site-packages/{pkg}-*.dist-info"))
        if found:
            versions.append(found[-1].name.removesuffix(".dist-info").replace("-", " ", 1))
    return (f"{cpu}, {os.cpu_count()} cores{mem}, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}; Flower environment: {', '.join(versions)}")


def model_size(spec_input: tuple[int, ...] = (1, 28, 28), classes: int = 10, hidden: int = 200) -> int:
    n = 1
    for d in spec_input:
        n *= d
    return 4 * (n * hidden + hidden + hidden * hidden + hidden + hidden * classes + classes)  # float32


# --- every method over one federation ------------------------------------------------------------------------
#: what the per-method table changes from a method's defaults, to keep its run short (said under the table)
METHOD_SETS = {"fedmoe": ["method.max_epochs=5"]}


def bench_methods(methods: list[str], sites: int, rounds: int, work: Path, env: Path, timeout: float) -> list[dict]:
    """Each method once simulated and once over one loopback federation (fedpipe's warm sites, the same partition and
    seed): per round seconds (median of the rounds after the first), MB up and down per round (array bytes over all
    sites, the communicating rounds), and the final personalized accuracy (mean over the sites, each on its own test
    split) in both."""
    from fedpipe.federation.spec import FederationSpec
    from fedpipe.federation.tryout import LoopbackFederation, prepare
    from fedpipe.run.config import load_config
    from fedpipe.run.run import Run

    def method_config(m: str):
        return load_config(None, [*BASE, f"method.name={m}", *METHOD_SETS.get(m, []), f"partition.num_clients={sites}",
                                  f"train.rounds={rounds}", f"run.store={work / 'store'}", f"run.id=methods-{m}"])

    spec_file, folders = prepare(method_config(methods[0]), fresh(work / "sites"))
    shape = FederationSpec.read(str(spec_file))
    rows = []
    with LoopbackFederation(work / "fed", env, server_root=work) as fed:
        for folder in folders:
            fed.start_site(folder)
        for m in methods:
            say(f"{m}: simulation, then {sites} sites")
            cfg = method_config(m)
            t0 = time.perf_counter()
            run = Run(cfg)
            run.partition()
            for phase in run.phases():
                run.train(phase.name)
            simulated = run.evaluate()
            sim_rounds = [json.loads(line) for phase in run.phases()
                          for line in (Path(cfg.run.store) / cfg.run_id() / "report" / f"rounds-{phase.name}.jsonl").read_text().splitlines()]
            t1 = time.perf_counter()
            spec = FederationSpec.from_run_config(cfg, tuple(shape.input_shape), shape.num_classes, len(folders))
            (work / f"spec-{m}.json").write_text(spec.to_json())
            out = fresh(work / f"out-{m}")
            fed.run(work / f"spec-{m}.json", out, timeout=timeout)
            fed_rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines() if line.strip()]
            scores = json.loads((out / "evaluation.json").read_text())
            per_round = lambda key, rows=fed_rounds: statistics.mean([r[key] for r in rows if r[key]] or [0]) / 1e6  # noqa: E731
            later = lambda rows, key="seconds": [r[key] for r in rows[1:]] or [r[key] for r in rows]  # noqa: E731
            rows.append({"method": m, "rounds": len(fed_rounds), "round_s": statistics.median(later(fed_rounds)),
                         "sim_round_s": statistics.median(later(sim_rounds)),
                         "up_mb": per_round("bytes_up"), "down_mb": per_round("bytes_down"),
                         "accuracy": statistics.mean(float(s["accuracy"]) for s in scores.values()),
                         "sim_accuracy": float(simulated["personalized_accuracy"]["mean"]),
                         "failed": sum(r["failed"] for r in fed_rounds), "sim_s": t1 - t0, "fed_s": time.perf_counter() - t1})
            say(f"  federation {rows[-1]['accuracy']:.4f} vs simulation {rows[-1]['sim_accuracy']:.4f}, "
                f"round {rows[-1]['round_s']:.2f} s")
    return rows


def methods_table(rows: list[dict]) -> str:
    lines = ["| method | rounds | round s (federation) | round s (simulation) | MB up / round | MB down / round | "
             "accuracy, federation | accuracy, simulation | failed site rounds |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['rounds']} | {r['round_s']:.2f} | {r['sim_round_s']:.2f} | {r['up_mb']:.2f} | "
                     f"{r['down_mb']:.2f} | {r['accuracy']:.4f} | {r['sim_accuracy']:.4f} | {r['failed']} |")
    return "\n".join(lines)


def main_methods(args, command: str) -> int:
    """`--methods`: the per-method table (benchmarks/results/federation-methods.md/.json)."""
    from fedpipe.algorithms import ALGORITHMS

    methods = list(ALGORITHMS) if args.methods == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    if unknown := [m for m in methods if m not in ALGORITHMS]:
        raise SystemExit(f"--methods: unknown method(s) {unknown}; choose from {', '.join(ALGORITHMS)}, or all")
    sites, rounds = args.sites[0] if args.sites != [4, 16] else 4, args.rounds
    with tempfile.TemporaryDirectory(prefix="fedpipe-bench-methods-") as tmp:
        rows = bench_methods(methods, sites, rounds, (args.work or Path(tmp)).resolve(), args.env.resolve(), args.timeout)
    text = (f"# Every method over one federation\n\n`{command.strip()}`, {time.strftime('%Y-%m-%d')}.\n\n"
            f"Machine: {machine(args.env)}.\n\n{sites} sites (loopback, TLS, fedpipe's warm sites), {rounds} rounds, the 2NN on "
            "mnist5k pathological, every site every round, 1 local epoch, batch 20, seed 0, one torch thread per process; "
            "each method's defaults" + "".join(f", {m}: {' '.join(v)}" for m, v in METHOD_SETS.items()) + ".\n\n"
            + methods_table(rows) + "\n\n"
            "- round s: the median of the rounds after the first (every phase's rounds; a phase that does not communicate "
            "trains at the sites too). MB up / down: array bytes over all sites, the mean over the rounds that upload (down: "
            "that download) anything; Local sends nothing either way.\n"
            "- accuracy: the mean over the sites of each one's personalized accuracy on its own test split, as the "
            "simulation's report computes it over its clients: the two agree where the federation's numbers equal the "
            "simulation's (tests/federation/test_methods.py checks the models to rtol 1e-5).\n")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "federation-methods.md").write_text(text)
    (args.out / "federation-methods.json").write_text(json.dumps({"command": command.strip(), "rows": rows}, indent=2))
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sites", type=int, nargs="+", default=[4, 16], help="site counts to run (default: 4 16)")
    ap.add_argument("--rounds", type=int, default=3, help="FedAvg rounds per run (default 3; the first is reported apart)")
    ap.add_argument("--quick", action="store_true", help="4 sites, 2 rounds, no SecAgg+: checks every system end to end")
    ap.add_argument("--only", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    ap.add_argument("--no-secagg", action="store_true", help="skip the SecAgg+ rows")
    ap.add_argument("--work", type=Path, help="folder for sites, logs and outputs (default: a temporary one, removed)")
    ap.add_argument("--env", type=Path, default=ROOT / ".cache" / "flower-venv", help="the Flower environment (scripts/flower-env.sh)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds one run may take before it counts as failed")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="where federation.md/.json go")
    ap.add_argument("--methods", help="instead: every method (all, or a comma-separated list) simulated and over one "
                                      "federation at --sites (default 4) for --rounds: the per-method table")
    args = ap.parse_args(argv)
    if args.methods:
        return main_methods(args, "benchmarks/federation.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    if unknown := only - set(SYSTEMS):
        ap.error(f"--only: unknown system(s) {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    sites, rounds = ([4], 2) if args.quick else (args.sites, args.rounds)
    secagg_modes = [False] if args.quick or args.no_secagg else [False, True]
    if only & {"federation", "flower"} and not (args.env / "bin" / "flower-superlink").exists():
        raise SystemExit(f"The Flower environment is missing ({args.env / 'bin' / 'flower-superlink'} not found): run "
                         "scripts/flower-env.sh first (about 1-3 minutes), or pass --env, or use --only simulation.")
    if rounds < 1 or min(sites) < 2:
        ap.error("--rounds must be 1 or more and every --sites 2 or more")

    command = "benchmarks/federation.py " + " ".join(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="fedpipe-bench-federation-") as tmp:
        base = args.work or Path(tmp)
        rows = []
        for n in sites:
            rows += bench_sites(n, rounds, only, secagg_modes, (base / f"sites-{n}").resolve(), args.env.resolve(), args.timeout)
    model_bytes = model_size()
    head = (f"# Federation transport cost\n\n`{command.strip()}`, {time.strftime('%Y-%m-%d')}, {rounds} rounds.\n\n"
            f"Machine: {machine(args.env)}.\n\nFedAvg, 2NN ({model_bytes:,} bytes of float32 parameters), mnist5k pathological, "
            "every site every round, 1 local epoch, batch 20, seed 0, one torch thread per process.\n\n")
    text = (head + table(rows, model_bytes) + "\n\n" + targets(rows) + "\n".join(f"- {n}" for n in NOTES) + "\n\n"
            + profile_table(args.env.resolve()) + BEFORE)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "federation.md").write_text(text)
    (args.out / "federation.json").write_text(json.dumps({"command": command.strip(), "machine": machine(args.env),
                                                          "model_bytes": model_bytes, "rows": rows}, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
