"""Read-only access to a user's data files, in a folder or under an S3 prefix (MinIO / S3, with the
endpoint and credentials of run.store: FEDPIPE_S3_ENDPOINT, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY).

Unlike the artifact store (`fedpipe.store.base.Store`), these files were written by someone else's tools:
there is no recorded sha256 to check. What makes them safe to read instead:

- listing is bounded (MAX_SOURCE_OBJECTS) and every read is bounded (`max_bytes`, checked on the listed
  size before fetching and on the bytes after);
- a folder source stays under its root: symbolic links that leave it, and hidden files and folders
  (names starting with '.'), are not listed;
- every object is listed with a version (S3: its ETag; a folder: the sha256 of its bytes), and `read`
  refuses bytes whose version is not the listed one, so data that changes between the snapshot a run
  recorded and the moment it is read is an error, not a silent mix of old and new.

`open_source(url)` resolves a final `latest` path segment to the newest complete drop under it
(`s3://bucket/drops/latest` -> `s3://bucket/drops/2026-11-25`), so a recurring run picks up the newest drop.
Only drops that can be trusted to be whole and to be drops are candidates (`DropPolicy`): a real folder or
prefix inside the root (a symbolic link is never followed out of it), whose name matches the drop pattern
(ISO dates by default: a `zz-...` or `~provider` name cannot pin `latest` forever), whose date, when its name
starts with one (YYYY-MM-DD), is a real calendar day no later than tomorrow (UTC): `9999-99-99` or a drop
dated next year would sort after every real drop and stay `latest` for good; whose suffix after the date, under
the default pattern, is a time of day (`T03-00Z`; `_zzzzzz` or `T99:99` would sort after that day's real drops);
and that is complete: it holds
a `_SUCCESS` marker, or its own manifest was written after every other file. Each drop passed over (a
half-uploaded one, an impossible or future date, a symbolic link named as a drop) is named in a warning.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import secrets
import stat
from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlparse

from minio.error import S3Error

from fedpipe.config import refuse_url_credentials
from fedpipe.errors import DataError, StoreError
from fedpipe.store.base import validate_key
from fedpipe.store.s3 import ENV_ACCESS_KEY, ENV_ENDPOINT, ENV_SECRET_KEY, S3Store

__all__ = ["LATEST", "MAX_SOURCE_OBJECTS", "DataSource", "DropPolicy", "FolderSource", "S3Source", "SourceObject", "open_source"]

log = logging.getLogger(__name__)

MAX_SOURCE_OBJECTS = 10_000_000  # files in one source: 10 million small images is far above real use
LATEST = "latest"
ISO_DATE_DROPS = r"\d{4}-\d{2}-\d{2}([T_.-][0-9A-Za-z:._-]{0,64})?"  # 2026-11-25, 2026-11-25T03-00Z, 2026-11-25_0300
SUCCESS_MARKER = "_SUCCESS"  # what Spark, Hadoop and many exporters write last into a finished output
DROP_MANIFEST = "fedpipe-data.yaml"  # `fedpipe.data.files.manifest.MANIFEST_NAME` (the data layer reads it)
_CHUNK = 2**20  # bytes hashed or fetched at a time
_MISSING_S3 = ("NoSuchKey", "NoSuchObject", "NotFound", "ResourceNotFound")
_HOW_TO_POINT = ("Set data.source to the folder or s3://bucket/prefix that holds the clients' files "
                 "(a final /latest picks its newest sub-folder).")


@dataclass(frozen=True)
class SourceObject:
    key: str  # '/'-separated, relative to the source's root
    size: int  # bytes
    version: str  # S3: the ETag; folder: sha256 of the bytes


class DataSource(ABC):
    """A folder or an S3 prefix of someone else's files, listed once and read by key."""

    @abstractmethod
    def url(self, key: str = "") -> str:
        """Where `key` lives, for messages: a local path or an s3:// URL."""

    @abstractmethod
    def list(self) -> list[SourceObject]:
        """Every (non-hidden) object under the source, sorted by key; at most MAX_SOURCE_OBJECTS
        (more is a DataError saying so)."""

    @abstractmethod
    def read(self, obj: SourceObject, max_bytes: int) -> bytes:
        """The bytes of `obj`; a DataError naming the object when it is larger than `max_bytes`, missing,
        unreadable, or no longer the listed version (changed since it was listed)."""

    @abstractmethod
    def write(self, key: str, data: bytes) -> str:
        """Write one small file (the manifest `fedpipe data init` makes) atomically; returns its URL."""

    def exists(self, key: str) -> bool:
        """True when an object is stored under `key` (without listing, in the sources below)."""
        return any(o.key == key for o in self.list())

    @abstractmethod
    def parent(self) -> DataSource | None:
        """The folder or prefix one level up (where a drops root keeps the manifest its drops share); None at
        the top (a filesystem root, a bucket)."""

    @abstractmethod
    def stat(self, key: str) -> SourceObject | None:
        """The listing of one object by key, without listing the source (None when there is none)."""


_LINKS_SAID: set[str] = set()  # linked folders already named in a warning (a run lists its source several times)


def _first_time(link: str) -> bool:
    if link in _LINKS_SAID:
        return False
    _LINKS_SAID.add(link)
    return True


def _target(link: Path) -> str:
    """Where a symbolic link points, for a message."""
    try:
        return os.readlink(link)
    except OSError:
        return "?"


def _hidden(key: str) -> bool:
    return any(part.startswith(".") for part in key.split("/"))


def _too_many(where: str) -> DataError:
    return DataError(
        f"{where} holds more than {MAX_SOURCE_OBJECTS:,} files, more than fedpipe reads from one data source. "
        "Point data.source at a sub-folder holding one dataset, or pack the samples into tables (layout: table)."
    )


def _too_large(where: str, size: str, max_bytes: int) -> DataError:
    return DataError(
        f"{where} is {size} bytes, more than the {max_bytes:,} bytes fedpipe reads from one such file. "
        "Shrink or remove it (`fedpipe data check` lists every problem)."
    )


def _changed(where: str) -> DataError:
    return DataError(
        f"{where} changed since it was listed: its bytes are no longer the version fedpipe listed (and "
        "recorded in the run's snapshot). The data is being written while it is read: wait until the upload "
        "is complete and run again."
    )


def _utf8_name(path: Path) -> None:
    """A DataError unless the file's name (and its folders') are UTF-8: keys are text in snapshots and messages."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(path)[-200:]
        raise DataError(f"A file under the data folder has a name that is not UTF-8 text (...{shown!r}); rename it "
                        "(e.g. `convmv -f latin1 -t utf8`), or remove it.") from None


def _write_key(key: str) -> str:
    try:
        return validate_key(key)
    except StoreError as exc:
        raise DataError(str(exc).replace("Artifact key", "Data file name", 1)) from None


_SAID: set[tuple[str, str]] = set()  # (drops root, drop) already named in the log
_DATED = re.compile(r"(\d{4})-(\d{2})-(\d{2})")  # a drop name's leading ISO date
# what may follow it under the default pattern: a time of day, hours first (03, 03-00, 0300, 03:00:00.5), and a zone
_TIME_OF_DAY = re.compile(r"[T_.-](?P<h>\d{2})(?:([:-]?)(?P<m>\d{2})(?:\2(?P<s>\d{2})(?:[.,]\d{1,9})?)?)?"
                          r"(?:Z|[+-](?P<zh>\d{2})(?::?(?P<zm>\d{2}))?)?")
FUTURE_SLACK = timedelta(days=1)  # a drop stamped in a time zone ahead of UTC is dated "tomorrow" for up to a day


def _today() -> date:
    return datetime.now(UTC).date()


def date_problem(name: str, today: date | None = None) -> str:
    """Why a drop named `name` cannot be the newest by its date ("" when it can): a leading YYYY-MM-DD that is
    no calendar day (9999-99-99), or that lies after tomorrow (UTC). Names without a leading date pass."""
    m = _DATED.match(name)
    if m is None:
        return ""
    try:
        day = date(int(m.group(1)), int(m.group(2)), int(m.group(3)))
    except ValueError:
        return "not a calendar date"
    today = today or _today()
    if day > today + FUTURE_SLACK:
        return f"dated in the future (today is {today.isoformat()}, UTC)"
    return ""


def time_problem(name: str) -> str:
    """Why the suffix after a drop's leading date is not a time of day ("" when it is, or there is none): a suffix
    only orders drops within their day, so `2026-01-01_zzzzzz` or `2026-11-28T99:99` must not sort after every
    real drop of that day (or, with a digit-free suffix, be taken for one)."""
    m = _DATED.match(name)
    rest = name[m.end():] if m else ""
    if not rest:
        return ""
    t = _TIME_OF_DAY.fullmatch(rest)
    fields = t and [(t["h"], 23), (t["m"], 59), (t["s"], 59), (t["zh"], 14), (t["zm"], 59)]
    if not fields or any(v is not None and int(v) > most for v, most in fields):
        return (f"{rest!r} after the date is not a time of day (a suffix only orders the drops of one day: write it as "
                "T03, T03-00, T0300 or T03:00:00Z)")
    return ""


@dataclass(frozen=True)
class DropPolicy:
    """Which sub-folders of a drops root `latest` may pick (`data.drop_pattern`, `data.drop_complete`)."""

    pattern: str = ISO_DATE_DROPS
    """A drop's name, matched whole; the newest is the last in string order (ISO dates sort in time)."""
    complete: str = "auto"
    """How a drop shows it is whole: `success_file` (a `_SUCCESS` file in it), `manifest_last` (its own
    fedpipe-data.yaml written after every other file), `auto` (either), `none` (trust any drop: only for
    drops moved into place in one atomic step)."""

    def matches(self, name: str) -> bool:
        return len(name) <= 255 and re.fullmatch(self.pattern, name) is not None

    def misdated(self, name: str, today: date) -> str:
        """Why a drop named as one cannot be `latest` by its name ("" when it can): its date (`date_problem`) and,
        under the default pattern, its suffix (`time_problem`; a pattern of one's own says what a suffix is)."""
        return date_problem(name, today) or (time_problem(name) if self.pattern == ISO_DATE_DROPS else "")


def _newest(children: list[str], parent: str, policy: DropPolicy, complete) -> str:
    """The newest drop name under `parent` that matches the policy's pattern and is `complete(name)`, logged; a
    DataError when there is none, naming what was passed over and why."""
    named = sorted((c for c in children if policy.matches(c)), reverse=True)
    other = sorted(set(children) - set(named))
    if other:
        log.info("%s/%s: %d sub-folder(s) whose names are not drops were passed over (%s).", parent, LATEST, len(other),
                 ", ".join(other[:5]) + (" ..." if len(other) > 5 else ""))
    today = _today()
    misdated = {c: why for c in named if (why := policy.misdated(c, today))}
    drops = [c for c in named if c not in misdated]
    if misdated:
        log.warning("%s/%s: %d drop(s) skipped for their date (%s): a drop named after a day or a time that cannot be, or "
                    "has not come, would sort after every real drop and stay `latest` for good. Rename it to when it was made.",
                    parent, LATEST, len(misdated), "; ".join(f"{c}: {why}" for c, why in list(misdated.items())[:5])
                    + (" ..." if len(misdated) > 5 else ""))
    incomplete = []
    for name in drops:
        if policy.complete == "none" or complete(name):
            if incomplete:
                log.warning("%s/%s: newer drop(s) %s are not complete (no %s, and no %s written after the data): "
                            "skipped until they are.", parent, LATEST, ", ".join(incomplete[:5]), SUCCESS_MARKER, DROP_MANIFEST)
            if (parent, name) not in _SAID:  # once per process: a check resolves `latest` several times
                _SAID.add((parent, name))
                log.info("%s/%s is %s (the newest complete drop of %d).", parent, LATEST, name, len(drops))
            return name
        incomplete.append(name)
    why = (f"none of its {len(drops)} drop(s) is complete ({', '.join(incomplete[:5])}: write {SUCCESS_MARKER} into a drop "
           f"once its upload has finished, or its {DROP_MANIFEST} last)" if drops else
           f"its only drop(s) are misdated ({'; '.join(f'{c}: {w}' for c, w in list(misdated.items())[:5])}): rename them to "
           "the day they were made" if misdated else
           f"it has no sub-folder named as a drop (the pattern {policy.pattern!r}, ISO dates by default: 2026-11-25, "
           f"2026-12-01, ...){'; found ' + ', '.join(other[:5]) if other else ''}")
    raise DataError(f"{parent}/{LATEST} asks for the newest complete drop under {parent}, but {why}. Or set data.source to "
                    "the drop itself.")


def _complete_by(policy: DropPolicy, marker: bool, manifest_last) -> bool:
    """Whether a drop is complete under `policy`, given whether it holds the marker and a function telling
    whether its own manifest was written after everything else."""
    if policy.complete in ("auto", "success_file") and marker:
        return True
    return policy.complete in ("auto", "manifest_last") and manifest_last()


class FolderSource(DataSource):
    """The files under a local folder. Listing hashes every file (its version is its sha256), and never
    leaves the root: hidden names, symbolic links that lead out of it and linked folders are not listed."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).expanduser().resolve()

    def __repr__(self) -> str:
        return f"FolderSource({str(self.root)!r})"

    def url(self, key: str = "") -> str:
        return str(self.root.joinpath(*key.split("/"))) if key else str(self.root)

    def require(self) -> None:
        """A DataError unless the root is a folder."""
        if not self.root.is_dir():
            what = "is not a folder" if self.root.exists() else "does not exist"
            raise DataError(f"The data folder {self.root} {what}. {_HOW_TO_POINT}")

    def children(self) -> list[str]:
        """The names of the root's immediate, non-hidden sub-folders (`latest` itself excluded); a symbolic
        link is never one, wherever it points (a drop is a real folder inside the root): each is named in a warning."""
        found = [p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != LATEST]
        for link in sorted(p for p in found if p.is_symlink() and _first_time(str(p))):
            log.warning("%s is a symbolic link (to %s), not a folder: a drop must be a real folder inside %s, so it is "
                        "never `latest`. Copy or move the drop there.", link, _target(link), self.root)
        return sorted(p.name for p in found if not p.is_symlink())

    def _path(self, key: str) -> Path:
        """The file of `key`, refused when it would lie outside the root (a '..', an absolute path, a link)."""
        parts = PurePosixPath(key).parts
        if not key or key.startswith("/") or ".." in parts:
            raise DataError(f"The data file name {key!r} is not a path inside {self.root}.")
        path = self.root.joinpath(*parts)
        try:
            inside = path.resolve().is_relative_to(self.root)
        except (OSError, RuntimeError):  # a symlink loop
            inside = False
        if not inside:
            raise DataError(f"{path} leads out of the data folder {self.root} through a symbolic link; not read.")
        return path

    def list(self) -> list[SourceObject]:
        self.require()

        def unreadable(exc: OSError) -> None:
            raise DataError(f"Could not list the folder {exc.filename}: {exc.strerror or exc}. Check its permissions.")

        found: list[SourceObject] = []
        for dirpath, dirnames, filenames in os.walk(self.root, onerror=unreadable):  # linked folders are not walked
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in dirnames:
                if os.path.islink(os.path.join(dirpath, name)) and _first_time(os.path.join(dirpath, name)):
                    link = Path(dirpath) / name
                    log.warning("%s is a symbolic link to a folder (%s): linked folders are never read, so its files are not "
                                "part of the data. Copy the folder into %s instead.", link, _target(link), self.root)
            for name in sorted(filenames):
                if name.startswith("."):
                    continue
                _utf8_name(Path(dirpath) / name)
                obj = self._entry(Path(dirpath) / name)
                if obj is not None:
                    found.append(obj)
                    if len(found) > MAX_SOURCE_OBJECTS:
                        raise _too_many(str(self.root))
        if not found:
            raise DataError(f"The data folder {self.root} holds no files (hidden ones aside). {_HOW_TO_POINT}")
        return sorted(found, key=lambda o: o.key)

    def _entry(self, path: Path) -> SourceObject | None:
        """The listing of one file: None for a link out of the root, a broken link, or not a regular file."""
        try:
            if path.is_symlink() and not path.resolve().is_relative_to(self.root):
                log.warning("%s is a symbolic link to %s, outside the data folder %s: not read.", path, path.resolve(), self.root)
                return None
            if not stat.S_ISREG(path.stat().st_mode):
                return None
            digest, size = hashlib.sha256(), 0
            with path.open("rb") as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
                    size += len(chunk)
        except FileNotFoundError:  # a broken link, or deleted while listing
            return None
        except (OSError, RuntimeError) as exc:
            raise DataError(f"Could not read {path}: {getattr(exc, 'strerror', None) or exc}. Check its permissions.") from None
        return SourceObject(path.relative_to(self.root).as_posix(), size, digest.hexdigest())

    def read(self, obj: SourceObject, max_bytes: int) -> bytes:
        where = self.url(obj.key)
        if obj.size > max_bytes:
            raise _too_large(where, f"{obj.size:,}", max_bytes)
        path = self._path(obj.key)
        try:
            with path.open("rb") as f:  # the listed size, not max_bytes: a 4 GiB read buffer claimed address space for nothing
                data = f.read(min(max_bytes, obj.size) + 1)  # one byte more shows a file that grew (the hash then differs)
        except FileNotFoundError:
            raise DataError(f"{where} was deleted since it was listed. Wait until the data is complete and run again.") from None
        except OSError as exc:
            raise DataError(f"Could not read {where}: {exc.strerror or exc}.") from None
        if len(data) > max_bytes:
            raise _too_large(where, f"more than {max_bytes:,}", max_bytes)
        if hashlib.sha256(data).hexdigest() != obj.version:
            raise _changed(where)
        return data

    def exists(self, key: str) -> bool:
        return self._path(_write_key(key)).is_file()

    def parent(self) -> FolderSource | None:
        return None if self.root.parent == self.root else FolderSource(self.root.parent)

    def stat(self, key: str) -> SourceObject | None:
        path = self._path(_write_key(key))
        return self._entry(path) if path.is_file() else None

    def write(self, key: str, data: bytes) -> str:
        path = self._path(_write_key(key))
        tmp = path.parent / f".fedpipe-tmp-{secrets.token_hex(8)}"  # hidden: never listed
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tmp.open("xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise DataError(f"Could not write {path}: {exc.strerror or exc}. Check free space and permissions.") from None
        return str(path)


class S3Source(DataSource):
    """The objects under an S3 prefix, with the endpoint, credentials and retries of the S3 artifact store
    (`S3Store.from_env`). An object's version is its ETag, checked again on every read."""

    def __init__(self, bucket: str, prefix: str = ""):
        try:  # never creates the bucket: a data source is read, not made
            store = S3Store.from_env(bucket, prefix, create_bucket=False)
        except StoreError as exc:
            raise DataError(str(exc).replace("The artifact store", "The data source", 1)) from None
        self.bucket, self.prefix = bucket, store.prefix
        self.endpoint_url = store.endpoint_url
        self._client = store._bucket.client
        self._call = store._call  # bounded retries on transient errors; credentials scrubbed from messages
        self._base = f"{self.prefix}/" if self.prefix else ""

    def __repr__(self) -> str:
        return f"S3Source({self.url()!r}, endpoint={self.endpoint_url!r})"

    def url(self, key: str = "") -> str:
        path = "/".join(p for p in (self.prefix, key) if p)
        return f"s3://{self.bucket}/{path}" if path else f"s3://{self.bucket}"

    def _no_bucket(self, exc: S3Error) -> None:
        if exc.code == "NoSuchBucket":
            raise DataError(f"The bucket {self.bucket!r} does not exist on {self.endpoint_url} ({ENV_ENDPOINT}). "
                            f"{_HOW_TO_POINT}") from None

    def require(self) -> None:
        """A DataError unless at least one object lies under the prefix."""
        def first() -> bool:
            try:
                return next(iter(self._client.list_objects(self.bucket, prefix=self._base, recursive=True)), None) is not None
            except S3Error as exc:
                self._no_bucket(exc)
                raise

        if not self._call(f"listing {self.url()}", first):
            raise DataError(f"Nothing is stored under {self.url()} on {self.endpoint_url}. Upload the data there, or "
                            f"fix the prefix. {_HOW_TO_POINT}")

    def children(self) -> list[str]:
        """The names of the prefix's immediate, non-hidden sub-prefixes (`latest` itself excluded)."""
        def names() -> list[str]:
            try:
                found = self._client.list_objects(self.bucket, prefix=self._base, recursive=False)
                return [o.object_name[len(self._base):].rstrip("/") for o in found if o.is_dir]
            except S3Error as exc:
                self._no_bucket(exc)
                raise

        return sorted(n for n in self._call(f"listing {self.url()}", names) if n and not n.startswith(".") and n != LATEST)

    def list(self) -> list[SourceObject]:
        def objects() -> list[SourceObject]:
            out = []
            try:
                for o in self._client.list_objects(self.bucket, prefix=self._base, recursive=True):
                    key = o.object_name[len(self._base):]
                    if o.is_dir or not key or key.endswith("/") or _hidden(key):
                        continue
                    out.append(SourceObject(key, int(o.size or 0), (o.etag or "").strip('"')))
                    if len(out) > MAX_SOURCE_OBJECTS:
                        raise _too_many(self.url())
            except S3Error as exc:
                self._no_bucket(exc)
                raise
            return out

        found = self._call(f"listing {self.url()}", objects)
        if not found:
            raise DataError(f"Nothing is stored under {self.url()} (hidden names aside). {_HOW_TO_POINT}")
        return sorted(found, key=lambda o: o.key)

    def read(self, obj: SourceObject, max_bytes: int) -> bytes:
        where = self.url(obj.key)
        if obj.size > max_bytes:
            raise _too_large(where, f"{obj.size:,}", max_bytes)
        data = self._call(f"reading {where}", lambda: self._fetch(obj, where, max_bytes))
        if len(data) > max_bytes:
            raise _too_large(where, f"more than {max_bytes:,}", max_bytes)
        return data

    def _fetch(self, obj: SourceObject, where: str, max_bytes: int) -> bytes:
        """One GET: the version checked on the response's ETag, at most max_bytes + 1 bytes read."""
        try:
            resp = self._client.get_object(self.bucket, self._base + obj.key)
        except S3Error as exc:
            if exc.code in _MISSING_S3:
                raise DataError(f"{where} was deleted since it was listed. Wait until the upload is complete and "
                                "run again.") from None
            self._no_bucket(exc)
            raise
        try:
            if (resp.headers.get("ETag") or "").strip('"') != obj.version:
                raise _changed(where)
            chunks, total = [], 0
            while total <= max_bytes:
                chunk = resp.read(min(_CHUNK, max_bytes + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
            return b"".join(chunks)
        finally:
            resp.close()
            resp.release_conn()

    def exists(self, key: str) -> bool:
        name = self._base + _write_key(key)

        def stat_object() -> bool:
            try:
                self._client.stat_object(self.bucket, name)
            except S3Error as exc:
                if exc.code in _MISSING_S3:
                    return False
                self._no_bucket(exc)
                raise
            return True

        return self._call(f"checking {self.url(key)}", stat_object)

    def parent(self) -> S3Source | None:
        if not self.prefix:
            return None
        return S3Source(self.bucket, self.prefix.rsplit("/", 1)[0] if "/" in self.prefix else "")

    def stat(self, key: str) -> SourceObject | None:
        name = self._base + _write_key(key)

        def stat_object() -> SourceObject | None:
            try:
                found = self._client.stat_object(self.bucket, name)
            except S3Error as exc:
                if exc.code in _MISSING_S3:
                    return None
                self._no_bucket(exc)
                raise
            return SourceObject(key, int(found.size or 0), (found.etag or "").strip('"'))

        return self._call(f"checking {self.url(key)}", stat_object)

    def write(self, key: str, data: bytes) -> str:
        name = self._base + _write_key(key)
        data = bytes(data)
        self._call(f"writing {self.url(key)}",  # one PUT: atomic for readers
                   lambda: self._client.put_object(self.bucket, name, io.BytesIO(data), len(data)))
        return self.url(key)


def _folder_drop_complete(parent: FolderSource, name: str, policy: DropPolicy) -> bool:
    """Whether the drop `name` under a folder is whole (`DropPolicy.complete`)."""
    drop = parent.root / name

    def manifest_last() -> bool:
        manifest = drop / DROP_MANIFEST
        if not manifest.is_file() or manifest.is_symlink():
            return False
        written = manifest.stat().st_mtime
        return all(p.stat().st_mtime <= written for p in drop.rglob("*") if p.is_file() and not p.is_symlink())

    marker = drop / SUCCESS_MARKER
    return _complete_by(policy, marker.is_file() and not marker.is_symlink(), manifest_last)


def _s3_drop_complete(parent: S3Source, name: str, policy: DropPolicy) -> bool:
    """Whether the drop `name` under an S3 prefix is whole (`DropPolicy.complete`)."""
    drop = S3Source(parent.bucket, "/".join(p for p in (parent.prefix, name) if p))

    def manifest_last() -> bool:
        times: dict[str, datetime] = {}

        def stamps() -> None:
            for o in drop._client.list_objects(drop.bucket, prefix=drop._base, recursive=True):
                if not o.is_dir and o.last_modified is not None:
                    times[o.object_name[len(drop._base):]] = o.last_modified

        drop._call(f"listing {drop.url()}", stamps)
        return DROP_MANIFEST in times and all(t <= times[DROP_MANIFEST] for t in times.values())

    return _complete_by(policy, drop.stat(SUCCESS_MARKER) is not None, manifest_last)


def _open_folder(path: str, policy: DropPolicy) -> FolderSource:
    root = Path(path).expanduser()
    if root.name == LATEST:
        parent = FolderSource(root.parent)
        parent.require()
        root = Path(parent.url(_newest(parent.children(), parent.url(), policy, lambda n: _folder_drop_complete(parent, n, policy))))
    source = FolderSource(root)
    source.require()
    return source


def _open_s3(bucket: str, prefix: str, policy: DropPolicy) -> S3Source:
    parts = [p for p in prefix.split("/") if p]
    if parts and parts[-1] == LATEST:
        parent = S3Source(bucket, "/".join(parts[:-1]))
        parts[-1] = _newest(parent.children(), parent.url(), policy, lambda n: _s3_drop_complete(parent, n, policy))
    source = S3Source(bucket, "/".join(parts))
    source.require()
    return source


def open_source(url: str, policy: DropPolicy | None = None) -> DataSource:
    """The source `url` names: a folder path, or s3://bucket/prefix; a final `/latest` segment is resolved
    to the newest complete drop under it (`policy`, default `DropPolicy()`). A DataError when the source does
    not exist or is empty. The source's `url()` is the resolved location (the dated drop a run read)."""
    policy = policy or DropPolicy()
    if not isinstance(url, str) or not url.strip():
        raise DataError(f"No data source given. {_HOW_TO_POINT}")
    url = url.strip()
    try:
        refuse_url_credentials(url, "The data source URL", f"put them in {ENV_ACCESS_KEY} and {ENV_SECRET_KEY}",
                               bare_is_host=False)
    except ValueError as exc:
        raise DataError(str(exc)) from None
    if "://" not in url:
        return _open_folder(url, policy)
    parsed = urlparse(url)
    scheme = parsed.scheme.lower()
    if scheme == "file":
        if parsed.netloc not in ("", "localhost") or not parsed.path:
            raise DataError(f"The data source {url!r} is not a local file URL: write file:///absolute/path or a plain path.")
        return _open_folder(unquote(parsed.path), policy)
    if scheme == "s3":
        if not parsed.netloc:
            raise DataError(f"The data source {url!r} has no bucket: write s3://bucket/prefix.")
        return _open_s3(parsed.netloc, parsed.path.strip("/"), policy)
    raise DataError(f"The data source {url!r} uses the unsupported scheme {parsed.scheme!r}: use a folder path, "
                    "file:///path, or s3://bucket/prefix (MinIO or any S3-compatible server).")
