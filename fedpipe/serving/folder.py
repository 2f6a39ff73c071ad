"""A model line version as KServe's storage initializer leaves it: the objects of `models/<name>/versions/<n>/`
downloaded into a folder (`/mnt/models`), read as the line's store.

KServe downloads an InferenceService's `storageUri` (`s3://bucket/prefix/models/NAME/versions/N/`, or the
`model-registry://NAME/N` the registry resolves to it) before the predictor starts. `VersionFolder` maps each
key of that version back to its file, so everything `fedpipe predict` checks is checked again here: signatures
(the MAC covers the store key, which the mapping restores), the sha256 of every file against the version's
record, and the size bounds. Read-only: a served version never writes.
"""

from __future__ import annotations

import os
from pathlib import Path

from fedpipe.errors import StoreError
from fedpipe.models.line import LineKeys
from fedpipe.store.base import Store, validate_key, validate_prefix


class VersionFolder(Store):
    """The files under `root` as the keys `models/<name>/versions/<version>/<file>` of a store."""

    def __init__(self, root: str | os.PathLike[str], name: str, version: int):
        self.root = Path(root).resolve()
        self.prefix = LineKeys(name).version(version)
        if not self.root.is_dir():
            raise StoreError(f"{self.root} is not a folder: it should hold the files of model line {name!r} version {version} "
                             "(what KServe's storage initializer downloads from the InferenceService's storageUri).")

    def _path(self, key: str) -> Path | None:
        key = validate_key(key)
        if not key.startswith(self.prefix):
            return None
        path = self.root.joinpath(*key[len(self.prefix):].split("/"))
        if path.is_symlink() or not path.resolve().is_relative_to(self.root):
            raise StoreError(f"{path} is a link or lies outside {self.root}: nothing is read through it.")
        return path

    def get(self, key: str) -> bytes:
        path = self._path(key)
        if path is None or not path.is_file():
            raise StoreError(f"No file for {key!r} in {self.root} (the downloaded version holds {self.prefix}* only).")
        return path.read_bytes()

    def exists(self, key: str) -> bool:
        path = self._path(key)
        return path is not None and path.is_file()

    def size(self, key: str) -> int | None:
        path = self._path(key)
        return path.stat().st_size if path is not None and path.is_file() else None

    def list(self, prefix: str = "") -> list[str]:
        prefix = validate_prefix(prefix)
        keys = [self.prefix + p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file() and not p.is_symlink()]
        return sorted(k for k in keys if k.startswith(prefix))

    def url(self, key: str = "") -> str:
        return str(self.root / key[len(self.prefix):]) if key.startswith(self.prefix) else f"{self.root} ({key or 'the version'})"

    def put(self, key: str, data: bytes) -> str:
        raise StoreError("A downloaded model line version is read-only.")

    def delete(self, key: str) -> None:
        raise StoreError("A downloaded model line version is read-only.")
