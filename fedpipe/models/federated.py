"""Publishing a federated run into its model line (`registry.name`), gated on figures the sites computed.

The server of a federation holds the global model and none of the sites' data, so the gate's comparison is made at the
sites, on the same samples for both models:

1. before the run, `champion_for(cfg)` reads the line's promoted version's server state (its state.pt, bounded and
   checked like a warm start's), which `fedpipe run` hands to the ServerApp (`fedpipe.federation.launch.federate`);
   a warm start (train.init_from) reads its version's the same way (`warm_start_for`): the server's round-0 model;
2. at the evaluation each site scores the new global model and the promoted one on its share of the global test set
   (`client_app.evaluate`: holdout-accuracy, champion-holdout-accuracy), and sends only those numbers;
3. `publish_federated(cfg, summary, champion)` decides with the simulation's rule (`fedpipe.models.gate.compare`):
   the metric is global_accuracy over all sites' held-out samples, and a site whose accuracy falls by more than
   registry.max_client_drop blocks the promotion. The drop check, which reads the clients' files, does not run (the
   decision says so): the sites' files never leave them.

A version of a federated run holds the global model exported for serving (with the sites' standardisation baked in),
its serving spec (no client models: personalized models stay at their sites, each in the site's own line, `fedpipe
site serve`), state.pt (the server's final state, no client's: what the next federated run's gate reads), the
config, the sites' data snapshots (from the census), the summary and the decision. The first version of a line is
promoted without a comparison, as in a simulation's line.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

from fedpipe.algorithms.base import ServerState
from fedpipe.engine.accounting import Ledger
from fedpipe.engine.state import PhaseState
from fedpipe.errors import ConfigError, CorruptArtifactError
from fedpipe.federation.launch import submission
from fedpipe.federation.report import read_output
from fedpipe.federation.resume import CHECKPOINT
from fedpipe.federation.spec import FederationSpec
from fedpipe.models.drop_check import EVALUATION_FILE, evaluation_bytes
from fedpipe.models.export import SPEC_FILE, SUFFIX, ServedFile, ServingSpec
from fedpipe.models.gate import Decision, compare, settings_of
from fedpipe.models.hub import sync_promoted
from fedpipe.models.line import ModelLine, ModelSpec, VersionRecord
from fedpipe.models.publish import REPORT_VERSIONS, STATE_FILE, finish_promotion, line_rows, outcome, registered
from fedpipe.models.site_line import exporter, spec_standardisation
from fedpipe.models.warm import _line as warm_line
from fedpipe.models.warm import starting_ledger, state_limit_for, version_ledger
from fedpipe.run.report import model_line_markdown
from fedpipe.run.run import Run
from fedpipe.store import open_store

log = logging.getLogger(__name__)

DROP_CHECK_NOTE = "not run in a federation: it reads the clients' files, and the sites' files never leave them"


def check_registry(cfg) -> None:
    """What a federated run's publication can do: gate on the global model (the only model the line gets), with no
    pinned reference set (the server holds no data to score it on)."""
    registry = cfg.registry
    if registry.gate_metric != "global_accuracy":
        raise ConfigError(f"registry.gate_metric={registry.gate_metric}: a federated run registers its global model only (each "
                          "site keeps its personalized model), so its gate compares global models: set "
                          "registry.gate_metric=global_accuracy")
    if registry.reference:
        raise ConfigError("registry.reference: in a federation the server holds no data to score a reference set on; the sites "
                          "score both models on their held-out shares instead: leave registry.reference empty")


def check_federated(cfg) -> None:
    """Everything a federated run's publication and warm start would refuse, checked before anything is sent (the
    pipeline's config task, so that a run started from the UI fails at once, not after its training)."""
    if cfg.registry.name:
        check_registry(cfg)


def _line(cfg) -> ModelLine:
    return ModelLine(open_store(str(cfg.run.store)), cfg.registry.name)


def champion_for(cfg, num_sites: int) -> tuple[int, dict[str, torch.Tensor]] | None:
    """(version, its server's global params) of the line's promoted version, for the sites to score beside this run's
    model; None when the run does not publish or the line has nothing promoted yet."""
    if not cfg.registry.name:
        return None
    check_registry(cfg)
    line = _line(cfg)
    version = line.promoted() if line.exists() else None
    if version is None:
        return None
    state, _ = _version_state(cfg, line, version, num_sites, "the sites score the promoted global model with this "
                              "run's network, so they must match. Publish this configuration to another line (registry.name).")
    return version, dict(state.server.global_params)


def warm_start_for(cfg, num_sites: int) -> tuple[int, dict[str, torch.Tensor], Ledger | None] | None:
    """(version, its server's global params, the accountant the run starts with) of the version train.init_from names
    (pinned when the run starts, `fedpipe.models.warm.pin_init_from`): the server's round-0 global model; None for
    `none`.

    A federated version holds no site's state (each site keeps its personal parts), so the sites' personal parts start
    anew, as a simulated warm start treats the clients a version lacks (`fedpipe.models.warm.warm_start`). With
    privacy the run's accountant continues the version's ledger (`fedpipe.models.warm.starting_ledger`, the
    simulation's rule: a version that is not private is refused unless privacy.public_init), so every epsilon the
    federation reports covers both runs."""
    given = cfg.train.init_from
    if given == "none":
        return None
    if given == "promoted":
        raise ConfigError("train.init_from=promoted must be pinned to a version number when the run starts "
                          "(fedpipe.models.warm.pin_init_from), so that the run's id says which version it started from.")
    line, version = warm_line(cfg), int(given)  # an empty registry.name is refused there, as for a simulated warm start
    state, where = _version_state(cfg, line, version, num_sites, "the server starts from that version's global model "
                                  "with this run's network, so they must match. Set train.init_from=none to start anew.")
    record = line.record(version)
    ledger = starting_ledger(cfg, version_ledger(record, state, where), f"model line {line.name!r} version {version} "
                             f"(run {record.run_id})", num_sites)
    return version, dict(state.server.global_params), ledger


def _version_state(cfg, line: ModelLine, version: int, num_sites: int, why: str) -> tuple[PhaseState, str]:
    """The server's state in `version`'s state.pt (and where it was read), read bounded by this run's model, the
    version's model and method checked against this run's first (`why`: what needs them equal)."""
    record = line.record(version)
    theirs = record.spec
    mine_model = cfg.model_name(theirs.input_shape)
    differ = [f"{what}: {a} vs {b}" for what, a, b in (("model", mine_model, theirs.model), ("method", cfg.method.name, theirs.method))
              if a != b]
    if differ:
        raise ConfigError(f"model line {line.name!r} version {version}'s {'; '.join(differ)} (this run vs the version) differ: {why}")
    from fedpipe.federation.own_data import site_params

    spec = FederationSpec.for_sites(cfg, num_sites, site_params(cfg)).with_data(tuple(theirs.input_shape), theirs.num_classes)
    _, initial = spec.build(torch.device("cpu"))
    model_bytes = sum(t.numel() * t.element_size() for t in initial.values())
    where = f"model line {line.name!r} version {version} ({line.store.url(line.keys.version(version) + STATE_FILE)})"
    state = PhaseState.from_bytes(line.read(version, STATE_FILE, state_limit_for(model_bytes, len(record.clients))), "cpu", where=where)
    if state.method != cfg.method.name:
        raise CorruptArtifactError(f"{where} holds a {state.method} state, but its record says {theirs.method}: restore it, or "
                                   "promote another version")
    return state, where


def site_scores(evaluation: dict, census: dict, key: str, only: set[str] | None = None) -> tuple[dict[str, float], float | None]:
    """Per site name the global model's accuracy on its held-out share (`key`: holdout-accuracy, or
    champion-holdout-accuracy for the promoted version's), and over those sites' held-out samples, each site weighed
    by the held-out count the census fixed for it (never by a count its evaluation states: one site claiming 10^9
    samples would decide alone). A site the census did not count, with no held-out share, or whose figure is not a
    finite fraction is left out (and logged); `only`: these site names at most."""
    sites = {str(s["client_id"]): s for s in census.get("sites", [])}
    per_site, weights = {}, {}
    for cid, scores in evaluation.items():
        site = sites.get(str(cid))
        if site is None or key not in scores:
            continue
        name = str(site["name"])
        weight = int((site.get("samples") or {}).get("holdout", 0))
        value = scores[key]
        if weight <= 0 or (only is not None and name not in only):
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or not 0 <= value <= 1:
            log.warning("The gate leaves out site %r: its %s %r is not a fraction in [0, 1]", name, key, value)
            continue
        per_site[name], weights[name] = float(value), weight
    held = sum(weights.values())
    overall = sum(per_site[n] * weights[n] for n in per_site) / held if held else None
    return per_site, overall


def decide_federated(cfg, evaluation: dict, census: dict, line: ModelLine, champion: int | None) -> Decision:
    """The gate's decision from the sites' figures: the first version is promoted; later ones by `compare`, the
    simulation's rule, on the global model's accuracy at every site that scored both models, weighed by the census's
    held-out counts. The decision names the sites it relied on."""
    from fedpipe.models.sides import Scores

    registry = cfg.registry
    mine, overall = site_scores(evaluation, census, "holdout-accuracy")
    if overall is None:
        raise ConfigError("no site scored the global model on held-out samples (a method without a global model, or sites "
                          "with exported try-out folders): a federated run is published by its global model. Nothing was registered.")
    if champion is None:
        return Decision(True, f"the first version of model line {line.name!r}: promoted without a comparison", "global_accuracy",
                        overall, None, None, 0, tuple(mine), settings=settings_of(registry),
                        drop_check={"enabled": False, "note": DROP_CHECK_NOTE},
                        compared={"on": "the sites' held-out shares of the global test set, scored at the sites",
                                  "sites": len(mine), "names": sorted(mine)})
    theirs, champ_overall = site_scores(evaluation, census, "champion-holdout-accuracy")
    shared = {n: a for n, a in mine.items() if n in theirs}
    if not shared:
        raise ConfigError(f"no site scored the promoted version {champion} (see the sites' logs): the gate cannot decide. Nothing "
                          "was registered or promoted; run again.")
    _, shared_overall = site_scores(evaluation, census, "holdout-accuracy", only=set(shared))
    theirs, champ_overall = site_scores(evaluation, census, "champion-holdout-accuracy", only=set(shared))
    decision = compare(Scores(shared, shared_overall), Scores(theirs, champ_overall), champion, registry, new_clients=(),
                       check_note=DROP_CHECK_NOTE)
    counted = {str(s["name"]): int((s.get("samples") or {}).get("holdout", 0)) for s in census.get("sites", [])}
    compared = {"on": "the sites' held-out shares of the global test set, scored at the sites", "sites": len(shared),
                "names": sorted(shared), "samples": sum(counted.get(n, 0) for n in shared),
                "weights": "the held-out counts the census fixed for each site"}
    return Decision(**{**decision.__dict__, "compared": compared})


CHAMPION_NOTE = "champion.json"  # which version of the line the sites scored, for a publish step that runs later


def note_champion(cfg, version: int | None) -> None:
    """Record, in the run's federation folder, which version of the model line the sites are asked to score (the
    pipeline's evaluate task; its publish task reads it back with `scored_champion`)."""
    run = submission(cfg)
    run.store.put(run.key(CHAMPION_NOTE), json.dumps({"version": version}).encode())


def scored_champion(cfg) -> int | None:
    """The version `note_champion` recorded (None: none, or nothing was promoted when the sites scored)."""
    run = submission(cfg)
    data = run.read(CHAMPION_NOTE)
    if data is None:
        return None
    try:
        version = json.loads(data).get("version")
        return None if version is None else int(version)
    except (ValueError, TypeError, AttributeError):
        raise CorruptArtifactError(f"{run.url}/{CHAMPION_NOTE} is not the evaluate task's note: rerun the pipeline") from None


def publish_federated(cfg, summary: dict, champion: int | None) -> dict:
    """Register the federated run's global model as the line's next version and promote it if the gate says so;
    `champion`: the version the sites scored (`champion_for`), None when nothing was promoted at the start. Reads the
    ServerApp's outputs from the run's store (`fedpipe.federation.outputs`), bounded."""
    import tempfile

    line, run = _line(cfg), Run(cfg)
    with tempfile.TemporaryDirectory(prefix="fedpipe-publish-") as tmp:
        out = submission(cfg).fetch(Path(tmp))
        census, evaluation = read_output(out / "census.json", "census"), read_output(out / "evaluation.json", "site evaluation")
        record = registered(line, run.layout.run_id)
        reused = record is not None
        if record is None:
            decision = decide_federated(cfg, evaluation, census, line, champion)
            spec = FederationSpec.read(str(out / "spec.json")).with_data(tuple(census["input_shape"]), int(census["num_classes"]))
            files, labels = _version_files(run.layout.run_id, spec, census, evaluation, out, decision)
            snapshots = {s["name"]: s["snapshot"] for s in census["sites"] if s.get("snapshot")}
            state = PhaseState.from_bytes((out / CHECKPOINT).read_bytes(), "cpu", where=str(out / CHECKPOINT))
            record = line.register(VersionRecord(0, run.layout.run_id, ModelSpec(spec.model_name, spec.method["name"],
                                                                                 tuple(spec.input_shape), spec.num_classes, labels),
                                                 cfg.to_yaml(), {"source": "federation", "sites": snapshots} if snapshots else None,
                                                 _record_summary(summary), tuple(), decision.to_json(), privacy=state.privacy), files)
            log.info("Model line %r: registered federated run %s as version %d.", line.name, run.layout.run_id, record.version)
    finish_promotion(line, record)
    result = outcome(line, record)
    hub = sync_promoted(line, cfg.registry.kubeflow_hub)
    if cfg.registry.kubeflow_hub.url:
        result["kubeflow_hub"] = hub
    if reused:
        result["reused"] = True
    page = model_line_markdown(line.name, line_rows(line), result["promoted_version"], line.history()[-REPORT_VERSIONS:], record.decision)
    key = run.layout.report("model_line.md")
    run.store.put(key, page.encode())
    return {**result, "report": run.store.url(key)}


def _version_files(run_id: str, spec: FederationSpec, census: dict, evaluation: dict, out: Path,
                   decision: Decision) -> tuple[dict[str, bytes], tuple]:
    """The version's files: the global model exported for serving, its serving spec, state.pt (the server's final
    state: the checkpoint, which holds no client's state), and the sites' own figures (what a later drop check reads)."""
    algorithm, _ = spec.build(torch.device("cpu"))
    server = ServerState(safetensors.torch.load_file(str(out / "global.safetensors"), device="cpu"))
    glob = algorithm.global_model(server)
    if glob is None:
        raise ConfigError(f"{spec.method['name']} trains no global model: a federated run is published by its global model")
    mean, std = spec_standardisation(spec)
    fmt, exporter_name, data = exporter(algorithm, spec, mean, std)(glob)
    global_file = ServedFile("global" + SUFFIX[fmt], fmt, exporter_name)
    labels = tuple(str(n) for n in census.get("labels") or range(spec.num_classes))
    serving = ServingSpec(run_id, spec.method["name"], spec.model_name, "image", tuple(spec.input_shape),
                          tuple(np.float32(mean).tolist()), tuple(np.float32(std).tolist()), labels, global_file, {},
                          None, None, spec.site_data["standardisation"]["source"])
    files = {global_file.file: data, SPEC_FILE: serving.to_bytes(), STATE_FILE: (out / CHECKPOINT).read_bytes()}
    sites = {str(s["client_id"]): s for s in census["sites"]}
    mine = {cid: e for cid, e in evaluation.items() if cid in sites and sites[cid].get("counts")}  # none with privacy: withheld
    if mine:
        names = {cid: str(sites[cid]["name"]) for cid in mine}
        files[EVALUATION_FILE] = evaluation_bytes({names[c]: e["accuracy"] for c, e in mine.items()},
                                                  {names[c]: int(e.get("test-samples", 0)) for c, e in mine.items()},
                                                  {names[c]: np.asarray(sites[c]["counts"]["test"]) for c in mine}, decision.candidate)
    return files, labels


def _record_summary(summary: dict) -> dict:
    """The run's summary in the shape a line's records keep (personalized accuracy's mean, the global model's top-1)."""
    glob = summary.get("global_accuracy")
    return {"title": summary.get("title"), "mode": "federation", "sites": summary.get("sites"), "rounds": summary.get("rounds"),
            "personalized_accuracy": {"mean": summary.get("personalized_accuracy"), "clients": summary.get("sites")},
            "global_model": None if glob is None else {"top1": glob}, "per_site": summary.get("per_site")}
