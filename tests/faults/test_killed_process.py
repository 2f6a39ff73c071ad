"""Fault: the training process killed with SIGKILL mid-phase. Started again, each phase resumes from its
last checkpoint and the run ends bitwise equal to an uninterrupted one."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from runs import SMALL, assert_same_params, small_run

OVERRIDES = ["method.name=superfed_mm", "train.rounds=6", "method.start_fraction=0.5"]


def cli(store, phase):
    args = [f"--set={s}" for s in [*SMALL, *OVERRIDES, f"run.store={store}", "run.id=test"]]
    return [sys.executable, "-m", "fedpipe.cli", "train", "--phase", phase, *args]


def wait_for(path, proc, timeout=120):
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the phase ended before it could be killed:\n{proc.stdout.read()}"
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.02)


@pytest.mark.slow
def test_killed_phase_resumes_to_the_same_weights(tmp_path):
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))  # this process's thread count: float sums depend on it
    run = small_run(killed, *OVERRIDES)
    run.partition()
    for phase in ("federation", "personalization"):
        proc = subprocess.Popen(cli(killed, phase), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        first = run.phases()[0 if phase == "federation" else 1].first_round
        wait_for(killed / "test" / "phases" / phase / f"round-{first + 1:05d}.pt", proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not (killed / "test" / "phases" / phase / "final.pt").exists(), "killed too late: the phase had finished"
        done = subprocess.run(cli(killed, phase), capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr
        assert f"Resuming phase {phase}" in done.stderr

    reference = small_run(clean, *OVERRIDES)
    reference.partition()
    for phase in reference.phases():
        expected = reference.train(phase.name)
    resumed = run.train("personalization")  # reads the finished state back
    assert_same_params(resumed.server.global_params, expected.server.global_params)
    for cid in expected.clients:
        assert_same_params(resumed.clients[cid], expected.clients[cid])
    # every round is reported once, even the ones run twice
    rounds = [line for line in (killed / "test" / "report" / "rounds-personalization.jsonl").read_text().splitlines()]
    assert len(rounds) == 3


KILLED_WHILE_REPLACING = """
import os, signal, sys
import fedpipe.store.folder as local
store = local.LocalStore(sys.argv[1])
store.put("run/rounds.jsonl", b"round 1\\n")
real = local._write_temp
def write_then_die(directory, data):
    if data == b"round 1\\nround 2\\n":  # the new bytes: die before they are renamed into place
        os.kill(os.getpid(), signal.SIGKILL)
    return real(directory, data)
local._write_temp = write_then_die
store.put("run/rounds.jsonl", b"round 1\\nround 2\\n")
"""


def test_a_process_killed_while_replacing_an_artifact_leaves_the_old_one_intact(tmp_path):
    """SIGKILL after the new hash is recorded but before the new bytes replace the old ones (the window
    a killed training process hits when it dies while rewriting its round log)."""
    from fedpipe.store import LocalStore

    proc = subprocess.run([sys.executable, "-c", KILLED_WHILE_REPLACING, str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    store = LocalStore(tmp_path)
    assert store.get("run/rounds.jsonl") == b"round 1\n"  # still intact, not reported as corrupt
    store.put("run/rounds.jsonl", b"round 1\nround 2\n")  # the next write goes through and settles the hash
    assert store.get("run/rounds.jsonl") == b"round 1\nround 2\n"
    assert len((tmp_path / "run" / ".sha256" / "rounds.jsonl").read_text().splitlines()) == 1
