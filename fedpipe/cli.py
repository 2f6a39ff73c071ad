"""The `fedpipe` command line."""

from __future__ import annotations

import functools
import inspect
import math
from pathlib import Path
from typing import Annotated, Optional

import typer

from fedpipe.errors import FedpipeError
from fedpipe.telemetry.progress import log_to_stderr

app = typer.Typer(
    name="fedpipe",
    help=(
        "Personalized federated learning (SuPerFed and its baselines) as a pipeline of steps: "
        "partition -> train each phase -> evaluate.\n\n"
        "Every command reads one config (YAML, see examples/; without --config the defaults run "
        "SuPerFed-MM on mnist5k, pathological split, 20 clients) and takes --set overrides such as "
        "--set train.rounds=50 --set method.name=fedavg. Artifacts go to the store (run.store: a "
        "folder, or s3://bucket/prefix) under the run's id; rerunning the same config resumes it."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="YAML run config (see examples/). Default: built-in defaults.")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", "-s", help="Override one field, e.g. --set train.rounds=50 (repeatable).")]
RunIdOpt = Annotated[Optional[str], typer.Option("--run-id", help="Folder name of the run in the store (default: derived from the config).")]


def _guarded(fn):
    """Turn a user-fixable error into one plain paragraph and exit code 2 (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        log_to_stderr()
        try:
            return fn(*args, **kwargs)
        except FedpipeError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None

    return wrapper


def _load(config: Optional[Path], overrides: Optional[list[str]], run_id: Optional[str] = None):
    """The config as written (defaults, file, --set): what is compiled into a pipeline or shown."""
    from fedpipe.run.config import load_config

    sets = list(overrides or [])
    if run_id:
        sets.append(f"run.id={run_id}")
    return load_config(config, sets)


def _load_for_run(config: Optional[Path], overrides: Optional[list[str]], run_id: Optional[str] = None):
    """The config of a run that starts here, with what it starts from pinned: its own data's snapshot (and
    the `latest` drop it reads) and the model-line version it warm-starts from, so both are in its id. Never
    for a compiled pipeline: its config task pins them when each run starts (a schedule must not freeze
    today's drop or today's promoted version)."""
    from fedpipe.models.warm import pin_init_from
    from fedpipe.run.config import with_data_snapshot

    return pin_init_from(with_data_snapshot(_load(config, overrides, run_id)))


def _print_summary(summary: dict) -> None:
    from fedpipe.run.report import summary_lines

    typer.echo("\n".join(summary_lines(summary)))


@app.command()
@_guarded
def run(config: ConfigOpt = None, set: SetOpt = None, run_id: RunIdOpt = None,
        fresh: Annotated[bool, typer.Option("--fresh", help="Delete the run's earlier artifacts (only what fedpipe wrote) and start over.")] = False,
        take_over: Annotated[bool, typer.Option("--take-over", help="Take the run over from a writer whose heartbeat is older than FEDPIPE_OWNER_STALE_SECONDS (a dead one).")] = False,
        pipeline_root: Annotated[Optional[Path], typer.Option(help="Folder for the pipeline's task artifacts (default: <store>/_kfp).")] = None,
        verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show every line the pipeline tasks print.")] = False,
        benchmark: Annotated[Optional[list[str]], typer.Option("--benchmark", help="Run the benchmark pipeline of these methods (repeatable) on one partition instead, and print its comparison table.")] = None):
    """Run the method's Kubeflow pipeline on this machine (kfp's local runner): config, partition,
    one task per training phase, evaluation; then print a summary and where the report is.

    The same compiled pipeline runs on a cluster (`fedpipe submit`). Running a config again reuses
    its finished steps and resumes an interrupted phase from its last finished round.
    """
    from fedpipe.errors import CorruptArtifactError
    from fedpipe.pipelines.local_runner import run_locally, run_method_locally
    from fedpipe.run.run import Run
    from fedpipe.safe_load import read_store_json

    cfg = _load_for_run(config, set, run_id)
    r = Run(cfg, take_over=take_over)
    if fresh:
        r.fresh()
    elif take_over:  # the pipeline's tasks are other processes: take the run over here, then hand it on
        with r.owner:
            pass
    r.preflight()  # bad data, split or model: a clear message before anything is written
    root = pipeline_root or Path(cfg.run.store if "://" not in cfg.run.store else "runs") / "_kfp"
    if benchmark:
        from fedpipe.pipelines.builder import DeployOptions, benchmark_pipeline

        typer.echo(f"Running the benchmark pipeline of {', '.join(benchmark)} locally; task artifacts in {root}", err=True)
        local_store = DeployOptions(store=cfg.run.store)
        unpinned = cfg.model_copy(update={"run": cfg.run.model_copy(update={"id": None})})  # one run per method
        folder = run_locally(benchmark_pipeline(unpinned, benchmark, local_store), {}, root, verbose)
        typer.echo((folder / "compare" / "table").read_text().rstrip())
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


ImageRepositoryOpt = Annotated[Optional[str], typer.Option(help="Image repository of the tasks, e.g. registry.example.com/ml/fedpipe (default: ghcr.io/fedpipe/fedpipe). `make images` builds one.")]
ImageTagOpt = Annotated[Optional[str], typer.Option(help="Image tag of the config, partition and evaluate tasks (default: fedpipe's version, the CPU image).")]
TrainingImageTagOpt = Annotated[Optional[str], typer.Option(help="Image tag of the training tasks (default: <image tag>-cuda, the CUDA image, which also runs on CPU nodes).")]
AcceleratorCountOpt = Annotated[Optional[int], typer.Option(min=0, help="GPUs each training task asks for: the default of the pipeline parameter accelerator_count (default 1; 0 = CPU only).")]
AcceleratorTypeOpt = Annotated[Optional[str], typer.Option(help="Extended resource of that request: the default of the parameter accelerator_type (default nvidia.com/gpu).")]
ResourceOpt = Annotated[Optional[list[str]], typer.Option("--resource", help="NAME=VALUE default of a resource parameter (repeatable): cpu_request, cpu_limit, memory_request, memory_limit of the training tasks; step_cpu_request, step_cpu_limit, step_memory_request, step_memory_limit of the other tasks. E.g. --resource memory_limit=32Gi.")]
StoreOpt = Annotated[Optional[str], typer.Option(help="Store of runs on the cluster (default: env FEDPIPE_STORE, else s3://mlpipeline/fedpipe).")]
S3EndpointOpt = Annotated[Optional[str], typer.Option(help="MinIO/S3 endpoint the pods use (default: env FEDPIPE_S3_ENDPOINT, else Kubeflow's MinIO).")]
S3SecretOpt = Annotated[Optional[str], typer.Option(help="Secret with the S3 credentials (default: env FEDPIPE_S3_SECRET, else mlpipeline-minio-artifact).")]
PushgatewayOpt = Annotated[Optional[str], typer.Option(help="Pushgateway URL the pods push round metrics to: the default of the run parameter telemetry_pushgateway, which the Kubeflow UI can change (default: env FEDPIPE_PUSHGATEWAY, else none).")]


DistributedPhaseOpt = Annotated[Optional[str], typer.Option("--distributed-phase", help="Run this phase (see `fedpipe methods`) as a Kubeflow Training Operator PyTorchJob (or a Trainer v2 TrainJob: --job-api), created and awaited by a small launcher task, instead of as one task: for a phase that outgrows one GPU or node. Needs the Training Operator (or Trainer) and the launcher's RBAC (the chart's pytorchJob.enabled).")]
NodesOpt = Annotated[Optional[int], typer.Option("--nodes", min=1, help="With --distributed-phase: pods of the PyTorchJob, one Master and the rest Workers (default 2).")]
ProcessesOpt = Annotated[Optional[int], typer.Option("--processes-per-node", min=1, help="With --distributed-phase: torchrun processes per pod (default 1).")]
GpusOpt = Annotated[Optional[int], typer.Option("--gpus-per-process", min=0, help="With --distributed-phase: GPUs per process, NCCL between them (default 0: CPU, gloo).")]
JobCleanupOpt = Annotated[Optional[str], typer.Option("--job-cleanup", help="With --distributed-phase: delete the finished PyTorchJob on-success (default; a failed one is kept to inspect), always, or never.")]
JobTimeoutOpt = Annotated[Optional[int], typer.Option("--job-timeout", min=1, help="With --distributed-phase: seconds the PyTorchJob may run (default 86400).")]
SigningSecretOpt = Annotated[Optional[str], typer.Option(help="Secret holding the artifact signing key under the key 'key': every task gets it as FEDPIPE_SIGNING_KEY and signs everything it writes (default: none, unsigned; the chart's signing.*).")]
KfpVersionOpt = Annotated[Optional[str], typer.Option("--kfp-version", help="The Kubeflow Pipelines backend the pipeline is compiled for (register, submit, schedule: the server's own; compile: 2.5.0, the floor, whose pipeline runs on every supported backend). From 2.16.0 (Kubeflow 26.03) every task also gets a securityContext: user 1000, non-root; older API servers refuse or drop such a task config.")]
JobApiOpt = Annotated[Optional[str], typer.Option("--job-api", help="With --distributed-phase: pytorchjob (Kubeflow Training Operator v1, default) or trainjob (Kubeflow Trainer v2.1+, Kubeflow 1.11+: a TrainJob on a ClusterTrainingRuntime).")]
TrainerRuntimeOpt = Annotated[Optional[str], typer.Option("--trainer-runtime", help="With --job-api trainjob: the ClusterTrainingRuntime the TrainJob runs on (default torch-distributed, which Trainer ships).")]


# The deployment flags of compile, register, submit and schedule, each declared once: `_deploy_flags`
# appends them to a command's parameters and hands the command their values as one dict, `deploy`.
DEPLOY_OPTIONS = {
    "image_repository": ImageRepositoryOpt, "image_tag": ImageTagOpt, "training_image_tag": TrainingImageTagOpt,
    "accelerator_count": AcceleratorCountOpt, "accelerator_type": AcceleratorTypeOpt, "resource": ResourceOpt,
    "store": StoreOpt, "s3_endpoint": S3EndpointOpt, "s3_secret": S3SecretOpt, "pushgateway": PushgatewayOpt,
    "distributed_phase": DistributedPhaseOpt, "nodes": NodesOpt, "processes_per_node": ProcessesOpt,
    "gpus_per_process": GpusOpt, "job_cleanup": JobCleanupOpt, "job_timeout": JobTimeoutOpt, "job_api": JobApiOpt, "kfp_version": KfpVersionOpt, "signing_secret": SigningSecretOpt,
    "trainer_runtime": TrainerRuntimeOpt,
}
DEPLOY_FLAGS = tuple(DEPLOY_OPTIONS)


def _deploy_flags(fn):
    """Give a cluster command the flags of DEPLOY_OPTIONS (after its own, all defaulting to None);
    the command takes them as `deploy`, a dict of their values by parameter name."""
    signature = inspect.signature(fn, eval_str=True)
    own = [param for name, param in signature.parameters.items() if name != "deploy"]
    flags = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=alias)
             for name, alias in DEPLOY_OPTIONS.items()]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        deploy = {name: kwargs.pop(name, None) for name in DEPLOY_FLAGS}
        return fn(*args, deploy=deploy, **kwargs)

    wrapper.__signature__ = signature.replace(parameters=[*own, *flags])
    return wrapper


def _distributed(deploy: dict) -> tuple:
    """The job settings of --distributed-phase (none without it)."""
    from fedpipe.k8s.phasejob import PhaseJob

    given = {("nodes", "--nodes"): deploy.get("nodes"), ("processes_per_node", "--processes-per-node"): deploy.get("processes_per_node"),
             ("gpus_per_process", "--gpus-per-process"): deploy.get("gpus_per_process"),
             ("cleanup", "--job-cleanup"): deploy.get("job_cleanup"), ("timeout_seconds", "--job-timeout"): deploy.get("job_timeout"),
             ("api", "--job-api"): deploy.get("job_api"), ("runtime", "--trainer-runtime"): deploy.get("trainer_runtime")}
    given = {key: value for key, value in given.items() if value is not None}
    if deploy.get("distributed_phase") is None:
        if given:
            raise FedpipeError(f"{', '.join(flag for _, flag in given)} only apply with --distributed-phase PHASE.")
        return ()
    return (PhaseJob(phase=deploy["distributed_phase"], **{field: value for (field, _), value in given.items()}),)


def _options(deploy: dict, distributed: tuple = ()):
    """DeployOptions from the deployment flags every cluster command shares (see DEPLOY_OPTIONS)."""
    from fedpipe.pipelines.builder import DeployOptions

    resources = {}
    for item in deploy.get("resource") or []:
        name, sep, value = item.partition("=")
        if not sep:
            raise FedpipeError(f"--resource {item!r} is not NAME=VALUE, e.g. --resource memory_limit=32Gi.")
        resources[name.strip()] = value.strip()
    for name in ("accelerator_count", "accelerator_type"):
        if deploy.get(name) is not None:
            resources[name] = str(deploy[name])
    chosen = {key: deploy.get(key) for key in ("image_repository", "image_tag", "training_image_tag", "store", "s3_endpoint",
                                                "s3_secret", "pushgateway", "kfp_version", "signing_secret")}
    return DeployOptions.from_env(**chosen, resources=resources, distributed=distributed)


def _pipeline(cfg, options, benchmark: Optional[list[str]]):
    from fedpipe.pipelines.builder import benchmark_pipeline, method_pipeline

    return benchmark_pipeline(cfg, benchmark, options) if benchmark else method_pipeline(cfg, options)


BenchmarkOpt = Annotated[Optional[list[str]], typer.Option("--benchmark", help="Compile the benchmark pipeline of these methods instead (repeatable).")]


@app.command("compile")
@_guarded
@_deploy_flags
def compile_(config: ConfigOpt = None, set: SetOpt = None,
             out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Where to write the pipeline YAML.")] = None,
             all_: Annotated[bool, typer.Option("--all", help="Regenerate the shipped pipelines/*.yaml and components/*.yaml (release defaults, environment ignored).")] = False,
             benchmark: BenchmarkOpt = None, *, deploy: dict):
    """Compile the method's pipeline (one task per phase) to Kubeflow Pipelines v2 YAML."""
    from fedpipe.pipelines.builder import SHIPPED, compile_pipeline, compile_shipped_components, shipped_pipelines

    if all_:
        for name, pipeline in shipped_pipelines().items():
            typer.echo(compile_pipeline(pipeline, SHIPPED / name))
        import fedpipe.components

        for path in compile_shipped_components(Path(fedpipe.components.__file__).parent):
            typer.echo(path)
        from fedpipe.pipelines.study import compile_shipped_study

        typer.echo(compile_shipped_study())
        return
    cfg = _load(config, set)
    target = out or Path(f"{cfg.method.name if not benchmark else 'benchmark'}.yaml")
    options = _options(deploy, _distributed(deploy))
    typer.echo(compile_pipeline(_pipeline(cfg, options, benchmark), target))


HostOpt = Annotated[Optional[str], typer.Option(help="Kubeflow Pipelines API, e.g. http://localhost:8080 (port-forwarded) or, in the cluster, http://ml-pipeline.kubeflow.svc.cluster.local:8888 (default: env KF_PIPELINES_ENDPOINT).")]
NamespaceOpt = Annotated[Optional[str], typer.Option(help="Kubeflow profile namespace; required on multi-user Kubeflow (default: kfp's saved namespace, or in a pod its own namespace). A single-user KFP ignores it.")]


def _token_from_env_only(ctx: typer.Context, param: typer.CallbackParam, value: Optional[str]) -> Optional[str]:
    """The KFP token comes from the environment or a file, never from the command line: argv is
    readable by every user of the machine (`ps`, /proc/<pid>/cmdline) and lands in shell history."""
    source = ctx.get_parameter_source(param.name)  # typer's own click or click: compared by name
    if value is not None and getattr(source, "name", None) == "COMMANDLINE":
        raise typer.BadParameter(param_hint="'--token'", message=
            "a token on the command line is visible to every user of this machine (ps) and stays in your shell "
            "history, so fedpipe does not take it there. Put it in the environment, FEDPIPE_KFP_TOKEN="
            "$(kubectl create token ...), or in a file readable only by you and pass --token-file FILE.")
    return value


TokenOpt = Annotated[Optional[str], typer.Option(envvar="FEDPIPE_KFP_TOKEN", show_default=False, hidden=True, callback=_token_from_env_only, help="Refused: the bearer token comes from env FEDPIPE_KFP_TOKEN or --token-file, never the command line.")]
TokenFileOpt = Annotated[Optional[str], typer.Option(envvar="KF_PIPELINES_SA_TOKEN_PATH", help="File holding the bearer token for the KFP API (multi-user Kubeflow), re-read on each request; or put the token itself in env FEDPIPE_KFP_TOKEN (which wins), e.g. FEDPIPE_KFP_TOKEN=$(kubectl create token default-editor -n <namespace> --audience pipelines.kubeflow.org). Default: the pod's projected token /var/run/secrets/kubeflow/pipelines/token when it exists.")]
MethodOpt = Annotated[Optional[str], typer.Option("--method", "-m", help="Shortcut for --set method.name=METHOD.")]
NameOpt = Annotated[Optional[str], typer.Option(help="Pipeline name in Kubeflow (default: fedpipe-<method>).")]
ExperimentOpt = Annotated[str, typer.Option(help="Kubeflow experiment the runs belong to.")]


def _cluster_pipeline(config, set, method, deploy: dict, host, namespace, token, token_file):
    """The config and flags checked (before anything is sent), then the KFP API connected, then the
    pipeline compiled for the backend version it reports (unless --kfp-version says otherwise)."""
    from dataclasses import replace

    from fedpipe.pipelines.builder import method_pipeline
    from fedpipe.pipelines.client import backend_version, connect

    distributed = _distributed(deploy)  # a misused --distributed-phase flag fails before the config is read
    cfg = _load(config, [*(set or []), *([f"method.name={method}"] if method else [])])
    options = _options(deploy, distributed)
    client = connect(host, namespace, token, token_file)
    if deploy.get("kfp_version") is None:
        options = replace(options, kfp_version=backend_version(client) or options.kfp_version)
    return cfg, method_pipeline(cfg, options), client


@app.command()
@_guarded
@_deploy_flags
def register(host: HostOpt = None, config: ConfigOpt = None, set: SetOpt = None, method: MethodOpt = None, name: NameOpt = None,
             namespace: NamespaceOpt = None, token: TokenOpt = None, token_file: TokenFileOpt = None, *, deploy: dict):
    """Upload the method's pipeline (compiled from the config) to Kubeflow, as a new pipeline or a new version."""
    from fedpipe.pipelines.builder import pipeline_name
    from fedpipe.pipelines.client import register as do_register

    cfg, pipeline, client = _cluster_pipeline(config, set, method, deploy, host, namespace, token, token_file)
    name = name or pipeline_name(cfg.method.name)
    done = do_register(client, pipeline, name, description=f"fedpipe {cfg.method.name}")
    typer.echo(f"pipeline {name}: version {done.version} (pipeline id {done.pipeline_id}, version id {done.version_id})")


@app.command()
@_guarded
@_deploy_flags
def submit(host: HostOpt = None, config: ConfigOpt = None, set: SetOpt = None, method: MethodOpt = None,
           experiment: ExperimentOpt = "fedpipe", run_name: Annotated[Optional[str], typer.Option(help="Name of the run in the Kubeflow UI.")] = None,
           namespace: NamespaceOpt = None, token: TokenOpt = None, token_file: TokenFileOpt = None, *, deploy: dict):
    """Start one run of the method's pipeline on a Kubeflow cluster (the config becomes its defaults)."""
    from fedpipe.pipelines.client import submit as do_submit

    cfg, pipeline, client = _cluster_pipeline(config, set, method, deploy, host, namespace, token, token_file)
    run_id = do_submit(client, pipeline, experiment, run_name or cfg.run_id(), namespace)
    typer.echo(f"submitted run {run_id} of {cfg.method.name} to experiment {experiment!r}")


@app.command()
@_guarded
@_deploy_flags
def schedule(cron: Annotated[str, typer.Option(help="When to retrain, cron syntax in UTC, e.g. '0 3 * * *' (daily at 03:00).")],
             host: HostOpt = None, config: ConfigOpt = None, set: SetOpt = None, method: MethodOpt = None, name: NameOpt = None,
             experiment: ExperimentOpt = "fedpipe", namespace: NamespaceOpt = None, token: TokenOpt = None, token_file: TokenFileOpt = None,
             *, deploy: dict):
    """Register the pipeline and create (or replace) a recurring run of it: scheduled retraining.
    Each scheduled run trains anew in its own run folder; missed times are not caught up."""
    from fedpipe.pipelines.builder import pipeline_name
    from fedpipe.pipelines.client import kfp_cron
    from fedpipe.pipelines.client import register as do_register
    from fedpipe.pipelines.client import schedule as do_schedule

    kfp_cron(cron)  # a bad expression fails before anything is registered
    cfg, pipeline, client = _cluster_pipeline(config, set, method, deploy, host, namespace, token, token_file)
    name = name or pipeline_name(cfg.method.name)
    registered = do_register(client, pipeline, name, description=f"fedpipe {cfg.method.name}")
    job = do_schedule(client, registered, f"{name}-schedule", cron, experiment, namespace)
    typer.echo(f"recurring run {job} of {name} (version {registered.version}) on '{cron}' in experiment {experiment!r}")


@app.command()
@_guarded
def unschedule(host: HostOpt = None, method: MethodOpt = None, name: NameOpt = None, experiment: ExperimentOpt = "fedpipe",
               namespace: NamespaceOpt = None, token: TokenOpt = None, token_file: TokenFileOpt = None):
    """Delete the recurring run `fedpipe schedule` made (`<name>-schedule` in the experiment), if there is one:
    retraining stops; the pipeline, its versions and past runs stay. The Helm chart runs it on uninstall and
    when an upgrade empties schedule.cron."""
    from fedpipe.pipelines.builder import pipeline_name
    from fedpipe.pipelines.client import connect
    from fedpipe.pipelines.client import unschedule as do_unschedule

    name = name or pipeline_name(_load(None, [f"method.name={method}"] if method else None).method.name)
    job_name = f"{name}-schedule"
    deleted = do_unschedule(connect(host, namespace, token, token_file), job_name, experiment, namespace)
    if not deleted:
        typer.echo(f"no recurring run {job_name!r} in experiment {experiment!r}: nothing to delete")
    for job in deleted:
        typer.echo(f"deleted recurring run {job} ({job_name}) from experiment {experiment!r}")


check_app = typer.Typer(
    help="Check, from where the pipeline's pods run, what a run needs: the KFP API, the store, the Pushgateway "
         "(the Helm chart's `helm test` runs these). Each prints one line and exits 0, or says what failed and exits 2.",
    no_args_is_help=True,
)
app.add_typer(check_app, name="check")
CHECK_JOB = "fedpipe-check"  # the Pushgateway job of the check's group, apart from the runs' `fedpipe`


@check_app.command("kfp")
@_guarded
def check_kfp(host: HostOpt = None, namespace: NamespaceOpt = None, token: TokenOpt = None, token_file: TokenFileOpt = None):
    """The Kubeflow Pipelines API answers healthz with a release fedpipe's pipelines run on (the same check
    register, submit and schedule make first) and, on multi-user Kubeflow, a namespace is given."""
    from fedpipe.pipelines.client import connect, describe_backend

    typer.echo(describe_backend(connect(host, namespace, token, token_file), host))


@check_app.command("store")
@_guarded
def check_store(store: Annotated[str, typer.Option(help="The store the runs write to, e.g. s3://mlpipeline/fedpipe (FEDPIPE_S3_ENDPOINT and the AWS_* credentials from the environment, as in a task pod).")]):
    """Write one small object to the store, read it back and delete it, with the credentials a task pod gets."""
    import uuid

    from fedpipe.store import open_store

    opened = open_store(store)
    key = f"_fedpipe-check/{uuid.uuid4().hex}"
    payload = f"fedpipe check {key}".encode()
    opened.put(key, payload)
    try:
        back = opened.get(key)
    finally:
        opened.delete(key)
    if back != payload:
        raise FedpipeError(f"The store {opened.url()} gave back other bytes than were written to {opened.url(key)}.")
    typer.echo(f"store {opened.url()}: wrote, read back and deleted {opened.url(key)}")


@check_app.command("pushgateway")
@_guarded
def check_pushgateway(url: Annotated[str, typer.Option(help="The Pushgateway the runs push to, e.g. http://fedpipe-pushgateway.<namespace>:9091.")]):
    """Push one metric group the way a pipeline task does (prometheus_client), find it in the Pushgateway's
    /api/v1/metrics, and delete it."""
    import uuid

    from prometheus_client import CollectorRegistry, Gauge, delete_from_gateway, push_to_gateway

    from fedpipe.telemetry.prometheus import run_groups

    run_id = f"check-{uuid.uuid4().hex[:12]}"
    registry = CollectorRegistry()
    Gauge("fedpipe_check", "Pushed by `fedpipe check pushgateway`; deleted right away.", registry=registry).set(1)
    try:
        push_to_gateway(url, job=CHECK_JOB, registry=registry, grouping_key={"run_id": run_id}, timeout=10)
        found = run_groups(url, run_id, job=CHECK_JOB, timeout=10)
        delete_from_gateway(url, job=CHECK_JOB, grouping_key={"run_id": run_id}, timeout=10)
    except Exception as e:
        raise FedpipeError(
            f"The Pushgateway at {url} did not take a push: {type(e).__name__}: {str(e)[:300]}. Check the URL and that it "
            "runs; a 403 'RBAC: access denied' means Istio guards it (a sidecar on the Pushgateway pod, in a profile "
            "namespace): run it outside the mesh (the chart's pushgateway.podAnnotations) or allow the pushes.") from None
    if not found:
        raise FedpipeError(f"The Pushgateway at {url} accepted a push, but the group run_id={run_id} is not in its /api/v1/metrics.")
    typer.echo(f"Pushgateway at {url}: pushed, found and deleted the group job={CHECK_JOB} run_id={run_id}")


@app.command()
@_guarded
def methods():
    """List the methods, their phases, the papers their update rules come from, and every default that
    departs from its paper or fills a gap the paper leaves (a method's `departures`; docs/faithfulness.md
    has the equations and the reasons)."""
    from fedpipe.algorithms import ALGORITHMS, phases_of

    for name, cls in ALGORITHMS.items():
        phases = ", ".join(p.name for p in phases_of(cls.Params(), 10))
        typer.echo(f"{name:<12} phases: {phases:<32} {cls.paper}")
        departures = getattr(cls, "departures", None)
        if departures is None:
            typer.echo("    defaults vs the paper: not listed here yet, see docs/faithfulness.md")
        elif not departures:
            typer.echo("    defaults vs the paper: the paper's")
        for line in departures or ():
            typer.echo(f"    default departs from the paper: {line}")


@app.command()
@_guarded
def datasets():
    """List the datasets and where each comes from."""
    from fedpipe.data.datasets import DATASETS

    for name, info in DATASETS.items():
        typer.echo(f"{name:<14} {info.num_classes:>3} classes  {'x'.join(map(str, info.input_shape)):<8} {info.description}")
    typer.echo(f"{'files':<14} {'your':>3} classes  {'any':<8} Your own federated data: images per client, or a Parquet/CSV "
               "table with a client column, in a folder or s3://bucket/prefix (data.dataset=files, data.source=...). "
               "Start with `fedpipe data init SOURCE`, then `fedpipe data check SOURCE`.")


data_app = typer.Typer(
    help="Your own federated data (data.dataset=files): images in <source>/<client>/<label>/<image>, or a Parquet "
         "or CSV table with a client column, in a folder or s3://bucket/prefix. `init` writes the manifest that says "
         "how the files are laid out; `check` reads them as a run would and lists every problem.",
    no_args_is_help=True,
)
app.add_typer(data_app, name="data")
SourceArg = Annotated[str, typer.Argument(help="A folder, or s3://bucket/prefix (endpoint and credentials from FEDPIPE_S3_ENDPOINT, "
                                               "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY); a final /latest means the newest sub-prefix by name.")]


@data_app.command("init")
@_guarded
def data_init(source: SourceArg,
              client_column: Annotated[Optional[str], typer.Option(help="Tables: the column naming each row's client (default: a column named client, site, device, user, ...).")] = None,
              label_column: Annotated[Optional[str], typer.Option(help="Tables: the column holding the label (default: label, target, class, y).")] = None,
              force: Annotated[bool, typer.Option("--force", help="Replace an existing fedpipe-data.yaml.")] = False,
              root: Annotated[bool, typer.Option("--root", help="Write it in the folder above SOURCE (the drops root: "
                                                 "drops/fedpipe-data.yaml), where every drop without a manifest of its own finds it.")] = False,
              labels: Annotated[Optional[str], typer.Option(help="The class order, comma-separated (class 0 first), e.g. "
                                                            "--labels zero,one,two; default: numbers and number words counted, other names in natural order.")] = None):
    """Look at the files under SOURCE and write its manifest, fedpipe-data.yaml: the layout, the columns and
    the label names. Read it, edit it if a guess is wrong, then run `fedpipe data check SOURCE`.

    For dated drops (drops/2026-01-01, drops/2026-02-01, ... read as drops/latest), write it once at the
    root with `fedpipe data init drops/latest --root`: a drop that has no fedpipe-data.yaml of its own uses
    the root's, so a scheduled run needs nothing written into each new drop (list every label the drops
    will ever hold: a label missing from it stops a run)."""
    from fedpipe.data.files.init import init_manifest, propose_image_size, reorder_labels, write_manifest

    manifest, where = init_manifest(source, client_column=client_column, label_column=label_column)
    if labels is not None:
        manifest = reorder_labels(manifest, labels.split(","))
    written = write_manifest(source, manifest, force=force, root=root)
    typer.echo(f"wrote {written}: layout {manifest.source.layout}, {len(manifest.labels)} labels "
               f"({', '.join(manifest.labels[:10])}{' ...' if len(manifest.labels) > 10 else ''})")
    proposal = propose_image_size(source) if manifest.source.layout == "image_folders" else None
    if proposal is not None:
        side, found = proposal
        typer.echo(f"image sizes: {found}; a run resizes them to one with data.image_size: {side} (the most common) is "
                   f"proposed: `--set data.image_size={side}` (or image_size: {side} under data: in your config)")
        typer.echo(f"next: fedpipe data check {source} --image-size {side}")
        return
    typer.echo(f"next: fedpipe data check {source}")


@data_app.command("check")
@_guarded
def data_check(source: SourceArg,
               image_size: Annotated[Optional[int], typer.Option(help="Resize images to this side, as data.image_size does.")] = None,
               min_client_size: Annotated[int, typer.Option(help="Fewest samples a client may have (partition.min_client_size).")] = 10,
               heatmap: Annotated[Optional[Path], typer.Option(help="Write the clients x labels heatmap of the natural partition here (PNG).")] = None):
    """Read SOURCE as a run would: clients, samples per client, classes, size on disk, and every problem
    (unreadable image, unknown label, NaN feature, a client too small, ...) naming its file and row.
    Exits 2 when a run would stop on an error."""
    from fedpipe.data.files.check import check_report

    report = check_report(source, image_size, min_client_size, heatmap)
    typer.echo("\n".join(report.lines))
    if not report.ok:
        raise typer.Exit(2)


models_app = typer.Typer(
    help="Model lines: the versions of a model in the store (models/<name>/), each one run's models exported for serving "
         "(the global model and every client's personalized model) with its record: run id, config, data snapshot, "
         "accuracy and the gate's decision. One version is promoted: what `fedpipe predict` and warm starts "
         "(train.init_from=promoted) use. `list` and `show` read; `promote` and `rollback` move the pointer by hand, "
         "each move recorded in the line's history.",
    no_args_is_help=True,
)
app.add_typer(models_app, name="models")
LineArg = Annotated[str, typer.Argument(metavar="NAME", help="The model line: registry.name of the runs that register into it.")]
LineStoreOpt = Annotated[Optional[str], typer.Option("--store", help="The store holding the model line: a folder or s3://bucket/prefix (default: run.store of --config / --set, else runs/).")]


def _model_line(name: str, store: Optional[str], config: Optional[Path], overrides: Optional[list[str]]):
    """The line NAME in the store; a line that is not there is an error naming the lines that are."""
    from fedpipe.models.line import ModelLine, line_names
    from fedpipe.store import open_store

    line = ModelLine(open_store(store if store is not None else _load(config, overrides).run.store), name)
    if not line.exists():
        lines = line_names(line.store)
        there = f"the lines there: {', '.join(lines[:20])}" if lines else "there is no model line there yet (a run with registry.name=NAME registers one)"
        raise FedpipeError(f"No model line {name!r} in {line.store.url()}; {there}. Pass --store (or --config / --set "
                           "run.store=...) if the line lives in another store.")
    return line


def _line_and_version(ref: str, store, config, overrides, *, default_latest: bool):
    """NAME or NAME@VERSION: the line, and the version (given, else the promoted one, else with
    `default_latest` the newest)."""
    name, _, given = ref.partition("@")
    line = _model_line(name, store, config, overrides)
    if given:
        if not given.isdigit() or int(given) < 1:
            raise FedpipeError(f"{ref!r}: the version after '@' is a number 1, 2, ... (`fedpipe models list {name}`).")
        versions = line.versions()
        if int(given) not in versions:
            there = (f"its versions are {_ranges(versions)}" if versions else "it has no registered version yet")
            raise FedpipeError(f"Model line {name!r} has no version {int(given)}; {there} (`fedpipe models list {name}`).")
        return line, int(given)
    version = line.promoted()
    if version is None and default_latest and line.versions():
        version = line.versions()[-1]
    if version is None:
        raise FedpipeError(f"Model line {name!r} in {line.store.url()} has no promoted version: name one as {name}@VERSION "
                           f"(`fedpipe models list {name}`), or promote one (`fedpipe models promote {name} VERSION`).")
    return line, version


def _ranges(numbers: list[int]) -> str:
    """1, 2, 3, 5, 7, 8 -> '1-3, 5, 7-8' (a line's versions, said short)."""
    spans: list[list[int]] = []
    for n in sorted(numbers):
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


def _promoted_or_warn(line) -> Optional[int]:
    """The promoted version; a bad pointer is said (on stderr) and shown as none, so the versions can still be listed."""
    from fedpipe.errors import CorruptArtifactError

    try:
        return line.promoted()
    except CorruptArtifactError as e:
        typer.echo(f"warning: {e}", err=True)
        return None


def _accuracy(summary: dict) -> str:
    pers, glob = summary.get("personalized_accuracy"), summary.get("global_model")
    mean = pers.get("mean") if isinstance(pers, dict) else None
    top1 = glob.get("top1") if isinstance(glob, dict) else None
    shown = lambda x: f"{100 * x:.2f}%" if isinstance(x, (int, float)) else "n/a"  # noqa: E731
    return f"personalized {shown(mean)}  global {shown(top1)}"


def _snapshot(snapshot: Optional[dict]) -> str:
    if not snapshot:
        return "bundled data"
    return f"{str(snapshot.get('digest', '?'))[:12]} ({snapshot.get('objects', '?')} objects)"


@models_app.command("list")
@_guarded
def models_list(name: LineArg, store: LineStoreOpt = None, config: ConfigOpt = None, set: SetOpt = None):
    """List a line's versions, oldest first: accuracy (the clients' mean personalized accuracy and the global
    model's, on their test splits), the data snapshot the run read, the gate's decision; * marks the promoted one."""
    line = _model_line(name, store, config, set)
    versions = line.versions()
    if not versions:
        typer.echo(f"model line {name} in {line.store.url()}: no versions yet (a run with registry.name={name} registers one)")
        return
    promoted = _promoted_or_warn(line)
    typer.echo(f"model line {name} in {line.store.url()}: {len(versions)} version(s), promoted: {promoted or 'none'}")
    from fedpipe.models.line import abandoned

    for n, claim in abandoned(line):
        typer.echo(f"  v{n:<4} claimed {claim.get('time', '?')} by run {claim.get('run_id', '?')} but never registered (a "
                   f"registration that died, or one still writing): `fedpipe models clean {name}` removes its files", err=True)
    for v in versions:
        r = line.record(v)
        decision = r.decision.get("reason") or ("promoted" if r.decision.get("promoted") else "no decision recorded")
        typer.echo(f"{'*' if v == promoted else ' '} v{v:<4} {r.created:<25} {_accuracy(r.summary)}  data {_snapshot(r.data_snapshot)}  "
                   f"run {r.run_id}  gate: {decision}")


@models_app.command("show")
@_guarded
def models_show(ref: Annotated[str, typer.Argument(metavar="NAME[@VERSION]", help="The line, and a version (default: the promoted one, else the newest).")],
                store: LineStoreOpt = None, config: ConfigOpt = None, set: SetOpt = None):
    """Show one version: its record (run, method, model, data, accuracy, the gate's decision), its clients and
    the files a server loads (spec.json says how to feed them), and the line's promotion history."""
    import json

    line, version = _line_and_version(ref, store, config, set, default_latest=True)
    r = line.record(version)
    promoted = _promoted_or_warn(line)
    typer.echo(f"model line {line.name}, version {version}{' (promoted)' if version == promoted else ''}, created {r.created}")
    typer.echo(f"  run          {r.run_id}")
    typer.echo(f"  model        {r.spec.model} ({r.spec.method}), input {'x'.join(map(str, r.spec.input_shape))}, "
               f"{r.spec.num_classes} classes")
    typer.echo(f"  accuracy     {_accuracy(r.summary)}")
    typer.echo(f"  data         {_snapshot(r.data_snapshot)}{'  ' + str(r.data_snapshot.get('source')) if r.data_snapshot else ''}")
    typer.echo(f"  gate         {json.dumps(r.decision) if r.decision else 'no decision recorded'}")
    shown = ", ".join(r.clients[:10]) + (f", ... ({len(r.clients)} in all)" if len(r.clients) > 10 else "")
    typer.echo(f"  clients      {shown or 'none'}")
    folder = line.keys.version(version)
    for key in line.store.list(folder):
        typer.echo(f"  file         {key[len(folder):]:<40} {line.store.size(key) or 0:>12,} bytes")
    for entry in line.history()[-10:]:
        typer.echo(f"  history      #{entry['seq']} {entry['time']} {entry['action']} v{entry['version']}: {entry['reason']}")


@models_app.command("clean")
@_guarded
def models_clean(name: LineArg, older_than_hours: Annotated[float, typer.Option(min=0, help="Only numbers claimed longer ago than this (a registration still writing is younger).")] = 1.0,
                 store: LineStoreOpt = None, config: ConfigOpt = None, set: SetOpt = None):
    """Remove the files of version numbers that were claimed but never registered (a registration that crashed
    between taking its number and writing its record). Registered versions are never touched."""
    line = _model_line(name, store, config, set)
    from fedpipe.models.line import remove_abandoned

    removed = remove_abandoned(line, older_than_hours * 3600)
    typer.echo(f"model line {name}: removed the files of {len(removed)} abandoned number(s)"
               + (f": {', '.join(f'v{n}' for n in removed)}" if removed else ""))


@models_app.command("regate")
@_guarded
def models_regate(ref: Annotated[str, typer.Argument(metavar="NAME@VERSION", help="The line and the version to decide on again.")],
                  store: LineStoreOpt = None, set: SetOpt = None):
    """Decide again whether a registered version should be promoted, without retraining: the gate scores its run's
    models against the promoted version under the version's registry settings with --set registry.*=... applied
    (e.g. after a rerun reported a registration made under other settings, or after a flagged drop was checked by
    hand). A promotion is recorded in the line's history; the version's record is never rewritten."""
    from fedpipe.models.publish import regate

    if "@" not in ref:
        raise FedpipeError(f"{ref!r}: name the version as NAME@VERSION (`fedpipe models list {ref}`).")
    line, version = _line_and_version(ref, store, None, None, default_latest=False)
    result = regate(line, version, list(set or []))
    verdict = "promoted" if result["changed"] else ("already promoted" if result["promoted"] else "not promoted")
    typer.echo(f"model line {line.name}, version {version}: {verdict}: {result['reason']}")


@models_app.command("promote")
@_guarded
def models_promote(name: LineArg, version: Annotated[int, typer.Argument(min=1, help="The version to promote (`fedpipe models list NAME`).")],
                   reason: Annotated[str, typer.Option(help="Why, for the history (shown by `fedpipe models show`).")] = "promoted by hand",
                   store: LineStoreOpt = None, config: ConfigOpt = None, set: SetOpt = None):
    """Promote a version by hand, whatever the gate decided: `fedpipe predict` and warm starts use it from now on.
    Of two promotions made at once one wins and the other changes nothing and says so."""
    line = _model_line(name, store, config, set)
    before = line.log.pointer()
    line.promote(version, reason)
    typer.echo(f"model line {name}: version {version} promoted (was {before.version if before else 'none'})")


@models_app.command("rollback")
@_guarded
def models_rollback(name: LineArg, store: LineStoreOpt = None, config: ConfigOpt = None, set: SetOpt = None):
    """Promote again the version promoted before the current one (per the history; rolling back twice goes two
    promotions back). Its record must be unchanged since it was promoted."""
    line = _model_line(name, store, config, set)
    current = line.log.pointer()
    version = line.rollback()
    typer.echo(f"model line {name}: version {version} promoted again (rolled back from {current.version if current else 'none'})")


@app.command()
@_guarded
def predict(files: Annotated[list[Path], typer.Argument(metavar="FILES...", help="Images (PNG, JPEG) for an image model; CSV files of raw feature rows for a table model.")],
            model: Annotated[str, typer.Option("--model", help="NAME or NAME@VERSION of a model line (default version: the promoted one).")],
            client: Annotated[Optional[str], typer.Option("--client", help="The client whose personalized model predicts: its name for data with its own clients (a site), else its number. Default: the global model.")] = None,
            trust_unsigned: Annotated[bool, typer.Option("--trust-unsigned", help="Read a model line without signatures (FEDPIPE_SIGNING_KEY unset): only if you trust everyone who can write its store. A .pt2 holding pickled code, and TorchScript, are refused all the same.")] = False,
            store: LineStoreOpt = None, config: ConfigOpt = None, set: SetOpt = None):
    """Predict with an exported model, as a server would: only torch loads it (torch.export's .pt2, or TorchScript),
    and it takes raw inputs (the normalisation the run applied is inside it). Prints `file  label  probability`
    per image, or per CSV row (file:line). The line must be signed (FEDPIPE_SIGNING_KEY, the key its runs signed
    with) unless --trust-unsigned; a .pt2 is checked to hold no pickle and no code before torch loads it, and
    TorchScript is loaded from a signed line only. Examples:

        fedpipe predict --model sites --client hospital-a scan1.png scan2.png

        fedpipe predict --model credit@3 --client branch-2 --store s3://mlpipeline/fedpipe rows.csv
    """
    import torch

    from fedpipe.models.export import MAX_SERVED_MODEL_BYTES, MAX_SPEC_BYTES, SPEC_FILE, ServingSpec, load_exported, read_inputs

    line, version = _line_and_version(model, store, config, set, default_latest=False)
    signed = _signed_or_trusted(line, trust_unsigned)
    spec = ServingSpec.from_bytes(line.read(version, SPEC_FILE, MAX_SPEC_BYTES), line.store.url(line.keys.version(version) + SPEC_FILE))
    served = spec.served(client)
    where = line.store.url(line.keys.version(version) + served.file)
    size = line.store.size(line.keys.version(version) + served.file) or 0
    if size > MAX_SERVED_MODEL_BYTES:
        raise FedpipeError(f"{where} is {size / 2**30:.1f} GiB; predict reads a model whole and takes at most "
                           f"{MAX_SERVED_MODEL_BYTES // 2**30} GiB. Serve it with torch.export.load on a machine sized for it.")
    net = load_exported(line.read(version, served.file, MAX_SERVED_MODEL_BYTES), served.format, where, signed=signed)
    names, x = read_inputs(spec, [str(f) for f in files])
    with torch.no_grad():
        probs = torch.softmax(net(x).double(), dim=1)
    best, index = probs.max(dim=1)
    width = max(len(n) for n in names)
    for row, p, i in zip(names, best.tolist(), index.tolist()):
        label = spec.labels[i] if i < len(spec.labels) else str(i)
        typer.echo(f"{row:<{width}}  {label}  {p:.4f}")


def _signed_or_trusted(line, trust_unsigned: bool) -> bool:
    """Whether the line's objects are verified against the signing key; an unsigned line is refused unless the
    user trusts whoever can write its store (--trust-unsigned)."""
    import os

    from fedpipe.store.signed import ENV_ALLOW_UNSIGNED, ENV_SIGNING_KEY, ENV_SIGNING_KEY_FILE, verifies_signatures

    if verifies_signatures(line.store) or trust_unsigned:
        return verifies_signatures(line.store)
    why = (f"{ENV_ALLOW_UNSIGNED} lets unsigned objects through" if os.environ.get(ENV_ALLOW_UNSIGNED)
           else f"neither {ENV_SIGNING_KEY} nor {ENV_SIGNING_KEY_FILE} is set")
    raise FedpipeError(
        f"Model line {line.name!r} in {line.store.url()} is read without signature checks ({why}), so anyone who can "
        f"write that store could have replaced its models, and predict refuses it. Set {ENV_SIGNING_KEY} (or "
        f"{ENV_SIGNING_KEY_FILE}) to the key the line's runs signed with; or, if you trust everyone who can write "
        "that store, pass --trust-unsigned.")


# --- studies: many runs of many methods, tuned on validation, repeated over seeds -----------------------
study_app = typer.Typer(
    help="A study: every method tuned on validation with the same budget (Optuna), rerun on several seeds, compared with "
    "confidence intervals and paired tests. `fedpipe study -c study.yaml` runs (or resumes) one here; see examples/study_*.yaml.",
    invoke_without_command=True, no_args_is_help=False,
)
app.add_typer(study_app, name="study")
StudyOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="The study file (YAML, see examples/study_*.yaml).")]


@study_app.callback()
@_guarded
def study_run(ctx: typer.Context, config: StudyOpt = None, set: SetOpt = None,
              workers: Annotated[Optional[int], typer.Option(help="Trials at once, each in a warm worker process (default: the study's `workers`).")] = None):
    """Run or resume the study: tuning trials (validation only), the frozen choice, the final runs on every seed and
    split (test), the papers' optimistic protocol beside, and the report (study.md, study.html, plots). A killed study
    resumes where it stopped: every finished trial and final run is reused."""
    if ctx.invoked_subcommand is not None:
        return
    if config is None:
        typer.echo(ctx.get_help())
        raise typer.Exit(2)
    from fedpipe.study.config import load_study
    from fedpipe.study.runner import run_study

    study, base = load_study(config, [*(set or []), *([f"workers={workers}"] if workers else [])])
    results = run_study(study, base)
    typer.echo(_study_lines(results))


def _study_lines(results: dict) -> str:
    lines = [f"study {results['study']}: {results['budget']['trials']} trials x {results['budget']['rounds']} rounds per method, "
             f"seeds {results['seeds']} ({results.get('wall_seconds', 0):.0f} s)"]
    for name, m in results["methods"].items():
        for split in results["splits"]:
            accs = [f["test"]["personalized_accuracy"] for f in m["finals"] if f["split"] == split]
            mean = sum(accs) / len(accs) if accs else float("nan")
            lines.append(f"  {name:<12} {split:<14} test personalized {100 * mean:6.2f}%   chosen {m['chosen'].get(split, {})}")
    lines.append(f"  report                 {results.get('report', '')}")
    return "\n".join(lines)


@study_app.command("trial")
@_guarded
def study_trial(config: StudyOpt, method: Annotated[str, typer.Option(help="The method of this trial.")],
                param: Annotated[Optional[list[str]], typer.Option("--param", help="A hyperparameter of this trial, PATH=VALUE (repeatable), e.g. --param train.lr=0.05.")] = None,
                split: Annotated[Optional[str], typer.Option(help="The study's split (default: its first).")] = None,
                set: SetOpt = None):
    """One tuning trial, as Katib runs it: train with these hyperparameters, score on the clients' validation splits
    only, and print each metric as NAME=VALUE on its own line (Katib's StdOut metrics collector reads them)."""
    from fedpipe.errors import ConfigError
    from fedpipe.search_space import parse_value
    from fedpipe.study.config import load_study, run_tree, split_names
    from fedpipe.study.trials import execute, objective_of

    study, base = load_study(config, set)
    entry = next((e for e in study.methods if e.name == method), None)
    if entry is None:
        raise ConfigError(f"method {method!r} is not in the study; its methods: {', '.join(e.name for e in study.methods)}")
    split = split or next(iter(split_names(study, base)))
    space, params = entry.search_space(), {}
    for item in param or []:
        key, sep, raw = item.partition("=")
        if not sep or key not in space:
            raise ConfigError(f"--param {item!r}: write PATH=VALUE for a path of {method}'s space: {', '.join(space)}")
        params[key] = parse_value(space[key], raw, f"--param {key}")
    cfg = run_tree(study, base, entry, split, study.seeds[0], params, tuning=True)
    result = execute({"kind": "trial", "method": method, "split": split, "params": params, "config": cfg.model_dump(mode="json")})
    for name in ("val_personalized_accuracy", "val_pooled_accuracy", "val_global_accuracy", "val_worst10_accuracy"):
        value = objective_of(result["metrics"], name)
        if value is not None and math.isfinite(value):  # Katib reads `nan` as no value: leave such a line out
            typer.echo(f"{name}={value:.6f}")


@study_app.command("katib")
@_deploy_flags
@_guarded
def study_katib(config: StudyOpt, namespace: Annotated[str, typer.Option(help="The profile namespace the Experiments run in (it needs the label katib.kubeflow.org/metrics-collector-injection: enabled).")],
                algorithm: Annotated[str, typer.Option(help="Katib's suggestion algorithm: tpe, random, grid, bayesianoptimization, multivariate-tpe, cmaes.")] = "tpe",
                parallel: Annotated[int, typer.Option(help="Trials each Experiment runs at once.")] = 2,
                set: SetOpt = None, deploy: Optional[dict] = None):
    """Print the study as Katib Experiments (one per method, same budget) and the ConfigMap holding the study file:

        fedpipe study katib -c study.yaml --namespace kubeflow-user-example-com | kubectl apply -f -

    Each trial is a Job running `fedpipe study trial` (validation only); Katib's StdOut collector reads its NAME=VALUE lines."""
    import yaml

    from fedpipe.k8s.katib import katib_manifests
    from fedpipe.k8s.phasejob import StorageAccess
    from fedpipe.pipelines.study import deployable
    from fedpipe.study.config import load_study

    study, base = load_study(config, set)
    options = _options(deploy)
    text, _ = deployable(study, base, options)  # what the trial pods read: base inlined, the deployment's store
    storage = StorageAccess(s3_endpoint=options.s3_endpoint, s3_secret=options.s3_secret, s3_secret_keys=options.s3_secret_keys,
                            pushgateway=options.pushgateway, signing_secret=options.signing_secret)
    docs = katib_manifests(text, study.study.name, {e.name: e.search_space() for e in study.methods}, namespace=namespace,
                           image=options.image, max_trials=study.budget.trials, parallel_trials=parallel, seed=study.seeds[0],
                           objective_metric=study.objective, algorithm=algorithm, storage=storage)
    typer.echo(yaml.safe_dump_all(docs, sort_keys=False))


@study_app.command("compile")
@_guarded
@_deploy_flags
def study_compile(config: StudyOpt, out: Annotated[Path, typer.Option("--out", "-o", help="Where to write the pipeline YAML.")] = Path("study.yaml"),
                  parallelism: Annotated[int, typer.Option(help="Trial tasks at once in each batch (dsl.ParallelFor's parallelism: fixed when compiled).")] = 4,
                  trials_per_task: Annotated[int, typer.Option(help="Trials one task runs in its warm process (default of the run parameter).")] = 1,
                  *, deploy: dict):
    """Compile the study as a Kubeflow pipeline (KFP >= 2.14): batches of trials fanned out with dsl.ParallelFor,
    collected with dsl.Collected into the next batch's suggestions, then the final runs and the report."""
    from fedpipe.pipelines.study import compile_study_pipeline

    typer.echo(compile_study_pipeline(Path(config), out, _options(deploy), parallelism=parallelism, trials_per_task=trials_per_task))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
