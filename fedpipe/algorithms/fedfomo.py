"""FedFomo (Zhang, Sapra, Fidler, Yeung and Alvarez, "Personalized Federated Learning with First Order
Model Optimization", ICLR 2021), Section 3 and Algorithm 1.

Every client i keeps its own model theta_i; the server keeps every client's latest uploaded model
and an affinity matrix P (row i: how useful client i found the others' models). In a round:

- the server sends client i the models of M other clients, chosen epsilon-greedily on P_i: for each
  of the M slots, with probability epsilon a random client not yet chosen, otherwise the not yet
  chosen one with the highest affinity (random tie-break); epsilon decays linearly;
- the client weighs each downloaded model n on its validation split (Eq. 5)
      w_n = (L_i(theta_i) - L_i(theta_n)) / ||theta_n - theta_i||,
  keeps the positive ones and normalises them (Eq. 6), and moves its model
      theta_i <- theta_i + sum_n  max(w_n, 0) / sum_m max(w_m, 0) * (theta_n - theta_i)
  (no move when no weight is positive);
- it then trains theta_i locally for E epochs and uploads it with the M weights w_n;
- the server stores theta_i and adds the weights to the affinities, P_{i,n} += w_n (Algorithm 1).

A client's personalized model is its theta_i; there is no global model. In round 1 no client has
uploaded yet, so nothing is downloaded and every client trains the initial model.

Choices (the paper is silent or the official code differs):
- `distance`: ||.|| in Eq. 5 is the L2 norm of the flattened parameter difference ('l2'); the
  official code defaults to the L1 norm ('l1'). A downloaded model identical to theta_i gets w_n = 0.
- L_i(theta_i) is the client's current model, as the paper writes; the official code's default
  compares against the model the client had before its previous local training.
- P accumulates the signed weights w_n of Eq. 5 (the paper); the official code adds them divided
  by |sum_n w_n|. Both only rank the candidates.
- epsilon decays per participation of the client (epsilon - decay * (rounds it has taken part in),
  floored at 0), which is per round when every client takes part every round (official code:
  epsilon 0.3, decay 0.05 per round). The draws are seeded by (run seed, client, participations).
- Without a validation split a client weighs the models on its training split.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import ClassVar, Literal

import torch
from pydantic import Field

from fedpipe.algorithms.aggregation import Aggregation, custom
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
from fedpipe.search_space import Dimension, Uniform
from fedpipe.seeding import torch_generator

WEIGHTS, IDS = "fedfomo/weights", "fedfomo/ids"  # sent with the model: the w_n of Eq. 5 and whose models they weigh
AFFINITY, PARTICIPATIONS = "fedfomo/affinity", "fedfomo/participations"  # server-side, per client
LOSS_BATCH = 1024  # samples per forward when computing validation losses (memory only)


def client_prefix(j: int) -> str:
    return f"client{j}/"


def model_of(entry: Params) -> Params:
    """A client's model from what the server holds for it (without FedFomo's own entries)."""
    return {n: t for n, t in entry.items() if not n.startswith("fedfomo/")}


def downloaded_ids(download: Params) -> list[int]:
    """The clients whose models a download holds (`client{j}/...` names), in order."""
    return sorted({int(n.split("/", 1)[0].removeprefix("client")) for n in download})


def fomo_update(own: Params, others: list[Params], weights: list[float]) -> Params:
    """theta_i + sum_n max(w_n, 0) / sum_m max(w_m, 0) * (theta_n - theta_i) (Eq. 6); theta_i when
    no weight is positive."""
    positive = [max(w, 0.0) for w in weights]
    total = sum(positive)
    if total <= 0:
        return own
    out = {}
    for n, t in own.items():
        acc = t.double().clone()
        for other, w in zip(others, positive):
            if w > 0:
                acc += (w / total) * (other[n].double() - t.double())
        out[n] = acc.to(t.dtype)
    return out


class FedFomoParams(MethodParams):
    """FedFomo: each client mixes in the other clients' models that lower its validation loss."""

    search_space: ClassVar[dict[str, Dimension]] = {"method.epsilon": Uniform(0.0, 0.5)}
    """What a study tunes beside train.lr: the exploration rate of model selection."""

    name: Literal["fedfomo"] = "fedfomo"
    models_per_round: int = Field(5, ge=1, le=1024)  # downloads per client and round
    """M: models of other clients a client downloads per round (PFLlib's default 5; official code 8)."""
    epsilon: float = Field(0.3, ge=0, le=1)
    """Exploration: probability that a download slot takes a random client instead of the highest
    affinity (official code 0.3)."""
    epsilon_decay: float = Field(0.05, ge=0)
    """Subtracted from epsilon for every round the client has taken part in (official code 0.05)."""
    distance: Literal["l2", "l1"] = "l2"
    """Norm of theta_n - theta_i in Eq. 5: 'l2' (the paper's ||.||) or 'l1' (the official code's default)."""


class FedFomo(Algorithm):
    name = "fedfomo"
    Params = FedFomoParams
    paper = "Zhang et al. 2021, Eq. 5-6 and Algorithm 1"
    uploads = "its whole model and its M weights w_n (validation-loss gains over other clients' models)"
    server_holds = "each client's latest model, its weights w_n and its affinities to the other clients (Algorithm 1)"
    privacy_refusal = "its server keeps each client's model and affinities (Algorithm 1): per-client statistics outside the noised sum"
    departures = (
        "models_per_round=5 (M): PFLlib's default; the official code downloads 8",
        "epsilon=0.3 decaying by epsilon_decay=0.05 per participation of the client: the official code's values, "
        "which it decays per round",
        "train.* are the run-wide defaults (SGD lr 0.01, momentum 0.9, weight decay 1e-4, B = 10, E = 5), not the "
        "paper's settings",
    )
    params: FedFomoParams

    @classmethod
    def phases(cls, params: MethodParams, rounds: int) -> list[Phase]:
        return [federation_phase(rounds, "clients mix in other clients' models weighted by validation-loss gain, then train")]

    # --- server side ----------------------------------------------------------------------------
    def choose(self, server: ServerState, client_id: int) -> list[int]:
        """The M clients whose models client `client_id` downloads: epsilon-greedy on its affinities."""
        pool = sorted(j for j in server.per_client if j != client_id)
        m = min(self.params.models_per_round, len(pool))
        if m == 0:
            return []
        entry = server.per_client.get(client_id, {})
        done = int(entry[PARTICIPATIONS]) if PARTICIPATIONS in entry else 0
        affinity = entry.get(AFFINITY, torch.zeros(0))
        epsilon = max(self.params.epsilon - self.params.epsilon_decay * done, 0.0)
        gen = torch_generator(self.seed, "fedfomo-download", client_id, done)
        tie_break = torch.rand(len(pool), generator=gen)
        score = [float(affinity[j]) if j < len(affinity) else 0.0 for j in pool]
        greedy = [pool[k] for k in sorted(range(len(pool)), key=lambda k: (-score[k], -float(tie_break[k])))]
        shuffled = [pool[k] for k in torch.randperm(len(pool), generator=gen).tolist()]
        chosen: list[int] = []
        for _ in range(m):
            source = shuffled if float(torch.rand((), generator=gen)) < epsilon else greedy
            chosen.append(next(j for j in source if j not in chosen))
        return chosen

    def download(self, phase: Phase, server: ServerState, client_id: int) -> Params:
        if phase.name != "federation":
            return server.global_params
        return {client_prefix(j) + n: t for j in self.choose(server, client_id)
                for n, t in model_of(server.per_client[j]).items()}

    def upload_layout(self, phase: Phase, download: Params, sent: Collection[str] = ()) -> Params:
        """Its own model (the network's layout) and one weight w_n and id per model it downloaded (Eq. 5)."""
        like = next(iter(download.values()), None)
        device = like.device if like is not None else torch.device("cpu")
        m = len(downloaded_ids(download))
        return {**{n: t.to(device) for n, t in self.initial().items()}, WEIGHTS: torch.zeros(m, dtype=torch.float32, device=device),
                IDS: torch.zeros(m, dtype=torch.int64, device=device)}

    def upload_problem(self, phase: Phase, download: Params, upload: Params) -> str | None:
        """The ids must be those of the models the client downloaded, in order (they index the server's affinities)."""
        sent = downloaded_ids(download)
        if upload[IDS].tolist() != sent:
            return f"its weights name clients {upload[IDS].tolist()[:5]}, but it was sent the models of {sent[:5]}"
        return None

    def aggregation(self, phase: Phase) -> Aggregation:
        return custom("each upload is stored as its client's model, its weights w_n added to the client's affinities (Algorithm 1)")

    def aggregate(self, phase: Phase, server: ServerState, uploads: list[Upload]) -> ServerState:
        per_client = dict(server.per_client)
        for u in uploads:
            old = per_client.get(u.client_id, {})
            ids, weights = u.tensors[IDS].tolist(), u.tensors[WEIGHTS]
            size = max([u.client_id, *ids, len(old.get(AFFINITY, ())) - 1]) + 1
            affinity = torch.zeros(size, dtype=torch.float64)
            if AFFINITY in old:
                affinity[: len(old[AFFINITY])] = old[AFFINITY]
            for j, w in zip(ids, weights.tolist()):
                affinity[j] += w  # P_{i,n} += w_n (Algorithm 1)
            done = int(old[PARTICIPATIONS]) + 1 if PARTICIPATIONS in old else 1
            per_client[u.client_id] = {
                **model_of(u.tensors),
                AFFINITY: affinity,
                PARTICIPATIONS: torch.tensor(done, dtype=torch.int64),
                IDS: u.tensors[IDS],
                WEIGHTS: weights,
            }
        return ServerState(server.global_params, per_client)

    def round_details(self, server: ServerState, clients: dict[int, Params]) -> dict:
        """Each client's latest weights w_n (Eq. 5, before clipping), by the client whose model they weigh."""
        latest = {}
        for cid, entry in sorted(server.per_client.items()):
            if IDS in entry:
                latest[cid] = {int(j): round(float(w), 6) for j, w in zip(entry[IDS].tolist(), entry[WEIGHTS].tolist())}
        return {"fomo_weights": latest}

    # --- client side ----------------------------------------------------------------------------
    def validation_loss(self, params: Params, x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.no_grad():
            total = sum(
                float(torch.nn.functional.cross_entropy(self.forward(params, x[s : s + LOSS_BATCH]), y[s : s + LOSS_BATCH], reduction="sum"))
                for s in range(0, len(y), LOSS_BATCH)
            )
        return total / max(len(y), 1)

    def distance(self, a: Params, b: Params) -> float:
        p = 2 if self.params.distance == "l2" else 1
        norms = torch.stack([torch.linalg.vector_norm((a[n] - b[n]).double(), ord=p) for n in a])
        return float(torch.linalg.vector_norm(norms, ord=p))

    def fomo_weights(self, own: Params, others: list[Params], x: torch.Tensor, y: torch.Tensor) -> list[float]:
        """w_n = (L(theta_i) - L(theta_n)) / ||theta_n - theta_i|| (Eq. 5); 0 for a model equal to theta_i."""
        base = self.validation_loss(own, x, y)
        weights = []
        for other in others:
            dist = self.distance(other, own)
            weights.append((base - self.validation_loss(other, x, y)) / dist if dist > 0 else 0.0)
        return weights

    def client_params(self, ctx: ClientContext, download: Params, state: Params | None) -> Slots:
        own = state if state is not None else self.initial()
        ids = downloaded_ids(download)
        others = [{n.removeprefix(client_prefix(j)): t for n, t in download.items() if n.startswith(client_prefix(j))} for j in ids]
        split = ctx.data.val if len(ctx.data.val) else ctx.data.train
        weights = self.fomo_weights(own, others, split.x, split.y) if others else []
        return {
            "model": fomo_update(own, others, weights),
            "fomo": {WEIGHTS: torch.tensor(weights, dtype=torch.float32), IDS: torch.tensor(ids, dtype=torch.int64)},
        }

    def initial(self) -> Params:
        """The run's initial model: a client's theta before its first round (the module's own parameters
        are never trained: the engine trains plain tensors through `functional_call`)."""
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def stages(self, ctx: ClientContext, local_epochs: int) -> list[Stage]:
        return [Stage(("model",), local_epochs, self.loss)]

    def loss(self, slots: Slots, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        return cross_entropy(self.forward(slots["model"], x), y)

    def client_result(self, ctx: ClientContext, slots: Slots, state: Params | None) -> tuple[Params | None, Params | None]:
        return {**slots["model"], **slots["fomo"]}, slots["model"]

    # --- evaluation -----------------------------------------------------------------------------
    def global_model(self, server: ServerState) -> Params | None:
        return None

    def personalized_candidates(self, server: ServerState, state: Params | None, client_id: int) -> list[tuple[float, Params]]:
        return [(0.0, state if state is not None else server.global_params)]
