"""`train.select` (issue 35): a federated phase can end with the round whose global model scored best on its
participants' validation splits, as the mixture-of-experts paper selects, and a resumed phase selects the same."""

from __future__ import annotations

import pytest
import torch
from runs import small_run

from fedpipe.engine.state import PhaseState
from fedpipe.run import callbacks

LOSSES = {1: 0.9, 2: 0.5, 3: 0.7, 4: 0.8}  # a hand-made trajectory of mean validation losses: round 2 is the best


def _run(tmp_path, *extra):
    return small_run(tmp_path, "method.name=fedavg", "train.rounds=4", "train.keep_checkpoints=10", "eval.every=0",
                     "train.select=best_val_loss", *extra)


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_best_val_loss_ends_with_the_best_round_and_survives_a_resume(tmp_path, monkeypatch):
    calls, seen = [], {}

    def scripted(self, params, phase, round_):
        calls.append(round_)
        seen[round_] = {k: v.clone() for k, v in params.items()}  # the global model each round scored
        if round_ == 3 and calls.count(3) == 1:
            raise RuntimeError("the pod was killed after round 2's checkpoint")
        return -LOSSES[round_]

    monkeypatch.setattr(callbacks.ModelSelection, "_score", scripted)
    run = _run(tmp_path)
    run.partition()
    with pytest.raises(RuntimeError, match="killed"):
        run.train("federation")
    final = _run(tmp_path).train("federation")  # resumed from round 2's checkpoint, and its selection with it
    assert calls == [1, 2, 3, 3, 4]  # rounds 1 and 2 were not scored again
    assert final.selection.round == 2
    assert _same(final.server.global_params, seen[2]) and not _same(final.server.global_params, seen[4])
    saved = PhaseState.from_bytes(run.store.get(run.layout.phase("federation").final), "cpu", clients=lambda r, inline, refs: inline)
    assert _same(saved.server.global_params, seen[2]) and saved.selection.round == 2  # what the next step reads


def test_the_real_criterion_is_checked_every_n_rounds(tmp_path):
    run = _run(tmp_path, "train.select_every=3")
    run.partition()
    final = run.train("federation")
    assert final.selection is not None and final.selection.round in (3, 4)  # round 3, and the last
    assert final.selection.score < 0  # a loss, negated


def test_last_is_the_default_and_leaves_run_ids_alone():
    from fedpipe.run.config import load_config

    assert load_config().train.select == "last"
    assert load_config(None, ["train.select=last"]).run_id() == load_config().run_id()
    assert load_config(None, ["train.select=best_val_loss"]).run_id() != load_config().run_id()
