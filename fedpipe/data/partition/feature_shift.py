"""Feature shift on top of a label split: which clients see all of their images transformed, and how."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from fedpipe.data import DatasetBundle
from fedpipe.data.partition._common import _round_half_up
from fedpipe.errors import DataError

FeatureShift = Literal["rotate90", "rotate180", "rotate270", "flip", "invert"]


def feature_transforms(cfg: Any, bundle: DatasetBundle, k: int, rng: np.random.Generator) -> list[str | None]:
    """Per client (of `k`), the feature shift applied to all its images, None for none.

    round(cfg.feature_shift_fraction * k) clients drawn from `rng` are transformed, the j-th of them
    (in id order) by cfg.feature_shift[j % len]. Rotations by 90 degrees need square images."""
    transforms: list[str | None] = [None] * k
    if not cfg.feature_shift:
        return transforms
    height, width = bundle.input_shape[1:]
    if height != width and {"rotate90", "rotate270"} & set(cfg.feature_shift):
        raise DataError(f"partition.feature_shift rotates by 90 degrees, which needs square images; {bundle.name} has {height}x{width}.")
    shifted = rng.choice(k, _round_half_up(cfg.feature_shift_fraction * k), replace=False)
    for j, i in enumerate(sorted(shifted)):
        transforms[i] = cfg.feature_shift[j % len(cfg.feature_shift)]
    return transforms
