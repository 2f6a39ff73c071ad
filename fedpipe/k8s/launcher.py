"""Create a phase's PyTorchJob through the Kubernetes API, wait for it to finish, then delete or keep it.

This runs inside the pipeline's launcher task (a KFP task pod, with its service account's token).
It polls the job's status with `get` rather than holding a watch open: a phase runs for hours,
a poll every few seconds costs the API server nothing, and there is no watch to lose and resume.
Everything it calls is in RBAC_RULES; the chart and manifests/components/pytorchjob grant exactly
those to the pipeline's service account, and the tests check both against what goes over the wire.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from fedpipe.errors import TrainingError
from fedpipe.k8s.pytorchjob import API_GROUP, API_VERSION, PLURAL, RUN_ID_ANNOTATION

log = logging.getLogger(__name__)

# (API group, resource, verbs) of every call below: what the pipeline's service account must be granted.
RBAC_RULES = (
    (API_GROUP, PLURAL, ("create", "get", "delete")),
    ("", "pods", ("list",)),  # only to say why a failed replica failed (OOMKilled, exit code, image pull)
)

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
JOB_NAME_LABEL = "training.kubeflow.org/job-name"  # the operator's labels on the job's pods
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"
REQUEST_TIMEOUT = 30  # seconds per API call


class PhaseJobError(TrainingError):
    """The phase's PyTorchJob could not be created, failed, or did not finish in time."""


class PhaseJobTimeout(PhaseJobError):
    """The job did not finish within the launcher's time limit."""


@dataclass(frozen=True)
class Finished:
    name: str
    namespace: str
    seconds: float
    deleted: bool
    status: dict


def connect():
    """An API client: the pod's service account in a cluster, else the kubeconfig ($KUBECONFIG, ~/.kube/config)."""
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        try:
            # $KUBECONFIG read now: the client reads it once, when it is imported
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG"), client_configuration=configuration)
        except (config.ConfigException, OSError) as e:
            raise PhaseJobError(
                "Cannot reach the Kubernetes API to run the phase as a PyTorchJob: not in a cluster and no usable "
                f"kubeconfig ({e})."
            ) from None
    return client.ApiClient(configuration)


def current_namespace() -> str:
    """Where the job goes: $FEDPIPE_NAMESPACE (the pipeline sets it to the task pod's namespace), else the
    service account's namespace, else the kubeconfig context's, else `default`."""
    if os.environ.get("FEDPIPE_NAMESPACE"):
        return os.environ["FEDPIPE_NAMESPACE"]
    if SERVICE_ACCOUNT_NAMESPACE.is_file():
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    try:
        from kubernetes import config

        _, active = config.list_kube_config_contexts(config_file=os.environ.get("KUBECONFIG"))
        return active["context"].get("namespace") or "default"
    except Exception:  # no kubeconfig either: connect() says so
        return "default"


def _api_message(e) -> str:
    try:
        body = json.loads(e.body)
        return body.get("message") or e.reason
    except (TypeError, ValueError, AttributeError):
        return str(e.reason or e.status)


def finished_as(job: dict) -> str | None:
    """"Succeeded" or "Failed" once the operator says so, else None."""
    for condition in reversed((job.get("status") or {}).get("conditions") or []):
        if condition.get("type") in ("Succeeded", "Failed") and condition.get("status") == "True":
            return condition["type"]
    return None


def state_of(job: dict) -> str:
    """The latest condition that holds (Created, Running, Restarting, Suspended, ...), with the replica counts."""
    holding = [c for c in (job.get("status") or {}).get("conditions") or [] if c.get("status") == "True"]
    state = holding[-1]["type"] if holding else "Pending"
    counts = []
    for replica, status in sorted(((job.get("status") or {}).get("replicaStatuses") or {}).items()):
        parts = [f"{status[k]} {k}" for k in ("active", "succeeded", "failed") if status.get(k)]
        if parts:
            counts.append(f"{replica}: {', '.join(parts)}")
    return f"{state} ({'; '.join(counts)})" if counts else state


class _JobApi:
    """The Kubernetes calls on one namespace's PyTorchJobs and their pods: each is one verb of RBAC_RULES."""

    def __init__(self, api_client, namespace: str):
        from kubernetes import client

        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.namespace = namespace

    def create(self, manifest: dict) -> dict:
        return self.custom.create_namespaced_custom_object(API_GROUP, API_VERSION, self.namespace, PLURAL, manifest,
                                                           _request_timeout=REQUEST_TIMEOUT)

    def get(self, name: str) -> dict:
        return self.custom.get_namespaced_custom_object(API_GROUP, API_VERSION, self.namespace, PLURAL, name,
                                                        _request_timeout=REQUEST_TIMEOUT)

    def delete(self, name: str) -> None:
        from kubernetes import client

        # Foreground: the job is gone only once its pods are, so a recreated job's pods never meet the old ones.
        self.custom.delete_namespaced_custom_object(API_GROUP, API_VERSION, self.namespace, PLURAL, name,
                                                    body=client.V1DeleteOptions(propagation_policy="Foreground"),
                                                    _request_timeout=REQUEST_TIMEOUT)

    def pods(self, name: str) -> list[dict]:
        response = self.core.list_namespaced_pod(self.namespace, label_selector=f"{JOB_NAME_LABEL}={name}",
                                                 _preload_content=False, _request_timeout=REQUEST_TIMEOUT)
        return json.loads(response.data).get("items") or []

    def delete_quietly(self, name: str, where: str) -> None:
        """Delete the job; a job already gone is fine, any other failure only a warning."""
        from kubernetes.client.exceptions import ApiException

        try:
            self.delete(name)
        except ApiException as e:
            if e.status != 404:
                log.warning("%s could not be deleted: %s", where, _api_message(e))


def _shape(manifest: dict) -> str:
    spec = manifest["spec"]
    nodes = sum(r.get("replicas", 1) for r in spec["pytorchReplicaSpecs"].values())
    return f"{nodes} node(s) x {spec.get('nprocPerNode', '1')} process(es)"


def _create_error(e, where: str) -> str:
    message = _api_message(e)
    if e.status == 404:
        return (f"Cannot create {where}: the cluster has no {PLURAL}.{API_GROUP}/{API_VERSION} kind ({message}). "
                "Install the Kubeflow Training Operator (v1.7 or later), or compile the pipeline without --distributed-phase.")
    if e.status in (401, 403):
        return (f"Cannot create {where}: the pipeline's service account may not ({message}). Grant it the "
                "pytorchjobs verbs: the chart's pytorchJob.enabled=true, or manifests/components/pytorchjob.")
    if e.status in (400, 422):
        return f"Cannot create {where}: the API server (or the operator's admission webhook) rejected it: {message}"
    return f"Cannot create {where}: {e.status} {message}"


class PhaseJobLauncher:
    """One PyTorchJob's life: create (or find again after a retry), wait, clean up, explain a failure."""

    def __init__(self, api_client=None, namespace: str | None = None, poll_seconds: float = 10.0):
        self.api_client = api_client if api_client is not None else connect()
        self.namespace = namespace or current_namespace()
        self.api = _JobApi(self.api_client, self.namespace)
        self.poll_seconds = poll_seconds

    # -- the life of a job ------------------------------------------------------------------------

    def run(self, manifest: dict, *, wait_seconds: float, cleanup: str = "on-success") -> Finished:
        """Create the job, wait until it succeeds (returned) or fails (PhaseJobError naming the job and
        why its replicas failed), at most `wait_seconds`; then delete it per `cleanup`."""
        from kubernetes.client.exceptions import ApiException

        name = manifest["metadata"]["name"]
        where = f"PyTorchJob {name} in namespace {self.namespace}"
        start = time.monotonic()
        deadline = start + wait_seconds
        self._create_or_adopt(manifest, where, deadline)
        try:
            job = self._wait(name, where, deadline, wait_seconds)
        except PhaseJobTimeout as e:
            if cleanup == "never":
                raise
            self.api.delete_quietly(name, where)  # a job past its time would hold its GPUs on
            raise PhaseJobTimeout(f"{e} The job was deleted.") from None
        outcome = finished_as(job)
        delete = cleanup == "always" or (cleanup == "on-success" and outcome == "Succeeded")
        if outcome == "Failed":
            why = self.explain_failure(job)
            if delete:
                self.api.delete_quietly(name, where)
            kept = "deleted" if delete else f"kept: kubectl -n {self.namespace} describe pytorchjob {name}"
            raise PhaseJobError(f"{where} failed: {why} (The job was {kept}.)")
        if delete:
            try:
                self.api.delete(name)
            except ApiException as e:
                if e.status != 404:
                    log.warning("%s succeeded but could not be deleted: %s", where, _api_message(e))
        log.info("%s succeeded after %.0f s", where, time.monotonic() - start)
        return Finished(name, self.namespace, time.monotonic() - start, delete, job.get("status") or {})

    def _create_or_adopt(self, manifest: dict, where: str, deadline: float) -> None:
        """Create the job. One already there (a retried launcher task) is the same run's: wait for it
        when it is still running or succeeded, replace it when it failed (the retry is a new try)."""
        from kubernetes.client.exceptions import ApiException

        name = manifest["metadata"]["name"]
        try:
            self.api.create(manifest)
            log.info("created %s: %s", where, _shape(manifest))
            return
        except ApiException as e:
            if e.status != 409:
                raise PhaseJobError(_create_error(e, where)) from None
        try:
            existing = self.api.get(name)
        except ApiException as e:
            raise PhaseJobError(f"{where} exists but cannot be read: {_api_message(e)}") from None
        theirs = (existing.get("metadata", {}).get("annotations") or {}).get(RUN_ID_ANNOTATION)
        ours = manifest["metadata"]["annotations"][RUN_ID_ANNOTATION]
        if theirs != ours:
            raise PhaseJobError(f"{where} already exists and belongs to run {theirs!r}, not {ours!r}; delete it or give the run another run.id.")
        if finished_as(existing) != "Failed":
            log.info("found %s from an earlier attempt (%s): waiting for it", where, state_of(existing))
            return
        log.info("%s from an earlier attempt failed: deleting it and starting again", where)
        try:
            self.api.delete(name)
        except ApiException as e:
            if e.status != 404:
                raise PhaseJobError(f"{where} from an earlier attempt failed and cannot be deleted: {_api_message(e)}") from None
        while True:
            try:
                self.api.get(name)
            except ApiException as e:
                if e.status == 404:
                    break
                raise PhaseJobError(f"{where}: {_api_message(e)}") from None
            if time.monotonic() > deadline:
                raise PhaseJobError(f"{where} from an earlier attempt is still being deleted; try again later.")
            time.sleep(self.poll_seconds)
        try:
            self.api.create(manifest)
        except ApiException as e:
            raise PhaseJobError(_create_error(e, where)) from None
        log.info("created %s again: %s", where, _shape(manifest))

    def _wait(self, name: str, where: str, deadline: float, limit: float) -> dict:
        """Poll until the job succeeds or fails; transient API errors are retried until the deadline."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        last_state, job = None, {}
        while True:
            try:
                job = self.api.get(name)
            except ApiException as e:
                if e.status == 404:
                    raise PhaseJobError(f"{where} disappeared before it finished (deleted by someone else?).") from None
                if e.status in (401, 403):
                    raise PhaseJobError(f"{where}: the pipeline's service account may not read it ({_api_message(e)}).") from None
                log.warning("%s: reading its status failed (%s %s); trying again", where, e.status, _api_message(e))
            except HTTPError as e:
                log.warning("%s: the Kubernetes API did not answer (%s); trying again", where, e)
            else:
                if finished_as(job):
                    return job
                state = state_of(job)
                if state != last_state:
                    log.info("%s: %s", where, state)
                    last_state = state
            if time.monotonic() + self.poll_seconds > deadline:
                raise PhaseJobTimeout(f"{where} did not finish within {limit:g} s; "
                                      f"last seen: {state_of(job) if job else 'unknown'}.")
            time.sleep(self.poll_seconds)

    # -- why it failed ----------------------------------------------------------------------------

    def explain_failure(self, job: dict) -> str:
        """The operator's reason and message, then for each failed pod: replica, exit code, reason, and
        where its logs are. Without permission to list pods, the operator's words alone."""
        from kubernetes.client.exceptions import ApiException

        name = job["metadata"]["name"]
        parts = _operator_reason(job)
        try:
            pods = self.api.pods(name)
        except ApiException as e:
            parts.append(f"(the pods could not be listed for details: {_api_message(e)})")
            pods = []
        parts += [_failed_pod_line(pod, why, self.namespace) for pod in pods if (why := _pod_failure(pod))]
        return " ".join(parts) if parts else "the operator gave no reason"


def _operator_reason(job: dict) -> list[str]:
    """The reason and message of the job's latest Failed condition (none when it has none)."""
    failed = [c for c in (job.get("status") or {}).get("conditions") or [] if c.get("type") == "Failed"]
    if not failed:
        return []
    condition = failed[-1]
    return [f"{condition.get('reason') or 'Failed'}: {condition.get('message') or 'no message'}"]


def _failed_pod_line(pod: dict, why: str, namespace: str) -> str:
    """One failed pod of the job: its replica, why it failed, and how to read its logs."""
    labels = pod.get("metadata", {}).get("labels") or {}
    replica = f"{labels.get(REPLICA_TYPE_LABEL, '?')} {labels.get(REPLICA_INDEX_LABEL, '?')}"
    pod_name = pod["metadata"]["name"]
    return (f"{replica} (pod {pod_name}): {why}; logs: kubectl -n {namespace} logs {pod_name} -c pytorch"
            + (" --previous" if "restarted" in why else ""))


def _pod_failure(pod: dict) -> str | None:
    """Why a pod of the job failed, in a few words, or None when it did not."""
    status = pod.get("status") or {}
    reasons = []
    if status.get("phase") == "Failed" and status.get("reason"):  # e.g. Evicted, DeadlineExceeded
        reasons.append(f"pod {status['reason']}: {status.get('message', '')}".rstrip(": "))
    for container in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        state, last = container.get("state") or {}, container.get("lastState") or {}
        terminated = state.get("terminated") or {}
        waiting = state.get("waiting") or {}
        if terminated and terminated.get("exitCode", 0) != 0:
            reasons.append(f"container {container['name']} exited with code {terminated.get('exitCode')}"
                           f" ({terminated.get('reason') or 'Error'}){': ' + terminated['message'] if terminated.get('message') else ''}")
        elif waiting.get("reason") and waiting["reason"] not in ("ContainerCreating", "PodInitializing"):
            earlier = last.get("terminated") or {}
            detail = (f", restarted {container.get('restartCount', 0)} times, last exit code {earlier.get('exitCode')}"
                      f" ({earlier.get('reason') or 'Error'})") if earlier else ""
            reasons.append(f"container {container['name']} {waiting['reason']}"
                           f"{': ' + waiting['message'] if waiting.get('message') else ''}{detail}")
    return "; ".join(reasons) or None
