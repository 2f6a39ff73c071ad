"""FedAMP (Huang, Chu, Zhou, Wang, Liu, Pei and Zhang, "Personalized Cross-Silo Federated Learning on
Non-IID Data", AAAI 2021): federated attentive message passing.

The objective (Eq. 3) is sum_i F_i(w_i) + lambda * sum_{i<j} A(||w_i - w_j||^2) with the attention-
inducing function A(x) = 1 - exp(-x / sigma) (the paper's choice in its experiments), so
A'(x) = exp(-x / sigma) / sigma. Each round alternates two steps:

- server (attentive message passing, Eq. 4-7: one gradient step on the attention term, written out
  per client): for each client i a personalized cloud model
      u_i = sum_j xi_ij w_j,   xi_ij = alpha_k * A'(||w_i - w_j||^2) (j != i),   xi_ii = 1 - sum_{j != i} xi_ij,
  over the latest models w_j the server holds; u_i is the client's download (one per client);
- client (the proximal step that follows it): w_i = argmin_w F_i(w) + lambda / (2 alpha_k) ||w - u_i||^2, approximately by
  E epochs of the engine's optimiser, after which w_i is uploaded and stored by the server.

A client's personalized model is its w_i; there is no global model. The server's w_j are the
clients' latest uploads; a client that has not uploaded yet counts with the initial model for
itself and is left out of the others' sums (in round 1 every u_i is the initial model).

Choices: `start_from` — the client's proximal step is centred on u_i, and by default the client's
optimiser starts there ('cloud'); PFLlib continues from the client's own previous w_i ('own').
alpha_k is a constant (the paper's alpha_k is a step size the theory lets decrease). Defaults follow
PFLlib (alpha_k = 1, sigma = 1, lambda = 1); the useful sigma grows with the squared distances between
the models, so tune it with the model size.
"""

from __future__ import annotations

import math
from typing import Literal

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
    Upload,
    cross_entropy,
    federation_phase,
)
from fedpipe.algorithms.regularizers import proximal_squared


class FedAMPParams(MethodParams):
    """FedAMP: per-client cloud models from attention over the clients' models, proximal local training."""

    name: Literal["fedamp"] = "fedamp"
    alpha_k: float = Field(1.0, gt=0)
    """alpha_k: the server's step size (scales every attention weight xi_ij) and divisor of the client's
    proximal weight. PFLlib's default 1."""
    lam: float = Field(1.0, ge=0)
    """lambda: weight of the attention term in Eq. 3; the client's proximal weight is lambda / alpha_k.
    PFLlib's default 1."""
    sigma: float = Field(1.0, gt=0)
    """sigma of A(x) = 1 - exp(-x / sigma), x the squared L2 distance between two clients' models.
    PFLlib's default 1."""
    start_from: Literal["cloud", "own"] = "cloud"
    """Where the client's local optimisation starts: 'cloud' (u_i, the centre of the proximal
    step) or 'own' (its previous w_i, as PFLlib does; the initial model before its first round)."""


def attention_derivative(x: float, sigma: float) -> float:
    """A'(x) for A(x) = 1 - exp(-x / sigma)."""
    return math.exp(-x / sigma) / sigma


class FedAMP(Algorithm):
    name = "fedamp"
    Params = FedAMPParams
    paper = "Huang et al. 2021, Eq. 3-7"
    params: FedAMPParams

    @classmethod
    def phases(cls, params: MethodParams, rounds: int) -> list[Phase]:
        return [federation_phase(rounds, "server passes attentive messages (cloud models u_i), clients train toward them")]

    # --- server side ----------------------------------------------------------------------------
    def xi(self, server: ServerState, client_id: int) -> dict[int, float]:
        """The coefficients xi_ij of u_i (Eq. 7), over client i and every client the server holds a model of."""
        own = server.per_client.get(client_id, server.global_params)
        xi = {}
        for j, w_j in sorted(server.per_client.items()):
            if j == client_id:
                continue
            sq = float(sum(((own[n].double() - w_j[n].double()) ** 2).sum() for n in own))
            xi[j] = self.params.alpha_k * attention_derivative(sq, self.params.sigma)
        xi[client_id] = 1.0 - sum(xi.values())
        return xi

    def cloud_model(self, server: ServerState, client_id: int) -> Params:
        """u_i = sum_j xi_ij w_j (Eq. 6)."""
        xi = self.xi(server, client_id)
        models = {j: server.per_client[j] for j in xi if j != client_id}
        models[client_id] = server.per_client.get(client_id, server.global_params)
        out = {}
        for n, t in models[client_id].items():
            acc = torch.zeros_like(t, dtype=torch.float64)
            for j, coef in xi.items():
                acc.add_(models[j][n].double(), alpha=coef)
            out[n] = acc.to(t.dtype)
        return out

    def download(self, phase: Phase, server: ServerState, client_id: int) -> Params:
        if phase.name != "federation":
            return server.global_params
        return self.cloud_model(server, client_id)

    def aggregate(self, phase: Phase, server: ServerState, uploads: list[Upload]) -> ServerState:
        return ServerState(server.global_params, {**server.per_client, **{u.client_id: u.tensors for u in uploads}})

    def round_details(self, server: ServerState, clients: dict[int, Params]) -> dict:
        """Each client's self-weight xi_ii for its next round: 1 means it learns from nobody."""
        return {"self_weight": {cid: round(self.xi(server, cid)[cid], 6) for cid in sorted(server.per_client)}}

    # --- client side ----------------------------------------------------------------------------
    def client_params(self, ctx: ClientContext, download: Params, state: Params | None) -> Slots:
        if self.params.start_from == "own":
            start = state if state is not None else {n: p.detach() for n, p in self.model.named_parameters()}
        else:
            start = download
        return {"model": start, "cloud": download}

    def stages(self, ctx: ClientContext, local_epochs: int) -> list[Stage]:
        return [Stage(("model",), local_epochs, self.loss)]

    def loss(self, slots: Slots, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """F_i(w) + lambda / (2 alpha_k) ||w - u_i||^2: the client's proximal step."""
        loss = cross_entropy(self.forward(slots["model"], x), y)
        if self.params.lam == 0:
            return loss
        return loss + (self.params.lam / self.params.alpha_k) * proximal_squared(slots["model"], slots["cloud"])

    def client_result(self, ctx: ClientContext, slots: Slots, state: Params | None) -> tuple[Params | None, Params | None]:
        return slots["model"], slots["model"]

    # --- evaluation -----------------------------------------------------------------------------
    def global_model(self, server: ServerState) -> Params | None:
        return None

    def personalized_candidates(self, server: ServerState, state: Params | None, client_id: int) -> list[tuple[float, Params]]:
        return [(0.0, state if state is not None else server.global_params)]
