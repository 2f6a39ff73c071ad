"""A model line behind KServe's model server (the `kserve` package: `fedpipe[serve]`).

`LineModel` is a `kserve.Model` whose `predict` takes the open inference protocol v2 (`POST
/v2/models/NAME/infer`) and v1 (`POST /v1/models/NAME:predict`) and answers through a `LinePredictor`.
The client is named by the request's `client` parameter or the `Fedpipe-Client` header:

    v2  {"parameters": {"client": "hospital-a"},
         "inputs": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": [...64 pixels 0..255...]}]}
        -> outputs "probabilities" FP64 [N, classes] (columns in the order of the spec's labels), "label" BYTES [N]
           (the best label's name), "label_index" INT64 [N]; parameters: line, version, model (personalized or
           global), client
    v1  {"instances": [[[...8 rows of 8 pixels...]]], "parameters": {"client": "hospital-a"}}
        -> {"predictions": [{"label": ..., "label_index": ..., "probabilities": {label: p, ...}}], "version": ...}

Errors are KServe's JSON `{"error": "..."}` with a 4xx status that says the cause (400 bad input, 404 unknown
client under `--unknown-client 404`, 413 a body over `max_request_bytes`), never a traceback. `serve` runs the
REST server of `kserve.ModelServer` (uvicorn) on one host and port; gRPC is left off.
"""

from __future__ import annotations

import sys
from typing import Any

from prometheus_client import Gauge  # a dependency of kserve

from fedpipe.errors import FedpipeError
from fedpipe.serving.predictor import DTYPES, LinePredictor, Prediction, ServingError

_argv, sys.argv = sys.argv, sys.argv[:1]  # kserve.model_server parses sys.argv when imported: not fedpipe's options
try:
    from kserve import Model, ModelServer
    from kserve.errors import InvalidInput, ModelNotFound
    from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse
finally:
    sys.argv = _argv

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


class UnknownClient(ModelNotFound):
    """404 with fedpipe's message (KServe's handler answers str(exc))."""

    def __init__(self, message: str):
        self.reason = message


def _kserve_error(e: FedpipeError) -> Exception:
    if isinstance(e, ServingError) and e.status == 404:
        return UnknownClient(str(e))
    if isinstance(e, ServingError):
        return InvalidInput(str(e))
    return RuntimeError(f"The model line could not be read: {e}")  # the store: KServe answers 500 with the message


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

    def predict(self, payload: Any, headers: dict[str, str] | None = None) -> Any:
        header = (headers or {}).get(CLIENT_HEADER)
        try:
            if isinstance(payload, InferRequest):
                return self._v2(payload, header)
            return self._v1(payload, header)
        except FedpipeError as e:
            raise _kserve_error(e) from None
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


def serve(predictor: LinePredictor, name: str, host: str, port: int, max_request_bytes: int = MAX_REQUEST_BYTES) -> None:
    """Serve `predictor` as model `name` over HTTP on host:port (KServe's REST server; blocks until SIGINT/SIGTERM)."""
    import asyncio

    from kserve.model_server import app
    from kserve.protocol.rest.server import RESTServer

    server = ModelServer(http_port=port, enable_grpc=False, workers=1, enable_latency_logging=False)
    server.register_model(LineModel(name, predictor))
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    rest = RESTServer("kserve.model_server:app", server.dataplane, server.model_repository_extension, port, workers=1)
    rest.config.host = host  # KServe listens on 0.0.0.0 (a pod); a laptop's default is loopback
    asyncio.run(rest.start())
