"""A TEST-ONLY audit of what the server holds, for the secure-aggregation test (tests/federation/test_secagg.py).

Off unless FEDPIPE_TEST_AUDIT is set in a process's environment (only that test sets it). Then:
- the ServerApp appends to `<out-dir>/audit.jsonl` a digest of every parameter set that reaches it: every array
  in every reply it receives (ArrayRecords and SecAgg+ masked vectors), every parameter set that reaches its
  aggregation hooks (the legacy strategy's `aggregate_fit`, fedpipe's `check_upload`, `Algorithm.aggregate` and
  `apply_average`), and keeps each round's aggregate (`audit/aggregate-R.safetensors`);
- each site appends the digest of its own plain upload to `<site-dir>/audit.jsonl` and keeps the upload in its own
  folder (`audit/upload-R.safetensors`), so that the test can compute the exact weighted average it compares with.

A digest is name- and order-free (a set of per-array digests, floats taken as float32): the legacy Parameters that
Flower's SecAgg+ workflow hands the strategy carry no names, and a float64 aggregate cast to float32 must match the
float32 tensors the server applies. No Flower import: the test in .venv reads the names from here.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

#: TEST-ONLY, off unless set (to anything but "" or "0") in the process's environment.
AUDIT_ENV = "FEDPIPE_TEST_AUDIT"
FILE = "audit.jsonl"


def enabled() -> bool:
    return os.environ.get(AUDIT_ENV, "").strip() not in ("", "0")


def _array(a) -> np.ndarray:
    if hasattr(a, "detach"):  # a torch tensor
        a = a.detach().cpu().numpy()
    a = np.asarray(a)
    return a.astype(np.float32) if a.dtype.kind == "f" else a


def digest(arrays: Iterable) -> str:
    """The digest of a parameter set (tensors or NumPy arrays, in any order, names ignored)."""
    parts = []
    for a in arrays:
        a = np.ascontiguousarray(_array(a))
        parts.append(hashlib.sha256(f"{a.dtype.str}{a.shape}".encode() + a.tobytes()).hexdigest())
    return hashlib.sha256("".join(sorted(parts)).encode()).hexdigest()[:24]


def record(folder: str | Path, round_: int, where: str, arrays: Iterable, **extra) -> None:
    """Append one audit line (a no-op unless the audit is on); empty parameter sets are skipped."""
    arrays = list(arrays)
    if not enabled() or not arrays:
        return
    line = {"round": round_, "where": where, "digest": digest(arrays), "arrays": len(arrays), "pid": os.getpid(),
            "time": time.time(), **extra}
    path = Path(folder) / FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def read(folder: str | Path) -> list[dict]:
    path = Path(folder) / FILE
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def keep(folder: str | Path, name: str, params: dict) -> None:
    """Save a parameter dict under `<folder>/audit/<name>.safetensors` (a no-op unless the audit is on)."""
    if not enabled():
        return
    import safetensors.torch

    path = Path(folder) / "audit" / f"{name}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file({k: v.detach().cpu().contiguous() for k, v in params.items()}, str(path))


class AuditedAlgorithm:
    """The server's algorithm with its aggregation hooks audited (test-only: serve wraps it when the audit is on):
    the digest of every upload `aggregate` receives and of every mean `apply_average` or `apply_mean` applies."""

    def __init__(self, algorithm, folder: str | Path):
        self._algorithm, self._folder = algorithm, folder

    def __getattr__(self, name):
        return getattr(self._algorithm, name)

    def aggregate(self, phase, server, uploads):
        for u in uploads:
            record(self._folder, None, "algorithm.aggregate", u.tensors.values(), client=u.client_id)
        return self._algorithm.aggregate(phase, server, uploads)

    def apply_average(self, server, averaged):
        record(self._folder, None, "algorithm.apply_average", averaged.values())
        return self._algorithm.apply_average(server, averaged)

    def apply_mean(self, server, mean):
        record(self._folder, None, "algorithm.apply_mean", mean.values())
        return self._algorithm.apply_mean(server, mean)
