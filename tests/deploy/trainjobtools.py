"""Kubeflow Trainer v2 (v2.1.0, what Kubeflow 1.11 and 26.03 ship) in the deploy tests: what its API server
side and its admission webhook refuse in a TrainJob, and the pod a TrainJob becomes.

No Trainer, JobSet or Kubernetes runs here. Each rule below is read from kubeflow/trainer at tag v2.1.0
(commit 73c9bece741c) and cites its file and function; the schemas are copies (schemas/README.md).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import yaml
from deploytools import DNS_1035_LABEL, NAMESPACE, crd_schema_problems, sample_pytorchjob

SCHEMAS = Path(__file__).resolve().parent / "schemas"
TRAINJOB_SCHEMA = SCHEMAS / "trainer.kubeflow.org_trainjobs.v1alpha1.yaml"
RUNTIME_SCHEMA = SCHEMAS / "trainer.kubeflow.org_clustertrainingruntimes.v1alpha1.yaml"
TORCH_DISTRIBUTED = SCHEMAS / "torch-distributed.clustertrainingruntime.yaml"

GROUP = "trainer.kubeflow.org"
# The CRD's CEL rule on spec.managedBy (trainjob_types.go, TrainJobSpec.ManagedBy).
MANAGED_BY = ("trainer.kubeflow.org/trainjob-controller", "kueue.x-k8s.io/multikueue")
# Runtimes the webhook knows (pkg/runtime/core/registry.go: TrainingRuntime and ClusterTrainingRuntime),
# keyed as runtime.RuntimeRefToRuntimeRegistryKey spells them (GroupKind.String()).
RUNTIME_KEYS = (f"ClusterTrainingRuntime.{GROUP}", f"TrainingRuntime.{GROUP}")
# pkg/constants/constants.go: TorchRunReservedEnvNames; the containers whose env only Trainer's own APIs set.
TORCHRUN_RESERVED_ENV = ("PET_MASTER_ADDR", "PET_MASTER_PORT", "PET_NNODES", "PET_NODE_RANK", "PET_NPROC_PER_NODE")
RESERVED_CONTAINERS = ("dataset-initializer", "model-initializer", "node")
TRAINER_PORT = 29500  # constants.ContainerTrainerPort
JOB_COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"  # constants.JobCompletionIndexFieldPath


def torch_distributed() -> dict:
    """Trainer's torch-distributed ClusterTrainingRuntime, as v2.1.0 ships it."""
    return yaml.safe_load(TORCH_DISTRIBUTED.read_text())


def sample_trainjob(phase: str = "personalization", **settings) -> dict:
    """The TrainJob the launcher task renders for deploytools.sample_pytorchjob's run (same inputs, api=trainjob)."""
    return sample_pytorchjob(phase, api="trainjob", **settings)


def trainjob_problems(doc: dict) -> list[str]:
    """What the API server refuses in a TrainJob create: the CRD schema (closed, list-map keys unique) and
    the CRD's CEL rules a create can break (trainjob_types.go: the name is an RFC 1035 label of at most 63
    characters; managedBy one of two values). Trainer's webhook comes after: `webhook_denial`."""
    problems = crd_schema_problems(TRAINJOB_SCHEMA, doc)
    if doc.get("apiVersion") != f"{GROUP}/v1alpha1" or doc.get("kind") != "TrainJob":
        problems.append("not a trainer.kubeflow.org/v1alpha1 TrainJob")
    name = (doc.get("metadata") or {}).get("name", "")
    if not DNS_1035_LABEL.match(name):
        problems.append("metadata.name must match RFC 1035 DNS label format")
    if len(name) > 63:
        problems.append("metadata.name must be no more than 63 characters")
    managed = (doc.get("spec") or {}).get("managedBy")
    if managed is not None and managed not in MANAGED_BY:
        problems.append("spec.managedBy: ManagedBy must be trainer.kubeflow.org/trainjob-controller or kueue.x-k8s.io/multikueue if set")
    return problems


def runtime_problems(doc: dict) -> list[str]:
    """A ClusterTrainingRuntime against its CRD schema (closed; its pod templates are cut, see the schema's header)."""
    problems = crd_schema_problems(RUNTIME_SCHEMA, doc)
    if doc.get("apiVersion") != f"{GROUP}/v1alpha1" or doc.get("kind") != "ClusterTrainingRuntime":
        problems.append("not a trainer.kubeflow.org/v1alpha1 ClusterTrainingRuntime")
    return problems


def _invalid(path: str, value, detail: str) -> str:
    """A field.Invalid error as k8s.io/apimachinery's field.Error words it (the value as JSON here)."""
    return f"{path}: Invalid value: {json.dumps(value, separators=(',', ':'))}: {detail}"


def _torch_errors(job: dict, runtime: dict) -> list[str]:
    """pkg/runtime/framework/plugins/torch/torch.go, Torch.Validate: only for a torch runtime and a TrainJob
    that sets numProcPerNode: a string must be auto, cpu or gpu; trainer.env must not set torchrun's PET_ names."""
    trainer = job["spec"].get("trainer") or {}
    if "torch" not in (runtime["spec"].get("mlPolicy") or {}) or trainer.get("numProcPerNode") is None:
        return []
    errors = []
    procs = trainer["numProcPerNode"]
    if isinstance(procs, str) and procs not in ("auto", "cpu", "gpu"):
        errors.append(_invalid("spec.trainer.numProcPerNode", procs, "must have an int value or [auto cpu gpu]"))
    reserved = sorted({e["name"] for e in trainer.get("env") or []} & set(TORCHRUN_RESERVED_ENV))
    if reserved:
        errors.append(_invalid("spec.trainer.env", trainer["env"], f"must not have reserved envs, invalid envs configured: [{' '.join(reserved)}]"))
    return errors


def _jobset_errors(job: dict, runtime: dict) -> list[str]:
    """pkg/runtime/framework/plugins/jobset/jobset.go, JobSet.Validate: each podTemplateOverride targets a
    replicated Job of the runtime, overrides only containers that Job has, and sets no env on node or the
    initializers. (Its initializer checks need spec.initializer, which fedpipe never sets.)"""
    names = {}
    for rjob in runtime["spec"]["template"]["spec"]["replicatedJobs"]:
        pod = rjob["template"]["spec"]["template"]["spec"]
        names[rjob["name"]] = {c["name"] for c in pod.get("initContainers", []) + pod.get("containers", [])}
    overrides = job["spec"].get("podTemplateOverrides") or []
    errors = []
    for override in overrides:
        for target in override["targetJobs"]:
            containers = names.get(target["name"], set())
            if target["name"] not in names:
                errors.append(_invalid("spec.podTemplateOverrides", overrides, "must not have targetJob that doesn't exist in the runtime job template"))
            for group, word in (("initContainers", "initContainer"), ("containers", "container")):
                for container in (override.get("spec") or {}).get(group) or []:
                    if container["name"] not in containers:
                        errors.append(_invalid("spec.podTemplateOverrides", overrides,
                                               f"must not have {word} that doesn't exist in the runtime job {target['name']}"))
                    elif group == "containers" and container.get("env") and container["name"] in RESERVED_CONTAINERS:
                        errors.append(_invalid("spec.podTemplateOverrides", overrides,
                                               "must not have envs for the dataset-initializer, model-initializer, node containers"))
    return errors


def webhook_denial(job: dict, runtimes: dict[str, dict]) -> str | None:
    """Why Trainer's validating webhook denies creating `job`, in its words, or None when it admits it.

    pkg/webhooks/trainjob_webhook.go, ValidateCreate: the runtimeRef's kind and group must be a runtime
    Trainer knows ("unsupported runtime: ..."); pkg/runtime/core/clustertrainingruntime.go, ValidateObjects:
    the ClusterTrainingRuntime must exist, then the plugins validate (`_torch_errors`, `_jobset_errors`);
    the errors are joined as field.ErrorList.ToAggregate does. `runtimes`: the cluster's
    ClusterTrainingRuntimes by name (the runtimeRef's apiGroup and kind default as the CRD defaults them).
    """
    ref = job["spec"]["runtimeRef"]
    key = f"{ref.get('kind', 'ClusterTrainingRuntime')}.{ref.get('apiGroup', GROUP)}"
    if key not in RUNTIME_KEYS:
        return f"unsupported runtime: {key}"
    runtime = runtimes.get(ref["name"]) if key == RUNTIME_KEYS[0] else None
    if runtime is None:
        if key == RUNTIME_KEYS[0]:
            return _invalid("spec.RuntimeRef", ref, f'clustertrainingruntimes.{GROUP} "{ref["name"]}" not found: '
                                                    "specified clusterTrainingRuntime must be created before the TrainJob is created")
        return _invalid("spec.runtimeRef", ref, f'trainingruntimes.{GROUP} "{ref["name"]}" not found: '
                                                "specified trainingRuntime must be created before the TrainJob is created")
    errors = _torch_errors(job, runtime) + _jobset_errors(job, runtime)
    if not errors:
        return None
    return errors[0] if len(errors) == 1 else f"[{', '.join(errors)}]"


# -- the pod a TrainJob becomes -------------------------------------------------------------------

MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "volumeMounts": "mountPath", "env": "name"}


def _strategic_merge(base, patch):
    """A strategic merge patch of a pod template, for the fields a podTemplateOverride carries: maps merge,
    the lists core/v1 declares with a patch merge key merge by it (volumes and containers by name,
    volumeMounts by mountPath), any other list (tolerations) is replaced."""
    if not (isinstance(base, dict) and isinstance(patch, dict)):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if key in MERGE_KEYS and isinstance(value, list):
            merged = {item[MERGE_KEYS[key]]: item for item in out.get(key) or []}
            for item in value:
                name = item[MERGE_KEYS[key]]
                merged[name] = _strategic_merge(merged[name], item) if name in merged else copy.deepcopy(item)
            out[key] = list(merged.values())
        else:
            out[key] = _strategic_merge(out.get(key), value) if isinstance(value, dict) else copy.deepcopy(value)
    return out


def _upsert(items: list[dict], new: list[dict], key: str = "name") -> list[dict]:
    """pkg/apply/apply.go, UpsertEnvVars / UpsertPort: replace the item with the same key, else append."""
    out = list(items)
    for item in new:
        same = [i for i, old in enumerate(out) if old.get(key) == item.get(key)]
        if same:
            out[same[0]] = item
        else:
            out.append(item)
    return out


def _torch_env(job: dict, runtime: dict) -> list[dict]:
    """The env the torch plugin adds to the `node` container (torch.go, EnforceMLPolicy), for an int numProcPerNode."""
    trainer, name = job["spec"]["trainer"], job["metadata"]["name"]
    nodes = trainer.get("numNodes") or (runtime["spec"].get("mlPolicy") or {}).get("numNodes") or 1
    procs = trainer.get("numProcPerNode")
    assert isinstance(procs, int), "only an int numProcPerNode is modelled here (fedpipe sets one)"
    return [
        {"name": "PET_NNODES", "value": str(nodes)},
        {"name": "PET_NPROC_PER_NODE", "value": str(procs)},
        {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": JOB_COMPLETION_INDEX}}},
        {"name": "PET_MASTER_ADDR", "value": f"{name}-node-0-0.{name}"},
        {"name": "PET_MASTER_PORT", "value": str(TRAINER_PORT)},
    ]


def trainer_pod_template(job: dict, runtime: dict) -> dict:
    """The pod template of the trainer Job (`node`) that Trainer v2.1.0 builds from a TrainJob and its runtime:

    1. the runtime's `node` pod template with each podTemplateOverride that targets it merged in
       (pkg/runtime/core/trainingruntime.go, newRuntimeInfo -> mergePodTemplateOverrides);
    2. on the `node` container, spec.trainer.env then the torch plugin's PET_* env and port 29500
       (plugins/torch/torch.go, EnforceMLPolicy; plugins/jobset/jobset.go, Build upserts them);
    3. spec.trainer's image, command, args and resourcesPerNode (plugins/jobset/builder.go, Builder.Trainer);
    4. restartPolicy OnFailure, JobSet's default for a replicated Job's pods (JobSet v0.10.1
       pkg/webhooks/jobset_webhook.go, Default).
    What the JobSet and Job controllers add later (their labels, the hostname) is left out.
    """
    (rjob,) = [r for r in runtime["spec"]["template"]["spec"]["replicatedJobs"] if r["name"] == "node"]
    template = copy.deepcopy(rjob["template"]["spec"]["template"])
    for override in job["spec"].get("podTemplateOverrides") or []:
        if any(t["name"] == "node" for t in override["targetJobs"]):
            patch = {"metadata": {k: v for k, v in (override.get("metadata") or {}).items() if k in ("labels", "annotations")},
                     "spec": override.get("spec") or {}}
            template = _strategic_merge(template, patch)
    trainer = job["spec"]["trainer"]
    (node,) = [c for c in template["spec"]["containers"] if c["name"] == "node"]
    node["env"] = _upsert(_upsert(node.get("env") or [], trainer.get("env") or []), _torch_env(job, runtime))
    node["ports"] = _upsert(node.get("ports") or [], [{"containerPort": TRAINER_PORT}], key="containerPort")
    node.update({k: trainer[k] for k in ("image", "command", "args") if k in trainer})
    if trainer.get("resourcesPerNode"):
        node["resources"] = trainer["resourcesPerNode"]
    template["spec"].setdefault("restartPolicy", "OnFailure")
    return template


def as_pod_template(job: dict, template: dict) -> dict:
    """A pod template as a core/v1 PodTemplate document, for kubernetes-validate."""
    meta = job["metadata"]
    return {"apiVersion": "v1", "kind": "PodTemplate",
            "metadata": {"name": f"{meta['name']}-node", "namespace": meta.get("namespace", NAMESPACE)}, "template": template}
