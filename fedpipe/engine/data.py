"""Client data as device tensors, built once per phase: batches are slices, nothing is re-read."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedpipe.data import DatasetBundle, LabeledArrays
from fedpipe.data.partition import Partition


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
    input_shape: tuple[int, int, int]

    @property
    def num_clients(self) -> int:
        return len(self.clients)


def channel_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std of uint8 images, on the 0..1 scale."""
    flat = x.transpose(1, 0, 2, 3).reshape(x.shape[1], -1).astype(np.float64) / 255.0
    return flat.mean(axis=1), np.maximum(flat.std(axis=1), 1e-6)


def prepare_data(bundle: DatasetBundle, partition: Partition, device: torch.device) -> FederatedData:
    """Standardise images with the clients' training pixels' statistics and move everything to `device`."""
    train_rows = np.concatenate([c.train for c in partition.clients])
    mean, std = channel_stats(bundle.train.x[train_rows])
    mean_t = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)

    def to_split(arrays: LabeledArrays, rows: np.ndarray | None) -> Split:
        x, y = (arrays.x, arrays.y) if rows is None else (arrays.x[rows], arrays.y[rows])
        xt = (torch.from_numpy(np.ascontiguousarray(x)).float().div_(255.0) - mean_t) / std_t
        return Split(xt.to(device), torch.from_numpy(np.ascontiguousarray(y)).long().to(device))

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
