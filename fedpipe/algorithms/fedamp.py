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

Convex weights (the paper's Eq. 6-7 read as an attentive average: xi_ij >= 0, sum_j xi_ij = 1).
Eq. 7 sets xi_ii = 1 - sum_{j != i} xi_ij, which is non-negative only when alpha_k is small against
sum_{j != i} A'(d_ij) (d_ij = ||w_i - w_j||^2); the paper assumes such an alpha_k but fixes none, and
with PFLlib's alpha_k = sigma = 1 real runs gave xi_ii between -4.8 and -1.5, so that u_i
extrapolated away from the others instead of averaging them. By default (`step: capped`) the
server's step is, per client i and round,

    alpha_{k,i} = min(alpha_k, (1 - min_self_weight) / sum_{j != i} A'(d_ij)),

so sum_{j != i} xi_ij <= 1 - min_self_weight and xi_ii >= min_self_weight >= 0: the paper's weights
exactly when they already are convex with enough self-weight, else the same attention profile
scaled down, xi_ij = (1 - min_self_weight) exp(-d_ij / sigma) / sum_{h != i} exp(-d_ih / sigma) (a
softmax of -d / sigma, computed in log space) and xi_ii = min_self_weight. The default
min_self_weight 0.5 keeps u_i centred on the client's own model (at least half of it is w_i), as
the paper's small steps do; 0 is the largest convex step, where u_i may leave w_i out altogether.
`step: fixed` is Eq. 7 as written, alpha_k as configured: a round in which some xi_ii would fall
below min_self_weight stops with a ConfigError naming method.alpha_k, method.sigma and
method.min_self_weight (a sufficient bound: alpha_k <= sigma (1 - min_self_weight) / (K - 1) for K
clients, since A' <= 1 / sigma). The client's proximal weight stays lambda / alpha_k with the
configured alpha_k (the cap bounds the server's step only). Each round's details record every
client's self_weight xi_ii and its step alpha_{k,i}.

Other choices: `start_from` — the client's proximal step is centred on u_i, and by default the
client's optimiser starts there ('cloud'); PFLlib continues from the client's own previous w_i
('own'). alpha_k is a constant bound (the paper's alpha_k is a step size the theory lets decrease).
alpha_k, sigma and lambda default to PFLlib's 1; the useful sigma grows with the squared distances
between the models, so tune it with the model size.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch
from pydantic import Field

from fedpipe.algorithms.aggregation import Aggregation, custom, weighted_sum
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
from fedpipe.errors import ConfigError
from fedpipe.search_space import Dimension, LogUniform


class FedAMPParams(MethodParams):
    """FedAMP: per-client cloud models from attention over the clients' models, proximal local training."""

    search_space: ClassVar[dict[str, Dimension]] = {"method.alpha_k": LogUniform(0.1, 10.0), "method.lam": LogUniform(0.1, 10.0), "method.sigma": LogUniform(0.1, 10.0)}
    """What a study tunes beside train.lr: FedAMP's step, proximal weight and similarity scale (its paper tunes all three)."""

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
    step: Literal["capped", "fixed"] = "capped"
    """How the server's step alpha_k keeps the cloud weights convex: 'capped' (default) uses, per client
    and round, min(alpha_k, (1 - min_self_weight) / sum_{j != i} A'(d_ij)), so xi_ii >= min_self_weight;
    'fixed' uses alpha_k as given (Eq. 7 as written) and stops the run with an error naming alpha_k,
    sigma and min_self_weight when some xi_ii falls below min_self_weight."""
    min_self_weight: float = Field(0.5, ge=0, lt=1)
    """The least self-weight xi_ii of a cloud model u_i (must be < 1: the others need some weight).
    Default 0.5: u_i stays centred on the client's own model, as the paper's small step sizes keep
    it; 0 allows the largest convex step. Not in the paper, which assumes alpha_k small enough."""
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
    uploads = "its whole model w_i, which the server keeps per client"
    server_holds = "each client's latest model w_i, from which it builds every client's cloud model u_i (Eq. 6-7)"
    privacy_refusal = ("its server keeps each client's model and weighs every pair of clients by their models' similarity "
                       "(Eq. 6-7): per-client statistics outside a clipped, noised sum")
    departures = (
        "step=capped, min_self_weight=0.5: the server's alpha_k is lowered per client and round so that xi_ii >= 0.5 "
        "(Eq. 7 with alpha_k = 1 gave xi_ii < 0 in real runs); step=fixed is Eq. 7 as written, checked",
        "alpha_k is a constant (the paper's theory lets the step size decrease); alpha_k = lam = sigma = 1 are PFLlib's "
        "defaults, not values from the paper",
    )
    params: FedAMPParams

    @classmethod
    def phases(cls, params: MethodParams, rounds: int) -> list[Phase]:
        return [federation_phase(rounds, "server passes attentive messages (cloud models u_i), clients train toward them")]

    # --- server side ----------------------------------------------------------------------------
    def weights(self, server: ServerState, client_id: int) -> tuple[dict[int, float], float]:
        """(xi, alpha_{k,i}): the coefficients xi_ij of u_i (Eq. 7), over client i and every client the
        server holds a model of, and the step that gave them (alpha_k, or less when capped)."""
        p = self.params
        own = server.per_client.get(client_id, server.global_params)
        # log A'(d) = -d / sigma - log sigma, per other client: weights in log space so that a tiny sigma
        # (A' up to 1 / sigma) neither overflows nor turns the capped softmax into 0 / 0
        log_a = {}
        for j, w_j in sorted(server.per_client.items()):
            if j == client_id:
                continue
            sq = float(sum(((own[n].double() - w_j[n].double()) ** 2).sum() for n in own))
            log_a[j] = -sq / p.sigma - math.log(p.sigma)
        if not log_a:
            return {client_id: 1.0}, p.alpha_k
        top = max(log_a.values())
        log_sum = top + math.log(sum(math.exp(v - top) for v in log_a.values()))  # log sum_{j != i} A'(d_ij)
        budget = 1.0 - p.min_self_weight  # what the others may weigh together
        alpha = p.alpha_k
        if p.step == "capped" and math.log(alpha) + log_sum > math.log(budget):
            alpha = math.exp(math.log(budget) - log_sum)
            xi = {j: budget * math.exp(v - log_sum) for j, v in log_a.items()}
        else:
            xi = {j: alpha * math.exp(v) for j, v in log_a.items()}
        xi[client_id] = 1.0 - sum(xi.values())
        if xi[client_id] < p.min_self_weight - 1e-12:
            bound = math.exp(math.log(budget) - log_sum)
            raise ConfigError(
                f"FedAMP's cloud model for client {client_id} is not a convex average: with method.alpha_k={p.alpha_k} and "
                f"method.sigma={p.sigma} its self-weight xi_ii = 1 - alpha_k * sum_j A'(||w_i - w_j||^2) is {xi[client_id]:.4g}, "
                f"below method.min_self_weight={p.min_self_weight}. Use method.step=capped (the default: alpha_k is lowered per "
                f"client and round as needed), or lower method.alpha_k to at most {bound:.4g} for this round "
                f"(for every round: alpha_k <= sigma * (1 - min_self_weight) / (clients - 1)), or raise method.sigma.")
        return xi, alpha

    def xi(self, server: ServerState, client_id: int) -> dict[int, float]:
        """The coefficients xi_ij of u_i (Eq. 7), convex: each >= 0, summing to 1 (see `weights`)."""
        return self.weights(server, client_id)[0]

    def cloud_model(self, server: ServerState, client_id: int) -> Params:
        """u_i = sum_j xi_ij w_j (Eq. 6)."""
        xi = self.xi(server, client_id)
        models = {j: server.per_client[j] for j in xi if j != client_id}
        models[client_id] = server.per_client.get(client_id, server.global_params)
        sums = weighted_sum([models[j] for j in xi], list(xi.values()))
        return {n: sums[n].to(t.dtype) for n, t in models[client_id].items()}

    def download(self, phase: Phase, server: ServerState, client_id: int) -> Params:
        if phase.name != "federation":
            return server.global_params
        return self.cloud_model(server, client_id)

    def aggregation(self, phase: Phase) -> Aggregation:
        return custom("each upload is stored as its client's model w_i; downloads are attentive cloud models u_i (Eq. 6-7)")

    def aggregate(self, phase: Phase, server: ServerState, uploads: list[Upload]) -> ServerState:
        return ServerState(server.global_params, {**server.per_client, **{u.client_id: u.tensors for u in uploads}})

    def round_details(self, server: ServerState, clients: dict[int, Params]) -> dict:
        """Each client's self-weight xi_ii for its next round (1: it learns from nobody) and the server's
        step alpha_{k,i} that gave it (below alpha_k where the cap applied)."""
        weights = {cid: self.weights(server, cid) for cid in sorted(server.per_client)}
        return {"self_weight": {cid: round(xi[cid], 6) for cid, (xi, _) in weights.items()},
                "alpha_k": {cid: float(f"{alpha:.6g}") for cid, (_, alpha) in weights.items()}}

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
