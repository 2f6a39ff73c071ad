"""The container image that `make images` (scripts/build-images.sh) built, and podman's Docker API.

- ``built_image()``: the image's reference as pulled back from the loopback registry
  (``127.0.0.1:<port>/fedpipe/fedpipe:<version>-cuda``, written to ``.cache/images/fedpipe-image.txt``).
- ``podman_service()``: a context manager that starts ``podman system service`` on a socket of its
  own and yields its URL, the ``base_url`` of ``docker.DockerClient`` (kfp's ``DockerRunner`` talks
  to it that way); it stops the service afterwards.

podman or the image missing FAILS the test (never a skip), naming ``make images``.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kfp import components

REPO = Path(__file__).resolve().parents[1]
IMAGE_FILE = REPO / ".cache" / "images" / "fedpipe-image.txt"
MAKE_IMAGES = "run `make images` (scripts/build-images.sh builds the image and pulls it from a loopback registry)"


def podman() -> str:
    """The podman binary; fail when it is missing."""
    found = shutil.which("podman") or next((p for p in ("/usr/bin/podman", "/usr/local/bin/podman") if Path(p).exists()), None)
    if not found:
        pytest.fail(f"podman is not installed: {MAKE_IMAGES} (it installs podman).", pytrace=False)
    return found


def built_image() -> str:
    """The reference of the image `make images` built and pulled back from the registry; fail when missing."""
    exe = podman()
    if not IMAGE_FILE.is_file():
        pytest.fail(f"no fedpipe image has been built ({IMAGE_FILE.relative_to(REPO)} is missing): {MAKE_IMAGES}.", pytrace=False)
    ref = IMAGE_FILE.read_text().strip()
    if subprocess.run([exe, "image", "exists", ref]).returncode != 0:
        pytest.fail(
            f"the image {ref} named in {IMAGE_FILE.relative_to(REPO)} is not in podman's storage: {MAKE_IMAGES}.", pytrace=False
        )
    return ref


@contextlib.contextmanager
def podman_service(timeout: float = 30.0) -> Iterator[str]:
    """Start `podman system service --time=0` on a fresh unix socket; yield its URL ("unix:///.../podman.sock")."""
    exe = podman()
    with tempfile.TemporaryDirectory(prefix="fedpipe-podman-") as folder:
        sock = Path(folder) / "podman.sock"
        url = f"unix://{sock}"
        log = open(Path(folder) / "service.log", "w+b")  # noqa: SIM115 (closed below)
        proc = subprocess.Popen([exe, "system", "service", "--time=0", url], stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout
            while not _answers(sock):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    pytest.fail(
                        f"podman system service did not come up on {url}: {log.read().decode(errors='replace')[-2000:]}",
                        pytrace=False,
                    )
                time.sleep(0.1)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


def _answers(sock: Path) -> bool:
    """True when the Docker API on `sock` answers GET /_ping with OK."""
    if not sock.exists():
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            s.connect(str(sock))
            s.sendall(b"GET /_ping HTTP/1.0\r\nHost: d\r\n\r\n")
            return b"OK" in s.recv(4096)
    except OSError:
        return False


def compile_for_image(tmp_path: Path, image: str, store: str, s3_endpoint: str, pushgateway: str):
    """The default pipeline (superfed_mm) compiled for `image` with the flags a user passes (`fedpipe compile
    --image-repository ... --store ... --s3-endpoint ... --pushgateway ...`), a CPU run; loaded as a component."""
    repository, tag = image.rsplit(":", 1)
    out = tmp_path / "superfed_mm.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "fedpipe.cli", "compile", "-o", str(out), "--set", "method.name=superfed_mm",
         "--image-repository", repository, "--image-tag", tag, "--training-image-tag", tag, "--accelerator-count", "0",
         "--store", store, "--s3-endpoint", s3_endpoint, "--pushgateway", pushgateway],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return components.load_component_from_file(str(out))
