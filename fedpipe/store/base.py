"""The artifact store interface: one API for a local folder and for MinIO / S3.

Keys are relative, '/'-separated paths (``"run-1/state/federation/round-0003.pt"``); a key with
``..``, a leading ``/`` or a backslash is rejected. Every write is atomic (no reader ever sees a
half-written object) and records the sha256 of the bytes; every read checks it.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod


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

    def put_text(self, key: str, text: str) -> str:
        return self.put(key, text.encode("utf-8"))

    def get_text(self, key: str) -> str:
        return self.get(key).decode("utf-8")
