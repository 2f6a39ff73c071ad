"""Round events as JSON lines in the store: <run>/report/rounds-<phase>.jsonl, one line per round."""

from __future__ import annotations

import json
import math

from fedpipe.store.base import Store
from fedpipe.telemetry.events import PhaseEvent, RoundEvent


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
            self.lines = [json.loads(line) for line in store.get_text(key).splitlines() if line.strip()]

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
            rows += [json.loads(line) for line in store.get_text(key).splitlines() if line.strip()]
    return sorted(rows, key=lambda r: r["round"])
