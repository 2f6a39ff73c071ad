"""The pipeline tasks' work, in terms of artifact files: what each Kubeflow component calls.

A task reads its input artifacts (files KFP hands it), brings them into the run's store when the
store lacks them, runs the library step (`fedpipe.run.run.Run`), and copies the step's outputs into
its output artifact files. The store (a folder, or MinIO on a cluster) keeps the per-round
checkpoints, so a task that is retried resumes where its last attempt stopped.

A phase's state (global model and every client's state: the largest thing a run writes) stays in the
run's store: between tasks it travels as a pointer (store URL, key, sha256, size; a few hundred bytes),
so KFP's artifact store does not hold a second copy and the next task downloads nothing into its
pod's disk. The next task checks the pointer against its own store before it trusts the state.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import yaml

from fedpipe.config import apply_override
from fedpipe.data.partition.schemes import SCHEME_CONFIGS
from fedpipe.errors import ConfigError, CorruptArtifactError
from fedpipe.models.warm import attach, pin_init_from
from fedpipe.run.config import RunConfig, load_config, with_data_snapshot
from fedpipe.run.layout import RunLayout
from fedpipe.run.report import clients_html, render_html, summary_lines
from fedpipe.run.run import Run
from fedpipe.safe_load import parse_json, parse_yaml, read_file, read_store_json
from fedpipe.store.base import sha256_hex
from fedpipe.telemetry.progress import log_to_stderr
from fedpipe.telemetry.release import releasable_row

log = logging.getLogger(__name__)




def _changed(value, default) -> bool:
    """KFP hands parameters inside a dict back as strings or floats: compare their YAML meaning."""
    if isinstance(value, str) and not isinstance(default, str):
        value = parse_yaml(value, "a pipeline parameter", "parameter", invalid_is_text=True)
    return value != default


def _unset(tree: dict, dotted: str) -> bool:
    """True when the base config leaves a field out (or null)."""
    section, _, key = dotted.partition(".")
    values = tree.get(section)
    return not isinstance(values, dict) or values.get(key) is None


def _belongs(tree: dict, dotted: str) -> bool:
    """False for a compiled partition field that the base config's own scheme does not have (a base with a
    natural partition, run through a pipeline compiled with a pathological one, keeps its own fields)."""
    section, _, key = dotted.partition(".")
    scheme = (tree.get("partition") or {}).get("scheme") if section == "partition" and isinstance(tree.get("partition"), dict) else None
    return scheme not in SCHEME_CONFIGS or key in SCHEME_CONFIGS[scheme].model_fields


def resolve_config(
    base_yaml: str, fields: dict, defaults: dict, overrides: list[str], job_id: str, out_path: str, method: str | None = None
) -> RunConfig:
    """The run's config: the base YAML, then every pipeline field the user changed from its compiled
    default or the base leaves unset (so a base_config pasted in the UI keeps the deployment's store and
    Pushgateway), then `overrides` (KEY=VALUE; METHOD:KEY=VALUE applies only to that method's run).
    `method` replaces the base's method section (the benchmark pipeline runs several methods).
    Without an explicit run.id each pipeline job gets its own run (config-derived id + job id), so a
    scheduled rerun trains anew while a retried task resumes from its checkpoints."""
    log_to_stderr()
    tree = parse_yaml(base_yaml, "the pipeline's base_config parameter") or {}
    if not isinstance(tree, dict):
        raise ConfigError("The pipeline's base_config parameter must be a YAML mapping of config sections.")
    if method:
        tree["method"] = {"name": method}
    for key, value in fields.items():
        if _changed(value, defaults.get(key)) or (_unset(tree, key) and value not in (None, "") and _belongs(tree, key)):
            apply_override(tree, f"{key}={value}")
    name = tree.get("method", {}).get("name")
    for assignment in overrides:
        key = assignment.split("=", 1)[0]
        if ":" in key:  # METHOD:key=value
            only, assignment = assignment.split(":", 1)
            if only != name:
                continue
        apply_override(tree, assignment)
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    # a user's own data: the drop read and its snapshot pinned; a warm start's `promoted`: the version it names now
    cfg = load_config(path)
    if cfg.engine.mode == "federation":  # before the model line is read: what would fail after the training fails now
        _check_federated(cfg, method)
    cfg = pin_init_from(with_data_snapshot(cfg))
    path.write_text(cfg.to_yaml())
    if cfg.run.id is None:
        cfg = load_config(path, [f"run.id={cfg.run_id()}-{job_id}"])
    path.write_text(cfg.to_yaml())
    return cfg


def _check_federated(cfg: RunConfig, method: str | None) -> None:
    """What a federated run would refuse only after its training, refused by the config task instead."""
    from fedpipe.models.federated import check_federated

    check_federated(cfg)


def _copy_out(run: Run, key: str, out_path: str) -> None:
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(run.store.get(key))


def _bring_in(run: Run, key: str, in_path: str) -> None:
    """Put an input artifact into the store, or check the store already holds the same bytes."""
    data = Path(in_path).read_bytes()
    if not run.store.exists(key):
        run.store.put(key, data)
    elif sha256_hex(run.store.get(key)) != sha256_hex(data):
        raise CorruptArtifactError(
            f"{run.store.url(key)} differs from the task's input artifact {in_path}: the store holds another "
            "run's data under this run id. Give the run another run.id."
        )


SUMMARY_LIMIT = 2**20  # a run's summary.json is a few kB
POINTER_FORMAT = "fedpipe.state-pointer/v1"
POINTER_LIMIT = 16 * 1024  # a pointer is a few hundred bytes; anything larger is not one


def write_pointer(run: Run, key: str, out_path: str) -> dict:
    """The output artifact of a phase: where its state is in the run's store and what it must hash to."""
    data = run.store.get(key)  # the store checks its own hash on the way
    pointer = {"format": POINTER_FORMAT, "store": run.store.url(), "key": key, "url": run.store.url(key),
               "sha256": sha256_hex(data), "size": len(data)}
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(pointer, indent=1))
    return pointer


def _read_pointer(in_path: str) -> dict:
    """A pointer artifact, bounded and checked field by field (KFP's artifact store is writable by others)."""
    where = f"the state pointer artifact {in_path}"
    advice = "It was not written by a fedpipe phase task of this version; rerun the pipeline."
    tree = parse_json(read_file(in_path, POINTER_LIMIT, "state pointer", CorruptArtifactError).encode(), where, "state pointer",
                      POINTER_LIMIT, CorruptArtifactError, advice)
    if not isinstance(tree, dict) or tree.get("format") != POINTER_FORMAT:
        raise CorruptArtifactError(f"{where} is not a fedpipe state pointer (format {POINTER_FORMAT}). {advice}")
    kinds = {"store": str, "key": str, "url": str, "sha256": str, "size": int}
    for name, kind in kinds.items():
        if type(tree.get(name)) is not kind:
            raise CorruptArtifactError(f"{where}: field {name!r} is missing or not a {kind.__name__}. {advice}")
    if not (len(tree["sha256"]) == 64 and all(c in "0123456789abcdef" for c in tree["sha256"])) or tree["size"] < 0:
        raise CorruptArtifactError(f"{where}: sha256 or size is not valid. {advice}")
    return tree


def check_pointer(run: Run, key: str, in_path: str) -> None:
    """The state a pointer names is this run's, at this key, in this store, with the bytes it recorded."""
    pointer = _read_pointer(in_path)
    if pointer["store"] != run.store.url() or pointer["key"] != key:
        raise CorruptArtifactError(
            f"The state handed to this task is {pointer['url']}, but this run keeps it at {run.store.url(key)}: the "
            "artifact belongs to another run or store. Rerun the pipeline, or give this run the store it was trained in."
        )
    if not run.store.exists(key):
        raise CorruptArtifactError(
            f"The state {run.store.url(key)} that the previous task wrote is gone from the store (deleted, or the store "
            "was wiped since). Rerun the pipeline: the phase that wrote it trains it again."
        )
    data = run.store.get(key)
    if len(data) != pointer["size"] or sha256_hex(data) != pointer["sha256"]:
        raise CorruptArtifactError(
            f"{run.store.url(key)} is not the state the previous task wrote (size {len(data)} bytes, sha256 "
            f"{sha256_hex(data)[:12]}..., expected {pointer['size']} bytes, {pointer['sha256'][:12]}...): it was rewritten "
            "since. Rerun the pipeline."
        )


def pointer_metadata(path: str) -> dict:
    """What the KFP UI shows of a state artifact: where the state is, its hash and size."""
    pointer = json.loads(Path(path).read_text())
    return {"store_url": pointer["url"], "sha256": pointer["sha256"], "size_bytes": pointer["size"]}


def _prepare(config_path: str, manifest_path: str | None = None) -> Run:
    log_to_stderr()
    cfg = load_config(config_path)
    # The run's single writer (run/record.py) is this pipeline job: a task retried in a new pod, or the next
    # task, is the same owner. KFP gives a task no job id in its env (only KFP_POD_NAME / KFP_POD_UID:
    # backend/src/v2/compiler/argocompiler/common.go), but the config task puts it into the run id
    # (`<config id>-<job id>`); with a run.id pinned by hand, jobs of that id share the owner.
    run = Run(cfg, owner=os.environ.get("FEDPIPE_OWNER") or f"kfp-pipeline-run:{cfg.run_id()}")
    if manifest_path is not None:
        run.check_record(create=True)
        _bring_in(run, run.layout.partition_manifest, manifest_path)
    return run


def partition(config_path: str, manifest_path: str, heatmap_path: str) -> dict:
    run = _prepare(config_path)
    p = run.partition()
    _copy_out(run, run.layout.partition_manifest, manifest_path)
    sizes = [c.size for c in p.clients]
    if run.cfg.privacy.enabled:  # each client's label counts and size are client statistics that epsilon does not cover:
        # the KFP UI (outside the trusted server) gets the count of clients only; the heatmap stays in the run's store
        Path(heatmap_path).write_text(render_html(f"Partition of {run.layout.run_id}", [
            "The label heatmap is withheld from the Kubeflow UI: privacy.enabled, and each client's label counts are "
            "not covered by the privacy guarantee. It is in the run's store (report/partition_heatmap.png)."], {}))
        return {"clients": len(sizes)}
    png = run.store.get(run.layout.report("partition_heatmap.png"))
    Path(heatmap_path).write_text(render_html(f"Partition of {run.layout.run_id}", [], {"partition_heatmap.png": png}))
    return {"clients": len(sizes), "min_client_size": min(sizes), "max_client_size": max(sizes)}


def _phase_inputs(config_path: str, phase: str, manifest_path: str, previous_path: str | None) -> Run:
    """The run with the phase's inputs (manifest, previous phase's state) in its store."""
    run = _prepare(config_path, manifest_path)
    names = [p.name for p in run.phases()]
    if phase not in names:
        raise ConfigError(f"method {run.cfg.method.name!r} has no phase {phase!r}; its phases are: {', '.join(names)}.")
    index = names.index(phase)
    if index > 0:
        if previous_path is None:
            raise ConfigError(f"phase {phase!r} needs the state of phase {names[index - 1]!r} as its input.")
        check_pointer(run, run.layout.phase(names[index - 1]).final, previous_path)
    return run


def _phase_outputs(run: Run, phase: str, state_path: str) -> dict:
    """The pointer to the phase's final state; the metrics of its last round (empty when it has no rounds)."""
    write_pointer(run, run.layout.phase(phase).final, state_path)
    rows = [json.loads(line) for line in _text_or_empty(run, run.layout.rounds(phase)).splitlines() if line.strip()]
    if not rows:
        return {}
    # the task's KFP metrics leave the trusted server: with privacy on, only the allowlist (no loss, cohort, timing)
    return releasable_row(rows[-1]) if run.cfg.privacy.enabled else rows[-1]


def train_phase(config_path: str, phase: str, manifest_path: str, previous_path: str | None, state_path: str) -> dict:
    """Run one phase; returns the metrics of its last round (empty when the phase has no rounds)."""
    run = attach(_phase_inputs(config_path, phase, manifest_path, previous_path))  # train.init_from: the first phase's start
    run.train(phase)
    return _phase_outputs(run, phase, state_path)


def launch_phase_job(config_path: str, phase: str, manifest_path: str, previous_path: str | None, state_path: str, *,
                     job: dict, image: str, resources: dict, storage: dict, poll_seconds: float = 10.0) -> dict:
    """Run one phase as a Kubeflow Training Operator PyTorchJob or a Trainer v2 TrainJob (the settings'
    `api`) and wait for it; same inputs and outputs as `train_phase`. The job's pods read the inputs
    from the run's store and rank 0 writes the phase's state there, so the store must be MinIO/S3,
    which every pod reaches.

    `job`: the PhaseJob fields; `resources`: the PodResources fields (the pipeline's training-task
    parameters); `storage`: the StorageAccess fields (endpoint, Secret name and keys, Pushgateway)."""
    from fedpipe.k8s.launcher import PhaseJobLauncher, job_manifest
    from fedpipe.k8s.phasejob import PhaseJob, PodResources, StorageAccess

    settings = PhaseJob.from_dict(job)
    store = load_config(config_path).run.store
    if not store.startswith("s3://"):
        raise ConfigError(
            f"phase {phase!r} runs as a {settings.kind}, whose pods share the run through its store, but run.store is "
            f"{store!r}, a folder only this pod sees. Set run.store to s3://bucket/prefix."
        )
    run = _phase_inputs(config_path, phase, manifest_path, previous_path)
    storage = dict(storage, s3_secret_keys=tuple(storage.get("s3_secret_keys", ("accesskey", "secretkey"))))
    pinned = run.cfg.model_copy(update={"run": run.cfg.run.model_copy(update={"id": run.layout.run_id})})  # every pod, one run folder
    launcher = PhaseJobLauncher(poll_seconds=poll_seconds)
    manifest = job_manifest(
        run_id=run.layout.run_id, phase=phase, config_yaml=pinned.to_yaml(), namespace=launcher.namespace,
        image=image, job=settings, resources=PodResources(**resources), storage=StorageAccess(**storage),
    )
    launcher.run(manifest, wait_seconds=settings.timeout_seconds + 60, cleanup=settings.cleanup)
    return _phase_outputs(run, phase, state_path)


def _text_or_empty(run: Run, key: str) -> str:
    return run.store.get_text(key) if run.store.exists(key) else ""


def evaluate(config_path: str, manifest_path: str, state_path: str, html_path: str, markdown_path: str) -> dict:
    run = _prepare(config_path, manifest_path)
    last = run.phases()[-1].name
    check_pointer(run, run.layout.phase(last).final, state_path)
    summary = run.evaluate()
    images = {
        name: run.store.get(run.layout.report(name))
        for name in ("accuracy.png", "lam_curve.png", *(() if run.cfg.privacy.enabled else ("partition_heatmap.png",)))
        if run.store.exists(run.layout.report(name))  # privacy on: the clients' label counts stay in the store
    }
    clients = _text_or_empty(run, run.layout.report("clients.csv"))
    Path(html_path).write_text(render_html(summary["title"], summary_lines(summary), images, clients_html(clients) if clients else ""))
    Path(markdown_path).write_text(run.store.get_text(run.layout.report("report.md")))
    return summary


def compare(config_path: str, run_ids: list[str], markdown_path: str, json_path: str) -> str:
    """The benchmark's comparison table (the papers' tables' shape) from the runs' summaries in the store.
    (Run ids travel between the tasks, not the summaries: kfp's local runner breaks a list of JSON strings.)"""
    from fedpipe.federation.report import comparison_table as federated_table
    from fedpipe.run.report import comparison_table

    run = _prepare(config_path)
    rows = [read_store_json(run.store, RunLayout(run_id).report("summary.json"), "run summary", SUMMARY_LIMIT, CorruptArtifactError,
                            "Run `fedpipe evaluate` on that run again.") for run_id in run_ids]
    # each method's run at the sites (engine.mode=federation) or simulated: the summaries say which
    table = federated_table(rows) if run.cfg.engine.mode == "federation" else comparison_table(rows)
    Path(markdown_path).write_text(table + "\n")
    Path(json_path).write_text(json.dumps(rows, indent=2))
    return table


MAX_MODEL_BYTES = 2**34  # one exported model (a .pt2 archive of its weights): 16 GiB is far above any fedpipe network
METADATA_CLIENTS = 1000  # clients listed in the personalized models' artifact metadata (index.json lists them all)


def publish(config_path: str, evaluated_run: str, global_path: str, clients_path: str, line_path: str) -> dict:
    """Register the evaluated run in its model line and promote it if the gate says so (registry.name empty:
    nothing is registered). Writes the exported models into the task's artifacts: the global model as one
    file, the personalized models as one folder (`<client>.pt2`, `index.json`, `spec.json`); returns the
    decision's figures and the artifacts' metadata."""
    from fedpipe.models.publish import publish as publish_run

    run = _prepare(config_path)
    if evaluated_run != run.layout.run_id:
        raise CorruptArtifactError(f"The evaluate task evaluated run {evaluated_run!r}, but this task's config is run "
                                   f"{run.layout.run_id!r}: the artifacts belong to another run. Rerun the pipeline.")
    if run.cfg.engine.mode == "federation":  # the global model only, gated on the sites' scores (fedpipe.models.federated)
        from fedpipe.models.federated import publish_federated, scored_champion

        result = (publish_federated(run.cfg, read_store_json(run.store, run.layout.report("summary.json"), "run summary", SUMMARY_LIMIT,
                                                             CorruptArtifactError, "Run the pipeline again."), scored_champion(run.cfg))
                  if run.cfg.registry.name else {"published": False, "reason": "registry.name is empty: the run's models are not registered"})
    else:
        result = publish_run(run)
    Path(clients_path).mkdir(parents=True, exist_ok=True)
    Path(global_path).parent.mkdir(parents=True, exist_ok=True)
    if not result["published"]:
        note = json.dumps({"published": False, "reason": result["reason"]})
        Path(global_path).write_text(note)
        (Path(clients_path) / "index.json").write_text(note)
        Path(line_path).write_text(f"Not published: {result['reason']}.\n")
        return {**result, "global_metadata": {"published": False}, "clients_metadata": {"published": False}}
    Path(line_path).write_text(run.store.get_text(run.layout.report("model_line.md")))
    return {**result, **_write_models(run, result, global_path, Path(clients_path))}


def _write_models(run: Run, result: dict, global_path: str, folder: Path) -> dict:
    """The published version's models copied into the task's Model artifacts; their metadata."""
    from fedpipe.models.line import ModelLine

    line, version = ModelLine(run.store, result["line"]), result["version"]
    base = {"line": line.name, "version": version, "run_id": run.layout.run_id, "store_url": result["where"]}
    glob = result["global_model"]
    if glob is None:
        Path(global_path).write_text(json.dumps({"global_model": None, "reason": f"{run.cfg.method.name} trains no global model"}))
    else:
        Path(global_path).write_bytes(line.read(version, glob, MAX_MODEL_BYTES))
    index = {}
    for client, key in result["client_models"].items():
        name = key.removeprefix("clients/")
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(line.read(version, key, MAX_MODEL_BYTES))
        index[client] = name
    if "spec.json" in result["files"]:
        (folder / "spec.json").write_bytes(line.read(version, "spec.json", MAX_MODEL_BYTES))
    (folder / "index.json").write_text(json.dumps({**base, "clients": index}, indent=1))
    return {"global_metadata": {**base, "client": "global", "format": result["global_format"] or "none"},
            "clients_metadata": {**base, "client": "personalized", "format": ",".join(result["client_formats"]), "clients": len(index),
                                 "index": dict(list(index.items())[:METADATA_CLIENTS]), "index_file": "index.json"}}
