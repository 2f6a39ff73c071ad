"""FedAvg-FT and FedProx-FT: federated training, then E epochs of local fine-tuning per client.

The "local update" personalisation of Wang et al. ("Federated Evaluation of On-device
Personalization", 2019) that SuPerFed's tables call FedAvg-LU / FedProx-LU: after the last round
every client fine-tunes the final global model on its own training split with plain cross-entropy,
and keeps the result as its personalized model.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedpipe.algorithms.base import Params, Phase, ServerState, Slots, Stage, cross_entropy
from fedpipe.algorithms.fedavg import FedAvg, FedAvgParams
from fedpipe.algorithms.fedprox import FedProx, FedProxParams
from fedpipe.schema import Section


class _FineTuneFields(Section):
    finetune_epochs: int = Field(5, ge=1)
    """Local epochs of fine-tuning per client after federated training (E of the fine-tuning step)."""
    finetune_lr_scale: float = Field(1.0, gt=0)
    """Fine-tuning learning rate as a multiple of train.lr decayed to the fine-tuning round."""


class FedAvgFTParams(FedAvgParams, _FineTuneFields):
    """FedAvg, then local fine-tuning of the final global model on every client."""

    name: Literal["fedavg_ft"] = "fedavg_ft"  # type: ignore[assignment]


class FedProxFTParams(FedProxParams, _FineTuneFields):
    """FedProx, then local fine-tuning of the final global model on every client."""

    name: Literal["fedprox_ft"] = "fedprox_ft"  # type: ignore[assignment]


class FineTuned:
    """Mixin: appends a `finetune` phase (one pass over every client, no upload) to a federated method."""

    @classmethod
    def phases(cls, params, rounds: int) -> list[Phase]:
        federated = super().phases(params, rounds)  # type: ignore[misc]
        return [*federated, Phase("finetune", rounds + 1, rounds + 1, sample_clients=False, communicates=False,
                                  description="every client fine-tunes the final global model locally")]

    def client_params(self, phase: Phase, download: Params, state: Params | None, client_id: int) -> Slots:
        if phase.name == "finetune":
            return {"personal": download}
        return super().client_params(phase, download, state, client_id)  # type: ignore[misc]

    def stages(self, phase: Phase, local_epochs: int) -> list[Stage]:
        if phase.name == "finetune":
            p = self.params  # type: ignore[attr-defined]
            return [Stage(("personal",), p.finetune_epochs, self._finetune_loss, lr_scale=p.finetune_lr_scale)]
        return super().stages(phase, local_epochs)  # type: ignore[misc]

    def _finetune_loss(self, slots: Slots, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        return cross_entropy(self.forward(slots["personal"], x), y)  # type: ignore[attr-defined]

    def client_result(self, phase: Phase, slots: Slots, state: Params | None) -> tuple[Params | None, Params | None]:
        if phase.name == "finetune":
            return None, slots["personal"]
        return super().client_result(phase, slots, state)  # type: ignore[misc]

    def personalized_candidates(self, server: ServerState, state: Params | None, client_id: int) -> list[tuple[float, Params]]:
        return [(0.0, state if state is not None else server.global_params)]


class FedAvgFT(FineTuned, FedAvg):
    name = "fedavg_ft"
    Params = FedAvgFTParams
    paper = "McMahan et al. 2017 + local fine-tuning (Wang et al. 2019)"


class FedProxFT(FineTuned, FedProx):
    name = "fedprox_ft"
    Params = FedProxFTParams
    paper = "Li et al. 2020 + local fine-tuning (Wang et al. 2019)"
