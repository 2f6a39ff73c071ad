"""`run.device` and the GPU probe (fedpipe/engine/devices.py): a process that was given a GPU which
PyTorch cannot use stops with the driver found, torch's CUDA version, the driver it needs and the
image build argument, instead of training on the CPU with the GPU idle.

No GPU is needed: CUDA's answer is faked (torch.cuda.is_available, torch.version.cuda), the node is a
fake /dev folder, a fake /proc/driver/nvidia/version file and a fake nvidia-smi, passed as parameters.
"""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest
import torch

from fedpipe.engine import devices
from fedpipe.engine.devices import (
    ACCELERATOR_COUNT_ENV,
    TORCH_BUILD_ARG,
    driver_version,
    gpu_given,
    resolve_device,
)
from fedpipe.errors import ConfigError, FedpipeError, GpuUnusableError

REPO = Path(__file__).resolve().parents[1]
# The two formats of the kernel module's /proc file (proprietary and open modules).
PROC_PROPRIETARY = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\nGCC version:  gcc version 12.2.0\n"
PROC_OPEN = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  "
             "(dvs-builder@U16-I3-B03-4-3)  Tue Jul 22 16:02:11 UTC 2025\nGCC version:  gcc version 12.3.0\n")


class Node:
    """A fake node: a /dev folder, the driver's /proc file, no nvidia-smi unless one is added."""

    def __init__(self, root: Path):
        self.dev = root / "dev"
        self.dev.mkdir(parents=True)
        self.proc = root / "proc-driver-nvidia-version"  # absent: no driver
        self.smi: str | None = None

    def give_gpu(self, index: int = 0) -> Node:
        for name in (f"nvidia{index}", "nvidiactl", "nvidia-uvm"):
            (self.dev / name).touch()
        return self

    def driver(self, proc_text: str) -> Node:
        self.proc.write_text(proc_text)
        return self

    def nvidia_smi(self, prints: str) -> Node:
        script = self.proc.parent / "nvidia-smi"
        script.write_text(f"#!/bin/sh\nprintf '{prints}'\n")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
        self.smi = str(script)
        return self

    def resolve(self, want: str, env: dict | None = None) -> torch.device:
        return resolve_device(want, env=env or {}, dev=self.dev, proc_version=self.proc, nvidia_smi=self.smi)


@pytest.fixture
def node(tmp_path) -> Node:
    return Node(tmp_path)


@pytest.fixture
def no_cuda(monkeypatch):
    """PyTorch cannot use any GPU (what an old driver looks like from torch), and torch is the CUDA 13.0 build."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu130")


def unusable(node: Node, want: str = "auto", env: dict | None = None) -> str:
    with pytest.raises(GpuUnusableError) as raised:
        node.resolve(want, env)
    return str(raised.value)


# --- the four cases ------------------------------------------------------------------------------------


def test_a_gpu_given_with_an_old_driver_stops_naming_driver_cuda_floor_and_build_arg(node, no_cuda):
    message = unusable(node.give_gpu().driver(PROC_PROPRIETARY))
    assert "/dev/nvidia0" in message  # what says a GPU was given
    assert "driver is 535.104.05, too old" in message
    assert "built for CUDA 13.0, which needs NVIDIA driver >= 580" in message
    assert f"--build-arg {TORCH_BUILD_ARG}=https://download.pytorch.org/whl/cu126 (CUDA 12.6, driver >= 525" in message
    assert "run.device: cpu" in message
    assert issubclass(GpuUnusableError, FedpipeError)  # the CLI prints it without a traceback


def test_no_gpu_given_trains_on_the_cpu_silently(node, no_cuda):
    assert node.driver(PROC_PROPRIETARY).resolve("auto") == torch.device("cpu")
    env = {"NVIDIA_VISIBLE_DEVICES": "void", "CUDA_VISIBLE_DEVICES": ""}
    assert node.resolve("auto", env) == torch.device("cpu")


def test_cpu_chosen_trains_on_the_cpu_even_with_a_gpu_given(node, no_cuda):
    node.give_gpu().driver(PROC_PROPRIETARY)
    assert node.resolve("cpu", {ACCELERATOR_COUNT_ENV: "1"}) == torch.device("cpu")
    with pytest.raises(GpuUnusableError):  # the same node under auto: the probe would have stopped it
        node.resolve("auto", {ACCELERATOR_COUNT_ENV: "1"})


def test_too_old_a_driver_and_no_driver_at_all_say_different_things(node, no_cuda):
    node.give_gpu()
    none_found = unusable(node)
    assert "no NVIDIA driver found" in none_found and "too old" not in none_found
    assert "built for CUDA 13.0, which needs NVIDIA driver >= 580" in none_found and TORCH_BUILD_ARG in none_found
    too_old = unusable(node.driver(PROC_PROPRIETARY))
    assert "535.104.05, too old" in too_old and "no NVIDIA driver found" not in too_old


def test_a_driver_new_enough_is_not_blamed(node, no_cuda):
    message = unusable(node.give_gpu().driver(PROC_OPEN))
    assert "580.65.06" in message and "not the cause" in message and "too old" not in message
    assert "/dev/nvidiactl" in message  # what to check instead


def test_a_driver_older_than_every_torch_build_says_upgrade(node, no_cuda):
    message = unusable(node.give_gpu().driver(PROC_PROPRIETARY.replace("535.104.05", "470.239.06")))
    assert "470.239.06, too old" in message and "upgrade the node's NVIDIA driver" in message
    assert TORCH_BUILD_ARG not in message  # the CUDA 12.6 build needs >= 525 too: no build to offer


def test_a_cpu_only_torch_given_a_gpu_points_at_the_cuda_image(node, no_cuda, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    message = unusable(node.give_gpu().driver(PROC_OPEN))
    assert "2.13.0+cpu) is a CPU-only build" in message and "-cuda" in message


def test_cuda_chosen_without_a_gpu_given_is_a_config_error(node, no_cuda):
    with pytest.raises(ConfigError, match="run.device=cuda but no GPU is visible"):
        node.resolve("cuda")
    assert "535.104.05" in unusable(node.give_gpu().driver(PROC_PROPRIETARY), "cuda")


def test_a_usable_gpu_is_used(node, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert node.give_gpu().resolve("auto") == torch.device("cuda")
    assert node.resolve("cuda") == torch.device("cuda")


# --- what counts as "given a GPU" -------------------------------------------------------------------------


@pytest.mark.parametrize(("env", "given"), [
    ({}, False),
    ({"NVIDIA_VISIBLE_DEVICES": "GPU-3f2c8a1e-0000-1111-2222-333344445555"}, True),  # device plugin, envvar strategy
    ({"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"}, True),  # device plugin, volume-mounts
    ({"NVIDIA_VISIBLE_DEVICES": "all"}, True),
    ({"NVIDIA_VISIBLE_DEVICES": "void"}, False),  # the image's own value, and CDI's
    ({"NVIDIA_VISIBLE_DEVICES": "none"}, False),
    ({"NVIDIA_VISIBLE_DEVICES": ""}, False),
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, True),
    ({"CUDA_VISIBLE_DEVICES": ""}, False),
    ({"CUDA_VISIBLE_DEVICES": "-1"}, False),
    ({ACCELERATOR_COUNT_ENV: "2"}, True),
    ({ACCELERATOR_COUNT_ENV: "0"}, False),
    ({ACCELERATOR_COUNT_ENV: ""}, False),
])
def test_gpu_given_reads_the_environment(node, env, given):
    evidence = gpu_given(env, node.dev)
    assert (evidence is not None) == given, evidence
    if given:
        assert next(iter(env.values())) in evidence  # the message quotes what it found


def test_device_files_say_given_even_when_cdi_sets_void(node):
    assert gpu_given({"NVIDIA_VISIBLE_DEVICES": "void"}, node.dev) is None
    (node.dev / "nvidiactl").touch()
    (node.dev / "nvidia-uvm").touch()
    assert gpu_given({}, node.dev) is None  # control files alone are no GPU
    node.give_gpu(3)
    assert gpu_given({"NVIDIA_VISIBLE_DEVICES": "void"}, node.dev) == f"the device file {node.dev / 'nvidia3'}"


def test_the_pipelines_count_wins_over_what_the_node_shows(node, no_cuda, monkeypatch):
    node.give_gpu().driver(PROC_PROPRIETARY)
    # Compiled for the CPU: a GPU that shows up anyway is someone else's, even when CUDA could use it.
    assert gpu_given({ACCELERATOR_COUNT_ENV: "0"}, node.dev) is None
    assert node.resolve("auto", {ACCELERATOR_COUNT_ENV: "0"}) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert node.resolve("auto", {ACCELERATOR_COUNT_ENV: "0"}) == torch.device("cpu")
    assert node.resolve("auto", {}) == torch.device("cuda")
    # Asked for a GPU: given, even where the node shows no device file.
    empty = Node(node.proc.parent / "other")  # no /dev/nvidia*, no driver
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no NVIDIA driver found" in unusable(empty, env={ACCELERATOR_COUNT_ENV: "1"})


def test_a_malformed_accelerator_count_is_named(node):
    with pytest.raises(ConfigError, match=ACCELERATOR_COUNT_ENV):
        gpu_given({ACCELERATOR_COUNT_ENV: "one"}, node.dev)


# --- reading the driver's version ---------------------------------------------------------------------


def test_driver_version_from_proc_then_nvidia_smi(node):
    assert driver_version(node.driver(PROC_PROPRIETARY).proc, None) == "535.104.05"
    assert driver_version(node.driver(PROC_OPEN).proc, None) == "580.65.06"
    node.proc.unlink()
    assert driver_version(node.proc, None) is None
    node.nvidia_smi("550.54.15\\n550.54.15\\n")  # one line per GPU
    assert driver_version(node.proc, node.smi) == "550.54.15"
    node.nvidia_smi("NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.\\n")
    assert driver_version(node.proc, node.smi) is None
    assert driver_version(node.proc, str(node.dev / "no-such-nvidia-smi")) is None


def test_the_message_uses_nvidia_smi_when_proc_is_missing(node, no_cuda):
    message = unusable(node.give_gpu().nvidia_smi("550.54.15\\n"))
    assert "550.54.15, too old" in message


# --- the facts the message relies on ---------------------------------------------------------------------


def test_the_build_arg_named_is_the_dockerfiles():
    dockerfile = (REPO / "images" / "Dockerfile").read_text()
    assert re.search(rf"^ARG {TORCH_BUILD_ARG}=", dockerfile, re.MULTILINE)
    assert f"{TORCH_BUILD_ARG}={devices.OLDER_CUDA_BUILD[0]}" in (REPO / "images" / "README.md").read_text()


def test_driver_floors_per_cuda_major():
    assert devices.minimum_driver("13.0") == 580 and devices.minimum_driver("13.2") == 580
    assert devices.minimum_driver("12.6") == 525
    assert devices.minimum_driver(None) is None and devices.minimum_driver("99.0") is None


# --- wired into the run -------------------------------------------------------------------------------------


def test_run_device_and_train_use_the_probe(tmp_path, monkeypatch, no_cuda):
    from runs import small_run

    run = small_run(tmp_path / "runs")
    assert run.device == torch.device("cpu")  # nothing given here (the fake count below is what gives one)
    monkeypatch.setenv(ACCELERATOR_COUNT_ENV, "1")
    with pytest.raises(GpuUnusableError, match=f"{ACCELERATOR_COUNT_ENV}=1"):
        run.device  # noqa: B018
    # First thing a phase does: not partitioned yet, so anything past the probe would fail otherwise.
    with pytest.raises(GpuUnusableError):
        run.train(run.phases()[0].name)
