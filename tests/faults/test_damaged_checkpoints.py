"""Fault: a checkpoint damaged on disk (one flipped byte, or cut short). It is detected by its sha256,
reported in the log, and the previous good checkpoint is used; with no good one left the phase stops
with a clear error instead of loading anything."""

import pytest
from runs import CrashAfterRound, assert_same_params, small_run

from fedpipe.errors import CorruptArtifactError

OVERRIDES = ["method.name=fedavg", "partition.num_clients=3", "train.rounds=4", "train.keep_checkpoints=3", "run.threads=1"]


@pytest.fixture(scope="module")
def expected(tmp_path_factory):
    reference = small_run(tmp_path_factory.mktemp("reference"), *OVERRIDES)
    reference.partition()
    return reference.train("federation")


def crashed_after_round_3(store):
    """A run whose phase stopped right after round 3's checkpoint: rounds 1-3 are on disk."""
    run = small_run(store, *OVERRIDES)
    run.partition()
    with pytest.raises(SystemExit):
        run.train("federation", telemetry_sinks=[CrashAfterRound(3)])
    return run, store / "test" / "phases" / "federation"


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


@pytest.mark.parametrize("damage", [flip_a_byte, truncate], ids=["flipped-byte", "truncated"])
def test_a_damaged_checkpoint_is_skipped_for_the_previous_good_one(tmp_path, caplog, expected, damage):
    run, folder = crashed_after_round_3(tmp_path)
    damage(folder / "round-00003.pt")

    with caplog.at_level("INFO", logger="fedpipe"):
        resumed = run.train("federation")
    warning = next(r.getMessage() for r in caplog.records if "Skipping damaged checkpoint of round 3" in r.getMessage())
    assert "round-00003.pt" in warning and "sha256" in warning  # found by its hash, named in the log
    assert "Resuming phase federation of run test after round 2" in caplog.text
    assert_same_params(resumed.server.global_params, expected.server.global_params)


def test_with_no_good_checkpoint_left_the_phase_stops_with_a_clear_error(tmp_path, caplog):
    run, folder = crashed_after_round_3(tmp_path)
    for n, damage in ((1, truncate), (2, flip_a_byte), (3, truncate)):
        damage(folder / f"round-{n:05d}.pt")

    with caplog.at_level("WARNING", logger="fedpipe"), pytest.raises(CorruptArtifactError) as err:
        run.train("federation")
    message = str(err.value)
    assert "Every checkpoint of this phase is damaged" in message and "round-00003.pt" in message
    assert "Delete" in message  # says how to go on
    assert sum("Skipping damaged checkpoint" in r.getMessage() for r in caplog.records) == 3
    assert not (folder / "final.pt").exists() and not (folder / "round-00004.pt").exists()
