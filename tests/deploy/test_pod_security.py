"""Every container the chart and the manifests run is locked down and has resource bounds."""

from __future__ import annotations

import pytest
from deploytools import ALL_ON, MANIFESTS, containers, pod_specs, sample_pytorchjob

RENDERS = ["chart-default", "chart-all-on", "chart-no-schedule-no-monitoring", "chart-operator-cpu-external-pushgateway",
           "kustomize-base", "kustomize-overlay",
           "pytorchjob-cpu", "pytorchjob-gpu"]


@pytest.fixture(params=RENDERS)
def workloads(request, render_chart, build_kustomization, kustomize_overlay) -> list[tuple[str, dict]]:
    docs = {
        "chart-default": lambda: render_chart(),
        "chart-all-on": lambda: render_chart(*ALL_ON),
        "chart-no-schedule-no-monitoring": lambda: render_chart(
            "--set", "pushgateway.enabled=false", "--set", "prometheusScrapeConfig.enabled=false"
        ),
        # A cluster with the Prometheus Operator, CPU-only training and someone else's Pushgateway.
        "chart-operator-cpu-external-pushgateway": lambda: render_chart(
            "--api-versions", "monitoring.coreos.com/v1/ServiceMonitor", "--set", "training.acceleratorCount=0",
            "--set", "pushgateway.enabled=false", "--set", "prometheusScrapeConfig.enabled=false",
            "--set", "pushgateway.url=http://prometheus-pushgateway.monitoring:9091", "--set", "networkPolicy.enabled=true",
            "--set", "networkPolicy.apiServer.cidrs={172.18.0.2/32}",
        ),
        "kustomize-base": lambda: build_kustomization(MANIFESTS),
        "kustomize-overlay": lambda: build_kustomization(kustomize_overlay),
        # A phase's PyTorchJob, as the pipeline's launcher task renders it (fedpipe.k8s.pytorchjob).
        "pytorchjob-cpu": lambda: [sample_pytorchjob()],
        "pytorchjob-gpu": lambda: [sample_pytorchjob(nodes=4, processes_per_node=2, gpus_per_process=1)],
    }[request.param]()
    found = pod_specs(docs)
    assert found, f"{request.param} renders no workload"
    return found


def test_pods_run_as_non_root_with_runtime_default_seccomp(workloads):
    for name, pod in workloads:
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True, name
        assert context["runAsUser"] > 0, name
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod["automountServiceAccountToken"] is False, f"{name} mounts a Kubernetes API token"


def test_containers_are_locked_down(workloads):
    for name, pod in workloads:
        for container in containers(pod):
            where = f"{name} container {container['name']}"
            context = container["securityContext"]
            assert context["runAsNonRoot"] is True, where
            assert context["runAsUser"] > 0, where
            assert context["readOnlyRootFilesystem"] is True, where
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["capabilities"] == {"drop": ["ALL"]}, where
            assert context["seccompProfile"] == {"type": "RuntimeDefault"}, where
            assert "privileged" not in context or context["privileged"] is False, where


def test_containers_have_requests_and_limits(workloads):
    for name, pod in workloads:
        for container in containers(pod):
            resources = container["resources"]
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(bound, {})), f"{name} {container['name']} {bound}"


def test_fedpipe_containers_get_a_writable_tmp(workloads):
    # The image's Python and the kfp client write temp files; the root filesystem is read-only.
    for name, pod in workloads:
        empty_dirs = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v}
        for container in containers(pod):
            if "ghcr.io/fedpipe/fedpipe" in container["image"]:
                mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
                assert mounts.get("/tmp") in empty_dirs, f"{name} {container['name']} has no emptyDir at /tmp"
