"""Inputs that size work or memory are bounded (issue 21, part 5): an oversized config field is refused
with a message naming the field and its bound; worker processes never outnumber the usable cores,
whether the config or a recorded engine.json asks for them; round logs are size-checked before they
are read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runs import SMALL, small_run

import fedpipe.engine.choice
import fedpipe.engine.distributed
import fedpipe.telemetry.jsonl
from fedpipe.engine.choice import EngineChoice
from fedpipe.errors import ConfigError, CorruptArtifactError
from fedpipe.run.config import load_config
from fedpipe.store import open_store
from fedpipe.telemetry.jsonl import JsonlSink, read_rounds

EXAMPLES = sorted(p for p in (Path(__file__).parent.parent / "examples").glob("*.yaml") if not p.name.startswith("study_"))  # run configs


@pytest.mark.parametrize(
    "overrides, field, bound",
    [
        (["engine.processes=100000"], "engine.processes", "1024"),
        (["train.rounds=1000000000"], "train.rounds", "100000"),
        (["method.name=fedmn", "method.router_feature_dim=1000000000"], "router_feature_dim", "65536"),
        (["method.name=fedmn", "method.router_label_dim=1000000000"], "router_label_dim", "65536"),
        (["method.name=fedmn", "method.units=100,100,100", "method.hidden=8,8"], "units", "4,096 paths"),
        (["method.name=fedmn", "method.hidden=1000000,8"], "hidden", "65,536"),
        (["train.local_epochs=1000000"], "train.local_epochs", "10000"),
        (["train.batch_size=1000000000"], "train.batch_size", "1000000"),
        (["train.min_clients=10000000"], "train.min_clients", "1000000"),
        (["train.keep_checkpoints=1000000"], "train.keep_checkpoints", "1000"),
        (["eval.batch_size=1000000000"], "eval.batch_size", "1000000"),
        (["eval.ece_bins=1000000000"], "eval.ece_bins", "10000"),
        (["eval.every=1000000000"], "eval.every", "100000"),
        (["engine.chunk=1000000000"], "engine.chunk", "1000000"),
        (["engine.state_memory_mb=1e12"], "engine.state_memory_mb", "1048576"),
        (["run.threads=100000"], "run.threads", "1024"),
        (["telemetry.pushgateway_retention_seconds=1000000000"], "pushgateway_retention_seconds", "3600"),
        (["partition.num_clients=100000000"], "partition.num_clients", "1,000,000"),
        (["method.name=fedmoe", "method.max_epochs=1000000000"], "max_epochs", "10000"),
        (["method.name=pfedmb", "method.num_branches=100000"], "num_branches", "64"),
        (["method.name=ifca", "method.clusters=100000"], "clusters", "1024"),
        (["method.name=fedfomo", "method.models_per_round=100000"], "models_per_round", "1024"),
        (["method.name=pfedme", "method.inner_steps=100000000"], "inner_steps", "10000"),
        (["method.name=ditto", "method.personal_epochs=100000000"], "personal_epochs", "10000"),
        (["method.name=fedavg", "method.finetune_epochs=100000000"], "finetune_epochs", "10000"),
        (["method.name=superfed_mm", "method.lam_grid_step=0.000000001"], "lam_grid_step", "0.001"),
    ],
    ids=lambda v: v if isinstance(v, str) and "." not in v and not v[0].isdigit() else None,
)
def test_an_oversized_field_is_refused_naming_the_field_and_its_bound(overrides, field, bound):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert field in str(e.value) and bound in str(e.value), str(e.value)


def test_every_example_stays_within_the_bounds():
    assert EXAMPLES
    for path in EXAMPLES:
        load_config(path)  # raises on a bound an example exceeds


def test_generous_values_are_still_accepted():
    cfg = load_config(None, ["train.rounds=2000", "engine.processes=64", "method.name=fedmn", "method.router_feature_dim=1024",
                             "partition.num_clients=1000", "eval.every=0"])
    assert cfg.train.rounds == 2000 and cfg.engine.processes == 64


def _spy_spawn(monkeypatch):
    started = {}

    class Stop(Exception):
        pass

    def spawn(recipe, world, port, threads):
        started.update(world=world, threads=threads)
        raise Stop

    monkeypatch.setattr(fedpipe.engine.distributed, "spawn_workers", spawn)
    return started, Stop


def test_configured_processes_are_clamped_to_the_usable_cores(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(fedpipe.engine.choice, "usable_cores", lambda: 2)
    started, stop = _spy_spawn(monkeypatch)
    run = small_run(tmp_path, "engine.processes=1000")
    run.partition()
    with pytest.raises(stop):
        run.train("federation")
    assert started["world"] == 2
    assert "1000 worker processes asked for" in caplog.text


def test_processes_from_a_hostile_engine_json_are_clamped(tmp_path, monkeypatch):
    monkeypatch.setattr(fedpipe.engine.choice, "usable_cores", lambda: 2)
    started, stop = _spy_spawn(monkeypatch)
    run = small_run(tmp_path, "engine.clients=auto", "engine.processes=auto")
    run.partition()
    hostile = {"clients": "sequential", "processes": 100_000, "threads": 1_000_000, "why": "hostile"}
    run.store.put_text(run.layout.phase("federation").engine_choice, json.dumps(hostile))
    with pytest.raises(stop):
        run.train("federation")
    assert started == {"world": 2, "threads": 2}


def test_a_hostile_engine_json_on_one_core_trains_in_this_process(tmp_path, monkeypatch):
    monkeypatch.setattr(fedpipe.engine.choice, "usable_cores", lambda: 1)
    started, _ = _spy_spawn(monkeypatch)
    run = small_run(tmp_path, "engine.clients=auto", "engine.processes=auto", "train.rounds=1")
    run.partition()
    run.store.put_text(run.layout.phase("federation").engine_choice,
                       json.dumps({"clients": "sequential", "processes": 100_000, "threads": None, "why": "hostile"}))
    assert run.train("federation") is not None
    assert started == {}


def test_a_recorded_choice_stays_within_the_configs_bound():
    # the ranks re-validate the run's config with the recorded number of processes in it
    made = EngineChoice.from_json({"clients": "sequential", "processes": 100_000, "threads": None, "why": "x"})
    assert made.processes == 1024
    load_config(None, [f"engine.processes={made.processes}"])


@pytest.mark.parametrize("bad", [{"clients": "sequential", "processes": 0}, {"clients": "sequential", "processes": -3},
                                 {"clients": "rm -rf", "processes": 1}, {"clients": "batched", "processes": 1, "threads": 0}])
def test_an_impossible_engine_json_is_refused(bad):
    with pytest.raises(ValueError):
        EngineChoice.from_json(bad)


def test_an_oversized_round_log_is_refused_before_it_is_fetched(tmp_path, monkeypatch):
    store = open_store(str(tmp_path))
    key = "run/report/rounds-federation.jsonl"
    store.put_text(key, json.dumps({"round": 1, "seconds": 1.0}) + "\n" + "x" * 5000)
    monkeypatch.setattr(fedpipe.telemetry.jsonl, "MAX_ROUND_LOG_BYTES", 1000)
    fetched = []
    get = store.get
    monkeypatch.setattr(store, "get", lambda k: fetched.append(k) or get(k))
    with pytest.raises(CorruptArtifactError, match="rounds-federation.jsonl is .* more than"):
        read_rounds(store, [key])
    with pytest.raises(CorruptArtifactError, match="round log"):
        JsonlSink(store, key)
    assert fetched == []


def test_a_damaged_round_log_is_named(tmp_path):
    store = open_store(str(tmp_path))
    key = "run/report/rounds-federation.jsonl"
    store.put_text(key, '{"round": 1}\n[[[[not json\n')
    with pytest.raises(CorruptArtifactError, match="rounds-federation.jsonl line 2 is not JSON"):
        read_rounds(store, [key])
    store.put_text(key, '{"round": 1}\n"a string"\n')
    with pytest.raises(CorruptArtifactError, match="line 2 is not a round record"):
        read_rounds(store, [key])


def test_small_runs_config_is_within_bounds():
    load_config(None, SMALL)
