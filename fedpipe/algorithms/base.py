"""The algorithm interface: what a client optimises, what it uploads, how the server aggregates.

An algorithm owns no loops, devices or files. It declares:
- its phases (`phases`): which rounds, whether clients are sampled, whether they communicate;
- per phase, a client's parameter slots (`client_params`): named groups of tensors such as
  ``{"global": ..., "local": ..., "anchor": ...}``, and the local stages that train some of them
  (`stages`), each with a loss that is a pure function of those tensors and a batch, so the engine
  can run one client or many at once (`torch.func.functional_call` / `vmap`);
- what leaves the client (`client_result`), how the server combines it (`aggregate`), and that
  rule declared as data per phase (`aggregation`: the plain weighted mean or the method's own,
  `fedpipe.algorithms.aggregation`);
- which models to evaluate (`global_model`, `personalized_candidates`).

Parameters travel as plain ``dict[str, Tensor]`` keyed by the module's parameter names.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
from pydantic import Field
from torch import nn
from torch.func import functional_call

from fedpipe.algorithms.aggregation import NO_UPLOADS, WEIGHTED_MEAN, Aggregation, Params, custom, weighted_average
from fedpipe.config import MAX_EPOCHS, Section
from fedpipe.search_space import Dimension

if TYPE_CHECKING:
    from fedpipe.data.federated import ClientData

Slots = dict[str, Params]  # slot name -> parameters, e.g. {"global": {...}, "local": {...}}
Loss = Callable[[Slots, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


@dataclass(frozen=True)
class Phase:
    """A stretch of rounds run as one training job (one pipeline task)."""

    name: str
    first_round: int  # global, 1-based, inclusive
    last_round: int  # inclusive
    sample_clients: bool  # True: a fraction C of clients per round; False: every client, every round
    communicates: bool  # clients upload and the server aggregates (opt-out clients stay out)
    description: str
    downloads: bool = True  # clients receive the server's model at the start of their round

    @property
    def rounds(self) -> range:
        return range(self.first_round, self.last_round + 1)


@dataclass(frozen=True)
class ClientContext:
    """Who is training, when, and on what: handed to every client-side call of a round."""

    client_id: int
    round: int  # global round index
    phase: Phase
    data: ClientData  # the client's train / validation / test splits, on the device


@dataclass(frozen=True)
class EarlyStopping:
    """Stop a stage when the loss on the client's validation split has not improved for `patience`
    epochs, and keep the trainable tensors of its best epoch (the stage's `epochs` is the maximum)."""

    patience: int


@dataclass(frozen=True)
class Stage:
    """One stretch of local optimisation inside a client's round.

    `loss(slots, x, y, noise)` must be pure: it reads only its arguments. `noise` is whatever
    `Algorithm.batch_noise` drew for this batch, or for the epoch with `noise_per="epoch"` (None
    when the stage needs no randomness).
    """

    trainable: tuple[str, ...]  # slots whose tensors the optimiser updates
    epochs: int
    loss: Loss
    lr_scale: float = 1.0  # multiplies the round's learning rate for this stage
    lr: float | None = None  # an absolute learning rate instead (a method's own rate, e.g. pFedMB's eta_alpha)
    noise_per: str = "batch"  # "batch" or "epoch": how often batch_noise is drawn
    after_step: Callable[[Slots], None] | None = None  # in-place fix-up after each step (e.g. a projection)
    update: Callable[[Slots, torch.Tensor, torch.Tensor, torch.Tensor | None, float], torch.Tensor] | None = None
    """A custom per-batch update (e.g. pFedMe's inner problem) that changes the trainable tensors in
    place and returns the batch loss; None: the engine's optimiser steps on `loss`."""
    early_stopping: EarlyStopping | None = None


@dataclass(frozen=True)
class Upload:
    """What one client sent to the server in a round."""

    client_id: int
    num_samples: int  # training samples: the aggregation weight of sample-weighted averaging
    tensors: Params


@dataclass
class ServerState:
    """What the server keeps between rounds: the global model, plus per-client tensors for methods
    whose server personalises (FedAMP's cloud models, FedFomo's model pool)."""

    global_params: Params
    per_client: dict[int, Params] = field(default_factory=dict)


class MethodParams(Section):
    """Base of each method's hyperparameters (a `name` literal plus its own fields)."""

    name: str
    finetune_epochs: int = Field(0, ge=0, le=MAX_EPOCHS)
    """After the method's own phases, every client fine-tunes its personalized model locally for
    this many epochs (a `finetune` phase; 0: none). pFedMB's comparisons fine-tune every method."""
    finetune_lr_scale: float = Field(1.0, gt=0)
    """Fine-tuning learning rate as a multiple of train.lr decayed to the fine-tuning round."""

    #: What a study tunes for this method beside `fedpipe.search_space.COMMON_SPACE` (train.lr): config
    #: paths to ranges, declared beside the fields (empty: only the shared ones)
    search_space: ClassVar[dict[str, Dimension]] = {}


#: The `bf16_refusal` of a method whose stage has its own per-batch `update` (the engine's autocast wraps only `loss`)
OWN_UPDATE_IN_FP32 = "its per-batch update is its own code, outside the engine's autocast: it trains in fp32"


class Algorithm(ABC):
    """A federated method. Subclasses set `name`, `Params`, `paper` and implement the abstract methods."""

    name: ClassVar[str]
    Params: ClassVar[type[MethodParams]]
    paper: ClassVar[str]  # where its update rules come from
    supports_finetune: ClassVar[bool] = True  # False where personalization is not one model per client
    departures: ClassVar[tuple[str, ...] | None] = None  # defaults departing from the paper or filling its gaps; None: not listed
    #: Its private surface, in plain words: what leaves a client in a communicating round (`fedpipe methods`)
    uploads: ClassVar[str] = "the global model"
    #: Why `privacy.enabled` cannot cover it (its server uses per-client statistics outside the clipped, noised
    #: sum), or None when the engine's differential privacy covers everything it uploads (`fedpipe.engine.privacy`)
    privacy_refusal: ClassVar[str | None] = None
    #: What its server keeps per client by definition (FedFomo's, FedAMP's models); None: nothing (`fedpipe.federation.resume`)
    server_holds: ClassVar[str | None] = None
    #: What privacy leaves visible even when it covers the method (said by `fedpipe methods` and the run's log)
    privacy_caveat: ClassVar[str | None] = None
    #: Why bf16 autocast would change what the method computes beyond rounding noise, or None where it is safe:
    #: `engine.amp=auto` then stays fp32 for it (an explicit `engine.amp=bf16` is honoured, with a warning)
    bf16_refusal: ClassVar[str | None] = None

    def __init__(self, params: MethodParams, model: nn.Module, seed: int):
        self.params = params
        self.model = model
        self.seed = seed
        #: whether evaluation may map `forward` over a client's stacked candidates (not through a recurrent
        #: layer: vmap has no rule for packed sequences and loops slowly; unset once it finds it cannot)
        self.vmap_eval = not any(isinstance(m, nn.RNNBase) for m in model.modules())

    # --- the network as a pure function -------------------------------------------------------
    def forward(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        """The method's network on parameter tensors: what every loss and every evaluation calls."""
        return functional_call(self.model, params, (x,))

    # --- phases ---------------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def phases(cls, params: MethodParams, rounds: int) -> list[Phase]:
        """The method's phases for a run of `rounds` federated rounds (known from the config alone,
        so a pipeline can be generated without loading data)."""

    # --- client side ----------------------------------------------------------------------------
    @abstractmethod
    def client_params(self, ctx: ClientContext, download: Params, state: Params | None) -> Slots:
        """The slots a client trains and reads this round, built from what it downloaded and the
        state it kept from earlier rounds (None on its first round). Returned tensors may alias
        their inputs: the engine copies the trainable ones before optimising."""

    @abstractmethod
    def stages(self, ctx: ClientContext, local_epochs: int) -> list[Stage]:
        """The local optimisation stages of a client's round."""

    def batch_noise(self, ctx: ClientContext, stage: Stage, generator: torch.Generator) -> torch.Tensor | None:
        """Per-batch (or per-epoch) randomness the loss needs (SuPerFed's lam). Drawn from the client's generator."""
        return None

    @abstractmethod
    def client_result(self, ctx: ClientContext, slots: Slots, state: Params | None) -> tuple[Params | None, Params | None]:
        """(upload, new persistent state) after local training. upload None: nothing is sent."""

    # --- server side ----------------------------------------------------------------------------
    def download(self, phase: Phase, server: ServerState, client_id: int) -> Params:
        """What a client receives at the start of a round (by default the global model)."""
        return server.global_params

    def upload_layout(self, phase: Phase, download: Params, sent: Collection[str] = ()) -> Params:
        """What a client's upload holds in `phase` after receiving `download`: tensors whose names, shapes and
        dtypes (not values) an upload must have. A federation's server checks every upload against it before
        aggregating (`fedpipe.federation.transport.check_upload`). By default the download's layout (the method
        uploads what it downloaded, trained); a method whose upload carries more or other tensors declares them here
        (pFedMB: its branches and its alpha). Where the upload is one of several forms (IFCA's cluster, FedMN's units),
        the names it holds (`sent`) pick the form, and an upload that is not wholly that form fails the check."""
        return download

    def upload_problem(self, phase: Phase, download: Params, upload: Params) -> str | None:
        """What a federation's server finds wrong in an upload's values beyond its layout (FedFomo: ids not sent), or None."""
        return None

    def aggregation(self, phase: Phase) -> Aggregation:
        """How `aggregate` combines this phase's uploads. By default the plain weighted mean
        (`WEIGHTED_MEAN`), and `NO_UPLOADS` for a phase that does not communicate. A method that
        overrides `aggregate` declares its rule here; one that does not is taken as custom (it loses
        the distributed fast path rather than getting a wrong one)."""
        if not phase.communicates:
            return NO_UPLOADS
        if type(self).aggregate is Algorithm.aggregate:
            return WEIGHTED_MEAN
        return custom(f"{self.name}'s own aggregate (not declared)")

    def aggregate(self, phase: Phase, server: ServerState, uploads: list[Upload]) -> ServerState:
        """Combine the round's uploads (by default: sample-weighted average into the global model,
        `WEIGHTED_MEAN`)."""
        if not uploads:
            return server
        return self.apply_average(server, weighted_average([u.tensors for u in uploads], [u.num_samples for u in uploads]))

    def apply_average(self, server: ServerState, averaged: Params) -> ServerState:
        """The server state after the default aggregation produced `averaged` (uploaded tensors replace
        their global counterparts). A distributed phase all-reduces the average and calls this directly."""
        return ServerState({**server.global_params, **averaged}, server.per_client)

    def secure_weighting(self, phase: Phase) -> str | None:
        """How a sum that hides each upload (SecAgg+, `fedpipe.federation.secagg`) can give this phase's aggregate:
        "samples" (the sample-weighted mean, then `apply_mean`), "uniform" (the unweighted mean, then `apply_mean`), or
        None: the rule needs each upload. By default "samples" for the plain weighted mean (`WEIGHTED_MEAN`)."""
        return "samples" if phase.communicates and self.aggregation(phase).is_weighted_mean else None

    def secure_upload(self, phase: Phase, upload: Params) -> Params:
        """What a site puts under SecAgg+'s masks instead of its upload (same names, shapes and dtypes), so that the
        masked sum's mean is what `apply_mean` needs. By default the upload itself; pFedMB sends alpha * branch."""
        return upload

    def apply_mean(self, server: ServerState, mean: Params) -> ServerState:
        """The server state from the round's mean upload, weighted as `secure_weighting` says: what a distributed
        phase's all-reduce or SecAgg+'s unmasked sum hands the server. By default `apply_average`; a method whose rule is
        post-processing of that mean (pFedMe's server mix) overrides this."""
        return self.apply_average(server, mean)

    def apply_private(self, server: ServerState, estimate: Params) -> ServerState:
        """The server state after a private round (`privacy.enabled`): `estimate` is the differentially private
        mean of the clients' uploads (DP-FedAvg's noised, clipped estimate, `fedpipe.engine.privacy`). By default it
        replaces the global tensors as `apply_average` does; a method with its own rule that is post-processing
        of the mean (pFedMe's server mix) overrides this."""
        return self.apply_average(server, estimate)

    def round_details(self, server: ServerState, clients: dict[int, Params]) -> dict:
        """Method-specific records of a finished round, JSON-serialisable (e.g. each client's branch
        weights), written to the round's line in the run's JSONL file; never pushed as metrics."""
        return {}

    def report_plots(self, rounds: list[dict]) -> dict[str, Callable[[Path], object]]:
        """Extra figures for the report, drawn from the run's round lines (with their `details`):
        {file name: function that draws it at a path}. E.g. pFedMB's alpha heatmap."""
        return {}

    # --- evaluation -----------------------------------------------------------------------------
    def global_model(self, server: ServerState) -> Params | None:
        """The model evaluated on the global test set (None when the method has none)."""
        return server.global_params

    def personalized_candidates(self, server: ServerState, state: Params | None, client_id: int) -> list[tuple[float, Params]]:
        """A client's personalized model(s), as parameters `forward` takes. With several candidates
        (SuPerFed's lam grid) the engine picks one per client on its validation split and reports
        the whole curve."""
        return [(0.0, self.global_model(server) or server.global_params)]

    @property
    def candidate_label(self) -> str | None:
        """Name of the candidate axis when there are several (e.g. "lam")."""
        return None


def privacy_problem(algorithm: Algorithm, phases: list[Phase]) -> str | None:
    """Why `privacy.enabled` cannot cover this configured method, or None: a declared refusal, or a communicating
    phase aggregated by a rule of its own that is not post-processing of the private mean (`apply_private`)."""
    if algorithm.privacy_refusal:
        return f"method {algorithm.name} cannot run with privacy.enabled: {algorithm.privacy_refusal}"
    inner = getattr(algorithm, "inner", algorithm)  # a FineTuned wrapper: the wrapped method's rule
    for phase in phases:
        rule = algorithm.aggregation(phase)
        if phase.communicates and rule.kind == "custom" and type(inner).apply_private is Algorithm.apply_private:
            return (f"method {algorithm.name} cannot run with privacy.enabled: its phase {phase.name!r} aggregates by its own "
                    f"rule ({rule.description}), which the engine's private mean does not cover")
    return None


def federation_phase(rounds: int, description: str) -> Phase:
    """The one communicating phase of rounds 1..R that most methods consist of: sampled clients
    train and upload, the server aggregates."""
    return Phase("federation", 1, rounds, sample_clients=True, communicates=True, description=description)


def cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, y)
