"""SuPerFed's "realistic" split: labels dealt into semantic clusters, each cut into clients of random size."""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from pydantic import Field, model_validator

from fedpipe.data.partition._common import _check_labels
from fedpipe.data.partition.base import _PartitionBase
from fedpipe.errors import DataError


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
