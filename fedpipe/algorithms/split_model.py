"""The common shape of FedPer and LG-FedAvg: a network split into shared layers, federated as in FedAvg,
and the client's own layers, which never leave it.

- the server sends the shared layers of its global model; the client trains its whole model (shared
  and own layers together) for E epochs on its own data and sends back the shared layers only;
- the server averages the shared layers by sample count (the default aggregation);
- a client's personalized model is the current global shared layers with its own layers, which start,
  on its first round, as the run's initial model's.

The methods differ in which part is shared. Each names one part by parameter-name prefixes in its
Params (`layers_option`); `option_names_shared` says whether that part is the shared one (LG-FedAvg:
global top layers) or the client's own (FedPer: personalization layers). The order of the two parts
in a client's model (`own_first`) follows each method's own layout.
"""

from __future__ import annotations

from typing import ClassVar

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
    federation_phase,
)
from fedpipe.nn.networks import names_under


class SplitModelAlgorithm(Algorithm):
    """Shared layers federated, the other layers kept on each client. Subclasses set `layers_option`,
    `option_names_shared`, `own_first` and `phase_description`, and check the split in `check_split`."""

    layers_option: ClassVar[str]  # the Params field listing the named layers' prefixes
    option_names_shared: ClassVar[bool]  # True: the named layers are the shared ones; False: the client's own
    own_first: ClassVar[bool] = False  # the client's own layers come first in its model
    phase_description: ClassVar[str]

    def __init__(self, params, model, seed):
        super().__init__(params, model, seed)
        names = [n for n, _ in model.named_parameters()]
        named = set(names_under(names, getattr(self.params, self.layers_option), f"method.{self.layers_option}"))
        self.shared_names = [n for n in names if (n in named) == self.option_names_shared]
        self.own_names = [n for n in names if (n in named) != self.option_names_shared]
        self.check_split()
        self._shared = set(self.shared_names)
        # where every client's own layers start: the initial model's
        self.initial_own = {n: p.detach() for n, p in model.named_parameters() if n not in self._shared}

    def check_split(self) -> None:
        """Raise ConfigError when the split leaves a part the method needs empty."""

    @classmethod
    def phases(cls, params: MethodParams, rounds: int) -> list[Phase]:
        return [federation_phase(rounds, cls.phase_description)]

    def shared_part(self, params: Params) -> Params:
        return {n: t for n, t in params.items() if n in self._shared}

    def own_layers(self, state: Params | None) -> Params:
        return state if state is not None else self.initial_own

    def whole(self, shared: Params, own: Params) -> Params:
        """A client's whole model from the shared layers and its own."""
        return {**own, **shared} if self.own_first else {**shared, **own}

    # --- server side ----------------------------------------------------------------------------
    def download(self, phase: Phase, server: ServerState, client_id: int) -> Params:
        return self.shared_part(server.global_params)  # the client's own layers never travel

    # --- client side ----------------------------------------------------------------------------
    def client_params(self, ctx: ClientContext, download: Params, state: Params | None) -> Slots:
        return {"model": self.whole(self.shared_part(download), self.own_layers(state))}

    def stages(self, ctx: ClientContext, local_epochs: int) -> list[Stage]:
        return [Stage(("model",), local_epochs, self.loss)]  # shared and own layers trained together

    def loss(self, slots: Slots, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        return cross_entropy(self.forward(slots["model"], x), y)

    def client_result(self, ctx: ClientContext, slots: Slots, state: Params | None) -> tuple[Params | None, Params | None]:
        model = slots["model"]
        return self.shared_part(model), {n: t for n, t in model.items() if n not in self._shared}

    # --- evaluation -----------------------------------------------------------------------------
    def global_model(self, server: ServerState) -> Params | None:
        # the shared part alone is no classifier; with nothing kept on the clients it is FedAvg's model
        return None if self.own_names else server.global_params

    def personalized_candidates(self, server: ServerState, state: Params | None, client_id: int) -> list[tuple[float, Params]]:
        return [(0.0, self.whole(self.shared_part(server.global_params), self.own_layers(state)))]
