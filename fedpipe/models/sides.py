"""The two model sets the gate weighs (the candidate run's and the promoted version's), each with the data
it was trained on, and how either is scored on samples from anywhere.

A model set is fed as it was trained: its inputs standardised as its own run chose (`data.standardisation`: with
its own training rows' statistics when pooled, else its fixed or declared constants), and a
client's personalized model picked on that client's own validation split (`fedpipe.engine.evaluation`). So
`score(side, tests, globals)` appends the samples to score to the side's own training data, points each
named client's test split at them (the global test set at `globals`), and evaluates: the very same samples
can be scored by both sides, each seeing them the way it sees its own data.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np
import torch

from fedpipe.algorithms import build_algorithm
from fedpipe.algorithms.base import Algorithm, ServerState
from fedpipe.data import DatasetBundle, LabeledArrays
from fedpipe.data.datasets import load_dataset
from fedpipe.data.federated import Standardisation, prepare_data
from fedpipe.data.partition import Partition, make_partition
from fedpipe.engine.evaluation import evaluate_global, evaluate_personalized
from fedpipe.engine.state import PhaseState
from fedpipe.errors import ConfigError
from fedpipe.models.line import ModelLine, VersionRecord
from fedpipe.models.warm import STATE_FILE, state_limit_for, version_client_names
from fedpipe.nn.imported import is_import_path, policy_problem
from fedpipe.nn.networks import build_model
from fedpipe.run.config import RunConfig
from fedpipe.run.run import Run
from fedpipe.seeding import derive_seed

EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class Scores:
    """One model set's accuracies: per client (by name), and its global model's on each named global set
    ("" is the global test set)."""

    clients: dict[str, float]
    global_accuracy: float | None
    globals: dict[str, float | None] | None = None


@dataclass(frozen=True)
class Side:
    """A model set with its data: its algorithm, final server and client states (keyed by `partition`'s
    client ids), the bundle and partition it was trained on, and how its run standardised inputs."""

    algorithm: Algorithm
    server: ServerState
    clients: dict
    bundle: DatasetBundle
    partition: Partition
    standardisation: Standardisation = Standardisation()

    @cached_property
    def names(self) -> dict[int, str]:
        """Client id -> name (a natural partition's names, else the ids written out)."""
        names = self.partition.client_names or tuple(str(c.id) for c in self.partition.clients)
        return {c.id: name for c, name in zip(self.partition.clients, names, strict=True)}

    @cached_property
    def _by_name(self) -> dict:
        return {self.names[c.id]: c for c in self.partition.clients}

    def split(self, name: str, split: str) -> LabeledArrays:
        """Client `name`'s raw samples of one split."""
        rows = getattr(self.client(name), split)
        return LabeledArrays(self.bundle.train.x[rows], self.bundle.train.y[rows])

    def client(self, name: str):
        """Client `name`'s split (a `ClientSplit`)."""
        return self._by_name[name]

    def ids(self, rows: np.ndarray) -> np.ndarray:
        return self.bundle.sample_ids[rows]

    def global_test(self) -> tuple[LabeledArrays, np.ndarray | None]:
        """The raw global test set and its samples' identities (None without identities)."""
        if self.partition.global_test_indices is None:
            return self.bundle.test, None  # type: ignore[return-value]
        rows = self.partition.global_test_indices
        ids = None if self.bundle.sample_ids is None else self.bundle.sample_ids[rows]
        return LabeledArrays(self.bundle.train.x[rows], self.bundle.train.y[rows]), ids


def candidate_side(run: Run) -> Side:
    """The candidate run's final models on its own data."""
    state = run.checkpoints(run.phases()[-1].name).load_final(run.device)
    algorithm, _ = run.build_algorithm()
    return Side(algorithm, state.server, dict(state.clients), run.bundle, run.load_partition(), run.cfg.standardisation())


def champion_side(run: Run, line: ModelLine, record: VersionRecord, cfg: RunConfig, data: tuple[DatasetBundle, Partition] | None) -> Side:
    """Version `record`'s models with `data` (its own drop's bundle and partition, or the candidate's when its
    drop cannot be read); its states re-keyed to `data`'s client ids by name (clients `data` lacks are left out)."""
    device = run.device
    check_recorded_model(record, line.name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(cfg.run.seed, "init-global"))
        model = build_model(record.spec.model, record.spec.input_shape, record.spec.num_classes).to(device)
    algorithm = build_algorithm(cfg.method, model, cfg.run.seed)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    where = f"model line {line.name!r} version {record.version} ({line.store.url(line.keys.version(record.version) + STATE_FILE)})"
    state = PhaseState.from_bytes(line.read(record.version, STATE_FILE, state_limit_for(model_bytes, len(record.clients))), device, where=where)
    bundle, partition = data if data is not None else (run.bundle, run.load_partition())
    names = version_client_names(record, state, where)
    target = {n: i for i, n in Side(algorithm, state.server, {}, bundle, partition).names.items()}
    to_data = {c: target[n] for c, n in names.items() if n in target}
    server = replace(state.server, per_client={to_data[c]: p for c, p in state.server.per_client.items() if c in to_data})
    return Side(algorithm, server, {to_data[c]: p for c, p in state.clients.items() if c in to_data}, bundle, partition,
                cfg.standardisation())  # the version's own choice: its models were trained on inputs standardised so


def check_recorded_model(record: VersionRecord, line: str) -> None:
    """A version record's model name (a bucket writer can plant one) passes this deployment's import policy
    before anything is imported (FEDPIPE_MODEL_PACKAGES, `fedpipe.nn.imported`)."""
    if is_import_path(record.spec.model) and (problem := policy_problem(record.spec.model)):
        raise ConfigError(f"Model line {line!r} version {record.version}'s record names its model by import path, and it "
                          f"is refused: {problem}. Nothing was imported, registered or promoted.")


def version_data(record_cfg: RunConfig) -> tuple[DatasetBundle, Partition]:
    """The data a version was trained on, read again (its data.snapshot pinned: a drop changed since is an error)."""
    bundle = load_dataset(record_cfg.data)
    return bundle, make_partition(bundle, record_cfg.partition, record_cfg.run.seed)


def score(side: Side, cfg: RunConfig, device: torch.device, tests: dict[str, LabeledArrays],
          globals_: dict[str, LabeledArrays] | None = None) -> Scores:
    """`side`'s models on `tests` (client name -> its samples to score) and its global model on each of
    `globals_` (name -> samples); a client of `tests` the side has no state for is scored as the method
    scores a client it never saw."""
    globals_ = {k: v for k, v in (globals_ or {}).items() if len(v)}
    tests = {k: v for k, v in tests.items() if len(v)}
    train = side.bundle.train
    parts, offset, positions = [train], len(train), {}
    for name, arrays in [*tests.items(), *((f"\0{k}", v) for k, v in globals_.items())]:
        positions[name] = np.arange(offset, offset + len(arrays), dtype=np.int64)
        parts.append(arrays)
        offset += len(arrays)
    merged = replace(side.bundle, train=LabeledArrays(np.concatenate([p.x for p in parts]), np.concatenate([p.y for p in parts])),
                     sample_ids=None)
    names = side.names
    glob_rows = np.concatenate([positions[f"\0{k}"] for k in globals_]) if globals_ else EMPTY
    partition = replace(side.partition, pool_size=len(merged.train), global_test_indices=glob_rows,
                        clients=tuple(replace(c, test=positions.get(names[c.id], EMPTY)) for c in side.partition.clients))
    data = prepare_data(merged, partition, device, side.standardisation)
    scored = replace(data, clients=tuple(c for c in data.clients if names[c.client_id] in tests))
    clients = {}
    if scored.clients:
        pers = evaluate_personalized(side.algorithm, side.server, side.clients, scored, cfg.eval.batch_size, cfg.eval.ece_bins,
                                     candidates=cfg.eval.candidates)
        clients = {names[c.client_id]: c.accuracy for c in pers.clients}
    results: dict[str, float | None] = {}
    start = 0
    for name, arrays in globals_.items():
        one = replace(data, global_test=replace(data.global_test, x=data.global_test.x[start:start + len(arrays)],
                                                y=data.global_test.y[start:start + len(arrays)]))
        start += len(arrays)
        result = evaluate_global(side.algorithm, side.server, one, cfg.eval.batch_size, cfg.eval.ece_bins)
        results[name] = None if result is None else result.accuracy
    return Scores(clients, results.get(""), results)


def own_scores(side: Side, cfg: RunConfig, device: torch.device) -> Scores:
    """A side's models on its own test splits and global test set."""
    tests = {name: side.split(name, "test") for name in side.names.values()}
    glob, _ = side.global_test()
    return score(side, cfg, device, tests, {"": glob} if glob is not None else {})

