"""Paths, value sets and helpers of the deploy tests (the fixtures are in conftest.py)."""

from __future__ import annotations

import importlib
import os
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
RELEASE = "fedpipe"
NAMESPACE = "fedpipe-test"
GET_HELM = "run scripts/get-helm.sh (it puts Helm and kubectl in .cache/bin) and try again"
SETUP_TEST = "run scripts/setup.sh --test (the project's test extra installs it) and try again"

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
    "--set", "dashboard.annotations.grafana_folder=fedpipe",
    "--set", "image.flavor=cuda",
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


# Kinds kubernetes-validate has no schema for (it only warns and passes them: CRDs), and what
# validates them here instead.
CRD_VALIDATORS = {"ServiceMonitor": validate_service_monitor}


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
    return specs


def containers(pod_spec: dict) -> list[dict]:
    return pod_spec.get("initContainers", []) + pod_spec["containers"]


def only(docs: list[dict], kind: str, name_suffix: str = "") -> dict:
    """The one document of that kind whose name ends with name_suffix."""
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, found {[d['metadata']['name'] for d in found]}"
    return found[0]
