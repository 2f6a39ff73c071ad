"""Local fine-tuning after federated training, for any method (`method.finetune_epochs`), and the
FedAvg-FT / FedProx-FT baselines that are FedAvg / FedProx with it switched on.

The "local update" personalization of Wang et al. ("Federated Evaluation of On-device
Personalization", 2019), which SuPerFed's tables call FedAvg-LU / FedProx-LU and which pFedMB's
comparison applies to every method: after the last round every client fine-tunes its personalized
model (the global model, or what the method personalizes it into) on its own training split with
plain cross-entropy for E epochs, and keeps the result as its personalized model.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import ClassVar, Literal

import torch
from pydantic import Field

from fedpipe.algorithms.aggregation import NO_UPLOADS, Aggregation
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
)
from fedpipe.algorithms.fedavg import FedAvg, FedAvgParams
from fedpipe.algorithms.fedprox import FedProx, FedProxParams
from fedpipe.config import MAX_EPOCHS
from fedpipe.search_space import Dimension, IntRange, LogUniform

FINETUNED = "finetuned/"  # prefix of the fine-tuned tensors in a client's kept state

# what FedAvg-FT / FedProx-FT add to their federated method's departures (`fedpipe methods`)
FINETUNE_DEPARTURES = (
    "finetune_epochs=5: pFedMB's fine-tuning for E = 5 local epochs; Wang et al. tune the epochs and SuPerFed's -LU "
    "baselines say only 'small steps'",
    "fine-tuning uses the run's optimiser at train.lr as decayed to the round after the last (finetune_lr_scale=1.0), "
    "on the training split: the papers do not give its rate",
)


def finetune_phase(after_round: int) -> Phase:
    return Phase("finetune", after_round + 1, after_round + 1, sample_clients=False, communicates=False,
                 description="every client fine-tunes its personalized model locally")


def with_finetune(phases: list[Phase], params: MethodParams) -> list[Phase]:
    """A method's own `phases`, then `finetune` when params.finetune_epochs > 0."""
    if params.finetune_epochs:
        return [*phases, finetune_phase(max(p.last_round for p in phases))]
    return phases


def _own(state: Params | None) -> Params | None:
    """The wrapped method's part of a client's state (without the fine-tuned tensors)."""
    if state is None:
        return None
    return {k: v for k, v in state.items() if not k.startswith(FINETUNED)}


class FineTuned(Algorithm):
    """Wraps a method and adds its `finetune` phase; everything else is the wrapped method's."""

    def __init__(self, inner: Algorithm):
        super().__init__(inner.params, inner.model, inner.seed)
        self.inner = inner
        self.name = inner.name
        self.paper = f"{inner.paper} + local fine-tuning (Wang et al. 2019)"
        self.uploads, self.privacy_refusal, self.privacy_caveat = inner.uploads, inner.privacy_refusal, inner.privacy_caveat

    def phases(self, params: MethodParams, rounds: int) -> list[Phase]:  # type: ignore[override]
        """The wrapped method's phases, then `finetune` (an instance's: the wrapper knows its method
        only once built; `fedpipe.algorithms.phases_of` gives them from the config alone)."""
        return with_finetune(type(self.inner).phases(params, rounds), params)

    def forward(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        return self.inner.forward(params, x)

    def client_params(self, ctx: ClientContext, download: Params, state: Params | None) -> Slots:
        if ctx.phase.name != "finetune":
            return self.inner.client_params(ctx, download, _own(state))
        candidates = self.inner.personalized_candidates(ServerState(download), _own(state), ctx.client_id)
        return {"personal": candidates[0][1]}

    def stages(self, ctx: ClientContext, local_epochs: int) -> list[Stage]:
        if ctx.phase.name != "finetune":
            return self.inner.stages(ctx, local_epochs)
        return [Stage(("personal",), self.params.finetune_epochs, self._finetune_loss, lr_scale=self.params.finetune_lr_scale)]

    def _finetune_loss(self, slots: Slots, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        return cross_entropy(self.inner.forward(slots["personal"], x), y)

    def batch_noise(self, ctx: ClientContext, stage: Stage, generator: torch.Generator) -> torch.Tensor | None:
        return None if ctx.phase.name == "finetune" else self.inner.batch_noise(ctx, stage, generator)

    def client_result(self, ctx: ClientContext, slots: Slots, state: Params | None) -> tuple[Params | None, Params | None]:
        if ctx.phase.name != "finetune":
            return self.inner.client_result(ctx, slots, _own(state))
        return None, {**(_own(state) or {}), **{FINETUNED + k: v for k, v in slots["personal"].items()}}

    def download(self, phase: Phase, server: ServerState, client_id: int) -> Params:
        return self.inner.download(phase, server, client_id)

    def upload_layout(self, phase: Phase, download: Params, sent: Collection[str] = ()) -> Params:
        return self.inner.upload_layout(phase, download, sent)

    def aggregation(self, phase: Phase) -> Aggregation:
        """The wrapped method's rule in its phases (FedAvg-FT's federation: the weighted mean); the
        `finetune` phase sends nothing."""
        return NO_UPLOADS if phase.name == "finetune" else self.inner.aggregation(phase)

    def aggregate(self, phase: Phase, server: ServerState, uploads: list[Upload]) -> ServerState:
        return self.inner.aggregate(phase, server, uploads)

    def apply_average(self, server: ServerState, averaged: Params) -> ServerState:
        return self.inner.apply_average(server, averaged)

    def apply_private(self, server: ServerState, estimate: Params) -> ServerState:
        return self.inner.apply_private(server, estimate)

    def global_model(self, server: ServerState) -> Params | None:
        return self.inner.global_model(server)

    def report_plots(self, rounds: list[dict]):
        return self.inner.report_plots(rounds)

    def round_details(self, server: ServerState, clients: dict[int, Params]) -> dict:
        return self.inner.round_details(server, {k: _own(v) for k, v in clients.items()})

    def personalized_candidates(self, server: ServerState, state: Params | None, client_id: int) -> list[tuple[float, Params]]:
        tuned = {k.removeprefix(FINETUNED): v for k, v in (state or {}).items() if k.startswith(FINETUNED)}
        return [(0.0, tuned)] if tuned else self.inner.personalized_candidates(server, _own(state), client_id)

    @property
    def candidate_label(self) -> str | None:
        return self.inner.candidate_label


class FedAvgFTParams(FedAvgParams):
    """FedAvg, then local fine-tuning of the final global model on every client."""

    search_space: ClassVar[dict[str, Dimension]] = {"method.finetune_epochs": IntRange(1, 10)}
    """What a study tunes beside train.lr: how long each client fine-tunes."""

    name: Literal["fedavg_ft"] = "fedavg_ft"  # type: ignore[assignment]
    finetune_epochs: int = Field(5, ge=1, le=MAX_EPOCHS)
    """Local epochs of fine-tuning per client after federated training (E of the fine-tuning step)."""


class FedProxFTParams(FedProxParams):
    """FedProx, then local fine-tuning of the final global model on every client."""

    search_space: ClassVar[dict[str, Dimension]] = {"method.mu": LogUniform(0.001, 1.0), "method.finetune_epochs": IntRange(1, 10)}
    """What a study tunes beside train.lr: FedProx's mu and how long each client fine-tunes."""

    name: Literal["fedprox_ft"] = "fedprox_ft"  # type: ignore[assignment]
    finetune_epochs: int = Field(5, ge=1, le=MAX_EPOCHS)
    """Local epochs of fine-tuning per client after federated training (E of the fine-tuning step)."""


class FedAvgFT(FedAvg):
    name = "fedavg_ft"
    Params = FedAvgFTParams
    paper = "McMahan et al. 2017"
    departures = (*FedAvg.departures, *FINETUNE_DEPARTURES)


class FedProxFT(FedProx):
    name = "fedprox_ft"
    Params = FedProxFTParams
    paper = "Li et al. 2020, Eq. 2"
    departures = (*FedProx.departures, *FINETUNE_DEPARTURES)
