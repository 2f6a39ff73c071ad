"""More methods over one real loopback federation, each against the simulation of the same partition.

One SuperLink and 4 sites (TLS and site keys on), started once; then one `flwr run` per method, in sequence, each with
its own spec and out-dir, 2 rounds, every site every round, seed 0. The methods are a representative set of the
federated ones (fedpipe.federation.support.FEDERATED; the others were checked once the same way, see the report of
issue 41's step): LG-FedAvg (only the global top layers travel, both ways; the local layers stay), Ditto (the global
model travels; a personal model stays at each site) and pFedMB (the upload carries the branches and alpha: the server
checks it against `Algorithm.upload_layout`, not the download; its finetune phase, off here to keep the module short,
runs at the sites as FedAvg-FT's does). Ditto once more with a robust rule (the coordinate-wise median of norm-bounded
updates, train.robust): the server's rule is the simulation's.

The sites' folders are shared by the runs and every method keeps its state under the phase name `federation`: each
state file names the run it belongs to (`Site.save_state`), so no run trains from another's state. LG-FedAvg's state
(a representation without a head) would break Ditto's first round if it were read as Ditto's personal model.

Checks per method: the server's global model equals the simulation's (the loopback tolerance, tests/federation/
test_loopback.py); each site's personal state equals the simulation's state of that client; the server holds no
client state (`server_client_states: 0`, its checkpoint holds none) and its out-dir no client's model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from unittest import mock

import pytest
import safetensors
import safetensors.torch
import torch
from runs import train_all

from fedpipe.algorithms.base import ServerState, Upload
from fedpipe.engine.clients import ClientTrainer, ClientWork
from fedpipe.engine.state import PhaseState
from fedpipe.federation.sites import Site
from fedpipe.federation.spec import FederationSpec
from fedpipe.federation.support import FEDERATED
from fedpipe.federation.tryout import LoopbackFederation, prepare
from fedpipe.run.config import load_config
from fedpipe.run.run import Run, federated_data

pytestmark = [pytest.mark.federation, pytest.mark.xdist_group("federation"), pytest.mark.slow, pytest.mark.timeout(900)]

BASE = ["partition.scheme=pathological", "partition.num_clients=4", "model.name=twonn", "train.rounds=2",
        "train.local_epochs=1", "train.batch_size=20", "train.client_fraction=1.0", "engine.clients=sequential",
        "run.threads=1", "run.seed=0", "telemetry.progress=false"]
#: the order matters: LG-FedAvg's state would be a wrong personal model for Ditto, whose state in turn lacks pFedMB's alpha
METHODS = {
    "lgfedavg": ["method.name=lgfedavg"],
    "ditto": ["method.name=ditto"],
    "pfedmb": ["method.name=pfedmb", "method.num_branches=3", "method.finetune_epochs=0"],  # its finetune phase: as fedavg_ft's
    # a robust rule (fedpipe/algorithms/robust.py) runs in the federation's round as in the simulation's: one implementation
    "ditto_median": ["method.name=ditto", "train.robust.rule=median", "train.robust.norm_bound=0.5"],
    # per-site traffic: each site its own download, each upload checked against that site's own layout
    "fedmn": ["method.name=fedmn"],  # the router and only the units the site trained go up
    "ifca": ["method.name=ifca", "method.clusters=2"],  # k models down, the picked one up
    "fedfomo": ["method.name=fedfomo", "method.models_per_round=2"],  # the server's picks down; the server holds models
    "fedamp": ["method.name=fedamp"],  # each site's own cloud model down; the server holds models
    "fedmoe": ["method.name=fedmoe", "method.max_epochs=2"],  # site OPT_OUT opts out: it trains its experts, sends nothing
    "local": ["method.name=local"],  # nothing travels; rounds and evaluation as the others'
}
#: the site that opts out of FedMoE's run (its site.json says so; the simulation flags the same client)
OPT_OUT = 3
#: the methods whose server keeps per-site models by definition (`fedpipe methods` says so)
SERVER_HOLDS = ("fedfomo", "fedamp")
RTOL, ATOL = 1e-5, 1e-6


def config(work, name: str, overrides: list[str]):
    return load_config(None, [*BASE, *overrides, f"run.store={work / 'store'}", f"run.id={name}"])


@pytest.fixture(scope="session")  # once per worker even when xdist interleaves modules
def methods(tmp_path_factory, flower_env):
    """Every method of METHODS: its simulation, then its run on the one loopback federation; each site's state files
    read right after its run (the next method's run overwrites them)."""
    work = tmp_path_factory.mktemp("methods")
    first_spec, folders = prepare(config(work, "prepare", METHODS["lgfedavg"]), work)  # the partition is the method's
    shape = FederationSpec.read(first_spec)
    results, timings = {}, {}
    with LoopbackFederation(work, flower_env) as fed:
        for folder in folders:
            fed.start_site(folder)
        for name, overrides in METHODS.items():
            cfg = config(work, name, overrides)
            with opting_out(folders, OPT_OUT if name == "fedmoe" else None):
                spec = FederationSpec.from_run_config(cfg, tuple(shape.input_shape), shape.num_classes, len(folders))
                spec_file = work / f"spec-{name}.json"
                spec_file.write_text(spec.to_json())
                out = work / f"out-{name}"
                t0 = time.perf_counter()
                fed.submit(spec_file, out, timeout=400)  # the sites train while this process simulates the same run
                sim = train_all(Run(cfg))
                t1 = time.perf_counter()
                result = fed.wait(out, timeout=400)
            timings[name] = (round(t1 - t0, 1), round(time.perf_counter() - t0, 1))
            sites = {}
            for folder in folders:
                cid = json.loads((folder / "site.json").read_text())["client_id"]
                files = {}
                for path in Site(folder, torch.device("cpu"), 0, (1,)).state_files():
                    with safetensors.safe_open(str(path), "pt") as f:
                        files[path.stem] = ((f.metadata() or {}).get("run"), {k: f.get_tensor(k) for k in f.keys()})
                sites[cid] = files
            results[name] = dict(spec=spec, spec_file=spec_file, folders=folders, sim=sim, result=result, out=out, sites=sites,
                                 rounds=[json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()],
                                 evaluation=json.loads((out / "evaluation.json").read_text()))
    print(f"methods over one federation (simulation s, federation s, side by side): {timings}")
    return results


@contextlib.contextmanager
def opting_out(folders, client):
    """Client `client` opts out (None: nobody): its site's own site.json says so, and the simulation's data flags the
    same client, on the same data (a site that opts out itself changes nothing of the partition)."""
    if client is None:
        yield
        return
    meta = next(f / "site.json" for f in folders if json.loads((f / "site.json").read_text())["client_id"] == client)
    before = meta.read_text()
    meta.write_text(json.dumps({**json.loads(before), "opt_out": True}))

    def flagged(*args, **kwargs):
        data = federated_data(*args, **kwargs)
        return dataclasses.replace(data, clients=tuple(dataclasses.replace(c, opt_out=c.client_id == client) for c in data.clients))

    try:
        with mock.patch("fedpipe.run.run.federated_data", flagged):
            yield
    finally:
        meta.write_text(before)


def server_models(m) -> dict:
    """What the server ends with: its global tensors, and per site what it holds (FedFomo's and FedAMP's models)."""
    checkpoint = PhaseState.from_bytes((m["out"] / "server-state.pt").read_bytes(), "cpu", where="server-state.pt")
    return checkpoint.server


@pytest.mark.parametrize("name", list(METHODS))
def test_global_model_equals_simulation(methods, name):
    m = methods[name]
    sim = {k: v.detach().cpu() for k, v in m["sim"].server.global_params.items()}
    fed = safetensors.torch.load_file(str(m["out"] / "global.safetensors"))
    assert sim.keys() == fed.keys()
    for k in sim:
        torch.testing.assert_close(fed[k], sim[k], rtol=RTOL, atol=ATOL, msg=lambda msg, k=k: f"{name} {k}: {msg}")
    held = m["sim"].server.per_client
    assert sorted(server_models(m).per_client) == sorted(held)  # FedFomo's and FedAMP's server holds a model per site
    for cid, tensors in held.items():
        for k, t in tensors.items():
            torch.testing.assert_close(server_models(m).per_client[cid][k], t.detach().cpu(), rtol=RTOL, atol=ATOL,
                                       msg=lambda msg, k=k, cid=cid: f"{name} server's model of site {cid}, {k}: {msg}")
    phases = m["spec"].phases()
    assert m["result"] == {"stage": "evaluate", "phase": phases[-1].name, "round": phases[-1].last_round, "sites": 4,
                           "server_client_states": len(held)}
    assert (len(held) == 4) == (name in SERVER_HOLDS)
    opted = name == "fedmoe"
    for r in m["rounds"]:
        clients = 3 if opted and r["phase"] == "federation" else 4  # the opt-out site is never asked in a communicating round
        assert (r["clients"], r["failed"], r["rejected"]) == (clients, 0, []), r
    communicating = [r for r in m["rounds"] if r["phase"] == "federation"]
    if name == "local":  # nothing travels, either way, yet the rounds ran at every site
        assert not communicating and len(m["rounds"]) == 2
        assert all(r["bytes_up"] == r["bytes_down"] == 0 for r in m["rounds"])
    else:
        assert len(communicating) == 2 and all(r["bytes_up"] > 0 for r in communicating)


@pytest.mark.parametrize("name", list(METHODS))
def test_personal_state_only_at_the_sites(methods, name):
    """Each site's personal state is the simulation's state of that client, and marked as this run's; the server's
    out-dir and checkpoint hold no client's state."""
    m = methods[name]
    run = Site._run_key(m["spec"])
    last = m["spec"].phases()[-1].name
    for cid, files in m["sites"].items():
        marked, state = files[last]
        assert marked == run, (name, cid, last)
        sim = m["sim"].clients[cid]
        assert state.keys() == sim.keys(), (name, cid)
        for k in sim:
            torch.testing.assert_close(state[k], sim[k].detach().cpu(), rtol=RTOL, atol=ATOL,
                                       msg=lambda msg, k=k, cid=cid: f"{name} site {cid} {k}: {msg}")
        assert m["evaluation"][str(cid)]["has-state"] == 1
    checkpoint = PhaseState.from_bytes((m["out"] / "server-state.pt").read_bytes(), "cpu", where="server-state.pt")
    assert not checkpoint.clients and (name in SERVER_HOLDS or not checkpoint.server.per_client)
    assert not [p.name for p in m["out"].iterdir() if p.suffix == ".safetensors" and p.name != "global.safetensors"]


def test_every_federated_method_uploads_its_declared_layout(tmp_path):
    """`Algorithm.upload_layout` (what the server checks each upload against) is what `client_result` really uploads,
    for every federated method, in every phase: one client's round per phase, in process as a site trains (no Flower)."""
    cfg = load_config(None, [*BASE, "partition.num_clients=2", f"run.store={tmp_path}", "run.id=layout"])
    run = Run(cfg)
    data = federated_data(run, run.partition(), torch.device("cpu"))
    checked = []
    for name in FEDERATED:
        extra = ["method.finetune_epochs=1"] if name in ("pfedmb", "fedavg_ft", "fedprox_ft") else []
        extra += ["method.max_epochs=1"] if name == "fedmoe" else []
        cfg = load_config(None, [*BASE, "partition.num_clients=2", f"method.name={name}", *extra])
        spec = FederationSpec.from_run_config(cfg, data.input_shape, data.num_classes, 2)  # refuses what is not federated
        algorithm, initial = spec.build(torch.device("cpu"))
        server, state = ServerState(initial), None
        for phase in spec.phases():
            if phase.last_round < phase.first_round:
                continue  # a phase without rounds (SuPerFed's with start_fraction 0 or 1)
            download = algorithm.download(phase, server, 0)
            trainer = ClientTrainer(algorithm, phase, data, spec.train_cfg, spec.engine_cfg, spec.seed)
            (o,) = trainer.train([ClientWork(0, download, state)], phase.first_round, 0.01)
            assert o.error is None, (name, phase.name, o.error)
            state = o.new_state
            if o.upload is None:
                continue
            layout = algorithm.upload_layout(phase, download, o.upload.keys())  # IFCA's cluster, FedMN's units: the names pick
            assert algorithm.upload_problem(phase, download, o.upload) is None, (name, phase.name)
            assert {k: (tuple(t.shape), t.dtype) for k, t in o.upload.items()} == \
                   {k: (tuple(t.shape), t.dtype) for k, t in layout.items()}, (name, phase.name)
            server = algorithm.aggregate(phase, server, [Upload(0, o.num_samples, o.upload)])
            checked.append((name, phase.name))
    assert {n for n, _ in checked} == set(FEDERATED) - {"local"}  # Local uploads nothing in any phase


def test_a_site_reads_only_its_runs_state(tmp_path):
    """Two runs' states under one phase name at one site (no Flower): each run reads its own, or none."""
    folder = tmp_path / "site-0"
    folder.mkdir()
    (folder / "site.json").write_text(json.dumps({"client_id": 0, "opt_out": False}))
    splits = {f"{s}_{v}": torch.zeros(1, 1) if v == "x" else torch.zeros(1, dtype=torch.long)
              for s in ("train", "val", "test") for v in ("x", "y")}
    safetensors.torch.save_file(splits, str(folder / "data.safetensors"))
    site = Site(folder, torch.device("cpu"), 2, (1,))
    a, b = (FederationSpec({"name": n}, {}, {}, 0, "twonn", [1], 2, 1) for n in ("lgfedavg", "ditto"))
    site.save_state("federation", {"head.weight": torch.ones(2, 1)}, a)
    assert site.load_state("federation", torch.device("cpu"), (), b) is None  # another run's state is none of b's
    assert torch.equal(site.load_state("federation", torch.device("cpu"), (), a)["head.weight"], torch.ones(2, 1))
    site.save_state("federation", {"w": torch.zeros(3)}, b)
    assert site.load_state("federation", torch.device("cpu"), (), a) is None  # b's run overwrote it
    assert set(site.load_state("finetune", torch.device("cpu"), ("federation",), b)) == {"w"}  # an earlier phase of b's run


def test_the_robust_rule_is_applied_at_the_server(methods):
    """Ditto with the median of norm-bounded updates is not Ditto's weighted mean (the equality above is not vacuous)."""
    plain = safetensors.torch.load_file(str(methods["ditto"]["out"] / "global.safetensors"))
    robust = safetensors.torch.load_file(str(methods["ditto_median"]["out"] / "global.safetensors"))
    assert max(float((plain[k] - robust[k]).abs().max()) for k in plain) > 1e-5


def test_an_opt_out_site_is_never_asked_to_upload(methods):
    """FedMoE with site OPT_OUT opting out (its own site.json): the census carries its flag, no communicating round asks
    it (so nothing of it is aggregated), and it still trains its specialist and gate at home (checked above against the
    simulation's state of that client)."""
    m = methods["fedmoe"]
    census = json.loads((m["out"] / "census.json").read_text())
    assert {s["client_id"]: s["opt_out"] for s in census["sites"]} == {c: c == OPT_OUT for c in range(4)}
    for r in m["rounds"]:
        assert (str(OPT_OUT) in r["reported"]) == (r["phase"] != "federation"), r


ASK_ANYWAY = """
import sys
from flwr.app import Context, RecordDict
from fedpipe.federation import client_app
from fedpipe.federation.spec import FederationSpec

spec, folder, by_policy = FederationSpec.read(sys.argv[1]), sys.argv[2], sys.argv[3] == "policy"
client_app.SETTINGS = client_app.SiteSettings(opt_out=by_policy)  # as the worker sets it from the site's policy
try:
    client_app._train_here(Context(1, 1, {"site-dir": folder}, RecordDict(), {}), spec, "federation", 1, 0.01, {})
except client_app.OptedOut as e:
    print("REFUSED:", e)
"""


@pytest.mark.parametrize("how", ["site.json", "policy"])
def test_an_opt_out_site_refuses_a_communicating_round_asked_anyway(methods, flower_env, tmp_path, how):
    """A server that asks an opt-out site (its own site.json, or its policy's opt_out) for FedMoE's federation round
    anyway gets a refusal before the site trains: the rule is the site's, not the server's."""
    import shutil
    import subprocess

    m = methods["fedmoe"]
    folder = shutil.copytree(next(f for f in m["folders"] if json.loads((f / "site.json").read_text())["client_id"] == OPT_OUT),
                             tmp_path / "site")
    if how == "site.json":
        (folder / "site.json").write_text(json.dumps({"client_id": OPT_OUT, "opt_out": True}))
    done = subprocess.run([str(flower_env / "bin" / "python"), "-c", ASK_ANYWAY, str(m["spec_file"]), str(folder), how],
                          capture_output=True, text=True, timeout=120)
    assert "REFUSED: site 3 opts out" in done.stdout, done.stdout + done.stderr[-2000:]
