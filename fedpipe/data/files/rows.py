"""What a layout reader returns, and the problems it found (each naming its file and row)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from fedpipe.errors import DataError

MAX_LISTED = 20  # problems of one kind spelled out in a message; the rest are counted
MAX_WHERE_CHARS = 500  # a problem's "where" and "what" as stored: a file name or a quoted value is cut, never
MAX_WHAT_CHARS = 1000  # repeated whole (a message quoting a 1 MB cell, a thousand times, was 21 MB of output)


def shown(value: object, limit: int = 80) -> str:
    """A value quoted in a message: its repr, cut to `limit` characters (a cell can be megabytes long)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


@dataclass(frozen=True)
class ClientRows:
    """Every sample of a user's dataset with its client, in the contract of `fedpipe.data`."""

    x: np.ndarray  # uint8 NCHW images, int64 [N, T] token ids, or float32 [N, F] features
    y: np.ndarray  # int64 class indices into the manifest's labels
    clients: np.ndarray  # int64 per row: index into client_names
    client_names: tuple[str, ...]
    where: Callable[[int], str]  # row i -> where it came from, for messages ("s3://b/p/a/cat/1.png", "t.parquet row 17")
    vocab_size: int | None = None  # token sequences only
    ids: np.ndarray | None = None  # uint64 per row: its identity (`fedpipe.data.identity`), what fixes its split
    skipped: int = 0  # samples decoded but not kept (images of another size than the first): an error says why


@dataclass(frozen=True)
class Problem:
    severity: Literal["error", "warning"]
    kind: str  # short and stable ("unreadable image", "unknown label", ...): problems are grouped by it
    where: str  # the file, and the row for tables
    what: str  # one sentence: what is wrong there

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


@dataclass
class Problems:
    """Problems found while reading, in the order found. Errors stop a run before anything is written;
    warnings are listed once."""

    found: list[Problem] = field(default_factory=list)

    def error(self, kind: str, where: str, what: str) -> None:
        self.found.append(Problem("error", kind, where[:MAX_WHERE_CHARS], what[:MAX_WHAT_CHARS]))

    def warning(self, kind: str, where: str, what: str) -> None:
        self.found.append(Problem("warning", kind, where[:MAX_WHERE_CHARS], what[:MAX_WHAT_CHARS]))

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.found if p.severity == "error"]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.found if p.severity == "warning"]

    def summary(self, severity: str) -> list[str]:
        """One block per kind: up to MAX_LISTED problems spelled out, then how many more."""
        lines: list[str] = []
        kinds: dict[str, list[Problem]] = {}
        for p in self.found:
            if p.severity == severity:
                kinds.setdefault(p.kind, []).append(p)
        for kind, items in kinds.items():
            lines.append(f"{kind} ({len(items)}):")
            lines += [f"  - {p}" for p in items[:MAX_LISTED]]
            if len(items) > MAX_LISTED:
                lines.append(f"  ... and {len(items) - MAX_LISTED} more")
        return lines

    def raise_if_errors(self, source: str) -> None:
        if self.errors:
            raise DataError(
                f"The data under {source} has {len(self.errors)} problem(s); nothing was written. Fix or remove "
                "the files named below (`fedpipe data check SOURCE` lists every problem):\n" + "\n".join(self.summary("error"))
            )
