"""Publishing an evaluated run into its model line (`registry.name`): the pipeline's last step.

    summary = publish(run)

1. the gate decides (`fedpipe.models.gate.decide`) against the promoted version, on this run's data; a gate
   that cannot decide raises, and nothing is registered or promoted;
2. the run's models are exported (`fedpipe.models.export.export_run`: the global model, every client's
   chosen personalized model, the serving spec) and registered as the line's next version with the run's
   final state (`state.pt`, what a warm start reads), its config, data snapshot, summary and the decision;
3. the version is promoted when the gate said so;
4. the decision is pushed to the run's Pushgateway (if one is configured; a failed push warns, never fails
   the step): `fedpipe_model_promoted{line,version}` (1 promoted, 0 not), `fedpipe_model_candidate_metric`
   and `fedpipe_model_champion_metric{line,version,metric}`, `fedpipe_model_promoted_version{line}`, one
   Pushgateway group per line (job `fedpipe-models`), replaced by each publication;
5. with `registry.kubeflow_hub.url` set, every promoted version not yet in Kubeflow Hub is registered there
   (`fedpipe.models.hub`: RegisteredModel / ModelVersion / ModelArtifact); a failure is said and kept
   beside the line for the next publication to retry, and never undoes the promotion;
6. the run's report gets a "Model line" page, `report/model_line.md`: the line's versions with their
   accuracy, data snapshot and decision, and the promotions.

A step retried after it registered the version (the same run id) registers nothing again: it finishes what
the first attempt left (the promotion its decision asked for) and reports the same version. With
registry.name empty the step does nothing.
"""

from __future__ import annotations

import logging
import os

from pydantic import ValidationError

from fedpipe.config import format_validation_error, refuse_url_credentials
from fedpipe.engine.accounting import Ledger
from fedpipe.engine.state import PhaseState
from fedpipe.errors import ConfigError, CorruptArtifactError
from fedpipe.models.drop_check import EVALUATION_FILE
from fedpipe.models.export import MAX_SPEC_BYTES, SPEC_FILE, ServingSpec, export_run
from fedpipe.models.gate import decide, settings_of
from fedpipe.models.hub import sync_promoted
from fedpipe.models.line import MAX_REASON_CHARS, REGATED, ModelLine, ModelSpec, VersionRecord
from fedpipe.run.privacy import delta_of
from fedpipe.run.report import model_line_markdown
from fedpipe.run.run import Run
from fedpipe.safe_load import MAX_RECORD_BYTES, read_store_json
from fedpipe.telemetry.prometheus import ENV_PUSHGATEWAY

log = logging.getLogger(__name__)

PUSH_JOB = "fedpipe-models"
REPORT_VERSIONS = 50  # the newest versions listed in the report's model line page
STATE_FILE = "state.pt"


def publish(run: Run) -> dict:
    """Register the evaluated `run` as its line's next version and promote it if the gate says so; returns
    what happened ({"published": False, ...} when registry.name is empty)."""
    registry = run.cfg.registry
    if not registry.name:
        return {"published": False, "line": "", "reason": "registry.name is empty: the run's models are not registered"}
    key = run.layout.report("summary.json")
    if not run.store.exists(key):
        raise ConfigError(f"Run {run.layout.run_id!r} has not been evaluated ({run.store.url(key)} is missing): run "
                          "`fedpipe evaluate` (the evaluate step) before publishing it.")
    summary = read_store_json(run.store, key, "run summary", MAX_RECORD_BYTES, CorruptArtifactError, "Run the evaluate step again.")
    line = ModelLine(run.store, registry.name)
    with run.owner:  # the run's one writer (a second publisher of the same run stops here, naming the first)
        record = registered(line, run.layout.run_id)
        reused = record is not None
        if record is None:
            decision = decide(run, line, registry)  # may raise: then nothing is registered
            files, _, clients = export_run(run)  # clients: names in the order of their ids (what a warm start maps by)
            state = final_state(run)
            files = {**files, STATE_FILE: state.to_bytes(), EVALUATION_FILE: decision.evaluation}
            data = run.cfg.data
            snapshot = run.bundle.snapshot or ({"source": data.source, "digest": data.snapshot} if data.snapshot else None)
            record = line.register(VersionRecord(0, run.layout.run_id, ModelSpec.of_run(run), run.cfg.to_yaml(), snapshot, summary,
                                                 tuple(clients), decision.to_json(), privacy=state.privacy), files)
            log.info("Model line %r: registered run %s as version %d.", line.name, run.layout.run_id, record.version)
        finish_promotion(line, record)
        result = outcome(line, record)
        # after the promotion, never before: a registry that fails costs a warning and a retry, not the promotion
        hub = sync_promoted(line, registry.kubeflow_hub)
        if registry.kubeflow_hub.url:
            result["kubeflow_hub"] = hub
        if reused:
            result["reused"] = True
            result["note"] = reuse_note(line, record, settings_of(registry))
            log.warning("%s", result["note"])
        page = model_line_markdown(line.name, line_rows(line), result["promoted_version"], line.history()[-REPORT_VERSIONS:],
                                   record.decision)
        run.store.put_text(run.layout.report("model_line.md"), page)
    push_decision(run, line, record, result["promoted_version"])
    return {**result, "report": run.store.url(run.layout.report("model_line.md"))}


def regate(line: ModelLine, version: int, overrides: list[str]) -> dict:
    """Decide again whether `version` should be promoted, without retraining: its run (still in the store) against
    the promoted version, under its recorded registry settings with `overrides` (registry.* only) applied. A
    promotion is made and recorded in the line's history; the version's record itself is never rewritten."""
    from fedpipe.config import apply_override
    from fedpipe.models.gate import version_config

    bad = [o for o in overrides if not o.strip().startswith("registry.")]
    if bad:
        raise ConfigError(f"regate decides again under other registry settings only; {', '.join(map(repr, bad[:3]))} "
                          "would need a new run (retrain with `fedpipe run`).")
    record = line.record(version)
    tree = version_config(record, line.name).model_dump(mode="json")
    for assignment in overrides:
        apply_override(tree, assignment)
    from fedpipe.run.config import RunConfig

    try:
        cfg = RunConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None
    promoted = line.promoted()
    if promoted == version:
        return {"version": version, "promoted": True, "changed": False,
                "reason": f"version {version} is the promoted version already: there is nothing to decide"}
    run = Run(cfg, line.store)
    if not run.store.exists(run.layout.report("summary.json")):
        raise ConfigError(f"Version {version}'s run {record.run_id!r} is no longer in {line.store.url()} (its evaluated "
                          "run folder is needed to score its models): regate cannot decide; promote by hand if it is wanted.")
    decision = decide(run, line, cfg.registry)
    said = decision.to_json()
    context = regate_context(overrides, said["checks_off"], decision.compared.get("on", ""))
    if decision.promote:
        verdict, _, figures = decision.reason.partition(": ")
        line.promote(version, f"{REGATED}{verdict} ({context}): {figures}"[:MAX_REASON_CHARS], expected=decision.champion_version)
    return {"version": version, "promoted": decision.promote, "changed": decision.promote, "reason": decision.reason,
            "context": context, "checks_off": said["checks_off"], "compared_on": decision.compared.get("on", ""), "decision": said}


def regate_context(overrides: list[str], off: list[str], compared_on: str) -> str:
    """What a regate's history entry says beside the decision: the settings it changed, the checks they turned off,
    and what was compared (the candidate's own test splits when the promoted version's drop could not be read)."""
    parts = [f"with {', '.join(o.strip() for o in overrides)}" if overrides else "under the version's recorded settings"]
    parts.append(f"checks off: {'; '.join(off)}" if off else "no check off")
    if compared_on:
        parts.append(f"compared on {compared_on}")
    return "; ".join(parts)


def registered(line: ModelLine, run_id: str) -> VersionRecord | None:
    """The version this run was registered as, if an earlier attempt of the step registered it."""
    for version in reversed(line.versions()):
        record = line.record(version)
        if record.run_id == run_id:
            return record
    return None


def reuse_note(line: ModelLine, record: VersionRecord, settings: dict) -> str:
    """What a rerun of a registered run says: the registration is reused, and whether its decision was made under
    other registry settings than the run's now (then `fedpipe models regate` decides again without retraining)."""
    note = (f"Model line {line.name!r}: this run is already registered as version {record.version}; its registration and "
            f"decision are reused (the gate did not decide again).")
    then = record.decision.get("settings")
    if then is None:
        return note + (" Its decision records no registry settings (made by an older fedpipe); to decide again under this "
                       f"run's, run `fedpipe models regate {line.name}@{record.version}`.")
    differ = sorted(k for k in set(then) | set(settings) if then.get(k) != settings.get(k))
    if differ:
        shown = ", ".join(f"registry.{k}: {then.get(k)!r} then, {settings.get(k)!r} now" for k in differ[:6])
        note += (f" Its decision was made under other registry settings ({shown}); to decide again under the new ones, run "
                 f"`fedpipe models regate {line.name}@{record.version}` with the same --set options.")
    return note


def finish_promotion(line: ModelLine, record: VersionRecord) -> None:
    """Promote the version when its decision says so and no promotion of it was made yet."""
    if not record.decision.get("promoted"):
        log.info("Model line %r, version %d: %s", line.name, record.version, record.decision.get("reason"))
        return
    if any(entry["version"] == record.version for entry in line.history()):
        return  # promoted by an earlier attempt (or promoted and rolled back since: left as it is)
    # only over the champion the gate decided against: a hand promotion made meanwhile is not overridden
    line.promote(record.version, str(record.decision.get("reason", "promoted by the gate"))[:2000],
                 expected=record.decision.get("champion_version"))
    log.info("Model line %r: version %d promoted (%s).", line.name, record.version, record.decision.get("reason"))


def final_state(run: Run) -> PhaseState:
    """The run's final state with every client's state inline (a version is read without the run's folder), and the
    accountant its training spent (a version keeps it: what a private warm start from it composes). A private run
    whose phases released nothing (Local, which never communicates) gets an empty ledger, epsilon 0: it is private,
    not a version that a private run must refuse to start from. A run without privacy gets none, whatever ledger a
    warm start brought it: its rounds were not accounted."""
    state = run.checkpoints(run.phases()[-1].name).load_final("cpu")
    ledger = None
    if run.cfg.privacy.enabled:
        ledger = state.privacy or Ledger(run.cfg.privacy.accountant, delta_of(run.cfg, len(run.load_partition().clients)))
    return PhaseState(state.method, state.phase, state.round, state.server, dict(state.clients.items()), state.config_fingerprint,
                      privacy=ledger)


def outcome(line: ModelLine, record: VersionRecord) -> dict:
    """What the step reports: the version, the decision's figures, the promoted version now, the model files
    (from the version's serving spec: the global model's file and each client's, by client name)."""
    d, folder = record.decision, line.keys.version(record.version)
    where = line.store.url(folder + SPEC_FILE)
    spec = ServingSpec.from_bytes(line.read(record.version, SPEC_FILE, MAX_SPEC_BYTES), where)
    glob = spec.global_model
    return {"published": True, "line": line.name, "version": record.version, "run_id": record.run_id,
            "promoted": bool(d.get("promoted")), "promoted_version": line.promoted(), "reason": d.get("reason", ""),
            "metric": d.get("metric"), "candidate": d.get("candidate"), "champion": d.get("champion"),
            "champion_version": d.get("champion_version"), "clients": list(record.clients),
            "compared": d.get("compared"), "new_samples": d.get("new_samples"), "drop_check": d.get("drop_check"),
            "global_model": None if glob is None else glob.file, "global_format": None if glob is None else glob.format,
            "client_models": {name: f.file for name, f in spec.clients.items()},
            "client_formats": sorted({f.format for f in spec.clients.values()}),
            "files": [k[len(folder):] for k in line.store.list(folder)], "where": line.store.url(folder.rstrip("/"))}


def line_rows(line: ModelLine) -> list[dict]:
    """The newest versions of the line as plain rows for the report."""
    rows = []
    for version in line.versions()[-REPORT_VERSIONS:]:
        r = line.record(version)
        personalized = (r.summary.get("personalized_accuracy") or {}).get("mean")
        glob = (r.summary.get("global_model") or {}).get("top1") if isinstance(r.summary.get("global_model"), dict) else None
        rows.append({"version": version, "run_id": r.run_id, "created": r.created, "personalized_accuracy": personalized,
                     "global_accuracy": glob, "data": r.data_snapshot, "promoted": r.decision.get("promoted"),
                     "reason": r.decision.get("reason", "")})
    return rows


def push_decision(run: Run, line: ModelLine, record: VersionRecord, promoted_version: int | None) -> bool:
    """The decision as gauges on the run's Pushgateway (telemetry.pushgateway or FEDPIPE_PUSHGATEWAY); False
    when none is configured or the push failed (one warning: a finished publication never fails on metrics)."""
    url = (run.cfg.telemetry.pushgateway or os.environ.get(ENV_PUSHGATEWAY, "")).strip().rstrip("/")
    if not url:
        return False
    from prometheus_client import CollectorRegistry, Gauge, push_to_gateway

    try:
        refuse_url_credentials(url, f"The Pushgateway URL (telemetry.pushgateway or env {ENV_PUSHGATEWAY})", "use a proxy that adds them.")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    url = url if "://" in url else "http://" + url
    registry, d, version = CollectorRegistry(), record.decision, str(record.version)
    Gauge("fedpipe_model_promoted", "1 when the line's newest version was promoted by the gate, 0 when not.",
          ["version"], registry=registry).labels(version).set(1 if d.get("promoted") else 0)
    metric = str(d.get("metric", ""))
    for name, value, of in (("candidate", d.get("candidate"), version), ("champion", d.get("champion"), str(d.get("champion_version")))):
        if isinstance(value, (int, float)):
            Gauge(f"fedpipe_model_{name}_metric", f"The gate's metric of the {name} version (0..1).", ["version", "metric"],
                  registry=registry).labels(of, metric).set(float(value))
    check = d.get("drop_check") or {}
    Gauge("fedpipe_model_drop_suspect", "1 when the drop check flagged the newest version's data as broken or poisoned "
          "(its promoted model collapsed on some clients), 0 when not.", ["version"], registry=registry).labels(version).set(
          1 if check.get("suspect") else 0)
    Gauge("fedpipe_model_drop_flagged_clients", "Clients the drop check flagged in the newest version's data.", ["version"],
          registry=registry).labels(version).set(int(check.get("flagged_count") or 0))
    if promoted_version is not None:
        Gauge("fedpipe_model_promoted_version", "The line's promoted version.", registry=registry).set(promoted_version)
    try:
        push_to_gateway(url, job=PUSH_JOB, registry=registry, grouping_key={"line": line.name}, timeout=5)
    except Exception as e:  # noqa: BLE001 - never fail a publication over its metrics
        log.warning("Could not push model line %r's decision to the Pushgateway at %s (%s): the version is registered%s "
                    "all the same.", line.name, url, str(e)[:200], " and promoted" if d.get("promoted") else "")
        return False
    return True
