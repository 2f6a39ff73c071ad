"""A real loopback federation on Flower 1.42's deployment engine against the simulation of the same partition.

One SuperLink and 4 site processes on 127.0.0.1, TLS on, SuperNode authentication on (each site's key
registered with `flwr supernode register`), each site reading only its own folder; a fifth site whose key
was never registered must be refused. FedAvg, every site every round, 3 rounds, seed 0: the global model
must equal the simulation's.

Tolerance: atol 1e-6 + rtol 1e-5 on every parameter. Why not bitwise: the transport is exact (float32 arrays
travel with their dtype and bytes, fedpipe/federation/transport.py), the client code is the same
(ClientTrainer, one thread in both), and the aggregation is the same function over the uploads in the same
client order; what may still differ is the order of the floating-point sums in the weighted average when the
two sides hold the uploads in a different order, and the two environments' torch builds (the CUDA wheel in
.venv, the CPU wheel at the sites) may pick different CPU kernels. Either changes a float32 parameter by a few
ulps per round (~1e-7 relative, compounded over 3 rounds of SGD), far below 1e-5; a real difference (a missing
client, a wrong weight, a different download) moves parameters by 1e-3 or more.
"""

from __future__ import annotations

import json
import re
import time

import pytest
import safetensors.torch
import torch
from runs import train_all

from fedpipe.federation.tryout import LoopbackFederation, prepare
from fedpipe.run.config import load_config
from fedpipe.run.run import Run

pytestmark = [pytest.mark.federation, pytest.mark.xdist_group("federation"), pytest.mark.slow, pytest.mark.timeout(600)]

OVERRIDES = [
    "method.name=fedavg",
    "partition.scheme=pathological",
    "partition.num_clients=4",
    "model.name=twonn",
    "train.rounds=3",
    "train.local_epochs=1",
    "train.batch_size=20",
    "train.client_fraction=1.0",
    "engine.clients=sequential",
    "run.threads=1",
    "run.seed=0",
    "telemetry.progress=false",
]
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="session")  # once per worker even when xdist interleaves modules
def loopback(tmp_path_factory, flower_env):
    """The simulation's final global model, and a loopback federation of the same config, run once for the module."""
    work = tmp_path_factory.mktemp("federation")
    cfg = load_config(None, [*OVERRIDES, f"run.store={work / 'store'}", "run.id=loopback"])

    t0 = time.perf_counter()
    state = train_all(Run(cfg))  # the simulation of the same partition
    simulated = {k: v.detach().cpu() for k, v in state.server.global_params.items()}
    sim_seconds = time.perf_counter() - t0

    spec_file, folders = prepare(cfg, work)
    t0 = time.perf_counter()
    with LoopbackFederation(work, flower_env) as fed:
        for folder in folders:
            fed.start_site(folder)
        intruder = folders[0].parent / "site-intruder"
        intruder.mkdir()
        (intruder / "site.json").write_text(json.dumps({"client_id": 99, "opt_out": False}))
        fed.start_site(intruder, name="intruder", register=False, max_retries=2)
        result = fed.run(spec_file, work / "out", timeout=400)
        intruder_log = fed.log_of("intruder")
        intruder_exit = fed.procs["intruder"].poll()
        before = fed._cli("supernode", "list", "fedpipe-tryout", "--format", "json").stdout
        t1 = time.perf_counter()
        control = control_api_calls(fed, fed.certs / "sites" / "intruder.pub")
        submitted = submit_without_token(fed, spec_file, work / "out-intruder")
        after = fed._cli("supernode", "list", "fedpipe-tryout", "--format", "json").stdout
        outside = submit_outside(fed, spec_file, tmp_path_factory.mktemp("outside"))
        print(f"the Control API and place checks took {time.perf_counter() - t1:.1f}s")
    fed_seconds = time.perf_counter() - t0
    federated = safetensors.torch.load_file(str(work / "out" / "global.safetensors"))
    rounds = [json.loads(line) for line in (work / "out" / "rounds.jsonl").read_text().splitlines()]
    print(f"simulation {sim_seconds:.1f}s, loopback federation {fed_seconds:.1f}s (rounds: {[round(r['seconds'], 1) for r in rounds]})")
    return dict(simulated=simulated, federated=federated, result=result, rounds=rounds, work=work,
                intruder_log=intruder_log, intruder_exit=intruder_exit, folders=folders, control=control,
                nodes_before=before, nodes_after=after, submitted=submitted, outside=outside)


def control_api_calls(fed, public_key) -> dict[str, int]:
    """Flower 1.42's Control API (`flwr run`, `flwr supernode register`) called as anyone who reaches the SuperLink's
    port would: plain HTTPS, the CA's trust only, no credentials. Returns each call's HTTP status."""
    import ssl
    import urllib.error
    import urllib.request

    from cryptography.hazmat.primitives import serialization

    pem = serialization.load_ssh_public_key(public_key.read_bytes()).public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    register = b"\x0a" + bytes([len(pem)]) if len(pem) < 128 else b"\x0a" + bytes([len(pem) & 0x7F | 0x80, len(pem) >> 7])
    bodies = {"/v1/control/list-nodes": b"", "/v1/control/register-node": register + pem}  # field 1: public_key (PEM)
    context, status = ssl.create_default_context(cafile=str(fed.tls["ca_cert"])), {}
    for path, body in bodies.items():
        request = urllib.request.Request(f"https://127.0.0.1:{fed.port}{path}", data=body, method="POST",
                                         headers={"Content-Type": "application/protobuf"})
        try:
            with urllib.request.urlopen(request, context=context, timeout=20) as r:
                status[path] = r.status
        except urllib.error.HTTPError as e:
            status[path] = e.code
    return status


def submit_without_token(fed, spec_file, out) -> str:
    """`flwr run` of fedpipe's app as another local process would: the try-out's connection and CA, but not its Control
    API token. Returns what the submission said when refused ('' if it was taken)."""
    from fedpipe.federation.control import TOKEN_ENV
    from fedpipe.federation.tryout import CONNECTION, submit_app

    environ = fed._environ()
    environ.pop(TOKEN_ENV)
    try:
        submit_app(fed.bin / "flwr", environ, fed.work / "intruder-app", CONNECTION, spec_file, out, timeout=30)
    except RuntimeError as e:
        return str(e)
    return ""


def submit_outside(fed, spec_file, outside) -> dict:
    """Two runs submitted with the try-out's own token whose run config names places outside the ServerApp's root:
    an `out-dir` folder holding a result.json (which the ServerApp of today's main deletes before it writes the census
    there), and a `store` that is not the deployment's. Waits until Flower lists both runs as finished."""
    from concurrent.futures import ThreadPoolExecutor

    from fedpipe.federation.tryout import CONNECTION, submit_app

    (outside / "out").mkdir()
    (outside / "out" / "result.json").write_text("kept")
    store = outside / "store"
    with ThreadPoolExecutor(2) as pool:  # both at once: each `flwr run` and each refused ServerApp takes seconds
        runs = list(pool.map(lambda submission: submit_app(fed.bin / "flwr", fed._environ(), *submission), [
            (fed.work / "outside-app-1", CONNECTION, spec_file, outside / "out", 30),
            (fed.work / "outside-app-2", CONNECTION, None, None, 30, 0, 0, str(store), "run-x/federation")]))
    deadline = time.monotonic() + 120  # both ServerApps ended (the SuperLink's log), then Flower's own record of them
    while time.monotonic() < deadline and not all(re.search(rf"Finished task \d+ of run {r}\b", fed.log_of("superlink")) for r in runs):
        time.sleep(0.5)  # Flower logs "Finished task <task> of run <run>" when the run's ServerApp process has ended
    listed = fed._cli("list", CONNECTION, "--format", "json", timeout=30).stdout
    status = {int(row["run-id"]): f"{row['status']}: {row.get('status-details', '')}"
              for row in json.loads(listed[listed.find("{"):]).get("runs", []) if int(row["run-id"]) in runs}
    return {"status": [status.get(r, "not finished") for r in runs], "kept": (outside / "out" / "result.json").read_text(),
            "files": sorted(str(p.relative_to(outside)) for p in outside.rglob("*"))}


def test_fedavg_federated_equals_simulation(loopback):
    sim, fed = loopback["simulated"], loopback["federated"]
    assert sim.keys() == fed.keys()
    worst = 0.0
    for name in sim:
        assert fed[name].dtype == sim[name].dtype == torch.float32
        torch.testing.assert_close(fed[name], sim[name], rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")
        worst = max(worst, float((fed[name] - sim[name]).abs().max()))
    print(f"largest parameter difference federation vs simulation: {worst:.3g}")
    # and the rounds really trained: the model moved away from its start
    assert loopback["result"] == {"stage": "evaluate", "phase": "federation", "round": 3, "sites": 4, "server_client_states": 0}
    assert [r["clients"] for r in loopback["rounds"]] == [4, 4, 4]
    assert all(r["failed"] == 0 and r["bytes_up"] > 0 for r in loopback["rounds"])


def test_each_site_reads_only_its_own_folder(loopback):
    """Each site folder holds one client's tensors; the ClientApp's only data path is its node config's site-dir."""
    for folder in loopback["folders"]:
        meta = json.loads((folder / "site.json").read_text())
        assert folder.name == f"site-{meta['client_id']}"
        # FedAvg keeps no personal state: beside its data only the worker's own log and its SuperNode secret
        assert sorted(p.name for p in folder.iterdir()) == ["data.safetensors", "messages.jsonl", "site.json", "superexec-secret"]


def test_the_control_api_refuses_whoever_lacks_the_tryouts_token(loopback):
    """Flower 1.42 serves the Fleet, Control and Runtime APIs on one port (flwr/superlink/main.py includes the control,
    fleet and runtime routers in one FastAPI app), and without Flower's enterprise account auth its Control API checks no
    credentials (flwr/superlink/config_loader.py `load_control_authn_plugin`: the noop plugin). fedpipe's SuperLink
    (fedpipe.federation.control) puts a token check in front of it: a local process that reaches the port with the CA's
    trust but not the try-out's token can neither list the nodes nor register a key nor submit a run; the try-out's own
    calls (which send the token) can. On today's main the first two answer 200 and the key is registered."""
    assert loopback["control"] == {"/v1/control/list-nodes": 403, "/v1/control/register-node": 403}, loopback["control"]
    before, after = (json.loads(loopback[k])["nodes"] for k in ("nodes_before", "nodes_after"))
    ids = lambda nodes: sorted(n["node-id"] for n in nodes)  # noqa: E731
    assert ids(before) == ids(after) and len(before) == 4, (before, after)  # the 4 sites the try-out registered; no new one
    assert "403" in loopback["submitted"] and "FEDPIPE_CONTROL_TOKEN_FILE" in loopback["submitted"], loopback["submitted"]
    assert not (loopback["work"] / "out-intruder").exists()


def test_a_run_config_naming_an_outside_folder_or_store_writes_nothing_there(loopback):
    """fedpipe's ServerApp takes its places from the SuperLink's deployment (FEDPIPE_SERVER_ROOT: the try-out's folder;
    FEDPIPE_SERVER_STORE: none here), not from the run config: a run whose out-dir is outside the root, or whose store is
    not the deployment's, is refused before anything is read, written or deleted (fedpipe.federation.places). On today's
    main the first deletes the folder's result.json and writes the census there, the second writes into the store."""
    outside = loopback["outside"]
    assert outside["files"] == ["out", "out/result.json"] and outside["kept"] == "kept", outside["files"]
    folder, store = outside["status"]
    # Flower's record of each run: failed, with the ServerApp's refusal (fedpipe.federation.places.PlaceRefused)
    assert folder.startswith("finished:failed") and "run config out-dir=" in folder and "FEDPIPE_SERVER_ROOT" in folder, folder
    assert store.startswith("finished:failed") and "run config store=" in store and "FEDPIPE_SERVER_STORE" in store, store


def test_unregistered_site_is_refused(loopback):
    """The intruder's key was never registered: the SuperLink refuses its activation, so it never joins a round."""
    log = loopback["intruder_log"]
    assert loopback["result"]["sites"] == 4  # the server saw only the 4 registered sites
    # Flower 1.42: the SuperLink answers the activation with error code 2004 (FLEET_NODE_ACTIVATION_FAILED, no
    # node with that public key); the SuperNode logs "Exit Code: 305" and its process exits with status 1
    assert "Failed to activate SuperNode" in log, log[-3000:]
    assert loopback["intruder_exit"] != 0, "the unregistered SuperNode must not end cleanly"  # None: still retrying
