"""Datasets (one registry) and partitioners (one registry) for federated simulations."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LabeledArrays:
    """Images as uint8 NCHW (0..255) and integer labels (int64), row i of one is row i of the other."""

    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return int(self.y.shape[0])


@dataclass(frozen=True)
class DatasetBundle:
    """A loaded dataset: its training pool, its official test split (None when it has none)."""

    name: str
    train: LabeledArrays
    test: LabeledArrays | None
    num_classes: int
    class_names: tuple[str, ...]
    fingerprint: str  # sha256 of the arrays' bytes (train then test), fixes what a partition refers to

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return tuple(self.train.x.shape[1:])  # type: ignore[return-value]
