"""A phase killed mid-run (SIGKILL) and started again ends with the same weights as an uninterrupted run."""

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


class CrashAfterRound:
    """A telemetry sink that stops the process's phase right after round `n` is checkpointed."""

    def __init__(self, n):
        self.n = n

    def phase_started(self, event): ...

    def phase_finished(self, event): ...

    def close(self): ...

    def round_finished(self, event):
        if event.round == self.n:
            raise SystemExit("simulated crash")


def test_a_damaged_checkpoint_is_skipped_for_the_previous_good_one(tmp_path, caplog):
    overrides = ["method.name=fedavg", "train.rounds=4", "train.keep_checkpoints=3"]
    reference = small_run(tmp_path / "ref", *overrides)
    reference.partition()
    expected = reference.train("federation")

    run = small_run(tmp_path / "a", *overrides)
    run.partition()
    with pytest.raises(SystemExit):
        run.train("federation", telemetry_sinks=[CrashAfterRound(3)])
    latest = tmp_path / "a" / "test" / "phases" / "federation" / "round-00003.pt"
    data = bytearray(latest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    latest.write_bytes(bytes(data))

    with caplog.at_level("WARNING"):
        resumed = run.train("federation")
    assert "Skipping damaged checkpoint of round 3" in caplog.text and "round-00003.pt" in caplog.text
    assert_same_params(resumed.server.global_params, expected.server.global_params)
