"""Schemes that draw each client's samples without regard to classes, or with replacement across
clients: `iid` and `with_replacement`."""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from fedpipe.data.partition._common import _capped_apportion, _check_labels, _check_num_clients
from fedpipe.data.partition.base import _FixedClientsBase
from fedpipe.errors import DataError


class IidPartition(_FixedClientsBase):
    """Every client gets a uniformly random share of the pool (sizes differ by at most one)."""

    scheme: Literal["iid"] = "iid"
    """The partition scheme: `iid`."""

    num_clients: int = Field(100, ge=1)
    """Number of clients K, at least 1 and at most the pool size."""


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


def iid(labels: np.ndarray, num_classes: int, rng: np.random.Generator, *, num_clients: int) -> list[np.ndarray]:
    """IID split: a random permutation of the pool cut into `num_clients` nearly equal parts.

    Follows the SuPerFed code's `iid` split (`np.array_split` of a permutation); client sizes
    differ by at most one sample; no sample is left out."""
    labels = _check_labels(labels, num_classes)
    _check_num_clients(num_clients, labels.size)
    return [np.sort(part) for part in np.array_split(rng.permutation(labels.size), num_clients)]


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
