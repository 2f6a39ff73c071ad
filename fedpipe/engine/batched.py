"""Many clients' local updates at once: one stacked copy of each trained tensor per client, the
algorithm's (pure) stage loss mapped over clients with `torch.func.vmap`, and SGD applied to the
stack with a mask, so a client that has run out of batches no longer moves.

It computes what `fedpipe.engine.sequential.train_client` computes for each client, within float
tolerance: the same shuffles and the same per-batch noise (SuPerFed's lam), drawn from each client's
own generator by the same schedule (`fedpipe.engine.schedule`); the same mini-batches (the last one
of an epoch may be smaller: clients are grouped by batch size at each step, so no padding enters a
loss); PyTorch's SGD rule (weight decay added to the gradient, momentum buffer starting at the
first gradient, no dampening).

What it cannot run (`batchable` says why): custom per-batch updates (pFedMe), in-place fix-ups
after a step (pFedMB's projection), early stopping (the mixture of experts), Adam, and models whose
layers have no vmap rule (an LSTM). Those clients train one by one.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.func import vmap

from fedpipe.algorithms.base import Algorithm, ClientContext, Slots, Stage
from fedpipe.engine.schedule import Step, stage_steps
from fedpipe.engine.sequential import ClientStats, autocast

log = logging.getLogger(__name__)

#: Steps run on a side stream before a CUDA graph is captured (cuBLAS and the allocator settle).
GRAPH_WARMUP_STEPS = 3


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


def _same_object(tensors: list[torch.Tensor]) -> bool:
    return all(t is tensors[0] for t in tensors[1:])


class _Stack:
    """The chunk's stacked tensors ([clients, ...]) and its per-client loss sums and sample counts.
    A slot every client reads from one shared tensor (the downloaded global model as an anchor) and
    none trains stays unstacked (in_dims None)."""

    def __init__(self, jobs: list[BatchJob]):
        first = jobs[0]
        self.jobs, self.count = jobs, len(jobs)
        self.device = first.ctx.data.train.y.device
        self.trained = {name for stage in first.stages for name in stage.trainable}
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}
        self.dims: dict[str, dict[str, int | None]] = {}
        for name, tensors in first.slots.items():
            self.tensors[name], self.dims[name] = {}, {}
            for k in tensors:
                column = [job.slots[name][k] for job in jobs]
                if name not in self.trained and _same_object(column):
                    self.tensors[name][k], self.dims[name][k] = column[0].detach(), None
                else:
                    self.tensors[name][k], self.dims[name][k] = torch.stack([t.detach() for t in column]).clone(), 0
        self.loss_sums = torch.zeros(self.count, device=self.device)
        self.seen = [0] * self.count

    def train_only(self, trainable: tuple[str, ...]) -> None:
        """Gradients for `trainable`'s tensors only (None: for none)."""
        for name in self.trained:
            for t in self.tensors[name].values():
                t.requires_grad_(name in trainable)

    def view(self, index: torch.Tensor | None) -> Slots:
        """The stacked slots restricted to the rows in `index` (all of them when None)."""
        return {name: {k: (v if self.dims[name][k] is None or index is None else v[index]) for k, v in tensors.items()}
                for name, tensors in self.tensors.items()}

    def tally(self, rows: list[int], index: torch.Tensor | None, losses: torch.Tensor, size: int) -> None:
        with torch.no_grad():
            if index is None:
                self.loss_sums += losses.detach() * size
            else:
                self.loss_sums.index_add_(0, index, losses.detach() * size)
        for c in rows:
            self.seen[c] += size

    def results(self) -> list[tuple[Slots, ClientStats]]:
        """Each client's slots (trained ones cloned out of the stack, the others as it sent them) and statistics."""
        out = []
        for c, job in enumerate(self.jobs):
            slots = {
                name: {k: (self.tensors[name][k][c].clone() if self.dims[name][k] == 0 and name in self.trained
                           else job.slots[name][k].detach()) for k in tensors}
                for name, tensors in job.slots.items()
            }
            out.append((slots, ClientStats(loss=float(self.loss_sums[c]) / max(self.seen[c], 1), samples=self.seen[c])))
        return out


def _step_gradients(stack: _Stack, mapped, params: Slots, schedules: list[list[Step]], t: int,
                    active: list[int], noisy: bool, amp: bool) -> dict[tuple[str, str], torch.Tensor]:
    """The gradients of step `t` for the `active` clients, summed over groups of equal batch size
    (no padding enters a loss); rows of clients outside a group get zero from it."""
    groups: dict[int, list[int]] = defaultdict(list)
    for c in active:
        groups[int(schedules[c][t].index.numel())].append(c)
    keys = [(name, k) for name in params for k in params[name]]
    grads: dict[tuple[str, str], torch.Tensor] = {}
    for size, rows in groups.items():
        index = None if len(rows) == stack.count else torch.tensor(rows, device=stack.device)
        x = torch.stack([stack.jobs[c].ctx.data.train.x[schedules[c][t].index] for c in rows])
        y = torch.stack([stack.jobs[c].ctx.data.train.y[schedules[c][t].index] for c in rows])
        noise = torch.stack([schedules[c][t].noise for c in rows]).to(stack.device) if noisy else None
        with autocast(stack.device, amp):
            losses = mapped(stack.view(index), x, y, noise)
        group_grads = torch.autograd.grad(losses.sum(), [params[name][k] for name, k in keys])
        for key, g in zip(keys, group_grads):
            grads[key] = g if key not in grads else grads[key] + g
        stack.tally(rows, index, losses, size)
    return grads


class _StaticStep:
    """The step of a chunk in which every client takes a full batch (all steps but an epoch's ragged
    last one, when every client has as many), on static buffers: each step's inputs are copied into
    tensors allocated once, so the same kernels run on the same addresses every time. On a GPU the
    step (forward, backward and SGD update, in place on the stack) is captured once as a CUDA graph
    and replayed: no kernel launches from Python, which is what bounds a batched step at small
    chunks. Elsewhere, or when capture fails (an op that syncs with the host), the same function is
    called as it is; either way it computes exactly what the eager step computes."""

    def __init__(self, stack: _Stack, mapped, params: Slots, buffers: dict, noisy: bool, amp: bool, sgd: dict):
        self.stack, self.mapped, self.params, self.buffers = stack, mapped, params, buffers
        self.noisy, self.amp, self.sgd = noisy, amp, sgd
        self.x = self.y = self.noise = self.losses = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.eager_only = stack.device.type != "cuda"

    def _compute(self) -> None:
        keys = [(name, k) for name in self.params for k in self.params[name]]
        with autocast(self.stack.device, self.amp):
            losses = self.mapped(self.stack.view(None), self.x, self.y, self.noise)
        grads = torch.autograd.grad(losses.sum(), [self.params[name][k] for name, k in keys])
        with torch.no_grad():
            for key, g in zip(keys, grads):
                _sgd_step(self.params[key[0]][key[1]], g, self.buffers[key], None, **self.sgd)
        self.losses = losses.detach()

    def _capture(self) -> None:
        """Warm up on a side stream, capture, and put the weights and buffers back as they were (the
        warm-up steps trained them; a capture only records)."""
        state = [t for tensors in self.params.values() for t in tensors.values()] + list(self.buffers.values())
        saved = [t.detach().clone() for t in state]
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(GRAPH_WARMUP_STEPS):
                    self._compute()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._compute()
            self.graph = graph
        except Exception as e:  # noqa: BLE001 - any capture failure: the eager step computes the same
            log.info("CUDA graph capture failed (%s: %s); the step runs eagerly.", type(e).__name__, str(e)[:200])
            self.eager_only = True
        finally:
            with torch.no_grad():
                for t, v in zip(state, saved):
                    t.copy_(v)

    def run(self, schedules: list[list[Step]], t: int) -> None:
        stack = self.stack
        x = torch.stack([job.ctx.data.train.x[schedules[c][t].index] for c, job in enumerate(stack.jobs)])
        y = torch.stack([job.ctx.data.train.y[schedules[c][t].index] for c, job in enumerate(stack.jobs)])
        noise = torch.stack([sched[t].noise for sched in schedules]).to(stack.device) if self.noisy else None
        if self.x is None:
            self.x, self.y, self.noise = x.clone(), y.clone(), None if noise is None else noise.clone()
        else:
            self.x.copy_(x)
            self.y.copy_(y)
            if noise is not None:
                self.noise.copy_(noise)
        if self.graph is None and not self.eager_only:
            self._capture()
        if self.graph is not None:
            self.graph.replay()
        else:
            self._compute()
        stack.tally(list(range(stack.count)), None, self.losses, int(y.shape[1]))


def _train_stage(algorithm: Algorithm, stack: _Stack, s: int, stage: Stage, *, batch_size: int, lr: float,
                 momentum: float, weight_decay: float, amp: bool, graphs: bool = False) -> None:
    """Stage `s` of every client, step by step; a client out of steps is masked out of the update.
    With `graphs`, the steps where every client takes a full batch run as one `_StaticStep`."""
    stage_lr = stage.lr if stage.lr is not None else lr * stage.lr_scale
    params = {name: stack.tensors[name] for name in stage.trainable}
    stack.train_only(stage.trainable)
    buffers = {(name, k): torch.zeros_like(t) for name in stage.trainable for k, t in params[name].items()}
    schedules = [stage_steps(algorithm, job.ctx, job.stages[s], batch_size, job.generator) for job in stack.jobs]
    noisy = any(step.noise is not None for sched in schedules for step in sched)
    mapped = vmap(stage.loss, in_dims=(stack.dims, 0, 0, 0 if noisy else None))
    static = _StaticStep(stack, mapped, params, buffers, noisy, amp,
                         dict(lr=stage_lr, momentum=momentum, weight_decay=weight_decay)) if graphs else None
    for t in range(max(len(sched) for sched in schedules)):
        active = [c for c in range(stack.count) if t < len(schedules[c])]
        if static is not None and len(active) == stack.count and all(int(sched[t].index.numel()) == batch_size for sched in schedules):
            static.run(schedules, t)  # static shapes: the chunk's every client on a full batch
            continue
        grads = _step_gradients(stack, mapped, params, schedules, t, active, noisy, amp)
        mask = None
        if len(active) < stack.count:
            mask = torch.zeros(stack.count, dtype=torch.bool, device=stack.device)
            mask[active] = True
        with torch.no_grad():
            for key, g in grads.items():
                _sgd_step(params[key[0]][key[1]], g, buffers[key], mask, stage_lr, momentum, weight_decay)


def train_batched(
    algorithm: Algorithm,
    jobs: list[BatchJob],
    *,
    batch_size: int,
    lr: float,
    momentum: float,
    weight_decay: float,
    amp: bool = False,
    graphs: bool = False,
) -> list[tuple[Slots, ClientStats]]:
    """Train `jobs` (same slot layout and stage keys) together; returns each client's trained slots
    (detached, owning their memory) and statistics, in the order of `jobs`. `graphs`: full-batch
    steps on static buffers, captured as CUDA graphs on a GPU (`_StaticStep`)."""
    stack = _Stack(jobs)
    for s, stage in enumerate(jobs[0].stages):
        _train_stage(algorithm, stack, s, stage, batch_size=batch_size, lr=lr, momentum=momentum,
                     weight_decay=weight_decay, amp=amp, graphs=graphs)
    stack.train_only(())
    return stack.results()


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
