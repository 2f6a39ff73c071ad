"""The predictor against a caller who is not its friend, and the InferenceService that runs it (issue 43, A9-A13).

KServe's model server (kserve 0.21, the serve extra) is served for real where the finding is about what goes over
the wire: one `fedpipe models serve` process on a loopback port serves a small line whose clients include a site
with a non-ASCII name ("Klinik Süd"). What KServe does on its own, and fedpipe changes, is cited from its source
(.venv/lib/python3.11/site-packages/kserve/...):

- A9: protocol/rest/v2_endpoints.py registers `POST /v2/repository/models/{name}/load|unload` for everyone;
  `ModelRepository.load` is `pass` (model_repository.py), so an unload cannot be undone, and `DataPlane.ready`
  returns True whatever the models are (protocol/dataplane.py), so /v2/health/ready stays 200 without a model.
- A10: the endpoints hand the model `dict(request.headers)` (v2_endpoints.py `infer`, v1_endpoints.py `predict`):
  Starlette's header values, decoded as latin-1, so UTF-8 bytes arrive as mojibake.
- A11: `InferRequest.from_bytes` (protocol/infer_type.py) lets numpy's ValueError out of `as_numpy`, which the
  generic handler answers 500 with its text; every handler in errors.py logs `exc_info` (a traceback per refused
  request); rest/server.py adds timing_asgi's middleware (two `kserve.trace` lines per request).
- A12: `Model.__call__` (model.py) calls a plain `predict` on the event loop and awaits a coroutine one.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from services import free_port, start_server, stop_server
from typer.testing import CliRunner

pytest.importorskip("kserve", reason="the serve extra (kserve) is part of the test extra: run scripts/setup.sh --test")

from fedpipe.models.line import ModelLine  # noqa: E402
from fedpipe.serving.predictor import LinePredictor, ServeOptions  # noqa: E402

LINE = "many"
SITES = ["Klinik Süd", "site-0", "site-1", "site-2"]
PIXELS = [0.0, 64.0, 128.0, 255.0]


class _Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.linear(x.flatten(1))


def _line(root: Path, sites: list[str] = SITES) -> ModelLine:
    """An unsigned line, promoted, whose one version has a model per site (each another, so the answer tells which
    answered: the file clients/c<i>.pt2 for SITES[i]) and a global model."""
    import fedpipe.models.export as export
    from fedpipe.models.export import export_model
    from fedpipe.models.line import ModelSpec, VersionRecord
    from fedpipe.store import open_store

    torch.manual_seed(0)
    files, entries = {}, {}
    for i, site in enumerate(sites):
        model = export_model(_Linear().eval(), torch.rand(2, 1, 2, 2) * 255)
        entries[site] = export.ServedFile(f"clients/c{i}.pt2", model.format, model.exporter, i, 1.0)
        files[entries[site].file] = model.data
    glob = export_model(_Linear().eval(), torch.rand(2, 1, 2, 2) * 255)
    files["global.pt2"] = glob.data
    spec = export.ServingSpec("r", "fedavg_ft", "linear", "image", (1, 2, 2), (0.0,), (1.0,), ("a", "b", "c"),
                              export.ServedFile("global.pt2", glob.format, glob.exporter), entries)
    files[export.SPEC_FILE] = spec.to_bytes()
    line = ModelLine(open_store(str(root)), LINE)
    record = VersionRecord(0, "r", ModelSpec("linear", "local", (1, 2, 2), 3, ("a", "b", "c")), "", None, {}, tuple(entries))
    line.promote(line.register(record, files).version, "test")
    return line


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the server's URL, the server, the store's folder): `fedpipe models serve` of `_line`, unsigned and trusted."""
    root = tmp_path_factory.mktemp("hardening")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("FEDPIPE_SIGNING_KEY", raising=False)
        mp.delenv("FEDPIPE_SIGNING_KEY_FILE", raising=False)
        _line(root / "store")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = start_server("fedpipe-serve", [sys.executable, "-m", "fedpipe.cli", "models", "serve", LINE, "--store", str(root / "store"),
                                                "--port", str(port), "--trust-unsigned", "--cache-size", "8"],
                              url, f"/v2/models/{LINE}/ready", root, timeout=120)
        try:
            yield url, server, root / "store"
        finally:
            stop_server(server)


def _call(url: str, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None) -> tuple[int, dict]:
    """One request through http.client, header values sent as the bytes given (a str header would go as latin-1)."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    try:
        connection.putrequest(method, path)
        sent = {"Content-Type": "application/json", **(headers or {})}
        if data is not None:
            sent["Content-Length"] = str(len(data))
        for name, value in sent.items():
            connection.putheader(name, value)
        connection.endheaders(data)
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        connection.close()


def _v2(client: str | None = None) -> dict:
    body: dict = {"inputs": [{"name": "input", "shape": [1, 1, 2, 2], "datatype": "FP32", "data": PIXELS}]}
    if client is not None:
        body["parameters"] = {"client": client}
    return body


def _probabilities(answer: dict) -> list[float]:
    return next(o for o in answer["outputs"] if o["name"] == "probabilities")["data"]


# --- A10: a site's non-ASCII name in the Fedpipe-Client header ---------------------------------------------------


def test_a_utf8_client_header_is_answered_by_that_clients_model(served):
    url, _, _ = served
    infer = f"/v2/models/{LINE}/infer"
    status, by_body = _call(url, "POST", infer, _v2("Klinik Süd"))
    assert status == 200 and by_body["parameters"]["client"] == "Klinik Süd"
    status, by_header = _call(url, "POST", infer, _v2(), {"Fedpipe-Client": "Klinik Süd".encode()})  # curl's bytes
    assert status == 200, by_header
    assert (by_header["parameters"]["model"], by_header["parameters"].get("client")) == ("personalized", "Klinik Süd"), by_header
    assert _probabilities(by_header) == _probabilities(by_body)
    status, v1 = _call(url, "POST", f"/v1/models/{LINE}:predict", {"instances": [[[[0.0, 64.0], [128.0, 255.0]]]]},
                       {"Fedpipe-Client": "Klinik Süd".encode()})
    assert status == 200 and v1["client"] == "Klinik Süd", v1
    # bytes that are not UTF-8 (what Python's http.client sends for a str) are refused, not guessed at
    status, refused = _call(url, "POST", infer, _v2(), {"Fedpipe-Client": "Klinik Süd".encode("latin-1")})
    assert status == 400 and "not UTF-8" in refused["error"] and "parameters" in refused["error"], refused
    # a name with no model of its own gets the global model (--unknown-client global), and the answer says so
    status, other = _call(url, "POST", infer, _v2(), {"Fedpipe-Client": "Klinik Nordstraße".encode()})
    assert status == 200 and other["parameters"] == {"version": 1, "model": "global", "unknown_client": "Klinik Nordstraße"}, other


# --- A11: what an error answer says, and what the log says ---------------------------------------------------------


def _access_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "uvicorn.access" in line]


def test_errors_answer_plainly_and_the_log_has_a_line_per_request(served):
    import time

    url, server, store = served
    infer = f"/v2/models/{LINE}/infer"
    before = server.log_path.read_text(errors="replace")
    header = json.dumps({"inputs": [{"name": "input", "shape": [1, 1, 2, 2], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 5}}]}).encode()
    binary = _call(url, "POST", infer, header + b"abcde",  # 5 bytes cannot hold 4 FP32 values
                   {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))})
    assert binary[0] == 400 and "binary_data_size" in binary[1]["error"], binary
    assert "buffer size" not in binary[1]["error"] and "ValueError" not in binary[1]["error"]
    assert _call(url, "POST", infer, _v2("site-0"))[0] == 200
    assert _call(url, "POST", infer, {"inputs": [{"name": "input", "shape": [1, 1, 2, 2], "datatype": "FP32", "data": [1.0]}]})[0] == 400
    assert _call(url, "POST", infer, _v2())[0] == 200
    # a store whose file for site-2 was swapped after the server started: the server's fault, not the caller's
    (store / "models" / LINE / "versions" / "1" / "clients" / "c3.pt2").write_bytes((store / "models" / LINE / "versions" / "1" / "clients" / "c2.pt2").read_bytes())
    status, corrupt = _call(url, "POST", infer, _v2("site-2"))
    assert status == 500, corrupt
    assert str(store) not in corrupt["error"] and "sha256" not in corrupt["error"] and not any(len(w) >= 40 for w in corrupt["error"].split())
    error_id = corrupt["error"].split("error ")[1].split(";")[0]
    requests = 5
    deadline = time.monotonic() + 20
    while len(_access_lines(server.log_path.read_text(errors="replace"))) - len(_access_lines(before)) < requests and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    new = server.log_path.read_text(errors="replace")[len(before):].splitlines()
    assert len(_access_lines("\n".join(new))) == requests, new
    others = [line for line in new if "uvicorn.access" not in line]
    assert len(others) == 1 and error_id in others[0] and "c3.pt2" in others[0] and "sha256" in others[0], new  # the 500's cause
    assert not [line for line in new if "Traceback" in line or "DeprecationWarning" in line or "kserve.trace" in line], new
    assert "DeprecationWarning" not in server.log_path.read_text(errors="replace")


# --- A9: the model repository extension, and readiness ------------------------------------------------------------


def test_readiness_follows_the_model(tmp_path, monkeypatch):
    """In-process, through KServe's routes (httpx over ASGI): the model gone from the registry (what KServe's unload
    and its ModelServer.stop do: model_repository.py `unload`), or not ready, and /v2/health/ready answers 503."""
    import httpx

    from fedpipe.serving.kserve_model import line_server

    monkeypatch.delenv("FEDPIPE_SIGNING_KEY", raising=False)
    server = line_server(LinePredictor(_line(tmp_path), None, ServeOptions(trust_unsigned=True)), LINE)

    async def probe() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://predictor") as client:
            statuses = [(await client.get("/v2/health/ready")).status_code]
            model = server.dataplane.model_registry.get_model(LINE)
            model.ready = False
            statuses.append((await client.get("/v2/health/ready")).status_code)
            model.ready = True
            server.dataplane.model_registry.unload(LINE)
            statuses.append((await client.get("/v2/health/ready")).status_code)
            statuses.append((await client.post(f"/v2/models/{LINE}/infer", json=_v2())).status_code)
            return statuses

    assert asyncio.run(probe()) == [200, 503, 503, 404]


def test_nobody_can_unload_the_served_model(served):
    """Last against the module's server: on a server that lets it, the unload takes the model away for good."""
    url, _, _ = served
    status, unloaded = _call(url, "POST", f"/v2/repository/models/{LINE}/unload")
    infer_status = _call(url, "POST", f"/v2/models/{LINE}/infer", _v2("site-0"))[0]
    ready_status = _call(url, "GET", "/v2/health/ready")[0]
    assert (ready_status == 200) == (infer_status == 200), (ready_status, infer_status)  # readiness says whether it answers
    assert status == 403 and "model repository extension is off" in unloaded["error"], unloaded
    assert infer_status == 200 and ready_status == 200
    status, loaded = _call(url, "POST", f"/v2/repository/models/{LINE}/load")
    assert status == 403 and "fedpipe models promote" in loaded["error"], loaded
    assert "model_repository_extension" not in _call(url, "GET", "/v2")[1]["extensions"]


# --- A12: a cache miss holds up only the requests for its own model ----------------------------------------------


def _slow_loads(predictor: LinePredictor, monkeypatch, release: threading.Event, timeout: float):
    """Replace the predictor's loads by ones that wait for `release` (at most `timeout` s); returns (loads begun per
    file, the most under way at once, the event set once two are under way at once)."""
    real, guard = predictor._load, threading.Lock()
    begun: dict[str, int] = {}
    active, most, two = [0], [0], threading.Event()

    def load(served, version):
        with guard:
            begun[served.file] = begun.get(served.file, 0) + 1
            active[0] += 1
            most[0] = max(most[0], active[0])
            if active[0] >= 2:
                two.set()
        try:
            release.wait(timeout)
            return real(served, version)
        finally:
            with guard:
                active[0] -= 1

    monkeypatch.setattr(predictor, "_load", load)
    return begun, most, two


def test_a_cache_miss_loads_outside_the_lock_and_once_per_client(tmp_path, monkeypatch):
    monkeypatch.delenv("FEDPIPE_SIGNING_KEY", raising=False)
    predictor = LinePredictor(_line(tmp_path), None, ServeOptions(trust_unsigned=True, cache_size=2))
    x = predictor.rows(PIXELS, [1, 1, 2, 2], "FP32")
    predictor.predict("site-0", x)  # cached
    release = threading.Event()
    begun, most, two = _slow_loads(predictor, monkeypatch, release, timeout=10)
    answers: dict[str, object] = {}

    def ask(tag: str, client: str) -> threading.Thread:
        thread = threading.Thread(target=lambda: answers.__setitem__(tag, predictor.predict(client, x)), daemon=True)
        thread.start()
        return thread

    threads = [ask("a1", "site-1"), ask("a2", "site-1"), ask("a3", "site-1"), ask("b", "site-2")]
    try:
        assert two.wait(5), "the second client's load waited for the first one's: the loads run under one lock"
        ask("cached", "site-0").join(5)
        assert "cached" in answers and not release.is_set(), "a cached client's request waited for another client's load"
    finally:
        release.set()
        for thread in threads:
            thread.join(30)
    assert begun == {"clients/c2.pt2": 1, "clients/c3.pt2": 1}, begun  # three requests for site-1, one load
    assert most[0] == 2 and predictor.cache.loads == 3 and len(predictor.cache) == 2
    assert all(np.array_equal(answers[t].probabilities, answers["a1"].probabilities) for t in ("a2", "a3"))


def test_a_failed_load_fails_the_requests_waiting_for_it_and_is_tried_again():
    from fedpipe.serving.predictor import ModelCache

    cache, release, calls = ModelCache(2), threading.Event(), []

    def failing():
        calls.append("load")
        release.wait(5)
        raise OSError("the store is down")

    errors = []

    def ask():
        try:
            cache.get("k", failing)
        except OSError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for thread in threads:
        thread.start()
    for _ in range(1000):  # until the two others wait for the load under way (its future's condition)
        pending = cache._loading.get("k")
        if pending is not None and len(pending._condition._waiters) == 2:
            break
        threading.Event().wait(0.01)
    release.set()
    for thread in threads:
        thread.join(10)
    assert errors == ["the store is down"] * 3 and calls == ["load"] and len(cache) == 0
    assert cache.get("k", lambda: "model") == "model" and cache.loads == 1


def test_kserves_model_answers_a_cached_client_while_another_loads(tmp_path, monkeypatch):
    """Through KServe's own dispatch (`Model.__call__`, as its data plane calls it): a request for a cached client is
    answered while another client's model is being loaded."""
    from kserve.protocol.infer_type import InferInput, InferRequest

    from fedpipe.serving.kserve_model import LineModel

    monkeypatch.delenv("FEDPIPE_SIGNING_KEY", raising=False)
    predictor = LinePredictor(_line(tmp_path), None, ServeOptions(trust_unsigned=True))
    model = LineModel(LINE, predictor)
    predictor.predict("site-0", predictor.rows(PIXELS, [1, 1, 2, 2], "FP32"))
    release, order = threading.Event(), []
    begun, _, _ = _slow_loads(predictor, monkeypatch, release, timeout=5)

    def request(client: str) -> InferRequest:
        return InferRequest(LINE, [InferInput("input", [1, 1, 2, 2], "FP32", data=PIXELS)], parameters={"client": client})

    async def main():
        miss = asyncio.ensure_future(model(request("site-1"), headers={}))
        for _ in range(500):
            if begun:
                break
            await asyncio.sleep(0.01)
        await model(request("site-0"), headers={})
        order.append("cached answered" if not miss.done() else "cached answered after the other client's load")
        release.set()
        await miss

    asyncio.run(main())
    assert order == ["cached answered"] and begun == {"clients/c2.pt2": 1}


# --- A13: `models deploy` without the store, the image pulled as its name says; `models serve --help` ------------


def test_deploy_writes_the_inference_service_without_reading_the_store(monkeypatch):
    import yaml

    import fedpipe.store
    from fedpipe.cli import app
    from fedpipe.errors import StoreError

    sys.path.insert(0, str(Path(__file__).resolve().parent / "deploy"))
    from deploytools import crd_schema_problems

    schemas = sorted((Path(__file__).resolve().parent / "deploy" / "schemas").glob("serving.kserve.io_inferenceservices.*.yaml"))
    opened = []

    def no_store(url, *args, **kwargs):  # a laptop with the cluster's kubeconfig but not its bucket's credentials
        opened.append(url)
        raise StoreError(f"{url}: access denied")

    monkeypatch.setattr(fedpipe.store, "open_store", no_store)
    runner = CliRunner()

    def deploy(*args: str) -> dict:
        done = runner.invoke(app, ["models", "deploy", *args, "--store", "s3://bucket/fedpipe", "--signing-secret", "fedpipe-signing"])
        assert done.exit_code == 0, done.output
        doc = yaml.safe_load(done.output)
        assert all(crd_schema_problems(schema, doc) == [] for schema in schemas), [crd_schema_problems(s, doc) for s in schemas]
        return doc

    followed = deploy("sites", "--namespace", "team-a")
    container = followed["spec"]["predictor"]["containers"][0]
    assert container["args"][:5] == ["models", "serve", "sites", "--store", "s3://bucket/fedpipe"] and "--wait-for-promotion" in container["args"]
    assert "fedpipe.io/deployed-version" not in followed["metadata"]["annotations"]
    assert container["imagePullPolicy"] == "Always"  # the default image is named by a tag, which can move
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": 8080}
    pinned = deploy("sites@3", "--storage", "s3")
    container = pinned["spec"]["predictor"]["containers"][0]
    assert {"name": "STORAGE_URI", "value": "s3://bucket/fedpipe/models/sites/versions/3/"} in container["env"]
    assert container["args"][2] == "sites@3" and pinned["metadata"]["name"] == "sites" and pinned["metadata"]["labels"]["fedpipe.io/model-line"] == "sites"
    digest = "ghcr.io/fedpipe/fedpipe@sha256:" + "ab" * 32
    assert deploy("sites", "--image", digest)["spec"]["predictor"]["containers"][0]["imagePullPolicy"] == "IfNotPresent"
    assert deploy("sites", "--image-pull-policy", "Never")["spec"]["predictor"]["containers"][0]["imagePullPolicy"] == "Never"
    assert opened == []
    # a pinned deployment that names no version reads the promoted one: then the store is needed, and the error says how not to
    refused = runner.invoke(app, ["models", "deploy", "sites", "--storage", "s3", "--store", "s3://bucket/fedpipe", "--trust-unsigned"])
    assert refused.exit_code == 2 and "access denied" in refused.output and "sites@VERSION" in refused.output, refused.output
    assert opened == ["s3://bucket/fedpipe"]


def test_serve_help_names_the_serve_extra():
    from fedpipe.cli import app

    done = CliRunner().invoke(app, ["models", "serve", "--help"])
    assert done.exit_code == 0 and "pip install 'fedpipe[serve]'" in " ".join(done.output.split()), done.output
