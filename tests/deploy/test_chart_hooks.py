"""The chart's hooks run for real: the commands they render, run through fedpipe's CLI against the KFP
API stand-in (tests/kfp_api_standin.py, NOT Kubeflow: it enforces what the real API server does, with
the Go sources it follows) and the local Pushgateway and S3 server (tests/services.py).

- the recurring run does not outlive the release: a `pre-delete` hook runs `fedpipe unschedule`, and
  an upgrade that empties schedule.cron runs it before `fedpipe register` (the registration Job's init
  container). In multi-user mode the stand-in allows the hooks' ServiceAccount exactly what the chart's
  Roles bound to it grant, as the API server's SubjectAccessReviews would;
- `helm test`: pods that push to the Pushgateway from where a pipeline pod runs, check the KFP API's
  version, and write to the bucket with the storage Secret's credentials.
"""

from __future__ import annotations

import json
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import kfp
import pytest
from deploytools import CHART, CLUSTER, NAMESPACE, RELEASE, only, parse_docs, run_tool
from istio_model import PROFILE_NAMESPACE_LABELS, Pod
from kfp_api_standin import KfpApiStandIn
from typer.testing import CliRunner

import fedpipe.pipelines.client as kfp_client
from fedpipe.cli import app
from fedpipe.pipelines.builder import POD_LABEL

CRON = ["--set", "schedule.cron=0 0 3 * * *", "--set", "schedule.experiment=nightly"]
FEDAVG = ["--set", "pipeline.method=fedavg"]  # a one-phase pipeline: quicker to compile
IN_CLUSTER_HOST = "http://ml-pipeline.kubeflow.svc.cluster.local:8888"
SA_USER = f"system:serviceaccount:{NAMESPACE}:fedpipe"  # the token's user, as a TokenReview names it
TEST_HOOKS = ["templates/tests/pushgateway-test.yaml", "templates/tests/kfp-api-test.yaml", "templates/tests/storage-test.yaml"]


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """Nothing from this machine steers kfp or the CLI (as in tests/test_kfp_client.py)."""
    for name in ("KF_PIPELINES_ENDPOINT", "FEDPIPE_KFP_TOKEN", "KF_PIPELINES_SA_TOKEN_PATH", "FEDPIPE_IMAGE", "FEDPIPE_STORE",
                 "FEDPIPE_S3_ENDPOINT", "FEDPIPE_S3_SECRET", "FEDPIPE_PUSHGATEWAY", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(kfp.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "kfp-context.json"))
    monkeypatch.setattr(kfp_client, "IN_CLUSTER_TOKEN_PATH", str(tmp_path / "no-projected-token"), raising=False)


def hook_pod(docs: list[dict], kind: str, suffix: str) -> dict:
    doc = only(docs, kind, suffix)
    return doc["spec"] if kind == "Pod" else doc["spec"]["template"]["spec"]


def run_container(container: dict, monkeypatch, tmp_path: Path, where: dict[str, str], secrets: dict | None = None):
    """Run a rendered fedpipe container's command here: its args and env, with the in-cluster addresses and
    paths in `where` replaced by local ones, secretKeyRefs resolved from `secrets` {(secret, key): value}."""
    assert container["command"] == ["fedpipe"], container["command"]

    def local(text: str) -> str:
        for cluster, here in where.items():
            text = text.replace(cluster, here)
        return text

    for env in container.get("env", []):
        if "value" in env:
            monkeypatch.setenv(env["name"], local(env["value"]))
        else:
            ref = env["valueFrom"]["secretKeyRef"]
            monkeypatch.setenv(env["name"], (secrets or {})[(ref["name"], ref["key"])])
    monkeypatch.setenv("HOME", str(tmp_path))
    return CliRunner().invoke(app, [local(arg) for arg in container["args"]])


def ok(result):
    assert result.exit_code == 0, f"exit {result.exit_code}\n{result.output}"
    return result


def failed(result) -> str:
    assert result.exit_code == 2 and "Traceback" not in result.output, f"exit {result.exit_code}\n{result.output}"
    return result.stderr


def bind_the_chart_s_roles(kfp_api: KfpApiStandIn, docs: list[dict]) -> None:
    """What the API server's SubjectAccessReviews allow the Job's ServiceAccount: the rules of every Role the
    chart binds to it (only those: the stand-in refuses the rest)."""
    for binding in (d for d in docs if d["kind"] == "RoleBinding"):
        if {"kind": "ServiceAccount", "name": "fedpipe", "namespace": NAMESPACE} in binding["subjects"]:
            role = only(docs, "Role", binding["roleRef"]["name"])
            kfp_api.bind_role(SA_USER, NAMESPACE, role["rules"])


class Cluster:
    """The stand-in KFP API, the token a projected volume would hold, and the run config ConfigMap's file."""

    def __init__(self, kfp_api: KfpApiStandIn, render_chart, tmp_path: Path, monkeypatch):
        self.kfp_api, self.render_chart, self.tmp_path, self.monkeypatch = kfp_api, render_chart, tmp_path, monkeypatch
        token = tmp_path / "kfp-token"
        token.write_text("projected-sa-token")
        kfp_api.add_token("projected-sa-token", SA_USER)
        self.token = token

    def run(self, docs: list[dict], container: dict):
        config = self.tmp_path / "config.yaml"
        config.write_text(only(docs, "ConfigMap", "-run-config")["data"]["config.yaml"])
        where = {IN_CLUSTER_HOST: self.kfp_api.url, "/etc/fedpipe/config.yaml": str(config),
                 "/var/run/secrets/kubeflow/pipelines/token": str(self.token)}  # fmt: skip
        return run_container(container, self.monkeypatch, self.tmp_path, where)

    def install(self, *values: str) -> list[dict]:
        """What `helm install` / `helm upgrade` applies, then the registration hook's containers in order."""
        docs = self.render_chart(*FEDAVG, *values)
        self.kfp_api.roles.clear()
        bind_the_chart_s_roles(self.kfp_api, docs)
        pod = hook_pod(docs, "Job", "-register")
        for container in pod.get("initContainers", []) + pod["containers"]:
            ok(self.run(docs, container))
        return docs

    def uninstall(self, docs: list[dict]) -> None:
        """`helm uninstall`: the pre-delete hooks, while the release's Roles still exist."""
        hooks = [d for d in docs if "pre-delete" in d["metadata"].get("annotations", {}).get("helm.sh/hook", "")]
        for hook in hooks:
            (container,) = hook["spec"]["template"]["spec"]["containers"]
            ok(self.run(docs, container))


def test_every_fedpipe_command_the_chart_renders_is_one_the_cli_has(render_chart):
    """Each container running `fedpipe` (the Job and its init container, the hooks, the test pods) names a
    command of the CLI and only options of it."""
    import typer

    group = typer.main.get_command(app)
    seen = set()
    for values in ([], CRON, ["--set", "pushgateway.enabled=false", "--set", "prometheusScrapeConfig.enabled=false",
                              "--set", "pushgateway.url=http://pg.monitoring:9091"]):  # fmt: skip
        for doc in render_chart(*values):
            spec = doc["spec"] if doc["kind"] == "Pod" else doc.get("spec", {}).get("template", {}).get("spec", {})
            for container in spec.get("initContainers", []) + spec.get("containers", []):
                if container.get("command") != ["fedpipe"]:
                    continue
                command, args = group, list(container["args"])
                while hasattr(command, "commands"):  # `check kfp` is a command of a group
                    name = args.pop(0)
                    assert name in command.commands, f"{doc['metadata']['name']}: no command {name!r}"
                    command = command.commands[name]
                options = {opt for param in command.params for opt in param.opts}
                given = {arg.split("=", 1)[0] for arg in args}
                assert all(arg.startswith("--") for arg in args) and given <= options, (doc["metadata"]["name"], given - options)
                seen.add(command.name)
    assert seen == {"register", "schedule", "unschedule", "kfp", "store", "pushgateway"}, seen


# -- the recurring run does not outlive the release --------------------------------------------------


def test_the_uninstall_hook_renders_with_its_annotations_and_the_schedule_s_name(render_chart, validate_k8s):
    docs = render_chart(*CRON, "--set", "kubeflow.namespace=kubeflow-user-example-com")
    validate_k8s(docs)
    job = only(docs, "Job", "-unschedule")
    annotations = job["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == "pre-delete"
    assert set(annotations["helm.sh/hook-delete-policy"].split(",")) == {"before-hook-creation", "hook-succeeded"}
    pod = job["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["args"] == ["unschedule", f"--host={IN_CLUSTER_HOST}", "--name=fedpipe-superfed-mm",
                                 "--namespace=kubeflow-user-example-com", "--experiment=nightly"]  # fmt: skip
    assert pod["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false", "a sidecar would keep uninstall waiting"
    assert pod["spec"]["serviceAccountName"] == "fedpipe" and pod["spec"]["automountServiceAccountToken"] is False
    assert not [m for m in container["volumeMounts"] if m["mountPath"] == "/etc/fedpipe"], "it needs no run config"
    # no schedule, nothing to remove on uninstall: `helm uninstall` does not depend on the KFP API then
    assert not [d for d in render_chart() if d["metadata"]["name"].endswith("-unschedule") and d["kind"] == "Job"]
    assert not [d for d in render_chart(*CRON, "--set", "register.enabled=false") if d["kind"] == "Job"]


def test_an_upgrade_that_empties_the_cron_removes_the_schedule_before_registering(render_chart):
    pod = hook_pod(render_chart(), "Job", "-register")
    (init,) = pod["initContainers"]
    assert init["args"] == ["unschedule", f"--host={IN_CLUSTER_HOST}", "--name=fedpipe-superfed-mm", f"--namespace={NAMESPACE}"]
    assert [c["args"][0] for c in pod["containers"]] == ["register"]
    nightly = hook_pod(render_chart("--set", "schedule.experiment=nightly"), "Job", "-register")
    assert nightly["initContainers"][0]["args"][-1] == "--experiment=nightly"
    scheduled = hook_pod(render_chart(*CRON), "Job", "-register")
    assert "initContainers" not in scheduled, "`fedpipe schedule` replaces the recurring run itself"


@pytest.mark.parametrize("multi_user", [False, True], ids=["single-user", "multi-user"])
def test_install_upgrade_and_uninstall_leave_no_recurring_run(render_chart, tmp_path, monkeypatch, multi_user):
    with KfpApiStandIn(multi_user=multi_user, tag_name="2.5.0") as kfp_api:
        cluster = Cluster(kfp_api, render_chart, tmp_path, monkeypatch)

        installed = cluster.install(*CRON)
        [job] = kfp_api.recurring_runs.values()
        assert job["display_name"] == "fedpipe-fedavg-schedule" and job["trigger"]["cron_schedule"]["cron"] == "0 0 3 * * *"
        if multi_user:
            assert job["namespace"] == NAMESPACE

        cluster.install("--set", "schedule.experiment=nightly")  # `helm upgrade --set schedule.cron=""`
        assert not kfp_api.recurring_runs, "the upgrade without a cron left the recurring run scheduling"
        assert kfp_api.pipeline_named("fedpipe-fedavg") is not None, "the pipeline stays registered"

        installed = cluster.install(*CRON)
        assert len(kfp_api.recurring_runs) == 1
        cluster.uninstall(installed)
        assert not kfp_api.recurring_runs, "the recurring run outlived `helm uninstall`"
        if multi_user:  # the hooks' calls were allowed by the chart's Roles, and by nothing else
            assert not [a for a in kfp_api.authorizations if not a[-1]], "a call the chart's Roles do not grant"
            assert {(verb, resource) for user, _, verb, resource, _ in kfp_api.authorizations if user == SA_USER} >= {
                ("list", "jobs"), ("delete", "jobs"), ("list", "experiments")}
        cluster.uninstall(installed)  # a second uninstall attempt finds nothing and still succeeds


# -- helm test ----------------------------------------------------------------------------------------


def show_only(helm: str, template: str, *values: str) -> list[dict]:
    argv = [helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *CLUSTER, "--show-only", template, *values]
    return parse_docs(run_tool(argv).stdout)


def test_the_test_hooks_render_validate_and_run_the_fedpipe_image(helm: str, render_chart, validate_k8s):
    docs = [doc for template in TEST_HOOKS for doc in show_only(helm, template)]
    validate_k8s(docs)
    lint = run_tool([helm, "lint", "--strict", str(CHART), "--set", "tests.enabled=true"]).stdout
    assert "0 chart(s) failed" in lint and "[WARNING]" not in lint, lint
    assert [d["kind"] for d in docs] == ["Pod"] * 3
    for doc in docs:
        assert doc["metadata"]["annotations"]["helm.sh/hook"] == "test", doc["metadata"]["name"]
        assert "before-hook-creation" in doc["metadata"]["annotations"]["helm.sh/hook-delete-policy"]
        (container,) = doc["spec"]["containers"]
        assert container["image"] == "ghcr.io/fedpipe/fedpipe:0.1.0" and container["command"] == ["fedpipe"]
        assert container["args"][0] == "check" and doc["spec"]["restartPolicy"] == "Never"
        pod = Pod(NAMESPACE, labels=doc["metadata"]["labels"], annotations=doc["metadata"].get("annotations", {}),
                  namespace_labels=PROFILE_NAMESPACE_LABELS)  # fmt: skip
        assert not pod.meshed, f"{doc['metadata']['name']}: a sidecar would keep `helm test` waiting"
    # the Pushgateway and the store are checked from a pod labelled like the pipeline's task pods
    for name in ("-test-pushgateway", "-test-storage"):
        labels = only(docs, "Pod", name)["metadata"]["labels"]
        assert labels[POD_LABEL[0]] == POD_LABEL[1] and labels["pipelines.kubeflow.org/v2_component"] == "true", labels
    # what `helm test` runs is among what `helm install` applies as hooks
    assert {d["metadata"]["name"] for d in docs} <= {d["metadata"]["name"] for d in render_chart() if d["kind"] == "Pod"}
    assert not [d for d in render_chart("--set", "tests.enabled=false") if d["kind"] == "Pod"]


def test_the_test_hooks_point_where_the_pipeline_goes(helm: str):
    (push,) = show_only(helm, TEST_HOOKS[0])
    assert push["spec"]["containers"][0]["args"] == ["check", "pushgateway", f"--url=http://fedpipe-pushgateway.{NAMESPACE}:9091"]
    (external,) = show_only(helm, TEST_HOOKS[0], "--set", "pushgateway.enabled=false", "--set", "prometheusScrapeConfig.enabled=false",
                            "--set", "pushgateway.url=http://prometheus-pushgateway.monitoring:9091")  # fmt: skip
    assert external["spec"]["containers"][0]["args"][-1] == "--url=http://prometheus-pushgateway.monitoring:9091"
    (api,) = show_only(helm, TEST_HOOKS[1], "--set", "kubeflow.namespace=kubeflow-user-example-com")
    assert api["spec"]["containers"][0]["args"] == ["check", "kfp", f"--host={IN_CLUSTER_HOST}", "--namespace=kubeflow-user-example-com"]
    assert api["spec"]["serviceAccountName"] == "fedpipe"
    (store,) = show_only(helm, TEST_HOOKS[2], "--set", "runConfig.run.store=s3://team-bucket/runs", "--set", "storage.existingSecret=team-s3")
    (container,) = store["spec"]["containers"]
    assert container["args"] == ["check", "store", "--store=s3://team-bucket/runs"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["FEDPIPE_S3_ENDPOINT"] == "http://minio-service.kubeflow:9000"
    assert env["AWS_ACCESS_KEY_ID"] == {"secretKeyRef": {"name": "team-s3", "key": "accesskey"}}
    assert env["AWS_SECRET_ACCESS_KEY"] == {"secretKeyRef": {"name": "team-s3", "key": "secretkey"}}


@pytest.mark.services
def test_the_pushgateway_test_pushes_finds_and_deletes_its_group(helm: str, pushgateway: str, monkeypatch, tmp_path, port_factory):
    (pod,) = show_only(helm, TEST_HOOKS[0])
    (container,) = pod["spec"]["containers"]
    in_cluster = f"http://fedpipe-pushgateway.{NAMESPACE}:9091"
    result = ok(run_container(container, monkeypatch, tmp_path, {in_cluster: pushgateway}))
    assert "pushed, found and deleted" in result.stdout
    # the Pushgateway answers a DELETE with 202 and applies it from its write queue (storage/diskmetricstore.go's
    # SubmitWriteRequest), so the group may be listed for a moment after the check returned
    deadline, groups = time.monotonic() + 10, ["?"]
    while groups and time.monotonic() < deadline:
        with urllib.request.urlopen(f"{pushgateway}/api/v1/metrics") as response:
            groups = [g for g in json.load(response)["data"] if g["labels"].get("job") == "fedpipe-check"]
        time.sleep(0.1 if groups else 0)
    assert not groups, "the check left its group behind"
    # a Pushgateway nobody serves, and one behind Istio's sidecar that denies the push, fail the test
    dead = f"http://127.0.0.1:{port_factory()}"
    assert "did not take a push" in failed(run_container(container, monkeypatch, tmp_path, {in_cluster: dead}))
    with envoy_denying_everything() as denied:
        message = failed(run_container(container, monkeypatch, tmp_path, {in_cluster: denied}))
    assert "403" in message and "Istio" in message and "pushgateway.podAnnotations" in message


@pytest.mark.services
def test_the_storage_test_writes_reads_and_deletes_with_the_secret_s_credentials(helm: str, s3_server: str, s3_credentials, monkeypatch,
                                                                                  tmp_path, port_factory):
    (pod,) = show_only(helm, TEST_HOOKS[2], "--set", "runConfig.run.store=s3://fedpipe-helm-test/runs")
    (container,) = pod["spec"]["containers"]
    where = {"http://minio-service.kubeflow:9000": s3_server}
    access, secret = s3_credentials
    secrets = {("mlpipeline-minio-artifact", "accesskey"): access, ("mlpipeline-minio-artifact", "secretkey"): secret}
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("FEDPIPE_S3_RETRY_SECONDS", "2")
    result = ok(run_container(container, monkeypatch, tmp_path, where, secrets))
    assert "wrote, read back and deleted s3://fedpipe-helm-test/runs/_fedpipe-check/" in result.stdout

    from fedpipe.store import open_store

    assert open_store("s3://fedpipe-helm-test/runs").list("_fedpipe-check") == [], "the check left its object behind"
    # a store nobody serves fails the test, naming it, never the credentials (moto takes any key, so a wrong one
    # cannot be shown here)
    dead = f"http://127.0.0.1:{port_factory()}"
    message = failed(run_container(container, monkeypatch, tmp_path, {"http://minio-service.kubeflow:9000": dead}, secrets))
    assert dead.removeprefix("http://") in message and secret not in message


@pytest.mark.parametrize("tag, passes", [("2.5.0", True), ("2.16.0", True), ("2.4.1", False)])
def test_the_kfp_test_checks_the_backend_version_against_the_floor(helm: str, monkeypatch, tmp_path, tag: str, passes: bool):
    (pod,) = show_only(helm, TEST_HOOKS[1])
    (container,) = pod["spec"]["containers"]
    with KfpApiStandIn(multi_user=True, tag_name=tag) as kfp_api:
        token = tmp_path / "token"
        token.write_text("t")
        where = {IN_CLUSTER_HOST: kfp_api.url, "/var/run/secrets/kubeflow/pipelines/token": str(token)}
        result = run_container(container, monkeypatch, tmp_path, where)
        if passes:
            assert f"version {tag}" in ok(result).stdout and "multi-user" in result.stdout
        else:
            assert "version 2.4.1" in failed(result) and "2.5.0" in result.stderr
        assert {r.path for r in kfp_api.recorded} == {"/apis/v2beta1/healthz"}, "the check only reads healthz"


class envoy_denying_everything:
    """A server that answers every request as Istio's sidecar does when an AuthorizationPolicy denies it."""

    def __enter__(self) -> str:
        class Deny(BaseHTTPRequestHandler):
            def _deny(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = b"RBAC: access denied"
                self.send_response(403)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_DELETE = _deny

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Deny)
        Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
