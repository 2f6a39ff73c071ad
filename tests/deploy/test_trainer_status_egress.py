"""The chart's egress for Kubeflow Trainer v2.2+'s TrainJob status reports (pytorchJob.trainerStatus): the job's
pods may reach the status server (kubeflow/trainer v2.2.0: the controller manager, labels app.kubernetes.io/name:
trainer and component: manager in kubeflow-system, manifests/base/manager/manager.yaml and overlays/manager;
statusServer.port default 10443, pkg/apis/config/v1alpha1/defaults.go) only when asked. No Trainer ran here."""

from __future__ import annotations

from deploytools import only

BASE = ("--set", "pytorchJob.enabled=true", "--set", "networkPolicy.enabled=true", "--set", "networkPolicy.apiServer.cidrs={172.18.0.2/32}")


def _egress(render_chart, *args: str) -> list[dict]:
    return only(render_chart(*BASE, *args), "NetworkPolicy", "-distributed-phase-egress")["spec"]["egress"]


def test_the_status_server_is_reachable_only_when_enabled(render_chart, validate_k8s):
    docs = render_chart(*BASE, "--set", "pytorchJob.trainerStatus.enabled=true")
    validate_k8s(docs)
    rule = _egress(render_chart, "--set", "pytorchJob.trainerStatus.enabled=true")[-1]
    (peer,) = rule["to"]
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "kubeflow-system"}
    assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "trainer", "app.kubernetes.io/component": "manager"}
    assert rule["ports"] == [{"protocol": "TCP", "port": 10443}]
    assert "kubeflow-system" not in str(_egress(render_chart))
