"""FedAvg (McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized
Data", AISTATS 2017, Algorithm 1): E local epochs of SGD, sample-weighted averaging on the server."""

from __future__ import annotations

from typing import Literal

import torch

from fedpipe.algorithms.base import (
    Algorithm,
    ClientContext,
    MethodParams,
    Params,
    Phase,
    Slots,
    Stage,
    cross_entropy,
    federation_phase,
)


class FedAvgParams(MethodParams):
    """FedAvg has no hyperparameters beyond the shared training ones (train.*)."""

    name: Literal["fedavg"] = "fedavg"


class FedAvg(Algorithm):
    name = "fedavg"
    Params = FedAvgParams
    paper = "McMahan et al. 2017, Algorithm 1"
    departures = (
        "train.momentum=0.9, train.weight_decay=1e-4 (SuPerFed's settings for every method): Algorithm 1 is plain SGD; "
        "train.momentum=0 train.weight_decay=0 is the paper's step",
        "train.lr=0.01 decayed by train.lr_decay=0.999 per round (SuPerFed's official scripts): Algorithm 1 keeps one "
        "eta, tuned per experiment",
        "train.client_fraction=1.0: every client trains every round (the paper's experiments mostly sample C = 0.1)",
    )

    @classmethod
    def phases(cls, params: MethodParams, rounds: int) -> list[Phase]:
        return [federation_phase(rounds, "federated training of one global model")]

    def client_params(self, ctx: ClientContext, download: Params, state: Params | None) -> Slots:
        return {"global": download}

    def stages(self, ctx: ClientContext, local_epochs: int) -> list[Stage]:
        return [Stage(("global",), local_epochs, self.loss)]

    def loss(self, slots: Slots, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        return cross_entropy(self.forward(slots["global"], x), y)

    def client_result(self, ctx: ClientContext, slots: Slots, state: Params | None) -> tuple[Params | None, Params | None]:
        return slots["global"], state
