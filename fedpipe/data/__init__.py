"""Datasets (one registry) and partitioners (one registry) for federated simulations.

The data contract, for every loader and every consumer:

- images: `x` is uint8 NCHW (0..255), and a dataset's input shape is (C, H, W);
- token sequences (text): `x` is int64 [N, T], token ids below the vocabulary size V, right-padded
  with PAD_ID = 0 (UNK_ID = 1 stands for words outside the vocabulary); a dataset's input shape is
  (T, V), the shape of the sequences' one-hot encoding, so a model builder learns both the length
  and the vocabulary from the shape alone. `is_text_shape` tells the two apart;
- tables (a user's numeric features, `data.dataset=files`): `x` is float32 [N, F], finite; a dataset's
  input shape is (F,). `is_table_shape` tells it apart;
- labels: int64 class indices, one per row of `x`.

A user's own federated data (`fedpipe.data.files`) also says which client each training row belongs to
(`DatasetBundle.clients`, the natural partition) and what was read (`DatasetBundle.snapshot`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PAD_ID = 0  # token id of padding (text)
UNK_ID = 1  # token id of a word outside the vocabulary (text)


def is_text_shape(shape: tuple[int, ...]) -> bool:
    """True for the input shape of token sequences, (T, V); images have (C, H, W)."""
    return len(shape) == 2


def is_table_shape(shape: tuple[int, ...]) -> bool:
    """True for the input shape of numeric features, (F,)."""
    return len(shape) == 1


@dataclass(frozen=True)
class LabeledArrays:
    """Inputs and integer labels (int64), row i of one is row i of the other. Inputs are images as
    uint8 NCHW (0..255), or token ids as int64 [N, T] (see the module docstring)."""

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
    vocab_size: int | None = None  # token sequences: V, every id is below it; None for images
    clients: np.ndarray | None = None  # int64 per row of `train`: its client (natural partition); None: no clients
    client_names: tuple[str, ...] = ()  # clients[i] names client_names[clients[i]] (a site, a device, a writer)
    snapshot: dict | None = None  # what was read (`fedpipe.data.files.snapshot`): source, digest, objects, bytes
    sample_ids: np.ndarray | None = None  # uint64 per row of `train`: its identity (`fedpipe.data.identity`); a
    # partition then draws each sample's split from it, so splits stay put across data drops. None: by position

    @property
    def is_text(self) -> bool:
        return self.vocab_size is not None

    @property
    def input_shape(self) -> tuple[int, ...]:
        """(C, H, W) for images; (T, V) for token sequences; (F,) for numeric features."""
        if self.is_text:
            return (int(self.train.x.shape[1]), int(self.vocab_size))
        return tuple(self.train.x.shape[1:])  # type: ignore[return-value]
