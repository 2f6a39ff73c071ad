"""A client's stage schedule: every epoch's shuffle and every batch's (or epoch's) noise, drawn from
the client's generator in one place, so the one-by-one engine (`fedpipe.engine.sequential`) and the
batched one (`fedpipe.engine.batched`) train on the same batches with the same noise.

Per epoch, in this order: a permutation of the training split (`torch.randperm`), then with
`noise_per="epoch"` one `Algorithm.batch_noise` draw, or with `noise_per="batch"` one draw per batch
in batch order. Nothing else draws from the client's generator while it trains (a stage's loss and
update read only their arguments), so drawing an epoch's steps before training on them consumes the
generator exactly as drawing each just before its batch would.

Epochs are drawn lazily: a consumer that stops after an epoch (early stopping) draws nothing for the
epochs it skips.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from fedpipe.algorithms.base import Algorithm, ClientContext, Stage


@dataclass(frozen=True)
class Step:
    """One optimisation step: the indices of its mini-batch in the client's training split (on the
    data's device) and the noise the stage's loss reads (None when the stage needs none)."""

    index: torch.Tensor
    noise: torch.Tensor | None


def stage_epochs(algorithm: Algorithm, ctx: ClientContext, stage: Stage, batch_size: int,
                 generator: torch.Generator) -> Iterator[list[Step]]:
    """The steps of each of the stage's epochs, one list per epoch, drawn from `generator` when the
    epoch is reached. Each epoch covers the whole split; its last batch may be smaller."""
    n, device = len(ctx.data.train), ctx.data.train.y.device
    for _ in range(stage.epochs):
        order = torch.randperm(n, generator=generator).to(device)
        noise = algorithm.batch_noise(ctx, stage, generator) if stage.noise_per == "epoch" else None
        steps = []
        for start in range(0, n, batch_size):
            if stage.noise_per == "batch":
                noise = algorithm.batch_noise(ctx, stage, generator)
            steps.append(Step(order[start : start + batch_size], noise))
        yield steps


def stage_steps(algorithm: Algorithm, ctx: ClientContext, stage: Stage, batch_size: int,
                generator: torch.Generator) -> list[Step]:
    """Every step of the stage, epoch after epoch (for an engine that needs no epoch boundaries)."""
    return [step for epoch in stage_epochs(algorithm, ctx, stage, batch_size, generator) for step in epoch]
