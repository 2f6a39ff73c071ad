"""Local training: every client trains its own model on its own data and never communicates.

The usual lower baseline of personalized FL (e.g. SuPerFed's and pFedMB's tables). Clients start
from the same initial model, train only in the rounds they are sampled (the same compute budget as
the federated methods), and keep their model between rounds.
"""

from __future__ import annotations

from typing import Literal

import torch

from fedpipe.algorithms.base import (
    Algorithm,
    ClientContext,
    MethodParams,
    Params,
    Phase,
    ServerState,
    Slots,
    Stage,
    cross_entropy,
)


class LocalParams(MethodParams):
    """Local training has no hyperparameters beyond the shared training ones (train.*)."""

    name: Literal["local"] = "local"


class Local(Algorithm):
    name = "local"
    Params = LocalParams
    paper = "no communication (baseline)"
    uploads = "nothing (epsilon 0)"
    departures = (
        "a client trains only in the rounds it is sampled, E epochs each (the federated methods' compute); SuPerFed's "
        "and pFedMB's Local baselines do not say for how long (pFedMB: until convergence)",
        "every client starts from the run's one initial model (the papers do not say)",
        "train.* are the run-wide defaults (SGD lr 0.01, momentum 0.9, weight decay 1e-4, B = 10); pFedMB trains every "
        "method with B = 64",
    )

    @classmethod
    def phases(cls, params: MethodParams, rounds: int) -> list[Phase]:
        return [Phase("local", 1, rounds, sample_clients=True, communicates=False, downloads=False,
                      description="each client trains its own model, nothing is sent")]

    def client_params(self, ctx: ClientContext, download: Params, state: Params | None) -> Slots:
        return {"local": state if state is not None else download}

    def stages(self, ctx: ClientContext, local_epochs: int) -> list[Stage]:
        return [Stage(("local",), local_epochs, self.loss)]

    def loss(self, slots: Slots, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        return cross_entropy(self.forward(slots["local"], x), y)

    def client_result(self, ctx: ClientContext, slots: Slots, state: Params | None) -> tuple[Params | None, Params | None]:
        return None, slots["local"]

    def global_model(self, server: ServerState) -> Params | None:
        return None  # there is no trained global model

    def personalized_candidates(self, server: ServerState, state: Params | None, client_id: int) -> list[tuple[float, Params]]:
        return [(0.0, state if state is not None else server.global_params)]
