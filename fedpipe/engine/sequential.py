"""One client's local update: the algorithm's stages, run over device-resident batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedpipe.algorithms.base import Algorithm, ClientContext, Slots, Stage


@dataclass(frozen=True)
class ClientStats:
    loss: float  # mean training loss over every sample seen (all stages and epochs)
    samples: int  # training samples processed (counting repeats over epochs)


def make_optimizer(kind: str, tensors: list[torch.Tensor], lr: float, momentum: float, weight_decay: float) -> torch.optim.Optimizer:
    """torch.optim's SGD or Adam with the fused kernel (one pass over each tensor instead of several:
    the step was a quarter of a batch-10 step of the MNIST CNN on a CPU with the per-tensor loop)."""
    if kind == "adam":
        return torch.optim.Adam(tensors, lr=lr, weight_decay=weight_decay, fused=True)
    opt = torch.optim.SGD(tensors, lr=lr, momentum=momentum, weight_decay=weight_decay, fused=True)
    if momentum:
        # Buffers start at zero rather than unset: momentum * 0 + d equals SGD's first-step buffer d
        # exactly, and the fused kernel cannot mix set and unset buffers (a tensor that got no
        # gradient on the first step, such as an unused FedMN unit).
        for t in tensors:
            opt.state[t]["momentum_buffer"] = torch.zeros_like(t)
    return opt


def channels_last(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Convolution weights in channels-last layout (oneDNN and cuDNN pick faster kernels for it);
    values are unchanged, only strides."""
    return {k: (t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t) for k, t in params.items()}


def autocast(device: torch.device, amp: bool):
    """bf16 autocast on a GPU when asked; a no-op context elsewhere."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp and device.type == "cuda")


@torch.no_grad()
def _validation_loss(stage: Stage, slots: Slots, ctx: ClientContext, batch_size: int) -> float:
    val = ctx.data.val
    total = sum(float(stage.loss(slots, val.x[i : i + batch_size], val.y[i : i + batch_size], None)) * len(val.y[i : i + batch_size])
                for i in range(0, len(val), batch_size))
    return total / max(len(val), 1)


def train_client(
    algorithm: Algorithm,
    ctx: ClientContext,
    slots: Slots,
    stages: list[Stage],
    *,
    batch_size: int,
    lr: float,
    optimizer: str,
    momentum: float,
    weight_decay: float,
    generator: torch.Generator,
    memory_format_cl: bool = False,
    amp: bool = False,
) -> tuple[Slots, ClientStats]:
    """Run `stages` on the client's training split and return the trained slots (detached) and statistics.

    Trainable slots are copied first, so the downloaded tensors (which other clients share) are
    never written. Each epoch shuffles with `generator`; the last batch may be smaller (no sample
    is dropped). A stage with early stopping keeps the tensors of its epoch with the lowest
    validation loss. `memory_format_cl` trains convolution weights in channels-last layout (the
    returned tensors are contiguous again); `amp` turns on bf16 autocast on a GPU.
    """
    data = ctx.data.train
    trained = {name for stage in stages for name in stage.trainable}
    slots = {
        name: {k: (t.detach().clone() if name in trained else t.detach()) for k, t in tensors.items()}
        for name, tensors in slots.items()
    }
    if memory_format_cl:  # the trained copies only: a frozen slot is read in whatever layout it has
        slots = {name: (channels_last(tensors) if name in trained else tensors) for name, tensors in slots.items()}
    n = len(data)
    device = data.y.device
    loss_sum = torch.zeros((), device=device)
    seen = 0
    for stage in stages:
        params = [t for name in stage.trainable for t in slots[name].values()]
        for name in trained:  # only this stage's tensors collect gradients
            for t in slots[name].values():
                t.requires_grad_(name in stage.trainable)
        stage_lr = stage.lr if stage.lr is not None else lr * stage.lr_scale
        opt = None if stage.update else make_optimizer(optimizer, params, stage_lr, momentum, weight_decay)
        best, best_loss, waited = None, float("inf"), 0
        for _ in range(stage.epochs):
            order = torch.randperm(n, generator=generator).to(device)
            noise = algorithm.batch_noise(ctx, stage, generator) if stage.noise_per == "epoch" else None
            for start in range(0, n, batch_size):
                idx = order[start : start + batch_size]
                if stage.noise_per == "batch":
                    noise = algorithm.batch_noise(ctx, stage, generator)
                if stage.update is not None:
                    loss = stage.update(slots, data.x[idx], data.y[idx], noise, stage_lr)
                else:
                    with autocast(device, amp):
                        loss = stage.loss(slots, data.x[idx], data.y[idx], noise)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                if stage.after_step is not None:
                    with torch.no_grad():
                        stage.after_step(slots)
                loss_sum += loss.detach() * idx.numel()
                seen += idx.numel()
            if stage.early_stopping is not None and len(ctx.data.val):
                val_loss = _validation_loss(stage, slots, ctx, max(batch_size, 256))
                if val_loss < best_loss:
                    best_loss, waited = val_loss, 0
                    best = {name: {k: t.detach().clone() for k, t in slots[name].items()} for name in stage.trainable}
                else:
                    waited += 1
                    if waited >= stage.early_stopping.patience:
                        break
        if best is not None:
            for name, tensors in best.items():
                for k, t in tensors.items():
                    slots[name][k].data.copy_(t)
    for name in trained:
        for t in slots[name].values():
            t.requires_grad_(False)
    if memory_format_cl:
        slots = {name: ({k: t.contiguous() for k, t in tensors.items()} if name in trained else tensors) for name, tensors in slots.items()}
    return slots, ClientStats(loss=float(loss_sum) / max(seen, 1), samples=seen)
