"""SuPerFed-MM's two phases over a real loopback federation, with a site killed mid-round.

4 sites, TLS and site keys on, every site every round; 4 rounds with start_fraction 0.25: round 1 is Phase I
(federation), rounds 2-4 Phase II (personalization), where each site trains its local model and keeps it in its own
folder (state/personalization.safetensors), never sending it. In round 3 site-1 stops replying (the test-only fault
injector's `hang`) and its warm worker is SIGKILLed mid-round (its SuperNode dies with it); a supervisor (`LoopbackFederation.restart_site`) starts it again with
its key and folder.

The fault rule under test (docs/federation.md, "Faults"): the round waits for a reply until the round timeout
(`round-timeout`, here 120 s: a busy 2-core CI machine starts a ClientApp slowly; Flower answers sooner once the SuperLink sees the node offline), counts the killed site
as failed and, since 3 >= train.min_clients = 1, aggregates the other three; the next round waits up to
`rejoin-wait` for the restarted site, which then trains from the personal state it saved in round 2.
"""

from __future__ import annotations

import json
import time

import pytest
import safetensors.torch

from fedpipe.engine.state import PhaseState
from fedpipe.federation.faults import FAULT_INJECTOR_ENV
from fedpipe.federation.sites import state_digest
from fedpipe.federation.tryout import LoopbackFederation, prepare
from fedpipe.run.config import load_config

pytestmark = [pytest.mark.federation, pytest.mark.xdist_group("federation"), pytest.mark.slow, pytest.mark.timeout(900)]

OVERRIDES = ["method.name=superfed_mm", "method.start_fraction=0.25", "partition.scheme=pathological",
             "partition.num_clients=4", "model.name=twonn", "train.rounds=4", "train.local_epochs=1", "train.batch_size=50",
             "train.client_fraction=1.0", "train.min_clients=1", "engine.clients=sequential", "run.threads=1", "run.seed=0",
             "telemetry.progress=false"]
KILLED, KILL_ROUND = 1, 3


@pytest.fixture(scope="session")  # once per worker even when xdist interleaves modules
def superfed(tmp_path_factory, flower_env):
    work = tmp_path_factory.mktemp("superfed-mm")
    cfg = load_config(None, [*OVERRIDES, f"run.store={work / 'store'}", "run.id=superfed"])
    spec_file, folders = prepare(cfg, work)
    num_classes = json.loads(spec_file.read_text())["num_classes"]
    victim = f"site-{KILLED}"
    t0 = time.perf_counter()
    with LoopbackFederation(work, flower_env) as fed:
        for folder in folders:
            fed.start_site(folder, env={FAULT_INJECTOR_ENV: f"hang@{KILL_ROUND}"} if folder.name == victim else None)
        fed.submit(spec_file, work / "out", timeout=300, round_timeout=120, rejoin_wait=240)
        deadline = time.monotonic() + 400
        while f"hangs in round {KILL_ROUND}" not in fed.log_of(victim):
            assert time.monotonic() < deadline, fed.log_of("superlink")[-3000:]
            assert not (work / "out" / "error.json").exists(), (work / "out" / "error.json").read_text()
            time.sleep(0.5)
        state_file = work / "sites" / victim / "state" / "personalization.safetensors"
        before = state_digest(safetensors.torch.load_file(str(state_file)))
        fed.kill_site(victim)
        t_kill = time.perf_counter()
        restart_seconds = fed.restart_site(victim, env={})
        result = fed.wait(work / "out", timeout=800)
    seconds = time.perf_counter() - t0
    rounds = [json.loads(line) for line in (work / "out" / "rounds.jsonl").read_text().splitlines()]
    evaluation = json.loads((work / "out" / "evaluation.json").read_text())
    print(f"superfed_mm federation {seconds:.0f}s; restart took {restart_seconds:.0f}s; rounds "
          f"{[round(r['seconds'], 1) for r in rounds]}; after the kill {time.perf_counter() - t_kill:.0f}s; "
          f"accuracy {[round(evaluation[k]['accuracy'], 3) for k in sorted(evaluation)]}")
    return dict(work=work, result=result, rounds=rounds, evaluation=evaluation, before=before, folders=folders,
                num_classes=num_classes)


def test_killed_site_does_not_stop_the_round(superfed):
    r = superfed["rounds"][KILL_ROUND - 1]
    assert r["round"] == KILL_ROUND and (r["clients"], r["failed"]) == (3, 1), r
    (rejected,) = r["rejected"]
    assert rejected["client"] == KILLED and f"site {KILLED} " in rejected["error"]
    assert rejected["error"].startswith(("SiteTimeout", "SiteError")), rejected


def test_killed_site_rejoins_with_its_state(superfed):
    nxt = superfed["rounds"][KILL_ROUND]
    assert (nxt["clients"], nxt["failed"]) == (4, 0), nxt
    # it trained from the personal state it had saved before it was killed (round 2's), not from a fresh one
    assert nxt["reported"][str(KILLED)]["state-in"] == superfed["before"] != 0
    assert superfed["rounds"][KILL_ROUND - 2]["reported"][str(KILLED)]["state-out"] == superfed["before"]


def test_personal_state_only_at_the_sites(superfed):
    assert superfed["result"] == {"stage": "evaluate", "phase": "personalization", "round": 4, "sites": 4, "server_client_states": 0}
    out = superfed["work"] / "out"
    assert sorted(p.name for p in out.iterdir()) == ["census.json", "evaluation.json", "global.safetensors", "result.json",
                                                     "rounds.jsonl", "server-state.pt"]
    checkpoint = PhaseState.from_bytes((out / "server-state.pt").read_bytes(), "cpu", where="server-state.pt")
    assert len(checkpoint.clients) == 0 and not checkpoint.server.per_client  # the server's checkpoint: global state only
    glob = safetensors.torch.load_file(str(out / "global.safetensors"))
    for folder in superfed["folders"]:
        state = safetensors.torch.load_file(str(folder / "state" / "personalization.safetensors"))
        assert state and set(state) <= set(glob)  # the local model: the mixed layers
        assert sorted(p.name for p in (folder / "state").iterdir()) == ["personalization.safetensors"]  # Phase I keeps none


def test_the_federation_learns(superfed):
    """Each site's personalized accuracy on its own test split, reported by the site, is above chance."""
    ev, chance = superfed["evaluation"], 1 / superfed["num_classes"]
    assert sorted(ev) == ["0", "1", "2", "3"]
    for site, s in ev.items():
        assert s["has-state"] == 1 and s["test-samples"] > 0
        assert s["accuracy"] > 2 * chance, (site, s)
