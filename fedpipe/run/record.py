"""The run record (``<run>/run.json``): a run folder belongs to one configuration; and the run's
owner (``<run>/owner.json``): one writer at a time.

The record is created only-if-absent (`Store.create`), so two first writers cannot both write it,
and it carries ``format`` = `RECORD_FORMAT`: `fedpipe run --fresh` deletes nothing under a prefix
whose record is not fedpipe's (`fedpipe_record_problem`).

`RunOwner` is the single-writer lock of a run. `claim` creates the owner record only-if-absent
(S3 ``If-None-Match: *``; a locked check in a folder) with the owner's token and a heartbeat; a
second writer stops with a StoreError naming the owner (it does not wait: a pipeline task that
waited could hang for a phase's whole length; a clear message lets the operator decide). The same
owner proceeds: the token is ``FEDPIPE_OWNER`` or the KFP run id (``KFP_RUN_ID``) when set, so a
retried KFP task of the same pipeline run resumes; otherwise host, pid and thread. An owner whose
heartbeat is older than ``FEDPIPE_OWNER_STALE_SECONDS`` (default 900) can be taken over explicitly
(``--take-over``, a compare-and-swap on the record: of two taking over, one wins); one on this host
whose process is gone is taken over without asking. `beat` (before every checkpoint) refreshes the
heartbeat and stops a writer whose run was taken over; `release` ends the claim.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from fedpipe.errors import ConfigError, CorruptArtifactError, StoreError
from fedpipe.run.config import RunConfig
from fedpipe.run.layout import RunLayout
from fedpipe.safe_load import MAX_RECORD_BYTES, read_store_json
from fedpipe.store import Store
from fedpipe.store.base import sha256_hex

log = logging.getLogger(__name__)

FRESH = "Start the run over with `fedpipe run --fresh`."
RECORD_FORMAT = "fedpipe.run-record/1"
OWNER_FORMAT = "fedpipe.run-owner/1"
ENV_OWNER = "FEDPIPE_OWNER"
ENV_KFP_RUN = "KFP_RUN_ID"
ENV_STALE = "FEDPIPE_OWNER_STALE_SECONDS"
DEFAULT_STALE_SECONDS = 900.0


def check_record(store: Store, layout: RunLayout, cfg: RunConfig, *, create: bool) -> None:
    """The run folder belongs to one configuration; refuse to mix another into it. A missing record
    is written (`create`) or an error."""
    key = layout.run_record
    if not store.exists(key):
        if create:
            record = {"format": RECORD_FORMAT, "run_id": layout.run_id, "fingerprint": cfg.fingerprint(),
                      "config": cfg.model_dump(mode="json")}
            if store.create(key, json.dumps(record, indent=2).encode()):
                return  # else another writer created it first: check theirs like any existing record
        else:
            raise StoreError(f"Run {layout.run_id!r} has not been partitioned yet ({store.url(key)} is missing). Run `fedpipe partition` (or `fedpipe run`) first.")
    record = read_store_json(store, key, "run record", MAX_RECORD_BYTES, CorruptArtifactError, FRESH)
    if not isinstance(record, dict):
        raise CorruptArtifactError(f"{store.url(key)} is not a valid run record: not a JSON object. {FRESH}")
    if record.get("fingerprint") != cfg.fingerprint():
        old = record.get("config")
        diff = config_diff(old if isinstance(old, dict) else {}, cfg.model_dump(mode="json"))
        raise ConfigError(
            f"Run {layout.run_id!r} in {store.url()} was made with a different configuration "
            f"({diff}). Give this config another run.id, or pass --fresh to start that run over."
        )


def config_diff(old: dict, new: dict, prefix: str = "") -> str:
    """'train.rounds: 3 -> 5; ...' for every leaf that differs."""
    changes = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            sub = config_diff(a, b, f"{prefix}{key}.")
            if sub:
                changes.append(sub)
        elif a != b:
            changes.append(f"{prefix}{key}: {json.dumps(a)} -> {json.dumps(b)}")
    return "; ".join(changes)


def fedpipe_record_problem(store: Store, layout: RunLayout) -> str | None:
    """Why the record under `layout`'s folder does not prove the folder is a fedpipe run (None: it
    does): missing, unreadable, without fedpipe's format, or for another run id. A record written
    before the format field (run_id, fingerprint and config, nothing else) still counts."""
    key = layout.run_record
    if not store.exists(key):
        return f"there is no fedpipe run record ({store.url(key)} is missing)"
    try:
        record = read_store_json(store, key, "run record", MAX_RECORD_BYTES, CorruptArtifactError, "")
    except StoreError as exc:
        return f"its run record cannot be read ({exc})"
    if not isinstance(record, dict):
        return f"{store.url(key)} is not a fedpipe run record (not a JSON object)"
    legacy = set(record) == {"run_id", "fingerprint", "config"}
    if record.get("format") != RECORD_FORMAT and not legacy:
        return f"{store.url(key)} is not a fedpipe run record (its format is {record.get('format')!r}, not {RECORD_FORMAT!r})"
    if record.get("run_id") != layout.run_id or not isinstance(record.get("fingerprint"), str):
        return f"{store.url(key)} records run {record.get('run_id')!r}, not {layout.run_id!r}"
    return None


def owner_token() -> str:
    """Who this writer is: FEDPIPE_OWNER, else the KFP run id, else host, pid and thread."""
    for name in (ENV_OWNER, ENV_KFP_RUN):
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return f"{socket.gethostname()}:pid{os.getpid()}:thread{threading.get_ident()}"


def stale_seconds_from_env() -> float:
    raw = os.environ.get(ENV_STALE, "").strip()
    try:
        return float(raw) if raw else DEFAULT_STALE_SECONDS
    except ValueError:
        raise ConfigError(f"{ENV_STALE}={raw!r} is not a number of seconds (default {DEFAULT_STALE_SECONDS:g}).") from None


def _process_gone(host: object, pid: object) -> bool:
    """True when the owner ran on this host and its process no longer exists."""
    if host != socket.gethostname() or not isinstance(pid, int) or pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


class RunOwner:
    """The single-writer claim on one run (the module's docstring says how)."""

    def __init__(self, store: Store, layout: RunLayout, token: str | None = None, stale_seconds: float | None = None,
                 clock: Callable[[], float] = time.time, *, take_over: bool = False):
        self.store, self.layout, self.clock, self.take_over = store, layout, clock, take_over
        self._depth = 0  # `with owner:` nests; the outermost claims and releases
        self.token = token or owner_token()
        self.stale_seconds = stale_seconds_from_env() if stale_seconds is None else float(stale_seconds)
        self.held = False

    def __enter__(self) -> RunOwner:
        if self._depth == 0:
            self.claim(take_over=self.take_over)
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.release()

    def _body(self) -> bytes:
        record = {"format": OWNER_FORMAT, "run_id": self.layout.run_id, "owner": self.token,
                  "host": socket.gethostname(), "pid": os.getpid(), "heartbeat": self.clock()}
        return json.dumps(record, indent=2).encode()

    def current(self) -> tuple[dict, str] | None:
        """The owner record now and the sha256 of its bytes; None when the run has no owner. A record
        that is not one (damaged, foreign) reads as an unknown owner that never beat."""
        try:
            raw = self.store.get(self.layout.owner)
        except CorruptArtifactError:
            return {"owner": "<unreadable owner record>", "heartbeat": 0.0}, sha256_hex(b"")
        except StoreError:
            if self.store.exists(self.layout.owner):
                raise
            return None
        try:
            record = json.loads(raw)
        except ValueError:
            record = None
        if not isinstance(record, dict) or record.get("format") != OWNER_FORMAT:
            record = {"owner": "<unreadable owner record>", "heartbeat": 0.0}
        return record, sha256_hex(raw)

    def describe(self, record: dict) -> str:
        beat = record.get("heartbeat")
        age = self.clock() - beat if isinstance(beat, (int, float)) else float("inf")
        return f"{record.get('owner')!r} (last heartbeat {age:.0f} s ago)"

    def claim(self, *, take_over: bool = False) -> None:
        """Become the run's one writer, or raise StoreError naming the owner (see the module)."""
        for _ in range(5):  # each turn loses only to a writer that changed the record meanwhile
            if self.store.create(self.layout.owner, self._body()):
                self.held = True
                return
            found = self.current()
            if found is None:
                continue  # released meanwhile
            record, digest = found
            if record.get("owner") == self.token or self._may_take(record, take_over):
                if self.store.replace_if(self.layout.owner, self._body(), digest):
                    if record.get("owner") != self.token:
                        log.warning("Run %s: took over from %s.", self.layout.run_id, self.describe(record))
                    self.held = True
                    return
                continue
            raise StoreError(self._refusal(record, take_over))
        raise StoreError(f"Run {self.layout.run_id!r}: could not claim {self.store.url(self.layout.owner)}; other writers keep changing it.")

    def _may_take(self, record: dict, take_over: bool) -> bool:
        if _process_gone(record.get("host"), record.get("pid")):
            return True
        beat = record.get("heartbeat")
        stale = not isinstance(beat, (int, float)) or self.clock() - beat >= self.stale_seconds
        return take_over and stale

    def _refusal(self, record: dict, take_over: bool) -> str:
        who = self.describe(record)
        head = f"Run {self.layout.run_id!r} in {self.store.url()} is being written by {who}; one run has one writer at a time."
        if take_over:
            return (f"{head} Its heartbeat is younger than {self.stale_seconds:g} s ({ENV_STALE}), so it looks alive: "
                    "--take-over refused. Stop it, or wait until its heartbeat is that old.")
        return (f"{head} Wait for it to finish, give this config another run.id, or, if that writer is dead, "
                f"pass --take-over once its heartbeat is {self.stale_seconds:g} s old ({ENV_STALE}).")

    def beat(self) -> None:
        """Refresh the heartbeat; raise StoreError when the run is no longer ours (taken over)."""
        found = self.current()
        if found is None or found[0].get("owner") != self.token:
            who = "nobody (its owner record was deleted)" if found is None else self.describe(found[0])
            raise StoreError(f"Run {self.layout.run_id!r} is now owned by {who}, not by {self.token!r}: this writer stops.")
        if not self.store.replace_if(self.layout.owner, self._body(), found[1]):
            self.beat()  # changed between the read and the write: check again who owns it

    def release(self) -> None:
        """End this writer's claim (the record is left alone when someone else holds it now)."""
        if not self.held:
            return
        self.held = False
        found = self.current()
        if found is not None and found[0].get("owner") == self.token:
            self.store.delete(self.layout.owner)
