"""A model line in the store: `models/<name>/versions/<n>/` and `models/<name>/promoted`.

Layout (every key under the store's prefix):

    models/<name>/versions/<n>/claim.json      who took the number n (created first, with a precondition)
    models/<name>/versions/<n>/version.json    the version's record (VersionRecord): run id, method, model
                                               spec, config (YAML), data snapshot, evaluation summary,
                                               the gate's decision; created with a precondition, never rewritten
    models/<name>/versions/<n>/state.pt        the run's final phase state (server + client states): warm starts
    models/<name>/versions/<n>/global.pt2      the global model, exported (methods that have one)
    models/<name>/versions/<n>/clients/<client>.pt2   each client's personalized model, exported
    models/<name>/versions/<n>/spec.json       what a server needs to feed the exported models (ServingSpec)
    models/<name>/promoted                     {"version": n, "record_sha256": ...}: replaced atomically
    models/<name>/history/<seq>.json           every promotion and rollback, in order (created, never rewritten)

Versions are numbered 1, 2, ... in order of registration; two registrations racing for the same number:
one wins the precondition, the other takes the next number. A registration first claims its number
(`claim.json`, created only if absent), so the loser of a race never writes into the winner's folder; a
registration that died after its claim leaves a number without a record, which is skipped (the version
exists once its record does). The promoted pointer names the sha256 of the version's record, so a record
changed after promotion (or a pointer to a missing version) is an error, and nothing is promoted from it.

The pointer is replaced with a compare-and-swap on its current bytes (`Store.replace_if`; `create` the
first time), so of two promoters racing one wins and the other gets an error, never a silent overwrite. The
pointer carries the sequence number of its history entry, and the entry is a copy of the pointer: an
entry lost to a crash between the two writes is written by the next promotion or rollback.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from fedpipe.engine.accounting import Ledger
from fedpipe.errors import ConfigError, CorruptArtifactError, StoreError
from fedpipe.safe_load import MAX_RECORD_BYTES, check_size, parse_json, read_store_json
from fedpipe.store.base import Store, sha256_hex, validate_key

if TYPE_CHECKING:
    from fedpipe.run.run import Run

NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"  # a line's name: a store key segment, lower case
RECORD_FORMAT = "fedpipe.model-version/1"
POINTER_FORMAT = "fedpipe.model-promoted/1"
MAX_VERSION_RECORD_BYTES = 4 * MAX_RECORD_BYTES  # a run record's config plus the run's summary
MAX_POINTER_BYTES = 64 * 2**10  # the pointer and a history entry: a version, a hash and a reason
MAX_REASON_CHARS = 2000
MAX_FILE_BYTES = 16 * 2**30  # one file of a version, as checked before a promotion (a model's state for many clients)
RESERVED_FILES = ("version.json", "claim.json")  # written by the line itself, never by `register`'s caller
ANY = object()  # `PromotionLog.move`'s expected pointer: whatever it is
ATTEMPTS = 1000  # numbers (or history entries) tried before giving up: only a store under constant contention gets there
REGATED = "regated: "  # how the history reason of a promotion `fedpipe models regate` made begins


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _bad(where: str, why: str) -> CorruptArtifactError:
    return CorruptArtifactError(f"{where} is not a valid model-line record: {why}. It was damaged or written by "
                                "something else; restore it from a copy, or register the run again as a new version.")


def _typed(tree: dict, name: str, types: type | tuple[type, ...], where: str) -> Any:
    if name not in tree:
        raise _bad(where, f"the field {name!r} is missing")
    value = tree[name]
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,))):
        raise _bad(where, f"the field {name!r} is {type(value).__name__}, not {getattr(types, '__name__', types)}")
    return value


@dataclass(frozen=True)
class ModelSpec:
    """What a model is, so a warm start or a served model can be checked against it."""

    model: str  # model.name as resolved (a bundled name or an import path)
    method: str
    input_shape: tuple[int, ...]
    num_classes: int
    class_names: tuple[str, ...]

    def mismatch(self, other: ModelSpec) -> list[str]:
        """The fields that differ, as 'field: this vs other' lines (empty: compatible)."""
        lines = []
        for name in ("model", "method", "input_shape", "num_classes", "class_names"):
            mine, theirs = _plain(getattr(self, name)), _plain(getattr(other, name))
            if mine != theirs:
                lines.append(f"{name}: {_shown(mine)} vs {_shown(theirs)}")
        return lines

    @classmethod
    def of_run(cls, run: Run) -> ModelSpec:
        """The spec of a run's models: its resolved model name, method, and the data's input shape and labels."""
        bundle = run.bundle
        return cls(run.cfg.model_name(bundle.input_shape), run.cfg.method.name, tuple(int(d) for d in bundle.input_shape),
                   int(bundle.num_classes), tuple(str(c) for c in bundle.class_names))

    def to_json(self) -> dict:
        return {"model": self.model, "method": self.method, "input_shape": list(self.input_shape),
                "num_classes": self.num_classes, "class_names": list(self.class_names)}

    @classmethod
    def from_json(cls, tree: Any, where: str) -> ModelSpec:
        if not isinstance(tree, dict):
            raise _bad(where, "its spec is not a JSON object")
        shape, names = _typed(tree, "input_shape", list, where), _typed(tree, "class_names", list, where)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
            raise _bad(where, "spec.input_shape is not a list of positive integers")
        if not all(isinstance(n, str) for n in names):
            raise _bad(where, "spec.class_names is not a list of strings")
        return cls(_typed(tree, "model", str, where), _typed(tree, "method", str, where), tuple(shape),
                   _typed(tree, "num_classes", int, where), tuple(names))


def _plain(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _shown(value: Any) -> str:
    if isinstance(value, tuple) and len(value) > 12:
        return f"({', '.join(map(repr, value[:12]))}, ... {len(value)} in all)"
    return repr(tuple(value) if isinstance(value, list) else value)


@dataclass(frozen=True)
class VersionRecord:
    version: int
    run_id: str
    spec: ModelSpec
    config_yaml: str
    data_snapshot: dict | None
    summary: dict  # the run's report summary (personalized and global accuracy, ...)
    clients: tuple[str, ...]  # the clients with a personalized model (names for natural partitions, else ids)
    decision: dict = field(default_factory=dict)  # the gate's: promoted (bool), reason, figures
    created: str = ""  # ISO time
    files: dict = field(default_factory=dict)  # file -> sha256 at registration: a file changed since is refused
    # the accountant of the run's global model (privacy.enabled; None: trained without differential privacy): what
    # `fedpipe models` shows; state.pt holds the same ledger, which a warm start composes (fedpipe.models.warm)
    privacy: Ledger | None = None

    def to_json(self) -> dict:
        return {"format": RECORD_FORMAT, "version": self.version, "run_id": self.run_id, "spec": self.spec.to_json(),
                "config_yaml": self.config_yaml, "data_snapshot": self.data_snapshot, "summary": self.summary,
                "clients": list(self.clients), "decision": self.decision, "created": self.created, "files": self.files,
                "privacy": None if self.privacy is None else self.privacy.to_json()}

    @classmethod
    def from_json(cls, tree: Any, where: str) -> VersionRecord:
        """A record read back, every field's type checked; a malformed one is a CorruptArtifactError naming `where`."""
        if not isinstance(tree, dict):
            raise _bad(where, "not a JSON object")
        if tree.get("format") != RECORD_FORMAT:
            raise _bad(where, f"its format is {tree.get('format')!r}, not {RECORD_FORMAT!r}")
        snapshot = tree.get("data_snapshot")
        if snapshot is not None and not isinstance(snapshot, dict):
            raise _bad(where, "the field 'data_snapshot' is neither an object nor null")
        clients = _typed(tree, "clients", list, where)
        if not all(isinstance(c, str) for c in clients):
            raise _bad(where, "the field 'clients' is not a list of strings")
        return cls(version=_typed(tree, "version", int, where), run_id=_typed(tree, "run_id", str, where),
                   spec=ModelSpec.from_json(tree.get("spec"), where), config_yaml=_typed(tree, "config_yaml", str, where),
                   data_snapshot=snapshot, summary=_typed(tree, "summary", dict, where), clients=tuple(clients),
                   decision=_typed(tree, "decision", dict, where), created=_typed(tree, "created", str, where),
                   files=_file_hashes(tree.get("files", {}), where), privacy=_ledger(tree.get("privacy"), where))


@dataclass(frozen=True)
class LineKeys:
    """The store keys of one model line (spelled here and nowhere else)."""

    name: str

    @property
    def folder(self) -> str:
        return f"models/{self.name}/"

    @property
    def versions(self) -> str:
        return f"{self.folder}versions/"

    def version(self, n: int) -> str:
        return f"{self.versions}{n}/"

    def record(self, n: int) -> str:
        return f"{self.version(n)}version.json"

    def claim(self, n: int) -> str:
        return f"{self.version(n)}claim.json"

    @property
    def pointer(self) -> str:
        return f"{self.folder}promoted"

    @property
    def history(self) -> str:
        return f"{self.folder}history/"

    def entry(self, seq: int) -> str:
        return f"{self.history}{seq:06d}.json"

    def hub(self, n: int) -> str:
        """Version n's Kubeflow Hub registration status (fedpipe.models.hub)."""
        return f"{self.folder}hub/{n}.json"

    def numbers(self, keys: list[str], leaf: str) -> list[int]:
        """The version numbers n of the keys `versions/<n>/<leaf>` among `keys`, ascending."""
        pattern = re.compile(re.escape(self.versions) + r"([1-9][0-9]{0,8})/" + re.escape(leaf))
        return sorted(int(m.group(1)) for k in keys if (m := pattern.fullmatch(k)))


@dataclass(frozen=True)
class Pointer:
    """The promoted pointer, as read: its bytes' sha256 (for the compare-and-swap) and its fields."""

    version: int
    record_sha256: str
    seq: int
    action: str
    reason: str
    time: str
    sha256: str  # of the pointer's own bytes

    def entry(self) -> dict:
        return {"format": POINTER_FORMAT, "seq": self.seq, "action": self.action, "version": self.version,
                "record_sha256": self.record_sha256, "reason": self.reason, "time": self.time}


def _pointer_of(tree: Any, where: str, sha: str) -> Pointer:
    if not isinstance(tree, dict) or tree.get("format") != POINTER_FORMAT:
        raise _bad(where, f"not a {POINTER_FORMAT} object")
    action = _typed(tree, "action", str, where)
    if action not in ("promote", "rollback"):
        raise _bad(where, f"its action is {action!r}, not promote or rollback")
    record_sha = _typed(tree, "record_sha256", str, where)
    if not re.fullmatch(r"[0-9a-f]{64}", record_sha):
        raise _bad(where, "record_sha256 is not a sha256 in hex")
    version, seq = _typed(tree, "version", int, where), _typed(tree, "seq", int, where)
    if version < 1 or seq < 1:
        raise _bad(where, "version and seq must be positive")
    return Pointer(version, record_sha, seq, action, _typed(tree, "reason", str, where), _typed(tree, "time", str, where), sha)


def _encode(tree: dict) -> bytes:
    return json.dumps(tree, indent=2).encode("utf-8")


class PromotionLog:
    """The promoted pointer and the history of one line: reading them, and moving the pointer."""

    def __init__(self, store: Store, keys: LineKeys):
        self.store, self.keys = store, keys

    def pointer(self) -> Pointer | None:
        key = self.keys.pointer
        if not self.store.exists(key):
            return None
        where = self.store.url(key)
        known = self.store.size(key)
        if known is not None:
            check_size(known, MAX_POINTER_BYTES, where, "promoted pointer", CorruptArtifactError)
        data = self.store.get(key)
        return _pointer_of(parse_json(data, where, "promoted pointer", MAX_POINTER_BYTES, CorruptArtifactError), where, sha256_hex(data))

    def move(self, action: str, version: int, record_sha: str, reason: str, expected: Any = ANY) -> None:
        """Replace the pointer (compare-and-swap on the bytes read), then write its history entry. With
        `expected` (a version, or None for a line never promoted), only if the pointer still names it."""
        if not isinstance(reason, str) or len(reason) > MAX_REASON_CHARS:
            raise ConfigError(f"A promotion's reason is text of at most {MAX_REASON_CHARS} characters.")
        current = self.pointer()
        now = None if current is None else current.version
        if expected is not ANY and now != expected:
            raise StoreError(f"Model line {self.keys.name!r}: the promoted version is {now or 'none'} now, not "
                             f"{expected or 'none'} as when this {action} of version {version} was decided (someone promoted "
                             f"or rolled back in between); this one changed nothing. Decide again: `fedpipe models regate "
                             f"{self.keys.name}@{version}`, or promote by hand.")
        if current is not None:
            self._write_entry(current)  # lost to a crash between the two writes of the last move: write it now
        seq = 1 if current is None else current.seq + 1
        data = _encode(Pointer(version, record_sha, seq, action, reason, _now(), "").entry())
        won = (self.store.create(self.keys.pointer, data) if current is None
               else self.store.replace_if(self.keys.pointer, data, current.sha256))
        if not won:
            raise StoreError(f"Model line {self.keys.name!r}: another promotion or rollback changed "
                             f"{self.store.url(self.keys.pointer)} while this {action} of version {version} was being made; "
                             f"this one changed nothing. Look at `fedpipe models list {self.keys.name}` and try again if it "
                             "is still wanted.")
        self.store.create(self.keys.entry(seq), data)

    def _write_entry(self, pointer: Pointer) -> None:
        key = self.keys.entry(pointer.seq)
        if not self.store.exists(key):
            self.store.create(key, _encode(pointer.entry()))

    def history(self) -> list[dict]:
        """Every entry, oldest first; reading writes nothing: an entry lost to a crash is shown from the
        pointer (the next move writes it)."""
        current = self.pointer()
        pattern = re.compile(re.escape(self.keys.history) + r"([0-9]{6,9})\.json")
        entries = []
        for key in self.store.list(self.keys.history):
            if (m := pattern.fullmatch(key)) is None:
                continue
            where = self.store.url(key)
            tree = read_store_json(self.store, key, "model-line history entry", MAX_POINTER_BYTES, CorruptArtifactError)
            entry = _pointer_of(tree, where, "").entry()
            if entry["seq"] != int(m.group(1)):
                raise _bad(where, f"it says seq {entry['seq']} but is named {m.group(1)}")
            entries.append(entry)
        if current is not None and all(e["seq"] != current.seq for e in entries):
            entries.append(current.entry())
        return sorted(entries, key=lambda e: e["seq"])

    def stack(self) -> list[tuple[int, str]]:
        """The promoted versions in force, oldest first, (version, record sha256), replayed from the
        history: a promotion pushes, a rollback pops back to the version it names."""
        stack: list[tuple[int, str]] = []
        for entry in self.history():
            if entry["action"] == "promote":
                stack.append((entry["version"], entry["record_sha256"]))
                continue
            while stack and stack[-1][0] != entry["version"]:
                stack.pop()
            if not stack:
                stack.append((entry["version"], entry["record_sha256"]))
        return stack


def line_names(store: Store) -> list[str]:
    """The model lines in `store` (those with at least one key under models/<name>/), by name."""
    names = {key.split("/")[1] for key in store.list("models/") if key.count("/") >= 2}
    return sorted(n for n in names if re.fullmatch(NAME_PATTERN, n))


class ModelLine:
    """One named line of models in a store."""

    def __init__(self, store: Store, name: str):
        if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name):
            raise ConfigError(f"Model line name {name!r} is not allowed: use 1-63 characters of a-z, 0-9, '.', '_' and "
                              "'-', starting with a letter or a digit (it is a folder name in the store), e.g. mnist-superfed.")
        self.store, self.name, self.keys = store, name, LineKeys(name)
        self.log = PromotionLog(store, self.keys)
        self._hashes: dict[int, dict] = {}  # version -> its record's file hashes (a record is never rewritten)

    def _file_hashes(self, version: int) -> dict:
        """The file hashes of a version's record, read once per line object (publishing 10,000 clients' models
        must not parse the record 10,000 times)."""
        if version not in self._hashes:
            self._hashes[version] = self.record(version).files
        return self._hashes[version]

    def exists(self) -> bool:
        """True when anything of the line is in the store (a version, a claim, the pointer)."""
        return bool(self.store.list(self.keys.folder))

    def versions(self) -> list[int]:
        """The registered versions, ascending."""
        return self.keys.numbers(self.store.list(self.keys.versions), "version.json")

    def record(self, version: int) -> VersionRecord:
        """The version's record, bounded and validated; a clear error when missing or malformed."""
        return self._record(version)[0]

    def _record(self, version: int) -> tuple[VersionRecord, str]:
        """(record, sha256 of its bytes)."""
        key = self.keys.record(_number(self.name, version))
        if not self.store.exists(key):
            raise StoreError(f"Model line {self.name!r} has no version {version} ({self.store.url(key)} is missing); "
                             f"its versions are {self.versions() or 'none yet'} (`fedpipe models list {self.name}`).")
        where = self.store.url(key)
        known = self.store.size(key)
        if known is not None:
            check_size(known, MAX_VERSION_RECORD_BYTES, where, "model version record", CorruptArtifactError)
        data = self.store.get(key)
        record = VersionRecord.from_json(parse_json(data, where, "model version record", MAX_VERSION_RECORD_BYTES,
                                                    CorruptArtifactError), where)
        if record.version != version:
            raise _bad(where, f"it says version {record.version} but lies in the folder of version {version}")
        return record, sha256_hex(data)

    def register(self, record_without_version: VersionRecord, files: dict[str, bytes]) -> VersionRecord:
        """Write `files` (relative keys: state.pt, global.pt2, clients/<c>.pt2, spec.json) under the next
        version, then its record (created last, with a precondition): the version exists once its record
        does. Returns the record with its number."""
        keys = [_file_key(self.name, k) for k in files]  # every name checked before anything is written
        claimed = self.keys.numbers(self.store.list(self.keys.versions), "claim.json")
        n = max([0, *claimed, *self.versions()])
        for _ in range(ATTEMPTS):
            n += 1
            claim = _encode({"run_id": record_without_version.run_id, "time": _now()})
            if not self.store.create(self.keys.claim(n), claim):
                continue  # another registration took n: take the next
            for rel, data in zip(keys, files.values()):
                self.store.put(self.keys.version(n) + rel, data)
            record = replace(record_without_version, version=n, created=record_without_version.created or _now(),
                             files={rel: sha256_hex(data) for rel, data in zip(keys, files.values())})
            if self.store.create(self.keys.record(n), _encode(record.to_json())):
                return record
        raise StoreError(f"Could not register a version of model line {self.name!r} in {self.store.url()}: "
                         f"{ATTEMPTS} numbers in a row were taken by other registrations. Try again.")

    def promoted(self) -> int | None:
        """The promoted version (None before the first promotion); a pointer to a missing version, or to
        a record changed since it was promoted, is a CorruptArtifactError naming both."""
        pointer = self.log.pointer()
        if pointer is None:
            return None
        self._verified(pointer.version, pointer.record_sha256, f"the promoted pointer {self.store.url(self.keys.pointer)}")
        return pointer.version

    def _verified(self, version: int, sha: str, named_by: str) -> VersionRecord:
        """The record of `version`, whose bytes must still have the sha256 `sha`."""
        key = self.store.url(self.keys.record(version))
        fix = f"Nothing is promoted from it: restore the record, or promote another version (`fedpipe models promote {self.name} VERSION`)."
        try:
            record, now = self._record(version)
        except StoreError as e:  # missing, damaged or malformed (CorruptArtifactError is a StoreError too)
            raise CorruptArtifactError(f"Model line {self.name!r}: {named_by} names version {version}, whose record {key} is "
                                       f"tampered or missing: {e} {fix}") from None
        if now != sha:
            raise CorruptArtifactError(f"Model line {self.name!r}: {named_by} names version {version} with record sha256 "
                                       f"{sha[:16]}..., but its record {key} now has sha256 {now[:16]}...: tampered or missing "
                                       f"(changed after it was promoted). {fix}")
        return record

    def promote(self, version: int, reason: str, expected: Any = ANY, *, over_refusal: bool = True) -> None:
        """Point `promoted` at `version` (atomically) and append the promotion to the history; with `expected`,
        only while the pointer still names that version (the gate's champion). Its files are checked first. With
        `over_refusal=False`, a version the gate refused (`refusal`) is a ConfigError saying so."""
        _, sha = self._record(_number(self.name, version))  # a missing or malformed record is refused here
        if not over_refusal and (why := refusal(self, version)):
            raise ConfigError(_refused(self.name, version, why, "promote"))
        self.check_files(version)
        self.log.move("promote", version, sha, reason, expected)

    def check_files(self, version: int) -> None:
        """Every file the version's record lists is there, within its size bound and unchanged (sha256): a
        version whose models were removed or swapped is never (re)promoted."""
        record = self.record(version)
        for key in record.files:
            self.read(version, key, MAX_FILE_BYTES)

    def rollback(self, *, over_refusal: bool = True) -> int:
        """Point `promoted` back at the version promoted before the current one; returns it (`roll_back`)."""
        return roll_back(self, over_refusal=over_refusal)

    def history(self) -> list[dict]:
        """Promotions and rollbacks, oldest first: {seq, action, version, reason, time} (and record_sha256)."""
        return self.log.history()

    def read(self, version: int, key: str, max_bytes: int) -> bytes:
        """A file of a version (state.pt, global.pt2, clients/<c>.pt2, spec.json), bounded."""
        full = self.keys.version(_number(self.name, version)) + validate_key(key, what="file of a model version")
        if not self.store.exists(full):
            raise StoreError(f"Model line {self.name!r}, version {version}, has no file {key!r} ({self.store.url(full)} is missing).")
        where = self.store.url(full)
        known = self.store.size(full)
        if known is not None:
            check_size(known, max_bytes, where, f"file {key}", CorruptArtifactError)
        data = self.store.get(full)
        check_size(len(data), max_bytes, where, f"file {key}", CorruptArtifactError)
        registered = self._file_hashes(version).get(key)
        if registered is not None and sha256_hex(data) != registered:  # rewritten through the store, hash and all
            raise CorruptArtifactError(f"Model line {self.name!r}, version {version}: {where} has sha256 {sha256_hex(data)[:16]}..., "
                                       f"not the {registered[:16]}... registered with the version: it was changed after "
                                       "registration. Nothing is read from it; promote or warm-start from another version.")
        return data


def roll_back(line: ModelLine, *, over_refusal: bool = True) -> int:
    """`line.rollback`: point `promoted` back at the version promoted before the current one; returns it. A version
    the gate refused (promoted by hand) is said so in the history; with `over_refusal=False` it is a ConfigError."""
    if line.log.pointer() is None:
        raise StoreError(f"Model line {line.name!r} has never been promoted: there is nothing to roll back.")
    stack = line.log.stack()
    if len(stack) < 2:
        raise StoreError(f"Model line {line.name!r} has no version promoted before the current one "
                         f"({stack[-1][0] if stack else 'none'}) to roll back to: promote one instead "
                         f"(`fedpipe models promote {line.name} VERSION`).")
    version, sha = stack[-2]
    line._verified(version, sha, "the history's earlier promotion")
    why = refusal(line, version)
    if why and not over_refusal:
        raise ConfigError(_refused(line.name, version, why, "rollback"))
    line.check_files(version)
    reason = f"rolled back from version {stack[-1][0]}" + (f", to a version the gate refused ({why})" if why else "")
    line.log.move("rollback", version, sha, reason[:MAX_REASON_CHARS], expected=stack[-1][0])
    return version

def refusal(line: ModelLine, version: int) -> str:
    """The gate's reason when it refused `version` ("" when it did not: promoted at registration, registered before
    the gate recorded decisions, or promoted since by `fedpipe models regate`, the gate deciding again)."""
    decision = line.record(version).decision
    if decision.get("promoted") is not False:
        return ""
    if any(e["version"] == version and e["action"] == "promote" and e["reason"].startswith(REGATED) for e in line.history()):
        return ""
    return str(decision.get("reason") or "not promoted (no reason recorded)")


def _refused(line: str, version: int, why: str, action: str) -> str:
    """What a hand promotion or rollback to a version the gate refused says."""
    to = f"Rolling back to version {version}" if action == "rollback" else f"Promoting version {version}"
    return (f"Model line {line!r}: the gate refused version {version} at registration ({why[:500]}). {to} overrides that "
            f"decision: pass --force if that is meant (the history records it), or decide again with `fedpipe models regate "
            f"{line}@{version}`. Nothing was changed.")


def _file_hashes(value: Any, where: str) -> dict:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) and len(v) == 64 for k, v in value.items()):
        raise _bad(where, "the field 'files' is not an object of file -> sha256")
    return value


def _ledger(value: Any, where: str) -> Ledger | None:
    """A record's privacy ledger, checked as `Ledger.from_json` checks one (None: the version is not private, or was
    registered before records carried it)."""
    if value is None:
        return None
    try:
        return Ledger.from_json(value)
    except (ValueError, TypeError, KeyError) as e:
        raise _bad(where, f"the field 'privacy' is not a privacy ledger ({e})") from None


def _number(name: str, version: Any) -> int:
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version < 10**9:
        raise ConfigError(f"A version of model line {name!r} is a number 1, 2, ...; got {version!r}.")
    return version


def _file_key(name: str, rel: str) -> str:
    validate_key(rel, what=f"file name of a version of model line {name!r}")
    if rel in RESERVED_FILES:
        raise ConfigError(f"{rel!r} is written by the model line itself; a version's files cannot use that name.")
    return rel


def abandoned(line: ModelLine) -> list[tuple[int, dict]]:
    """Numbers claimed without a record (a registration that died between its claim and its record, or one
    still writing), with what their claim says ({run_id, time}); a damaged claim says {}."""
    keys = line.store.list(line.keys.versions)
    recorded = set(line.keys.numbers(keys, "version.json"))
    out = []
    for n in line.keys.numbers(keys, "claim.json"):
        if n in recorded:
            continue
        try:
            claim = parse_json(line.store.get(line.keys.claim(n)), line.store.url(line.keys.claim(n)), "claim",
                               MAX_POINTER_BYTES, CorruptArtifactError)
        except (CorruptArtifactError, StoreError):
            claim = {}
        out.append((n, claim if isinstance(claim, dict) else {}))
    return out


def remove_abandoned(line: ModelLine, older_than_seconds: float) -> list[int]:
    """Delete the files of numbers claimed without a record longer ago than `older_than_seconds` (a
    registration still writing is younger); returns the numbers removed. Versions are never touched."""
    now, removed = datetime.now(UTC), []
    for n, claim in abandoned(line):
        try:
            age = (now - datetime.fromisoformat(str(claim.get("time")))).total_seconds()
        except (TypeError, ValueError):
            age = float("inf")  # a damaged claim: no registration can be writing under it
        if age >= older_than_seconds and not line.store.exists(line.keys.record(n)):
            line.store.delete_folder(line.keys.version(n))  # and what a write killed midway left there (a temp file)
            removed.append(n)
    return removed
