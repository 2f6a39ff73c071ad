"""The KServe InferenceService (serving.kserve.io/v1beta1) that serves a model line on a cluster.

Its predictor is a custom container: fedpipe's image running `fedpipe models serve` (`kserve_model`) on port
8080, as KServe expects of a custom predictor (kserve/kserve docs: "Deploy a custom predictor"). Two ways to
get the models, chosen by `storage`:

- `store` (the default): the predictor reads the line from the store itself (`--store s3://...`), with the
  storage Secret's credentials and the signing key, as the pipeline's tasks do. It follows the promoted
  pointer (`follow`): when the recurring run promotes a version (or someone rolls back), the running predictor
  serves it within `reload_seconds`, with no pod restart, no rollout and nobody patching the resource.
- `s3` or `model-registry`: the version promoted now is pinned as the predictor's `STORAGE_URI`
  (`s3://bucket/prefix/models/NAME/versions/N/`, or `model-registry://NAME/N` for a version registered in
  Kubeflow Hub), which KServe's storage initializer downloads into /mnt/models before the predictor starts
  (`--folder /mnt/models NAME@N`; signatures and file hashes are checked there all the same). A promotion
  then rolls out by writing the resource again (`fedpipe models deploy NAME --apply`).

Writing it reads nothing: following the promoted version needs no version number, and a pinned one is given
(`NAME@VERSION`) or looked up by the caller. The predictor's readiness probe is its `/v2/health/ready`, which
follows the model (`kserve_model`). An image named by a tag is pulled `Always` (a tag can be moved to other
bytes; a node's cached copy would keep running unnoticed), one pinned by digest `IfNotPresent`, as the chart's.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from fedpipe.errors import FedpipeError
from fedpipe.models.line import LineKeys

API_VERSION, KIND = "serving.kserve.io/v1beta1", "InferenceService"
PORT = 8080  # KServe's custom predictor port
STORAGE_MODES = ("store", "s3", "model-registry")
MOUNT = "/mnt/models"  # where KServe's storage initializer puts a STORAGE_URI's files
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
READINESS = "/v2/health/ready"  # 503 while the model is not ready to answer (kserve_model.LineDataPlane.ready)


@dataclass(frozen=True)
class ServingDeployment:
    """What `inference_service` writes. `store`: the line's store (s3://bucket/prefix); `version`: the version to
    serve (None: follow the promoted one, `storage="store"` only); `image`: fedpipe's image (with the serve extra),
    `repository:tag` or `repository@sha256:...`; `image_pull_policy`: None for Always with a tag, IfNotPresent with
    a digest; the rest as `fedpipe models deploy` says."""

    line: str
    version: int | None
    store: str
    image: str
    image_pull_policy: str | None = None
    namespace: str | None = None
    name: str | None = None
    storage: str = "store"
    follow: bool = True
    cache_size: int = 32
    unknown_client: str = "global"
    reload_seconds: float = 30.0
    s3_endpoint: str | None = "http://minio-service.kubeflow:9000"
    storage_secret: str = "mlpipeline-minio-artifact"
    access_key_key: str = "accesskey"
    secret_key_key: str = "secretkey"
    signing_secret: str | None = None
    trust_unsigned: bool = False
    hub_model: str | None = None  # the RegisteredModel's name in Kubeflow Hub (registry.kubeflow_hub.model; default: the line's)
    service_account: str | None = None
    min_replicas: int = 1
    max_replicas: int = 1
    resources: dict = field(default_factory=lambda: {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}})
    pod_security: dict = field(default_factory=lambda: {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                                                         "seccompProfile": {"type": "RuntimeDefault"}})
    container_security: dict = field(default_factory=lambda: {
        "runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}})

    def __post_init__(self):
        if self.storage not in STORAGE_MODES:
            raise FedpipeError(f"The storage of a served line is one of {', '.join(STORAGE_MODES)}; got {self.storage!r}.")
        if not self.store.startswith("s3://"):
            raise FedpipeError(f"A served line's store must be reachable from the cluster: s3://bucket/prefix, not {self.store!r} "
                               "(pass --store, or the run.store of the pipeline's config).")
        if self.version is None and (self.storage != "store" or not self.follow):
            raise FedpipeError(f"Serving {self.line!r} pinned (--storage {self.storage}{'' if self.follow else ', --pin'}) needs "
                               f"the version: deploy {self.line}@VERSION.")
        if self.image_pull_policy is not None and self.image_pull_policy not in PULL_POLICIES:
            raise FedpipeError(f"imagePullPolicy is one of {', '.join(PULL_POLICIES)}; got {self.image_pull_policy!r}.")
        if not self.signing_secret and not self.trust_unsigned:
            raise FedpipeError("The predictor serves signed lines only: name the Secret holding the signing key the line's runs "
                               "signed with (--signing-secret; the chart's is <release>-signing), or pass --trust-unsigned if "
                               "everyone who can write the store is trusted.")


def resource_name(line: str) -> str:
    """A DNS-1035 label for the InferenceService (KServe names its Deployment and Service after it)."""
    name = re.sub(r"[^a-z0-9-]+", "-", line.lower()).strip("-")
    name = name if name[:1].isalpha() else f"fedpipe-{name}"
    return name[:45].rstrip("-")


def storage_uri(d: ServingDeployment) -> str:
    """Where the version lives: the store's folder of it (of the line, when the promoted one is followed), or its
    Kubeflow Hub address."""
    if d.storage == "model-registry":
        return f"model-registry://{d.hub_model or d.line}/{d.version}"  # ModelVersions are named by the version number
    keys = LineKeys(d.line)
    return d.store.rstrip("/") + "/" + (keys.folder if d.version is None else keys.version(d.version))


def pull_policy(d: ServingDeployment) -> str:
    """The container's imagePullPolicy: as given, else IfNotPresent for an image pinned by digest, Always for a tag."""
    return d.image_pull_policy or ("IfNotPresent" if "@sha256:" in d.image else "Always")


def _args(d: ServingDeployment) -> list[str]:
    downloaded = d.storage != "store"
    ref = d.line if d.follow and not downloaded else f"{d.line}@{d.version}"
    where = ["--folder", MOUNT] if downloaded else ["--store", d.store]
    return ["models", "serve", ref, *where, "--host", "0.0.0.0", "--port", str(PORT), "--cache-size", str(d.cache_size),
            "--unknown-client", d.unknown_client, "--reload-seconds", f"{d.reload_seconds:g}",
            *(["--trust-unsigned"] if d.trust_unsigned and not d.signing_secret else []),
            *(["--wait-for-promotion"] if ref == d.line else [])]


def _env(d: ServingDeployment) -> list[dict]:
    def secret(name: str, key: str) -> dict:
        return {"secretKeyRef": {"name": name, "key": key}}

    env = [{"name": "HOME", "value": "/tmp"}]
    if d.storage == "store":
        if d.s3_endpoint:
            env.append({"name": "FEDPIPE_S3_ENDPOINT", "value": d.s3_endpoint})
        env += [{"name": "AWS_ACCESS_KEY_ID", "valueFrom": secret(d.storage_secret, d.access_key_key)},
                {"name": "AWS_SECRET_ACCESS_KEY", "valueFrom": secret(d.storage_secret, d.secret_key_key)}]
    else:
        env.append({"name": "STORAGE_URI", "value": storage_uri(d)})  # KServe's storage initializer downloads it to /mnt/models
    if d.signing_secret:
        env.append({"name": "FEDPIPE_SIGNING_KEY", "valueFrom": secret(d.signing_secret, "key")})
    return env


def inference_service(d: ServingDeployment) -> dict:
    """The InferenceService as a dict (YAML-ready)."""
    name = d.name or resource_name(d.line)
    labels = {"app.kubernetes.io/name": "fedpipe", "app.kubernetes.io/component": "serving", "app.kubernetes.io/part-of": "fedpipe",
              "fedpipe.io/model-line": d.line}
    annotations = {"fedpipe.io/storage-uri": storage_uri(d),
                   "fedpipe.io/follows-promoted": "true" if d.follow and d.storage == "store" else "false"}
    if d.version is not None:
        annotations["fedpipe.io/deployed-version"] = str(d.version)
    container = {"name": "kserve-container", "image": d.image, "imagePullPolicy": pull_policy(d), "command": ["fedpipe"],
                 "args": _args(d), "env": _env(d), "ports": [{"containerPort": PORT, "protocol": "TCP"}],
                 "readinessProbe": {"httpGet": {"path": READINESS, "port": PORT}, "periodSeconds": 10, "failureThreshold": 3},
                 "resources": d.resources, "securityContext": d.container_security,
                 "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}
    predictor = {"minReplicas": d.min_replicas, "maxReplicas": d.max_replicas, "securityContext": d.pod_security,
                 "containers": [container], "volumes": [{"name": "tmp", "emptyDir": {}}],
                 "labels": {"app.kubernetes.io/part-of": "fedpipe", "app.kubernetes.io/component": "serving"}}
    if d.service_account:
        predictor["serviceAccountName"] = d.service_account
    metadata = {"name": name, "labels": labels, "annotations": annotations}
    if d.namespace:
        metadata["namespace"] = d.namespace
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": {"predictor": predictor}}


def apply(doc: dict, namespace: str) -> str:
    """Create the InferenceService, or replace the one of that name (through the kubernetes client, with the
    in-cluster config or ~/.kube/config); returns what was done."""
    from kubernetes import client, config
    from kubernetes.client.rest import ApiException

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        try:  # $KUBECONFIG read now: the client reads it once, when it is imported
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG"), client_configuration=configuration)
        except (config.ConfigException, OSError) as e:
            raise FedpipeError(f"Cannot reach the Kubernetes API to write the InferenceService: not in a cluster and no "
                               f"usable kubeconfig ({e}). Print it instead (without --apply) and apply it with kubectl.") from None
    api = client.CustomObjectsApi(client.ApiClient(configuration))
    group, version = API_VERSION.split("/")
    name, plural = doc["metadata"]["name"], "inferenceservices"
    doc = {**doc, "metadata": {**doc["metadata"], "namespace": namespace}}
    try:
        try:
            current = api.get_namespaced_custom_object(group, version, namespace, plural, name)
        except ApiException as e:
            if e.status != 404:
                raise
            api.create_namespaced_custom_object(group, version, namespace, plural, doc)
            return f"created InferenceService {namespace}/{name}"
        doc["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        api.replace_namespaced_custom_object(group, version, namespace, plural, name, doc)
        return f"replaced InferenceService {namespace}/{name}"
    except ApiException as e:
        raise FedpipeError(f"Writing InferenceService {namespace}/{name} failed: {e.status} {e.reason}. {str(e.body)[:500]} "
                           "Is KServe installed (kubectl get crd inferenceservices.serving.kserve.io), and may you write "
                           "InferenceServices in that namespace?") from None
