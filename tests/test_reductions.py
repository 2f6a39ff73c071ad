"""Reductions the papers state, run end to end on real data with the same seed (CPU, bitwise)."""

import torch
from runs import assert_same_params, small_run, train_all


def final_global(tmp_path, *overrides):
    return train_all(small_run(tmp_path / "store", *overrides)).server.global_params


def test_superfed_with_mu_nu_zero_and_no_phase_two_is_fedavg(tmp_path):
    fedavg = final_global(tmp_path / "a", "method.name=fedavg")
    for variant in ("superfed_mm", "superfed_lm"):
        superfed = final_global(
            tmp_path / variant, f"method.name={variant}", "method.mu=0", "method.nu=0", "method.start_fraction=1.0"
        )
        assert_same_params(superfed, fedavg)


def test_fedprox_with_mu_zero_is_fedavg_and_with_mu_it_is_not(tmp_path):
    fedavg = final_global(tmp_path / "a", "method.name=fedavg")
    assert_same_params(final_global(tmp_path / "b", "method.name=fedprox", "method.mu=0"), fedavg)
    prox = final_global(tmp_path / "c", "method.name=fedprox", "method.mu=0.5")
    assert any(not torch.equal(prox[n], fedavg[n]) for n in fedavg)


def test_superfed_with_nu_zero_and_no_phase_two_is_fedprox_with_layer_norms(tmp_path):
    fedprox = final_global(tmp_path / "a", "method.name=fedprox", "method.mu=0.3", "method.proximal=layer_norms")
    superfed = final_global(tmp_path / "b", "method.name=superfed_mm", "method.mu=0.3", "method.nu=0", "method.start_fraction=1.0")
    assert_same_params(superfed, fedprox)


def test_same_seed_same_numbers_other_seed_other_numbers(tmp_path):
    a = train_all(small_run(tmp_path / "a", "method.name=superfed_lm", "train.rounds=2", "method.start_fraction=0.5"))
    b = train_all(small_run(tmp_path / "b", "method.name=superfed_lm", "train.rounds=2", "method.start_fraction=0.5"))
    assert_same_params(a.server.global_params, b.server.global_params)
    assert a.clients.keys() == b.clients.keys() and a.clients
    for cid in a.clients:
        assert_same_params(a.clients[cid], b.clients[cid])
    c = train_all(small_run(tmp_path / "c", "method.name=superfed_lm", "train.rounds=2", "method.start_fraction=0.5", "run.seed=1"))
    assert any(not torch.equal(c.server.global_params[n], a.server.global_params[n]) for n in a.server.global_params)
