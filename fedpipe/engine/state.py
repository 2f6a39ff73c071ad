"""Phase state: what one training job hands the next, and what a checkpoint holds.

A state is plain tensors in nested dicts, saved with `torch.save` and read back with
`torch.load(weights_only=True)`, so loading an artifact never runs pickled code.

Clients' states live in a `ClientStates` (fedpipe.engine.client_states) bound to the phase's folder
and the run's memory budget: a checkpoint either holds them inline (few and small, as always) or
refers to objects in the phase's clients folder (format 2), read back only when a client is used. Such a checkpoint is not self-contained: it needs the run's store, which every step and every
pipeline task of a run shares anyway.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.utils.serialization

from fedpipe.algorithms.base import Params, ServerState
from fedpipe.engine.accounting import Ledger
from fedpipe.engine.client_states import ClientKeys, ClientStates
from fedpipe.errors import CorruptArtifactError, StoreError
from fedpipe.store.base import Store
from fedpipe.store.write_behind import WriteBehind

log = logging.getLogger(__name__)

FORMAT = 1  # clients inline
FORMAT_REFS = 2  # some clients as references to objects in the store ("client_refs")


@dataclass
class PhaseState:
    """Everything training needs to go on: the server's state, each client's kept state, and the
    last finished round (global index). Randomness is derived from (seed, round, client), so no RNG
    state is needed to resume."""

    method: str
    phase: str  # the phase that produced this state ("init" before any)
    round: int
    server: ServerState
    clients: MutableMapping[int, Params] = field(default_factory=dict)  # a dict, or a ClientStates
    config_fingerprint: str = ""
    selection: Selection | None = None  # train.select: the best round so far and its server state
    privacy: Ledger | None = None  # privacy.enabled: the run's accountant so far (carried from phase to phase)

    def __setattr__(self, name, value) -> None:
        super().__setattr__(name, value)
        # states set from now on are produced by the round after the last finished one (their keys say so)
        if name in ("round", "clients") and isinstance(self.__dict__.get("clients"), ClientStates) and "round" in self.__dict__:
            self.clients.round = self.round + 1

    def to_bytes(self) -> bytes:
        if isinstance(self.clients, ClientStates):
            inline, refs = self.clients.checkpoint_parts()  # may first write changed states to the store
        else:
            inline, refs = dict(self.clients), {}
        d = {
            "format": FORMAT_REFS if refs else FORMAT,
            "method": self.method,
            "phase": self.phase,
            "round": self.round,
            "config_fingerprint": self.config_fingerprint,
            "global": _cpu(self.server.global_params),
            "server_clients": {k: _cpu(v) for k, v in self.server.per_client.items()},
            "clients": {k: _cpu(v) for k, v in inline.items()},
        }
        if refs:
            d["client_refs"] = refs
        if self.privacy is not None:
            d["privacy"] = self.privacy.to_json()
        if self.selection is not None:
            sel = self.selection
            d["selection"] = {"round": sel.round, "score": sel.score, "global": _cpu(sel.server.global_params),
                              "server_clients": {k: _cpu(v) for k, v in sel.server.per_client.items()}}
        return saved_bytes(d)

    @classmethod
    def from_bytes(cls, data: bytes, device: torch.device | str = "cpu", where: str = "state",
                   clients: Callable[[int, dict, dict], MutableMapping[int, Params]] | None = None) -> PhaseState:
        """`clients(round, inline, refs)` builds the clients' mapping (`Checkpoints` binds it to the
        store); without it the clients come back as a dict, and a state with references is refused."""
        try:
            d = torch.load(io.BytesIO(data), map_location=device, weights_only=True)
            if d.get("format") not in (FORMAT, FORMAT_REFS):
                raise ValueError(f"unknown state format {d.get('format')!r}")
            round_ = int(d["round"])
            inline = {int(k): dict(v) for k, v in d["clients"].items()}
            refs = {int(k): list(v) for k, v in d.get("client_refs", {}).items()}
            if clients is not None:
                kept = clients(round_, inline, refs)
            elif refs:
                raise ValueError("it refers to client states in the store; read it through Checkpoints")
            else:
                kept = inline
            return cls(
                method=d["method"],
                phase=d["phase"],
                round=round_,
                server=ServerState(dict(d["global"]), {int(k): dict(v) for k, v in d["server_clients"].items()}),
                clients=kept,
                config_fingerprint=d.get("config_fingerprint", ""),
                selection=_selection(d.get("selection")),
                privacy=Ledger.from_json(d["privacy"]) if d.get("privacy") is not None else None,
            )
        except Exception as e:  # any unreadable content is a bad artifact, reported as such
            raise CorruptArtifactError(
                f"{where} is not a readable fedpipe state ({type(e).__name__}: {e}). It was damaged or "
                "written by something else; rerun the step that produces it."
            ) from None


@dataclass
class Selection:
    """`train.select`'s choice so far: the round, its validation score (higher is better: a loss is negated)
    and the server state after it."""

    round: int
    score: float
    server: ServerState


def _selection(d: dict | None) -> Selection | None:
    if d is None:
        return None
    server = ServerState(dict(d["global"]), {int(k): dict(v) for k, v in d["server_clients"].items()})
    return Selection(int(d["round"]), float(d["score"]), server)


def saved_bytes(obj: object) -> bytes:
    """`torch.save` bytes of `obj` without the zip's CRC32 per record: every object the store holds already
    has its sha256 checked on read, and the CRC took a third of the time of saving (clients' states, which
    were torch.save bytes before they were safetensors)."""
    buf = io.BytesIO()
    with torch.utils.serialization.config.patch(**{"save.compute_crc32": False}):
        torch.save(obj, buf)
    return buf.getvalue()


def _cpu(params: Params) -> Params:
    return {k: v.detach().to("cpu") for k, v in params.items()}


class PhaseKeys(ClientKeys, Protocol):
    """Where one phase's artifacts live in the store. The run layer decides (`fedpipe.run.layout`);
    the engine only asks."""

    @property
    def folder(self) -> str:
        """Every key of the phase starts with it."""

    @property
    def final(self) -> str:
        """The phase's final state."""

    def round(self, round_: int) -> str:
        """The checkpoint after `round_`."""

    def round_of(self, key: str) -> int | None:
        """The round of a checkpoint key; None for another key."""

    @property
    def rounds(self) -> str:
        """A prefix of every checkpoint key (and of few other keys)."""

    @property
    def clients(self) -> str:
        """The folder of the phase's spilled client states."""


class Checkpoints:
    """Per-round checkpoints of one phase, and its final state, in the store (where: `layout`).

    A round's checkpoint exists while the phase runs; when it is done the final state does and the
    checkpoints are removed. The clients' states that did not fit in `state_memory_mb` are objects
    in the phase's clients folder (see `ClientStates`); one is deleted once no kept checkpoint (or
    the final state) refers to it and it is no younger than the newest of them (a younger one
    belongs to a state whose checkpoint is still to be written). A key the layout does not name
    as a client state is never deleted.

    `guard`, when given, is called before every write (the run's owner check: a writer whose run
    was taken over stops there instead of overwriting the new owner's checkpoints).

    With `background`, a round's checkpoint is written on a background thread (`WriteBehind`: its client
    objects, then the checkpoint, then the old ones' removal, in that order) while the next round trains;
    at most one round's writes wait, so a failed write stops the phase at its next checkpoint. `save_final`
    and `close` return once everything is written.
    """

    def __init__(self, store: Store, layout: PhaseKeys, state_memory_mb: float = 1024,
                 guard: Callable[[], None] | None = None, background: bool = False):
        self.store, self.layout = WriteBehind(store, background=background), layout
        self.guard = guard if guard is not None else (lambda: None)
        self.budget_bytes = max(1, int(state_memory_mb * 2**20))
        self._refs: dict[str, set[str]] = {}  # checkpoint key -> the client objects it refers to

    @property
    def final_key(self) -> str:
        return self.layout.final

    def round_keys(self) -> list[tuple[int, str]]:
        found = [(r, k) for k in self.store.list(self.layout.rounds) if (r := self.layout.round_of(k)) is not None]
        return sorted(found)

    def client_states(self, states: Mapping[int, Params] | None, device: torch.device | str) -> ClientStates:
        """`states` (a dict, or another phase's ClientStates) as this phase's ClientStates: within the
        budget, spilling into this phase's folder. Nothing is read or copied."""
        return ClientStates(self.store, self.layout, self.budget_bytes, device).adopt(states or {})

    def _read(self, key: str, device: torch.device | str) -> PhaseState:
        where = self.store.url(key)

        def clients(round_: int, inline: dict, refs: dict) -> ClientStates:
            return ClientStates.restore(self.store, self.layout, self.budget_bytes, device, round_, inline, refs)

        state = PhaseState.from_bytes(self.store.get(key), device, where=where, clients=clients)
        refs = state.clients.referenced_keys()
        missing = sorted(refs - self._existing(refs))
        if missing:
            raise CorruptArtifactError(
                f"{where} refers to {len(missing)} saved client state(s) that are not in the store (the first: "
                f"{self.store.url(missing[0])}): they were deleted or never finished writing."
            )
        self._refs[key] = refs
        return state

    def _existing(self, keys: set[str]) -> set[str]:
        """Which of `keys` exist: one listing per folder, not one request per object."""
        folders = {k.rsplit("/", 1)[0] + "/" for k in keys}
        return {k for folder in folders for k in self.store.list(folder)} & keys

    def _refs_of(self, key: str) -> set[str]:
        """The client objects checkpoint `key` refers to (read once; nothing is restored)."""
        if key not in self._refs:
            found: set[str] = set()

            def note(round_: int, inline: dict, refs: dict) -> dict:
                found.update(ref[0] for ref in refs.values())
                return {}

            try:
                PhaseState.from_bytes(self.store.get(key), "cpu", where=self.store.url(key), clients=note)
            except StoreError:  # damaged or gone: never resumed from, so it keeps nothing alive
                pass
            self._refs[key] = found
        return self._refs[key]

    def _collect(self, kept: list[str], newest: int) -> None:
        """Delete this phase's client objects that none of the checkpoints `kept` refers to, produced
        no later than round `newest` (the newest kept state's round; a later object is part of a
        state not yet checkpointed). Objects of earlier phases are theirs to keep."""
        needed = set().union(*(self._refs_of(k) for k in kept)) if kept else set()
        for key in self.store.list(self.layout.clients):
            named = self.layout.client_state_of(key)
            if named is not None and key not in needed and named[1] <= newest:
                self.store.delete(key)
        self._refs = {k: v for k, v in self._refs.items() if k in kept}

    def save_round(self, state: PhaseState, keep: int) -> None:
        """Queue round `state.round`'s checkpoint (see the class docstring); the previous one's writes
        finish first."""
        key, round_ = self.layout.round(state.round), state.round
        self.store.flush()
        self.guard()
        self.store.put(key, state.to_bytes())  # the bytes are taken now: training may go on changing `state`
        refs = _references(state)

        def tidy() -> None:  # on the writer thread, after the checkpoint is written
            self._refs[key] = refs
            rounds = self.round_keys()
            for _, old in rounds[:-keep]:
                self.store.delete(old)
            kept = rounds[-keep:]  # keep 0 deletes nothing, as [:-0] is empty
            self._collect([k for _, k in kept], max((r for r, _ in kept), default=round_))

        self.store.later(tidy)

    def close(self) -> None:
        """Wait for the queued writes (the phase's last checkpoint) and raise what failed."""
        self.store.flush()

    def latest_good(self, device: torch.device | str) -> PhaseState | None:
        """The newest checkpoint that reads back intact (and whose client objects all exist); damaged
        ones are reported and skipped. None when the phase has no checkpoint; an error when it has
        some but none is intact (starting the phase over silently would hide the damage)."""
        keys = self.round_keys()
        for rnd, key in reversed(keys):
            try:
                return self._read(key, device)
            except CorruptArtifactError as e:
                log.warning("Skipping damaged checkpoint of round %d: %s", rnd, e)
        if keys:
            names = ", ".join(self.store.url(k) for _, k in keys)
            raise CorruptArtifactError(
                f"Every checkpoint of this phase is damaged ({names}); none can be resumed from. Delete "
                "them to run the phase again from its start, or restore them from a copy."
            )
        return None

    def save_final(self, state: PhaseState) -> None:
        self.store.flush()
        self.guard()
        self.store.put(self.final_key, state.to_bytes())
        self.store.flush()  # the final state is written before its checkpoints go
        self._refs[self.final_key] = _references(state)
        for _, key in self.round_keys():
            self.store.delete(key)
        self._collect([self.final_key], state.round)

    def has_final(self) -> bool:
        return self.store.exists(self.final_key)

    def load_final(self, device: torch.device | str) -> PhaseState:
        if not self.has_final():
            raise StoreError(f"{self.store.url(self.final_key)} does not exist: the phase that writes it has not finished. Run it first.")
        return self._read(self.final_key, device)


def _references(state: PhaseState) -> set[str]:
    return state.clients.referenced_keys() if isinstance(state.clients, ClientStates) else set()
