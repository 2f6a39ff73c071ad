"""The chart's pods in a Kubeflow profile namespace, where Istio injects sidecars and the profile
controller's AuthorizationPolicy guards every meshed pod (istio_model.py says what is modelled and the
upstream source of each rule)."""

from __future__ import annotations

import pytest
from deploytools import ALL_ON, NAMESPACE, only
from istio_model import (
    INJECT,
    KFP_POD_ANNOTATIONS,
    PROFILE_NAMESPACE_LABELS,
    Pod,
    Request,
    allowed,
    profile_policies,
    sidecar_injected,
)

from fedpipe.pipelines.builder import POD_LABEL

ALL_ON = [*ALL_ON, "--set", "networkPolicy.apiServer.cidrs={172.18.0.2/32}"]  # networkPolicy.enabled needs them

# A fedpipe task pod as KFP starts it: the pipeline's label, KFP's label and KFP's annotation.
TASK_POD = Pod(NAMESPACE, labels={POD_LABEL[0]: POD_LABEL[1], "pipelines.kubeflow.org/v2_component": "true"},
               annotations=KFP_POD_ANNOTATIONS, service_account="default-editor", namespace_labels=PROFILE_NAMESPACE_LABELS)  # fmt: skip
# What fedpipe's Prometheus sink sends (prometheus_client.push_to_gateway: PUT /metrics/job/<job>/<label>/<value>...).
PUSH = "/metrics/job/fedpipe/run_id/r1/pipeline/p/method/superfed_mm/phase/federation/dataset/mnist5k"
KFP_API = Pod("kubeflow", labels={"app": "ml-pipeline"}, service_account="ml-pipeline", namespace_labels={"istio-injection": "enabled"})


def pod_of(doc: dict, namespace: str = NAMESPACE) -> Pod:
    """The pod a workload (Deployment, Job, Pod) of the chart starts in a profile namespace."""
    meta = doc["metadata"] if doc["kind"] == "Pod" else doc["spec"]["template"]["metadata"]
    spec = doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]
    return Pod(namespace, labels=meta.get("labels") or {}, annotations=meta.get("annotations") or {},
               service_account=spec.get("serviceAccountName", "default"), namespace_labels=PROFILE_NAMESPACE_LABELS)  # fmt: skip


# -- the model itself: what the profile controller's policy admits ---------------------------------


def test_the_profile_policy_admits_the_namespace_s_meshed_pods_and_no_plaintext_client():
    policies = profile_policies(NAMESPACE)
    meshed_server = Pod(NAMESPACE, labels={"app": "x"}, namespace_labels=PROFILE_NAMESPACE_LABELS)
    plain_server = Pod(NAMESPACE, labels={"app": "x"}, annotations={INJECT: "false"}, namespace_labels=PROFILE_NAMESPACE_LABELS)
    meshed_client = Pod(NAMESPACE, namespace_labels=PROFILE_NAMESPACE_LABELS)
    assert meshed_server.meshed and meshed_client.meshed and not plain_server.meshed and not TASK_POD.meshed
    # a meshed pod of the same namespace: source.namespace from its mTLS certificate
    assert allowed(Request(meshed_client, PUSH, "PUT"), meshed_server, policies)
    # a meshed pod of another profile: neither its namespace nor its principal is admitted
    other = Pod("team-b", namespace_labels=PROFILE_NAMESPACE_LABELS)
    assert not allowed(Request(other, PUSH, "PUT"), meshed_server, policies)
    # KFP's pipeline pods talk plaintext: no peer identity, so only the Knative probe paths pass
    assert not allowed(Request(TASK_POD, PUSH, "PUT"), meshed_server, policies)
    assert allowed(Request(TASK_POD, "/healthz"), meshed_server, policies)
    assert allowed(Request(TASK_POD, "/metrics"), meshed_server, policies)  # exact path only
    # the user id header counts only from the ingress gateway or KFP's UI, never from a plaintext pod
    assert not allowed(Request(TASK_POD, PUSH, "PUT", {"kubeflow-userid": "user@example.com"}), meshed_server, policies)
    # a server without a sidecar enforces nothing: a plaintext client reaches it
    assert allowed(Request(TASK_POD, PUSH, "PUT"), plain_server, policies)
    # KFP's API server takes any request without a user id header (its bearer token is checked by KFP)
    assert allowed(Request(TASK_POD, "/apis/v2beta1/healthz"), KFP_API, policies)
    assert allowed(Request(plain_server, "/apis/v2beta1/recurringruns", "DELETE", {"authorization": "Bearer t"}), KFP_API, policies)
    assert not allowed(Request(TASK_POD, "/apis/v2beta1/runs", headers={"kubeflow-userid": "someone"}), KFP_API, policies)


@pytest.mark.parametrize("labels, annotations, meshed", [
    ({}, {}, True), ({}, {INJECT: "false"}, False), ({}, {INJECT: "true"}, True), ({INJECT: "false"}, {}, False),
    ({INJECT: "true"}, {INJECT: "false"}, True),  # the label wins
])  # fmt: skip
def test_injection_follows_the_namespace_label_and_the_pod_s_opt_out(labels, annotations, meshed):
    assert sidecar_injected(PROFILE_NAMESPACE_LABELS, labels, annotations) is meshed
    assert not sidecar_injected({}, labels, annotations), "no injection outside an istio-injection namespace"


# -- the chart's pods -------------------------------------------------------------------------------


def test_pipeline_pods_can_push_to_the_chart_s_pushgateway_in_a_profile_namespace(render_chart):
    """KFP task pods are outside the mesh (kubeflow/pipelines 2.5.0 / 2.16.0 v2_template.go RunWorkflow,
    SetAnnotationsToAllTemplatesIfKeyNotExist); the profile's policy (kubeflow/kubeflow v1.10.0
    profile_controller.go getAuthorizationPolicy) admits no plaintext push to a meshed pod."""
    for values in ([], ALL_ON):
        server = pod_of(only(render_chart(*values), "Deployment", "-pushgateway"))
        assert allowed(Request(TASK_POD, PUSH, "PUT"), server, profile_policies(NAMESPACE)), (
            "a KFP task pod (outside the mesh) cannot push to the Pushgateway: the profile's ns-owner-access-istio policy "
            f"denies plaintext requests to a meshed pod (its annotations: {server.annotations})"
        )
        # Prometheus (outside the namespace) scrapes it too
        prometheus = Pod("monitoring", labels={"app.kubernetes.io/name": "prometheus"})
        assert allowed(Request(prometheus, "/metrics"), server, profile_policies(NAMESPACE))


def test_the_pushgateway_annotations_are_a_value(render_chart):
    server = pod_of(only(render_chart("--set", "pushgateway.podAnnotations.team=a"), "Deployment", "-pushgateway"))
    assert server.annotations == {INJECT: "false", "team": "a"} and not server.meshed
    meshed = pod_of(only(render_chart("--set-string", f"pushgateway.podAnnotations.{INJECT.replace('.', chr(92) + '.')}=true"),
                         "Deployment", "-pushgateway"))  # fmt: skip
    assert meshed.meshed, "a user who meshes the Pushgateway (and adds their own AuthorizationPolicy) can"


def test_the_registration_job_runs_outside_the_mesh_and_still_reaches_kfp(render_chart):
    """A classic sidecar never exits, so the Job's pod would never finish. Classic is what Istio injects unless
    ENABLE_NATIVE_SIDECARS is on (kubeflow/manifests v1.9.1, common/istio-1-22/istio-install/base/install.yaml,
    the injection template's `$nativeSidecar := (eq (env "ENABLE_NATIVE_SIDECARS" "false") "true")`, and istiod
    there sets no such env; v1.10.1's Istio 1.24 sets it, and native sidecars need Kubernetes 1.29+). Outside
    the mesh the Job still reaches KFP: kubeflow/manifests v1.10.1 (and v1.11.0, 26.03)
    .../installs/multi-user/istio-authorization-config.yaml, AuthorizationPolicy ml-pipeline."""
    for values in ([], ["--set", "schedule.cron=0 0 3 * * *"]):
        job = pod_of(only(render_chart(*values), "Job", "-register"))
        assert not job.meshed, f"the registration Job's pod gets a sidecar (annotations {job.annotations})"
        # bearer token, no kubeflow-userid: ml-pipeline's own policy lets a pod outside the mesh in
        assert allowed(Request(job, "/apis/v2beta1/pipelines", headers={"authorization": "Bearer t"}), KFP_API, profile_policies(NAMESPACE))
    extra = pod_of(only(render_chart("--set", "register.podAnnotations.team=a"), "Job", "-register"))
    assert extra.annotations == {INJECT: "false", "team": "a"}
    meshed = pod_of(only(render_chart("--set-string", f"register.podAnnotations.{INJECT.replace('.', chr(92) + '.')}=true"), "Job", "-register"))
    assert meshed.meshed, "register.podAnnotations can put the Job back in the mesh (with native sidecars)"
