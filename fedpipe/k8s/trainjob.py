"""A training phase as a Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1): the one place its manifest is made.

Kubeflow 1.11 and 26.03 ship Trainer v2.1.0 beside the Training Operator v1.9.2. A TrainJob names a
ClusterTrainingRuntime (`torch-distributed`, which Trainer ships, unless the settings name another)
and overrides parts of it; Trainer builds a JobSet from the two, one replicated Job `node` with
`numNodes` pods. What follows is kubeflow/trainer at v2.1.0:

- `spec.trainer` sets the `node` container's image, command, args, env and resources, and the node
  and process counts (pkg/runtime/framework/plugins/jobset/builder.go, Builder.Trainer).
- The torch plugin (pkg/runtime/framework/plugins/torch/torch.go, EnforceMLPolicy) adds PET_NNODES,
  PET_NPROC_PER_NODE, PET_NODE_RANK (the Job completion index), PET_MASTER_ADDR
  (`<name>-node-0-0.<name>`) and PET_MASTER_PORT (29500) to that container; torchrun's arguments
  refer to them (RENDEZVOUS), so the pods start exactly as a PyTorchJob's do. Its webhook refuses
  those names in `trainer.env`.
- `spec.podTemplateOverrides` (pkg/runtime/core/trainingruntime.go, mergePodTemplateOverrides: a
  strategic merge patch of the pod template) brings the pods' labels and annotations (the run
  config, no Istio sidecar), volumes, the `node` container's volume mounts, node selector and
  tolerations. Env may not be set there for `node` (the JobSet plugin's Validate).
- There is no field for a deadline, restarts, a pod security context or the service-account token
  (TrainJobSpec, PodTemplateSpecOverride in pkg/apis/trainer/v1alpha1/trainjob_types.go): those are
  the runtime's. So the launcher enforces the deadline itself, and a cluster that needs the pods
  locked down like the chart's names a runtime that does so (`PhaseJob.runtime`).
"""

from __future__ import annotations

from fedpipe.k8s import phasejob
from fedpipe.k8s.phasejob import PhaseJob, PodResources, Rendezvous, StorageAccess

API_GROUP = "trainer.kubeflow.org"
API_VERSION = "v1alpha1"
KIND = "TrainJob"
PLURAL = "trainjobs"
RUNTIME_KIND = "ClusterTrainingRuntime"

# The runtime's trainer Job and its container are both `node` (pkg/constants/constants.go, Node):
# Trainer applies spec.trainer only to a container of that name.
TRAINER_JOB = "node"
CONTAINER = "node"
TRAINER_PORT = 29500  # constants.ContainerTrainerPort: PET_MASTER_PORT
RENDEZVOUS = Rendezvous(node_rank="PET_NODE_RANK", master_addr="PET_MASTER_ADDR", master_port="PET_MASTER_PORT")
# The JobSet's pods are `<JobSet>-<replicated job>-<job index>-<pod index>-<5 random>`, a DNS-1035
# label of at most 63 characters (JobSet v0.10.1, pkg/webhooks/jobset_webhook.go, ValidateCreate); the
# JobSet is named after the TrainJob (plugins/jobset/jobset.go, Build).
POD_NAME_SUFFIX = f"-{TRAINER_JOB}-0-{{index}}-xxxxx"


def train_job_name(run_id: str, phase: str, job: PhaseJob) -> str:
    """phasejob.phase_job_name, cut so that JobSet's longest pod name (the last node's) fits 63."""
    longest_suffix = len(POD_NAME_SUFFIX.format(index=job.nodes - 1))
    return phasejob.phase_job_name(run_id, phase, most=min(49, 63 - longest_suffix))


def _override(run_id: str, phase: str, config_yaml: str, job: PhaseJob, pod: PodResources) -> dict:
    """The podTemplateOverride of the trainer Job's pods: what a TrainJob can say about them beyond spec.trainer."""
    return {
        "targetJobs": [{"name": TRAINER_JOB}],
        "metadata": phasejob.pod_metadata(run_id, phase, config_yaml),
        "spec": {
            "volumes": phasejob.volumes(job),
            "containers": [{"name": CONTAINER, "volumeMounts": phasejob.volume_mounts()}],
            **phasejob.placement(pod),
        },
    }


def train_job_manifest(*, run_id: str, phase: str, config_yaml: str, namespace: str, image: str, job: PhaseJob,
                       resources: PodResources, storage: StorageAccess) -> dict:
    """The TrainJob that runs `phase` of the run whose resolved config is `config_yaml` (YAML text with
    run.id set), on the ClusterTrainingRuntime `job.runtime`; same inputs as the PyTorchJob's manifest."""
    phasejob.check_inputs(run_id, phase, config_yaml, job, KIND)
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "metadata": phasejob.job_metadata(run_id, phase, namespace, train_job_name(run_id, phase, job), job.queue),
        "spec": {
            "runtimeRef": {"name": job.runtime, "apiGroup": API_GROUP, "kind": RUNTIME_KIND},
            "trainer": {
                "image": image,
                "command": ["torchrun"],
                "args": phasejob.torchrun_args(phase, job, RENDEZVOUS),
                "env": phasejob.env(storage),
                "numNodes": job.nodes,
                "numProcPerNode": job.processes_per_node,
                "resourcesPerNode": phasejob.resources(job, resources),
            },
            "podTemplateOverrides": [_override(run_id, phase, config_yaml, job, resources)],
        },
    }
