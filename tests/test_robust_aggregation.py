"""Robust aggregation (`train.robust`, fedpipe/algorithms/robust.py): each rule against aggregates computed by hand on
five uploads of two numbers (one of them an outlier), FedAvg's aggregate unchanged bit for bit with the option at its
default, the refusals (a method with its own rule, privacy, SecAgg+, too few uploads for multi-Krum), and a short run
that still learns under a robust rule.

The five updates (global = 0, so uploads = updates), per coordinate sorted:
    u1 = (1, 2), u2 = (2, 0), u3 = (4, 1), u4 = (5, 4), u5 = (100, -50)
    coordinate 0: 1 2 4 5 100      median 4   trimmed mean (beta 0.2: one dropped at each end) (2 + 4 + 5) / 3 = 11/3
    coordinate 1: -50 0 1 2 4      median 1   trimmed mean (0 + 1 + 2) / 3 = 1
Squared distances: d12 = 5, d13 = 10, d14 = 20, d23 = 5, d24 = 25, d34 = 10, and from u5: 12505, 12104, 11817, 11941.
Krum scores with f = 1 (n - f - 2 = 2 nearest): s1 = 5 + 10 = 15, s2 = 5 + 5 = 10, s3 = 5 + 10 = 15, s4 = 10 + 20 = 30,
s5 = 11817 + 11941 = 23758. Multi-Krum keeps m = n - f = 4: u2, u1, u3, u4, mean (12/4, 7/4) = (3, 1.75); Krum (m = 1)
keeps u2 = (2, 0); m = 2 keeps u2 and u1 (s1 = s3: the earlier wins), mean (1.5, 1).
"""

from __future__ import annotations

import pytest
import torch
from runs import small_run

from fedpipe.algorithms import build_algorithm, phases_of
from fedpipe.algorithms.aggregation import weighted_average
from fedpipe.algorithms.base import ServerState, Upload
from fedpipe.algorithms.fedavg import FedAvg, FedAvgParams
from fedpipe.algorithms.pfedmb import PFedMB
from fedpipe.algorithms.robust import krum_scores, multi_krum, robust_average
from fedpipe.config import RobustConfig, TrainConfig
from fedpipe.data.federated import ClientData, FederatedData, Split
from fedpipe.engine.clients import ClientOutcome
from fedpipe.engine.rounds import run_phase, run_round
from fedpipe.engine.sequential import ClientStats
from fedpipe.engine.state import PhaseState
from fedpipe.errors import ConfigError, TrainingError
from fedpipe.federation.spec import FederationSpec, refusal
from fedpipe.nn.networks import build_model
from fedpipe.run.config import load_config

POINTS = [(1.0, 2.0), (2.0, 0.0), (4.0, 1.0), (5.0, 4.0), (100.0, -50.0)]
SAMPLES = [10, 20, 30, 40, 10**6]  # the outlier also claims a million samples: the robust rules ignore counts
ZERO = {"w": torch.zeros(2)}


def uploads(points=POINTS, base=ZERO):
    return [{"w": base["w"] + torch.tensor(p)} for p in points]


def aggregate(**robust):
    return robust_average(ZERO, uploads(), SAMPLES, RobustConfig(**robust))["w"].tolist()


def test_coordinate_median_of_the_hand_example():
    assert aggregate(rule="median") == [4.0, 1.0]
    # an even count: the mean of the two middle values
    got = robust_average({"w": torch.zeros(1)}, [{"w": torch.tensor([v])} for v in (1.0, 2.0, 4.0, 10.0)], [1] * 4,
                         RobustConfig(rule="median"))
    assert got["w"].tolist() == [3.0]


def test_trimmed_mean_of_the_hand_example():
    assert aggregate(rule="trimmed_mean", trim_fraction=0.2) == pytest.approx([11 / 3, 1.0], abs=1e-6)
    # floor(beta * n): beta = 0.3 of 5 still drops one value at each end
    assert aggregate(rule="trimmed_mean", trim_fraction=0.3) == pytest.approx([11 / 3, 1.0], abs=1e-6)
    # beta = 0 is the plain unweighted mean: the outlier pulls it away
    assert aggregate(rule="trimmed_mean", trim_fraction=0.0) == pytest.approx([112 / 5, -43 / 5], abs=1e-5)


def test_multi_krum_scores_picks_and_averages_of_the_hand_example():
    updates = torch.tensor(POINTS, dtype=torch.float64)
    assert krum_scores(updates, 1).tolist() == [15.0, 10.0, 15.0, 30.0, 23758.0]
    mean, chosen = multi_krum(updates, 1)
    assert chosen == [1, 0, 2, 3] and mean.tolist() == [3.0, 1.75]
    assert aggregate(rule="multi_krum", byzantine=1) == [3.0, 1.75]
    assert aggregate(rule="multi_krum", byzantine=1, krum_keep=1) == [2.0, 0.0]  # Krum itself
    assert aggregate(rule="multi_krum", byzantine=1, krum_keep=2) == [1.5, 1.0]


def test_multi_krum_refuses_a_round_with_too_few_uploads():
    with pytest.raises(ValueError, match=r"needs more than 2f \+ 2 = 4 uploads in a round, and 4 came"):
        robust_average(ZERO, uploads()[:4], SAMPLES[:4], RobustConfig(rule="multi_krum", byzantine=1))


def test_norm_bounding_scales_each_update_over_every_tensor():
    g = {"w": torch.tensor([1.0, 1.0]), "b": torch.tensor([-1.0])}
    ups = [{"w": g["w"] + torch.tensor([3.0, 0.0]), "b": g["b"] + torch.tensor([4.0])},  # norm 5 -> x 0.5
           {"w": g["w"] + torch.tensor([6.0, 0.0]), "b": g["b"] + torch.tensor([8.0])},  # norm 10 -> x 0.25
           {"w": g["w"].clone(), "b": g["b"].clone()}]  # norm 0 stays 0
    got = robust_average(g, ups, [1, 3, 4], RobustConfig(norm_bound=2.5))  # with the weighted mean
    # the bounded updates (1.5, 0 | 2), (1.5, 0 | 2), 0 weighted 1, 3, 4: (6, 0 | 8) / 8
    assert got["w"].tolist() == [1.75, 1.0] and got["b"].tolist() == [0.0]
    within = robust_average(g, ups[:1], [1], RobustConfig(norm_bound=5.0))  # exactly at the bound: unchanged
    assert torch.equal(within["w"], ups[0]["w"]) and torch.equal(within["b"], ups[0]["b"])
    # composed with a rule: bound first (M = 10 leaves u1..u4, scales u5 to norm 10), then the median
    assert aggregate(rule="median", norm_bound=10.0) == [4.0, 1.0]


def test_the_rules_work_on_updates_against_a_global_model_and_keep_the_dtype():
    base = {"w": torch.tensor([10.0, -3.0])}
    got = robust_average(base, uploads(base=base), SAMPLES, RobustConfig(rule="median"))
    assert got["w"].dtype == torch.float32 and got["w"].tolist() == [14.0, -2.0]


def test_a_non_finite_upload_is_left_out():
    bad = uploads() + [{"w": torch.tensor([float("nan"), 0.0])}, {"w": torch.tensor([float("inf"), 1.0])}]
    got = robust_average(ZERO, bad, SAMPLES + [1, 1], RobustConfig(rule="median"))
    assert got["w"].tolist() == [4.0, 1.0]


# --- the engine's round: the option off is FedAvg, bit for bit; on, the rule's aggregate ------------------
def tiny_data(clients: int) -> FederatedData:
    x, y = torch.zeros(2, 1, 28, 28), torch.zeros(2, dtype=torch.long)
    split = Split(x, y)
    return FederatedData(tuple(ClientData(c, split, split, split, False) for c in range(clients)), split, 10, (1, 28, 28))


def fedavg():
    torch.manual_seed(0)
    algorithm = FedAvg(FedAvgParams(), build_model("twonn", (1, 28, 28), 10), seed=0)
    return algorithm, FedAvg.phases(algorithm.params, 3)[0]


def round_with(algorithm, phase, train: TrainConfig, ups: list[dict]) -> tuple[PhaseState, list[Upload]]:
    """One run_round of `algorithm` whose clients upload `ups` (the trainer is a stand-in returning them)."""
    server = ServerState({n: p.detach().clone() for n, p in algorithm.model.named_parameters()})
    state = PhaseState("fedavg", "init", 0, server, {})
    sent = [Upload(c, 7 + 5 * c, u) for c, u in enumerate(ups)]

    def trainer(round_, lr, works):
        return [ClientOutcome(u.client_id, u.num_samples, u.tensors, stats=ClientStats(1.0, 1)) for u in sent], None

    run_round(algorithm, phase, tiny_data(len(ups)), state, train, 0, trainer, 1)
    return state, sent


def noisy_uploads(algorithm, n: int) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    return [{k: p.detach() + torch.randn(p.shape, generator=g) for k, p in algorithm.model.named_parameters()} for _ in range(n)]


def test_fedavg_is_unchanged_bit_for_bit_with_the_option_at_its_default():
    algorithm, phase = fedavg()
    ups = noisy_uploads(algorithm, 4)
    state, sent = round_with(algorithm, phase, TrainConfig(), ups)
    server = ServerState({n: p.detach().clone() for n, p in algorithm.model.named_parameters()})
    plain = algorithm.apply_average(server, weighted_average([u.tensors for u in sent], [u.num_samples for u in sent]))
    for k, v in plain.global_params.items():
        assert torch.equal(state.server.global_params[k], v), k
    assert not TrainConfig().robust.active


def test_the_round_aggregates_by_the_robust_rule():
    algorithm, phase = fedavg()
    ups = noisy_uploads(algorithm, 5)
    state, _ = round_with(algorithm, phase, TrainConfig(robust=RobustConfig(rule="median")), ups)
    for k in ups[0]:
        hand = torch.stack([u[k] for u in ups]).median(dim=0).values  # odd count: the middle value
        assert torch.allclose(state.server.global_params[k], hand, atol=1e-6), k
    with pytest.raises(TrainingError, match=r"Round 1 of phase 'federation': multi-Krum .* 4 uploads in a round, and 3 came"):
        round_with(algorithm, phase, TrainConfig(robust=RobustConfig(rule="multi_krum")), ups[:3])


# --- refusals --------------------------------------------------------------------------------------------
def test_a_method_with_its_own_rule_is_refused():
    params = PFedMB.Params()
    algorithm = build_algorithm(params, build_model("lenet5", (1, 28, 28), 10), seed=0)
    phase = phases_of(params, 3)[0]
    train = TrainConfig(robust=RobustConfig(rule="median"))
    state = PhaseState("pfedmb", "init", 0, ServerState({}), {})

    def trainer(round_, lr, works):
        raise AssertionError("no round may run")

    with pytest.raises(ConfigError, match=r"train.robust.rule=median applies to methods whose aggregate is a weighted mean "
                                          r"\(FedAvg, FedProx, .*pfedmb aggregates its phase 'federation' by its own rule .*"
                                          r"set train.robust.rule=mean"):
        run_phase(algorithm, phase, tiny_data(3), state, train, 0, trainer)  # refused before its first round


def test_privacy_and_secure_aggregation_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="train.robust cannot run with privacy.enabled: privacy's clipping already bounds"):
        load_config(None, ["train.robust.rule=median", "privacy.enabled=true", "data.standardisation=fixed"])
    with pytest.raises(ConfigError, match="SecAgg\\+ hides each single update from the server, so median, trimmed mean, "
                                          "multi-Krum and server-side norm bounding cannot run there; only a bound each site "
                                          "applies to its own update fits, which an honest site applies and a dishonest one does not"):
        load_config(None, ["method.name=fedavg", "train.robust.norm_bound=3", "federation.secure_aggregation.enabled=true"])
    # the server's own check of a spec (fedpipe.federation.secagg.check_secure goes through `refusal`)
    assert "SecAgg+ hides each single update" in refusal("fedavg", secure_aggregation=True, robust=True)
    assert refusal("fedavg", secure_aggregation=True) is None and refusal("fedavg", robust=True) is None


def test_the_rule_travels_to_the_federations_server_in_the_spec():
    spec = FederationSpec.from_run_config(load_config(None, ["method.name=fedavg", "train.robust.rule=median"]), (1, 28, 28), 10, 4)
    assert spec.train_cfg.robust.rule == "median"
    # off, the spec is what it was before train.robust existed (a federation's checkpoints are matched by its fingerprint)
    assert "robust" not in FederationSpec.from_run_config(load_config(None, ["method.name=fedavg"]), (1, 28, 28), 10, 4).train


def test_the_config_bounds_and_the_cli_syntax():
    cfg = load_config(None, ["train.robust.rule=trimmed_mean", "train.robust.trim_fraction=0.2"])
    assert cfg.train.robust.rule == "trimmed_mean" and cfg.train.robust.trim_fraction == 0.2
    for bad in ("train.robust.trim_fraction=0.5", "train.robust.rule=mode", "train.robust.norm_bound=0"):
        with pytest.raises(ConfigError, match="train.robust"):
            load_config(None, [bad])
    assert load_config(None, []).run_id() == load_config(None, ["train.robust.rule=mean"]).run_id()  # off: the same run
    assert load_config(None, []).run_id() != load_config(None, ["train.robust.rule=median"]).run_id()


def test_a_short_run_still_learns_under_a_robust_rule(tmp_path):
    run = small_run(tmp_path, "method.name=fedavg", "data.dataset=digits", "partition.scheme=iid", "partition.num_clients=5",
                    "train.rounds=3", "train.lr=0.05", "run.threads=1", "train.robust.rule=multi_krum",
                    "train.robust.norm_bound=20")
    summary = run.run_all()
    assert summary["global_model"]["top1"] >= 0.4  # chance is 0.1; FedAvg reaches about 0.8 here
