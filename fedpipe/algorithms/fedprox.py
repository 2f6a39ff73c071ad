"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020): FedAvg whose
local objective adds a proximal term toward the round's global model (Eq. 2)."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from fedpipe.algorithms.base import ClientContext, MethodParams, Params, Slots, cross_entropy
from fedpipe.algorithms.fedavg import FedAvg
from fedpipe.algorithms.regularizers import mixable_layers, proximal_layer_norms, proximal_squared
from fedpipe.search_space import Dimension, LogUniform


class FedProxParams(MethodParams):
    """FedProx: FedAvg plus a proximal term toward the round's global model."""

    search_space: ClassVar[dict[str, Dimension]] = {"method.mu": LogUniform(0.001, 1.0)}
    """What a study tunes beside train.lr: the proximal weight, the range FedProx's paper sweeps (0.001 to 1)."""

    name: Literal["fedprox"] = "fedprox"
    mu: float = Field(0.01, ge=0)
    """Weight of the proximal term; 0 makes FedProx FedAvg."""
    proximal: Literal["squared", "layer_norms"] = "squared"
    """'squared': (mu/2)||w - w^t||^2 over all parameters, the FedProx paper's Eq. 2.
    'layer_norms': mu * sum over tensors of ||w_t - w_t^t||_2, the form SuPerFed's official code uses for
    FedProx (and for its own proximity term), over the tensors SuPerFed mixes with its defaults
    (`regularizers.mixable_layers`, chosen by module type): the weights of conv, linear, LSTM/GRU/RNN
    (weight_ih / weight_hh) and embedding layers and norm layers' affine weight and bias; no other
    biases. (The official FedProx takes every tensor named `weight*`, norm layers' biases left out; no
    bundled model has a norm layer.) A model with a layer of another type is refused, naming it."""


class FedProx(FedAvg):
    name = "fedprox"
    Params = FedProxParams
    paper = "Li et al. 2020, Eq. 2"
    departures = (
        "mu=0.01: SuPerFed's value for every proximal method; the paper tunes mu per dataset from {0.001, 0.01, 0.1, 1}",
        "every client runs the full train.local_epochs (no stragglers with partial work, which the paper's systems "
        "heterogeneity experiments simulate)",
        "train.* are the run-wide defaults (SGD lr 0.01 decayed 0.999 per round, momentum 0.9, weight decay 1e-4, "
        "B = 10, E = 5): SuPerFed's settings; the paper's local solver is plain SGD",
    )
    params: FedProxParams

    def __init__(self, params, model, seed):
        super().__init__(params, model, seed)
        # SuPerFed's selection with its defaults, so SuPerFed with nu = 0 and no Phase II is this FedProx
        layers = mixable_layers(model) if params.proximal == "layer_norms" else {}
        self.prox_names = [n for names in layers.values() for n in names]

    def client_params(self, ctx: ClientContext, download: Params, state: Params | None) -> Slots:
        return {"global": download, "anchor": download}

    def loss(self, slots: Slots, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        loss = cross_entropy(self.forward(slots["global"], x), y)
        if self.params.mu == 0:
            return loss
        w, anchor = slots["global"], slots["anchor"]
        if self.params.proximal == "squared":
            return loss + self.params.mu * proximal_squared(w, anchor)
        return loss + self.params.mu * proximal_layer_norms(w, anchor, self.prox_names)

