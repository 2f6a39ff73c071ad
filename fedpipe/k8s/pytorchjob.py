"""A training phase as a Kubeflow Training Operator PyTorchJob (kubeflow.org/v1): the one place its manifest is made.

A phase that outgrows one GPU or one node runs as a PyTorchJob instead of a single pipeline task:
`nodes` pods (one Master, the rest Workers), each running

    torchrun --nnodes=N --nproc-per-node=P --node-rank=$(PET_NODE_RANK)
             --master-addr=$(MASTER_ADDR) --master-port=$(MASTER_PORT) -m fedpipe.cli train --phase PHASE -c CONFIG

The Training Operator (v1.7 or later, where `spec.nprocPerNode` exists) sets MASTER_ADDR, MASTER_PORT,
PET_NODE_RANK, PET_NNODES and PET_NPROC_PER_NODE in every pod; Kubernetes expands the $(VAR)
references in the arguments. `fedpipe train` under torchrun joins the process group (NCCL when the
pod has a GPU, else gloo) and rank 0 writes the store, so the pods share the run's store (MinIO/S3),
never a local folder.

What the pods get is what the pipeline's training task gets: the same image, the run config as a
file (from an annotation of the pod template, through a downward-API volume: no ConfigMap to create,
clean up or grant), the store endpoint and Pushgateway as env, the credentials from the same Secret
(a secretKeyRef, never a value), and the lock-down of the chart's pods (non-root, read-only root
filesystem with an emptyDir at /tmp, no capabilities, seccomp RuntimeDefault, no API token).
"""

from __future__ import annotations

import copy
import hashlib
import re
from dataclasses import dataclass, field

import yaml

from fedpipe.errors import ConfigError

API_GROUP = "kubeflow.org"
API_VERSION = "v1"
KIND = "PyTorchJob"
PLURAL = "pytorchjobs"

# The operator finds the training container and its rendezvous port by these names.
CONTAINER = "pytorch"
PORT_NAME = "pytorchjob-port"

CONFIG_DIR = "/etc/fedpipe"
CONFIG_PATH = f"{CONFIG_DIR}/config.yaml"
CONFIG_ANNOTATION = "fedpipe.io/run-config"
RUN_ID_ANNOTATION = "fedpipe.io/run-id"
PHASE_LABEL = "fedpipe.io/phase"
RUN_LABEL = "fedpipe.io/run"
COMPONENT = "distributed-phase"  # app.kubernetes.io/component of the job and its pods (the NetworkPolicy selects it)

CLEANUPS = ("on-success", "always", "never")
CLEAN_POD_POLICIES = ("Running", "All", "None")

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
    """The shape of one phase's PyTorchJob, chosen when the pipeline is compiled.

    The clients of each round are spread over nodes x processes_per_node processes; the final
    weights are those of one process, so the sizes are a matter of speed only.
    """

    phase: str
    """The method's phase that runs as a PyTorchJob (see `fedpipe methods`), e.g. personalization."""
    nodes: int = 2
    """Pods (Kubernetes nodes they may land on): one Master and nodes-1 Workers; >= 1."""
    processes_per_node: int = 1
    """torchrun processes per pod (`spec.nprocPerNode`); >= 1."""
    gpus_per_process: int = 0
    """GPUs per process; each pod asks for processes_per_node x gpus_per_process of the accelerator
    (resource `accelerator_type`). 0: CPU only, the processes talk gloo; > 0: NCCL."""
    backoff_limit: int = 3
    """Container restarts (restartPolicy OnFailure) before the job fails (`runPolicy.backoffLimit`);
    a restarted phase resumes from its last checkpoint in the store."""
    clean_pod_policy: str = "Running"
    """`runPolicy.cleanPodPolicy` once the job finishes: Running (stop pods still running, keep
    finished ones and their logs), All, or None."""
    cleanup: str = "on-success"
    """What the launcher does with the finished job: on-success (delete it when it succeeded, keep a
    failed one to inspect), always (delete it either way), never (keep it)."""
    timeout_seconds: int = 24 * 3600
    """Longest the job may run (`runPolicy.activeDeadlineSeconds`); the launcher gives up a minute later."""
    shm_size: str = "1Gi"
    """Size of the memory-backed /dev/shm (NCCL, gloo and data loaders need more than the runtime's 64Mi)."""
    master_port: int = 23456
    """Port of the rendezvous store on the Master pod."""

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
        ]
        errors = [message for ok, message in checks if not ok]
        if errors:
            raise ConfigError(f"Distributed phase {self.phase!r}: {'; '.join(errors)}.")

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node

    def as_dict(self) -> dict:
        """The fields as plain values (how the pipeline hands them to the launcher task)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, values: dict) -> PhaseJob:
        """The inverse of as_dict. KFP hands a dict parameter over as a protobuf Struct, whose numbers
        are floats: the integer fields are made integers again (a fraction is an error)."""
        unknown = set(values) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown PyTorchJob settings: {', '.join(sorted(unknown))}")
        out = dict(values)
        for name, spec in cls.__dataclass_fields__.items():
            if spec.type == "int" and isinstance(out.get(name), float):
                if not out[name].is_integer():
                    raise ConfigError(f"PyTorchJob setting {name} must be a whole number, not {out[name]}")
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


def _label_value(text: str, most: int = 63) -> str:
    """A valid label value (and DNS label part): lowercase alphanumerics and '-', alphanumeric at both ends."""
    value = re.sub(r"[^a-z0-9-]+", "-", text.lower())[:most].strip("-")
    return value or "x"


def run_hash(run_id: str) -> str:
    return hashlib.sha256(run_id.encode()).hexdigest()[:10]


def phase_job_name(run_id: str, phase: str) -> str:
    """fedpipe-<phase>-<hash of the run id>: one job per run and phase, so a retried launcher finds
    its job again. At most 49 characters, a DNS-1035 label as the operator requires; its pods and
    Services add `-worker-<index>` and stay within 63."""
    return f"fedpipe-{_label_value(phase, 30)}-{run_hash(run_id)}"


def labels(run_id: str, phase: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "fedpipe",
        "app.kubernetes.io/part-of": "fedpipe",
        "app.kubernetes.io/component": COMPONENT,
        "app.kubernetes.io/managed-by": "fedpipe-launcher",
        PHASE_LABEL: _label_value(phase),
        RUN_LABEL: run_hash(run_id),
    }


def torchrun_args(phase: str, job: PhaseJob) -> list[str]:
    """torchrun's arguments; the $(VAR)s are the env the operator sets, expanded by Kubernetes."""
    return [
        f"--nnodes={job.nodes}",
        f"--nproc-per-node={job.processes_per_node}",
        "--node-rank=$(PET_NODE_RANK)",
        "--master-addr=$(MASTER_ADDR)",
        "--master-port=$(MASTER_PORT)",
        "-m", "fedpipe.cli", "train", "--phase", phase, "--config", CONFIG_PATH,
    ]  # fmt: skip


def _env(storage: StorageAccess) -> list[dict]:
    env = [{"name": "FEDPIPE_S3_ENDPOINT", "value": storage.s3_endpoint}]
    if storage.pushgateway:
        env.append({"name": "FEDPIPE_PUSHGATEWAY", "value": storage.pushgateway})
    env += [{"name": name, "value": str(value)} for name, value in storage.extra_env.items()]
    access, secret_key = storage.s3_secret_keys
    env += [
        {"name": "AWS_ACCESS_KEY_ID", "valueFrom": {"secretKeyRef": {"name": storage.s3_secret, "key": access}}},
        {"name": "AWS_SECRET_ACCESS_KEY", "valueFrom": {"secretKeyRef": {"name": storage.s3_secret, "key": secret_key}}},
        # The root filesystem is read-only: caches (torch, matplotlib, datasets) go under /tmp.
        {"name": "HOME", "value": "/tmp"},
    ]
    return env


def _resources(job: PhaseJob, resources: PodResources) -> dict:
    out = {
        "requests": {"cpu": resources.cpu_request, "memory": resources.memory_request},
        "limits": {"cpu": resources.cpu_limit, "memory": resources.memory_limit},
    }
    gpus = job.processes_per_node * job.gpus_per_process
    if gpus:
        out["limits"][resources.accelerator_type] = gpus  # extended resources: the request follows the limit
    return out


def _pod_template(run_id: str, phase: str, config_yaml: str, image: str, job: PhaseJob, resources: PodResources,
                  storage: StorageAccess) -> dict:
    spec = {
        # The pods talk to the store and each other, never to the Kubernetes API.
        "automountServiceAccountToken": False,
        "securityContext": dict(POD_SECURITY_CONTEXT),
        "containers": [{
            "name": CONTAINER,
            "image": image,
            "imagePullPolicy": "IfNotPresent",
            "command": ["torchrun"],
            "args": torchrun_args(phase, job),
            "ports": [{"name": PORT_NAME, "containerPort": job.master_port, "protocol": "TCP"}],
            "env": _env(storage),
            "resources": _resources(job, resources),
            "securityContext": dict(CONTAINER_SECURITY_CONTEXT),
            "volumeMounts": [
                {"name": "run-config", "mountPath": CONFIG_DIR, "readOnly": True},
                {"name": "tmp", "mountPath": "/tmp"},
                {"name": "dshm", "mountPath": "/dev/shm"},
            ],
        }],
        "volumes": [
            # The run config as /etc/fedpipe/config.yaml, from the pod's own annotation.
            {"name": "run-config", "downwardAPI": {"items": [
                {"path": "config.yaml", "fieldRef": {"fieldPath": f"metadata.annotations['{CONFIG_ANNOTATION}']"}},
            ]}},
            {"name": "tmp", "emptyDir": {}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": job.shm_size}},
        ],
    }  # fmt: skip
    if resources.node_selector:
        spec["nodeSelector"] = dict(resources.node_selector)
    if resources.tolerations:
        spec["tolerations"] = list(resources.tolerations)
    return {
        "metadata": {
            "labels": labels(run_id, phase),
            "annotations": {
                # An Istio sidecar keeps a finished pod running and sits between the ranks (Kubeflow's own advice).
                "sidecar.istio.io/inject": "false",
                CONFIG_ANNOTATION: config_yaml,
            },
        },
        "spec": spec,
    }


def phase_job_manifest(*, run_id: str, phase: str, config_yaml: str, namespace: str, image: str, job: PhaseJob,
                       resources: PodResources, storage: StorageAccess) -> dict:
    """The PyTorchJob that runs `phase` of the run whose resolved config is `config_yaml` (YAML text
    with run.id set: every pod, and the launcher, must agree on the run's folder in the store)."""
    if job.phase != phase:
        raise ConfigError(f"the PyTorchJob settings are for phase {job.phase!r}, not {phase!r}")
    parsed = yaml.safe_load(config_yaml)
    if not isinstance(parsed, dict) or (parsed.get("run") or {}).get("id") != run_id:
        raise ConfigError(f"the run config given for the PyTorchJob must have run.id={run_id!r}")
    template = _pod_template(run_id, phase, config_yaml, image, job, resources, storage)
    replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": template}}
    if job.nodes > 1:
        replicas["Worker"] = {"replicas": job.nodes - 1, "restartPolicy": "OnFailure", "template": copy.deepcopy(template)}
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "metadata": {
            "name": phase_job_name(run_id, phase),
            "namespace": namespace,
            "labels": labels(run_id, phase),
            "annotations": {RUN_ID_ANNOTATION: run_id, PHASE_LABEL: phase},
        },
        "spec": {
            "nprocPerNode": str(job.processes_per_node),
            "pytorchReplicaSpecs": replicas,
            "runPolicy": {
                "cleanPodPolicy": job.clean_pod_policy,
                "backoffLimit": job.backoff_limit,
                "activeDeadlineSeconds": job.timeout_seconds,
            },
        },
    }
