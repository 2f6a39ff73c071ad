"""The Helm chart, through the real Helm: lint, render, validate, and what each switch does."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from deploytools import (
    ALL_ON,
    CHART,
    CLUSTER,
    DASHBOARD_JSON,
    NAMESPACE,
    RELEASE,
    assert_values_documented,
    only,
    run_tool,
    schema_rejection,
)

from fedpipe.pipelines.builder import LAUNCHER_COMPONENT, POD_LABEL, RESOURCE_PARAMETERS
from fedpipe.run.config import load_config

# networkPolicy.enabled needs the Kubernetes API server's addresses (every task pod's launcher reads the
# storage Secret through it).
API_SERVER = ["--set", "networkPolicy.apiServer.cidrs={172.18.0.2/32}"]
ALL_ON = [*ALL_ON, *API_SERVER]
NETWORK = ["--set", "networkPolicy.enabled=true", *API_SERVER]
# A cluster that serves the Prometheus Operator's ServiceMonitor API (kube-prometheus-stack installed).
OPERATOR = ["--api-versions", "monitoring.coreos.com/v1/ServiceMonitor"]
# A CPU-only cluster whose Pushgateway is someone else's (e.g. the prometheus-community chart's).
EXTERNAL_PUSHGATEWAY = "http://prometheus-pushgateway.monitoring:9091"
CPU_EXTERNAL = [
    "--set", "training.acceleratorCount=0", "--set", "pushgateway.enabled=false",
    "--set", "prometheusScrapeConfig.enabled=false", "--set", f"pushgateway.url={EXTERNAL_PUSHGATEWAY}",
    *NETWORK,
]  # fmt: skip

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
    "prometheus-operator": OPERATOR,
    "cpu-external-pushgateway": [*OPERATOR, *CPU_EXTERNAL],
}  # fmt: skip


@pytest.mark.parametrize("strict", [False, True], ids=["lint", "lint-strict"])
def test_helm_lint_passes(helm: str, strict: bool, tmp_path):
    values = tmp_path / "all-on.yaml"
    values.write_text(yaml.safe_dump({"schedule": {"cron": "0 0 3 * * *"},
                                        "networkPolicy": {"enabled": True, "apiServer": {"cidrs": ["172.18.0.2/32"]}}}))
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
            # the task pods' egress policy (networkPolicy.enabled is on by default; CLUSTER gives its API server address)
            "NetworkPolicy/fedpipe-training-egress",
            # `helm test` pods (hooks: applied only by `helm test`)
            "Pod/fedpipe-test-kfp-api",
            "Pod/fedpipe-test-pushgateway",
            "Pod/fedpipe-test-storage",
            "Role/fedpipe-register",
            "RoleBinding/fedpipe-register",
            # what `fedpipe unschedule` calls, for an upgrade that empties schedule.cron
            "Role/fedpipe-unschedule",
            "RoleBinding/fedpipe-unschedule",
            # the artifact signing key, generated at install (signing is on by default)
            "Secret/fedpipe-signing",
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
        ({"serviceMonitor": {"enabled": "yes"}}, "serviceMonitor.enabled"),
        ({"image": {"flavor": "cuda"}}, "flavor"),  # replaced by image.tag / image.trainingTag
        ({"training": {"acceleratorCount": -1}}, "training.acceleratorCount"),
        ({"steps": {"resources": {"requests": {"cpu": "half"}, "limits": {"cpu": 1, "memory": "1Gi"}}}}, "cpu"),
        ({"pushgateway": {"url": "pushgateway:9091"}}, "pushgateway.url"),
        ({"serviceMonitor": {"interval": "15 seconds"}}, "serviceMonitor.interval"),
        ({"storage": {"endpoint": "minio:9000"}}, "storage.endpoint"),
        ({"runConfig": {"trian": {"rounds": 3}}}, "trian"),
        ({"register": {"resources": {"limits": {"memory": "lots"}}}}, "memory"),
    ],
    ids=["bool-as-string", "unknown-key", "enum", "removed-flavor", "negative-gpus", "step-quantity", "pushgateway-url", "duration",
         "url", "unknown-config-section", "quantity"],
)
def test_schema_rejects_bad_values(helm: str, tmp_path, values: dict, message: str):
    stderr = schema_rejection(helm, tmp_path, values)
    assert message in stderr, stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "storage.createSecret=true", "--set", "storage.accessKey=a"], "storage.secretKey is required"),
        (["--set", "runConfig.method.name=fedavg"], "differs from pipeline.method"),
        (["--set", "pushgateway.enabled=false"], "prometheusScrapeConfig.enabled needs pushgateway.enabled"),
    ],
)
def test_inconsistent_values_fail_with_a_message(helm: str, args: list[str], message: str):
    proc = run_tool([helm, "template", RELEASE, str(CHART), *CLUSTER, *args], check=False)
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


def job_containers(docs: list[dict]) -> list[dict]:
    """The registration Job's main containers (register or schedule; the unschedule init container aside)."""
    return only(docs, "Job", "-register")["spec"]["template"]["spec"]["containers"]


def job_env(docs: list[dict]) -> dict[str, str]:
    (container,) = job_containers(docs)
    return {e["name"]: e["value"] for e in container["env"]}


def job_args(render_chart, *values: str) -> list[str]:
    (container,) = job_containers(render_chart(*values))
    return container["args"]


def flags(args: list[str]) -> dict[str, list[str]]:
    """--name=value arguments as {--name: [values]} (repeatable flags keep every value)."""
    out: dict[str, list[str]] = {}
    for arg in args:
        if arg.startswith("--"):
            name, _, value = arg.partition("=")
            out.setdefault(name, []).append(value)
    return out


# What `fedpipe register` compiles the pipeline with by default: the chart's values.
DEFAULT_DEPLOY_ARGS = [
    f"--namespace={NAMESPACE}",
    "--image-repository=ghcr.io/fedpipe/fedpipe",
    "--image-tag=0.1.0",
    "--training-image-tag=0.1.0-cuda",
    "--accelerator-count=1",
    "--accelerator-type=nvidia.com/gpu",
    "--resource=cpu_request=1",
    "--resource=cpu_limit=4",
    "--resource=memory_request=2Gi",
    "--resource=memory_limit=16Gi",
    "--resource=step_cpu_request=500m",
    "--resource=step_cpu_limit=2",
    "--resource=step_memory_request=1Gi",
    "--resource=step_memory_limit=8Gi",
    f"--pushgateway=http://fedpipe-pushgateway.{NAMESPACE}:9091",
]


def test_registration_job_passes_the_deployment_to_the_pipeline(render_chart):
    # Storage goes in env vars (the Secret's name and keys, never the credentials); the rest are flags.
    env = job_env(render_chart())
    assert env["FEDPIPE_S3_ENDPOINT"] == "http://minio-service.kubeflow:9000"
    assert env["FEDPIPE_S3_SECRET"] == "mlpipeline-minio-artifact"
    assert env["FEDPIPE_S3_SECRET_KEYS"] == "accesskey,secretkey"
    assert not {"FEDPIPE_IMAGE", "FEDPIPE_TRAINING_IMAGE", "FEDPIPE_PUSHGATEWAY"} & set(env), "replaced by flags"
    assert not [name for name in env if name.startswith("AWS_")], "the Job needs no storage credentials"
    assert job_env(render_chart(*ALL_ON))["FEDPIPE_S3_SECRET"] == "fedpipe-storage"


def test_registration_job_compiles_the_pipeline_from_the_values(render_chart):
    assert job_args(render_chart) == [
        "register",
        "--host=http://ml-pipeline.kubeflow.svc.cluster.local:8888",
        "--method=superfed_mm",
        "--name=fedpipe-superfed-mm",
        *DEFAULT_DEPLOY_ARGS,
        "--signing-secret=fedpipe-signing",  # signing is on by default
        "--config=/etc/fedpipe/config.yaml",
    ]
    # The chart's defaults are the pipeline's: one GPU per training task, the same CPU/memory.
    defaults = dict(item.split("=", 1) for item in flags(DEFAULT_DEPLOY_ARGS)["--resource"])
    assert defaults == {k: v for k, v in RESOURCE_PARAMETERS.items() if not k.startswith("accelerator")}
    assert RESOURCE_PARAMETERS["accelerator_count"] == "1" and RESOURCE_PARAMETERS["accelerator_type"] == "nvidia.com/gpu"

    given = flags(job_args(render_chart, *ALL_ON))
    assert given["--image-tag"] == ["0.2.0"] and given["--training-image-tag"] == ["0.2.0-cuda12"]
    assert given["--accelerator-count"] == ["2"]
    assert given["--namespace"] == ["kubeflow-user-example-com"]


def test_cpu_only_is_a_value(render_chart):
    cpu = flags(job_args(render_chart, "--set", "training.acceleratorCount=0"))
    assert cpu["--accelerator-count"] == ["0"]
    assert cpu["--training-image-tag"] == ["0.1.0-cuda"]  # the CUDA build runs on CPU nodes too
    small = flags(job_args(render_chart, "--set", "training.acceleratorCount=0", "--set", "image.trainingTag=0.1.0"))
    assert small["--training-image-tag"] == ["0.1.0"]
    amd = flags(job_args(render_chart, "--set", "training.acceleratorType=amd.com/gpu", "--set", "training.acceleratorCount=4"))
    assert amd["--accelerator-type"] == ["amd.com/gpu"] and amd["--accelerator-count"] == ["4"]


def test_image_and_resources_are_values(render_chart):
    given = flags(job_args(
        render_chart,
        "--set", "image.repository=registry.example.com/ml/fedpipe", "--set", "image.tag=1.2.3",
        "--set", "training.resources.limits.memory=64Gi", "--set", "steps.resources.requests.cpu=250m",
        "--set", "kubeflow.namespace=kubeflow-user-example-com",
    ))  # fmt: skip
    assert given["--image-repository"] == ["registry.example.com/ml/fedpipe"]
    assert given["--image-tag"] == ["1.2.3"] and given["--training-image-tag"] == ["1.2.3-cuda"]
    assert "memory_limit=64Gi" in given["--resource"] and "step_cpu_request=250m" in given["--resource"]
    assert given["--namespace"] == ["kubeflow-user-example-com"]
    (container,) = job_containers(render_chart("--set", "image.repository=registry.example.com/ml/fedpipe", "--set", "image.tag=1.2.3"))
    assert container["image"] == "registry.example.com/ml/fedpipe:1.2.3"


def test_pushgateway_url_is_the_chart_s_own_an_external_one_or_none(render_chart):
    assert flags(job_args(render_chart))["--pushgateway"] == [f"http://fedpipe-pushgateway.{NAMESPACE}:9091"]
    assert flags(job_args(render_chart, *CPU_EXTERNAL))["--pushgateway"] == [EXTERNAL_PUSHGATEWAY]
    none = flags(job_args(render_chart, "--set", "pushgateway.enabled=false", "--set", "prometheusScrapeConfig.enabled=false"))
    assert "--pushgateway" not in none


def test_the_job_s_flags_are_the_cli_s_and_compile_the_pipeline_the_values_say(render_chart, tmp_path):
    """Every flag the Job passes is an option of that `fedpipe` command, and `fedpipe compile` with the
    same deployment flags gives the pipeline's run parameters the chart's values as defaults."""
    import typer
    from typer.testing import CliRunner

    from fedpipe.cli import app

    commands = typer.main.get_command(app).commands
    for values in ([], ["--set", "schedule.cron=0 0 3 * * *", "--set", "schedule.experiment=nightly"]):
        (container,) = job_containers(render_chart(*values))
        command, *args = container["args"]
        options = {opt for param in commands[command].params for opt in param.opts}
        assert set(flags(args)) <= options, set(flags(args)) - options

    deploy = [a for a in job_args(render_chart, "--set", "training.acceleratorCount=0") if a.split("=")[0] not in ("--namespace",)]
    deploy = [a for a in deploy[1:] if not a.startswith(("--host=", "--name=", "--method=", "--config="))]
    out = tmp_path / "pipeline.yaml"
    result = CliRunner().invoke(app, ["compile", "--set", "method.name=superfed_mm", *deploy, "-o", str(out)])
    assert result.exit_code == 0, result.output
    pipeline = next(yaml.safe_load_all(out.read_text()))  # the pipeline spec, then its platform (Kubernetes) spec
    params = {k: v.get("defaultValue") for k, v in pipeline["root"]["inputDefinitions"]["parameters"].items()}
    assert params["accelerator_count"] == "0"
    assert params["accelerator_type"] == "nvidia.com/gpu"
    assert params["step_memory_limit"] == "8Gi" and params["cpu_request"] == "1"
    assert params["telemetry_pushgateway"] == f"http://fedpipe-pushgateway.{NAMESPACE}:9091"
    images = set(re.findall(r"^\s+image: (\S+)$", out.read_text(), re.M))
    assert images == {"ghcr.io/fedpipe/fedpipe:0.1.0", "ghcr.io/fedpipe/fedpipe:0.1.0-cuda"}, images


def test_registration_job_registers_and_schedules(render_chart):
    job = only(render_chart(), "Job", "-register")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    assert "before-hook-creation" in job["metadata"]["annotations"]["helm.sh/hook-delete-policy"]
    pod = job["spec"]["template"]["spec"]
    # without a cron, first remove a recurring run an earlier revision scheduled (test_chart_hooks.py)
    assert [c["args"][0] for c in pod["initContainers"]] == ["unschedule"]
    (register,) = pod["containers"]
    assert register["command"] == ["fedpipe"]
    assert register["args"][0] == "register"
    assert register["image"] == "ghcr.io/fedpipe/fedpipe:0.1.0"

    # `fedpipe schedule` uploads the version itself: one container, so one new version per upgrade.
    pod = only(render_chart(*ALL_ON), "Job", "-register")["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    (schedule,) = pod["containers"]
    assert schedule["args"][0] == "schedule"
    assert "--cron=0 0 3 * * *" in schedule["args"] and "--experiment=nightly" in schedule["args"]
    assert schedule["image"] == "ghcr.io/fedpipe/fedpipe:0.2.0"
    assert flags(schedule["args"])["--namespace"] == ["kubeflow-user-example-com"]
    (schedule,) = job_containers(render_chart("--set", "schedule.cron=0 0 3 * * *"))
    assert schedule["args"][1:-2] == job_args(render_chart)[1:-1] and schedule["args"][-2] == "--cron=0 0 3 * * *"


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
    def rules(*args: str, role_suffix: str = "-register") -> dict[str, list[str]]:
        role = only(render_chart(*args), "Role", role_suffix)
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
    # `fedpipe unschedule` (uninstall hook; the Job's first step without a cron), with or without a cron;
    # test_chart_hooks.py runs it against the multi-user stand-in with only these rules bound
    for values in ([], ["--set", "schedule.cron=0 0 3 * * *"]):
        assert rules(*values, role_suffix="-unschedule") == {"experiments": ["list"], "jobs": ["delete", "list"]}


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


def test_service_monitor_is_on_where_the_operator_is_with_kube_prometheus_stack_s_label(render_chart, helm):
    # kube-prometheus-stack's Prometheus selects ServiceMonitors labelled release: <its release name>.
    monitor = only(render_chart(*OPERATOR), "ServiceMonitor", "-pushgateway")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True
    other = only(render_chart(*OPERATOR, "--set", "serviceMonitor.labels.release=prometheus"), "ServiceMonitor")
    assert other["metadata"]["labels"]["release"] == "prometheus"
    # Without the Operator's CRDs `helm install` must still work: nothing of that API is rendered.
    assert "ServiceMonitor" not in {d["kind"] for d in render_chart()}
    assert "ServiceMonitor" not in {d["kind"] for d in render_chart(*OPERATOR, "--set", "serviceMonitor.enabled=false")}
    assert "ServiceMonitor" not in {d["kind"] for d in render_chart(*OPERATOR, *CPU_EXTERNAL)}  # no Pushgateway of ours
    assert only(render_chart("--set", "serviceMonitor.enabled=true"), "ServiceMonitor")
    # The alternative for Prometheus without the Operator stays.
    assert only(render_chart(*OPERATOR), "ConfigMap", "-prometheus-scrape-config")
    proc = run_tool([helm, "template", RELEASE, str(CHART), *CLUSTER, "--set", "serviceMonitor.enabled=true", "--set", "pushgateway.enabled=false",
                     "--set", "prometheusScrapeConfig.enabled=false"], check=False)  # fmt: skip
    assert proc.returncode != 0 and "serviceMonitor.enabled needs pushgateway.enabled" in proc.stderr, proc.stderr


def task_pod_labels(*extra: tuple[str, str]) -> dict[str, str]:
    """Labels of a fedpipe task pod: the pipeline's (builder.POD_LABEL) and KFP's own."""
    return {POD_LABEL[0]: POD_LABEL[1], "pipelines.kubeflow.org/v2_component": "true", **dict(extra)}


def selects(policy: dict, labels: dict[str, str]) -> bool:
    selector = policy["spec"]["podSelector"]
    assert set(selector) <= {"matchLabels"}, "only matchLabels is checked here"
    return selector.get("matchLabels", {}).items() <= labels.items()


def egress_ports(policy: dict) -> set[tuple[str, int]]:
    return {(p["protocol"], p["port"]) for rule in policy["spec"]["egress"] for p in rule.get("ports", [])}


def test_network_policy_allows_what_training_needs(render_chart):
    policy = only(render_chart(*ALL_ON), "NetworkPolicy")
    assert policy["spec"]["policyTypes"] == ["Egress"]
    assert {("UDP", 53), ("TCP", 53), ("TCP", 9000), ("TCP", 9091), ("TCP", 8888), ("TCP", 8887), ("TCP", 8080)} <= egress_ports(policy)


def test_network_policy_selects_fedpipe_s_task_pods_only(render_chart):
    docs = render_chart(*NETWORK)
    policy = only(docs, "NetworkPolicy", "-training-egress")
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/part-of"] == "fedpipe"
    assert selects(policy, task_pod_labels())
    assert not selects(policy, {"pipelines.kubeflow.org/v2_component": "true"}), "another pipeline's task pod"
    for workload in ("Deployment", "Job"):  # the Pushgateway and the registration Job are not task pods
        assert not selects(policy, only(docs, workload)["spec"]["template"]["metadata"]["labels"]), workload
    custom = only(render_chart(*NETWORK, "--set", "networkPolicy.podSelector.matchLabels.team=a"),
                  "NetworkPolicy")  # fmt: skip
    assert custom["spec"]["podSelector"]["matchLabels"]["team"] == "a"


def test_task_pods_and_the_launcher_reach_the_api_server_and_a_pytorchjob_s_pods_never(render_chart, validate_k8s):
    docs = render_chart("--set", "pytorchJob.enabled=true", "--set", "networkPolicy.enabled=true",
                        "--set", "networkPolicy.apiServer.cidrs={172.18.0.2/32}")  # fmt: skip
    validate_k8s(docs)
    launcher_pod = task_pod_labels(("app.kubernetes.io/component", LAUNCHER_COMPONENT))
    policies = [d for d in docs if d["kind"] == "NetworkPolicy" and selects(d, launcher_pod)]
    api = [rule for policy in policies for rule in policy["spec"]["egress"]
           if any(peer.get("ipBlock", {}).get("cidr") == "172.18.0.2/32" for peer in rule.get("to", []))]  # fmt: skip
    assert api and {p["port"] for rule in api for p in rule["ports"]} == {443, 6443}
    training = only(docs, "NetworkPolicy", "-training-egress")
    assert training in policies, "the launcher is a task pod: DNS, store, Pushgateway, KFP too"
    # every task pod reaches it too (Argo's wait container reports through it), a PyTorchJob's pods never
    assert any(peer.get("ipBlock", {}).get("cidr") == "172.18.0.2/32" for r in training["spec"]["egress"] for peer in r.get("to", []))
    job_pod = {"app.kubernetes.io/part-of": "fedpipe", "app.kubernetes.io/component": "distributed-phase"}
    job_policies = [d for d in docs if d["kind"] == "NetworkPolicy" and selects(d, job_pod)]
    assert job_policies and not [r for d in job_policies for r in d["spec"]["egress"] if any("ipBlock" in peer for peer in r.get("to", []))]
    assert "NetworkPolicy" not in {d["kind"] for d in render_chart("--set", "pytorchJob.enabled=true", "--set", "networkPolicy.enabled=false")}


def test_network_policy_needs_the_api_server_s_addresses_for_every_task_pod(helm: str, render_chart, validate_k8s):
    """KFP's launcher in every task pod reads the artifact-store Secret through the Kubernetes API
    (kubeflow/pipelines 2.5.0 and 2.16.0, backend/src/v2/component/launcher_v2.go, LauncherV2.Execute ->
    backend/src/v2/objectstore/object_store.go, OpenBucket -> createS3BucketSession -> getS3BucketCredential:
    CoreV1().Secrets(namespace).Get), so an egress policy without the API server breaks every task, not
    only the PyTorchJob launcher. (The kfp-launcher ConfigMap is read by the root DAG's driver pod,
    backend/src/v2/driver/driver.go RootDAG at 2.5.0, driver/root_dag.go at 2.16.0, which the policy does not select.)"""
    for extra in ([], ["--set", "pytorchJob.enabled=true"], ["--set", "networkPolicy.apiServer.cidrs=null"]):
        proc = run_tool([helm, "template", RELEASE, str(CHART), "--set", "networkPolicy.enabled=true", *extra], check=False)
        assert proc.returncode != 0, f"networkPolicy.enabled without the API server's addresses was accepted ({extra})"
        assert "networkPolicy.apiServer.cidrs is required" in proc.stderr and "kubectl get endpointslices" in proc.stderr, proc.stderr
    docs = render_chart("--set", "networkPolicy.enabled=true", "--set", "networkPolicy.apiServer.cidrs={172.18.0.2/32,172.18.0.3/32}")
    validate_k8s(docs)
    task_policies = [d for d in docs if d["kind"] == "NetworkPolicy" and selects(d, task_pod_labels())]
    reached = {(peer["ipBlock"]["cidr"], port["port"]) for policy in task_policies for rule in policy["spec"]["egress"]
               for peer in rule.get("to", []) if "ipBlock" in peer for port in rule["ports"]}  # fmt: skip
    assert reached == {(cidr, port) for cidr in ("172.18.0.2/32", "172.18.0.3/32") for port in (443, 6443)}
    assert "NetworkPolicy" not in {d["kind"] for d in render_chart("--set", "networkPolicy.enabled=false")}, "off: no addresses needed"


def test_network_policy_reaches_an_external_pushgateway(render_chart):
    policy = only(render_chart(*CPU_EXTERNAL), "NetworkPolicy")
    (rule,) = [r for r in policy["spec"]["egress"] if ("TCP", 9091) in {(p["protocol"], p["port"]) for p in r["ports"]}]
    (peer,) = rule["to"]
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}
    https = only(render_chart(*CPU_EXTERNAL, "--set", "pushgateway.url=https://pushgateway.example.com"), "NetworkPolicy")
    assert ("TCP", 443) in egress_ports(https)


def test_dashboard_config_map_embeds_the_one_dashboard_json(render_chart):
    config_map = only(render_chart(), "ConfigMap", "-grafana-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["fedpipe.json"]) == json.loads(DASHBOARD_JSON.read_text())
    elsewhere = only(render_chart("--set", "dashboard.namespace=monitoring"), "ConfigMap", "-grafana-dashboard")
    assert elsewhere["metadata"]["namespace"] == "monitoring"


def notes(helm: str, *args: str) -> str:
    out = run_tool([helm, "install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE, *CLUSTER, *args]).stdout
    return out[out.index("NOTES:") :]


def test_notes_tell_what_to_do_next(helm: str):
    text = notes(helm, "--set", "schedule.cron=0 0 3 * * *")
    for part in [
        "Pipelines -> fedpipe-superfed-mm",
        "logs -f job/fedpipe-register",
        "Recurring runs",
        "fedpipe submit --host",
        f"http://fedpipe-pushgateway.{NAMESPACE}:9091",
        'search "fedpipe"',
        "2.5.0",
        "job/fedpipe-unschedule",  # the recurring run goes with the release
        "--no-hooks",
        "helm test fedpipe",
    ]:
        assert part in text, text
    assert "helm test" not in notes(helm, "--set", "tests.enabled=false")


def test_notes_name_only_what_the_release_created(helm: str):
    # The recurring run is `fedpipe schedule`'s: "<pipeline>-schedule" in the experiment "fedpipe" unless told.
    scheduled = notes(helm, "--set", "schedule.cron=0 0 3 * * *")
    assert '"fedpipe-superfed-mm-schedule"' in scheduled and 'experiment "fedpipe"' in scheduled, scheduled
    nightly = notes(helm, "--set", "schedule.cron=0 0 3 * * *", "--set", "schedule.experiment=nightly")
    assert 'experiment "nightly"' in nightly, nightly
    plain = notes(helm)
    assert "ecurring run" not in plain and "-schedule" not in plain and "xperiment" not in plain, plain
    assert "ServiceMonitor" not in plain, "no ServiceMonitor is rendered without the Operator's API"
    assert "ServiceMonitor fedpipe-pushgateway" in notes(helm, "--set", "serviceMonitor.enabled=true")
    quiet = notes(helm, "--set", "pushgateway.enabled=false", "--set", "prometheusScrapeConfig.enabled=false",
                  "--set", "dashboard.enabled=false")  # fmt: skip
    assert "scrape" not in quiet and "port-forward svc/fedpipe-pushgateway" not in quiet and "Grafana" not in quiet, quiet
    assert "1 nvidia.com/gpu each" in plain and "CPU only" in notes(helm, "--set", "training.acceleratorCount=0")


def test_the_kfp_backend_floor_is_stated():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["annotations"]["fedpipe.dev/min-kfp-backend"] == "2.5.0"
    assert chart["annotations"]["fedpipe.dev/min-kubeflow"] == "1.10"
    readme = (CHART / "README.md").read_text()
    assert "2.5.0" in readme and "Kubeflow 1.10" in readme


# Values whose content is a free-form map (Kubernetes objects, labels, the run config).
FREE_FORM = {
    "runConfig", "register.resources", "podSecurityContext", "containerSecurityContext", "pushgateway.resources",
    "pushgateway.podSecurityContext", "pushgateway.containerSecurityContext", "dashboard.labels", "serviceMonitor.labels", "alerts.labels",
    "networkPolicy.podSelector", "networkPolicy.dns.podLabels", "networkPolicy.storage.podLabels",
    "networkPolicy.pushgateway.podLabels", "training.resources", "steps.resources", "register.podAnnotations",
    "pushgateway.podAnnotations", "tests.resources", "networkPolicy.istiod.podLabels", "serving.resources",
    "federation.resources", "federation.filter.resources", "federation.podAnnotations",
}  # fmt: skip


def test_every_value_is_commented_typed_and_in_the_readme():
    assert_values_documented(CHART, FREE_FORM)


def test_run_config_values_take_every_section_of_the_run_config():
    """runConfig's schema is closed (a misspelt section fails the install by name), so it must list every section
    fedpipe's config has: one it lacked (engine, registry, federation) could not be set from the chart at all, e.g. a
    scheduled federated run (engine.mode=federation)."""
    from fedpipe.run.config import RunConfig

    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["runConfig"]
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == set(RunConfig.model_fields)
