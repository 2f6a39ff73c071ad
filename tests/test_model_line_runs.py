"""Scheduled retraining into a model line: the newest data drop, a warm start from the promoted version, the
promotion gate, versions and rollback (fedpipe.models), through the pipeline's own tasks (components/bodies.py:
config, partition, each phase, evaluate, publish), on digit images per site in S3 (the S3 test server).

The scheduled runs read `s3://<bucket>/drops/latest`, a prefix that grows between them: drop 1 holds 600
images, drop 2 1,200, drop 3 all 1,797, but drop 3's training labels are shuffled (within each site, the images
of the rows its partition trains on are permuted among them, so every training image carries another image's
label while the held-out validation and test rows keep their true labels: a broken labelling of new data,
which the gate, scoring both models on the candidate's test splits, must catch)."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest
import yaml
from own_data import SITES, upload_folder, write_digit_folders

from fedpipe.components import bodies
from fedpipe.errors import ConfigError, CorruptArtifactError, StoreError
from fedpipe.models.line import ModelLine
from fedpipe.run.config import load_config
from fedpipe.run.run import Run
from fedpipe.store import open_store

LINE = "digits-sites"
# what the chart's recurring run sets (schedule.cron): the newest drop, the promoted version, the line and its
# gate (the store and the data source are the test's bucket: `Schedule.config`)
SCHEDULED = {
    "data": {"dataset": "files"},
    "partition": {"scheme": "natural"},
    "method": {"name": "fedper"},
    "train": {"rounds": 4, "local_epochs": 1, "lr": 0.02, "batch_size": 20, "init_from": "promoted"},
    "registry": {"name": LINE, "gate_metric": "personalized_accuracy", "tolerance": 0.0, "max_client_drop": 0.05},
    "telemetry": {"progress": False, "pushgateway_retention_seconds": 0},
    "engine": {"clients": "sequential"},
}


class Schedule:
    """A test's bucket in the S3 test server (its data drops and its run store) and its pipeline runs."""

    def __init__(self, raw_client, tmp_path: Path):
        self.raw, self.tmp, self.bucket = raw_client, tmp_path, f"retrain-{uuid.uuid4().hex[:12]}"
        raw_client.make_bucket(self.bucket)  # a bucket per test: the S3 server lives for the whole session
        self.store = f"s3://{self.bucket}/runs"

    @property
    def line(self) -> ModelLine:
        return ModelLine(open_store(self.store), LINE)

    def config(self, **sections) -> dict:
        """SCHEDULED in this test's bucket; `sections` replace whole sections."""
        return {**SCHEDULED, "run": {"store": self.store, "threads": 1},
                "data": {"dataset": "files", "source": f"s3://{self.bucket}/drops/latest"}, **sections}

    def drop(self, day: str, limit: int, shuffle_training_labels: bool = False) -> str:
        """The digit images of the first `limit` samples as s3://<bucket>/drops/<day>/<site>/<digit>/<n>.png with
        its manifest; optionally with the training rows' labels shuffled (the module's docstring)."""
        folder = write_digit_folders(self.tmp / "drops" / day, limit=limit)
        done = subprocess.run([sys.executable, "-m", "fedpipe.cli", "data", "init", str(folder)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        if shuffle_training_labels:
            _shuffle_training_labels(folder)
        return upload_folder(self.raw, folder, self.bucket, f"drops/{day}")

    def resolve(self, job: str, config: dict | None = None, *overrides: str):
        """The pipeline's config task alone."""
        out = self.tmp / "kfp" / job / "config"
        return bodies.resolve_config(yaml.safe_dump(config or self.config()), {}, {}, list(overrides), job, str(out))

    def run(self, job: str, config: dict | None = None, *overrides: str) -> tuple[Run, dict]:
        """One run of the pipeline, task by task as KFP runs them (each task's body with its artifact files);
        returns the run and the publish task's result."""
        out = self.tmp / "kfp" / job
        cfg = self.resolve(job, config, *overrides)
        config_path, manifest = str(out / "config"), str(out / "manifest")
        bodies.partition(config_path, manifest, str(out / "heatmap"))
        previous = None
        for phase in Run(cfg).phases():
            bodies.train_phase(config_path, phase.name, manifest, previous, str(out / phase.name))
            previous = str(out / phase.name)
        run_id = bodies.evaluate(config_path, manifest, previous, str(out / "report"), str(out / "summary"))["run_id"]
        published = bodies.publish(config_path, run_id, str(out / "global_model"), str(out / "client_models"), str(out / "model_line"))
        return Run(cfg), published


def _shuffle_training_labels(folder: Path) -> None:
    """Permute, within each client, the image files of the rows its natural partition trains on (the
    partition depends on the rows' clients and labels only, so it stays the same and the test rows stay true)."""
    from fedpipe.data.files import check_files, load_files
    from fedpipe.data.partition import make_partition

    cfg = load_config(None, [f"data.source={folder}", "data.dataset=files", "partition.scheme=natural"])
    rows = check_files(str(folder)).rows
    before = make_partition(load_files(str(folder)), cfg.partition, cfg.run.seed)
    rng = np.random.default_rng(3)
    for client in before.clients:
        files = [Path(rows.where(int(i))) for i in client.train]
        images = [f.read_bytes() for f in files]
        for f, j in zip(files, rng.permutation(len(files))):
            f.write_bytes(images[j])
    after = make_partition(load_files(str(folder)), cfg.partition, cfg.run.seed)
    assert all(np.array_equal(a.test, b.test) and np.array_equal(a.train, b.train) for a, b in zip(before.clients, after.clients))


def _first_round(run: Run) -> float:
    """The personalized accuracy of the run's first evaluated round (after round 1)."""
    first = run.phases()[0].name
    rows = [json.loads(line) for line in run.store.get_text(run.layout.rounds(first)).splitlines() if line.strip()]
    return rows[0]["personalized_accuracy"]


def _pushed(pushgateway: str) -> str:
    with urllib.request.urlopen(f"{pushgateway}/metrics", timeout=10) as resp:
        return resp.read().decode()


@pytest.mark.slow
@pytest.mark.services
def test_scheduled_runs_version_warm_start_gate_and_roll_back(tmp_path, raw_client, pushgateway, monkeypatch):
    monkeypatch.setenv("FEDPIPE_PUSHGATEWAY", pushgateway)
    s = Schedule(raw_client, tmp_path)
    line = s.line

    # run 1: the line's first version, promoted without a comparison, started cold (nothing promoted yet)
    s.drop("2026-01-01", 600)
    run1, published1 = s.run("job-1")
    assert run1.cfg.train.init_from == "none" and run1.cfg.data.source == f"s3://{s.bucket}/drops/2026-01-01"
    assert published1["version"] == 1 and published1["promoted"] and line.promoted() == 1

    # run 2: the grown prefix, warm-started from version 1 (pinned when the run started: in its config and id)
    s.drop("2026-02-01", 1200)
    run2, published2 = s.run("job-2")
    assert run2.cfg.train.init_from == "1" and run2.cfg.data.source.endswith("/2026-02-01")
    cold, not_published = s.run("job-2-cold", None, "train.init_from=none", "registry.name=")
    assert not not_published["published"] and line.versions() == [1, 2]  # registry.name empty: nothing registered
    warm_first, cold_first = _first_round(run2), _first_round(cold)
    print(f"round-1 personalized accuracy on drop 2: warm start from version 1 {warm_first:.3f}, cold start {cold_first:.3f}")
    # stable splits: drop 2's test files were never in version 1's training split, so this is the honest gain
    # (with splits redrawn per drop it read +0.15 and more, from test files version 1 had trained on)
    assert warm_first >= cold_first + 0.02, (warm_first, cold_first)
    assert published2["version"] == 2 and published2["promoted"] and line.promoted() == 2
    assert published2["champion_version"] == 1 and published2["candidate"] > published2["champion"]

    # run 3: shuffled training labels; warm-started from version 2, registered as version 3, not promoted
    s.drop("2026-03-01", 1797, shuffle_training_labels=True)
    run3, published3 = s.run("job-3")
    assert run3.cfg.train.init_from == "2"
    assert published3["version"] == 3 and not published3["promoted"] and line.promoted() == 2
    assert published3["candidate"] < published3["champion"] - 0.2, published3
    assert published3["reason"].startswith("not promoted")
    record3 = line.record(3)
    assert record3.decision["promoted"] is False and record3.data_snapshot["source"].endswith("/2026-03-01")
    assert record3.clients == SITES

    # the decision on the Pushgateway, the version's models in the task's artifacts, the line in the report
    metrics = _pushed(pushgateway)
    assert 'fedpipe_model_promoted{instance="",job="fedpipe-models",line="digits-sites",version="3"} 0' in metrics
    assert 'fedpipe_model_promoted_version{instance="",job="fedpipe-models",line="digits-sites"} 2' in metrics
    models = tmp_path / "kfp" / "job-3" / "client_models"
    index = json.loads((models / "index.json").read_text())
    assert sorted(index["clients"]) == sorted(SITES) and index["version"] == 3
    assert all((models / f).stat().st_size > 0 for f in index["clients"].values())
    assert published3["clients_metadata"]["clients"] == len(SITES) and published3["global_metadata"]["line"] == LINE
    page = run3.store.get_text(run3.layout.report("model_line.md"))
    assert "Promoted version: 2." in page and page.count("| not promoted:") == 1 and "2026\\-03\\-01" in page

    # rollback: the pointer moves back to version 1, the version promoted before 2
    assert line.rollback() == 1 and line.promoted() == 1
    assert [(e["action"], e["version"]) for e in line.history()] == [("promote", 1), ("promote", 2), ("rollback", 1)]


# --- bad inputs: each a clear error, and nothing promoted -----------------------------------------------------

def _one_version(raw_client, tmp_path: Path, config: dict | None = None) -> Schedule:
    """A line whose version 1 (promoted) was trained on drop 2026-01-01."""
    s = Schedule(raw_client, tmp_path)
    s.drop("2026-01-01", 400)
    s.run("first", config)
    assert s.line.promoted() == 1
    return s


@pytest.mark.services
def test_a_promoted_pointer_to_a_missing_version_stops_the_next_run(tmp_path, raw_client):
    s = _one_version(raw_client, tmp_path)
    raw_client.remove_object(s.bucket, f"runs/{s.line.keys.record(1)}")
    with pytest.raises(CorruptArtifactError, match="names version 1"):
        s.resolve("next")
    s.drop("2026-02-01", 600)
    with pytest.raises(CorruptArtifactError, match="names version 1"):  # a run started cold cannot publish either
        s.run("cold", None, "train.init_from=none")
    assert s.line.versions() == []


@pytest.mark.services
def test_a_tampered_version_is_refused_for_warm_starts_and_the_gate(tmp_path, raw_client):
    s = _one_version(raw_client, tmp_path)
    line = s.line
    # a record rewritten after its promotion (through the store: its own hash is consistent)
    tree = json.loads(line.store.get(line.keys.record(1)))
    tree["summary"]["personalized_accuracy"]["mean"] = 0.99
    line.store.put(line.keys.record(1), json.dumps(tree).encode())
    with pytest.raises(CorruptArtifactError, match="tampered"):
        s.resolve("next")
    with pytest.raises(CorruptArtifactError, match="tampered"):
        s.run("cold", None, "train.init_from=none")
    assert line.versions() == [1]
    # a version's state rewritten behind the store's back: a warm start from it stops
    key = f"runs/{line.keys.version(1)}state.pt"
    data = raw_client.get_object(s.bucket, key).read()
    raw_client.put_object(s.bucket, key, io.BytesIO(data[:-8] + b"\0" * 8), len(data))
    with pytest.raises(CorruptArtifactError, match="state.pt"):
        s.run("from-1", None, "train.init_from=1")
    assert line.versions() == [1]


@pytest.mark.services
def test_a_warm_start_from_another_model_names_both_specs(tmp_path, raw_client):
    s = _one_version(raw_client, tmp_path)
    another = s.config(model={"name": "lenet5"})
    another["data"]["image_size"] = 16
    with pytest.raises(ConfigError, match=r"model: 'lenet5' vs 'twonn'") as err:
        s.run("another", another)
    assert "this run trains model lenet5" in str(err.value) and "is model twonn" in str(err.value)
    assert s.line.versions() == [1] and s.line.promoted() == 1


@pytest.mark.services
def test_a_gate_metric_the_method_does_not_produce_promotes_nothing(tmp_path, raw_client):
    s = Schedule(raw_client, tmp_path)
    config = s.config(method={"name": "local"}, registry={**SCHEDULED["registry"], "gate_metric": "global_accuracy"},
                      train={**SCHEDULED["train"], "init_from": "none", "rounds": 1})
    s.drop("2026-01-01", 400)
    with pytest.raises(ConfigError, match="local trains no global model"):
        s.run("local", config)
    assert s.line.versions() == [] and s.line.promoted() is None


@pytest.mark.services
def test_init_from_needs_a_line_and_an_existing_version(tmp_path, raw_client):
    s = Schedule(raw_client, tmp_path)
    s.drop("2026-01-01", 300)
    with pytest.raises(ConfigError, match="registry.name is empty"):
        s.resolve("no-line", None, "registry.name=")
    with pytest.raises(StoreError, match="has no version 7"):
        s.resolve("no-version", None, "train.init_from=7")


@pytest.mark.slow
def test_fedpipe_run_publishes_through_the_local_pipeline(tmp_path):
    """`fedpipe run` (the shipped pipeline on kfp's local runner) ends with the publish task: a version, promoted,
    its models as the task's Model artifacts; the next run warm-starts from it."""
    import torch
    from runs import SMALL

    sets = [*SMALL, f"run.store={tmp_path}", "method.name=fedavg", "train.rounds=2", "registry.name=mnist"]
    for run_id, init_from in (("first", "none"), ("second", "promoted")):
        done = subprocess.run([sys.executable, "-m", "fedpipe.cli", "run", *(f"--set={s}" for s in sets),
                               f"--set=run.id={run_id}", f"--set=train.init_from={init_from}"], capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout + done.stderr
        assert re.search(r"Task 'publish(-\d+)?' finished with status SUCCESS", done.stderr)  # the simulation branch's publish
    assert "starts from model line 'mnist' version 1" in done.stderr
    line = ModelLine(open_store(str(tmp_path)), "mnist")
    assert line.versions() == [1, 2] and line.record(2).run_id == "second" and line.promoted() in (1, 2)
    task = max((tmp_path / "_kfp").iterdir(), key=lambda p: p.stat().st_mtime) / "publish"
    assert line.record(2).decision["promoted"] == (line.promoted() == 2) and "# Model line mnist" in (task / "model_line").read_text()
    index = json.loads((task / "client_models" / "index.json").read_text())
    assert len(index["clients"]) == 6 and index["line"] == "mnist"
    served = torch.export.load(str(task / "global_model")).module()
    assert served(torch.zeros(3, 1, 28, 28)).shape == (3, 10)


def test_the_charts_recurring_run_retrains_into_a_model_line_by_default(tmp_path):
    """With schedule.cron the chart's run config reads the newest drop, warm-starts from the promoted version and
    registers every run in a model line behind the gate; each is a value, a runConfig field wins; without a cron
    nothing of it."""
    from deploy.deploytools import CHART, CLUSTER, GET_HELM, find_tool

    helm = find_tool("helm", GET_HELM)

    def config(*values: str):
        done = subprocess.run([helm, "template", "fedpipe", str(CHART), *CLUSTER, *values], capture_output=True, text=True, check=True)
        (config_map,) = [d for d in yaml.safe_load_all(done.stdout) if d and d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-run-config")]
        path = tmp_path / "config.yaml"
        path.write_text(config_map["data"]["config.yaml"])
        return load_config(path)

    cron = ["--set", "schedule.cron=0 0 3 * * *"]
    plain, scheduled = config(), config(*cron, "--set", "schedule.retraining.dataSource=s3://mlpipeline/drops/latest")
    assert plain.registry.name == "" and plain.train.init_from == "none" and plain.data.dataset == "mnist5k"
    assert scheduled.registry.name == "fedpipe-superfed-mm" and scheduled.train.init_from == "promoted"
    assert scheduled.data.dataset == "files" and scheduled.data.source == "s3://mlpipeline/drops/latest"
    assert scheduled.registry.gate_metric == "personalized_accuracy" and scheduled.registry.max_client_drop == 0.05
    own = config(*cron, "--set", "runConfig.train.init_from=none", "--set", "schedule.retraining.line=nightly",
                 "--set", "schedule.retraining.gateMetric=worst10_accuracy", "--set-json", "schedule.retraining.tolerance=0.02")
    assert own.train.init_from == "none" and own.registry.name == "nightly" and own.data.dataset == "mnist5k"
    assert own.registry.gate_metric == "worst10_accuracy" and own.registry.tolerance == 0.02
    # a federated schedule gates on the global model (the only one its line gets): the empty default picks it, and
    # any other metric fails the render by name rather than the run after its training (fedpipe.models.federated)
    federated = ["--set", "runConfig.engine.mode=federation", "--set", "federation.enabled=true", "--set", "federation.tls.secretName=superlink-tls",
                 "--set", "federation.tls.caSecretName=federation-ca"]
    fed = config(*cron, *federated, "--set", "runConfig.federation.sites=3")
    assert fed.engine.mode == "federation" and fed.registry.gate_metric == "global_accuracy" and fed.train.init_from == "promoted"
    refused = subprocess.run([helm, "template", "fedpipe", str(CHART), *CLUSTER, *cron, *federated, "--set",
                              "schedule.retraining.gateMetric=personalized_accuracy"], capture_output=True, text=True)
    assert refused.returncode != 0 and "schedule.retraining.gateMetric=personalized_accuracy with runConfig.engine.mode=federation" in refused.stderr


# --- the gate's rule, on scores alone --------------------------------------------------------------------------

def _registry(**fields):
    from fedpipe.config import RegistryConfig

    return RegistryConfig(name=LINE, **fields)


def test_the_gate_compares_shared_clients_and_reports_new_ones_apart():
    from fedpipe.models.gate import Scores, compare

    champion = Scores({"a": 0.90, "b": 0.80}, 0.7)
    better = compare(Scores({"a": 0.92, "b": 0.81, "new": 0.10}, 0.6), champion, 4, _registry())
    assert better.promote and better.shared_clients == 2 and better.new_clients == ("new",)
    assert better.candidate == pytest.approx(0.865) and better.champion == pytest.approx(0.85)  # "new" does not count
    assert better.candidate_on_new_clients == pytest.approx(0.10)
    worse = compare(Scores({"a": 0.89, "b": 0.79}, 0.7), champion, 4, _registry())
    assert not worse.promote and "below it by more than the tolerance" in worse.reason
    assert compare(Scores({"a": 0.89, "b": 0.79}, 0.7), champion, 4, _registry(tolerance=0.02)).promote
    # one client losing more than max_client_drop stops a promotion the mean would allow
    dropped = compare(Scores({"a": 1.0, "b": 0.74}, 0.7), champion, 4, _registry(max_client_drop=0.05))
    assert not dropped.promote and dropped.dropped == {"b": pytest.approx(0.06)} and "b -0.06" in dropped.reason
    global_gate = compare(Scores({"a": 0.5, "b": 0.5}, 0.71), champion, 4, _registry(gate_metric="global_accuracy", max_client_drop=1.0))
    assert global_gate.promote and global_gate.candidate == 0.71
    with pytest.raises(ConfigError, match="no global model"):
        compare(Scores({"a": 0.9}, 0.8), Scores({"a": 0.9}, None), 4, _registry(gate_metric="global_accuracy"))
    nothing_shared = compare(Scores({"c": 0.99}, None), Scores({}, None), 4, _registry())
    assert not nothing_shared.promote and "no client of this run" in nothing_shared.reason


def test_worst10_is_the_mean_of_the_lowest_tenth_of_clients_at_least_one():
    from fedpipe.models.gate import gate_metric

    assert gate_metric("worst10_accuracy", [0.9] * 9 + [0.1], None) == pytest.approx(0.1)
    assert gate_metric("worst10_accuracy", [0.5, 0.9, 0.7], None) == pytest.approx(0.5)  # 10% of 3 clients: one
    assert gate_metric("worst10_accuracy", [0.2, 0.4, *[1.0] * 9], None) == pytest.approx(0.3)  # 10% of 11: two
    assert gate_metric("personalized_accuracy", [0.2, 0.4], None) == pytest.approx(0.3)
