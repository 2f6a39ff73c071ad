"""A stand-in for the Kubeflow Pipelines API server (REST API v2beta1), for tests only.

No KFP server can run here (no Kubernetes cluster, no network), so the tests of ``fedpipe
register``, ``submit`` and ``schedule`` point the *real* ``kfp.Client`` at this small HTTP server
on a free loopback port. That checks what our client sends **through the real kfp library**: real
HTTP requests, the request JSON and multipart uploads that ``kfp_server_api`` builds, and response
JSON in the shapes ``kfp_server_api`` deserialises (for example ``recurringRuns``, not
``recurring_runs``, in the list of recurring runs, and int64 fields as strings).

This is NOT Kubeflow and says nothing about a real cluster. It keeps pipelines, pipeline versions,
experiments, runs and recurring runs in memory with server-generated ids; nothing is ever
executed or scheduled; there is no Argo. It mimics only the server behaviour the client can
observe and fedpipe relies on:

- ``GET /apis/v2beta1/healthz`` answers ``commit_sha``, ``tag_name`` (the release, configurable;
  ``None`` leaves it out) and ``multi_user``, without authentication, as the real server's plain
  HTTP handler does (backend/src/apiserver/main.go, ``newHealthzResponse``);

- uploading a pipeline also creates its first version, named after the pipeline (as the real
  upload server does), and answers 409 when a pipeline of that name exists;
- uploading a version answers 409 when the pipeline already has a version of that name, and 400
  for an unknown pipeline id; an upload whose file is not a YAML pipeline spec answers 400;
- list endpoints understand the ``filter`` JSON kfp sends (EQUALS / NOT_EQUALS / IS_SUBSTRING / IN,
  by name or number, on string fields such as ``display_name``; other operations answer 400),
  ``page_size`` / ``page_token``, and ``experiment_id``;
- creating a run or a recurring run checks that its experiment (and pipeline version) exist;
- errors come back as JSON in the real server's shapes: ``{"error_message", "error_details"}``
  from the upload endpoints, ``{"error", "code", "message", "details"}`` from the others.

Every request is recorded (method, path, query, parsed body; for uploads the multipart fields and
file content; the raw bytes too) so tests can assert on exactly what went over the wire.
``fail(...)`` makes chosen requests answer an error instead, to test error handling.

Multi-user mode (``KfpApiStandIn(multi_user=True)``) enforces what the real API server enforces
when MULTIUSER=true, as in the Kubeflow manifests (paths under backend/src/apiserver/ of
kubeflow/pipelines):

- identity (resource/resource_manager.go ``IsAuthorized``, auth/auth.go ``GetAuthenticators``): the
  ``kubeflow-userid`` header (USERID_HEADER of the Kubeflow manifests, prefix ""), else
  ``Authorization: Bearer <token>`` checked by a TokenReview with audience pipelines.kubeflow.org
  (auth/authenticator_token_review.go); here ``add_token(token, user)`` stands for the TokenReview.
  No identity: 401 (Unauthenticated); an identity not allowed in the namespace: 403
  (PermissionDenied, a SubjectAccessReview with the verb and resource of the call; here
  ``grant(user, namespace)`` allows everything, ``bind_role(user, namespace, rules)`` only what a Role's
  rules grant). Every decision is kept in ``authorizations``;
- experiments: created and listed only with a namespace, else 400 "An experiment cannot have an empty
  namespace in multi-user mode" (server/experiment_server.go ``canAccessExperiment``), then
  authorized in it; listing returns only that namespace's experiments;
- runs and recurring runs: need an experiment id ("Experiment id can not be empty in multi-user
  mode", resource_manager.go ``GetValidExperimentNamespacePair``) and take its namespace; a recurring
  run that names another namespace is refused ("Experiment ... belongs to namespace ... instead of
  ..."); creating, listing and deleting are authorized in that namespace (server/run_server.go
  ``createRun``/``canAccessRun``, server/job_server.go ``createJob``/``listJobs``/``canAccessJob``);
  listing recurring runs without an experiment or a namespace is 400; deleting one looks it up before
  authorizing, so an unknown id is 404 (job_server.go ``DeleteRecurringRun`` -> ``deleteJob`` ->
  ``canAccessJob``);
- pipelines: an upload with a ``namespace`` is authorized in it and the pipeline belongs to it; an
  upload without one makes a shared pipeline, which the real upload server lets through without
  authorization (server/pipeline_upload_server.go ``canUploadVersionedPipeline``); an authorization
  failure on upload answers 400 "Failed to create a pipeline" as that server does; reading or listing
  shared pipelines needs no identity (server/pipeline_server.go ``canAccessPipeline``), a namespace's
  pipelines do; a pipeline's versions inherit its namespace.

In single-user mode (the default) namespaces are dropped on the way in, as the real server's
``ReplaceNamespace`` does, and nothing is authenticated.

Usage::

    with KfpApiStandIn() as kfp:
        ...  # fedpipe register --host {kfp.url}
        [upload] = kfp.requests("POST", "/apis/v2beta1/pipelines/upload")
"""

from __future__ import annotations

import email.parser
import email.policy
import json
import re
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

API = "/apis/v2beta1"

# v2beta1 Predicate.Operation, by number
_OPERATIONS = {1: "EQUALS", 2: "NOT_EQUALS", 3: "GREATER_THAN", 5: "GREATER_THAN_EQUALS", 6: "LESS_THAN",
               7: "LESS_THAN_EQUALS", 8: "IN", 9: "IS_SUBSTRING"}

# gRPC status codes the grpc-gateway puts in its error bodies, by HTTP status.
_GRPC_CODE = {400: 3, 401: 16, 403: 7, 404: 5, 409: 6, 500: 13, 501: 12, 503: 14}


@dataclass
class Recorded:
    """One request as the stand-in received it."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    raw: bytes  # the request body exactly as sent
    target: str = ""  # the request target exactly as sent (path and query string)
    body: Any = None  # parsed JSON body (None when there is none)
    form: dict[str, str] = field(default_factory=dict)  # multipart fields that are not files
    files: dict[str, tuple[str, bytes]] = field(default_factory=dict)  # multipart files: name -> (filename, content)
    status: int = 0  # what the stand-in answered

    def param(self, name: str) -> str | None:
        values = self.query.get(name)
        return values[0] if values else None

    def wire_bytes(self) -> bytes:
        """Everything this request carried: request line (with query), headers and body."""
        head = f"{self.method} {self.target}\n" + "".join(f"{k}: {v}\n" for k, v in self.headers.items())
        return head.encode() + b"\n" + self.raw


@dataclass
class _Fault:
    method: str
    path: re.Pattern
    status: int
    message: str
    times: int | None  # None: every matching request


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _new_id() -> str:
    return str(uuid.uuid4())


class KfpApiStandIn:
    """The stand-in server; ``start()`` / ``stop()`` or use it as a context manager."""

    def __init__(self, multi_user: bool = False, tag_name: str | None = "2.15.0") -> None:
        self.lock = threading.RLock()
        self.recorded: list[Recorded] = []
        self.faults: list[_Fault] = []
        self.multi_user = multi_user
        self.tag_name = tag_name  # healthz tag_name (the TAG_NAME the server image was built with); None: left out
        self.commit_sha = "0f2c9a1e"
        self.tokens: dict[str, str] = {}  # bearer token -> user: what a TokenReview would answer
        self.access: dict[str, set[str]] = {}  # user -> namespaces: what SubjectAccessReviews would allow
        self.roles: dict[tuple[str, str], list[dict]] = {}  # (user, namespace) -> RBAC rules bound to the user there
        self.authorizations: list[tuple[str, str, str, str, bool]] = []  # (user, namespace, verb, resource, allowed)
        self.pipelines: dict[str, dict] = {}
        self.versions: dict[str, dict] = {}  # version id -> version (with "pipeline_id")
        self.specs: dict[str, bytes] = {}  # version id -> the uploaded file
        self.experiments: dict[str, dict] = {}
        self.runs: dict[str, dict] = {}
        self.recurring_runs: dict[str, dict] = {}
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        default = {"experiment_id": _new_id(), "display_name": "Default", "description": "All runs created without specifying an experiment will be grouped here.",
                   "created_at": _now(), "namespace": "", "storage_state": "AVAILABLE"}
        if not multi_user:  # a fresh single-user KFP has a "Default" experiment; multi-user ones are per namespace
            self.experiments[default["experiment_id"]] = default

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> KfpApiStandIn:
        standin = self

        class Handler(_Handler):
            server_state = standin

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="kfp-api-standin", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = None

    def __enter__(self) -> KfpApiStandIn:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._server is not None, "start() the stand-in first"
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- for tests --------------------------------------------------------------------------------

    def fail(self, method: str, path: str, status: int, message: str, times: int | None = None) -> None:
        """Answer requests `method` `path` (a regex matched against the whole path) with `status` and
        `message` in the server's error shape, `times` times (None: until `clear_faults()`)."""
        with self.lock:
            self.faults.append(_Fault(method.upper(), re.compile(path), status, message, times))

    def clear_faults(self) -> None:
        with self.lock:
            self.faults.clear()

    def add_token(self, token: str, user: str) -> None:
        """A bearer token the (simulated) TokenReview accepts, for `user`."""
        with self.lock:
            self.tokens[token] = user

    def grant(self, user: str, *namespaces: str) -> None:
        """Let `user` do anything with KFP resources in these namespaces (a profile's contributor)."""
        with self.lock:
            self.access.setdefault(user, set()).update(namespaces)

    def bind_role(self, user: str, namespace: str, rules: list[dict]) -> None:
        """Bind a Role's `rules` (rbac.authorization.k8s.io/v1 PolicyRules) to `user` in `namespace`: a
        SubjectAccessReview then allows exactly the verbs they grant on pipelines.kubeflow.org resources."""
        with self.lock:
            self.roles.setdefault((user, namespace), []).extend(rules)

    def _role_allows(self, user: str, namespace: str, verb: str, resource: str) -> bool:
        def has(values: list[str], value: str) -> bool:
            return "*" in values or value in values

        return any(has(rule.get("apiGroups", []), "pipelines.kubeflow.org") and has(rule.get("resources", []), resource)
                   and has(rule.get("verbs", []), verb) for rule in self.roles.get((user, namespace), []))

    def requests(self, method: str | None = None, path: str | None = None) -> list[Recorded]:
        """Recorded requests, optionally only those with this method and this exact path."""
        with self.lock:
            return [r for r in self.recorded if (method is None or r.method == method.upper()) and (path is None or r.path == path)]

    def versions_of(self, pipeline_id: str) -> list[dict]:
        with self.lock:
            return [v for v in self.versions.values() if v["pipeline_id"] == pipeline_id]

    def pipeline_named(self, name: str, namespace: str | None = None) -> dict | None:
        with self.lock:
            return next((p for p in self.pipelines.values() if p["display_name"] == name
                         and (namespace is None or p["namespace"] == namespace)), None)

    def experiment_named(self, name: str, namespace: str | None = None) -> dict | None:
        with self.lock:
            return next((e for e in self.experiments.values() if e["display_name"] == name
                         and (namespace is None or e["namespace"] == namespace)), None)

    # -- dispatch ---------------------------------------------------------------------------------

    def _routes(self) -> list[tuple[str, re.Pattern, Callable]]:
        seg = r"([^/:]+)"
        table = [
            ("GET", "/healthz", self._healthz),
            ("POST", "/pipelines/upload", self._upload_pipeline),
            ("POST", "/pipelines/upload_version", self._upload_version),
            ("GET", "/pipelines", self._list_pipelines),
            ("GET", f"/pipelines/{seg}", self._get_pipeline),
            ("GET", f"/pipelines/{seg}/versions", self._list_versions),
            ("GET", f"/pipelines/{seg}/versions/{seg}", self._get_version),
            ("GET", "/experiments", self._list_experiments),
            ("POST", "/experiments", self._create_experiment),
            ("GET", f"/experiments/{seg}", self._get_experiment),
            ("POST", "/runs", self._create_run),
            ("GET", "/runs", self._list_runs),
            ("GET", f"/runs/{seg}", self._get_run),
            ("GET", "/recurringruns", self._list_recurring_runs),
            ("POST", "/recurringruns", self._create_recurring_run),
            ("GET", f"/recurringruns/{seg}", self._get_recurring_run),
            ("DELETE", f"/recurringruns/{seg}", self._delete_recurring_run),
        ]
        return [(m, re.compile(re.escape(API) + p + "$"), h) for m, p, h in table]

    def handle(self, req: Recorded) -> tuple[int, Any]:
        with self.lock:
            self.recorded.append(req)
            for fault in self.faults:
                if fault.method == req.method and fault.path.fullmatch(req.path) and fault.times != 0:
                    if fault.times is not None:
                        fault.times -= 1
                    return fault.status, self._error_body(req.path, fault.status, fault.message)
            for method, pattern, handler in self._routes():
                match = pattern.match(req.path)
                if match and method == req.method:
                    try:
                        return 200, handler(req, *match.groups())
                    except ApiError as e:
                        return e.status, self._error_body(req.path, e.status, e.message)
            return 404, self._error_body(req.path, 404, "Not Found")

    @staticmethod
    def _error_body(path: str, status: int, message: str) -> dict:
        if path.startswith(f"{API}/pipelines/upload"):  # the upload endpoints are plain HTTP handlers
            return {"error_message": message, "error_details": message}
        return {"error": message, "code": _GRPC_CODE.get(status, 2), "message": message, "details": []}

    # -- lists and filters ------------------------------------------------------------------------

    @staticmethod
    def _predicates(req: Recorded) -> list[Callable[[dict], bool]]:
        raw = req.param("filter")
        if not raw:
            return []
        try:
            predicates = json.loads(raw).get("predicates", [])
        except (ValueError, AttributeError):
            raise ApiError(400, f"Invalid filter: {raw}") from None
        tests = []
        for p in predicates:
            key, op = p.get("key"), p.get("operation", "EQUALS")
            op = _OPERATIONS.get(op, op)  # proto JSON allows the enum's name or its number (kfp sends numbers)
            if "stringValue" in p or "string_value" in p:
                value = p.get("stringValue", p.get("string_value"))
            elif "stringValues" in p or "string_values" in p:
                value = (p.get("stringValues") or p.get("string_values") or {}).get("values", [])
            else:
                raise ApiError(400, f"Invalid filter: predicate {p} has no string value")
            ops = {
                "EQUALS": lambda a, b: a == b,
                "NOT_EQUALS": lambda a, b: a != b,
                "IS_SUBSTRING": lambda a, b: b in (a or ""),
                "IN": lambda a, b: a in b,
            }
            if op not in ops:
                raise ApiError(400, f"Invalid filter: operation {op} is not supported by the stand-in")
            tests.append(lambda item, key=key, f=ops[op], value=value: f(item.get(key), value))
        return tests

    def _page(self, req: Recorded, items: list[dict], key: str) -> dict:
        tests = self._predicates(req)
        items = [i for i in items if all(t(i) for t in tests)]
        size = int(req.param("page_size") or 0) or len(items) or 1
        start = int(req.param("page_token") or 0)
        page = items[start:start + size]
        out: dict[str, Any] = {"total_size": len(items)}
        if page:
            out[key] = page
        if start + size < len(items):
            out["next_page_token"] = str(start + size)
        return out

    # -- healthz ----------------------------------------------------------------------------------

    def _healthz(self, req):
        health = {"commit_sha": self.commit_sha, "tag_name": self.tag_name, "multi_user": self.multi_user, "pipeline_store": "database"}
        return {k: v for k, v in health.items() if v is not None}

    # -- multi-user: namespaces, identity and authorization ---------------------------------------

    def _namespace(self, namespace: str | None) -> str:
        """resource_manager.go ReplaceNamespace: kept in multi-user mode, dropped in single-user mode."""
        return (namespace or "") if self.multi_user else ""

    def _identity(self, req: Recorded) -> str:
        """The caller, as IsAuthorized finds it: the user id header, else a bearer token a TokenReview accepts."""
        headers = {k.lower(): v for k, v in req.headers.items()}
        if headers.get("kubeflow-userid"):
            return headers["kubeflow-userid"]
        errors = ["Request header error: there is no user identity header."]
        authorization = headers.get("authorization")
        if authorization is not None:
            if not authorization.startswith("Bearer "):
                errors.append("Header 'Authorization' is incorrectly formatted. Expected prefix 'Bearer '")
            elif authorization[len("Bearer "):] in self.tokens:
                return self.tokens[authorization[len("Bearer "):]]
            else:
                errors.append("Authentication failure: Review.Status.Authenticated is false")
        raise ApiError(401, "Failed to check authorization. User identity is empty in the request header: [" + ", ".join(errors[1:] or errors) + "]")

    def _authorize(self, req: Recorded, namespace: str, verb: str, resource: str, context: str) -> None:
        """IsAuthorized (resource_manager.go): skipped in single-user mode; 401 without an identity, 403
        when the identity may not `verb` `resource` in `namespace`."""
        if not self.multi_user:
            return
        try:
            user = self._identity(req)
        except ApiError as e:
            raise ApiError(e.status, f"{context}: {e.message}") from None
        permitted = namespace in self.access.get(user, set()) or self._role_allows(user, namespace, verb, resource)
        self.authorizations.append((user, namespace, verb, resource, permitted))
        if not permitted:
            raise ApiError(403, f"{context}: User '{user}' is not authorized with reason: no RBAC policy matched "
                                f"(request: namespace={namespace} verb={verb} group=pipelines.kubeflow.org resource={resource})")

    def _require_namespace(self, namespace: str, message: str) -> None:
        if self.multi_user and not namespace:
            raise ApiError(400, message)

    def _authorize_pipeline(self, req: Recorded, pipeline: dict, verb: str) -> None:
        """canAccessPipeline (pipeline_server.go): reading a shared pipeline (no namespace) needs no identity."""
        if pipeline["namespace"]:
            self._authorize(req, pipeline["namespace"], verb, "pipelines", f"Failed to access pipeline {pipeline['pipeline_id']}")

    # -- pipelines --------------------------------------------------------------------------------

    @staticmethod
    def _uploaded_spec(req: Recorded) -> tuple[str, bytes, dict]:
        if "uploadfile" not in req.files:
            raise ApiError(400, "Failed to read pipeline from file")
        filename, content = req.files["uploadfile"]
        try:
            docs = [d for d in yaml.safe_load_all(content) if d is not None]
        except yaml.YAMLError:
            raise ApiError(400, "Failed to read a pipeline spec file") from None
        spec = docs[0] if docs else None
        if not isinstance(spec, dict) or "pipelineInfo" not in spec or "root" not in spec:
            raise ApiError(400, "Failed to read a pipeline spec file")
        platform = {}
        for doc in docs[1:]:
            platform.update(doc)
        return filename, content, ({"pipeline_spec": spec, "platform_spec": platform} if platform else spec)

    def _add_version(self, pipeline_id: str, name: str, description: str, content: bytes, spec: dict) -> dict:
        version = {"pipeline_id": pipeline_id, "pipeline_version_id": _new_id(), "display_name": name, "name": name,
                   "description": description, "created_at": _now(), "pipeline_spec": spec}
        self.versions[version["pipeline_version_id"]] = version
        self.specs[version["pipeline_version_id"]] = content
        return version

    def _upload_pipeline(self, req):
        filename, content, spec = self._uploaded_spec(req)
        namespace = self._namespace(req.param("namespace"))
        if namespace:  # canUploadVersionedPipeline: a shared pipeline (no namespace) is not authorized at all
            try:
                self._authorize(req, namespace, "create", "pipelines", "Authorization Failure")
            except ApiError:
                raise ApiError(400, "Failed to create a pipeline") from None  # the upload server's answer to any authz error
        name = req.param("display_name") or req.param("name") or filename
        if self.pipeline_named(name, namespace) is not None:  # names are unique within a namespace
            raise ApiError(409, "Failed to create a pipeline and a pipeline version")
        pipeline = {"pipeline_id": _new_id(), "display_name": name, "name": req.param("name") or name,
                    "description": req.param("description") or "", "created_at": _now(), "namespace": namespace}
        self.pipelines[pipeline["pipeline_id"]] = pipeline
        # like the real upload server: the pipeline's first version is named after the pipeline
        self._add_version(pipeline["pipeline_id"], name, pipeline["description"], content, spec)
        return pipeline

    def _upload_version(self, req):
        filename, content, spec = self._uploaded_spec(req)
        pipeline_id = req.param("pipelineid")
        if not pipeline_id:
            raise ApiError(400, "Failed to create a pipeline version")
        if pipeline_id not in self.pipelines:
            raise ApiError(400, "Failed to create a pipeline version")  # the real server: 400 for an unknown pipeline id
        namespace = self.pipelines[pipeline_id]["namespace"]  # a version belongs to its pipeline's namespace
        if namespace:
            try:
                self._authorize(req, namespace, "create", "pipelines", "Authorization Failure")
            except ApiError:
                raise ApiError(400, "Failed to create a pipeline version") from None
        name = req.param("display_name") or req.param("name") or filename
        if any(v["display_name"] == name for v in self.versions_of(pipeline_id)):
            raise ApiError(409, "Failed to create a pipeline version")
        return self._add_version(pipeline_id, name, req.param("description") or "", content, spec)

    def _list_pipelines(self, req):
        namespace = self._namespace(req.param("namespace"))
        if not self.multi_user:
            return self._page(req, list(self.pipelines.values()), "pipelines")
        if namespace:  # listPipelines: a namespace's own pipelines, authorized; without one the shared pipelines
            self._authorize(req, namespace, "list", "pipelines", "Failed to list pipelines due to authorization error. "
                                                                 f"Check if you have read permission to namespace {namespace}")
        return self._page(req, [p for p in self.pipelines.values() if p["namespace"] == namespace], "pipelines")

    def _get_pipeline(self, req, pipeline_id):
        if pipeline_id not in self.pipelines:
            raise ApiError(404, f"Pipeline {pipeline_id} not found")
        self._authorize_pipeline(req, self.pipelines[pipeline_id], "get")
        return self.pipelines[pipeline_id]

    def _list_versions(self, req, pipeline_id):
        if pipeline_id not in self.pipelines:
            raise ApiError(404, f"Pipeline {pipeline_id} not found")
        self._authorize_pipeline(req, self.pipelines[pipeline_id], "list")
        return self._page(req, self.versions_of(pipeline_id), "pipeline_versions")

    def _get_version(self, req, pipeline_id, version_id):
        version = self.versions.get(version_id)
        if version is None or version["pipeline_id"] != pipeline_id:
            raise ApiError(404, f"Pipeline version {version_id} not found")
        self._authorize_pipeline(req, self.pipelines[pipeline_id], "get")
        return version

    # -- experiments ------------------------------------------------------------------------------

    def _list_experiments(self, req):
        namespace = self._namespace(req.param("namespace"))
        if self.multi_user:  # listExperiments -> canAccessExperiment
            self._require_namespace(namespace, "List experiments failed: Failed to authorize with API: "
                                               "An experiment cannot have an empty namespace in multi-user mode")
            self._authorize(req, namespace, "list", "experiments", "List experiments failed: Failed to authorize with API")
        items = [e for e in self.experiments.values() if not self.multi_user or e["namespace"] == namespace]
        return self._page(req, items, "experiments")

    def _create_experiment(self, req):
        body = req.body or {}
        name = body.get("display_name")
        if not name:
            raise ApiError(400, "Experiment name is empty. Please specify a valid experiment name")
        namespace = self._namespace(body.get("namespace"))
        if self.multi_user:  # createExperiment -> canAccessExperiment
            self._require_namespace(namespace, "Failed to create a experiment: Failed to authorize the request: "
                                               "An experiment cannot have an empty namespace in multi-user mode")
            self._authorize(req, namespace, "create", "experiments", "Failed to create a experiment: Failed to authorize the request")
        if any(e["display_name"] == name and e["namespace"] == namespace for e in self.experiments.values()):
            raise ApiError(409, f"Failed to create a new experiment: experiment {name!r} already exists")
        experiment = {"experiment_id": _new_id(), "display_name": name, "description": body.get("description") or "",
                      "created_at": _now(), "namespace": namespace, "storage_state": "AVAILABLE"}
        self.experiments[experiment["experiment_id"]] = experiment
        return experiment

    def _get_experiment(self, req, experiment_id):
        if experiment_id not in self.experiments:
            raise ApiError(404, f"Experiment {experiment_id} not found")
        self._authorize(req, self.experiments[experiment_id]["namespace"], "get", "experiments", "Failed to fetch experiment")
        return self.experiments[experiment_id]

    # -- runs and recurring runs ------------------------------------------------------------------

    def _check_source(self, body: dict) -> None:
        if not body.get("experiment_id") or body["experiment_id"] not in self.experiments:
            raise ApiError(404, f"Experiment {body.get('experiment_id')!r} not found")
        reference = body.get("pipeline_version_reference")
        if bool(body.get("pipeline_spec")) == bool(reference):
            raise ApiError(400, "Please specify either a pipeline spec or a pipeline version reference, not both and not neither")
        if reference:
            version = self.versions.get(reference.get("pipeline_version_id"))
            if version is None or version["pipeline_id"] != reference.get("pipeline_id"):
                raise ApiError(404, f"Pipeline version {reference} not found")

    def _experiment_namespace(self, body: dict, what: str) -> str:
        """GetValidExperimentNamespacePair (resource_manager.go) for a new run or recurring run: in multi-user
        mode the experiment id is required and its namespace is the one of the new resource; a namespace
        named in the request must be that one."""
        if not self.multi_user:
            return ""
        context = f"Failed to create a {what} due to invalid experimentId and namespace combination"
        experiment_id = body.get("experiment_id")
        if not experiment_id:
            raise ApiError(400, f"{context}: Experiment id can not be empty in multi-user mode")
        if experiment_id not in self.experiments:
            raise ApiError(404, f"{context}: Failed to fetch namespace for experiment {experiment_id}: Experiment {experiment_id} not found")
        namespace = self.experiments[experiment_id]["namespace"]
        claimed = body.get("namespace") or ""
        if claimed and claimed != namespace:
            raise ApiError(400, f"{context}: Experiment {experiment_id} belongs to namespace '{namespace}' instead of '{claimed}'")
        return namespace

    def _namespace_of_list(self, req: Recorded, what: str) -> str:
        """listRuns / listJobs: the experiment's namespace when filtering by experiment, else the namespace asked for."""
        namespace = self._namespace(req.param("namespace"))
        experiment_id = req.param("experiment_id")
        if experiment_id:
            if experiment_id not in self.experiments:
                raise ApiError(404, f"Failed to list {what} due to error fetching namespace for experiment {experiment_id}")
            namespace = self.experiments[experiment_id]["namespace"]
        return namespace

    def _create_run(self, req):
        body = req.body or {}
        if not body.get("display_name"):
            raise ApiError(400, "The run name is empty. Please specify a valid name")
        namespace = self._experiment_namespace(body, "run")  # run_server.go createRun
        if self.multi_user:
            self._require_namespace(namespace, "A run cannot have an empty namespace in multi-user mode")
            self._authorize(req, namespace, "create", "runs", "Failed to create a new run: Failed to create a run due to "
                                                              f"authorization error. Check if you have write permissions to namespace {namespace}")
        self._check_source(body)
        run = {**body, "run_id": _new_id(), "storage_state": "AVAILABLE", "state": "PENDING",
               "created_at": _now(), "scheduled_at": _now(), "namespace": namespace}
        self.runs[run["run_id"]] = run
        return run

    def _list_runs(self, req):
        namespace = self._namespace_of_list(req, "runs")
        experiment_id = req.param("experiment_id")
        if self.multi_user:  # listRuns -> canAccessRun
            self._require_namespace(namespace, "Failed to list runs: A run cannot have an empty namespace in multi-user mode")
            self._authorize(req, namespace, "list", "runs", "Failed to list runs due to authorization error. "
                                                            f"Check if you have permission to access namespace {namespace}")
        items = [r for r in self.runs.values() if (not experiment_id or r["experiment_id"] == experiment_id)
                 and (not self.multi_user or r["namespace"] == namespace)]
        return self._page(req, items, "runs")

    def _get_run(self, req, run_id):
        if run_id not in self.runs:
            raise ApiError(404, f"Run {run_id} not found")
        self._authorize(req, self.runs[run_id]["namespace"], "get", "runs", f"Failed to access run {run_id}")
        return self.runs[run_id]

    def _create_recurring_run(self, req):
        body = req.body or {}
        if not body.get("display_name"):
            raise ApiError(400, "The recurring run name is empty. Please specify a valid name")
        namespace = self._experiment_namespace(body, "recurring run")  # job_server.go createJob
        if self.multi_user:
            self._require_namespace(namespace, "Failed to create a recurring run: Recurring run cannot have an empty namespace in multi-user mode")
            self._authorize(req, namespace, "create", "jobs", "Failed to create a recurring run: Failed to create a recurring run due to "
                                                              f"authorization error. Check if you have write permission to namespace {namespace}")
        self._check_source(body)
        trigger = body.get("trigger") or {}
        if not (trigger.get("cron_schedule") or {}).get("cron") and not trigger.get("periodic_schedule"):
            raise ApiError(400, "A recurring run needs a trigger: a cron or a periodic schedule")
        recurring = {**body, "recurring_run_id": _new_id(), "created_at": _now(), "updated_at": _now(),
                     "status": "ENABLED" if body.get("mode", "ENABLE") == "ENABLE" else "DISABLED",
                     "max_concurrency": str(body.get("max_concurrency", "1")),  # int64: a string in protojson
                     "namespace": self.experiments[body["experiment_id"]]["namespace"]}
        self.recurring_runs[recurring["recurring_run_id"]] = recurring
        return recurring

    def _list_recurring_runs(self, req):
        namespace = self._namespace_of_list(req, "recurring runs")
        experiment_id = req.param("experiment_id")
        if self.multi_user:  # listJobs -> canAccessJob
            self._require_namespace(namespace, "Failed to list jobs: a recurring run cannot have an empty namespace in multi-user mode")
            self._authorize(req, namespace, "list", "jobs", "Failed to list jobs: Failed to list recurring runs due to authorization "
                                                            f"error. Check if you have permission to access namespace {namespace}")
        items = [r for r in self.recurring_runs.values() if (not experiment_id or r["experiment_id"] == experiment_id)
                 and (not self.multi_user or r["namespace"] == namespace)]
        return self._page(req, items, "recurringRuns")  # the v2beta1 proto field is literally `recurringRuns`

    def _get_recurring_run(self, req, recurring_run_id):
        if recurring_run_id not in self.recurring_runs:
            raise ApiError(404, f"Recurring run {recurring_run_id} not found")
        self._authorize(req, self.recurring_runs[recurring_run_id]["namespace"], "get", "jobs", "Failed to authorize the request")
        return self.recurring_runs[recurring_run_id]

    def _delete_recurring_run(self, req, recurring_run_id):
        """DeleteRecurringRun (server/job_server.go at 2.5.0): deleteJob -> canAccessJob, which in multi-user mode
        looks the job up first (an unknown id is 404 before any authorization), then authorizes `delete` on
        jobs in the job's namespace; single-user mode skips that and ResourceManager.DeleteJob answers 404
        for an unknown id. Both wrap their error in "Failed to disable a recurring run" (sic)."""
        context = "Failed to disable a recurring run"
        if recurring_run_id not in self.recurring_runs:
            if self.multi_user:
                raise ApiError(404, f"{context}: Failed to authorize the request: failed to authorize with the recurring run ID: "
                                    f"ResourceNotFoundError: Job {recurring_run_id} not found")
            raise ApiError(404, f"{context}: Failed to delete recurring run {recurring_run_id}. Check if exists: "
                                f"ResourceNotFoundError: Job {recurring_run_id} not found")
        self._authorize(req, self.recurring_runs[recurring_run_id]["namespace"], "delete", "jobs",
                        f"{context}: Failed to authorize the request")
        del self.recurring_runs[recurring_run_id]
        return {}


class _Handler(BaseHTTPRequestHandler):
    server_state: KfpApiStandIn

    def log_message(self, format, *args):  # keep test output quiet
        pass

    def _serve(self) -> None:
        parts = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        req = Recorded(method=self.command, path=parts.path, query=parse_qs(parts.query, keep_blank_values=True),
                       headers=dict(self.headers.items()), raw=raw, target=self.path)
        status, payload = 200, None
        try:
            _parse_body(req, self.headers.get("Content-Type") or "")
        except ValueError as e:
            req.body = None
            with self.server_state.lock:
                self.server_state.recorded.append(req)
            status, payload = 400, KfpApiStandIn._error_body(req.path, 400, f"Cannot parse the request body: {e}")
        else:
            try:
                status, payload = self.server_state.handle(req)
            except Exception as e:  # a bug in the stand-in: answer 500 rather than hang the client
                status, payload = 500, KfpApiStandIn._error_body(req.path, 500, f"stand-in error: {type(e).__name__}: {e}")
        req.status = status
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_DELETE = do_PATCH = do_PUT = _serve


def _parse_body(req: Recorded, content_type: str) -> None:
    if not req.raw:
        return
    if content_type.startswith("multipart/form-data"):
        message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
            b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + req.raw)
        if not message.is_multipart():
            raise ValueError("not a multipart body")
        for part in message.iter_parts():
            name = part.get_param("name", header="content-disposition")
            content = part.get_payload(decode=True) or b""
            filename = part.get_filename()
            if filename is not None:
                req.files[name] = (filename, content)
            else:
                req.form[name] = content.decode("utf-8", "replace")
        return
    if "json" in content_type or not content_type:
        req.body = json.loads(req.raw)
        return
    raise ValueError(f"unexpected Content-Type {content_type!r}")
