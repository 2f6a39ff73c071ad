"""What Istio does with a pod in a Kubeflow profile namespace, as data and small functions, for tests.

No cluster and no Istio run here. This module models only the parts of Istio and of Kubeflow's
profile controller that decide whether one pod's HTTP request reaches another, each taken from the
upstream source at the tags Kubeflow 1.10.1, 1.11.0 and 26.03 pin (kubeflow/manifests README: Profiles
+ KFAM v1.10.0 in all three; Istio 1.24.3, 1.28.0, 1.29.0):

- the profile namespace: the profile controller creates it labelled ``istio-injection: enabled``
  (kubeflow/kubeflow v1.10.0, components/profile-controller/controllers/profile_controller.go,
  ``Reconcile``: "inject istio sidecar to all pods in target namespace by default");
- sidecar injection: the injector webhook selects pods of namespaces labelled
  ``istio-injection: enabled`` whose *label* ``sidecar.istio.io/inject`` is not "false"
  (kubeflow/manifests v1.10.1, common/istio-1-24/istio-install/base/install.yaml, the
  MutatingWebhookConfiguration's namespaceSelector/objectSelector), then the injector skips a pod
  whose annotation (or label, which wins) says anything but y/yes/true/on or nothing
  (istio/istio 1.24.3, pkg/kube/inject/inject.go, ``injectRequired``);
- KFP's pipeline pods: the API server puts ``sidecar.istio.io/inject: "false"`` on every template of
  a run's workflow unless the template sets it (kubeflow/pipelines 2.5.0 and 2.16.0,
  backend/src/apiserver/template/v2_template.go, ``RunWorkflow`` and ``ScheduledWorkflow``, through
  ``SetAnnotationsToAllTemplatesIfKeyNotExist``), so they are outside the mesh and talk plaintext;
- authorization, enforced only by a pod's sidecar: ALLOW policies that apply to the server pod (those
  of its namespace whose selector matches, and those of the root namespace istio-system); with any,
  a request passes only if some rule matches; a policy with no rules matches nothing. The ones that
  apply in a profile namespace: ``global-deny-all`` (kubeflow/manifests v1.10.1,
  common/istio-1-24/istio-install/base/deny_all_authorizationpolicy.yaml; the same at 26.03 under
  common/istio/) and ``ns-owner-access-istio`` (profile_controller.go above,
  ``getAuthorizationPolicy``, created by ``updateIstioAuthorizationPolicy``);
- ``principals`` and ``source.namespace`` match the *authenticated* peer identity, i.e. the client's
  mTLS certificate (istio/istio 1.24.3, pilot/pkg/security/authz/model/generator.go,
  ``srcNamespaceGenerator.principal`` and ``srcPrincipalGenerator.principal``, both through
  ``principalAuthenticated`` in principal.go): a plaintext request from a pod without a sidecar has
  none, so those rules never match it. Paths match exactly, or by a ``*`` prefix/suffix wildcard
  (pilot/pkg/security/authz/matcher/string.go, ``StringMatcherWithPrefix``);
- the KFP API server's own policy ``ml-pipeline`` in ``kubeflow`` (kubeflow/manifests v1.10.1,
  apps/pipeline/upstream/base/installs/multi-user/istio-authorization-config.yaml; unchanged at
  v1.11.0 and 26.03 under applications/): any request without a ``kubeflow-userid`` header passes,
  which is how KFP's own (unmeshed) pipeline pods and a bearer-token client reach it.

No PeerAuthentication is installed by those manifests (mTLS stays PERMISSIVE), so a sidecar accepts
plaintext and only the authorization policies decide.
"""

from __future__ import annotations

from dataclasses import dataclass, field

INJECT = "sidecar.istio.io/inject"
# What KFP's API server puts on every pipeline pod (v2_template.go, SetAnnotationsToAllTemplatesIfKeyNotExist).
KFP_POD_ANNOTATIONS = {INJECT: "false"}
# What the profile controller labels a profile namespace with (profile_controller.go, Reconcile).
PROFILE_NAMESPACE_LABELS = {"istio-injection": "enabled"}
USERID_HEADER = "kubeflow-userid"  # the profile controller's r.UserIdHeader in the Kubeflow manifests (prefix "")
INGRESS_GATEWAY = "cluster.local/ns/istio-system/sa/istio-ingressgateway-service-account"
KFP_UI = "cluster.local/ns/kubeflow/sa/ml-pipeline-ui"
NOTEBOOK_CONTROLLER = "cluster.local/ns/kubeflow/sa/notebook-controller-service-account"


def sidecar_injected(namespace_labels: dict, pod_labels: dict, pod_annotations: dict) -> bool:
    """Whether a new pod gets Istio's sidecar (the webhook's selectors, then inject.go injectRequired)."""
    if namespace_labels.get("istio-injection") != "enabled":
        return False  # the only injection rule a profile namespace uses; revision labels are not modelled
    if pod_labels.get(INJECT) == "false":
        return False  # the webhook's objectSelector: not even called
    wanted = pod_labels.get(INJECT, pod_annotations.get(INJECT, ""))  # the label wins over the annotation
    if wanted.lower() in ("y", "yes", "true", "on"):
        return True
    return wanted == ""  # "" is the namespace's default (enabled); anything else ("false", "no") is off


def ns_owner_access_istio(namespace: str, owner: str) -> dict:
    """The AuthorizationPolicy the profile controller puts in a profile namespace (getAuthorizationPolicy)."""
    return {
        "name": "ns-owner-access-istio", "namespace": namespace, "selector": None, "action": "ALLOW",
        "rules": [
            {"from": [{"principals": [INGRESS_GATEWAY, KFP_UI]}],
             "when": [{"key": f"request.headers[{USERID_HEADER}]", "values": [owner]}]},
            {"when": [{"key": "source.namespace", "values": [namespace]}]},
            {"to": [{"paths": ["/healthz", "/metrics", "/wait-for-drain"]}]},
            {"from": [{"principals": [NOTEBOOK_CONTROLLER]}], "to": [{"methods": ["GET"], "paths": ["*/api/kernels"]}]},
        ],
    }  # fmt: skip


# Kubeflow's mesh-wide allow-nothing policy in the root namespace (deny_all_authorizationpolicy.yaml: `spec: {}`).
GLOBAL_DENY_ALL = {"name": "global-deny-all", "namespace": "istio-system", "selector": None, "action": "ALLOW", "rules": []}

# The KFP API server's policy (istio-authorization-config.yaml, AuthorizationPolicy ml-pipeline).
ML_PIPELINE = {
    "name": "ml-pipeline", "namespace": "kubeflow", "selector": {"app": "ml-pipeline"}, "action": "ALLOW",
    "rules": [
        {"from": [{"principals": [f"cluster.local/ns/kubeflow/sa/{sa}" for sa in (
            "ml-pipeline", "ml-pipeline-ui", "ml-pipeline-persistenceagent", "ml-pipeline-scheduledworkflow",
            "ml-pipeline-viewer-crd-service-account", "kubeflow-pipelines-cache")]}]},
        {"when": [{"key": f"request.headers[{USERID_HEADER}]", "notValues": ["*"]}]},
    ],
}  # fmt: skip


@dataclass(frozen=True)
class Pod:
    namespace: str
    labels: dict = field(default_factory=dict)
    annotations: dict = field(default_factory=dict)
    service_account: str = "default"
    namespace_labels: dict = field(default_factory=dict)

    @property
    def meshed(self) -> bool:
        return sidecar_injected(self.namespace_labels, self.labels, self.annotations)

    @property
    def principal(self) -> str:
        return f"cluster.local/ns/{self.namespace}/sa/{self.service_account}"


@dataclass(frozen=True)
class Request:
    client: Pod
    path: str
    method: str = "GET"
    headers: dict = field(default_factory=dict)


def _string_match(pattern: str, value: str) -> bool:
    """Istio's string match (StringMatcherWithPrefix): *, *suffix, prefix*, or exact."""
    if pattern == "*":
        return value != ""
    if pattern.startswith("*"):
        return value.endswith(pattern[1:])
    if pattern.endswith("*"):
        return value.startswith(pattern[:-1])
    return value == pattern


def _peer(request: Request, server: Pod) -> Pod | None:
    """The authenticated client: only when both ends have a sidecar (Istio's auto mTLS); plaintext has none."""
    return request.client if request.client.meshed and server.meshed else None


def _condition(condition: dict, request: Request, peer: Pod | None) -> bool:
    key = condition["key"]
    if key == "source.namespace":
        value = peer.namespace if peer else None  # from the peer certificate (principalAuthenticated)
    elif key.startswith("request.headers[") and key.endswith("]"):
        value = request.headers.get(key[len("request.headers["):-1])
    else:
        raise ValueError(f"condition {key} is not modelled")
    if "values" in condition and not (value is not None and any(_string_match(p, value) for p in condition["values"])):
        return False
    return not ("notValues" in condition and value is not None and any(_string_match(p, value) for p in condition["notValues"]))


def _rule(rule: dict, request: Request, peer: Pod | None) -> bool:
    if "from" in rule and not any(
        peer is not None and any(_string_match(p, peer.principal) for p in source["principals"]) for source in rule["from"]
    ):
        return False
    if "to" in rule and not any(
        all(any(_string_match(p, request.path) for p in op[key]) if key == "paths" else request.method in op[key]
            for key in ("paths", "methods") if key in op)
        for op in rule["to"]
    ):  # fmt: skip
        return False
    return all(_condition(c, request, peer) for c in rule.get("when", []))


def applies(policy: dict, server: Pod) -> bool:
    if policy["namespace"] == "istio-system":
        return True  # the root namespace: every workload of the mesh
    selector = policy["selector"] or {}
    return policy["namespace"] == server.namespace and selector.items() <= server.labels.items()


def allowed(request: Request, server: Pod, policies: list[dict]) -> bool:
    """Whether `server` accepts `request`: always without a sidecar (nothing enforces a policy there);
    with one, when no ALLOW policy applies to it or a rule of one matches."""
    if not server.meshed:
        return True
    peer = _peer(request, server)
    relevant = [p for p in policies if p["action"] == "ALLOW" and applies(p, server)]
    return not relevant or any(_rule(rule, request, peer) for p in relevant for rule in p["rules"])


def profile_policies(namespace: str, owner: str = "user@example.com") -> list[dict]:
    """The authorization policies that apply to workloads of a fresh profile namespace, and KFP's."""
    return [GLOBAL_DENY_ALL, ns_owner_access_istio(namespace, owner), ML_PIPELINE]
