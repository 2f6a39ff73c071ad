"""The device a run trains on (`run.device`), and the check that a GPU given to this process is usable.

`auto` trains on the GPU when PyTorch can use one and on the CPU otherwise. That "otherwise" hides a
failure: a GPU task on a node whose NVIDIA driver is older than what this torch's CUDA needs (PyPI's
torch 2.13 is built for CUDA 13.0: driver >= 580) sees `torch.cuda.is_available()` False, and would
train on the CPU of a GPU node, the GPU held and idle, saying nothing. So before falling back to the
CPU, `resolve_device` asks whether this process *was given* a GPU (`gpu_given`); if it was, it stops
with `GpuUnusableError`, naming the driver found, the CUDA version torch was built for, the driver
that version needs, and the image build argument that picks another CUDA build.

Driver floors (NVIDIA, "CUDA Compatibility", minor version compatibility: an application built with
any CUDA 12.x runs on a driver >= 525, any 13.x on a driver >= 580). torch 2.13 is published for CUDA
12.6 and 13.0 (13.2 experimental); PyPI's is the 13.0 one.

Every probe takes its inputs as parameters (the environment, the /dev folder, the driver's /proc
file, the nvidia-smi command), so tests can fake a node without one.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

import torch

from fedpipe.errors import ConfigError, GpuUnusableError

#: Set by the pipeline on a training task to the number of GPUs the task requested from Kubernetes
#: (its accelerator count). >0: this process was given GPUs. 0: the task was compiled for the CPU, so
#: `auto` trains on the CPU even if some GPU is visible (it belongs to someone else). Unset (local
#: runs, where nothing allocates a GPU): the device files and the NVIDIA/CUDA variables decide.
ACCELERATOR_COUNT_ENV = "FEDPIPE_ACCELERATOR_COUNT"
#: The build argument of images/Dockerfile that picks where torch comes from, hence its CUDA version.
TORCH_BUILD_ARG = "TORCH_INDEX_URL"
#: torch 2.13's build for older drivers: (index URL, its CUDA version).
OLDER_CUDA_BUILD = ("https://download.pytorch.org/whl/cu126", "12.6")
#: Minimum NVIDIA driver branch per CUDA major version (minor version compatibility).
DRIVER_FLOOR = {11: 450, 12: 525, 13: 580}
DEV = Path("/dev")
PROC_DRIVER_VERSION = Path("/proc/driver/nvidia/version")
# "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 ..." (or "... Open Kernel Module for
# x86_64  580.65.06  Release Build ...")
_PROC_VERSION = re.compile(r"Kernel Module\b.*?\s(\d+\.\d+(?:\.\d+)?)\s")
_HIDDEN = {"", "void", "none"}  # NVIDIA_VISIBLE_DEVICES values that give no GPU (the NVIDIA container runtime's meaning)


def accelerator_count(env: Mapping[str, str]) -> int | None:
    """The GPU count the pipeline compiled this task with (`ACCELERATOR_COUNT_ENV`), or None when unset."""
    raw = env.get(ACCELERATOR_COUNT_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ConfigError(f"{ACCELERATOR_COUNT_ENV}={raw!r} must be a whole number of GPUs (0 for a CPU task).")
    return int(raw)


def gpu_given(env: Mapping[str, str], dev: Path = DEV) -> str | None:
    """What says this process was given a GPU, in words for an error message; None if nothing does.

    Evidence, first found wins: the pipeline's accelerator count; NVIDIA device files (`/dev/nvidia0`...,
    present whenever the NVIDIA runtime or CDI injected a GPU, even where NVIDIA_VISIBLE_DEVICES reads
    `void`, as CDI sets it); NVIDIA_VISIBLE_DEVICES naming devices (the device plugin's `envvar` and
    `volume-mounts` strategies); CUDA_VISIBLE_DEVICES naming devices (schedulers such as Slurm).
    """
    count = accelerator_count(env)
    if count is not None:
        return f"{ACCELERATOR_COUNT_ENV}={count} (the task asked Kubernetes for {count} GPU{'s' * (count > 1)})" if count else None
    files = sorted(p.name for p in dev.glob("nvidia[0-9]*"))  # one per GPU; not nvidiactl, nvidia-uvm, nvidia-caps
    if files:
        return "the device file" + "s" * (len(files) > 1) + " " + ", ".join(str(dev / f) for f in files)
    nvidia = env.get("NVIDIA_VISIBLE_DEVICES", "").strip()
    if nvidia.lower() not in _HIDDEN:
        return f"NVIDIA_VISIBLE_DEVICES={nvidia}"
    cuda = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    if cuda and not cuda.startswith("-1"):  # "" or "-1": CUDA's way to hide every GPU
        return f"CUDA_VISIBLE_DEVICES={cuda}"
    return None


def driver_version(proc_version: Path = PROC_DRIVER_VERSION, nvidia_smi: str | None = "nvidia-smi") -> str | None:
    """The NVIDIA driver's version ("580.65.06"): from the kernel module's /proc file, else from
    `nvidia-smi` (a command name or path; None: do not ask it); None when neither answers."""
    try:
        found = _PROC_VERSION.search(proc_version.read_text(errors="replace"))
        if found:
            return found.group(1)
    except OSError:
        pass
    command = shutil.which(nvidia_smi) if nvidia_smi else None
    if command is None:
        return None
    try:
        out = subprocess.run([command, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.stdout.strip().splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else ""
    return first if re.fullmatch(r"\d+\.\d+(?:\.\d+)?", first) else None


def minimum_driver(cuda: str | None) -> int | None:
    """The oldest NVIDIA driver branch that runs a torch built for CUDA `cuda` ("13.0"); None if unknown."""
    if not cuda:
        return None
    return DRIVER_FLOOR.get(int(cuda.split(".")[0]))


def unusable_gpu_message(evidence: str, driver: str | None, cuda: str | None, torch_version: str) -> str:
    """Why PyTorch cannot use the GPU this process was given, and what to do about it."""
    head = f"This process was given a GPU ({evidence}), but PyTorch cannot use it, and training on the CPU would leave the GPU idle: "
    cpu = " Or set run.device: cpu to train on the CPU on purpose."
    if not cuda:
        return (head + f"this torch ({torch_version}) is a CPU-only build. Use the CUDA image (tag <version>-cuda, "
                f"built with an empty {TORCH_BUILD_ARG})." + cpu)
    floor = minimum_driver(cuda)
    needs = f"driver >= {floor}" if floor else "a driver that supports it (NVIDIA's CUDA compatibility table)"
    built = f"this torch ({torch_version}) is built for CUDA {cuda}, which needs NVIDIA {needs}"
    older_url, older_cuda = OLDER_CUDA_BUILD
    older_floor = minimum_driver(older_cuda)
    rebuild = (f" Upgrade the node's NVIDIA driver, or use an image whose torch is built for an older CUDA: build it with "
               f"--build-arg {TORCH_BUILD_ARG}={older_url} (CUDA {older_cuda}, driver >= {older_floor}; images/README.md).")
    if driver is None:
        return (head + f"no NVIDIA driver found (no {PROC_DRIVER_VERSION}, no nvidia-smi), and {built}. Check that the node has "
                "the NVIDIA driver and that the NVIDIA container toolkit and device plugin run there." + rebuild + cpu)
    major = int(driver.split(".")[0])
    if floor is not None and major < floor:
        if older_floor is not None and floor > older_floor <= major:  # an older CUDA build runs on this driver
            return head + f"the node's NVIDIA driver is {driver}, too old: {built}." + rebuild + cpu
        return (head + f"the node's NVIDIA driver is {driver}, too old: {built}. No torch build of this version supports "
                "that driver: upgrade the node's NVIDIA driver." + cpu)
    return (head + f"the node's NVIDIA driver is {driver} and {built}, so the driver's version is not the cause. Check that "
            "the container has the GPU's device files (/dev/nvidia0, /dev/nvidiactl, /dev/nvidia-uvm), that "
            "CUDA_VISIBLE_DEVICES does not hide it, and what `nvidia-smi` says in the pod." + cpu)


def resolve_device(want: str, *, env: Mapping[str, str] | None = None, dev: Path = DEV,
                   proc_version: Path = PROC_DRIVER_VERSION, nvidia_smi: str | None = "nvidia-smi") -> torch.device:
    """The device for `run.device` = `want` ("auto", "cpu" or "cuda").

    cpu: the CPU, nothing probed. cuda: the GPU; an error if PyTorch cannot use one. auto: the GPU when
    PyTorch can use one (unless the pipeline compiled this task for the CPU), else the CPU, unless this
    process was given a GPU, which then stops the run (`GpuUnusableError`) rather than idle the GPU.
    """
    if want == "cpu":
        return torch.device("cpu")
    env = os.environ if env is None else env
    if want == "auto" and accelerator_count(env) == 0:
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    evidence = gpu_given(env, dev)
    if evidence is not None:
        driver = driver_version(proc_version, nvidia_smi)
        raise GpuUnusableError(unusable_gpu_message(evidence, driver, torch.version.cuda, torch.__version__))
    if want == "cuda":
        raise ConfigError("run.device=cuda but no GPU is visible to PyTorch; use run.device=auto or cpu.")
    return torch.device("cpu")
