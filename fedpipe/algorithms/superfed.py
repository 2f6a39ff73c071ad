"""SuPerFed (Hahn et al., "Connecting Low-Loss Subspace for Personalized Federated Learning", KDD 2022;
arXiv title "Subspace Learning for Personalized Federated Optimization").

Every client holds a federated model w_g and a local model w_l of one architecture, and trains the
weight-space mixture w(lam) = (1 - lam) w_g + lam w_l (Eq. 3; the formulas lost from the paper copy
are restored in ../shared/reference/superfed.md from the official code):

- Phase I, rounds 1 .. floor(L R): lam = 0, w_l frozen; loss = CE(w_g) + mu * prox.
- Phase II, later rounds: lam ~ U(0, 1) per mini-batch, one for the whole model (Model Mixing, MM) or
  one per layer (Layer Mixing, LM); both models trained;
  loss = CE(w(lam)) + mu * prox + nu * cos^2(w_g, w_l).
- prox = sum_l ||w_g,l - w_g,l^prev||_2 over the mixed layers; cos^2 is the squared cosine of the two
  concatenated weight vectors. Only w_g is uploaded; the server averages it by sample count.

With mu = nu = 0 and no Phase II it is FedAvg; with nu = 0 and no Phase II it is FedProx with
`proximal: layer_norms`.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field, model_validator

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
)
from fedpipe.algorithms.regularizers import proximal_layer_norms, squared_cosine, weight_names
from fedpipe.engine.seeding import torch_generator


class _SuPerFedFields(MethodParams):
    mu: float = Field(0.01, ge=0)
    """Weight of the proximity term toward the previous round's global model (both phases)."""
    start_fraction: float = Field(0.6, ge=0, le=1)
    """L: Phase II (personalization) starts after floor(L * train.rounds) rounds. 1 means no Phase II."""
    mix_bias: bool = False
    """False (official code): only layers' weights have a local copy; biases are shared, federated and
    trained by both phases. True: biases are mixed too (the paper's wording: the whole models mix)."""
    lam_grid_step: float = Field(0.1, gt=0, le=1)
    """Spacing of the lam grid swept at evaluation (0.0, 0.1, ..., 1.0 by default)."""

    @model_validator(mode="after")
    def _mixing_is_the_personalization(self):
        if self.finetune_epochs:
            raise ValueError("SuPerFed personalizes by mixing its global and local models (lam); finetune_epochs must stay 0")
        return self


class SuPerFedMMParams(_SuPerFedFields):
    """SuPerFed with Model Mixing: one lam ~ U(0, 1) per mini-batch for the whole model."""

    name: Literal["superfed_mm"] = "superfed_mm"
    nu: float = Field(1.0, ge=0)
    """Weight of the orthogonality term cos^2(w_g, w_l) in Phase II (official default 1 for MM)."""


class SuPerFedLMParams(_SuPerFedFields):
    """SuPerFed with Layer Mixing: one lam ~ U(0, 1) per layer and mini-batch."""

    name: Literal["superfed_lm"] = "superfed_lm"
    start_fraction: float = Field(0.8, ge=0, le=1)
    """L: Phase II (personalization) starts after floor(L * train.rounds) rounds (official 0.8 for LM)."""
    nu: float = Field(2.0, ge=0)
    """Weight of the orthogonality term cos^2(w_g, w_l) in Phase II (official default 2 for LM)."""


class SuPerFedMM(Algorithm):
    """SuPerFed with Model Mixing: one lam per mini-batch for every layer."""

    name = "superfed_mm"
    Params = SuPerFedMMParams
    paper = "Hahn et al. 2022, Eq. 3 and Algorithm 1"
    params: SuPerFedMMParams
    layerwise = False

    def __init__(self, params, model, seed):
        super().__init__(params, model, seed)
        names = dict(model.named_parameters())
        self.mixed = [n for n in names if self.params.mix_bias or n in weight_names(names)]
        # Layer Mixing draws one lam per layer: a layer is the module that owns a mixed tensor.
        layers = sorted({n.rsplit(".", 1)[0] for n in self.mixed})
        self.layer_of = {n: layers.index(n.rsplit(".", 1)[0]) for n in self.mixed}
        self.num_layers = len(layers)

    @classmethod
    def phases(cls, params: _SuPerFedFields, rounds: int) -> list[Phase]:
        # Both phases always exist (a pipeline has one task per phase); with L = 0 or L = 1 one of
        # them has no rounds and hands its input state on unchanged.
        split = math.floor(params.start_fraction * rounds)
        return [
            Phase("federation", 1, split, sample_clients=True, communicates=True,
                  description="Phase I: the global model alone (lam = 0)"),
            Phase("personalization", split + 1, rounds, sample_clients=True, communicates=True,
                  description="Phase II: global and local models mixed in weight space"),
        ]

    # --- client side ----------------------------------------------------------------------------
    def client_params(self, ctx: ClientContext, download: Params, state: Params | None) -> Slots:
        slots = {"global": download, "anchor": download}
        if ctx.phase.name == "personalization":
            slots["local"] = state if state is not None else self.init_local(download, ctx.client_id)
        return slots

    def init_local(self, like: Params, client_id: int) -> Params:
        """A client's local model, initialised differently from the global one (seeded by the client id):
        Xavier-normal weights as in the official code, zero biases."""
        gen = torch_generator(self.seed, "superfed-local-init", client_id)
        local = {}
        for n in self.mixed:
            t = torch.empty(like[n].shape, dtype=like[n].dtype)
            if t.dim() > 1:
                torch.nn.init.xavier_normal_(t, generator=gen)
            else:
                t.zero_()
            local[n] = t.to(like[n].device)
        return local

    def stages(self, ctx: ClientContext, local_epochs: int) -> list[Stage]:
        if ctx.phase.name == "personalization":
            return [Stage(("global", "local"), local_epochs, self.mixed_loss)]
        return [Stage(("global",), local_epochs, self.federation_loss)]

    def batch_noise(self, ctx: ClientContext, stage: Stage, generator: torch.Generator) -> torch.Tensor | None:
        if ctx.phase.name != "personalization":
            return None
        return torch.rand(self.num_layers if self.layerwise else (), generator=generator)

    def federation_loss(self, slots: Slots, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        loss = cross_entropy(self.forward(slots["global"], x), y)
        if self.params.mu > 0:
            loss = loss + self.params.mu * proximal_layer_norms(slots["global"], slots["anchor"], self.mixed)
        return loss

    def mixed_loss(self, slots: Slots, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        g, l = slots["global"], slots["local"]
        loss = cross_entropy(self.forward(self.mix(g, l, noise), x), y)
        if self.params.mu > 0:
            loss = loss + self.params.mu * proximal_layer_norms(g, slots["anchor"], self.mixed)
        if self.params.nu > 0:
            loss = loss + self.params.nu * squared_cosine(g, l, self.mixed)
        return loss

    def mix(self, g: Params, l: Params, lam: torch.Tensor | float) -> Params:
        """w(lam) = (1 - lam) w_g + lam w_l for the mixed tensors; the rest (shared biases) from w_g.
        `lam` is a scalar, or one value per layer (Layer Mixing)."""
        out = dict(g)
        for n in self.mixed:
            lam_n = lam[self.layer_of[n]] if isinstance(lam, torch.Tensor) and lam.dim() == 1 else lam
            out[n] = (1 - lam_n) * g[n] + lam_n * l[n]
        return out

    def client_result(self, ctx: ClientContext, slots: Slots, state: Params | None) -> tuple[Params | None, Params | None]:
        return slots["global"], slots.get("local", state)

    # --- evaluation -----------------------------------------------------------------------------
    @property
    def candidate_label(self) -> str | None:
        return "lam"

    def lam_grid(self) -> list[float]:
        steps = round(1 / self.params.lam_grid_step)
        return [round(i / steps, 6) for i in range(steps + 1)]

    def personalized_candidates(self, server: ServerState, state: Params | None, client_id: int) -> list[tuple[float, Params]]:
        g = server.global_params
        if state is None:  # a client that never reached Phase II has no local model: every lam is w_g
            return [(lam, g) for lam in self.lam_grid()]
        return [(lam, self.mix(g, state, lam)) for lam in self.lam_grid()]


class SuPerFedLM(SuPerFedMM):
    """SuPerFed with Layer Mixing: every layer draws its own lam per mini-batch."""

    name = "superfed_lm"
    Params = SuPerFedLMParams
    params: SuPerFedLMParams
    layerwise = True
