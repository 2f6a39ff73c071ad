"""`engine.chunk: auto`: the largest batched chunk whose memory fits a budget, from one probe.

A chunk of K clients holds, per client: a stacked copy of every slot tensor (the trained ones get a
gradient and a momentum buffer besides), one mini-batch of inputs, and the activations autograd
saves for the backward of one step. The probe measures the last exactly, on whatever device: one
forward of the client's first stage loss on one batch, with `saved_tensors_hooks` adding up the
bytes of what autograd keeps (each storage once). The per-client figure times `SAFETY` (the
step's temporaries: summed gradients, the SGD update's intermediates, vmap's batching of
intermediates) divides the budget: `engine.chunk_memory_fraction` of the GPU's free memory, or of
the CPU's available memory. Decided once per phase from these static facts and recorded beside
the phase's checkpoints, like the other engine choices, so a resume on a bigger GPU computes what
the run began computing.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fedpipe.algorithms.base import Algorithm, ClientContext, Slots, Stage
from fedpipe.engine.schedule import stage_steps

#: Room for the step's temporaries beyond what the probe counts.
SAFETY = 1.5
#: Bytes assumed available on a CPU whose /proc/meminfo cannot be read.
FALLBACK_CPU_BYTES = 4 << 30


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def client_bytes(algorithm: Algorithm, ctx: ClientContext, slots: Slots, stages: list[Stage], batch_size: int,
                 generator: torch.Generator) -> int:
    """Bytes one more client adds to a batched chunk (before `SAFETY`)."""
    weights = sum(_bytes(t) for tensors in slots.values() for t in tensors.values())
    if not stages:  # a client that trains nothing this round (IFCA's stage-less rounds): its slots only
        return weights
    stage = stages[0]
    trained = {name for s in stages for name in s.trainable}
    optimizer = 2 * sum(_bytes(t) for name in trained for t in slots[name].values())  # gradient + momentum buffer
    steps = stage_steps(algorithm, ctx, stage, batch_size, generator)
    if not steps:  # no training samples: nothing is stepped
        return weights + optimizer
    step = steps[0]
    x, y = ctx.data.train.x[step.index], ctx.data.train.y[step.index]
    probe = {name: {k: t.detach().clone().requires_grad_(name in stage.trainable) for k, t in tensors.items()}
             for name, tensors in slots.items()}
    seen: dict[tuple, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[(storage.data_ptr(), t.device)] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stage.loss(probe, x, y, step.noise)
    params = {t.untyped_storage().data_ptr() for tensors in probe.values() for t in tensors.values()}
    saved = sum(n for (ptr, _), n in seen.items() if ptr not in params)  # the weights are counted above
    return weights + optimizer + _bytes(x) + _bytes(y) + saved


def memory_budget(device: torch.device, fraction: float) -> int:
    """`fraction` of the device's free memory (a GPU's, from the driver) or of the CPU's available memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(int(line.split()[1]) * 1024 * fraction)
    except (OSError, ValueError, IndexError):
        pass
    return int(FALLBACK_CPU_BYTES * fraction)


def auto_chunk(per_client: int, budget: int, clients_per_round: int) -> int:
    """The largest chunk within `budget` (at least 1, at most the clients a round trains)."""
    fits = int(budget // max(int(per_client * SAFETY), 1))
    return max(1, min(fits, max(clients_per_round, 1)))
