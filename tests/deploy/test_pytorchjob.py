"""A phase as a Kubeflow Training Operator PyTorchJob: the manifest the launcher renders, validated like
the chart's, and the RBAC and network rules the chart and manifests give its launcher.

No cluster and no Training Operator run here. The PyTorchJob is checked against the operator's CRD
schema (a transcription, tests/deploy/schemas/README.md) and its admission webhook's rules, and each
replica's pod template with kubernetes-validate --strict against Kubernetes 1.30; whether the operator
then starts the pods, and torchrun joins them, is not tested.
"""

from __future__ import annotations

import copy

import pytest
import yaml
from deploytools import (
    CHART,
    NAMESPACE,
    containers,
    only,
    pod_specs,
    pod_templates,
    pytorchjob_problems,
    run_tool,
    run_training_container,
    sample_pytorchjob,
    write_overlay,
)

from fedpipe.k8s.launcher import RBAC_RULES
from fedpipe.k8s.pytorchjob import CONFIG_ANNOTATION, CONFIG_PATH, CONTAINER_SECURITY_CONTEXT, POD_SECURITY_CONTEXT, labels
from fedpipe.pipelines.builder import LAUNCHER_COMPONENT
from fedpipe.run.config import load_config

SHAPES = {
    "cpu-2-nodes": {},
    "gpu-4-nodes-2-procs": {"nodes": 4, "processes_per_node": 2, "gpus_per_process": 1},
    "one-node": {"nodes": 1, "processes_per_node": 4, "cleanup": "never", "clean_pod_policy": "None"},
    "pinned-to-gpu-nodes": {"nodes": 2, "gpus_per_process": 1, "resources": {
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "cpu_request": "8", "cpu_limit": "16", "memory_request": "64Gi", "memory_limit": "96Gi"}},
}  # fmt: skip

ON = ["--set", "pytorchJob.enabled=true", "--set", "pytorchJob.phase=personalization", "--set", "pytorchJob.nodes=3",
      "--set", "pytorchJob.gpusPerProcess=1"]  # fmt: skip
NETWORK = ["--set", "networkPolicy.enabled=true", "--set", "networkPolicy.apiServer.cidrs={10.0.0.1/32,10.0.0.2/32}"]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_rendered_pytorchjob_validates(validate_k8s, shape: str):
    job = sample_pytorchjob(**SHAPES[shape])
    # The PyTorchJob (CRD schema and webhook rules, through CRD_VALIDATORS) and each replica's pod
    # template as a PodTemplate (kubernetes-validate --strict, Kubernetes 1.30).
    validate_k8s([job, *pod_templates(job)])
    assert set(job["spec"]["pytorchReplicaSpecs"]) == ({"Master", "Worker"} if job_nodes(job) > 1 else {"Master"})


def job_nodes(job: dict) -> int:
    return sum(r["replicas"] for r in job["spec"]["pytorchReplicaSpecs"].values())


@pytest.mark.parametrize(
    "mistake, path",
    [
        (lambda j: j["spec"]["runPolicy"].update(cleanPodpolicy="All"), "cleanPodpolicy"),  # misspelt: the API server would drop it
        (lambda j: j["spec"]["pytorchReplicaSpecs"]["Worker"].update(replicas="2"), "replicas"),
        (lambda j: j["spec"]["pytorchReplicaSpecs"]["Master"].update(replicas=2), "Master.replicas must be 1"),
        (lambda j: j["spec"]["pytorchReplicaSpecs"].update(Chief=j["spec"]["pytorchReplicaSpecs"]["Worker"]), "Master or Worker"),
        (lambda j: j["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0].update(name="trainer"), "named pytorch"),
        (lambda j: j["spec"]["pytorchReplicaSpecs"]["Worker"].update(restartPolicy="OnError"), "restartPolicy"),
        (lambda j: j["spec"].update(nprocPerNode=2), "nprocPerNode"),
        (lambda j: j["metadata"].update(name="Fedpipe_Job"), "DNS-1035"),
        (lambda j: j["spec"].pop("pytorchReplicaSpecs"), "pytorchReplicaSpecs"),
    ],
    ids=["misspelt-field", "wrong-type", "two-masters", "unknown-replica-type", "no-pytorch-container", "restart-policy",
         "nproc-as-int", "bad-name", "no-replicas"],
)
def test_the_validation_catches_what_the_cluster_would_refuse(mistake, path: str):
    job = sample_pytorchjob()
    assert pytorchjob_problems(job) == []
    broken = copy.deepcopy(job)
    mistake(broken)
    problems = pytorchjob_problems(broken)
    assert problems and any(path in p for p in problems), problems


def test_a_pod_template_mistake_fails_kubernetes_validate(validate_k8s):
    job = sample_pytorchjob()
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["volumeMount"] = []  # misspelt
    assert pytorchjob_problems(job) == []  # the CRD schema's part leaves the pod spec to kubernetes-validate...
    with pytest.raises(AssertionError, match="volumeMount"):  # ...which rejects it
        validate_k8s([job, *pod_templates(job)])


def test_each_pod_runs_torchrun_with_the_operators_rendezvous():
    job = sample_pytorchjob(nodes=4, processes_per_node=2, gpus_per_process=1)
    assert job["spec"]["nprocPerNode"] == "2"
    assert job["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] == 1
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3
    assert job["spec"]["runPolicy"] == {"cleanPodPolicy": "Running", "backoffLimit": 3, "activeDeadlineSeconds": 86400}
    for name, pod in pod_specs([job]):
        (container,) = pod["containers"]
        assert container["name"] == "pytorch" and container["command"] == ["torchrun"]
        # The operator sets PET_NODE_RANK, MASTER_ADDR, MASTER_PORT; Kubernetes expands $(VAR) in args.
        assert container["args"] == [
            "--nnodes=4", "--nproc-per-node=2", "--node-rank=$(PET_NODE_RANK)", "--master-addr=$(MASTER_ADDR)",
            "--master-port=$(MASTER_PORT)", "-m", "fedpipe.cli", "train", "--phase", "personalization", "--config", CONFIG_PATH,
        ]  # fmt: skip
        assert container["ports"] == [{"name": "pytorchjob-port", "containerPort": 23456, "protocol": "TCP"}]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 2, name  # 2 processes x 1 GPU
    cpu = sample_pytorchjob()
    for name, pod in pod_specs([cpu]):
        assert "nvidia.com/gpu" not in pod["containers"][0]["resources"]["limits"], f"{name}: a CPU job asks for a GPU"


def test_pods_get_the_run_config_as_a_file_and_credentials_only_from_the_secret(tmp_path):
    job = sample_pytorchjob()
    for name, pod in pod_specs([job]):
        template = next(r["template"] for r in job["spec"]["pytorchReplicaSpecs"].values() if r["template"]["spec"] is pod)
        (container,) = pod["containers"]
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        volume = next(v for v in pod["volumes"] if v["name"] == mounts["/etc/fedpipe"]["name"])
        (item,) = volume["downwardAPI"]["items"]
        assert item["path"] == "config.yaml" and mounts["/etc/fedpipe"]["readOnly"] is True
        assert item["fieldRef"]["fieldPath"] == f"metadata.annotations['{CONFIG_ANNOTATION}']"
        path = tmp_path / "config.yaml"
        path.write_text(template["metadata"]["annotations"][CONFIG_ANNOTATION])
        cfg = load_config(path)  # fedpipe's own validation, every field checked
        assert cfg.run.id == job["metadata"]["annotations"]["fedpipe.io/run-id"] and cfg.run.store.startswith("s3://")
        env = {e["name"]: e for e in container["env"]}
        for var, key in (("AWS_ACCESS_KEY_ID", "accesskey"), ("AWS_SECRET_ACCESS_KEY", "secretkey")):
            assert env[var] == {"name": var, "valueFrom": {"secretKeyRef": {"name": "mlpipeline-minio-artifact", "key": key}}}, name
        assert env["FEDPIPE_S3_ENDPOINT"]["value"] == "http://minio-service.kubeflow:9000"
        assert env["FEDPIPE_PUSHGATEWAY"]["value"] == f"http://fedpipe-pushgateway.{NAMESPACE}:9091"
        assert pod["automountServiceAccountToken"] is False
        assert template["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"


def test_security_contexts_are_the_charts():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert POD_SECURITY_CONTEXT == values["podSecurityContext"]
    assert CONTAINER_SECURITY_CONTEXT == values["containerSecurityContext"]


def test_job_names_fit_the_operators_service_names():
    long_phase = "a_very_long_phase_name_that_goes_on_and_on_and_on"
    job = sample_pytorchjob(phase="personalization")
    name = job["metadata"]["name"]
    assert name.startswith("fedpipe-personalization-") and len(name) <= 49
    from fedpipe.k8s.pytorchjob import phase_job_name

    long_name = phase_job_name("x" * 200, long_phase)
    assert len(long_name) <= 49 and long_name[0].isalpha() and not long_name.endswith("-")
    assert len(f"{long_name}-worker-999") <= 63  # the operator's pod and Service names
    assert phase_job_name("run-a", "federation") != phase_job_name("run-b", "federation")


# -- the chart and the manifests ------------------------------------------------------------------


def granted(role: dict) -> set[tuple[str, str, str]]:
    return {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}  # fmt: skip


def expected() -> set[tuple[str, str, str]]:
    return {(group, resource, verb) for group, resource, verbs in RBAC_RULES for verb in verbs}


def test_chart_grants_the_pipeline_service_account_exactly_what_the_launcher_calls(render_chart, validate_k8s):
    assert not [d for d in render_chart() if "pytorchjob" in d["metadata"]["name"]], "off by default"
    docs = render_chart(*ON)
    validate_k8s(docs)
    role = only(docs, "Role", "-pytorchjob-launcher")
    assert granted(role) == expected()
    binding = only(docs, "RoleBinding", "-pytorchjob-launcher")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pipeline-runner", "namespace": NAMESPACE}]
    other = render_chart(*ON, "--set", "pytorchJob.pipelineServiceAccount=default-editor")
    assert only(other, "RoleBinding", "-pytorchjob-launcher")["subjects"][0]["name"] == "default-editor"
    # The registration Job's own Role keeps no Kubernetes verbs.
    assert {g for g, _, _ in granted(only(docs, "Role", "-register"))} == {"pipelines.kubeflow.org"}


def test_helm_lint_passes_with_the_pytorchjob_rules(helm: str, tmp_path):
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({
        "pytorchJob": {"enabled": True, "phase": "personalization", "nodes": 4, "gpusPerProcess": 1},
        "networkPolicy": {"enabled": True, "apiServer": {"cidrs": ["10.0.0.1/32"]}},
    }))  # fmt: skip
    out = run_tool([helm, "lint", str(CHART), "--strict", "-f", str(values)]).stdout
    assert "0 chart(s) failed" in out, out
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"pytorchJob": {"enabled": True, "nodes": 0}}))
    proc = run_tool([helm, "template", "fedpipe", str(CHART), "-f", str(bad)], check=False)
    assert proc.returncode != 0 and "nodes" in proc.stderr, proc.stderr


def test_chart_registers_the_pipeline_with_the_distributed_phase(render_chart, tmp_path):
    docs = render_chart(*ON, "--set", "schedule.cron=0 0 3 * * *")
    pod = only(docs, "Job", "-register")["spec"]["template"]["spec"]
    flags = ["--distributed-phase=personalization", "--nodes=3", "--processes-per-node=1", "--gpus-per-process=1"]
    for container in containers(pod):  # register, then schedule: both compile the pipeline
        assert all(flag in container["args"] for flag in flags), container["args"]
    without_phase = render_chart("--set", "pytorchJob.enabled=true")
    (container,) = only(without_phase, "Job", "-register")["spec"]["template"]["spec"]["containers"]
    assert not [a for a in container["args"] if a.startswith("--distributed-phase")]
    # The CLI accepts those flags and compiles the pipeline with them.
    from typer.testing import CliRunner

    from fedpipe.cli import app

    out = tmp_path / "p.yaml"
    result = CliRunner().invoke(app, ["compile", "--set", "method.name=superfed_mm", *flags, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "comp-launch-phase-job" in out.read_text()


def test_network_policies_let_the_launcher_reach_the_api_server_and_the_ranks_reach_each_other(render_chart, validate_k8s, helm):
    docs = render_chart(*ON, *NETWORK)
    validate_k8s(docs)
    launcher = only(docs, "NetworkPolicy", "-pytorchjob-launcher-egress")
    assert launcher["spec"]["podSelector"] == {"matchLabels": {"app.kubernetes.io/component": LAUNCHER_COMPONENT}}
    (rule,) = launcher["spec"]["egress"]
    assert [peer["ipBlock"]["cidr"] for peer in rule["to"]] == ["10.0.0.1/32", "10.0.0.2/32"]
    assert {p["port"] for p in rule["ports"]} == {443, 6443}
    ranks = only(docs, "NetworkPolicy", "-distributed-phase-egress")
    selector = ranks["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= labels("any-run", "personalization").items(), "the policy must select the job's pods"
    peers = [rule for rule in ranks["spec"]["egress"] if "ports" not in rule]
    assert peers == [{"to": [{"podSelector": {"matchLabels": selector}}]}]  # each other, any port
    ports = {(p["protocol"], p["port"]) for rule in ranks["spec"]["egress"] for p in rule.get("ports", [])}
    assert ports == {("UDP", 53), ("TCP", 53), ("TCP", 9000), ("TCP", 9091)}  # no API server, no KFP
    # every task pod reaches the API server too: Argo's wait container in it reports through it
    training = only(docs, "NetworkPolicy", "-training-egress")
    assert [r for r in training["spec"]["egress"] if any("ipBlock" in peer for peer in r.get("to", []))]
    proc = run_tool([helm, "template", "fedpipe", str(CHART), *ON, "--set", "networkPolicy.enabled=true"], check=False)
    assert proc.returncode != 0 and "networkPolicy.apiServer.cidrs is required" in proc.stderr


def test_kustomize_component_grants_the_same(build_kustomization, validate_k8s, tmp_path):
    overlay = write_overlay(
        tmp_path,
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources:\n  - ../manifests\ncomponents:\n  - ../manifests/components/pytorchjob\n",
    )
    docs = build_kustomization(overlay)
    validate_k8s(docs)
    assert granted(only(docs, "Role", "fedpipe-pytorchjob-launcher")) == expected()
    (subject,) = only(docs, "RoleBinding", "fedpipe-pytorchjob-launcher")["subjects"]
    assert subject == {"kind": "ServiceAccount", "name": "pipeline-runner", "namespace": "kubeflow"}


@pytest.mark.slow
def test_the_pods_command_runs_under_torchrun(tmp_path):
    """The Master pod's command, with the $(VAR)s expanded as Kubernetes would from the operator's env,
    run here for one node and one process: torchrun accepts the arguments, `-m fedpipe.cli train`
    runs the phase from the mounted config, and the phase's state lands in the store."""
    from runs import SMALL
    from services import free_port

    from fedpipe.k8s.pytorchjob import PhaseJob, PodResources, StorageAccess, phase_job_manifest

    store = tmp_path / "store"
    cfg = load_config(None, [*SMALL, "method.name=fedavg", "train.rounds=1", "partition.num_clients=4", f"run.store={store}",
                             "run.id=torchrun-test"])
    job = phase_job_manifest(run_id=cfg.run_id(), phase="federation", config_yaml=cfg.to_yaml(), namespace=NAMESPACE, image="img",
                             job=PhaseJob("federation", nodes=1), resources=PodResources(),
                             storage=StorageAccess(s3_endpoint="http://unused:9000", s3_secret="s"))
    master = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    (container,) = master["spec"]["containers"]
    operator_env = {"PET_NODE_RANK": "0", "PET_NNODES": "1", "PET_NPROC_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(free_port()), "WORLD_SIZE": "1", "RANK": "0"}
    done = run_training_container(container, master["metadata"]["annotations"][CONFIG_ANNOTATION], operator_env, tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert (store / "torchrun-test" / "phases" / "federation" / "final.pt").is_file()
