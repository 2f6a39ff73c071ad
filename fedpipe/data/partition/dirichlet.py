"""Dirichlet label skew: per class, client proportions drawn from Dir(alpha)."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from fedpipe.data.partition._common import _check_labels, _class_indices
from fedpipe.data.partition.base import _FixedClientsBase
from fedpipe.errors import DataError

#: How many fresh Dirichlet draws `dirichlet` tries before it repairs the last one.
DIRICHLET_MAX_DRAWS = 50


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
