"""A phase as a Kubeflow Trainer v2 TrainJob: the manifest the launcher renders, the launcher's life of a
TrainJob against the Kubernetes API stand-in, the CLI flag and the chart's choice of API.

No cluster, Trainer, JobSet or Training Operator runs here. What a real one does is read from
kubeflow/trainer at tag v2.1.0 (what Kubeflow 1.11.0 and 26.03 ship; commit 73c9bece741c) and from
kubernetes-sigs/jobset v0.10.1 (its go.mod's JobSet), and encoded in tests/deploy/trainjobtools.py (each
rule citing its file and function) and tests/k8s_api_standin.py: the TrainJob CRD schema (a copy,
schemas/README.md) with its CEL rules, Trainer's admission webhook, the pod a TrainJob becomes, and the
statuses Trainer sets. The stand-in is NOT Kubernetes: nothing is scheduled, no pod runs; a job's status
is what a test scripts.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import yaml
from deploytools import CHART, DNS_1035_LABEL, NAMESPACE, RELEASE, only, run_tool, run_training_container, sample_pytorchjob
from k8s_api_standin import KubernetesApiStandIn, jobset_pod, trainjob_complete, trainjob_failed, trainjob_running
from kfp_backend import flat_tasks
from trainjobtools import (
    TRAINER_PORT,
    as_pod_template,
    runtime_problems,
    sample_trainjob,
    torch_distributed,
    trainer_pod_template,
    trainjob_problems,
    webhook_denial,
)

from fedpipe.errors import ConfigError
from fedpipe.k8s.launcher import RBAC_RULES, TRAINJOB_RBAC_RULES, PhaseJobError, PhaseJobLauncher, PhaseJobTimeout
from fedpipe.k8s.phasejob import CONFIG_ANNOTATION, CONFIG_PATH, PhaseJob, labels
from fedpipe.k8s.trainjob import train_job_name
from fedpipe.run.config import load_config

RUNTIMES = {"torch-distributed": torch_distributed()}
SHAPES = {
    "cpu-2-nodes": {},
    "gpu-4-nodes-2-procs": {"nodes": 4, "processes_per_node": 2, "gpus_per_process": 1},
    "one-node": {"nodes": 1, "processes_per_node": 4, "cleanup": "never"},
    "pinned-to-gpu-nodes": {"nodes": 2, "gpus_per_process": 1, "resources": {
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "cpu_request": "8", "cpu_limit": "16", "memory_request": "64Gi", "memory_limit": "96Gi"}},
}  # fmt: skip


def node_pod(job: dict) -> dict:
    """The pod template of the job's trainer Job, as Trainer v2.1.0 builds it on torch-distributed."""
    return trainer_pod_template(job, torch_distributed())


# -- the manifest ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", list(SHAPES))
def test_rendered_trainjob_validates(validate_k8s, shape: str):
    job = sample_trainjob(**SHAPES[shape])
    assert trainjob_problems(job) == [], "the API server (CRD schema, CEL) would refuse it"
    assert webhook_denial(job, RUNTIMES) is None, "Trainer's webhook would refuse it"
    # The pod Trainer makes of it, as a PodTemplate: kubernetes-validate --strict, Kubernetes 1.30.
    validate_k8s([as_pod_template(job, node_pod(job))])


def test_the_copied_runtime_is_a_valid_runtime_and_trainers_torch_one():
    runtime = torch_distributed()
    assert runtime_problems(runtime) == []
    broken = copy.deepcopy(runtime)
    broken["spec"]["mlPolicy"]["torch"]["numProcsPerNode"] = "auto"  # misspelt: the schema copy refuses it
    assert any("numProcsPerNode" in p for p in runtime_problems(broken))
    # What trainjob.py relies on: a torch policy, a replicated Job `node` marked as the trainer, a container `node`.
    assert runtime["metadata"]["name"] == "torch-distributed" and "torch" in runtime["spec"]["mlPolicy"]
    (rjob,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert rjob["name"] == "node" and rjob["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    assert [c["name"] for c in rjob["template"]["spec"]["template"]["spec"]["containers"]] == ["node"]


@pytest.mark.parametrize(
    "mistake, words",
    [
        (lambda j: j["spec"]["trainer"].update(numProcsPerNode=2), "numProcsPerNode"),  # misspelt: the API server would drop it
        (lambda j: j["spec"]["trainer"].update(numNodes="2"), "numNodes"),
        (lambda j: j["spec"]["trainer"]["env"].append({"name": "HOME", "value": "/home"}), "Duplicate value: ['HOME']"),
        (lambda j: j["spec"]["podTemplateOverrides"][0]["spec"]["volumes"].append({"name": "tmp", "emptyDir": {}}), "Duplicate"),
        (lambda j: j["metadata"].update(name="Fedpipe_Job"), "RFC 1035"),
        (lambda j: j["metadata"].update(name="f" * 64), "no more than 63"),
        (lambda j: j["spec"].update(managedBy="fedpipe"), "ManagedBy must be"),
        (lambda j: j["spec"].pop("runtimeRef"), "runtimeRef"),
        (lambda j: j["spec"]["podTemplateOverrides"][0]["spec"].update(securityContext={"runAsNonRoot": True}), "securityContext"),
    ],
    ids=["misspelt-field", "wrong-type", "duplicate-env", "duplicate-volume", "bad-name", "long-name", "managed-by",
         "no-runtime-ref", "no-security-context-override"],
)
def test_the_validation_catches_what_the_api_server_would_refuse(mistake, words: str):
    job = sample_trainjob()
    assert trainjob_problems(job) == []
    broken = copy.deepcopy(job)
    mistake(broken)
    problems = trainjob_problems(broken)
    assert problems and any(words in p for p in problems), problems


@pytest.mark.parametrize(
    "mistake, runtimes, words",
    [
        (lambda j: None, {}, 'clustertrainingruntimes.trainer.kubeflow.org "torch-distributed" not found'),
        (lambda j: j["spec"]["runtimeRef"].update(kind="Runtime"), RUNTIMES, "unsupported runtime: Runtime.trainer.kubeflow.org"),
        (lambda j: j["spec"]["podTemplateOverrides"][0]["targetJobs"][0].update(name="trainer"), RUNTIMES,
         "must not have targetJob that doesn't exist"),
        (lambda j: j["spec"]["podTemplateOverrides"][0]["spec"]["containers"][0].update(name="pytorch"), RUNTIMES,
         "must not have container that doesn't exist in the runtime job node"),
        (lambda j: j["spec"]["podTemplateOverrides"][0]["spec"]["containers"][0].update(env=[{"name": "A", "value": "b"}]),
         RUNTIMES, "must not have envs for the dataset-initializer, model-initializer, node containers"),
        (lambda j: j["spec"]["trainer"]["env"].append({"name": "PET_MASTER_ADDR", "value": "x"}), RUNTIMES,
         "must not have reserved envs, invalid envs configured: [PET_MASTER_ADDR]"),
        (lambda j: j["spec"]["trainer"].update(numProcPerNode="many"), RUNTIMES, "must have an int value or [auto cpu gpu]"),
    ],
    ids=["no-runtime", "unknown-runtime-kind", "unknown-target-job", "unknown-container", "env-on-node", "reserved-env",
         "procs-word"],
)
def test_the_webhook_model_denies_what_trainers_webhook_denies(mistake, runtimes: dict, words: str):
    job = sample_trainjob()
    assert webhook_denial(job, RUNTIMES) is None
    broken = copy.deepcopy(job)
    mistake(broken)
    assert trainjob_problems(broken) == [], "the schema passes it: only the webhook refuses it"
    denial = webhook_denial(broken, runtimes)
    assert denial and words in denial, denial


def test_each_pod_runs_torchrun_with_trainers_rendezvous():
    job = sample_trainjob(nodes=4, processes_per_node=2, gpus_per_process=1)
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (4, 2)
    assert job["spec"]["runtimeRef"] == {"name": "torch-distributed", "apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime"}
    (container,) = node_pod(job)["spec"]["containers"]
    assert container["command"] == ["torchrun"]
    assert container["args"] == [
        "--nnodes=4", "--nproc-per-node=2", "--node-rank=$(PET_NODE_RANK)", "--master-addr=$(PET_MASTER_ADDR)",
        "--master-port=$(PET_MASTER_PORT)", "-m", "fedpipe.cli", "train", "--phase", "personalization", "--config", CONFIG_PATH,
    ]  # fmt: skip
    env = {e["name"]: e for e in container["env"]}
    # Kubernetes leaves a $(VAR) it cannot resolve as it is: every one must be in the pod's env.
    assert set(re.findall(r"\$\((\w+)\)", " ".join(container["args"]))) <= set(env)
    # The explicit arguments say what Trainer's env says (torchrun would read PET_* by itself too).
    assert env["PET_NNODES"]["value"] == "4" and env["PET_NPROC_PER_NODE"]["value"] == "2"
    assert env["PET_MASTER_PORT"]["value"] == str(TRAINER_PORT) and {"containerPort": TRAINER_PORT} in container["ports"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2  # 2 processes x 1 GPU
    cpu = node_pod(sample_trainjob())["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in cpu["resources"]["limits"], "a CPU job asks for a GPU"


def test_a_trainjob_and_a_pytorchjob_of_the_same_phase_run_the_same_container():
    """Same inputs, same training container: image, env (credentials by reference), resources, mounts,
    volumes, placement; only the rendezvous variables differ (each controller's own)."""
    shape = SHAPES["pinned-to-gpu-nodes"]
    pytorch = sample_pytorchjob(**shape)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    pod = node_pod(sample_trainjob(**shape))
    (theirs,), (ours,) = pytorch["spec"]["containers"], pod["spec"]["containers"]
    for key in ("image", "command", "resources", "volumeMounts"):
        assert ours[key] == theirs[key], key
    assert [e for e in ours["env"] if not e["name"].startswith("PET_")] == theirs["env"]
    assert [a.replace("PET_MASTER_", "MASTER_") for a in ours["args"]] == theirs["args"]
    for key in ("volumes", "nodeSelector", "tolerations"):
        assert pod["spec"][key] == pytorch["spec"][key], key
    assert pod["metadata"] == pytorch["metadata"]


def test_pods_get_the_run_config_as_a_file_and_credentials_only_from_the_secret(tmp_path):
    job = sample_trainjob()
    pod = node_pod(job)
    (container,) = pod["spec"]["containers"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mounts["/etc/fedpipe"]["name"])
    (item,) = volume["downwardAPI"]["items"]
    assert item["fieldRef"]["fieldPath"] == f"metadata.annotations['{CONFIG_ANNOTATION}']" and item["path"] == "config.yaml"
    path = tmp_path / "config.yaml"
    path.write_text(pod["metadata"]["annotations"][CONFIG_ANNOTATION])
    cfg = load_config(path)  # fedpipe's own validation, every field checked
    assert cfg.run.id == job["metadata"]["annotations"]["fedpipe.io/run-id"] and cfg.run.store.startswith("s3://")
    env = {e["name"]: e for e in container["env"]}
    for var, key in (("AWS_ACCESS_KEY_ID", "accesskey"), ("AWS_SECRET_ACCESS_KEY", "secretkey")):
        assert env[var] == {"name": var, "valueFrom": {"secretKeyRef": {"name": "mlpipeline-minio-artifact", "key": key}}}
    assert pod["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
    assert mounts["/dev/shm"]["name"] == "dshm" and mounts["/tmp"]["name"] == "tmp"


def test_job_names_keep_jobsets_pod_names_within_63_characters():
    """JobSet names its pods <JobSet>-<replicated job>-<job index>-<pod index>-<5 random> and refuses a JobSet
    whose longest pod name is no DNS-1035 label of at most 63 characters (kubernetes-sigs/jobset v0.10.1,
    pkg/webhooks/jobset_webhook.go, ValidateCreate; pkg/util/placement/placement.go, GenPodName); the JobSet
    is named after the TrainJob (kubeflow/trainer v2.1.0, plugins/jobset/jobset.go, Build)."""
    long_phase = "a_very_long_phase_name_that_goes_on_and_on_and_on"
    for nodes in (1, 2, 10, 1000):
        job = PhaseJob(long_phase, nodes=nodes, api="trainjob")
        name = train_job_name("x" * 200, long_phase, job)
        longest_pod = f"{name}-node-0-{nodes - 1}-abcde"
        assert len(longest_pod) <= 63 and DNS_1035_LABEL.match(longest_pod), (nodes, longest_pod)
    assert train_job_name("run-a", "federation", PhaseJob("federation", api="trainjob")).startswith("fedpipe-federation-")
    assert train_job_name("run-a", "federation", PhaseJob("federation")) != train_job_name("run-b", "federation", PhaseJob("federation"))


@pytest.mark.parametrize("setting", [{"backoff_limit": 6}, {"clean_pod_policy": "All"}, {"master_port": 29500}])
def test_pytorchjob_only_settings_are_refused_for_a_trainjob(setting: dict):
    (name,) = setting
    PhaseJob("personalization", **setting)  # fine for a PyTorchJob
    with pytest.raises(ConfigError, match=rf"{name} only apply to a PyTorchJob.*use api=pytorchjob"):
        PhaseJob("personalization", api="trainjob", **setting)


def test_unknown_api_and_runtime_names_are_refused():
    with pytest.raises(ConfigError, match="api must be one of pytorchjob, trainjob, not 'tfjob'"):
        PhaseJob("personalization", api="tfjob")
    with pytest.raises(ConfigError, match="runtime must name a ClusterTrainingRuntime"):
        PhaseJob("personalization", api="trainjob", runtime="Torch Distributed")
    job = PhaseJob("personalization", api="trainjob", runtime="torch-distributed-hardened")
    assert PhaseJob.from_dict(json.loads(json.dumps(job.as_dict()))) == job
    assert sample_trainjob(runtime="torch-distributed-hardened")["spec"]["runtimeRef"]["name"] == "torch-distributed-hardened"


@pytest.mark.slow
def test_the_pods_command_runs_under_torchrun(tmp_path):
    """The `node` pod's command with the env Trainer sets (PET_NODE_RANK: the Job completion index, 0 for the
    first pod; the master's DNS name and port 29500 replaced by loopback and a free port), run here for one
    node and one process: torchrun starts, `-m fedpipe.cli train` runs the phase, its state lands in the store."""
    from runs import SMALL
    from services import free_port

    from fedpipe.k8s.launcher import job_manifest
    from fedpipe.k8s.phasejob import PodResources, StorageAccess

    store = tmp_path / "store"
    cfg = load_config(None, [*SMALL, "method.name=fedavg", "train.rounds=1", "partition.num_clients=4", f"run.store={store}",
                             "run.id=torchrun-trainjob"])
    job = job_manifest(run_id=cfg.run_id(), phase="federation", config_yaml=cfg.to_yaml(), namespace=NAMESPACE, image="img",
                       job=PhaseJob("federation", nodes=1, api="trainjob"), resources=PodResources(),
                       storage=StorageAccess(s3_endpoint="http://unused:9000", s3_secret="s"))
    pod = node_pod(job)
    (container,) = pod["spec"]["containers"]
    trainer_env = {e["name"]: e.get("value", "0") for e in container["env"] if e["name"].startswith("PET_")}
    trainer_env.update(PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=str(free_port()))
    done = run_training_container(container, pod["metadata"]["annotations"][CONFIG_ANNOTATION], trainer_env, tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert (store / "torchrun-trainjob" / "phases" / "federation" / "final.pt").is_file()


# -- the launcher against the API stand-in --------------------------------------------------------

NS = "team-a"
FAST = 0.02  # seconds between polls
TRAINJOBS = f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{NS}/trainjobs"


@pytest.fixture
def k8s(tmp_path, monkeypatch):
    """The stand-in with Trainer's torch-distributed runtime installed, the TrainJob CRD checks as the API
    server's own validation and Trainer's webhook model as its validating webhook."""
    for name in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "FEDPIPE_NAMESPACE"):
        monkeypatch.delenv(name, raising=False)
    standin = KubernetesApiStandIn(admit=lambda job: "; ".join(trainjob_problems(job)) or None, webhook=webhook_denial,
                                   runtimes=RUNTIMES)
    with standin as server:
        monkeypatch.setenv("KUBECONFIG", str(server.kubeconfig(tmp_path, namespace=NS)))
        yield server


def trainjob(**settings) -> dict:
    manifest = sample_trainjob(**settings)
    manifest["metadata"]["namespace"] = NS
    return manifest


def launch(manifest: dict, *, wait: float = 10.0, cleanup: str = "on-success"):
    return PhaseJobLauncher(poll_seconds=FAST).run(manifest, wait_seconds=wait, cleanup=cleanup)


def test_the_standins_statuses_are_trainers_shape():
    """What the tests script is what Trainer may write: each status passes the TrainJob CRD's status schema."""
    for status in (trainjob_running(), trainjob_complete(), trainjob_failed()):
        assert trainjob_problems({**sample_trainjob(), "status": status}) == [], status
    assert trainjob_problems({**sample_trainjob(), "status": {"conditions": [{"type": "Complete", "status": "True"}]}})


def test_a_completing_trainjob_is_created_awaited_and_deleted(k8s):
    manifest = trainjob()
    name = manifest["metadata"]["name"]
    k8s.script(name, [{}, trainjob_running(), trainjob_complete()])
    done = launch(manifest)
    assert done.name == name and done.namespace == NS and done.deleted
    assert done.status["conditions"][0]["type"] == "Complete"
    (create,) = k8s.requests("POST")
    assert create.path == TRAINJOBS and create.status == 201
    assert create.body == manifest, "the job on the wire is the rendered manifest"
    gets = k8s.requests("GET")
    assert len(gets) == 3 and {g.path for g in gets} == {f"{TRAINJOBS}/{name}"}
    (delete,) = k8s.requests("DELETE")
    assert delete.path == f"{TRAINJOBS}/{name}" and delete.body["propagationPolicy"] == "Foreground"


def test_a_failed_trainjob_names_the_job_the_reason_and_the_failing_pod(k8s):
    manifest = trainjob(nodes=3)
    name = manifest["metadata"]["name"]
    k8s.script(name, [trainjob_running(), trainjob_failed()])
    k8s.pods[name] = [
        jobset_pod(name, 0),
        jobset_pod(name, 1, restarts=3, container_state={"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
                   last_state={"terminated": {"exitCode": 137, "reason": "OOMKilled"}}),
        jobset_pod(name, 2),
    ]
    failing = k8s.pods[name][1]["metadata"]["name"]
    with pytest.raises(PhaseJobError) as caught:
        launch(manifest)
    message = str(caught.value)
    assert f"TrainJob {name} in namespace {NS} failed: FailedJobs: jobset failed due to one or more job failures" in message
    assert f"node 1 (pod {failing}): container node CrashLoopBackOff" in message and "last exit code 137 (OOMKilled)" in message
    assert f"kubectl -n {NS} logs {failing} -c node --previous" in message
    assert "node 0" not in message and "node 2" not in message, "healthy pods are not blamed"
    assert f"kept: kubectl -n {NS} describe trainjob {name}" in message and not k8s.requests("DELETE")
    (listed,) = [r for r in k8s.requests("GET") if r.path.endswith("/pods")]
    assert listed.param("labelSelector") == f"jobset.sigs.k8s.io/jobset-name={name}"


def test_a_failed_trainjob_is_deleted_when_cleanup_is_always(k8s):
    manifest = trainjob(nodes=1)
    name = manifest["metadata"]["name"]
    k8s.script(name, [trainjob_failed()])
    k8s.pods[name] = [jobset_pod(name, 0, phase="Failed", container_state={"terminated": {"exitCode": 2, "reason": "Error"}})]
    with pytest.raises(PhaseJobError, match=r"node 0 \(pod .*\): container node exited with code 2 \(Error\)") as caught:
        launch(manifest, cleanup="always")
    assert "was deleted" in str(caught.value) and len(k8s.requests("DELETE")) == 1


@pytest.mark.parametrize("cleanup", ["on-success", "never"])
def test_a_trainjob_that_never_finishes_times_out_and_is_deleted(k8s, cleanup: str):
    """A TrainJob has no deadline of its own (Trainer v2.1.0 TrainJobSpec has none): past the phase's time the
    launcher deletes it, even with cleanup never, or it would hold its GPUs on."""
    manifest = trainjob()
    name = manifest["metadata"]["name"]
    k8s.script(name, [trainjob_running()])
    with pytest.raises(PhaseJobTimeout, match=rf"TrainJob {name} in namespace {NS} did not finish.*Running \(node: 1 active, 1 ready\).*deleted") as caught:
        launch(manifest, wait=0.3, cleanup=cleanup)
    assert len(k8s.requests("DELETE")) == 1
    assert ("no deadline of its own" in str(caught.value)) == (cleanup == "never")


def test_a_retried_launcher_waits_for_its_running_trainjob_and_replaces_a_failed_one(k8s):
    running = trainjob()
    k8s.put(running, [trainjob_running(), trainjob_complete()])  # an earlier attempt created it
    launch(running)
    assert [r.status for r in k8s.requests("POST")] == [409] and not k8s.created, "no second job"
    failed = trainjob(phase="federation")
    k8s.put(failed, [trainjob_failed()])
    k8s.script(failed["metadata"]["name"], [trainjob_running(), trainjob_complete()])
    before = len(k8s.requests())
    launch(failed)
    calls = [(r.method, r.status) for r in k8s.requests()[before:] if r.method in ("POST", "DELETE")]
    assert calls == [("POST", 409), ("DELETE", 200), ("POST", 201), ("DELETE", 200)]


@pytest.mark.parametrize(
    "status, message, expected",
    [
        (404, "the server could not find the requested resource", "Install Kubeflow Trainer v2"),
        (403, 'trainjobs.trainer.kubeflow.org is forbidden: User "system:serviceaccount:team-a:pipeline-runner" cannot create resource',
         "pytorchJob.api trainjob"),
    ],
    ids=["no-trainer", "no-rbac"],
)
def test_a_trainjob_that_cannot_be_created_says_why(k8s, status, message, expected):
    k8s.fail("POST", r".*/trainjobs", status, message)
    manifest = trainjob()
    with pytest.raises(PhaseJobError) as caught:
        launch(manifest)
    assert f"Cannot create TrainJob {manifest['metadata']['name']} in namespace {NS}" in str(caught.value)
    assert expected in str(caught.value) and message in str(caught.value)


def test_a_missing_runtime_is_denied_by_trainers_webhook_and_the_message_says_what_to_do(k8s):
    k8s.runtimes.clear()  # a cluster with Trainer's controller but not its runtimes
    with pytest.raises(PhaseJobError) as caught:
        launch(trainjob())
    message = str(caught.value)
    (create,) = k8s.requests("POST")
    assert create.status == 403, "a webhook denial is a 403, not an RBAC problem"
    assert 'rejected it: admission webhook "validator.trainjob.trainer.kubeflow.org" denied the request' in message
    assert "specified clusterTrainingRuntime must be created before the TrainJob is created" in message
    assert "is not installed" in message and "--trainer-runtime" in message
    assert "service account may not" not in message


def test_a_trainjob_the_api_server_refuses_says_why(k8s):
    manifest = trainjob()
    manifest["spec"]["trainer"]["env"].append({"name": "HOME", "value": "/home"})
    with pytest.raises(PhaseJobError, match=r'rejected it: TrainJob.trainer.kubeflow.org ".*" is invalid: .*Duplicate value'):
        launch(manifest)


def test_the_launcher_makes_only_the_calls_trainjob_rbac_grants(k8s):
    first = trainjob()
    k8s.put(first, [trainjob_failed()])
    k8s.script(first["metadata"]["name"], [trainjob_running(), trainjob_failed()])
    with pytest.raises(PhaseJobError):
        launch(first, cleanup="always")
    second = trainjob(phase="federation")
    k8s.script(second["metadata"]["name"], [trainjob_complete()])
    launch(second)
    assert k8s.verbs() == {(group, resource, verb) for group, resource, verbs in TRAINJOB_RBAC_RULES for verb in verbs}


@pytest.mark.services
def test_the_launcher_task_runs_the_phase_as_a_trainjob_through_the_store(k8s, s3_env, s3_credentials, tmp_path):
    """What the pipeline's launch_phase_job task does with api=trainjob, for a method's first phase: create
    the TrainJob beside the task, wait, return the last round's metrics that rank 0 (here the stand-in)
    wrote to the store; no credential goes to the API server."""
    import uuid

    from test_pytorchjob_launcher import RESOURCES, resolved_config

    from fedpipe.components import bodies
    from fedpipe.store import open_store

    cfg, config = resolved_config(tmp_path, f"s3://fedpipe-k8s-{uuid.uuid4().hex[:10]}/runs")
    run_id, manifest = cfg.run_id(), tmp_path / "manifest.json"
    bodies.partition(str(config), str(manifest), str(tmp_path / "heatmap.html"))
    store = open_store(cfg.run.store)
    rounds = [{"round": 1, "train_loss": 0.7}, {"round": 2, "train_loss": 0.4}]

    def rank_zero_writes_the_store(job: dict) -> None:  # what the job's pods would do
        store.put(f"{run_id}/phases/federation/final.pt", b"federation's final state")
        store.put_text(f"{run_id}/report/rounds-federation.jsonl", "".join(json.dumps(r) + "\n" for r in rounds))

    k8s.on_create = rank_zero_writes_the_store
    settings = PhaseJob("federation", nodes=2, timeout_seconds=600, api="trainjob")
    name = train_job_name(run_id, "federation", settings)
    k8s.script(name, [trainjob_running(), trainjob_complete()])
    last = bodies.launch_phase_job(str(config), "federation", str(manifest), None, str(tmp_path / "state"), job=settings.as_dict(),
                                  image="ghcr.io/fedpipe/fedpipe:0.1.0-cuda", resources=RESOURCES, poll_seconds=FAST,
                                  storage={"s3_endpoint": s3_env, "s3_secret": "team-s3", "s3_secret_keys": ["ak", "sk"]})
    assert last == rounds[-1]
    (job,) = k8s.created
    assert job["kind"] == "TrainJob" and job["metadata"]["name"] == name and job["metadata"]["namespace"] == NS
    config_in_job = job["spec"]["podTemplateOverrides"][0]["metadata"]["annotations"][CONFIG_ANNOTATION]
    assert f"id: {run_id}" in config_in_job and f"store: {cfg.run.store}" in config_in_job
    env = {e["name"]: e for e in job["spec"]["trainer"]["env"]}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "team-s3", "key": "sk"}
    for request in k8s.requests():
        for credential in s3_credentials:
            assert credential.encode() not in request.raw, f"{request.method} {request.path} carries a credential"
    assert len(k8s.requests("DELETE")) == 1


def test_the_launcher_task_names_the_trainjob_when_the_store_is_a_folder(k8s, tmp_path):
    from fedpipe.components import bodies

    config = tmp_path / "config.yaml"
    config.write_text(load_config(None, ["method.name=superfed_mm", f"run.store={tmp_path / 'runs'}"]).to_yaml())
    settings = PhaseJob("personalization", api="trainjob").as_dict()
    with pytest.raises(ConfigError, match="runs as a TrainJob, whose pods share the run through its store"):
        bodies.launch_phase_job(str(config), "personalization", "unused", None, str(tmp_path / "state"), job=settings,
                               image="img", resources={}, storage={"s3_endpoint": "http://x", "s3_secret": "s"})
    assert not k8s.requests()


# -- the CLI and the compiled pipeline ------------------------------------------------------------


def compile_with(tmp_path, *flags: str):
    from typer.testing import CliRunner

    from fedpipe.cli import app

    out = tmp_path / "p.yaml"
    result = CliRunner().invoke(app, ["compile", "--set", "method.name=superfed_mm", *flags, "-o", str(out)])
    return result, out


def test_job_api_flag_compiles_a_trainjob_launcher(tmp_path):
    result, out = compile_with(tmp_path, "--distributed-phase=personalization", "--nodes=3", "--job-api=trainjob",
                               "--trainer-runtime=torch-distributed-hardened")
    assert result.exit_code == 0, result.output
    spec = next(yaml.safe_load_all(out.read_text()))
    tasks = flat_tasks(spec)
    (launcher,) = [t for t in tasks.values() if t["componentRef"]["name"] == "comp-launch-phase-job"]
    assert launcher["taskInfo"]["name"] == "personalization (TrainJob)"
    settings = PhaseJob.from_dict(launcher["inputs"]["parameters"]["job"]["runtimeValue"]["constant"])
    assert settings == PhaseJob("personalization", nodes=3, api="trainjob", runtime="torch-distributed-hardened")


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--job-api=trainjob"], "only apply with --distributed-phase"),
        (["--distributed-phase=personalization", "--job-api=tfjob"], "api must be one of pytorchjob, trainjob"),
    ],
    ids=["without-phase", "unknown-api"],
)
def test_job_api_flag_mistakes_say_what_is_wrong(tmp_path, flags: list[str], words: str):
    result, _ = compile_with(tmp_path, *flags)
    assert result.exit_code != 0 and words in result.output, result.output


# -- the chart ------------------------------------------------------------------------------------

ON = ["--set", "pytorchJob.enabled=true", "--set", "pytorchJob.phase=personalization", "--set", "pytorchJob.nodes=3"]
TRAINER = ["--api-versions", "trainer.kubeflow.org/v1alpha1/TrainJob"]  # a cluster that serves Trainer v2 (Kubeflow 1.11+)
NETWORK = ["--set", "networkPolicy.enabled=true", "--set", "networkPolicy.apiServer.cidrs={10.0.0.1/32}"]


def granted(role: dict) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def expected(rules) -> set[tuple[str, str, str]]:
    return {(group, resource, verb) for group, resource, verbs in rules for verb in verbs}


def register_args(docs: list[dict]) -> list[str]:
    (container,) = only(docs, "Job", "-register")["spec"]["template"]["spec"]["containers"]
    return container["args"]


def test_chart_picks_trainjob_where_the_cluster_serves_it(render_chart, validate_k8s):
    docs = render_chart(*ON, *TRAINER)
    validate_k8s(docs)
    role = only(docs, "Role", "-trainjob-launcher")
    assert granted(role) == expected(TRAINJOB_RBAC_RULES)
    binding = only(docs, "RoleBinding", "-trainjob-launcher")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pipeline-runner", "namespace": NAMESPACE}]
    assert not [d for d in docs if d["metadata"]["name"].endswith("-pytorchjob-launcher") and d["kind"] in ("Role", "RoleBinding")]
    args = register_args(docs)
    assert "--job-api=trainjob" in args and "--trainer-runtime=torch-distributed" in args


def test_chart_keeps_the_locked_down_pytorchjob_where_both_apis_are_served(render_chart):
    """Kubeflow 1.11 and 26.03 ship Training Operator v1.9.2 beside Trainer v2.1.0: `auto` keeps the
    PyTorchJob, whose pods carry the security context a TrainJob has no field for."""
    docs = render_chart(*ON, *TRAINER, "--api-versions", "kubeflow.org/v1/PyTorchJob")
    assert "--job-api=pytorchjob" in register_args(docs)
    assert not [d for d in docs if "trainjob" in d["metadata"]["name"]]


def test_chart_keeps_the_pytorchjob_where_trainer_is_not_served(render_chart):
    docs = render_chart(*ON)
    assert granted(only(docs, "Role", "-pytorchjob-launcher")) == expected(RBAC_RULES)
    assert not [d for d in docs if "trainjob" in d["metadata"]["name"]]
    args = register_args(docs)
    assert "--job-api=pytorchjob" in args and not [a for a in args if a.startswith("--trainer-runtime")]


@pytest.mark.parametrize("api, served, role", [("pytorchjob", True, "-pytorchjob-launcher"), ("trainjob", False, "-trainjob-launcher")])
def test_an_explicit_api_value_wins_over_what_the_cluster_serves(render_chart, api: str, served: bool, role: str):
    docs = render_chart(*ON, *(TRAINER if served else []), "--set", f"pytorchJob.api={api}",
                        "--set", "pytorchJob.trainerRuntime=torch-hardened")
    only(docs, "Role", role)
    assert f"--job-api={api}" in register_args(docs)
    assert ("--trainer-runtime=torch-hardened" in register_args(docs)) == (api == "trainjob")


def test_chart_schema_refuses_an_unknown_api(helm: str, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"pytorchJob": {"enabled": True, "api": "tfjob"}}))
    proc = run_tool([helm, "template", RELEASE, str(CHART), "-f", str(bad)], check=False)
    assert proc.returncode != 0 and "schema" in proc.stderr and "api" in proc.stderr, proc.stderr


def test_the_register_jobs_trainjob_flags_compile_the_pipeline(render_chart, tmp_path):
    args = register_args(render_chart(*ON, *TRAINER))
    job_flags = [a for a in args if a.startswith(("--distributed-phase", "--nodes", "--processes-per-node", "--gpus-per-process",
                                                  "--job-api", "--trainer-runtime"))]
    result, out = compile_with(tmp_path, *job_flags)
    assert result.exit_code == 0, result.output
    assert "personalization (TrainJob)" in out.read_text()


def test_the_distributed_phase_network_policy_selects_the_trainjobs_pods(render_chart, validate_k8s):
    """Trainer gives the pods the podTemplateOverride's labels (mergePodTemplateOverrides); JobSet adds its own
    (jobset.sigs.k8s.io/jobset-name, ...: labelAndAnnotateObject) and keeps them. The policy selects fedpipe's."""
    docs = render_chart(*ON, *TRAINER, *NETWORK)
    validate_k8s(docs)
    ranks = only(docs, "NetworkPolicy", "-distributed-phase-egress")
    selector = ranks["spec"]["podSelector"]["matchLabels"]
    pod_labels = node_pod(sample_trainjob())["metadata"]["labels"]
    assert selector.items() <= pod_labels.items() and pod_labels == labels("superfed-mm-test-0a1b2c3d-job42", "personalization")
    assert [rule for rule in ranks["spec"]["egress"] if "ports" not in rule] == [{"to": [{"podSelector": {"matchLabels": selector}}]}]
    only(docs, "NetworkPolicy", "-pytorchjob-launcher-egress")  # the launcher reaches the API server under either API
