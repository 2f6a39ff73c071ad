"""One model line version served: the global model and every client's personalized model, chosen per request.

`LinePredictor` is the serving logic with no web framework in it (`fedpipe.serving.kserve_model` puts it behind
KServe's `ModelServer`). It reads the line as `fedpipe predict` does: through the store (signed unless the
operator trusts unsigned lines), every file bounded and checked against the sha256 its version's record lists,
a .pt2 checked to hold no pickle and no code before torch loads it (`fedpipe.models.export.load_exported`),
TorchScript from a signed line only. Nothing of the user's model package is ever imported: an exported model is
a program and tensors, so the fail-closed import policy (FEDPIPE_MODEL_PACKAGES) has nothing to let through.

- Models load lazily, one per served file, into a least-recently-used cache of at most `cache_size` models
  (a line of 10,000 clients is served in bounded memory; a miss costs one file read and one load). A load runs
  outside the predictor's lock, so a cache miss holds up only the requests for that same file: they wait for
  the one load under way (a future per file) instead of loading it again, while every other request is
  answered meanwhile. Memory: `cache_size` models plus at most `MAX_LOADS` being loaded.
- A client the version has no model for is served the global model (`unknown_client="global"`, for methods
  that have one) or refused with a 404 (`unknown_client="404"`).
- Following the promoted version (no version pinned), the pointer is read again when a request comes and the
  last check is older than `reload_seconds` (check-on-request with a TTL): an idle server reads nothing, no
  thread runs beside the server's event loop, and a promotion (or a rollback) is served at most
  `reload_seconds` after it. A pointer that cannot be read or does not verify keeps the version being served
  (and says so in the log): a damaged pointer never takes a serving endpoint down.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedpipe.errors import FedpipeError, StoreError
from fedpipe.models.export import MAX_SERVED_MODEL_BYTES, MAX_SPEC_BYTES, SPEC_FILE, ServedFile, ServingSpec, load_exported
from fedpipe.models.line import ModelLine

log = logging.getLogger(__name__)

UNKNOWN_CLIENT_POLICIES = ("global", "404")
DTYPES = {"image": ("FP32", np.float32), "table": ("FP32", np.float32), "text": ("INT64", np.int64)}
MAX_BATCH = 1024  # rows per request: a bigger batch is split by the caller (each row is one input)
MAX_LOADS = 4  # models being loaded at once (each holds its file's bytes, up to MAX_SERVED_MODEL_BYTES, meanwhile)
# torch.export.load is not thread-safe: its deserializer is process-wide state (torch/_export/serde/serialize.py,
# `_CURRENT_DESERIALIZER`; two loads at once fail with "_CURRENT_DESERIALIZER is already set").
_DESERIALIZING = threading.Lock()


class ServingError(FedpipeError):
    """A request the predictor refuses: `status` is the HTTP status it answers with (400, 404, 413, 503)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ServeOptions:
    """How a line is served. `cache_size`: models held at once (>= 1); `unknown_client`: "global" or "404";
    `reload_seconds`: how stale the promoted version may get (0: checked on every request); `max_batch`: rows
    per request; `trust_unsigned`: serve a line read without signature checks."""

    cache_size: int = 32
    unknown_client: str = "global"
    reload_seconds: float = 30.0
    max_batch: int = MAX_BATCH
    trust_unsigned: bool = False

    def __post_init__(self):
        if not isinstance(self.cache_size, int) or self.cache_size < 1:
            raise FedpipeError(f"The model cache holds at least 1 model; got cache_size={self.cache_size!r}.")
        if self.unknown_client not in UNKNOWN_CLIENT_POLICIES:
            raise FedpipeError(f"unknown_client is one of {', '.join(UNKNOWN_CLIENT_POLICIES)} (serve the global model, or "
                               f"answer 404); got {self.unknown_client!r}.")
        if not (isinstance(self.reload_seconds, (int, float)) and 0 <= self.reload_seconds <= 86400):
            raise FedpipeError(f"reload_seconds is 0 to 86400 (0: check the promoted pointer on every request); got {self.reload_seconds!r}.")
        if not isinstance(self.max_batch, int) or not 1 <= self.max_batch <= 65536:
            raise FedpipeError(f"max_batch is 1 to 65536 rows; got {self.max_batch!r}.")


@dataclass(frozen=True)
class Prediction:
    """One request's answer: per row, the probabilities (softmax of the model's scores, in float64 as `fedpipe
    predict` computes them), the best label's index and name; which model answered."""

    probabilities: np.ndarray  # [N, classes] float64
    index: np.ndarray  # [N] int64
    labels: list[str]  # [N]
    client: str | None  # the client whose model answered (None: the global model)
    model: str  # "personalized" or "global"
    version: int
    asked: str | None = None  # the client the request named (a name with no model of its own: the global model answered)


def signed_or_trusted(line: ModelLine, trust_unsigned: bool, what: str = "predict") -> bool:
    """Whether the line's objects are verified against the signing key; an unsigned line is refused unless the
    user trusts whoever can write its store (`trust_unsigned`)."""
    from fedpipe.store.signed import ENV_ALLOW_UNSIGNED, ENV_SIGNING_KEY, ENV_SIGNING_KEY_FILE, verifies_signatures

    if verifies_signatures(line.store) or trust_unsigned:
        return verifies_signatures(line.store)
    why = (f"{ENV_ALLOW_UNSIGNED} lets unsigned objects through" if os.environ.get(ENV_ALLOW_UNSIGNED)
           else f"neither {ENV_SIGNING_KEY} nor {ENV_SIGNING_KEY_FILE} is set")
    raise FedpipeError(
        f"Model line {line.name!r} in {line.store.url()} is read without signature checks ({why}), so anyone who can "
        f"write that store could have replaced its models, and {what} refuses it. Set {ENV_SIGNING_KEY} (or "
        f"{ENV_SIGNING_KEY_FILE}) to the key the line's runs signed with; or, if you trust everyone who can write "
        "that store, pass --trust-unsigned.")


class ModelCache:
    """At most `size` loaded models, by served file; the least recently used goes first. Thread-safe: a model is
    loaded outside the cache's lock, once however many requests ask for it meanwhile (they share its future; a
    failed load fails them all and the next request tries again)."""

    def __init__(self, size: int):
        self.size, self.loads = size, 0
        self._models: OrderedDict[str, Any] = OrderedDict()
        self._loading: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._generation = 0  # bumped by clear(): a load begun before it is not cached after it

    def __len__(self) -> int:
        return len(self._models)

    def get(self, key: str, load) -> Any:
        with self._lock:
            if key in self._models:
                self._models.move_to_end(key)
                return self._models[key]
            pending = self._loading.get(key)
            if pending is None:
                pending = self._loading[key] = Future()
                generation, loader = self._generation, True
            else:
                loader = False
        if not loader:
            return pending.result()  # the load under way for this file: its model, or its error
        try:
            model = load()
        except BaseException as e:
            with self._lock:
                self._loading.pop(key, None)
            pending.set_exception(e)
            raise
        with self._lock:
            self._loading.pop(key, None)
            self.loads += 1
            if generation == self._generation:
                self._models[key] = model
                while len(self._models) > self.size:
                    self._models.popitem(last=False)
        pending.set_result(model)
        return model

    def clear(self) -> None:
        with self._lock:
            self._models.clear()
            self._generation += 1


class LinePredictor:
    """Serves `line` at `version` (pinned), or at its promoted version, followed (`version=None`)."""

    def __init__(self, line: ModelLine, version: int | None = None, options: ServeOptions | None = None):
        self.line, self.pinned, self.options = line, version, options or ServeOptions()
        self.signed = signed_or_trusted(line, self.options.trust_unsigned, "serving")
        self.cache = ModelCache(self.options.cache_size)
        self._lock = threading.Lock()  # guards (version, spec) and the reload clock; never held across a store read
        self._refreshing = False
        self._loads = threading.BoundedSemaphore(MAX_LOADS)
        self.version, self.spec = self._load_version(self._wanted())
        self._checked = time.monotonic()

    def _wanted(self) -> int:
        if self.pinned is not None:
            return self.pinned
        version = self.line.promoted()
        if version is None:
            raise FedpipeError(f"Model line {self.line.name!r} in {self.line.store.url()} has no promoted version to serve: "
                               f"promote one (`fedpipe models promote {self.line.name} VERSION`) or serve {self.line.name}@VERSION.")
        return version

    def _load_version(self, version: int) -> tuple[int, ServingSpec]:
        where = self.line.store.url(self.line.keys.version(version) + SPEC_FILE)
        spec = ServingSpec.from_bytes(self.line.read(version, SPEC_FILE, MAX_SPEC_BYTES), where)
        if spec.input_kind not in DTYPES:
            raise FedpipeError(f"{where}: input kind {spec.input_kind!r} cannot be served.")
        log.info("Serving model line %s version %d (%s, %d clients)", self.line.name, version, spec.method, len(spec.clients))
        return version, spec

    def refresh(self, now: float | None = None) -> None:
        """Follow the promoted pointer (when not pinned and the last check is older than reload_seconds). The store
        is read outside the lock, by one request at a time; the others are answered by the version served now."""
        if self.pinned is not None:
            return
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._refreshing or now - self._checked < self.options.reload_seconds:
                return
            self._checked, self._refreshing = now, True
        try:
            version = self._wanted()
            if version != self.version:
                loaded = self._load_version(version)
                with self._lock:
                    log.info("Model line %s: promoted version moved from %d to %d", self.line.name, self.version, version)
                    self.version, self.spec = loaded
                self.cache.clear()
        except FedpipeError as e:  # the store unreachable, a pointer or record that does not verify
            log.error("Model line %s: still serving version %d; the promoted version could not be read: %s",
                      self.line.name, self.version, e)
        finally:
            self._refreshing = False

    def served_file(self, client: str | None, spec: ServingSpec | None = None,
                    version: int | None = None) -> tuple[ServedFile, str | None]:
        """The file that answers for `client` (None: the global model) in `spec` (default: the version served now),
        and the client it is for (None: global)."""
        spec, version = (self.spec, self.version) if spec is None else (spec, version)
        if client is not None and client in spec.clients:
            return spec.clients[client], client
        if client is not None and (self.options.unknown_client == "404" or spec.global_model is None):
            known = ", ".join(list(spec.clients)[:10]) + (f", ... ({len(spec.clients)} in all)" if len(spec.clients) > 10 else "")
            fallback = ("this server answers 404 for unknown clients (--unknown-client 404)" if spec.global_model is not None
                        else f"{spec.method} has no global model to fall back on")
            raise ServingError(f"No client {client!r} has a model in model line {self.line.name!r} version {version}, and "
                               f"{fallback}. Name one of its clients: {known or 'none'}.", status=404)
        if spec.global_model is None:
            raise ServingError(f"{spec.method} has no global model: name a client (the 'client' parameter or the "
                               "Fedpipe-Client header).", status=400)
        return spec.global_model, None

    def _load(self, served: ServedFile, version: int):
        where = self.line.store.url(self.line.keys.version(version) + served.file)
        with self._loads:  # at most MAX_LOADS files in memory besides the cache's models
            data = self.line.read(version, served.file, MAX_SERVED_MODEL_BYTES)  # bounded, its registered sha256 checked
            with _DESERIALIZING:  # the store reads run side by side; torch's deserializers one at a time
                return load_exported(data, served.format, where, signed=self.signed)

    def rows(self, data: Any, shape: list[Any], datatype: str | None) -> torch.Tensor:
        """A raw input batch [N, *spec input shape] from a request's tensor: its shape, type and values checked."""
        spec = self.spec
        want_type, np_type = DTYPES[spec.input_kind]
        expected = ["N", *spec.input_shape]
        if datatype is not None and str(datatype).upper() != want_type:
            raise ServingError(f"The input's datatype is {datatype!r}; this model takes {want_type} ({spec.input_kind}: "
                               f"{_raw(spec)}).")
        if (not isinstance(shape, (list, tuple)) or len(shape) != len(expected)
                or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape) or list(shape[1:]) != list(spec.input_shape)):
            raise ServingError(f"The input's shape is {shape!r}; this model takes {expected} (N rows of {_raw(spec)}).")
        if not 1 <= shape[0] <= self.options.max_batch:
            raise ServingError(f"The input has {shape[0]} rows; send 1 to {self.options.max_batch} per request.")
        count = math.prod(shape)
        try:
            array = np.asarray(data, dtype=np_type)
        except (ValueError, TypeError, OverflowError):
            raise ServingError(f"The input's data are not {want_type} numbers: send a flat (or nested) list of {count} "
                               "numbers in row-major order.") from None
        if array.size != count:
            raise ServingError(f"The input's shape {shape} holds {count} values, but {array.size} were sent.")
        if spec.input_kind == "text":
            vocab = spec.vocab_size
            if array.min() < 0 or (vocab is not None and array.max() >= vocab):
                raise ServingError(f"Token ids are 0 to {(vocab or 1) - 1} (PAD 0, UNK 1, the training vocabulary); got "
                                   f"{int(array.min())} to {int(array.max())}.")
        elif not np.isfinite(array).all():
            raise ServingError("The input holds NaN or infinite values; send finite raw values.")
        return torch.from_numpy(np.ascontiguousarray(array.reshape(shape)))

    def predict(self, client: str | None, x: torch.Tensor) -> Prediction:
        """`x` (raw rows, see `rows`) through `client`'s model (None: the global model). Only the choice of the
        version is made under the lock: the model's load (a cache miss) and its forward pass are not."""
        self.refresh()
        with self._lock:
            version, spec = self.version, self.spec
        served, whose = self.served_file(client, spec, version)
        net = self.cache.get(f"{version}/{served.file}", lambda: self._load(served, version))
        with torch.no_grad():
            probs = torch.softmax(net(x).double(), dim=1)  # as `fedpipe predict`: float64 softmax of the scores
        index = probs.argmax(dim=1)
        labels = [spec.labels[i] if i < len(spec.labels) else str(i) for i in index.tolist()]
        return Prediction(probs.numpy(), index.numpy().astype(np.int64), labels, whose, "global" if whose is None else "personalized",
                          version, client)

    def client_of(self, parameter: Any, header: Any) -> str | None:
        """The client a request names, by its 'client' parameter or its Fedpipe-Client header (both: they must agree)."""
        named = [str(v) for v in (parameter, header) if v not in (None, "")]
        if parameter is not None and not isinstance(parameter, str):
            raise ServingError(f"The 'client' parameter is a client's name (a string); got {type(parameter).__name__}.")
        if len(set(named)) > 1:
            raise ServingError(f"The 'client' parameter ({parameter!r}) and the Fedpipe-Client header ({header!r}) name "
                               "different clients; send one.")
        if named and len(named[0]) > 1000:
            raise ServingError("A client's name is at most 1000 characters.")
        return named[0] if named else None


def _raw(spec: ServingSpec) -> str:
    from fedpipe.models.export import RAW_INPUT

    return RAW_INPUT[spec.input_kind].split(" as ")[0] if spec.input_kind in RAW_INPUT else spec.input_kind


def open_predictor(store_url: str, ref: str, options: ServeOptions) -> LinePredictor:
    """NAME (its promoted version, followed) or NAME@VERSION (pinned) in the store at `store_url`."""
    from fedpipe.store import open_store

    name, _, given = ref.partition("@")
    line = ModelLine(open_store(store_url), name)
    if not line.exists():
        raise StoreError(f"No model line {name!r} in {line.store.url()}: pass the store that holds it (--store).")
    if given and (not given.isdigit() or int(given) < 1):
        raise FedpipeError(f"{ref!r}: the version after '@' is a number 1, 2, ... (`fedpipe models list {name}`).")
    return LinePredictor(line, int(given) if given else None, options)


def open_folder(folder: str, ref: str, options: ServeOptions) -> LinePredictor:
    """NAME@VERSION from a folder holding that version's files as KServe's storage initializer downloads them."""
    from fedpipe.serving.folder import VersionFolder
    from fedpipe.store.signed import signing_from_env

    name, _, given = ref.partition("@")
    if not given.isdigit() or int(given) < 1:
        raise FedpipeError(f"{ref!r}: serving a downloaded folder (--folder) needs the version it holds, as NAME@VERSION.")
    line = ModelLine(signing_from_env()(VersionFolder(folder, name, int(given))), name)
    return LinePredictor(line, int(given), options)
