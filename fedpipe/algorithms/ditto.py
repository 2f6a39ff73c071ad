"""Ditto (Li, Hu, Beirami and Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021), Algorithm 1 with FedAvg as the global solver.

Each sampled client k, given the round's global model w^t:

- updates the global model as FedAvg does, E local epochs of SGD on F_k from w^t, and sends it back
  (UPDATE_GLOBAL in Algorithm 1); the server averages by sample count (FedAvg);
- updates its personal model v_k, kept between rounds, for `personal_epochs` epochs on
      h_k(v_k; w^t) = F_k(v_k) + lambda/2 ||v_k - w^t||^2                      (Eq. 2, Algorithm 1)
  whose gradient is grad F_k(v_k) + lambda (v_k - w^t); w^t is the downloaded global model, not the
  client's freshly updated copy.

v_k starts as the initial global model w^0 (the paper's v_k^0). A client's personalized model is
v_k; the global model w is evaluated on the global test set. The global update runs first and draws
the same shuffles as FedAvg, so Ditto's global model is FedAvg's, bit for bit (tests pin this).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

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
    federation_phase,
)
from fedpipe.algorithms.regularizers import proximal_squared
from fedpipe.config import MAX_EPOCHS
from fedpipe.search_space import Dimension, LogUniform


class DittoParams(MethodParams):
    """Ditto: FedAvg for the global model, plus a personal model pulled toward it."""

    search_space: ClassVar[dict[str, Dimension]] = {"method.lam": LogUniform(0.01, 2.0)}
    """What a study tunes beside train.lr: Ditto's paper sweeps lam over 0.01..2."""

    name: Literal["ditto"] = "ditto"
    lam: float = Field(0.1, ge=0)
    """lambda: weight of (1/2)||v - w^t||^2 in the personal objective (Eq. 2). 0: the personal model
    is trained locally, unaffected by the global one; large: it stays at w^t."""
    personal_epochs: int | None = Field(None, ge=1, le=MAX_EPOCHS)
    """Epochs of the personal update per round (the paper's s local iterations); None: train.local_epochs."""
    personal_lr_scale: float = Field(1.0, gt=0)
    """Personal update's learning rate as a multiple of the round's (the paper uses one eta for both)."""


class Ditto(Algorithm):
    name = "ditto"
    Params = DittoParams
    paper = "Li et al. 2021, Algorithm 1 (Eq. 2)"
    uploads = "the global model (its personal model stays on the client)"
    departures = (
        "lam=0.1: fedpipe's value; the paper tunes lambda per dataset",
        "personal_epochs=None: the personal update runs train.local_epochs epochs, as the global one, at the same rate "
        "(Algorithm 1's s local iterations; the paper does not fix s)",
        "train.momentum=0.9, train.weight_decay=1e-4 apply to both updates: Algorithm 1 writes plain SGD steps; "
        "train.momentum=0 train.weight_decay=0 is the paper's step",
        "train.lr=0.01 decayed by 0.999 per round, B = 10, E = 5: the run-wide defaults, not the paper's settings",
    )
    params: DittoParams

    @classmethod
    def phases(cls, params: MethodParams, rounds: int) -> list[Phase]:
        return [federation_phase(rounds, "FedAvg for the global model; each client also trains a personal model near it")]

    # --- client side ----------------------------------------------------------------------------
    def client_params(self, ctx: ClientContext, download: Params, state: Params | None) -> Slots:
        personal = state if state is not None else {n: p.detach() for n, p in self.model.named_parameters()}  # v_k^0 = w^0
        return {"global": download, "anchor": download, "personal": personal}

    def stages(self, ctx: ClientContext, local_epochs: int) -> list[Stage]:
        return [
            Stage(("global",), local_epochs, self.global_loss),  # UPDATE_GLOBAL: FedAvg's local update
            Stage(("personal",), self.params.personal_epochs or local_epochs, self.personal_loss,
                  lr_scale=self.params.personal_lr_scale),
        ]

    def global_loss(self, slots: Slots, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        return cross_entropy(self.forward(slots["global"], x), y)

    def personal_loss(self, slots: Slots, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """h_k(v; w^t) = F_k(v) + lambda/2 ||v - w^t||^2 (Eq. 2)."""
        loss = cross_entropy(self.forward(slots["personal"], x), y)
        if self.params.lam == 0:
            return loss
        return loss + self.params.lam * proximal_squared(slots["personal"], slots["anchor"])

    def client_result(self, ctx: ClientContext, slots: Slots, state: Params | None) -> tuple[Params | None, Params | None]:
        return slots["global"], slots["personal"]

    # --- evaluation -----------------------------------------------------------------------------
    def personalized_candidates(self, server: ServerState, state: Params | None, client_id: int) -> list[tuple[float, Params]]:
        return [(0.0, state if state is not None else server.global_params)]
