"""A training phase as a Kubernetes training job: the settings and the pod parts that a Kubeflow Training
Operator PyTorchJob (`pytorchjob.py`) and a Kubeflow Trainer v2 TrainJob (`trainjob.py`) share.

Either way the phase runs as `nodes` pods, each running

    torchrun --nnodes=N --nproc-per-node=P --node-rank=$(<rank env>)
             --master-addr=$(<address env>) --master-port=$(<port env>) -m fedpipe.cli train --phase PHASE -c CONFIG

where the three variables are the ones the job's controller sets in every pod (`Rendezvous`);
Kubernetes expands the $(VAR) references in the arguments. `fedpipe train` under torchrun joins the
process group (NCCL when the pod has a GPU, else gloo) and rank 0 writes the store, so the pods share
the run's store (MinIO/S3), never a local folder.

What the pods get is what the pipeline's training task gets: the same image, the run config as a
file (from an annotation of the pod template, through a downward-API volume: no ConfigMap to create,
clean up or grant), the store endpoint and Pushgateway as env, the credentials from the same Secret
(a secretKeyRef, never a value).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

import yaml

from fedpipe.errors import ConfigError

CONFIG_DIR = "/etc/fedpipe"
CONFIG_PATH = f"{CONFIG_DIR}/config.yaml"
CONFIG_ANNOTATION = "fedpipe.io/run-config"
RUN_ID_ANNOTATION = "fedpipe.io/run-id"
PHASE_LABEL = "fedpipe.io/phase"
RUN_LABEL = "fedpipe.io/run"
# Kueue's queue label (sigs.k8s.io/kueue pkg/controller/constants/constants.go QueueLabel, v0.19.2): on a job object
# of an integration Kueue manages (pkg/controller/jobs/: batch/job, trainer.kubeflow.org/trainjob, kubeflow.org/
# pytorchjob, pod, ...) it names the LocalQueue of the job's namespace; Kueue's webhook suspends the job (a pod:
# a scheduling gate) until its ClusterQueue admits it. The label goes on the job only: its pods belong to it.
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# A LocalQueue name as Kueue's webhook checks the label (jobframework/validation.go ValidateQueueName: a DNS-1123
# subdomain) that fits a label value (at most 63 characters); empty: no queue.
QUEUE_NAME = re.compile(r"((?=.{1,63}\Z)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)?")
COMPONENT = "distributed-phase"  # app.kubernetes.io/component of the job and its pods (the NetworkPolicy selects it)

APIS = ("pytorchjob", "trainjob")
KINDS = {"pytorchjob": "PyTorchJob", "trainjob": "TrainJob"}
CLEANUPS = ("on-success", "always", "never")
CLEAN_POD_POLICIES = ("Running", "All", "None")
TRAINER_RUNTIME = "torch-distributed"  # the ClusterTrainingRuntime Kubeflow Trainer v2 ships for torchrun

# The chart's podSecurityContext / containerSecurityContext defaults (a deploy test checks they agree).
POD_SECURITY_CONTEXT = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 1000,
    "fsGroup": 1000,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY_CONTEXT = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 1000,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


@dataclass(frozen=True)
class PhaseJob:
    """The shape of one phase's job, chosen when the pipeline is compiled.

    The clients of each round are spread over nodes x processes_per_node processes; the final
    weights are those of one process, so the sizes are a matter of speed only.
    """

    phase: str
    """The method's phase that runs as a job (see `fedpipe methods`), e.g. personalization."""
    nodes: int = 2
    """Pods (Kubernetes nodes they may land on); >= 1. PyTorchJob: one Master and nodes-1 Workers."""
    processes_per_node: int = 1
    """torchrun processes per pod (PyTorchJob `spec.nprocPerNode`, TrainJob `trainer.numProcPerNode`); >= 1."""
    gpus_per_process: int = 0
    """GPUs per process; each pod asks for processes_per_node x gpus_per_process of the accelerator
    (resource `accelerator_type`). 0: CPU only, the processes talk gloo; > 0: NCCL."""
    backoff_limit: int = 3
    """PyTorchJob only: container restarts (restartPolicy OnFailure) before the job fails
    (`runPolicy.backoffLimit`); a restarted phase resumes from its last checkpoint in the store.
    A TrainJob's restarts are its runtime's (Kubernetes Job `backoffLimit`, default 6)."""
    clean_pod_policy: str = "Running"
    """PyTorchJob only: `runPolicy.cleanPodPolicy` once the job finishes: Running (stop pods still
    running, keep finished ones and their logs), All, or None."""
    cleanup: str = "on-success"
    """What the launcher does with the finished job: on-success (delete it when it succeeded, keep a
    failed one to inspect), always (delete it either way), never (keep it; a TrainJob that runs past
    timeout_seconds is deleted all the same, since it has no deadline of its own)."""
    timeout_seconds: int = 24 * 3600
    """Longest the job may run: the PyTorchJob's `runPolicy.activeDeadlineSeconds`; the launcher gives up
    a minute later (and deletes a TrainJob, which has no deadline field)."""
    shm_size: str = "1Gi"
    """Size of the memory-backed /dev/shm (NCCL, gloo and data loaders need more than the runtime's 64Mi)."""
    master_port: int = 23456
    """PyTorchJob only: port of the rendezvous store on the Master pod (a TrainJob's runtime sets 29500)."""
    api: str = "pytorchjob"
    """Which Kubeflow API runs the job: pytorchjob (Training Operator v1, kubeflow.org/v1 PyTorchJob) or
    trainjob (Trainer v2, trainer.kubeflow.org/v1alpha1 TrainJob on the ClusterTrainingRuntime `runtime`)."""
    runtime: str = TRAINER_RUNTIME
    """TrainJob only: the ClusterTrainingRuntime it runs on; a torch one, whose trainer job and container
    are named `node` (Trainer's torch-distributed, or a platform team's hardened copy of it)."""
    queue: str = ""
    """Kueue's LocalQueue the job waits in (label KUEUE_QUEUE_LABEL on the job); empty: not queued. Needs
    the kind's Kueue integration: trainer.kubeflow.org/trainjob is on in Kueue's default configuration,
    kubeflow.org/pytorchjob must be turned on (controller_manager_config.yaml integrations.frameworks).
    Time spent queued counts against timeout_seconds."""

    def __post_init__(self) -> None:
        checks = [
            (bool(self.phase), "phase must name a phase of the method"),
            (self.nodes >= 1, f"nodes must be at least 1, not {self.nodes}"),
            (self.processes_per_node >= 1, f"processes_per_node must be at least 1, not {self.processes_per_node}"),
            (self.gpus_per_process >= 0, f"gpus_per_process must be 0 (CPU) or more, not {self.gpus_per_process}"),
            (self.backoff_limit >= 0, f"backoff_limit must be 0 or more, not {self.backoff_limit}"),
            (self.clean_pod_policy in CLEAN_POD_POLICIES, f"clean_pod_policy must be one of {', '.join(CLEAN_POD_POLICIES)}, not {self.clean_pod_policy!r}"),
            (self.cleanup in CLEANUPS, f"cleanup must be one of {', '.join(CLEANUPS)}, not {self.cleanup!r}"),
            (self.timeout_seconds > 0, f"timeout_seconds must be positive, not {self.timeout_seconds}"),
            (1 <= self.master_port <= 65535, f"master_port must be a TCP port, not {self.master_port}"),
            (self.api in APIS, f"api must be one of {', '.join(APIS)}, not {self.api!r}"),
            (bool(re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", self.runtime)), f"runtime must name a ClusterTrainingRuntime, not {self.runtime!r}"),
            (bool(QUEUE_NAME.fullmatch(self.queue)), f"queue must name a Kueue LocalQueue (lower-case letters, digits, '-' and '.', at most 63), not {self.queue!r}"),
        ]
        errors = [message for ok, message in checks if not ok] + self._trainjob_limits()
        if errors:
            raise ConfigError(f"Distributed phase {self.phase!r}: {'; '.join(errors)}.")

    def _trainjob_limits(self) -> list[str]:
        """Settings a TrainJob (Trainer v2.1.0's TrainJobSpec) has no field for: an error rather than a
        setting silently dropped."""
        if self.api != "trainjob":
            return []
        defaults = {name: spec.default for name, spec in self.__dataclass_fields__.items()}
        ignored = [name for name in ("backoff_limit", "clean_pod_policy", "master_port") if getattr(self, name) != defaults[name]]
        return [f"{', '.join(ignored)} only apply to a PyTorchJob: a TrainJob takes them from its ClusterTrainingRuntime "
                f"({self.runtime}); leave them out, or use api=pytorchjob"] if ignored else []

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node

    @property
    def kind(self) -> str:
        """The Kubernetes kind of the job: PyTorchJob or TrainJob."""
        return KINDS[self.api]

    def as_dict(self) -> dict:
        """The fields as plain values (how the pipeline hands them to the launcher task)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, values: dict) -> PhaseJob:
        """The inverse of as_dict. KFP hands a dict parameter over as a protobuf Struct, whose numbers
        are floats: the integer fields are made integers again (a fraction is an error)."""
        unknown = set(values) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown distributed-phase settings: {', '.join(sorted(unknown))}")
        out = dict(values)
        for name, spec in cls.__dataclass_fields__.items():
            if spec.type == "int" and isinstance(out.get(name), float):
                if not out[name].is_integer():
                    raise ConfigError(f"distributed-phase setting {name} must be a whole number, not {out[name]}")
                out[name] = int(out[name])
        return cls(**out)


@dataclass(frozen=True)
class PodResources:
    """What each pod of the job asks for: the pipeline's training-task resources (the same run parameters)."""

    cpu_request: str = "1"
    cpu_limit: str = "4"
    memory_request: str = "2Gi"
    memory_limit: str = "16Gi"
    accelerator_type: str = "nvidia.com/gpu"
    node_selector: dict = field(default_factory=dict)
    tolerations: list = field(default_factory=list)


@dataclass(frozen=True)
class StorageAccess:
    """How the pods reach the store and the Pushgateway: endpoint as env, credentials from a Secret."""

    s3_endpoint: str
    s3_secret: str
    s3_secret_keys: tuple[str, str] = ("accesskey", "secretkey")
    pushgateway: str = ""
    extra_env: dict = field(default_factory=dict)
    signing_secret: str = ""  # the artifact signing key's Secret (data key "key"); empty: unsigned


@dataclass(frozen=True)
class Rendezvous:
    """The env variables a job's controller sets in every pod, which torchrun's arguments refer to."""

    node_rank: str
    master_addr: str
    master_port: str


def _label_value(text: str, most: int = 63) -> str:
    """A valid label value (and DNS label part): lowercase alphanumerics and '-', alphanumeric at both ends."""
    value = re.sub(r"[^a-z0-9-]+", "-", text.lower())[:most].strip("-")
    return value or "x"


def run_hash(run_id: str) -> str:
    return hashlib.sha256(run_id.encode()).hexdigest()[:10]


def phase_job_name(run_id: str, phase: str, most: int = 49) -> str:
    """fedpipe-<phase>-<hash of the run id>: one job per run and phase, so a retried launcher finds
    its job again. At most `most` characters (the phase is cut), a DNS-1035 label as both controllers
    require; each kind's module says what its pods and Services add to it."""
    return f"fedpipe-{_label_value(phase, most - 19)}-{run_hash(run_id)}"


def labels(run_id: str, phase: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "fedpipe",
        "app.kubernetes.io/part-of": "fedpipe",
        "app.kubernetes.io/component": COMPONENT,
        "app.kubernetes.io/managed-by": "fedpipe-launcher",
        PHASE_LABEL: _label_value(phase),
        RUN_LABEL: run_hash(run_id),
    }


def job_metadata(run_id: str, phase: str, namespace: str, name: str, queue: str = "") -> dict:
    """The job object's own metadata: its labels (and Kueue's queue label when `queue` is set), and the run
    and phase it belongs to (a retried launcher adopts a job only when the run id agrees)."""
    return {"name": name, "namespace": namespace, "labels": {**labels(run_id, phase), **({KUEUE_QUEUE_LABEL: queue} if queue else {})},
            "annotations": {RUN_ID_ANNOTATION: run_id, PHASE_LABEL: phase}}


def pod_metadata(run_id: str, phase: str, config_yaml: str) -> dict:
    """The pods' labels (the NetworkPolicy selects them) and annotations (the run config the
    downward-API volume mounts, and no Istio sidecar: one keeps a finished pod running and sits between
    the ranks, Kubeflow's own advice)."""
    return {"labels": labels(run_id, phase), "annotations": {"sidecar.istio.io/inject": "false", CONFIG_ANNOTATION: config_yaml}}


def torchrun_args(phase: str, job: PhaseJob, rendezvous: Rendezvous) -> list[str]:
    """torchrun's arguments; the $(VAR)s are the env the job's controller sets, expanded by Kubernetes."""
    return [
        f"--nnodes={job.nodes}",
        f"--nproc-per-node={job.processes_per_node}",
        f"--node-rank=$({rendezvous.node_rank})",
        f"--master-addr=$({rendezvous.master_addr})",
        f"--master-port=$({rendezvous.master_port})",
        "-m", "fedpipe.cli", "train", "--phase", phase, "--config", CONFIG_PATH,
    ]  # fmt: skip


def env(storage: StorageAccess) -> list[dict]:
    """The training container's env: store endpoint, Pushgateway, extra env, credentials by secretKeyRef."""
    out = [{"name": "FEDPIPE_S3_ENDPOINT", "value": storage.s3_endpoint}]
    if storage.pushgateway:
        out.append({"name": "FEDPIPE_PUSHGATEWAY", "value": storage.pushgateway})
    out += [{"name": name, "value": str(value)} for name, value in storage.extra_env.items()]
    access, secret_key = storage.s3_secret_keys
    out += [
        {"name": "AWS_ACCESS_KEY_ID", "valueFrom": {"secretKeyRef": {"name": storage.s3_secret, "key": access}}},
        {"name": "AWS_SECRET_ACCESS_KEY", "valueFrom": {"secretKeyRef": {"name": storage.s3_secret, "key": secret_key}}},
        # The root filesystem is read-only: caches (torch, matplotlib, datasets) go under /tmp.
        {"name": "HOME", "value": "/tmp"},
    ]
    if storage.signing_secret:  # every rank signs and verifies with the key the pipeline's tasks use
        out.append({"name": "FEDPIPE_SIGNING_KEY", "valueFrom": {"secretKeyRef": {"name": storage.signing_secret, "key": "key"}}})
    return out


def resources(job: PhaseJob, pod: PodResources) -> dict:
    """Requests and limits of each pod's training container."""
    out = {
        "requests": {"cpu": pod.cpu_request, "memory": pod.memory_request},
        "limits": {"cpu": pod.cpu_limit, "memory": pod.memory_limit},
    }
    gpus = job.processes_per_node * job.gpus_per_process
    if gpus:
        out["limits"][pod.accelerator_type] = gpus  # extended resources: the request follows the limit
    return out


def volume_mounts() -> list[dict]:
    return [
        {"name": "run-config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]


def volumes(job: PhaseJob) -> list[dict]:
    return [
        # The run config as /etc/fedpipe/config.yaml, from the pod's own annotation.
        {"name": "run-config", "downwardAPI": {"items": [
            {"path": "config.yaml", "fieldRef": {"fieldPath": f"metadata.annotations['{CONFIG_ANNOTATION}']"}},
        ]}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": job.shm_size}},
    ]  # fmt: skip


def placement(pod: PodResources) -> dict:
    """nodeSelector and tolerations of the pods, when the run sets them."""
    out = {}
    if pod.node_selector:
        out["nodeSelector"] = dict(pod.node_selector)
    if pod.tolerations:
        out["tolerations"] = list(pod.tolerations)
    return out


def check_inputs(run_id: str, phase: str, config_yaml: str, job: PhaseJob, kind: str) -> None:
    """The settings are this phase's, for this kind of job, and the config pins the run id: every pod,
    and the launcher, must agree on the run's folder in the store."""
    if job.kind != kind:
        raise ConfigError(f"the settings of phase {phase!r} are for a {job.kind} (api={job.api}), not a {kind}")
    if job.phase != phase:
        raise ConfigError(f"the {job.kind} settings are for phase {job.phase!r}, not {phase!r}")
    parsed = yaml.safe_load(config_yaml)
    if not isinstance(parsed, dict) or (parsed.get("run") or {}).get("id") != run_id:
        raise ConfigError(f"the run config given for the {job.kind} must have run.id={run_id!r}")
