"""A stand-in for the few Kubernetes API calls the phase-job launcher makes, for tests only.

No Kubernetes cluster, no Kubeflow Training Operator and no Kubeflow Trainer can run here. So the launcher's tests
point the *real* ``kubernetes`` Python client (through a kubeconfig with a bearer token) at this
small HTTP server on a loopback port: real HTTP requests, the JSON the client sends, the Status
objects it gets back on errors. This is NOT Kubernetes: nothing is scheduled, no pod runs, no
operator reconciles; a job's status is whatever the test scripted.

It serves, in the API server's URL layout and JSON shapes, for kubeflow.org/v1 ``pytorchjobs`` and
trainer.kubeflow.org/v1alpha1 ``trainjobs`` (``SERVED``):

- ``POST   /apis/{group}/{version}/namespaces/{ns}/{plural}``: create (409 AlreadyExists when the
  name is taken; 422 Invalid when the ``admit`` callable, e.g. the CRD schema check, rejects it; then,
  as the API server calls validating webhooks after its own validation, 403 when the ``webhook``
  callable denies it, worded as the API server words a webhook's denial);
- ``GET    /apis/{group}/{version}/namespaces/{ns}/{plural}/{name}``: the job, its ``status`` the
  next one of the statuses scripted for that creation of the job (the last one repeats);
- ``DELETE /apis/{group}/{version}/namespaces/{ns}/{plural}/{name}``: foreground deletion: the
  job stays (with a deletionTimestamp) for ``linger`` more reads, then is gone (404);
- ``GET    /api/v1/namespaces/{ns}/pods?labelSelector=KEY=VALUE``: the pods scripted for that job.

``runtimes`` are the ClusterTrainingRuntimes the cluster has (by name), which the TrainJob webhook
looks up (Trainer's webhook refuses a TrainJob whose runtime does not exist).

Anything else answers 404 and is recorded, so a test sees any call the RBAC would not allow.
``fail(...)`` makes chosen requests answer an error instead.

Usage::

    with KubernetesApiStandIn() as k8s:
        k8s.script("fedpipe-x-123", [running(), succeeded()])
        monkeypatch.setenv("KUBECONFIG", str(k8s.kubeconfig(tmp_path, namespace="team-a")))
"""

from __future__ import annotations

import copy
import json
import re
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

JOBS = re.compile(r"^/apis/([^/]+)/([^/]+)/namespaces/([^/]+)/([^/]+)$")
JOB = re.compile(r"^/apis/([^/]+)/([^/]+)/namespaces/([^/]+)/([^/]+)/([^/]+)$")
PODS = re.compile(r"^/api/v1/namespaces/([^/]+)/pods$")
TOKEN = "standin-token-6d1f"


@dataclass(frozen=True)
class Resource:
    group: str
    version: str
    plural: str
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"


SERVED = {(r.group, r.version, r.plural): r for r in (Resource("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob"),
                                                      Resource("trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob"))}
# The validating webhook of each kind that has one here (its name, as the API server quotes it in a denial):
# kubeflow/trainer v2.1.0 pkg/webhooks/trainjob_webhook.go, the kubebuilder:webhook marker.
WEBHOOK_NAMES = {"TrainJob": "validator.trainjob.trainer.kubeflow.org"}

_REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 409: "AlreadyExists", 422: "Invalid",
            500: "InternalError", 503: "ServiceUnavailable"}


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- statuses a test scripts (the Training Operator's JobStatus shape) ------------------------------

def _condition(kind: str, reason: str, message: str) -> dict:
    return {"type": kind, "status": "True", "reason": reason, "message": message, "lastUpdateTime": _now(),
            "lastTransitionTime": _now()}


def created() -> dict:
    return {"conditions": [_condition("Created", "PyTorchJobCreated", "PyTorchJob is created.")]}


def running(master: int = 1, worker: int = 1) -> dict:
    replicas = {"Master": {"active": master}}
    if worker:
        replicas["Worker"] = {"active": worker}
    return {"conditions": [_condition("Created", "PyTorchJobCreated", "PyTorchJob is created."),
                           _condition("Running", "PyTorchJobRunning", "PyTorchJob is running.")],
            "replicaStatuses": replicas, "startTime": _now()}


def succeeded(master: int = 1, worker: int = 1) -> dict:
    replicas = {"Master": {"succeeded": master}}
    if worker:
        replicas["Worker"] = {"succeeded": worker}
    running_false = dict(_condition("Running", "PyTorchJobRunning", "PyTorchJob is running."), status="False")
    return {"conditions": [_condition("Created", "PyTorchJobCreated", "PyTorchJob is created."), running_false,
                           _condition("Succeeded", "PyTorchJobSucceeded", "PyTorchJob is successfully completed.")],
            "replicaStatuses": replicas, "startTime": _now(), "completionTime": _now()}


def failed(reason: str, message: str, replicas: dict) -> dict:
    running_false = dict(_condition("Running", "PyTorchJobRunning", "PyTorchJob is running."), status="False")
    return {"conditions": [_condition("Created", "PyTorchJobCreated", "PyTorchJob is created."), running_false,
                           _condition("Failed", reason, message)],
            "replicaStatuses": replicas, "startTime": _now(), "completionTime": _now()}


def _pod(name: str, labels: dict, annotations: dict, container: str, phase: str, container_state: dict | None,
         last_state: dict | None, restarts: int) -> dict:
    return {
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "status": {"phase": phase, "containerStatuses": [{
            "name": container, "ready": phase == "Running", "restartCount": restarts, "image": "img", "imageID": "",
            "state": container_state or {"running": {"startedAt": _now()}}, "lastState": last_state or {}}]},
    }  # fmt: skip


def pod(job: str, replica: str, index: int, *, phase: str = "Running", container_state: dict | None = None,
        last_state: dict | None = None, restarts: int = 0) -> dict:
    """A pod of the PyTorchJob as the operator labels it, with the `pytorch` container in `container_state`."""
    labels = {"training.kubeflow.org/job-name": job, "training.kubeflow.org/replica-type": replica,
              "training.kubeflow.org/replica-index": str(index)}
    return _pod(f"{job}-{replica}-{index}", labels, {}, "pytorch", phase, container_state, last_state, restarts)


def jobset_pod(trainjob: str, index: int, *, phase: str = "Running", container_state: dict | None = None,
               last_state: dict | None = None, restarts: int = 0) -> dict:
    """A pod of the TrainJob's JobSet (replicated Job `node`, Job index 0, pod `index`), named and marked as
    JobSet v0.10.1 does (pkg/controllers/jobset_controller.go, labelAndAnnotateObject: the JobSet is named
    after the TrainJob) and as the Job controller annotates an Indexed Job's pod (its completion index,
    which Trainer's PET_NODE_RANK reads), with the `node` container in `container_state`."""
    labels = {"jobset.sigs.k8s.io/jobset-name": trainjob, "jobset.sigs.k8s.io/replicatedjob-name": "node",
              "jobset.sigs.k8s.io/job-index": "0"}
    annotations = {**labels, "batch.kubernetes.io/job-completion-index": str(index)}
    name = f"{trainjob}-node-0-{index}-{uuid.uuid4().hex[:5]}"
    return _pod(name, labels, annotations, "node", phase, container_state, last_state, restarts)


# -- TrainJob statuses (Kubeflow Trainer v2.1.0, pkg/apis/trainer/v1alpha1/trainjob_types.go TrainJobStatus) -----
# Its conditions are metav1.Conditions; Complete and Failed are the JobSet's Completed and Failed, renamed
# (pkg/runtime/framework/plugins/jobset/jobset.go, Status), with JobSet v0.10.1's reasons and messages
# (pkg/constants/constants.go: AllJobsCompleted, FailedJobs). jobsStatus counts child Jobs, not pods.

def _metav1_condition(kind: str, reason: str, message: str) -> dict:
    return {"type": kind, "status": "True", "reason": reason, "message": message, "lastTransitionTime": _now(),
            "observedGeneration": 1}


def _jobs_status(**counts: int) -> list[dict]:
    return [{"name": "node", **{k: counts.get(k, 0) for k in ("active", "ready", "succeeded", "failed", "suspended")}}]


def trainjob_running() -> dict:
    """The JobSet's `node` Job runs, its pods ready; Trainer sets no condition until it ends."""
    return {"jobsStatus": _jobs_status(active=1, ready=1)}


def trainjob_complete() -> dict:
    return {"conditions": [_metav1_condition("Complete", "AllJobsCompleted", "jobset completed successfully")],
            "jobsStatus": _jobs_status(succeeded=1)}


def trainjob_failed(reason: str = "FailedJobs", message: str = "jobset failed due to one or more job failures") -> dict:
    return {"conditions": [_metav1_condition("Failed", reason, message)], "jobsStatus": _jobs_status(failed=1)}


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # names in lower case
    raw: bytes
    body: Any = None
    status: int = 0

    def param(self, name: str) -> str | None:
        values = self.query.get(name)
        return values[0] if values else None

    @property
    def verb(self) -> tuple[str, str, str]:
        """(API group, resource, RBAC verb) of the request, as the API server's authorizer sees it."""
        if PODS.match(self.path):
            group, resource, named = "", "pods", False
        elif m := JOB.match(self.path):
            group, resource, named = m[1], m[4], True
        elif m := JOBS.match(self.path):
            group, resource, named = m[1], m[4], False
        else:
            return ("?", self.path, self.method.lower())
        if self.method == "GET":
            verb = "watch" if self.param("watch") in ("true", "1") else ("get" if named else "list")
        else:
            verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete" if named else "deletecollection"}[self.method]
        return (group, resource, verb)


@dataclass
class _Fault:
    method: str
    path: re.Pattern
    status: int
    message: str
    times: int | None


@dataclass
class _Job:
    obj: dict
    statuses: list[dict] = field(default_factory=list)
    deleting_reads_left: int | None = None


class KubernetesApiStandIn:
    def __init__(self, admit: Callable[[dict], str | None] | None = None, linger: int = 1,
                 webhook: Callable[[dict, dict[str, dict]], str | None] | None = None, runtimes: dict[str, dict] | None = None) -> None:
        self.lock = threading.RLock()
        self.admit = admit  # returns an error message for a job the API server would refuse
        self.webhook = webhook  # (job, runtimes) -> why a kind's validating webhook (WEBHOOK_NAMES) denies it
        self.runtimes = dict(runtimes or {})  # ClusterTrainingRuntimes by name
        self.linger = linger
        self.recorded: list[Recorded] = []
        self.faults: list[_Fault] = []
        self.jobs: dict[tuple[str, str, str], _Job] = {}  # (plural, namespace, name)
        self.scripts: dict[str, list[list[dict]]] = {}  # job name -> statuses of its 1st, 2nd, ... creation
        self.pods: dict[str, list[dict]] = {}
        self.on_create: Callable[[dict], None] | None = None
        self.created: list[dict] = []  # every body accepted by a create, in order
        self._server: ThreadingHTTPServer | None = None

    # -- lifecycle --------------------------------------------------------------------------------

    def __enter__(self) -> KubernetesApiStandIn:
        standin = self

        class Handler(_Handler):
            state = standin

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="k8s-api-standin", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def url(self) -> str:
        assert self._server is not None, "enter the stand-in first"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def kubeconfig(self, folder: Path, namespace: str = "team-a") -> Path:
        """A kubeconfig whose current context is this server, a bearer token and `namespace`."""
        path = Path(folder) / "kubeconfig"
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "standin",
            "clusters": [{"name": "standin", "cluster": {"server": self.url}}],
            "users": [{"name": "launcher", "user": {"token": TOKEN}}],
            "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "launcher", "namespace": namespace}}],
        }))
        return path

    # -- for tests --------------------------------------------------------------------------------

    def script(self, name: str, *creations: list[dict]) -> None:
        """The statuses successive reads of job `name` return, one list per creation of it."""
        with self.lock:
            self.scripts[name] = [list(c) for c in creations]

    def put(self, obj: dict, statuses: list[dict]) -> None:
        """A job that already exists (one an earlier attempt created)."""
        with self.lock:
            obj = copy.deepcopy(obj)
            obj["metadata"].update({"uid": str(uuid.uuid4()), "creationTimestamp": _now(), "resourceVersion": "1"})
            self.jobs[(_plural(obj), obj["metadata"]["namespace"], obj["metadata"]["name"])] = _Job(obj, list(statuses))

    def fail(self, method: str, path: str, status: int, message: str, times: int | None = None) -> None:
        with self.lock:
            self.faults.append(_Fault(method.upper(), re.compile(path), status, message, times))

    def requests(self, method: str | None = None) -> list[Recorded]:
        with self.lock:
            return [r for r in self.recorded if method is None or r.method == method.upper()]

    def verbs(self) -> set[tuple[str, str, str]]:
        return {r.verb for r in self.requests()}

    # -- the API ----------------------------------------------------------------------------------

    @staticmethod
    def status_body(code: int, message: str, name: str = "", resource: Resource | None = None) -> dict:
        details = {"name": name, "group": resource.group, "kind": resource.plural} if resource else {"name": name}
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
                "reason": _REASONS.get(code, "Unknown"), "details": details, "code": code}

    def handle(self, req: Recorded) -> tuple[int, Any]:
        with self.lock:
            self.recorded.append(req)
            for fault in self.faults:
                if fault.method == req.method and fault.path.fullmatch(req.path) and fault.times != 0:
                    if fault.times is not None:
                        fault.times -= 1
                    return fault.status, self.status_body(fault.status, fault.message)
            if req.method == "POST" and (m := JOBS.match(req.path)) and (r := SERVED.get((m[1], m[2], m[4]))):
                return self._create(r, m[3], req.body)
            if (m := JOB.match(req.path)) and (r := SERVED.get((m[1], m[2], m[4]))):
                if req.method == "GET" and req.param("watch") is None:
                    return self._get(r, m[3], m[5])
                if req.method == "DELETE":
                    return self._delete(r, m[3], m[5], req.body or {})
            if (m := PODS.match(req.path)) and req.method == "GET" and req.param("watch") is None:
                return self._pods(m[1], req.param("labelSelector") or "")
            return 404, self.status_body(404, "the server could not find the requested resource (stand-in: not served)")

    def _create(self, r: Resource, namespace: str, body: Any) -> tuple[int, Any]:
        if not isinstance(body, dict) or body.get("kind") != r.kind or body.get("apiVersion") != r.api_version:
            return 400, self.status_body(400, f"the body is not a {r.api_version} {r.kind}")
        name = body.get("metadata", {}).get("name", "")
        if body["metadata"].get("namespace", namespace) != namespace:
            return 400, self.status_body(400, "the namespace of the provided object does not match the namespace sent on the request")
        if self.admit is not None and (problem := self.admit(body)):
            return 422, self.status_body(422, f'{r.kind}.{r.group} "{name}" is invalid: {problem}', name, r)
        # The API server calls validating webhooks after its own validation; it words a denial so
        # (k8s.io/apiserver pkg/admission/plugin/webhook/errors/statuserror.go, ToStatusErr), with the code
        # the webhook gave: controller-runtime's Denied is 403 Forbidden (pkg/webhook/admission/response.go).
        if r.kind in WEBHOOK_NAMES and self.webhook is not None and (denial := self.webhook(body, self.runtimes)):
            return 403, self.status_body(403, f'admission webhook "{WEBHOOK_NAMES[r.kind]}" denied the request: {denial}', name, r)
        if (r.plural, namespace, name) in self.jobs:
            return 409, self.status_body(409, f'{r.plural}.{r.group} "{name}" already exists', name, r)
        obj = copy.deepcopy(body)
        obj["metadata"].update({"namespace": namespace, "uid": str(uuid.uuid4()), "creationTimestamp": _now(), "resourceVersion": "1"})
        creations = self.scripts.get(name) or [[created() if r.kind == "PyTorchJob" else {}]]
        statuses = creations.pop(0) if len(creations) > 1 else list(creations[0])
        self.jobs[(r.plural, namespace, name)] = _Job(obj, statuses)
        self.created.append(copy.deepcopy(body))
        if self.on_create is not None:
            self.on_create(copy.deepcopy(body))
        return 201, obj

    def _get(self, r: Resource, namespace: str, name: str) -> tuple[int, Any]:
        job = self.jobs.get((r.plural, namespace, name))
        if job is None:
            return 404, self.status_body(404, f'{r.plural}.{r.group} "{name}" not found', name, r)
        if job.deleting_reads_left is not None:
            if job.deleting_reads_left <= 0:
                del self.jobs[(r.plural, namespace, name)]
                return 404, self.status_body(404, f'{r.plural}.{r.group} "{name}" not found', name, r)
            job.deleting_reads_left -= 1
        elif job.statuses:
            status = job.statuses.pop(0) if len(job.statuses) > 1 else job.statuses[0]
            if status:  # an empty status is left out (TrainJobStatus is `omitzero`)
                job.obj["status"] = status
        return 200, job.obj

    def _delete(self, r: Resource, namespace: str, name: str, options: dict) -> tuple[int, Any]:
        job = self.jobs.get((r.plural, namespace, name))
        if job is None:
            return 404, self.status_body(404, f'{r.plural}.{r.group} "{name}" not found', name, r)
        if options.get("propagationPolicy") == "Foreground" and self.linger > 0:
            job.obj["metadata"]["deletionTimestamp"] = _now()
            job.obj["metadata"]["finalizers"] = ["foregroundDeletion"]
            job.deleting_reads_left = self.linger
            return 200, job.obj
        del self.jobs[(r.plural, namespace, name)]
        return 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": {"name": name}}

    def _pods(self, namespace: str, selector: str) -> tuple[int, Any]:
        wanted = dict(part.split("=", 1) for part in selector.split(",") if "=" in part)
        items = [p for pods in self.pods.values() for p in pods
                 if wanted.items() <= p["metadata"]["labels"].items()]
        return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": items}


def _plural(obj: dict) -> str:
    group, _, version = obj["apiVersion"].partition("/")
    (r,) = [r for r in SERVED.values() if (r.group, r.version, r.kind) == (group, version, obj["kind"])]
    return r.plural


class _Handler(BaseHTTPRequestHandler):
    state: KubernetesApiStandIn

    def log_message(self, format, *args):  # keep test output quiet
        pass

    def _serve(self) -> None:
        parts = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        req = Recorded(self.command, parts.path, parse_qs(parts.query, keep_blank_values=True),
                       {k.lower(): v for k, v in self.headers.items()}, raw)
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            status, payload = 401, KubernetesApiStandIn.status_body(401, "Unauthorized")
            with self.state.lock:
                self.state.recorded.append(req)
        else:
            try:
                req.body = json.loads(raw) if raw else None
                status, payload = self.state.handle(req)
            except ValueError as e:
                status, payload = 400, KubernetesApiStandIn.status_body(400, f"cannot parse the body: {e}")
            except Exception as e:  # a bug in the stand-in: answer 500 rather than hang the client
                status, payload = 500, KubernetesApiStandIn.status_body(500, f"stand-in error: {type(e).__name__}: {e}")
        req.status = status
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_DELETE = do_PATCH = do_PUT = _serve
