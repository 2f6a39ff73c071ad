"""Phase state: what one training job hands the next, and what a checkpoint holds.

A state is plain tensors in nested dicts, saved with `torch.save` and read back with
`torch.load(weights_only=True)`, so loading an artifact never runs pickled code.
"""

from __future__ import annotations

import io
import logging
import re
from dataclasses import dataclass, field

import torch

from fedpipe.algorithms.base import Params, ServerState
from fedpipe.errors import CorruptArtifactError, StoreError
from fedpipe.store.base import Store

log = logging.getLogger(__name__)

FORMAT = 1


@dataclass
class PhaseState:
    """Everything training needs to go on: the server's state, each client's kept state, and the
    last finished round (global index). Randomness is derived from (seed, round, client), so no RNG
    state is needed to resume."""

    method: str
    phase: str  # the phase that produced this state ("init" before any)
    round: int
    server: ServerState
    clients: dict[int, Params] = field(default_factory=dict)
    config_fingerprint: str = ""

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        torch.save(
            {
                "format": FORMAT,
                "method": self.method,
                "phase": self.phase,
                "round": self.round,
                "config_fingerprint": self.config_fingerprint,
                "global": _cpu(self.server.global_params),
                "server_clients": {k: _cpu(v) for k, v in self.server.per_client.items()},
                "clients": {k: _cpu(v) for k, v in self.clients.items()},
            },
            buf,
        )
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, device: torch.device | str = "cpu", where: str = "state") -> PhaseState:
        try:
            d = torch.load(io.BytesIO(data), map_location=device, weights_only=True)
            if d.get("format") != FORMAT:
                raise ValueError(f"unknown state format {d.get('format')!r}")
            return cls(
                method=d["method"],
                phase=d["phase"],
                round=int(d["round"]),
                server=ServerState(dict(d["global"]), {int(k): dict(v) for k, v in d["server_clients"].items()}),
                clients={int(k): dict(v) for k, v in d["clients"].items()},
                config_fingerprint=d.get("config_fingerprint", ""),
            )
        except Exception as e:  # any unreadable content is a bad artifact, reported as such
            raise CorruptArtifactError(
                f"{where} is not a readable fedpipe state ({type(e).__name__}: {e}). It was damaged or "
                "written by something else; rerun the step that produces it."
            ) from None


def _cpu(params: Params) -> Params:
    return {k: v.detach().to("cpu") for k, v in params.items()}


class Checkpoints:
    """Per-round checkpoints of one phase, and its final state, in the store.

    Layout: <run>/phases/<phase>/round-00007.pt while the phase runs, <run>/phases/<phase>/final.pt
    when it is done (the checkpoints are then removed).
    """

    ROUND = re.compile(r"round-(\d+)\.pt$")

    def __init__(self, store: Store, run_id: str, phase: str):
        self.store = store
        self.prefix = f"{run_id}/phases/{phase}/"

    @property
    def final_key(self) -> str:
        return self.prefix + "final.pt"

    def round_keys(self) -> list[tuple[int, str]]:
        found = [(int(m.group(1)), k) for k in self.store.list(self.prefix) if (m := self.ROUND.search(k))]
        return sorted(found)

    def save_round(self, state: PhaseState, keep: int) -> None:
        self.store.put(f"{self.prefix}round-{state.round:05d}.pt", state.to_bytes())
        for _, key in self.round_keys()[:-keep]:
            self.store.delete(key)

    def latest_good(self, device: torch.device | str) -> PhaseState | None:
        """The newest checkpoint that reads back intact; damaged ones are reported and skipped.
        None when the phase has no checkpoint; an error when it has some but none is intact (starting
        the phase over silently would hide the damage)."""
        keys = self.round_keys()
        for rnd, key in reversed(keys):
            try:
                return PhaseState.from_bytes(self.store.get(key), device, where=self.store.url(key))
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
        self.store.put(self.final_key, state.to_bytes())
        for _, key in self.round_keys():
            self.store.delete(key)

    def has_final(self) -> bool:
        return self.store.exists(self.final_key)

    def load_final(self, device: torch.device | str) -> PhaseState:
        if not self.has_final():
            raise StoreError(f"{self.store.url(self.final_key)} does not exist: the phase that writes it has not finished. Run it first.")
        data = self.store.get(self.final_key)
        return PhaseState.from_bytes(data, device, where=self.store.url(self.final_key))
