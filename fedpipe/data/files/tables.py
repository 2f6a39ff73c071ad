"""The `table` layout: Parquet or CSV files, one row per sample, with a client column, a label column and
the inputs (numeric feature columns, an image column, or a text column).

Reading is bounded and streamed. A file's bytes come from the source with a bound (MAX_TABLE_BYTES); a
Parquet file is read batch by batch (`ParquetFile.iter_batches`) into arrays preallocated from its
metadata's row count, a CSV file batch by batch (`pyarrow.csv.open_csv`), every column it needs read as
text and parsed here, so a stray word in a numeric column is a problem naming its row rather than a
failed read. Columns become numpy arrays one at a time; no data frame is made.

What a value means:

- client: its text (integers as written: 3 -> "3"); the client names are sorted, each row holds the
  index of its client's name. A missing or empty client is an error.
- label: its text is looked up among the manifest's labels first; when it is not one of them, an integer
  0 <= k < len(labels) stands for labels[k], unless the labels are themselves integers (then "3" means
  the label named "3" and nothing else). Anything else, or a missing label, is an error.
- features: numbers (integers, floats, booleans, or text holding numbers), as float32; a missing value,
  NaN, an infinity or a number beyond float32's range is an error naming the file, the row and the column.
- image: a path relative to the source (text; it must be one of the source's files, read with the bound
  MAX_IMAGE_BYTES), or the encoded PNG/JPEG bytes (binary), decoded by `images.decode_image`.
- text: tokenized as AG News is (`fedpipe.data.text.tokenize`), the vocabulary being the TEXT_VOCAB_SIZE - 2
  most frequent words of ALL rows of the table. The split of each client's rows into train and test is
  made later, from the natural partition; building the vocabulary first means test rows' words can be
  in it (which words exist, never a label), the price of one vocabulary for every client and split.

Rows are named "<file> row N": N counts a file's data rows from 1 (a CSV's header line not counted).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from fedpipe.data import PAD_ID, UNK_ID
from fedpipe.data.files.budget import DecodeBudget
from fedpipe.data.files.manifest import TABLE_EXTENSIONS, DataManifest, TableLayout
from fedpipe.data.files.rows import ClientRows, Problems, shown
from fedpipe.data.identity import identity_of
from fedpipe.data.text import TEXT_MAX_LENGTH, TEXT_VOCAB_SIZE, rank_words, tokenize
from fedpipe.errors import DataError
from fedpipe.store.source import DataSource, SourceObject

__all__ = ["read_table"]

MAX_TABLE_BYTES = 4 * 2**30  # one table file; its bytes are held while it is read
MAX_IMAGE_BYTES = 64 * 2**20  # one image a path column names
BATCH_ROWS = 65_536  # rows converted at a time (Parquet)
CSV_BLOCK_BYTES = 1 << 22  # bytes of CSV parsed at a time
MAX_ROW_PROBLEMS = 1_000  # problems of one kind listed per file; the rest are counted
IDENTITY_VALUES = 1 << 16  # values turned into Python objects at a time to name rows (rows x named columns)
TOKENIZING_BYTES = 48  # what tokenizing a text holds per character of it, at most: its lower-cased copy, and a
#                        word object and a list slot for every other character (one-letter words and separators)
WORD_BYTES = 256  # what one more distinct word costs while the vocabulary is counted (its text, two dict entries)
ROW_NOTE = "(rows count from 1; a CSV's header line is not counted)"
_INTEGER = re.compile(r"[+-]?\d+")


# --- opening one table file ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Table:
    """One opened table file: its column names and types (a CSV's inferred from its first block), its row
    count when the metadata says it, and its batches of the named columns (a CSV's as text when `as_text`)."""

    names: list[str]
    types: dict[str, pa.DataType]
    num_rows: int | None
    batches: Callable[[list[str], bool], Iterator[pa.RecordBatch]]
    typed: bool = True  # False for CSV: its values are read as text and parsed here, whatever was inferred
    uncompressed: Callable[[list[str]], int] | None = None  # Parquet: the named columns' size once decompressed


def _batch_bytes(batch: pa.RecordBatch) -> int:
    """What a batch's values take once expanded: text and binary columns after dictionary decoding (measured on
    the dictionary's value lengths, nothing expanded), 8 bytes per value of the others."""
    total = 0
    for col in batch.columns:
        if _is_string(col.type) or _is_bytes(col.type):
            if pa.types.is_dictionary(col.type):
                lengths = pc.binary_length(col.dictionary).to_numpy(zero_copy_only=False)
                indices = pc.fill_null(col.indices, 0).to_numpy(zero_copy_only=False)
                total += int(lengths[indices].sum()) if len(lengths) else 0
            else:
                total += int(pc.sum(pc.binary_length(col)).as_py() or 0)
        total += 8 * len(col)
    return total


def _open_table(data: bytes, key: str) -> _Table:
    """Parse a table file's head: a Parquet footer, or a CSV header and first block (its types inferred).
    A Parquet file's text and binary columns are read dictionary-encoded, as they are stored, so what they
    expand to is measured (`_batch_bytes`) before anything expands them."""
    if key.lower().endswith(".parquet"):
        import pyarrow.parquet as pq

        schema = pq.ParquetFile(pa.BufferReader(data)).schema_arrow
        texts = [f.name for f in schema if _is_string(f.type) or _is_bytes(f.type)]
        pf = pq.ParquetFile(pa.BufferReader(data), read_dictionary=texts)

        def parquet_batches(columns: list[str], as_text: bool) -> Iterator[pa.RecordBatch]:
            yield from pf.iter_batches(batch_size=BATCH_ROWS, columns=columns)

        meta = pf.metadata
        needed = {n for n in schema.names}

        def uncompressed(columns: list[str]) -> int:
            wanted = set(columns) & needed
            return sum(rg.column(j).total_uncompressed_size for rg in (meta.row_group(i) for i in range(meta.num_row_groups))
                       for j in range(rg.num_columns) if rg.column(j).path_in_schema in wanted)

        return _Table(list(schema.names), {f.name: f.type for f in schema}, meta.num_rows, parquet_batches, uncompressed=uncompressed)
    import pyarrow.csv as pcsv

    with pcsv.open_csv(pa.BufferReader(data)) as head:
        schema = head.schema

    def csv_batches(columns: list[str], as_text: bool) -> Iterator[pa.RecordBatch]:
        convert = pcsv.ConvertOptions(
            include_columns=columns, null_values=[""], strings_can_be_null=True,
            column_types={c: pa.string() for c in columns} if as_text else None,
        )
        read = pcsv.ReadOptions(block_size=CSV_BLOCK_BYTES)
        with pcsv.open_csv(pa.BufferReader(data), read_options=read, convert_options=convert) as reader:
            yield from reader

    return _Table(list(schema.names), {f.name: f.type for f in schema}, None, csv_batches, typed=False)


def _table_files(source: DataSource, objects: list[SourceObject], layout: TableLayout,
                 problems: Problems) -> list[SourceObject]:
    """The files the layout names (a missing one is an error), or every .parquet and .csv file in key order."""
    if not layout.files:
        found = [o for o in objects if o.key.lower().endswith(TABLE_EXTENSIONS)]
        if not found:
            problems.error("no table", source.url(), "no .parquet or .csv file under the source; the manifest's "
                           "layout is `table` (name the files in its `files`, or put them under the source)")
        return found
    by_key = {o.key: o for o in objects}
    chosen: list[SourceObject] = []
    for name in dict.fromkeys(layout.files):
        key = name.removeprefix("./")
        if not key.lower().endswith(TABLE_EXTENSIONS):
            problems.error("unknown table format", source.url(key), "a table file is .parquet or .csv")
        elif key not in by_key:
            problems.error("missing table", source.url(key), "the manifest's `files` names it, but the source "
                           "has no such file (paths are relative to the source)")
        else:
            chosen.append(by_key[key])
    return chosen


# --- values ----------------------------------------------------------------------------------------


def _text(col: pa.Array) -> pa.Array:
    """A column's values as text (integers as written, 3.0 as "3"); nulls stay null."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()
    if pa.types.is_string(col.type):
        return col
    return pc.cast(col, pa.string())


def _distinct(col: pa.Array) -> tuple[list, np.ndarray]:
    """A column's distinct values as Python objects (text, integers as written; bytes for a binary column) and
    each row's index into them (-1 where missing), without expanding it: a value repeated on every row of a
    dictionary-encoded column is one object, however many rows hold it (a 3 KB client name on 262,144 rows was
    800 MB of copies). A dictionary larger than the rows it serves gives only those rows' values."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if pa.types.is_dictionary(col.type) and len(col.dictionary) > len(col):
        col = col.dictionary_decode()  # a slice of a large dictionary's column: its own values only
    if pa.types.is_dictionary(col.type):
        values, indices = col.dictionary, col.indices
        if not _is_bytes(values.type):
            values = _text(values)
    else:
        encoded = (col if _is_bytes(col.type) else _text(col)).dictionary_encode()
        values, indices = encoded.dictionary, encoded.indices
    return values.to_pylist(), pc.fill_null(indices, -1).to_numpy(zero_copy_only=False).astype(np.int64)


def _is_scalar(t: pa.DataType) -> bool:
    """A type whose values have a text form a client or a label can be: text, integers, floats, booleans."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    return (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t)
            or pa.types.is_floating(t) or pa.types.is_boolean(t))


def _is_bytes(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_binary(t) or pa.types.is_large_binary(t)


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_decimal(t)


def _is_string(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _numbers(col: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(float64 values, True where a text value is not a number); nulls and bad text are NaN. Nothing is expanded
    or copied whole: a dictionary-encoded column's distinct values are parsed once and spread to its rows (a 1 MB
    text on 1,500 rows decoded was 1.5 GB, and its trimmed copy and Python list as much again), and text that
    is no plain number is parsed a value at a time."""
    if pa.types.is_dictionary(col.type) and len(col.dictionary) <= len(col):
        values, bad = _numbers(col.dictionary)
        index = pc.fill_null(col.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64)
        values, bad = np.append(values, np.nan), np.append(bad, False)  # index -1 (a missing value): NaN, reported so
        return values[index], bad[index]
    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()  # a slice of a large dictionary's column: its own values only
    not_number = np.zeros(len(col), dtype=bool)
    if _is_number(col.type):
        return pc.cast(col, pa.float64()).to_numpy(zero_copy_only=False), not_number
    try:
        return pc.cast(col, pa.float64()).to_numpy(zero_copy_only=False), not_number
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    values = np.full(len(col), np.nan)
    for i, scalar in enumerate(col):  # slow path, one value at a time: text that is not a plain number (or padded)
        v = scalar.as_py()
        if v is not None:
            try:
                values[i] = float(v)
            except ValueError:
                not_number[i] = True
    return values, not_number


class _Names:
    """Distinct values (client names) in order of first sight; each row gets its value's index."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}

    def rows(self, values: list, index: np.ndarray) -> np.ndarray:
        """int64 index per row of a column given as `_distinct` gives it; -1 where missing or empty."""
        lut = np.full(len(values) + 1, -1, dtype=np.int64)  # the last entry: a missing value (index -1)
        for k in np.unique(index[index >= 0]).tolist():  # the values some row holds (a dictionary may hold others)
            if values[k]:
                lut[k] = self.index.setdefault(values[k], len(self.index))
        return lut[index]

    def sorted(self, clients: np.ndarray) -> tuple[np.ndarray, tuple[str, ...]]:
        """The rows' indices into the sorted names, and those names."""
        names = sorted(self.index)
        remap = np.empty(max(len(names), 1), dtype=np.int64)
        for i, name in enumerate(names):
            remap[self.index[name]] = i
        return remap[clients], tuple(names)


class _Labels:
    """A label's text -> its class index (the module docstring says how); -1 unknown, -2 missing."""

    def __init__(self, labels: tuple[str, ...]) -> None:
        self.labels = labels
        self.index = {name: i for i, name in enumerate(labels)}
        self.by_position = not all(_INTEGER.fullmatch(x) for x in labels)

    def of(self, value: str) -> int:
        if value in self.index:
            return self.index[value]
        # an index has at most as many digits as the label count (int() of a 5,000-digit text raises)
        if self.by_position and len(value) <= 12 and _INTEGER.fullmatch(value) and 0 <= int(value) < len(self.labels):
            return int(value)
        return -1

    def rows(self, values: list, index: np.ndarray) -> np.ndarray:
        """int64 class per row of a column given as `_distinct` gives it: -1 where unknown, -2 where missing."""
        lut = np.asarray([self.of(v) for v in values] + [-2], dtype=np.int64)
        return lut[index]

    def expected(self) -> str:
        names = ", ".join(repr(x) for x in self.labels[:10]) + (", ..." if len(self.labels) > 10 else "")
        also = f", or an index 0..{len(self.labels) - 1}" if self.by_position else ""
        return f"the manifest's labels are {names}{also}"


# --- problems per file -----------------------------------------------------------------------------


class _Report:
    """Row problems of one file: each names "<file> row N"; past MAX_ROW_PROBLEMS of a kind they are counted."""

    def __init__(self, problems: Problems, url: str) -> None:
        self.problems, self.url, self.counts = problems, url, Counter[str]()
        self.errors_before = len(problems.errors)

    def rows(self, kind: str, rows: np.ndarray, offset: int, what: Callable[[int], str]) -> None:
        """An error per row in `rows` (indices within a batch starting at file row `offset`)."""
        room = max(0, MAX_ROW_PROBLEMS - self.counts[kind])
        for r in rows[:room]:
            self.problems.error(kind, f"{self.url} row {offset + int(r) + 1}", f"{what(int(r))} {ROW_NOTE}")
        self.counts[kind] += len(rows)

    def file(self, kind: str, what: str) -> None:
        self.problems.error(kind, self.url, what)

    def finish(self) -> bool:
        """Count the problems not listed; True when this file had no error."""
        for kind, n in self.counts.items():
            if n > MAX_ROW_PROBLEMS:
                self.problems.error(kind, self.url, f"{n - MAX_ROW_PROBLEMS} more rows like the ones above ({n} in all)")
        return len(self.problems.errors) == self.errors_before


# --- the inputs ------------------------------------------------------------------------------------


class _Parts:
    """One file's rows of an array, filled batch by batch: preallocated when the row count is known (a
    Parquet file's metadata), else a list of batches joined at the end (CSV)."""

    def __init__(self, rows: int | None, tail: tuple[int, ...], dtype: type) -> None:
        self.tail, self.dtype, self.pos = tail, dtype, 0
        self.buf = np.empty((rows, *tail), dtype=dtype) if rows is not None else None
        self.parts: list[np.ndarray] = []

    def take(self, k: int) -> np.ndarray:
        """A writable array for the next k rows."""
        if self.buf is not None and self.pos + k <= len(self.buf):
            out = self.buf[self.pos:self.pos + k]
        else:
            out = np.empty((k, *self.tail), dtype=self.dtype)
            self.parts.append(out)
        self.pos += k
        return out

    def done(self) -> np.ndarray:
        if self.buf is not None and not self.parts:
            return self.buf[: self.pos]
        head = [self.buf[: min(self.pos, len(self.buf))]] if self.buf is not None else []
        return np.concatenate(head + self.parts) if head or self.parts else np.empty((0, *self.tail), self.dtype)


def _feature_batch(batch: pa.RecordBatch, features: tuple[str, ...], out: np.ndarray, report: _Report,
                   offset: int) -> None:
    """Fill out[:, j] with feature j of the batch; every missing, non-finite or non-number value is a row error."""
    for j, name in enumerate(features):
        col = batch.column(name)
        values, not_number = _numbers(col)
        with np.errstate(over="ignore", invalid="ignore"):
            out[:, j] = values
        if not_number.any():
            report.rows("not a number", np.flatnonzero(not_number), offset,
                        lambda r, c=col, n=name: f"column {n!r} holds {shown(c[r].as_py())}, not a number")
            out[not_number, j] = 0.0  # reported; not reported again as non-finite
    bad_rows, bad_cols = np.nonzero(~np.isfinite(out))
    for r, j in zip(bad_rows[:MAX_ROW_PROBLEMS].tolist(), bad_cols[:MAX_ROW_PROBLEMS].tolist(), strict=True):
        v = batch.column(features[j])[r].as_py()
        quoted = "missing" if v is None else f"{shown(v)}, not a finite float32"
        report.rows("bad feature value", np.asarray([r]), offset, lambda _r, f=features[j], s=quoted: f"feature {f!r} is {s}")
    if len(bad_rows) > MAX_ROW_PROBLEMS:
        report.counts["bad feature value"] += len(bad_rows) - MAX_ROW_PROBLEMS


class _Images:
    """The image column: paths relative to the source, or encoded bytes; decoded as the row is read."""

    def __init__(self, source: DataSource, objects: list[SourceObject], layout: TableLayout,
                 image_size: int | None, budget: DecodeBudget) -> None:
        from fedpipe.data.files.images import ImageStack

        self.source, self.by_key, self.column = source, {o.key: o for o in objects}, layout.image_column
        self.stack = ImageStack(layout.channels, image_size, budget=budget)
        self.used: dict[str, SourceObject] = {}

    def batch(self, batch: pa.RecordBatch, report: _Report, offset: int) -> None:
        values, index = _distinct(batch.column(self.column))
        for r, k in enumerate(index.tolist()):
            if self.stack.budget.exhausted:
                return
            value = values[k] if k >= 0 else None
            where = f"{report.url} row {offset + r + 1}"
            data = self._bytes(value, r, report, offset)
            if data is None:
                continue
            if isinstance(value, str):
                where = f"{self.source.url(value.removeprefix('./'))} ({where})"
            self.stack.add(data, where, report.problems)

    def _bytes(self, value: str | bytes | None, r: int, report: _Report, offset: int) -> bytes | None:
        row = np.asarray([r])
        if value is None or len(value) == 0:
            report.rows("missing image", row, offset, lambda _r: f"column {self.column!r} is empty")
            return None
        if isinstance(value, bytes):
            return value
        obj = self.by_key.get(value.removeprefix("./"))
        if obj is None:
            report.rows("missing image", row, offset, lambda _r: f"image {shown(value)} is not a file under the source "
                        "(a path in an image column is relative to the source)")
            return None
        try:
            data = self.source.read(obj, MAX_IMAGE_BYTES)
        except DataError as exc:
            message = str(exc)
            report.rows("unreadable image", row, offset, lambda _r: message)
            return None
        self.used[obj.key] = obj
        return data


class _Texts:
    """The text column, encoded once every row is read (one vocabulary for the table), counted as it is read: the
    words' counts (for the vocabulary) and each row's first TEXT_MAX_LENGTH words, as numbers of words; never
    every row's words (a 1 MB text of one repeated word is 350,000 word objects, 22 MB; 50 rows of it were 1.5 GB).
    A text repeated on many rows (a dictionary-encoded column) is tokenized once."""

    def __init__(self, column: str, budget: DecodeBudget) -> None:
        self.column, self.budget = column, budget
        self.counts: Counter[str] = Counter()  # every word of every row: the vocabulary is their most frequent
        self.numbers: dict[str, int] = {}  # word -> its number, for the words a row keeps
        self.heads: list[np.ndarray] = []  # per batch: int32 [rows, TEXT_MAX_LENGTH] word numbers, -1 past the end

    def batch(self, batch: pa.RecordBatch, report: _Report, offset: int) -> None:
        values, index = _distinct(batch.column(self.column))
        missing = np.flatnonzero(index < 0)
        if len(missing):
            report.rows("missing text", missing, offset, lambda _r: f"column {self.column!r} is empty")
        held, first, times = np.unique(index, return_index=True, return_counts=True)  # the values rows hold
        heads = np.full((len(values) + 1, TEXT_MAX_LENGTH), -1, dtype=np.int32)  # the last: a missing text
        words_before = len(self.counts)
        for k, r, n in zip(held.tolist(), first.tolist(), times.tolist(), strict=True):
            if k < 0:
                continue
            text = values[k]
            if not self.budget.fits(TOKENIZING_BYTES * len(text), f"{report.url} row {offset + r + 1}",
                                    f"tokenizing this text of {len(text):,} characters", report.problems):
                return
            words = tokenize(text)
            if n == 1:
                self.counts.update(words)
            else:  # the same text on several rows: its words counted as often
                for word, m in Counter(words).items():
                    self.counts[word] += m * n
            kept = [self.numbers.setdefault(w, len(self.numbers)) for w in words[:TEXT_MAX_LENGTH]]
            heads[k, : len(kept)] = kept
            del words
        # the new distinct words, and each row's word numbers (int32 now, int64 token ids at the end)
        grown = (len(self.counts) - words_before) * WORD_BYTES + len(index) * TEXT_MAX_LENGTH * 12
        if self.budget.charge(grown, report.url, f"the words of rows {offset + 1:,} to {offset + len(index):,}", report.problems):
            self.heads.append(heads[index])

    def result(self) -> np.ndarray:
        """int64 [rows, TEXT_MAX_LENGTH] token ids: `text.encode` of every row's words under `text.build_vocabulary`
        of all of them (the same ids, computed from the counts and the kept words)."""
        vocabulary = rank_words(self.counts, TEXT_VOCAB_SIZE)  # every row: see the module docstring
        lut = np.full(len(self.numbers) + 1, PAD_ID, dtype=np.int64)  # the last entry: past a text's end (-1)
        for word, number in self.numbers.items():
            lut[number] = vocabulary.get(word, UNK_ID)
        if not self.heads:
            return np.empty((0, TEXT_MAX_LENGTH), dtype=np.int64)
        return lut[np.concatenate(self.heads)]


# --- reading ---------------------------------------------------------------------------------------


@dataclass
class _Read:
    """What the files gave so far: per file its arrays, and the rows' file boundaries."""

    clients: _Names
    labels: _Labels
    x: list[np.ndarray]
    y: list[np.ndarray]
    c: list[np.ndarray]
    ids: list[np.ndarray]
    urls: list[str]
    starts: list[int]
    total: int = 0


def _inputs_of(layout: TableLayout) -> list[str]:
    return list(layout.features) or [layout.image_column or layout.text_column]  # type: ignore[list-item]


def _required(layout: TableLayout) -> list[str]:
    named = [layout.id_column] if layout.id_column else []
    return list(dict.fromkeys([layout.client_column, layout.label_column, *_inputs_of(layout), *named]))


def _identity_batch(batch: pa.RecordBatch, layout: TableLayout, out: np.ndarray) -> None:
    """Each row's identity (`fedpipe.data.identity`): its client and its id column, else its client and its
    input values (as read: text, or an image column's bytes); never its label. The values become Python objects
    IDENTITY_VALUES at a time, each distinct one once (`_distinct`), and rows naming the same values are hashed
    once: a 1 MB text on 50 rows is not 50 copies of it."""
    named = [layout.id_column] if layout.id_column else _inputs_of(layout)
    columns = [batch.column(layout.client_column), *(batch.column(c) for c in named)]
    step = max(1, IDENTITY_VALUES // len(columns))
    for start in range(0, len(batch), step):
        parts = [_distinct(col.slice(start, step)) for col in columns]
        keys = np.stack([index for _, index in parts], axis=1)
        repeated = all(len(values) < len(index) for values, index in parts[1:])  # else every row differs
        named_by, row_of = np.unique(keys, axis=0, return_inverse=True) if repeated else (keys, None)
        # per column, each named row's value (the same objects, not copies; a missing value: b"")
        values = [[held[k] for k in ks] for held, ks in zip([[*v, b""] for v, _ in parts], named_by.T.tolist(), strict=True)]
        ids = np.fromiter((identity_of(*row) for row in zip(*values, strict=True)), dtype=np.uint64, count=len(named_by))
        out[start : start + step] = ids if row_of is None else ids[row_of.reshape(-1)]


def _schema_problems(table: _Table, layout: TableLayout, report: _Report) -> bool:
    """Errors for missing columns and for columns whose type cannot mean what the manifest says; True if any."""
    missing = [c for c in _required(layout) if c not in table.types]
    if missing:
        report.file("missing column", f"no column {', '.join(map(repr, missing))} (the manifest names it); the file "
                    f"has {', '.join(map(repr, table.names[:50]))}{', ...' if len(table.names) > 50 else ''}")
        return True
    if not table.typed:
        return False
    wrong = [(c, "text, integers or floats") for c in (layout.client_column, layout.label_column, layout.id_column)
             if c and not _is_scalar(table.types[c])]
    wrong += [(c, "numbers") for c in layout.features if not (_is_number(table.types[c]) or _is_string(table.types[c]))]
    if layout.image_column and not (_is_string(table.types[layout.image_column])
                                    or pa.types.is_binary(table.types[layout.image_column])
                                    or pa.types.is_large_binary(table.types[layout.image_column])):
        wrong.append((layout.image_column, "paths (text) or image bytes (binary)"))
    if layout.text_column and not _is_string(table.types[layout.text_column]):
        wrong.append((layout.text_column, "text"))
    for column, expected in wrong:
        report.file("wrong column type", f"column {column!r} has type {table.types[column]}; it must hold {expected}")
    return bool(wrong)


def _read_file(source: DataSource, obj: SourceObject, layout: TableLayout, inputs: _Images | _Texts | None,
               read: _Read, problems: Problems, budget: DecodeBudget) -> None:
    """Read one table file into `read` (its rows are added only when it had no error), charging the budget
    with what its columns take decoded before they are."""
    report = _Report(problems, source.url(obj.key))
    try:
        table = _open_table(source.read(obj, MAX_TABLE_BYTES), obj.key)
    except DataError as exc:
        return report.file("unreadable table", str(exc))
    except (pa.ArrowException, OSError) as exc:
        return report.file("unreadable table", f"not a readable {obj.key.rsplit('.', 1)[-1]} file: {exc}")
    if _schema_problems(table, layout, report):
        return None
    n = table.num_rows
    if table.uncompressed is not None and table.uncompressed(_required(layout)) > budget.limit - budget.used:
        return budget.charge(table.uncompressed(_required(layout)), report.url, "its columns, decompressed,", problems) and None
    row_bytes = 24 + 4 * len(layout.features)  # label, client and identity per row, and the features
    if n is not None and not budget.charge(n * row_bytes, report.url, f"its {n:,} rows (as its metadata says)", problems):
        return None
    x = _Parts(n, (len(layout.features),), np.float32) if layout.features else None
    y, c, ids = _Parts(n, (), np.int64), _Parts(n, (), np.int64), _Parts(n, (), np.uint64)
    offset = 0
    try:
        for batch in table.batches(_required(layout), True):
            if not budget.charge(_batch_bytes(batch) + (len(batch) * row_bytes if n is None else 0), report.url,
                                 f"rows {offset + 1:,} to {offset + len(batch):,}", problems):
                return None
            _rows_batch(batch, layout, read, report, offset, y.take(len(batch)), c.take(len(batch)))
            _identity_batch(batch, layout, ids.take(len(batch)))
            if x is not None:
                _feature_batch(batch, layout.features, x.take(len(batch)), report, offset)
            if inputs is not None:
                inputs.batch(batch, report, offset)
                if budget.exhausted:  # an image or a text past the budget (named by the error)
                    return None
            offset += len(batch)
    except (pa.ArrowException, OSError) as exc:
        return report.file("unreadable table", f"reading stopped after {offset} rows: {exc}")
    if report.finish():
        read.x += [x.done()] if x is not None else []
        read.y.append(y.done())
        read.c.append(c.done())
        read.ids.append(ids.done())
    read.urls.append(report.url)
    read.starts.append(read.total)
    read.total += offset
    return None


def _rows_batch(batch: pa.RecordBatch, layout: TableLayout, read: _Read, report: _Report, offset: int,
                y: np.ndarray, c: np.ndarray) -> None:
    """Fill a batch's labels and clients; a missing client, a missing or unknown label is a row error."""
    c[:] = read.clients.rows(*_distinct(batch.column(layout.client_column)))
    report.rows("missing client", np.flatnonzero(c < 0), offset,
                lambda _r: f"client column {layout.client_column!r} is empty")
    labels, index = _distinct(batch.column(layout.label_column))
    y[:] = read.labels.rows(labels, index)
    report.rows("missing label", np.flatnonzero(y == -2), offset,
                lambda _r: f"label column {layout.label_column!r} is empty")
    report.rows("unknown label", np.flatnonzero(y == -1), offset,
                lambda r: f"label {shown(labels[index[r]])} is not a label of the manifest; {read.labels.expected()}")


def _where(urls: list[str], starts: list[int]) -> Callable[[int], str]:
    """Row i of the whole table -> "<file> row N", found from the files' first rows (no list of strings)."""
    first = np.asarray(starts, dtype=np.int64)

    def where(i: int) -> str:
        f = int(np.searchsorted(first, i, side="right")) - 1
        return f"{urls[f]} row {i - int(first[f]) + 1}"

    return where


def read_table(source: DataSource, objects: list[SourceObject], manifest: DataManifest, image_size: int | None,
               problems: Problems, budget: DecodeBudget | None = None) -> tuple[ClientRows | None, list[SourceObject]]:
    """Every row of the table files, or None when any error was found (each is in `problems`), and the
    objects read (table files, and the images a path column names)."""
    layout = manifest.source
    assert isinstance(layout, TableLayout)
    errors_before = len(problems.errors)
    files = _table_files(source, objects, layout, problems)
    budget = budget if budget is not None else DecodeBudget()
    inputs: _Images | _Texts | None = None
    if layout.image_column:
        inputs = _Images(source, objects, layout, image_size, budget)
    elif layout.text_column:
        inputs = _Texts(layout.text_column, budget)
    read = _Read(_Names(), _Labels(manifest.labels), [], [], [], [], [], [])
    for obj in files:
        if budget.exhausted:
            break
        _read_file(source, obj, layout, inputs, read, problems, budget)
    used = files + (list(inputs.used.values()) if isinstance(inputs, _Images) else [])
    where = _where(read.urls, read.starts)
    if len(problems.errors) > errors_before or not files:
        return None, used
    if isinstance(inputs, _Images):
        inputs.stack.finish(problems)
        if len(problems.errors) > errors_before:
            return None, used
        x = inputs.stack.array()
    elif isinstance(inputs, _Texts):
        x = inputs.result()
    else:
        x = _join(read.x, (0, len(layout.features)), np.float32)
    clients, names = read.clients.sorted(_join(read.c, (0,), np.int64))
    vocab = None
    if layout.text_column:

        vocab = TEXT_VOCAB_SIZE
    return ClientRows(x, _join(read.y, (0,), np.int64), clients, names, where, vocab, _join(read.ids, (0,), np.uint64)), used


def _join(parts: list[np.ndarray], empty: tuple[int, ...], dtype: type) -> np.ndarray:
    """The files' arrays as one (no copy for a single file)."""
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.empty(empty, dtype=dtype)
