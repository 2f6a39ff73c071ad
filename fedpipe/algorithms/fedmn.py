"""FedMN (Wang et al., "Personalized Federated Learning via Heterogeneous Modular Networks", arXiv
2210.14830, 2022). The paper's Section II (Eq. 1-3) gives the model and the objective; what it leaves out
comes from the authors' code (xztcwang/FedMN: PolicyNet/policy_net.py, utils/averaging.py, utils/args.py),
written out in docs/methods/fedmn.md, without its quirks.

A pool of modular units (fedpipe/nn/modular.py: n_1 encoders, then MLP units; E = sum_l n_l n_{l+1} + n_L
path variables, Section II-A) is shared by all clients. Each client's routing hypernetwork reads its
whole training set (per-sample embeddings of x and y, averaged: a summary of p(x, y)) and outputs one
logit per path; the client's architecture V_m is a vector of conditionally independent Bernoulli
path decisions, P(V_m) = prod_i P(v_i) with P(v_i = 1) = sigmoid(logit_i) (Eq. 3). The client
minimises its share of the empirical risk, L_m(theta, V_m) = mean CE(f_theta(x; V_m), y) (Eq. 2),
with the architecture fixed for an epoch of local training (Section II-B).

- Sampling: v_i = 1[logit_i + g_i > 0], g_i logistic noise (a difference of two Gumbels), drawn once
  per local epoch from the client's generator (`noise_per="epoch"`). A decision with no complete
  encoder -> output path gets its best-scoring path switched on (`PathLayout.decide`).
- Relaxation (binary Gumbel-softmax / Gumbel-sigmoid): s_i = sigmoid((logit_i + g_i) / tau). With
  `straight_through` the forward pass uses the hard v and the backward pass the gradient of s
  (v = hard + (s - stopgrad(s))), so the task loss trains the router; without it the forward pass
  uses s (the official run's soft samples).
- The hard decision of an epoch is computed from the router as the client downloaded it (its
  logits on the client's data, computed once when the round starts) plus that epoch's noise, so it
  cannot flip in mid-epoch while the router trains; the relaxed s comes from the router being
  trained. With one local epoch (the official setting) this is the decision at the epoch's start.
- Temperature: tau_r from `tau_start` (first round) to `tau_end` (last round of the phase), by
  `tau_schedule` (exponential or linear in the round; the official annealing condition never fires).
- Upload: the router, and the units the client trained: those on an active path in at least one
  of its epochs (the others get no gradient and stay bitwise equal to the download, see
  fedpipe/nn/modular.py). Server: each unit is the sample-weighted average over the clients that
  uploaded it, and keeps its value when none did; the router is averaged over all clients. The
  download is the whole pool (a client needs every unit its epochs may sample).
- Kept state: the client's decision at the end of its last round, its most probable architecture
  under its trained router (v_i = 1[logit_i > 0], repaired as above), which is its personalized
  model for testing; plus the units it uploaded and the round (for the cluster report). A client
  that never trained is tested on every link switched on (the mean of every path).
- Clusters: clients with the same decision share an architecture (the paper's implicit clusters);
  `round_details` lists them every round, and the report draws them (architecture_clusters.png).

Choices where the paper and code are silent, or where this differs (each stated):
- Encoders (`encoder`): `cnn` = copies of the configured model's `features` (e.g. LeNet-5's two conv
  layers) + a linear layer to hidden[0], each unit re-initialised from its own seed; `mlp` for
  models without `features`. Every unit starts from its own random initialisation: the official
  run's FedAvg-pretrained encoders are not reproduced (no pretraining phase).
- The router's learning rate is `router_lr_scale` times the units' (the gradient reaching the router
  is scaled, so with SGD the step scales and weight decay does not).
- FedMN has no single global model: nothing is scored on the global test set.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Collection
from pathlib import Path
from typing import ClassVar, Literal

import torch
from pydantic import Field, field_validator, model_validator
from torch import nn
from torch.func import functional_call

from fedpipe.algorithms.aggregation import Aggregation, custom, weighted_average
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
    federation_phase,
)
from fedpipe.config import MAX_WIDTH
from fedpipe.errors import ConfigError
from fedpipe.nn.modular import ModularNetwork, PathLayout, RoutingHypernetwork
from fedpipe.search_space import Dimension, LogUniform
from fedpipe.seeding import derive_seed

NET, ROUTER = "net.", "router."  # name prefixes of the pool's units and of the router
DECISION = "decision"  # a client's architecture: E floats in {0, 1} (kept state; also in its candidate)
UPLOADED = "uploaded"  # kept state: 0/1 per unit, the units it sent in its last round
ROUND = "round"  # kept state: the last round it trained in


#: Bounds of the module pool: the router has one logit per path (the product of `units`), so a few
#: large layers would make it enormous; the official run has 3 layers of 2 units (8 paths).
MAX_LAYERS = 16
MAX_PATHS = 4096


class FedMNParams(MethodParams):
    """FedMN: a shared pool of modular units; each client's router picks its architecture from its data."""

    search_space: ClassVar[dict[str, Dimension]] = {"method.router_lr_scale": LogUniform(0.1, 10.0), "method.tau_end": LogUniform(0.01, 1.0)}
    """What a study tunes beside train.lr: the router's rate and the final Gumbel temperature."""

    name: Literal["fedmn"] = "fedmn"
    units: tuple[int, ...] = (2, 2, 2)
    """n_1, ..., n_L: units per layer (layer 1: encoders; the others: MLP units). Official: [2, 2, 2].
    A list, or one comma-separated string ("2,2,2")."""
    hidden: tuple[int, ...] = (512, 256)
    """Output widths of layers 1 .. L-1 (one fewer than `units`; layer L outputs the class scores).
    Official: 512, 256. With [2, 2, 2] and (120, 84) on LeNet-5 encoders, every path is a LeNet-5."""
    encoder: Literal["auto", "cnn", "mlp"] = "auto"
    """Encoder units: cnn (copies of the configured model's convolutional `features`, each with its
    own initialisation, then a linear layer to hidden[0]), mlp (flatten, linear), or auto (cnn when
    the model has `features`: superfed_cnn, lenet5, mcmahan_cnn; mlp otherwise, and for tables)."""
    router_feature_dim: int = Field(32, ge=1, le=MAX_WIDTH)
    """Router: width of the per-sample input embedding (a small CNN, then linear; for tables, one linear layer)."""
    router_label_dim: int = Field(16, ge=1, le=MAX_WIDTH)
    """Router: width of the per-sample label embedding (one-hot through a linear layer)."""
    tau_start: float = Field(1.0, gt=0)
    """Gumbel-sigmoid temperature in the first round."""
    tau_end: float = Field(0.1, gt=0)
    """Gumbel-sigmoid temperature in the last round of the federation."""
    tau_schedule: Literal["exponential", "linear", "constant"] = "exponential"
    """How tau moves from tau_start to tau_end over the rounds: exponential (geometric), linear, or
    constant (tau_start throughout)."""
    straight_through: bool = True
    """True: hard 0/1 decisions in the forward pass, the relaxed sample's gradient in the backward
    pass. False: the relaxed (soft) sample in both (the official run)."""
    lr_scale: float = Field(1.0, gt=0)
    """Learning rate of the units: train.lr (decayed per round) times this."""
    router_lr_scale: float = Field(1.0, gt=0)
    """Learning rate of the router as a multiple of the units' (its gradient is scaled by this)."""

    @field_validator("units", "hidden", mode="before")
    @classmethod
    def _comma_separated(cls, v):
        # a pipeline parameter is a string: "2,2,2" means [2, 2, 2]
        if isinstance(v, str):
            return tuple(int(p) for p in v.split(",") if p.strip())
        if isinstance(v, int):
            return (v,)
        return v

    @model_validator(mode="after")
    def _shapes(self):
        if not self.units or min(self.units) < 1:
            raise ValueError(f"units must list at least one layer of at least one unit, got {list(self.units)}")
        if len(self.hidden) != len(self.units) - 1 or (self.hidden and min(self.hidden) < 1):
            raise ValueError(f"hidden needs {len(self.units) - 1} positive widths for {len(self.units)} layers "
                             f"(units={list(self.units)}), got {list(self.hidden)}")
        paths = math.prod(self.units)  # the router scores every path: one logit each
        if len(self.units) > MAX_LAYERS or paths > MAX_PATHS:
            raise ValueError(f"units {list(self.units)} make {len(self.units)} layers and {paths:,} paths; fedpipe's bound is "
                             f"{MAX_LAYERS} layers and {MAX_PATHS:,} paths (the official run has 3 layers, 8 paths)")
        if self.hidden and max(self.hidden) > MAX_WIDTH:
            raise ValueError(f"hidden widths are at most {MAX_WIDTH:,} (fedpipe's bound), got {list(self.hidden)}")
        return self


def temperature(params: FedMNParams, round_: int, first: int, last: int) -> float:
    """tau of round `round_` in a phase of rounds first..last: tau_start at `first`, tau_end at `last`,
    geometric or linear in between (constant: tau_start)."""
    if params.tau_schedule == "constant" or last <= first:
        return params.tau_start
    t = min(max((round_ - first) / (last - first), 0.0), 1.0)
    if params.tau_schedule == "linear":
        return params.tau_start + (params.tau_end - params.tau_start) * t
    return params.tau_start * (params.tau_end / params.tau_start) ** t


def _strip(params: Params, prefix: str) -> Params:
    return {n[len(prefix):]: t for n, t in params.items() if n.startswith(prefix)}


def selective_average(previous: Params, uploads: list[Upload], unit_tensors: dict[str, tuple[str, ...]],
                      shared: tuple[str, ...]) -> Params:
    """The new pool from a round's uploads: each unit the sample-weighted average over the clients
    that uploaded it (unchanged when none did); the `shared` tensors (the router) over every client."""
    out = dict(previous)
    out.update(weighted_average([{n: u.tensors[n] for n in shared} for u in uploads], [u.num_samples for u in uploads]))
    for unit, names in unit_tensors.items():
        users = [u for u in uploads if any(n in u.tensors for n in names)]
        if any(n not in u.tensors for u in users for n in names):
            raise ValueError(f"an upload holds part of unit {unit}: a unit travels whole")
        if users:
            out.update(weighted_average([{n: u.tensors[n] for n in names} for u in users], [u.num_samples for u in users]))
    return out


def selective_layout(download: Params, unit_tensors: dict[str, tuple[str, ...]], shared: tuple[str, ...],
                     sent: Collection[str]) -> Params:
    """What a client's selective upload must hold, given the names it holds (`sent`): the `shared` tensors (the router)
    and each unit it names, whole; a unit sent in part, or the router left out, fails a federation's check."""
    sent = set(sent)
    units = [u for u, names in unit_tensors.items() if sent.intersection(names)]
    return {n: download[n] for n in (*shared, *(n for u in units for n in unit_tensors[u]))}


def build_networks(params: FedMNParams, model: nn.Module, seed: int) -> tuple[nn.ModuleDict, str]:
    """The pool of units and the router ({"net", "router"}, on the model's device), sized from the
    configured model, and the encoder kind it uses (cnn or mlp)."""
    shape, classes = getattr(model, "input_shape", None), getattr(model, "num_classes", None)
    if shape is None or classes is None:
        raise ValueError("FedMN sizes its networks from model.input_shape and model.num_classes (set by build_model)")
    if len(shape) not in (1, 3):
        raise ConfigError(f"FedMN's encoders and router read images (C, H, W) or a table's rows (F,); this dataset's inputs "
                          f"have shape {tuple(shape)} (token sequences?). Choose an image or table dataset for method.name=fedmn.")
    features = getattr(model, "features", None) if len(shape) == 3 else None  # a table has no convolutional features
    encoder = params.encoder if params.encoder != "auto" else ("cnn" if features is not None else "mlp")
    if encoder == "cnn" and len(shape) == 1:
        raise ConfigError("method.encoder=cnn copies a CNN's convolutional `features`, which read images; this dataset is a "
                          f"table of {shape[0]} features: set method.encoder=mlp (or auto).")
    if encoder == "cnn" and features is None:
        raise ConfigError(f"method.encoder=cnn copies the model's convolutional `features`, and {type(model).__name__} has none; "
                          "set model.name to a CNN (lenet5, superfed_cnn, mcmahan_cnn) or method.encoder=mlp.")
    device = next(model.parameters()).device
    template = copy.deepcopy(features).cpu() if encoder == "cnn" else None  # the model itself stays as it is
    net = ModularNetwork(shape, classes, params.units, params.hidden, encoder, seed, template)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, "fedmn-router"))
        router = RoutingHypernetwork(shape, classes, net.layout.num_paths, params.router_feature_dim, params.router_label_dim)
    return nn.ModuleDict({"net": net, "router": router}).to(device), encoder


def unit_tensor_names(layout: PathLayout, pool: Params) -> dict[str, tuple[str, ...]]:
    """Each unit's name (`layout.unit_names()`) -> the names of its tensors in the pool."""
    names = layout.unit_names()
    flat = [(l, j) for l, n in enumerate(layout.units) for j in range(n)]
    return {names[k]: tuple(n for n in pool if n.startswith(f"{NET}units.{l}.{j}.")) for k, (l, j) in enumerate(flat)}


def sample_paths(layout: PathLayout, logits: torch.Tensor, noise: torch.Tensor, start: torch.Tensor | None) -> torch.Tensor:
    """Path variables from the router's `logits` and an epoch's noise (E logistic draws g, then tau):
    the relaxed sample s = sigmoid((logits + g) / tau) (Eq. 3's Gumbel-sigmoid); with the round's
    starting logits `start` (straight-through), the hard decision from start + g forward and the
    gradient of s backward."""
    noise = noise.to(logits.device, logits.dtype)
    g, tau = noise[:-1], noise[-1]
    soft = torch.sigmoid((logits + g) / tau)
    if start is None:
        return soft
    hard = layout.decide(start + g)
    return hard + (soft - soft.detach())  # exactly `hard` forward (x - x = 0), d soft backward


def architecture_details(layout: PathLayout, units: list[str], clients: dict[int, Params]) -> dict:
    """FedMN's round details from the clients' kept states (see `FedMN.round_details`)."""
    states = {cid: s for cid, s in sorted(clients.items()) if s and DECISION in s}
    if not states:
        return {}
    latest = max(int(s[ROUND]) for s in states.values())
    arch = {cid: layout.describe(s[DECISION]) for cid, s in states.items()}
    groups: dict[str, list[int]] = {}
    for cid, a in arch.items():
        groups.setdefault(a, []).append(cid)
    clusters = [
        {"architecture": a, "clients": cids,
         "units": [n for n, used in zip(units, layout.used_mask(states[cids[0]][DECISION]).tolist()) if used]}
        for a, cids in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    ]
    uploaded = {str(cid): [n for n, sent in zip(units, s[UPLOADED].tolist()) if sent]
                for cid, s in states.items() if int(s[ROUND]) == latest}
    return {"architecture": {str(c): a for c, a in arch.items()}, "clusters": clusters, "uploaded_units": uploaded}


class FedMN(Algorithm):
    name = "fedmn"
    Params = FedMNParams
    paper = "Wang et al. 2022, Eq. 1-3"
    uploads = "the router and the modules its routed architecture used (which modules it used is visible)"
    privacy_refusal = "its upload reveals which modules a client uses, and the per-module counts (Eq. 3) are outside the accountant"
    departures = (
        "straight_through=true: hard 0/1 paths forward, the Gumbel-sigmoid's gradient backward (the official run uses "
        "soft samples; the surviving pages do not say)",
        "every unit starts from its own random initialisation; the official run starts the encoders from a "
        "FedAvg-pretrained model",
        "tau_start=1.0 -> tau_end=0.1, exponential per round: fedpipe's schedule (the pages give none; the official "
        "annealing never fires)",
        "router_feature_dim=32, router_label_dim=16, router_lr_scale=1.0: fedpipe's values (the pages do not give them)",
        "train.* (lr 0.01, weight decay 1e-4, B = 10, E = 5, run-wide) where the official run uses lr 0.02, weight "
        "decay 5e-4, B = 128, E = 1 (momentum 0.9 in both)",
        "a client that never trained is tested with every path switched on (the paper does not say)",
    )
    params: FedMNParams

    def __init__(self, params: FedMNParams, model: nn.Module, seed: int):
        super().__init__(params, model, seed)
        self.base_model = model
        self.model, self.encoder = build_networks(params, model, seed)
        self.layout: PathLayout = self.model["net"].layout
        self.initial = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        self.unit_tensors = unit_tensor_names(self.layout, self.initial)
        self.router_tensors = tuple(n for n in self.initial if n.startswith(ROUTER))

    @classmethod
    def phases(cls, params: MethodParams, rounds: int) -> list[Phase]:
        return [federation_phase(rounds, "modular federation: routed architectures, selective upload")]

    # --- the networks as pure functions ------------------------------------------------------------
    def pool(self, global_params: Params) -> Params:
        """The server's pool (units and router); the configured model's initial weights, which the
        engine starts every method from, are replaced by the pool's seeded initialisation."""
        if all(n in global_params for n in self.initial):
            return global_params
        device = next(iter(global_params.values())).device
        return {n: t.to(device) for n, t in self.initial.items()}

    def router_logits(self, router: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The E path logits of the router on a client's data (x, y)."""
        return functional_call(self.model["router"], _strip(router, ROUTER), (x, y))

    def network(self, units: Params, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Class scores of the modular network on `x` under path variables `v`."""
        return functional_call(self.model["net"], _strip(units, NET), (x, v))

    def forward(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        """A personalized model (units + the client's DECISION) on `x`: the decision is a constant."""
        return self.network(params, x, params[DECISION].detach().to(x.device))

    def path_variables(self, slots: Slots, noise: torch.Tensor) -> torch.Tensor:
        """v for a batch (Eq. 3): the epoch's hard decision (round-start logits + epoch noise) with the straight-through
        gradient of the relaxed sample from the router being trained; or that relaxed sample, without straight-through."""
        logits = self.router_logits(slots["router"], slots["data"]["x"], slots["data"]["y"])
        s = self.params.router_lr_scale
        if s != 1.0:
            logits = s * logits + (1.0 - s) * logits.detach()  # same value, gradient scaled by s
        start = slots["start"]["logits"] if self.params.straight_through else None
        return sample_paths(self.layout, logits, noise, start)

    # --- client side ----------------------------------------------------------------------------
    def client_params(self, ctx: ClientContext, download: Params, state: Params | None) -> Slots:
        pool = self.pool(download)
        units = {n: t for n, t in pool.items() if n.startswith(NET)}
        router = {n: pool[n] for n in self.router_tensors}
        data = {"x": ctx.data.train.x, "y": ctx.data.train.y}
        with torch.no_grad():
            start = self.router_logits(router, data["x"], data["y"])
        # "downloaded" aliases the pool: the engine copies only the trainable slots
        return {"units": units, "router": router, "downloaded": units, "data": data, "start": {"logits": start}}

    def stages(self, ctx: ClientContext, local_epochs: int) -> list[Stage]:
        return [Stage(("units", "router"), local_epochs, self.loss, lr_scale=self.params.lr_scale, noise_per="epoch")]

    def batch_noise(self, ctx: ClientContext, stage: Stage, generator: torch.Generator) -> torch.Tensor | None:
        """Once per epoch: E logistic draws g = log u - log(1 - u), u ~ U(0, 1), and the round's tau last."""
        u = torch.rand(self.layout.num_paths, generator=generator, dtype=torch.float64).clamp(1e-7, 1 - 1e-7)
        g = torch.log(u) - torch.log1p(-u)
        return torch.cat([g, torch.tensor([temperature(self.params, ctx.round, ctx.phase.first_round, ctx.phase.last_round)], dtype=torch.float64)]).float()

    def loss(self, slots: Slots, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        return cross_entropy(self.network(slots["units"], x, self.path_variables(slots, noise)), y)  # Eq. 2

    def trained_units(self, slots: Slots) -> list[str]:
        """The units whose weights local training changed: those on an active path in some epoch."""
        now, then = slots["units"], slots["downloaded"]
        return [u for u, names in self.unit_tensors.items() if any(not torch.equal(now[n], then[n]) for n in names)]

    def decision(self, router: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The most probable architecture under a router: v_i = 1[logit_i > 0] (repaired to a network)."""
        with torch.no_grad():
            return self.layout.decide(self.router_logits(router, x, y))

    def client_result(self, ctx: ClientContext, slots: Slots, state: Params | None) -> tuple[Params | None, Params | None]:
        trained = self.trained_units(slots)
        upload = {**slots["router"], **{n: slots["units"][n] for u in trained for n in self.unit_tensors[u]}}
        decision = self.decision(slots["router"], slots["data"]["x"], slots["data"]["y"])
        sent = torch.tensor([float(u in trained) for u in self.unit_tensors], device=decision.device)
        kept = {DECISION: decision, UPLOADED: sent, ROUND: torch.tensor(float(ctx.round), device=decision.device)}
        return upload, kept

    # --- server side ----------------------------------------------------------------------------
    def download(self, phase: Phase, server: ServerState, client_id: int) -> Params:
        return self.pool(server.global_params)

    def upload_layout(self, phase: Phase, download: Params, sent: Collection[str] = ()) -> Params:
        return selective_layout(download, self.unit_tensors, self.router_tensors, sent)

    def aggregation(self, phase: Phase) -> Aggregation:
        return custom("each unit averaged by samples over the clients that uploaded it (kept when none did), the router over all")

    def aggregate(self, phase: Phase, server: ServerState, uploads: list[Upload]) -> ServerState:
        if not uploads:
            return server
        return ServerState(selective_average(self.pool(server.global_params), uploads, self.unit_tensors, self.router_tensors),
                           server.per_client)

    def round_details(self, server: ServerState, clients: dict[int, Params]) -> dict:
        """Each client's architecture (decision bits, one group per layer of links), the clusters of
        clients sharing one (largest first, with the units it uses), and the units each client of
        the latest round uploaded."""
        return architecture_details(self.layout, list(self.unit_tensors), clients)

    def report_plots(self, rounds: list[dict]) -> dict[str, Callable[[Path], object]]:
        from fedpipe import plots

        rows = [r for r in rounds if r.get("details", {}).get("architecture")]
        if not rows:
            return {}
        return {"architecture_clusters.png": lambda path: plots.architecture_clusters(rows, path)}

    # --- evaluation -----------------------------------------------------------------------------
    def global_model(self, server: ServerState) -> Params | None:
        return None  # every client has its own architecture; there is no global one

    def personalized_candidates(self, server: ServerState, state: Params | None, client_id: int) -> list[tuple[float, Params]]:
        """The pool's units under the client's kept decision (every link on for a client that never trained)."""
        pool = self.pool(server.global_params)
        units = {n: t for n, t in pool.items() if n.startswith(NET)}
        if state and DECISION in state:
            decision = state[DECISION]
        else:
            decision = torch.ones(self.layout.num_paths, device=next(iter(units.values())).device)
        return [(0.0, {**units, DECISION: decision})]
