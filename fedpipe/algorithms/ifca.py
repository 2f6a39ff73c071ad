"""IFCA (Ghosh, Chung, Yin and Ramchandran, "An Efficient Framework for Clustered Federated Learning",
NeurIPS 2020), Algorithm 2 with model averaging.

The server holds k cluster models theta_1..theta_k. In every round (Algorithm 2):

- it broadcasts all k models to the sampled clients (each download is k x P parameters);
- client i estimates its cluster identity as the model with the lowest loss on its training data,
      j_i = argmin_j F_i(theta_j)                                   (cluster identity estimate)
  trains that model for E local epochs (the "model averaging" variant) and sends it back with
  j_i (here the cluster is the name under which the tensors travel, so it costs no bytes);
- the server replaces each cluster model by the average of the models uploaded for it;
  a cluster nobody picked keeps its model.

The server averages each cluster's uploads with equal weights 1/|S_j|, as Algorithm 2 does
(`weighting: uniform`, the default since it is the paper's rule); `weighting: samples` weights
them by training-set size instead (FedAvg's rule). The two agree when the clients of a cluster hold
equally many samples, as in the paper's experiments; with `clusters: 1` and `weighting: samples`
IFCA is FedAvg.

Initialisation: IFCA needs k different starting points (the paper draws them at random). Cluster 0
is the run's initial model; cluster j > 0 is a fresh default PyTorch initialisation of the same
network seeded by (run seed, j).

A client's personalized model is the cluster model it picks. With `reassign_at_end` (default) an
`assignment` phase follows the last round: every client downloads the final k models and picks
again on its training data (no training, nothing uploaded), so evaluation uses the final models'
argmin. Until then, and without it, a client's pick is the one of its last round. There is no
single global model.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Collection
from typing import ClassVar, Literal

import torch
from pydantic import Field

from fedpipe.algorithms.aggregation import NO_UPLOADS, WEIGHTED_MEAN, Aggregation, custom, weighted_average
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
from fedpipe.search_space import Dimension, IntRange
from fedpipe.seeding import derive_seed

log = logging.getLogger(__name__)

CLUSTER_KEY = "ifca/cluster"  # in a client's kept state: the cluster it picked last, as an int64 scalar
LOSS_BATCH = 1024  # samples per forward when estimating a client's cluster (memory only)


def cluster_prefix(j: int) -> str:
    return f"cluster{j}/"


class IFCAParams(MethodParams):
    """IFCA: k cluster models; every client trains the one with the lowest loss on its data."""

    search_space: ClassVar[dict[str, Dimension]] = {"method.clusters": IntRange(2, 5)}
    """What a study tunes beside train.lr: the number of cluster models k."""

    name: Literal["ifca"] = "ifca"
    clusters: int = Field(2, ge=1, le=1024)  # k models on the server, each scored by every client
    """k: number of cluster models (paper: the number of underlying client groups; PFLlib has no IFCA)."""
    weighting: Literal["uniform", "samples"] = "uniform"
    """How the server averages the models uploaded for one cluster: 'uniform' (the default: Algorithm 2,
    the plain mean over the cluster's clients) or 'samples' (by training-set size, as FedAvg)."""
    reassign_at_end: bool = True
    """After the last round every client picks its cluster again with the final models (an
    `assignment` phase; each client downloads the k models once more). False: a client keeps the
    cluster it picked in the last round it took part in."""


class IFCA(Algorithm):
    name = "ifca"
    Params = IFCAParams
    paper = "Ghosh et al. 2020, Algorithm 2 (model averaging)"
    uploads = "the model of the cluster it chose (the choice travels with it)"
    privacy_refusal = ("its server learns which cluster each client chose and averages each cluster's uploads over that "
                       "cluster's clients (Algorithm 2): the choice and the per-cluster counts are outside a clipped, noised sum")
    departures = (
        "cluster j > 0 starts from a seeded fresh initialisation, cluster 0 from the run's initial model "
        "(the paper: random initialisations)",
        "reassign_at_end=true: every client picks its cluster again with the final models before evaluation",
    )
    params: IFCAParams

    def __init__(self, params, model, seed):
        super().__init__(params, model, seed)
        self._initial: Params | None = None
        fixed = [f"{path}.{n}" if path else n for path, m in model.named_modules() if not hasattr(m, "reset_parameters")
                 for n, _ in m.named_parameters(recurse=False)]
        if fixed and self.params.clusters > 1:
            log.warning("IFCA draws the other clusters' models by each layer's reset_parameters, which the layers holding %s "
                        "of %s do not have: those parameters start equal in every cluster.", ", ".join(fixed[:10]),
                        type(model).__name__)

    @classmethod
    def phases(cls, params: IFCAParams, rounds: int) -> list[Phase]:
        phases = [federation_phase(rounds, "each client trains the cluster model with its lowest training loss")]
        if params.reassign_at_end:
            phases.append(Phase("assignment", rounds + 1, rounds + 1, sample_clients=False, communicates=False,
                                description="every client picks its cluster with the final models (no training)"))
        return phases

    # --- the k models -----------------------------------------------------------------------------
    def fresh_init(self, j: int, like: Params) -> Params:
        """A default PyTorch initialisation of the network, seeded by (run seed, j)."""
        module = copy.deepcopy(self.model).to("cpu")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.seed, "ifca-cluster", j))
            for m in module.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
        return {n: p.detach().to(like[n].device) for n, p in module.named_parameters()}

    def clusters(self, server: ServerState) -> Params:
        """The k cluster models as one flat dict, `cluster<j>/<parameter>`. A server state that still
        holds the plain initial model (round 1) is expanded: cluster 0 is that model."""
        g = server.global_params
        if any(n.startswith(cluster_prefix(0)) for n in g):
            return g
        if self._initial is None:
            initial = {cluster_prefix(0) + n: t for n, t in g.items()}
            for j in range(1, self.params.clusters):
                initial.update({cluster_prefix(j) + n: t for n, t in self.fresh_init(j, g).items()})
            self._initial = initial
        return self._initial

    def cluster(self, models: Params, j: int) -> Params:
        prefix = cluster_prefix(j)
        return {n.removeprefix(prefix): t for n, t in models.items() if n.startswith(prefix)}

    def cluster_losses(self, models: Params, x: torch.Tensor, y: torch.Tensor) -> list[float]:
        """F_i(theta_j): mean cross-entropy of every cluster model on (x, y)."""
        losses = []
        with torch.no_grad():
            for j in range(self.params.clusters):
                params = self.cluster(models, j)
                total = sum(
                    float(torch.nn.functional.cross_entropy(self.forward(params, x[s : s + LOSS_BATCH]), y[s : s + LOSS_BATCH], reduction="sum"))
                    for s in range(0, len(y), LOSS_BATCH)
                )
                losses.append(total / max(len(y), 1))
        return losses

    def pick(self, models: Params, x: torch.Tensor, y: torch.Tensor) -> int:
        """argmin_j F_i(theta_j) (Algorithm 2's cluster identity estimate); ties go to the lowest j."""
        losses = self.cluster_losses(models, x, y)
        return min(range(len(losses)), key=lambda j: (losses[j], j))

    # --- server side ----------------------------------------------------------------------------
    def download(self, phase: Phase, server: ServerState, client_id: int) -> Params:
        return self.clusters(server)  # all k models (k x P)

    def upload_layout(self, phase: Phase, download: Params, sent: Collection[str] = ()) -> Params:
        """The model of the one cluster the client picked (Algorithm 2: it uploads that cluster's model, its index
        in the names' prefix): the cluster the upload's names start with (cluster 0 when none does, so the check
        names what is missing); an upload that mixes clusters fails the check."""
        picked = next((j for j in range(self.params.clusters) if any(n.startswith(cluster_prefix(j)) for n in sent)), 0)
        return {n: t for n, t in download.items() if n.startswith(cluster_prefix(picked))}

    def aggregation(self, phase: Phase) -> Aggregation:
        """With one cluster weighted by samples, IFCA is FedAvg: the plain weighted mean."""
        if not phase.communicates:
            return NO_UPLOADS
        if self.params.clusters == 1 and self.params.weighting == "samples":
            return WEIGHTED_MEAN
        return custom(f"each cluster model is the {self.params.weighting}-weighted mean of the models uploaded for it "
                      "(Algorithm 2); a cluster nobody picked keeps its model")

    def aggregate(self, phase: Phase, server: ServerState, uploads: list[Upload]) -> ServerState:
        models = dict(self.clusters(server))
        for j in range(self.params.clusters):
            prefix = cluster_prefix(j)
            mine = [u for u in uploads if next(iter(u.tensors)).startswith(prefix)]
            if not mine:
                continue  # nobody picked cluster j this round: it keeps its model
            weights = [u.num_samples if self.params.weighting == "samples" else 1 for u in mine]
            models.update(weighted_average([u.tensors for u in mine], weights))
        return ServerState(models, server.per_client)

    def apply_average(self, server: ServerState, averaged: Params) -> ServerState:
        return ServerState({**self.clusters(server), **averaged}, server.per_client)

    # --- client side ----------------------------------------------------------------------------
    def client_params(self, ctx: ClientContext, download: Params, state: Params | None) -> Slots:
        train = ctx.data.train
        j = self.pick(download, train.x, train.y)
        slots: Slots = {"choice": {CLUSTER_KEY: torch.tensor(j, dtype=torch.int64)}}
        if ctx.phase.name == "federation":
            slots["model"] = self.cluster(download, j)
        return slots

    def stages(self, ctx: ClientContext, local_epochs: int) -> list[Stage]:
        if ctx.phase.name != "federation":
            return []  # the assignment phase only picks
        return [Stage(("model",), local_epochs, self.loss)]

    def loss(self, slots: Slots, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        return cross_entropy(self.forward(slots["model"], x), y)

    def client_result(self, ctx: ClientContext, slots: Slots, state: Params | None) -> tuple[Params | None, Params | None]:
        choice = slots["choice"]
        if "model" not in slots:
            return None, choice
        prefix = cluster_prefix(int(choice[CLUSTER_KEY]))
        return {prefix + n: t for n, t in slots["model"].items()}, choice

    def round_details(self, server: ServerState, clients: dict[int, Params]) -> dict:
        picks = {cid: int(s[CLUSTER_KEY]) for cid, s in sorted(clients.items()) if s and CLUSTER_KEY in s}
        sizes = [sum(1 for j in picks.values() if j == c) for c in range(self.params.clusters)]
        return {"cluster_of_client": picks, "clients_per_cluster": sizes}

    # --- evaluation -----------------------------------------------------------------------------
    def global_model(self, server: ServerState) -> Params | None:
        return None  # k cluster models, no single global one

    def personalized_candidates(self, server: ServerState, state: Params | None, client_id: int) -> list[tuple[float, Params]]:
        j = int(state[CLUSTER_KEY]) if state is not None and CLUSTER_KEY in state else 0
        return [(0.0, self.cluster(self.clusters(server), j))]
