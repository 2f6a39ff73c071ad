"""The chart's signed artifacts (signing.*): the signing-key Secret it creates (or the existing one it names),
`--signing-secret=<name>` in the registration Job's flags, the key nowhere but in that Secret, and the
values the schema and the templates refuse."""

from __future__ import annotations

import base64
import json

import pytest
import yaml
from deploytools import ALL_ON, CHART, CLUSTER, NAMESPACE, RELEASE, only, run_tool, schema_rejection

# An unmistakable dummy key, passed only with --set.
KEY = "SIGNKEY-LEAKCHECK-" + "5e" * 20
CREATE = ["--set", "signing.enabled=true", "--set", "signing.createSecret=true", "--set", f"signing.key={KEY}"]
EXISTING = ["--set", "signing.enabled=true", "--set", "signing.existingSecret=team-signing"]
API_SERVER = ["--set", "networkPolicy.apiServer.cidrs={172.18.0.2/32}"]


def job_args(docs: list[dict]) -> list[str]:
    (container,) = only(docs, "Job", "-register")["spec"]["template"]["spec"]["containers"]
    return container["args"]


def signing_flags(docs: list[dict]) -> list[str]:
    return [a for a in job_args(docs) if a.startswith("--signing")]


def test_signing_is_on_by_default_with_a_key_generated_at_install(render_chart, helm: str):
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["signing"] == {"enabled": True, "createSecret": True, "key": "", "existingSecret": ""}
    keys = []
    for _ in range(2):
        docs = render_chart()
        secret = only(docs, "Secret", "-signing")
        assert signing_flags(docs) == [f"--signing-secret={RELEASE}-signing"]
        assert secret["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}  # uninstall keeps the key
        keys.append(base64.b64decode(secret["data"]["key"]).decode())
    assert all(len(k) == 64 and k.isalnum() for k in keys) and keys[0] != keys[1]  # random, no cluster to look up
    # an upgrade keeps the key the Secret holds: the template looks it up before generating one
    template = (CHART / "templates" / "signing-secret.yaml").read_text()
    assert 'lookup "v1" "Secret" $namespace $name' in template and "randAlphaNum 64" in template
    off = render_chart("--set", "signing.enabled=false")
    assert not [d for d in off if d["kind"] == "Secret"] and signing_flags(off) == []
    assert "with --trust-unsigned" in run_tool([helm, "install", RELEASE, str(CHART), "--dry-run=client", *CLUSTER, "--set",
                                                "signing.enabled=false"]).stdout


def test_created_secret_holds_the_key_and_the_job_names_it(render_chart):
    docs = render_chart(*CREATE)
    secret = only(docs, "Secret", "-signing")
    assert secret["metadata"] == {**secret["metadata"], "name": f"{RELEASE}-signing", "namespace": NAMESPACE}
    assert "annotations" not in secret["metadata"]  # a key the user gave is theirs to keep
    assert secret["type"] == "Opaque" and set(secret["data"]) == {"key"}  # the data key the tasks read
    assert base64.b64decode(secret["data"]["key"]).decode() == KEY
    assert signing_flags(docs) == [f"--signing-secret={RELEASE}-signing"]


def test_existing_secret_is_named_and_none_is_created(render_chart):
    docs = render_chart(*EXISTING)
    assert not [d for d in docs if d["kind"] == "Secret"]
    assert signing_flags(docs) == ["--signing-secret=team-signing"]


def test_secret_lives_where_the_runs_pods_run(render_chart):
    # Task pods read the Secret in the KFP namespace of their runs (kubeflow.namespace, else the release's).
    docs = render_chart(*CREATE, "--set", "kubeflow.namespace=kubeflow-user-alice")
    assert only(docs, "Secret", "-signing")["metadata"]["namespace"] == "kubeflow-user-alice"
    assert "--namespace=kubeflow-user-alice" in job_args(docs)


@pytest.mark.parametrize("values", [CREATE, EXISTING, [*ALL_ON, *API_SERVER, *CREATE]], ids=["create", "existing", "all-on"])
def test_rendered_manifests_validate_with_signing_on(render_chart, validate_k8s, values: list[str]):
    validate_k8s(render_chart(*values))


def test_helm_lint_strict_passes_with_signing_on(helm: str):
    out = run_tool([helm, "lint", str(CHART), "--strict", *CREATE]).stdout
    assert "0 chart(s) failed" in out, out


def test_the_key_is_only_in_the_secret(render_chart):
    docs = render_chart(*ALL_ON, *API_SERVER, *CREATE)
    encoded = base64.b64encode(KEY.encode()).decode()
    others = [d for d in docs if not (d["kind"] == "Secret" and d["metadata"]["name"].endswith("-signing"))]
    text = yaml.safe_dump_all(others) + json.dumps(others)
    assert KEY not in text and encoded not in text
    for arg in job_args(docs):
        assert KEY not in arg


@pytest.mark.parametrize(
    "values, message",
    [
        ({"signing": {"enabled": "yes"}}, "signing.enabled"),
        ({"signing": {"keyFile": "/etc/key"}}, "keyFile"),
        ({"signing": {"createSecret": True, "enabled": True, "key": "too-short"}}, "signing.key"),
        ({"signing": {"existingSecret": "Not_A_Name"}}, "signing.existingSecret"),
    ],
    ids=["bool-as-string", "unknown-key", "short-key", "bad-secret-name"],
)
def test_schema_rejects_bad_signing_values(helm: str, tmp_path, values: dict, message: str):
    stderr = schema_rejection(helm, tmp_path, values)
    assert message in stderr, stderr
    assert "too-short" not in stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "signing.createSecret=false"], "signing.existingSecret is required"),
        ([*EXISTING, "--set", f"signing.key={KEY}"], "signing.key and signing.existingSecret are both set"),
        (
            [*CREATE, "--set", "nativeMode.enabled=true", "--set", "register.enabled=false"],
            "signing",
        ),
        (["--set", "nativeMode.enabled=true", "--set", "register.enabled=false"], "or set signing.enabled=false"),
    ],
    ids=["no-secret", "key-and-existing-secret", "native-mode", "native-mode-by-default"],
)
def test_inconsistent_signing_values_fail_with_a_message(helm: str, args: list[str], message: str):
    proc = run_tool([helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *CLUSTER, *args], check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert KEY not in proc.stderr


def test_the_job_s_signing_flag_is_a_cli_option(render_chart, tmp_path):
    """`fedpipe register` takes the flag the chart passes, and the compiled pipeline gives every task the
    key from that Secret (pipelines/builder.py DeployOptions.signing_secret)."""
    import typer

    from fedpipe.cli import app
    from fedpipe.pipelines.builder import DeployOptions, compile_pipeline, method_pipeline
    from fedpipe.run.config import load_config

    (command, *_) = job_args(render_chart(*CREATE))
    options = {opt for param in typer.main.get_command(app).commands[command].params for opt in param.opts}
    assert "--signing-secret" in options
    path = compile_pipeline(method_pipeline(load_config(None, ["method.name=fedavg"]), DeployOptions(signing_secret="fedpipe-signing")),
                            tmp_path / "p.yaml")
    platform = list(yaml.safe_load_all(path.read_text()))[1]
    for label, config in platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"].items():
        keys = {(s["secretName"], e["secretKey"], e["envVar"]) for s in config["secretAsEnv"] for e in s["keyToEnv"]}
        assert ("fedpipe-signing", "key", "FEDPIPE_SIGNING_KEY") in keys, label
