"""The partition (clients' splits) and its artifact, the manifest: writing it and validating it back."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from fedpipe.data import DatasetBundle
from fedpipe.data.partition._common import _round_half_up
from fedpipe.data.partition.feature_shift import FeatureShift
from fedpipe.data.partition.schemes import PartitionConfig
from fedpipe.errors import DataError

# A count, index or seed of a manifest: what numpy's int64 holds (a larger one written into a damaged or
# hostile manifest would raise OverflowError in the checks, not a validation error naming its field).
_Count = Annotated[int, Field(ge=0, lt=2**63)]

MANIFEST_FORMAT = "fedpipe.partition"
MANIFEST_VERSION = 1


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
    client_names: tuple[str, ...] = ()  # natural partition: client i is the data's client_names[i]; else ()

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
            **({"client_names": list(self.client_names)} if self.client_names else {}),
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
            client_names=tuple(model.client_names),
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
    train: _Count
    val: _Count
    test: _Count


class _SplitIndices(_ManifestPart):
    train: list[_Count]
    val: list[_Count]
    test: list[_Count]


class _ClientManifest(_ManifestPart):
    id: _Count
    opt_out: bool
    transform: FeatureShift | None = None
    sizes: _SplitSizes
    indices: _SplitIndices
    label_counts: list[_Count]

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
    size: _Count | None
    indices: list[_Count] | None

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
    seed: _Count
    num_classes: int = Field(ge=1)
    pool_size: int = Field(ge=1)
    scheme: PartitionConfig  # a config section: validated by its own (lax) rules
    num_clients: int = Field(ge=1)
    global_test: _GlobalTestManifest
    client_names: list[Annotated[str, Field(min_length=1, max_length=1024)]] = []  # natural partition only
    clients: list[_ClientManifest] = Field(min_length=1)

    @model_validator(mode="after")
    def _named_clients(self) -> _Manifest:
        if self.client_names and len(self.client_names) != len(self.clients):
            raise ValueError(f"client_names has {len(self.client_names)} entries but there are {len(self.clients)} clients")
        return self

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
