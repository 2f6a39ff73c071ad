"""Serving a model line (fedpipe.serving): the KServe custom predictor served for real.

Every method's tiny run on the real 8x8 digits is exported and registered as one version of a SIGNED line; one
`fedpipe models serve` process (KServe's ModelServer, uvicorn, on a loopback port) follows the promoted pointer
while the test promotes each version in turn, and a client's prediction through the v2 endpoint must equal
`fedpipe predict --client` on the same pixels (as PNG files). Then the endpoint's refusals (unknown client, bad
shape, bad datatype, an oversize body): a 4xx JSON error, no traceback; and the model cache, bounded.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from runs import small_run, train_all
from services import free_port, start_server, stop_server
from typer.testing import CliRunner

pytest.importorskip("kserve", reason="the serve extra (kserve) is part of the test extra: run scripts/setup.sh --test")

from fedpipe.algorithms import ALGORITHMS  # noqa: E402
from fedpipe.models.export import export_model  # noqa: E402
from fedpipe.models.line import ModelLine, ModelSpec, VersionRecord  # noqa: E402
from fedpipe.serving.predictor import LinePredictor, ServeOptions, ServingError  # noqa: E402

KEY = "serving-test-signing-key-0123456789abcdef"
LINE = "every"
# 2 clients with two classes each, 1 round (SuPerFed: 2, one per phase): seconds per method
TINY = ["data.dataset=digits", "model.name=twonn", "partition.scheme=pathological", "partition.num_clients=2", "train.rounds=1",
        "train.lr=0.05", "run.threads=1", "engine.clients=sequential", "eval.batch_size=1000"]
EXTRA = {"superfed_mm": ["method.start_fraction=0.5", "train.rounds=2"], "superfed_lm": ["method.start_fraction=0.5", "train.rounds=2"]}


def _register(line: ModelLine, run, files: dict[str, bytes], clients) -> int:
    record = VersionRecord(0, run.layout.run_id, ModelSpec.of_run(run), run.cfg.to_yaml(), run.bundle.snapshot, {}, tuple(clients))
    return line.register(record, files).version


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(store folder, {version: method}, pixels [N,1,8,8] uint8, their PNG files, the server's URL): a signed line
    with a version per method, version 1 promoted, served by `fedpipe models serve` (cache of 2, unknown clients
    refused, the pointer checked on every request)."""
    from fedpipe.models.export import export_run

    root = tmp_path_factory.mktemp("serving")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDPIPE_SIGNING_KEY", KEY)
        mp.delenv("FEDPIPE_SIGNING_ALLOW_UNSIGNED", raising=False)
        versions, line = {}, None
        for method in ALGORITHMS:
            run = small_run(root / "runs", f"method.name={method}", *TINY, *EXTRA.get(method, []), run_id=method)
            train_all(run)
            files, spec, clients = export_run(run)
            line = line or ModelLine(run.store, LINE)
            versions[_register(line, run, files, clients)] = method
        line.promote(1, "test")
        pixels = run.bundle.train.x[:3]
        pngs = []
        from PIL import Image

        for i, image in enumerate(pixels):
            pngs.append(root / f"digit{i}.png")
            Image.fromarray(image[0], mode="L").save(pngs[-1])
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = start_server("fedpipe-serve", [sys.executable, "-m", "fedpipe.cli", "models", "serve", LINE, "--store", str(root / "runs"),
                                                "--port", str(port), "--cache-size", "2", "--unknown-client", "404",
                                                "--reload-seconds", "0", "--max-request-bytes", "65536"],
                              url, f"/v2/models/{LINE}/ready", root, timeout=120)
        try:
            yield root / "runs", versions, pixels, pngs, url, line
        finally:
            stop_server(server)
            log = server.log_path.read_text(errors="replace")
            print(log[-3000:])


def _post(url: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _v2(pixels: np.ndarray, client: str | None = None, shape=None, datatype="FP32") -> dict:
    body = {"inputs": [{"name": "input", "shape": list(shape or pixels.shape), "datatype": datatype,
                        "data": pixels.astype(float).reshape(-1).tolist()}]}
    if client is not None:
        body["parameters"] = {"client": client}
    return body


def _predict_cli(store: Path, client: str, pngs: list[Path]) -> list[tuple[str, float]]:
    from fedpipe.cli import app

    done = CliRunner().invoke(app, ["predict", "--model", LINE, "--client", client, "--store", str(store), *map(str, pngs)])
    assert done.exit_code == 0, done.output
    return [(row.split()[1], float(row.split()[2])) for row in done.output.strip().splitlines()]


def test_every_methods_clients_are_served_as_fedpipe_predict_answers(served, monkeypatch):
    store, versions, pixels, pngs, url, line = served
    monkeypatch.setenv("FEDPIPE_SIGNING_KEY", KEY)
    for version, method in versions.items():
        if version > 1:
            line.promote(version, "test")  # the server follows the pointer (checked on every request here)
        for client in ("0", "1"):  # both clients through the endpoint; one of them (in turn) through `fedpipe predict` too
            status, answer = _post(f"{url}/v2/models/{LINE}/infer", _v2(pixels, client))
            assert status == 200, (method, answer)
            params = answer["parameters"]
            assert (params["version"], params["client"], params["model"]) == (version, client, "personalized"), method
            outputs = {o["name"]: o for o in answer["outputs"]}
            probs = np.asarray(outputs["probabilities"]["data"]).reshape(outputs["probabilities"]["shape"])
            served_rows = [(label, round(float(p), 4)) for label, p in zip(outputs["label"]["data"], probs.max(axis=1))]
            assert np.allclose(probs.sum(axis=1), 1.0)
            if int(client) == version % 2:
                assert served_rows == _predict_cli(store, client, pngs), f"{method} client {client}"
    # the header names the client as the parameter does; v1 answers the same
    status, by_header = _post(f"{url}/v2/models/{LINE}/infer", _v2(pixels), {"Fedpipe-Client": "1"})
    status1, v1 = _post(f"{url}/v1/models/{LINE}:predict", {"instances": pixels.astype(float).tolist(), "parameters": {"client": "1"}})
    assert status == status1 == 200 and by_header["parameters"]["client"] == "1"
    labels = next(o for o in by_header["outputs"] if o["name"] == "label")["data"]
    assert [p["label"] for p in v1["predictions"]] == labels and v1["client"] == "1"


def _is_clear(status: int, answer: dict, expected_status: int, *words: str) -> None:
    assert status == expected_status, answer
    assert set(answer) == {"error"} and "Traceback" not in answer["error"], answer
    for word in words:
        assert word in answer["error"], answer


def test_bad_requests_get_a_clear_4xx_json_answer(served):
    _, versions, pixels, _, url, _ = served
    infer = f"{url}/v2/models/{LINE}/infer"
    _is_clear(*_post(infer, _v2(pixels, "nowhere")), 404, "No client 'nowhere'", "0, 1")
    _is_clear(*_post(infer, _v2(pixels[:, :, :4], "0")), 400, "[3, 1, 4, 8]", "['N', 1, 8, 8]")
    _is_clear(*_post(infer, _v2(pixels, "0", shape=[3, 1, 8, 8 + 1])), 400, "shape")
    _is_clear(*_post(infer, _v2(pixels, "0", datatype="INT64")), 400, "datatype", "FP32")
    _is_clear(*_post(infer, {"inputs": [{"name": "x", "shape": [2, 1, 8, 8], "datatype": "FP32", "data": [1.0] * 10}],
                             "parameters": {"client": "0"}}), 400, "128 values", "10 were sent")
    _is_clear(*_post(infer, _v2(pixels, "0"), {"Fedpipe-Client": "1"}), 400, "different clients")
    big = _v2(np.zeros((1000, 1, 8, 8)), "0")  # ~320 KB of JSON, over the server's 64 KiB
    _is_clear(*_post(infer, big), 413, "at most 65,536", "fewer rows")
    for client in ("0", "1"):
        assert _post(infer, _v2(pixels, client))[0] == 200
    with urllib.request.urlopen(f"{url}/v2/models/{LINE}", timeout=10) as response:  # the model's metadata says what to send
        metadata = json.loads(response.read())
    assert metadata["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]
    assert [o["name"] for o in metadata["outputs"]] == ["probabilities", "label", "label_index"]
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    cached = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("fedpipe_serving_cached_models{")]
    assert cached and 1 <= cached[0] <= 2  # --cache-size 2


class _Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.linear(x.flatten(1))


def _tiny_line(root: Path, clients: int, promote: bool = True, with_global: bool = False) -> ModelLine:
    """A line whose one version has `clients` personalized models (a linear classifier each, exported as fedpipe
    exports: torch.export), and no global model."""
    import fedpipe.models.export as export
    from fedpipe.store import open_store

    line = ModelLine(open_store(str(root)), "many")
    files, entries = {}, {}
    torch.manual_seed(0)
    exported = export_model(_Linear().eval(), torch.rand(2, 1, 2, 2) * 255)  # one model, filed under every client's name
    for c in range(clients):
        entries[f"site-{c}"] = export.ServedFile(f"clients/site-{c}.pt2", exported.format, exported.exporter, c, 1.0)
        files[entries[f"site-{c}"].file] = exported.data
    glob = None
    if with_global:  # another model than the clients': the answer tells which one answered
        other = export_model(_Linear().eval(), torch.rand(2, 1, 2, 2) * 255)
        glob = export.ServedFile("global.pt2", other.format, other.exporter)
        files[glob.file] = other.data
    spec = export.ServingSpec("r", "fedavg_ft", "linear", "image", (1, 2, 2), (0.0,), (1.0,), ("a", "b", "c"), glob, entries)
    files[export.SPEC_FILE] = spec.to_bytes()
    record = VersionRecord(0, "r", ModelSpec("linear", "local", (1, 2, 2), 3, ("a", "b", "c")), "", None, {}, tuple(entries))
    version = line.register(record, files).version
    if promote:
        line.promote(version, "test")
    return line


def test_the_model_cache_stays_bounded_under_1000_clients(tmp_path, monkeypatch):
    import os

    monkeypatch.delenv("FEDPIPE_SIGNING_KEY", raising=False)
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # 1,000 files written: their durability is not what is tested here
    line = _tiny_line(tmp_path, 1000)
    predictor = LinePredictor(line, None, ServeOptions(cache_size=8, trust_unsigned=True, unknown_client="global"))
    x = predictor.rows([0.0, 64.0, 128.0, 255.0], [1, 1, 2, 2], "FP32")
    sizes = []
    for c in range(0, 1000, 25):  # 40 different clients
        predictor.predict(f"site-{c}", x)
        sizes.append(len(predictor.cache))
    assert max(sizes) == 8 and predictor.cache.loads == 40
    predictor.predict("site-975", x)  # the most recent: still cached
    assert predictor.cache.loads == 40
    predictor.predict("site-0", x)  # the oldest: evicted long ago, loaded again
    assert predictor.cache.loads == 41 and len(predictor.cache) == 8
    with pytest.raises(ServingError, match="no global model") as e:  # unknown client, and no global model to fall back on
        predictor.predict("site-1000", x)
    assert e.value.status == 404


def test_an_unsigned_line_is_served_only_when_trusted(tmp_path, monkeypatch):
    from fedpipe.errors import FedpipeError

    monkeypatch.delenv("FEDPIPE_SIGNING_KEY", raising=False)
    line = _tiny_line(tmp_path, 2)
    with pytest.raises(FedpipeError, match="--trust-unsigned"):
        LinePredictor(line, 1, ServeOptions())
    assert LinePredictor(line, 1, ServeOptions(trust_unsigned=True)).version == 1


def test_the_promoted_pointer_is_followed_within_the_reload_interval(tmp_path, monkeypatch):
    monkeypatch.delenv("FEDPIPE_SIGNING_KEY", raising=False)
    line = _tiny_line(tmp_path, 2)
    record = line.record(1)
    files = {key: line.read(1, key, 2**20) for key in record.files}
    line.promote(line.register(record, files).version, "the next one")
    predictor = LinePredictor(line, None, ServeOptions(trust_unsigned=True, reload_seconds=60))
    assert predictor.version == 2
    line.rollback()
    predictor.refresh(now=predictor._checked + 59)
    assert predictor.version == 2  # within the interval: not read again
    predictor.refresh(now=predictor._checked + 61)
    assert predictor.version == 1 and len(predictor.cache) == 0


def test_a_version_downloaded_by_kserves_storage_initializer_is_served_with_every_check(tmp_path, monkeypatch):
    """`--folder`: the version's objects as KServe downloads them from its storageUri (bytes as stored: signed
    envelopes included) are served with the signatures and the record's hashes checked; a swapped file is refused."""
    import shutil

    from fedpipe.errors import CorruptArtifactError
    from fedpipe.serving.predictor import open_folder

    monkeypatch.setenv("FEDPIPE_SIGNING_KEY", KEY)
    line = _tiny_line(tmp_path / "store", 3)
    folder = tmp_path / "mnt-models"
    for key in line.store.list(line.keys.version(1)):  # what `aws s3 cp --recursive` of the version's folder leaves
        target = folder / key[len(line.keys.version(1)):]
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tmp_path / "store" / key, target)
    served = open_folder(str(folder), "many@1", ServeOptions())
    from_store = LinePredictor(line, 1, ServeOptions())
    x = served.rows([0.0, 64.0, 128.0, 255.0, 1.0, 2.0, 3.0, 4.0], [2, 1, 2, 2], "FP32")
    assert np.array_equal(served.predict("site-1", x).probabilities, from_store.predict("site-1", x).probabilities)
    (folder / "clients" / "site-2.pt2").write_bytes((folder / "clients" / "site-1.pt2").read_bytes())  # a bucket writer's swap
    with pytest.raises(CorruptArtifactError):
        served.predict("site-2", x)
    monkeypatch.delenv("FEDPIPE_SIGNING_KEY")
    with pytest.raises(Exception, match="--trust-unsigned"):  # the envelopes are not read as models without the key
        open_folder(str(folder), "many@1", ServeOptions())


def test_a_new_installs_predictor_waits_for_the_first_promotion(tmp_path, monkeypatch):
    import time

    from fedpipe.cli.models import _wait_for_promotion

    monkeypatch.delenv("FEDPIPE_SIGNING_KEY", raising=False)
    line = _tiny_line(tmp_path, 2, promote=False)
    slept = []

    def sleep(seconds):  # the first run's promotion happens while the predictor waits
        slept.append(seconds)
        line.promote(1, "the first run")

    monkeypatch.setattr(time, "sleep", sleep)
    _wait_for_promotion(line, 0)
    assert slept == [5.0] and LinePredictor(line, None, ServeOptions(trust_unsigned=True)).version == 1


@pytest.mark.parametrize("kind", ["image", "table", "text"])
def test_each_input_kind_is_checked_in_its_raw_form(kind):
    """The rows a request may send, per input kind (spec.json's): shape [N, *input shape], the spec's datatype,
    finite values; token ids inside the vocabulary."""
    from fedpipe.models.export import ServingSpec

    shape = {"image": (1, 2, 2), "table": (3,), "text": (4,)}[kind]
    norm = {"image": ((0.0,), (1.0,)), "table": ((0.0,) * 3, (1.0,) * 3), "text": (None, None)}[kind]
    spec = ServingSpec("r", "local", "m", kind, shape, *norm, ("a", "b"), None, {}, vocab_size=10 if kind == "text" else None)
    predictor = object.__new__(LinePredictor)  # the input checks read only the spec and the options
    predictor.spec, predictor.options = spec, ServeOptions(max_batch=4)
    datatype = "INT64" if kind == "text" else "FP32"
    count = int(np.prod(shape))
    x = predictor.rows(list(range(2 * count)), [2, *shape], datatype)
    assert tuple(x.shape) == (2, *shape) and x.dtype == (torch.int64 if kind == "text" else torch.float32)
    other = "FP32" if kind == "text" else "INT64"
    for data, sent_shape, sent_type, words in [
        (list(range(count)), [1, *shape], other, "datatype"),
        (list(range(count)), [1, *shape, 1], datatype, "shape"),
        (list(range(5 * count)), [5, *shape], datatype, "1 to 4"),
        ([1] * (count - 1), [1, *shape], datatype, "were sent"),
        (["x"] * count, [1, *shape], datatype, "not"),
    ]:
        with pytest.raises(ServingError, match=words):
            predictor.rows(data, sent_shape, sent_type)
    if kind == "text":
        with pytest.raises(ServingError, match="Token ids are 0 to 9"):
            predictor.rows([0, 1, 2, 10], [1, 4], "INT64")
    else:
        with pytest.raises(ServingError, match="NaN"):
            predictor.rows([float("nan")] * count, [1, *shape], "FP32")


def test_an_unknown_client_gets_the_global_model_or_a_404_as_configured(tmp_path, monkeypatch):
    monkeypatch.delenv("FEDPIPE_SIGNING_KEY", raising=False)
    line = _tiny_line(tmp_path, 2, with_global=True)
    x = torch.tensor([[[[0.0, 64.0], [128.0, 255.0]]]])
    fallback = LinePredictor(line, 1, ServeOptions(trust_unsigned=True, unknown_client="global"))
    unknown, nobody, known = fallback.predict("site-9", x), fallback.predict(None, x), fallback.predict("site-1", x)
    assert (unknown.model, unknown.client) == (nobody.model, nobody.client) == ("global", None)
    assert np.array_equal(unknown.probabilities, nobody.probabilities) and known.model == "personalized"
    assert not np.allclose(unknown.probabilities, known.probabilities)  # the global model answered, not a client's
    strict = LinePredictor(line, 1, ServeOptions(trust_unsigned=True, unknown_client="404"))
    with pytest.raises(ServingError, match="No client 'site-9'.*site-0, site-1") as e:
        strict.predict("site-9", x)
    assert e.value.status == 404 and strict.predict(None, x).model == "global"


def test_a_chunked_body_over_the_limit_is_refused_before_the_app_sees_it():
    """A body without Content-Length (chunked) is counted as it arrives: past the bound, 413 and the app never runs."""
    import asyncio

    from fedpipe.serving.kserve_model import BodyLimit

    seen = []

    async def app(scope, receive, send):
        seen.append(await receive())

    async def run(chunks: list[bytes]) -> list[dict]:
        messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
        sent = []

        async def receive():
            return messages.pop(0)

        async def send(message):
            sent.append(message)

        await BodyLimit(app, max_bytes=1000)({"type": "http", "headers": [(b"transfer-encoding", b"chunked")]}, receive, send)
        return sent

    refused = asyncio.run(run([b"x" * 600, b"x" * 600, b"x" * 600]))
    assert refused[0]["status"] == 413 and b"at most 1,000" in refused[1]["body"] and seen == []
    assert asyncio.run(run([b"x" * 600, b"x" * 300])) == [] and seen == [{"type": "http.request", "body": b"x" * 600, "more_body": True}]
