"""The suite itself (issue 43, A19): two test workers on a 2-core machine must not run 2x the threads it has."""

from __future__ import annotations

import os

import torch


def test_each_test_worker_uses_its_share_of_the_cores():
    """Under pytest-xdist each worker's torch takes cores / workers intra-op threads (tests/conftest.py), and the
    OpenMP pool of a child process it starts inherits OMP_NUM_THREADS. Alone (no xdist), the whole machine."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = len(os.sched_getaffinity(0))
    assert torch.get_num_threads() <= max(1, cores // workers), (torch.get_num_threads(), cores, workers)
    if workers > 1:
        assert int(os.environ["OMP_NUM_THREADS"]) <= max(1, cores // workers)
