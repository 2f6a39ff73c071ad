"""FedPer (Arivazhagan et al., "Federated Learning with Personalization Layers", arXiv:1912.00818, 2019).

The network is split into base layers W_B, federated as in FedAvg, and personalization layers W_P,
which never leave the client (Algorithms 1 and 2):

- the server sends W_B^t; client j trains (W_B, W_P,j) together for E epochs with SGD on its own data
  (Algorithm 1) and sends back W_B only;
- the server averages the base layers by sample count, W_B^{t+1} = sum_j n_j W_B,j / n (Algorithm 2);
- a client's personalized model is the current global base with its own personalization layers.

Which layers are personal is `personal_layers` (parameter-name prefixes; the paper's experiments
personalize the last one or two fully connected layers; every network here ends in a `head` Linear,
the default). A client's personalization layers start, on its first round, as the initial model's
(every client starts from the one initial model, as in FedAvg; the paper leaves their
initialisation open). With no personal layers FedPer is FedAvg.
"""

from __future__ import annotations

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
    cross_entropy,
    federation_phase,
)
from fedpipe.errors import ConfigError
from fedpipe.nn.networks import names_under


class FedPerParams(MethodParams):
    """FedPer: federated base layers, personalization layers kept on each client."""

    name: Literal["fedper"] = "fedper"
    personal_layers: list[str] = Field(default_factory=lambda: ["head"])
    """Prefixes of the parameter names that stay on the client (a prefix matches the name itself or
    `prefix.` + anything): ["head"] is the output layer of every network here; ["body.3", "head"] in
    `twonn` would also keep the second hidden layer. []: nothing is personal, which is FedAvg."""


class FedPer(Algorithm):
    name = "fedper"
    Params = FedPerParams
    paper = "Arivazhagan et al. 2019, Algorithms 1 and 2"
    departures = (
        "personal_layers=[head]: only the output layer is personal; the paper's experiments personalise the last one or "
        "two fully connected layers (SuPerFed describes FedPer's personalization layer as the penultimate one)",
        "a client's personalization layers start as the run's initial model's (the paper does not say)",
        "train.* are the run-wide defaults (SGD lr 0.01, momentum 0.9, weight decay 1e-4, B = 10, E = 5), SuPerFed's "
        "settings, not the paper's",
    )
    params: FedPerParams

    def __init__(self, params, model, seed):
        super().__init__(params, model, seed)
        names = [n for n, _ in model.named_parameters()]
        self.personal = names_under(names, self.params.personal_layers, "method.personal_layers")
        if len(self.personal) == len(names):
            raise ConfigError("method.personal_layers covers every parameter: nothing would be federated. Keep some base layers.")
        # the initial model's personalization layers: where every client's own layers start
        self.initial_personal = {n: p.detach() for n, p in model.named_parameters() if n in self.personal}

    @classmethod
    def phases(cls, params: MethodParams, rounds: int) -> list[Phase]:
        return [federation_phase(rounds, "base layers federated, personalization layers kept on each client")]

    def base(self, params: Params) -> Params:
        return {n: t for n, t in params.items() if n not in self.personal}

    def own_layers(self, state: Params | None) -> Params:
        return state if state is not None else self.initial_personal

    # --- server side ----------------------------------------------------------------------------
    def download(self, phase: Phase, server: ServerState, client_id: int) -> Params:
        return self.base(server.global_params)  # W_B^t only (Algorithm 2): the head never travels

    # --- client side ----------------------------------------------------------------------------
    def client_params(self, ctx: ClientContext, download: Params, state: Params | None) -> Slots:
        return {"model": {**self.base(download), **self.own_layers(state)}}

    def stages(self, ctx: ClientContext, local_epochs: int) -> list[Stage]:
        return [Stage(("model",), local_epochs, self.loss)]  # W_B and W_P trained together (Algorithm 1)

    def loss(self, slots: Slots, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        return cross_entropy(self.forward(slots["model"], x), y)

    def client_result(self, ctx: ClientContext, slots: Slots, state: Params | None) -> tuple[Params | None, Params | None]:
        model = slots["model"]
        return self.base(model), {n: model[n] for n in self.personal}

    # --- evaluation -----------------------------------------------------------------------------
    def global_model(self, server: ServerState) -> Params | None:
        # the base alone is no classifier; without personal layers the global model is FedAvg's
        return None if self.personal else server.global_params

    def personalized_candidates(self, server: ServerState, state: Params | None, client_id: int) -> list[tuple[float, Params]]:
        return [(0.0, {**self.base(server.global_params), **self.own_layers(state)})]
