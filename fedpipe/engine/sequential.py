"""One client's local update: the algorithm's stages, run over device-resident batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedpipe.algorithms.base import Algorithm, ClientContext, Slots, Stage
from fedpipe.engine.schedule import stage_epochs


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
    """bf16 autocast of the forward (and so of its backward) when asked, on a GPU or a CPU; the weights,
    their gradients, the optimizer's buffers and every aggregation stay fp32 (autocast casts an op's
    inputs, never a parameter)."""
    kind = device.type if device.type in ("cuda", "cpu") else "cpu"
    return torch.autocast(kind, dtype=torch.bfloat16, enabled=amp and device.type in ("cuda", "cpu"))


@torch.no_grad()
def _validation_loss(stage: Stage, slots: Slots, ctx: ClientContext, batch_size: int) -> float:
    val = ctx.data.val
    total = sum(float(stage.loss(slots, val.x[i : i + batch_size], val.y[i : i + batch_size], None)) * len(val.y[i : i + batch_size])
                for i in range(0, len(val), batch_size))
    return total / max(len(val), 1)


@dataclass(frozen=True)
class LocalOptim:
    """The run's local optimisation settings, as `train_client` takes them."""

    batch_size: int
    lr: float
    optimizer: str
    momentum: float
    weight_decay: float
    amp: bool = False


class _Tally:
    """Sum of batch losses weighted by batch size, and samples seen (kept on the device: no sync per step)."""

    def __init__(self, device: torch.device):
        self.loss_sum = torch.zeros((), device=device)
        self.seen = 0

    def add(self, loss: torch.Tensor, count: int) -> None:
        self.loss_sum += loss.detach() * count
        self.seen += count

    def stats(self) -> ClientStats:
        return ClientStats(loss=float(self.loss_sum) / max(self.seen, 1), samples=self.seen)


class _EarlyStop:
    """A stage's early stopping: after each epoch, the validation loss; keeps the best epoch's tensors."""

    def __init__(self, stage: Stage, ctx: ClientContext, batch_size: int):
        self.stage, self.ctx, self.batch_size = stage, ctx, max(batch_size, 256)
        self.active = stage.early_stopping is not None and len(ctx.data.val) > 0
        self.best: Slots | None = None
        self.best_loss, self.waited = float("inf"), 0

    def stop_after_epoch(self, slots: Slots) -> bool:
        """Record the epoch; True when the stage should stop (no improvement for `patience` epochs)."""
        if not self.active:
            return False
        val_loss = _validation_loss(self.stage, slots, self.ctx, self.batch_size)
        if val_loss < self.best_loss:
            self.best_loss, self.waited = val_loss, 0
            self.best = {name: {k: t.detach().clone() for k, t in slots[name].items()} for name in self.stage.trainable}
            return False
        self.waited += 1
        return self.waited >= self.stage.early_stopping.patience

    def restore_best(self, slots: Slots) -> None:
        if self.best is not None:
            for name, tensors in self.best.items():
                for k, t in tensors.items():
                    slots[name][k].data.copy_(t)


def _own_copies(slots: Slots, trained: set[str], memory_format_cl: bool) -> Slots:
    """The trained slots copied (the downloaded tensors are shared by other clients), in channels-last
    layout when asked; frozen slots are read as they are."""
    slots = {
        name: {k: (t.detach().clone() if name in trained else t.detach()) for k, t in tensors.items()}
        for name, tensors in slots.items()
    }
    if memory_format_cl:
        slots = {name: (channels_last(tensors) if name in trained else tensors) for name, tensors in slots.items()}
    return slots


def _train_stage(algorithm: Algorithm, ctx: ClientContext, slots: Slots, stage: Stage, trained: set[str],
                 opt_cfg: LocalOptim, generator: torch.Generator, tally: _Tally) -> None:
    """Run one stage in place on `slots`: its epochs (from the shared schedule), with early stopping."""
    data, device = ctx.data.train, ctx.data.train.y.device
    for name in trained:  # only this stage's tensors collect gradients
        for t in slots[name].values():
            t.requires_grad_(name in stage.trainable)
    stage_lr = stage.lr if stage.lr is not None else opt_cfg.lr * stage.lr_scale
    opt = None
    if not stage.update:
        params = [t for name in stage.trainable for t in slots[name].values()]
        opt = make_optimizer(opt_cfg.optimizer, params, stage_lr, opt_cfg.momentum, opt_cfg.weight_decay)
    early = _EarlyStop(stage, ctx, opt_cfg.batch_size)
    for epoch in stage_epochs(algorithm, ctx, stage, opt_cfg.batch_size, generator):
        for step in epoch:
            x, y = data.x[step.index], data.y[step.index]
            if stage.update is not None:
                loss = stage.update(slots, x, y, step.noise, stage_lr)
            else:
                with autocast(device, opt_cfg.amp):
                    loss = stage.loss(slots, x, y, step.noise)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            if stage.after_step is not None:
                with torch.no_grad():
                    stage.after_step(slots)
            tally.add(loss, step.index.numel())
        if early.stop_after_epoch(slots):
            break
    early.restore_best(slots)


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
    never written. Each epoch's shuffle and noise come from `generator` through the shared schedule
    (`fedpipe.engine.schedule`); the last batch may be smaller (no sample is dropped). A stage with
    early stopping keeps the tensors of its epoch with the lowest validation loss. `memory_format_cl`
    trains convolution weights in channels-last layout (the returned tensors are contiguous again);
    `amp` turns on bf16 autocast on a GPU.
    """
    opt_cfg = LocalOptim(batch_size, lr, optimizer, momentum, weight_decay, amp)
    trained = {name for stage in stages for name in stage.trainable}
    slots = _own_copies(slots, trained, memory_format_cl)
    tally = _Tally(ctx.data.train.y.device)
    for stage in stages:
        _train_stage(algorithm, ctx, slots, stage, trained, opt_cfg, generator, tally)
    for name in trained:
        for t in slots[name].values():
            t.requires_grad_(False)
    if memory_format_cl:
        slots = {name: ({k: t.contiguous() for k, t in tensors.items()} if name in trained else tensors) for name, tensors in slots.items()}
    return slots, tally.stats()
