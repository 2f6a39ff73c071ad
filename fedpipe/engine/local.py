"""One client's local update: the algorithm's stages, run over device-resident batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedpipe.algorithms.base import Algorithm, Phase, Slots, Stage
from fedpipe.engine.data import Split


@dataclass(frozen=True)
class ClientStats:
    loss: float  # mean training loss over every sample seen (all stages and epochs)
    samples: int  # training samples processed (counting repeats over epochs)


def make_optimizer(kind: str, tensors: list[torch.Tensor], lr: float, momentum: float, weight_decay: float) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(tensors, lr=lr, weight_decay=weight_decay)
    return torch.optim.SGD(tensors, lr=lr, momentum=momentum, weight_decay=weight_decay)


def train_client(
    algorithm: Algorithm,
    phase: Phase,
    slots: Slots,
    stages: list[Stage],
    data: Split,
    *,
    batch_size: int,
    lr: float,
    optimizer: str,
    momentum: float,
    weight_decay: float,
    generator: torch.Generator,
) -> tuple[Slots, ClientStats]:
    """Run `stages` on `data` and return the trained slots (detached) and the client's statistics.

    Trainable slots are copied first, so the downloaded tensors (which other clients share) are
    never written. Each epoch shuffles with `generator`; the last batch may be smaller (no sample
    is dropped).
    """
    trained = {name for stage in stages for name in stage.trainable}
    slots = {
        name: {k: (t.detach().clone() if name in trained else t.detach()) for k, t in tensors.items()}
        for name, tensors in slots.items()
    }
    n = len(data)
    device = data.y.device
    loss_sum = torch.zeros((), device=device)
    seen = 0
    for stage in stages:
        params = [t for name in stage.trainable for t in slots[name].values()]
        for name in trained:  # only this stage's tensors collect gradients
            for t in slots[name].values():
                t.requires_grad_(name in stage.trainable)
        opt = make_optimizer(optimizer, params, lr * stage.lr_scale, momentum, weight_decay)
        for _ in range(stage.epochs):
            order = torch.randperm(n, generator=generator).to(device)
            for start in range(0, n, batch_size):
                idx = order[start : start + batch_size]
                noise = algorithm.batch_noise(phase, stage, generator)
                loss = stage.loss(slots, data.x[idx], data.y[idx], noise)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                loss_sum += loss.detach() * idx.numel()
                seen += idx.numel()
    for name in trained:
        for t in slots[name].values():
            t.requires_grad_(False)
    return slots, ClientStats(loss=float(loss_sum) / max(seen, 1), samples=seen)
