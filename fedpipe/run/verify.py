"""The run manifest (``<run>/manifest.json``) and `verify_run`, which checks a finished run against it.

The evaluate step writes the manifest last, after the report: every artifact key of the run with
its sha256 and size at that moment. A store's write is atomic, so a manifest that exists belongs to
a run that finished. `verify_run` reads every listed artifact back and compares: each one is
intact, missing, or damaged (its bytes differ from what was written). Files in the run folder that
the manifest does not list (a later partial rerun, a file copied in by hand) are named but are not
damage.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime

from fedpipe.errors import CorruptArtifactError, StoreError
from fedpipe.run.layout import RunLayout
from fedpipe.safe_load import read_store_json
from fedpipe.store.base import Store, sha256_hex

log = logging.getLogger(__name__)

FORMAT = "fedpipe.run-manifest"
MANIFEST_LIMIT = 256 * 2**20  # one line per artifact: 256 MiB is millions of them


def write_run_manifest(store: Store, run_id: str) -> dict:
    """List every artifact of the run with its sha256 and size and store the list (one atomic put)."""
    layout = RunLayout(run_id)
    key = layout.run_manifest
    artifacts, foreign = {}, []
    for k in store.list(layout.folder):
        if k == key:
            continue
        if not layout.owns(k):  # not a key fedpipe writes (a file copied in by hand): named, never vouched for
            foreign.append(k)
            continue
        data = store.get(k)  # checks the hash recorded at write time: never vouch for damaged bytes
        artifacts[k] = {"sha256": sha256_hex(data), "size": len(data)}
    if foreign:
        log.warning("The run folder %s holds %d file(s) fedpipe did not write; the run's manifest leaves them out: %s",
                    store.url(run_id), len(foreign), ", ".join(foreign[:10]) + (" ..." if len(foreign) > 10 else ""))
    manifest = {
        "format": FORMAT,
        "run_id": run_id,
        "written_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "artifacts": artifacts,
    }
    store.put_text(key, json.dumps(manifest, indent=2) + "\n")
    return manifest


@dataclass
class Verification:
    run_id: str
    where: str  # the manifest's URL
    intact: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    damaged: dict[str, str] = field(default_factory=dict)  # key -> what differs
    unlisted: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.missing and not self.damaged


def _read_manifest(store: Store, run_id: str) -> dict:
    key = RunLayout(run_id).run_manifest
    url = store.url(key)
    if not store.exists(key):
        raise StoreError(
            f"Run {run_id!r} has no run manifest ({url} is missing): the run has not finished (the evaluate "
            "step writes it last), the run id or the store is wrong, or the manifest was deleted. Check "
            "`--store` and the run id, or finish the run with `fedpipe evaluate`."
        )
    try:
        manifest = read_store_json(store, key, "run manifest", MANIFEST_LIMIT, CorruptArtifactError,
                                   "Rewrite it by running `fedpipe evaluate` on the run again.")
        artifacts = manifest["artifacts"]
        if manifest.get("format") != FORMAT or not isinstance(artifacts, dict):
            raise ValueError("not a fedpipe run manifest")
        for k, entry in artifacts.items():
            if not isinstance(k, str) or not isinstance(entry.get("sha256"), str) or not isinstance(entry.get("size"), int):
                raise ValueError(f"bad entry for {k!r}")
    except CorruptArtifactError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptArtifactError(
            f"{url} is not a readable run manifest ({e}). Rewrite it by running `fedpipe evaluate` on the run again."
        ) from None
    return manifest


def verify_run(store: Store, run_id: str) -> Verification:
    """Re-read every artifact the run manifest lists and compare its sha256 and size."""
    layout = RunLayout(run_id)
    manifest = _read_manifest(store, run_id)
    result = Verification(run_id, store.url(layout.run_manifest))
    for key, entry in sorted(manifest["artifacts"].items()):
        if not store.exists(key):
            result.missing.append(key)
            continue
        size = store.size(key)
        if size is not None and size > entry["size"]:  # never fetch more than was written
            result.damaged[key] = f"its size is {size} bytes, more than the {entry['size']} the manifest has"
            continue
        try:
            data = store.get(key)
        except CorruptArtifactError:
            # the store's own hash check failed: the bytes changed after they were written
            result.damaged[key] = "its bytes no longer match the sha256 recorded when it was written"
            continue
        digest = sha256_hex(data)
        if digest != entry["sha256"] or len(data) != entry["size"]:
            result.damaged[key] = f"sha256 {digest[:16]}... ({len(data)} bytes), the manifest has {entry['sha256'][:16]}... ({entry['size']} bytes)"
        else:
            result.intact.append(key)
    listed = set(manifest["artifacts"]) | {layout.run_manifest}
    result.unlisted = [k for k in store.list(layout.folder) if k not in listed]
    return result
