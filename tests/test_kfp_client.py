"""`fedpipe register`, `submit` and `schedule` against a stand-in Kubeflow Pipelines API server.

No KFP server can run here, so `kfp_api_standin.KfpApiStandIn` (an in-process HTTP server on a
loopback port, NOT Kubeflow) answers the v2beta1 REST API. The commands run in-process through
typer's CliRunner and talk to it with the real `kfp.Client`, so these tests check the requests
our code makes through the real kfp library: the uploaded pipeline file, the run and recurring-run
JSON, and how server errors and an unreachable server reach the user.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys

import kfp
import pytest
import yaml
from kfp_api_standin import KfpApiStandIn
from typer.testing import CliRunner

import fedpipe
from fedpipe.cli import app
from fedpipe.errors import FedpipeError
from fedpipe.pipelines.client import kfp_cron

API = "/apis/v2beta1"
UPLOAD = f"{API}/pipelines/upload"
UPLOAD_VERSION = f"{API}/pipelines/upload_version"
VERSION_NAME = re.compile(re.escape(fedpipe.__version__) + r"-[0-9a-f]{12}")

# Unmistakable dummies for the leak check.
ACCESS_KEY = "LEAKCHECK-AKID-4c1e7b90"
SECRET_KEY = "LEAKCHECK-SECRET-d93f0a-never-send-me"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """Nothing from the developer's machine steers kfp or the compiled pipeline."""
    for name in ("KF_PIPELINES_ENDPOINT", "KF_PIPELINES_UI_ENDPOINT", "KF_PIPELINES_DEFAULT_EXPERIMENT_NAME",
                 "KF_PIPELINES_OVERRIDE_EXPERIMENT_NAME", "KF_PIPELINES_IAP_OAUTH2_CLIENT_ID",
                 "KF_PIPELINES_APP_OAUTH2_CLIENT_ID", "KF_PIPELINES_APP_OAUTH2_CLIENT_SECRET",
                 "FEDPIPE_IMAGE", "FEDPIPE_STORE", "FEDPIPE_S3_ENDPOINT", "FEDPIPE_S3_SECRET", "FEDPIPE_PUSHGATEWAY",
                 "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    # kfp keeps a namespace in ~/.config/kfp/context.json; point it at an empty folder
    monkeypatch.setattr(kfp.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "kfp-context.json"))


@pytest.fixture
def kfp_api():
    with KfpApiStandIn() as server:
        yield server


def fedpipe_cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def ok(result):
    assert result.exit_code == 0, f"exit {result.exit_code}\n{result.output}"
    return result


def error_paragraph(result) -> str:
    """The one paragraph a failed command prints: exit 2, 'error: ...' on stderr, no traceback."""
    assert result.exit_code == 2, f"exit {result.exit_code}\n{result.output}"
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), f"not one paragraph:\n{result.stderr}"
    return lines[0]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spec_docs(content: bytes) -> tuple[dict, dict]:
    """An uploaded pipeline file: the pipeline spec and the platform (Kubernetes) spec."""
    docs = [d for d in yaml.safe_load_all(content) if d is not None]
    assert len(docs) == 2, f"expected a pipeline spec and a platform spec, got {len(docs)} documents"
    return docs[0], docs[1]


def phases(spec: dict) -> list[str]:
    """The training phases of a compiled pipeline, in the order the DAG runs them."""
    tasks = spec["root"]["dag"]["tasks"]
    train = {name: t for name, t in tasks.items() if t["componentRef"]["name"].startswith("comp-train-phase")}
    order, done = [], set()
    while len(order) < len(train):
        for name, task in sorted(train.items()):
            if name not in done and set(task.get("dependentTasks", [])) & set(train) <= done:
                order.append(task["inputs"]["parameters"]["phase"]["runtimeValue"]["constant"])
                done.add(name)
    return order


def defaults(spec: dict) -> dict:
    return {k: v.get("defaultValue") for k, v in spec["root"]["inputDefinitions"]["parameters"].items()}


# -- register -------------------------------------------------------------------------------------


def test_register_uploads_the_pipeline_once_and_adds_a_version_per_config(kfp_api):
    first = ok(fedpipe_cli("register", "--host", kfp_api.url, "--method", "fedavg"))

    [upload] = kfp_api.requests("POST", UPLOAD)
    assert upload.param("name") == "fedpipe-fedavg"
    filename, content = upload.files["uploadfile"]
    assert filename.endswith(".yaml")
    spec, platform = spec_docs(content)
    assert spec["pipelineInfo"]["name"] == "fedpipe-fedavg"
    assert spec["schemaVersion"].startswith("2.")
    assert {"resolve-config", "partition", "train-phase", "evaluate"} <= set(spec["root"]["dag"]["tasks"])
    assert phases(spec) == ["federation"]
    assert set(spec["deploymentSpec"]["executors"]) >= {"exec-train-phase", "exec-evaluate"}
    assert "kubernetes" in platform["platforms"]
    pipeline = kfp_api.pipeline_named("fedpipe-fedavg")
    assert pipeline is not None and upload.status == 200

    # the config's own version, named after fedpipe's release and the hash of exactly that file
    [version_upload] = kfp_api.requests("POST", UPLOAD_VERSION)
    version = version_upload.param("name")
    assert VERSION_NAME.fullmatch(version), version
    assert version_upload.param("pipelineid") == pipeline["pipeline_id"]
    assert version_upload.files["uploadfile"][1] == content
    assert version == f"{fedpipe.__version__}-{hashlib.sha256(content).hexdigest()[:12]}"
    [registered] = [v for v in kfp_api.versions_of(pipeline["pipeline_id"]) if v["display_name"] == version]
    assert f"version {version} " in first.stdout
    assert pipeline["pipeline_id"] in first.stdout and registered["pipeline_version_id"] in first.stdout

    # the same config again: nothing uploaded, the same version reported
    again = ok(fedpipe_cli("register", "--host", kfp_api.url, "--method", "fedavg"))
    assert len(kfp_api.requests("POST", UPLOAD)) == 1
    assert len(kfp_api.requests("POST", UPLOAD_VERSION)) == 1
    assert registered["pipeline_version_id"] in again.stdout and f"version {version} " in again.stdout

    # another config: a new version of the same pipeline, carrying the new defaults
    changed = ok(fedpipe_cli("register", "--host", kfp_api.url, "--method", "fedavg", "--set", "train.rounds=7"))
    assert len(kfp_api.requests("POST", UPLOAD)) == 1, "a changed config must not create a second pipeline"
    uploads = kfp_api.requests("POST", UPLOAD_VERSION)
    assert len(uploads) == 2
    new_version = uploads[1].param("name")
    assert VERSION_NAME.fullmatch(new_version) and new_version != version
    assert uploads[1].param("pipelineid") == pipeline["pipeline_id"]
    assert defaults(spec_docs(uploads[1].files["uploadfile"][1])[0])["train_rounds"] == 7
    assert len(kfp_api.pipelines) == 1
    names = {v["display_name"] for v in kfp_api.versions_of(pipeline["pipeline_id"])}
    # the first one is the version the server itself makes on upload, named after the pipeline
    assert names == {"fedpipe-fedavg", version, new_version}
    assert f"version {new_version} " in changed.stdout


# -- submit ---------------------------------------------------------------------------------------


def test_submit_creates_the_experiment_and_a_run_with_the_config_as_defaults(kfp_api):
    assert kfp_api.experiment_named("exp1") is None
    result = ok(fedpipe_cli("submit", "--host", kfp_api.url, "--method", "superfed_mm",
                            "--set", "train.rounds=12", "--experiment", "exp1"))

    experiment = kfp_api.experiment_named("exp1")
    assert experiment is not None
    [created] = kfp_api.requests("POST", f"{API}/experiments")
    assert created.body["display_name"] == "exp1"

    [run_request] = kfp_api.requests("POST", f"{API}/runs")
    body = run_request.body
    assert body["experiment_id"] == experiment["experiment_id"]
    assert body["display_name"], "a run needs a name"
    assert "pipeline_version_reference" not in body, "submit sends the compiled spec itself"
    spec, platform = body["pipeline_spec"]["pipeline_spec"], body["pipeline_spec"]["platform_spec"]
    assert spec["pipelineInfo"]["name"] == "fedpipe-superfed-mm"
    assert phases(spec) == ["federation", "personalization"]
    params = defaults(spec)
    base = json.loads(params["base_config"])
    assert base["train"]["rounds"] == 12 and base["method"]["name"] == "superfed_mm"
    assert params["train_rounds"] == 12
    assert body["runtime_config"].get("parameters", {}) == {}, "the config travels as the spec's defaults"
    assert "kubernetes" in platform["platforms"]

    [run_id] = kfp_api.runs
    printed = re.search(r"submitted run (\S+) of superfed_mm to experiment 'exp1'", result.stdout)
    assert printed and printed.group(1) == run_id

    # a second submission reuses the experiment
    ok(fedpipe_cli("submit", "--host", kfp_api.url, "--method", "superfed_mm", "--set", "train.rounds=12", "--experiment", "exp1"))
    assert len(kfp_api.requests("POST", f"{API}/experiments")) == 1
    assert [e["display_name"] for e in kfp_api.experiments.values()].count("exp1") == 1
    assert {r["experiment_id"] for r in kfp_api.runs.values()} == {experiment["experiment_id"]} and len(kfp_api.runs) == 2


# -- schedule -------------------------------------------------------------------------------------


def test_schedule_creates_one_recurring_run_of_the_registered_version_and_replaces_it(kfp_api):
    first = ok(fedpipe_cli("schedule", "--host", kfp_api.url, "--method", "fedavg", "--cron", "0 3 * * *"))

    pipeline = kfp_api.pipeline_named("fedpipe-fedavg")
    [version_upload] = kfp_api.requests("POST", UPLOAD_VERSION)
    [version] = [v for v in kfp_api.versions_of(pipeline["pipeline_id"]) if v["display_name"] == version_upload.param("name")]
    experiment = kfp_api.experiment_named("fedpipe")
    assert experiment is not None, "the default experiment 'fedpipe' is created"

    [create] = kfp_api.requests("POST", f"{API}/recurringruns")
    body = create.body
    assert body["display_name"] == "fedpipe-fedavg-schedule"
    assert body["trigger"]["cron_schedule"]["cron"] == "0 0 3 * * *"
    assert int(body["max_concurrency"]) == 1
    assert body["no_catchup"] is True
    assert body["mode"] == "ENABLE"
    assert body["experiment_id"] == experiment["experiment_id"]
    assert body["pipeline_version_reference"] == {"pipeline_id": pipeline["pipeline_id"], "pipeline_version_id": version["pipeline_version_id"]}
    assert "pipeline_spec" not in body, "a schedule runs the registered version, not an inline copy"
    [old_id] = kfp_api.recurring_runs
    assert f"recurring run {old_id} of fedpipe-fedavg (version {version['display_name']})" in first.stdout
    assert not kfp_api.requests("DELETE")

    # scheduling again with another cron replaces it: the old one deleted, exactly one left
    second = ok(fedpipe_cli("schedule", "--host", kfp_api.url, "--method", "fedavg", "--cron", "30 4 * * 1"))
    [delete] = kfp_api.requests("DELETE")
    assert delete.path == f"{API}/recurringruns/{old_id}"
    [(new_id, job)] = kfp_api.recurring_runs.items()
    assert new_id != old_id
    assert job["trigger"]["cron_schedule"]["cron"] == "0 30 4 * * 1"
    assert job["pipeline_version_reference"]["pipeline_version_id"] == version["pipeline_version_id"]
    assert len(kfp_api.requests("POST", UPLOAD_VERSION)) == 1, "the same config is not uploaded again"
    assert new_id in second.stdout


def test_a_bad_cron_leaves_the_existing_schedule_alone(kfp_api):
    ok(fedpipe_cli("schedule", "--host", kfp_api.url, "--method", "fedavg", "--cron", "0 3 * * *"))
    [old_id] = kfp_api.recurring_runs
    message = error_paragraph(fedpipe_cli("schedule", "--host", kfp_api.url, "--method", "fedavg", "--cron", "0 3 * *"))
    assert "'0 3 * *'" in message and "5 fields" in message
    assert list(kfp_api.recurring_runs) == [old_id]


@pytest.mark.parametrize("given, sent", [("0 3 * * *", "0 0 3 * * *"), ("*/15  *  * * 1-5", "0 */15 * * * 1-5"), ("5 0 3 * * *", "5 0 3 * * *")])
def test_kfp_cron_makes_six_fields(given, sent):
    assert kfp_cron(given) == sent


@pytest.mark.parametrize("bad", ["", "0 3 * *", "daily", "0 0 0 3 * * *"])
def test_kfp_cron_rejects_what_is_not_cron(bad):
    with pytest.raises(FedpipeError, match="5 fields"):
        kfp_cron(bad)


# -- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["register"], ["submit"], ["schedule", "--cron", "0 3 * * *"]])
def test_an_unreachable_host_is_one_paragraph_with_the_port_forward(command):
    host = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    message = error_paragraph(fedpipe_cli(*command, "--host", host, "--method", "fedavg"))
    assert host in message
    assert "kubectl port-forward" in message and "--host" in message


def test_an_unreachable_host_in_a_real_process_prints_only_the_paragraph(tmp_path):
    """The same through the installed entry point: what a user's terminal shows (logging included)."""
    host = f"http://127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KF_PIPELINES", "FEDPIPE_", "AWS_"))}
    env["HOME"] = str(tmp_path)  # no ~/.config/kfp/context.json
    done = subprocess.run([sys.executable, "-m", "fedpipe.cli", "register", "--host", host, "--method", "fedavg"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), f"not one paragraph:\n{done.stderr}"
    assert host in lines[0] and "kubectl port-forward" in lines[0]


def test_an_unreachable_host_with_a_namespace_also_says_how_to_port_forward():
    host = f"http://127.0.0.1:{free_port()}"
    message = error_paragraph(fedpipe_cli("register", "--host", host, "--method", "fedavg", "--namespace", "team-a"))
    assert host in message and "kubectl port-forward" in message


@pytest.mark.parametrize("path, status, server_message, what", [
    (UPLOAD, 500, "Failed to create a pipeline and a pipeline version: database is locked", "upload the pipeline"),
    (UPLOAD, 409, "Failed to create a pipeline and a pipeline version", "upload the pipeline"),
    (UPLOAD_VERSION, 500, "Failed to create a pipeline version: object store unavailable", "upload the pipeline version"),
], ids=["upload-500", "upload-409", "upload-version-500"])
def test_a_refused_upload_is_one_paragraph_with_the_servers_message(kfp_api, path, status, server_message, what):
    kfp_api.fail("POST", path, status, server_message)
    message = error_paragraph(fedpipe_cli("register", "--host", kfp_api.url, "--method", "fedavg"))
    assert f"Kubeflow Pipelines refused to {what}" in message
    assert server_message in message
    assert [r.status for r in kfp_api.requests("POST", path)] == [status], "an upload is tried once"


def test_a_refused_run_is_one_paragraph_with_the_servers_message(kfp_api):
    kfp_api.fail("POST", f"{API}/runs", 403, "User 'alice' is not allowed to create runs in namespace 'kubeflow'")
    message = error_paragraph(fedpipe_cli("submit", "--host", kfp_api.url, "--method", "fedavg"))
    assert "refused to create the run" in message and "User 'alice' is not allowed" in message
    assert not kfp_api.runs


# -- credentials ----------------------------------------------------------------------------------


def test_no_credentials_from_the_environment_are_sent(kfp_api, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    outputs = [
        ok(fedpipe_cli("submit", "--host", kfp_api.url, "--method", "fedavg")).output,
        ok(fedpipe_cli("register", "--host", kfp_api.url, "--method", "fedavg")).output,  # uploads the YAML
    ]
    assert kfp_api.requests("POST", f"{API}/runs") and kfp_api.requests("POST", UPLOAD) and kfp_api.requests("POST", UPLOAD_VERSION)
    for request in kfp_api.recorded:
        wire = request.wire_bytes()  # request line, query, headers, body (uploaded files included)
        for secret in (ACCESS_KEY, SECRET_KEY):
            assert secret.encode() not in wire, f"{request.method} {request.path} carries {secret}"
    for output in outputs:
        assert ACCESS_KEY not in output and SECRET_KEY not in output

    # the pods get their credentials from the Secret, by reference
    [run] = kfp_api.requests("POST", f"{API}/runs")
    platform = json.dumps(run.body["pipeline_spec"]["platform_spec"])
    assert "AWS_SECRET_ACCESS_KEY" in platform and "secretNameParameter" in platform
