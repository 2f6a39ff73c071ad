"""Many clients' local updates at once: one stacked copy of each trained tensor per client, the
algorithm's (pure) stage loss mapped over clients with `torch.func.vmap`, and SGD applied to the
stack with a mask, so a client that has run out of batches no longer moves.

It computes what `fedpipe.engine.sequential.train_client` computes for each client, within float
tolerance: the same shuffles and the same per-batch noise (SuPerFed's lam), drawn from each client's
own generator in the same order; the same mini-batches (the last one of an epoch may be smaller:
clients are grouped by batch size at each step, so no padding enters a loss); PyTorch's SGD rule
(weight decay added to the gradient, momentum buffer starting at the first gradient, no dampening).

What it cannot run (`batchable` says why): custom per-batch updates (pFedMe), in-place fix-ups
after a step (pFedMB's projection), early stopping (the mixture of experts), Adam, and models whose
layers have no vmap rule (an LSTM). Those clients train one by one.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.func import vmap

from fedpipe.algorithms.base import Algorithm, ClientContext, Slots, Stage
from fedpipe.engine.sequential import ClientStats, autocast


@dataclass
class BatchJob:
    """One client's part of a batched chunk: its context, its slots (as `client_params` built them),
    its stages and its own generator."""

    ctx: ClientContext
    slots: Slots
    stages: list[Stage]
    generator: torch.Generator


def stage_key(stage: Stage) -> tuple:
    """Clients whose stages agree on these can share stacked steps (the loss is the same function)."""
    loss = getattr(stage.loss, "__func__", stage.loss)
    return (stage.trainable, stage.epochs, stage.lr, stage.lr_scale, stage.noise_per, loss)


def batchable(stages: list[Stage], optimizer: str) -> str | None:
    """None when these stages can run batched, else the reason in plain words."""
    if optimizer != "sgd":
        return f"optimizer {optimizer!r} (the batched step implements SGD)"
    for stage in stages:
        if stage.update is not None:
            return "a custom per-batch update"
        if stage.after_step is not None:
            return "an in-place fix-up after each step"
        if stage.early_stopping is not None:
            return "early stopping"
    return None


def _schedule(algorithm: Algorithm, job: BatchJob, stage: Stage, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The client's (batch indices, noise) for every step of `stage`, drawn exactly as train_client draws them."""
    n, device = len(job.ctx.data.train), job.ctx.data.train.y.device
    steps = []
    for _ in range(stage.epochs):
        order = torch.randperm(n, generator=job.generator).to(device)
        noise = algorithm.batch_noise(job.ctx, stage, job.generator) if stage.noise_per == "epoch" else None
        for start in range(0, n, batch_size):
            if stage.noise_per == "batch":
                noise = algorithm.batch_noise(job.ctx, stage, job.generator)
            steps.append((order[start : start + batch_size], noise))
    return steps


def _same_object(tensors: list[torch.Tensor]) -> bool:
    return all(t is tensors[0] for t in tensors[1:])


def train_batched(
    algorithm: Algorithm,
    jobs: list[BatchJob],
    *,
    batch_size: int,
    lr: float,
    momentum: float,
    weight_decay: float,
    amp: bool = False,
) -> list[tuple[Slots, ClientStats]]:
    """Train `jobs` (same slot layout and stage keys) together; returns each client's trained slots
    (detached, owning their memory) and statistics, in the order of `jobs`."""
    first = jobs[0]
    count = len(jobs)
    device = first.ctx.data.train.y.device
    trained = {name for stage in first.stages for name in stage.trainable}
    # Stacked tensors: [clients, ...]. A slot every client reads from one shared tensor (the
    # downloaded global model as an anchor) and none trains stays unstacked (in_dims None).
    stacked: dict[str, dict[str, torch.Tensor]] = {}
    dims: dict[str, dict[str, int | None]] = {}
    for name, tensors in first.slots.items():
        stacked[name], dims[name] = {}, {}
        for k in tensors:
            column = [job.slots[name][k] for job in jobs]
            if name not in trained and _same_object(column):
                stacked[name][k], dims[name][k] = column[0].detach(), None
            else:
                stacked[name][k], dims[name][k] = torch.stack([t.detach() for t in column]).clone(), 0
    loss_sums = torch.zeros(count, device=device)
    seen = [0] * count

    for s, stage in enumerate(first.stages):
        stage_lr = stage.lr if stage.lr is not None else lr * stage.lr_scale
        params = {name: stacked[name] for name in stage.trainable}
        for name in trained:
            for t in stacked[name].values():
                t.requires_grad_(name in stage.trainable)
        buffers = {(name, k): torch.zeros_like(t) for name in stage.trainable for k, t in stacked[name].items()}
        schedules = [_schedule(algorithm, job, job.stages[s], batch_size) for job in jobs]
        noise_dim = None if all(step[1] is None for sched in schedules for step in sched) else 0
        mapped = vmap(stage.loss, in_dims=(dims, 0, 0, noise_dim))
        for t in range(max(len(sched) for sched in schedules)):
            active = [c for c in range(count) if t < len(schedules[c])]
            groups: dict[int, list[int]] = defaultdict(list)
            for c in active:
                groups[int(schedules[c][t][0].numel())].append(c)
            grads: dict[tuple[str, str], torch.Tensor] = {}
            for size, rows in groups.items():
                whole = len(rows) == count
                index = None if whole else torch.tensor(rows, device=device)
                view = {name: {k: (v if dims[name][k] is None or whole else v[index]) for k, v in tensors.items()} for name, tensors in stacked.items()}
                x = torch.stack([jobs[c].ctx.data.train.x[schedules[c][t][0]] for c in rows])
                y = torch.stack([jobs[c].ctx.data.train.y[schedules[c][t][0]] for c in rows])
                noise = None if noise_dim is None else torch.stack([schedules[c][t][1] for c in rows]).to(device)
                with autocast(device, amp):
                    losses = mapped(view, x, y, noise)
                keys = [(name, k) for name in params for k in params[name]]
                group_grads = torch.autograd.grad(losses.sum(), [params[name][k] for name, k in keys])
                for key, g in zip(keys, group_grads):
                    grads[key] = g if key not in grads else grads[key] + g
                with torch.no_grad():
                    if whole:
                        loss_sums += losses.detach() * size
                    else:
                        loss_sums.index_add_(0, index, losses.detach() * size)
                for c in rows:
                    seen[c] += size
            mask = None
            if len(active) < count:
                mask = torch.zeros(count, dtype=torch.bool, device=device)
                mask[active] = True
            with torch.no_grad():
                for key, g in grads.items():
                    _sgd_step(params[key[0]][key[1]], g, buffers[key], mask, stage_lr, momentum, weight_decay)

    for name in trained:
        for t in stacked[name].values():
            t.requires_grad_(False)
    results = []
    for c, job in enumerate(jobs):
        slots = {
            name: {k: (stacked[name][k][c].clone() if dims[name][k] == 0 and name in trained else job.slots[name][k].detach()) for k in tensors}
            for name, tensors in job.slots.items()
        }
        results.append((slots, ClientStats(loss=float(loss_sums[c]) / max(seen[c], 1), samples=seen[c])))
    return results


def _sgd_step(p: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, mask: torch.Tensor | None,
              lr: float, momentum: float, weight_decay: float) -> None:
    """torch.optim.SGD's rule, row by row of the stack; rows outside `mask` keep p and buf.
    d = g + wd * p; buf = momentum * buf + d (buf starts at 0, so the first step sets it to d); p -= lr * buf."""
    d = grad.add(p, alpha=weight_decay) if weight_decay else grad
    if momentum:
        new_buf = buf * momentum + d
        d = new_buf
    if mask is None:
        if momentum:
            buf.copy_(new_buf)
        p.sub_(d, alpha=lr)
        return
    rows = mask.view(-1, *([1] * (p.dim() - 1)))
    if momentum:
        buf.copy_(torch.where(rows, new_buf, buf))
    p.sub_(torch.where(rows, d, torch.zeros((), dtype=d.dtype, device=d.device)), alpha=lr)
