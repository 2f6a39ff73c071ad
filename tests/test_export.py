"""Models exported for serving (fedpipe.models.export): for every method, a tiny real run is exported, and every
exported file is loaded in a fresh Python that cannot import fedpipe, with torch alone, fed each client's RAW test
inputs (pixels 0..255, raw feature values), and must predict exactly what fedpipe's evaluation of that client's
chosen model predicts; then `fedpipe predict` on image files and on a CSV of table rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from own_data import SITES, breast_cancer_table, write_digit_folders
from runs import small_run, train_all
from typer.testing import CliRunner

from fedpipe.algorithms import ALGORITHMS
from fedpipe.data.federated import FEATURE_SHIFTS, input_standardisation, prepare_data
from fedpipe.engine.evaluation import eval_mode, evaluate_personalized, predict
from fedpipe.errors import FedpipeError
from fedpipe.models.export import SPEC_FILE, ServingSpec, export_model, export_run, served_module
from fedpipe.models.line import ModelLine, ModelSpec, VersionRecord
from fedpipe.run.config import load_config, with_data_snapshot
from fedpipe.run.run import Run

# 4 clients with two classes each, 2 rounds (SuPerFed: one per phase): personalized models differ from the global one
TINY = ["data.dataset=digits", "model.name=twonn", "partition.scheme=pathological", "partition.num_clients=4", "train.rounds=2",
        "train.lr=0.05", "run.threads=1", "engine.clients=sequential"]
EXTRA = {"superfed_mm": ["method.start_fraction=0.5"], "superfed_lm": ["method.start_fraction=0.5"]}
SAME_AS_GLOBAL = {"fedavg", "fedprox"}  # their personalized model is the global model itself

# Run with `python -I -S`: no site-packages, so not fedpipe's editable install; torch's folder is added by hand.
LOADER = """
import sys
sys.path.append(sys.argv[1])
try:
    import fedpipe  # noqa: F401
except ImportError:
    pass
else:
    sys.exit("fedpipe is importable here; the test would prove nothing")
import torch

job = torch.load(sys.argv[2])
out = {}
for key, (path, fmt) in job["models"].items():
    model = torch.export.load(path).module() if fmt == "pt2" else torch.jit.load(path)
    with torch.no_grad():
        for name, x in job["inputs"][key].items():
            out[key + "|" + name] = model(x).argmax(1)
torch.save(out, sys.argv[3])
"""


def _load_without_fedpipe(tmp_path: Path, files: dict[str, bytes], spec: ServingSpec, inputs: dict[str, dict[str, torch.Tensor]]) -> dict:
    """{model key|input name: argmax} from the exported files, loaded by torch alone in a fresh process.
    `inputs`: per model key ("global" or a client's name), named raw input batches."""
    folder = tmp_path / "served"
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    served = {"global": spec.global_model} if spec.global_model else {}
    served.update(spec.clients)
    job = {"models": {k: [str(folder / f.file), f.format] for k, f in served.items() if k in inputs}, "inputs": inputs}
    torch.save(job, tmp_path / "job.pt")
    (tmp_path / "loader.py").write_text(LOADER)
    site = str(Path(torch.__file__).parents[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    done = subprocess.run([sys.executable, "-I", "-S", str(tmp_path / "loader.py"), site, str(tmp_path / "job.pt"), str(tmp_path / "out.pt")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return torch.load(tmp_path / "out.pt")


def _reference(run: Run):
    """fedpipe's own evaluation of the run, independent of the export: (algorithm, state, partition, data, result)."""
    cpu = torch.device("cpu")
    state = run.checkpoints(run.phases()[-1].name).load_final(cpu)
    algorithm, _ = run.build_algorithm(cpu)
    partition = run.load_partition()
    data = prepare_data(run.bundle, partition, cpu)
    return algorithm, state, partition, data, evaluate_personalized(algorithm, state.server, state.clients, data, 1000, 15)


def _raw(bundle, rows: np.ndarray, transform: str | None) -> torch.Tensor:
    x = bundle.train.x[rows]
    x = FEATURE_SHIFTS[transform](x) if transform else x
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64 if bundle.is_text else np.float32))


def _check_served_like_fedpipe(tmp_path: Path, run: Run) -> tuple[dict[str, bytes], ServingSpec]:
    """Export `run`; every file, loaded without fedpipe, predicts each client's raw test inputs (and one input
    alone) as fedpipe's evaluation of the client's chosen model does, and the global model the global test set."""
    files, spec, clients = export_run(run)
    algorithm, state, partition, data, result = _reference(run)
    names = [partition.client_names[c.client_id] if partition.client_names else str(c.client_id) for c in result.clients]
    assert clients == tuple(names) == tuple(spec.clients) and SPEC_FILE in files
    assert ServingSpec.from_bytes(files[SPEC_FILE], "spec.json") == spec
    inputs, expected = {}, {}
    with eval_mode(algorithm.model):
        for c, name, client in zip(result.clients, names, partition.clients):
            assert spec.clients[name].client_id == c.client_id and spec.clients[name].candidate == c.candidates[c.chosen]
            chosen = algorithm.personalized_candidates(state.server, state.clients.get(c.client_id), c.client_id)[c.chosen][1]
            raw = _raw(run.bundle, client.test, client.transform)
            inputs[name] = {"test": raw, "one": raw[:1]}
            expected[f"{name}|test"] = predict(algorithm, chosen, data.clients[c.client_id].test.x, 1000).argmax(1)
            expected[f"{name}|one"] = expected[f"{name}|test"][:1]
        glob = algorithm.global_model(state.server)
        assert (glob is None) == (spec.global_model is None)
        if glob is not None and partition.global_test_indices is not None:
            inputs["global"] = {"test": _raw(run.bundle, partition.global_test_indices, None)}
            expected["global|test"] = predict(algorithm, glob, data.global_test.x, 1000).argmax(1)
    got = _load_without_fedpipe(tmp_path, files, spec, inputs)
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
    return files, spec


@pytest.mark.parametrize("method", list(ALGORITHMS))
def test_every_methods_exported_models_predict_raw_inputs_as_fedpipe_does(tmp_path, method):
    run = small_run(tmp_path / "runs", f"method.name={method}", *TINY, *EXTRA.get(method, []))
    train_all(run)
    files, spec = _check_served_like_fedpipe(tmp_path, run)
    formats = sorted({f"{f.format} ({f.exporter})" for f in [*spec.clients.values(), *([spec.global_model] if spec.global_model else [])]})
    print(f"\nexport of {method}: {', '.join(formats)}")
    client_bytes = {files[f.file] for f in spec.clients.values()}
    if method in SAME_AS_GLOBAL:
        assert client_bytes == {files[spec.global_model.file]}
    else:  # personalized: some client's model is its own (not the global model's, not every other client's)
        assert len(client_bytes) > 1 or (spec.global_model is not None and client_bytes != {files[spec.global_model.file]})
    assert spec.input_kind == "image" and spec.input_shape == (1, 8, 8) and spec.labels == tuple(run.bundle.class_names)
    kind, mean, std = input_standardisation(run.bundle, run.load_partition())
    assert spec.mean == tuple(np.float32(mean).tolist()) and spec.std == tuple(np.float32(std).tolist())


def test_feature_shifted_clients_are_served_their_raw_inputs(tmp_path):
    run = small_run(tmp_path / "runs", "method.name=fedper", *TINY, "partition.feature_shift=[rotate90, flip]")
    train_all(run)
    _check_served_like_fedpipe(tmp_path, run)


def _files_run(tmp_path: Path, source: Path, *sets: str) -> Run:
    from fedpipe.data.files.init import init_manifest, write_manifest

    manifest, _ = init_manifest(str(source), client_column="branch" if source.name == "table" else None,
                                label_column="diagnosis" if source.name == "table" else None)
    write_manifest(str(source), manifest)
    cfg = load_config(None, ["data.dataset=files", f"data.source={source}", "partition.scheme=natural", "train.batch_size=20",
                             "telemetry.progress=false", "engine.clients=sequential", "run.threads=1", "train.rounds=2",
                             "train.lr=0.05", f"run.store={tmp_path / 'runs'}", "registry.name=served", *sets])
    return Run(with_data_snapshot(cfg))


def _register(run: Run, files: dict[str, bytes], clients: tuple[str, ...]) -> ModelLine:
    line = ModelLine(run.store, run.cfg.registry.name)
    record = VersionRecord(0, run.layout.run_id, ModelSpec.of_run(run), run.cfg.to_yaml(), run.bundle.snapshot, {}, clients)
    line.promote(line.register(record, files).version, "test")
    return line


def test_a_table_model_takes_raw_feature_rows_and_predicts_a_csv(tmp_path):
    breast_cancer_table(tmp_path / "table" / "patients.parquet")
    run = _files_run(tmp_path, tmp_path / "table", "method.name=fedper")
    train_all(run)
    files, spec = _check_served_like_fedpipe(tmp_path, run)
    assert spec.input_kind == "table" and spec.input_shape == (30,) and set(spec.clients) == {f"branch-{b}" for b in range(4)}
    _, _, partition, data, result = _reference(run)
    _register(run, files, tuple(spec.clients))
    client = partition.clients[2]
    raw = run.bundle.train.x[client.test[:5]]
    csv = tmp_path / "rows.csv"
    csv.write_text("f" + ",f".join(map(str, range(30))) + "\n" + "\n".join(",".join(repr(float(v)) for v in row) for row in raw) + "\n")
    done = CliRunner().invoke(app_(), ["predict", "--trust-unsigned", "--model", "served", "--client", "branch-2", "--store", str(run.store.url()), str(csv)])
    assert done.exit_code == 0, done.output
    lines = done.output.strip().splitlines()
    assert [line.split()[0] for line in lines] == [f"{csv}:{n}" for n in range(2, 7)]
    served = torch.export.load(tmp_path / "served" / spec.clients["branch-2"].file).module()
    expected = served(torch.from_numpy(raw)).argmax(1)
    assert [line.split()[1] for line in lines] == [spec.labels[i] for i in expected]


def test_predict_reads_image_files_for_a_sites_model(tmp_path):
    source = write_digit_folders(tmp_path / "sites", limit=600)
    run = _files_run(tmp_path, source, "method.name=fedper")
    train_all(run)
    files, spec, clients = export_run(run)
    assert clients == SITES[: len(clients)] and spec.input_shape == (1, 8, 8)
    _register(run, files, clients)
    pngs = sorted((source / SITES[0]).rglob("*.png"))[:4]
    runner = CliRunner()
    done = runner.invoke(app_(), ["predict", "--trust-unsigned", "--model", "served@1", "--client", SITES[0], "--store", str(run.store.url()), *map(str, pngs)])
    assert done.exit_code == 0, done.output
    rows = [line.split() for line in done.output.strip().splitlines()]
    assert [r[0] for r in rows] == list(map(str, pngs)) and all(0 < float(r[2]) <= 1 for r in rows)
    # the same as fedpipe's own network on the same pixels, standardised as the run standardised them
    from PIL import Image

    algorithm, state, partition, data, result = _reference(run)
    c = result.clients[0]
    chosen = algorithm.personalized_candidates(state.server, state.clients.get(0), 0)[c.chosen][1]
    pixels = torch.tensor(np.stack([np.asarray(Image.open(p))[None] for p in pngs]), dtype=torch.float32)
    _, mean, std = input_standardisation(run.bundle, partition)
    x = (pixels / 255 - torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)) / torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    with eval_mode(algorithm.model):
        expected = algorithm.forward(chosen, x).argmax(1)
    assert [r[1] for r in rows] == [spec.labels[i] for i in expected]
    unknown = runner.invoke(app_(), ["predict", "--trust-unsigned", "--model", "served", "--client", "nowhere", "--store", str(run.store.url()), str(pngs[0])])
    assert unknown.exit_code == 2 and "No client 'nowhere'" in unknown.output and SITES[0] in unknown.output
    # images are decoded within the data readers' budget (data.max_decoded_mb): a large one past it is refused by name
    big = tmp_path / "big.png"
    Image.fromarray(np.zeros((1500, 1500), dtype=np.uint8)).save(big)
    over = runner.invoke(app_(), ["predict", "--trust-unsigned", "--model", "served", "--client", SITES[0], "--store", str(run.store.url()),
                                  "--set", "data.max_decoded_mb=1", str(pngs[0]), str(big)])
    assert over.exit_code != 0 and "past the drop's budget of 1 MB" in over.output and str(big) in over.output, over.output
    assert "data.max_decoded_mb" in over.output
    fits = runner.invoke(app_(), ["predict", "--trust-unsigned", "--model", "served", "--client", SITES[0], "--store", str(run.store.url()),
                                  "--set", "data.max_decoded_mb=8", str(big)])
    assert fits.exit_code == 0, fits.output


def test_predict_decodes_images_within_the_decode_budget(tmp_path):
    """What decoding one image needs must fit the budget, and the rows kept are charged: the first image past it
    is refused by name, as the data readers refuse a drop's."""
    from PIL import Image

    from fedpipe.data.files.budget import DecodeBudget
    from fedpipe.models.export import read_inputs

    spec = ServingSpec("r", "fedavg", "cnn", "image", (1, 256, 256), (0.5,), (0.25,), ("a", "b"), None)
    paths = []
    for i in range(6):
        paths.append(str(tmp_path / f"scan{i}.png"))
        Image.fromarray(np.full((256, 256), 40 * i, dtype=np.uint8)).save(paths[-1])
    names, x = read_inputs(spec, paths[:2], DecodeBudget(1))
    assert names == paths[:2] and tuple(x.shape) == (2, 1, 256, 256)
    with pytest.raises(FedpipeError, match="past the drop's budget of 1 MB") as refused:  # 256 KiB a row: the 4th fills 1 MB
        read_inputs(spec, paths, DecodeBudget(1))
    assert paths[3] in str(refused.value) and paths[2] not in str(refused.value) and "data.max_decoded_mb" in str(refused.value)
    big = tmp_path / "big.png"
    Image.fromarray(np.zeros((1500, 1500), dtype=np.uint8)).save(big)
    with pytest.raises(FedpipeError, match=f"^{big}: decoding this 1500x1500 L image .* past the drop's budget"):
        read_inputs(spec, [str(big)], DecodeBudget(1))


def app_():
    from fedpipe.cli import app

    return app


def _refusing(monkeypatch, formats: set[str]) -> None:
    """Make the exporters of `formats` fail, as they do on a network they cannot take."""
    import fedpipe.models.export as export

    def refuse(module, example):
        raise RuntimeError("simulated: this network cannot be exported this way")

    monkeypatch.setattr(export, "EXPORTERS", tuple((fmt, name, refuse if fmt in formats else fn, load)
                                                   for fmt, name, fn, load in export.EXPORTERS))


def test_where_torch_export_fails_the_traced_torchscript_is_served(tmp_path, monkeypatch):
    _refusing(monkeypatch, {"pt2"})
    run = small_run(tmp_path / "runs", "method.name=superfed_lm", *TINY, *EXTRA["superfed_lm"])
    train_all(run)
    files, spec = _check_served_like_fedpipe(tmp_path, run)
    served = [spec.global_model, *spec.clients.values()]
    assert all(f.format == "torchscript" and f.exporter == "torch.jit.trace" and f.file.endswith(".ts.pt") for f in served)


def test_a_model_no_exporter_takes_is_a_clear_error(monkeypatch):
    from fedpipe.models.export import ExportError

    _refusing(monkeypatch, {"pt2", "torchscript"})

    class Linear:  # an algorithm as far as serving needs one: a network and forward(params, x)
        model = torch.nn.Identity()

        def forward(self, params, x):
            return x @ params["w"]

    module = served_module(Linear(), {"w": torch.ones(4, 3)}, "table", (np.zeros(4), np.ones(4)))
    with pytest.raises(ExportError, match=r"torch\.export: .*simulated.*torch\.export\.draft_export: .*torch\.jit\.trace: "):
        export_model(module, torch.ones(2, 4))


def test_a_malformed_spec_is_refused():
    from fedpipe.errors import CorruptArtifactError

    with pytest.raises(CorruptArtifactError, match="spec.json is not a valid serving spec"):
        ServingSpec.from_bytes(json.dumps({"format": "fedpipe.serving-spec/1"}).encode(), "spec.json")
