"""Fault: clients that fail inside a round, injected through a tiny FedAvg subclass used by this test
only (client 0 raises, client 1 returns NaN weights). They are left out of the round and counted in
its `failed_clients`; the round goes on while at least `train.min_clients` reported back, and below
that the phase stops with a clear message and writes nothing of that round."""

import json

import pytest
import torch
from runs import SMALL, small_run, swap_algorithm_class
from typer.testing import CliRunner

from fedpipe.algorithms.fedavg import FedAvg
from fedpipe.cli import app
from fedpipe.errors import TrainingError

OVERRIDES = ["method.name=fedavg", "partition.num_clients=4", "train.rounds=2", "run.threads=1"]
RAISES, RETURNS_NAN = 0, 1


class FaultyFedAvg(FedAvg):
    def client_result(self, ctx, slots, state):
        if ctx.client_id == RAISES:
            raise RuntimeError("simulated client crash: device lost")
        upload, state = super().client_result(ctx, slots, state)
        if ctx.client_id == RETURNS_NAN:
            upload = {name: torch.full_like(t, float("nan")) for name, t in upload.items()}
        return upload, state


@pytest.fixture
def faulty_clients(monkeypatch):
    swap_algorithm_class(monkeypatch, FaultyFedAvg)


def rounds(store):
    path = store / "test" / "report" / "rounds-federation.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_failing_clients_are_left_out_and_counted_while_enough_report(tmp_path, caplog, faulty_clients):
    run = small_run(tmp_path, *OVERRIDES, "train.min_clients=2")
    run.partition()
    with caplog.at_level("WARNING", logger="fedpipe"):
        state = run.train("federation")
    rows = rounds(tmp_path)
    assert [r["failed_clients"] for r in rows] == [2, 2] and [r["clients"] for r in rows] == [2, 2]
    assert all(torch.isfinite(t).all() for t in state.server.global_params.values())  # the NaNs never reached the model
    text = caplog.text
    assert "client 0 failed" in text and "device lost" in text
    assert "client 1 failed" in text and "non-finite" in text


def test_below_min_clients_the_phase_fails_clearly_and_keeps_nothing_of_the_round(tmp_path, faulty_clients):
    store = tmp_path / "store"
    small_run(store, *OVERRIDES, "train.min_clients=3").partition()
    args = [f"--set={s}" for s in [*SMALL, *OVERRIDES, "train.min_clients=3", f"run.store={store}", "run.id=test"]]
    result = CliRunner().invoke(app, ["train", "--phase", "federation", *args])
    assert result.exit_code == 2, result.output
    assert "error: Round 1 of phase 'federation': only 2 of 4 clients reported back (train.min_clients=3)" in result.output
    # the first failing client's warning carries its traceback (to find the bug in a method); the error is one paragraph
    error = result.output[result.output.index("error: "):]
    assert "Traceback" not in error and error.count("\n") == 1
    assert not list((store / "test").rglob("round-*.pt")) and not (store / "test" / "phases" / "federation" / "final.pt").exists()
    assert rounds(store) == []

    with pytest.raises(TrainingError, match="only 2 of 4 clients"):  # the same from the library
        small_run(store, *OVERRIDES, "train.min_clients=3").train("federation")
