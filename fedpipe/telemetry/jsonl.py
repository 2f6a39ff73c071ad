"""Round events as JSON lines in the store: <run>/report/rounds-<phase>.jsonl, one line per round."""

from __future__ import annotations

import json
import math

from fedpipe.errors import CorruptArtifactError
from fedpipe.safe_load import check_size, decode_text
from fedpipe.store.base import Store
from fedpipe.telemetry.events import PhaseEvent, RoundEvent

#: A phase's round log: a line is about 500 bytes plus a method's details (pFedMB's alphas: a few KB
#: for 50 clients), so even the config's bound of 100,000 rounds at 2 KB a line is 200 MB. Beyond
#: 256 MiB the object is not a round log (or was damaged), and reading it would only exhaust memory.
MAX_ROUND_LOG_BYTES = 256 * 2**20
ADVICE = "Delete it (its phase's rounds are then not in the report's curves) or rerun the phase."


def read_lines(store: Store, key: str) -> list[dict]:
    """The round lines of one JSONL object, its size checked before it is fetched; a line that is
    not a JSON object with a round number is CorruptArtifactError naming the object."""
    where = store.url(key)
    known = store.size(key)
    if known is not None:
        check_size(known, MAX_ROUND_LOG_BYTES, where, "round log", CorruptArtifactError, ADVICE)
    data = store.get(key)
    check_size(len(data), MAX_ROUND_LOG_BYTES, where, "round log", CorruptArtifactError, ADVICE)
    lines = []
    for number, line in enumerate(decode_text(data, where, "round log", CorruptArtifactError).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise CorruptArtifactError(f"{where} line {number} is not JSON ({str(e).splitlines()[0][:100]}). {ADVICE}") from None
        if not isinstance(row, dict) or not isinstance(row.get("round"), int):
            raise CorruptArtifactError(f"{where} line {number} is not a round record (no round number). {ADVICE}")
        lines.append(row)
    return lines


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    return value


class JsonlSink:
    """Keeps the phase's lines and rewrites the object after every round (atomic in every store).

    After a resume, lines of rounds that are run again are dropped, so each round appears once.
    """

    def __init__(self, store: Store, key: str):
        self.store, self.key = store, key
        self.lines: list[dict] = []
        if store.exists(key):
            self.lines = read_lines(store, key)

    def phase_started(self, event: PhaseEvent) -> None:
        self.lines = [line for line in self.lines if line["round"] < event.first_round]

    def round_finished(self, event: RoundEvent) -> None:
        self.lines.append(_clean(event.to_dict()))
        self.store.put_text(self.key, "".join(json.dumps(line) + "\n" for line in self.lines))

    def phase_finished(self, event: PhaseEvent) -> None:
        pass

    def close(self) -> None:
        pass


def read_rounds(store: Store, keys: list[str]) -> list[dict]:
    """All round lines of the given JSONL objects, in round order."""
    rows = []
    for key in keys:
        if store.exists(key):
            rows += read_lines(store, key)
    return sorted(rows, key=lambda r: r["round"])
