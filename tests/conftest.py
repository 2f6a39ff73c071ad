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
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
INSTALL_HINT = "run scripts/test-services.sh (it installs the test servers) and try again"

S3_ACCESS_KEY = "fedpipe-test-access"
# A distinctive secret so tests can assert it never leaks into messages.
S3_SECRET_KEY = "fedpipe-test-SECRET-d0e5n0t-l3ak"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_binary(*names: str) -> str:
    """A server binary from the venv, PATH or /usr/bin; fail (not skip) when missing."""
    venv_bin = Path(sys.executable).parent
    for name in names:
        for candidate in (venv_bin / name, REPO / ".venv" / "bin" / name):
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
        found = shutil.which(name) or shutil.which(name, path="/usr/bin:/usr/sbin:/usr/local/bin")
        if found:
            return found
    pytest.fail(f"{' / '.join(names)} is not installed: {INSTALL_HINT}.", pytrace=False)


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen
    log_path: Path

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


def _start(
    name: str, argv: list[str], url: str, ready_path: str, workdir: Path, timeout: float = 20.0
) -> Server:
    log_path = workdir / f"{name}.log"
    log_file = open(log_path, "wb")  # noqa: SIM115 - closed with the process below
    proc = subprocess.Popen(
        argv,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        cwd=workdir,
        start_new_session=True,
    )
    log_file.close()
    server = Server(name, url, proc, log_path)
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        if proc.poll() is not None:
            pytest.fail(
                f"{name} exited with code {proc.returncode} at start ({' '.join(argv)}):\n"
                f"{server.log_tail()}",
                pytrace=False,
            )
        try:
            with urllib.request.urlopen(url + ready_path, timeout=1) as resp:
                if resp.status < 500:
                    return server
        except urllib.error.HTTPError as exc:
            if exc.code < 500:
                return server
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            _stop(server)
            pytest.fail(
                f"{name} did not become ready within {timeout:g} s:\n{server.log_tail()}", pytrace=False
            )
        time.sleep(delay)
        delay = min(delay * 1.5, 0.2)


def _stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(timeout=5)


@pytest.fixture(autouse=True)
def _keep_torch_thread_count():
    """A run with `run.threads` sets torch's thread count for the whole process; put it back so it
    does not leak into later tests (float sums, hence bitwise comparisons, depend on it)."""
    import torch

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
    server = _start("moto_server", [binary, "-H", "127.0.0.1", "-p", str(port)], url, "/", services_dir)
    yield url
    _stop(server)


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


@pytest.fixture(scope="session")
def pushgateway(services_dir: Path) -> Iterator[str]:
    """A real Prometheus Pushgateway on loopback; yields its URL."""
    binary = find_binary("prometheus-pushgateway", "pushgateway")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = _start(
        "pushgateway",
        [binary, f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        url,
        "/-/ready",
        services_dir,
    )
    yield url
    _stop(server)


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
    server = _start(
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
    _stop(server)
