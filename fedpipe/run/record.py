"""The run record (``<run>/run.json``): a run folder belongs to one configuration."""

from __future__ import annotations

import json

from fedpipe.errors import ConfigError, CorruptArtifactError, StoreError
from fedpipe.run.config import RunConfig
from fedpipe.run.layout import RunLayout
from fedpipe.safe_load import MAX_RECORD_BYTES, read_store_json
from fedpipe.store import Store

FRESH = "Start the run over with `fedpipe run --fresh`."


def check_record(store: Store, layout: RunLayout, cfg: RunConfig, *, create: bool) -> None:
    """The run folder belongs to one configuration; refuse to mix another into it. A missing record
    is written (`create`) or an error."""
    key = layout.run_record
    if not store.exists(key):
        if create:
            record = {"run_id": layout.run_id, "fingerprint": cfg.fingerprint(), "config": cfg.model_dump(mode="json")}
            store.put_text(key, json.dumps(record, indent=2))
            return
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
