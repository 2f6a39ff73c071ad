"""Small, fast runs on real data (mnist5k) for the engine's tests."""

from __future__ import annotations

from pathlib import Path

import torch

import fedpipe.run.run
from fedpipe.run.config import load_config
from fedpipe.run.run import Run

# 6 clients of the real mnist5k digits, the 784-200-200-10 MLP, 3 rounds of 1 epoch: a few seconds.
SMALL = [
    "partition.scheme=pathological",
    "partition.num_clients=6",
    "model.name=twonn",
    "train.rounds=3",
    "train.local_epochs=1",
    "train.batch_size=20",
    "telemetry.progress=false",
    "engine.clients=sequential",  # bitwise comparisons between runs need one way of training (see engine.clients)
]


def small_run(store: Path, *overrides: str, run_id: str = "test") -> Run:
    cfg = load_config(None, [*SMALL, f"run.store={store}", f"run.id={run_id}", *overrides])
    return Run(cfg)


def train_all(run: Run):
    """Partition and every training phase; returns the last phase's final state."""
    run.partition()
    state = None
    for phase in run.phases():
        state = run.train(phase.name)
    return state


def assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs"


class CrashAfterRound:
    """A telemetry sink that stops the process's phase right after round `n` is checkpointed: when
    round n + 1 is reported, which happens before that round's checkpoint is written."""

    def __init__(self, n):
        self.n = n

    def phase_started(self, event): ...

    def phase_finished(self, event): ...

    def close(self): ...

    def round_finished(self, event):
        if event.round == self.n + 1:
            raise SystemExit("simulated crash")


def swap_algorithm_class(monkeypatch, cls) -> None:
    """Runs built from now on (in this test) use `cls`, a subclass of the configured method's class, as
    their algorithm: how tests inject failing clients."""
    real = fedpipe.run.run.build_algorithm

    def build(params, model, seed):
        algorithm = real(params, model, seed)
        algorithm.__class__ = cls
        return algorithm

    monkeypatch.setattr(fedpipe.run.run, "build_algorithm", build)
