"""Kueue's queue on fedpipe's GPU work (`--kueue-queue`), read from sigs.k8s.io/kueue at tag v0.19.2 (commit
8eab68778f): the label is `kueue.x-k8s.io/queue-name` (pkg/controller/constants/constants.go QueueLabel) on the
object of an integration Kueue manages (pkg/controller/jobs/: `pod`, `batch/job`, `trainer.kubeflow.org/trainjob`
on in the default controller_manager_config.yaml; `kubeflow.org/pytorchjob` there but commented out), and Kueue's
webhook refuses a value that is not a DNS-1123 subdomain (jobframework/validation.go ValidateQueueName). A job's
pods are never labelled (FindAncestorJobManagedByKueue: the job is the workload). No Kueue ran here: the objects
are checked against what those rules and the CRD schemas (tests/deploy/schemas) say."""

from __future__ import annotations

import random

import pytest
import yaml
from deploytools import sample_pytorchjob, validate_pytorchjob
from kfp_backend import flat_tasks
from trainjobtools import sample_trainjob, trainjob_problems

from fedpipe.errors import ConfigError
from fedpipe.k8s.phasejob import KUEUE_QUEUE_LABEL, PhaseJob
from fedpipe.pipelines.builder import DeployOptions, compile_pipeline, method_pipeline
from fedpipe.run.config import load_config

QUEUE = "team-a-gpus"


def _compiled(tmp_path, options: DeployOptions, method: str = "superfed_mm") -> tuple[dict, dict]:
    path = compile_pipeline(method_pipeline(load_config(None, [f"method.name={method}"]), options), tmp_path / "p.yaml")
    spec, platform = yaml.safe_load_all(path.read_text())
    return spec, platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


def test_the_label_is_kueues():
    assert KUEUE_QUEUE_LABEL == "kueue.x-k8s.io/queue-name"  # constants.go QueueLabel at v0.19.2


def test_only_the_gpu_tasks_pods_wait_in_the_queue_and_every_backend_takes_the_label(tmp_path):
    """The training tasks' pods get the label (Kueue's pod integration gates each until admitted); the CPU steps
    do not: a config or evaluate task held in a GPU queue would wait for GPUs it never uses."""
    from kfp_backend import KNOWN_FIELDS, run_pipeline, unknown_platform_fields, unresolved

    spec, executors = _compiled(tmp_path, DeployOptions(kueue_queue=QUEUE))
    queued = sorted(label for label, config in executors.items() if config["podMetadata"]["labels"].get(KUEUE_QUEUE_LABEL) == QUEUE)
    gpu = sorted(label for label, e in spec["deploymentSpec"]["executors"].items() if e["container"].get("resources", {}).get("accelerator"))
    assert queued == gpu == ["exec-train-phase", "exec-train-phase-2"]  # superfed_mm's two phases
    for config in executors.values():
        assert all(not unknown_platform_fields(config, version) for version in KNOWN_FIELDS)
    assert all(not unresolved(t.parameters) for t in run_pipeline(spec, {}, "2.17.0", random.Random(0)).values())
    _, plain = _compiled(tmp_path, DeployOptions())
    assert not any(KUEUE_QUEUE_LABEL in config["podMetadata"]["labels"] for config in plain.values())


def test_a_distributed_phase_queues_its_job_not_the_launcher(tmp_path):
    """With a distributed phase, the job object (PyTorchJob / TrainJob) carries the label and the small
    launcher task does not: a launcher admitted into the GPU queue would hold quota while it waits for its
    own job behind it."""
    spec, executors = _compiled(tmp_path, DeployOptions(kueue_queue=QUEUE, distributed=(PhaseJob("personalization", api="trainjob"),)))
    assert KUEUE_QUEUE_LABEL not in executors["exec-launch-phase-job"]["podMetadata"]["labels"]
    job = flat_tasks(spec)["launch-phase-job"]["inputs"]["parameters"]["job"]["runtimeValue"]["constant"]
    assert job["queue"] == QUEUE and PhaseJob.from_dict(job).queue == QUEUE


@pytest.mark.parametrize("api", ["pytorchjob", "trainjob"])
def test_the_jobs_carry_the_queue_on_the_object_and_stay_valid(api):
    doc = sample_pytorchjob(api=api, queue=QUEUE) if api == "pytorchjob" else sample_trainjob(queue=QUEUE)
    assert doc["metadata"]["labels"][KUEUE_QUEUE_LABEL] == QUEUE
    if api == "pytorchjob":
        validate_pytorchjob(doc)
        templates = [r["template"] for r in doc["spec"]["pytorchReplicaSpecs"].values()]
    else:
        assert trainjob_problems(doc) == []
        templates = [o["spec"] for o in doc["spec"].get("podTemplateOverrides", [])]
    assert KUEUE_QUEUE_LABEL not in yaml.safe_dump(templates)  # the pods belong to the job's workload
    assert KUEUE_QUEUE_LABEL not in sample_pytorchjob(api=api)["metadata"]["labels"]


def test_a_katib_trial_job_carries_the_queue():
    from fedpipe.k8s.katib import katib_experiment
    from fedpipe.search_space import LogUniform

    experiment = katib_experiment("s", "fedavg", {"train.lr": LogUniform(1e-3, 1e-1)}, namespace="ns", image="i", max_trials=2,
                                  parallel_trials=1, seed=0, study_configmap="cm", queue=QUEUE)
    job = experiment["spec"]["trialTemplate"]["trialSpec"]
    assert job["kind"] == "Job" and job["metadata"]["labels"] == {KUEUE_QUEUE_LABEL: QUEUE}


@pytest.mark.parametrize("name", ["GPU", "a..b", "-gpu", "gpu_1", "a" * 64, "team a"])
def test_a_queue_name_kueue_would_refuse_is_refused_before_anything_is_compiled(name):
    with pytest.raises(ConfigError, match="kueue-queue"):
        DeployOptions(kueue_queue=name)
    with pytest.raises(ConfigError, match="Kueue LocalQueue"):
        PhaseJob("personalization", queue=name)


def test_the_chart_passes_the_queue_to_the_registration_job_and_native_mode_applies_it(render_chart, helm, tmp_path):
    """training.kueueQueue: `--kueue-queue` on `fedpipe register` (the Job compiles it in), or, in native mode,
    the label put on the precompiled pipeline's GPU executors the way the compiler does; a name Kueue's webhook
    would refuse is refused by the values schema."""
    from deploytools import only, schema_rejection

    job = only(render_chart("--set", f"training.kueueQueue={QUEUE}"), "Job", "-register")
    assert f"--kueue-queue={QUEUE}" in job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(a.startswith("--kueue-queue") for a in only(render_chart(), "Job", "-register")["spec"]["template"]["spec"]["containers"][0]["args"])
    native = ["--set", "nativeMode.enabled=true", "--set", "register.enabled=false", "--set", "signing.enabled=false"]
    (version,) = [d for d in render_chart(*native, "--set", f"training.kueueQueue={QUEUE}") if d["kind"] == "PipelineVersion"]
    executors = version["spec"]["platformSpec"]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    gpu = {label for label, e in version["spec"]["pipelineSpec"]["deploymentSpec"]["executors"].items() if e["container"]["resources"].get("accelerator")}
    assert gpu and {label for label, e in executors.items() if e["podMetadata"]["labels"].get(KUEUE_QUEUE_LABEL) == QUEUE} == gpu
    assert "kueueQueue" in schema_rejection(helm, tmp_path, {"training": {"kueueQueue": "GPU_queue"}})
