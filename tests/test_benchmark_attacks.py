"""benchmarks/attacks.py's attackers do what they say, on tiny tensors: the sign flip, the scaled model replacement,
"a little is enough" (its z_max from Baruch et al.'s formula and its per-coordinate mean minus z_max std), the pattern
stamp; and the round wrapper replaces only the malicious clients' outcomes."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_attacks", ROOT / "benchmarks" / "attacks.py")
attacks = importlib.util.module_from_spec(spec)
sys.modules["bench_attacks"] = attacks
spec.loader.exec_module(attacks)

G = {"w": torch.tensor([1.0, -1.0]), "b": torch.tensor([0.5])}


def test_sign_flip_is_the_flipped_scaled_update():
    honest = {"w": torch.tensor([2.0, 1.0]), "b": torch.tensor([0.0])}  # u = (1, 2 | -0.5)
    got = attacks.sign_flip(G, honest, 10.0)
    assert got["w"].tolist() == [-9.0, -21.0] and got["b"].tolist() == [5.5]


def test_model_replacement_scales_the_backdoored_models_difference():
    x = {"w": torch.tensor([1.5, -1.0]), "b": torch.tensor([0.0])}
    got = attacks.model_replacement(G, x, 4.0)
    assert got["w"].tolist() == [3.0, -1.0] and got["b"].tolist() == [-1.5]
    same = attacks.model_replacement(G, x, 1.0)
    assert all(torch.equal(same[k], x[k]) for k in G)


def test_alie_z_max_follows_baruch_et_al():
    # s = floor(n/2 + 1) - a; z = Phi^-1((n - s) / n)
    assert attacks.alie_z(10, 1) == pytest.approx(0.0, abs=1e-12)  # s = 5: (10 - 5) / 10 = 0.5
    assert attacks.alie_z(10, 3) == pytest.approx(0.5244005, abs=1e-6)  # s = 3: Phi^-1(0.7)
    assert attacks.alie_z(50, 12) == pytest.approx(0.5828415, abs=1e-6)  # their MNIST setting (24% of 50): s = 14, Phi^-1(0.72)
    assert math.isfinite(attacks.alie_z(4, 3))


def test_alie_is_the_mean_minus_z_max_std_of_the_honest_updates():
    honest = [{"w": G["w"] + torch.tensor([u, 2 * u]), "b": G["b"] + torch.tensor([0.0])} for u in (1.0, 2.0, 3.0, 6.0)]
    # updates' first coordinate 1, 2, 3, 6: mean 3, sample std sqrt(14 / 3)
    got = attacks.alie(G, honest, 10, 3)
    z, std = attacks.alie_z(10, 3), math.sqrt(14 / 3)
    assert got["w"].tolist() == pytest.approx([1.0 + 3 - z * std, -1.0 + 6 - z * 2 * std], abs=1e-5)
    assert got["b"].tolist() == [0.5]


def test_the_stamp_whitens_the_bottom_right_3x3_only():
    x = torch.zeros(2, 1, 5, 5)
    got = attacks.stamp(x, 1.0)
    assert got[..., 2:, 2:].eq(1.0).all() and got.sum() == 2 * 9 and x.sum() == 0


def test_the_wrapper_replaces_only_the_malicious_outcomes():
    from fedpipe.engine.clients import ClientOutcome, ClientWork

    class Trainer:  # the ClientTrainer surface the wrapper uses; client 0 states 10^6 samples, the others their own
        by_id = {c: type("C", (), {"train": [0] * (10 + c), "test": [0] * 4})() for c in range(4)}

        def _train(self, works, round_, lr):
            return [ClientOutcome(w.client_id, 10**6 if w.client_id == 0 else 10 + w.client_id,
                                  {k: v + 1 for k, v in w.download.items()}) for w in works]

    works = [ClientWork(c, G, None) for c in range(4)]
    outcomes, averaged = attacks.Attacked(Trainer(), "sign_flip", 1, census=False, privacy=None, white=1.0)(1, 0.1, works)
    assert averaged is None
    assert outcomes[0].upload["w"].tolist() == [1.0 - 10.0, -1.0 - 10.0]  # gamma = 10 / 1
    assert all(o.upload["w"].tolist() == [2.0, 0.0] for o in outcomes[1:])
    census, _ = attacks.Attacked(Trainer(), "none", 0, census=True, privacy=None, white=1.0)(1, 0.1, works)
    # the census (fedpipe's federation rule): client 0's reply states 10^6 against its 10 and is refused; the others stand
    assert census[0].upload is None and "census counted 10" in census[0].error
    assert [(o.num_samples, o.error) for o in census[1:]] == [(11, None), (12, None), (13, None)]
