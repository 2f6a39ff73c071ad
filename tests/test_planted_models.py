"""A bucket writer plants a served model in a model line (issue 30, item 1): a `.pt2` whose weights are a pickle,
whose shape expression is Python, a TorchScript file, each hash-consistent (the file's sha256 recomputed in
version.json, the record's in the promoted pointer, through the store so its own hashes agree) and unsigned.
`fedpipe predict` refuses each before torch runs anything of it (the payload would create a marker file), and
refuses an unsigned line unless --trust-unsigned; the gate and a warm start never load a served file at all."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from fedpipe.cli import app
from fedpipe.errors import ConfigError, CorruptArtifactError
from fedpipe.models.export import (
    PT2,
    SPEC_FILE,
    TORCHSCRIPT,
    ServedFile,
    ServingSpec,
    _export_torchscript,
    export_model,
    served_module,
)
from fedpipe.models.line import ModelLine, ModelSpec, VersionRecord
from fedpipe.models.safe_pt2 import checked_pt2
from fedpipe.store import open_store
from fedpipe.store.signed import ENV_SIGNING_KEY

KEY = "k" * 40
ROOT = "archive/"
WEIGHTS = f"{ROOT}data/weights/model_weights_config.json"


class Linear:  # an algorithm as far as serving needs one: a network and forward(params, x)
    model = torch.nn.Identity()

    def forward(self, params, x):
        return x @ params["w"]


def _module():
    return served_module(Linear(), {"w": torch.arange(12.0).reshape(4, 3) / 10}, "table", (np.zeros(4), np.ones(4)))


@pytest.fixture(scope="module")
def exported() -> dict[str, bytes]:
    example = torch.ones(2, 4)
    return {PT2: export_model(_module(), example).data, TORCHSCRIPT: _export_torchscript(_module(), example)}


class OpensMarker:
    """A pickle whose loading creates `path` (what a real payload would do with os.system)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _zip_entries(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {info.filename: z.read(info) for info in z.infolist()}


def _zipped(entries: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        for name, data in entries.items():
            z.writestr(name, data)
    return buffer.getvalue()


def pickled_weight(data: bytes, marker: Path) -> bytes:
    """The archive with its first weight stored as a pickle (`use_pickle: true`) that creates `marker`."""
    entries = _zip_entries(data)
    config = json.loads(entries[WEIGHTS])
    meta = next(iter(config["config"].values()))
    meta["use_pickle"] = True
    entries[WEIGHTS] = json.dumps(config).encode()
    entries[f"{ROOT}data/weights/{meta['path_name']}"] = pickle.dumps(OpensMarker(marker))
    return _zipped(entries)


def python_shape(data: bytes, marker: Path) -> bytes:
    """The archive with a shape expression that sympy evaluates as Python, creating `marker`."""
    entries = _zip_entries(data)
    program = entries[f"{ROOT}models/model.json"].decode()
    symbol = program[program.index("Symbol('"):program.index(")", program.index("Symbol('")) + 1]
    entries[f"{ROOT}models/model.json"] = program.replace(symbol, f"open('{marker}', 'w') and {symbol}", 1).encode()
    return _zipped(entries)


def _line(store_url: str, files: dict[str, bytes], fmt: str = PT2) -> ModelLine:
    """A promoted version 1 serving `files["global"]` (a table model of 4 features, 3 labels)."""
    file = "global" + (".pt2" if fmt == PT2 else ".ts.pt")
    spec = ServingSpec("run-a", "fedavg", "tabular_mlp", "table", (4,), (0.0,) * 4, (1.0,) * 4, ("a", "b", "c"),
                       ServedFile(file, fmt, "test"))
    line = ModelLine(open_store(store_url), "served")
    record = VersionRecord(0, "run-a", ModelSpec("tabular_mlp", "fedavg", (4,), 3, ("a", "b", "c")), "method:\n  name: fedavg\n",
                           None, {}, ())
    line.promote(line.register(record, {file: files[fmt], SPEC_FILE: spec.to_bytes()}).version, "test")
    return line


def rewrite_record(line: ModelLine, version: int, edit) -> None:
    """Edit a version's record as a bucket writer would: the record's sha256 in the promoted pointer recomputed,
    every object written through the store (so its own hashes agree)."""
    store, keys = line.store, line.keys
    record = json.loads(store.get(keys.record(version)))
    edit(record)
    text = json.dumps(record).encode()
    store.put(keys.record(version), text)
    pointer = json.loads(store.get(keys.pointer))
    pointer["record_sha256"] = hashlib.sha256(text).hexdigest()
    store.put(keys.pointer, json.dumps(pointer).encode())
    assert ModelLine(open_store(store.url()), line.name).promoted() == version  # consistent: the line still reads


def plant(line: ModelLine, file: str, data: bytes, version: int = 1) -> None:
    """Replace a file of the promoted version, its sha256 in version.json recomputed (`rewrite_record`)."""
    line.store.put(line.keys.version(version) + file, data)
    rewrite_record(line, version, lambda record: record["files"].update({file: hashlib.sha256(data).hexdigest()}))


def predict(store: str, tmp_path: Path, *flags: str):
    rows = tmp_path / "rows.csv"
    rows.write_text("1,2,3,4\n0,0,0,1\n")
    return CliRunner().invoke(app, ["predict", *flags, "--model", "served", "--store", store, str(rows)])


@pytest.mark.parametrize("plant_with, refusal", [(pickled_weight, "stored as a pickle"), (python_shape, "shape expression")],
                         ids=["pickled-weight", "python-shape"])
def test_predict_refuses_a_planted_pt2_without_running_it(tmp_path, exported, plant_with, refusal):
    marker = tmp_path / "marker"
    line = _line(str(tmp_path / "store"), exported)
    plant(line, "global.pt2", plant_with(exported[PT2], marker))
    done = predict(str(tmp_path / "store"), tmp_path, "--trust-unsigned")
    assert not marker.exists(), "the planted payload ran"
    assert done.exit_code != 0 and refusal in done.output and "global.pt2 is refused" in done.output, done.output
    done = predict(str(tmp_path / "store"), tmp_path)  # without the flag: refused before reading any model file
    assert done.exit_code != 0 and "pass --trust-unsigned" in done.output and "FEDPIPE_SIGNING_KEY" in done.output, done.output
    assert not marker.exists()


def test_predict_loads_torchscript_only_from_a_signed_line(tmp_path, exported, monkeypatch):
    marker = tmp_path / "marker"
    real = torch.jit.load
    monkeypatch.setattr(torch.jit, "load", lambda *a, **k: (marker.touch(), real(*a, **k))[1])  # a load is what runs code
    _line(str(tmp_path / "plain"), exported, TORCHSCRIPT)
    done = predict(str(tmp_path / "plain"), tmp_path, "--trust-unsigned")
    assert not marker.exists(), "torch.jit.load ran on an unsigned line's file"
    assert done.exit_code != 0 and "is TorchScript" in done.output and "Sign the line" in done.output, done.output
    monkeypatch.setenv(ENV_SIGNING_KEY, KEY)
    _line(str(tmp_path / "signed"), exported, TORCHSCRIPT)
    done = predict(str(tmp_path / "signed"), tmp_path)
    assert done.exit_code == 0 and len(done.output.strip().splitlines()) == 2, done.output
    assert marker.exists()


def test_predict_reads_a_signed_line_and_an_unsigned_one_only_when_trusted(tmp_path, exported, monkeypatch):
    _line(str(tmp_path / "plain"), exported)
    assert predict(str(tmp_path / "plain"), tmp_path).exit_code != 0
    trusted = predict(str(tmp_path / "plain"), tmp_path, "--trust-unsigned")
    assert trusted.exit_code == 0 and [r.split()[1] for r in trusted.output.strip().splitlines()] == ["c", "c"], trusted.output
    monkeypatch.setenv(ENV_SIGNING_KEY, KEY)
    _line(str(tmp_path / "signed"), exported)
    assert predict(str(tmp_path / "signed"), tmp_path).output == trusted.output


def _mutated(data: bytes, change) -> bytes:
    entries = _zip_entries(data)
    change(entries)
    return _zipped(entries)


def _program(entries: dict, edit) -> None:
    tree = json.loads(entries[f"{ROOT}models/model.json"])
    edit(tree)
    entries[f"{ROOT}models/model.json"] = json.dumps(tree).encode()


def _constant(entries: dict, path_name: str) -> None:
    entries[f"{ROOT}data/constants/model_constants_config.json"] = json.dumps(
        {"config": {"c": {"path_name": path_name, "is_param": False, "use_pickle": False, "tensor_meta": {}}}}).encode()
    entries[f"{ROOT}data/constants/{path_name}"] = b"x"


def _spec_type(tree: dict, kind: str) -> None:
    signature = tree["graph_module"]["module_call_graph"][0]["signature"]
    signature["in_spec"] = json.dumps([1, {"type": kind, "context": '{"__enum__": true, "fqn": "os:path"}', "children_spec": []}])


MUTATIONS = {
    "guards-code": (lambda e: _program(e, lambda t: t.update(guards_code=["__import__('os').system('true')"])), "guard code"),
    "custom-object": (lambda e: _constant(e, "custom_obj_0"), "not a raw tensor file"),
    "opaque-object": (lambda e: _constant(e, "opaque_obj_0"), "not a raw tensor file"),
    "legacy-weights": (lambda e: e.update({f"{ROOT}data/weights/model.pt": b"pickle"}), "never write"),
    "extra-file": (lambda e: e.update({f"{ROOT}extra/notes": b"hi"}), "never write"),
    "outside-root": (lambda e: e.update({"../escape": b"x"}), "one root folder"),
    "quote-in-name": (lambda e: _program(e, lambda t: t["graph_module"]["signature"]["input_specs"][0]["buffer"].update(
        buffer_name='w")or print("x')), "not a plain name"),
    "defaultdict-spec": (lambda e: _program(e, lambda t: _spec_type(t, "collections.defaultdict")), "pytree node"),
    "enum-context": (lambda e: _program(e, lambda t: _spec_type(t, "builtins.tuple")), "context"),
    "power": (lambda e: _program(e, lambda t: t.update(range_constraints={}, graph_module={**t["graph_module"], "x": {
        "expr_str": "9**9**9**9"}})), "power"),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_every_way_torch_would_run_code_is_refused(exported, name):
    change, refusal = MUTATIONS[name]
    with pytest.raises(CorruptArtifactError, match=refusal):
        checked_pt2(_mutated(exported[PT2], change), "global.pt2", 2**30)


def test_the_archive_is_bounded(exported):
    with pytest.raises(CorruptArtifactError, match="expand to more than 1,000 bytes"):
        checked_pt2(exported[PT2], "global.pt2", 1000)
    with pytest.raises(CorruptArtifactError, match="not a .pt2 .zip. archive"):
        checked_pt2(b"PK\x03\x04 not a zip", "global.pt2", 2**30)
    twice = io.BytesIO()
    with zipfile.ZipFile(twice, "w") as z:
        for name, data in [*_zip_entries(exported[PT2]).items(), (f"{ROOT}models/model.json", b"{}")]:
            z.writestr(name, data)
    with pytest.raises(CorruptArtifactError, match="stored twice"):
        checked_pt2(twice.getvalue(), "global.pt2", 2**30)


EVIL = "open({marker!r}, 'w')  # what importing a planted package can do\n\n\ndef build(input_shape, num_classes):\n    pass\n"


def _tiny_cfg(store: Path, run_id: str, *sets: str):
    from runs import SMALL

    from fedpipe.run.config import load_config

    return load_config(None, [*SMALL, "data.dataset=digits", "partition.num_clients=4", "train.rounds=1", "method.name=fedavg",
                              "run.threads=1", "registry.name=planted", f"run.store={store}", f"run.id={run_id}", *sets])


def test_the_gate_and_a_warm_start_run_nothing_a_bucket_writer_plants(tmp_path, exported, monkeypatch):
    """A pickled global.pt2 in the promoted version: a warm start from it and the gate against it never load a served
    file. Then its record names a model by import path (a package installed here whose import would run code): the
    gate refuses it before importing anything, since FEDPIPE_MODEL_PACKAGES is unset (fail closed)."""
    from fedpipe.models.publish import publish
    from fedpipe.models.warm import attach, pin_init_from
    from fedpipe.run.run import Run

    store, marker, imported = tmp_path / "runs", tmp_path / "marker", tmp_path / "imported"
    publish(_run_all(Run(_tiny_cfg(store, "first"))))
    line = ModelLine(open_store(str(store)), "planted")
    plant(line, "global.pt2", pickled_weight(exported[PT2], marker))
    warm = attach(Run(pin_init_from(_tiny_cfg(store, "warm", "train.init_from=promoted"))))
    assert warm.cfg.train.init_from == "1"
    publish(_run_all(warm))  # the warm start reads state.pt (weights only); the gate scores version 1 from it too
    assert not marker.exists() and line.versions() == [1, 2]
    (tmp_path / "site" / "evilnets").mkdir(parents=True)
    (tmp_path / "site" / "evilnets" / "__init__.py").write_text(EVIL.format(marker=str(imported)))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delenv("FEDPIPE_MODEL_PACKAGES", raising=False)
    promoted = line.promoted()
    rewrite_record(line, promoted, lambda record: record["spec"].update(model="evilnets:build"))
    with pytest.raises(ConfigError) as refused:
        publish(_run_all(Run(_tiny_cfg(store, "cold"))))
    assert not imported.exists(), "the planted model name was imported"
    assert re.search(r"version \d's record names its model by import path, and it is refused: .*FEDPIPE_MODEL_PACKAGES is "
                     "unset or empty", str(refused.value)), refused.value
    assert line.versions() == [1, 2] and line.promoted() == promoted


def _run_all(run):
    run.run_all()
    return run
