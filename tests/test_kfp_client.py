"""`fedpipe register`, `submit` and `schedule` against a stand-in Kubeflow Pipelines API server.

No KFP server can run here, so `kfp_api_standin.KfpApiStandIn` (an in-process HTTP server on a
loopback port, NOT Kubeflow) answers the v2beta1 REST API. The commands run in-process through
typer's CliRunner and talk to it with the real `kfp.Client`, so these tests check the requests
our code makes through the real kfp library: the uploaded pipeline file, the run and recurring-run
JSON, and how server errors and an unreachable server reach the user.

The multi-user tests run the stand-in in its multi-user mode, which refuses what the real API server
of multi-user Kubeflow refuses (no identity, a namespace the caller may not use, experiments without
a namespace, ...; see kfp_api_standin for the Go sources), and the version tests make it report an
older or an unknown release in healthz.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import kfp
import pytest
import yaml
from kfp_api_standin import KfpApiStandIn
from kfp_backend import flat_tasks
from typer.testing import CliRunner

import fedpipe
import fedpipe.pipelines.client as kfp_client
from fedpipe.cli import app
from fedpipe.errors import FedpipeError
from fedpipe.pipelines.client import kfp_cron

API = "/apis/v2beta1"
UPLOAD = f"{API}/pipelines/upload"
UPLOAD_VERSION = f"{API}/pipelines/upload_version"
VERSION_NAME = re.compile(re.escape(fedpipe.__version__) + r"-[0-9a-f]{12}")

# kfp_client's own value, before the autouse fixture below points it at a file that is not there.
PROJECTED_TOKEN_PATH = getattr(kfp_client, "IN_CLUSTER_TOKEN_PATH", None)

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
                 "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "FEDPIPE_KFP_TOKEN", "KF_PIPELINES_SA_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    # kfp keeps a namespace in ~/.config/kfp/context.json; point it at an empty folder
    monkeypatch.setattr(kfp.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "kfp-context.json"))
    # no projected token here, whatever this machine has at /var/run/secrets/kubeflow/pipelines/token
    monkeypatch.setattr(kfp_client, "IN_CLUSTER_TOKEN_PATH", str(tmp_path / "no-projected-token"), raising=False)


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
    tasks = flat_tasks(spec)
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
    assert {"resolve-config", "partition", "train-phase", "evaluate"} <= set(flat_tasks(spec))
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


# -- unschedule ------------------------------------------------------------------------------------


def test_unschedule_deletes_the_recurring_run_schedule_made_and_only_it(kfp_api):
    ok(fedpipe_cli("schedule", "--host", kfp_api.url, "--method", "fedavg", "--cron", "0 3 * * *"))
    ok(fedpipe_cli("schedule", "--host", kfp_api.url, "--method", "fedprox", "--cron", "0 4 * * *"))  # another pipeline's
    [(fedavg_id, _)] = [(i, r) for i, r in kfp_api.recurring_runs.items() if r["display_name"] == "fedpipe-fedavg-schedule"]

    result = ok(fedpipe_cli("unschedule", "--host", kfp_api.url, "--method", "fedavg"))
    [delete] = kfp_api.requests("DELETE")
    assert delete.path == f"{API}/recurringruns/{fedavg_id}" and delete.status == 200
    assert [r["display_name"] for r in kfp_api.recurring_runs.values()] == ["fedpipe-fedprox-schedule"]
    assert fedavg_id in result.stdout and "fedpipe-fedavg-schedule" in result.stdout
    # the pipeline and its versions stay
    assert kfp_api.pipeline_named("fedpipe-fedavg") is not None

    # nothing left: nothing deleted, and it says so
    again = ok(fedpipe_cli("unschedule", "--host", kfp_api.url, "--name", "fedpipe-fedavg"))
    assert len(kfp_api.requests("DELETE")) == 1 and "nothing to delete" in again.stdout
    # the same name in another experiment is another recurring run
    ok(fedpipe_cli("unschedule", "--host", kfp_api.url, "--method", "fedprox", "--experiment", "nightly"))
    assert len(kfp_api.recurring_runs) == 1 and kfp_api.experiment_named("nightly") is None, "unschedule creates nothing"
    ok(fedpipe_cli("unschedule", "--host", kfp_api.url, "--method", "fedprox", "--experiment", "fedpipe"))
    assert not kfp_api.recurring_runs


def test_unschedule_of_a_recurring_run_deleted_meanwhile_succeeds(kfp_api):
    ok(fedpipe_cli("schedule", "--host", kfp_api.url, "--method", "fedavg", "--cron", "0 3 * * *"))
    [job_id] = kfp_api.recurring_runs
    kfp_api.fail("DELETE", f"{API}/recurringruns/.*", 404, f"Job {job_id} not found", times=1)  # another uninstall won
    ok(fedpipe_cli("unschedule", "--host", kfp_api.url, "--method", "fedavg"))
    kfp_api.fail("DELETE", f"{API}/recurringruns/.*", 500, "database is down", times=1)
    message = error_paragraph(fedpipe_cli("unschedule", "--host", kfp_api.url, "--method", "fedavg"))
    assert "refused to delete the recurring run" in message and "database is down" in message
    assert list(kfp_api.recurring_runs) == [job_id]


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


# -- multi-user Kubeflow --------------------------------------------------------------------------

TEAM = "team-a"
USER = "system:serviceaccount:team-a:fedpipe"
TOKEN = "kfp-token-3b9e2c-for-team-a"
HEALTHZ = f"{API}/healthz"


@pytest.fixture
def kfp_multi_user():
    """A multi-user KFP API: TOKEN is USER's (a TokenReview would say so), and USER may work in TEAM only."""
    with KfpApiStandIn(multi_user=True) as server:
        server.add_token(TOKEN, USER)
        server.grant(USER, TEAM)
        yield server


def authorization(request) -> str | None:
    return next((v for k, v in request.headers.items() if k.lower() == "authorization"), None)


def assert_all_authenticated(server, token: str = TOKEN) -> None:
    """Every call but healthz (which the real server answers to anyone) carried the token, and none was refused."""
    calls = [r for r in server.recorded if r.path != HEALTHZ]
    assert calls
    for request in calls:
        assert authorization(request) == f"Bearer {token}", f"{request.method} {request.path}: {authorization(request)!r}"
        assert request.status == 200, f"{request.method} {request.path} answered {request.status}"


def token_file(tmp_path, token: str = TOKEN):
    path = tmp_path / "kfp-token"
    path.write_text(token + "\n")
    return path


def test_in_the_cluster_the_projected_token_is_sent_and_the_pipeline_belongs_to_the_namespace(kfp_multi_user, tmp_path, monkeypatch):
    """Where the chart mounts it, with --host given (kfp itself only uses that token when no host is given)."""
    monkeypatch.setattr(kfp_client, "IN_CLUSTER_TOKEN_PATH", str(token_file(tmp_path)), raising=False)
    ok(fedpipe_cli("register", "--host", kfp_multi_user.url, "--method", "fedavg", "--namespace", TEAM))

    assert_all_authenticated(kfp_multi_user)
    [upload] = kfp_multi_user.requests("POST", UPLOAD)
    assert upload.param("namespace") == TEAM, "the pipeline belongs to the profile, not to every profile"
    pipeline = kfp_multi_user.pipeline_named("fedpipe-fedavg", TEAM)
    assert pipeline is not None and kfp_multi_user.pipeline_named("fedpipe-fedavg", "") is None
    [listing] = kfp_multi_user.requests("GET", f"{API}/pipelines")
    assert listing.param("namespace") == TEAM

    # registering again finds it in the namespace: no second pipeline, no new version
    ok(fedpipe_cli("register", "--host", kfp_multi_user.url, "--method", "fedavg", "--namespace", TEAM))
    assert len(kfp_multi_user.requests("POST", UPLOAD)) == 1 and len(kfp_multi_user.requests("POST", UPLOAD_VERSION)) == 1
    assert_all_authenticated(kfp_multi_user)


def test_submit_with_the_token_file_the_chart_names_puts_experiment_and_run_in_the_namespace(kfp_multi_user, tmp_path, monkeypatch):
    path = token_file(tmp_path)
    monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(path))  # what the chart's registration Job sets
    ok(fedpipe_cli("submit", "--host", kfp_multi_user.url, "--method", "fedavg", "--namespace", TEAM, "--experiment", "exp1"))

    assert_all_authenticated(kfp_multi_user)
    [created] = kfp_multi_user.requests("POST", f"{API}/experiments")
    assert created.body["namespace"] == TEAM
    experiment = kfp_multi_user.experiment_named("exp1", TEAM)
    assert experiment is not None
    [run] = kfp_multi_user.runs.values()
    assert run["experiment_id"] == experiment["experiment_id"] and run["namespace"] == TEAM

    # the kubelet rotates the token: the file is read again for each request
    kfp_multi_user.add_token("rotated-token", USER)
    path.write_text("rotated-token")
    kfp_multi_user.recorded.clear()
    ok(fedpipe_cli("submit", "--host", kfp_multi_user.url, "--method", "fedavg", "--namespace", TEAM, "--experiment", "exp1"))
    assert_all_authenticated(kfp_multi_user, "rotated-token")
    assert len(kfp_multi_user.runs) == 2 and not kfp_multi_user.requests("POST", f"{API}/experiments")


def test_schedule_from_outside_with_a_token_makes_the_recurring_run_in_the_namespace(kfp_multi_user, monkeypatch):
    token = []  # the token comes from FEDPIPE_KFP_TOKEN (a --token value would show in `ps`; tests/test_secrets.py)
    monkeypatch.setenv("FEDPIPE_KFP_TOKEN", TOKEN)
    ok(fedpipe_cli("schedule", "--host", kfp_multi_user.url, "--method", "fedavg", "--cron", "0 3 * * *", "--namespace", TEAM, *token))

    assert_all_authenticated(kfp_multi_user)
    experiment = kfp_multi_user.experiment_named("fedpipe", TEAM)
    assert experiment is not None
    [(old_id, job)] = kfp_multi_user.recurring_runs.items()
    assert job["namespace"] == TEAM and job["experiment_id"] == experiment["experiment_id"]
    pipeline = kfp_multi_user.pipeline_named("fedpipe-fedavg", TEAM)
    assert job["pipeline_version_reference"]["pipeline_id"] == pipeline["pipeline_id"]

    # replacing it: listed and deleted in the namespace
    ok(fedpipe_cli("schedule", "--host", kfp_multi_user.url, "--method", "fedavg", "--cron", "30 4 * * *", "--namespace", TEAM, *token))
    assert_all_authenticated(kfp_multi_user)
    [delete] = kfp_multi_user.requests("DELETE")
    assert delete.path == f"{API}/recurringruns/{old_id}"
    [job] = kfp_multi_user.recurring_runs.values()
    assert job["trigger"]["cron_schedule"]["cron"] == "0 30 4 * * *" and job["namespace"] == TEAM


def test_unschedule_in_a_profile_namespace_with_only_the_verbs_it_needs(kfp_multi_user, tmp_path, monkeypatch):
    """The verbs the real server checks (kubeflow/pipelines 2.5.0, backend/src/apiserver/server/): experiment_server.go
    ListExperiments (list experiments, kfp's get_experiment by name), job_server.go listJobs (list jobs in the
    experiment's namespace) and DeleteRecurringRun -> deleteJob -> canAccessJob (delete jobs in the job's namespace)."""
    monkeypatch.setenv("FEDPIPE_KFP_TOKEN", TOKEN)
    ok(fedpipe_cli("schedule", "--host", kfp_multi_user.url, "--method", "fedavg", "--cron", "0 3 * * *", "--namespace", TEAM))
    monkeypatch.delenv("FEDPIPE_KFP_TOKEN")
    [job_id] = kfp_multi_user.recurring_runs
    # the chart's uninstall hook: its ServiceAccount's projected token, and a Role with only these rules
    hook_user = "system:serviceaccount:team-a:fedpipe-hook"
    kfp_multi_user.add_token("hook-token", hook_user)
    kfp_multi_user.bind_role(hook_user, TEAM, [
        {"apiGroups": ["pipelines.kubeflow.org"], "resources": ["experiments"], "verbs": ["list"]},
        {"apiGroups": ["pipelines.kubeflow.org"], "resources": ["jobs"], "verbs": ["list", "delete"]},
    ])  # fmt: skip
    monkeypatch.setattr(kfp_client, "IN_CLUSTER_TOKEN_PATH", str(token_file(tmp_path, "hook-token")), raising=False)
    kfp_multi_user.recorded.clear()
    ok(fedpipe_cli("unschedule", "--host", kfp_multi_user.url, "--method", "fedavg", "--namespace", TEAM))

    assert not kfp_multi_user.recurring_runs
    assert_all_authenticated(kfp_multi_user, "hook-token")
    checked = {(ns, verb, resource) for user, ns, verb, resource, _ in kfp_multi_user.authorizations if user == hook_user}
    assert checked == {(TEAM, "list", "experiments"), (TEAM, "list", "jobs"), (TEAM, "delete", "jobs")}
    [delete] = kfp_multi_user.requests("DELETE")
    assert delete.path == f"{API}/recurringruns/{job_id}"


def test_unschedule_in_a_namespace_the_caller_may_not_use_is_refused(kfp_multi_user, monkeypatch):
    monkeypatch.setenv("FEDPIPE_KFP_TOKEN", TOKEN)
    ok(fedpipe_cli("schedule", "--host", kfp_multi_user.url, "--method", "fedavg", "--cron", "0 3 * * *", "--namespace", TEAM))
    kfp_multi_user.add_token("other-token", "system:serviceaccount:team-b:fedpipe")
    kfp_multi_user.grant("system:serviceaccount:team-b:fedpipe", "team-b")
    monkeypatch.setenv("FEDPIPE_KFP_TOKEN", "other-token")
    message = error_paragraph(fedpipe_cli("unschedule", "--host", kfp_multi_user.url, "--method", "fedavg", "--namespace", TEAM))
    assert "is not authorized" in message and TEAM in message
    assert len(kfp_multi_user.recurring_runs) == 1
    monkeypatch.setenv("FEDPIPE_KFP_TOKEN", TOKEN)
    message = error_paragraph(fedpipe_cli("unschedule", "--host", kfp_multi_user.url, "--method", "fedavg"))
    assert "multi-user" in message and "--namespace" in message


@pytest.mark.parametrize("command", [["register"], ["submit"], ["schedule", "--cron", "0 3 * * *"]], ids=["register", "submit", "schedule"])
def test_multi_user_without_a_namespace_is_refused_before_anything_is_sent(kfp_multi_user, command, monkeypatch):
    monkeypatch.setenv("FEDPIPE_KFP_TOKEN", TOKEN)
    message = error_paragraph(fedpipe_cli(*command, "--host", kfp_multi_user.url, "--method", "fedavg"))
    assert "multi-user" in message and "--namespace" in message
    assert {r.path for r in kfp_multi_user.recorded} == {HEALTHZ}, "nothing is looked up or uploaded"
    assert not kfp_multi_user.pipelines and not kfp_multi_user.experiments


def test_the_namespace_kfp_remembers_is_used(kfp_multi_user, tmp_path, monkeypatch):
    """kfp's own mechanism: kfp.Client().set_user_namespace() saves it in ~/.config/kfp/context.json."""
    (tmp_path / "kfp-context.json").write_text(json.dumps({"namespace": TEAM}))
    monkeypatch.setenv("FEDPIPE_KFP_TOKEN", TOKEN)
    ok(fedpipe_cli("submit", "--host", kfp_multi_user.url, "--method", "fedavg"))
    assert_all_authenticated(kfp_multi_user)
    assert kfp_multi_user.experiment_named("fedpipe", TEAM) is not None
    assert [r["namespace"] for r in kfp_multi_user.runs.values()] == [TEAM]


def test_multi_user_without_credentials_says_how_to_pass_a_token(kfp_multi_user):
    message = error_paragraph(fedpipe_cli("submit", "--host", kfp_multi_user.url, "--method", "fedavg", "--namespace", TEAM))
    assert "refused to look up the experiment" in message and "User identity is empty" in message
    assert "FEDPIPE_KFP_TOKEN" in message and "pipelines.kubeflow.org" in message
    assert not kfp_multi_user.experiments and not kfp_multi_user.runs


def test_a_token_the_server_does_not_accept_is_refused(kfp_multi_user, monkeypatch):
    monkeypatch.setenv("FEDPIPE_KFP_TOKEN", "not-a-token")
    message = error_paragraph(fedpipe_cli("schedule", "--host", kfp_multi_user.url, "--method", "fedavg", "--cron", "0 3 * * *",
                                          "--namespace", TEAM))
    assert "Authentication failure" in message and "FEDPIPE_KFP_TOKEN" in message
    assert not kfp_multi_user.recurring_runs


def test_a_namespace_the_caller_may_not_use_is_refused(kfp_multi_user, monkeypatch):
    monkeypatch.setenv("FEDPIPE_KFP_TOKEN", TOKEN)
    message = error_paragraph(fedpipe_cli("submit", "--host", kfp_multi_user.url, "--method", "fedavg", "--namespace", "team-b"))
    assert f"User '{USER}' is not authorized" in message and "team-b" in message and "--namespace" in message
    assert not kfp_multi_user.experiments


def test_a_token_file_that_cannot_be_read_is_one_paragraph(kfp_multi_user, tmp_path):
    missing = tmp_path / "nowhere" / "token"
    message = error_paragraph(fedpipe_cli("register", "--host", kfp_multi_user.url, "--method", "fedavg", "--namespace", TEAM,
                                          "--token-file", missing))
    assert str(missing) in message and "--token-file" in message
    assert not kfp_multi_user.recorded


def test_the_in_cluster_token_is_where_kfp_and_the_chart_put_it():
    import kfp.client

    assert PROJECTED_TOKEN_PATH == kfp.client.KF_PIPELINES_SA_TOKEN_PATH
    assert kfp_client.TOKEN_FILE_ENV == kfp.client.KF_PIPELINES_SA_TOKEN_ENV
    helpers = (Path(__file__).parents[1] / "charts" / "fedpipe" / "templates" / "_helpers.tpl").read_text()
    assert f"mountPath: {os.path.dirname(PROJECTED_TOKEN_PATH)}\n" in helpers


def test_a_single_user_server_takes_the_token_and_needs_no_namespace(kfp_api, monkeypatch):
    monkeypatch.setenv("FEDPIPE_KFP_TOKEN", TOKEN)
    ok(fedpipe_cli("schedule", "--host", kfp_api.url, "--method", "fedavg", "--cron", "0 3 * * *"))
    assert all(authorization(r) == f"Bearer {TOKEN}" for r in kfp_api.recorded if r.path != HEALTHZ)
    assert len(kfp_api.recurring_runs) == 1


# -- the multi-user stand-in refuses what the real server refuses ---------------------------------


def call(server, method: str, path: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(server.url + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_multi_user_standin_enforces_identity_and_namespaces(kfp_multi_user):
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    status, health = call(kfp_multi_user, "GET", HEALTHZ)  # no identity needed
    assert status == 200 and health["multi_user"] is True and health["tag_name"]

    assert call(kfp_multi_user, "POST", f"{API}/experiments", {"display_name": "e", "namespace": TEAM})[0] == 401
    status, error = call(kfp_multi_user, "POST", f"{API}/experiments", {"display_name": "e"}, bearer)
    assert status == 400 and "cannot have an empty namespace in multi-user mode" in error["message"]
    assert call(kfp_multi_user, "POST", f"{API}/experiments", {"display_name": "e", "namespace": "team-b"}, bearer)[0] == 403
    status, experiment = call(kfp_multi_user, "POST", f"{API}/experiments", {"display_name": "e", "namespace": TEAM},
                              {"kubeflow-userid": USER})  # the header Istio sets behind the Kubeflow ingress
    assert status == 200 and experiment["namespace"] == TEAM
    assert call(kfp_multi_user, "GET", f"{API}/experiments", headers=bearer)[0] == 400

    spec = {"pipelineInfo": {"name": "p"}, "root": {}}
    status, error = call(kfp_multi_user, "POST", f"{API}/runs", {"display_name": "r", "pipeline_spec": spec}, bearer)
    assert status == 400 and "Experiment id can not be empty in multi-user mode" in error["message"]
    job = {"display_name": "j", "experiment_id": experiment["experiment_id"], "pipeline_spec": spec,
           "trigger": {"cron_schedule": {"cron": "0 0 3 * * *"}}}
    status, error = call(kfp_multi_user, "POST", f"{API}/recurringruns", {**job, "namespace": "team-b"}, bearer)
    assert status == 400 and f"belongs to namespace '{TEAM}' instead of 'team-b'" in error["message"]
    assert call(kfp_multi_user, "POST", f"{API}/recurringruns", job)[0] == 401
    status, made = call(kfp_multi_user, "POST", f"{API}/recurringruns", job, bearer)
    assert status == 200 and made["namespace"] == TEAM
    assert call(kfp_multi_user, "GET", f"{API}/recurringruns", headers=bearer)[0] == 400  # neither experiment nor namespace
    assert call(kfp_multi_user, "DELETE", f"{API}/recurringruns/{made['recurring_run_id']}")[0] == 401


def test_the_standin_deletes_recurring_runs_as_the_real_server_does():
    """DeleteRecurringRun (job_server.go at 2.5.0): an unknown id is 404 in both modes (multi-user: canAccessJob
    looks the job up before authorizing); a known one is authorized in its namespace, then gone."""
    spec = {"pipelineInfo": {"name": "p"}, "root": {}}
    for multi_user in (False, True):
        with KfpApiStandIn(multi_user=multi_user) as server:
            server.add_token(TOKEN, USER)
            server.grant(USER, TEAM)
            bearer = {"Authorization": f"Bearer {TOKEN}"}
            status, error = call(server, "DELETE", f"{API}/recurringruns/no-such-id", headers=bearer)
            assert status == 404 and "Failed to disable a recurring run" in error["message"] and "no-such-id" in error["message"]
            _, experiment = call(server, "POST", f"{API}/experiments", {"display_name": "e", "namespace": TEAM}, bearer)
            job = {"display_name": "j", "experiment_id": experiment["experiment_id"], "pipeline_spec": spec,
                   "trigger": {"cron_schedule": {"cron": "0 0 3 * * *"}}}
            _, made = call(server, "POST", f"{API}/recurringruns", job, bearer)
            path = f"{API}/recurringruns/{made['recurring_run_id']}"
            if multi_user:
                server.add_token("other", "system:serviceaccount:team-b:x")
                assert call(server, "DELETE", path, headers={"Authorization": "Bearer other"})[0] == 403
                assert made["recurring_run_id"] in server.recurring_runs
            assert call(server, "DELETE", path, headers=bearer) == (200, {})
            assert not server.recurring_runs and call(server, "GET", path, headers=bearer)[0] == 404


# -- the KFP backend's version --------------------------------------------------------------------


@pytest.fixture
def kfp_release():
    """A single-user stand-in whose healthz reports the release the test sets."""
    with KfpApiStandIn() as server:
        yield server


@pytest.mark.parametrize("tag", ["2.4.1", "2.3.0", "2.2.0", "v2.0.5", "1.8.5"])
def test_a_too_old_kfp_backend_is_refused_before_anything_is_uploaded(kfp_release, tag):
    kfp_release.tag_name = tag
    message = error_paragraph(fedpipe_cli("register", "--host", kfp_release.url, "--method", "fedavg"))
    assert f"version {tag}" in message and kfp_client.MIN_KFP_BACKEND in message and "Kubeflow 1.10" in message
    assert {r.path for r in kfp_release.recorded} == {HEALTHZ}


@pytest.mark.parametrize("command", [["submit"], ["schedule", "--cron", "0 3 * * *"]], ids=["submit", "schedule"])
def test_submit_and_schedule_also_refuse_a_too_old_backend(kfp_release, command):
    kfp_release.tag_name = "2.3.0"
    message = error_paragraph(fedpipe_cli(*command, "--host", kfp_release.url, "--method", "fedavg"))
    assert "version 2.3.0" in message and "2.5.0" in message
    assert not kfp_release.runs and not kfp_release.recurring_runs and not kfp_release.pipelines


def test_the_version_floor_is_2_5_0():
    assert kfp_client.MIN_KFP_BACKEND == "2.5.0"


@pytest.mark.parametrize("tag", ["2.5.0", "2.5.1", "2.14.3", "v2.15.0", "2.5.0-rc.1", "3.0.0"])
def test_a_new_enough_kfp_backend_is_accepted_quietly(kfp_release, tag):
    kfp_release.tag_name = tag
    result = ok(fedpipe_cli("register", "--host", kfp_release.url, "--method", "fedavg"))
    assert "cannot tell" not in result.stderr
    assert len(kfp_release.pipelines) == 1


@pytest.mark.parametrize("tag", ["unknown", "", "master", "dev", "0f2c9a1e", None], ids=lambda t: repr(t))
def test_an_unknown_kfp_backend_version_is_a_warning_and_goes_on(kfp_release, tag):
    """A server built without TAG_NAME says 'unknown' (main.go: GetStringConfigWithDefault("TAG_NAME", "unknown"));
    a dev build may say anything; None leaves tag_name out. fedpipe cannot tell, says so and goes on."""
    kfp_release.tag_name = tag
    result = ok(fedpipe_cli("register", "--host", kfp_release.url, "--method", "fedavg"))
    warning = [line for line in result.stderr.splitlines() if "cannot tell the version" in line]
    assert len(warning) == 1 and "2.5.0" in warning[0] and repr(tag) in warning[0]
    assert len(kfp_release.pipelines) == 1


@pytest.mark.parametrize("tag, parsed", [("2.5.0", (2, 5, 0)), ("v2.14.3", (2, 14, 3)), ("2.15.0-rc.1", (2, 15, 0)), ("2.5", (2, 5, 0)),
                                         (" 2.4.1 ", (2, 4, 1)), ("unknown", None), ("", None), (None, None), ("master", None), ("2", None)])
def test_parse_kfp_version(tag, parsed):
    assert kfp_client.parse_kfp_version(tag) == parsed
