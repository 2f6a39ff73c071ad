"""Differential privacy in a federation, both modes: the sites clip (and in local mode noise) their own updates, the
server samples, accounts, adapts the clip and (central mode) adds its noise, with the engine's `Privacy`, as the
simulation does (fedpipe/federation/private.py).

One loopback federation (SuperLink + 4 site processes, TLS and site keys on), two runs on it: FedAvg under
privacy.mode=central with adaptive clipping, and under privacy.mode=local, each 2 rounds with Poisson sampling at
q = 0.75 and privacy.seeded_noise (every draw keyed by the seed: the only way two processes can draw the same noise,
so that the federation can be compared with the simulation; a real run keys the server's draws by its own secret and
each site's local noise by the site's own: test_census_unit.py). The global model must
equal the simulation's within the loopback tolerance (rtol 1e-5, atol 1e-6: test_loopback.py), and so must the
accountant's epsilon after each round.

A third run on the same federation is a private warm start: central mode at another noise multiplier, its server
starting from the central run's global model and continuing its ledger (`warm-start-ledger.json`, as `fedpipe run`
writes it from a model-line version: fedpipe.models.federated.warm_start_for). Its epsilon after each round must be the
simulation's composed epsilon: the simulated central run's ledger continued by `fedpipe.models.warm.starting_ledger`
(the simulation's private warm start) and spent round by round.
"""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
from runs import train_all

from fedpipe.engine.state import PhaseState
from fedpipe.federation.resume import CHECKPOINT, WARM_LEDGER, WARM_START
from fedpipe.federation.tryout import LoopbackFederation, prepare
from fedpipe.models.warm import starting_ledger
from fedpipe.run.config import load_config
from fedpipe.run.run import Run

pytestmark = [pytest.mark.federation, pytest.mark.xdist_group("federation"), pytest.mark.slow, pytest.mark.timeout(600)]

BASE = ["method.name=fedavg", "partition.scheme=pathological", "partition.num_clients=4", "model.name=twonn", "train.rounds=2",
        "train.local_epochs=1", "train.batch_size=20", "train.client_fraction=0.75", "train.min_clients=1",
        "engine.clients=sequential", "run.threads=1", "run.seed=0", "telemetry.progress=false",
        "privacy.enabled=true", "privacy.clip=1.0", "privacy.noise_multiplier=0.3", "privacy.seeded_noise=true"]
MODES = {"central": ["privacy.mode=central", "privacy.adaptive_clip=true", "privacy.clip_count_stddev=1.0"],
         "local": ["privacy.mode=local"],
         # central mode under SecAgg+: each site clips and masks its update and its centred clip bit; the server unmasks
         # only their sums, adds its noise to the sum and adapts the clip from the summed bits
         # one round: a second round's local training amplifies the first round's quantisation error (by a factor that
         # varies from run to run: SecAgg+ rounds stochastically), so the round is compared with its own bound
         "secure": ["privacy.mode=central", "privacy.adaptive_clip=true", "privacy.clip_count_stddev=1.0",
                    "federation.secure_aggregation.enabled=true", "train.rounds=1"]}
WARM = ["privacy.mode=central", "privacy.noise_multiplier=0.5"]


@pytest.fixture(scope="session")  # once per worker even when xdist interleaves modules
def private_runs(tmp_path_factory, flower_env):
    work = tmp_path_factory.mktemp("private")
    runs = {}
    cfgs = {mode: load_config(None, [*BASE, *extra, f"run.store={work / 'store'}", f"run.id=private-{mode}"]) for mode, extra in MODES.items()}
    spec_files = {}
    for mode, cfg in cfgs.items():
        spec_files[mode], folders = prepare(cfg, work / mode)  # the same partition for both modes
    # a site refuses seeded noise unless its own policy allows it (fedpipe/federation/policy.py): these sites do, since
    # comparing the federation's noise with the simulation's needs the draws the seed fixes
    policy = work / "seeded-noise-policy.yaml"
    policy.write_text("privacy:\n  allow_seeded_noise: true\n")
    with LoopbackFederation(work / "fed", flower_env, server_root=work) as fed:
        for folder in folders:
            fed.start_site(folder, policy=policy)
        for mode in cfgs:
            out = work / "fed" / f"out-{mode}"
            fed.run(spec_files[mode], out, timeout=400)
            runs[mode] = {"out": out, "cfg": cfgs[mode], "federated": safetensors.torch.load_file(str(out / "global.safetensors")),
                          "rounds": [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]}
        # the warm start: the central run's model and ledger, as the submitter hands a version's to the ServerApp
        warm_cfg = load_config(None, [*BASE, *WARM, f"run.store={work / 'store'}", "run.id=private-warm"])
        warm_spec, _ = prepare(warm_cfg, work / "warm")
        out = work / "fed" / "out-warm"
        out.mkdir(parents=True)
        central = PhaseState.from_bytes((runs["central"]["out"] / CHECKPOINT).read_bytes(), "cpu")
        (out / WARM_START).write_bytes((runs["central"]["out"] / "global.safetensors").read_bytes())
        ledger = starting_ledger(warm_cfg, central.privacy, "the central run", 4)
        (out / WARM_LEDGER).write_text(json.dumps(ledger.to_json()))
        fed.run(warm_spec, out, timeout=400)
        runs["warm"] = {"rounds": [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()],
                        "start": central.privacy}
    for mode, cfg in cfgs.items():
        run = Run(cfg)
        state = train_all(run)
        runs[mode]["simulated"] = {k: v.detach().cpu() for k, v in state.server.global_params.items()}
        runs[mode]["sim_rounds"] = [json.loads(line) for line in run.store.get(run.layout.rounds("federation")).decode().splitlines()]
        runs[mode]["sim_ledger"] = state.privacy
    runs["warm"]["cfg"] = warm_cfg
    return dict(runs=runs, folders=folders)


def secure_bound(cfg) -> float:
    """How far SecAgg+'s quantisation may move one private round's model, per value: the unmasked mean of the sites'
    clipped updates (every site weighing max_weight) is within 1.25 quantisation steps of the exact mean
    (tests/federation/test_secagg.py), the sum within the sites' number of them, the model within that over q W."""
    secure = cfg.federation.secure_aggregation
    step = 2 * secure.clipping_range / secure.quantization_range
    sites, q = cfg.partition.num_clients, cfg.train.client_fraction
    return sites * 1.25 * step / (q * sites)


@pytest.mark.parametrize("mode", list(MODES))
def test_private_federation_equals_the_private_simulation(private_runs, mode):
    r = private_runs["runs"][mode]
    sim, fed = r["simulated"], r["federated"]
    atol = 1e-6 + (secure_bound(r["cfg"]) if mode == "secure" else 0.0)
    worst = max(float((fed[k].double() - sim[k].double()).abs().max()) for k in sim)
    print(f"{mode}: the federation's model within {worst:.3g} of the simulation's (allowed {atol:.3g})")
    for name in sim:
        torch.testing.assert_close(fed[name], sim[name], rtol=1e-5, atol=atol, msg=lambda m, name=name: f"{mode} {name}: {m}")
    fed_eps = [line["privacy"]["epsilon"] for line in r["rounds"]]
    sim_eps = [line["extra"]["epsilon"] for line in r["sim_rounds"]]
    print(f"{mode}: epsilon per round federation {fed_eps}, simulation {sim_eps}")
    assert fed_eps == pytest.approx(sim_eps, rel=1e-9) and fed_eps[0] > 0 and (len(fed_eps) == 1 or fed_eps[-1] > fed_eps[0])


def test_local_mode_sites_release_only_their_noised_update(private_runs):
    """In local mode the server is not trusted: the sites' replies carry no loss, sample count, update norm or state
    digest (the round lines' `reported` is empty and their loss 0); in central mode they report them to the server."""
    local, central = private_runs["runs"]["local"]["rounds"], private_runs["runs"]["central"]["rounds"]
    assert all(line["reported"] == {} or all(not m for m in line["reported"].values()) for line in local)
    assert all(line["loss"] == 0 for line in local) and all(line["loss"] > 0 for line in central)
    assert central[-1]["privacy"]["clip"] != 1.0  # adaptive clipping moved the clip, from the norms the sites reported


def test_a_private_warm_start_continues_the_versions_ledger_as_the_simulation_composes_it(private_runs):
    runs = private_runs["runs"]
    warm, cfg = runs["warm"], runs["warm"]["cfg"]
    # the simulation's composition: the simulated central run's ledger, continued as a simulated warm start continues it
    sim = starting_ledger(cfg, runs["central"]["sim_ledger"], "the central run", 4)
    start = sim.epsilon()
    expected = []
    for _ in warm["rounds"]:
        sim.spend(cfg.privacy.noise_multiplier, cfg.train.client_fraction)
        expected.append(sim.epsilon())
    fed_eps = [line["privacy"]["epsilon"] for line in warm["rounds"]]
    print(f"warm start: epsilon from {start:.4f}, per round federation {fed_eps}, simulation {expected}")
    assert fed_eps == pytest.approx(expected, rel=1e-9)
    assert fed_eps[0] > runs["central"]["rounds"][-1]["privacy"]["epsilon"]  # the version's rounds count too


def test_privacy_with_secagg_releases_only_sums(private_runs):
    """Under SecAgg+ the server adds its noise to the unmasked sum and adapts the clip from the summed centred clip
    bits: the round was summed under the masks (no upload and no norm reached the server: the sites report none), the
    clip it adapted to equals the simulation's (the bit count, summed under the masks, is quantised too), and the
    accountant spent what the simulation's spent."""
    secure = private_runs["runs"]["secure"]
    (line,), (simulated,) = secure["rounds"], secure["sim_rounds"]
    assert line["secure_aggregation"]["sites_summed"] == line["clients"] > 0 and not line["secure_aggregation"]["halted"]
    assert line["failed"] == 0 and all("update-norm" not in m for m in line["reported"].values())
    assert line["privacy"]["epsilon"] == pytest.approx(simulated["extra"]["epsilon"], rel=1e-9)
    adapted = PhaseState.from_bytes((secure["out"] / CHECKPOINT).read_bytes(), "cpu").privacy.clip
    assert adapted != 1.0 and adapted == pytest.approx(secure["sim_ledger"].clip, rel=1e-4)  # the summed bits moved it
