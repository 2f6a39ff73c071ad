"""Warm starts (`train.init_from`): a run's first phase starts from a version of its model line instead of
the seeded random weights.

    cfg = pin_init_from(cfg, store)      # when the run starts: `promoted` -> the version it names now
    run = Run(cfg, warm_start=...)       # or attach(run): the version is read when the first phase starts

`pin_init_from` resolves `promoted` to a version number where `with_data_snapshot` pins the data (the CLI's
config loading, the pipeline's config task), so the number is part of the run's config and id: a rerun of
the run starts from the same version even after a later promotion, and the report says which. A line with
no promoted version yet pins `none`: the first scheduled run of a line starts cold.

`warm_start(run)` reads the version's `state.pt` (bounded by what this run's model and the version's clients
can need), checks the version's `ModelSpec` against this run's (a mismatch is a ConfigError naming both),
and maps the version's clients onto this run's by name (a natural partition's client names; the client
ids otherwise): a client of this run the version lacks starts without a state, a client of the version
this run lacks is left out. The run layer gets plain tensors (`fedpipe.run.run.WarmStart`) and never
imports this module.

With privacy.enabled, `starting_ledger` decides what the run's accountant starts from. The version's weights
were trained on its clients' data, so a private run from a private version continues that version's
accountant (its epsilon then covers both runs), and a private run from a version that is not private is
refused unless privacy.public_init says the version holds no client's data.
"""

from __future__ import annotations

import logging
import math

import torch

from fedpipe.algorithms.base import ServerState
from fedpipe.engine.accounting import Ledger
from fedpipe.engine.state import PhaseState
from fedpipe.errors import ConfigError, CorruptArtifactError
from fedpipe.models.line import ModelLine, ModelSpec, VersionRecord
from fedpipe.run.config import RunConfig
from fedpipe.run.privacy import delta_of
from fedpipe.run.run import Run, WarmStart
from fedpipe.store import Store, open_store

log = logging.getLogger(__name__)

STATE_FILE = "state.pt"
#: room per client state beyond the model's own size: a state holds at most a few copies of the model (a
#: local model, a personalized one, the server's per-client model) plus a few hundred bytes per tensor
COPIES_PER_CLIENT = 4
OVERHEAD_PER_CLIENT = 64 * 2**10
OVERHEAD = 16 * 2**20


def _line(cfg: RunConfig, store: Store | None = None) -> ModelLine:
    """The model line a warm start reads (registry.name in the run's store)."""
    if not cfg.registry.name:
        raise ConfigError(f"train.init_from={cfg.train.init_from} starts the run from a version of the model line "
                          "registry.name, but registry.name is empty: set it (the line the versions are in), or set "
                          "train.init_from=none.")
    return ModelLine(store if store is not None else open_store(cfg.run.store), cfg.registry.name)


def pin_init_from(cfg: RunConfig, store: Store | None = None) -> RunConfig:
    """`cfg` with train.init_from pinned: `promoted` becomes the promoted version's number (or `none` while
    the line has none), a version number is checked to exist. `none`: `cfg` as it is."""
    given = cfg.train.init_from
    if given == "none":
        return cfg
    line = _line(cfg, store)
    if given == "promoted":
        version = line.promoted()  # a pointer to a missing or changed version: a CorruptArtifactError here
        if version is None:
            log.warning("Model line %r has no promoted version yet: this run starts from random weights "
                        "(train.init_from=promoted pinned to none).", line.name)
        pinned = "none" if version is None else str(version)
    else:
        line.record(int(given))  # missing or malformed: a clear error before the run starts
        pinned = given
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"init_from": pinned})})


def attach(run: Run) -> Run:
    """`run` with its warm start read when its first phase starts (nothing is read for `none`, nor for a
    phase that resumes from a checkpoint or has finished)."""
    if run.cfg.train.init_from != "none":
        run.warm_start = lambda: warm_start(run)
    return run


def warm_start(run: Run) -> WarmStart | None:
    """The first phase's start from the version train.init_from names (None for `none`)."""
    given = run.cfg.train.init_from
    if given == "none":
        return None
    if given == "promoted":
        raise ConfigError("train.init_from=promoted must be pinned to a version number when the run starts "
                          "(fedpipe.models.warm.pin_init_from), so that the run's id says which version it started from.")
    line = _line(run.cfg, run.store)
    version = int(given)
    record = line.record(version)
    check_spec(ModelSpec.of_run(run), record, line.name)
    where = f"model line {line.name!r} version {version} ({line.store.url(line.keys.version(version) + STATE_FILE)})"
    data = line.read(version, STATE_FILE, state_limit(run, record))
    state = PhaseState.from_bytes(data, "cpu", where=where)
    if state.method != run.cfg.method.name:
        raise ConfigError(f"{where} holds a {state.method} state, but this run trains {run.cfg.method.name}.")
    ids = client_ids(run)
    names = version_client_names(record, state, where)
    clients = {ids[names[c]]: dict(p) for c, p in state.clients.items() if names.get(c) in ids}
    per_client = {ids[names[c]]: dict(p) for c, p in state.server.per_client.items() if names.get(c) in ids}
    kept = len(set(clients) | set(per_client))
    log.info("Warm start from %s: %d of this run's %d clients keep their state from it (%d start without one).",
             where, kept, len(ids), len(ids) - kept)
    ledger = starting_ledger(run.cfg, version_ledger(record, state, where), f"model line {line.name!r} version {version} "
                             f"(run {record.run_id})", len(ids))
    return WarmStart(ServerState(dict(state.server.global_params), per_client), clients, where, privacy=ledger)


def version_ledger(record: VersionRecord, state: PhaseState, where: str) -> Ledger | None:
    """The accountant a version's training spent: its state's (checked by `Ledger.from_json` as the state is read,
    and pinned by the record's sha256 of state.pt), which must be the one its record shows (`fedpipe models`)."""
    if record.privacy is not None and (state.privacy is None or state.privacy.to_json() != record.privacy.to_json()):
        raise CorruptArtifactError(f"{where}: the version's state and its record disagree on its privacy ledger, so "
                                   "what it spent is unknown. It was damaged or written by something else; start from "
                                   "another version.")
    return state.privacy


def starting_ledger(cfg: RunConfig, spent: Ledger | None, source: str, num_clients: int) -> Ledger | None:
    """The accountant a warm-started run starts with (None: a fresh one, or none without privacy).

    A private version's history continues: the new run's rounds are more sampled Gaussian mechanisms on the same
    people (its clients' data shaped the starting weights), and RDP composes additively across mechanisms (Mironov
    2017, Prop. 1; Opacus's accountants compose a history by the same sum), so epsilon over the joined history at
    this run's delta, with this run's accountant, bounds what both runs reveal. A version that is not private (no
    ledger, or an infinite epsilon: noise_multiplier 0) has no bound to continue: refused unless privacy.public_init."""
    p = cfg.privacy
    if not p.enabled:
        return None  # the run reports no epsilon, and its own version is not private either
    if spent is not None and math.isfinite(epsilon := spent.epsilon()):
        own = spent.rounds - spent.inherited_rounds
        sources = [*spent.sources, {"from": source[:Ledger.MAX_SOURCE_CHARS], "rounds": own}][-Ledger.MAX_SOURCES:]
        log.info("privacy: this run continues the accountant of %s (%d private rounds, epsilon %.3f at its delta %.3g); "
                 "every epsilon it reports covers those rounds too.", source, spent.rounds, epsilon, spent.delta)
        return Ledger(p.accountant, delta_of(cfg, num_clients), [list(h) for h in spent.history],
                      inherited_rounds=spent.rounds, sources=sources)
    if p.public_init:
        log.warning("privacy: %s was not trained with differential privacy; privacy.public_init=true says it holds no client's "
                    "data, so its training is not counted in this run's epsilon.", source)
        return None
    why = ("it has no privacy ledger: it was trained with privacy.enabled=false" if spent is None
           else "its privacy ledger spends an infinite epsilon: it was trained with privacy.noise_multiplier=0")
    raise ConfigError(
        f"train.init_from={cfg.train.init_from}: this run has privacy.enabled=true, but it would start from {source}, which "
        f"is not private ({why}). Its weights may reveal its clients' data, and no epsilon this run reports would cover "
        "that. Start from a private version (`fedpipe models list {cfg.registry.name}` shows each version's epsilon), or from random weights "
        "(train.init_from=none); or, if that version was trained on public data only, set privacy.public_init=true.")


def check_spec(mine: ModelSpec, record: VersionRecord, line: str) -> None:
    """A version's model must be this run's: a ConfigError naming both specs and what differs."""
    differ = mine.mismatch(record.spec)
    if differ:
        raise ConfigError(
            f"train.init_from={record.version}: version {record.version} of model line {line!r} is {_spec_text(record.spec)}, "
            f"but this run trains {_spec_text(mine)} ({'; '.join(f'this run vs the version: {d}' for d in differ)}). A warm "
            "start needs the same model, method, input shape and labels: set train.init_from=none to start from random "
            "weights, or register this configuration in another line (registry.name)."
        )


def _spec_text(spec: ModelSpec) -> str:
    names = ", ".join(spec.class_names[:10]) + (" ..." if len(spec.class_names) > 10 else "")
    return (f"model {spec.model} trained with {spec.method} on inputs of shape {tuple(spec.input_shape)} with "
            f"{spec.num_classes} classes ({names})")


def state_limit(run: Run, record: VersionRecord) -> int:
    """The most bytes the version's state can take for this run's model (`state_limit_for`)."""
    _, initial = run.build_algorithm(torch.device("cpu"))
    return state_limit_for(sum(t.numel() * t.element_size() for t in initial.values()), len(record.clients))


def state_limit_for(model_bytes: int, clients: int) -> int:
    """The most bytes a state of `clients` clients can take for a model of `model_bytes`: every client with a
    few copies of the model, the server's own, and room for the tensors' headers."""
    return OVERHEAD + (clients + 1) * (COPIES_PER_CLIENT * model_bytes + OVERHEAD_PER_CLIENT) + 2 * model_bytes


def client_ids(run: Run) -> dict[str, int]:
    """This run's clients by name: a natural partition's names, else the ids written out."""
    partition = run.load_partition()
    names = partition.client_names or tuple(str(c.id) for c in partition.clients)
    return {name: c.id for name, c in zip(names, partition.clients)}


def version_client_names(record: VersionRecord, state: PhaseState, where: str) -> dict[int, str]:
    """The version's client ids -> names: its record lists its clients in id order."""
    names = dict(enumerate(record.clients))
    unknown = sorted((set(state.clients) | set(state.server.per_client)) - set(names))
    if unknown:
        raise ConfigError(f"{where} holds states of clients {unknown[:5]} that its record does not list "
                          f"({len(record.clients)} clients): the version is inconsistent; start from another one.")
    return names
