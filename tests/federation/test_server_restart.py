"""The server killed mid-run and started again resumes from its checkpoint (issue 41, "Must show").

The loopback federation of tests/federation/test_loopback.py (4 sites, TLS and site keys on, FedAvg, every site every
round, 3 rounds, seed 0). As soon as round 1 is checkpointed (`out/server-state.pt`, then its line in rounds.jsonl),
the ServerApp process (`flwr-serverapp`, launched by the SuperLink's SuperExec) is SIGKILLed, in round 2; the SuperLink
and the sites stay up. The same app and run config is then submitted again (`flwr run`: in Flower 1.42 a run that
lost its ServerApp is not restarted; a new run is what a restart of the phase task submits). Its ServerApp finds the
checkpoint in its out-dir and goes on from the round after it.

The resumed run must end at the same global model as an uninterrupted run: the simulation of the same partition,
within the tolerance (and for the reasons) of test_loopback.py, which shows that an uninterrupted federation equals
that simulation. Randomness is derived from (seed, round, client), so nothing but the server's phase state is needed
to resume.
"""

from __future__ import annotations

import json
import time

import pytest
import safetensors.torch
import torch
from runs import train_all

from fedpipe.engine.state import PhaseState
from fedpipe.federation import resume
from fedpipe.federation.tryout import LoopbackFederation, kill_serverapp, prepare
from fedpipe.run.config import load_config
from fedpipe.run.run import Run

from .test_loopback import ATOL, OVERRIDES, RTOL

pytestmark = [pytest.mark.federation, pytest.mark.xdist_group("federation"), pytest.mark.slow, pytest.mark.timeout(900)]


def _rounds(out):
    path = out / "rounds.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="session")  # once per worker even when xdist interleaves modules
def restarted(tmp_path_factory, flower_env):
    work = tmp_path_factory.mktemp("server-restart")
    cfg = load_config(None, [*OVERRIDES, f"run.store={work / 'store'}", "run.id=restart"])
    state = train_all(Run(cfg))  # the simulation of the same partition
    simulated = {k: v.detach().cpu() for k, v in state.server.global_params.items()}

    spec_file, folders = prepare(cfg, work)
    out = work / "out"
    t0 = time.perf_counter()
    with LoopbackFederation(work, flower_env) as fed:
        for folder in folders:
            fed.start_site(folder)
        site_pids = {f.name: fed.procs[f.name].pid for f in folders}
        fed.submit(spec_file, out, timeout=300)
        deadline = time.monotonic() + 400
        while not _rounds(out):
            assert time.monotonic() < deadline, fed.log_of("superlink")[-3000:]
            assert not (out / "error.json").exists(), (out / "error.json").read_text()
            time.sleep(0.2)
        killed = kill_serverapp(fed)
        t_kill = time.perf_counter()
        checkpoint_at_kill = PhaseState.from_bytes((out / resume.CHECKPOINT).read_bytes()).round
        time.sleep(3)
        before_restart = _rounds(out)
        result = fed.run(spec_file, out, timeout=400)
        sites_alive = {n: fed.procs[n].poll() is None and fed.procs[n].pid == pid for n, pid in site_pids.items()}
    seconds = time.perf_counter() - t0
    print(f"federation with a server kill {seconds:.1f}s (restart to result {time.perf_counter() - t_kill:.1f}s)")
    return dict(simulated=simulated, federated=safetensors.torch.load_file(str(out / "global.safetensors")), result=result,
                killed=killed, checkpoint_at_kill=checkpoint_at_kill, before_restart=before_restart, rounds=_rounds(out),
                resumes=[json.loads(line) for line in (out / resume.RESUMES).read_text().splitlines()],
                final_state=PhaseState.from_bytes((out / resume.CHECKPOINT).read_bytes()), folders=folders, sites_alive=sites_alive)


def test_the_server_was_killed_mid_run(restarted):
    assert restarted["killed"], "no flwr-serverapp process was found under the SuperLink"
    assert 1 <= restarted["checkpoint_at_kill"] < 3
    assert len(restarted["before_restart"]) == restarted["checkpoint_at_kill"]  # the killed server ran no further round


def test_the_restarted_server_resumes_from_its_checkpoint(restarted):
    at_kill = restarted["checkpoint_at_kill"]
    assert restarted["resumes"] == [{"from_phase": "federation", "from_round": at_kill}]
    assert [r["round"] for r in restarted["rounds"]] == [1, 2, 3]  # each round trained once: none repeated, none skipped
    assert all(r["clients"] == 4 and r["failed"] == 0 for r in restarted["rounds"])
    assert restarted["result"] == {"stage": "evaluate", "phase": "federation", "round": 3, "sites": 4, "server_client_states": 0}


def test_the_resumed_run_ends_at_the_uninterrupted_global_model(restarted):
    sim, fed = restarted["simulated"], restarted["federated"]
    assert sim.keys() == fed.keys()
    for name in sim:
        torch.testing.assert_close(fed[name], sim[name], rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")
    final = restarted["final_state"]
    assert final.round == 3 and not final.clients and not final.server.per_client  # the server's checkpoint: no client state
    for name in sim:
        torch.testing.assert_close(final.server.global_params[name], fed[name], rtol=0, atol=0)


def test_the_sites_stayed_up_with_their_folders_intact(restarted):
    assert all(restarted["sites_alive"].values()), restarted["sites_alive"]
    for folder in restarted["folders"]:
        # FedAvg keeps no personal state: beside its data only the worker's own log and its SuperNode secret
        assert sorted(p.name for p in folder.iterdir()) == ["data.safetensors", "messages.jsonl", "site.json", "superexec-secret"]
