"""The fields every partition scheme's config shares (splits, global test hold-out, opt-out, feature shift)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, model_validator

from fedpipe.config import Section
from fedpipe.data.partition.feature_shift import FeatureShift


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
