"""Features no other test pins: the expected calibration error, top-5 accuracy, the candidate (lam)
chosen on the validation split and never on the test split, the learning-rate decay schedule, and
`engine.clients=auto` computing exactly what the engine it picked computes."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from runs import small_run, train_all
from torch.nn import functional as F

import fedpipe.engine.clients
from fedpipe.algorithms.base import ServerState
from fedpipe.data.federated import ClientData, FederatedData, Split
from fedpipe.engine.evaluation import evaluate_personalized, expected_calibration_error, score, score_segments

# --- ECE ---------------------------------------------------------------------------------------------


def _ece_by_hand(probs: torch.Tensor, y: torch.Tensor, bins: int) -> float:
    """Guo et al. 2017, Eq. 3, bin by bin: sum_b |B_b|/n |acc(B_b) - conf(B_b)|, bin b = (b/M, (b+1)/M]."""
    conf, pred = probs.max(dim=1)
    total = 0.0
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        inside = [i for i in range(len(y)) if lo < conf[i] <= hi or (b == 0 and conf[i] == 0)]
        if inside:
            acc = sum(float(pred[i] == y[i]) for i in inside) / len(inside)
            mean_conf = sum(float(conf[i]) for i in inside) / len(inside)
            total += len(inside) / len(y) * abs(acc - mean_conf)
    return total


def test_ece_is_the_binned_gap_between_confidence_and_accuracy():
    # two samples at confidence 0.9 (one right), one at 0.6 (right), one at 0.3 (wrong), 10 bins:
    # |0.5 - 0.9| * 2/4 + |1 - 0.6| * 1/4 + |0 - 0.3| * 1/4 = 0.2 + 0.1 + 0.075
    probs = torch.tensor([[0.9, 0.05, 0.05], [0.9, 0.05, 0.05], [0.2, 0.6, 0.2], [0.3, 0.3, 0.4]], dtype=torch.float64)
    probs[3] = torch.tensor([0.35, 0.35, 0.3], dtype=torch.float64)  # top class 0 at 0.35, label 2: wrong
    y = torch.tensor([0, 1, 1, 2])
    expected = 0.5 * abs(0.5 - 0.9) + 0.25 * abs(1 - 0.6) + 0.25 * abs(0 - 0.35)
    assert expected_calibration_error(probs, y, 10) == pytest.approx(expected, abs=1e-12)
    # one bin: the gap between mean confidence and accuracy; a bin per sample here: the mean gap
    assert expected_calibration_error(probs, y, 1) == pytest.approx(abs(0.5 - (0.9 + 0.9 + 0.6 + 0.35) / 4), abs=1e-12)
    assert expected_calibration_error(probs, y, 5) == pytest.approx(_ece_by_hand(probs, y, 5), abs=1e-12)
    gen = torch.Generator().manual_seed(0)
    for bins in (1, 3, 15):
        p = torch.softmax(3 * torch.randn(200, 10, generator=gen, dtype=torch.float64), dim=1)
        t = torch.randint(0, 10, (200,), generator=gen)
        assert expected_calibration_error(p, t, bins) == pytest.approx(_ece_by_hand(p, t, bins), abs=1e-12)
    # perfectly confident and right: 0; confident and always wrong: 1
    one_hot = torch.eye(3, dtype=torch.float64)
    assert expected_calibration_error(one_hot, torch.arange(3), 15) == 0
    assert expected_calibration_error(one_hot, (torch.arange(3) + 1) % 3, 15) == pytest.approx(1)
    # and `score` reports it from logits (softmax first)
    logits = torch.log(probs)
    assert score(logits, y, 10).ece == pytest.approx(expected, abs=1e-9)


# --- top-5 -------------------------------------------------------------------------------------------


def test_top5_counts_a_label_among_the_five_highest_logits():
    # 7 classes; the label ranks 1st, 3rd, 5th, 6th and 7th in the five rows
    logits = torch.tensor([[7.0, 6, 5, 4, 3, 2, 1]]).repeat(5, 1)
    y = torch.tensor([0, 2, 4, 5, 6])
    s = score(logits, y, None)
    assert s.accuracy == pytest.approx(1 / 5) and s.top5 == pytest.approx(3 / 5)
    # with fewer than five classes every label is in the top five
    assert score(torch.tensor([[1.0, 0, 0], [0, 1.0, 0]]), torch.tensor([2, 2]), None).top5 == 1


def test_scoring_many_segments_at_once_equals_scoring_each_alone():
    """`score_segments` (a block of clients' candidates scored together) against `score` of each run by
    hand: accuracy, top-5, loss and ECE of every segment, an empty one NaN."""
    g = torch.Generator().manual_seed(3)
    sizes = [5, 1, 0, 12, 7]
    logits = torch.randn(sum(sizes), 8, generator=g) * 3
    y = torch.randint(0, 8, (sum(sizes),), generator=g)
    together = score_segments(logits, y, sizes, 10)
    start = 0
    for size, got in zip(sizes, together):
        alone = logits[start : start + size], y[start : start + size]
        start += size
        assert got.n == size
        if size == 0:
            assert math.isnan(got.accuracy) and math.isnan(got.loss) and math.isnan(got.ece)
            continue
        acc = (alone[0].argmax(1) == alone[1]).double().mean().item()
        loss = F.cross_entropy(alone[0].double(), alone[1]).item()
        probs = torch.softmax(alone[0].double(), dim=1)
        assert (got.accuracy, got.loss) == (pytest.approx(acc, abs=1e-12), pytest.approx(loss, abs=1e-5))
        assert got.top5 == pytest.approx((alone[0].topk(5, dim=1).indices == alone[1][:, None]).any(1).double().mean().item())
        assert got.ece == pytest.approx(_ece_by_hand(probs, alone[1], 10), abs=1e-9)


# --- the candidate is chosen on validation, not on test ------------------------------------------------


class TwoCandidates:
    """A stub method with two personalized candidates: 'A' predicts class 0, 'B' class 1."""

    model = torch.nn.Identity()
    candidate_label = "lam"

    def personalized_candidates(self, server, state, client_id):
        return [(0.0, {"cls": torch.tensor(0)}), (1.0, {"cls": torch.tensor(1)})]

    def global_model(self, server):  # the evaluation asks which candidates are the server's own models
        return None

    def forward(self, params, x):
        return torch.nn.functional.one_hot(torch.full((len(x),), int(params["cls"])), 2).float() * 5


def _split(labels):
    return Split(torch.zeros(len(labels), 1), torch.tensor(labels))


def test_the_candidate_is_picked_on_the_validation_split_and_scored_on_test():
    # validation says candidate 0 (class 0), test would say candidate 1: the headline is candidate 0's
    # test accuracy; the test-oracle pick is reported apart
    client = ClientData(0, train=_split([1, 1, 1]), val=_split([0, 0, 0, 1]), test=_split([1, 1, 1, 0]), opt_out=False)
    data = FederatedData((client,), _split([0, 1]), 2, (1,))
    result = evaluate_personalized(TwoCandidates(), ServerState({}), {}, data, 10, 5)
    (c,) = result.clients
    assert c.chosen == 0 and c.oracle == 1
    assert c.accuracy == pytest.approx(0.25) and result.mean_accuracy == pytest.approx(0.25)
    assert result.oracle_mean_accuracy == pytest.approx(0.75)
    # without a validation split the choice falls back to the training split (never to test)
    client = ClientData(0, train=_split([0, 0, 1]), val=_split([]), test=_split([1, 1, 1, 0]), opt_out=False)
    (c,) = evaluate_personalized(TwoCandidates(), ServerState({}), {}, FederatedData((client,), _split([0]), 2, (1,)), 10, 5).clients
    assert c.chosen == 0 and c.accuracy == pytest.approx(0.25)


# --- learning-rate decay ---------------------------------------------------------------------------------


def test_learning_rate_decays_every_round_across_phases(tmp_path, monkeypatch):
    """lr_r = lr * lr_decay^(r - 1), r the global round (fine-tuning rounds continue the count), and
    it is what each client's optimiser gets."""
    seen: dict[int, set[float]] = {}
    real = fedpipe.engine.clients.train_client

    def recording(algorithm, ctx, slots, stages, **kw):
        seen.setdefault(ctx.round, set()).add(kw["lr"])
        return real(algorithm, ctx, slots, stages, **kw)

    monkeypatch.setattr(fedpipe.engine.clients, "train_client", recording)
    run = small_run(tmp_path, "method.name=fedavg_ft", "train.lr=0.08", "train.lr_decay=0.5", "train.rounds=3",
                    "partition.num_clients=3", "data.dataset=digits", "run.threads=1")
    train_all(run)
    assert sorted(seen) == [1, 2, 3, 4]  # 3 federated rounds, then the fine-tuning round
    for r, lrs in seen.items():
        assert len(lrs) == 1 and lrs.pop() == pytest.approx(0.08 * 0.5 ** (r - 1), rel=1e-12), r


# --- engine.clients=auto is the engine it picked ------------------------------------------------------


def test_auto_computes_the_same_numbers_as_the_engine_it_picked(tmp_path, caplog):
    """auto on a CPU trains one by one (fedpipe.engine.choice), says so, and its numbers are bit for bit
    those of engine.clients=sequential, not those of batched."""
    overrides = ["method.name=fedavg", "train.rounds=2", "data.dataset=digits", "partition.num_clients=4", "run.threads=1"]
    with caplog.at_level(logging.INFO, logger="fedpipe.run.run"):
        auto = train_all(small_run(tmp_path / "auto", *overrides, "engine.clients=auto", "engine.processes=auto"))
    said = [r.getMessage() for r in caplog.records if ": clients trained " in r.getMessage()]
    assert said and all("clients trained one by one in 1 process (" in m for m in said), said
    named = train_all(small_run(tmp_path / "named", *overrides, "engine.clients=sequential", "engine.processes=1"))
    other = train_all(small_run(tmp_path / "other", *overrides, "engine.clients=batched", "engine.processes=1"))
    for k in named.server.global_params:
        assert torch.equal(auto.server.global_params[k], named.server.global_params[k]), k
    # (the two engines agree only within float tolerance, so bitwise equality says which one ran)
    assert any(not torch.equal(auto.server.global_params[k], other.server.global_params[k]) for k in other.server.global_params)
