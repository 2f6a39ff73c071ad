"""The compiled pipeline, run in the project's own image: the cluster path short of a cluster.

`make images` builds the image with podman, pushes it to a registry on loopback and pulls it back, as a
cluster's nodes would. Here `fedpipe compile` (the flags a user passes) compiles the default pipeline for
that image, the S3 test server and the real Pushgateway, and kfp's local DockerRunner runs every task in
its own container through podman's Docker-compatible API: the components' commands, the image's user
(1000), paths, environment and the artifacts passed between tasks are the ones a pod gets. Containers use
host networking, so all traffic stays on loopback. What is not real here: Kubernetes and KFP's own
backend (driver, launcher, Argo), and a GPU: the run trains on the CPU (tests/test_pipelines.py reads the
compiled GPU request the way the driver does).

The same compiled pipeline run by the SubprocessRunner (every task a process on this machine, with this
machine's torch) gives the same summary: the image changes where the code runs, not what it computes.

This test fails, never skips, when podman or the image is missing: `make test` builds the image first.
"""

import hashlib
import io
import json
import os
import re
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import yaml
from containers import built_image, compile_for_image, podman, podman_service
from kfp import local
from minio import Minio
from runs import SMALL

pytestmark = pytest.mark.services

BUCKET = "fedpipe-containers"
TINY = [*SMALL, "method.name=superfed_mm", "train.rounds=2", "partition.num_clients=4", "run.threads=1",
        "telemetry.pushgateway_retention_seconds=0"]
# What differs between two runs of one config by design: their ids, where their report is, how long they took.
RUN_SPECIFIC = {"run_id", "report", "training_seconds"}


def _config(run_id: str) -> str:
    from fedpipe.run.config import load_config

    return load_config(None, [*TINY, f"run.store=s3://{BUCKET}/runs", f"run.id={run_id}"]).to_yaml()


def _run(pipeline, runner, root, run_id: str) -> None:
    os.makedirs(root, mode=0o777, exist_ok=True)
    os.chmod(root, 0o777)  # the image's user (1000) writes the task outputs into this folder
    local.init(runner=runner, pipeline_root=str(root), raise_on_error=True)
    pipeline(base_config=_config(run_id), accelerator_count="0")  # a CPU run, as the UI starts one on a CPU node


def _summary(client: Minio, run_id: str) -> dict:
    data = client.get_object(BUCKET, f"runs/{run_id}/report/summary.json")
    try:
        return json.load(io.BytesIO(data.read()))
    finally:
        data.close()
        data.release_conn()


def _prom(prometheus: str, expr: str) -> list[dict]:
    url = f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)["data"]["result"]


def test_the_compiled_pipeline_runs_in_the_image_and_equals_the_subprocess_run(
        tmp_path, s3_env, s3_credentials, pushgateway, prometheus, monkeypatch):
    image = built_image()
    access, secret = s3_credentials
    client = Minio(s3_env.removeprefix("http://"), access_key=access, secret_key=secret, secure=False)
    if not client.bucket_exists(BUCKET):
        client.make_bucket(BUCKET)
    pipeline = compile_for_image(tmp_path, image, f"s3://{BUCKET}/runs", s3_env, pushgateway)

    with podman_service() as socket_url:
        monkeypatch.setenv("DOCKER_HOST", socket_url)  # kfp's DockerRunner calls docker.from_env()
        # The credentials a pod gets from the Secret; the endpoint and Pushgateway come from the compiled spec.
        runner = local.DockerRunner(network_mode="host", environment={"AWS_ACCESS_KEY_ID": access, "AWS_SECRET_ACCESS_KEY": secret})
        started = time.time()
        _run(pipeline, runner, tmp_path / "docker-root", "in-containers")
        took = time.time() - started
    in_containers = _summary(client, "in-containers")
    print(f"pipeline in containers: {took:.0f} s")

    # the tasks ran in the image, as its non-root user, and passed their artifacts as files
    [run_dir] = list((tmp_path / "docker-root").iterdir())
    for task in ("resolve-config", "partition", "train-phase", "train-phase-2", "evaluate"):
        assert (run_dir / task).is_dir(), task
    state = run_dir / "train-phase-2" / "state"
    assert state.stat().st_uid == 1000, "task outputs are written by the image's user"
    stored = client.get_object(BUCKET, "runs/in-containers/phases/personalization/final.pt")
    try:
        final = stored.read()
    finally:
        stored.close()
        stored.release_conn()
    pointer = json.loads(state.read_text())  # the state stays in the store; the artifact points at it
    assert pointer["url"] == f"s3://{BUCKET}/runs/in-containers/phases/personalization/final.pt", pointer
    assert pointer["sha256"] == hashlib.sha256(final).hexdigest() and pointer["size"] == len(final)

    # the round metrics left the containers: Prometheus scraped them from the Pushgateway
    # (the run deleted its groups when it finished; Prometheus keeps what it scraped)
    selector = '{run_id="in-containers",phase="personalization"}'
    rounds = _prom(prometheus, f"max_over_time(fedpipe_round{selector}[10m])")
    assert rounds and float(rounds[0]["value"][1]) == 2, rounds

    # the same compiled pipeline, every task a process on this machine
    _run(pipeline, local.SubprocessRunner(use_venv=False), tmp_path / "subprocess-root", "in-processes")
    in_processes = _summary(client, "in-processes")
    assert in_containers["personalized_accuracy"]["mean"] > 0.5, in_containers  # it learned (4 clients, 10 classes)
    assert {k: v for k, v in in_containers.items() if k not in RUN_SPECIFIC} == \
        {k: v for k, v in in_processes.items() if k not in RUN_SPECIFIC}


def test_a_config_error_inside_the_image_fails_the_task_with_its_message(tmp_path, s3_env, s3_credentials, pushgateway,
                                                                        monkeypatch, capfd):
    image = built_image()
    access, secret = s3_credentials
    pipeline = compile_for_image(tmp_path, image, f"s3://{BUCKET}/runs", s3_env, pushgateway)
    bad = yaml.safe_load(_config("bad"))
    bad["train"]["rounds"] = 0
    with podman_service() as socket_url:
        monkeypatch.setenv("DOCKER_HOST", socket_url)
        runner = local.DockerRunner(network_mode="host", environment={"AWS_ACCESS_KEY_ID": access, "AWS_SECRET_ACCESS_KEY": secret})
        root = tmp_path / "bad"
        os.makedirs(root, mode=0o777)
        os.chmod(root, 0o777)
        local.init(runner=runner, pipeline_root=str(root), raise_on_error=True)
        with pytest.raises(Exception):  # noqa: B017 (kfp's local runner raises a ValueError or RuntimeError)
            pipeline(base_config=yaml.safe_dump(bad))
    log = re.sub(r"\x1b\[[0-9;]*m", "", "".join(capfd.readouterr()))  # the runner colours task names
    assert "Executing task 'resolve-config'" in log
    assert "Executing task 'partition'" not in log and "Executing task 'train-phase'" not in log  # nothing ran after it
    # kfp 2.17's DockerRunner starts containers with auto_remove: podman may remove a quick one before the
    # runner reads its logs and exit code (docker_task_handler.run_docker_container), so the task's own
    # message is checked by running the image directly, as the pod's main container would
    done = subprocess.run([podman(), "run", "--rm", "--network", "none", image, "fedpipe", "config", "--set", "train.rounds=0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "train.rounds: Input should be greater than or equal to 1" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
