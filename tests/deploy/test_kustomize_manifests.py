"""The plain manifests, through the real kubectl kustomize and kubernetes-validate."""

from __future__ import annotations

import json

import yaml
from deploytools import DASHBOARD_JSON, MANIFESTS, NAMESPACE, find_tool, only, parse_docs, run_tool

from fedpipe.run.config import load_config

SERVICES_HINT = "run scripts/test-services.sh (it installs Prometheus, which ships promtool) and try again"


def test_base_validates(build_kustomization, validate_k8s):
    docs = build_kustomization(MANIFESTS)
    validate_k8s(docs)
    assert {d["metadata"].get("namespace") for d in docs} == {"kubeflow"}
    assert "ServiceMonitor" not in {d["kind"] for d in docs}  # needs the Operator's CRDs: a component


def test_overlay_with_components_validates(build_kustomization, validate_k8s, kustomize_overlay):
    docs = build_kustomization(kustomize_overlay)
    validate_k8s(docs)  # the ServiceMonitor with the Prometheus Operator's models
    assert {d["metadata"].get("namespace") for d in docs} == {"team-a"}
    (subject,) = only(docs, "RoleBinding")["subjects"]
    assert subject["namespace"] == "team-a"


def test_schedule_component_schedules_with_the_same_flags(build_kustomization, kustomize_overlay):
    (register,) = only(build_kustomization(MANIFESTS), "Job")["spec"]["template"]["spec"]["containers"]
    docs = build_kustomization(kustomize_overlay)
    pod = only(docs, "Job", "fedpipe-register")["spec"]["template"]["spec"]
    # `fedpipe schedule` uploads the version itself: one container, so one new version per run of the Job.
    assert "initContainers" not in pod
    (schedule,) = pod["containers"]
    assert register["args"][0] == "register" and schedule["args"][0] == "schedule"
    # The same deployment flags as the register Job (images, GPU, resources, Pushgateway, namespace), then the schedule.
    assert schedule["args"][1:] == [*register["args"][1:], "--cron=0 0 3 * * *", "--experiment=fedpipe"]
    assert {k: v for k, v in register.items() if k not in ("name", "args")} == {
        k: v for k, v in schedule.items() if k not in ("name", "args")
    }
    rules = {r["resources"][0]: sorted(r["verbs"]) for r in only(docs, "Role")["rules"]}
    assert rules == {
        "pipelines": ["create", "get", "list"],
        "experiments": ["create", "get", "list"],
        "jobs": ["create", "delete", "get", "list"],
    }


def test_rbac_has_no_kubernetes_verbs(build_kustomization):
    role = only(build_kustomization(MANIFESTS), "Role")
    assert role["rules"] == [
        {"apiGroups": ["pipelines.kubeflow.org"], "resources": ["pipelines"], "verbs": ["get", "list", "create"]}
    ]


def test_dashboard_comes_from_the_chart_copy(build_kustomization):
    config_map = only(build_kustomization(MANIFESTS), "ConfigMap", "grafana-dashboard")
    assert config_map["metadata"]["name"] == "fedpipe-grafana-dashboard"  # no hash suffix
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["fedpipe.json"]) == json.loads(DASHBOARD_JSON.read_text())


def test_run_config_is_a_valid_fedpipe_config(build_kustomization, tmp_path):
    docs = build_kustomization(MANIFESTS)
    path = tmp_path / "config.yaml"
    path.write_text(only(docs, "ConfigMap", "run-config")["data"]["config.yaml"])
    config = load_config(path)  # fedpipe's own validation, every field checked
    (container,) = only(docs, "Job")["spec"]["template"]["spec"]["containers"]
    assert f"--method={config.method.name}" in container["args"]
    assert config.run.store == "s3://mlpipeline/fedpipe"


def test_registration_job_passes_the_deployment_to_the_pipeline(build_kustomization):
    docs = build_kustomization(MANIFESTS)
    (container,) = only(docs, "Job")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    given = dict(arg.split("=", 1) for arg in container["args"] if arg.startswith("--") and not arg.startswith("--resource="))
    image = f"{given['--image-repository']}:{given['--image-tag']}"
    assert image == container["image"], "--image-repository/--image-tag and kustomization.yaml's images disagree"
    assert given["--training-image-tag"] == given["--image-tag"] + "-cuda"
    assert given["--accelerator-count"] == "1" and given["--accelerator-type"] == "nvidia.com/gpu"  # GPU by default
    # The namespace is the Job's own (an overlay's `namespace:` carries over); Kubernetes expands $(KFP_NAMESPACE).
    assert given["--namespace"] == "$(KFP_NAMESPACE)"
    assert env["KFP_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    service = only(docs, "Service", "pushgateway")
    assert given["--pushgateway"] == f"http://{service['metadata']['name']}.$(KFP_NAMESPACE):{service['spec']['ports'][0]['port']}"
    assert not {"FEDPIPE_IMAGE", "FEDPIPE_TRAINING_IMAGE", "FEDPIPE_PUSHGATEWAY"} & set(env), "replaced by flags"
    assert env["FEDPIPE_S3_SECRET"] == "mlpipeline-minio-artifact"
    assert env["FEDPIPE_S3_SECRET_KEYS"] == "accesskey,secretkey"
    assert not [name for name in env if name.startswith("AWS_")], "the Job needs no storage credentials"


def test_manifests_compile_the_pipeline_as_the_chart_does(build_kustomization, render_chart):
    """The plain manifests and the chart's defaults give the pipeline the same images, GPU, resources."""
    (manifests,) = only(build_kustomization(MANIFESTS), "Job")["spec"]["template"]["spec"]["containers"]
    (chart,) = only(render_chart(), "Job", "-register")["spec"]["template"]["spec"]["containers"]

    def deploy(args: list[str]) -> list[str]:
        return [a for a in args if a.startswith(("--image", "--training-image", "--accelerator", "--resource="))]

    assert deploy(manifests["args"]) and deploy(manifests["args"]) == deploy(chart["args"])


def test_service_monitor_carries_kube_prometheus_stack_s_label(build_kustomization, kustomize_overlay):
    monitor = only(build_kustomization(kustomize_overlay), "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_storage_secret_template_is_valid_and_only_placeholders(validate_k8s, build_kustomization):
    template = MANIFESTS / "storage-secret.template.yaml"
    (secret,) = parse_docs(template.read_text())
    validate_k8s([secret])
    assert set(secret["stringData"]) == {"accesskey", "secretkey"}  # the keys of Kubeflow's MinIO secret
    assert all(value.startswith("REPLACE-WITH-") for value in secret["stringData"].values())
    assert "TEMPLATE" in template.read_text() and "PLACEHOLDERS" in template.read_text()
    assert "Secret" not in {d["kind"] for d in build_kustomization(MANIFESTS)}  # never applied by accident


def test_scrape_configs_pass_promtool_and_target_the_pushgateway(render_chart, build_kustomization, tmp_path):
    promtool = find_tool("promtool", SERVICES_HINT)
    chart = only(render_chart(), "ConfigMap", "-prometheus-scrape-config")["data"]["prometheus.yml"]
    base = build_kustomization(MANIFESTS)
    manifests = only(base, "ConfigMap", "prometheus-scrape-config")["data"]["prometheus.yml"]
    service = only(base, "Service", "pushgateway")
    expected = {
        "chart": f"fedpipe-pushgateway.{NAMESPACE}.svc:9091",
        "manifests": f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc:{service['spec']['ports'][0]['port']}",
    }
    for name, text in [("chart", chart), ("manifests", manifests)]:
        path = tmp_path / f"{name}.yml"
        path.write_text(text)
        run_tool([promtool, "check", "config", str(path)])
        (job,) = yaml.safe_load(text)["scrape_configs"]
        assert job["honor_labels"] is True, name
        assert job["static_configs"][0]["targets"] == [expected[name]], name


def test_the_pushgateway_and_the_job_run_outside_the_mesh_as_in_the_chart(build_kustomization, kustomize_overlay):
    """In a profile namespace (istio-injection: enabled) a meshed Pushgateway refuses KFP's plaintext pushes and a
    classic sidecar keeps the Job from finishing (tests/deploy/istio_model.py, test_chart_istio.py)."""
    from istio_model import PROFILE_NAMESPACE_LABELS, sidecar_injected

    for docs in (build_kustomization(MANIFESTS), build_kustomization(kustomize_overlay)):
        for kind, name in (("Deployment", "pushgateway"), ("Job", "register")):
            meta = only(docs, kind, name)["spec"]["template"]["metadata"]
            assert meta.get("annotations", {}).get("sidecar.istio.io/inject") == "false", f"{kind} {name}: {meta}"
            assert not sidecar_injected(PROFILE_NAMESPACE_LABELS, meta["labels"], meta["annotations"])
