"""The artifact store interface: one API for a local folder and for MinIO / S3.

Keys are relative, '/'-separated paths (``"run-1/state/federation/round-0003.pt"``); a key with
``..``, a leading ``/`` or a backslash is rejected. Every write is atomic (no reader ever sees a
half-written object) and records the sha256 of the bytes; every read checks it.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import PurePosixPath, PureWindowsPath

from fedpipe.errors import StoreError

#: Writes `put_many` keeps in flight at once.
PUT_MANY_THREADS = 8


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Store(ABC):
    """Write-once-mostly blob store with integrity checks."""

    @abstractmethod
    def put(self, key: str, data: bytes) -> str:
        """Atomically write `data` under `key`; return its sha256 (hex)."""

    @abstractmethod
    def get(self, key: str) -> bytes:
        """Read `key`, verify its sha256; raise StoreError if missing, CorruptArtifactError if bad."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """True when a complete object is stored under `key`."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Keys under `prefix`, sorted."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove `key` (and its recorded hash); no error when absent."""

    @abstractmethod
    def size(self, key: str) -> int | None:
        """The object's size in bytes without reading it (None when absent), so that a reader with a size
        cap refuses an oversized object before fetching it."""

    @abstractmethod
    def url(self, key: str = "") -> str:
        """Where `key` lives, for messages: a local path or an s3:// URL."""

    def create(self, key: str, data: bytes) -> bool:
        """Write `data` under `key` only if no object is there, atomically with respect to every other
        writer (S3 ``If-None-Match: *``; a locked check in a folder); True when this call wrote it.
        A run's owner record and its run record are created this way, so two writers cannot both win.

        This fallback (check, then put) is NOT atomic: `LocalStore` and `S3Store` override it, and a
        store that wraps another (signing, caching) must forward to the inner store's."""
        if self.exists(key):
            return False
        self.put(key, data)
        return True

    def replace_if(self, key: str, data: bytes, expected_sha256: str) -> bool:
        """Replace the object under `key` with `data` only if `get(key)` would now return bytes with
        the sha256 `expected_sha256` (compare-and-swap; S3 ``If-Match: <etag>``); True when this call
        wrote it. The fallback here (read, compare, put) is NOT atomic; see `create`."""
        try:
            current = self.get(key)
        except StoreError:
            return False
        if sha256_hex(current) != expected_sha256:
            return False
        self.put(key, data)
        return True

    def put_many(self, items: Mapping[str, bytes]) -> Mapping[str, str]:
        """`put` each of `items` ({key: bytes}); returns {key: sha256}. The writes overlap (a round's
        changed client states: one request or fsync each, hundreds at 1,000 clients), so they cost
        about the slowest one rather than the sum; each object is still written atomically, and when
        one fails the error is raised after the others have finished (a checkpoint refers to none of
        them until this returns)."""
        keys = list(items)
        if len(keys) <= 1:
            return {k: self.put(k, items[k]) for k in keys}
        with ThreadPoolExecutor(max_workers=min(PUT_MANY_THREADS, len(keys)), thread_name_prefix="fedpipe-put") as pool:
            futures = [pool.submit(self.put, k, items[k]) for k in keys]
        return {k: f.result() for k, f in zip(keys, futures)}

    def delete_folder(self, prefix: str) -> None:
        """Remove every object under the folder `prefix` (ending in '/') and whatever writes that died there left
        behind that `list` does not show (a folder store's temp files); no error when there is nothing. Only for a
        folder no one writes into any more (a registration that died long ago)."""
        for key in self.list(prefix):
            self.delete(key)

    def put_text(self, key: str, text: str) -> str:
        return self.put(key, text.encode("utf-8"))

    def get_text(self, key: str) -> str:
        return self.get(key).decode("utf-8")


# Names that LocalStore keeps for itself next to the objects; no part of a key may use them.
SIDECAR_DIR = ".sha256"
TEMP_PREFIX = ".fedpipe-tmp-"


def validate_key(key: object, *, what: str = "key") -> str:
    """Return `key` when it is a safe relative '/'-separated path; raise StoreError saying why not."""
    if not isinstance(key, str):
        raise StoreError(f"Artifact {what} must be a string, got {type(key).__name__} ({key!r}).")
    if key == "":
        raise StoreError(f"Artifact {what} is empty: give a relative path such as 'run-1/report.json'.")
    if "\\" in key:
        raise StoreError(
            f"Artifact {what} {key!r} contains a backslash: use '/' to separate the parts of a key."
        )
    if any(ord(c) < 32 or ord(c) == 127 for c in key):
        raise StoreError(f"Artifact {what} {key!r} contains a control character; remove it.")
    if key.startswith("/") or PurePosixPath(key).is_absolute() or PureWindowsPath(key).is_absolute():
        raise StoreError(
            f"Artifact {what} {key!r} is an absolute path: keys are relative to the store "
            "(drop the leading '/')."
        )
    parts = key.split("/")
    if ".." in parts:
        raise StoreError(
            f"Artifact {what} {key!r} contains a '..' part, which would point outside the store; "
            "use a path inside it."
        )
    if any(p in ("", ".") for p in parts):
        raise StoreError(
            f"Artifact {what} {key!r} has an empty or '.' part (a doubled or trailing '/'); "
            "write it as 'a/b/c'."
        )
    if any(p == SIDECAR_DIR or p.startswith(TEMP_PREFIX) for p in parts):
        raise StoreError(
            f"Artifact {what} {key!r} uses a part named '{SIDECAR_DIR}' or starting with '{TEMP_PREFIX}'; "
            "those names are kept for the store's own hash and temporary files; pick another name."
        )
    return key


def validate_prefix(prefix: object) -> str:
    """A listing prefix: '' or a string prefix of keys (it may end with '/')."""
    if prefix == "":
        return ""
    if not isinstance(prefix, str):
        raise StoreError(f"Listing prefix must be a string, got {type(prefix).__name__}.")
    stripped = prefix.rstrip("/")
    if stripped == "":
        raise StoreError("Listing prefix '/' is an absolute path: use '' to list the whole store.")
    # A prefix may end in the middle of a name ('run-1/rou'), so only the complete parts are checked.
    if "\\" in prefix or prefix.startswith("/") or ".." in prefix.split("/"):
        raise StoreError(
            f"Listing prefix {prefix!r} is not a relative '/'-separated path inside the store "
            "(no leading '/', no '..', no backslashes)."
        )
    return prefix
