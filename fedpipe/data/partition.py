"""Non-IID partitions of a dataset over federated clients, and the partition artifact (manifest).

A partition is made in three steps (`make_partition`):

1. The global test set: the dataset's official test split when it has one; otherwise a stratified
   hold-out of `global_test_fraction` of the training pool (per class, largest-remainder rounding).
2. The rest of the pool is divided over clients by one scheme (a partitioner function, see
   `PARTITIONERS`): `iid`, `pathological`, `classes_per_client`, `dirichlet`, `majority_class`,
   `random_class_shares`, `semantic_groups`, `with_replacement`.
3. Each client's samples are shuffled and split into train / validation / test
   (`val_fraction`, `test_fraction`, both rounded down, the training split keeps the rest), and
   `round(opt_out_fraction * K)` clients chosen at random are flagged opt-out.

All randomness comes from numpy Generators derived from the seed with `np.random.SeedSequence`, one
independent stream per purpose, so the same (data, config, seed) always gives the same partition.
Every index in a `Partition` is a row of `bundle.train`.

Partitioner functions share one signature,
``fn(labels, num_classes, rng, **scheme_params) -> list[np.ndarray]``: per-client arrays of
positions into `labels`, disjoint; samples that a scheme leaves unused belong to no client.

One scheme is the exception: `with_replacement` lets clients share samples (sampling with
replacement across clients, without replacement inside one client), so a small pool can stand in
for a population far larger than it (10,000 clients over mnist5k's 4,000 pool samples). Its configs
say so with `clients_share_samples`; the manifest then checks that each client's own indices are
distinct and that no client holds a global-test sample, instead of "every sample at most once".
It is a scheme of its own, not a flag on `iid`/`dirichlet`, so those configs, their fingerprints
and their partitions stay exactly what they were.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    TypeAdapter,
    model_validator,
)

from fedpipe.config import Section
from fedpipe.data import DatasetBundle
from fedpipe.errors import ConfigError, DataError

__all__ = [
    "MANIFEST_FORMAT",
    "MANIFEST_VERSION",
    "PARTITIONERS",
    "ClassesPerClientPartition",
    "ClientSplit",
    "DirichletPartition",
    "IidPartition",
    "MajorityClassPartition",
    "Partition",
    "PartitionConfig",
    "PathologicalPartition",
    "RandomClassSharesPartition",
    "SemanticGroupsPartition",
    "classes_per_client",
    "deal_label_clusters",
    "dirichlet",
    "iid",
    "majority_class",
    "make_partition",
    "parse_partition_config",
    "pathological_shards",
    "random_class_shares",
    "semantic_groups",
    "with_replacement",
    "WithReplacementPartition",
]

MANIFEST_FORMAT = "fedpipe.partition"
MANIFEST_VERSION = 1

#: How many fresh Dirichlet draws `dirichlet` tries before it repairs the last one.
DIRICHLET_MAX_DRAWS = 50


# ================================================================================================
# Configuration
# ================================================================================================


FeatureShift = Literal["rotate90", "rotate180", "rotate270", "flip", "invert"]


class _PartitionBase(Section):
    """Fields every partition scheme shares: the per-client splits, the global test hold-out, opt-out."""

    val_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    """Fraction of each client's samples used as its validation split, in [0, 1); rounded down."""

    test_fraction: float = Field(0.2, ge=0.0, lt=1.0)
    """Fraction of each client's samples used as its local test split, in [0, 1); rounded down
    (SuPerFed keeps a random 20% of each client's data for testing). val_fraction + test_fraction
    must stay below 1: the training split keeps the rest and is never empty."""

    global_test_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    """Only for datasets without an official test split: the fraction of the pool held out,
    stratified by class, as the global test set, in (0, 1). Ignored when the dataset has one."""

    opt_out_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    """Fraction q of clients flagged opt-out, in [0, 1): round(q * K) clients drawn at random never
    take part in federated aggregation (they keep all data private; mixture-of-experts method)."""

    feature_shift: tuple[FeatureShift, ...] = ()
    """Feature skew on top of the label split: round(feature_shift_fraction * K) clients drawn at
    random see every one of their images transformed, the j-th of them by feature_shift[j % len]
    (rotate90, rotate180, rotate270, flip, invert); e.g. [rotate90, invert] for FedMN's mixed label
    and feature skew. Empty: no feature skew. The global test set is never transformed."""

    feature_shift_fraction: float = Field(0.5, ge=0.0, le=1.0)
    """Fraction of clients whose images are transformed when feature_shift is set, in [0, 1]."""

    @model_validator(mode="after")
    def _fractions_leave_training_data(self) -> _PartitionBase:
        if self.val_fraction + self.test_fraction >= 1.0:
            raise ValueError(
                f"val_fraction ({self.val_fraction}) + test_fraction ({self.test_fraction}) must be "
                "below 1 so that every client keeps training samples; lower one of them."
            )
        return self

    clients_share_samples: ClassVar[bool] = False  # True: a sample may belong to several clients

    def partitioner_params(self) -> dict[str, Any]:
        """The keyword arguments of this scheme's partitioner function (its own fields)."""
        shared = set(_PartitionBase.model_fields) | {"scheme"}
        return {k: getattr(self, k) for k in type(self).model_fields if k not in shared}


class _FixedClientsBase(_PartitionBase):
    """Schemes that split the pool over a given number of clients."""

    num_clients: int = Field(100, ge=1)
    """Number of clients K, at least 1."""


class IidPartition(_FixedClientsBase):
    """Every client gets a uniformly random share of the pool (sizes differ by at most one)."""

    scheme: Literal["iid"] = "iid"
    """The partition scheme: `iid`."""

    num_clients: int = Field(100, ge=1)
    """Number of clients K, at least 1 and at most the pool size."""


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


class DirichletPartition(_FixedClientsBase):
    """Per class, client proportions drawn from Dir(alpha) (Hsu et al. 2019)."""

    scheme: Literal["dirichlet"] = "dirichlet"
    """The partition scheme: `dirichlet`."""

    alpha: float = Field(0.3, gt=0.0)
    """Dirichlet concentration, > 0: small values (0.05) give one or two classes per client,
    large ones (100) an almost IID split."""

    min_client_size: int = Field(10, ge=1)
    """Least number of samples per client (before the train/val/test split), at least 1;
    min_client_size * num_clients must not exceed the pool size."""


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


class SemanticGroupsPartition(_PartitionBase):
    """SuPerFed's "realistic" EMNIST/TinyImageNet split: label clusters cut into clients of random size."""

    scheme: Literal["semantic_groups"] = "semantic_groups"
    """The partition scheme: `semantic_groups`. The number of clients is an outcome of the sizes."""

    num_groups: int = Field(5, ge=1)
    """Number of disjoint label clusters, from 1 to the number of labels (SuPerFed: 5 for EMNIST,
    10 for TinyImageNet)."""

    label_families: tuple[tuple[Annotated[int, Field(ge=0)], ...], ...] | None = None
    """Optional disjoint groups of labels (e.g. EMNIST digits / lowercase / uppercase), each dealt
    evenly over the clusters; labels in no family are left unused. None: one family of all labels."""

    client_size_min: int = Field(100, ge=1)
    """Smallest client size (samples before the train/val/test split), at least 1 (SuPerFed: 100)."""

    client_size_max: int = Field(800, ge=1)
    """Largest client size, >= client_size_min (SuPerFed: 800 for EMNIST, 400 for TinyImageNet)."""

    @model_validator(mode="after")
    def _check_sizes_and_families(self) -> SemanticGroupsPartition:
        if self.client_size_min > self.client_size_max:
            raise ValueError(
                f"client_size_min ({self.client_size_min}) must not exceed client_size_max ({self.client_size_max})."
            )
        if self.label_families is not None:
            seen: set[int] = set()
            for family in self.label_families:
                if not family:
                    raise ValueError("label_families must not contain an empty family.")
                for label in family:
                    if label in seen:
                        raise ValueError(f"label_families lists label {label} twice; the families must be disjoint.")
                    seen.add(label)
        return self


class WithReplacementPartition(_FixedClientsBase):
    """Clients draw their samples independently, so one sample may belong to several clients
    (a large population over a small dataset, e.g. 10,000 clients over mnist5k)."""

    scheme: Literal["with_replacement"] = "with_replacement"
    """The partition scheme: `with_replacement`: sampling with replacement across clients, without
    replacement inside a client (a client's samples are distinct). No global-test sample is drawn."""

    clients_share_samples: ClassVar[bool] = True

    num_clients: int = Field(100, ge=1)
    """Number of clients K, at least 1; may exceed the pool size, since clients share samples."""

    samples_per_client: int = Field(20, ge=1)
    """Samples n every client draws (before its train/val/test split), at least 1 and at most the
    pool size. Every client has exactly n samples."""

    alpha: float | None = Field(None, gt=0.0)
    """None: each client draws uniformly from the whole pool (IID clients). A number > 0: label skew
    as in `dirichlet`: each client's class proportions are drawn from Dir(alpha) over the classes and
    its n samples apportioned to them (largest remainder; a class cannot give more than it holds,
    the rest goes to the other classes in proportion). Small alpha (0.1): one or two classes per client."""


PartitionConfig = Annotated[
    (
        IidPartition
        | PathologicalPartition
        | ClassesPerClientPartition
        | DirichletPartition
        | MajorityClassPartition
        | RandomClassSharesPartition
        | SemanticGroupsPartition
        | WithReplacementPartition
    ),
    Field(discriminator="scheme"),
]
"""The `partition` config section: one of the schemes, chosen by its `scheme` field."""

_CONFIG_ADAPTER: TypeAdapter[Any] = TypeAdapter(PartitionConfig)


def parse_partition_config(data: Any) -> Any:
    """Validate a mapping (e.g. ``{"scheme": "dirichlet", "num_clients": 20}``) into a PartitionConfig.

    Raises pydantic.ValidationError naming the offending field."""
    if isinstance(data, _PartitionBase):
        return data
    return _CONFIG_ADAPTER.validate_python(data)


# ================================================================================================
# Helpers
# ================================================================================================


def _round_half_up(x: float) -> int:
    """round() with halves going up (Python's round() goes to even), tolerant of float noise."""
    return int(math.floor(x + 0.5 + 1e-9))


def _floor(x: float) -> int:
    """floor() tolerant of float noise (0.29 * 100 is 28.999999999999996)."""
    return int(math.floor(x + 1e-9))


def _apportion(total: int, weights: np.ndarray) -> np.ndarray:
    """Non-negative integers summing to `total`, proportional to `weights` (largest remainder method,
    ties to the lower position). Each share is the floor or the ceiling of its exact value."""
    w = np.asarray(weights, dtype=np.float64)
    exact = total * w / w.sum()
    base = np.floor(exact).astype(np.int64)
    rest = int(total - base.sum())
    if rest > 0:
        order = np.argsort(-(exact - base), kind="stable")
        base[order[:rest]] += 1
    return base


def _even_split(total: int, parts: int, rng: np.random.Generator) -> np.ndarray:
    """`total` units over `parts` slots as evenly as possible; the extra units go to random slots."""
    out = np.full(parts, total // parts, dtype=np.int64)
    out[rng.choice(parts, total % parts, replace=False)] += 1
    return out


def _check_labels(labels: np.ndarray, num_classes: int) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise DataError(f"labels must be a 1-D array, got shape {labels.shape}.")
    if labels.size and not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"labels must be integers, got dtype {labels.dtype}.")
    if num_classes < 1:
        raise DataError(f"num_classes must be at least 1, got {num_classes}.")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise DataError(
            f"labels must lie in [0, {num_classes}); found values from {labels.min()} to {labels.max()}. "
            "The dataset's num_classes does not match its labels."
        )
    return labels.astype(np.int64, copy=False)


def _class_indices(labels: np.ndarray, num_classes: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Per class, the positions of its samples in random order."""
    return [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]


def _check_num_clients(num_clients: int, pool: int) -> None:
    if num_clients < 1:
        raise DataError(f"partition.num_clients must be at least 1, got {num_clients}.")
    if num_clients > pool:
        raise DataError(
            f"partition.num_clients={num_clients} is larger than the {pool} samples available to the "
            f"clients; use at most {pool} clients."
        )


def _balanced_class_sets(present: np.ndarray, num_clients: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """A (num_clients, k) array of distinct classes per client, spread evenly: each client takes the k
    classes with the fewest holders so far, ties broken at random. Holder counts of any two classes
    differ by at most one, and every client's set is random."""
    holders = np.zeros(present.size, dtype=np.int64)
    sets = np.empty((num_clients, k), dtype=np.int64)
    for i in range(num_clients):
        order = np.lexsort((rng.random(present.size), holders))[:k]
        holders[order] += 1
        sets[i] = present[order]
    return sets


# ================================================================================================
# Partitioners
# ================================================================================================


def iid(labels: np.ndarray, num_classes: int, rng: np.random.Generator, *, num_clients: int) -> list[np.ndarray]:
    """IID split: a random permutation of the pool cut into `num_clients` nearly equal parts.

    Follows the SuPerFed code's `iid` split (`np.array_split` of a permutation); client sizes
    differ by at most one sample; no sample is left out."""
    labels = _check_labels(labels, num_classes)
    _check_num_clients(num_clients, labels.size)
    return [np.sort(part) for part in np.array_split(rng.permutation(labels.size), num_clients)]


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
    taken = np.zeros(num_classes, dtype=np.int64)
    out = []
    for i in range(num_clients):
        parts = []
        for c in sets[i]:
            parts.append(by_class[c][taken[c] : taken[c] + per_class])
            taken[c] += per_class
        out.append(np.sort(np.concatenate(parts)))
    return out


def _dirichlet_counts(class_sizes: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """(C, K) sample counts: class c's samples cut at the cumulative Dir(alpha) proportions."""
    counts = np.zeros((class_sizes.size, num_clients), dtype=np.int64)
    for c, n_c in enumerate(class_sizes):
        if n_c == 0:
            continue
        props = rng.dirichlet(np.full(num_clients, alpha))
        if not np.all(np.isfinite(props)) or props.sum() <= 0:  # underflow at tiny alpha
            props = np.zeros(num_clients)
            props[rng.integers(num_clients)] = 1.0
        cuts = np.minimum(np.floor(np.cumsum(props) * n_c + 1e-9).astype(np.int64), n_c)
        cuts[-1] = n_c
        cuts = np.maximum.accumulate(cuts)
        counts[c] = np.diff(np.concatenate([[0], cuts]))
    return counts


def _repair_min_size(counts: np.ndarray, min_size: int) -> None:
    """Move samples, in place, from the largest clients to those under `min_size` until none is under.

    Deterministic: deficient clients in id order; the donor is the largest client (lowest id on
    ties), giving from its most frequent class, never going below `min_size` itself. Needs
    counts.sum() >= min_size * K, which guarantees a donor with surplus while any client is short."""
    sizes = counts.sum(axis=0)
    for k in np.flatnonzero(sizes < min_size):
        while sizes[k] < min_size:
            donor = int(np.argmax(sizes))
            c = int(np.argmax(counts[:, donor]))
            amount = int(min(min_size - sizes[k], sizes[donor] - min_size, counts[c, donor]))
            if amount <= 0:  # cannot happen when the feasibility check passed
                raise DataError("the Dirichlet repair found no donor; this is a bug in fedpipe.")
            counts[c, donor] -= amount
            counts[c, k] += amount
            sizes[donor] -= amount
            sizes[k] += amount


def dirichlet(
    labels: np.ndarray,
    num_classes: int,
    rng: np.random.Generator,
    *,
    num_clients: int,
    alpha: float = 0.3,
    min_client_size: int = 10,
) -> list[np.ndarray]:
    """Dirichlet label skew (Hsu et al. 2019; as used by FedMoE, pFedMB and the SuPerFed code).

    For every class, proportions over the K clients are drawn from Dir(alpha) and the class's
    shuffled samples are cut at the cumulative proportions (the FedKT/SuPerFed recipe, without its
    size-capping trick). PFLlib redraws until every client has `min_client_size` samples, which
    never ends for hundreds of clients; here at most DIRICHLET_MAX_DRAWS draws are tried, then
    the last draw is repaired deterministically (see `_repair_min_size`): samples move from the
    largest clients to the small ones. Every sample goes to some client. Infeasible settings
    (min_client_size * K > pool size) raise DataError."""
    labels = _check_labels(labels, num_classes)
    n = labels.size
    if alpha <= 0:
        raise DataError(f"partition.alpha must be above 0, got {alpha}.")
    if min_client_size < 1:
        raise DataError(f"partition.min_client_size must be at least 1, got {min_client_size}.")
    if num_clients < 1:
        raise DataError(f"partition.num_clients must be at least 1, got {num_clients}.")
    if min_client_size * num_clients > n:
        raise DataError(
            f"partition.min_client_size={min_client_size} with num_clients={num_clients} needs "
            f"{min_client_size * num_clients} samples but the pool has {n}; lower min_client_size to at "
            f"most {n // num_clients} or use fewer clients."
        )
    class_sizes = np.bincount(labels, minlength=num_classes)
    counts = _dirichlet_counts(class_sizes, num_clients, alpha, rng)
    draws = 1
    while counts.sum(axis=0).min() < min_client_size and draws < DIRICHLET_MAX_DRAWS:
        counts = _dirichlet_counts(class_sizes, num_clients, alpha, rng)
        draws += 1
    if counts.sum(axis=0).min() < min_client_size:
        _repair_min_size(counts, min_client_size)
    by_class = _class_indices(labels, num_classes, rng)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in range(num_classes):
        for k, chunk in enumerate(np.split(by_class[c], np.cumsum(counts[c])[:-1])):
            if chunk.size:
                parts[k].append(chunk)
    return [np.sort(np.concatenate(p)) if p else np.empty(0, dtype=np.int64) for p in parts]


def majority_class(
    labels: np.ndarray,
    num_classes: int,
    rng: np.random.Generator,
    *,
    num_clients: int,
    p: float = 0.8,
    samples_per_client: int = 100,
    majority_classes: int = 2,
) -> list[np.ndarray]:
    """Majority-class skew of the federated mixture of experts paper (Listo Zec et al., Sec. 4).

    "The dataset of each client contains two majority classes which together form a fraction p of
    the client data and the remaining classes form a fraction (1 - p)." With n samples per client,
    m = round(p * n) (halves up) samples come from the client's `majority_classes` classes, split
    between them as evenly as possible, and the n - m others are spread as evenly as possible over
    all other classes of the pool (extra units to random classes). So p = 2/C gives an IID split, as
    the paper says of p = 0.2 on 10 classes. The authors' code draws the minority part uniformly from
    the remaining pool instead, which is the same in expectation on balanced data. Majority classes
    are spread evenly over clients (fewest holders first, ties at random); the authors' code draws them
    independently at random. Samples are drawn without replacement; the rest of the pool is unused.
    Settings a class cannot supply raise DataError."""
    labels = _check_labels(labels, num_classes)
    n, k_clients, m_classes = samples_per_client, num_clients, majority_classes
    pool = labels.size
    if not 0.0 <= p <= 1.0:
        raise DataError(f"partition.p must lie in [0, 1], got {p}.")
    if n < 1 or k_clients < 1:
        raise DataError("partition.samples_per_client and partition.num_clients must be at least 1.")
    if n * k_clients > pool:
        raise DataError(
            f"partition.samples_per_client={n} with num_clients={k_clients} needs {n * k_clients} samples "
            f"but the pool has {pool}; lower samples_per_client to at most {pool // k_clients} or use fewer clients."
        )
    counts = np.bincount(labels, minlength=num_classes)
    present = np.flatnonzero(counts)
    if m_classes < 1 or m_classes > present.size:
        raise DataError(
            f"partition.majority_classes={m_classes} must lie between 1 and the {present.size} classes present "
            f"in the pool; set it to at most {present.size}."
        )
    m = _round_half_up(p * n)
    rest = n - m
    if rest > 0 and present.size == m_classes:
        raise DataError(
            f"partition.p={p} leaves {rest} samples per client for classes other than the majority ones, but "
            f"the pool has only {present.size} classes; set p to 1 or lower majority_classes."
        )
    sets = _balanced_class_sets(present, k_clients, m_classes, rng)
    demand = np.zeros((k_clients, num_classes), dtype=np.int64)
    for i in range(k_clients):
        demand[i, sets[i]] = _even_split(m, m_classes, rng)
        if rest > 0:
            others = np.setdiff1d(present, sets[i])
            demand[i, others] = _even_split(rest, others.size, rng)
    need = demand.sum(axis=0)
    short = np.flatnonzero(need > counts)
    if short.size:
        c = int(short[np.argmax(need[short] - counts[short])])
        raise DataError(
            f"partition.samples_per_client={n} with num_clients={k_clients} and p={p} needs {need[c]} samples "
            f"of class {c} but the pool has {counts[c]}; lower samples_per_client or num_clients."
        )
    by_class = _class_indices(labels, num_classes, rng)
    taken = np.zeros(num_classes, dtype=np.int64)
    out = []
    for i in range(k_clients):
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


def deal_label_clusters(
    num_classes: int,
    num_groups: int,
    label_families: tuple[tuple[int, ...], ...] | list[list[int]] | None,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Deal labels into `num_groups` disjoint clusters, family by family (SuPerFed appendix).

    Each family's labels are shuffled and dealt round-robin; the dealing goes on where the previous
    family stopped, so a cluster that got an extra label of one family does not also get one of the
    next. EMNIST (10 digits, 26 lower, 26 upper, 5 clusters): every cluster gets 2 digits and 5 or 6
    letters of each case. `semantic_groups` calls this first with its generator, so the clusters of a
    partition can be recomputed from the same generator state."""
    families = [list(range(num_classes))] if label_families is None else [list(f) for f in label_families]
    flat = [label for family in families for label in family]
    if any(label < 0 or label >= num_classes for label in flat):
        bad = next(label for label in flat if label < 0 or label >= num_classes)
        raise DataError(
            f"partition.label_families contains label {bad}, outside the dataset's labels 0..{num_classes - 1}."
        )
    if len(set(flat)) != len(flat):
        raise DataError("partition.label_families must be disjoint: a label appears in two families.")
    if num_groups < 1 or num_groups > len(flat):
        raise DataError(
            f"partition.num_groups={num_groups} must lie between 1 and the {len(flat)} labels to deal; "
            f"set it to at most {len(flat)}."
        )
    clusters: list[list[int]] = [[] for _ in range(num_groups)]
    position = 0
    for family in families:
        for label in rng.permutation(np.asarray(family, dtype=np.int64)):
            clusters[position % num_groups].append(int(label))
            position += 1
    return [np.sort(np.asarray(c, dtype=np.int64)) for c in clusters]


def _cut_sizes(total: int, low: int, high: int, rng: np.random.Generator) -> list[int]:
    """Cut `total` into sizes drawn uniformly from [low, high].

    A draw that would leave fewer than `low` samples is shortened so that exactly `low` remain
    (when that keeps it >= low); the last piece takes what is left once that is at most `high`.
    So only the last piece can be smaller than `low`, and only when no in-range cut exists: the
    total is below `low`, or high < 2 * low - 1 and the draws ended in between."""
    sizes = []
    remaining = total
    while remaining > 0:
        if remaining <= high:
            size = remaining
        else:
            size = int(rng.integers(low, high + 1))
            if remaining - size < low and remaining - low >= low:
                size = remaining - low
        sizes.append(size)
        remaining -= size
    return sizes


def semantic_groups(
    labels: np.ndarray,
    num_classes: int,
    rng: np.random.Generator,
    *,
    num_groups: int = 5,
    label_families: tuple[tuple[int, ...], ...] | None = None,
    client_size_min: int = 100,
    client_size_max: int = 800,
) -> list[np.ndarray]:
    """SuPerFed's "realistic" split of EMNIST and TinyImageNet (Hahn et al., appendix "Dataset Split
    Scenario").

    Labels are dealt into `num_groups` disjoint clusters (`deal_label_clusters`: each family, e.g.
    EMNIST digits / lowercase / uppercase, is shuffled and spread over all clusters). Each cluster's
    samples are shuffled and cut into clients with sizes drawn uniformly from
    [client_size_min, client_size_max] until the cluster is used up (`_cut_sizes`: only a cluster's
    last client may be smaller than client_size_min, when nothing else fits). The number of clients
    is an outcome; client ids are shuffled so they do not reveal the cluster. Samples of labels in
    no family are unused."""
    labels = _check_labels(labels, num_classes)
    if client_size_min < 1 or client_size_min > client_size_max:
        raise DataError(
            f"partition.client_size_min ({client_size_min}) must be at least 1 and at most "
            f"client_size_max ({client_size_max})."
        )
    clusters = deal_label_clusters(num_classes, num_groups, label_families, rng)
    clients: list[np.ndarray] = []
    for cluster in clusters:
        idx = rng.permutation(np.flatnonzero(np.isin(labels, cluster)))
        start = 0
        for size in _cut_sizes(idx.size, client_size_min, client_size_max, rng):
            clients.append(np.sort(idx[start : start + size]))
            start += size
    if not clients:
        raise DataError("partition scheme semantic_groups found no samples with the labels of label_families.")
    return [clients[i] for i in rng.permutation(len(clients))]


def _capped_apportion(total: int, weights: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """`_apportion` with an upper bound per slot: what a full slot cannot take goes to the slots with
    room, in proportion to their weights (to their room when all of those weights are zero).
    Needs total <= caps.sum()."""
    counts = np.minimum(_apportion(total, weights), caps)
    while (left := total - int(counts.sum())) > 0:
        room = caps - counts
        open_ = room > 0
        w = np.where(open_, weights, 0.0)
        if w.sum() <= 0:
            w = room.astype(np.float64)
        counts += np.minimum(_apportion(left, w), room)
    return counts


def with_replacement(
    labels: np.ndarray,
    num_classes: int,
    rng: np.random.Generator,
    *,
    num_clients: int,
    samples_per_client: int = 20,
    alpha: float | None = None,
) -> list[np.ndarray]:
    """Every client draws `samples_per_client` distinct samples of the pool on its own, so clients
    may share samples and K may exceed the pool (the usual way to simulate thousands of clients on a
    small dataset). alpha None: uniform draws (IID clients). alpha > 0: the client's class
    proportions ~ Dir(alpha) over the classes present, its n samples apportioned to them
    (`_capped_apportion`: never more of a class than the pool holds), then drawn within each class.
    Clients are drawn one after another from `rng`, so client i does not depend on K."""
    labels = _check_labels(labels, num_classes)
    n, pool = samples_per_client, labels.size
    if num_clients < 1:
        raise DataError(f"partition.num_clients must be at least 1, got {num_clients}.")
    if n < 1 or n > pool:
        raise DataError(
            f"partition.samples_per_client={n} must lie between 1 and the {pool} samples of the pool "
            f"(a client's samples are distinct); set it to at most {pool}."
        )
    if alpha is None:
        return [np.sort(rng.choice(pool, n, replace=False)) for _ in range(num_clients)]
    if alpha <= 0:
        raise DataError(f"partition.alpha must be above 0, got {alpha}.")
    sizes = np.bincount(labels, minlength=num_classes)
    present = np.flatnonzero(sizes)
    by_class = [np.flatnonzero(labels == c) for c in present]
    out = []
    for _ in range(num_clients):
        props = rng.dirichlet(np.full(present.size, alpha))
        if not np.all(np.isfinite(props)) or props.sum() <= 0:  # underflow at tiny alpha
            props = np.zeros(present.size)
            props[rng.integers(present.size)] = 1.0
        counts = _capped_apportion(n, props, sizes[present])
        parts = [rng.choice(rows, k, replace=False) for rows, k in zip(by_class, counts, strict=True) if k]
        out.append(np.sort(np.concatenate(parts)))
    return out


Partitioner = Callable[..., list[np.ndarray]]

#: Scheme name (the config's `scheme`) -> partitioner function.
PARTITIONERS: dict[str, Partitioner] = {
    "iid": iid,
    "pathological": pathological_shards,
    "classes_per_client": classes_per_client,
    "dirichlet": dirichlet,
    "majority_class": majority_class,
    "random_class_shares": random_class_shares,
    "semantic_groups": semantic_groups,
    "with_replacement": with_replacement,
}


# ================================================================================================
# The partition
# ================================================================================================


def _stream(seed: int, purpose: str) -> np.random.Generator:
    """An independent Generator for one purpose ("holdout", "scheme", "splits", "opt_out") under `seed`."""
    return np.random.default_rng(
        np.random.SeedSequence(entropy=int(seed), spawn_key=(zlib.crc32(b"partition"), zlib.crc32(purpose.encode())))
    )


def _stratified_holdout(labels: np.ndarray, fraction: float, num_classes: int, rng: np.random.Generator) -> np.ndarray:
    """round(fraction * N) positions, per class in proportion to its size (largest remainder), at random."""
    counts = np.bincount(labels, minlength=num_classes)
    total = _round_half_up(fraction * labels.size)
    if total < 1 or total >= labels.size:
        raise DataError(
            f"partition.global_test_fraction={fraction} of {labels.size} samples gives a global test set of "
            f"{total} samples; choose a fraction that leaves both a test set and a client pool."
        )
    quota = _apportion(total, counts.astype(np.float64))
    picks = [rng.permutation(np.flatnonzero(labels == c))[: quota[c]] for c in range(num_classes)]
    return np.sort(np.concatenate(picks)).astype(np.int64)


def _as_index_array(a: Any) -> np.ndarray:
    return np.asarray(a, dtype=np.int64).reshape(-1)


@dataclass(frozen=True, eq=False)
class ClientSplit:
    """One client's samples: sorted row indices into `bundle.train` for each split."""

    id: int
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    opt_out: bool
    label_counts: np.ndarray  # (num_classes,) samples per class over train + val + test
    transform: str | None = None  # the feature shift applied to all its images (None: none)

    @property
    def indices(self) -> np.ndarray:
        """All of the client's rows (train, then val, then test)."""
        return np.concatenate([self.train, self.val, self.test])

    @property
    def size(self) -> int:
        return int(self.train.size + self.val.size + self.test.size)


@dataclass(frozen=True, eq=False)
class Partition:
    """A dataset divided over clients. Equality compares the manifests."""

    dataset: str
    fingerprint: str
    seed: int
    config: Any  # a PartitionConfig member
    num_classes: int
    pool_size: int  # len(bundle.train); every index is below it
    clients: tuple[ClientSplit, ...]
    global_test_indices: np.ndarray | None  # rows of bundle.train; None: the official test split

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    @property
    def opt_out_ids(self) -> tuple[int, ...]:
        return tuple(c.id for c in self.clients if c.opt_out)

    def label_counts(self, labels: np.ndarray) -> np.ndarray:
        """(K, C) samples per client and class over train + val + test; `labels` is bundle.train.y."""
        labels = np.asarray(labels)
        out = np.zeros((self.num_clients, self.num_classes), dtype=np.int64)
        for i, client in enumerate(self.clients):
            out[i] = np.bincount(labels[client.indices], minlength=self.num_classes)[: self.num_classes]
        return out

    def check_matches(self, bundle: DatasetBundle) -> None:
        """Raise DataError unless this partition was made from `bundle`'s data."""
        if bundle.fingerprint != self.fingerprint:
            raise DataError(
                f"the partition was made from different data: it records dataset {self.dataset!r} with "
                f"fingerprint {self.fingerprint[:16]}..., but the loaded dataset {bundle.name!r} has fingerprint "
                f"{bundle.fingerprint[:16]}...; make the partition again from this dataset."
            )
        if len(bundle.train) != self.pool_size or bundle.num_classes != self.num_classes:
            raise DataError(
                f"the partition was made from different data: it expects {self.pool_size} training rows and "
                f"{self.num_classes} classes, the dataset has {len(bundle.train)} and {bundle.num_classes}."
            )
        if self.global_test_indices is None and bundle.test is None:
            raise DataError(
                f"the partition uses the official test split of {self.dataset!r}, but the loaded dataset has none."
            )
        if not np.array_equal(self.label_counts(bundle.train.y), np.stack([c.label_counts for c in self.clients])):
            raise DataError(
                "the partition was made from different data: its clients' label counts do not match the "
                "dataset's labels; make the partition again from this dataset."
            )

    # --- manifest ---------------------------------------------------------------------------------
    def to_manifest(self) -> dict[str, Any]:
        """A JSON-serialisable description of the partition (see `Partition.from_manifest`)."""
        if self.global_test_indices is None:
            global_test: dict[str, Any] = {"source": "official", "size": None, "indices": None}
        else:
            global_test = {
                "source": "holdout",
                "size": int(self.global_test_indices.size),
                "indices": self.global_test_indices.tolist(),
            }
        return {
            "format": MANIFEST_FORMAT,
            "format_version": MANIFEST_VERSION,
            "dataset": self.dataset,
            "fingerprint": self.fingerprint,
            "seed": int(self.seed),
            "num_classes": int(self.num_classes),
            "pool_size": int(self.pool_size),
            "scheme": self.config.model_dump(mode="json"),
            "num_clients": self.num_clients,
            "global_test": global_test,
            "clients": [
                {
                    "id": int(c.id),
                    "opt_out": bool(c.opt_out),
                    "transform": c.transform,
                    "sizes": {"train": int(c.train.size), "val": int(c.val.size), "test": int(c.test.size)},
                    "indices": {"train": c.train.tolist(), "val": c.val.tolist(), "test": c.test.tolist()},
                    "label_counts": c.label_counts.tolist(),
                }
                for c in self.clients
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_manifest(), separators=(",", ":"))

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any] | str | bytes) -> Partition:
        """Validate a manifest (a dict, or its JSON text) and rebuild the partition.

        Raises pydantic.ValidationError naming the field for missing, unknown or mistyped fields,
        negative or out-of-range indices, indices used twice, and sizes or counts that disagree."""
        if isinstance(manifest, (str, bytes)):
            model = _Manifest.model_validate_json(manifest)
        else:
            model = _Manifest.model_validate(manifest)
        clients = tuple(
            ClientSplit(
                id=c.id,
                train=_as_index_array(c.indices.train),
                val=_as_index_array(c.indices.val),
                test=_as_index_array(c.indices.test),
                opt_out=c.opt_out,
                label_counts=np.asarray(c.label_counts, dtype=np.int64),
                transform=c.transform,
            )
            for c in model.clients
        )
        gt = model.global_test
        return cls(
            dataset=model.dataset,
            fingerprint=model.fingerprint,
            seed=model.seed,
            config=model.scheme,
            num_classes=model.num_classes,
            pool_size=model.pool_size,
            clients=clients,
            global_test_indices=None if gt.indices is None else _as_index_array(gt.indices),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Partition):
            return NotImplemented
        return self.to_manifest() == other.to_manifest()

    __hash__ = None  # type: ignore[assignment]


# --- manifest validation -------------------------------------------------------------------------


class _ManifestPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class _SplitSizes(_ManifestPart):
    train: NonNegativeInt
    val: NonNegativeInt
    test: NonNegativeInt


class _SplitIndices(_ManifestPart):
    train: list[NonNegativeInt]
    val: list[NonNegativeInt]
    test: list[NonNegativeInt]


class _ClientManifest(_ManifestPart):
    id: NonNegativeInt
    opt_out: bool
    transform: FeatureShift | None = None
    sizes: _SplitSizes
    indices: _SplitIndices
    label_counts: list[NonNegativeInt]

    @model_validator(mode="after")
    def _sizes_agree(self) -> _ClientManifest:
        for split in ("train", "val", "test"):
            n_idx, n_size = len(getattr(self.indices, split)), getattr(self.sizes, split)
            if n_idx != n_size:
                raise ValueError(f"client {self.id}: sizes.{split} is {n_size} but indices.{split} has {n_idx} entries")
        if self.sizes.train < 1:
            raise ValueError(f"client {self.id}: indices.train is empty; every client needs a training sample")
        total = self.sizes.train + self.sizes.val + self.sizes.test
        if sum(self.label_counts) != total:
            raise ValueError(f"client {self.id}: label_counts sum to {sum(self.label_counts)}, not its {total} samples")
        return self


class _GlobalTestManifest(_ManifestPart):
    source: Literal["official", "holdout"]
    size: NonNegativeInt | None
    indices: list[NonNegativeInt] | None

    @model_validator(mode="after")
    def _consistent(self) -> _GlobalTestManifest:
        if self.source == "official":
            if self.indices is not None or self.size is not None:
                raise ValueError("global_test: an official test split has no indices and no size")
        else:
            if self.indices is None or self.size is None or not self.indices:
                raise ValueError("global_test: a holdout needs its non-empty indices and size")
            if len(self.indices) != self.size:
                raise ValueError(f"global_test: size is {self.size} but indices has {len(self.indices)} entries")
        return self


class _Manifest(_ManifestPart):
    format: Literal["fedpipe.partition"]
    format_version: Literal[1]
    dataset: str = Field(min_length=1)
    fingerprint: str = Field(min_length=1)
    seed: NonNegativeInt
    num_classes: int = Field(ge=1)
    pool_size: int = Field(ge=1)
    scheme: PartitionConfig  # a config section: validated by its own (lax) rules
    num_clients: int = Field(ge=1)
    global_test: _GlobalTestManifest
    clients: list[_ClientManifest] = Field(min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> _Manifest:
        k = len(self.clients)
        if self.num_clients != k:
            raise ValueError(f"num_clients is {self.num_clients} but clients has {k} entries")
        for position, client in enumerate(self.clients):
            if client.id != position:
                raise ValueError(f"clients[{position}].id is {client.id}; client ids must be 0..{k - 1} in order")
            if len(client.label_counts) != self.num_classes:
                raise ValueError(
                    f"clients[{position}].label_counts has {len(client.label_counts)} entries, "
                    f"not num_classes={self.num_classes}"
                )
        expected_k = getattr(self.scheme, "num_clients", None)
        if expected_k is not None and expected_k != k:
            raise ValueError(f"scheme.num_clients is {expected_k} but the manifest has {k} clients")
        opt_outs = sum(c.opt_out for c in self.clients)
        expected_opt = _round_half_up(self.scheme.opt_out_fraction * k)
        if opt_outs != expected_opt:
            raise ValueError(
                f"{opt_outs} clients are opt_out but scheme.opt_out_fraction={self.scheme.opt_out_fraction} "
                f"of {k} clients means {expected_opt}"
            )
        shifted = [c.transform for c in self.clients if c.transform is not None]
        expected_shifted = _round_half_up(self.scheme.feature_shift_fraction * k) if self.scheme.feature_shift else 0
        if len(shifted) != expected_shifted or not set(shifted) <= set(self.scheme.feature_shift):
            raise ValueError(
                f"{len(shifted)} clients have a transform ({sorted(set(shifted))}) but scheme.feature_shift="
                f"{list(self.scheme.feature_shift)} with fraction {self.scheme.feature_shift_fraction} means {expected_shifted}"
            )
        # every index in range, and used once across all clients, splits and the global test hold-out;
        # where clients share samples (with_replacement): once inside each client, and never in a
        # client and the global test set
        arrays, owners = [], []
        for client in self.clients:
            for split in ("train", "val", "test"):
                arrays.append(np.asarray(getattr(client.indices, split), dtype=np.int64))
                owners.append(f"clients[{client.id}].indices.{split}")
        if self.global_test.indices is not None:
            arrays.append(np.asarray(self.global_test.indices, dtype=np.int64))
            owners.append("global_test.indices")
        lengths = np.array([a.size for a in arrays])
        everything = np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)
        if everything.size and everything.max() >= self.pool_size:
            where = int(np.searchsorted(np.cumsum(lengths), int(np.argmax(everything)), side="right"))
            raise ValueError(
                f"{owners[where]}: index {everything.max()} is out of range (pool_size is {self.pool_size})"
            )
        if not self.scheme.clients_share_samples:
            _no_index_twice(arrays, owners)
            return self
        for i in range(len(self.clients)):
            _no_index_twice(arrays[3 * i : 3 * i + 3], owners[3 * i : 3 * i + 3])
        if self.global_test.indices is not None:
            held_out = np.isin(everything[: -arrays[-1].size or None], arrays[-1])
            if held_out.any():
                first = int(np.argmax(held_out))
                where = owners[int(np.searchsorted(np.cumsum(lengths), first, side="right"))]
                raise ValueError(f"index {everything[first]} is used more than once: in {where} and global_test.indices")
        return self


def _no_index_twice(arrays: list[np.ndarray], owners: list[str]) -> None:
    """Raise ValueError naming the first index that occurs twice in `arrays` and where it occurs."""
    lengths = np.array([a.size for a in arrays])
    everything = np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)
    values, counts = np.unique(everything, return_counts=True)
    if values.size != everything.size:
        dup = int(values[np.argmax(counts > 1)])
        places = np.flatnonzero(everything == dup)
        where = [owners[int(np.searchsorted(np.cumsum(lengths), p, side="right"))] for p in places]
        raise ValueError(f"index {dup} is used more than once: in {' and '.join(where)}")


# ================================================================================================
# make_partition
# ================================================================================================


def make_partition(bundle: DatasetBundle, cfg: Any, seed: int) -> Partition:
    """Divide `bundle` over clients according to `cfg` (a PartitionConfig or its mapping).

    Global test set: `bundle.test` when present (recorded as None), else a stratified hold-out of
    `cfg.global_test_fraction` of `bundle.train`. The rest of `bundle.train` is partitioned by the
    scheme. Each client's samples are shuffled and split: test = floor(test_fraction * n),
    val = floor(val_fraction * n), train = the rest (so train >= 1 for any non-empty client; an
    empty client raises DataError). round(opt_out_fraction * K) clients, halves up, drawn at random
    are opt-out; at least one client must stay in the federation. Every draw comes from a
    SeedSequence-derived stream of `seed` (one per purpose), so the result is a pure function of
    (bundle, cfg, seed)."""
    cfg = parse_partition_config(cfg)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"the partition seed must be a non-negative integer, got {seed!r}.")
    seed = int(seed)
    labels = _check_labels(bundle.train.y, bundle.num_classes)
    n = labels.size
    if n == 0:
        raise DataError(f"dataset {bundle.name!r} has no training samples to partition.")

    if bundle.test is None:
        holdout = _stratified_holdout(labels, cfg.global_test_fraction, bundle.num_classes, _stream(seed, "holdout"))
        mask = np.ones(n, dtype=bool)
        mask[holdout] = False
        pool = np.flatnonzero(mask)
    else:
        holdout = None
        pool = np.arange(n, dtype=np.int64)

    partitioner = PARTITIONERS[cfg.scheme]
    local = partitioner(labels[pool], bundle.num_classes, _stream(seed, "scheme"), **cfg.partitioner_params())
    k = len(local)
    if k == 0:
        raise DataError(f"partition scheme {cfg.scheme} produced no clients.")

    n_opt = _round_half_up(cfg.opt_out_fraction * k)
    if n_opt >= k:
        raise DataError(
            f"partition.opt_out_fraction={cfg.opt_out_fraction} of {k} clients makes all {n_opt} clients "
            "opt out, leaving none to train the federated model; lower opt_out_fraction."
        )
    opt_out = np.zeros(k, dtype=bool)
    opt_out[_stream(seed, "opt_out").choice(k, n_opt, replace=False)] = True
    transforms: list[str | None] = [None] * k
    if cfg.feature_shift:
        height, width = bundle.input_shape[1:]
        if height != width and {"rotate90", "rotate270"} & set(cfg.feature_shift):
            raise DataError(f"partition.feature_shift rotates by 90 degrees, which needs square images; {bundle.name} has {height}x{width}.")
        shifted = _stream(seed, "feature_shift").choice(k, _round_half_up(cfg.feature_shift_fraction * k), replace=False)
        for j, i in enumerate(sorted(shifted)):
            transforms[i] = cfg.feature_shift[j % len(cfg.feature_shift)]

    split_rng = _stream(seed, "splits")
    clients = []
    for i, positions in enumerate(local):
        rows = pool[np.asarray(positions, dtype=np.int64)]
        size = rows.size
        if size == 0:
            raise DataError(
                f"partition scheme {cfg.scheme} left client {i} without samples; every client needs at least "
                "one training sample. Use fewer clients or a less extreme setting."
            )
        rows = split_rng.permutation(rows)
        n_test = _floor(cfg.test_fraction * size)
        n_val = _floor(cfg.val_fraction * size)
        n_train = size - n_test - n_val
        if n_train < 1:  # cannot happen while val_fraction + test_fraction < 1; kept as a guard
            raise DataError(
                f"client {i} has {size} samples and would keep no training sample; lower val_fraction/test_fraction."
            )
        clients.append(
            ClientSplit(
                id=i,
                train=np.sort(rows[:n_train]),
                val=np.sort(rows[n_train : n_train + n_val]),
                test=np.sort(rows[n_train + n_val :]),
                opt_out=bool(opt_out[i]),
                label_counts=np.bincount(labels[rows], minlength=bundle.num_classes).astype(np.int64),
                transform=transforms[i],
            )
        )
    return Partition(
        dataset=bundle.name,
        fingerprint=bundle.fingerprint,
        seed=seed,
        config=cfg,
        num_classes=bundle.num_classes,
        pool_size=n,
        clients=tuple(clients),
        global_test_indices=holdout,
    )
