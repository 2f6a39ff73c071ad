"""pFedMe (Dinh, Tran and Nguyen, "Personalized Federated Learning with Moreau Envelopes", NeurIPS 2020).

Each client i keeps a local copy w_i of the global model and, per mini-batch D (Algorithm 1, the
client's local iterations):

1. approximately solves the personalized problem on the batch loss (the Moreau-envelope inner
   problem, Section 3)
       theta_i = argmin_theta  f_i(theta; D) + lambda/2 ||theta - w_i||^2
   by K gradient steps with the personal learning rate p:
       theta <- theta - p * (grad f_i(theta; D) + lambda (theta - w_i));
2. moves its local model toward it (Algorithm 1's local update):
       w_i <- w_i - eta * lambda * (w_i - theta_i),
   eta being the round's learning rate (train.lr, decayed).

After the local iterations the server mixes the clients' w_i into the global model (Algorithm 1's
server update):
       w^{t+1} = (1 - beta) w^t + beta * (1/S) sum_{i in S} w_i.
A client's personalized model is its theta_i after its last local iteration. The engine's optimiser
settings (train.optimizer, momentum, weight_decay) do not apply: the two updates above are the
optimiser. The paper counts R local iterations per round; here a round is train.local_epochs
epochs of mini-batches.

The paper does not say where each batch's K steps start. The official code warm-starts them from
the previous batch's theta (and from w^t at the start of a round): `warm_start: true`. With
`warm_start: false` every batch starts from the current w_i; then K = 1, beta = 1 and sample-weighted
averaging make pFedMe FedAvg with plain SGD at learning rate eta * lambda * p (tests pin this).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from fedpipe.algorithms.aggregation import WEIGHTED_MEAN, Aggregation, custom, weighted_average
from fedpipe.algorithms.base import (
    OWN_UPDATE_IN_FP32,
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
from fedpipe.config import MAX_EPOCHS
from fedpipe.search_space import Dimension, LogUniform


class PFedMeParams(MethodParams):
    """pFedMe: bi-level personalization through Moreau envelopes (Algorithm 1)."""

    search_space: ClassVar[dict[str, Dimension]] = {"method.lam": LogUniform(1.0, 30.0), "method.personal_lr": LogUniform(0.003, 0.1)}
    """What a study tunes beside train.lr: pFedMe's paper tunes lam in 0.5..30 and the personal rate."""

    name: Literal["pfedme"] = "pfedme"
    lam: float = Field(15.0, gt=0)
    """lambda: strength of the pull between the personalized model theta and the local model w.
    Paper and official code: 15."""
    inner_steps: int = Field(5, ge=1, le=MAX_EPOCHS)  # K steps per mini-batch
    """K: gradient steps that approximately solve the personalized problem per mini-batch (paper: 5)."""
    personal_lr: float = Field(0.01, gt=0)
    """p: learning rate of the K inner steps (PFLlib's default 0.01; the paper tunes it per dataset)."""
    beta: float = Field(1.0, gt=0)
    """Server mixing: w^{t+1} = (1 - beta) w^t + beta * mean of the clients' w_i (Algorithm 1). 1: plain
    averaging; the paper also reports beta = 2."""
    warm_start: bool = True
    """True (official code): each batch's inner steps start from the previous batch's theta (from the
    downloaded w^t at the start of a round). False: every batch starts from the current w_i."""
    weighting: Literal["uniform", "samples"] = "uniform"
    """How the server averages the clients' w_i: 'uniform' (1/S, Algorithm 1) or 'samples'
    (by training-set size, as FedAvg and PFLlib do)."""


class PFedMe(Algorithm):
    name = "pfedme"
    Params = PFedMeParams
    paper = "Dinh et al. 2020, Algorithm 1"
    uploads = "its local model w_i (its personalized model theta_i stays on the client)"
    bf16_refusal = OWN_UPDATE_IN_FP32
    departures = (
        "personal_lr=0.01 (p): PFLlib's default; the paper tunes p per dataset",
        "eta = train.lr 0.01 decayed by 0.999 per round (run-wide): the paper tunes eta per dataset",
        "warm_start=true: each batch's K steps start from the previous batch's theta, as the official code (the paper "
        "does not say)",
        "a round is train.local_epochs = 5 epochs of batches of train.batch_size = 10; the paper counts R local "
        "iterations (R = 20, |D| = 20 in its experiments)",
        "a client that never trained is evaluated on the global model (the paper does not say)",
    )
    params: PFedMeParams

    @classmethod
    def phases(cls, params: MethodParams, rounds: int) -> list[Phase]:
        return [federation_phase(rounds, "local models w_i pulled toward personalized models theta_i; server averages w_i")]

    # --- client side ----------------------------------------------------------------------------
    def client_params(self, ctx: ClientContext, download: Params, state: Params | None) -> Slots:
        # w_{i,0} = w^t, and theta starts at w^t too (the official code loads w^t into both)
        return {"local": download, "personal": download}

    def stages(self, ctx: ClientContext, local_epochs: int) -> list[Stage]:
        return [Stage(("local", "personal"), local_epochs, self.personal_loss, update=self.update)]

    def batch_loss(self, params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """f_i(params; D): the pure function whose gradient the inner steps take."""
        return cross_entropy(self.forward(params, x), y)

    def personal_loss(self, slots: Slots, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        return self.batch_loss(slots["personal"], x, y)

    def solve_personal(self, theta: Params, w: Params, x: torch.Tensor, y: torch.Tensor) -> tuple[Params, torch.Tensor]:
        """K steps on h(theta) = f(theta; D) + lambda/2 ||theta - w||^2; returns theta and the
        batch loss f at the last step's starting point."""
        lam, p = self.params.lam, self.params.personal_lr
        theta = {n: t.detach() for n, t in theta.items()}
        loss = torch.zeros(())
        for _ in range(self.params.inner_steps):
            grads, loss = self.batch_grad(theta, x, y)
            with torch.no_grad():
                theta = {n: theta[n] - p * (grads[n] + lam * (theta[n] - w[n])) for n in theta}
        return theta, loss

    def batch_grad(self, params: Params, x: torch.Tensor, y: torch.Tensor) -> tuple[Params, torch.Tensor]:
        """grad f(params; D) and f(params; D), by reverse-mode autograd on the pure batch loss (the same
        numbers as torch.func.grad_and_value, at half its per-call overhead for these small models)."""
        leaves = {n: t.detach().requires_grad_(True) for n, t in params.items()}
        with torch.enable_grad():
            loss = self.batch_loss(leaves, x, y)
            grads = torch.autograd.grad(loss, list(leaves.values()))
        return dict(zip(leaves, grads)), loss.detach()

    def update(self, slots: Slots, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None, lr: float) -> torch.Tensor:
        """One local iteration of Algorithm 1 on a mini-batch, in place: the K inner steps, then the local update."""
        w, personal = slots["local"], slots["personal"]
        start = personal if self.params.warm_start else w
        with torch.no_grad():
            w_now = {n: t.detach().clone() for n, t in w.items()}
        theta, loss = self.solve_personal(start, w_now, x, y)
        with torch.no_grad():
            for n in w:
                personal[n].copy_(theta[n])
                w[n].sub_(lr * self.params.lam * (w_now[n] - theta[n]))  # w <- w - eta lambda (w - theta)
        return loss.detach()

    def client_result(self, ctx: ClientContext, slots: Slots, state: Params | None) -> tuple[Params | None, Params | None]:
        return slots["local"], slots["personal"]  # upload w_{i,R}; keep theta_i as the personalized model

    # --- server side ----------------------------------------------------------------------------
    def aggregation(self, phase: Phase) -> Aggregation:
        """weighting=samples with beta = 1 is the plain weighted mean; otherwise Algorithm 1's mix."""
        if self.params.weighting == "samples" and self.params.beta == 1.0:
            return WEIGHTED_MEAN
        return custom(f"w = (1 - beta) w + beta * the {self.params.weighting}-weighted mean of the clients' w_i "
                      f"(Algorithm 1, beta = {self.params.beta})")

    def aggregate(self, phase: Phase, server: ServerState, uploads: list[Upload]) -> ServerState:
        if not uploads:
            return server
        weights = [u.num_samples if self.params.weighting == "samples" else 1 for u in uploads]
        mean = weighted_average([u.tensors for u in uploads], weights)
        beta = self.params.beta
        if beta == 1.0:
            return ServerState({**server.global_params, **mean}, server.per_client)
        old = server.global_params
        mixed = {n: ((1 - beta) * old[n].double() + beta * mean[n].double()).to(old[n].dtype) for n in mean}
        return ServerState({**old, **mixed}, server.per_client)

    def secure_weighting(self, phase: Phase) -> str | None:
        """Algorithm 1's mean is over the sites' w_i, uniform or sample-weighted (`weighting`): a masked sum gives either."""
        return self.params.weighting if phase.communicates else None

    def apply_mean(self, server: ServerState, mean: Params) -> ServerState:
        """Algorithm 1's server step, w = (1 - beta) w + beta * mean, from the round's mean (SecAgg+'s unmasked sum)."""
        beta, old = self.params.beta, server.global_params
        mixed = {n: ((1 - beta) * old[n].double() + beta * mean[n].double()).to(old[n].dtype) for n in mean}
        return ServerState({**old, **mixed}, server.per_client)

    def apply_private(self, server: ServerState, estimate: Params) -> ServerState:
        """With privacy: Algorithm 1's mix over the private (equal-weight) mean, post-processing of it."""
        return self.apply_mean(server, estimate)

    # --- evaluation -----------------------------------------------------------------------------
    def personalized_candidates(self, server: ServerState, state: Params | None, client_id: int) -> list[tuple[float, Params]]:
        return [(0.0, state if state is not None else server.global_params)]
