"""Clients' persistent states (SuPerFed's local models, pFedMB's alphas, ...) within a memory budget.

`ClientStates` is the mapping client id -> Params that a phase reads and writes. The most recently
used states stay in memory up to `budget_bytes`; the least recently used beyond it are written to
the store ("spilled") and read back when their client is used again. So 10,000 clients cost the
budget in memory, not 10,000 models.

A spilled state is one immutable object whose key (`PhaseKeys.client_state`) names the client, the
round that produced the state, and a hash of the bytes. Nothing is ever written
twice under one key, so an older checkpoint that refers to an object can still be resumed from
after later rounds changed the client, and a read checks the bytes against the key's hash.

Checkpoints (`PhaseState.to_bytes`) are all or nothing: when every state is in memory and together
they are small (`inline_bytes`), they are written inside the checkpoint as before; otherwise the
states changed since they were last written are written as objects first and the checkpoint holds
only references, so its size and each round's writes stay bounded by what changed, not by the
number of clients. Reading a checkpoint back (`restore`) loads referenced states only when used.

Values are treated as immutable: to change a client's state, assign a new dict (which is what the
round loop does). A state bigger than the whole budget still works: the one in use always stays.
"""

from __future__ import annotations

import hashlib
import io
from collections import OrderedDict
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Protocol

import safetensors.torch
import torch

from fedpipe.algorithms.base import Params
from fedpipe.errors import CorruptArtifactError, StoreError
from fedpipe.safe_load import parse_json
from fedpipe.store.base import Store

FORMAT = 2  # safetensors; 1 (torch.save) is still read
#: Most bytes of a client state's safetensors header (its tensors' names, types, shapes and offsets).
MAX_HEADER_BYTES = 16 * 2**20
#: Most bytes of states a checkpoint holds inline (beyond it, states are objects and referenced).
INLINE_MAX_BYTES = 64 * 2**20


class ClientKeys(Protocol):
    """The keys of a phase's spilled client states (the run layer decides them: fedpipe.run.layout)."""

    def client_state(self, client_id: int, round_: int, digest: str) -> str: ...

    def client_state_of(self, key: str) -> tuple[int, int, str] | None:
        """(client, round, digest) that a client-state key (of any phase) names; None for another key."""


def params_bytes(params: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in params.values())


@dataclass
class _Entry:
    params: Params | None  # in memory; None while spilled
    key: str | None  # the object holding exactly these tensors; None: never written (dirty)
    nbytes: int
    round: int  # the round that produced the state (named in its key)


class ClientStates(MutableMapping[int, Params]):
    """client id -> Params, at most `budget_bytes` of them in memory (least recently used spill).

    `layout` names the objects new states are written to (the phase's folder); states loaded go to
    `device`. `round` is the round the states set now belong to: `PhaseState` keeps it
    at its last finished round + 1."""

    def __init__(self, store: Store, layout: ClientKeys, budget_bytes: int, device: torch.device | str = "cpu",
                 inline_bytes: int = INLINE_MAX_BYTES):
        if budget_bytes <= 0:
            raise ValueError("budget_bytes must be positive")
        self.store, self.layout = store, layout
        self.budget_bytes = int(budget_bytes)
        self.inline_bytes = int(min(inline_bytes, budget_bytes))
        self.device = torch.device(device)
        self.round = 0
        self._entries: dict[int, _Entry] = {}
        self._resident: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._resident_bytes = 0
        self._writes = self._reads = self._written_bytes = 0

    # --- the mapping ------------------------------------------------------------------------------
    def __getitem__(self, client_id: int) -> Params:
        entry = self._entries[client_id]
        if entry.params is None:
            entry.params = self._load(client_id, entry.key)
            self._resident_bytes += entry.nbytes
        self._touch(client_id)
        return entry.params

    def __setitem__(self, client_id: int, params: Params) -> None:
        if not isinstance(params, Mapping) or not all(isinstance(t, torch.Tensor) for t in params.values()):
            raise TypeError(f"client {client_id}'s state must be a dict of tensors, got {type(params).__name__}")
        self._drop(client_id)
        entry = _Entry(dict(params), None, params_bytes(params), self.round)
        self._entries[client_id] = entry
        self._resident_bytes += entry.nbytes
        self._touch(client_id)

    def __delitem__(self, client_id: int) -> None:
        if client_id not in self._entries:
            raise KeyError(client_id)
        self._drop(client_id)  # its object, if any, stays: a checkpoint may refer to it

    def __contains__(self, client_id: object) -> bool:
        return client_id in self._entries  # without loading

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._entries))  # one order whatever was spilled or restored

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"ClientStates({self.stats})"

    # --- what is where --------------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, int]:
        """Clients with a state, how many (and how many bytes) are in memory, how many are only in
        the store, and the objects written and read so far."""
        clients, resident = len(self._entries), len(self._resident)
        return {"clients": clients, "resident": resident, "resident_bytes": self._resident_bytes, "spilled": clients - resident,
                "budget_bytes": self.budget_bytes, "writes": self._writes, "written_bytes": self._written_bytes, "reads": self._reads}

    def referenced_keys(self) -> set[str]:
        """Store objects this mapping relies on (its spilled states and the written copies of
        resident ones)."""
        return {e.key for e in self._entries.values() if e.key is not None}

    # --- checkpoints ------------------------------------------------------------------------------
    def checkpoint_parts(self) -> tuple[dict[int, Params], dict[int, list]]:
        """(inline states, references {client: [key, bytes, round]}) for a checkpoint: all inline
        when nothing is spilled and the states are small; else every changed state is written
        first and all are referenced."""
        dirty = [cid for cid, e in self._entries.items() if e.key is None]
        if len(dirty) == len(self._entries) and sum(self._entries[c].nbytes for c in dirty) <= self.inline_bytes:
            return {cid: self._entries[cid].params for cid in sorted(dirty)}, {}
        self._write_many(dirty)
        return {}, {cid: [e.key, e.nbytes, e.round] for cid, e in sorted(self._entries.items())}

    @classmethod
    def restore(cls, store: Store, layout: ClientKeys, budget_bytes: int, device: torch.device | str, round_: int,
                inline: Mapping[int, Params], refs: Mapping[int, list]) -> ClientStates:
        """The mapping a checkpoint describes: inline states in memory, referenced ones read when used."""
        states = cls(store, layout, budget_bytes, device)
        states.round = round_
        for cid, (key, nbytes, rnd) in refs.items():
            named = layout.client_state_of(key) if isinstance(key, str) else None
            if named is None or named[0] != int(cid):
                raise ValueError(f"client {cid}'s reference {key!r} is not a fedpipe client-state key")
            states._entries[int(cid)] = _Entry(None, key, int(nbytes), int(rnd))
        for cid, params in inline.items():
            states[int(cid)] = params
        return states

    def adopt(self, other: Mapping[int, Params]) -> ClientStates:
        """Take over `other`'s states (another ClientStates: by reference, nothing is read; a dict:
        as new states) and return self; used to give the previous phase's states to this phase."""
        if isinstance(other, ClientStates):
            for cid, e in other._entries.items():
                self._entries[cid] = _Entry(e.params, e.key, e.nbytes, e.round)
                if e.params is not None:
                    self._resident_bytes += e.nbytes
            for cid in other._resident:
                self._touch(cid)
        else:
            for cid, params in other.items():
                self[int(cid)] = params
        return self

    # --- internals --------------------------------------------------------------------------------
    def _touch(self, client_id: int) -> None:
        self._resident[client_id] = None
        self._resident.move_to_end(client_id)
        while self._resident_bytes > self.budget_bytes and len(self._resident) > 1:
            self._evict(next(iter(self._resident)))

    def _evict(self, client_id: int) -> None:
        entry = self._entries[client_id]
        if entry.key is None:
            self._write_many([client_id])
        entry.params = None
        self._resident_bytes -= entry.nbytes
        del self._resident[client_id]

    def _drop(self, client_id: int) -> None:
        entry = self._entries.pop(client_id, None)
        if entry is not None and entry.params is not None:
            self._resident_bytes -= entry.nbytes
            self._resident.pop(client_id, None)

    def _write_many(self, client_ids: list[int]) -> None:
        """Write these clients' states in one `put_many` (the store overlaps the writes)."""
        blobs = {}
        for cid in client_ids:
            entry = self._entries[cid]
            data = serialize(cid, entry.params)
            blobs[cid] = (self.layout.client_state(cid, entry.round, hashlib.sha256(data).hexdigest()[:16]), data)
        self.store.put_many(dict(blobs.values()))
        for cid, (key, data) in blobs.items():
            self._entries[cid].key = key
            self._writes += 1
            self._written_bytes += len(data)

    def _load(self, client_id: int, key: str) -> Params:
        self._reads += 1
        named = self.layout.client_state_of(key)
        return load_state(self.store, key, client_id, named[2] if named else None, self.device)


def serialize(client_id: int, params: Params) -> bytes:
    """One client's state as safetensors bytes (FORMAT): raw tensor bytes behind a JSON header that names
    the client, a fifth of torch.save's time and read back without unpickling anything. Each tensor is
    on the CPU and holds only its own elements (a view would otherwise drag its whole base storage in)."""
    own, seen = {}, set()
    for name, t in params.items():
        t = t.detach().to("cpu")
        if (t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous()
                or t.untyped_storage().data_ptr() in seen):  # safetensors refuses two names on one storage
            t = t.clone(memory_format=torch.contiguous_format)
        seen.add(t.untyped_storage().data_ptr())
        own[name] = t
    return safetensors.torch.save(own, metadata={"fedpipe": "client-state", "format": str(FORMAT), "client": str(int(client_id))})


def _parse_state(data: bytes, client_id: int) -> Params:
    """The tensors of a client-state object of `client_id`; ValueError saying what is wrong otherwise."""
    if data[:2] == b"PK":  # format 1 (torch.save, a zip): checkpoints of earlier versions still resume
        d = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        if d.get("format") != 1 or int(d["client"]) != int(client_id):
            raise ValueError(f"it holds client {d.get('client')!r}, format {d.get('format')!r}")
        params = dict(d["params"])
        if not all(isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in params.items()):
            raise ValueError("its entries are not named tensors")
        return params
    size = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if not 0 < size <= min(len(data) - 8, MAX_HEADER_BYTES):
        raise ValueError("it is neither a safetensors file nor a torch.save zip")
    header = parse_json(data[8 : 8 + size], "its header", "safetensors header", MAX_HEADER_BYTES, CorruptArtifactError)
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("fedpipe") != "client-state" or meta.get("format") != str(FORMAT):
        raise ValueError("it is not a fedpipe client state")
    if meta.get("client") != str(int(client_id)):
        raise ValueError(f"it holds client {meta.get('client')!r}")
    return safetensors.torch.load(data)  # the library checks the header against the bytes


def load_state(store: Store, key: str, client_id: int, digest: str | None, device: torch.device | str = "cpu") -> Params:
    """Read a spilled state back, checking its bytes against `digest`, the hash its key names; damage
    or absence is a CorruptArtifactError that says which client and file."""
    url = store.url(key)
    advice = ("A checkpoint of this run refers to it, so the run cannot go on from that checkpoint: start it "
              "over with `fedpipe run --fresh`, or restore the file from a copy.")
    try:
        data = store.get(key)
    except CorruptArtifactError as e:
        raise CorruptArtifactError(f"The saved state of client {client_id} ({url}) is damaged: {e}") from None
    except StoreError:
        raise CorruptArtifactError(f"The saved state of client {client_id} ({url}) is missing from the store. {advice}") from None
    if digest is None or hashlib.sha256(data).hexdigest()[:16] != digest:
        raise CorruptArtifactError(
            f"The saved state of client {client_id} ({url}) is damaged: its bytes do not match the hash in its name. {advice}"
        )
    try:
        params = {k: t.to(device) for k, t in _parse_state(data, client_id).items()}
    except Exception as e:  # any unreadable content is a bad artifact
        raise CorruptArtifactError(
            f"The saved state of client {client_id} ({url}) is not a readable fedpipe client state "
            f"({type(e).__name__}: {e}). {advice}"
        ) from None
    return params
