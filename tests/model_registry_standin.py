"""A stand-in of Kubeflow Model Registry's REST server (Kubeflow Hub), on loopback, for tests only.

It is NOT Kubeflow Model Registry: no database, no MLMD, no kube-rbac-proxy. It answers the operations of
the vendored subset of the registry's OpenAPI document (tests/deploy/schemas/model-registry.v0.3.7.openapi.yaml,
from kubeflow/model-registry at tag v0.3.7, the release Kubeflow 26.03 ships) and enforces, operation by
operation, what the real server does with a request, each rule from the Go source at that tag:

- the route and method must be one the document defines (internal/server/openapi/routers.go: chi, 404/405);
- every call carries `Authorization: Bearer <token>` (the document's only security scheme, `Bearer`; in a
  cluster the registry's kube-rbac-proxy or Istio checks it): 401 without it;
- a JSON body is decoded strictly (api_model_registry_service.go: ``d.DisallowUnknownFields()``): an unknown
  or mistyped field is 400; inside a oneOf (``Artifact``, ``MetadataValue``: pkg/openapi/model_*.go
  ``UnmarshalJSON``) the discriminator picks the type and the value is decoded with plain ``json.Unmarshal``,
  so unknown fields there pass but a wrong or missing discriminator, a mistyped or missing required
  field is 400; a required field missing at the top (``Assert*Required``) is 422;
- names are unique where the server says so (internal/core: ``api.ErrConflict`` -> 409): a RegisteredModel's
  name, a ModelVersion's name within its model, an artifact's name within its version; a parent that does
  not exist is 404;
- every answer it gives is checked against the document's response schema (a stand-in that answered what
  the real one cannot would prove nothing): a mismatch is recorded in ``errors`` and fails the test.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import jsonschema
import yaml

SPEC_PATH = Path(__file__).parent / "deploy" / "schemas" / "model-registry.v0.3.7.openapi.yaml"
SPEC = yaml.safe_load(SPEC_PATH.read_text())
COMPONENTS = SPEC["components"]


def _ref(ref: str) -> dict:
    _, _, kind, name = ref.split("/")
    return COMPONENTS[kind][name]


def to_json_schema(schema: dict, closed: bool = True) -> dict:
    """An OpenAPI 3.0 schema as a JSON Schema: $refs inlined, allOf flattened into one object, objects
    closed (`closed`: decoded strictly) and a discriminated oneOf made a oneOf whose variants each pin
    the discriminator (decoded leniently below it, as the Go models' UnmarshalJSON does)."""
    if "$ref" in schema:
        return to_json_schema(_ref(schema["$ref"]), closed)
    if "oneOf" in schema:
        disc = schema.get("discriminator", {})
        variants = []
        for key, target in disc.get("mapping", {}).items():
            variant = to_json_schema({"$ref": target}, closed=False)
            variant["properties"][disc["propertyName"]] = {"const": key}
            variant["required"] = sorted(set(variant.get("required", [])) | {disc["propertyName"]})
            variants.append(variant)
        return {"oneOf": variants}
    if "allOf" in schema:
        merged = {"type": "object", "properties": {}, "required": []}
        for part in [*schema["allOf"], {k: v for k, v in schema.items() if k != "allOf"}]:
            flat = to_json_schema(part, closed)
            merged["properties"].update(flat.get("properties", {}))
            merged["required"] += flat.get("required", [])
        merged["required"] = sorted(set(merged["required"]))
        if closed:
            merged["additionalProperties"] = False
        return merged
    out = {k: v for k, v in schema.items() if k in ("type", "enum", "format", "required", "default")}
    if "properties" in schema:
        out["properties"] = {k: to_json_schema(v, closed) for k, v in schema["properties"].items()}
        if closed:
            out["additionalProperties"] = False
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = to_json_schema(schema["additionalProperties"], closed)
    if "items" in schema:
        out["items"] = to_json_schema(schema["items"], closed)
    return out


def _routes() -> list[tuple[str, re.Pattern, dict]]:
    routes = []
    for path, item in SPEC["paths"].items():
        pattern = re.compile("^" + re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", path) + "$")
        for method, op in item.items():
            if method in ("get", "post", "patch", "put", "delete"):
                params = [p if "$ref" not in p else _ref(p["$ref"]) for p in item.get("parameters", []) + op.get("parameters", [])]
                routes.append((method.upper(), pattern, {**op, "parameters": params}))
    return routes


ROUTES = _routes()


class Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class ModelRegistryStandIn:
    """`with ModelRegistryStandIn(token) as hub:` serves on http://127.0.0.1:<port>; `hub.models`,
    `hub.versions`, `hub.artifacts` hold what was registered, `hub.errors` what it answered wrongly,
    `hub.requests` every (method, path, status); `hub.fail_next(n, status)` answers the next n calls so."""

    def __init__(self, token: str):
        self.token = token
        self.models: dict[str, dict] = {}
        self.versions: dict[str, dict] = {}
        self.artifacts: dict[str, dict] = {}
        self.errors: list[str] = []
        self.requests: list[tuple[str, str, int]] = []
        self._failures: list[int] = []
        self._ids = 0
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> ModelRegistryStandIn:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fail_next(self, n: int, status: int = 503) -> None:
        self._failures += [status] * n

    # -- the operations ---------------------------------------------------------------------------
    def _new(self, body: dict, **extra) -> dict:
        self._ids += 1
        now = str(int(time.time() * 1000))
        return {**copy.deepcopy(body), **extra, "id": str(self._ids), "createTimeSinceEpoch": now, "lastUpdateTimeSinceEpoch": now}

    def _find(self, table: dict, q: dict, parent_key: str | None) -> dict:
        name, parent = q.get("name"), q.get("parentResourceId")
        if not name and not q.get("externalId"):
            raise Refused(400, "invalid parameters: name or externalId required")
        if parent_key and name and not parent:
            raise Refused(400, "invalid parameters: parentResourceId required with name")
        for obj in table.values():
            if (not name or obj.get("name") == name) and (not parent_key or not parent or obj.get(parent_key) == parent) and (
                    not q.get("externalId") or obj.get("externalId") == q["externalId"]):
                return obj
        raise Refused(404, f"no entity found for {q}")

    def operate(self, op: str, params: dict, q: dict, body) -> tuple[int, dict]:
        if op == "getRegisteredModels":
            items = list(self.models.values())[: int(q.get("pageSize", "100"))]
            return 200, {"items": items, "nextPageToken": "", "pageSize": len(items), "size": len(items)}
        if op == "findRegisteredModel":
            return 200, self._find(self.models, q, None)
        if op == "createRegisteredModel":
            if any(m["name"] == body["name"] for m in self.models.values()):
                raise Refused(409, f"registered model with name {body['name']} already exists")
            model = self._new(body, state=body.get("state", "LIVE"))
            self.models[model["id"]] = model
            return 201, model
        if op == "findModelVersion":
            return 200, self._find(self.versions, q, "registeredModelId")
        if op == "createModelVersion":
            if body["registeredModelId"] not in self.models:
                raise Refused(404, f"no registered model found for id {body['registeredModelId']}")
            if any(v["name"] == body["name"] and v["registeredModelId"] == body["registeredModelId"] for v in self.versions.values()):
                raise Refused(409, f"model version with name {body['name']} already exists")
            version = self._new(body, state=body.get("state", "LIVE"))
            self.versions[version["id"]] = version
            return 201, version
        if op == "findModelArtifact":
            return 200, self._public(self._find(self.artifacts, q, "modelVersionId"))
        if op in ("upsertModelVersionArtifact", "getModelVersionArtifacts"):
            version = params["modelversionId"]
            if version not in self.versions:
                raise Refused(404, f"no model version found for id {version}")
            if op == "getModelVersionArtifacts":
                items = [a for a in self.artifacts.values() if a["modelVersionId"] == version]
                return 200, {"items": [self._public(a) for a in items], "nextPageToken": "", "pageSize": len(items), "size": len(items)}
            if body.get("id"):
                raise Refused(400, "updating an artifact is not in this stand-in")
            if any(a.get("name") == body.get("name") and a["modelVersionId"] == version for a in self.artifacts.values()):
                raise Refused(409, f"model artifact with name {body.get('name')} already exists")
            artifact = self._new(body, modelVersionId=version)
            self.artifacts[artifact["id"]] = artifact
            return 201, self._public(artifact)
        raise Refused(501, f"{op} is in the document but not in this stand-in")

    @staticmethod
    def _public(artifact: dict) -> dict:
        return {k: v for k, v in artifact.items() if k != "modelVersionId"}

    # -- HTTP --------------------------------------------------------------------------------------
    def _handler(self):
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                standin.requests.append((self.command, self.path, status))

            def _serve(self) -> None:
                try:
                    status, body, op = standin._dispatch(self.command, self.path, self.headers, self._body())
                except Refused as e:
                    status, body, op = e.status, {"code": str(e.status), "message": e.message}, None
                standin._check_answer(op, status, body)
                self._answer(status, body)

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            do_GET = do_POST = do_PATCH = _serve

        return Handler

    def _dispatch(self, method: str, target: str, headers, raw: bytes) -> tuple[int, dict, dict]:
        parts = urlsplit(target)
        matches = [(m, p.match(parts.path), op) for m, p, op in ROUTES if p.match(parts.path)]
        if not matches:
            raise Refused(404, f"404 page not found: {parts.path}")
        found = [(match, op) for m, match, op in matches if m == method]
        if not found:
            raise Refused(405, f"method {method} not allowed on {parts.path}")
        match, op = found[0]
        if headers.get("Authorization", "") != f"Bearer {self.token}":
            raise Refused(401, "missing or wrong bearer token")
        if self._failures:
            raise Refused(self._failures.pop(0), "injected failure")
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        for p in op["parameters"]:
            if p["in"] == "query" and p.get("required") and p["name"] not in query:
                raise Refused(400, f"required parameter {p['name']} is missing")
        body = None
        if "requestBody" in op:
            body = self._decode(op, raw)
        with self._lock:
            status, answer = self.operate(op["operationId"], match.groupdict(), query, body)
        return status, answer, op

    @staticmethod
    def _decode(op: dict, raw: bytes):
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise Refused(400, f"invalid JSON: {e}") from None
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        top = to_json_schema(schema, closed=True)
        errors = sorted(jsonschema.Draft7Validator(top).iter_errors(body), key=lambda e: list(e.path))
        if errors:
            e = errors[0]
            # Assert*Required (a required field of the body itself is missing): 422; the decoder's errors: 400
            status = 422 if e.validator == "required" and not e.path else 400
            raise Refused(status, f"{'/'.join(map(str, e.path)) or 'body'}: {e.message}")
        return body

    def _check_answer(self, op: dict | None, status: int, body: dict) -> None:
        if op is None:
            return
        response = op["responses"].get(str(status))
        if response is None:
            self.errors.append(f"{op['operationId']} answered {status}, which the document does not list")
            return
        if "$ref" in response:
            response = _ref(response["$ref"])
        schema = to_json_schema(response["content"]["application/json"]["schema"], closed=True)
        for e in jsonschema.Draft7Validator(schema).iter_errors(body):
            self.errors.append(f"{op['operationId']} {status}: {'/'.join(map(str, e.path))}: {e.message}")
