"""The ServerApp's outputs in the run's store: where `fedpipe run` and the pipeline's federation tasks meet the ServerApp.

In Flower 1.42 the ServerApp runs where the SuperLink runs (its SuperExec starts it), not where the run was submitted
(a laptop, a pipeline pod). So the two sides share nothing but the run's store (a folder both machines see, or
s3://, Kubeflow's MinIO on a cluster), under `<run>/federation/`:

    written by the submitter   spec.json (what the sites train), champion.safetensors (the model line's promoted
                               state, when the run is gated), warm-start.safetensors (the global model of the
                               version train.init_from names, when the run starts from one)
    written by the ServerApp   census.json, rounds.jsonl, server-state.pt (its checkpoint), global.safetensors,
                               evaluation.json, result.json or error.json (what the submitter waits for)

The ServerApp works in a scratch folder of its own machine (`FEDPIPE_SERVERAPP_WORK`, the SuperLink's volume on a
cluster; default: the temp folder): `ServerOutputs.pull` copies the submitter's files and the checkpoint there before
it starts (so a ServerApp started on a new pod resumes from the store), and `push` copies each output to the store as
soon as it is written (the checkpoint after every round, before its line in rounds.jsonl).

Every object read back is bounded (`LIMITS`) before it is parsed: the store may be written by others.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

from fedpipe.errors import CorruptArtifactError
from fedpipe.federation.resume import CHAMPION, CHECKPOINT, RESUMES, WARM_LEDGER, WARM_START
from fedpipe.store import Store, open_store, validate_prefix

MODEL_BYTES = 8 * 2**30  # a global model, a checkpoint or a champion: far above any model fedpipe trains
JSON_BYTES = 64 * 2**20
LIMITS = {"spec.json": JSON_BYTES, CHAMPION: MODEL_BYTES, WARM_START: MODEL_BYTES, WARM_LEDGER: JSON_BYTES, CHECKPOINT: MODEL_BYTES, RESUMES: JSON_BYTES,
          "census.json": JSON_BYTES, "rounds.jsonl": JSON_BYTES, "global.safetensors": MODEL_BYTES,
          "evaluation.json": JSON_BYTES, "result.json": JSON_BYTES, "error.json": JSON_BYTES, "champion.json": 4096}
SUBMITTED = ("spec.json", CHAMPION, WARM_START, WARM_LEDGER)  # what the submitter writes before the ServerApp starts
RESUMED = (CHECKPOINT, "rounds.jsonl", RESUMES)  # what a ServerApp on a fresh machine needs to go on from the last round
FINAL = ("result.json", "error.json")  # what the submitter waits for; removed before each submission
WORK_ENV = "FEDPIPE_SERVERAPP_WORK"


def federation_prefix(run_id: str) -> str:
    return f"{run_id}/federation"


def get_bounded(store: Store, key: str, name: str) -> bytes | None:
    """The object at `key` (None when there is none), refused when it is larger than `name`'s limit."""
    size = store.size(key)
    if size is None:
        return None
    limit = LIMITS.get(name, JSON_BYTES)
    if size > limit:
        raise CorruptArtifactError(f"{store.url(key)} holds {size} bytes, more than the {limit} a federated run's {name} may: "
                                   "it was not written by fedpipe's ServerApp; remove it and run again")
    return store.get(key)


class ServerOutputs:
    """The ServerApp's side: its scratch folder and the store's `<prefix>/` it mirrors."""

    def __init__(self, store_url: str, prefix: str, work: str | Path | None = None):
        self.store, self.prefix = open_store(store_url), validate_prefix(prefix).rstrip("/")
        # the folder is named by a digest: the prefix comes from a submitted run config, never a path on this machine
        digest = hashlib.sha256(f"{self.store.url()}\0{self.prefix}".encode()).hexdigest()[:24]
        root = Path(work or os.environ.get(WORK_ENV) or Path(tempfile.gettempdir()) / "fedpipe-serverapp")
        self.folder = root / digest
        self.folder.mkdir(parents=True, exist_ok=True)

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def pull(self) -> None:
        """The submitter's files and the last checkpoint, from the store into the folder; a file the store no longer
        holds is removed here too (the store is the truth: a champion from an earlier submission must not linger)."""
        for name in (*SUBMITTED, *RESUMED):
            data = get_bounded(self.store, self.key(name), name)
            path = self.folder / name
            if data is None:
                path.unlink(missing_ok=True)
                continue
            tmp = path.with_suffix(".pulled")
            tmp.write_bytes(data)
            tmp.replace(path)
        if not (self.folder / "spec.json").exists():
            raise CorruptArtifactError(f"{self.store.url(self.key('spec.json'))} is missing: the run was submitted without its "
                                       "spec (submit it with `fedpipe run` or the pipeline's federation tasks)")
        for name in FINAL:
            (self.folder / name).unlink(missing_ok=True)

    def push(self, *names: str) -> None:
        """The named outputs, from the folder into the store (those that exist)."""
        for name in names:
            path = self.folder / name
            if path.exists():
                self.store.put(self.key(name), path.read_bytes())


class SubmittedRun:
    """The submitter's side of `<store>/<run>/federation/`: its inputs, the wait for the ServerApp's answer, and a
    local copy of the outputs for the report and the model line."""

    def __init__(self, store_url: str, run_id: str):
        self.store, self.prefix = open_store(store_url), federation_prefix(run_id)

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    @property
    def url(self) -> str:
        return self.store.url(self.prefix)

    def submit(self, spec_json: str, champion: bytes | None, warm_start: bytes | None = None,
               warm_ledger: bytes | None = None) -> None:
        """The spec, the champion, the warm start and its privacy ledger (each absent one: an earlier one is removed),
        and no answer of an earlier submission."""
        for name in FINAL:
            self.store.delete(self.key(name))
        self.store.put(self.key("spec.json"), spec_json.encode())
        for name, data in ((CHAMPION, champion), (WARM_START, warm_start), (WARM_LEDGER, warm_ledger)):
            if data is None:
                self.store.delete(self.key(name))
            else:
                self.store.put(self.key(name), data)

    def answer(self) -> dict | None:
        """result.json once the ServerApp wrote it; RuntimeError with error.json's message when it failed; None before."""
        for name in FINAL:
            data = get_bounded(self.store, self.key(name), name)
            if data is None:
                continue
            try:
                parsed = json.loads(data)
            except ValueError as e:
                raise CorruptArtifactError(f"{self.store.url(self.key(name))} is not JSON ({e})") from None
            if name == "error.json":
                raise RuntimeError(f"the ServerApp failed: {parsed.get('error', parsed) if isinstance(parsed, dict) else parsed}")
            return parsed
        return None

    def wait(self, timeout: float, poll: float = 1.0, on_poll=lambda: None) -> dict:
        """`answer()` once there is one; `on_poll()` between polls (the pipeline task forwards new rounds' metrics);
        TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            on_poll()
            found = self.answer()
            if found is not None:
                on_poll()
                return found
            if time.monotonic() > deadline:
                raise TimeoutError(f"the ServerApp wrote no result to {self.url} within {timeout:.0f}s: see the SuperLink's log "
                                   "(a site missing from the census is named there), or raise federation.connect_timeout")
            time.sleep(poll)

    def read(self, name: str) -> bytes | None:
        return get_bounded(self.store, self.key(name), name)

    def fetch(self, folder: str | Path) -> Path:
        """A local copy of every output the store holds (the report and the model line read files)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for name in LIMITS:
            data = self.read(name)
            if data is not None:
                (folder / name).write_bytes(data)
        return folder
