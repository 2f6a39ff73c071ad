"""The InferenceService that serves a model line, from `fedpipe models deploy` and from the chart (`serving.enabled`),
validated against KServe's InferenceService CRD schema at v0.16.0 (Kubeflow 26.03) and v0.18.0 (26.03.1), vendored
in tests/deploy/schemas/ (see the README there): the schema closed (`deploytools.crd_schema_problems`), so a
misspelt field fails here where the API server would silently drop it. The NetworkPolicy the chart adds for the
predictor goes through kubernetes-validate."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from deploytools import crd_schema_problems, only
from typer.testing import CliRunner

from fedpipe.serving.inference_service import ServingDeployment, inference_service

SCHEMAS = Path(__file__).resolve().parent / "schemas"
KSERVE = {version: SCHEMAS / f"serving.kserve.io_inferenceservices.v1beta1.kserve-{version}.yaml" for version in ("v0.16.0", "v0.18.0")}
SERVING_ON = ["--set", "serving.enabled=true"]


def _problems(doc: dict) -> dict[str, list[str]]:
    """Per KServe version, what its CRD schema refuses in `doc` (empty lists: valid at both)."""
    assert doc["apiVersion"] == "serving.kserve.io/v1beta1" and doc["kind"] == "InferenceService"
    return {version: crd_schema_problems(path, doc) for version, path in KSERVE.items()}


def _valid(doc: dict) -> None:
    problems = _problems(doc)
    assert problems == {v: [] for v in KSERVE}, problems
    container = doc["spec"]["predictor"]["containers"][0]
    assert container["name"] == "kserve-container" and container["ports"] == [{"containerPort": 8080, "protocol": "TCP"}]


@pytest.mark.parametrize("storage", ["store", "s3", "model-registry"])
def test_the_deployed_inference_service_is_valid_at_both_kserve_versions(storage):
    doc = inference_service(ServingDeployment("sites", 3, "s3://mlpipeline/fedpipe", "ghcr.io/fedpipe/fedpipe:0.1.0", namespace="team-a",
                                              storage=storage, signing_secret="fedpipe-signing"))
    _valid(doc)
    container = doc["spec"]["predictor"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["FEDPIPE_SIGNING_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "fedpipe-signing", "key": "key"}}
    if storage == "store":  # the store itself, the promoted version followed
        assert container["args"][:5] == ["models", "serve", "sites", "--store", "s3://mlpipeline/fedpipe"] and "STORAGE_URI" not in env
    else:  # pinned, downloaded by KServe's storage initializer into /mnt/models
        uri = "s3://mlpipeline/fedpipe/models/sites/versions/3/" if storage == "s3" else "model-registry://sites/3"
        assert env["STORAGE_URI"]["value"] == uri and container["args"][:5] == ["models", "serve", "sites@3", "--folder", "/mnt/models"]
        assert "AWS_SECRET_ACCESS_KEY" not in env


@pytest.mark.parametrize("break_it", ["misspelt", "wrong type", "unknown predictor field"])
def test_a_wrong_field_fails_the_schema_check(break_it):
    doc = inference_service(ServingDeployment("sites", 1, "s3://b/p", "img:1", trust_unsigned=True))
    broken = copy.deepcopy(doc)
    predictor = broken["spec"]["predictor"]
    if break_it == "misspelt":
        predictor["containers"][0]["imagePulPolicy"] = "Always"
    elif break_it == "wrong type":
        predictor["maxReplicas"] = "one"
    else:
        predictor["replicas"] = 1
    problems = _problems(broken)
    assert all(problems[v] for v in KSERVE), problems
    _valid(doc)


def test_the_charts_inference_service_is_valid_and_the_same_as_deploys(render_chart, validate_k8s):
    docs = render_chart(*SERVING_ON, "--set", "networkPolicy.enabled=true", "--set", "networkPolicy.apiServer.cidrs={172.18.0.2/32}",
                        "--set", "kubeflow.namespace=team-a")
    isvc = only(docs, "InferenceService")
    _valid(isvc)
    line = isvc["metadata"]["labels"]["fedpipe.io/model-line"]
    same = inference_service(ServingDeployment(line, 1, "s3://mlpipeline/fedpipe", isvc["spec"]["predictor"]["containers"][0]["image"],
                                               signing_secret="fedpipe-signing"))
    chart_c, cli_c = isvc["spec"]["predictor"]["containers"][0], same["spec"]["predictor"]["containers"][0]
    for key in ("name", "command", "args", "env", "ports", "readinessProbe", "volumeMounts", "securityContext", "resources"):
        assert chart_c[key] == cli_c[key], key
    assert isvc["metadata"]["name"] == same["metadata"]["name"] and isvc["metadata"]["namespace"] == "team-a"
    assert isvc["spec"]["predictor"]["securityContext"] == same["spec"]["predictor"]["securityContext"]
    policy = next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("serving-egress"))
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= isvc["spec"]["predictor"]["labels"].items()
    validate_k8s([policy])


def test_the_chart_serves_nothing_by_default_and_trusts_unsigned_only_with_signing_off(render_chart):
    assert not [d for d in render_chart() if d["kind"] == "InferenceService"]
    unsigned = only(render_chart(*SERVING_ON, "--set", "signing.enabled=false"), "InferenceService")
    container = unsigned["spec"]["predictor"]["containers"][0]
    assert "--trust-unsigned" in container["args"] and "FEDPIPE_SIGNING_KEY" not in {e["name"] for e in container["env"]}
    _valid(unsigned)


@pytest.mark.services
def test_fedpipe_models_deploy_writes_it_for_the_promoted_version(s3_env, raw_client, tmp_path, monkeypatch):
    from fedpipe.cli import app
    from fedpipe.models.line import ModelLine, ModelSpec, VersionRecord
    from fedpipe.store import open_store

    monkeypatch.delenv("FEDPIPE_SIGNING_KEY", raising=False)
    if not raw_client.bucket_exists("serving"):
        raw_client.make_bucket("serving")
    line = ModelLine(open_store("s3://serving/fedpipe"), "sites")
    record = VersionRecord(0, "r", ModelSpec("m", "fedper", (1, 8, 8), 10, tuple("0123456789")), "", None, {}, ())
    for _ in range(2):
        line.register(record, {"spec.json": b"{}"})
    line.promote(2, "test")
    runner = CliRunner()
    done = runner.invoke(app, ["models", "deploy", "sites", "--store", "s3://serving/fedpipe", "--trust-unsigned", "--storage", "model-registry",
                               "--namespace", "team-a", "--cpu", "1,2", "--memory", "2Gi,6Gi"])
    assert done.exit_code == 0, done.output
    doc = yaml.safe_load(done.output)
    _valid(doc)
    container = doc["spec"]["predictor"]["containers"][0]
    assert {"name": "STORAGE_URI", "value": "model-registry://sites/2"} in container["env"] and "sites@2" in container["args"]
    assert container["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "2", "memory": "6Gi"}}
    named = runner.invoke(app, ["models", "deploy", "sites", "--store", "s3://serving/fedpipe", "--trust-unsigned", "--storage", "model-registry",
                                "--hub-model", "digit-sites"])
    assert {"name": "STORAGE_URI", "value": "model-registry://digit-sites/2"} in yaml.safe_load(named.output)["spec"]["predictor"]["containers"][0]["env"]
    refused = runner.invoke(app, ["models", "deploy", "sites", "--store", "s3://serving/fedpipe"])
    assert refused.exit_code == 2 and "--signing-secret" in refused.output


class _InferenceServiceApi:
    """A stand-in of the Kubernetes API server for one resource type, InferenceServices, for `--apply` (NOT Kubernetes:
    nothing reconciles). What it enforces is the API server's own: a create of a taken name is 409 AlreadyExists; a
    replace must carry the stored metadata.resourceVersion (else 409 Conflict) and bumps it; an object the CRD's schema
    refuses (KServe v0.18.0's, closed as above) is 422 Invalid, answered as Status objects the client parses."""

    PATH = "/apis/serving.kserve.io/v1beta1/namespaces/"

    def __init__(self):
        import http.server
        import json
        import threading

        self.objects: dict[tuple[str, str], dict] = {}
        self.calls: list[str] = []
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self):
                rest = self.path.split("?")[0].removeprefix(stand_in.PATH).split("/")
                stand_in.calls.append(f"{self.command} {self.path}")
                return (rest[0], rest[2] if len(rest) > 2 else None) if len(rest) >= 2 and rest[1] == "inferenceservices" else (None, None)

            def do_GET(self):
                ns, name = self._route()
                found = stand_in.objects.get((ns, name))
                self._answer(200, found) if found else self._answer(404, _status(404, "NotFound", f"{name} not found"))

            def do_POST(self):
                ns, _ = self._route()
                doc = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                key = (ns, doc["metadata"]["name"])
                if key in stand_in.objects:
                    return self._answer(409, _status(409, "AlreadyExists", "already exists"))
                if problems := crd_schema_problems(KSERVE["v0.18.0"], doc):
                    return self._answer(422, _status(422, "Invalid", "; ".join(problems)))
                doc["metadata"]["resourceVersion"] = "1"
                stand_in.objects[key] = doc
                self._answer(201, doc)

            def do_PUT(self):
                ns, name = self._route()
                doc = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                current = stand_in.objects.get((ns, name))
                if current is None:
                    return self._answer(404, _status(404, "NotFound", f"{name} not found"))
                if doc["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
                    return self._answer(409, _status(409, "Conflict", "the object has been modified"))
                if problems := crd_schema_problems(KSERVE["v0.18.0"], {**doc, "metadata": {}}):
                    return self._answer(422, _status(422, "Invalid", "; ".join(problems)))
                doc["metadata"]["resourceVersion"] = str(int(current["metadata"]["resourceVersion"]) + 1)
                stand_in.objects[(ns, name)] = doc
                self._answer(200, doc)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def kubeconfig(self, folder: Path) -> Path:
        path = folder / "kubeconfig"
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "standin",
            "clusters": [{"name": "standin", "cluster": {"server": f"http://127.0.0.1:{self.server.server_address[1]}"}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "u", "namespace": "team-a"}}]}))
        return path


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "reason": reason, "code": code}


def test_apply_creates_the_inference_service_then_replaces_it(tmp_path, monkeypatch):
    from fedpipe.errors import FedpipeError
    from fedpipe.serving.inference_service import apply

    api = _InferenceServiceApi()
    try:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path)))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        first = inference_service(ServingDeployment("sites", 1, "s3://b/p", "img:1", storage="model-registry", trust_unsigned=True))
        assert apply(first, "team-a") == "created InferenceService team-a/sites"
        second = inference_service(ServingDeployment("sites", 2, "s3://b/p", "img:1", storage="model-registry", trust_unsigned=True))
        assert apply(second, "team-a") == "replaced InferenceService team-a/sites"
        stored = api.objects[("team-a", "sites")]
        assert stored["metadata"]["resourceVersion"] == "2" and stored["metadata"]["annotations"]["fedpipe.io/deployed-version"] == "2"
        assert {"name": "STORAGE_URI", "value": "model-registry://sites/2"} in stored["spec"]["predictor"]["containers"][0]["env"]
        wrong = copy.deepcopy(second)
        wrong["spec"]["predictor"]["maxReplicas"] = "two"
        with pytest.raises(FedpipeError, match="422.*maxReplicas"):
            apply(wrong, "team-a")
    finally:
        api.server.shutdown()
