"""Client data as device tensors, built once per phase: batches are slices, nothing is re-read."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedpipe.data import DatasetBundle, LabeledArrays
from fedpipe.data.partition import Partition
from fedpipe.errors import DataError


@dataclass(frozen=True)
class Split:
    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return int(self.y.shape[0])


@dataclass(frozen=True)
class ClientData:
    client_id: int
    train: Split
    val: Split
    test: Split
    opt_out: bool


@dataclass(frozen=True)
class FederatedData:
    clients: tuple[ClientData, ...]
    global_test: Split
    num_classes: int
    input_shape: tuple[int, ...]  # (C, H, W) for images, (T, V) for token sequences (fedpipe.data)

    @property
    def num_clients(self) -> int:
        return len(self.clients)


def channel_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std of uint8 images, on the 0..1 scale."""
    flat = x.transpose(1, 0, 2, 3).reshape(x.shape[1], -1).astype(np.float64) / 255.0
    return flat.mean(axis=1), np.maximum(flat.std(axis=1), 1e-6)


FEATURE_SHIFTS = {
    "rotate90": lambda x: np.rot90(x, 1, axes=(2, 3)),
    "rotate180": lambda x: np.rot90(x, 2, axes=(2, 3)),
    "rotate270": lambda x: np.rot90(x, 3, axes=(2, 3)),
    "flip": lambda x: x[..., ::-1],
    "invert": lambda x: 255 - x,
}


def prepare_data(bundle: DatasetBundle, partition: Partition, device: torch.device) -> FederatedData:
    """Apply each client's feature shift, standardise images with the training pixels' statistics of
    the clients that take part in federation (opt-out clients' data must not shape anything shared),
    and move everything to `device`. Token sequences (text) go to the device as int64 ids, untouched."""
    if bundle.is_text:
        return _prepare_text(bundle, partition, device)

    def raw(arrays: LabeledArrays, rows: np.ndarray | None, transform: str | None) -> tuple[np.ndarray, np.ndarray]:
        x, y = (arrays.x, arrays.y) if rows is None else (arrays.x[rows], arrays.y[rows])
        return (FEATURE_SHIFTS[transform](x) if transform else x), y

    splits = [{s: raw(bundle.train, getattr(c, s), c.transform) for s in ("train", "val", "test")} for c in partition.clients]
    opt_in = [s["train"][0] for s, c in zip(splits, partition.clients) if not c.opt_out] or [s["train"][0] for s in splits]
    mean, std = channel_stats(np.concatenate(opt_in))
    mean_t = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)

    def to_split(xy: tuple[np.ndarray, np.ndarray]) -> Split:
        x, y = xy
        xt = (torch.from_numpy(np.ascontiguousarray(x)).float().div_(255.0) - mean_t) / std_t
        return Split(xt.to(device), torch.from_numpy(np.ascontiguousarray(y)).long().to(device))

    clients = tuple(
        ClientData(c.id, to_split(s["train"]), to_split(s["val"]), to_split(s["test"]), c.opt_out)
        for c, s in zip(partition.clients, splits)
    )
    if partition.global_test_indices is None:
        assert bundle.test is not None, "an official-test partition needs the dataset's test split"
        global_test = to_split(raw(bundle.test, None, None))
    else:
        global_test = to_split(raw(bundle.train, partition.global_test_indices, None))
    return FederatedData(clients, global_test, bundle.num_classes, bundle.input_shape)


def _prepare_text(bundle: DatasetBundle, partition: Partition, device: torch.device) -> FederatedData:
    """Token ids as int64 tensors on `device`: no standardisation, and no feature shift (those are
    image transforms; a partition asking for one on text is refused)."""
    shifted = [c.id for c in partition.clients if c.transform]
    if shifted:
        raise DataError(
            f"partition.feature_shift transforms images, but {bundle.name} holds token sequences (clients "
            f"{shifted[:5]} have a shift); leave partition.feature_shift empty for text."
        )

    def to_split(arrays: LabeledArrays, rows: np.ndarray | None) -> Split:
        x, y = (arrays.x, arrays.y) if rows is None else (arrays.x[rows], arrays.y[rows])
        return Split(torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64)).to(device),
                     torch.from_numpy(np.ascontiguousarray(y)).long().to(device))

    clients = tuple(
        ClientData(c.id, to_split(bundle.train, c.train), to_split(bundle.train, c.val), to_split(bundle.train, c.test), c.opt_out)
        for c in partition.clients
    )
    if partition.global_test_indices is None:
        assert bundle.test is not None, "an official-test partition needs the dataset's test split"
        global_test = to_split(bundle.test, None)
    else:
        global_test = to_split(bundle.train, partition.global_test_indices)
    return FederatedData(clients, global_test, bundle.num_classes, bundle.input_shape)
