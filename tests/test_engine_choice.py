"""engine.clients / engine.processes = auto: decided from static facts, recorded, reused; never timed.

Once `auto` timed the two ways of training on round 1 and kept the faster, so the same config and
seed gave different numbers on a busy and a quiet machine (the ways agree within float tolerance,
not bit for bit). These tests pin that the choice no longer depends on timings, and that a rerun on a
machine with other cores computes what the first attempt computed.
"""

from __future__ import annotations

import itertools
import random
import time

import pytest
from runs import assert_same_params, small_run, train_all

import fedpipe.run.run
from fedpipe.engine import choice as engine_choice_module
from fedpipe.engine.choice import MIN_SAMPLES_FOR_PROCESSES, EngineChoice, choose, clients_mode, usable_cores
from fedpipe.errors import CorruptArtifactError
from fedpipe.run.run import engine_choice

AUTO = ["engine.clients=auto", "engine.processes=auto"]


def facts(**kw):
    base = dict(clients="auto", processes="auto", threads=None, device_type="cpu", cores=2, clients_per_round=20, samples_per_round=14_000)
    return {**base, **kw}


def test_auto_trains_one_by_one_in_a_process_per_core_on_a_cpu_with_enough_work():
    made = choose(**facts())
    assert (made.clients, made.processes, made.threads) == ("sequential", 2, 1)
    assert choose(**facts(cores=16, clients_per_round=5)).processes == 5  # never more processes than clients


@pytest.mark.parametrize("change", [dict(cores=1), dict(clients_per_round=1), dict(samples_per_round=MIN_SAMPLES_FOR_PROCESSES - 1)])
def test_auto_stays_in_one_process_when_processes_cannot_pay(change):
    made = choose(**facts(**change))
    assert (made.clients, made.processes) == ("sequential", 1)
    assert "one process" in made.why


def test_auto_batches_on_a_gpu_in_one_process_and_explicit_values_win():
    assert (choose(**facts(device_type="cuda")).clients, choose(**facts(device_type="cuda")).processes) == ("batched", 1)
    made = choose(**facts(clients="batched", processes=3))
    assert (made.clients, made.processes) == ("batched", 3)
    assert clients_mode("sequential", "cuda") == "sequential"


def test_usable_cores_follows_the_affinity_mask(monkeypatch):
    monkeypatch.setattr(engine_choice_module.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert 1 <= usable_cores() <= 3


def jittery_clock():
    """A perf_counter whose intervals are random: what a loaded machine looks like to a timer."""
    rng, now = random.Random(7), itertools.count()
    real = time.perf_counter

    def clock():
        next(now)
        return real() + rng.uniform(0, 5)

    return clock


def test_two_runs_with_different_timings_give_identical_results(tmp_path, monkeypatch):
    """auto on both engine fields; the second run sees a clock that jumps at random. Results are bit
    for bit the same (with a timed choice they were not: the two ways differ in the last bits)."""
    first = train_all(small_run(tmp_path / "a", *AUTO, "method.name=superfed_mm"))
    monkeypatch.setattr(time, "perf_counter", jittery_clock())
    second = train_all(small_run(tmp_path / "b", *AUTO, "method.name=superfed_mm"))
    assert_same_params(first.server.global_params, second.server.global_params)
    for cid in first.clients:
        assert_same_params(first.clients[cid], second.clients[cid])


def test_a_rerun_on_other_cores_reuses_the_recorded_choice(tmp_path, monkeypatch):
    run = small_run(tmp_path, *AUTO, "partition.num_clients=20", "train.local_epochs=3", "train.rounds=1")
    run.partition()
    monkeypatch.setattr(fedpipe.run.run, "usable_cores", lambda: 1)
    first = engine_choice(run, "federation")
    assert first.processes == 1
    recorded = run.layout.phase("federation").engine_choice
    assert not run.store.exists(recorded)  # written by the phase, once its inputs have been read
    run.train("federation")
    assert run.store.exists(recorded)
    run.store.delete(run.layout.phase("federation").final)  # as if the phase had been stopped: it is trained again
    monkeypatch.setattr(fedpipe.run.run, "usable_cores", lambda: 8)  # the rerun's machine has more cores
    again = engine_choice(run, "federation")
    assert (again.clients, again.processes, again.why) == (first.clients, first.processes, first.why)
    run.store.delete(recorded)  # without the record, the new machine's facts decide
    assert engine_choice(run, "federation").processes > 1


def test_an_explicit_setting_overrides_the_record(tmp_path):
    run = small_run(tmp_path, *AUTO)
    run.partition()
    run.store.put_text(run.layout.phase("federation").engine_choice, '{"clients": "batched", "processes": 1, "threads": null, "why": "x"}')
    pinned = small_run(tmp_path, "engine.clients=sequential", "engine.processes=auto")
    assert engine_choice(pinned, "federation") == EngineChoice("sequential", 1, None, "x", recorded=True)


def test_a_damaged_engine_record_is_named_with_the_fix(tmp_path):
    run = small_run(tmp_path, *AUTO)
    run.partition()
    run.store.put_text(run.layout.phase("federation").engine_choice, '{"clients": "batched"}')
    with pytest.raises(CorruptArtifactError, match="engine.json is not a valid engine choice. Delete it"):
        engine_choice(run, "federation")
