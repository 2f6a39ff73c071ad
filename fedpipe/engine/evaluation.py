"""Evaluation: the global model on the global test set, and each client's personalized model(s) on
its own validation and test splits.

When a method offers several personalized candidates per client (SuPerFed's lam grid), each client
picks one on its validation split (highest accuracy, then lowest loss); the headline is that pick's
test accuracy. The test-oracle pick (best test accuracy, what SuPerFed's official code reports) is
given beside it, labelled as such, and so is the whole curve.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch.func import vmap
from torch.nn import functional as F

from fedpipe.algorithms.base import Algorithm, Params, ServerState
from fedpipe.data.federated import FederatedData, Split


@dataclass(frozen=True)
class Scores:
    accuracy: float  # top-1, 0..1
    top5: float
    loss: float  # mean cross-entropy
    ece: float  # expected calibration error
    n: int

    @property
    def correct(self) -> float:
        return self.accuracy * self.n


@contextmanager
def eval_mode(model: torch.nn.Module):
    """The model in eval mode (dropout off, batch-norm statistics frozen) and no autograd."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def predict(algorithm: Algorithm, params: Params, x: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Logits for `x` in batches (call inside `eval_mode`)."""
    if len(x) == 0:
        return torch.empty(0)
    return torch.cat([algorithm.forward(params, x[i : i + batch_size]) for i in range(0, len(x), batch_size)])


def expected_calibration_error(probs: torch.Tensor, y: torch.Tensor, bins: int) -> float:
    """ECE of one model's probabilities [n, K] (`_ece_segments`, which holds the formula)."""
    if len(y) == 0:
        return float("nan")
    return float(_ece_segments(probs, y, torch.zeros(len(y), dtype=torch.long, device=y.device), 1, bins)[0])


def _ece_segments(probs: torch.Tensor, y: torch.Tensor, segment: torch.Tensor, count: int, bins: int) -> torch.Tensor:
    """ECE with `bins` equal-width confidence bins (Guo et al. 2017, Eq. 3) of each of `count` segments of
    the rows of probs [M, K] (row m in segment[m]) at once: sum_b |B_b| / n * |acc(B_b) - conf(B_b)| =
    sum_b |sum_{i in B_b} (correct_i - conf_i)| / n, confidence = the top softmax probability; bin b holds
    confidences in (b/bins, (b+1)/bins]."""
    conf, pred = probs.double().max(dim=1)
    which = (torch.ceil(conf * bins).long() - 1).clamp_(0, bins - 1)
    gap = torch.zeros(count * bins, dtype=torch.float64, device=probs.device)
    gap.index_add_(0, segment * bins + which, (pred == y).double() - conf)
    n = torch.bincount(segment, minlength=count).double()
    return gap.view(count, bins).abs().sum(dim=1) / n


def score(logits: torch.Tensor, y: torch.Tensor, ece_bins: int | None) -> Scores:
    """Top-1, top-5, mean cross-entropy and (unless ece_bins is None) ECE of `logits` against `y`."""
    return score_segments(logits, y, [len(y)], ece_bins)[0]


def score_segments(logits: torch.Tensor, y: torch.Tensor, sizes: list[int], ece_bins: int | None) -> list[Scores]:
    """`score` of each run of consecutive rows of logits [M, K] against y [M], the runs `sizes` long (a
    block of clients' candidates on their own splits): one set of tensor operations for all of them
    instead of a dozen small ones per client and candidate (at 10,000 clients, most of the evaluation).
    Sums are taken in float64 and divided by each run's length; an empty run scores NaN."""
    count = len(sizes)
    n = torch.tensor(sizes, dtype=torch.float64, device=logits.device)
    segment = torch.repeat_interleave(torch.arange(count, device=logits.device), n.long())

    def total(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(count, dtype=torch.float64, device=logits.device).index_add_(0, segment, values.double())

    if len(y) == 0:
        nan = [float("nan")] * count
        return [Scores(a, t, lo, e, int(k)) for a, t, lo, e, k in zip(nan, nan, nan, nan, sizes)]
    top = logits.topk(min(5, logits.shape[1]), dim=1).indices
    accuracy = total(top[:, 0] == y) / n
    top5 = total((top == y[:, None]).any(dim=1)) / n
    loss = total(F.cross_entropy(logits, y, reduction="none")) / n
    ece = _ece_segments(F.softmax(logits.double(), dim=1), y, segment, count, ece_bins).tolist() if ece_bins else [float("nan")] * count
    return [Scores(a, t, lo, e, int(k)) for a, t, lo, e, k in zip(accuracy.tolist(), top5.tolist(), loss.tolist(), ece, sizes)]


#: Most bytes of stacked candidate weights one vmapped evaluation forward holds (beyond: in groups).
STACKED_EVAL_BYTES = 256 * 2**20


def predict_many(algorithm: Algorithm, models: list[Params], x: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """`predict` of each of `models` on the same `x`: their weights stacked and the forward mapped over
    them (`torch.func.vmap`, in groups of at most STACKED_EVAL_BYTES), one model at a time where the
    network has no vmap rule (an LSTM) or a model's tensors differ in shape. Call inside `eval_mode`."""
    if len(models) < 2 or len(x) == 0 or not getattr(algorithm, "vmap_eval", True):
        return [predict(algorithm, p, x, batch_size) for p in models]
    size = max(1, sum(t.numel() * t.element_size() for t in models[0].values()))
    group = max(1, STACKED_EVAL_BYTES // size)
    out: list[torch.Tensor] = []
    mapped = vmap(algorithm.forward, in_dims=(0, None))
    try:
        for start in range(0, len(models), group):
            part = models[start : start + group]
            stacked = {name: _stacked([p[name] for p in part]) for name in part[0]}
            logits = torch.cat([mapped(stacked, x[i : i + batch_size]) for i in range(0, len(x), batch_size)], dim=1)
            out.extend(logits.unbind(0))
    except (RuntimeError, NotImplementedError, KeyError):  # no vmap rule, or models of different shapes
        algorithm.vmap_eval = False
        return [predict(algorithm, p, x, batch_size) for p in models]
    return out


def evaluate_model(algorithm: Algorithm, params: Params, split: Split, batch_size: int, ece_bins: int) -> Scores:
    with eval_mode(algorithm.model):
        return score(predict(algorithm, params, split.x, batch_size), split.y, ece_bins)


@dataclass(frozen=True)
class ClientResult:
    client_id: int
    opt_out: bool
    candidates: tuple[float, ...]  # e.g. the lam grid; one entry for methods with a single model
    val: tuple[Scores, ...]  # per candidate (on the training split when the client has no validation split)
    test: tuple[Scores, ...]
    chosen: int  # index picked on validation
    oracle: int  # index with the best test accuracy (reported beside, never as the headline)
    on_global_test: Scores | None = None  # the chosen model on the shared global test set (when asked)

    @property
    def accuracy(self) -> float:
        return self.test[self.chosen].accuracy


@dataclass(frozen=True)
class PersonalizedResult:
    clients: tuple[ClientResult, ...]
    candidate_label: str | None

    @property
    def mean_accuracy(self) -> float:
        return float(np.mean([c.accuracy for c in self.clients]))

    @property
    def std_accuracy(self) -> float:
        return float(np.std([c.accuracy for c in self.clients]))

    @property
    def weighted_accuracy(self) -> float:
        correct = sum(c.test[c.chosen].correct for c in self.clients)
        return float(correct / max(sum(c.test[c.chosen].n for c in self.clients), 1))

    @property
    def mean_global_test_accuracy(self) -> float | None:
        """Mean over clients of their personalized model's accuracy on the balanced global test set
        (how well a specialist generalises; the mixture-of-experts paper's "global" column)."""
        scores = [c.on_global_test.accuracy for c in self.clients if c.on_global_test is not None]
        return float(np.mean(scores)) if scores else None

    @property
    def oracle_mean_accuracy(self) -> float:
        return float(np.mean([c.test[c.oracle].accuracy for c in self.clients]))

    @property
    def pooled_choice(self) -> int | None:
        """The one candidate for every client, picked on the validation splits pooled over clients (most
        correct predictions, then the lowest summed loss): an honest estimator with less noise than each
        client's own pick on its ~20 validation samples (`eval.candidates=pooled`). None with one candidate."""
        counts = {len(c.candidates) for c in self.clients}
        if len(counts) != 1 or counts == {1}:
            return None
        return min(range(counts.pop()), key=lambda i: (-sum(c.val[i].correct for c in self.clients),
                                                       sum(c.val[i].loss * c.val[i].n for c in self.clients), i))

    @property
    def pooled_mean_accuracy(self) -> float | None:
        i = self.pooled_choice
        return None if i is None else float(np.mean([c.test[i].accuracy for c in self.clients]))

    def curve(self) -> list[tuple[float, float, float]]:
        """(candidate, mean test accuracy over clients, std) for each candidate."""
        values = self.clients[0].candidates
        return [
            (v, float(np.mean([c.test[i].accuracy for c in self.clients])), float(np.std([c.test[i].accuracy for c in self.clients])))
            for i, v in enumerate(values)
        ]


def _pick(scores: tuple[Scores, ...]) -> int:
    """Highest accuracy, then lowest loss, then the first candidate."""
    return min(range(len(scores)), key=lambda i: (-scores[i].accuracy, scores[i].loss, i))


def evaluate_personalized(
    algorithm: Algorithm, server: ServerState, client_states: dict[int, Params], data: FederatedData, batch_size: int, ece_bins: int,
    on_global_test: bool = False, candidates: str = "per_client",
) -> PersonalizedResult:
    """Every client's candidates on its validation and test splits; with `on_global_test`, also its
    chosen model on the global test set. `candidates`: each client picks on its own validation split
    (per_client), or all clients take the candidate best on their validation splits pooled (pooled)."""
    if candidates == "pooled":
        per_client = evaluate_personalized(algorithm, server, client_states, data, batch_size, ece_bins)
        pick = per_client.pooled_choice
        if pick is not None:
            return _with_choice(per_client, pick, algorithm, server, client_states, data, batch_size, ece_bins, on_global_test)
    results = []
    with eval_mode(algorithm.model):
        for block in _blocks(algorithm, server, client_states, data):
            results.extend(_evaluate_block(algorithm, server, block, data, batch_size, ece_bins, on_global_test))
    return PersonalizedResult(tuple(results), algorithm.candidate_label)


def _evaluate_block(algorithm: Algorithm, server: ServerState, block: Block, data: FederatedData, batch_size: int,
                    ece_bins: int, on_global_test: bool) -> list[ClientResult]:
    """`evaluate_personalized` of one block of clients: every distinct candidate's logits on the client's
    selection and test inputs, then all of them scored together (`score_segments`)."""
    shared = _shared_logits(algorithm, server, block, data, batch_size)
    runs = []  # (client index, candidates, distinct ids, their logits [C, n, K], selection split, cut)
    for i, candidates in block:
        client = data.clients[i]
        select_on = client.val if len(client.val) else client.train
        x = torch.cat([select_on.x, client.test.x])  # one forward per candidate for both splits
        # a candidate that is the very same tensors as an earlier one is neither run nor scored again
        # (SuPerFed's 11 lam of a client without a local model: at 10,000 clients, scoring them all
        # took most of the evaluation); the others run together (`predict_many`)
        distinct = list({id(p): p for _, p in candidates}.values())
        todo = [p for p in distinct if (i, id(p)) not in shared]
        logits = dict(zip(map(id, todo), predict_many(algorithm, todo, x, batch_size)))
        logits.update({id(p): shared.pop((i, id(p))) for p in distinct if (i, id(p)) in shared})
        runs.append((i, candidates, [id(p) for p in distinct], torch.stack([logits[id(p)] for p in distinct]), select_on, len(select_on)))

    classes = next((r[3].shape[-1] for r in runs if r[3].dim() == 3), 0)  # a client without samples has no [C, 0, K]
    val = _score_runs([(st[:, :cut], sel.y) for *_, st, sel, cut in runs], classes, None)
    test = _score_runs([(st[:, cut:], data.clients[i].test.y) for i, _, _, st, _, cut in runs], classes, ece_bins)
    results = []
    for (i, candidates, ids, _, _, _), val_of, test_of in zip(runs, val, test):
        client = data.clients[i]
        seen = dict(zip(ids, zip(val_of, test_of)))
        val_scores = [seen[id(p)][0] for _, p in candidates]
        test_scores = [seen[id(p)][1] for _, p in candidates]
        chosen = _pick(val_scores)
        glob = None
        if on_global_test and len(data.global_test):
            glob = score(predict(algorithm, candidates[chosen][1], data.global_test.x, batch_size), data.global_test.y, ece_bins)
        results.append(ClientResult(client.client_id, client.opt_out, tuple(v for v, _ in candidates), tuple(val_scores),
                                    tuple(test_scores), chosen, _pick(test_scores), glob))
    return results


def _score_runs(runs: list[tuple[torch.Tensor, torch.Tensor]], classes: int, ece_bins: int | None) -> list[list[Scores]]:
    """For each (logits [C, n, K] of C models, labels [n]): the C models' Scores, all runs scored at once."""
    if not runs:
        return []
    rows = torch.cat([logits.reshape(-1, classes) for logits, _ in runs if logits.numel()] or [torch.empty(0, classes)])
    ys = torch.cat([y.repeat(len(logits)) for logits, y in runs])
    flat = iter(score_segments(rows, ys, [len(y) for logits, y in runs for _ in range(len(logits))], ece_bins))
    return [[next(flat) for _ in range(len(logits))] for logits, _ in runs]


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack(tensors), without a copy where it can: one tensor shared by every model (a layer that is
    w_g in each) is expanded, and tensors that are already the consecutive rows of one (SuPerFed's mixed
    candidates) are read in place."""
    first, n = tensors[0], len(tensors)
    if all(t is first for t in tensors):
        return first.expand(n, *first.shape)
    step = first.numel()
    if first.is_contiguous() and all(
        t.is_contiguous() and t.shape == first.shape and t.dtype == first.dtype and t.device == first.device
        and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() and t.storage_offset() == first.storage_offset() + j * step
        for j, t in enumerate(tensors)
    ):
        return first.as_strided((n, *first.shape), (step, *first.stride()), first.storage_offset())
    return torch.stack(tensors)


#: Samples of the clients that share one model run through it in one go (bounds the concatenated copy).
SHARED_EVAL_SAMPLES = 65_536
#: Bytes of candidate weights made for the evaluation (SuPerFed's mixed models) held at once.
EVAL_BLOCK_BYTES = 256 * 2**20

Block = list[tuple[int, list[tuple[float, Params]]]]  # (client index, its candidates)


def _blocks(algorithm: Algorithm, server: ServerState, client_states: dict[int, Params], data: FederatedData) -> Iterator[Block]:
    """The clients with their candidates, in blocks whose candidates made for the evaluation (not the server's
    own models, which any number of clients share) take at most EVAL_BLOCK_BYTES: SuPerFed's 11 mixed models
    of 1,000 clients would take gigabytes, and making them twice (once to find who shares what) took a
    fifth of its evaluation."""
    own = {id(t) for m in (server.global_params, algorithm.global_model(server)) if m is not None for t in m.values()}
    block: Block = []
    held = 0
    for i, client in enumerate(data.clients):
        candidates = algorithm.personalized_candidates(server, client_states.get(client.client_id), client.client_id)
        fresh = {id(t): t for _, p in candidates for t in p.values() if id(t) not in own}
        held += sum(t.numel() * t.element_size() for t in fresh.values())
        block.append((i, candidates))
        if held >= EVAL_BLOCK_BYTES:
            yield block
            block, held = [], 0
    if block:
        yield block


def _shared_logits(algorithm: Algorithm, server: ServerState, block: Block, data: FederatedData,
                   batch_size: int) -> dict[tuple[int, int], torch.Tensor]:
    """{(client index, id(model)): logits on the client's selection and test inputs} for the server's
    models that the block's clients take as a candidate as they are (FedAvg's global model for every client,
    SuPerFed's w_g for the clients without a local model), run over those clients' inputs
    concatenated: full evaluation batches instead of one small forward per client (10,000 clients'
    evaluation was most of a FedAvg run's wall time). Per-sample logits do not depend on the batch
    (eval mode), so scores agree with one forward per client within float tolerance."""
    models = {id(m): m for m in (server.global_params, algorithm.global_model(server)) if m is not None}
    users: dict[int, list[int]] = {pid: [] for pid in models}
    for i, candidates in block:
        for pid in {id(p) for _, p in candidates if id(p) in models and p is models[id(p)]}:
            users[pid].append(i)

    def inputs(i: int) -> list[torch.Tensor]:
        client = data.clients[i]
        return [client.val.x if len(client.val) else client.train.x, client.test.x]

    out: dict[tuple[int, int], torch.Tensor] = {}
    for pid, rows in users.items():
        start = 0
        while len(rows) > 1 and start < len(rows):
            part, n = [], 0
            while start < len(rows) and (not part or n + sum(len(t) for t in inputs(rows[start])) <= SHARED_EVAL_SAMPLES):
                part.append(rows[start])
                n += sum(len(t) for t in inputs(rows[start]))
                start += 1
            logits = predict(algorithm, models[pid], torch.cat([t for i in part for t in inputs(i)]), batch_size)
            for i, piece in zip(part, logits.split([sum(len(t) for t in inputs(i)) for i in part])):
                out[(i, pid)] = piece
    return out


def _with_choice(result: PersonalizedResult, pick: int, algorithm: Algorithm, server: ServerState, client_states: dict[int, Params],
                 data: FederatedData, batch_size: int, ece_bins: int, on_global_test: bool) -> PersonalizedResult:
    """`result` with every client on candidate `pick` (and, when asked, that model on the global test set)."""
    clients = []
    with eval_mode(algorithm.model):
        for c in result.clients:
            glob = None
            if on_global_test and len(data.global_test):
                params = algorithm.personalized_candidates(server, client_states.get(c.client_id), c.client_id)[pick][1]
                glob = score(predict(algorithm, params, data.global_test.x, batch_size), data.global_test.y, ece_bins)
            clients.append(replace(c, chosen=pick, on_global_test=glob))
    return PersonalizedResult(tuple(clients), result.candidate_label)


def evaluate_global(algorithm: Algorithm, server: ServerState, data: FederatedData, batch_size: int, ece_bins: int) -> Scores | None:
    params = algorithm.global_model(server)
    if params is None or len(data.global_test) == 0:
        return None
    return evaluate_model(algorithm, params, data.global_test, batch_size, ece_bins)
