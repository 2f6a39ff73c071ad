"""A user's own model and own data, in containers: what a platform team does to run its own network on a cluster.

docs/data/models.md (the README's former "Models") says: to train your own network (`model.name: package.module:function`) on Kubeflow,
build an image FROM fedpipe's that installs your package, set FEDPIPE_MODEL_PACKAGES there, and compile the
pipeline for that image. Here a small package `mynets` (an MLP over the flattened 8x8 digits, `body` and
`head`) is written into a temporary folder and pip-installed into an image derived from the one `make images`
built (podman, no network: `--no-index --no-build-isolation`, the image's own setuptools builds it). The
default pipeline (SuPerFed-MM, two phases) is compiled for the derived image and run by kfp's DockerRunner, every
task in its own container (see test_pipeline_in_containers.py), on the user's own federated data: image folders
per site (tests/own_data.py) uploaded to the S3 test server with a plain client, their manifest written by
`fedpipe data init`, read with `data.dataset=files` and kept as the sites give them (`partition.scheme=natural`).

Then the same compiled pipeline, its image reference now naming the un-derived image, fails at the first task
that builds the model (train-phase) with the plain "not installed" message: the package is what made it work.

This test fails, never skips, when podman or the image is missing: `make test` builds the image first.
"""

import csv
import io
import json
import os
import re
import secrets
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from containers import built_image, compile_for_image, podman, podman_service
from kfp import local
from own_data import SITES, upload_folder, write_digit_folders

pytestmark = pytest.mark.services

BUCKET = "fedpipe-derived"
SOURCE_PREFIX = "sites/2026-11-25"
HIDDEN = 48  # the user's MLP: 64 inputs -> 48 -> classes; no bundled model has a 64x48 layer

MYNETS = '''
"""A user's own networks: an MLP over the flattened image, named `body` and `head` as fedpipe's defaults expect."""
from torch import nn


class DigitMLP(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        features = 1
        for d in input_shape:
            features *= d
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(features, HIDDEN), nn.ReLU())
        self.head = nn.Linear(HIDDEN, num_classes)

    def forward(self, x):
        return self.head(self.body(x))


def build(input_shape, num_classes):
    return DigitMLP(input_shape, num_classes)
'''.replace("HIDDEN", str(HIDDEN))

PYPROJECT = """\
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "mynets"
version = "0.1.0"

[tool.setuptools]
packages = ["mynets"]
"""

# What the Dockerfile of docs/data/models.md does, made to build offline: the base image has setuptools (84, checked with
# `podman run --rm IMAGE python -c "import setuptools"`), so `--no-build-isolation` builds the package with it
# and `--no-index --no-deps` asks no index for anything. The image runs as user 1000, who cannot write the
# image's site-packages: the install runs as root, and the image's user is put back for the tasks.
CONTAINERFILE = """\
FROM {base}
USER 0:0
COPY mynets /src/mynets
RUN pip install --no-cache-dir --no-deps --no-index --no-build-isolation /src/mynets
USER 1000:1000
ENV FEDPIPE_MODEL_PACKAGES=mynets
"""


def _build_derived_image(tmp_path, base: str, ref: str) -> float:
    """Build the derived image `ref` FROM `base` with `mynets` installed; its build's seconds."""
    context = tmp_path / "derived"
    package = context / "mynets"
    (package / "mynets").mkdir(parents=True)
    (package / "pyproject.toml").write_text(PYPROJECT)
    (package / "mynets" / "__init__.py").write_text(textwrap.dedent(MYNETS).lstrip())
    (context / "Containerfile").write_text(CONTAINERFILE.format(base=base))
    started = time.time()
    done = subprocess.run([podman(), "build", "--network", "none", "-f", str(context / "Containerfile"), "-t", ref, str(context)],
                          capture_output=True, text=True, timeout=600)
    took = time.time() - started
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return took


def _config(source: str, run_id: str) -> str:
    from fedpipe.run.config import load_config

    return load_config(None, [
        "data.dataset=files", f"data.source={source}", "partition.scheme=natural", "model.name=mynets:build",
        "method.name=superfed_mm", "train.rounds=2", "train.batch_size=20", "train.lr=0.05", "run.threads=1",
        "telemetry.progress=false", "telemetry.pushgateway_retention_seconds=0", f"run.store=s3://{BUCKET}/runs",
        f"run.id={run_id}",
    ]).to_yaml()


def _run(pipeline, runner, root, base_config: str) -> None:
    os.makedirs(root, mode=0o777, exist_ok=True)
    os.chmod(root, 0o777)  # the image's user (1000) writes the task outputs into this folder
    local.init(runner=runner, pipeline_root=str(root), raise_on_error=True)
    pipeline(base_config=base_config, accelerator_count="0")


def _get(client, key: str) -> bytes:
    data = client.get_object(BUCKET, key)
    try:
        return data.read()
    finally:
        data.close()
        data.release_conn()


def _log(capfd) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", "".join(capfd.readouterr()))  # the runner colours task names


def test_an_import_path_model_installed_in_a_derived_image_trains_on_own_data_in_containers(
        tmp_path, s3_env, s3_credentials, raw_client, pushgateway, monkeypatch, capfd):
    base = built_image()
    derived = f"localhost/fedpipe-derived:test-{secrets.token_hex(4)}"
    access, secret = s3_credentials
    try:
        build_seconds = _build_derived_image(tmp_path, base, derived)
        pipeline = compile_for_image(tmp_path, derived, f"s3://{BUCKET}/runs", s3_env, pushgateway)

        # the user's own data: image folders per site, uploaded by a plain client, described by `fedpipe data init`
        source = upload_folder(raw_client, write_digit_folders(tmp_path / "sites", limit=600), BUCKET, SOURCE_PREFIX)
        done = subprocess.run([sys.executable, "-m", "fedpipe.cli", "data", "init", source], capture_output=True, text=True,
                              timeout=300)  # the S3 endpoint and credentials: s3_env's environment
        assert done.returncode == 0, done.stdout + done.stderr

        with podman_service() as socket_url:
            monkeypatch.setenv("DOCKER_HOST", socket_url)  # kfp's DockerRunner calls docker.from_env()
            runner = local.DockerRunner(network_mode="host", environment={"AWS_ACCESS_KEY_ID": access, "AWS_SECRET_ACCESS_KEY": secret})
            capfd.readouterr()
            started = time.time()
            _run(pipeline, runner, tmp_path / "derived-root", _config(source, "own-model"))
            pipeline_seconds = time.time() - started
            log = _log(capfd)
            for task in ("resolve-config", "partition", "train-phase", "train-phase-2", "evaluate"):
                assert f"Task '{task}' finished with status SUCCESS" in log, (task, log[-5000:])

            # it learned: a site holds 4 of the 10 digits (chance 0.25); 2 rounds reach about 0.94
            summary = json.loads(_get(raw_client, "runs/own-model/report/summary.json"))
            personalized = summary["personalized_accuracy"]["mean"]
            assert personalized > 0.7, summary["personalized_accuracy"]
            assert summary["partition"] == "natural" and summary["num_clients"] == len(SITES) == 5
            assert summary["data"]["source"] == source, summary
            clients = list(csv.DictReader(io.StringIO(_get(raw_client, "runs/own-model/report/clients.csv").decode())))
            assert [row["name"] for row in clients] == list(SITES)  # the sites the folders named

            # the model that trained is the user's: its layers, in the final state the pipeline left in the store
            final = torch.load(io.BytesIO(_get(raw_client, "runs/own-model/phases/personalization/final.pt")), weights_only=True)
            assert {k: tuple(v.shape) for k, v in final["global"].items()} == {
                "body.1.weight": (HIDDEN, 64), "body.1.bias": (HIDDEN,), "head.weight": (10, HIDDEN), "head.bias": (10,)}
            # and it came from the package installed in the derived image (build_imported logs where it imported it from)
            assert "Model mynets:build: DigitMLP from /usr/local/lib/python3.11/site-packages/mynets/__init__.py" in log, log[-5000:]

            # the same compiled pipeline, its image reference now naming the un-derived image: the package is neither
            # installed nor allowed there (FEDPIPE_MODEL_PACKAGES unset: only the bundled models, fail-closed)
            assert subprocess.run([podman(), "rmi", derived], capture_output=True, timeout=120).returncode == 0
            assert subprocess.run([podman(), "tag", base, derived], capture_output=True, timeout=120).returncode == 0
            started = time.time()
            with pytest.raises(Exception):  # noqa: B017 (kfp's local runner raises a ValueError or RuntimeError)
                _run(pipeline, runner, tmp_path / "base-root", _config(source, "no-package"))
            failed_seconds = time.time() - started
            log = _log(capfd)
        assert "Task 'partition' finished with status SUCCESS" in log, log[-5000:]  # the data is fine ...
        assert "Executing task 'train-phase'" in log and "Executing task 'train-phase-2'" not in log, log[-5000:]
        # ... and the first task that builds the model stops, saying which variable allows the package and where
        assert ("model.name='mynets:build' names package 'mynets', but FEDPIPE_MODEL_PACKAGES is unset or empty" in log
                and "ENV FEDPIPE_MODEL_PACKAGES=mynets" in log), log[-5000:]
        with capfd.disabled():
            print(f"\nderived image built in {build_seconds:.0f} s; pipeline in containers: {pipeline_seconds:.0f} s, "
                  f"personalized accuracy {personalized:.3f}, global top1 {summary['global_model']['top1']:.3f}; "
                  f"the run in the un-derived image failed in {failed_seconds:.0f} s")
    finally:
        # the derived image (or the un-derived image's extra tag, after the second run): only this tag goes
        subprocess.run([podman(), "rmi", "--ignore", derived], capture_output=True, timeout=300)
