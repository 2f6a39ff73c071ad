"""Federated mixture of experts (Listo Zec, Mogren, Martinsson, Sütfeld and Gillblad, "Specialized
federated learning using a mixture of experts", 2020), Algorithm 1, as three phases:

1. `federation`: a global model f_g by FedAvg (Eq. 2) on the opt-in clients' data only (Eq. 4). Opt-out
   clients never join a communicating phase (the engine's `select_clients`, which also keeps the
   number of participants per round at m = round(C K) while enough opt-in clients remain, as the
   paper does); nothing derived from their data reaches the server.
2. `specialists`: every client, opt-in and opt-out, fine-tunes a copy of f_g on all its training data
   (Eq. 5; Algorithm 1, lines 6-7): its specialist f_s^k, the paper's "Fine-tuned" baseline. The same
   phase trains the paper's "Local" baseline (`baselines`): the initial model trained on the client's
   data alone, as the authors' code does.
3. `gate`: the mixture (Eq. 6)
       y_h(x) = h^k(x) f_s^k(x) + (1 - h^k(x)) f_g(x),
   with a gate h^k that has the experts' body and one sigmoid output, is trained on the client's data
   (Eq. 7): gate and specialist jointly, f_g frozen (lines 8-9). Its loss is -log y_h(x)[y].

Every local training (specialist, Local, mixture) runs up to `max_epochs` epochs (default 500, the
paper's) and stops early on the client's validation loss (`patience`), keeping its best epoch (the
engine implements it); early stopping ends it long before the cap, except on a client without a
validation split, which trains all max_epochs. Phases 2 and 3 do not communicate and run every client
once.

Optimiser: the paper uses Adam throughout (Algorithm 1, lines 7 and 9; Sec. 4), with lr 5e-5 for
FedAvg and the Local model and 1e-5 for the specialist and the mixture (images). fedpipe's default
stays the run's `train.optimizer` (SGD, momentum 0.9, lr 0.01): the optimiser and its rates are one
run-wide setting, and Adam at the SGD default rate 0.01 would be 200 to 1000 times the paper's. The
paper's behaviour is the named option `train.optimizer: adam` with `train.lr: 5e-5`,
`method.finetune_lr: 1e-5`, `method.local_lr: 5e-5`, `train.weight_decay: 0` (examples/fedmoe_*.yaml
set exactly these).

Eq. 6 mixes the experts' outputs, their softmax probabilities (`mixture: probabilities`, the default);
the authors' code mixes log-probabilities instead, a geometric mixture (`mixture: log_probabilities`;
the authors' models/ClientUpdate.py, `train_mix`, weights the log-softmax outputs under an NLL loss). Either way `forward` returns log-probabilities, which are valid logits: softmax
gives back the mixture (normalised, for the geometric one), so evaluation, cross-entropy and
calibration treat the mixture as any other model.

A client's kept state holds namespaced tensors: "finetuned.*" (phase 2's specialist), "local.*" (the
Local baseline), "specialist.*" and "gate.*" (the mixture's, phase 3). Its personalized model is the
mixture after phase 3, the specialist after phase 2 and the global model before; `compared_models`
names every model of the paper's Table 1 for the benchmark (benchmarks/mixture.py).

Departure: the paper picks FedAvg's global model as the round (checked every 50) with the best mean
validation loss of the participating clients; the engine keeps the last round's global model.
"""

from __future__ import annotations

import copy
import math
from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from fedpipe.algorithms.base import (
    Algorithm,
    ClientContext,
    EarlyStopping,
    MethodParams,
    Params,
    Phase,
    ServerState,
    Slots,
    Stage,
    cross_entropy,
    federation_phase,
)
from fedpipe.config import MAX_EPOCHS
from fedpipe.errors import ConfigError
from fedpipe.search_space import Dimension, LogUniform
from fedpipe.seeding import torch_generator

FINETUNED, LOCAL, SPECIALIST, GATE, GLOBAL = "finetuned", "local", "specialist", "gate", "global"


def prefixed(prefix: str, params: Params) -> Params:
    """{"prefix.name": tensor}: a model's tensors under a namespace."""
    return {f"{prefix}.{k}": v for k, v in params.items()}


def part(prefix: str, params: Params | None) -> Params:
    """The tensors under `prefix` with the prefix taken off ({} when there are none)."""
    cut = len(prefix) + 1
    return {k[cut:]: v for k, v in (params or {}).items() if k.startswith(prefix + ".")}


class FedMoEParams(MethodParams):
    """Federated mixture of experts: FedAvg, local specialists, then a gated mixture of the two."""

    search_space: ClassVar[dict[str, Dimension]] = {"method.mixture_lr": LogUniform(0.0001, 0.01)}
    """What a study tunes beside train.lr: the gate's learning rate."""

    name: Literal["fedmoe"] = "fedmoe"
    max_epochs: int = Field(500, ge=1, le=MAX_EPOCHS)
    """Most epochs of each local training (specialist, Local baseline, mixture); early stopping on the
    client's validation loss usually ends it much sooner. Default 500, the paper's; a client without a
    validation split trains all of them."""
    patience: int = Field(3, ge=1, le=MAX_EPOCHS)
    """Epochs without a lower validation loss before a local training stops; its best epoch is kept.
    The paper does not give its patience. A client without a validation split trains max_epochs."""
    finetune_lr: float | None = Field(None, gt=0)
    """Learning rate of the specialist's fine-tuning (phase 2). None: train.lr (decayed to the phase's
    round). The paper: 1e-5 for CIFAR-10 and Fashion-MNIST, 1e-6 for AG News (with Adam), five and
    five hundred times below FedAvg's."""
    mixture_lr: float | None = Field(None, gt=0)
    """Learning rate of the mixture's training (phase 3: gate and specialist). None: finetune_lr, as
    in the paper."""
    local_lr: float | None = Field(None, gt=0)
    """Learning rate of the Local baseline. None: train.lr (decayed to the phase's round), as the paper
    trains it with FedAvg's rate."""
    baselines: bool = True
    """Also produce the paper's baselines for its Table 1: train the Local model in phase 2 and keep the
    fine-tuned specialist beside the mixture after phase 3. False halves each client's kept state; the
    personalized model (the mixture) is the same either way."""
    mixture: Literal["probabilities", "log_probabilities"] = "probabilities"
    """'probabilities': Eq. 6 on the experts' softmax outputs, h p_s + (1 - h) p_g, loss -log of the
    true class's mixed probability (the paper). 'log_probabilities': h log p_s + (1 - h) log p_g with
    loss -(that)[y], what the authors' code computes (a geometric mixture)."""

    @model_validator(mode="after")
    def _the_mixture_is_the_personalization(self):
        if self.finetune_epochs:
            raise ValueError("the federated mixture of experts personalizes by its own phases (specialists, gate); "
                             "finetune_epochs must stay 0")
        return self


class FedMoE(Algorithm):
    name = "fedmoe"
    Params = FedMoEParams
    paper = "Listo Zec et al. 2020, Algorithm 1 (Eqs. 4-7)"
    uploads = "the global model, in the federation phase only; opt-out clients upload nothing (specialist and gate stay local)"
    supports_finetune = False
    departures = (
        "optimizer: train.optimizer (default SGD, lr 0.01) where the paper uses Adam (lr 5e-5; 1e-5 for specialist and "
        "mixture); the paper's: train.optimizer=adam with its rates, as examples/fedmoe_*.yaml",
        "patience=3: the paper uses early stopping without giving a patience",
        "train.select=last (the default): the global model is the last round's; the paper keeps the round (checked every 50) with "
        "the best mean validation loss: train.select=best_val_loss, train.select_every=50, as examples/fedmoe_*.yaml",
    )
    params: FedMoEParams

    def __init__(self, params, model, seed):
        super().__init__(params, model, seed)
        # the initial model: where every client's Local baseline starts (as the existing `local` method)
        self.initial = {n: p.detach() for n, p in model.named_parameters()}
        self.gate_net = gate_network(model, seed)
        self.initial_gate = {n: p.detach() for n, p in self.gate_net.named_parameters()}
        self._gate_key = f"{GATE}.{next(iter(self.initial_gate))}"

    @classmethod
    def phases(cls, params: MethodParams, rounds: int) -> list[Phase]:
        return [
            federation_phase(rounds, "a global model by FedAvg on the opt-in clients' data (Algorithm 1, line 4)"),
            Phase("specialists", rounds + 1, rounds + 1, sample_clients=False, communicates=False,
                  description="every client fine-tunes the global model into its specialist (lines 6-7)"),
            Phase("gate", rounds + 2, rounds + 2, sample_clients=False, communicates=False,
                  description="every client trains its gate and specialist in the mixture, global model frozen (lines 8-9)"),
        ]

    # --- the networks -------------------------------------------------------------------------------
    def forward(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        """A plain model's logits, or, for namespaced mixture parameters ("global.*", "specialist.*",
        "gate.*"), the mixture's log-probabilities."""
        if self._gate_key in params:
            return self.mixture_log_probs(part(GLOBAL, params), part(SPECIALIST, params), part(GATE, params), x)
        return functional_call(self.model, params, (x,))

    def gate_logit(self, gate: Params, x: torch.Tensor) -> torch.Tensor:
        """The gate's pre-sigmoid output a(x), [N, 1]: h(x) = sigmoid(a(x))."""
        self.gate_net.train(self.model.training)  # evaluation switches the model's mode: follow it
        return functional_call(self.gate_net, gate, (x,))

    def mixture_log_probs(self, g: Params, s: Params, gate: Params, x: torch.Tensor) -> torch.Tensor:
        """log y_h(x), [N, C]: Eq. 6 on probabilities, log(h p_s + (1 - h) p_g), computed as
        logaddexp(log h + log p_s, log(1 - h) + log p_g) so that no probability underflows; or, with
        `mixture: log_probabilities`, h log p_s + (1 - h) log p_g."""
        log_g = F.log_softmax(functional_call(self.model, g, (x,)), dim=1)
        log_s = F.log_softmax(functional_call(self.model, s, (x,)), dim=1)
        a = self.gate_logit(gate, x)
        if self.params.mixture == "probabilities":
            return torch.logaddexp(F.logsigmoid(a) + log_s, F.logsigmoid(-a) + log_g)
        h = torch.sigmoid(a)
        return h * log_s + (1 - h) * log_g

    # --- client side --------------------------------------------------------------------------------
    def client_params(self, ctx: ClientContext, download: Params, state: Params | None) -> Slots:
        phase = ctx.phase.name
        if phase == "federation":
            return {GLOBAL: download}
        if phase == "specialists":
            slots = {SPECIALIST: download}  # w_s^k <- w_g (line 6); the engine copies it before training
            if self.params.baselines:
                slots[LOCAL] = self.initial
            return slots
        # gate: f_g frozen (it is in no stage's trainable slots), the specialist from phase 2
        return {GLOBAL: download, SPECIALIST: part(FINETUNED, state) or download, GATE: self.initial_gate}

    def stages(self, ctx: ClientContext, local_epochs: int) -> list[Stage]:
        phase, p = ctx.phase.name, self.params
        if phase == "federation":
            return [Stage((GLOBAL,), local_epochs, self.global_loss)]
        stop = EarlyStopping(p.patience)
        if phase == "specialists":
            stages = [Stage((SPECIALIST,), p.max_epochs, self.specialist_loss, lr=p.finetune_lr, early_stopping=stop)]
            if p.baselines:
                stages.append(Stage((LOCAL,), p.max_epochs, self.local_loss, lr=p.local_lr, early_stopping=stop))
            return stages
        return [Stage((SPECIALIST, GATE), p.max_epochs, self.mixture_loss, lr=p.mixture_lr or p.finetune_lr,
                      early_stopping=stop)]

    def global_loss(self, slots: Slots, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        return cross_entropy(self.forward(slots[GLOBAL], x), y)

    def specialist_loss(self, slots: Slots, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        return cross_entropy(self.forward(slots[SPECIALIST], x), y)

    def local_loss(self, slots: Slots, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        return cross_entropy(self.forward(slots[LOCAL], x), y)

    def mixture_loss(self, slots: Slots, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """Eq. 7: the mean over the batch of -log y_h(x)[y] (-(h log p_s + (1 - h) log p_g)[y] for the
        log-probability mixture)."""
        return F.nll_loss(self.mixture_log_probs(slots[GLOBAL], slots[SPECIALIST], slots[GATE], x), y)

    def client_result(self, ctx: ClientContext, slots: Slots, state: Params | None) -> tuple[Params | None, Params | None]:
        phase = ctx.phase.name
        if phase == "federation":
            return slots[GLOBAL], state
        kept = dict(state or {})
        if phase == "specialists":
            kept.update(prefixed(FINETUNED, slots[SPECIALIST]))
            if LOCAL in slots:
                kept.update(prefixed(LOCAL, slots[LOCAL]))
            return None, kept
        if not self.params.baselines:
            kept = {k: v for k, v in kept.items() if not k.startswith(FINETUNED + ".")}
        kept.update(prefixed(SPECIALIST, slots[SPECIALIST]))
        kept.update(prefixed(GATE, slots[GATE]))
        return None, kept

    # --- evaluation ---------------------------------------------------------------------------------
    def mixture_params(self, server: ServerState, state: Params) -> Params:
        """The mixture as one parameter dict `forward` takes: the global model and the client's
        specialist and gate, namespaced."""
        return {**prefixed(GLOBAL, server.global_params), **{k: v for k, v in state.items() if k.startswith((SPECIALIST + ".", GATE + "."))}}

    def personalized_candidates(self, server: ServerState, state: Params | None, client_id: int) -> list[tuple[float, Params]]:
        if state is not None and self._gate_key in state:
            return [(0.0, self.mixture_params(server, state))]
        finetuned = part(FINETUNED, state)
        return [(0.0, finetuned or server.global_params)]

    def compared_models(self, server: ServerState, state: Params | None) -> dict[str, Params]:
        """The models of the paper's Table 1 that a client has, by name: "fedavg" (the global model),
        "local", "finetuned" (phase 2's specialist) and "mixture" (each when trained)."""
        out = {"fedavg": server.global_params}
        if local := part(LOCAL, state):
            out["local"] = local
        if finetuned := part(FINETUNED, state):
            out["finetuned"] = finetuned
        if state is not None and self._gate_key in state:
            out["mixture"] = self.mixture_params(server, state)
        return out


def gate_network(model: nn.Module, seed: int) -> nn.Module:
    """The gate h: the experts' architecture with its output layer replaced by one unit (the sigmoid is
    applied by the mixture). Its body starts as the initial model's; its new output layer is drawn as
    PyTorch initialises a Linear layer, from a generator derived from the run seed (the same gate for
    every client, as Algorithm 1's line 3 initialises w_h^k before the loop; no global RNG is touched)."""
    head = getattr(model, "head", None)
    if not isinstance(head, nn.Linear):
        raise ConfigError(
            f"The mixture of experts' gate is the model with its output layer replaced by one unit: it needs the output "
            f"layer as an nn.Linear named `head`, and {type(model).__name__} has "
            f"{'none' if head is None else 'a ' + type(head).__name__ + ' there'}. Name the model's last linear layer `head`."
        )
    gate = copy.deepcopy(model)
    gen = torch_generator(seed, "fedmoe-gate-head")
    out = nn.Linear(head.in_features, 1, bias=head.bias is not None, device="meta").to_empty(device="cpu")
    with torch.no_grad():
        nn.init.kaiming_uniform_(out.weight, a=math.sqrt(5), generator=gen)  # nn.Linear.reset_parameters
        if out.bias is not None:
            bound = 1 / math.sqrt(head.in_features)
            nn.init.uniform_(out.bias, -bound, bound, generator=gen)
    gate.head = out.to(head.weight.device)
    return gate
