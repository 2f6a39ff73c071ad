"""A training phase as a Kubeflow Training Operator PyTorchJob (kubeflow.org/v1): the one place its manifest is made.

A phase that outgrows one GPU or one node runs as a PyTorchJob instead of a single pipeline task:
`nodes` pods (one Master, the rest Workers), each running torchrun (`phasejob.torchrun_args`) with
the rendezvous the Training Operator (v1.7 or later, where `spec.nprocPerNode` exists) sets in every
pod: PET_NODE_RANK, MASTER_ADDR and MASTER_PORT (and PET_NNODES, PET_NPROC_PER_NODE).

The pods get the lock-down of the chart's pods (non-root, read-only root filesystem with an emptyDir
at /tmp, no capabilities, seccomp RuntimeDefault, no API token), besides what `phasejob` gives every
kind of job. The settings, resources and storage types are `phasejob`'s (re-exported here).
"""

from __future__ import annotations

import copy

from fedpipe.k8s.phasejob import (
    CONFIG_ANNOTATION,
    CONFIG_PATH,
    CONTAINER_SECURITY_CONTEXT,
    POD_SECURITY_CONTEXT,
    RUN_ID_ANNOTATION,
    PhaseJob,
    PodResources,
    Rendezvous,
    StorageAccess,
    check_inputs,
    env,
    job_metadata,
    labels,
    phase_job_name,
    placement,
    pod_metadata,
    resources,
    torchrun_args,
    volume_mounts,
    volumes,
)

__all__ = [
    "API_GROUP", "API_VERSION", "CONFIG_ANNOTATION", "CONFIG_PATH", "CONTAINER", "CONTAINER_SECURITY_CONTEXT", "KIND",
    "PLURAL", "POD_SECURITY_CONTEXT", "PORT_NAME", "RENDEZVOUS", "RUN_ID_ANNOTATION", "PhaseJob", "PodResources",
    "StorageAccess", "labels", "phase_job_manifest", "phase_job_name",
]  # fmt: skip

API_GROUP = "kubeflow.org"
API_VERSION = "v1"
KIND = "PyTorchJob"
PLURAL = "pytorchjobs"

# The operator finds the training container and its rendezvous port by these names.
CONTAINER = "pytorch"
PORT_NAME = "pytorchjob-port"
# The env the operator sets in every replica's pod (MASTER_ADDR: the Master's Service).
RENDEZVOUS = Rendezvous(node_rank="PET_NODE_RANK", master_addr="MASTER_ADDR", master_port="MASTER_PORT")


def _pod_template(run_id: str, phase: str, config_yaml: str, image: str, job: PhaseJob, pod: PodResources,
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
            "args": torchrun_args(phase, job, RENDEZVOUS),
            "ports": [{"name": PORT_NAME, "containerPort": job.master_port, "protocol": "TCP"}],
            "env": env(storage),
            "resources": resources(job, pod),
            "securityContext": dict(CONTAINER_SECURITY_CONTEXT),
            "volumeMounts": volume_mounts(),
        }],
        "volumes": volumes(job),
        **placement(pod),
    }  # fmt: skip
    return {"metadata": pod_metadata(run_id, phase, config_yaml), "spec": spec}


def phase_job_manifest(*, run_id: str, phase: str, config_yaml: str, namespace: str, image: str, job: PhaseJob,
                       resources: PodResources, storage: StorageAccess) -> dict:
    """The PyTorchJob that runs `phase` of the run whose resolved config is `config_yaml` (YAML text
    with run.id set: every pod, and the launcher, must agree on the run's folder in the store)."""
    check_inputs(run_id, phase, config_yaml, job, KIND)
    template = _pod_template(run_id, phase, config_yaml, image, job, resources, storage)
    replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": template}}
    if job.nodes > 1:
        replicas["Worker"] = {"replicas": job.nodes - 1, "restartPolicy": "OnFailure", "template": copy.deepcopy(template)}
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        # ≤ 49 characters: the operator's pod and Service names add `-worker-<index>` and stay within 63.
        "metadata": job_metadata(run_id, phase, namespace, phase_job_name(run_id, phase), job.queue),
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
