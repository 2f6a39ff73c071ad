"""A phase over two processes (torch.distributed, gloo) ends with the same weights as one process:
started by `engine.processes=2`, and by a real `torchrun`. Both aggregation paths are covered:
the all-reduce of weighted sums (default averaging) and the gather of uploads (a method with its
own aggregation)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from runs import assert_same_params, small_run, train_all

from fedpipe.engine.clients import ClientWork
from fedpipe.engine.distributed import assign

UNEQUAL = ["partition.scheme=dirichlet", "partition.alpha=0.5", "train.rounds=2", "run.threads=1"]


def _same_state(a, b) -> None:
    assert_same_params(a.server.global_params, b.server.global_params)
    assert a.server.per_client.keys() == b.server.per_client.keys()
    for cid in a.server.per_client:
        assert_same_params(a.server.per_client[cid], b.server.per_client[cid])
    assert a.clients.keys() == b.clients.keys()
    for cid in a.clients:
        assert_same_params(a.clients[cid], b.clients[cid])


@pytest.mark.parametrize(
    "method, extra",
    [
        ("superfed_mm", ["method.start_fraction=0.5"]),  # all-reduce, and clients' local models kept on rank 0
        ("fedamp", []),  # its own aggregation: uploads gathered on rank 0
    ],
)
def test_two_processes_end_with_the_weights_of_one(tmp_path, method, extra):
    overrides = [f"method.name={method}", *UNEQUAL, *extra]
    one = train_all(small_run(tmp_path / "one", *overrides))
    two = train_all(small_run(tmp_path / "two", *overrides, "engine.processes=2"))
    _same_state(one, two)  # bitwise: float64 sums of float32 uploads, divided once


def test_a_torchrun_launched_phase_equals_one_process(tmp_path):
    overrides = ["method.name=fedavg", *UNEQUAL]
    one = train_all(small_run(tmp_path / "one", *overrides))
    run = small_run(tmp_path / "two", *overrides)
    run.partition()
    torchrun = Path(sys.executable).with_name("torchrun")
    args = [a for o in overrides for a in ("--set", o)]
    common = ["--set", "train.rounds=2", "--set", f"run.store={tmp_path / 'two'}", "--set", "run.id=test"]
    from runs import SMALL

    small = [a for o in SMALL for a in ("--set", o)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node=2", "-m", "fedpipe.cli", "train", "--phase", "federation", *small, *args, *common],
        capture_output=True, text=True, env=env, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("phase federation finished at round 2") == 1  # rank 0 reports, rank 1 is quiet
    state = run.train("federation")  # reads the final state the torchrun job wrote
    assert_same_params(one.server.global_params, state.server.global_params)


def test_clients_go_to_the_least_loaded_rank_largest_first():
    works = [ClientWork(cid, {}, None) for cid in range(5)]
    sizes = {0: 10, 1: 50, 2: 30, 3: 30, 4: 5}
    shares = assign(works, sizes, 2)
    # 1 (50) -> rank 0; 2 (30) -> 1; 3 (30) -> 1 (30 < 50); 0 (10) -> 0 (50 < 60); 4 (5) -> 0 (tie 60-60: lower rank)
    assert [[w.client_id for w in s] for s in shares] == [[0, 1, 4], [2, 3]]
    assert sorted(w.client_id for s in shares for w in s) == list(range(5))
    assert torch.tensor([len(s) for s in assign(works, sizes, 8)]).sum() == 5
