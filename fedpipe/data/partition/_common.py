"""Helpers the partition schemes share: rounding, apportioning, label checks, seeded streams."""

from __future__ import annotations

import math
import zlib

import numpy as np

from fedpipe.errors import DataError


def _stream(seed: int, purpose: str) -> np.random.Generator:
    """An independent Generator for one purpose ("holdout", "scheme", "splits", "opt_out") under `seed`."""
    return np.random.default_rng(
        np.random.SeedSequence(entropy=int(seed), spawn_key=(zlib.crc32(b"partition"), zlib.crc32(purpose.encode())))
    )


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
