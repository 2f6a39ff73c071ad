"""Fault: an S3 server that accepts connections and then says nothing (issue 30, item 6). A task must fail within
about FEDPIPE_S3_RETRY_SECONDS, not after minutes of 120 s read timeouts per attempt (6 min 15 s before the fix)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from fedpipe.errors import StoreError
from fedpipe.store.s3 import S3Store


@pytest.fixture
def silent_server():
    """A TCP listener on loopback that accepts every connection and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held, stop = [], threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join(2)
    for conn in held:
        conn.close()
    listener.close()


def test_a_stalled_server_fails_within_the_retry_budget(silent_server):
    store = S3Store("stalled", endpoint=silent_server, access_key="k", secret_key="s", secure=False,
                    retry_seconds=6, create_bucket=False)
    start = time.monotonic()
    with pytest.raises(StoreError):
        store.exists("anything")
    took = time.monotonic() - start
    print(f"a silent S3 server failed the call in {took:.1f} s (retry budget 6 s)")
    assert took < 6 + 6 + 2, took  # the budget, one attempt's read timeout begun just before its end, and slack
