"""Proposing a table's manifest (`fedpipe data init` on Parquet or CSV files): which column names the client,
which the label, and what the inputs are, from the column names and a sample of rows."""

from __future__ import annotations

import pyarrow as pa

from fedpipe.data.files.manifest import TABLE_EXTENSIONS, DataManifest, TableLayout, label_order
from fedpipe.data.files.tables import MAX_TABLE_BYTES, _is_number, _is_string, _open_table, _Table, _text
from fedpipe.errors import DataError
from fedpipe.store.source import DataSource, SourceObject

__all__ = ["infer_table_manifest"]

INFER_ROWS = 10_000  # rows `infer_table_manifest` looks at to tell the columns apart
CLIENT_NAMES = ("client", "site", "device", "user", "writer", "hospital", "branch")
LABEL_NAMES = ("label", "labels", "target", "class", "y")
TEXT_NAMES = ("text", "sentence", "review")


def _pick(names: list[str], given: str | None, candidates: tuple[str, ...], what: str, flag: str) -> str:
    """The column `given` names, else the first of `candidates` (case-insensitive); a DataError asking for `flag`."""
    if given is not None:
        if given not in names:
            raise DataError(f"there is no column {given!r} to be the {what} column; the columns are "
                            f"{', '.join(map(repr, names))}")
        return given
    lower = {n.lower(): n for n in reversed(names)}
    for candidate in candidates:
        if candidate in lower:
            return lower[candidate]
    raise DataError(f"no column is named as a {what} column usually is ({', '.join(candidates)}); say which one "
                    f"it is with {flag} COLUMN. The columns are {', '.join(map(repr, names))}")


def _inputs(table: _Table, sample: pa.Table, taken: set[str]) -> dict:
    """The inputs the sample suggests: a text column, else an image column, else every numeric column."""
    rest = [n for n in table.names if n not in taken]
    for n in rest:
        if _is_string(table.types[n]) and n.lower() in TEXT_NAMES:
            return {"text_column": n}
    for n in rest:
        t = table.types[n]
        if pa.types.is_binary(t) or pa.types.is_large_binary(t):
            return {"image_column": n}
        if _is_string(t):
            values = [v for v in _text(sample.column(n)).to_pylist() if v is not None]
            if values and all(v.lower().endswith((".png", ".jpg", ".jpeg")) for v in values):
                return {"image_column": n}
    features = tuple(n for n in rest if _is_number(table.types[n]))
    if not features:
        raise DataError("no input column found: a table needs numeric feature columns, a text column (named "
                        f"{', '.join(TEXT_NAMES)}) or an image column (paths or bytes); the columns are "
                        f"{', '.join(map(repr, table.names))}")
    return {"features": features}


def _label_values(source: DataSource, files: list[SourceObject], column: str) -> tuple[str, ...]:
    """Every distinct label text over all files (only that column is read), sorted (numerically when integers)."""
    from fedpipe.data.files.manifest import MAX_LABELS

    seen: set[str] = set()
    for obj in files:
        table = _open_table(source.read(obj, MAX_TABLE_BYTES), obj.key)
        if column not in table.types:
            raise DataError(f"{source.url(obj.key)} has no column {column!r}; every table file has the same columns")
        for batch in table.batches([column], True):
            seen.update(v for v in _text(batch.column(0)).dictionary_encode().dictionary.to_pylist() if v)
            if len(seen) > MAX_LABELS:
                raise DataError(f"column {column!r} has more than {MAX_LABELS} distinct values: is it the label column?")
    return tuple(label_order(seen))


def infer_table_manifest(source: DataSource, objects: list[SourceObject], client_column: str | None = None,
                         label_column: str | None = None) -> DataManifest:
    """A manifest for the table files under the source, proposed from the first file's columns and up to
    INFER_ROWS of its rows, and the label values of every file; a DataError says what it could not tell."""
    files = [o for o in objects if o.key.lower().endswith(TABLE_EXTENSIONS)]
    if not files:
        raise DataError(f"{source.url()} has no .parquet or .csv file to propose a table layout from")
    try:
        table = _open_table(source.read(files[0], MAX_TABLE_BYTES), files[0].key)
        batches = []
        for batch in table.batches(table.names, False):
            batches.append(batch)
            if sum(len(b) for b in batches) >= INFER_ROWS:
                break
        sample = pa.Table.from_batches(batches) if batches else pa.table({})
        client = _pick(table.names, client_column, CLIENT_NAMES, "client", "--client-column")
        label = _pick(table.names, label_column, LABEL_NAMES, "label", "--label-column")
        inputs = _inputs(table, sample, {client, label})
        labels = _label_values(source, files, label)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"a table file under {source.url()} cannot be read: {exc}") from None
    if len(labels) < 2:
        raise DataError(f"column {label!r} holds {len(labels)} distinct label(s) ({', '.join(labels)}); "
                        "a classification needs at least two")
    layout = TableLayout(client_column=client, label_column=label, **inputs)
    return DataManifest(source=layout, labels=labels)
