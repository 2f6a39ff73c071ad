"""One run, step by step: run, partition, train, evaluate, verify, config."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from fedpipe.cli.common import ConfigOpt, RunIdOpt, SetOpt, _guarded, _load, _load_for_run, _print_summary, app


@app.command()
@_guarded
def run(config: ConfigOpt = None, set: SetOpt = None, run_id: RunIdOpt = None,
        fresh: Annotated[bool, typer.Option("--fresh", help="Delete the run's earlier artifacts (only what fedpipe wrote) and start over.")] = False,
        take_over: Annotated[bool, typer.Option("--take-over", help="Take the run over from a writer whose heartbeat is older than FEDPIPE_OWNER_STALE_SECONDS (a dead one).")] = False,
        pipeline_root: Annotated[Optional[Path], typer.Option(help="Folder for the pipeline's task artifacts (default: <store>/_kfp).")] = None,
        verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show every line the pipeline tasks print.")] = False,
        benchmark: Annotated[Optional[list[str]], typer.Option("--benchmark", help="Run the benchmark pipeline of these methods (repeatable) on one partition instead, and print its comparison table. With engine.mode=federation: each method its own federated run on the same sites, one table.")] = None):
    """Run the method's Kubeflow pipeline on this machine (kfp's local runner): config, partition,
    one task per training phase, evaluation; then print a summary and where the report is.

    The same compiled pipeline runs on a cluster (`fedpipe submit`). Running a config again reuses
    its finished steps and resumes an interrupted phase from its last finished round.
    """
    from fedpipe.errors import CorruptArtifactError
    from fedpipe.pipelines.local_runner import run_method_locally
    from fedpipe.run.run import Run
    from fedpipe.safe_load import read_store_json

    if _load(config, set, run_id).engine.mode == "federation":  # the sites hold the data: the server side goes to the SuperLink
        from fedpipe.models.warm import pin_init_from

        # no data snapshot to pin here (each site reads its own); the warm start's version is pinned, as in a simulation
        cfg = pin_init_from(_load(config, set, run_id))
        if benchmark:  # the benchmark pipeline's federation branch: one census, each method its own run at the same sites
            _run_benchmark(cfg, benchmark, pipeline_root or _pipeline_root(cfg), verbose)
        else:
            _run_federated(cfg)
        return
    cfg = _load_for_run(config, set, run_id)
    r = Run(cfg, take_over=take_over)
    if fresh:
        r.fresh()
    elif take_over:  # the pipeline's tasks are other processes: take the run over here, then hand it on
        with r.owner:
            pass
    r.preflight()  # bad data, split or model: a clear message before anything is written
    root = pipeline_root or _pipeline_root(cfg)
    if benchmark:
        _run_benchmark(cfg, benchmark, root, verbose)
        return
    typer.echo(f"Running pipeline {cfg.method.name} ({', '.join(p.name for p in r.phases())}) locally; task artifacts in {root}", err=True)
    folder = run_method_locally(cfg, root, verbose)
    summary = read_store_json(r.store, r.layout.report("summary.json"), "run summary", 2**20, CorruptArtifactError,
                              "Run `fedpipe evaluate` again.")
    summary["report"] = r.store.url(r.layout.report_dir)
    _print_summary(summary)
    typer.echo(f"  report as HTML         {folder / 'evaluate' / 'report'} (the pipeline's artifact)")
    if cfg.registry.name:
        _print_publication(r.store, cfg.registry.name, r.layout.run_id)


def _run_federated(cfg) -> None:
    """engine.mode=federation: submit the run to federation.superlink (the sites have joined it with `fedpipe site
    join`), wait, print what the sites reported and where the report is (fedpipe.federation.launch); with
    registry.name, the sites also score the line's promoted global model and the run's is registered, and promoted
    when the gate says so (fedpipe.models.federated)."""
    from fedpipe.federation.launch import federate, site_count
    from fedpipe.federation.report import summary_lines
    from fedpipe.models.federated import champion_for, publish_federated, warm_start_for
    from fedpipe.run.run import Run
    from fedpipe.store import open_store

    champion = champion_for(cfg, site_count(cfg))  # None: no line, or nothing promoted yet
    warm = warm_start_for(cfg, site_count(cfg))  # None: train.init_from=none
    typer.echo(f"Running {cfg.method.name} as a federation through {cfg.federation.superlink}: waiting for "
               f"{site_count(cfg)} sites" + (f"; starting from version {warm[0]} of model line {cfg.registry.name!r}" if warm else "")
               + (f"; the sites also score version {champion[0]} of model line {cfg.registry.name!r}" if champion else ""), err=True)
    summary = federate(cfg, champion=None if champion is None else champion[1], warm_start=None if warm is None else warm[1],
                       warm_ledger=None if warm is None else warm[2])
    for line in summary_lines(summary)[1:]:
        typer.echo(line)
    typer.echo(f"  outputs                {summary['folder']}")
    if cfg.registry.name:
        publish_federated(cfg, summary, None if champion is None else champion[0])
        _print_publication(open_store(str(cfg.run.store)), cfg.registry.name, Run(cfg).layout.run_id)


def _pipeline_root(cfg) -> Path:
    """Where the local runner keeps the pipeline's task artifacts by default: <store>/_kfp (runs/_kfp for an S3 store)."""
    return Path(cfg.run.store if "://" not in cfg.run.store else "runs") / "_kfp"


def _run_benchmark(cfg, methods: list[str], root: Path, verbose: bool) -> None:
    """`--benchmark`: the benchmark pipeline on this machine (kfp's local runner), then its comparison table. Simulated:
    one partition, each method its own run on it; engine.mode=federation: one census, each method its own run through
    the same SuperLink on the same sites (the pipeline's federation branch)."""
    from fedpipe.pipelines.builder import DeployOptions, benchmark_pipeline
    from fedpipe.pipelines.local_runner import run_locally

    where = "at the sites" if cfg.engine.mode == "federation" else "on one partition"
    typer.echo(f"Running the benchmark pipeline of {', '.join(methods)} locally, {where}; task artifacts in {root}", err=True)
    unpinned = cfg.model_copy(update={"run": cfg.run.model_copy(update={"id": None})})  # one run per method
    folder = run_locally(benchmark_pipeline(unpinned, methods, DeployOptions(store=cfg.run.store)), {}, root, verbose)
    # the simulation's comparison task is made first and keeps its plain name; the federation branch's is compare-2
    table = next(p for p in (folder / "compare" / "table", folder / "compare-2" / "table") if p.exists())
    typer.echo(table.read_text().rstrip())


def _print_publication(store, name: str, run_id: str) -> None:
    """The publish task's outcome: this run's version of the model line, the gate's decision, what is promoted."""
    from fedpipe.models.line import ModelLine

    line = ModelLine(store, name)
    mine = [line.record(v) for v in line.versions()[::-1][:50]]
    mine = [rec for rec in mine if rec.run_id == run_id][:1]
    if not mine:
        typer.echo(f"  model line             {name}: this run was not registered (see the publish task's log)")
        return
    rec = mine[0]
    verdict = "promoted" if rec.decision.get("promoted") else "not promoted"
    typer.echo(f"  model line             {name} version {rec.version}: {verdict} ({rec.decision.get('reason', '')}); "
               f"promoted now: version {line.promoted()}")


@app.command()
@_guarded
def partition(config: ConfigOpt = None, set: SetOpt = None, run_id: RunIdOpt = None):
    """Split the dataset over clients: writes the manifest (client -> sample indices) and a label heatmap."""
    from fedpipe.run.run import Run

    r = Run(_load_for_run(config, set, run_id))
    p = r.partition()
    sizes = [len(c.train) + len(c.val) + len(c.test) for c in p.clients]
    typer.echo(f"{len(p.clients)} clients, {min(sizes)}-{max(sizes)} samples each; manifest: {r.store.url(r.layout.partition_manifest)}")


@app.command()
@_guarded
def train(phase: Annotated[str, typer.Option("--phase", "-p", help="The phase to run (see `fedpipe methods`), e.g. federation.")],
          config: ConfigOpt = None, set: SetOpt = None, run_id: RunIdOpt = None,
          take_over: Annotated[bool, typer.Option("--take-over", help="Take the run over from a writer whose heartbeat is older than FEDPIPE_OWNER_STALE_SECONDS (a dead one).")] = False):
    """Run one training phase; it reads the previous phase's state and resumes from its own last checkpoint.
    With train.init_from, the first phase starts from that model-line version (PyTorchJob and TrainJob pods
    run this command)."""
    from fedpipe.models.warm import attach
    from fedpipe.run.run import Run

    r = attach(Run(_load_for_run(config, set, run_id), take_over=take_over))
    state = r.train(phase)
    if state is None:  # a rank > 0 of a distributed phase: rank 0 reports
        return
    typer.echo(f"phase {phase} finished at round {state.round}; state: {r.store.url(r.layout.phase(phase).final)}")


@app.command()
@_guarded
def evaluate(config: ConfigOpt = None, set: SetOpt = None, run_id: RunIdOpt = None):
    """Evaluate the last phase's models and write the report (summary, per-client table, plots)."""
    from fedpipe.run.run import Run

    _print_summary(Run(_load_for_run(config, set, run_id)).evaluate())


@app.command()
@_guarded
def verify(run_id: Annotated[str, typer.Argument(metavar="RUN", help="The run's id: its folder name in the store (`fedpipe run` prints it in the report path).")],
           store: Annotated[Optional[str], typer.Option(help="The store holding the run: a folder or s3://bucket/prefix (default: run.store of --config / --set, else runs/).")] = None,
           config: ConfigOpt = None, set: SetOpt = None,
           quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only damaged or missing artifacts and the verdict.")] = False):
    """Check that a finished run's artifacts are intact: exit 0 when all are, 1 when any is missing or changed.

    The evaluate step writes RUN/manifest.json last, listing every artifact of the run (partition
    manifest, phase states, round metrics, report) with its sha256 and size. `verify` reads each one
    back from the store (a folder, or MinIO / S3 with FEDPIPE_S3_ENDPOINT and the AWS_* credentials
    in the environment), recomputes its sha256 and names every file that is missing or whose bytes
    differ. Examples:

        fedpipe verify fedavg-mnist5k-pathological-s0-1a2b3c4d

        fedpipe verify test --store s3://mlpipeline/fedpipe

    A damaged file cannot be repaired from the manifest: delete it and rerun the step that writes
    it (`fedpipe run` reuses the intact steps), or restore it from a copy.
    """
    from fedpipe.run.verify import verify_run
    from fedpipe.store import open_store

    if store is None:
        store = _load(config, set).run.store
    s = open_store(store)
    result = verify_run(s, run_id)
    total = len(result.intact) + len(result.missing) + len(result.damaged)
    typer.echo(f"run {run_id}: checking {total} artifacts listed in {result.where}")
    for key in result.intact if not quiet else []:
        typer.echo(f"  intact   {s.url(key)}")
    for key in result.missing:
        typer.echo(f"  MISSING  {s.url(key)}")
    for key, why in result.damaged.items():
        typer.echo(f"  DAMAGED  {s.url(key)}: {why}")
    for key in result.unlisted:
        typer.echo(f"  note: {s.url(key)} is not in the manifest (written after the run finished?)")
    if result.ok:
        typer.echo(f"run {run_id}: all {total} artifacts intact")
        return
    bad = len(result.missing) + len(result.damaged)
    typer.echo(f"run {run_id}: {bad} of {total} artifacts missing or damaged; rerun the steps that write them "
               "(fedpipe run reuses intact steps) or restore them from a copy", err=True)
    raise typer.Exit(1)


@app.command("config")
@_guarded
def show_config(config: ConfigOpt = None, set: SetOpt = None,
                explain: Annotated[bool, typer.Option("--explain", help="List every field with its meaning instead.")] = False):
    """Print the resolved config as YAML (defaults + file + --set), or explain every field."""
    cfg = _load(config, set)
    if not explain:
        typer.echo(cfg.to_yaml().rstrip())
        return
    for line in _explain(cfg):
        typer.echo(line)


def _explain(cfg) -> list[str]:
    lines = []
    for section_name in type(cfg).model_fields:
        section = getattr(cfg, section_name)
        lines.append(f"{section_name}:  ({type(section).__doc__.strip().splitlines()[0] if type(section).__doc__ else ''})")
        for name, field in type(section).model_fields.items():
            doc = " ".join((field.description or "").split())
            lines.append(f"  {section_name}.{name} = {getattr(section, name)!r}\n      {doc}")
    return lines
