"""The Helm chart, through the real Helm: lint, render, validate, and what each switch does."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from deploytools import ALL_ON, CHART, DASHBOARD_JSON, NAMESPACE, RELEASE, only, run_tool

from fedpipe.config import load_config

# Every switch on its own, and all of them together.
VALUE_SETS = {
    "default": [],
    "all-on": ALL_ON,
    "monitoring-only": ["--set", "register.enabled=false"],
    "no-monitoring": [
        "--set", "pushgateway.enabled=false", "--set", "prometheusScrapeConfig.enabled=false",
        "--set", "dashboard.enabled=false",
    ],
    "existing-secret-elsewhere": [
        "--set", "storage.existingSecret=team-s3", "--set", "storage.accessKeyKey=AWS_ACCESS_KEY_ID",
        "--set", "storage.secretKeyKey=AWS_SECRET_ACCESS_KEY", "--set", "dashboard.namespace=monitoring",
        "--set", "image.digest=sha256:" + "ab" * 32, "--set", "serviceAccount.create=false",
        "--set", "serviceAccount.name=pipeline-runner",
    ],
}  # fmt: skip


@pytest.mark.parametrize("strict", [False, True], ids=["lint", "lint-strict"])
def test_helm_lint_passes(helm: str, strict: bool, tmp_path):
    values = tmp_path / "all-on.yaml"
    values.write_text(yaml.safe_dump({"schedule": {"cron": "0 0 3 * * *"}, "networkPolicy": {"enabled": True}}))
    for extra in ([], ["-f", str(values)]):
        argv = [helm, "lint", str(CHART), *(["--strict"] if strict else []), *extra]
        out = run_tool(argv).stdout
        assert "0 chart(s) failed" in out, out


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_rendered_manifests_validate(render_chart, validate_k8s, name: str):
    validate_k8s(render_chart(*VALUE_SETS[name]))


def test_default_render_has_exactly_the_default_pieces(render_chart):
    kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in render_chart())
    assert kinds == sorted(
        [
            "ConfigMap/fedpipe-grafana-dashboard",
            "ConfigMap/fedpipe-prometheus-scrape-config",
            "ConfigMap/fedpipe-run-config",
            "Deployment/fedpipe-pushgateway",
            "Job/fedpipe-register",
            "Role/fedpipe-register",
            "RoleBinding/fedpipe-register",
            "Service/fedpipe-pushgateway",
            "ServiceAccount/fedpipe",
        ]
    )


def test_switches_add_their_objects(render_chart):
    docs = render_chart(*ALL_ON)
    for kind, suffix in [("Secret", "-storage"), ("ServiceMonitor", "-pushgateway"), ("NetworkPolicy", "-training-egress")]:
        only(docs, kind, suffix)
    assert not [d for d in render_chart("--set", "register.enabled=false") if d["kind"] in ("Job", "Role", "ServiceAccount")]


@pytest.mark.parametrize(
    "values, message",
    [
        ({"pushgateway": {"enabled": "yes"}}, "pushgateway.enabled"),
        ({"pushgatway": {"enabled": True}}, "pushgatway"),
        ({"image": {"flavor": "gpu"}}, "image.flavor"),
        ({"serviceMonitor": {"interval": "15 seconds"}}, "serviceMonitor.interval"),
        ({"storage": {"endpoint": "minio:9000"}}, "storage.endpoint"),
        ({"runConfig": {"trian": {"rounds": 3}}}, "trian"),
        ({"register": {"resources": {"limits": {"memory": "lots"}}}}, "memory"),
    ],
    ids=["bool-as-string", "unknown-key", "enum", "duration", "url", "unknown-config-section", "quantity"],
)
def test_schema_rejects_bad_values(helm: str, tmp_path, values: dict, message: str):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(values))
    proc = run_tool([helm, "template", RELEASE, str(CHART), "-f", str(path)], check=False)
    assert proc.returncode != 0, f"{values} was accepted"
    # Helm 4 names the value as a JSON pointer (/pushgateway/enabled), Helm 3 with dots.
    assert "schema" in proc.stderr and message in proc.stderr.replace("/", "."), proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "storage.createSecret=true", "--set", "storage.accessKey=a"], "storage.secretKey is required"),
        (["--set", "runConfig.method.name=fedavg"], "differs from pipeline.method"),
        (["--set", "pushgateway.enabled=false"], "prometheusScrapeConfig.enabled needs pushgateway.enabled"),
    ],
)
def test_inconsistent_values_fail_with_a_message(helm: str, args: list[str], message: str):
    proc = run_tool([helm, "template", RELEASE, str(CHART), *args], check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_run_config_is_a_valid_fedpipe_config(render_chart, tmp_path):
    config_map = only(
        render_chart("--set", "pipeline.method=fedprox", "--set", "runConfig.train.rounds=7"), "ConfigMap", "-run-config"
    )
    path = tmp_path / "config.yaml"
    path.write_text(config_map["data"]["config.yaml"])
    config = load_config(path)  # fedpipe's own validation, every field checked
    assert config.method.name == "fedprox"
    assert config.train.rounds == 7
    assert config.run.store == "s3://mlpipeline/fedpipe"


def job_env(docs: list[dict]) -> dict[str, str]:
    (container,) = only(docs, "Job", "-register")["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container["env"]}


def test_registration_job_passes_the_deployment_to_the_pipeline(render_chart):
    # `fedpipe register` compiles the pipeline with what these say (fedpipe.pipelines.builder.DeployOptions).
    env = job_env(render_chart())
    assert env["FEDPIPE_IMAGE"] == "ghcr.io/fedpipe/fedpipe:0.1.0"
    assert env["FEDPIPE_S3_ENDPOINT"] == "http://minio-service.kubeflow:9000"
    assert env["FEDPIPE_S3_SECRET"] == "mlpipeline-minio-artifact"
    assert env["FEDPIPE_S3_SECRET_KEYS"] == "accesskey,secretkey"
    assert env["FEDPIPE_PUSHGATEWAY"] == f"http://fedpipe-pushgateway.{NAMESPACE}:9091"
    assert not [name for name in env if name.startswith("AWS_")], "the Job needs no storage credentials"
    created = job_env(render_chart(*ALL_ON))
    assert created["FEDPIPE_S3_SECRET"] == "fedpipe-storage" and created["FEDPIPE_IMAGE"].endswith("-cuda")
    assert "FEDPIPE_PUSHGATEWAY" not in job_env(
        render_chart("--set", "pushgateway.enabled=false", "--set", "prometheusScrapeConfig.enabled=false")
    )


def test_registration_job_registers_and_schedules(render_chart):
    job = only(render_chart(), "Job", "-register")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    assert "before-hook-creation" in job["metadata"]["annotations"]["helm.sh/hook-delete-policy"]
    pod = job["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    (register,) = pod["containers"]
    assert register["command"] == ["fedpipe"]
    assert register["args"] == [
        "register",
        "--host=http://ml-pipeline.kubeflow.svc.cluster.local:8888",
        "--method=superfed_mm",
        "--name=fedpipe-superfed-mm",
        "--config=/etc/fedpipe/config.yaml",
    ]
    assert register["image"] == "ghcr.io/fedpipe/fedpipe:0.1.0"

    pod = only(render_chart(*ALL_ON), "Job", "-register")["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["initContainers"]] == ["register"]
    (schedule,) = pod["containers"]
    assert schedule["args"][0] == "schedule"
    assert "--cron=0 0 3 * * *" in schedule["args"] and "--experiment=nightly" in schedule["args"]
    assert schedule["image"] == "ghcr.io/fedpipe/fedpipe:0.1.0-cuda"


def test_registration_job_authenticates_with_a_projected_kfp_token(render_chart):
    pod = only(render_chart(), "Job", "-register")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "fedpipe"
    assert pod["automountServiceAccountToken"] is False
    (volume,) = [v for v in pod["volumes"] if "projected" in v]
    (source,) = volume["projected"]["sources"]
    assert source["serviceAccountToken"]["audience"] == "pipelines.kubeflow.org"
    (container,) = pod["containers"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    assert mount["mountPath"] == "/var/run/secrets/kubeflow/pipelines" and mount["readOnly"] is True
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["KF_PIPELINES_SA_TOKEN_PATH"] == "/var/run/secrets/kubeflow/pipelines/token"
    assert only(render_chart(), "ServiceAccount")["automountServiceAccountToken"] is False


def test_rbac_grants_only_kfp_verbs_the_job_uses(render_chart):
    def rules(*args: str) -> dict[str, list[str]]:
        role = only(render_chart(*args), "Role", "-register")
        granted = {}
        for rule in role["rules"]:
            assert rule["apiGroups"] == ["pipelines.kubeflow.org"], rule  # no Kubernetes API access
            for resource in rule["resources"]:
                granted[resource] = sorted(rule["verbs"])
        return granted

    assert rules() == {"pipelines": ["create", "get", "list"]}
    assert rules("--set", "schedule.cron=0 0 3 * * *") == {
        "pipelines": ["create", "get", "list"],
        "experiments": ["create", "get", "list"],
        "jobs": ["create", "delete", "get", "list"],
    }


def test_monitoring_pieces_point_at_the_pushgateway(render_chart):
    docs = render_chart(*ALL_ON)
    service = only(docs, "Service", "-pushgateway")
    deployment = only(docs, "Deployment", "-pushgateway")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    monitor = only(docs, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True and endpoint["port"] == service["spec"]["ports"][0]["name"]
    scrape = yaml.safe_load(only(docs, "ConfigMap", "-prometheus-scrape-config")["data"]["prometheus.yml"])
    (job,) = scrape["scrape_configs"]
    assert job["honor_labels"] is True
    assert job["static_configs"][0]["targets"] == [f"fedpipe-pushgateway.{NAMESPACE}.svc:9091"]


def test_network_policy_allows_what_training_needs(render_chart):
    policy = only(render_chart(*ALL_ON), "NetworkPolicy")
    assert policy["spec"]["policyTypes"] == ["Egress"]
    ports = {(p["protocol"], p["port"]) for rule in policy["spec"]["egress"] for p in rule["ports"]}
    assert {("UDP", 53), ("TCP", 53), ("TCP", 9000), ("TCP", 9091), ("TCP", 8888), ("TCP", 8887), ("TCP", 8080)} <= ports


def test_dashboard_config_map_embeds_the_one_dashboard_json(render_chart):
    config_map = only(render_chart(), "ConfigMap", "-grafana-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["fedpipe.json"]) == json.loads(DASHBOARD_JSON.read_text())
    elsewhere = only(render_chart("--set", "dashboard.namespace=monitoring"), "ConfigMap", "-grafana-dashboard")
    assert elsewhere["metadata"]["namespace"] == "monitoring"


def test_notes_tell_what_to_do_next(helm: str):
    out = run_tool(
        [helm, "install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE, "--set", "schedule.cron=0 0 3 * * *"]
    ).stdout
    notes = out[out.index("NOTES:") :]
    for text in [
        "Pipelines -> fedpipe-superfed-mm",
        "logs -f job/fedpipe-register",
        "Recurring runs",
        "fedpipe submit --host",
        f"http://fedpipe-pushgateway.{NAMESPACE}:9091",
        'search "fedpipe"',
    ]:
        assert text in notes, notes


def values_leaves(tree: dict, prefix: str = "") -> list[str]:
    """Dotted paths of the values a user sets (maps that are free-form count as one value)."""
    leaves = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and path not in FREE_FORM:
            leaves += values_leaves(value, path + ".")
        else:
            leaves.append(path)
    return leaves


# Values whose content is a free-form map (Kubernetes objects, labels, the run config).
FREE_FORM = {
    "runConfig", "register.resources", "podSecurityContext", "containerSecurityContext", "pushgateway.resources",
    "pushgateway.podSecurityContext", "pushgateway.containerSecurityContext", "dashboard.labels",
    "networkPolicy.podSelector", "networkPolicy.dns.podLabels", "networkPolicy.storage.podLabels",
}  # fmt: skip


def commented_keys(text: str) -> dict[str, bool]:
    """Dotted path of every key in a YAML file -> whether a comment line is right above it."""
    found, stack, previous = {}, [], ""
    for line in text.splitlines():
        match = re.match(r"^( *)([A-Za-z0-9_.-]+):", line)
        if match:
            depth = len(match[1]) // 2
            stack = stack[:depth] + [match[2]]
            found[".".join(stack)] = previous.lstrip().startswith("#")
        if line.strip():
            previous = line
    return found


def test_every_value_is_commented_typed_and_in_the_readme():
    text = (CHART / "values.yaml").read_text()
    comments = commented_keys(text)
    schema = json.loads((CHART / "values.schema.json").read_text())
    readme = (CHART / "README.md").read_text()
    for leaf in values_leaves(yaml.safe_load(text)):
        assert comments[leaf], f"{leaf} has no comment above it in values.yaml"
        node = schema
        for part in leaf.split("."):
            node = node["properties"][part]
        assert "type" in node or "$ref" in node, f"{leaf} has no type in values.schema.json"
        assert f"`{leaf}`" in readme, f"{leaf} is missing from the values table of charts/fedpipe/README.md"
