"""A site's own log of every message it took or refused: `messages.jsonl` in its folder, one JSON line per message
(time, run, method, kind, round, phase, decision, reason, bytes that left the site, seconds), written by its worker
(`fedpipe.federation.worker`) and summed up by `fedpipe site check --state`. No Flower, no torch."""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from pathlib import Path

LOG = "messages.jsonl"
#: what `summary` reads of the log at most (its newest part): a log is a line per message
MAX_READ_BYTES = 16 * 2**20


def append(folder: str | Path, entry: dict) -> None:
    with open(Path(folder) / LOG, "a") as f:
        f.write(json.dumps({"time": round(time.time(), 3), **entry}, sort_keys=True) + "\n")


def read(folder: str | Path) -> list[dict]:
    """The log's entries (its newest MAX_READ_BYTES; a line that is not JSON is skipped)."""
    path = Path(folder) / LOG
    if not path.exists():
        return []
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(max(0, size - MAX_READ_BYTES))
        text = f.read().decode("utf-8", errors="replace")
    entries = []
    for line in text.splitlines()[1 if size > MAX_READ_BYTES else 0:]:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            entries.append(entry)
    return entries


def summary(folder: str | Path) -> list[str]:
    """A line per run: its messages taken and refused, the bytes that left the site, and each refusal's reason."""
    runs: dict[str, Counter] = defaultdict(Counter)
    reasons: dict[str, Counter] = defaultdict(Counter)
    for e in read(folder):
        run = f"{e.get('run', '?')} ({e.get('method', '?')})"
        runs[run][str(e.get("decision", "?"))] += 1
        runs[run]["bytes"] += int(e.get("bytes_out", 0) or 0)
        if e.get("decision") in ("refused", "failed"):
            reasons[run][str(e.get("reason", ""))[:160]] += 1
    lines = []
    for run, c in runs.items():
        lines.append(f"{run}: {c['took']} messages taken, {c['refused']} refused, {c['failed'] + c['error']} failed, "
                     f"{c['bytes'] / 1e6:.3f} MB sent")
        lines += [f"    {n} x {reason}" for reason, n in reasons[run].most_common(5)]
    return lines or ["no message taken or refused yet"]
