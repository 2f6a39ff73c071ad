"""Checkpoints written in the background (fedpipe.store.write_behind): in order, readable before they land,
bounded, and a failed write stops the phase at its next checkpoint with the previous one intact."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from fedpipe.algorithms.base import ServerState
from fedpipe.engine.state import Checkpoints, PhaseState
from fedpipe.errors import StoreError
from fedpipe.run.layout import RunLayout
from fedpipe.store.folder import LocalStore
from fedpipe.store.write_behind import WriteBehind


class Gated(LocalStore):
    """A folder store whose writes wait for `gate` and are recorded in order; `fail_on` keys fail."""

    def __init__(self, root, fail_on: tuple[str, ...] = ()):
        super().__init__(root)
        self.gate, self.order, self.fail_on = threading.Event(), [], fail_on
        self.gate.set()

    def put(self, key: str, data: bytes) -> str:
        assert self.gate.wait(10)
        if key.endswith(self.fail_on) and self.fail_on:
            raise StoreError(f"disk full writing {key}")
        self.order.append(key)
        return super().put(key, data)

    def put_many(self, items):
        assert self.gate.wait(10)
        self.order.extend(sorted(items))
        return super().put_many(items)


def test_writes_land_in_order_and_are_readable_before_they_do(tmp_path):
    inner = Gated(tmp_path)
    store = WriteBehind(inner)
    inner.gate.clear()  # the writer is stuck on the first write
    store.put_many({"a/1": b"one", "a/2": b"two"})
    store.put("a/ckpt", b"refers to 1 and 2")
    assert store.get("a/1") == b"one" and store.exists("a/ckpt") and store.size("a/2") == 3
    assert not inner.exists("a/ckpt")  # not written yet: reads were served from the queue
    inner.gate.set()
    assert store.list("a/") == ["a/1", "a/2", "a/ckpt"]  # a listing waits for the queue
    assert inner.order[-1] == "a/ckpt" and set(inner.order) == {"a/1", "a/2", "a/ckpt"}  # the checkpoint last
    assert inner.get("a/ckpt") == b"refers to 1 and 2"


def test_a_failed_write_drops_what_was_queued_behind_it_and_is_raised_to_the_caller(tmp_path):
    inner = Gated(tmp_path, fail_on=("a/2",))
    store = WriteBehind(inner)
    inner.gate.clear()
    store.put("a/1", b"one")
    store.put("a/2", b"two")
    store.put("a/ckpt", b"refers to 2")
    inner.gate.set()
    with pytest.raises(StoreError, match=r"background write .* failed.*disk full writing a/2"):
        store.flush()
    assert inner.exists("a/1") and not inner.exists("a/ckpt")  # never a checkpoint without its objects
    with pytest.raises(StoreError, match="disk full"):  # and every later call says so
        store.put("a/3", b"three")


def test_a_write_waits_while_the_queue_holds_max_pending_bytes(tmp_path):
    inner = Gated(tmp_path)
    store = WriteBehind(inner, max_pending_bytes=10)
    inner.gate.clear()
    store.put("a/1", b"x" * 8)
    done = threading.Event()
    threading.Thread(target=lambda: (store.put("a/2", b"y" * 8), done.set()), daemon=True).start()
    time.sleep(0.3)
    assert not done.is_set()  # 16 bytes would be queued: it waits for the writer
    inner.gate.set()
    assert done.wait(10)
    store.flush()
    assert inner.get("a/2") == b"y" * 8


def _state(round_: int) -> PhaseState:
    return PhaseState("fedavg", "p", round_, ServerState({"w": torch.full((2,), float(round_))}), {})


@pytest.mark.parametrize("background", [True, False])
def test_a_checkpoint_that_fails_stops_the_phase_at_the_latest_at_the_next_one(tmp_path, background):
    phase = RunLayout("run").phase("p")
    inner = Gated(tmp_path, fail_on=(phase.round(2),))
    ckpt = Checkpoints(inner, phase, background=background)
    ckpt.save_round(_state(1), keep=2)
    with pytest.raises(StoreError, match=r"disk full writing run/phases/p/round-0*2"):
        ckpt.save_round(_state(2), keep=2)  # in the background: queued, the failure not known yet
        assert background
        ckpt.save_round(_state(3), keep=2)
    back = Checkpoints(LocalStore(tmp_path), phase).latest_good("cpu")
    assert back.round == 1 and torch.equal(back.server.global_params["w"], torch.ones(2))


def test_put_returns_the_sha256_of_what_it_queued(tmp_path):
    import hashlib

    store = WriteBehind(LocalStore(tmp_path))
    assert store.put("a/1", b"one") == hashlib.sha256(b"one").hexdigest()
    assert dict(store.put_many({"a/2": b"two"})) == {"a/2": hashlib.sha256(b"two").hexdigest()}
    store.flush()
