"""Pipelines generated from a method's phase list: adding a method adds no pipeline code.

    config --> partition --> phase 1 --> phase 2 --> ... --> evaluate --> publish

`publish` registers the run's models in its model line (registry.name) and promotes them when the gate says
so (fedpipe.models); with registry.name empty (the default) it does nothing. The benchmark has no publish task.

The pipeline's parameters are the run config's fields (`train_rounds`, `partition_num_clients`,
`method_nu`, ...; defaults = the compiled config), a `base_config` YAML, `overrides` (KEY=VALUE
strings for anything else), and the tasks' resources (RESOURCE_PARAMETERS: one GPU per training task by
default, CPU and memory for every task; node selector and tolerations of the training tasks). A field
changed in the Kubeflow UI wins over `base_config`. `telemetry_pushgateway` says where round metrics go.

Needs a Kubeflow Pipelines backend of 2.5.0 or later (Kubeflow 1.10.1+; 1.10.0 ships 2.4.1): resources
from runtime parameters (driver 2.4.0), node selector and tolerations as JSON parameters (driver 2.5.0:
backend/src/v2/driver/driver.go reads NodeSelectorJson / TolerationJson, which 2.4.1 lacks).
fedpipe.pipelines.client checks the server's version before it uploads. No task input holds a
placeholder nested in a dict or list, which launchers before 2.14.0 resolve at random
(components/definitions.py; tests/test_kfp_conformance.py checks every shipped pipeline).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from kfp import compiler, dsl, kubernetes

from fedpipe import __version__
from fedpipe.algorithms import ALGORITHMS, phases_of
from fedpipe.components.definitions import Components, build, compile_components
from fedpipe.config import refuse_url_credentials
from fedpipe.errors import ConfigError
from fedpipe.k8s.phasejob import KUEUE_QUEUE_LABEL, QUEUE_NAME
from fedpipe.k8s.pytorchjob import PhaseJob
from fedpipe.run.config import RunConfig, load_config


def _ensure_container_spec_exists(self) -> None:
    """kfp 2.17's `PipelineTask._ensure_container_spec_exists` (kfp/dsl/pipeline_task.py), which every
    `set_cpu_limit`, `set_memory_request`, `set_env_variable`, ... calls, names its caller in its error by
    `inspect.stack()[1][3]`: that reads every frame's source and looks up its module in all of `sys.modules`, 0.1 to 0.3 s
    a call in a process that has imported torch (the test suite's: 70 s to build the shipped pipelines, 1 s without it).
    The same check and the same message, with the caller's name from its frame alone."""
    if self.container_spec is None:
        caller = sys._getframe(1).f_code.co_name
        raise ValueError(f"{caller} can only be used on single-step components, not pipelines used as components, or special "
                         "components like importers.")


dsl.PipelineTask._ensure_container_spec_exists = _ensure_container_spec_exists


# Fields that are fixed by the pipeline's shape: the method decides the phases (one task each),
# and the scheme decides which partition fields exist. Change them with `overrides` or another pipeline.
FIXED_FIELDS = {"method.name", "partition.scheme", "telemetry.pipeline"}

# Unset text fields that are still run parameters (with "" for unset), because the UI is where they are
# set: data.source names a user's own data (data.dataset=files) for a run started from the KFP UI.
TEXT_PARAMETERS = {"data.source", "privacy.delta", "privacy.target_epsilon"}

# The pipeline's resource parameters and their defaults. Kubeflow's driver reads a resource given as a
# runtime parameter from the parameter's *string* value (backend/src/v2/driver: initPodSpecPatch ->
# resolvePodSpecInputRuntimeParameter -> Value.GetStringValue, then ParseQuantity): an int parameter
# would resolve to "" and the pod would get no GPU. So every quantity here is a string, the GPU count too.
RESOURCE_PARAMETERS: dict[str, str] = {
    # the training tasks: one GPU each unless the run (or `--accelerator-count 0`) says CPU only
    "accelerator_type": "nvidia.com/gpu",
    "accelerator_count": "1",
    "cpu_request": "1",
    "cpu_limit": "4",
    "memory_request": "2Gi",
    "memory_limit": "16Gi",
    # the config, partition, evaluate and comparison tasks
    "step_cpu_request": "500m",
    "step_cpu_limit": "2",
    "step_memory_request": "1Gi",
    "step_memory_limit": "8Gi",
}
TRAINING_RESOURCES = ("accelerator_type", "accelerator_count", "cpu_request", "cpu_limit", "memory_request", "memory_limit")
STEP_RESOURCES = ("step_cpu_request", "step_cpu_limit", "step_memory_request", "step_memory_limit")
# Where to place the training tasks' pods (kfp-kubernetes reads these as JSON parameters).
PLACEMENT_PARAMETERS: dict[str, tuple[type, object]] = {"node_selector": (dict, {}), "tolerations": (list, [])}

# A Kubernetes quantity (k8s.io/apimachinery resource.ParseQuantity), e.g. 500m, 2, 1.5, 4Gi, 1e3.
_QUANTITY = re.compile(r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")
# Where a federation task finds the federation's CA certificate (DeployOptions.federation_ca_secret's ca.crt).
FEDERATION_CA_DIR = "/etc/fedpipe/federation-ca"
# Where a federation task finds the SuperLink's Control API token (DeployOptions.federation_control_secret's token), named
# to `flwr` by FEDPIPE_CONTROL_TOKEN_FILE (fedpipe.federation.control).
FEDERATION_CONTROL_DIR = "/etc/fedpipe/federation-control"
# The label on every task pod of a fedpipe pipeline: what the chart's NetworkPolicy selects.
POD_LABEL = ("app.kubernetes.io/part-of", "fedpipe")
# The user every task's container runs as: the image's USER (images/Dockerfile).
TASK_USER = 1000
# The oldest Kubeflow Pipelines backend that runs fedpipe's pipelines (see the module's docstring), and
# the first that knows a task's securityContext (kubernetes_executor_config.proto field 18, applied by
# the driver: backend/src/v2/driver/k8s.go, GetSecurityContext). A pipeline is compiled for one backend
# version (DeployOptions.kfp_version): the platform spec must hold only fields that version's protos
# know, because its API server parses each task's Kubernetes config strictly (2.14+:
# v2/compiler/argocompiler/container.go, protojson.Unmarshal, an unknown field refuses the run; 2.5.0:
# jsonpb.UnmarshalString, whose error is ignored and the pod's labels silently dropped).
MIN_KFP_BACKEND = "2.5.0"
SECURITY_CONTEXT_KFP = "2.16.0"
_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:\.(\d+))?(?:[-+.].*)?")


def parse_kfp_version(tag: object) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a KFP release tag such as '2.5.0', 'v2.14.3' or '2.15.0-rc.1'; None for
    what is no release ('unknown' when the image was built without TAG_NAME, 'master', a commit, nothing).
    A pre-release counts as its release."""
    if not isinstance(tag, str):
        return None
    match = _VERSION.fullmatch(tag.strip())
    if not match:
        return None
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def resource_defaults(given: dict[str, str] | None = None) -> dict[str, str]:
    """RESOURCE_PARAMETERS with `given` over them, each checked: a wrong name or value is a ConfigError
    here rather than a pod the driver cannot create."""
    given = dict(given or {})
    unknown = sorted(set(given) - set(RESOURCE_PARAMETERS))
    if unknown:
        raise ConfigError(f"unknown resource {', '.join(unknown)}: choose from {', '.join(RESOURCE_PARAMETERS)}.")
    out = {**RESOURCE_PARAMETERS, **{k: str(v).strip() for k, v in given.items()}}
    for name, value in out.items():
        if name == "accelerator_type":
            if not re.fullmatch(r"[A-Za-z0-9.\-]+/[A-Za-z0-9_.\-]+", value):
                raise ConfigError(f"accelerator type {value!r} is not an extended resource name such as nvidia.com/gpu or amd.com/gpu.")
        elif name == "accelerator_count":
            if not value.isdigit():
                raise ConfigError(f"accelerator count {value!r} must be a whole number of devices: 1 (one GPU), or 0 for CPU only.")
        elif not _QUANTITY.match(value):
            raise ConfigError(f"resource {name}={value!r} is not a Kubernetes quantity (e.g. 500m or 2 for CPU, 512Mi or 4Gi for memory).")
    return out


@dataclass(frozen=True)
class DeployOptions:
    """Where a compiled pipeline runs: its image, its store, and how its pods reach MinIO and the Pushgateway.

    Credentials are never part of a pipeline: pods read them from the Secret `s3_secret` (keys
    `s3_secret_keys`) as AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY. The Secret's name is fixed when the
    pipeline is compiled (the chart: at install), not a run parameter that a UI user could point at any Secret.
    """

    image_repository: str = "ghcr.io/fedpipe/fedpipe"
    image_tag: str = __version__  # the CPU image: config, partition, evaluate, comparison
    training_image_tag: str | None = None  # None: `<image_tag>-cuda`, the CUDA image, which runs on CPU nodes too
    store: str = "s3://mlpipeline/fedpipe"  # the bucket of Kubeflow's own MinIO
    s3_endpoint: str = "http://minio-service.kubeflow:9000"
    s3_secret: str = "mlpipeline-minio-artifact"  # Kubeflow's own MinIO credentials
    s3_secret_keys: tuple[str, str] = ("accesskey", "secretkey")
    # Secret holding the artifact signing key under the data key "key" (the chart's signing.*): every task gets
    # it as FEDPIPE_SIGNING_KEY, so every store it opens signs and verifies (fedpipe.store.signed). Empty: unsigned.
    signing_secret: str = ""
    pushgateway: str = ""  # default of the run parameter telemetry_pushgateway; empty: no metrics are pushed
    resources: dict[str, str] = field(default_factory=dict)  # defaults of the resource parameters (RESOURCE_PARAMETERS)
    retries: int = 2  # a failed training task is retried and resumes from its last checkpoint
    extra_env: dict[str, str] = field(default_factory=dict)
    # Phases that run as a Kubeflow Training Operator PyTorchJob, started and awaited by a small launcher
    # task, instead of as one training task (fedpipe.k8s.pytorchjob).
    distributed: tuple[PhaseJob, ...] = ()
    # The KFP backend the pipeline is compiled for: the floor's pipeline runs on every supported backend;
    # from SECURITY_CONTEXT_KFP on, every task also carries a securityContext (user TASK_USER, non-root).
    kfp_version: str = MIN_KFP_BACKEND
    # Kueue's LocalQueue for the GPU work (`--kueue-queue`): the training tasks' pods carry Kueue's queue label
    # (Kueue's `pod` integration admits each pod), a distributed phase's PyTorchJob / TrainJob carries it on the
    # job object; the CPU steps and the launcher task are not queued. Empty: nothing is queued.
    kueue_queue: str = ""
    # Federation mode (engine.mode=federation, a run parameter): the SuperLink's control address the federation tasks
    # submit to (the default of the run parameter federation_superlink; the chart's `<release>-superlink-control:9091`),
    # and the Secret whose ca.crt the SuperLink's certificate is checked against, mounted into those tasks at
    # FEDERATION_CA_DIR (empty: none mounted; federation.root_certificates must then name a file the image has).
    federation_superlink: str = ""
    federation_ca_secret: str = ""
    # The Secret whose `token` the SuperLink's Control API asks of every call (the chart's `<superlink>-control`): mounted
    # into the census, phase and evaluate tasks only, at FEDERATION_CONTROL_DIR. Empty: none (a SuperLink started by
    # fedpipe then refuses their submissions).
    federation_control_secret: str = ""

    def __post_init__(self) -> None:
        for flag, url in (("--pushgateway", self.pushgateway), ("--s3-endpoint", self.s3_endpoint)):
            try:
                refuse_url_credentials(url, flag, "the pods read the store's credentials from the Secret "
                                       "(--s3-secret); a Pushgateway behind authentication needs a proxy in the namespace.")
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.signing_secret and not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", self.signing_secret):
            raise ConfigError(f"--signing-secret {self.signing_secret!r} is not a Kubernetes Secret name.")
        version = parse_kfp_version(self.kfp_version)
        if version is None or version < parse_kfp_version(MIN_KFP_BACKEND):
            raise ConfigError(f"--kfp-version {self.kfp_version!r} is not a Kubeflow Pipelines release of {MIN_KFP_BACKEND} or "
                              "later (e.g. 2.5.0 for Kubeflow 1.10.1, 2.15.0 for 1.11, 2.16.0 for 26.03).")
        for what, value in (("--image-repository", self.image_repository), ("--image-tag", self.image_tag),
                            ("--training-image-tag", self.training_image_tag or self.image_tag)):
            if not value or any(c.isspace() for c in value) or (what != "--image-repository" and (":" in value or "/" in value)):
                raise ConfigError(f"{what} {value!r} is not valid: a repository looks like ghcr.io/fedpipe/fedpipe, a tag like 0.1.0.")
        resource_defaults(self.resources)
        if self.federation_ca_secret and not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", self.federation_ca_secret):
            raise ConfigError(f"--federation-ca-secret {self.federation_ca_secret!r} is not a Kubernetes Secret name.")
        if self.federation_control_secret and not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", self.federation_control_secret):
            raise ConfigError(f"--federation-control-secret {self.federation_control_secret!r} is not a Kubernetes Secret name.")
        if self.federation_superlink and not re.fullmatch(r"[A-Za-z0-9.\-]+:[0-9]{1,5}", self.federation_superlink):
            raise ConfigError(f"--federation-superlink {self.federation_superlink!r} is not HOST:PORT (the chart's SuperLink control "
                              "Service, e.g. fedpipe-superlink-control:9091).")
        if not QUEUE_NAME.fullmatch(self.kueue_queue):
            raise ConfigError(f"--kueue-queue {self.kueue_queue!r} is not a Kueue LocalQueue name (lower-case letters, digits, '-' "
                              "and '.', at most 63 characters; `kubectl get localqueues -n NAMESPACE` lists them).")

    @property
    def task_security_context(self) -> bool:
        return parse_kfp_version(self.kfp_version) >= parse_kfp_version(SECURITY_CONTEXT_KFP)

    @property
    def image(self) -> str:
        return f"{self.image_repository}:{self.image_tag}"

    @property
    def training_image(self) -> str:
        return f"{self.image_repository}:{self.training_image_tag or self.image_tag + '-cuda'}"

    @classmethod
    def from_env(cls, **overrides) -> DeployOptions:
        """Defaults, then FEDPIPE_STORE / FEDPIPE_S3_ENDPOINT / FEDPIPE_S3_SECRET / FEDPIPE_S3_SECRET_KEYS
        ("accesskey,secretkey") / FEDPIPE_PUSHGATEWAY from the environment, then `overrides` (the CLI's flags)."""
        keys = os.environ.get("FEDPIPE_S3_SECRET_KEYS")
        env = {
            "store": os.environ.get("FEDPIPE_STORE"),
            "s3_endpoint": os.environ.get("FEDPIPE_S3_ENDPOINT"),
            "s3_secret": os.environ.get("FEDPIPE_S3_SECRET"),
            "s3_secret_keys": tuple(k.strip() for k in keys.split(",")) if keys else None,
            "pushgateway": os.environ.get("FEDPIPE_PUSHGATEWAY"),
        }
        # an unset flag (None) must not hide the environment's value
        chosen = {**{k: v for k, v in env.items() if v is not None}, **{k: v for k, v in overrides.items() if v is not None}}
        return replace(cls(), **chosen)


# The launcher task's pod label; the chart's NetworkPolicy lets only pods with it reach the Kubernetes API.
LAUNCHER_COMPONENT = "pytorchjob-launcher"
LAUNCHER_RESOURCES = {"cpu_request": "100m", "cpu_limit": "1", "memory_request": "512Mi", "memory_limit": "2Gi"}


def pipeline_name(method: str | None) -> str:
    return f"fedpipe-{method.replace('_', '-')}" if method else "fedpipe-benchmark"


def flat_fields(cfg: RunConfig, sections: tuple[str, ...] | None = None) -> dict[str, object]:
    """The config's scalar fields as {"train.rounds": 30, ...} (lists and unset values are left to `overrides`,
    except the unset text fields of TEXT_PARAMETERS, which are parameters with "" for unset)."""
    out = {}
    for section, values in cfg.model_dump(mode="json").items():
        if sections is not None and section not in sections:
            continue
        for key, value in values.items():
            dotted = f"{section}.{key}"
            if value is None and dotted in TEXT_PARAMETERS:
                value = ""
            if isinstance(value, (bool, int, float, str)) and dotted not in FIXED_FIELDS:
                out[dotted] = value
    return out


def _one_line(cfg: RunConfig) -> str:
    # kfp writes parameter defaults into the compiled file's header comment verbatim: a multi-line
    # default would break the YAML, so the base config is compact JSON (which is YAML too)
    return json.dumps(cfg.model_dump(mode="json"), separators=(",", ":"))


def _param(dotted: str) -> str:
    return dotted.replace(".", "_")


def _signature(fields: dict[str, object], base_yaml: str, options: DeployOptions) -> inspect.Signature:
    kw = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("base_config", kw, default=base_yaml, annotation=str)]
    params += [inspect.Parameter(_param(k), kw, default=v, annotation=type(v)) for k, v in fields.items()]
    params.append(inspect.Parameter("overrides", kw, default=[], annotation=list))
    params += [inspect.Parameter(name, kw, default=value, annotation=str) for name, value in resource_defaults(options.resources).items()]
    params += [inspect.Parameter(name, kw, default=default, annotation=kind) for name, (kind, default) in PLACEMENT_PARAMETERS.items()]
    return inspect.Signature(params)


def _bind(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    bound = dict(zip(list(signature.parameters), args))
    bound.update(kwargs)
    return bound


def _storage(task, options: DeployOptions) -> None:
    """Every task reads and writes the run's store: the endpoint as env, the credentials from the Secret
    named at compile time (a run parameter would let a UI user point a run at any Secret of the namespace).
    (The Pushgateway is a run parameter, telemetry_pushgateway, that reaches the tasks in the config.)
    Every task pod carries POD_LABEL, which the chart's NetworkPolicy selects."""
    task.set_env_variable("FEDPIPE_S3_ENDPOINT", options.s3_endpoint)
    kubernetes.add_pod_label(task, *POD_LABEL)
    for name, value in options.extra_env.items():
        task.set_env_variable(name, value)
    access, secret_key = options.s3_secret_keys
    kubernetes.use_secret_as_env(task, secret_name=options.s3_secret, secret_key_to_env={access: "AWS_ACCESS_KEY_ID", secret_key: "AWS_SECRET_ACCESS_KEY"})
    if options.signing_secret:
        kubernetes.use_secret_as_env(task, secret_name=options.signing_secret, secret_key_to_env={"key": "FEDPIPE_SIGNING_KEY"})
    # kfp-kubernetes writes SecretAsEnv.optional: false, a field the protos have only since KFP 2.15.0
    # (kubeflow/pipelines#12216): 2.14 would refuse the run, 2.5.0 drop the pod's labels. false is its
    # default, so leaving it out means the same on every backend.
    for entry in task.platform_config["kubernetes"]["secretAsEnv"]:
        if entry.get("optional") is False:
            del entry["optional"]
    if options.task_security_context:
        kubernetes.set_security_context(task, run_as_user=TASK_USER, run_as_group=TASK_USER, run_as_non_root=True)


def _resolve_task(c: Components, v: dict, fields: dict, method: str):
    """The config task: every field its own input, wired straight to the pipeline parameter (no dict of
    placeholders, which backends before KFP 2.14 resolve at random: components/definitions.py)."""
    return c.resolve_config(base_config=v["base_config"], defaults=fields, overrides=v["overrides"], method=method,
                            job_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, **{_param(k): v[_param(k)] for k in fields})


def _method_branch(c: Components, v: dict, options: DeployOptions, cfg: RunConfig, fields: dict, manifest, method: str | None,
                   publish: bool = False, config=None) -> object:
    """resolve config (unless `config` is resolved already) -> partition (unless `manifest`) -> phase tasks -> evaluate
    (-> publish) for one method, simulated; returns the evaluate task."""
    if config is None:
        resolve = _resolve_task(c, v, fields, method or "").set_display_name(f"config {method}" if method else "config")
        _step(resolve, v, options)
        config = resolve.outputs["config"]
    if manifest is None:
        part = c.partition(config=config).set_display_name("partition")
        _step(part, v, options)
        manifest = part.outputs["manifest"]
    phases = phases_of(cfg.method, cfg.train.rounds)
    distributed = {job.phase: job for job in options.distributed}
    previous = None
    for phase in phases:
        inputs = {"previous": previous} if previous is not None else {}
        if phase.name in distributed:
            task = _launcher_task(c, v, options, distributed[phase.name], config, manifest, inputs)
            task.set_display_name(f"{method + ' ' if method else ''}{phase.name} ({distributed[phase.name].kind})")
        else:
            task = c.train_phase(config=config, phase=phase.name, manifest=manifest, requested_accelerators=v["accelerator_count"], **inputs)
            task.set_display_name(f"{method + ' ' if method else ''}{phase.name}")
            task.set_accelerator_type(v["accelerator_type"]).set_accelerator_limit(v["accelerator_count"])
            task.set_cpu_request(v["cpu_request"]).set_cpu_limit(v["cpu_limit"])
            task.set_memory_request(v["memory_request"]).set_memory_limit(v["memory_limit"])
            # kfp 2.17's resource setters do not register the parameters they name as the task's channels, so a DAG
            # around the task (the simulation branch) would not get them as inputs (as in pipelines/study.py)
            task.register_pipeline_channels([v[k] for k in TRAINING_RESOURCES])
            kubernetes.add_node_selector_json(task, v["node_selector"])
            kubernetes.add_toleration_json(task, v["tolerations"])
            queue(task, options)
        task.set_retry(options.retries)
        _storage(task, options)
        previous = task.outputs["state"]
    evaluate = c.evaluate(config=config, manifest=manifest, state=previous).set_display_name(f"evaluate {method}" if method else "evaluate")
    _step(evaluate, v, options)
    if publish:  # after evaluate: its output (the run id) is the publish task's input
        _step(c.publish(config=config, evaluated_run=evaluate.outputs["Output"]).set_display_name("publish"), v, options)
    return evaluate


def _federated_branch(c: Components, v: dict, options: DeployOptions, cfg: RunConfig, config) -> None:
    """census -> one task per phase -> evaluate -> publish, each a stage of the run at the SuperLink
    (components/federated.py). CPU tasks: the sites train. A phase task is retried like a simulated one (the
    ServerApp resumes from its checkpoint in the store)."""
    census = c.federated_census(config=config).set_display_name("census of the sites")
    _federation_step(census, v, options)
    previous = None
    for phase in phases_of(cfg.method, cfg.train.rounds):
        inputs = {"previous": previous} if previous is not None else {}
        task = c.federated_phase(config=config, phase=phase.name, census=census.outputs["Output"], **inputs)
        task.set_display_name(f"{phase.name} at the sites")
        _federation_step(task, v, options)
        task.set_retry(options.retries)
        previous = task.outputs["state"]
    evaluate = c.federated_evaluate(config=config, state=previous).set_display_name("evaluate at the sites")
    _federation_step(evaluate, v, options)
    _step(c.publish(config=config, evaluated_run=evaluate.outputs["Output"]).set_display_name("publish"), v, options)


def _federation_step(task, v: dict, options: DeployOptions) -> None:
    """A federation task: a step's resources and store, the federation's CA certificate mounted read-only, and the
    Control API's token (which only these tasks get: they alone submit runs)."""
    _step(task, v, options)
    if options.federation_control_secret:
        kubernetes.use_secret_as_volume(task, secret_name=options.federation_control_secret, mount_path=FEDERATION_CONTROL_DIR)
        task.set_env_variable("FEDPIPE_CONTROL_TOKEN_FILE", f"{FEDERATION_CONTROL_DIR}/token")
    if options.federation_ca_secret:
        kubernetes.use_secret_as_volume(task, secret_name=options.federation_ca_secret, mount_path=FEDERATION_CA_DIR)
    if options.federation_ca_secret or options.federation_control_secret:
        for entry in task.platform_config["kubernetes"]["secretAsVolume"]:  # as for secretAsEnv in _storage: 2.15+ protos only
            if entry.get("optional") is False:
                del entry["optional"]


def queue(task, options: DeployOptions) -> None:
    """A GPU task's pod waits in Kueue's LocalQueue `options.kueue_queue` (KUEUE_QUEUE_LABEL on the pod: Kueue's
    pod integration, sigs.k8s.io/kueue pkg/controller/jobs/pod, gates it until its ClusterQueue admits it)."""
    if options.kueue_queue:
        kubernetes.add_pod_label(task, KUEUE_QUEUE_LABEL, options.kueue_queue)


def _step(task, v: dict, options: DeployOptions) -> None:
    """A task that is not a training phase (config, partition, evaluate, comparison): CPU only, sized by
    the step_* resource parameters."""
    task.set_cpu_request(v["step_cpu_request"]).set_cpu_limit(v["step_cpu_limit"])
    task.set_memory_request(v["step_memory_request"]).set_memory_limit(v["step_memory_limit"])
    task.register_pipeline_channels([v[k] for k in STEP_RESOURCES])  # see the training task's note in _method_branch
    _storage(task, options)


def _launcher_task(c: Components, v: dict, options: DeployOptions, job: PhaseJob, config, manifest, inputs: dict):
    """The task that runs a phase as a PyTorchJob: a small pod of its own (it only talks to the API server
    and copies artifacts); the training resources parameters size each pod of the job instead."""
    storage = {"s3_endpoint": options.s3_endpoint, "s3_secret_keys": list(options.s3_secret_keys), "signing_secret": options.signing_secret,
               "pushgateway": options.pushgateway, "extra_env": dict(options.extra_env)}
    task = c.launch_phase_job(
        config=config, phase=job.phase, manifest=manifest, job=replace(job, queue=job.queue or options.kueue_queue).as_dict(),
        image=options.training_image, storage=storage,
        cpu_request=v["cpu_request"], cpu_limit=v["cpu_limit"], memory_request=v["memory_request"], memory_limit=v["memory_limit"],
        accelerator_type=v["accelerator_type"], node_selector=v["node_selector"], tolerations=v["tolerations"], s3_secret=options.s3_secret,
        **inputs,
    )
    task.set_cpu_request(LAUNCHER_RESOURCES["cpu_request"]).set_cpu_limit(LAUNCHER_RESOURCES["cpu_limit"])
    task.set_memory_request(LAUNCHER_RESOURCES["memory_request"]).set_memory_limit(LAUNCHER_RESOURCES["memory_limit"])
    kubernetes.use_field_path_as_env(task, "FEDPIPE_NAMESPACE", "metadata.namespace")  # the job goes beside the task
    kubernetes.add_pod_label(task, "app.kubernetes.io/component", LAUNCHER_COMPONENT)
    return task


def _check_distributed(options: DeployOptions, phases_by_method: dict[str, list[str]]) -> None:
    """Every distributed phase is a phase of some method in the pipeline, and named once."""
    names = [job.phase for job in options.distributed]
    if len(set(names)) != len(names):
        raise ConfigError(f"a distributed phase is given twice: {', '.join(names)}.")
    known = {phase for phases in phases_by_method.values() for phase in phases}
    for name in names:
        if name not in known:
            listed = "; ".join(f"{m}: {', '.join(p)}" for m, p in phases_by_method.items())
            raise ConfigError(f"--distributed-phase {name!r} is not a phase of the pipeline's method(s) ({listed}).")


def _deployed(cfg: RunConfig, options: DeployOptions, name: str) -> RunConfig:
    """The config as the cluster runs it: artifacts in the deployment's store, metrics labelled by pipeline."""
    store = cfg.run.store if cfg.run.store.startswith("s3://") else options.store
    # the Pushgateway becomes the run parameter telemetry_pushgateway (settable in the UI; empty: no push)
    pushgateway = cfg.telemetry.pushgateway or options.pushgateway or ""
    federation = {}
    if options.federation_superlink:
        federation["superlink"] = options.federation_superlink
    if options.federation_ca_secret:
        federation["root_certificates"] = f"{FEDERATION_CA_DIR}/ca.crt"
    return cfg.model_copy(update={
        "run": cfg.run.model_copy(update={"store": store}),
        "telemetry": cfg.telemetry.model_copy(update={"pipeline": name, "pushgateway": pushgateway}),
        "federation": cfg.federation.model_copy(update=federation),
    })


def method_pipeline(cfg: RunConfig, options: DeployOptions = DeployOptions()) -> Callable:
    """The pipeline of `cfg.method`: one task per phase, generated from the method's phase list."""
    name = pipeline_name(cfg.method.name)
    _check_distributed(options, {cfg.method.name: [p.name for p in phases_of(cfg.method, cfg.train.rounds)]})
    cfg = _deployed(cfg, options, name)
    fields = flat_fields(cfg)
    c = build(options.image, options.training_image, fields)
    signature = _signature(fields, _one_line(cfg), options)

    def body(*args, **kwargs):
        v = _bind(signature, args, kwargs)
        resolve = _resolve_task(c, v, fields, "").set_display_name("config")
        _step(resolve, v, options)
        # the simulation branch first: kfp names tasks in the order they are made, so its tasks keep their plain names
        # (partition, train-phase, evaluate, publish: the local runner's artifact folders), the federation's get -2
        with dsl.If(resolve.outputs["Output"] != "federation", name="simulation"):
            _method_branch(c, v, options, cfg, fields, None, None, publish=True, config=resolve.outputs["config"])
        with dsl.Else(name="federation"):
            _federated_branch(c, v, options, cfg, resolve.outputs["config"])

    return _as_pipeline(body, signature, name, f"{cfg.method.name}: {ALGORITHMS[cfg.method.name].paper}. "
                        "Simulation (engine_mode): partition, one task per training phase, evaluation; federation: the sites' "
                        "census, one task per phase trained at the sites, their evaluation. Then publication in the model line.")


def benchmark_pipeline(cfg: RunConfig, methods: list[str], options: DeployOptions = DeployOptions()) -> Callable:
    """Several methods on the same partition and budget, ending with a comparison table."""
    name = pipeline_name(None)
    cfg = _deployed(cfg, options, name)
    shared = ("run", "data", "partition", "model", "train", "eval", "telemetry", "privacy")
    fields = flat_fields(cfg, shared)
    c = build(options.image, options.training_image, fields, methods)
    signature = _signature(fields, _one_line(cfg), options)
    per_method = {m: load_config(None, [f"method.name={m}"]).method for m in methods}
    _check_distributed(options, {m: [p.name for p in phases_of(per_method[m], cfg.train.rounds)] for m in methods})

    def body(*args, **kwargs):
        v = _bind(signature, args, kwargs)
        resolve = _resolve_task(c, v, fields, "").set_display_name("config (shared)")
        _step(resolve, v, options)
        with dsl.If(resolve.outputs["Output"] != "federation", name="simulation"):
            part = c.partition(config=resolve.outputs["config"]).set_display_name("partition (shared)")
            _step(part, v, options)
            evaluations = [
                _method_branch(c, v, options, cfg.model_copy(update={"method": per_method[m]}), fields, part.outputs["manifest"], m)
                for m in methods
            ]
            _compare(c, v, options, resolve.outputs["config"], methods, evaluations)
        with dsl.Else(name="federation"):  # engine_mode=federation: one census, each method its own run at the same sites
            census = c.federated_census(config=resolve.outputs["config"]).set_display_name("census of the sites (shared)")
            _federation_step(census, v, options)
            evaluations = [_federated_method(c, v, options, cfg.model_copy(update={"method": per_method[m]}), fields, census, m)
                           for m in methods]
            _compare(c, v, options, resolve.outputs["config"], methods, evaluations)

    return _as_pipeline(body, signature, name, f"Benchmark of {', '.join(methods)} on one partition (simulation) or on the "
                        "same sites (federation), with a comparison table.")


def _compare(c: Components, v: dict, options: DeployOptions, config, methods: list[str], evaluations: list) -> None:
    table = c.compare(config=config, **{f"run_id_{m}": e.outputs["Output"] for m, e in zip(methods, evaluations)})
    table.set_display_name("comparison table")
    _step(table, v, options)


def _federated_method(c: Components, v: dict, options: DeployOptions, cfg: RunConfig, fields: dict, census, method: str):
    """One method of a benchmark at the sites: its own config (its run id), then its phases and its evaluation, each a
    stage of its run at the SuperLink, after the shared census; returns its evaluate task (nothing is published)."""
    resolve = _resolve_task(c, v, fields, method).set_display_name(f"config {method}")
    _step(resolve, v, options)
    previous = None
    for phase in phases_of(cfg.method, cfg.train.rounds):
        inputs = {"previous": previous} if previous is not None else {}
        task = c.federated_phase(config=resolve.outputs["config"], phase=phase.name, census=census.outputs["Output"], **inputs)
        task.set_display_name(f"{method} {phase.name} at the sites")
        _federation_step(task, v, options)
        task.set_retry(options.retries)
        previous = task.outputs["state"]
    evaluate = c.federated_evaluate(config=resolve.outputs["config"], state=previous).set_display_name(f"evaluate {method} at the sites")
    _federation_step(evaluate, v, options)
    return evaluate


def _as_pipeline(body: Callable, signature: inspect.Signature, name: str, description: str) -> Callable:
    body.__signature__ = signature
    body.__name__ = name.replace("-", "_")
    body.__doc__ = description
    return dsl.pipeline(name=name, description=description)(body)


def compile_pipeline(pipeline: Callable, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(pipeline, str(path))
    return path


SHIPPED = Path(__file__).parent  # the compiled pipelines that ship with fedpipe (pipelines/*.yaml)


def compile_shipped_components(folder: Path, options: DeployOptions = DeployOptions()) -> list[Path]:
    """What `fedpipe compile --all` writes to components/: each component for the release's images, the
    config task with the default method pipeline's fields and the comparison over every method."""
    fields = flat_fields(_deployed(load_config(None), options, pipeline_name(None)))
    return compile_components(folder, options.image, options.training_image, fields, list(ALGORITHMS))


def shipped_pipelines(options: DeployOptions = DeployOptions()) -> dict[str, Callable]:
    """What `fedpipe compile --all` writes: each method's pipeline with its default config, and the benchmark."""
    out = {f"{m}.yaml": method_pipeline(load_config(None, [f"method.name={m}"]), options) for m in ALGORITHMS}
    out["benchmark.yaml"] = benchmark_pipeline(load_config(None), list(ALGORITHMS), options)
    return out
