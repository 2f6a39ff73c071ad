"""A pipeline on Kubeflow: compile, register, submit, schedule, unschedule, and the flags they share."""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Annotated, Optional

import typer

from fedpipe.cli.common import ConfigOpt, SetOpt, _guarded, _load, app
from fedpipe.errors import FedpipeError

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
KueueQueueOpt = Annotated[Optional[str], typer.Option("--kueue-queue", help="Kueue's LocalQueue (in the namespace the runs go to) that the GPU work waits in: each training task's pod carries the label kueue.x-k8s.io/queue-name (Kueue's `pod` integration must be on), a --distributed-phase's PyTorchJob or TrainJob carries it on the job (Kueue's kubeflow.org/pytorchjob or trainer.kubeflow.org/trainjob integration). CPU steps are never queued. Default: no queue.")]
TrainerRuntimeOpt = Annotated[Optional[str], typer.Option("--trainer-runtime", help="With --job-api trainjob: the ClusterTrainingRuntime the TrainJob runs on (default torch-distributed, which Trainer ships).")]

FederationSuperlinkOpt = Annotated[Optional[str], typer.Option("--federation-superlink", help="Federation mode (the run parameter engine_mode=federation): the SuperLink's Control API as HOST:PORT, the default of the run parameter federation_superlink (the chart's SuperLink: <release>-superlink-control:9091; the chart passes it when federation.enabled). docs/federation-kubernetes.md.")]
FederationCaSecretOpt = Annotated[Optional[str], typer.Option("--federation-ca-secret", help="Federation mode: the Secret whose ca.crt the SuperLink's certificate is checked against (the chart's SuperLink TLS Secret), mounted read-only into the census, phase and evaluate tasks; federation.root_certificates then names it. Default: none mounted.")]
FederationControlSecretOpt = Annotated[Optional[str], typer.Option("--federation-control-secret", help="Federation mode: the Secret whose `token` the SuperLink's Control API asks of every call (the chart's `<release>-superlink-control`), mounted read-only into the census, phase and evaluate tasks only. Default: none (a SuperLink that asks for a token then refuses their submissions).")]


# The deployment flags of compile, register, submit and schedule, each declared once: `_deploy_flags`
# appends them to a command's parameters and hands the command their values as one dict, `deploy`.
DEPLOY_OPTIONS = {
    "image_repository": ImageRepositoryOpt, "image_tag": ImageTagOpt, "training_image_tag": TrainingImageTagOpt,
    "accelerator_count": AcceleratorCountOpt, "accelerator_type": AcceleratorTypeOpt, "resource": ResourceOpt,
    "store": StoreOpt, "s3_endpoint": S3EndpointOpt, "s3_secret": S3SecretOpt, "pushgateway": PushgatewayOpt,
    "distributed_phase": DistributedPhaseOpt, "nodes": NodesOpt, "processes_per_node": ProcessesOpt,
    "gpus_per_process": GpusOpt, "job_cleanup": JobCleanupOpt, "job_timeout": JobTimeoutOpt, "job_api": JobApiOpt, "kfp_version": KfpVersionOpt, "signing_secret": SigningSecretOpt,
    "trainer_runtime": TrainerRuntimeOpt, "kueue_queue": KueueQueueOpt, "federation_superlink": FederationSuperlinkOpt,
    "federation_ca_secret": FederationCaSecretOpt,
    "federation_control_secret": FederationControlSecretOpt,
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
                                                "s3_secret", "pushgateway", "kfp_version", "signing_secret", "kueue_queue",
                                                "federation_superlink", "federation_ca_secret",
                                                "federation_control_secret")}
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
