"""How a phase's clients are trained when the config says `auto`: decided from facts that do not
change from one run of a config to the next, never from timings.

The engines agree within float tolerance, not bit for bit, so a choice made by timing them (as this
project once did) made a run's numbers depend on the machine's load. Here `auto` looks at:

- the device: on a GPU, clients train batched (`torch.func.vmap`; a method whose stages cannot be
  batched falls back to one by one, also deterministically) in one process;
- on a CPU, the usable cores (affinity and the cgroup CPU quota of a container) and the work of a
  round: with two cores or more and a round that trains at least `MIN_SAMPLES_FOR_PROCESSES`
  samples, one single-threaded process per core (at most one per client of the round), each
  training its clients one by one. Below that, starting the workers (about 3 s a phase: Python,
  torch and the dataset in each) costs more than they save.

The run records the choice beside the phase's checkpoints and reruns and resumes reuse it, so a
run continued on a machine with other cores still computes what it began computing.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from fedpipe.config import MAX_CLIENTS, MAX_PROCESSES

log = logging.getLogger(__name__)

MIN_SAMPLES_FOR_PROCESSES = 5_000


@dataclass(frozen=True)
class EngineChoice:
    """The resolved way to train a phase: how each process trains its clients, how many processes,
    and the CPU threads of each (None: PyTorch's default)."""

    clients: str  # "batched" or "sequential"
    processes: int
    threads: int | None
    why: str
    recorded: bool = False  # already in the run's record (or nothing to record)
    amp: str = "off"  # "bf16" or "off": engine.amp resolved (`amp_mode`)
    chunk: int | None = None  # engine.chunk=auto resolved by the first batched round (`fedpipe.engine.chunking`); None: not yet

    def to_json(self) -> dict:
        made = {"clients": self.clients, "processes": self.processes, "threads": self.threads, "why": self.why, "amp": self.amp}
        return made if self.chunk is None else {**made, "chunk": self.chunk}

    @classmethod
    def from_json(cls, d: dict, recorded: bool = False) -> EngineChoice:
        """A recorded choice (engine.json, read back from the store); ValueError when it is not one a run
        could have made. Its processes are clamped to the usable cores where they start (`capped`)."""
        made = cls(str(d["clients"]), int(d["processes"]), None if d.get("threads") is None else int(d["threads"]),
                   str(d.get("why", ""))[:1000], recorded, str(d.get("amp", "off")),  # records before amp: fp32
                   None if d.get("chunk") is None else int(d["chunk"]))
        if made.clients not in ("batched", "sequential"):
            raise ValueError(f"clients must be batched or sequential, not {made.clients[:50]!r}")
        if made.chunk is not None and not 1 <= made.chunk <= MAX_CLIENTS:
            raise ValueError(f"chunk must be between 1 and {MAX_CLIENTS}")
        if made.amp not in ("bf16", "off"):
            raise ValueError(f"amp must be bf16 or off, not {made.amp[:50]!r}")
        if made.processes < 1 or (made.threads is not None and made.threads < 1):
            raise ValueError("processes and threads must be at least 1")
        if made.processes > MAX_PROCESSES:  # the config's bound: the ranks re-validate the config it goes into
            log.warning("The recorded engine choice asks for %d processes, more than the %d a config may: using %d.",
                        made.processes, MAX_PROCESSES, MAX_PROCESSES)
            made = dataclasses.replace(made, processes=MAX_PROCESSES)
        return made


def usable_cores() -> int:
    """CPU cores this process may use: its affinity mask, bounded by a cgroup v2 CPU quota (a pod's
    CPU limit shows as cpu.max, while os.cpu_count() reports the node's cores)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.floor(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def capped(processes: int, threads: int | None, cores: int | None = None) -> tuple[int, int | None]:
    """Worker processes and threads per process, clamped to the usable cores (with a warning): more
    processes than cores only slow a phase down, and a config or a recorded engine.json asking for
    100,000 would otherwise fork until the machine gives out. Clamping never changes results (the
    engines agree within float tolerance whatever the number of processes)."""
    cores = usable_cores() if cores is None else cores
    if processes > cores:
        log.warning("%d worker processes asked for, but only %d CPU cores are usable here: running %d.", processes, cores, cores)
        processes = cores
    if threads is not None and threads > cores:
        log.warning("%d CPU threads per process asked for, but only %d cores are usable here: using %d.", threads, cores, cores)
        threads = cores
    return processes, threads


def clients_mode(requested: str, device_type: str) -> str:
    """engine.clients resolved: `auto` is batched on a GPU, one by one on a CPU."""
    if requested != "auto":
        return requested
    return "batched" if device_type == "cuda" else "sequential"


def amp_mode(requested: str, device: torch.device, refusal: str | None = None) -> str:
    """engine.amp resolved: `auto` is bf16 on a GPU with bf16 tensor cores (compute capability 8.0 and
    up: A100, H100, L4, RTX 30xx+), where it runs the forward at up to twice the speed with fp32
    master weights; off elsewhere (on a CPU bf16 autocast is slower than fp32 unless it has AMX), and
    off for a method that opts out (`refusal`: its `Algorithm.bf16_refusal`)."""
    if requested != "auto":
        return requested
    if refusal:
        return "off"
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        if torch.cuda.get_device_capability(index)[0] >= 8 and torch.cuda.is_bf16_supported():
            return "bf16"
    return "off"


def choose(
    *,
    clients: str,
    processes: int | str,
    threads: int | None,
    device_type: str,
    cores: int,
    clients_per_round: int,
    samples_per_round: int,
) -> EngineChoice:
    """Resolve `engine.clients` and `engine.processes` (either may be `auto`) from static facts."""
    mode = clients_mode(clients, device_type)
    if processes != "auto":
        return EngineChoice(mode, int(processes), threads, f"engine.processes={processes} as configured")
    if device_type == "cuda":
        return EngineChoice(mode, 1, threads, "one process on the GPU")
    world = min(cores, clients_per_round)
    if world < 2 or samples_per_round < MIN_SAMPLES_FOR_PROCESSES:
        why = (f"one process: {cores} usable CPU core{'s' * (cores != 1)}, {clients_per_round} clients and "
               f"{samples_per_round:,} training samples a round (processes pay from {MIN_SAMPLES_FOR_PROCESSES:,} on 2+ cores)")
        return EngineChoice(mode, 1, threads, why)
    why = (f"{world} single-threaded processes: {cores} usable CPU cores, {clients_per_round} clients and "
           f"{samples_per_round:,} training samples a round")
    return EngineChoice(mode, world, threads or 1, why)
