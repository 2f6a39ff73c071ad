"""The MLflow sink (fedpipe/telemetry/mlflow.py) against a REAL ``mlflow server`` on loopback.

The module fixture starts ``mlflow server`` from the venv (SQLite backend, artifacts proxied by the
server into a temp folder) on a free 127.0.0.1 port and stops it at the end. The tests make small
real fedpipe runs (digits, fedavg, 2 rounds, 4 clients) and read back through MlflowClient what the
server stored: per-round metrics with step = round, the config as params, tags, the report as
artifacts, nesting under a parent run, KFP's MLFLOW_RUN_ID / MLFLOW_EXPERIMENT_ID, and one warning
when the server is down.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from services import free_port, start_server, stop_server

from fedpipe.run.config import load_config
from fedpipe.run.run import Run
from fedpipe.telemetry import PhaseEvent, RoundEvent, RunLabels
from fedpipe.telemetry import mlflow as sink_module
from fedpipe.telemetry.mlflow import (
    ENV_PARENT_RUN,
    MlflowSink,
    finish_run,
    flat_params,
    log_artifacts,
    start_parent_run,
)

pytestmark = pytest.mark.slow

MLFLOW_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", ENV_PARENT_RUN, "KFP_RUN_ID", "KFP_POD_NAME")
SMALL = [
    "data.dataset=digits",
    "method.name=fedavg",
    "train.rounds=2",
    "partition.num_clients=4",
    "telemetry.progress=false",
    "engine.processes=1",  # no rank processes to start: a few seconds a run
]


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory) -> str:
    """A real MLflow tracking server on a free loopback port, for this module."""
    work = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        f"sqlite:///{work / 'mlflow.db'}",
        "--artifacts-destination",
        str(work / "artifacts"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    server = start_server("mlflow", argv, f"http://127.0.0.1:{port}", "/health", work, timeout=60)
    try:
        from mlflow.tracking import MlflowClient

        MlflowClient(tracking_uri=server.url).search_experiments()  # the store is made on the first call: not in a test
        yield server.url
    finally:
        stop_server(server)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(server.proc.pid, signal.SIGTERM)  # its workers, in the session the fixture started


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in MLFLOW_ENV:
        monkeypatch.delenv(name, raising=False)
    sink_module._down.clear()
    yield
    sink_module._down.clear()


@pytest.fixture
def client(mlflow_uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=mlflow_uri)


def small_run(store: Path, *extra: str) -> Run:
    return Run(load_config(None, [*SMALL, f"run.store={store}", *extra]))


def runs_of(client, fedpipe_run_id: str, experiment: str = "fedpipe") -> list:
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    return client.search_runs([exp.experiment_id], filter_string=f"tags.`fedpipe.run_id` = '{fedpipe_run_id}'")


def event(run_id: str, round_: int, phase: str = "train") -> RoundEvent:
    labels = RunLabels(run_id, "local", "fedavg", phase, "digits")
    return RoundEvent(labels, round_, round_, 2, 4, 0, 0.5 / round_, 0.8, None, 100, 200, 0.1, 50.0, extra={"alpha": 0.25})


def test_a_run_logs_rounds_params_tags_and_its_report(mlflow_uri, client, tmp_path):
    run = small_run(tmp_path, f"telemetry.mlflow={mlflow_uri}", "telemetry.mlflow_experiment=fedpipe")
    summary = run.run_all()
    assert summary
    [phase] = [p.name for p in run.phases()]
    [found] = runs_of(client, run.layout.run_id)
    run_id = found.info.run_id
    assert found.info.status == "FINISHED"  # ended by the evaluation
    for metric in (
        "train_loss",
        "bytes_uploaded",
        "bytes_downloaded",
        "seconds",
        "samples_per_second",
        "clients",
        "failed_clients",
    ):
        history = client.get_metric_history(run_id, metric)
        assert sorted(m.step for m in history) == [1, 2], metric  # one entry per round, step = the global round
    losses = {m.step: m.value for m in client.get_metric_history(run_id, "train_loss")}
    rounds = [json.loads(line) for line in run.store.get_text(run.layout.rounds(phase)).splitlines() if line.strip()]
    assert losses == {r["round"]: pytest.approx(r["train_loss"]) for r in rounds}
    params = found.data.params
    assert params["train.lr"] == json.dumps(run.cfg.train.lr)
    assert params["train.rounds"] == "2" and params["method.name"] == "fedavg" and params["data.dataset"] == "digits"
    tags = found.data.tags
    assert tags["method"] == "fedavg" and tags["dataset"] == "digits" and tags["split"] == run.cfg.partition.scheme
    assert tags["seed"] == str(run.cfg.run.seed) and tags["fedpipe.run_id"] == run.layout.run_id and tags["phase"] == phase
    artifacts = {a.path for a in client.list_artifacts(run_id, "report")}
    in_store = {key[len(run.layout.run_id) + 1 :] for key in run.store.list(run.layout.report_dir + "/")}
    assert artifacts == in_store  # everything under the run's report/ keys
    assert {"report/summary.json", "report/report.md", f"report/rounds-{phase}.jsonl"} <= artifacts
    assert any(p.endswith(".png") for p in artifacts)
    local = Path(client.download_artifacts(run_id, "report/summary.json", str(tmp_path / "dl")))
    assert local.read_bytes() == run.store.get(run.layout.report("summary.json"))


def test_trials_nest_under_a_parent_run(mlflow_uri, client, monkeypatch):
    parent = start_parent_run(
        mlflow_uri, "study-nesting", "study-1", {"trials": 2, "space": {"lr": [0.1, 0.01]}}, {"kind": "study"}
    )
    assert parent is not None
    first = MlflowSink(mlflow_uri, fedpipe_run_id="trial-a", parent_run_id=parent, params={"train.lr": "0.1"})
    monkeypatch.setenv(ENV_PARENT_RUN, parent)  # a trial worker process inherits its parent from the env
    second = MlflowSink(mlflow_uri, fedpipe_run_id="trial-b", params={"train.lr": "0.01"})
    for sink, name in ((first, "trial-a"), (second, "trial-b")):
        sink.phase_started(PhaseEvent(event(name, 1).labels, 2, 1))
        sink.round_finished(event(name, 1))
        sink.round_finished(event(name, 2))
        assert sink.log_report({"summary.json": b"{}"})
    experiment = client.get_run(parent).info.experiment_id
    children = client.search_runs([experiment], filter_string=f"tags.`mlflow.parentRunId` = '{parent}'")
    assert sorted(r.data.tags["fedpipe.run_id"] for r in children) == ["trial-a", "trial-b"]
    for child in children:
        assert child.info.status == "FINISHED"
        assert [m.step for m in client.get_metric_history(child.info.run_id, "alpha")] == [1, 2]  # extra scalars too
    assert client.get_run(parent).data.params["trials"] == "2"
    assert log_artifacts(mlflow_uri, parent, {"study.json": b'{"best": "trial-a"}'})
    assert [a.path for a in client.list_artifacts(parent)] == ["study.json"]
    assert finish_run(mlflow_uri, parent, "FINISHED")
    assert client.get_run(parent).info.status == "FINISHED"


def test_kfp_variables_put_metrics_into_the_tasks_run(mlflow_uri, client, tmp_path, monkeypatch):
    """KFP's native MLflow integration (KEP-12862) sets MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_ID and
    MLFLOW_RUN_ID (the task's nested run): fedpipe logs into that run and leaves ending it to KFP."""
    experiment = client.create_experiment("kfp-pipeline-run")
    task_run = client.create_run(experiment, run_name="train-task").info.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", experiment)
    monkeypatch.setenv("MLFLOW_RUN_ID", task_run)
    monkeypatch.setenv("KFP_POD_NAME", "fedpipe-train-pod-1")
    run = small_run(tmp_path, "run.seed=7")  # no telemetry.mlflow; another run id than the first test's
    assert run.cfg.telemetry.mlflow is None
    run.run_all()
    assert sorted(m.step for m in client.get_metric_history(task_run, "train_loss")) == [1, 2]
    got = client.get_run(task_run)
    assert got.data.params["method.name"] == "fedavg"
    assert got.data.tags["fedpipe.run_id"] == run.layout.run_id and got.data.tags["kfp.pod_name"] == "fedpipe-train-pod-1"
    assert "report/summary.json" in {a.path for a in client.list_artifacts(task_run, "report")}
    assert got.info.status == "RUNNING"  # KFP ends its task's run, not fedpipe
    assert len(client.search_runs([experiment])) == 1  # no run of fedpipe's own beside the task's
    assert runs_of(client, run.layout.run_id) == []  # nor in the default experiment


def test_an_unreachable_server_warns_once_and_the_run_finishes(tmp_path, caplog):
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    run = small_run(tmp_path, f"telemetry.mlflow={down}")
    with caplog.at_level(logging.WARNING), caplog.at_level(logging.DEBUG, logger="fedpipe.telemetry.mlflow"):
        summary = run.run_all()
    assert summary and run.store.exists(run.layout.report("summary.json"))
    warnings = [r for r in caplog.records if r.name == "fedpipe.telemetry.mlflow" and r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    text = warnings[0].getMessage()
    assert down in text and "not being tracked" in text and "MLFLOW_TRACKING_URI" in text
    skipped = [r for r in caplog.records if r.name == "fedpipe.telemetry.mlflow" and "not trying to" in r.getMessage()]
    assert skipped  # the report step did not wait for the server again


def test_no_mlflow_without_a_uri_and_no_import():
    """Without telemetry.mlflow or MLFLOW_TRACKING_URI there is no sink, and mlflow is never imported."""
    code = (
        "import sys, tempfile\n"
        "from fedpipe.run.config import load_config\n"
        "from fedpipe.run.run import Run\n"
        "import fedpipe.cli\n"
        f"run = Run(load_config(None, {SMALL!r} + ['run.store=' + tempfile.mkdtemp()]))\n"
        "names = [type(s).__name__ for s in run.default_sinks('train')]\n"
        "assert 'MlflowSink' not in names, names\n"
        "assert 'mlflow' not in sys.modules\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in MLFLOW_ENV}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_params_are_flattened_and_cut_to_mlflows_limit():
    params = flat_params({"train": {"lr": 0.01, "rounds": 3}, "data": {"name": "x" * 7000, "opts": {}}, "ok": True, "none": None})
    assert params["train.lr"] == "0.01" and params["train.rounds"] == "3" and params["ok"] == "true" and params["none"] == "null"
    assert len(params["data.name"]) == 6000 and params["data.opts"] == "{}"


def test_the_config_refuses_credentials_in_the_uri():
    from fedpipe.errors import ConfigError

    with pytest.raises((ConfigError, ValueError), match="telemetry.mlflow"):
        load_config(None, ["telemetry.mlflow=https://user:secret@mlflow.example.com"])


def test_a_study_is_a_parent_run_with_its_trials_and_final_runs_nested(mlflow_uri, client, tmp_path):
    """The whole path: `mlflow:` in a study makes its parent run; every trial and final run (ordinary fedpipe runs,
    in the study's worker) nests under it with its per-round metrics; the study report lands on the parent."""
    from fedpipe.study.config import load_study
    from fedpipe.study.runner import run_study

    study, base = load_study(None, text=f"""
study: {{name: tracked, store: {tmp_path}}}
base: {{data: {{dataset: digits}}, partition: {{num_clients: 4}}, model: {{name: twonn}}, train: {{local_epochs: 1, batch_size: 20}}}}
methods: [fedavg]
budget: {{trials: 2, rounds: 2}}
seeds: [0]
workers: 1
mlflow: {mlflow_uri}
""")
    run_study(study, base, progress=False)
    experiment = client.get_experiment_by_name("fedpipe")
    parents = client.search_runs([experiment.experiment_id], "tags.`fedpipe.study` = 'tracked'")
    assert len(parents) == 1
    parent = parents[0]
    children = client.search_runs([experiment.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert len(children) == 3  # 2 tuning trials and 1 final run
    for child in children:
        assert [m.step for m in client.get_metric_history(child.info.run_id, "train_loss")] == [1, 2]
    assert {"study.md", "study.html"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert client.get_run(parent.info.run_id).info.status == "FINISHED"


def _kfp_2_17_task_runs(client, experiment: str, tasks) -> tuple[str, dict]:
    """What KFP 2.17.0's MLflow plugin makes before the tasks run: the API server's parent run of the pipeline
    run, and for each task the driver's nested run (backend/src/v2/common/plugins/mlflow/handler.go,
    OnTaskStart: CreateRun(experiment, task name, [mlflow.parentRunId = the parent])); {task: run id}."""
    from kfp_backend import MLFLOW_PARENT_TAG

    parent = client.create_run(experiment, run_name="fedpipe-fedavg-run").info.run_id
    return parent, {t: client.create_run(experiment, run_name=t, tags={MLFLOW_PARENT_TAG: parent}).info.run_id for t in tasks}


def _inject(monkeypatch, mlflow_uri: str, experiment: str, task_run: str) -> None:
    """handler.go RetrieveUserContainerEnvVars at 2.17.0: the variables the driver puts on the task's container."""
    from kfp_backend import MLFLOW_PLUGIN_ENV

    for name, value in zip(MLFLOW_PLUGIN_ENV, (task_run, mlflow_uri, experiment), strict=True):
        monkeypatch.setenv(name, value)


def test_under_kfp_2_17s_mlflow_plugin_fedpipe_logs_into_each_tasks_run_and_the_launcher_can_end_it(mlflow_uri, client, tmp_path,
                                                                                                     monkeypatch):
    """KFP 2.17.0's native MLflow integration, step by step from its source, with fedpipe in the middle: the
    driver's nested runs and injected variables; fedpipe's phase work logs into the phase task's run (no run
    of its own); then the launcher (handler.go OnTaskEnd) logs each task's input parameters as JSON text
    (metadata FormatExecutionParameters) and its KFP Metrics scalars in ONE LogBatch, and ends the run. MLflow
    refuses a whole batch when one param changes a logged value, or holds over 100 params or a value over
    6,000 characters: every task of the shipped fedavg pipeline (its inputs as the 2.17 conformance model
    resolves them) must pass on the real server, the phase task after fedpipe has logged into its run."""
    import random

    import yaml
    from kfp_backend import go_json, run_pipeline
    from mlflow.entities import Metric, Param

    from fedpipe.pipelines.builder import SHIPPED

    spec = next(yaml.safe_load_all((SHIPPED / "fedavg.yaml").read_text()))
    # the simulation branch's tasks (inside the pipeline's engine_mode branches), by their own names
    tasks = {name.rsplit("/", 1)[-1]: task for name, task in run_pipeline(spec, {}, "2.17.0", random.Random(0)).items()}
    experiment = client.create_experiment("kfp-2-17-fedavg")
    parent, task_runs = _kfp_2_17_task_runs(client, experiment, tasks)
    _inject(monkeypatch, mlflow_uri, experiment, task_runs["train-phase"])
    run = small_run(tmp_path, "run.seed=17")
    run.run_all()  # the phase task's (and here the evaluate task's) work
    last = client.get_run(task_runs["train-phase"]).data.metrics
    kfp_metrics = {"train-phase": {k: last[k] for k in ("train_loss", "personalized_accuracy") if k in last}}
    for name, task in tasks.items():
        params = [Param(k, go_json(v)) for k, v in task.parameters.items()]
        assert len(params) <= 100 and all(len(p.value) <= 6000 for p in params), name
        metrics = [Metric(k, v, 0, 0) for k, v in kfp_metrics.get(name, {}).items()]  # mapToMetrics: no timestamp, step 0
        client.log_batch(task_runs[name], metrics=metrics, params=params)  # refused on any conflict: the test fails
        client.set_terminated(task_runs[name], "FINISHED")  # UpdateRun with the terminal status
    phase = client.get_run(task_runs["train-phase"])
    assert phase.data.params["method.name"] == "fedavg" and phase.data.params["phase"] == go_json(tasks["train-phase"].parameters["phase"])
    assert phase.data.tags["fedpipe.run_id"] == run.layout.run_id and phase.data.tags["mlflow.parentRunId"] == parent
    # the launcher's copy of the task's KFP metrics lands at step 0, before fedpipe's rounds 1 and 2
    assert [m.step for m in client.get_metric_history(task_runs["train-phase"], "train_loss")] == [0, 1, 2]
    assert len(client.search_runs([experiment])) == len(tasks) + 1  # fedpipe opened no run of its own


def test_a_study_inside_a_kfp_2_17_task_nests_under_the_tasks_run_which_nests_under_the_pipelines(mlflow_uri, client, tmp_path,
                                                                                                    monkeypatch):
    """`fedpipe study run` as one task of a pipeline run under KFP 2.17's MLflow plugin: the study's parent run
    nests under the task's run (itself under the pipeline's parent run), its trials and final runs under the
    study's run, all in the pipeline's experiment; the task's run is left for the launcher to end."""
    from fedpipe.study.config import load_study
    from fedpipe.study.runner import run_study

    experiment = client.create_experiment("kfp-2-17-study")
    parent, task_runs = _kfp_2_17_task_runs(client, experiment, ["study"])
    _inject(monkeypatch, mlflow_uri, experiment, task_runs["study"])
    study, base = load_study(None, text=f"""
study: {{name: in-kfp, store: {tmp_path}}}
base: {{data: {{dataset: digits}}, partition: {{num_clients: 4}}, model: {{name: twonn}}, train: {{local_epochs: 1, batch_size: 20}}}}
methods: [fedavg]
budget: {{trials: 2, rounds: 2}}
seeds: [0]
workers: 1
""")
    run_study(study, base, progress=False)
    runs = client.search_runs([experiment])
    (study_run,) = [r for r in runs if r.data.tags.get("fedpipe.study") == "in-kfp"]
    assert study_run.data.tags["mlflow.parentRunId"] == task_runs["study"]
    assert client.get_run(task_runs["study"]).data.tags["mlflow.parentRunId"] == parent
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == study_run.info.run_id]
    assert len(children) == 3 and all(r.info.experiment_id == experiment for r in children)  # 2 trials, 1 final run
    assert client.get_run(task_runs["study"]).info.status == "RUNNING"  # the launcher ends it, not fedpipe
    assert len(runs) == 1 + 1 + 1 + 3  # the pipeline's, the task's, the study's, its runs: nothing else
