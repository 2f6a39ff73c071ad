"""Differential privacy on the upload path (`privacy`, issue 33): the accountant against a published table, the
noise and the clip by statistics, a private run that reduces to the plain one, the budget stop and a resumed
accountant, the methods refused, and `fedpipe privacy plan`.

The accountant is Opacus's (a real library, not a stand-in); the runs are real fedpipe runs on mnist5k."""

from __future__ import annotations

import json
import math

import pytest
import torch
from runs import CrashAfterRound, small_run, train_all
from scipy import stats
from typer.testing import CliRunner

from fedpipe.config import PrivacyConfig
from fedpipe.engine.accounting import Ledger, _rdp_one_round, calibrate, epsilon_of
from fedpipe.engine.privacy import Privacy, clip_updates, poisson_sample, sum_updates
from fedpipe.errors import ConfigError
from fedpipe.run.config import load_config

# --- the accountant -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sigma, epochs, published", [(1.12, 60, 2.92), (0.6, 30, 9.74), (1.2, 10, 1.20)])
def test_rdp_of_the_sampled_gaussian_reproduces_tf_privacy_published_table(sigma, epochs, published):
    """TensorFlow Privacy, tutorials/README.md, "Select Parameters" (DP-SGD on MNIST: 60,000 examples, batches of
    256, steps_per_epoch = 60000 // 256 as mnist_dpsgd_tutorial.py counts them; epsilon at delta = 1e-5):
    noise 1.12 for 60 epochs -> 2.92, 0.6 for 30 -> 9.74, 1.2 for 10 -> 1.20. Those figures convert RDP to
    (epsilon, delta) by Mironov 2017, Proposition 3 (epsilon = min over orders of RDP - log(delta) / (order - 1));
    the RDP is the library's (Opacus compute_rdp at its default orders, which are TF Privacy's), composed
    per round as fedpipe's accountant does. Agreement within the table's two decimals (the 9.74 row computes
    to 9.747)."""
    from opacus.accountants import RDPAccountant

    q, steps = 256 / 60000, epochs * (60000 // 256)
    per_round = _rdp_one_round(sigma, q)
    classic = min(steps * r - math.log(1e-5) / (a - 1) for r, a in zip(per_round, RDPAccountant.DEFAULT_ALPHAS))
    assert abs(classic - published) < 0.01
    # fedpipe reports Opacus's tighter conversion (Balle et al. 2020, Theorem 21): never above the classic one
    ours = epsilon_of("rdp", [[sigma, q, steps]], 1e-5)
    assert 0.7 * published < ours <= classic


def test_epsilon_composes_rounds_and_the_prv_accountant_is_tighter():
    one = epsilon_of("rdp", [[1.0, 0.1, 50]], 1e-3)
    assert epsilon_of("rdp", [[1.0, 0.1, 20], [1.0, 0.1, 30]], 1e-3) == pytest.approx(one, rel=1e-12)  # history split = same
    assert epsilon_of("rdp", [[1.0, 0.1, 51]], 1e-3) > one
    assert epsilon_of("prv", [[1.0, 0.1, 50]], 1e-3) < one  # Gopi et al. 2021: tighter than RDP
    assert epsilon_of("rdp", [], 1e-3) == 0 and math.isinf(epsilon_of("rdp", [[0.0, 0.1, 1]], 1e-3))


def test_calibration_is_the_smallest_noise_within_the_target():
    plan = ((0.2, 18), (0.2, 12))
    sigma = calibrate("rdp", 4.0, 1e-3, plan)
    spent = lambda s: epsilon_of("rdp", [[s, q, n] for q, n in plan], 1e-3)  # noqa: E731
    assert spent(sigma) <= 4.0 < spent(sigma * 0.98)


def test_a_ledger_survives_json_and_continues():
    ledger = Ledger("rdp", 1e-3)
    for _ in range(3):
        ledger.spend(1.0, 0.1)
    back = Ledger.from_json(json.loads(json.dumps(ledger.to_json())))
    back.spend(1.0, 0.1)
    assert back.history == [[1.0, 0.1, 4]] and back.epsilon() == pytest.approx(epsilon_of("rdp", [[1.0, 0.1, 4]], 1e-3))


# --- clipping and noise -----------------------------------------------------------------------------------------


def _cfg(**kw) -> PrivacyConfig:
    return PrivacyConfig(enabled=True, seeded_noise=True, **kw)


def test_clipped_updates_are_within_the_clip_flat_and_per_layer():
    g = torch.Generator().manual_seed(0)
    updates = [{"a": torch.randn(5, 3, generator=g) * s, "b": torch.randn(7, generator=g) * s} for s in (0.01, 1.0, 100.0)]
    for per_layer in (False, True):
        clipped, norms = clip_updates(updates, 0.5, per_layer)
        for c, u, n in zip(clipped, updates, norms):
            flat = math.sqrt(sum(float(t.pow(2).sum()) for t in c.values()))
            assert flat <= 0.5 + 1e-12
            assert n == pytest.approx(math.sqrt(sum(float(t.double().pow(2).sum()) for t in u.values())))
            if per_layer:
                assert all(float(t.norm()) <= 0.5 / math.sqrt(2) + 1e-12 for t in c.values())
        assert torch.allclose(clipped[0]["a"], updates[0]["a"].double())  # a short update is left as it is


def test_an_outlier_moves_the_aggregate_by_at_most_clip_over_the_cohort():
    """DP-FedAvg's sensitivity (McMahan et al. 2018, Algorithm 1, f~_f): one client changes the noiseless
    aggregate by at most C / (q W), however large its update."""
    clip, q, eligible = 0.5, 0.25, 40
    privacy = Privacy(_cfg(clip=clip, noise_multiplier=0.0), 0, q, eligible)
    g = torch.Generator().manual_seed(1)
    glob = {"w": torch.randn(50, generator=g), "b": torch.randn(3, generator=g)}
    honest = [{k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in glob.items()} for _ in range(9)]
    outlier = {k: v + 1e6 for k, v in glob.items()}
    downloads = [glob] * 10
    without, _ = privacy.privatize(list(range(9)), honest, downloads[:9], 1)
    with_it, norms = privacy.privatize(list(range(10)), honest + [outlier], downloads, 1)
    assert norms[-1] > 1e6
    a = privacy.aggregate(glob, sum_updates(without), 1)
    b = privacy.aggregate(glob, sum_updates(with_it), 1)
    moved = math.sqrt(sum(float((b[k].double() - a[k].double()).pow(2).sum()) for k in glob))
    assert moved <= clip / (q * eligible) * (1 + 1e-5)
    assert moved > 0.9 * clip / (q * eligible)  # and it does move by about that much: the bound is tight


@pytest.mark.parametrize("mode", ["central", "local"])
def test_the_noise_has_the_configured_std(mode):
    """The aggregate's noise over 40,000 coordinates: mean 0 and std sigma * C / (q W) in central mode (and
    sqrt(m) times that with m noised uploads in local mode), by a Kolmogorov-Smirnov test against that normal
    and a chi-square interval on the variance."""
    sigma, clip, q, eligible, m = 1.3, 0.7, 0.5, 8, 4
    privacy = Privacy(_cfg(clip=clip, noise_multiplier=sigma, mode=mode), 7, q, eligible)
    glob = {"w": torch.zeros(200, 100), "b": torch.zeros(20, 100, dtype=torch.float64)}
    zeros = [{k: v.clone() for k, v in glob.items()} for _ in range(m)]
    updates, _ = privacy.privatize(list(range(m)), zeros, [glob] * m, 3)
    out = privacy.aggregate(glob, sum_updates(updates), 3)
    noise = torch.cat([out[k].double().flatten() for k in glob]).numpy() * (q * eligible)
    std = sigma * clip * (math.sqrt(m) if mode == "local" else 1.0)
    assert stats.kstest(noise, "norm", args=(0.0, std)).pvalue > 1e-3
    n = noise.size
    chi2 = float((noise**2).sum()) / std**2  # ~ chi-square with n degrees of freedom
    assert stats.chi2.ppf(1e-4, n) < chi2 < stats.chi2.ppf(1 - 1e-4, n)
    wrong = stats.kstest(noise, "norm", args=(0.0, std * 1.05)).pvalue  # a 5% wrong std is told apart
    assert wrong < 1e-3


def test_poisson_sampling_draws_each_client_independently():
    cfg = _cfg()
    sizes = [len(poisson_sample(list(range(100)), 0.2, cfg, 0, r)) for r in range(1, 401)]
    assert len(set(sizes)) > 5  # the cohort's size varies, as Poisson sampling's does
    assert abs(sum(sizes) / len(sizes) - 20) < 1.0  # mean q * n
    assert poisson_sample(list(range(10)), 0.3, cfg, 0, 5) == poisson_sample(list(range(10)), 0.3, cfg, 0, 5)  # seeded


# --- whole runs -------------------------------------------------------------------------------------------------

EVERYONE = ["train.client_fraction=1.0", "train.rounds=2"]


def test_no_noise_and_a_huge_clip_is_the_plain_run(tmp_path):
    """sigma = 0, C = 1e6, every client every round (q = 1) and clients of equal size: DP-FedAvg's
    theta + sum_k (theta_k - theta) / n is FedAvg's sum_k n_k theta_k / sum_k n_k. Equal to float32 rounding,
    not bit for bit: the private path adds float64 differences to theta, the plain one divides a float64 sum
    of the models, so the last float32 bit may differ. Both standardise inputs with the fixed constants, as a private
    run must (pooled statistics would be a release outside the accountant)."""
    plain = small_run(tmp_path / "plain", "method.name=fedavg", *EVERYONE, "data.standardisation=fixed")  # as private runs do
    plain.partition()
    sizes = {len(c.train) for c in plain.load_partition().clients}
    assert len(sizes) == 1, "the test needs clients of equal size"
    a = train_all(plain)
    b = train_all(small_run(tmp_path / "dp", "method.name=fedavg", *EVERYONE, "privacy.enabled=true", "privacy.noise_multiplier=0",
                            "privacy.clip=1e6", "privacy.seeded_noise=true"))
    for k, v in a.server.global_params.items():
        assert torch.allclose(v, b.server.global_params[k], atol=1e-6, rtol=0), k
    assert b.privacy is not None and b.privacy.history == [[0.0, 1.0, 2]]


def test_with_noise_the_run_differs_and_reports_epsilon_every_round(tmp_path):
    run = small_run(tmp_path, "method.name=fedavg", *EVERYONE, "privacy.enabled=true", "privacy.seeded_noise=true",
                    "privacy.noise_multiplier=1.0", "privacy.clip=0.5")
    state = train_all(run)
    rows = [json.loads(line) for line in run.store.get_text(run.layout.rounds("federation")).splitlines()]
    eps = [r["extra"]["epsilon"] for r in rows]
    delta = 1e-5  # the default: min(1e-5, 0.01/6)
    assert eps == pytest.approx([epsilon_of("rdp", [[1.0, 1.0, r]], delta) for r in (1, 2)])
    summary = run.evaluate()
    assert summary["privacy"]["epsilon"] == pytest.approx(eps[-1]) and summary["privacy"]["delta"] == pytest.approx(delta)
    assert state.privacy.rounds == 2


def test_target_epsilon_stops_at_the_last_round_within_it_and_a_resumed_run_continues_the_accountant(tmp_path):
    sigma, q, delta = 1.0, 0.5, 1e-5
    after = [epsilon_of("rdp", [[sigma, q, r]], delta) for r in range(1, 6)]
    target = (after[2] + after[3]) / 2  # round 4 would exceed it
    base = ["method.name=fedavg", "train.rounds=5", "train.client_fraction=0.5", "privacy.enabled=true", "privacy.seeded_noise=true",
            f"privacy.noise_multiplier={sigma}"]
    stopped = small_run(tmp_path / "stop", *base, f"privacy.target_epsilon={target}")
    state = train_all(stopped)
    assert state.round == 3 and state.privacy.stopped_at == 3 and state.privacy.epsilon() <= target
    assert stopped.evaluate()["privacy"]["stopped_after_round"] == 3

    # a run killed after round 2 and resumed spends exactly what an uninterrupted run does
    whole = train_all(small_run(tmp_path / "whole", *base))
    crashed = small_run(tmp_path / "crash", *base)
    crashed.partition()
    with pytest.raises(SystemExit):
        crashed.train("federation", telemetry_sinks=[CrashAfterRound(2)])
    resumed = train_all(small_run(tmp_path / "crash", *base))
    assert resumed.privacy.history == whole.privacy.history == [[sigma, q, 5]]
    assert resumed.privacy.epsilon() == pytest.approx(after[4])
    for k, v in whole.server.global_params.items():  # seeded noise and sampling: the same model too
        assert torch.equal(v, resumed.server.global_params[k])


@pytest.mark.parametrize("method, why", [("pfedmb", "alpha"), ("ifca", "cluster"), ("fedfomo", "affinities"),
                                         ("fedamp", "pairwise|pair of clients"), ("fedmn", "which modules")])
def test_methods_whose_server_uses_per_client_statistics_are_refused(method, why):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"method.name={method}", "privacy.enabled=true"])
    assert "cannot run with privacy.enabled" in str(e.value)
    assert any(w in str(e.value) for w in why.split("|"))
    load_config(None, [f"method.name={method}"])  # without privacy it is fine


def test_model_selection_on_clients_validation_data_is_refused_with_privacy():
    with pytest.raises(ConfigError, match="train.select=last"):
        load_config(None, ["method.name=fedavg", "privacy.enabled=true", "train.select=best_val_loss"])


def test_an_undeclared_custom_aggregation_is_refused_at_run_time():
    from fedpipe.algorithms.aggregation import custom
    from fedpipe.algorithms.base import privacy_problem
    from fedpipe.algorithms.fedavg import FedAvg
    from fedpipe.algorithms.pfedme import PFedMe

    class Odd(FedAvg):
        def aggregation(self, phase):
            return custom("the median of the uploads")

    cfg = load_config(None, ["method.name=fedavg"])
    phases = FedAvg.phases(cfg.method, 3)
    assert "the median of the uploads" in privacy_problem(Odd(cfg.method, torch.nn.Linear(2, 2), 0), phases)
    assert privacy_problem(FedAvg(cfg.method, torch.nn.Linear(2, 2), 0), phases) is None
    mixed = load_config(None, ["method.name=pfedme", "method.beta=2.0"]).method  # its own mix: post-processing of the mean
    assert privacy_problem(PFedMe(mixed, torch.nn.Linear(2, 2), 0), PFedMe.phases(mixed, 3)) is None


def test_privacy_off_keeps_the_run_id():
    assert load_config(None, []).run_id() == load_config(None, ["privacy.clip=3"]).run_id()
    assert load_config(None, []).run_id() != load_config(None, ["privacy.enabled=true"]).run_id()


def test_privacy_plan_prints_the_calibrated_noise_and_the_schedule():
    from fedpipe.cli import app

    done = CliRunner().invoke(app, ["privacy", "plan", "--set", "method.name=fedavg_ft", "--set", "train.rounds=30", "--set",
                                    "train.client_fraction=0.2", "--set", "partition.num_clients=100", "--set", "privacy.target_epsilon=4"])
    assert done.exit_code == 0, done.output
    assert "30 private rounds" in done.output and "calibrated to target_epsilon 4.0" in done.output
    sigma = float(done.output.split("noise multiplier")[1].split()[0])
    assert sigma == pytest.approx(calibrate("rdp", 4.0, 1e-5, ((0.2, 30),)), rel=1e-3)
    last = done.output.strip().splitlines()[-1].split()
    assert last[0] == "30" and 3.9 < float(last[1]) <= 4.0
    bad = CliRunner().invoke(app, ["privacy", "plan", "--set", "partition.scheme=natural"])
    assert bad.exit_code == 2
    # adaptive clipping: 20 expected clients a round, count noise 20/20 = 1, updates at (1 - 1/4)^-1/2 (Theorem 1)
    adaptive = CliRunner().invoke(app, ["privacy", "plan", "--set", "train.client_fraction=0.2", "--set", "partition.num_clients=100",
                                        "--set", "privacy.noise_multiplier=1", "--set", "privacy.adaptive_clip=true"])
    assert adaptive.exit_code == 0 and "count noise std 1, so the updates carry noise multiplier 1.1547" in adaptive.output
    refused = CliRunner().invoke(app, ["privacy", "plan", "--set", "partition.num_clients=100", "--set", "privacy.noise_multiplier=5",
                                       "--set", "privacy.adaptive_clip=true", "--set", "privacy.clip_count_stddev=1"])
    assert refused.exit_code == 2 and "clip_count_stddev" in refused.output


ADAPTIVE = ["privacy.adaptive_clip=true", "privacy.clip_count_stddev=1"]


@pytest.mark.parametrize("how, extra", [(["engine.clients=batched"], []), (["engine.processes=2", "run.threads=1"], []),
                                        (["engine.processes=2", "run.threads=1"], ADAPTIVE)])
def test_batched_clients_and_two_processes_privatise_as_one_by_one(tmp_path, how, extra):
    """Clipping runs where the clients train (batched: the norms of a chunk's clients at once; over processes: on
    each rank, whose clipped updates are summed by the all-reduce, rank 0 adding the noise): the same model as
    one by one in one process, within float tolerance (batched training itself agrees only that far)."""
    base = ["method.name=fedavg", "train.rounds=2", "train.client_fraction=0.5", "privacy.enabled=true", "privacy.seeded_noise=true",
            "privacy.noise_multiplier=0.5", "privacy.clip=0.3", *extra]  # adaptive: the ranks clip with rank 0's clip
    one = train_all(small_run(tmp_path / "one", *base))
    other = train_all(small_run(tmp_path / "other", *base, *how))
    assert other.privacy.history == one.privacy.history and other.privacy.clip == one.privacy.clip
    for k, v in one.server.global_params.items():
        assert torch.allclose(v, other.server.global_params[k], atol=1e-5, rtol=1e-4), k


# --- adaptive clipping (Andrew et al. 2021) ---------------------------------------------------------------------


def _adaptive(**kw) -> PrivacyConfig:
    return PrivacyConfig(enabled=True, adaptive_clip=True, seeded_noise=True, **kw)


def test_adaptive_clipping_noises_the_updates_by_theorem_1():
    """sigma_Delta = (sigma^-2 - (2 sigma_b)^-2)^(-1/2): by hand, sigma = 1 and sigma_b = 1 give 1 / sqrt(3/4);
    without adaptive clipping the updates carry sigma itself; a count noise that leaves nothing is refused."""
    p = Privacy(_adaptive(noise_multiplier=1.0, clip_count_stddev=1.0), 0, 0.5, 40)
    assert p.update_sigma == pytest.approx(1 / math.sqrt(0.75)) and p.sigma == 1.0
    assert Privacy(_adaptive(noise_multiplier=1.0), 0, 0.5, 40).count_std == pytest.approx(1.0)  # cohort 20 / 20
    assert Privacy(PrivacyConfig(enabled=True, noise_multiplier=1.0), 0, 0.5, 40).update_sigma == 1.0
    with pytest.raises(ValueError, match="clip_count_stddev"):
        Privacy(_adaptive(noise_multiplier=3.0, clip_count_stddev=1.0), 0, 0.5, 40)


def test_adaptive_clipping_moves_the_clip_to_the_target_quantile_of_the_norms():
    """The geometric update, by hand for one round, then driven by norms of known quantiles: the clip settles at
    the target quantile (Andrew et al. 2021, Algorithm 1), from far below and from far above."""
    p = Privacy(_adaptive(noise_multiplier=0.0, clip=1.0, clip_lr=0.2, target_quantile=0.5), 0, 1.0, 4)
    assert p.adapt([0.5, 0.9, 2.0, 3.0], 1) == pytest.approx(math.exp(-0.2 * (2 / 4 - 0.5)))  # 2 of 4 within: stays
    assert p.adapt([0.5, 0.6, 0.7, 3.0], 2) == pytest.approx(math.exp(-0.2 * (3 / 4 - 0.5)))  # 3 of 4 within: shrinks
    norms = torch.distributions.LogNormal(0.0, 0.5).sample((50,), ).tolist()  # reused every round: fixed quantiles
    torch.manual_seed(0)
    for start, quantile in ((0.01, 0.5), (100.0, 0.5), (1.0, 0.9)):
        p = Privacy(_adaptive(noise_multiplier=1.0, clip=start, target_quantile=quantile, clip_count_stddev=2.5), 0, 1.0, 50)
        for round_ in range(1, 301):
            p.adapt(norms, round_)
        within = sum(n <= p.clip for n in norms) / len(norms)
        assert abs(within - quantile) <= 0.12, (start, quantile, p.clip, within)


def test_an_adaptive_run_records_its_clip_every_round_and_resumes_with_it(tmp_path):
    base = ["method.name=fedavg", "train.rounds=4", "train.client_fraction=0.5", "privacy.enabled=true", "privacy.seeded_noise=true",
            "privacy.noise_multiplier=0.01", "privacy.clip=10", "privacy.adaptive_clip=true", "privacy.clip_count_stddev=1"]
    run = small_run(tmp_path / "whole", *base)
    whole = train_all(run)
    rows = [json.loads(line) for line in run.store.get_text(run.layout.rounds("federation")).splitlines()]
    clips = [r["extra"]["privacy_clip"] for r in rows]
    assert clips[0] == 10 and clips[-1] < clips[0] and whole.privacy.clip < clips[-1]  # 10 clips nothing: it shrinks
    assert run.evaluate()["privacy"]["adaptive_clip"]["final_clip"] == pytest.approx(whole.privacy.clip)
    crashed = small_run(tmp_path / "crash", *base)
    crashed.partition()
    with pytest.raises(SystemExit):
        crashed.train("federation", telemetry_sinks=[CrashAfterRound(2)])
    resumed = train_all(small_run(tmp_path / "crash", *base))
    assert resumed.privacy.clip == whole.privacy.clip and resumed.privacy.history == whole.privacy.history
    for k, v in whole.server.global_params.items():
        assert torch.equal(v, resumed.server.global_params[k])
    with pytest.raises(ConfigError, match="central"):
        load_config(None, [*base, "privacy.mode=local"])
