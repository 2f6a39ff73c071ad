"""A store whose writes happen on a background thread, in order: a round's checkpoint is written
while the next round trains (at 1,000 clients, writing a round's changed client states took a
sixth of a run's wall time).

`WriteBehind(store)` queues `put`, `put_many` and `later(task)` to one writer thread that runs them
in the order they were queued, so a checkpoint queued after its clients' objects lands after them:
a process killed in between leaves the previous checkpoint the newest, as with synchronous writes.
Until an object is written its bytes stay here, and `get`, `exists` and `size` see them; `list`,
`delete`, `create` and `replace_if` first wait for everything queued (`flush`), except on the writer
thread itself, where everything queued before the running task is already done.

The first failure stops the queue: the tasks behind it are dropped (a checkpoint is never written
without its objects), and every later call raises it, naming what failed, so the run stops at its
next checkpoint instead of training on without one. `max_pending_bytes` bounds the memory: a write
waits while that much is queued. With `background=False` every task runs at once on the caller's
thread (the same order and errors, no thread): on a 2-core CPU the writer's threads and the training
thread contend for the interpreter lock, and the rounds slowed by about what the checkpoints saved
(benchmarks/wall_time.py), so the run writes in the background only beside a GPU.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Mapping

from fedpipe.errors import StoreError
from fedpipe.store.base import Store, sha256_hex

#: Bytes queued at most before a write waits for the writer (a few rounds of changed client states).
MAX_PENDING_BYTES = 1 << 30


class WriteBehind(Store):
    """`inner` with its writes queued to one background thread (see the module's docstring)."""

    def __init__(self, inner: Store, max_pending_bytes: int = MAX_PENDING_BYTES, background: bool = True):
        self.inner, self.background = inner, background
        self.max_pending_bytes = max(1, int(max_pending_bytes))
        self._cond = threading.Condition()
        self._tasks: deque[tuple[Callable[[], None], int]] = deque()  # (task, bytes it holds)
        self._pending: dict[str, bytes] = {}  # key -> the newest bytes queued for it
        self._pending_bytes = 0
        self._writer: threading.Thread | None = None  # running while tasks are queued
        self._error: StoreError | None = None

    def __repr__(self) -> str:
        return f"WriteBehind({self.inner!r})"

    # --- the queue ----------------------------------------------------------------------------
    def later(self, task: Callable[[], None]) -> None:
        """Run `task` on the writer thread after everything queued so far."""
        self._submit(task, 0, {})

    def flush(self) -> None:
        """Wait until everything queued is written; raise the failure that stopped the queue, if any."""
        if threading.current_thread() is self._writer:
            return  # a task of the queue: everything before it is done
        with self._cond:
            self._cond.wait_for(lambda: self._writer is None)
            self._raise_failure()

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise StoreError(f"A background write to {self.inner.url()} failed, so the writes queued after it were "
                             f"dropped: {self._error}") from self._error

    def _submit(self, task: Callable[[], None], nbytes: int, objects: dict[str, bytes]) -> None:
        if not self.background:
            task()
            return
        with self._cond:
            self._raise_failure()
            # wait for room (one task bigger than the bound still goes, alone)
            self._cond.wait_for(lambda: self._error is not None or not self._tasks or self._pending_bytes + nbytes <= self.max_pending_bytes)
            self._raise_failure()
            self._pending.update(objects)
            self._pending_bytes += nbytes
            self._tasks.append((task, nbytes))
            if self._writer is None:
                self._writer = threading.Thread(target=self._drain, name="fedpipe-write-behind")
                self._writer.start()  # not a daemon: an exiting interpreter waits for the writes it was given

    def _drain(self) -> None:
        while True:
            with self._cond:
                if not self._tasks:
                    self._writer = None
                    self._cond.notify_all()
                    return
                task, nbytes = self._tasks[0]
            try:
                task()
            except Exception as e:  # noqa: BLE001 - kept and raised on the caller's thread
                error = e if isinstance(e, StoreError) else StoreError(f"{type(e).__name__}: {e}")
                with self._cond:
                    self._error = self._error or error
                    self._tasks.clear()
                    self._pending.clear()
                    self._pending_bytes = 0
                    self._cond.notify_all()
                continue
            with self._cond:
                self._tasks.popleft()
                self._pending_bytes -= nbytes
                self._cond.notify_all()

    def _write(self, items: dict[str, bytes]) -> None:
        """The writer's side of put/put_many: write, then forget the bytes still queued under these keys
        unless a later put replaced them."""
        if len(items) == 1:
            [(key, data)] = items.items()
            self.inner.put(key, data)
        else:
            self.inner.put_many(items)
        with self._cond:
            for key, data in items.items():
                if self._pending.get(key) is data:
                    del self._pending[key]

    # --- Store ----------------------------------------------------------------------------------
    def put(self, key: str, data: bytes) -> str:
        return self.put_many({key: data})[key]

    def put_many(self, items: Mapping[str, bytes]) -> Mapping[str, str]:
        for key, data in items.items():
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise StoreError(f"Can only store bytes under {key!r}, got {type(data).__name__}.")
        objects = {key: bytes(data) for key, data in items.items()}
        if objects:
            self._submit(lambda: self._write(objects), sum(len(d) for d in objects.values()), objects)
        return _Digests(objects)

    def get(self, key: str) -> bytes:
        with self._cond:
            data = self._pending.get(key)
        return data if data is not None else self.inner.get(key)

    def exists(self, key: str) -> bool:
        with self._cond:
            if key in self._pending:
                return True
        return self.inner.exists(key)

    def size(self, key: str) -> int | None:
        with self._cond:
            data = self._pending.get(key)
        return len(data) if data is not None else self.inner.size(key)

    def url(self, key: str = "") -> str:
        return self.inner.url(key)

    def list(self, prefix: str = "") -> list[str]:
        self.flush()
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.flush()
        self.inner.delete(key)

    def delete_folder(self, prefix: str) -> None:
        self.flush()
        self.inner.delete_folder(prefix)

    def create(self, key: str, data: bytes) -> bool:
        self.flush()
        return self.inner.create(key, data)

    def replace_if(self, key: str, data: bytes, expected_sha256: str) -> bool:
        self.flush()
        return self.inner.replace_if(key, data, expected_sha256)


class _Digests(Mapping[str, str]):
    """{key: sha256} of queued objects, each hashed when read: the caller's thread does not hash a round's
    client states (tens of megabytes) for digests nobody reads."""

    def __init__(self, objects: dict[str, bytes]):
        self._objects = objects

    def __getitem__(self, key: str) -> str:
        return sha256_hex(self._objects[key])

    def __iter__(self):
        return iter(self._objects)

    def __len__(self) -> int:
        return len(self._objects)
