"""Create a phase's job (a PyTorchJob or a TrainJob) through the Kubernetes API, wait for it to finish,
then delete or keep it.

This runs inside the pipeline's launcher task (a KFP task pod, with its service account's token).
It polls the job's status with `get` rather than holding a watch open: a phase runs for hours,
a poll every few seconds costs the API server nothing, and there is no watch to lose and resume.
Everything it calls is in each kind's `rbac_rules`; the chart (and manifests/components/pytorchjob for
the PyTorchJob) grant exactly those to the pipeline's service account, and the tests check both
against what goes over the wire. What differs between the kinds is data (`JobKind`), not code.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fedpipe.errors import TrainingError
from fedpipe.k8s import pytorchjob, trainjob
from fedpipe.k8s.phasejob import RUN_ID_ANNOTATION, PhaseJob

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
REQUEST_TIMEOUT = 30  # seconds per API call


@dataclass(frozen=True)
class JobKind:
    """What the launcher needs to know of one kind of job: where its API is, which condition says it
    succeeded, how its controller labels its pods, and what to tell a user whose cluster lacks it."""

    kind: str
    group: str
    version: str
    plural: str
    succeeded: str  # the condition type that says the job succeeded (Failed says it failed, for both)
    pod_selector: str  # the label whose value is the job's name on each of its pods
    replica_key: str  # the label naming a pod's replica type / replicated job
    index_key: str  # the label or annotation with a pod's index within it
    container: str  # the training container (for `kubectl logs -c`)
    own_deadline: bool  # whether the job stops itself at the phase's timeout
    replicas: Callable[[dict], dict]  # {replica: {active, ready, succeeded, failed}} from the job's status
    shape: Callable[[dict], str]  # "N node(s) x P process(es)" from the manifest
    install: str  # what to do when the cluster does not serve the kind
    grant: str  # how to grant the pipeline's service account the kind's verbs
    hints: tuple[tuple[str, str], ...] = ()  # (words of a rejection, what to do about it)

    @property
    def rbac_rules(self) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
        """(API group, resource, verbs) of every call the launcher makes for this kind."""
        return (
            (self.group, self.plural, ("create", "get", "delete")),
            ("", "pods", ("list",)),  # only to say why a failed pod failed (OOMKilled, exit code, image pull)
        )


def _pytorchjob_shape(manifest: dict) -> str:
    spec = manifest["spec"]
    nodes = sum(r.get("replicas", 1) for r in spec["pytorchReplicaSpecs"].values())
    return f"{nodes} node(s) x {spec.get('nprocPerNode', '1')} process(es)"


def _trainjob_shape(manifest: dict) -> str:
    trainer = manifest["spec"].get("trainer") or {}
    return (f"{trainer.get('numNodes', 1)} node(s) x {trainer.get('numProcPerNode', 'auto')} process(es) "
            f"on {manifest['spec']['runtimeRef'].get('kind', 'ClusterTrainingRuntime')} {manifest['spec']['runtimeRef']['name']}")


PYTORCHJOB = JobKind(
    kind=pytorchjob.KIND, group=pytorchjob.API_GROUP, version=pytorchjob.API_VERSION, plural=pytorchjob.PLURAL,
    # The Training Operator's JobStatus (kubeflow/training-operator pkg/apis/kubeflow.org/v1/common_types.go).
    succeeded="Succeeded", pod_selector="training.kubeflow.org/job-name", replica_key="training.kubeflow.org/replica-type",
    index_key="training.kubeflow.org/replica-index", container=pytorchjob.CONTAINER, own_deadline=True,
    replicas=lambda status: status.get("replicaStatuses") or {}, shape=_pytorchjob_shape,
    install="Install the Kubeflow Training Operator (v1.7 or later), compile the pipeline with --job-api trainjob "
            "(Kubeflow Trainer v2), or without --distributed-phase.",
    grant="the chart's pytorchJob.enabled=true, or manifests/components/pytorchjob",
)  # fmt: skip
TRAINJOB = JobKind(
    kind=trainjob.KIND, group=trainjob.API_GROUP, version=trainjob.API_VERSION, plural=trainjob.PLURAL,
    # kubeflow/trainer v2.1.0: TrainJobComplete / TrainJobFailed (pkg/apis/trainer/v1alpha1/trainjob_types.go), copied
    # from the JobSet's Completed / Failed (pkg/runtime/framework/plugins/jobset/jobset.go, Status), with jobsStatus.
    succeeded="Complete", pod_selector="jobset.sigs.k8s.io/jobset-name", replica_key="jobset.sigs.k8s.io/replicatedjob-name",
    index_key="batch.kubernetes.io/job-completion-index", container=trainjob.CONTAINER, own_deadline=False,
    replicas=lambda status: {j["name"]: j for j in status.get("jobsStatus") or []}, shape=_trainjob_shape,
    install="Install Kubeflow Trainer v2 (2.1 or later: Kubeflow 1.11+), or compile the pipeline with --job-api "
            "pytorchjob (the Training Operator's PyTorchJob).",
    grant="the chart's pytorchJob.enabled=true with pytorchJob.api trainjob (or auto on a cluster that serves TrainJobs)",
    hints=(("must be created before the TrainJob is created",
            "The ClusterTrainingRuntime it names is not installed: install Trainer's runtimes (kubeflow/trainer "
            "manifests/base/runtimes, part of Kubeflow's install) or name one the cluster has (fedpipe --trainer-runtime, "
            "the chart's pytorchJob.trainerRuntime)."),),
)  # fmt: skip
KINDS = {k.kind: k for k in (PYTORCHJOB, TRAINJOB)}
MANIFESTS = {pytorchjob.KIND: pytorchjob.phase_job_manifest, trainjob.KIND: trainjob.train_job_manifest}
# What the pipeline's service account must be granted for a PyTorchJob / a TrainJob.
RBAC_RULES = PYTORCHJOB.rbac_rules
TRAINJOB_RBAC_RULES = TRAINJOB.rbac_rules


def job_manifest(*, job: PhaseJob, **inputs) -> dict:
    """The manifest of the kind of job `job.api` names (same inputs for both: see pytorchjob.phase_job_manifest)."""
    return MANIFESTS[job.kind](job=job, **inputs)


def kind_of(obj: dict) -> JobKind:
    known = KINDS.get(obj.get("kind", ""))
    if known is None or obj.get("apiVersion") != f"{known.group}/{known.version}":
        raise PhaseJobError(f"{obj.get('apiVersion')} {obj.get('kind')} is not a job the launcher runs: "
                            f"one of {', '.join(f'{k.group}/{k.version} {k.kind}' for k in KINDS.values())}.")
    return known


class PhaseJobError(TrainingError):
    """The phase's job could not be created, failed, or did not finish in time."""


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
                "Cannot reach the Kubernetes API to run the phase as a training job: not in a cluster and no usable "
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


def _holding(job: dict) -> list[dict]:
    return [c for c in (job.get("status") or {}).get("conditions") or [] if c.get("status") == "True"]


def finished_as(job: dict) -> str | None:
    """"Succeeded" or "Failed" once the job's controller says so (a TrainJob's Complete is "Succeeded"), else None."""
    succeeded = kind_of(job).succeeded
    for condition in reversed(_holding(job)):
        if condition.get("type") in (succeeded, "Failed"):
            return "Failed" if condition["type"] == "Failed" else "Succeeded"
    return None


def state_of(job: dict) -> str:
    """The latest condition that holds (Created, Running, Restarting, Suspended, ...), with the replica
    counts; without one (a TrainJob before it ends), Running while a replica is active, else Pending."""
    replicas = kind_of(job).replicas(job.get("status") or {})
    counts = []
    for replica, status in sorted(replicas.items()):
        parts = [f"{status[k]} {k}" for k in ("active", "ready", "succeeded", "failed") if status.get(k)]
        if parts:
            counts.append(f"{replica}: {', '.join(parts)}")
    holding = _holding(job)
    active = any(status.get("active") for status in replicas.values())
    state = holding[-1]["type"] if holding else ("Running" if active else "Pending")
    return f"{state} ({'; '.join(counts)})" if counts else state


class _JobApi:
    """The Kubernetes calls on one namespace's jobs of one kind and their pods: each is one verb of its rbac_rules."""

    def __init__(self, api_client, namespace: str, kind: JobKind):
        from kubernetes import client

        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.namespace = namespace
        self.kind = kind
        self.where = (kind.group, kind.version, namespace, kind.plural)

    def create(self, manifest: dict) -> dict:
        return self.custom.create_namespaced_custom_object(*self.where, manifest, _request_timeout=REQUEST_TIMEOUT)

    def get(self, name: str) -> dict:
        return self.custom.get_namespaced_custom_object(*self.where, name, _request_timeout=REQUEST_TIMEOUT)

    def delete(self, name: str) -> None:
        from kubernetes import client

        # Foreground: the job is gone only once its pods are, so a recreated job's pods never meet the old ones.
        self.custom.delete_namespaced_custom_object(*self.where, name, body=client.V1DeleteOptions(propagation_policy="Foreground"),
                                                    _request_timeout=REQUEST_TIMEOUT)

    def pods(self, name: str) -> list[dict]:
        response = self.core.list_namespaced_pod(self.namespace, label_selector=f"{self.kind.pod_selector}={name}",
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


def _create_error(e, where: str, kind: JobKind) -> str:
    message = _api_message(e)
    # A validating admission webhook's denial comes back as 403 too (controller-runtime v0.22
    # pkg/webhook/admission/response.go, Denied; k8s.io/apiserver .../webhook/errors/statuserror.go, ToStatusErr).
    webhook = "admission webhook" in message
    if e.status == 404:
        return f"Cannot create {where}: the cluster has no {kind.plural}.{kind.group}/{kind.version} kind ({message}). {kind.install}"
    if e.status in (401, 403) and not webhook:
        return f"Cannot create {where}: the pipeline's service account may not ({message}). Grant it the {kind.plural} verbs: {kind.grant}."
    if e.status in (400, 422) or webhook:
        hints = [hint for words, hint in kind.hints if words in message]
        return " ".join([f"Cannot create {where}: the API server (or the controller's admission webhook) rejected it: {message}", *hints])
    return f"Cannot create {where}: {e.status} {message}"


class PhaseJobLauncher:
    """One job's life: create (or find again after a retry), wait, clean up, explain a failure."""

    def __init__(self, api_client=None, namespace: str | None = None, poll_seconds: float = 10.0):
        self.api_client = api_client if api_client is not None else connect()
        self.namespace = namespace or current_namespace()
        self.poll_seconds = poll_seconds

    def _api(self, job: dict) -> _JobApi:
        return _JobApi(self.api_client, self.namespace, kind_of(job))

    # -- the life of a job ------------------------------------------------------------------------

    def run(self, manifest: dict, *, wait_seconds: float, cleanup: str = "on-success") -> Finished:
        """Create the job, wait until it succeeds (returned) or fails (PhaseJobError naming the job and
        why its pods failed), at most `wait_seconds`; then delete it per `cleanup`. A job past its time
        is deleted unless cleanup is never and the job stops itself (a PyTorchJob's deadline)."""
        from kubernetes.client.exceptions import ApiException

        api, name = self._api(manifest), manifest["metadata"]["name"]
        where = f"{api.kind.kind} {name} in namespace {self.namespace}"
        start = time.monotonic()
        deadline = start + wait_seconds
        self._create_or_adopt(api, manifest, where, deadline)
        try:
            job = self._wait(api, name, where, deadline, wait_seconds)
        except PhaseJobTimeout as e:
            if cleanup == "never" and api.kind.own_deadline:
                raise
            api.delete_quietly(name, where)  # a job past its time would hold its GPUs on
            why = "" if cleanup != "never" else f" even with cleanup never: a {api.kind.kind} has no deadline of its own"
            raise PhaseJobTimeout(f"{e} The job was deleted{why}.") from None
        outcome = finished_as(job)
        delete = cleanup == "always" or (cleanup == "on-success" and outcome == "Succeeded")
        if outcome == "Failed":
            why = self.explain_failure(job)
            if delete:
                api.delete_quietly(name, where)
            kept = "deleted" if delete else f"kept: kubectl -n {self.namespace} describe {api.kind.kind.lower()} {name}"
            raise PhaseJobError(f"{where} failed: {why} (The job was {kept}.)")
        if delete:
            try:
                api.delete(name)
            except ApiException as e:
                if e.status != 404:
                    log.warning("%s succeeded but could not be deleted: %s", where, _api_message(e))
        log.info("%s succeeded after %.0f s", where, time.monotonic() - start)
        return Finished(name, self.namespace, time.monotonic() - start, delete, job.get("status") or {})

    def _create_or_adopt(self, api: _JobApi, manifest: dict, where: str, deadline: float) -> None:
        """Create the job. One already there (a retried launcher task) is the same run's: wait for it
        when it is still running or succeeded, replace it when it failed (the retry is a new try)."""
        from kubernetes.client.exceptions import ApiException

        name = manifest["metadata"]["name"]
        try:
            api.create(manifest)
            log.info("created %s: %s", where, api.kind.shape(manifest))
            return
        except ApiException as e:
            if e.status != 409:
                raise PhaseJobError(_create_error(e, where, api.kind)) from None
        try:
            existing = api.get(name)
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
            api.delete(name)
        except ApiException as e:
            if e.status != 404:
                raise PhaseJobError(f"{where} from an earlier attempt failed and cannot be deleted: {_api_message(e)}") from None
        self._wait_gone(api, name, where, deadline)
        try:
            api.create(manifest)
        except ApiException as e:
            raise PhaseJobError(_create_error(e, where, api.kind)) from None
        log.info("created %s again: %s", where, api.kind.shape(manifest))

    def _wait_gone(self, api: _JobApi, name: str, where: str, deadline: float) -> None:
        """Poll until a deleted job is gone (foreground deletion waits for its pods)."""
        from kubernetes.client.exceptions import ApiException

        while True:
            try:
                api.get(name)
            except ApiException as e:
                if e.status == 404:
                    return
                raise PhaseJobError(f"{where}: {_api_message(e)}") from None
            if time.monotonic() > deadline:
                raise PhaseJobError(f"{where} from an earlier attempt is still being deleted; try again later.")
            time.sleep(self.poll_seconds)

    def _wait(self, api: _JobApi, name: str, where: str, deadline: float, limit: float) -> dict:
        """Poll until the job succeeds or fails; transient API errors are retried until the deadline."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        last_state, job = None, {}
        while True:
            try:
                job = api.get(name)
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
        """The controller's reason and message, then for each failed pod: replica, exit code, reason, and
        where its logs are. Without permission to list pods, the controller's words alone."""
        from kubernetes.client.exceptions import ApiException

        api, name = self._api(job), job["metadata"]["name"]
        parts = _controller_reason(job)
        try:
            pods = api.pods(name)
        except ApiException as e:
            parts.append(f"(the pods could not be listed for details: {_api_message(e)})")
            pods = []
        parts += [_failed_pod_line(pod, why, self.namespace, api.kind) for pod in pods if (why := _pod_failure(pod))]
        return " ".join(parts) if parts else "the controller gave no reason"


def _controller_reason(job: dict) -> list[str]:
    """The reason and message of the job's latest Failed condition (none when it has none)."""
    failed = [c for c in (job.get("status") or {}).get("conditions") or [] if c.get("type") == "Failed"]
    if not failed:
        return []
    condition = failed[-1]
    return [f"{condition.get('reason') or 'Failed'}: {condition.get('message') or 'no message'}"]


def _failed_pod_line(pod: dict, why: str, namespace: str, kind: JobKind) -> str:
    """One failed pod of the job: its replica and index, why it failed, and how to read its logs."""
    meta = pod.get("metadata", {})
    marks = {**(meta.get("annotations") or {}), **(meta.get("labels") or {})}
    replica = f"{marks.get(kind.replica_key, '?')} {marks.get(kind.index_key, '?')}"
    pod_name = meta["name"]
    return (f"{replica} (pod {pod_name}): {why}; logs: kubectl -n {namespace} logs {pod_name} -c {kind.container}"
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
