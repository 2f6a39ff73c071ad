"""Tensors over Flower's Message API, and the server's check of every upload before it is aggregated.

Flower 1.42's `ArrayRecord.from_torch_state_dict` (flwr/app/message/arrayrecord.py) serialises each
tensor as a NumPy array with its dtype and shape (flwr/app/message/array.py): float32 stays float32,
bit for bit, so the transport adds no rounding of its own.
"""

from __future__ import annotations

import numpy as np
import torch

Params = dict[str, torch.Tensor]

#: An upload larger than this many times the expected bytes is refused before it is even decoded further.
MAX_UPLOAD_FACTOR = 1.0
#: Seconds between the server's pulls for replies (Flower's own `Grid.send_and_receive` waits 3 s between them,
#: flwr/superlink/grid/http_grid.py): a pull is one small request to the SuperLink, on the SuperLink's own machine.
POLL = 0.05


class UploadRejected(ValueError):
    """A site's upload failed the server's check; the round goes on without it."""


def to_record(params: Params):
    from flwr.app import ArrayRecord

    return ArrayRecord.from_torch_state_dict({k: t.detach().cpu().contiguous() for k, t in params.items()})


def from_record(record, device: torch.device | str = "cpu") -> Params:
    return {k: torch.from_numpy(np.array(a.numpy(), copy=True)).to(device) for k, a in record.items()}


def record_bytes(record) -> int:
    return int(sum(len(a.data) for a in record.values()))


def check_upload(site: str, expected: Params, record) -> Params:
    """The upload as tensors, or UploadRejected naming what is wrong: names, shapes, dtypes, finite values,
    bytes. `expected` is what the method uploads for this client (FedAvg: the downloaded global model's layout)."""
    names, want = set(record.keys()), set(expected)
    if names != want:
        missing, extra = sorted(want - names), sorted(names - want)
        raise UploadRejected(f"upload from {site}: wrong tensor names (missing {missing[:3]}, unexpected {extra[:3]})")
    budget = sum(t.numel() * t.element_size() for t in expected.values()) * MAX_UPLOAD_FACTOR
    size = record_bytes(record)
    if size > budget + 1024 * len(expected):  # the per-array header NumPy writes
        raise UploadRejected(f"upload from {site}: {size} bytes, more than the {int(budget)} the method's upload takes")
    got = from_record(record, next(iter(expected.values())).device) if expected else {}
    for k, t in expected.items():
        u = got[k]
        if tuple(u.shape) != tuple(t.shape):
            raise UploadRejected(f"upload from {site}: {k} has shape {tuple(u.shape)}, expected {tuple(t.shape)}")
        if u.dtype != t.dtype:
            raise UploadRejected(f"upload from {site}: {k} has dtype {u.dtype}, expected {t.dtype}")
        if u.is_floating_point() and not torch.isfinite(u).all():
            raise UploadRejected(f"upload from {site}: {k} holds non-finite values")
    return got
