"""A user's own federated data (`data.dataset: files`): the clients as the files give them.

`load_files(source, ...)` reads the folder or S3 prefix `source` (a final `latest` segment: its newest
sub-prefix by name) in the layout its manifest (`fedpipe-data.yaml`, `manifest.py`) names, checks every
file and row, and returns a `DatasetBundle` whose `clients` array is the natural partition and whose
`snapshot` names exactly what was read. `check_files` does the same reading and returns the statistics
and every problem instead of stopping at the first error (`fedpipe data check`).

The snapshot (`snapshot_of`) is a sha256 over every file under the source: its key, size and version
(S3 ETag, or the sha256 of a local file's bytes), so it is known from a listing alone, before anything
is decoded (a file the layout does not use counts too: what was there is what the run saw). A run records it in its config (`data.snapshot`), so it
enters the run's id: new data is a new run, and the same data resumes the same run.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import ValidationError

from fedpipe.config import format_validation_error
from fedpipe.data import DatasetBundle, LabeledArrays
from fedpipe.data.files.budget import DecodeBudget
from fedpipe.data.files.manifest import MANIFEST_MAX_BYTES, MANIFEST_NAME, TABLE_EXTENSIONS, DataManifest
from fedpipe.data.files.rows import ClientRows, Problems
from fedpipe.errors import ConfigError, DataError
from fedpipe.safe_load import parse_yaml
from fedpipe.store.source import DataSource, DropPolicy, SourceObject, open_source

log = logging.getLogger(__name__)

__all__ = ["DataCheck", "check_files", "current_snapshot", "load_files", "read_manifest", "snapshot_of"]


@dataclass(frozen=True)
class DataCheck:
    """What `fedpipe data check` reports: the rows read (None when reading stopped early), the manifest,
    the snapshot, the bytes on disk and every problem."""

    source: str
    manifest: DataManifest | None
    rows: ClientRows | None
    snapshot: dict | None
    problems: Problems
    files_read: int = 0  # the data files the layout read (the snapshot covers every file listed)


INHERITED_MANIFEST = "../" + MANIFEST_NAME  # how a manifest shared from the drops root enters a snapshot


def find_manifest(source: DataSource, objects: list[SourceObject]) -> tuple[DataSource, SourceObject] | None:
    """Where the source's manifest is: its own `fedpipe-data.yaml`, else the one in the folder above it (a drops
    root: `drops/fedpipe-data.yaml` serves `drops/2026-03-01`, so a drop needs only its data); None when neither."""
    own = next((o for o in objects if o.key == MANIFEST_NAME), None)
    if own is not None:
        return source, own
    parent = source.parent()
    found = parent.stat(MANIFEST_NAME) if parent is not None else None
    return (parent, found) if found is not None else None


def read_manifest(source: DataSource, objects: list[SourceObject]) -> DataManifest:
    """The source's fedpipe-data.yaml (its own, or its drops root's), bounded and validated; a DataError saying
    how to make one."""
    found = find_manifest(source, objects)
    if found is None:
        above = source.parent()
        root = f" or, for every drop at once, in {above.url()} (`fedpipe data init {source.url()} --root`)" if above else ""
        raise DataError(
            f"{source.url()} has no {MANIFEST_NAME}, the file that says how the data is laid out, and neither has the "
            f"folder above it. Write one with `fedpipe data init {source.url()}` (it looks at the files and proposes the "
            f"layout, the columns and the label names){root}, check it, and run again."
        )
    holder, entry = found
    where = holder.url(MANIFEST_NAME)
    text = holder.read(entry, MANIFEST_MAX_BYTES).decode("utf-8", errors="replace")
    try:
        tree = parse_yaml(text, where, "data manifest", max_bytes=MANIFEST_MAX_BYTES)  # bounded size, depth and nodes
        return DataManifest.model_validate(tree or {})
    except ValidationError as exc:
        raise DataError(f"{where} is not a valid data manifest: {format_validation_error(exc)}") from None
    except ConfigError as exc:
        raise DataError(f"{exc} Fix it, or rewrite it with `fedpipe data init`.") from None


def snapshot_of(source: DataSource, objects: list[SourceObject]) -> dict:
    """What a run read: the source URL, a sha256 over every object's key, size and version (in key order, a
    manifest shared from the drops root as `../fedpipe-data.yaml`), how many objects and how many bytes."""
    found = find_manifest(source, objects)
    listed = list(objects)
    if found is not None and found[0] is not source:
        listed.append(SourceObject(INHERITED_MANIFEST, found[1].size, found[1].version))
    digest = hashlib.sha256()
    for o in sorted(listed, key=lambda o: o.key):
        digest.update(f"{o.key}\0{o.size}\0{o.version}\n".encode())
    return {"source": source.url(), "digest": digest.hexdigest(), "objects": len(listed),
            "bytes": int(sum(o.size for o in listed))}


def open_data(url: str, policy: DropPolicy | None = None) -> tuple[DataSource, str | None]:
    """The source `url` names, and the table file it names when it is one (`sites/visits.parquet`: the folder
    `sites`, reading that file alone); else (source, None)."""
    head, _, name = url.strip().rstrip("/").rpartition("/")
    if name.lower().endswith(TABLE_EXTENSIONS):
        folder = head or "."
        try:
            source = open_source(folder, policy)
        except DataError:
            source = None
        if source is not None and source.stat(name) is not None:
            return source, name
    return open_source(url, policy), None


def current_snapshot(url: str, policy: DropPolicy | None = None) -> dict:
    """The snapshot of what is under `url` now, from a listing alone (`latest` resolved by `policy`: its
    "source" is the dated prefix actually read)."""
    source, _ = open_data(url, policy)
    return snapshot_of(source, source.list())


def check_files(url: str, image_size: int | None = None, max_decoded_mb: int | Literal["auto"] = "auto") -> DataCheck:
    """Read the source as a run would and return every problem found instead of raising on the first; the
    drop may take at most `max_decoded_mb` decoded (`budget.DecodeBudget`; auto: a share of this process's memory)."""
    source, table_file = open_data(url)
    objects = source.list()
    problems = Problems()
    try:
        manifest = read_manifest(source, objects)
    except DataError as exc:
        problems.error("manifest", source.url(MANIFEST_NAME), str(exc))
        return DataCheck(source.url(), None, None, None, problems)
    if table_file is not None and manifest.source.layout == "table":  # the file the source names, alone
        manifest = manifest.model_copy(update={"source": manifest.source.model_copy(update={"files": (table_file,)})})
    from fedpipe.data.files import images, tables

    reader = images.read_image_folders if manifest.source.layout == "image_folders" else tables.read_table
    rows, read = reader(source, objects, manifest, image_size, problems, DecodeBudget(max_decoded_mb))
    if rows is not None:
        _check_rows(rows, problems)
    return DataCheck(source.url(), manifest, rows, snapshot_of(source, objects), problems, len(read))


def load_files(url: str, image_size: int | None = None, expected_snapshot: str | None = None,
               max_decoded_mb: int | Literal["auto"] = "auto") -> DatasetBundle:
    """The bundle of a user's federated data; a DataError listing every error found (nothing is written
    before a run has its data). `expected_snapshot`: the digest the run recorded; data that changed since
    is an error, not a silent mix."""
    check = check_files(url, image_size, max_decoded_mb)
    check.problems.raise_if_errors(check.source)
    rows, manifest, snapshot = check.rows, check.manifest, check.snapshot
    assert rows is not None and manifest is not None and snapshot is not None
    if expected_snapshot and snapshot["digest"] != expected_snapshot:
        raise DataError(
            f"The data under {check.source} changed since this run recorded it (data.snapshot={expected_snapshot[:12]}..., "
            f"now {snapshot['digest'][:12]}...): a run reads one snapshot. Start a new run on the new data (leave "
            "data.snapshot unset; fedpipe records it), or restore the files the run was made from."
        )
    for w in check.problems.summary("warning"):
        log.warning("%s: %s", check.source, w)
    train = LabeledArrays(rows.x, rows.y)
    digest = hashlib.sha256()
    for a in (rows.x, rows.y, rows.clients):
        digest.update(np.ascontiguousarray(a).data)
    return DatasetBundle(
        name="files", train=train, test=None, num_classes=len(manifest.labels), class_names=manifest.labels,
        fingerprint=digest.hexdigest(), vocab_size=rows.vocab_size, clients=rows.clients,
        client_names=rows.client_names, snapshot=snapshot, sample_ids=rows.ids,
    )


def _check_rows(rows: ClientRows, problems: Problems) -> None:
    """Checks across files: the same sample under two clients (a leak between clients' splits). The rows are
    hashed and compared in place, a few MiB at a time, however wide a row is (an 8000x8000 image is one row)."""
    if len(rows.y) == 0:
        problems.error("no samples", "the source", "no sample could be read; check the layout in the manifest")
        return
    flat = np.ascontiguousarray(rows.x).reshape(len(rows.y), -1).view(np.uint8)
    hashes = _row_hashes(flat)
    order = np.argsort(hashes, kind="stable")
    same = np.flatnonzero(hashes[order][1:] == hashes[order][:-1])  # candidates, confirmed byte for byte below
    first_of: dict[int, int] = {}
    for k in same:
        i, j = int(order[k]), int(order[k + 1])
        first = first_of.setdefault(i, i)
        if _rows_equal(flat, first, j):
            first_of[j] = first
            if rows.clients[first] != rows.clients[j]:
                problems.warning("duplicated across clients", rows.where(j),
                                 f"the same input as {rows.where(first)} (client {rows.client_names[rows.clients[first]]!r}); "
                                 "a sample held by two clients can sit in one's train and the other's test split")


CHUNK_BYTES = 4 * 2**20  # the working memory of hashing and comparing rows: uint64 products of this many bytes


def _row_hashes(flat: np.ndarray, chunk_bytes: int = CHUNK_BYTES) -> np.ndarray:
    """A 64-bit hash of each row's bytes (a random linear form, wrapping), over blocks of rows and columns of
    about `chunk_bytes` of uint64 products: a million rows cost 8 MB of hashes, and a row of 192 MB (one large
    image) 4 MiB at a time, never a uint64 copy of it (8x its size) or a weight per byte of it."""
    n, width = flat.shape
    cols = max(1, min(width, chunk_bytes // 8))
    rows_at = max(1, chunk_bytes // (8 * cols))
    out = np.zeros(n, dtype=np.uint64)
    for c0 in range(0, width, cols):
        c1 = min(width, c0 + cols)  # each block of columns its own weights, drawn from its position
        weights = np.random.default_rng((0x5EED, c0)).integers(1, 2**63, size=c1 - c0, dtype=np.uint64) | np.uint64(1)
        for r0 in range(0, n, rows_at):
            block = flat[r0 : r0 + rows_at, c0:c1].astype(np.uint64)
            block *= weights
            out[r0 : r0 + rows_at] += block.sum(axis=1, dtype=np.uint64)  # uint64 wraps, as a hash should
    return out


def _rows_equal(flat: np.ndarray, i: int, j: int, chunk_bytes: int = CHUNK_BYTES) -> bool:
    """Whether rows i and j hold the same bytes, compared a block at a time (no row-wide temporary)."""
    a, b = flat[i], flat[j]
    return all(np.array_equal(a[k : k + chunk_bytes], b[k : k + chunk_bytes]) for k in range(0, len(a), chunk_bytes))
