"""Paths, value sets and helpers of the deploy tests (the fixtures are in conftest.py)."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "fedpipe"
MANIFESTS = REPO / "manifests"
DASHBOARD_JSON = CHART / "dashboards" / "fedpipe.json"
K8S_VERSION = "1.30.0"
# The span of the Kubernetes versions under the Kubeflow releases the README supports: 1.30 (ValidatingAdmissionPolicy
# GA; Kubeflow 1.10's clusters) to 1.34 (the floor of Kubeflow 26.03, as kubeflow/manifests' README at tag v26.03 states it)
K8S_SPAN = ("1.30.0", "1.34.0")
RELEASE = "fedpipe"
NAMESPACE = "fedpipe-test"
GET_HELM = "run scripts/get-helm.sh (it puts Helm and kubectl in .cache/bin) and try again"
SETUP_TEST = "run scripts/setup.sh --test (the project's test extra installs it) and try again"

# What every install of the chart must say about its cluster: the Kubernetes API server's address, which the egress
# NetworkPolicy (networkPolicy.enabled, on by default) lets the task pods reach; without it the chart refuses to render.
CLUSTER = ["--set", "networkPolicy.apiServer.cidrs={172.18.0.2/32}"]

# Values that switch on every optional piece of the chart.
ALL_ON = [
    "--set", "storage.createSecret=true",
    "--set", "storage.accessKey=dummy-access",
    "--set", "storage.secretKey=dummy-secret",
    "--set", "schedule.cron=0 0 3 * * *",
    "--set", "schedule.experiment=nightly",
    "--set", "serviceMonitor.enabled=true",
    "--set", "serviceMonitor.labels.release=kube-prometheus-stack",
    "--set", "networkPolicy.enabled=true",
    "--set", "networkPolicy.apiServer.cidrs={172.18.0.2/32}",
    "--set", "dashboard.annotations.grafana_folder=fedpipe",
    "--set", "image.tag=0.2.0",
    "--set", "image.trainingTag=0.2.0-cuda12",
    "--set", "training.acceleratorCount=2",
    "--set", "kubeflow.namespace=kubeflow-user-example-com",
]  # fmt: skip


def find_tool(name: str, hint: str) -> str:
    """A tool from .cache/bin, the venv or the PATH; fail (never skip) when it is missing."""
    for candidate in (REPO / ".cache" / "bin" / name, Path(sys.executable).parent / name):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    pytest.fail(f"{name} is not installed: {hint}.", pytrace=False)


def import_tool(module: str, package: str):
    """A Python module the tests use as a tool; fail (never skip) when its package is missing."""
    try:
        return importlib.import_module(module)
    except ImportError:
        pytest.fail(f"{package} is not installed: {SETUP_TEST}.", pytrace=False)


def run_tool(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}", pytrace=False)
    return proc



def schema_rejection(helm: str, tmp_path: Path, values: dict) -> str:
    """`helm template` with `values` must fail on the chart's values schema; returns its stderr with the value's
    path in dots (Helm 4 names it as a JSON pointer, /signing/enabled; Helm 3 with dots)."""
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(values))
    proc = run_tool([helm, "template", RELEASE, str(CHART), "-f", str(path)], check=False)
    assert proc.returncode != 0, f"{values} was accepted"
    assert "schema" in proc.stderr, proc.stderr
    return proc.stderr.replace("/", ".")

def parse_docs(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def validate_service_monitor(doc: dict) -> None:
    """Validates a ServiceMonitor with the Prometheus Operator's models (generated from its CRDs).

    Strict mode rejects wrong types and values outside the CRD's patterns and enums; the models
    ignore unknown fields, so a round trip that loses one (a misspelt field) fails too.
    """
    models = import_tool("cloudcoil.models.prometheus_operator.v1", "cloudcoil-models-prometheus-operator")
    model = models.ServiceMonitor.model_validate(doc, strict=True)
    assert model.model_dump(mode="json", by_alias=True, exclude_unset=True) == doc, (
        "the ServiceMonitor has fields the Prometheus Operator does not know"
    )


PYTORCHJOB_SCHEMA = Path(__file__).resolve().parent / "schemas" / "kubeflow.org_pytorchjobs.v1.yaml"
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# Enums of the Training Operator's v1 API types (the CRD leaves them plain strings).
RESTART_POLICIES = ("Always", "OnFailure", "Never", "ExitCode")
CLEAN_POD_POLICIES = ("None", "Running", "All")
MANAGED_BY = ("", "kubeflow.org/training-operator", "kueue.x-k8s.io/multikueue")


def _closed(schema):
    """The CRD schema with unknown fields made errors: the API server prunes them silently (a structural
    schema), so a misspelt field would vanish on the cluster; here it fails."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: (_closed(value) if key != "properties" else {k: _closed(v) for k, v in value.items()}) for key, value in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def _list_map_problems(schema: dict, value, path: str = "") -> list[str]:
    """Duplicate keys in lists the schema declares `x-kubernetes-list-type: map` (env by name, volumes by
    name, ...): the API server refuses them (a structural schema's list-map keys must be unique)."""
    problems = []
    if isinstance(value, dict):
        for key, item in value.items():
            sub = (schema.get("properties") or {}).get(key)
            if sub is None and isinstance(schema.get("additionalProperties"), dict):
                sub = schema["additionalProperties"]
            if sub is not None:
                problems += _list_map_problems(sub, item, f"{path}.{key}" if path else key)
    elif isinstance(value, list) and "items" in schema:
        if schema.get("x-kubernetes-list-type") == "map":
            keys = [tuple(item.get(k) for k in schema["x-kubernetes-list-map-keys"]) for item in value if isinstance(item, dict)]
            problems += [f"{path}: Duplicate value: {list(key)}" for key in {k for k in keys if keys.count(k) > 1}]
        for index, item in enumerate(value):
            problems += _list_map_problems(schema["items"], item, f"{path}[{index}]")
    return problems


def crd_schema_problems(schema_path: Path, doc: dict) -> list[str]:
    """What the API server refuses in a custom resource by its CRD's openAPIV3Schema: the schema closed
    (`_closed`) and list-map keys unique. CEL rules and webhooks are each kind's own checks."""
    jsonschema = import_tool("jsonschema", "jsonschema")
    schema = yaml.safe_load(schema_path.read_text())
    problems = [f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
                for e in jsonschema.Draft7Validator(_closed(schema)).iter_errors(doc)]
    return problems + _list_map_problems(schema, doc)


def pytorchjob_problems(doc: dict) -> list[str]:
    """What the API server and the Training Operator's admission webhook would refuse in a PyTorchJob
    (tests/deploy/schemas/README.md): the CRD schema, closed; then the webhook's rules."""
    problems = crd_schema_problems(PYTORCHJOB_SCHEMA, doc)
    if doc.get("apiVersion") != "kubeflow.org/v1" or doc.get("kind") != "PyTorchJob":
        problems.append("not a kubeflow.org/v1 PyTorchJob")
    name = (doc.get("metadata") or {}).get("name", "")
    if not (DNS_1035_LABEL.match(name) and len(name) <= 63):
        problems.append(f"metadata.name {name!r} is not a DNS-1035 label")
    spec = doc.get("spec") or {}
    for rtype, replica in (spec.get("pytorchReplicaSpecs") or {}).items():
        where = f"spec.pytorchReplicaSpecs.{rtype}"
        if rtype not in ("Master", "Worker"):
            problems.append(f"{where}: replica type must be Master or Worker")
        if rtype == "Master" and replica.get("replicas") != 1:
            problems.append(f"{where}.replicas must be 1")
        if rtype == "Worker" and isinstance(replica.get("replicas", 1), int) and replica.get("replicas", 1) < 1:
            problems.append(f"{where}.replicas must be at least 1")
        if replica.get("restartPolicy", "Never") not in RESTART_POLICIES:
            problems.append(f"{where}.restartPolicy must be one of {RESTART_POLICIES}")
        containers = ((replica.get("template") or {}).get("spec") or {}).get("containers") or []
        if not any(c.get("name") == "pytorch" for c in containers):
            problems.append(f"{where}: no container named pytorch (the operator's default container)")
        if not all(c.get("image") for c in containers):
            problems.append(f"{where}: a container has no image")
    policy = spec.get("runPolicy") or {}
    if policy.get("cleanPodPolicy", "None") not in CLEAN_POD_POLICIES:
        problems.append(f"spec.runPolicy.cleanPodPolicy must be one of {CLEAN_POD_POLICIES}")
    if policy.get("managedBy", "") not in MANAGED_BY:
        problems.append(f"spec.runPolicy.managedBy must be one of {MANAGED_BY}")
    if spec.get("elasticPolicy", {}).get("nProcPerNode") is not None and "nprocPerNode" in spec:
        problems.append("spec.elasticPolicy.nProcPerNode must not be used with spec.nprocPerNode")
    return problems


def validate_pytorchjob(doc: dict) -> None:
    """A PyTorchJob against the PyTorchJob CRD's schema and the operator's admission rules; its pod
    templates go through kubernetes-validate as PodTemplates (`pod_templates`)."""
    problems = pytorchjob_problems(doc)
    assert not problems, "the PyTorchJob would be refused:\n" + "\n".join(problems)


def pod_templates(doc: dict) -> list[dict]:
    """Each replica's pod template of a PyTorchJob as a core/v1 PodTemplate, for kubernetes-validate."""
    meta = doc["metadata"]
    return [
        {"apiVersion": "v1", "kind": "PodTemplate",
         "metadata": {"name": f"{meta['name']}-{rtype.lower()}", "namespace": meta.get("namespace", NAMESPACE),
                      "labels": meta.get("labels", {})},
         "template": replica["template"]}
        for rtype, replica in doc["spec"]["pytorchReplicaSpecs"].items()
    ]  # fmt: skip


# Kinds kubernetes-validate has no schema for (it only warns and passes them: CRDs), and what
# validates them here instead.
CRD_VALIDATORS = {"ServiceMonitor": validate_service_monitor, "PyTorchJob": validate_pytorchjob}


def pod_specs(docs: list[dict]) -> list[tuple[str, dict]]:
    """(kind/name, pod spec) of every workload in the documents."""
    specs = []
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
            specs.append((name, doc["spec"]["template"]["spec"]))
        elif doc["kind"] == "CronJob":
            specs.append((name, doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]))
        elif doc["kind"] == "Pod":
            specs.append((name, doc["spec"]))
        elif doc["kind"] == "PyTorchJob":
            specs += [(f"{name} {rtype}", r["template"]["spec"]) for rtype, r in doc["spec"]["pytorchReplicaSpecs"].items()]
    return specs


def containers(pod_spec: dict) -> list[dict]:
    return pod_spec.get("initContainers", []) + pod_spec["containers"]


def only(docs: list[dict], kind: str, name_suffix: str = "") -> dict:
    """The one document of that kind whose name ends with name_suffix."""
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def sample_pytorchjob(phase: str = "personalization", *, store: str = "s3://mlpipeline/fedpipe", resources: dict | None = None,
                      **job) -> dict:
    """A phase's PyTorchJob as the launcher task renders it (fedpipe.k8s.pytorchjob), for a
    superfed_mm run in Kubeflow's MinIO with its credentials Secret; with api="trainjob", its TrainJob
    (fedpipe.k8s.trainjob) from the same inputs."""
    from fedpipe.k8s.launcher import job_manifest
    from fedpipe.k8s.phasejob import PhaseJob, PodResources, StorageAccess
    from fedpipe.run.config import load_config

    cfg = load_config(None, ["method.name=superfed_mm", f"run.store={store}", "run.id=superfed-mm-test-0a1b2c3d-job42"])
    return job_manifest(
        run_id=cfg.run_id(), phase=phase, config_yaml=cfg.to_yaml(), namespace=NAMESPACE,
        image="ghcr.io/fedpipe/fedpipe:0.1.0-cuda", job=PhaseJob(phase=phase, **job),
        resources=PodResources(**(resources or {})),
        storage=StorageAccess(s3_endpoint="http://minio-service.kubeflow:9000", s3_secret="mlpipeline-minio-artifact",
                              pushgateway=f"http://fedpipe-pushgateway.{NAMESPACE}:9091"),
    )


def run_training_container(container: dict, config_text: str, controller_env: dict[str, str], folder: Path) -> subprocess.CompletedProcess:
    """A job pod's training container, run here as Kubernetes would start it: the run config where the
    downward-API volume puts it (/etc/fedpipe/config.yaml, here in `folder`), the $(VAR)s of its args
    expanded from `controller_env` (what the job's controller sets in the pod), its plain env set (the
    store endpoint dropped: the config's store is a folder here). First `fedpipe partition`, as the
    pipeline's partition task would; returns the finished container command (torchrun)."""
    from fedpipe.k8s.phasejob import CONFIG_PATH

    config = folder / "config.yaml"
    config.write_text(config_text)
    args = [re.sub(r"\$\((\w+)\)", lambda m: controller_env[m[1]], a).replace(CONFIG_PATH, str(config)) for a in container["args"]]
    env = {**os.environ, **controller_env, **{e["name"]: e["value"] for e in container["env"] if "value" in e}, "HOME": str(folder)}
    env.pop("FEDPIPE_S3_ENDPOINT")
    python = Path(sys.executable)
    subprocess.run([str(python), "-m", "fedpipe.cli", "partition", "-c", str(config)], env=env, check=True, capture_output=True, timeout=300)
    return subprocess.run([str(python.parent / container["command"][0]), *args], env=env, capture_output=True, text=True, timeout=600)


def write_overlay(root: Path, kustomization: str) -> Path:
    """An overlay folder with `kustomization` beside copies of manifests/ and the dashboard folder it
    uses (kustomize takes only relative paths, so their layout is kept under `root`)."""
    shutil.copytree(MANIFESTS, root / "manifests")
    shutil.copytree(CHART / "dashboards", root / "charts" / "fedpipe" / "dashboards")
    overlay = root / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(kustomization)
    return overlay


def values_leaves(tree: dict, free_form: set[str], prefix: str = "") -> list[str]:
    """Dotted paths of the values a user sets (maps that are free-form count as one value)."""
    leaves = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and path not in free_form:
            leaves += values_leaves(value, free_form, path + ".")
        else:
            leaves.append(path)
    return leaves


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


def assert_values_documented(chart: Path, free_form: set[str]) -> None:
    """Every value of `chart` has a comment above it in values.yaml, a type in values.schema.json and a row in the
    values table of its README.md."""
    import json

    text = (chart / "values.yaml").read_text()
    comments = commented_keys(text)
    schema = json.loads((chart / "values.schema.json").read_text())
    readme = (chart / "README.md").read_text()
    for leaf in values_leaves(yaml.safe_load(text), free_form):
        assert comments[leaf], f"{leaf} has no comment above it in {chart.name}/values.yaml"
        node = schema
        for part in leaf.split("."):
            node = node["properties"][part]
        assert "type" in node or "$ref" in node, f"{leaf} has no type in {chart.name}/values.schema.json"
        assert f"`{leaf}`" in readme, f"{leaf} is missing from the values table of charts/{chart.name}/README.md"
