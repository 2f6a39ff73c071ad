"""The PyTorchJob launcher against a recording stand-in of the Kubernetes API.

No Kubernetes cluster and no Kubeflow Training Operator run here. `k8s_api_standin` is an
in-process HTTP server on a loopback port that answers the few API calls the launcher makes
(create, get and delete a kubeflow.org/v1 PyTorchJob; list pods), with job statuses each test
scripts: it is NOT Kubernetes, nothing is scheduled and no pod runs. The launcher talks to it with
the real `kubernetes` client, through a kubeconfig with a bearer token, so these tests check what
goes over the wire (the job it creates, the calls it makes, hence the RBAC it needs) and what a user
reads when the job fails, never finishes, or cannot be created. The stand-in admits a job only if it
passes the PyTorchJob CRD schema check of the deploy tests.
"""

from __future__ import annotations

import hashlib
import json

import pytest
from deploytools import pytorchjob_problems, sample_pytorchjob
from k8s_api_standin import KubernetesApiStandIn, failed, pod, running, succeeded

from fedpipe.components import bodies
from fedpipe.k8s.launcher import RBAC_RULES, PhaseJobError, PhaseJobLauncher, PhaseJobTimeout

NAMESPACE = "team-a"
FAST = 0.02  # seconds between polls


@pytest.fixture
def k8s(tmp_path, monkeypatch):
    """The stand-in, and the environment a launcher outside a cluster finds it through."""
    for name in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "FEDPIPE_NAMESPACE"):
        monkeypatch.delenv(name, raising=False)
    with KubernetesApiStandIn(admit=lambda job: "; ".join(pytorchjob_problems(job)) or None) as server:
        monkeypatch.setenv("KUBECONFIG", str(server.kubeconfig(tmp_path, namespace=NAMESPACE)))
        yield server


def job_manifest(**job) -> dict:
    manifest = sample_pytorchjob(**job)
    manifest["metadata"]["namespace"] = NAMESPACE
    return manifest


def launch(manifest: dict, *, wait: float = 10.0, cleanup: str = "on-success"):
    return PhaseJobLauncher(poll_seconds=FAST).run(manifest, wait_seconds=wait, cleanup=cleanup)


def test_a_succeeding_job_is_created_awaited_and_deleted(k8s):
    manifest = job_manifest()
    name = manifest["metadata"]["name"]
    k8s.script(name, [running(), running(), succeeded()])
    done = launch(manifest)
    assert done.name == name and done.namespace == NAMESPACE and done.deleted
    (create,) = k8s.requests("POST")
    assert create.path == f"/apis/kubeflow.org/v1/namespaces/{NAMESPACE}/pytorchjobs"
    assert create.body == manifest, "the job on the wire is the rendered manifest"
    assert create.headers["authorization"] == "Bearer standin-token-6d1f"
    gets = k8s.requests("GET")
    assert len(gets) == 3 and {g.path for g in gets} == {f"{create.path}/{name}"}
    (delete,) = k8s.requests("DELETE")
    assert delete.body["propagationPolicy"] == "Foreground"


def test_a_failed_job_names_the_job_and_the_failing_replicas_reason(k8s):
    manifest = job_manifest(nodes=3)
    name = manifest["metadata"]["name"]
    k8s.script(name, [running(worker=2), failed("PyTorchJobFailed", f"PyTorchJob {name} is failed because 1 Worker replica(s) failed.",
                                                {"Master": {"active": 1}, "Worker": {"active": 1, "failed": 1}})])
    k8s.pods[name] = [
        pod(name, "master", 0),
        pod(name, "worker", 0),
        pod(name, "worker", 1, phase="Running", restarts=3,
            container_state={"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}},
            last_state={"terminated": {"exitCode": 137, "reason": "OOMKilled"}}),
    ]
    with pytest.raises(PhaseJobError) as caught:
        launch(manifest)
    message = str(caught.value)
    assert f"PyTorchJob {name} in namespace {NAMESPACE} failed" in message
    assert "PyTorchJobFailed" in message and "1 Worker replica(s) failed" in message
    assert f"worker 1 (pod {name}-worker-1)" in message and "CrashLoopBackOff" in message
    assert "last exit code 137 (OOMKilled)" in message
    assert f"kubectl -n {NAMESPACE} logs {name}-worker-1 -c pytorch --previous" in message
    assert "master 0" not in message and "worker 0" not in message, "healthy replicas are not blamed"
    assert "kept" in message and not k8s.requests("DELETE"), "on-success keeps a failed job to inspect"
    (listed,) = [r for r in k8s.requests("GET") if r.path.endswith("/pods")]
    assert listed.param("labelSelector") == f"training.kubeflow.org/job-name={name}"


def test_a_failed_job_with_a_terminated_master_is_deleted_when_cleanup_is_always(k8s):
    manifest = job_manifest(nodes=1)
    name = manifest["metadata"]["name"]
    k8s.script(name, [failed("PyTorchJobFailed", "1 Master replica(s) failed.", {"Master": {"failed": 1}})])
    k8s.pods[name] = [pod(name, "master", 0, phase="Failed",
                          container_state={"terminated": {"exitCode": 2, "reason": "Error", "message": "error: method 'x' has no phase"}})]
    with pytest.raises(PhaseJobError, match=r"master 0 .*exited with code 2 \(Error\): error: method 'x' has no phase") as caught:
        launch(manifest, cleanup="always")
    assert "was deleted" in str(caught.value) and len(k8s.requests("DELETE")) == 1


def test_a_job_that_never_finishes_times_out_and_is_deleted(k8s):
    manifest = job_manifest()
    name = manifest["metadata"]["name"]
    k8s.script(name, [running()])
    with pytest.raises(PhaseJobTimeout, match=rf"PyTorchJob {name} in namespace {NAMESPACE} did not finish.*Running \(Master: 1 active; Worker: 1 active\).*deleted"):
        launch(manifest, wait=0.3)
    assert len(k8s.requests("DELETE")) == 1, "a job past its time would hold its GPUs on"


def test_cleanup_never_keeps_even_a_timed_out_job(k8s):
    manifest = job_manifest()
    k8s.script(manifest["metadata"]["name"], [running()])
    with pytest.raises(PhaseJobTimeout):
        launch(manifest, wait=0.2, cleanup="never")
    assert not k8s.requests("DELETE")


def test_a_retried_launcher_waits_for_its_running_job(k8s):
    manifest = job_manifest()
    k8s.put(manifest, [running(), succeeded()])  # the earlier attempt created it
    launch(manifest)
    assert len(k8s.requests("POST")) == 1 and k8s.requests("POST")[0].status == 409
    assert not k8s.created, "no second job"


def test_a_retried_launcher_replaces_its_failed_job(k8s):
    manifest = job_manifest()
    name = manifest["metadata"]["name"]
    k8s.put(manifest, [failed("PyTorchJobFailed", "1 Master replica(s) failed.", {"Master": {"failed": 1}})])
    k8s.script(name, [running(), succeeded()])
    launch(manifest)
    statuses = [(r.method, r.status) for r in k8s.requests() if r.method in ("POST", "DELETE")]
    assert statuses == [("POST", 409), ("DELETE", 200), ("POST", 201), ("DELETE", 200)]
    # Between the two, the launcher read the old job until it was gone (foreground deletion).
    reads = [r.status for r in k8s.requests("GET")]
    assert 404 in reads


def test_a_job_of_another_run_under_the_same_name_is_not_touched(k8s):
    manifest = job_manifest()
    theirs = json.loads(json.dumps(manifest))
    theirs["metadata"]["annotations"]["fedpipe.io/run-id"] = "someone-else"
    k8s.put(theirs, [running()])
    with pytest.raises(PhaseJobError, match="belongs to run 'someone-else'"):
        launch(manifest)
    assert not k8s.requests("DELETE")


@pytest.mark.parametrize(
    "status, message, expected",
    [
        (404, "the server could not find the requested resource", "Install the Kubeflow Training Operator"),
        (403, 'pytorchjobs.kubeflow.org is forbidden: User "system:serviceaccount:team-a:pipeline-runner" cannot create resource',
         "pytorchJob.enabled=true"),
        (500, "etcdserver: request timed out", "500 etcdserver: request timed out"),
    ],
    ids=["no-training-operator", "no-rbac", "server-error"],
)
def test_a_job_that_cannot_be_created_says_why(k8s, status, message, expected):
    k8s.fail("POST", r".*/pytorchjobs", status, message)
    manifest = job_manifest()
    with pytest.raises(PhaseJobError) as caught:
        launch(manifest)
    assert f"Cannot create PyTorchJob {manifest['metadata']['name']} in namespace {NAMESPACE}" in str(caught.value)
    assert expected in str(caught.value) and message in str(caught.value)


def test_a_job_the_admission_rejects_says_why(k8s):
    manifest = job_manifest()
    manifest["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = 2
    with pytest.raises(PhaseJobError, match=r"rejected it: .*Master\.replicas must be 1"):
        launch(manifest)


def test_transient_api_errors_while_waiting_are_retried(k8s):
    manifest = job_manifest()
    k8s.script(manifest["metadata"]["name"], [running(), succeeded()])
    k8s.fail("GET", r".*/pytorchjobs/.*", 503, "the server is currently unable to handle the request", times=2)
    assert launch(manifest).deleted
    assert [r.status for r in k8s.requests("GET")][:2] == [503, 503]


def test_the_launcher_makes_only_the_calls_rbac_grants(k8s):
    """Every call of every path above (success with cleanup, failure with pod details, a replaced job),
    as the API server's authorizer sees it: exactly RBAC_RULES, which the chart and manifests grant."""
    first = job_manifest()
    k8s.put(first, [failed("PyTorchJobFailed", "x", {"Master": {"failed": 1}})])
    k8s.script(first["metadata"]["name"], [running(), failed("PyTorchJobFailed", "x", {"Master": {"failed": 1}})])
    with pytest.raises(PhaseJobError):
        launch(first, cleanup="always")
    second = job_manifest(phase="federation")
    k8s.script(second["metadata"]["name"], [succeeded()])
    launch(second)
    allowed = {(group, resource, verb) for group, resource, verbs in RBAC_RULES for verb in verbs}
    assert k8s.verbs() == allowed


def test_the_namespace_comes_from_the_task_pod(k8s, monkeypatch):
    monkeypatch.setenv("FEDPIPE_NAMESPACE", "team-b")  # the pipeline sets it from the pod's metadata.namespace
    manifest = job_manifest()
    manifest["metadata"]["namespace"] = "team-b"
    k8s.script(manifest["metadata"]["name"], [succeeded()])
    launch(manifest)
    assert k8s.requests("POST")[0].path == "/apis/kubeflow.org/v1/namespaces/team-b/pytorchjobs"


# -- the pipeline's launcher task, end to end through the store ---------------------------------


def resolved_config(tmp_path, store: str) -> tuple:
    """The run config as the pipeline's config task writes it (run.id = config id + KFP job id)."""
    from runs import SMALL

    from fedpipe.run.config import load_config

    base = load_config(None, [*SMALL, "method.name=superfed_mm", f"run.store={store}"]).to_yaml()
    path = tmp_path / "config.yaml"
    cfg = bodies.resolve_config(base, {}, {}, [], "job-7f3a", str(path))
    return cfg, path


JOB_SETTINGS = {"phase": "personalization", "nodes": 2.0, "processes_per_node": 1.0, "gpus_per_process": 0.0,  # floats: a protobuf Struct
                "backoff_limit": 3.0, "clean_pod_policy": "Running", "cleanup": "on-success", "timeout_seconds": 600.0,
                "shm_size": "1Gi", "master_port": 23456.0}
RESOURCES = {"cpu_request": "2", "cpu_limit": "4", "memory_request": "4Gi", "memory_limit": "8Gi",
             "accelerator_type": "nvidia.com/gpu", "node_selector": {}, "tolerations": []}


@pytest.mark.services
def test_the_launcher_task_runs_the_phase_through_the_store(k8s, s3_env, s3_credentials, tmp_path):
    """What the pipeline's launch_phase_job task does: check the previous phase's state in the S3 store
    against the pointer it was handed, create the job, wait, hand on a pointer to the phase's state
    (written by the job's rank 0, here by the stand-in)."""
    import uuid

    from fedpipe.k8s.pytorchjob import CONFIG_ANNOTATION, phase_job_name
    from fedpipe.run.run import Run
    from fedpipe.store import open_store

    cfg, config = resolved_config(tmp_path, f"s3://fedpipe-k8s-{uuid.uuid4().hex[:10]}/runs")
    run_id = cfg.run_id()
    manifest, previous, state = tmp_path / "manifest.json", tmp_path / "previous.pt", tmp_path / "state.pt"
    bodies.partition(str(config), str(manifest), str(tmp_path / "heatmap.html"))
    store = open_store(cfg.run.store)
    store.put(f"{run_id}/phases/federation/final.pt", b"federation's final state")  # what the federation task left
    bodies.write_pointer(Run(cfg, store), f"{run_id}/phases/federation/final.pt", str(previous))
    rounds = [{"round": 1, "train_loss": 0.9}, {"round": 2, "train_loss": 0.5, "personalized_accuracy": 0.8}]

    def rank_zero_writes_the_store(job: dict) -> None:  # what the job's pods would do
        store.put(f"{run_id}/phases/personalization/final.pt", b"personalization's final state")
        store.put_text(f"{run_id}/report/rounds-personalization.jsonl", "".join(json.dumps(r) + "\n" for r in rounds))

    k8s.on_create = rank_zero_writes_the_store
    name = phase_job_name(run_id, "personalization")
    k8s.script(name, [running(), succeeded()])
    last = bodies.launch_phase_job(str(config), "personalization", str(manifest), str(previous), str(state), job=JOB_SETTINGS,
                                  image="ghcr.io/fedpipe/fedpipe:0.1.0-cuda", resources=RESOURCES, poll_seconds=FAST,
                                  storage={"s3_endpoint": s3_env, "s3_secret": "team-s3", "s3_secret_keys": ["ak", "sk"],
                                           "pushgateway": "", "extra_env": {}})
    assert last == rounds[-1]
    pointer = json.loads(state.read_text())
    assert pointer["url"] == store.url(f"{run_id}/phases/personalization/final.pt")
    assert pointer["sha256"] == hashlib.sha256(b"personalization's final state").hexdigest()
    (job,) = k8s.created
    assert job["metadata"]["name"] == name and job["metadata"]["namespace"] == NAMESPACE
    template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    config_in_job = template["metadata"]["annotations"][CONFIG_ANNOTATION]
    assert f"id: {run_id}" in config_in_job and f"store: {cfg.run.store}" in config_in_job
    assert "--nnodes=2" in template["spec"]["containers"][0]["args"]
    env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "team-s3", "key": "sk"}
    # The launcher's pod has the credentials in its env; none went to the API server.
    for request in k8s.requests():
        for credential in s3_credentials:
            assert credential.encode() not in request.raw, f"{request.method} {request.path} carries a credential"
    assert len(k8s.requests("DELETE")) == 1


def test_the_launcher_task_refuses_a_store_the_pods_cannot_share(k8s, tmp_path):
    from fedpipe.errors import ConfigError

    _, config = resolved_config(tmp_path, str(tmp_path / "runs"))
    with pytest.raises(ConfigError, match="a folder only this pod sees"):
        bodies.launch_phase_job(str(config), "personalization", "unused", None, str(tmp_path / "state.pt"), job=JOB_SETTINGS,
                               image="img", resources=RESOURCES, storage={"s3_endpoint": "http://x", "s3_secret": "s"})
    assert not k8s.requests(), "nothing may be created for a run the pods cannot reach"
