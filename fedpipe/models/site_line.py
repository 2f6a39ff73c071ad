"""A site's own model line: after a federated run, the site exports its personalized model (and the federation's global
model) where it is, registers them in a model line in its own folder, and serves them with the predictor
`fedpipe models serve` runs (`fedpipe site serve`). The personalized model never leaves the site.

What the site kept from the run (`fedpipe.federation.client_app.evaluate` writes it): `served/latest.json` (the run's
spec, the site's client id and name, the candidate its validation split chose) and `served/global.safetensors` (the
final global model the server sent for the evaluation); its personal state is in `state/`. The model is rebuilt from
the spec (`FederationSpec.build`), its personalized candidates from the method (`personalized_candidates`), and exported
as every run's models are (`fedpipe.models.export.served_module`, `export_model`), with the run's standardisation baked
in. The line lives in `<site folder>/models/<name>/` and is signed like any store when FEDPIPE_SIGNING_KEY is set.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

from fedpipe.algorithms.base import ServerState
from fedpipe.data.federated import FIXED_IMAGE_MEAN, FIXED_IMAGE_STD
from fedpipe.errors import ConfigError, CorruptArtifactError
from fedpipe.federation.sites import GLOBAL, LATEST, SERVED, Site
from fedpipe.federation.spec import FederationSpec
from fedpipe.models.export import SPEC_FILE, SUFFIX, ServedFile, ServingSpec, client_file_stems, export_model, served_module
from fedpipe.models.line import ModelLine, ModelSpec, VersionRecord
from fedpipe.safe_load import parse_json
from fedpipe.store import open_store

log = logging.getLogger(__name__)
MAX_LATEST_BYTES = 4 * 2**20


def _latest(folder: Path) -> dict:
    path = folder / SERVED / LATEST
    if not path.exists():
        raise ConfigError(f"{folder} holds no finished federated run ({path} is missing): a site keeps its models after a run's "
                          "evaluation; join a run first (`fedpipe site join`)")
    return parse_json(path.read_bytes()[: MAX_LATEST_BYTES + 1], str(path), "site's served record", MAX_LATEST_BYTES, CorruptArtifactError)


def register_site_models(folder: str | Path) -> tuple[ModelLine, VersionRecord]:
    """Export this site's models from its latest federated run and register them as the next version of its own model
    line (once per run: the same run again returns the version it already has), promoted."""
    folder = Path(folder).resolve()
    latest = _latest(folder)
    spec = FederationSpec.from_json(str(latest["spec"]))
    mean, std = spec_standardisation(spec)  # refuses a try-out folder of exported tensors: only own files serve raw inputs
    cpu = torch.device("cpu")
    name, client_id, chosen = str(latest["name"]), int(latest["client_id"]), int(latest["chosen"])
    run_key = f"{Site._run_key(spec)}-{name}"
    line = ModelLine(open_store(str(folder / "models")), name)
    for v in line.versions()[::-1][:50]:
        if line.record(v).run_id == run_key:
            return line, line.record(v)
    algorithm, _ = spec.build(cpu)
    server = ServerState(safetensors.torch.load_file(str(folder / SERVED / GLOBAL), device="cpu"))
    names = [p.name for p in spec.phases()]
    state = _state(folder, spec, names)
    files: dict[str, bytes] = {}
    export = exporter(algorithm, spec, mean, std)
    global_file = None
    if (glob := algorithm.global_model(server)) is not None:
        fmt, exporter_name, data = export(glob)
        global_file = ServedFile("global" + SUFFIX[fmt], fmt, exporter_name)
        files[global_file.file] = data
    candidates = algorithm.personalized_candidates(server, state, client_id)
    fmt, exporter_name, data = export(candidates[chosen][1])
    (stem,) = client_file_stems([name])
    mine = ServedFile(f"clients/{stem}{SUFFIX[fmt]}", fmt, exporter_name, client_id, float(latest.get("candidate", 0.0)))
    files[mine.file] = data
    labels = tuple(str(n) for n in latest.get("labels") or range(spec.num_classes))
    serving = ServingSpec(run_key, spec.method["name"], spec.model_name, "image", tuple(spec.input_shape),
                          tuple(np.float32(mean).tolist()), tuple(np.float32(std).tolist()), labels, global_file, {name: mine},
                          algorithm.candidate_label, None, spec.site_data["standardisation"]["source"])
    files[SPEC_FILE] = serving.to_bytes()
    record = line.register(VersionRecord(0, run_key, ModelSpec(spec.model_name, spec.method["name"], tuple(spec.input_shape),
                                                               spec.num_classes, labels), "", latest.get("snapshot"),
                                         {"accuracy": latest.get("accuracy")}, (name,),
                                         {"promoted": True, "reason": "the site's latest federated run"}), files)
    line.promote(record.version, "the site's latest federated run")
    log.info("Site %s: registered its models of run %s as version %d of %s", name, run_key, record.version, line.store.url())
    return line, record


def spec_standardisation(spec: FederationSpec) -> tuple[np.ndarray, np.ndarray]:
    """The per-channel mean and std a federation's sites standardise with (declared, or fixed: a federation never pools),
    which every exported model bakes in so that it takes raw inputs."""
    if not spec.site_data:
        raise ConfigError("a try-out federation's sites hold exported tensors, standardised with the simulation's statistics: "
                          "only sites with their own files (`fedpipe site join --data`) give models that take raw inputs")
    if len(spec.input_shape) != 3:
        raise ConfigError("a federation's models are exported for image inputs today; a table model is served from a simulation's line")
    standardisation, channels = spec.site_data["standardisation"], spec.input_shape[0]
    if standardisation["source"] == "declared":
        return np.asarray(standardisation["mean"], dtype=np.float64), np.asarray(standardisation["std"], dtype=np.float64)
    return np.full(channels, FIXED_IMAGE_MEAN), np.full(channels, FIXED_IMAGE_STD)


def exporter(algorithm, spec: FederationSpec, mean: np.ndarray, std: np.ndarray):
    """params -> (format, exporter, bytes): a model of `algorithm` with these parameters, exported for serving with the
    standardisation baked in (`fedpipe.models.export`, as every run's models are)."""
    example = torch.zeros((2, *spec.input_shape), dtype=torch.float32)

    def export(params) -> tuple[str, str, bytes]:
        e = export_model(served_module(algorithm, params, "image", (mean, std)), example)
        return e.format, e.exporter, e.data

    return export


def _state(folder: Path, spec: FederationSpec, names: list[str]):
    """The site's personal state of the run's last phase (else the latest earlier one's); None for a method without one."""
    for phase in reversed(names):
        path = folder / "state" / f"{phase}.safetensors"
        if path.exists() and Site._state_run(path) == Site._run_key(spec):  # this run's state, not an earlier run's
            return safetensors.torch.load_file(str(path), device="cpu")
    return None
