"""A store in a local folder: each object is a plain file at ``root/key``.

Users can open what fedpipe writes (report PNGs, JSON) straight from the folder. Each object's
sha256 lies in the hidden folder beside it, ``<dir>/.sha256/<name>``, in ``sha256sum`` format
(``cd <dir> && sha256sum -c .sha256/<name>`` checks it by hand), out of the way of people browsing.

Write protocol (`put`), so that a visible object always has its hash and is never half-written:

1. the sidecar is written to a temp file in the sidecar folder, fsynced and renamed to
   ``<dir>/.sha256/<name>``; when an object is being replaced, the sidecar lists the new hash and
   then the old one, so a process killed before step 2 leaves the old object still checking;
2. the data is written to a temp file in the same folder, fsynced and renamed to ``<key>``;
3. a replaced object's sidecar is rewritten with the new hash alone, and the folder is fsynced.

A read accepts the bytes when their sha256 is one the sidecar lists (two only in that window).

Writers of one key take turns: `put`, `create`, `replace_if` and `delete` hold an exclusive
``flock`` on the lock file of the key's folder (``<dir>/.sha256/.fedpipe-tmp-lock``; one per
folder, so the store stays one object file and one hash file per key, plus this) for the three steps, and `get` a shared one, so two processes writing one key can no longer leave one's bytes
beside the other's hash (they did: 10 of 40 trials), and a reader never pairs old bytes with a newer
sidecar. (No ``fcntl`` on Windows: there the steps are unlocked, as before.)

Every path is confined to the root: a key whose resolved path (symlinks followed) leaves the root
is refused with a StoreError naming it, on read, write, list and delete.

If step 2 fails the previous sidecar is put back (or removed when there was no object), and
temp files are removed. Temp files are named ``.fedpipe-tmp-*``; `list` hides them and sidecars.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections import defaultdict
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

from fedpipe.errors import CorruptArtifactError, StoreError
from fedpipe.store.base import PUT_MANY_THREADS, SIDECAR_DIR, TEMP_PREFIX, Store, sha256_hex, validate_key, validate_prefix

__all__ = ["LocalStore"]


def _fsync_dir(path: Path) -> None:
    if os.name != "posix":
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_temp(directory: Path, data: bytes) -> Path:
    """Write `data` to a new temp file in `directory`, fsynced; return its path."""
    tmp = directory / f"{TEMP_PREFIX}{secrets.token_hex(8)}"
    # 0o666 masked by the umask, like any file the user creates (mkstemp would force 0o600).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return tmp


#: A sidecar lists one hash (two while an object is replaced): "<64 hex>  <name>\n", a name being at
#: most 255 bytes. Anything longer is not a sidecar fedpipe wrote, and is not read past this.
MAX_SIDECAR_BYTES = 4096


def _read_sidecar(sidecar: Path) -> bytes:
    with sidecar.open("rb") as f:
        data = f.read(MAX_SIDECAR_BYTES + 1)
    if len(data) > MAX_SIDECAR_BYTES:
        raise CorruptArtifactError(
            f"The hash file {sidecar} is longer than the {MAX_SIDECAR_BYTES} bytes a fedpipe hash file can be: it was "
            "replaced by something else. Delete the object and re-run the step that produces it."
        )
    return data


def _hashes(sidecar: bytes) -> list[str]:
    """The hashes a sidecar lists, first one first (the newest write)."""
    text = sidecar.decode("ascii", errors="replace")
    return [line.split()[0].lower() for line in text.splitlines() if line.split()]


def _replace_file(target: Path, data: bytes) -> None:
    """Atomically replace `target` with `data` (a fsynced temp file renamed over it)."""
    tmp = _write_temp(target.parent, data)
    try:
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _restore_sidecar(sidecar: Path, old: bytes | None, *, had_object: bool) -> None:
    """After a failed data write: put the previous hash back so the old object still checks."""
    with contextlib.suppress(OSError):
        if old is not None and had_object:
            _replace_file(sidecar, old)
        elif not had_object:
            sidecar.unlink(missing_ok=True)


def _check_sidecar(path: Path, sidecar: Path, data: bytes) -> None:
    """Raise CorruptArtifactError unless `data` (read from `path`) has a sha256 its sidecar lists."""
    try:
        recorded = _hashes(_read_sidecar(sidecar))
    except FileNotFoundError:
        raise CorruptArtifactError(
            f"The artifact {path} has no recorded sha256 ({sidecar} is missing), so its "
            "integrity cannot be checked: it was not written by fedpipe or its hash file was "
            "deleted. Re-run the step that produces it."
        ) from None
    except OSError as exc:
        raise StoreError(f"Could not read the hash file {sidecar}: {exc.strerror or exc}.") from exc
    expected = recorded[0] if recorded else ""
    actual = sha256_hex(data)
    if actual not in recorded:
        raise CorruptArtifactError(
            f"The artifact {path} is corrupt: its sha256 is {actual} ({len(data)} bytes) but "
            f"{expected or 'nothing readable'} was recorded in {sidecar} when it was "
            "written, so the file was changed or truncated after it was written. Delete it and "
            "re-run the step that produces it, or restore it from a copy."
        )


#: The lock file of a folder's objects, in its sidecar folder (a name no key part may take).
LOCK_NAME = f"{TEMP_PREFIX}lock"


@contextlib.contextmanager
def _locked(path: Path, *, shared: bool = False) -> Iterator[None]:
    """Hold the lock of the object at `path` (exclusive for writers, shared for readers). A reader
    in a folder that has no sidecar folder (nothing written there) or may not create the lock file
    reads unlocked: there is no writer it could race with that it could wait for."""
    if fcntl is None:
        yield
        return
    lock = path.parent / SIDECAR_DIR / LOCK_NAME
    try:
        if not shared:
            lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        if not shared:
            raise
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _write_object(path: Path, sidecar: Path, data: bytes, digest: str) -> None:
    """The three steps of the write protocol (the module's docstring); the caller holds the lock."""
    sidecar.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        raise StoreError(f"Cannot write {path}: a folder of that name is in the way.")
    old_sidecar = sidecar.read_bytes() if sidecar.is_file() else None
    entry = f"{digest}  {path.name}\n"
    # keep the current object's hash listed until the new bytes are in place: a process killed
    # between the two renames must not leave an intact old object looking corrupt
    old_digests = _hashes(old_sidecar) if old_sidecar is not None and path.is_file() else []
    pending = entry + "".join(f"{h}  {path.name}\n" for h in dict.fromkeys(old_digests) if h != digest)
    _replace_file(sidecar, pending.encode())
    data_tmp = None
    try:
        data_tmp = _write_temp(path.parent, data)
        os.replace(data_tmp, path)
    except BaseException:
        if data_tmp is not None:
            with contextlib.suppress(OSError):
                data_tmp.unlink()
        _restore_sidecar(sidecar, old_sidecar, had_object=path.is_file())
        raise
    if pending != entry:
        _replace_file(sidecar, entry.encode())
    _fsync_dir(path.parent)


def _put_folder(entries: list[tuple[Path, bytes]], sidecar_of) -> dict[Path, str]:
    """`LocalStore.put_many` for objects of one folder; the caller holds the folder's lock. Returns
    {path: sha256}. New objects' sidecar and data temp files are written (and fsynced) side by side by
    a few threads, each hashing its object once (hashlib lets go of the interpreter lock), the sidecars
    renamed into place before the data, and the folder fsynced once, not once per object (a round's
    client states: 3 serial fsyncs each before). Objects being replaced take `put`'s path."""
    digests: dict[Path, str] = {}
    fresh = [(path, data) for path, data in entries if not path.exists()]
    for path, data in entries:
        if path.exists():
            digests[path] = sha256_hex(data)
            _write_object(path, sidecar_of(path), data, digests[path])
    if not fresh:
        return digests
    folder = fresh[0][0].parent
    (folder / SIDECAR_DIR).mkdir(parents=True, exist_ok=True)

    def temps(entry: tuple[Path, bytes]) -> tuple[Path, Path, str]:
        path, data = entry
        digest = sha256_hex(data)
        return _write_temp(folder / SIDECAR_DIR, f"{digest}  {path.name}\n".encode()), _write_temp(folder, data), digest

    with ThreadPoolExecutor(max_workers=min(PUT_MANY_THREADS, len(fresh)), thread_name_prefix="fedpipe-put") as pool:
        futures = [pool.submit(temps, e) for e in fresh]
    written = [f.result() for f in futures if f.exception() is None]
    try:
        if len(written) < len(futures):
            raise next(f.exception() for f in futures if f.exception() is not None)
        for (path, _), (sidecar_tmp, _, _) in zip(fresh, written):
            os.replace(sidecar_tmp, sidecar_of(path))
        _fsync_dir(folder / SIDECAR_DIR)
        for (path, _), (_, data_tmp, digest) in zip(fresh, written):
            os.replace(data_tmp, path)
            digests[path] = digest
    except BaseException:
        for path, _ in fresh:  # a sidecar without its object is removed; the object rename is the commit
            if not path.exists():
                _restore_sidecar(sidecar_of(path), None, had_object=False)
        for pair in written:
            for tmp in pair[:2]:
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(folder)
    return digests


def _confine(root: Path, path: Path, key: str) -> None:
    """Refuse `path` when, symlinks followed, it leads out of the root (a link to /etc, to $HOME)."""
    try:
        inside = path.resolve().is_relative_to(root)
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise StoreError(f"The artifact key {key!r} cannot be resolved under {root}: {exc}.") from None
    if not inside:
        raise StoreError(
            f"The artifact key {key!r} leads out of the store folder {root} (to {path.resolve()}) "
            "through a symbolic link; fedpipe reads and writes only inside its store. Remove the link."
        )


def _paths(root: Path, keys) -> dict[str, Path]:
    """The paths of `keys` under `root`, each and its sidecar confined to the root (`_confine`) with each
    folder resolved once: a path that is not itself a link resolves to its resolved folder plus its name,
    so it is inside the root when that folder is (a round's 100 client states cost 200 resolutions of a
    dozen system calls each otherwise)."""
    inside: dict[Path, bool] = {}
    paths = {}
    for key in keys:
        path = root.joinpath(*validate_key(key).split("/"))
        for p in (path, LocalStore._sidecar(path)):
            if p.parent not in inside:
                with contextlib.suppress(OSError, RuntimeError):  # a loop: the full check below says so
                    inside[p.parent] = p.parent.resolve().is_relative_to(root)
            if not inside.get(p.parent) or os.path.islink(p):
                _confine(root, p, key)
        paths[key] = path
    return paths


_ANY = "any"  # `_put_when`: write whatever is stored now


def _keys_under(root: Path, start: Path, prefix: str) -> list[str]:
    """`LocalStore.list`: the keys with `prefix` in the folder `start` (inside `root`) and below, sorted.

    os.walk does not follow links to folders, so every folder it enters is a real one inside the root and
    only a file that is itself a link needs resolving (each `_confine` is a dozen system calls: 1,000
    clients' states listed every round added up). Folders that cannot hold a key with the prefix (a
    phase's clients/ when listing its round checkpoints) are not entered."""
    keys = []
    for dirpath, dirnames, filenames in os.walk(start):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        here = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = [d for d in dirnames if not d.startswith(TEMP_PREFIX) and d != SIDECAR_DIR
                       and (f"{here}{d}/".startswith(prefix) or prefix.startswith(f"{here}{d}/"))]
        for name in filenames:
            key = here + name
            if name.startswith(TEMP_PREFIX) or not key.startswith(prefix):
                continue
            if os.path.islink(os.path.join(dirpath, name)):
                _confine(root, Path(dirpath) / name, key)
            keys.append(key)
    return sorted(keys)


def _remove_leftovers(folder: Path) -> None:
    """Under `folder`, whose objects were deleted: the temp files of writes killed before their rename (data and
    sidecar temps, the folders' lock files), sidecars whose object is gone, then every folder left empty."""
    if not folder.is_dir() or folder.is_symlink():
        return
    try:
        for dirpath, dirnames, filenames in os.walk(folder, topdown=False):
            here = Path(dirpath)
            for name in filenames:
                path = here / name
                orphan = here.name == SIDECAR_DIR and not (here.parent / name).is_file()
                if name.startswith(TEMP_PREFIX) or orphan:
                    path.unlink(missing_ok=True)
            for name in dirnames:
                with contextlib.suppress(OSError):  # not empty: something that is not ours stays, and its folder
                    (here / name).rmdir()
        with contextlib.suppress(OSError):
            folder.rmdir()
    except OSError as exc:
        raise StoreError(f"Could not remove what was left in {folder}: {exc.strerror or exc}.") from exc


class LocalStore(Store):
    """Objects as plain files under `root`, each with its sha256 in a hidden ``.sha256/`` sidecar."""

    def __init__(self, root: str | os.PathLike[str]):
        # The folder is created by the first write, so a run that fails validation leaves nothing behind.
        self.root = Path(root).expanduser().resolve()
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(f"The artifact store path {self.root} exists but is not a folder.")

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    # -- paths ---------------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        return _paths(self.root, [key])[key]

    @staticmethod
    def _sidecar(path: Path) -> Path:
        return path.parent / SIDECAR_DIR / path.name

    def url(self, key: str = "") -> str:
        return str(self._path(key)) if key else str(self.root)

    # -- Store API -----------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> str:
        return self._put_when(key, data, _ANY)[1]

    def put_many(self, items: Mapping[str, bytes]) -> Mapping[str, str]:
        """The write protocol for many objects, a folder at a time under its lock (`_put_folder`)."""
        folders: dict[Path, list[tuple[Path, bytes]]] = defaultdict(list)
        for key, data in items.items():
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise StoreError(f"Can only store bytes under {key!r}, got {type(data).__name__}.")
        paths = _paths(self.root, items)
        for key, data in items.items():
            folders[paths[key].parent].append((paths[key], bytes(data)))
        digests: dict[Path, str] = {}
        try:
            for entries in folders.values():
                with _locked(entries[0][0]):
                    digests.update(_put_folder(entries, self._sidecar))
        except StoreError:
            raise
        except OSError as exc:
            raise StoreError(f"Could not write artifacts under {self.root}: {exc.strerror or exc}. Check free disk space and permissions on the store folder.") from exc
        return {k: digests[path] for k, path in paths.items()}

    def create(self, key: str, data: bytes) -> bool:
        return self._put_when(key, data, None)[0]

    def replace_if(self, key: str, data: bytes, expected_sha256: str) -> bool:
        return self._put_when(key, data, expected_sha256)[0]

    @staticmethod
    def _current_sha256(path: Path) -> str | None:
        """The sha256 of the object at `path` as stored now (None when there is none); the caller
        holds the key's lock."""
        try:
            return sha256_hex(path.read_bytes())
        except (FileNotFoundError, IsADirectoryError):
            return None

    def _put_when(self, key: str, data: bytes, expected: str | None) -> tuple[bool, str]:
        """Under the key's lock: write `data` when the current object's sha256 is `expected` (None:
        there is no object; `_ANY`: whatever is there)."""
        path = self._path(key)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise StoreError(f"Can only store bytes under {key!r}, got {type(data).__name__}.")
        data = bytes(data)
        digest = sha256_hex(data)
        try:
            with _locked(path):
                if expected is not _ANY and (path.is_file() if expected is None else self._current_sha256(path) != expected):
                    return False, digest
                _write_object(path, self._sidecar(path), data, digest)
        except StoreError:
            raise
        except OSError as exc:
            raise StoreError(
                f"Could not write the artifact {path}: {exc.strerror or exc}. "
                "Check free disk space and permissions on the store folder."
            ) from exc
        return True, digest

    def get(self, key: str) -> bytes:
        path = self._path(key)
        with _locked(path, shared=True):
            data = self._read_checked(path)
        return data

    def _read_checked(self, path: Path) -> bytes:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise StoreError(
                f"No artifact at {path}: it was never written, or was deleted. "
                "Run the step that produces it first (or check the store path)."
            ) from None
        except IsADirectoryError:
            raise StoreError(f"{path} is a folder, not an artifact.") from None
        except OSError as exc:
            raise StoreError(f"Could not read the artifact {path}: {exc.strerror or exc}.") from exc
        _check_sidecar(path, self._sidecar(path), data)
        return data

    def size(self, key: str) -> int | None:
        try:
            return self._path(key).stat().st_size
        except OSError:
            return None

    def exists(self, key: str) -> bool:
        path = self._path(key)
        return path.is_file() and self._sidecar(path).is_file()

    def list(self, prefix: str = "") -> list[str]:
        prefix = validate_prefix(prefix)
        # Walk only the deepest folder the prefix names completely.
        head = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root.joinpath(*head.split("/")) if head else self.root
        if head:
            _confine(self.root, start, head)
        if not start.is_dir():
            return []
        return _keys_under(self.root, start, prefix)

    def delete_folder(self, prefix: str) -> None:
        """`Store.delete_folder`, and then the temp files and sidecars that writes killed midway left in the folder
        (`list` hides them), and the folders left empty."""
        super().delete_folder(prefix)
        head = validate_prefix(prefix).rstrip("/")
        if head:
            _confine(self.root, self.root.joinpath(*head.split("/")), head)
            _remove_leftovers(self.root.joinpath(*head.split("/")))

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            # Data first: an object is never visible without its hash.
            with _locked(path) if self._sidecar(path).parent.is_dir() else contextlib.nullcontext():
                path.unlink(missing_ok=True)
                self._sidecar(path).unlink(missing_ok=True)
        except IsADirectoryError:
            raise StoreError(f"{path} is a folder, not an artifact; not deleted.") from None
        except OSError as exc:
            raise StoreError(f"Could not delete {path}: {exc.strerror or exc}.") from exc
