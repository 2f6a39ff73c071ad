"""Models exported for serving: loadable with torch alone, fed raw inputs.

A served model (`served_module`) holds its parameters and the normalisation constants as buffers; its
`forward(x)` takes what a server has at hand and applies what fedpipe's `prepare_data` applied before
training, then returns the method's `forward(params, x)` (logits; FedMoE's mixture: log-probabilities,
whose softmax is the same probabilities):

    images   float32 [N, C, H, W], pixels 0..255 (decoded, channels first)   -> (x / 255 - mean) / std per channel
    tables   float32 [N, F], the raw feature values                           -> (x - mean) / std per column
    text     int64   [N, T], token ids (PAD 0, UNK 1, right-padded)           -> as they are

spec.json's normalisation block records the mean and std baked in and their source (`data.standardisation`):
pooled (the clients' pooled training data), fixed (data-independent) or declared (the run config's constants).

It is saved with `torch.export` (a .pt2 archive: `torch.export.load(f).module()`); where a method's network
cannot be exported, with `torch.jit.trace` (TorchScript: `torch.jit.load(f)`), and `spec.json` says which
per file. fedpipe loads such a file back (`load_exported`: `fedpipe predict`, and each exporter's own check) only
after `safe_pt2` checked that it holds no pickle and no code, and TorchScript only from a signed line. The
batch dimension is dynamic. A client's feature shift (a simulation of its data) is not part of
its model: a server feeds the client's inputs as they come.

`export_run` exports a finished run: the global model (methods that have one) and every client's CHOSEN
personalized model, the candidate the run's evaluation picks on the client's validation split
(`evaluate_personalized`), on the CPU.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import warnings
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from fedpipe.algorithms.base import Algorithm, Params
from fedpipe.data.federated import DECLARED, FIXED, POOLED, input_standardisation, prepare_data
from fedpipe.engine.evaluation import eval_mode, evaluate_personalized
from fedpipe.errors import ArtifactSignatureError, CorruptArtifactError, FedpipeError
from fedpipe.models.safe_pt2 import checked_pt2
from fedpipe.safe_load import parse_json

if TYPE_CHECKING:
    from fedpipe.data.files.budget import DecodeBudget
    from fedpipe.run.run import Run

log = logging.getLogger(__name__)

SPEC_FORMAT = "fedpipe.serving-spec/1"
SPEC_FILE = "spec.json"
MAX_SPEC_BYTES = 64 * 2**20  # a spec lists every client: ~200 bytes each, 10,000 clients are ~2 MB
#: One served model file, read whole: the bundled networks export to well under 10 MB and a ResNet-50 to ~100 MB;
#: a larger network of one's own is served by loading its file with torch on a machine sized for it.
MAX_SERVED_MODEL_BYTES = 2 * 2**30
PT2, TORCHSCRIPT = "pt2", "torchscript"
SUFFIX = {PT2: ".pt2", TORCHSCRIPT: ".ts.pt"}
RAW_INPUT = {
    "image": "decoded pixels 0..255 as float32 [N, C, H, W] (channels first; RGB or grayscale as the spec's channels)",
    "table": "the raw feature values as float32 [N, F], in the training data's column order",
    "text": "token ids as int64 [N, T] (PAD 0, UNK 1, right-padded to T), from the training data's vocabulary",
}
NORMALISATION = {
    "image": "(x / 255 - mean[c]) / std[c] per channel c (baked into the model)",
    "table": "(x - mean[f]) / std[f] per feature column f (baked into the model)",
    "text": "none",
}
#: normalisation.source in spec.json: where the baked-in mean and std come from (`data.standardisation`).
NORMALISATION_SOURCES = {
    POOLED: "computed exactly from the opt-in clients' pooled training data (not covered by differential privacy)",
    FIXED: "data-independent constants: images (x / 255 - 0.5) / 0.5, table columns as they are",
    DECLARED: "constants declared in the run's config (data.input_mean, data.input_std)",
}


class ExportError(FedpipeError):
    """A model could not be exported by torch.export nor by torch.jit.trace."""


class ServedModel(nn.Module):
    """A method's model on raw inputs: the parameters and the normalisation as buffers, the method's own
    `forward` (the algorithm is held as a plain attribute, not a submodule: only what it reads is exported)."""

    def __init__(self, algorithm: Algorithm, params: Params, input_kind: str, normalisation: tuple | None):
        super().__init__()
        if input_kind not in RAW_INPUT:
            raise ValueError(f"input_kind must be one of {sorted(RAW_INPUT)}, not {input_kind!r}")
        self.algorithm, self.input_kind, self.names = algorithm, input_kind, list(params)
        for i, name in enumerate(self.names):
            self.register_buffer(f"param_{i}", params[name].detach().to("cpu").clone())
        if input_kind != "text":
            mean, std = (torch.as_tensor(np.asarray(v, dtype=np.float64), dtype=torch.float32) for v in normalisation)
            shape = (1, -1, 1, 1) if input_kind == "image" else (1, -1)
            self.register_buffer("mean", mean.reshape(shape))
            self.register_buffer("std", std.reshape(shape))

    def train(self, mode: bool = True) -> ServedModel:
        """The method's network follows (dropout, batch norm, FedMoE's gate read its mode): served models are in eval mode."""
        super().train(mode)
        self.algorithm.model.train(mode)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_kind == "image":
            x = x.div(255.0).sub(self.mean).div(self.std)  # prepare_data's float32 steps, in its order
        elif self.input_kind == "table":
            x = x.sub(self.mean).div(self.std)
        return self.algorithm.forward({n: getattr(self, f"param_{i}") for i, n in enumerate(self.names)}, x)


def served_module(algorithm: Algorithm, params: Params, input_kind: str, normalisation: tuple | None) -> nn.Module:
    """`params` (as `algorithm.forward` takes them) wrapped to take raw inputs of `input_kind` ("image",
    "table", "text"); `normalisation` is (mean, std) as `input_standardisation` gives them (None for text)."""
    return ServedModel(algorithm, params, input_kind, normalisation).eval()


@dataclass(frozen=True)
class Exported:
    data: bytes
    format: str  # "pt2" (torch.export.load(f).module()) or "torchscript" (torch.jit.load(f))
    exporter: str  # torch.export, torch.export.draft_export or torch.jit.trace


def export_model(module: nn.Module, example: torch.Tensor) -> Exported:
    """`module` exported with a dynamic batch dimension, by the first of these that works:

    - `torch.export.export`: a .pt2 archive (format "pt2");
    - `torch.export.draft_export` (also .pt2): for a network whose control flow reads its own parameters'
      values (FedMN's decision says which units run), traced on the real values, so the program is
      specialised to them (they are constants of a served model) and guarded by runtime asserts;
    - `torch.jit.trace`: TorchScript (format "torchscript").

    Each is checked: loaded back from its bytes it must give `module`'s outputs on `example` and on a batch
    of another size. `example` holds at least 2 raw inputs."""
    if len(example) < 2:
        raise ValueError("export_model needs an example batch of at least 2 inputs (a batch of 1 would fix the batch size)")
    with eval_mode(module), _quiet():
        expected = module(example)
        bigger = torch.cat([example, example[:1]])
        expected_bigger = module(bigger)
        failures = []
        for fmt, exporter, export, load in EXPORTERS:
            try:
                data = export(module, example)
                loaded = load(data)
                _check_same(loaded(example), expected)
                _check_same(loaded(bigger), expected_bigger)
            except Exception as e:  # noqa: BLE001 - any failure of an exporter means: try the next one
                failures.append(f"{exporter}: {type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}")
                continue
            if failures:
                log.info("Exported with %s after %s", exporter, "; ".join(failures))
            return Exported(data, fmt, exporter)
    raise ExportError("The model could not be exported for serving: " + "; ".join(failures)
                      + ". A model by import path must be traceable by torch.export or torch.jit.trace.")


@contextmanager
def _quiet():
    """torch's exporters log every guard they meet and print the graph of a failed attempt to stderr (noise
    when the next exporter works; a failure of all is reported by `export_model`): keep them out of the log."""
    before = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(), redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(before)


def _export_pt2(module: nn.Module, example: torch.Tensor, draft: bool = False) -> bytes:
    batch = torch.export.Dim("batch", min=1, max=2**20)
    export = torch.export.draft_export if draft else torch.export.export
    program = export(module, (example,), dynamic_shapes={"x": {0: batch}})
    buf = io.BytesIO()
    torch.export.save(program, buf)
    return buf.getvalue()


def _load_pt2(data: bytes) -> Any:
    # loaded as a server loads it (checked first): a program the check refuses is never exported as .pt2
    return load_exported(data, PT2, "the exported program", max_bytes=max(MAX_SERVED_MODEL_BYTES, 2 * len(data)))


def _load_own_torchscript(data: bytes) -> Any:
    return torch.jit.load(io.BytesIO(data), map_location="cpu")  # bytes this process just wrote, never a stranger's


def _export_torchscript(module: nn.Module, example: torch.Tensor) -> bytes:
    # torch.func.functional_call (every method's forward) refuses to run under the tracer, for fear of a
    # traced module whose parameters were swapped; here the swapped-in tensors ARE the traced module's
    # buffers, so the trace records reads of them. `export_model` checks the result against the module.
    real = torch.jit.is_tracing
    torch.jit.is_tracing = lambda: False
    try:
        traced = torch.jit.trace(module, (example,), check_trace=False)
    finally:
        torch.jit.is_tracing = real
    buf = io.BytesIO()
    torch.jit.save(traced, buf)
    return buf.getvalue()


EXPORTERS = (
    (PT2, "torch.export", _export_pt2, _load_pt2),
    (PT2, "torch.export.draft_export", lambda module, example: _export_pt2(module, example, draft=True), _load_pt2),
    (TORCHSCRIPT, "torch.jit.trace", _export_torchscript, _load_own_torchscript),
)


def _check_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
        raise ExportError(f"the exported model's outputs differ from the model's (shape {tuple(got.shape)} vs {tuple(expected.shape)})")


def load_exported(data: bytes, fmt: str, where: str, *, signed: bool = False, max_bytes: int | None = None) -> Any:
    """A callable model from an exported file's bytes, with torch alone (what a server does). A .pt2 archive is
    checked and rebuilt first (`safe_pt2`: no pickle, no code; its entries expand to at most `max_bytes`).
    TorchScript is loaded only when `signed` (its bytes verified against the line's signing key): torch.jit.load
    reads pickled data and compiles the code inside the file, which no check here can make safe."""
    if fmt == PT2:
        archive = checked_pt2(data, where, max_bytes or MAX_SERVED_MODEL_BYTES)
        return torch.export.load(io.BytesIO(archive)).module()
    if fmt == TORCHSCRIPT:
        if not signed:
            raise ArtifactSignatureError(
                f"{where} is TorchScript, which torch.jit.load runs code from, and it comes from a model line without "
                "signatures, so it is refused. Sign the line (set FEDPIPE_SIGNING_KEY or FEDPIPE_SIGNING_KEY_FILE for the "
                "runs that register it and for this command; the chart turns signing on by default) and register the run "
                "again; or, if you trust everyone who can write the store, load the file yourself with torch.jit.load.")
        return torch.jit.load(io.BytesIO(data), map_location="cpu").eval()
    raise CorruptArtifactError(f"unknown exported model format {fmt!r} (known: {PT2}, {TORCHSCRIPT})")


# --- the serving spec --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServedFile:
    """One exported model: its file (relative to the version's folder), how it was saved, whose it is."""

    file: str
    format: str  # pt2 or torchscript
    exporter: str
    client_id: int | None = None  # None: the global model
    candidate: float | None = None  # the value of the chosen candidate (SuPerFed's lam); None for the global model

    def to_json(self) -> dict:
        return {"file": self.file, "format": self.format, "exporter": self.exporter, "client_id": self.client_id,
                "candidate": self.candidate}


@dataclass(frozen=True)
class ServingSpec:
    """What a server needs to feed the exported models of a run (spec.json): the input, the labels, the files."""

    run_id: str
    method: str
    model: str
    input_kind: str  # image, table or text
    input_shape: tuple[int, ...]  # one input, raw: (C, H, W), (F,) or (T,)
    mean: tuple[float, ...] | None  # the normalisation (baked into every model; here for reference)
    std: tuple[float, ...] | None
    labels: tuple[str, ...]
    global_model: ServedFile | None
    clients: dict[str, ServedFile] = field(default_factory=dict)  # by client name (natural partitions) or id
    candidate_label: str | None = None
    vocab_size: int | None = None
    normalisation_source: str | None = None  # pooled, fixed or declared (NORMALISATION_SOURCES); None: text, or a spec of before

    def to_json(self) -> dict:
        dtype = "int64" if self.input_kind == "text" else "float32"
        return {
            "format": SPEC_FORMAT, "run_id": self.run_id, "method": self.method, "model": self.model,
            "input": {"kind": self.input_kind, "shape": ["N", *self.input_shape], "dtype": dtype, "raw": RAW_INPUT[self.input_kind],
                      "vocab_size": self.vocab_size, "resize": _resize_rule(self.input_kind, self.input_shape)},
            "normalisation": {"applied": NORMALISATION[self.input_kind], "mean": _floats(self.mean), "std": _floats(self.std),
                              "source": self.normalisation_source, "source_detail": NORMALISATION_SOURCES.get(self.normalisation_source)},
            "output": "scores [N, classes] whose softmax gives the class probabilities (logits; a mixture's log-probabilities)",
            "labels": list(self.labels), "candidate_label": self.candidate_label,
            "global_model": None if self.global_model is None else self.global_model.to_json(),
            "clients": {name: f.to_json() for name, f in self.clients.items()},
        }

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json(), indent=2).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> ServingSpec:
        """A spec read back (bounded, every field checked); a malformed one is a CorruptArtifactError naming `where`."""
        tree = parse_json(data, where, "serving spec", MAX_SPEC_BYTES, CorruptArtifactError)
        try:
            return _spec_of(tree)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CorruptArtifactError(f"{where} is not a valid serving spec ({type(e).__name__}: {e}); export the run again.") from None

    def served(self, client: str | None) -> ServedFile:
        """The file of `client`'s personalized model, or of the global model (None)."""
        if client is None:
            if self.global_model is None:
                raise FedpipeError(f"{self.method} has no global model; name a client (--client), one of: {_listed(self.clients)}.")
            return self.global_model
        if client not in self.clients:
            raise FedpipeError(f"No client {client!r} has a model here; the clients are: {_listed(self.clients)}.")
        return self.clients[client]


def _resize_rule(kind: str, shape: tuple[int, ...]) -> str | None:
    """How an image of another size becomes one input (what training did with data.image_size, and what
    `image_rows` does for files); None for tables and text."""
    if kind != "image":
        return None
    h, w = shape[-2:]
    return (f"an image of another size is resized to {w}x{h} (PIL's bilinear filter; the aspect ratio is not kept, nothing "
            f"is cropped or padded), as data.image_size did in training; a client sending tensors must send {h}x{w}")


def _floats(values: tuple[float, ...] | None) -> list[float] | None:
    return None if values is None else [float(v) for v in values]


def _listed(names) -> str:
    names = list(names)
    return ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "") if names else "none"


def _file_of(tree: dict) -> ServedFile:
    file, fmt = tree["file"], tree["format"]
    if not isinstance(file, str) or fmt not in (PT2, TORCHSCRIPT):
        raise ValueError(f"a model file entry needs a file name and a format ({PT2} or {TORCHSCRIPT})")
    client_id, candidate = tree.get("client_id"), tree.get("candidate")
    return ServedFile(file, fmt, str(tree.get("exporter", "")), None if client_id is None else int(client_id),
                      None if candidate is None else float(candidate))


def _spec_of(tree: Any) -> ServingSpec:
    if not isinstance(tree, dict) or tree.get("format") != SPEC_FORMAT:
        raise ValueError(f"not a {SPEC_FORMAT} object")
    inp, norm = tree["input"], tree["normalisation"]
    if inp["kind"] not in RAW_INPUT:
        raise ValueError(f"unknown input kind {inp['kind']!r}")
    source = norm.get("source")  # absent from the specs exported before it was recorded
    if source is not None and source not in NORMALISATION_SOURCES:
        raise ValueError(f"unknown normalisation source {source!r} (known: {', '.join(NORMALISATION_SOURCES)})")
    shape = tuple(int(d) for d in inp["shape"][1:])
    glob = tree.get("global_model")
    return ServingSpec(
        run_id=str(tree["run_id"]), method=str(tree["method"]), model=str(tree["model"]), input_kind=inp["kind"], input_shape=shape,
        mean=None if norm.get("mean") is None else tuple(float(v) for v in norm["mean"]),
        std=None if norm.get("std") is None else tuple(float(v) for v in norm["std"]),
        labels=tuple(str(v) for v in tree["labels"]), global_model=None if glob is None else _file_of(glob),
        clients={str(name): _file_of(f) for name, f in tree["clients"].items()}, candidate_label=tree.get("candidate_label"),
        vocab_size=inp.get("vocab_size"), normalisation_source=source,
    )


# --- a finished run -----------------------------------------------------------------------------------


def client_file_stems(names: list[str]) -> list[str]:
    """A file name (without suffix) per client name: the name itself where it is a safe key segment that no
    other name matches case-insensitively, else a slug of it and a hash of the whole name."""
    folded = [n.lower() for n in names]
    stems = []
    for name, low in zip(names, folded):
        if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", name) and folded.count(low) == 1 and not low.endswith((".pt", ".pt2")):
            stems.append(name)
        else:
            slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")[:60] or "client"
            stems.append(f"{slug}-{hashlib.sha256(name.encode('utf-8')).hexdigest()[:12]}")
    return stems


def _digest(params: Params) -> str:
    """The identity of a model's parameters (names, dtypes, shapes and bytes): equal models export once."""
    h = hashlib.sha256()
    for name in sorted(params):
        t = params[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _example(bundle) -> torch.Tensor:
    """Two raw inputs of the training data (as a server would feed them): the exporters' example batch."""
    x = bundle.train.x[:2]
    if len(x) < 2:
        x = np.concatenate([x, x])[:2]
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64 if bundle.is_text else np.float32))


def export_run(run: Run) -> tuple[dict[str, bytes], ServingSpec, tuple[str, ...]]:
    """(files, spec, clients) of a finished run, from its last phase's final state, on the CPU: `global.pt2`
    (methods with a global model), `clients/<client>.pt2` per client (its chosen personalized model: the
    candidate `evaluate_personalized` picks on its validation split), and `spec.json`; a model exported by
    TorchScript ends in `.ts.pt` instead. `clients` are the clients' names (natural partitions) or ids as
    text, in the order of their ids. The run's state (state.pt) is not among the files: that is the run's."""
    cpu = torch.device("cpu")
    state = run.checkpoints(run.phases()[-1].name).load_final(cpu)
    algorithm, _ = run.build_algorithm(cpu)
    partition = run.load_partition()
    chosen = run.cfg.standardisation()  # the run's own choice: its models were trained on inputs standardised so
    kind, mean, std = input_standardisation(run.bundle, partition, chosen)
    normalisation = None if kind == "text" else (mean, std)
    example = _example(run.bundle)
    exported: dict[str, Exported] = {}  # by the parameters' digest: clients with the very same model export once

    def export(params: Params) -> Exported:
        digest = _digest(params)
        if digest not in exported:
            exported[digest] = export_model(served_module(algorithm, params, kind, normalisation), example)
        return exported[digest]

    files: dict[str, bytes] = {}
    glob = algorithm.global_model(state.server)
    global_file = None
    if glob is not None:
        e = export(glob)
        global_file = ServedFile("global" + SUFFIX[e.format], e.format, e.exporter)
        files[global_file.file] = e.data
    data = prepare_data(run.bundle, partition, cpu, chosen)
    result = evaluate_personalized(algorithm, state.server, state.clients, data, run.cfg.eval.batch_size, run.cfg.eval.ece_bins,
                                   candidates=run.cfg.eval.candidates)
    names = [partition.client_names[c.client_id] if partition.client_names else str(c.client_id) for c in result.clients]
    clients: dict[str, ServedFile] = {}
    for c, name, stem in zip(result.clients, names, client_file_stems(names)):
        candidates = algorithm.personalized_candidates(state.server, state.clients.get(c.client_id), c.client_id)
        e = export(candidates[c.chosen][1])
        clients[name] = ServedFile(f"clients/{stem}{SUFFIX[e.format]}", e.format, e.exporter, c.client_id, float(c.candidates[c.chosen]))
        files[clients[name].file] = e.data
    bundle = run.bundle
    shape = (int(bundle.train.x.shape[1]),) if kind == "text" else tuple(int(d) for d in bundle.input_shape)
    spec = ServingSpec(run.layout.run_id, run.cfg.method.name, run.cfg.model_name(bundle.input_shape), kind, shape,
                       None if mean is None else tuple(np.float32(mean).tolist()), None if std is None else tuple(np.float32(std).tolist()),
                       tuple(bundle.class_names), global_file, clients, algorithm.candidate_label, bundle.vocab_size,
                       None if kind == "text" else chosen.source)
    files[SPEC_FILE] = spec.to_bytes()
    log.info("Exported %s: %s", run.layout.run_id, ", ".join(sorted({f"{e.exporter} ({e.format})" for e in exported.values()})))
    return files, spec, tuple(names)


# --- raw inputs from files (`fedpipe predict`) ------------------------------------------------------------

MAX_INPUT_FILE_BYTES = 64 * 2**20


def read_inputs(spec: ServingSpec, paths: list[str], budget: DecodeBudget | None = None) -> tuple[list[str], torch.Tensor]:
    """(what each row is, the raw input batch) of files as `spec`'s models take them: an image file (PNG or
    JPEG, converted to the spec's channels and resized to its size) is one row, named by its path; a CSV of
    feature rows (a header line is skipped) gives one row per line, named path:line. Images are decoded within
    `budget`, as the data readers decode a drop (`data.max_decoded_mb`; default auto): what decoding one needs
    must fit what is left, and each row kept (float32) is charged; the first image past it is an error naming it."""
    from fedpipe.data.files.budget import DecodeBudget
    from fedpipe.data.files.images import decode_image
    from fedpipe.data.files.rows import Problems

    if budget is None and spec.input_kind == "image":
        budget = DecodeBudget()
    names, rows = [], []
    for path in paths:
        data = _read_input_file(path)
        if spec.input_kind == "image":
            channels, height, width = spec.input_shape
            problems = Problems()
            image = decode_image(data, path, channels, height if height == width else None, problems, budget)
            if image is None or not budget.charge(channels * height * width * 4, path, "its input row (float32)", problems):
                raise FedpipeError("; ".join(str(p) for p in problems.errors) or f"{path} is not a readable image.")
            if image.shape != (channels, height, width):
                raise FedpipeError(f"{path} is {image.shape[2]}x{image.shape[1]} pixels; the model takes {width}x{height}. "
                                   "Resize it first.")
            names.append(path)
            rows.append(torch.from_numpy(image.astype(np.float32)))
        elif spec.input_kind == "table":
            for line, values in _csv_rows(data, path, spec.input_shape[0]):
                names.append(f"{path}:{line}")
                rows.append(torch.tensor(values, dtype=torch.float32))
        else:
            raise FedpipeError(f"{spec.model} takes token ids; `fedpipe predict` reads images and tables. Feed the exported "
                               "model int64 token ids [N, T] of the training vocabulary (spec.json says how).")
    if not rows:
        raise FedpipeError(f"No inputs in {', '.join(paths) or 'no files'}: give image files or CSV files of feature rows.")
    return names, torch.stack(rows)


def _read_input_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_INPUT_FILE_BYTES + 1)
    except OSError as e:
        raise FedpipeError(f"Cannot read {path}: {e.strerror or e}.") from None
    if len(data) > MAX_INPUT_FILE_BYTES:
        raise FedpipeError(f"{path} is larger than {MAX_INPUT_FILE_BYTES // 2**20} MiB; split it.")
    return data


def _csv_rows(data: bytes, path: str, features: int) -> list[tuple[int, list[float]]]:
    """(line number, values) of every non-empty CSV line; the first line is a header when it is not numbers."""
    import csv

    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise FedpipeError(f"{path} is not UTF-8 text: give a CSV file of feature rows.") from None
    out = []
    for number, cells in enumerate(csv.reader(io.StringIO(text)), start=1):
        if not cells or all(not c.strip() for c in cells):
            continue
        try:
            values = [float(c) for c in cells]
        except ValueError:
            if number == 1:
                continue  # a header
            raise FedpipeError(f"{path}:{number} holds a value that is not a number: {cells[:5]}.") from None
        if len(values) != features or not all(np.isfinite(values)):
            raise FedpipeError(f"{path}:{number} has {len(values)} values; the model takes {features} finite feature values "
                               "per row, in the training data's column order.")
        out.append((number, values))
    return out
