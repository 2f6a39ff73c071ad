"""The test servers (moto S3, Pushgateway, Prometheus): start one on a loopback port and stop it.

Used by the session fixtures of conftest.py and by the fault tests that start and stop servers of
their own. A missing binary FAILS the test with a message to run ``scripts/test-services.sh`` (it is
never skipped silently).
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


def start_server(
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
            stop_server(server)
            pytest.fail(
                f"{name} did not become ready within {timeout:g} s:\n{server.log_tail()}", pytrace=False
            )
        time.sleep(delay)
        delay = min(delay * 1.5, 0.2)


def stop_server(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(timeout=5)
