"""Shared fixtures: real servers for the integration tests (``-m services``).

The session fixtures start each server on a free loopback port the first time a test asks for it
and stop it at the end of the session:

- ``s3_server``: ``moto_server`` (an S3-compatible server, in memory) from the venv;
- ``pushgateway``: ``prometheus-pushgateway``;
- ``prometheus``: ``prometheus`` with a temp data dir, scraping the Pushgateway every second with
  ``honor_labels: true``.

A missing binary FAILS the test with a message to run ``scripts/test-services.sh`` (it is never
skipped silently).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from services import S3_ACCESS_KEY, S3_SECRET_KEY, find_binary, free_port, start_server, stop_server

# Issue 43, A19: each pytest-xdist worker's torch (and its OpenMP pool) took every core, so two workers ran 2x the
# threads the machine has, spinning against each other: a 19 s test took over 300 s on a loaded 2-core machine.
# Each worker gets its share of the cores instead, set before anything imports torch (OpenMP reads it once).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
WORKER_THREADS = max(1, (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1) // _WORKERS)
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(WORKER_THREADS))
    os.environ.setdefault("MKL_NUM_THREADS", str(WORKER_THREADS))


@pytest.fixture(autouse=True)
def _keep_torch_thread_count():
    """A run with `run.threads` sets torch's thread count for the whole process; put it back so it
    does not leak into later tests (float sums, hence bitwise comparisons, depend on it)."""
    import torch

    if _WORKERS > 1 and torch.get_num_threads() != WORKER_THREADS:
        torch.set_num_threads(WORKER_THREADS)  # the worker's share, whatever a test set before
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def port_factory():
    """A function returning a free loopback TCP port (nothing listens there)."""
    return free_port


@pytest.fixture(scope="session")
def s3_credentials() -> tuple[str, str]:
    """(access key, secret key) that `s3_env` puts in the environment."""
    return S3_ACCESS_KEY, S3_SECRET_KEY


@pytest.fixture(scope="session")
def services_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("services")


@pytest.fixture(scope="session")
def s3_server(services_dir: Path) -> Iterator[str]:
    """A real S3-compatible server (moto_server) on loopback; yields its endpoint URL."""
    binary = find_binary("moto_server")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server("moto_server", [binary, "-H", "127.0.0.1", "-p", str(port)], url, "/", services_dir)
    yield url
    stop_server(server)


@pytest.fixture
def s3_env(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The environment `S3Store.from_env` / `open_store('s3://...')` reads, for one test."""
    monkeypatch.setenv("FEDPIPE_S3_ENDPOINT", s3_server)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET_KEY)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("FEDPIPE_S3_RETRY_SECONDS", "5")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("FEDPIPE_S3_CREATE_BUCKET", raising=False)
    return s3_server


@pytest.fixture
def raw_client(s3_env: str, s3_credentials: tuple[str, str]):
    """The plain minio client on the same S3 server: a bucket writer behind the store's back (no fedpipe
    hashes, no signing key), to tamper with objects."""
    from minio import Minio

    return Minio(s3_env.removeprefix("http://"), access_key=s3_credentials[0], secret_key=s3_credentials[1],
                 secure=False, region="us-east-1")


@pytest.fixture(scope="session")
def pushgateway(services_dir: Path) -> Iterator[str]:
    """A real Prometheus Pushgateway on loopback; yields its URL."""
    binary = find_binary("prometheus-pushgateway", "pushgateway")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(
        "pushgateway",
        # no persistence file: Debian's build defaults to a shared one under /var/lib
        [binary, f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn", "--persistence.file="],
        url,
        "/-/ready",
        services_dir,
    )
    yield url
    stop_server(server)


@pytest.fixture(scope="session")
def prometheus(pushgateway: str, services_dir: Path) -> Iterator[str]:
    """A real Prometheus scraping the Pushgateway every second (honor_labels); yields its URL."""
    binary = find_binary("prometheus")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = services_dir / "prometheus.yml"
    config.write_text(
        "global:\n"
        "  scrape_interval: 1s\n"
        "  evaluation_interval: 1s\n"
        "scrape_configs:\n"
        "  - job_name: pushgateway\n"
        "    honor_labels: true\n"
        "    scrape_interval: 1s\n"
        "    scrape_timeout: 1s\n"
        "    static_configs:\n"
        f"      - targets: ['{pushgateway.removeprefix('http://')}']\n"
    )
    data = services_dir / "prometheus-data"
    data.mkdir()
    server = start_server(
        "prometheus",
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        url,
        "/-/ready",
        services_dir,
    )
    yield url
    stop_server(server)


FLOWER_ENV = Path(__file__).resolve().parents[1] / ".cache" / "flower-venv"


@pytest.fixture(scope="session")
def flower_env() -> Path:
    """The Flower 1.42 environment; built by scripts/flower-env.sh when missing or stale (about a minute here; the script
    holds a lock, so two xdist workers asking at once build it once). Every test that runs Flower's code asks for it."""
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run(["nice", "-n", "10", "bash", str(root / "scripts" / "flower-env.sh"), str(FLOWER_ENV)],
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        pytest.fail(f"scripts/flower-env.sh could not build the Flower environment at {FLOWER_ENV} (exit {r.returncode}); "
                    f"the federation tests need it:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return FLOWER_ENV
