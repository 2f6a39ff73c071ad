"""SuPerFed (Hahn et al., "Connecting Low-Loss Subspace for Personalized Federated Learning", KDD 2022;
arXiv title "Subspace Learning for Personalized Federated Optimization").

Every client holds a federated model w_g and a local model w_l of one architecture, and trains the
weight-space mixture w(lam) = (1 - lam) w_g + lam w_l (Sec. "Proposed Method", Eq. 3; where a copy of the
paper lost its formulas, they are restated from the authors' code, vaseline555/SuPerFed src/algorithm.py
`superfed_update`, and written out with the paper's equation numbers in docs/methods/superfed.md):

- Phase I, rounds 1 .. floor(L R): lam = 0, w_l frozen; loss = CE(w_g) + mu * prox.
- Phase II, later rounds: lam ~ U(0, 1) per mini-batch, one for the whole model (Model Mixing, MM) or
  one per layer (Layer Mixing, LM); both models trained;
  loss = CE(w(lam)) + mu * prox + nu * cos^2(w_g, w_l).
- prox = sum ||w_g,t - w_g,t^prev||_2 over the mixed tensors t (one norm per tensor, as the official
  code sums them); cos^2 is the squared cosine of the two concatenated vectors of mixed tensors. Only
  w_g is uploaded; the server averages it by sample count.

What is mixed (`fedpipe.algorithms.regularizers.mixable_layers`): every layer of the model, chosen by
module type as the official code does (its `set_lambda` and Lines* layers): Conv*, Linear, LSTM/GRU/RNN
(every weight_ih/weight_hh, both directions), Embedding, and the affine weight and bias of norm layers
(`mix_norm`). Biases follow `mix_bias`. A layer is a module: Layer Mixing draws one lam per module (an
LSTM's four tensors share one), Model Mixing one for all. A model with a trainable layer of any other
type is refused, naming it, rather than leaving that layer silently unpersonalized.

Defaults and why:
- `mix_bias: false`. The authors' released code builds every model bias-free (its Builder's conv,
  linear and LSTM default to bias=False and every model passes bias=False), so there the question
  does not arise; their first implementation of the Table 4 CNN (commit ae1803b, Jan 2022) had
  biases and mixed only the weights (LinesConv), the biases shared; and their FedProx's layer-wise
  term skips biases. Here, where a model has biases (twonn, lenet5, bilstm), they stay shared:
  federated, trained in both phases, outside the prox and cos^2 terms. True mixes them like weights.
- `mix_norm: true`. The official LinesBN mixes a batch-norm layer's weight and bias with the layer's
  lam (local copy initialised to ones and zeros), and the official scripts pass --bn_type LinesBN with
  every model that has batch norm. False keeps norm layers shared. No bundled model has a norm layer.
- The bundled SuPerFed CNN (model superfed_cnn) is bias-free, like every model of the released code.

With mu = nu = 0 and no Phase II it is FedAvg; with nu = 0 and no Phase II it is FedProx with
`proximal: layer_norms` (which covers the same tensors: `mixable_layers` with these defaults).
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

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
from fedpipe.algorithms.regularizers import layer_kind, mixable_layers, proximal_layer_norms, squared_cosine
from fedpipe.search_space import Dimension, LogUniform, Uniform
from fedpipe.seeding import torch_generator


class _SuPerFedFields(MethodParams):
    mu: float = Field(0.01, ge=0)
    """Weight of the proximity term toward the previous round's global model (both phases)."""
    start_fraction: float = Field(0.6, ge=0, le=1)
    """L: Phase II (personalization) starts after floor(L * train.rounds) rounds. 1 means no Phase II."""
    mix_bias: bool = False
    """False: biases (of conv, linear and recurrent layers) have no local copy; they stay shared, federated
    and trained in both phases, and outside the prox and cos^2 terms. The authors' released code has no
    biases at all (every layer bias=False); their first Table 4 CNN (commit ae1803b) had biases and mixed
    only the weights, as here; their FedProx term skips biases. True: biases are mixed too (zero-initialised
    locally), so every tensor of those layers is personalized."""
    mix_norm: bool = True
    """True (official LinesBN): norm layers (BatchNorm, InstanceNorm, LayerNorm, GroupNorm, RMSNorm) mix
    their affine weight and bias with the layer's lam, local copy initialised to ones and zeros. False:
    norm layers stay shared. No bundled model has a norm layer."""
    lam_grid_step: float = Field(0.1, ge=0.001, le=1)  # 1/step + 1 candidates evaluated per client: at most 1,001
    """Spacing of the lam grid swept at evaluation (0.0, 0.1, ..., 1.0 by default)."""

    @model_validator(mode="after")
    def _mixing_is_the_personalization(self):
        if self.finetune_epochs:
            raise ValueError("SuPerFed personalizes by mixing its global and local models (lam); finetune_epochs must stay 0")
        return self


class SuPerFedMMParams(_SuPerFedFields):
    """SuPerFed with Model Mixing: one lam ~ U(0, 1) per mini-batch for the whole model."""

    search_space: ClassVar[dict[str, Dimension]] = {"method.mu": LogUniform(0.001, 1.0), "method.nu": Uniform(0.0, 5.0), "method.start_fraction": Uniform(0.3, 0.9)}
    """What a study tunes beside train.lr: the paper's sweeps (Sec. 5): mu and nu from 0 up, L where Phase II starts."""

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

    search_space: ClassVar[dict[str, Dimension]] = {"method.mu": LogUniform(0.001, 1.0), "method.nu": Uniform(0.0, 5.0), "method.start_fraction": Uniform(0.5, 0.95)}
    """What a study tunes beside train.lr: as Model Mixing's, with L later (Layer Mixing's official 0.8)."""


class SuPerFedMM(Algorithm):
    """SuPerFed with Model Mixing: one lam per mini-batch for every layer.

    Mixes every layer the model has, chosen by module type (conv, linear, LSTM/GRU/RNN, embedding, and
    norm layers with mix_norm, their default True as the official LinesBN); biases stay shared by
    default (mix_bias False: the authors' released models have no biases, their first Table 4 CNN shared
    them). A model with a trainable layer of another type is refused, naming the layer. The bundled
    SuPerFed CNN is bias-free, like every model of the released code. See the module docstring.
    """

    name = "superfed_mm"
    Params = SuPerFedMMParams
    paper = "Hahn et al. 2022, Eq. 3 and Algorithm 1"
    uploads = "the global model (its local model stays on the client)"
    departures = (
        "mix_bias=false: biases are shared, not mixed (the released code's models have no biases; its first Table 4 "
        "CNN shared them); mix_norm=true: norm layers' affine weight and bias are mixed (official LinesBN); every "
        "conv, linear, LSTM/GRU/RNN and embedding layer is mixed, chosen by module type",
        "lam is chosen per client on its validation split (the official code picks it on test data: reported beside "
        "it as the test-oracle lam)",
        "the proximity term is sum_t ||w_g,t - w_g,t^prev||_2 (not squared) and the cos^2 term leaves out the "
        "official code's +1e-6: both as the official src/algorithm.py (superfed_update) computes Eq. 3's terms",
        "mu=0.01, start_fraction (L) and nu: the official scripts' values for K = 50 clients (MM: L=0.6, nu=1; "
        "LM: L=0.8, nu=2), not tuned per run",
    )
    params: SuPerFedMMParams
    layerwise = False

    def __init__(self, params, model, seed):
        super().__init__(params, model, seed)
        # {module name: [its mixed parameters]}, by module type; raises ConfigError on a layer it cannot mix
        self.layers = mixable_layers(model, bias=self.params.mix_bias, norm=self.params.mix_norm)
        self.mixed = [n for names in self.layers.values() for n in names]
        # Layer Mixing draws one lam per layer: a layer is a module, in the model's order.
        self.layer_of = {n: i for i, names in enumerate(self.layers.values()) for n in names}
        self.num_layers = len(self.layers)

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
        """A client's local model, initialised differently from the global one (seeded by the client id),
        per layer type as the official code's Lines* layers: conv / linear weights Xavier-normal, embedding
        weights N(0, 1) (the padding row zero, as nn.Embedding has it), recurrent weights
        U(-1/sqrt(hidden), 1/sqrt(hidden)), norm layers' weight ones and bias zeros; mixed biases zero."""
        gen = torch_generator(self.seed, "superfed-local-init", client_id)
        modules = dict(self.model.named_modules())
        local = {}
        for path, names in self.layers.items():
            module = modules[path]
            kind = layer_kind(module)
            for n in names:
                t = torch.empty(like[n].shape, dtype=like[n].dtype)
                short = n[len(path) + 1:] if path else n
                if kind == "norm":
                    t.fill_(1.0 if short == "weight" else 0.0)
                elif short.startswith("bias"):
                    t.zero_()
                elif kind == "embedding":
                    torch.nn.init.normal_(t, generator=gen)
                    if getattr(module, "padding_idx", None) is not None:
                        t[module.padding_idx] = 0
                elif kind == "rnn":
                    bound = 1 / math.sqrt(module.hidden_size)
                    torch.nn.init.uniform_(t, -bound, bound, generator=gen)
                else:
                    torch.nn.init.xavier_normal_(t, generator=gen)
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
        """w(lam) = (1 - lam) w_g + lam w_l for the mixed tensors; the rest (shared biases, norm layers
        without mix_norm) from w_g. `lam` is a scalar, or one value per layer (module) for Layer Mixing."""
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
        g, grid = server.global_params, self.lam_grid()
        if state is None:  # a client that never reached Phase II has no local model: every lam is w_g
            return [(lam, g) for lam in grid]
        # `mix` for the whole grid at once: the candidates are rows of one tensor per layer, which the evaluation
        # maps its forward over without copying them (`predict_many`). torch.lerp makes them in one pass over
        # memory (half the time of a multiply and a fused multiply-add); it computes w_g + lam (w_l - w_g), or
        # w_l - (1 - lam)(w_l - w_g) from lam = 0.5 on, so lam = 0 and 1 give w_g and w_l exactly and a middle
        # lam may differ from `mix` in the last bit.
        rows = {}
        for n in self.mixed:
            take = torch.tensor(grid, dtype=g[n].dtype, device=g[n].device).view((len(grid),) + (1,) * g[n].dim())
            rows[n] = torch.lerp(g[n], state[n], take).unbind(0)
        return [(lam, {**g, **{n: r[j] for n, r in rows.items()}}) for j, lam in enumerate(grid)]


class SuPerFedLM(SuPerFedMM):
    """SuPerFed with Layer Mixing: every layer (module: a conv, a linear, a whole LSTM, an embedding, a
    norm layer) draws its own lam per mini-batch. Mixes what SuPerFedMM mixes, with the same defaults."""

    name = "superfed_lm"
    Params = SuPerFedLMParams
    params: SuPerFedLMParams
    layerwise = True
