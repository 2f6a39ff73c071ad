"""Label-skew schemes that hand classes to clients: `pathological` shards, `classes_per_client`,
`majority_class` and `random_class_shares`."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from fedpipe.data.partition._common import (
    _apportion,
    _balanced_class_sets,
    _check_labels,
    _check_num_clients,
    _class_indices,
    _even_split,
    _round_half_up,
)
from fedpipe.data.partition.base import _FixedClientsBase
from fedpipe.errors import DataError


class PathologicalPartition(_FixedClientsBase):
    """McMahan et al.'s shards as in the SuPerFed code: sort by label, cut into S*K shards."""

    scheme: Literal["pathological"] = "pathological"
    """The partition scheme: `pathological`."""

    shards_per_client: int = Field(2, ge=1)
    """Shards S each client receives, at least 1; shards_per_client * num_clients must not exceed
    the pool size. With shards that do not straddle classes a client sees at most S classes."""


class ClassesPerClientPartition(_FixedClientsBase):
    """Each client holds exactly `classes_per_client` classes and the same number of samples."""

    scheme: Literal["classes_per_client"] = "classes_per_client"
    """The partition scheme: `classes_per_client`."""

    classes_per_client: int = Field(2, ge=1)
    """Distinct classes per client, from 1 to the number of classes in the pool (pFedMB: 2)."""


class MajorityClassPartition(_FixedClientsBase):
    """Each client's samples: `majority_classes` classes form fraction p, the other classes the rest."""

    scheme: Literal["majority_class"] = "majority_class"
    """The partition scheme: `majority_class`."""

    p: float = Field(0.8, ge=0.0, le=1.0)
    """Majority-class fraction p in [0, 1]: the majority classes together form round(p * n) of a
    client's n samples. p = 1 is the 2-class pathological split; p = 2/C (0.2 on 10 classes) is IID."""

    samples_per_client: int = Field(100, ge=1)
    """Samples per client n (before its train/val/test split), at least 1."""

    majority_classes: int = Field(2, ge=1)
    """Number of majority classes per client, at least 1 and at most the classes in the pool."""

    minority: Literal["even", "pool"] = "even"
    """How the (1 - p) part is drawn. even: spread as evenly as possible over the other classes (p = 2/C is then
    exactly IID). pool: drawn uniformly from what is left of the other classes in the pool, so each client's
    class counts there vary (hypergeometrically). The paper says only that the other classes form fraction
    1 - p (Listo Zec et al., Sec. 4); both readings agree in expectation on balanced data."""


class RandomClassSharesPartition(_FixedClientsBase):
    """pFedMB's CIFAR-100 split: random classes per client, class samples shared by random weights."""

    scheme: Literal["random_class_shares"] = "random_class_shares"
    """The partition scheme: `random_class_shares`."""

    classes_per_client: int = Field(20, ge=1)
    """Random distinct classes per client, from 1 to the number of classes in the pool (pFedMB: 20)."""

    share_low: float = Field(0.3, gt=0.0)
    """Lower end of the per-(client, class) weight u ~ U(share_low, share_high), > 0 (pFedMB: 0.3)."""

    share_high: float = Field(0.7, gt=0.0)
    """Upper end of the weight u ~ U(share_low, share_high), >= share_low (pFedMB: 0.7)."""

    @model_validator(mode="after")
    def _low_below_high(self) -> RandomClassSharesPartition:
        if self.share_low > self.share_high:
            raise ValueError(f"share_low ({self.share_low}) must not exceed share_high ({self.share_high}).")
        return self


def pathological_shards(
    labels: np.ndarray,
    num_classes: int,
    rng: np.random.Generator,
    *,
    num_clients: int,
    shards_per_client: int = 2,
) -> list[np.ndarray]:
    """Pathological non-IID split (McMahan et al. 2017) as in the SuPerFed code (superfed.md).

    The pool is sorted by label (random order within a label), cut into S*K equal shards of
    floor(N / (S*K)) samples, and client k gets shards k, k+K, k+2K, ... (the SuPerFed code's
    ``split_indices[idx % K]``). The N mod (S*K) samples after the last shard, all of the highest
    labels, are left unused. When the shard size divides every class size no shard straddles two
    classes, so a client sees at most S classes."""
    labels = _check_labels(labels, num_classes)
    n = labels.size
    k_clients, s = num_clients, shards_per_client
    if k_clients < 1 or s < 1:
        raise DataError("partition.num_clients and partition.shards_per_client must be at least 1.")
    if s * k_clients > n:
        raise DataError(
            f"partition.shards_per_client={s} with num_clients={k_clients} asks for {s * k_clients} shards "
            f"but the pool has only {n} samples (at most one shard per sample); lower num_clients or "
            "shards_per_client."
        )
    order = rng.permutation(n)
    order = order[np.argsort(labels[order], kind="stable")]
    shard = n // (s * k_clients)
    shards = order[: shard * s * k_clients].reshape(s * k_clients, shard)
    return [np.sort(shards[k::k_clients].ravel()) for k in range(k_clients)]


def classes_per_client(
    labels: np.ndarray,
    num_classes: int,
    rng: np.random.Generator,
    *,
    num_clients: int,
    classes_per_client: int = 2,
) -> list[np.ndarray]:
    """Each client gets `classes_per_client` distinct random classes and the same number of samples.

    pFedMB (Mori et al.) CIFAR-10 "each client is randomly assigned 2 classes with the same data
    size". The paper gives no procedure; this one: clients pick their classes one after another,
    each taking the k classes held by the fewest clients so far (ties at random), so classes are
    spread evenly (holder counts differ by at most one). Every client then takes s samples of
    each of its classes, s = min over held classes of floor(class size / holders), so every client
    has exactly k * s samples; what is left of each class is unused."""
    labels = _check_labels(labels, num_classes)
    k = classes_per_client
    counts = np.bincount(labels, minlength=num_classes)
    present = np.flatnonzero(counts)
    if k < 1 or k > present.size:
        raise DataError(
            f"partition.classes_per_client={k} must lie between 1 and the {present.size} classes present "
            f"in the pool; set it to at most {present.size}."
        )
    _check_num_clients(num_clients, labels.size)
    sets = _balanced_class_sets(present, num_clients, k, rng)
    holders = np.bincount(sets.ravel(), minlength=num_classes)
    held = np.flatnonzero(holders)
    per_class = int(np.min(counts[held] // holders[held]))
    if per_class == 0:
        worst = held[np.argmin(counts[held] // holders[held])]
        raise DataError(
            f"partition.classes_per_client={k} with num_clients={num_clients}: class {worst} has "
            f"{counts[worst]} samples for {holders[worst]} clients, fewer than one sample each; lower "
            "num_clients or classes_per_client."
        )
    by_class = _class_indices(labels, num_classes, rng)
    demand = np.zeros((num_clients, num_classes), dtype=np.int64)
    np.add.at(demand, (np.arange(num_clients)[:, None], sets), per_class)
    return _take_per_class(by_class, demand)


def majority_class(
    labels: np.ndarray,
    num_classes: int,
    rng: np.random.Generator,
    *,
    num_clients: int,
    p: float = 0.8,
    samples_per_client: int = 100,
    majority_classes: int = 2,
    minority: str = "even",
) -> list[np.ndarray]:
    """Majority-class skew of the federated mixture of experts paper (Listo Zec et al., Sec. 4).

    "The dataset of each client contains two majority classes which together form a fraction p of
    the client data and the remaining classes form a fraction (1 - p)." With n samples per client,
    m = round(p * n) (halves up) samples come from the client's `majority_classes` classes, split
    between them as evenly as possible, and the n - m others are spread as evenly as possible over
    all other classes of the pool (extra units to random classes). So p = 2/C gives an IID split, as
    the paper says of p = 0.2 on 10 classes. minority="pool" draws them uniformly from what is left of
    the other classes' samples instead (the same in expectation on balanced data). Majority classes
    are spread evenly over clients (fewest holders first, ties at random); the authors' code draws them
    independently at random. Samples are drawn without replacement; the rest of the pool is unused.
    Settings a class cannot supply raise DataError."""
    labels = _check_labels(labels, num_classes)
    n, k_clients, m_classes = samples_per_client, num_clients, majority_classes
    counts = np.bincount(labels, minlength=num_classes)
    present = np.flatnonzero(counts)
    _check_majority_settings(labels.size, present.size, p=p, n=n, k_clients=k_clients, m_classes=m_classes)
    m = _round_half_up(p * n)
    sets = _balanced_class_sets(present, k_clients, m_classes, rng)
    demand = np.zeros((k_clients, num_classes), dtype=np.int64)
    if minority not in ("even", "pool"):
        raise DataError(f"partition.minority must be 'even' or 'pool', got {minority!r}.")
    for i in range(k_clients):
        demand[i, sets[i]] = _even_split(m, m_classes, rng)
        if n - m > 0:
            others = np.setdiff1d(present, sets[i])
            if minority == "pool":  # a uniform draw without replacement from the others' unused samples
                left = np.maximum(counts[others] - demand[:i, others].sum(axis=0), 0)
                if left.sum() < n - m:
                    raise DataError(f"partition.minority=pool: client {i} needs {n - m} samples of classes other than its "
                                    f"majority ones but the pool has {left.sum()} left; lower samples_per_client or num_clients.")
                demand[i, others] = rng.multivariate_hypergeometric(left, n - m)
            else:
                demand[i, others] = _even_split(n - m, others.size, rng)
    need = demand.sum(axis=0)
    short = np.flatnonzero(need > counts)
    if short.size:
        c = int(short[np.argmax(need[short] - counts[short])])
        raise DataError(
            f"partition.samples_per_client={n} with num_clients={k_clients} and p={p} needs {need[c]} samples "
            f"of class {c} but the pool has {counts[c]}; lower samples_per_client or num_clients."
        )
    return _take_per_class(_class_indices(labels, num_classes, rng), demand)


def _check_majority_settings(pool: int, n_present: int, *, p: float, n: int, k_clients: int, m_classes: int) -> None:
    """Raise DataError for `majority_class` settings no pool of `pool` samples over `n_present` classes can meet."""
    if not 0.0 <= p <= 1.0:
        raise DataError(f"partition.p must lie in [0, 1], got {p}.")
    if n < 1 or k_clients < 1:
        raise DataError("partition.samples_per_client and partition.num_clients must be at least 1.")
    if n * k_clients > pool:
        raise DataError(
            f"partition.samples_per_client={n} with num_clients={k_clients} needs {n * k_clients} samples "
            f"but the pool has {pool}; lower samples_per_client to at most {pool // k_clients} or use fewer clients."
        )
    if m_classes < 1 or m_classes > n_present:
        raise DataError(
            f"partition.majority_classes={m_classes} must lie between 1 and the {n_present} classes present "
            f"in the pool; set it to at most {n_present}."
        )
    rest = n - _round_half_up(p * n)
    if rest > 0 and n_present == m_classes:
        raise DataError(
            f"partition.p={p} leaves {rest} samples per client for classes other than the majority ones, but "
            f"the pool has only {n_present} classes; set p to 1 or lower majority_classes."
        )


def _take_per_class(by_class: list[np.ndarray], demand: np.ndarray) -> list[np.ndarray]:
    """Client after client, demand[i, c] of the next unused positions of class c; sorted per client."""
    taken = np.zeros(demand.shape[1], dtype=np.int64)
    out = []
    for i in range(demand.shape[0]):
        parts = []
        for c in np.flatnonzero(demand[i]):
            parts.append(by_class[c][taken[c] : taken[c] + demand[i, c]])
            taken[c] += demand[i, c]
        out.append(np.sort(np.concatenate(parts)))
    return out


def random_class_shares(
    labels: np.ndarray,
    num_classes: int,
    rng: np.random.Generator,
    *,
    num_clients: int,
    classes_per_client: int = 20,
    share_low: float = 0.3,
    share_high: float = 0.7,
) -> list[np.ndarray]:
    """pFedMB's CIFAR-100 split (Mori et al., after FedAMP/Huang et al. 2021): classes and sizes vary.

    Each client draws `classes_per_client` distinct classes uniformly at random and, for each, a
    weight u ~ U(share_low, share_high). Class c's samples are divided among its holders in the
    proportions u_i,c / sum_j u_j,c (largest-remainder rounding, so the whole class is used).
    A class no client drew is left unused (pFedMB assigns classes at random, not evenly)."""
    labels = _check_labels(labels, num_classes)
    k = classes_per_client
    if not 0 < share_low <= share_high:
        raise DataError(f"partition.share_low ({share_low}) must be above 0 and at most share_high ({share_high}).")
    counts = np.bincount(labels, minlength=num_classes)
    present = np.flatnonzero(counts)
    if k < 1 or k > present.size:
        raise DataError(
            f"partition.classes_per_client={k} must lie between 1 and the {present.size} classes present "
            f"in the pool; set it to at most {present.size}."
        )
    _check_num_clients(num_clients, labels.size)
    weights = np.zeros((num_clients, num_classes))
    for i in range(num_clients):
        chosen = rng.choice(present, k, replace=False)
        weights[i, chosen] = rng.uniform(share_low, share_high, size=k)
    by_class = _class_indices(labels, num_classes, rng)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in present:
        holders = np.flatnonzero(weights[:, c])
        if holders.size == 0:
            continue
        shares = _apportion(int(counts[c]), weights[holders, c])
        for i, chunk in zip(holders, np.split(by_class[c], np.cumsum(shares)[:-1]), strict=True):
            if chunk.size:
                parts[i].append(chunk)
    return [np.sort(np.concatenate(p)) if p else np.empty(0, dtype=np.int64) for p in parts]
