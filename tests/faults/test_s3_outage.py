"""Fault: the S3 server (a real, dedicated moto_server) stops while a phase runs.

The phase fails after bounded retries (FEDPIPE_S3_RETRY_SECONDS) with a StoreError that names the
endpoint and says what to check; the credentials appear in no message.

moto keeps its objects in memory only (it has no persistence to turn on), so the restarted server
is empty: a real MinIO would still hold the checkpoints and the phase would resume from them (that
resume is tested against moto in tests/integration/test_run_services.py, without an outage). What this
test shows honestly is the other case, a server that lost everything: rerunning the phase says
clearly that the run's record is missing from the store and to partition first (it neither hangs
nor starts training from nothing), and the run done again from the start finishes.
"""

import threading
import time

import pytest
from minio import Minio
from runs import small_run
from services import S3_ACCESS_KEY, S3_SECRET_KEY, find_binary, free_port, start_server, stop_server

from fedpipe.errors import StoreError

OVERRIDES = ["method.name=fedavg", "partition.num_clients=2", "train.rounds=8", "run.threads=1"]
STORE = "s3://outage/team-a"
RETRY_SECONDS = 1.5


def start_moto(port, workdir):
    binary = find_binary("moto_server")
    return start_server("moto_server", [binary, "-H", "127.0.0.1", "-p", str(port)], f"http://127.0.0.1:{port}", "/", workdir)


@pytest.fixture
def s3_endpoint(tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.setenv("FEDPIPE_S3_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET_KEY)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("FEDPIPE_S3_RETRY_SECONDS", str(RETRY_SECONDS))
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("FEDPIPE_S3_CREATE_BUCKET", raising=False)
    servers = []
    yield port, servers
    for server in servers:
        stop_server(server)


def stop_when_checkpoint_appears(server, key, stopped):
    client = Minio(server.url.removeprefix("http://"), access_key=S3_ACCESS_KEY, secret_key=S3_SECRET_KEY, secure=False)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if any(o.object_name == key for o in client.list_objects("outage", prefix=key)):
            stop_server(server)
            stopped.append(time.monotonic())
            return
        time.sleep(0.02)


def test_s3_server_stopped_mid_phase(tmp_path, s3_endpoint):
    port, servers = s3_endpoint
    servers.append(start_moto(port, tmp_path))
    url = f"http://127.0.0.1:{port}"
    run = small_run(STORE, *OVERRIDES)
    run.partition()

    stopped: list[float] = []
    watcher = threading.Thread(target=stop_when_checkpoint_appears,
                               args=(servers[0], "team-a/test/phases/federation/round-00001.pt", stopped))
    watcher.start()
    with pytest.raises(StoreError) as err:
        run.train("federation")
    failed = time.monotonic()
    watcher.join()
    assert stopped, "the phase ended before the server could be stopped"
    message = str(err.value)
    assert f"Could not reach the S3 / MinIO server at {url}" in message and "FEDPIPE_S3_ENDPOINT" in message
    assert "attempts over" in message and "FEDPIPE_S3_RETRY_SECONDS" in message
    assert S3_SECRET_KEY not in message and S3_ACCESS_KEY not in message
    assert failed - stopped[0] < RETRY_SECONDS + 10  # bounded: the retry budget plus at most one round of training

    # The server comes back on the same endpoint, empty (moto keeps nothing across restarts).
    servers.append(start_moto(port, tmp_path))
    with pytest.raises(StoreError, match=r"has not been partitioned yet \(s3://outage/team-a/test/run.json is missing\)"):
        small_run(STORE, *OVERRIDES).train("federation")
    again = small_run(STORE, *OVERRIDES)
    again.partition()
    assert again.train("federation").round == 8
