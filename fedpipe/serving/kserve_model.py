"""A model line behind KServe's model server (the `kserve` package: `fedpipe[serve]`).

`LineModel` is a `kserve.Model` whose `predict` takes the open inference protocol v2 (`POST
/v2/models/NAME/infer`) and v1 (`POST /v1/models/NAME:predict`) and answers through a `LinePredictor`.
The client is named by the request's `client` parameter or the `Fedpipe-Client` header (UTF-8):

    v2  {"parameters": {"client": "hospital-a"},
         "inputs": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": [...64 pixels 0..255...]}]}
        -> outputs "probabilities" FP64 [N, classes] (columns in the order of the spec's labels), "label" BYTES [N]
           (the best label's name), "label_index" INT64 [N]; parameters: version, model (personalized or
           global), client (or unknown_client: a name the version has no model for, answered by the global model)
    v1  {"instances": [[[...8 rows of 8 pixels...]]], "parameters": {"client": "hospital-a"}}
        -> {"predictions": [{"label": ..., "label_index": ..., "probabilities": {label: p, ...}}], "version": ...}

Errors are KServe's JSON `{"error": "..."}` with a 4xx status that says the cause (400 bad input, a malformed
binary tensor included; 404 unknown client under `--unknown-client 404`; 413 a body over `max_request_bytes`),
never a traceback. A fault on the server's side (the store unreachable, a file whose sha256 does not match) is
a 500 whose answer says only that, with an error id; the log line with that id has the store path and the cause.

`serve` runs KServe's REST server (uvicorn; gRPC is left off) on one host and port, with these differences from
`kserve.ModelServer`'s, each for a reason:
- the model repository extension (`POST /v2/repository/models/NAME/load|unload`) is refused (403): KServe's
  `ModelRepository.load` loads nothing (kserve/model_repository.py), so an unload by anyone who reaches the port
  could only take the endpoint down for good. What is served changes by promoting a version (followed here).
- readiness follows the model: `/v2/health/ready` answers 503 unless every registered model is ready (KServe's
  `DataPlane.ready` answers True whatever the models are; kserve/protocol/dataplane.py), and the
  InferenceService probes it.
- `predict` runs on a worker thread (KServe calls a plain `predict` on the event loop: kserve/model.py
  `Model.__call__`), so a cache miss's load holds up only the requests for that model.
- one log line per request (uvicorn's access line): KServe's timing middleware (two `kserve.trace` lines per
  request) is left out, its error handlers' tracebacks for refused requests too, and FastAPI's deprecation
  warning about KServe's `ORJSONResponse` is filtered once, when the app is built.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import sys
import uuid
import warnings
from typing import Any

from prometheus_client import Gauge  # a dependency of kserve

from fedpipe.errors import FedpipeError
from fedpipe.serving.predictor import DTYPES, LinePredictor, Prediction, ServingError

_argv, sys.argv = sys.argv, sys.argv[:1]  # kserve.model_server parses sys.argv when imported: not fedpipe's options
try:
    from kserve import Model
    from kserve.errors import (
        InferenceError,
        InvalidInput,
        ModelNotFound,
        ModelNotReady,
        ServerNotLive,
        ServerNotReady,
        UnsupportedProtocol,
    )
    from kserve.model_repository import ModelRepository
    from kserve.protocol.dataplane import DataPlane
    from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse
    from kserve.protocol.model_repository_extension import ModelRepositoryExtension
    from kserve.protocol.rest.server import RESTServer
finally:
    sys.argv = _argv

log = logging.getLogger(__name__)

CLIENT_HEADER = "fedpipe-client"  # HTTP header names are case-insensitive; Starlette gives them in lower case
MAX_REQUEST_BYTES = 16 * 2**20


# On KServe's /metrics (the process's default registry), by model name.
CACHED = Gauge("fedpipe_serving_cached_models", "Models loaded in the serving cache now (at most --cache-size)", ["model"])
LOADS = Gauge("fedpipe_serving_model_loads", "Models loaded from the store since the server started (cache misses)", ["model"])
VERSION = Gauge("fedpipe_serving_version", "The model line version being served", ["model"])


def _observe(name: str, predictor: LinePredictor) -> None:
    CACHED.labels(name).set(len(predictor.cache))
    LOADS.labels(name).set(predictor.cache.loads)
    VERSION.labels(name).set(predictor.version)


class Answered(Exception):
    """A request answered with `status` and the JSON `{"error": message}`, and nothing more in the log than the
    access line (a refused request is the caller's to fix, not the operator's)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def client_header(value: str | None) -> str | None:
    """The Fedpipe-Client header's value as its sender wrote it, UTF-8 (what curl sends for "Klinik Süd").

    Starlette gives header values decoded as latin-1, one character per byte (KServe's endpoints hand the model
    `dict(request.headers)`: kserve/protocol/rest/v2_endpoints.py `infer`, v1_endpoints.py `predict`), so a UTF-8
    name arrives as "Klinik SÃ¼d": the bytes are recovered and decoded as UTF-8. Bytes that are not UTF-8 (Python's
    http.client encodes a str header as latin-1) are refused rather than guessed at: a wrong guess would be
    answered by another client's model, or by the global one."""
    if value is None or value.isascii():
        return value
    try:
        raw = value.encode("latin-1")
    except UnicodeEncodeError:  # not bytes as received (a direct call with a str): already decoded
        return value
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ServingError("The Fedpipe-Client header's bytes are not UTF-8: send the client's name encoded as UTF-8 "
                           "(curl does; with Python's http.client or requests, pass name.encode()), or name the client in "
                           "the body instead: \"parameters\": {\"client\": NAME}.") from None


def _error_id() -> str:
    return uuid.uuid4().hex[:12]


class LineModel(Model):
    """A kserve.Model serving one model line (its global and personalized models) under the line's name."""

    def __init__(self, name: str, predictor: LinePredictor):
        super().__init__(name)
        self.predictor = predictor
        self.ready = True
        _observe(name, predictor)

    def get_input_types(self) -> list[dict]:
        spec = self.predictor.spec
        return [{"name": "input", "datatype": DTYPES[spec.input_kind][0], "shape": [-1, *spec.input_shape]}]

    def get_output_types(self) -> list[dict]:
        classes = len(self.predictor.spec.labels)
        return [{"name": "probabilities", "datatype": "FP64", "shape": [-1, classes]},
                {"name": "label", "datatype": "BYTES", "shape": [-1]}, {"name": "label_index", "datatype": "INT64", "shape": [-1]}]

    async def predict(self, payload: Any, headers: dict[str, str] | None = None) -> Any:
        # On a worker thread: KServe awaits a coroutine `predict` and calls a plain one on the event loop, where a
        # cache miss's load (a store read, a model load) would hold up every other request.
        return await asyncio.get_running_loop().run_in_executor(None, self.answer, payload, headers)

    def answer(self, payload: Any, headers: dict[str, str] | None = None) -> Any:
        """A v2 `InferRequest` or a v1 body answered (the blocking part of `predict`)."""
        try:
            header = client_header((headers or {}).get(CLIENT_HEADER))
            if isinstance(payload, InferRequest):
                return self._v2(payload, header)
            return self._v1(payload, header)
        except ServingError as e:
            log.debug("Refused (%d): %s", e.status, e)
            raise Answered(e.status, str(e)) from None
        except FedpipeError as e:  # the store or an artifact: the operator's to fix, and not the caller's to read
            ref = _error_id()
            log.error("Request %s (model %s): the model line could not be read: %s", ref, self.name, e)
            raise Answered(500, f"The model for this request could not be loaded (error {ref}; the server's log says why).") from None
        except Exception:
            ref = _error_id()
            log.exception("Request %s (model %s) failed", ref, self.name)
            raise Answered(500, f"The request failed on the server's side (error {ref}; the server's log says why).") from None
        finally:
            _observe(self.name, self.predictor)

    def _v2(self, request: InferRequest, header: str | None) -> InferResponse:
        p = self.predictor
        if len(request.inputs) != 1:
            raise ServingError(f"Send exactly one input tensor (got {len(request.inputs)}): N rows of {p.spec.input_kind} inputs.")
        tensor = request.inputs[0]
        data: Any = tensor.data
        if getattr(tensor, "_raw_data", None) is not None:  # the binary tensor extension
            try:
                data = tensor.as_numpy()
            except (ValueError, TypeError) as e:
                raise ServingError(f"The input's binary data does not make shape {list(tensor.shape)} of {tensor.datatype} ({e}).") from None
        client = p.client_of((request.parameters or {}).get("client"), header)
        x = p.rows(data, list(tensor.shape), tensor.datatype)
        return _response(self.name, request.id, p.predict(client, x))

    def _v1(self, body: Any, header: str | None) -> dict:
        p = self.predictor
        if not isinstance(body, dict) or not isinstance(body.get("instances"), list) or not body["instances"]:
            raise ServingError('A v1 request is {"instances": [input, ...]} with one raw input per instance '
                               f"(shape {list(p.spec.input_shape)}); the client goes in \"parameters\": {{\"client\": NAME}} "
                               "or the Fedpipe-Client header.")
        parameters = body.get("parameters") if isinstance(body.get("parameters"), dict) else {}
        client = p.client_of(parameters.get("client"), header)
        rows = body["instances"]
        x = p.rows(rows, [len(rows), *p.spec.input_shape], None)
        result = p.predict(client, x)
        labels = p.spec.labels
        predictions = [{"label": name, "label_index": int(i), "probabilities": dict(zip(labels, map(float, row)))}
                       for name, i, row in zip(result.labels, result.index, result.probabilities)]
        return {"predictions": predictions, **_about(result)}


def _about(result: Prediction) -> dict:
    about: dict = {"version": result.version, "model": result.model}
    if result.client is not None:
        about["client"] = result.client
    elif result.asked is not None:  # a name with no model of its own: said, so a misspelt name is not served silently
        about["unknown_client"] = result.asked
    return about


def _response(name: str, request_id: str | None, result: Prediction) -> InferResponse:
    n = len(result.labels)
    outputs = [InferOutput("probabilities", list(result.probabilities.shape), "FP64", result.probabilities.tolist()),
               InferOutput("label", [n], "BYTES", list(result.labels)),
               InferOutput("label_index", [n], "INT64", result.index.tolist())]
    return InferResponse(request_id or "", name, outputs, parameters=_about(result))


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is answered 413 before anything parses it (a declared
    Content-Length at once; a chunked body as soon as it passes the bound)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await self._refuse(send, declared.decode("latin-1"))
        messages, total = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            total += len(message.get("body", b""))
            if total > self.max_bytes:
                return await self._refuse(send, f"more than {total}")
            if not message.get("more_body"):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)

    async def _refuse(self, send, size: str) -> None:
        import json

        body = json.dumps({"error": f"The request body is {size} bytes; this server takes at most {self.max_bytes:,} "
                                    "(--max-request-bytes). Send fewer rows per request."}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class LineDataPlane(DataPlane):
    """KServe's data plane, with readiness that follows the models, no model repository extension advertised, and a
    malformed binary tensor answered 400 (KServe lets numpy's ValueError through as a 500)."""

    async def ready(self) -> bool:
        models = self.model_registry.get_models()
        ready = [await self.model_registry.is_model_ready(name) for name in list(models)]
        return bool(ready) and all(ready) and await super().ready()

    def metadata(self) -> dict:
        about = super().metadata()
        about["extensions"] = [e for e in about.get("extensions", []) if e != "model_repository_extension"]
        return about

    def decode_inference_request(self, body, headers, model_name):
        try:
            return super().decode_inference_request(body, headers, model_name)
        except InvalidInput:
            raise
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, struct.error, UnicodeDecodeError) as e:
            log.debug("A binary inference request did not parse: %s: %s", type(e).__name__, e)
            raise InvalidInput("The binary request does not parse: its first Inference-Header-Content-Length bytes are "
                               "the JSON header, and each input's parameters.binary_data_size bytes that follow hold its "
                               "shape's values of its datatype (FP32: 4 bytes each, INT64: 8), little-endian, in order.") from None


class ClosedRepository(ModelRepositoryExtension):
    """The model repository extension, refused: this server serves one model line for the life of its process."""

    async def load(self, model_name: str) -> None:
        raise Answered(403, self._why(model_name, "load"))

    async def unload(self, model_name: str) -> None:
        raise Answered(403, self._why(model_name, "unload"))

    @staticmethod
    def _why(name: str, verb: str) -> str:
        return (f"This server does not {verb} models (the model repository extension is off): it serves model {name!r} "
                "for the life of its process. To change what it serves, promote another version of the line (fedpipe "
                "models promote / rollback); a predictor following the promoted version serves it within --reload-seconds.")


def _answer(status: int):
    async def handler(_request, exc):
        from fastapi.responses import JSONResponse

        return JSONResponse(status_code=status, content={"error": str(exc)})

    return handler


async def _answered(_request, exc: Answered):
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=exc.status, content={"error": str(exc)})


async def _fault(_request, exc: Exception):
    """An exception nothing else answered (KServe's own): a plain 500; the traceback goes to the log (uvicorn's)."""
    from fastapi.responses import JSONResponse

    ref = _error_id()
    log.error("Request %s failed: %s: %s", ref, type(exc).__name__, exc)
    return JSONResponse(status_code=500, content={"error": f"The request failed on the server's side (error {ref}; the server's log says why)."})


class LineServer(RESTServer):
    """KServe's REST server (its v1 and v2 endpoints, /metrics) on an app of its own, for one model line."""

    def __init__(self, app, dataplane: DataPlane, repository: ModelRepositoryExtension, host: str, port: int, max_request_bytes: int):
        super().__init__(app, dataplane, repository, port, workers=1)  # uvicorn takes the app itself as well as its import path
        self.app, self.max_request_bytes = app, max_request_bytes
        self.config.host = host  # KServe listens on 0.0.0.0 (a pod); a laptop's default is loopback

    def create_application(self):  # once: `line_server` builds the app, and RESTServer.start calls this again
        if not getattr(self, "_created", False):
            self._add_middlewares(self.app)
            self._register_endpoints(self.app)
            self._add_exception_handlers(self.app)
            self._created = True

    def _add_middlewares(self, app) -> None:
        # Not KServe's TimingMiddleware: two kserve.trace lines per request beside uvicorn's access line, and the
        # latencies are on /metrics already (KServe's request_*_seconds histograms, per model).
        app.add_middleware(BodyLimit, max_bytes=self.max_request_bytes)

    def _add_exception_handlers(self, app) -> None:
        # KServe's handlers log a traceback for every refused request (kserve/errors.py): these answer the same JSON.
        for kind, status in ((InvalidInput, 400), (ModelNotFound, 404), (ModelNotReady, 503), (ServerNotReady, 503),
                             (ServerNotLive, 503), (NotImplementedError, 501), (UnsupportedProtocol, 501), (InferenceError, 500)):
            app.add_exception_handler(kind, _answer(status))
        app.add_exception_handler(Answered, _answered)
        app.add_exception_handler(Exception, _fault)


def line_server(predictor: LinePredictor, name: str, host: str = "127.0.0.1", port: int = 8080,
                max_request_bytes: int = MAX_REQUEST_BYTES) -> LineServer:
    """The REST server that serves `predictor` as model `name` (its app built: `.app` is an ASGI app)."""
    from importlib import metadata

    from fastapi import FastAPI
    from fastapi.responses import ORJSONResponse

    _quiet_orjson_deprecation()
    app = FastAPI(title="KServe ModelServer", version=metadata.version("kserve"), docs_url=None, redoc_url=None,
                  default_response_class=ORJSONResponse)  # as kserve.model_server's app
    models = ModelRepository()
    models.update(LineModel(name, predictor))
    server = LineServer(app, LineDataPlane(model_registry=models), ClosedRepository(model_registry=models), host, port, max_request_bytes)
    server.create_application()
    return server


def _quiet_orjson_deprecation() -> None:
    """FastAPI (0.120+) warns each time an ORJSONResponse is made, and KServe makes one per answer (its app's default
    response class; v1's predict): KServe's to change, nothing an operator can act on."""
    import fastapi.exceptions

    category = getattr(fastapi.exceptions, "FastAPIDeprecationWarning", None)
    if category is not None:
        warnings.filterwarnings("ignore", message="ORJSONResponse is deprecated", category=category)


def serve(predictor: LinePredictor, name: str, host: str, port: int, max_request_bytes: int = MAX_REQUEST_BYTES) -> None:
    """Serve `predictor` as model `name` over HTTP on host:port (KServe's REST server; blocks until SIGINT/SIGTERM)."""
    from kserve.logging import configure_logging
    from kserve.logging import logger as kserve_logger

    if not kserve_logger.handlers:  # as kserve.ModelServer does: KServe's and uvicorn's log format
        configure_logging()
    server = line_server(predictor, name, host, port, max_request_bytes)
    asyncio.run(server.start())
