"""LG-FedAvg (Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov and Morency, "Think Locally, Act
Globally: Federated Learning with Local and Global Representations", arXiv:2001.01523, 2020),
Algorithm 1 with supervised local representations.

The network is split in two: the lower layers are each client's local representation h(x; theta_m^l),
never sent; the top layers theta^g are a global model acting on those representations, federated
as in FedAvg:

- the server sends theta^g; client m trains (theta_m^l, theta^g) jointly for E epochs on its own data,
  loss l(g(h(x; theta_m^l); theta^g), y), and sends back theta^g only;
- the server averages the returned theta^g by sample count (FedAvg's weighting; the authors' code
  averages them uniformly);
- a client's personalized model is its own local layers under the current global layers.

Which layers are global is `global_layers` (parameter-name prefixes). The default is the output layer,
`head`, that every network here ends in; the authors' scripts keep the last two layers global for
their CIFAR-10 CNN (here lenet5's ["body.2", "head"]) and start from a FedAvg-trained model (run
fedavg first and keep the whole model as every client's start, or accept the initial model as here:
every client's local layers start as the initial model's). FedPer is the mirror image: a global body
and personal top layers.

There is no global model to evaluate on its own: the global layers need a client's representation.
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


class LGFedAvgParams(MethodParams):
    """LG-FedAvg: local representation layers per client, global top layers federated."""

    name: Literal["lgfedavg"] = "lgfedavg"
    global_layers: list[str] = Field(default_factory=lambda: ["head"])
    """Prefixes of the parameter names that are global (federated); every other parameter is a local
    representation layer. ["head"]: the output layer of every network here; ["body.2", "head"] in
    lenet5 is the authors' CIFAR-10 setting (the last two layers global)."""


class LGFedAvg(Algorithm):
    name = "lgfedavg"
    Params = LGFedAvgParams
    paper = "Liang et al. 2020, Algorithm 1 (local representations, global top layers)"
    departures = (
        "global_layers=[head]: only the output layer is global; the authors' scripts keep the last two layers global "
        "(lenet5: global_layers=[body.2, head])",
        "every layer starts from the run's initial model; the authors' scripts start from a FedAvg-trained model",
        "the server averages the global layers by sample count (FedAvg's rule); the authors' code averages them uniformly",
        "train.* are the run-wide defaults (SGD lr 0.01, momentum 0.9, weight decay 1e-4, B = 10, E = 5), SuPerFed's "
        "settings, not the paper's",
    )
    params: LGFedAvgParams

    def __init__(self, params, model, seed):
        super().__init__(params, model, seed)
        names = [n for n, _ in model.named_parameters()]
        self.global_names = names_under(names, self.params.global_layers, "method.global_layers")
        if not self.global_names or len(self.global_names) == len(names):
            raise ConfigError("method.global_layers must name some but not all layers: LG-FedAvg needs both local "
                              "representation layers and global layers.")
        # where every client's local representation layers start: the initial model's
        self.initial_local = {n: p.detach() for n, p in model.named_parameters() if n not in self.global_names}

    @classmethod
    def phases(cls, params: MethodParams, rounds: int) -> list[Phase]:
        return [federation_phase(rounds, "global top layers federated, local representation layers kept on each client")]

    def global_part(self, params: Params) -> Params:
        return {n: params[n] for n in self.global_names}

    def local_part(self, state: Params | None) -> Params:
        return state if state is not None else self.initial_local

    # --- server side ----------------------------------------------------------------------------
    def download(self, phase: Phase, server: ServerState, client_id: int) -> Params:
        return self.global_part(server.global_params)  # theta^g only: representations never travel

    # --- client side ----------------------------------------------------------------------------
    def client_params(self, ctx: ClientContext, download: Params, state: Params | None) -> Slots:
        return {"model": {**self.local_part(state), **download}}

    def stages(self, ctx: ClientContext, local_epochs: int) -> list[Stage]:
        return [Stage(("model",), local_epochs, self.loss)]  # local and global layers trained jointly

    def loss(self, slots: Slots, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        return cross_entropy(self.forward(slots["model"], x), y)

    def client_result(self, ctx: ClientContext, slots: Slots, state: Params | None) -> tuple[Params | None, Params | None]:
        model = slots["model"]
        return self.global_part(model), {n: t for n, t in model.items() if n not in self.global_names}

    # --- evaluation -----------------------------------------------------------------------------
    def global_model(self, server: ServerState) -> Params | None:
        return None  # the global layers alone are no classifier

    def personalized_candidates(self, server: ServerState, state: Params | None, client_id: int) -> list[tuple[float, Params]]:
        return [(0.0, {**self.local_part(state), **self.global_part(server.global_params)})]
