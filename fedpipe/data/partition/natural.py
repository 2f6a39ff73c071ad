"""The `natural` scheme: the clients as a user's files give them (a site, a device, a writer).

In personalized FL on real data the partition is not made, it is found: each client's samples are the ones
its files name (`DatasetBundle.clients`, from `fedpipe.data.files`). This scheme keeps them, and only
splits each client's own samples into train / validation / test as every scheme does (stratified hold-out
of the global test set first, then per-client shuffled splits; `make_partition`).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from fedpipe.data.partition.base import _PartitionBase
from fedpipe.errors import DataError


class NaturalPartition(_PartitionBase):
    """Keep the clients of the data (data.dataset=files): client k holds exactly the rows its files name."""

    scheme: Literal["natural"] = "natural"
    """The partition scheme: `natural`, the clients as the files give them."""

    min_client_size: int = Field(10, ge=1)
    """A client with fewer samples than this (after the global test hold-out) is an error naming it:
    its train/validation/test splits would be too small to mean anything. Remove the client's files,
    merge it with another, or lower this bound."""


def natural_clients(clients: np.ndarray | None, names: tuple[str, ...], pool: np.ndarray, min_client_size: int) -> list[np.ndarray]:
    """Per client (in `names` order), the positions into `pool` of its rows; every client of the data,
    each with at least `min_client_size` rows. `clients[i]` is the client of row i of the training data."""
    if clients is None:
        raise DataError(
            "partition.scheme=natural keeps the clients the data names, but this dataset has no clients (a "
            "bundled dataset is one pool). Use data.dataset=files with your own data, or another scheme "
            "(iid, dirichlet, pathological, ...) to divide a pool."
        )
    owner = clients[pool]
    per_client = [np.flatnonzero(owner == k).astype(np.int64) for k in range(len(names))]
    small = [(names[k], rows.size) for k, rows in enumerate(per_client) if rows.size < min_client_size]
    if small:
        listed = ", ".join(f"{name!r} ({n})" for name, n in small[:20])
        raise DataError(
            f"{len(small)} client(s) have fewer than partition.min_client_size={min_client_size} samples after the "
            f"global test hold-out: {listed}{' ...' if len(small) > 20 else ''}. Remove or merge their files, or "
            "lower partition.min_client_size."
        )
    return per_client


def unseen_test_classes(client_splits, labels: np.ndarray, class_names: tuple[str, ...], names: tuple[str, ...]) -> list[str]:
    """One line per client whose test split holds a class its training split lacks (its personalized
    model never saw that class: a warning, since a site may really have such a class only rarely)."""
    lines = []
    for c in client_splits:
        unseen = sorted(set(labels[c.test].tolist()) - set(labels[c.train].tolist()))
        if unseen:
            name = names[c.id] if c.id < len(names) else str(c.id)
            lines.append(f"client {name!r}: class(es) {', '.join(class_names[k] for k in unseen[:10])} in its test split "
                         "but not in its training split")
    return lines
