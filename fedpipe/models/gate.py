"""The promotion gate: is a run's version good enough to replace the promoted one?

`decide(candidate_run, line, cfg.registry)` scores both on the CANDIDATE's data: the candidate's chosen
personalized models (as `fedpipe.engine.evaluation` picks them, on each client's validation split) and the
promoted version's (its `state.pt`, its method and config build its algorithm), each client's models on that
client's test split, the global models on the global test set. Clients are matched by name (a natural
partition's client names, else the ids): the clients present in both are compared, the candidate's new
clients are reported apart (the promoted version has no model of theirs).

The metric (`registry.gate_metric`):
- personalized_accuracy: the mean test accuracy of the shared clients' personalized models;
- worst10_accuracy: the mean of the lowest 10% of those accuracies (at least one client);
- global_accuracy: the global model's accuracy on the global test set (a method without one cannot be gated on it).

Promote when candidate >= promoted - `tolerance` AND no shared client loses more than `max_client_drop`
accuracy. The line's first version (nothing promoted yet) is promoted. A gate that cannot decide (a metric
the method does not produce, a promoted version on other inputs or labels, a damaged or missing promoted
version) raises; nothing is then registered or promoted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from pydantic import ValidationError

from fedpipe.algorithms import build_algorithm
from fedpipe.config import RegistryConfig, format_validation_error
from fedpipe.data.federated import FederatedData, prepare_data
from fedpipe.engine.evaluation import evaluate_global, evaluate_personalized
from fedpipe.engine.state import PhaseState
from fedpipe.errors import ConfigError, CorruptArtifactError
from fedpipe.models.line import ModelLine, ModelSpec, VersionRecord
from fedpipe.models.warm import STATE_FILE, client_ids, state_limit_for, version_client_names
from fedpipe.nn.networks import build_model
from fedpipe.run.config import RunConfig
from fedpipe.run.run import Run
from fedpipe.safe_load import parse_yaml
from fedpipe.seeding import derive_seed

METRICS = ("personalized_accuracy", "global_accuracy", "worst10_accuracy")
MAX_NAMED_CLIENTS = 20  # clients named in a decision (the record stays small at any client count)


@dataclass(frozen=True)
class Scores:
    """One model set's accuracies on the candidate's data: per client (by name) and the global model's."""

    clients: dict[str, float]
    global_accuracy: float | None


@dataclass(frozen=True)
class Decision:
    """What the gate decided and the figures it decided on."""

    promote: bool
    reason: str
    metric: str
    candidate: float | None  # the metric over the compared clients (all of them for the first version)
    champion: float | None  # the promoted version's, over the same clients (None: nothing promoted yet)
    champion_version: int | None
    shared_clients: int = 0
    new_clients: tuple[str, ...] = ()
    candidate_on_new_clients: float | None = None  # the candidate's mean accuracy on its new clients
    dropped: dict[str, float] = field(default_factory=dict)  # shared clients losing more than max_client_drop

    def to_json(self) -> dict:
        return {"promoted": self.promote, "reason": self.reason, "metric": self.metric, "candidate": self.candidate,
                "champion": self.champion, "champion_version": self.champion_version, "shared_clients": self.shared_clients,
                "new_clients": list(self.new_clients[:MAX_NAMED_CLIENTS]), "new_client_count": len(self.new_clients),
                "candidate_on_new_clients": self.candidate_on_new_clients,
                "dropped_clients": dict(list(self.dropped.items())[:MAX_NAMED_CLIENTS]), "dropped_client_count": len(self.dropped)}


def decide(candidate: Run, line: ModelLine, registry: RegistryConfig) -> Decision:
    """The gate's decision for `candidate` (an evaluated run) against `line`'s promoted version."""
    metric = registry.gate_metric
    data = prepare_data(candidate.bundle, candidate.load_partition(), candidate.device)
    ids = client_ids(candidate)
    mine = candidate_scores(candidate, data, ids)
    if metric == "global_accuracy" and mine.global_accuracy is None:
        raise ConfigError(f"registry.gate_metric=global_accuracy, but {candidate.cfg.method.name} trains no global model "
                          "(or the data has no global test set), so the gate has nothing to compare: choose "
                          "personalized_accuracy or worst10_accuracy. Nothing was registered or promoted.")
    version = line.promoted()  # a pointer to a missing or changed record: CorruptArtifactError, nothing promoted
    if version is None:
        value = gate_metric(metric, list(mine.clients.values()), mine.global_accuracy)
        return Decision(True, f"the first version of model line {line.name!r}: promoted without a comparison", metric,
                        value, None, None, 0, tuple(mine.clients))
    theirs = champion_scores(candidate, line, version, data, ids)
    return compare(mine, theirs, version, registry)


def compare(mine: Scores, theirs: Scores, version: int, registry: RegistryConfig) -> Decision:
    """The decision from both model sets' scores (`theirs` holds the shared clients only)."""
    metric = registry.gate_metric
    shared = [name for name in mine.clients if name in theirs.clients]
    new = tuple(name for name in mine.clients if name not in theirs.clients)
    on_new = float(np.mean([mine.clients[n] for n in new])) if new else None
    if metric == "global_accuracy" and theirs.global_accuracy is None:
        raise ConfigError(f"registry.gate_metric=global_accuracy, but the promoted version {version} has no global model "
                          "to compare with: choose personalized_accuracy or worst10_accuracy. Nothing was promoted.")
    if not shared and metric != "global_accuracy":
        return Decision(False, f"no client of this run is one of version {version}'s, so {metric} cannot be compared: "
                        "not promoted (promote it by hand if it is wanted)", metric, None, None, version, 0, new, on_new)
    candidate = gate_metric(metric, [mine.clients[n] for n in shared], mine.global_accuracy)
    champion = gate_metric(metric, [theirs.clients[n] for n in shared], theirs.global_accuracy)
    drops = {n: theirs.clients[n] - mine.clients[n] for n in shared}
    dropped = dict(sorted(((n, d) for n, d in drops.items() if d > registry.max_client_drop), key=lambda nd: -nd[1]))
    better = candidate >= champion - registry.tolerance
    figures = f"{metric} {candidate:.4f} vs {champion:.4f} of version {version} over {len(shared)} shared clients"
    if better and not dropped:
        reason = f"promoted: {figures} (tolerance {registry.tolerance:g}); no client lost more than {registry.max_client_drop:g}"
    elif not better:
        reason = f"not promoted: {figures}, below it by more than the tolerance {registry.tolerance:g}"
    else:
        worst = ", ".join(f"{n} -{d:.4f}" for n, d in list(dropped.items())[:5])
        reason = (f"not promoted: {len(dropped)} client(s) lost more than max_client_drop={registry.max_client_drop:g} "
                  f"({worst}); {figures}")
    return Decision(better and not dropped, reason, metric, candidate, champion, version, len(shared), new, on_new, dropped)


def worst_fraction_mean(accuracies: list[float], fraction: float) -> float:
    """The mean of the lowest `fraction` of the accuracies: ceil(fraction * n) of them, at least one (the
    gate's worst10_accuracy; a study's fairness column, `fedpipe.study.stats`, is the same number)."""
    return float(np.mean(sorted(accuracies)[: max(1, math.ceil(fraction * len(accuracies)))]))


def gate_metric(metric: str, accuracies: list[float], global_accuracy: float | None) -> float:
    """The gate's metric from client accuracies and the global model's."""
    if metric == "global_accuracy":
        if global_accuracy is None:
            raise ConfigError("registry.gate_metric=global_accuracy needs a global model.")
        return float(global_accuracy)
    if not accuracies:
        raise ConfigError(f"registry.gate_metric={metric} needs at least one client.")
    if metric == "worst10_accuracy":
        return worst_fraction_mean(accuracies, 0.1)
    if metric == "personalized_accuracy":
        return float(np.mean(accuracies))
    raise ConfigError(f"unknown registry.gate_metric {metric!r}; choose one of {', '.join(METRICS)}.")


def _score(algorithm, server, clients, data: FederatedData, names: dict[int, str], cfg: RunConfig) -> Scores:
    pers = evaluate_personalized(algorithm, server, clients, data, cfg.eval.batch_size, cfg.eval.ece_bins, candidates=cfg.eval.candidates)
    glob = evaluate_global(algorithm, server, data, cfg.eval.batch_size, cfg.eval.ece_bins)
    return Scores({names[c.client_id]: c.accuracy for c in pers.clients}, None if glob is None else glob.accuracy)


def candidate_scores(run: Run, data: FederatedData, ids: dict[str, int]) -> Scores:
    """The candidate run's final models on its own data."""
    state = run.checkpoints(run.phases()[-1].name).load_final(run.device)
    algorithm, _ = run.build_algorithm()
    return _score(algorithm, state.server, state.clients, data, {i: n for n, i in ids.items()}, run.cfg)


def champion_scores(run: Run, line: ModelLine, version: int, data: FederatedData, ids: dict[str, int]) -> Scores:
    """Version `version`'s models on the candidate's data: the shared clients' personalized models (its states
    mapped onto the candidate's client ids by name) and its global model."""
    record = line.record(version)
    _check_inputs(ModelSpec.of_run(run), record, line.name)
    cfg = version_config(record, line.name)
    device = run.device
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(cfg.run.seed, "init-global"))
        model = build_model(record.spec.model, record.spec.input_shape, record.spec.num_classes).to(device)
    algorithm = build_algorithm(cfg.method, model, cfg.run.seed)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    where = f"model line {line.name!r} version {version} ({line.store.url(line.keys.version(version) + STATE_FILE)})"
    state = PhaseState.from_bytes(line.read(version, STATE_FILE, state_limit_for(model_bytes, len(record.clients))), device, where=where)
    names = version_client_names(record, state, where)
    to_mine = {c: ids[n] for c, n in names.items() if n in ids}
    server = replace(state.server, per_client={to_mine[c]: p for c, p in state.server.per_client.items() if c in to_mine})
    clients = {to_mine[c]: p for c, p in state.clients.items() if c in to_mine}
    shared = set(to_mine.values())
    subset = replace(data, clients=tuple(c for c in data.clients if c.client_id in shared))
    return _score(algorithm, server, clients, subset, {i: n for n, i in ids.items()}, run.cfg)


def _check_inputs(mine: ModelSpec, record: VersionRecord, line: str) -> None:
    """The promoted version must read the candidate's inputs and predict its labels (its model or method may differ)."""
    theirs = record.spec
    differ = [d for d in mine.mismatch(theirs) if d.split(":")[0] in ("input_shape", "num_classes", "class_names")]
    if differ:
        raise ConfigError(f"The gate cannot compare this run with version {record.version} of model line {line!r}: they "
                          f"see other inputs or labels ({'; '.join(f'this run vs the version: {d}' for d in differ)}). "
                          "Register this configuration in another line (registry.name). Nothing was promoted.")


def version_config(record: VersionRecord, line: str) -> RunConfig:
    """The config a version was trained with (its method's parameters build its algorithm)."""
    where = f"the config of model line {line!r} version {record.version}"
    tree = parse_yaml(record.config_yaml, where)
    try:
        return RunConfig.model_validate(tree or {})
    except ValidationError as e:
        raise CorruptArtifactError(f"{where} is not a valid fedpipe config: {format_validation_error(e)}") from None
