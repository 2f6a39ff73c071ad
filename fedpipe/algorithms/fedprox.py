"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020): FedAvg whose
local objective adds a proximal term toward the round's global model (Eq. 2)."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedpipe.algorithms.base import ClientContext, MethodParams, Params, Slots, cross_entropy
from fedpipe.algorithms.fedavg import FedAvg
from fedpipe.algorithms.regularizers import proximal_layer_norms, proximal_squared, weight_names


class FedProxParams(MethodParams):
    """FedProx: FedAvg plus a proximal term toward the round's global model."""

    name: Literal["fedprox"] = "fedprox"
    mu: float = Field(0.01, ge=0)
    """Weight of the proximal term; 0 makes FedProx FedAvg."""
    proximal: Literal["squared", "layer_norms"] = "squared"
    """'squared': (mu/2)||w - w^t||^2 over all parameters, the FedProx paper's Eq. 2.
    'layer_norms': mu * sum over weight tensors of ||w_l - w_l^t||_2, the form SuPerFed's official code
    uses for FedProx (and for its own proximity term)."""


class FedProx(FedAvg):
    name = "fedprox"
    Params = FedProxParams
    paper = "Li et al. 2020, Eq. 2"
    params: FedProxParams

    def client_params(self, ctx: ClientContext, download: Params, state: Params | None) -> Slots:
        return {"global": download, "anchor": download}

    def loss(self, slots: Slots, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        loss = cross_entropy(self.forward(slots["global"], x), y)
        if self.params.mu == 0:
            return loss
        w, anchor = slots["global"], slots["anchor"]
        if self.params.proximal == "squared":
            return loss + self.params.mu * proximal_squared(w, anchor)
        return loss + self.params.mu * proximal_layer_norms(w, anchor, weight_names(w))

