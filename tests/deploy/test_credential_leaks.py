"""Credentials appear in rendered output only inside the Secret the user asked the chart to create."""

from __future__ import annotations

import base64
import re

import pytest
import yaml
from deploytools import CHART, CLUSTER, MANIFESTS, NAMESPACE, RELEASE, only, pod_specs, run_tool, sample_pytorchjob

# Unmistakable dummies, passed only with --set.
ACCESS_KEY = "LEAKCHECK-ACCESS-7f3a9c"
SECRET_KEY = "LEAKCHECK-SECRET-e81d2b-do-not-print"

# What credential material looks like in a render that was given none: Kubeflow's default MinIO
# credentials, AWS key ids, and private keys.
CREDENTIAL_PATTERNS = [r"minio123", r"\bAKIA[0-9A-Z]{16}\b", r"-----BEGIN [A-Z ]*PRIVATE KEY-----"]


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def assert_no_credentials(docs: list[dict], where: str) -> None:
    # the one Secret a render holds unasked is the artifact signing key's, generated at install (signing is on by default)
    unasked = [d["metadata"]["name"] for d in docs if d["kind"] == "Secret" and not d["metadata"]["name"].endswith("-signing")]
    assert not unasked, f"{where} renders a Secret nobody asked for: {unasked}"
    text = yaml.safe_dump_all(docs)
    for pattern in CREDENTIAL_PATTERNS:
        assert not re.search(pattern, text), f"{where} contains {pattern}"
    for doc in docs:
        for container in _all_containers(doc):
            for env in container.get("env", []):
                if env["name"].startswith("AWS_"):
                    assert "value" not in env, f"{where}: {env['name']} has a literal value"


def _all_containers(doc: dict) -> list[dict]:
    if doc["kind"] == "PyTorchJob":
        return [c for _, pod in pod_specs([doc]) for c in pod.get("initContainers", []) + pod["containers"]]
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("initContainers", []) + spec.get("containers", [])


def test_created_secret_is_the_only_place_credentials_appear(helm: str):
    argv = [
        helm, "install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE, *CLUSTER,
        "--set", "storage.createSecret=true",
        "--set", f"storage.accessKey={ACCESS_KEY}",
        "--set", f"storage.secretKey={SECRET_KEY}",
        "--set", "schedule.cron=0 0 3 * * *",
    ]  # fmt: skip
    out = run_tool(argv).stdout  # manifests, hooks and NOTES, as `helm install` would print them
    for plain in (ACCESS_KEY, SECRET_KEY):
        assert plain not in out, "a credential appears in plain text"
        assert out.count(b64(plain)) == 1, "a credential appears outside the Secret's data"
    # The hooks (the registration Job) and the manifests; "MANIFEST:" separates them.
    rendered = out[out.index("HOOKS:") + len("HOOKS:") : out.index("NOTES:")].replace("\nMANIFEST:\n", "\n---\n")
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    assert {"Job", "ConfigMap", "Deployment"} <= {d["kind"] for d in docs}
    secret = only(docs, "Secret", "-storage")
    assert secret["data"] == {"accesskey": b64(ACCESS_KEY), "secretkey": b64(SECRET_KEY)}
    assert "stringData" not in secret
    others = yaml.safe_dump_all([d for d in docs if d is not secret])
    assert b64(SECRET_KEY) not in others and b64(ACCESS_KEY) not in others


def test_default_chart_render_has_no_credentials(render_chart):
    assert_no_credentials(render_chart(), "the default chart render")
    assert_no_credentials(render_chart("--set", "schedule.cron=0 0 3 * * *", "--set", "networkPolicy.enabled=true",
                                       "--set", "networkPolicy.apiServer.cidrs={172.18.0.2/32}"), "the chart")


def test_kustomize_output_has_no_credentials(build_kustomization, kustomize_overlay):
    assert_no_credentials(build_kustomization(MANIFESTS), "kubectl kustomize manifests/")
    assert_no_credentials(build_kustomization(kustomize_overlay), "the overlay")


def test_pytorchjob_has_no_credentials(render_chart, monkeypatch):
    # The launcher renders the job in a pod that has the credentials in its env: none may reach the job.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    for job in (sample_pytorchjob(), sample_pytorchjob(nodes=3, gpus_per_process=1)):
        assert_no_credentials([job], "the PyTorchJob")
        text = yaml.safe_dump(job)
        assert ACCESS_KEY not in text and SECRET_KEY not in text
        refs = [e for c in _all_containers(job) for e in c["env"] if e["name"].startswith("AWS_")]
        assert refs and all(e["valueFrom"]["secretKeyRef"]["name"] == "mlpipeline-minio-artifact" for e in refs)
    assert_no_credentials(render_chart("--set", "pytorchJob.enabled=true", "--set", "pytorchJob.phase=federation"), "the chart")


# --- the compiled pipeline (`fedpipe compile`): the YAML is uploaded to Kubeflow and readable there ----
KFP_TOKEN = "LEAKCHECK-KFP-TOKEN-0b7d42"
PUSHGATEWAY_PASSWORD = "LEAKCHECK-PGW-PASSWORD-5e21"


def _compile(tmp_path, *args: str, env: dict | None = None):
    from typer.testing import CliRunner

    from fedpipe.cli import app

    out = tmp_path / "pipeline.yaml"
    result = CliRunner().invoke(app, ["compile", "--out", str(out), *args], env=env)
    return result, (out.read_text() if out.exists() else "")


def test_compiled_pipeline_holds_no_credentials_from_the_environment(tmp_path):
    env = {"FEDPIPE_KFP_TOKEN": KFP_TOKEN, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    result, text = _compile(tmp_path, env=env)
    assert result.exit_code == 0, result.output
    for secret in (KFP_TOKEN, ACCESS_KEY, SECRET_KEY):
        assert secret not in text and secret not in result.output
    for pattern in CREDENTIAL_PATTERNS:
        assert not re.search(pattern, text), f"the compiled pipeline contains {pattern}"


def test_a_pushgateway_password_in_the_config_never_reaches_the_pipeline(tmp_path):
    result, text = _compile(tmp_path, "--set", f"telemetry.pushgateway=http://admin:{PUSHGATEWAY_PASSWORD}@pgw:9091")
    assert result.exit_code == 2 and "telemetry.pushgateway" in result.output
    assert PUSHGATEWAY_PASSWORD not in result.output and PUSHGATEWAY_PASSWORD not in text


@pytest.mark.parametrize("flag", ["--pushgateway", "--s3-endpoint"])
def test_a_password_on_a_deploy_flag_never_reaches_the_pipeline(tmp_path, flag):
    result, text = _compile(tmp_path, flag, f"http://admin:{PUSHGATEWAY_PASSWORD}@pgw:9091")
    assert result.exit_code != 0 and flag in result.output
    assert PUSHGATEWAY_PASSWORD not in text and PUSHGATEWAY_PASSWORD not in result.output
