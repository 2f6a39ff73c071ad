"""The ServerApp's checkpoint: its phase state after every round, in its own folder, so that a server killed
mid-run and started again (a new `flwr run` of the same app and run config) goes on from the last finished round.

What is saved is `fedpipe.engine.state.PhaseState`, with its own serialisation (`to_bytes` / `from_bytes`, read back
with `torch.load(weights_only=True)`): the method, the phase and last finished round, the server's state (the global
model) and the spec's fingerprint. It never holds a client's state: in a federation those stay in each site's store,
and `save` refuses a state that holds one. Randomness is derived from (seed, round, client), so the resumed rounds
choose the same clients and train the same way as an uninterrupted run's (`fedpipe.engine.rounds.run_phase` skips the
rounds up to the checkpoint's).

The file is written atomically (a temporary file, then a rename): a server killed mid-write keeps the previous one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from fedpipe.engine.state import PhaseState
from fedpipe.errors import ConfigError

CHECKPOINT = "server-state.pt"
RESUMES = "resumes.jsonl"  # one line per start that found a checkpoint: {"from_phase", "from_round"}
#: the promoted version's server state, written into the out-dir by `fedpipe run` when the run publishes to a model
#: line: the sites score its global model beside the new one, on the same samples (the gate's comparison)
CHAMPION = "champion.safetensors"
#: the global model of the model-line version train.init_from names, written by the submitter: the server's round-0
#: model instead of the seeded initialisation (a warm start; `fedpipe.models.federated.warm_start_for`)
WARM_START = "warm-start.safetensors"
#: with privacy: the accountant of that version (its ledger, JSON), which the server's accountant continues, as a
#: simulated private warm start continues it (`fedpipe.models.warm.starting_ledger`)
WARM_LEDGER = "warm-start-ledger.json"


def fingerprint(spec_json: str) -> str:
    """The spec's fingerprint: a checkpoint is resumed only by a run of the same spec (method, train, seed, model...)."""
    return hashlib.sha256(spec_json.encode()).hexdigest()[:16]


def server_holds(method: str) -> str | None:
    """What `method`'s server keeps per site by its definition (`Algorithm.server_holds`; None: nothing)."""
    from fedpipe.algorithms import ALGORITHMS

    return getattr(ALGORITHMS.get(method), "server_holds", None)


def save(out: Path, state: PhaseState, spec_json: str) -> None:
    """The server's phase state after a round, into `out/server-state.pt` (atomically)."""
    if len(state.clients) or (state.server.per_client and not server_holds(state.method)):
        raise ValueError(f"the server's state holds client states ({len(state.clients)} clients, "
                         f"{len(state.server.per_client)} server-side per-client): a federation keeps them at the sites")
    state.config_fingerprint = fingerprint(spec_json)
    path = out / CHECKPOINT
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(state.to_bytes())
    tmp.replace(path)


def load(out: Path, spec_json: str, method: str) -> PhaseState | None:
    """The checkpoint in `out`, or None when there is none; ConfigError when it belongs to another spec."""
    path = out / CHECKPOINT
    if not path.exists():
        return None
    state = PhaseState.from_bytes(path.read_bytes(), "cpu", where=str(path))
    if state.method != method or state.config_fingerprint != fingerprint(spec_json):
        raise ConfigError(f"{path} is the checkpoint of another run (method {state.method!r}, spec {state.config_fingerprint}); "
                          f"this run's spec is {fingerprint(spec_json)}: use another out-dir, or remove it to start afresh")
    with open(out / RESUMES, "a") as f:
        f.write(json.dumps({"from_phase": state.phase, "from_round": state.round}) + "\n")
    return state
