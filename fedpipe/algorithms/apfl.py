"""APFL (Deng, Kamani and Mahdavi, "Adaptive Personalized Federated Learning", arXiv:2003.13461, 2020),
Algorithm 1 (local descent APFL) with the adaptive mixing weight.

Every client i keeps a local model v_i and a mixing weight alpha_i; its personalized model is the
weight-space mixture v_bar_i = alpha_i v_i + (1 - alpha_i) w. On each mini-batch xi, from the current
(w_i, v_i, alpha_i), all with the same step size eta (Algorithm 1):

    w_i     <- w_i - eta * grad f_i(w_i; xi)                        (the client's copy of the global model)
    v_i     <- v_i - eta * grad_v f_i(v_bar_i; xi)                  (= alpha_i * grad f_i(v_bar_i; xi))
    alpha_i <- alpha_i - eta_alpha * <v_i - w_i, grad f_i(v_bar_i; xi)>,  projected on [0, 1]

the last being the adaptive alpha update, alpha's gradient grad_alpha f_i(v_bar_i), Eq. (10) of the
paper. Every gradient is taken at the batch's starting point (the updates are simultaneous). After E
local epochs (the synchronisation gap tau) the client sends w_i; the server averages the w_i of the
round's clients (by sample count, as FedAvg). Only sampled clients train (the paper's partial
participation); a client's v_i starts as the initial model w^0 and its alpha_i at `alpha`.

The steps are the paper's plain SGD, written here as a custom update: train.optimizer, momentum and
weight decay do not apply to APFL. The authors' code (FedTorch) departs from Algorithm 1: it steps w
before taking v's gradient, and updates alpha once per round (on its first batch); this file follows
the algorithm as printed. A client that never trained has no local model: its personalized model is
the global one.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

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
    cross_entropy,
    federation_phase,
)
from fedpipe.search_space import Dimension, Uniform

LOCAL, ALPHA = "local", "alpha"


class APFLParams(MethodParams):
    """APFL: a global model by FedAvg, a local model per client, mixed by a learned weight alpha_i."""

    search_space: ClassVar[dict[str, Dimension]] = {"method.alpha": Uniform(0.0, 1.0)}
    """What a study tunes beside train.lr: the mixing weight alpha (APFL's paper sweeps 0..1)."""

    name: Literal["apfl"] = "apfl"
    alpha: float = Field(0.5, ge=0, le=1)
    """alpha_i at the start (every client): 0 is the global model, 1 the local one. The paper's
    experiments use 0.25, 0.5 and 0.75 when alpha is fixed."""
    adaptive_alpha: bool = True
    """Learn alpha_i by the adaptive update (Eq. 10); False keeps it at `alpha`."""
    alpha_lr: float | None = Field(None, gt=0)
    """Step size of the alpha update; None: the round's learning rate (the paper's one eta_t)."""


class APFL(Algorithm):
    name = "apfl"
    Params = APFLParams
    paper = "Deng et al. 2020, Algorithm 1 and Eq. 10 (adaptive alpha)"
    uploads = "the global model (its local model and alpha stay on the client)"
    bf16_refusal = OWN_UPDATE_IN_FP32
    departures = (
        "alpha=0.5: where every client's adaptive alpha starts is fedpipe's choice (the paper's fixed-alpha runs use "
        "0.25, 0.5 and 0.75)",
        "eta = train.lr 0.01 decayed by 0.999 per round (run-wide), also alpha's step (alpha_lr=None, the paper's one "
        "eta); the value is not the paper's",
        "the server averages the w_i by sample count (FedAvg's rule); Algorithm 1 takes the plain mean over the sampled clients",
        "a client that never trained is evaluated on the global model (the paper does not say)",
    )
    params: APFLParams

    def __init__(self, params, model, seed):
        super().__init__(params, model, seed)
        self.initial = {n: p.detach() for n, p in model.named_parameters()}  # v_i^(0) = w^(0)

    @classmethod
    def phases(cls, params: MethodParams, rounds: int) -> list[Phase]:
        return [federation_phase(rounds, "global and local models trained together, mixed by a learned alpha per client")]

    @staticmethod
    def mix(w: Params, v: Params, alpha: torch.Tensor | float) -> Params:
        """v_bar = alpha v + (1 - alpha) w, per tensor."""
        return {n: alpha * v[n] + (1 - alpha) * w[n] for n in w}

    # --- client side --------------------------------------------------------------------------------
    def client_params(self, ctx: ClientContext, download: Params, state: Params | None) -> Slots:
        local = {k.removeprefix(LOCAL + "."): v for k, v in (state or {}).items() if k.startswith(LOCAL + ".")}
        alpha = state[ALPHA] if state is not None else torch.tensor(self.params.alpha, device=next(iter(download.values())).device)
        return {"global": download, LOCAL: local or self.initial, ALPHA: {ALPHA: alpha}}

    def stages(self, ctx: ClientContext, local_epochs: int) -> list[Stage]:
        return [Stage(("global", LOCAL, ALPHA), local_epochs, self.loss, update=self.update)]

    def loss(self, slots: Slots, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """f_i(v_bar_i): the personalized model's cross-entropy (what the engine reports)."""
        return cross_entropy(self.forward(self.mix(slots["global"], slots[LOCAL], slots[ALPHA][ALPHA]), x), y)

    def update(self, slots: Slots, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None, lr: float) -> torch.Tensor:
        """One step of Algorithm 1 on the batch, in place; returns f_i(v_bar_i) before the step."""
        w, v, alpha = slots["global"], slots[LOCAL], slots[ALPHA][ALPHA]
        grad_w = torch.autograd.grad(cross_entropy(self.forward(w, x), y), list(w.values()))
        loss = cross_entropy(self.forward(self.mix(w, v, alpha), x), y)
        # d f(v_bar)/d v = alpha * grad f(v_bar); d f(v_bar)/d alpha = <v - w, grad f(v_bar)> (Eq. 10)
        grads = torch.autograd.grad(loss, [*v.values(), alpha])
        with torch.no_grad():
            for t, g in zip(w.values(), grad_w):
                t.sub_(lr * g)
            for t, g in zip(v.values(), grads[:-1]):
                t.sub_(lr * g)
            if self.params.adaptive_alpha:
                alpha.sub_((self.params.alpha_lr or lr) * grads[-1]).clamp_(0.0, 1.0)
        return loss.detach()

    def client_result(self, ctx: ClientContext, slots: Slots, state: Params | None) -> tuple[Params | None, Params | None]:
        kept = {f"{LOCAL}.{k}": t for k, t in slots[LOCAL].items()}
        kept[ALPHA] = slots[ALPHA][ALPHA]
        return slots["global"], kept

    # --- server side and evaluation ---------------------------------------------------------------
    def round_details(self, server: ServerState, clients: dict[int, Params]) -> dict:
        return {"alpha": {str(cid): round(float(s[ALPHA]), 6) for cid, s in sorted(clients.items()) if s and ALPHA in s}}

    def personalized_candidates(self, server: ServerState, state: Params | None, client_id: int) -> list[tuple[float, Params]]:
        if state is None:
            return [(0.0, server.global_params)]
        local = {k.removeprefix(LOCAL + "."): v for k, v in state.items() if k.startswith(LOCAL + ".")}
        return [(0.0, self.mix(server.global_params, local, state[ALPHA]))]
