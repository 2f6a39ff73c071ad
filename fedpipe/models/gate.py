"""The promotion gate: is a run's version good enough to replace the promoted one, and is its data sound?

`decide(candidate_run, line, cfg.registry)` weighs the candidate's models against the promoted version's
(`fedpipe.models.sides`: each set fed as it was trained, its chosen personalized models as
`fedpipe.engine.evaluation` picks them) on data the candidate's drop cannot rewrite:

- by default, the test samples that both versions' drops hold, read from the PROMOTED version's drop (its
  data snapshot, read again and checked): stable splits (`fedpipe.data.identity`) make them the same files,
  so a drop that relabels or swaps them cannot move the comparison. The candidate's new test samples are
  scored by both and reported apart. When the promoted version's drop can no longer be read (deleted, or
  changed since), or the data has no sample identities (a bundled dataset), the candidate's test splits are
  used, and the decision says so;
- with `registry.reference`, a pinned reference set instead: each client's samples there score its models,
  all of them the global models.

Clients are matched by name (a natural partition's client names, else the ids). Before comparing, the drop
check (`fedpipe.models.drop_check`) scores the promoted version on each client's new test split against
what it recorded at registration, and on each part of it apart: the samples its own drop held (paired with its
drop's copies of the same files) and the new ones (relabelled files under new names show there, however many
other files are renamed); a flagged client marks the drop as suspect and nothing is promoted.
A decision names the checks its settings turned off (`checks_off`).

The metric (`registry.gate_metric`):
- personalized_accuracy: the mean test accuracy of the shared clients' personalized models;
- worst10_accuracy: the mean of the lowest 10% of those accuracies (at least one client);
- global_accuracy: the global model's accuracy on the global test set (a method without one cannot be gated on it).

Promote when the drop is not suspect AND candidate >= promoted - `tolerance` AND no shared client loses more
than `max_client_drop` AND no new client falls more than `max_client_drop` below the promoted version's global
model on that client's test split (its floor; a method without a global model: the promoted client model whose
label mix is nearest). The line's first version (nothing promoted yet) is promoted. A gate that cannot decide
(a metric the method does not produce, a promoted version on other inputs or labels, a damaged or missing
promoted version) raises; nothing is then registered or promoted.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np
from pydantic import ValidationError

from fedpipe.config import RegistryConfig, format_validation_error
from fedpipe.data import LabeledArrays
from fedpipe.errors import ConfigError, CorruptArtifactError, DataError
from fedpipe.models.drop_check import ClientCheck, Seen, check_drop, evaluation_bytes, label_shift, read_evaluation
from fedpipe.models.line import ModelLine, ModelSpec, VersionRecord
from fedpipe.models.sides import Scores, Side, candidate_side, champion_side, own_scores, score, version_data
from fedpipe.run.config import RunConfig
from fedpipe.run.run import Run
from fedpipe.safe_load import parse_yaml

log = logging.getLogger(__name__)

METRICS = ("personalized_accuracy", "global_accuracy", "worst10_accuracy")
MAX_NAMED_CLIENTS = 20  # clients named in a decision (the record stays small at any client count)

__all__ = ["Decision", "Scores", "checks_off", "compare", "decide", "gate_metric", "worst_fraction_mean"]


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
    compared: dict = field(default_factory=dict)  # what was compared: on which data, how many samples
    new_samples: dict = field(default_factory=dict)  # the candidate's new test samples, scored apart
    drop_check: dict = field(default_factory=dict)  # suspect, flagged clients and every client's figures
    floors: dict = field(default_factory=dict)  # new clients: the candidate's accuracy and the floor it must keep
    settings: dict = field(default_factory=dict)  # the registry settings the decision was made under
    evaluation: bytes = b""  # the candidate's own figures per client (evaluation.json), not part of the record

    def to_json(self) -> dict:
        return {"promoted": self.promote, "reason": self.reason, "metric": self.metric, "candidate": self.candidate,
                "champion": self.champion, "champion_version": self.champion_version, "shared_clients": self.shared_clients,
                "new_clients": list(self.new_clients[:MAX_NAMED_CLIENTS]), "new_client_count": len(self.new_clients),
                "candidate_on_new_clients": self.candidate_on_new_clients,
                "dropped_clients": dict(list(self.dropped.items())[:MAX_NAMED_CLIENTS]), "dropped_client_count": len(self.dropped),
                "compared": self.compared, "new_samples": self.new_samples, "drop_check": self.drop_check,
                "new_client_floors": dict(list(self.floors.items())[:MAX_NAMED_CLIENTS]), "settings": self.settings,
                "checks_off": checks_off(self.settings)}


def settings_of(registry: RegistryConfig) -> dict:
    """The registry settings a decision depends on (the line's name aside)."""
    return registry.model_dump(mode="json", exclude={"name"})


# the drop check's rules and the value that turns each off (or opens it all the way)
_RULES_OFF = (("max_drop", "accuracy-fall rule", lambda v: v >= 1), ("max_label_shift", "label-shift rule", lambda v: v >= 1),
              ("chance_multiple", "below-chance rule", lambda v: v <= 0), ("relabel_below_chance", "relabelled-new-samples rule", lambda v: v <= 0),
             ("max_seen_drop", "seen-samples rule", lambda v: v >= 1), ("max_new_drop", "new-samples rule", lambda v: v >= 1))


def checks_off(settings: dict) -> list[str]:
    """The gate's checks that a decision's registry settings (`settings_of`) turn off or open all the way, in words
    naming the setting: what a promotion made under them did not look at."""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    check, off = settings.get("drop_check") or {}, []
    if check.get("enabled") is False:
        off.append("the drop check (registry.drop_check.enabled=false)")
    else:
        off += [f"the drop check's {what} (registry.drop_check.{key}={check[key]:g})"
                for key, what, is_off in _RULES_OFF if number(check.get(key)) and is_off(check[key])]
    if number(settings.get("max_client_drop")) and settings["max_client_drop"] >= 1:
        off.append(f"the per-client loss limit (registry.max_client_drop={settings['max_client_drop']:g})")
    if number(settings.get("tolerance")) and settings["tolerance"] >= 1:
        off.append(f"the metric comparison (registry.tolerance={settings['tolerance']:g})")
    return off


def decide(candidate: Run, line: ModelLine, registry: RegistryConfig) -> Decision:
    """The gate's decision for `candidate` (an evaluated run) against `line`'s promoted version."""
    metric, cfg, device = registry.gate_metric, candidate.cfg, candidate.device
    cand = candidate_side(candidate)
    mine = own_scores(cand, cfg, device)
    if metric == "global_accuracy" and mine.global_accuracy is None:
        raise ConfigError(f"registry.gate_metric=global_accuracy, but {cfg.method.name} trains no global model "
                          "(or the data has no global test set), so the gate has nothing to compare: choose "
                          "personalized_accuracy or worst10_accuracy. Nothing was registered or promoted.")
    evaluation = _evaluation(cand, mine)
    version = line.promoted()  # a pointer to a missing or changed record: CorruptArtifactError, nothing promoted
    if version is None:
        value = gate_metric(metric, list(mine.clients.values()), mine.global_accuracy)
        return Decision(True, f"the first version of model line {line.name!r}: promoted without a comparison", metric,
                        value, None, None, 0, tuple(mine.clients), settings=settings_of(registry), evaluation=evaluation)
    record = line.record(version)
    _check_inputs(ModelSpec.of_run(candidate), record, line.name)
    champ_cfg = version_config(record, line.name)
    champ_data, where = _champion_data(candidate, champ_cfg, record)
    champ = champion_side(candidate, line, record, champ_cfg, champ_data)
    known = [n for n in cand.names.values() if n in set(record.clients) and n in set(champ.names.values())]
    own_drop = champ_data is not None
    new_tests, new_globals = _new_sets(cand, champ, known) if own_drop else ({}, {})
    if registry.reference:
        tests, globals_, compared = _reference_sets(candidate, registry.reference, known)
    else:
        tests, globals_, compared = _shared_sets(cand, champ, known, own_drop, where)
    mine_shared, theirs = score(cand, cfg, device, tests, globals_), score(champ, cfg, device, tests, globals_)
    new_samples, on_new = _apart(cand, champ, cfg, device, new_tests, new_globals)
    on_seen = _seen(cand, champ, known, cfg, device) if own_drop else None
    checks, check_note = _drop_check(cand, champ, line, version, known, registry, cfg, device,
                                     on_new if own_drop or champ_cfg.data == cfg.data else None, on_seen)
    floors = _floors(cand, champ, record, [n for n in mine.clients if n not in known], mine, cfg, device)
    new = tuple(n for n in mine.clients if n not in known)
    shared = Scores({n: a for n, a in mine_shared.clients.items() if n in known}, mine_shared.global_accuracy)
    decision = compare(shared, Scores({n: a for n, a in theirs.clients.items() if n in known}, theirs.global_accuracy),
                       version, registry, new_clients=new, on_new=float(np.mean([mine.clients[n] for n in new])) if new else None,
                       checks=checks, floors=floors, check_note=check_note)
    return Decision(**{**decision.__dict__, "compared": compared, "new_samples": new_samples, "evaluation": evaluation})


def compare(mine: Scores, theirs: Scores, version: int, registry: RegistryConfig, *, new_clients: tuple[str, ...] | None = None,
            on_new: float | None = None, checks: list[ClientCheck] | None = None, floors: dict | None = None,
            check_note: str = "") -> Decision:
    """The decision from both model sets' scores on the compared data (`theirs` holds the shared clients only),
    the drop check's figures and the new clients' floors."""
    metric, checks, floors = registry.gate_metric, checks or [], floors or {}
    shared = [name for name in mine.clients if name in theirs.clients]
    new = new_clients if new_clients is not None else tuple(name for name in mine.clients if name not in theirs.clients)
    if on_new is None and new and all(n in mine.clients for n in new):
        on_new = float(np.mean([mine.clients[n] for n in new]))
    flagged = [c for c in checks if c.flagged]
    suspect = registry.drop_check.enabled and bool(flagged)
    check = {"enabled": registry.drop_check.enabled, "suspect": suspect, "flagged": [c.to_json() for c in flagged[:MAX_NAMED_CLIENTS]],
             "flagged_count": len(flagged), "clients": [c.to_json() for c in checks[:MAX_NAMED_CLIENTS]], "checked": len(checks),
             "note": check_note}
    common = {"drop_check": check, "floors": floors, "settings": settings_of(registry)}
    if metric == "global_accuracy" and theirs.global_accuracy is None:
        raise ConfigError(f"registry.gate_metric=global_accuracy, but the promoted version {version} has no global model "
                          "to compare with: choose personalized_accuracy or worst10_accuracy. Nothing was promoted.")
    if not shared and metric != "global_accuracy":  # every test file renamed, say: the drop check still speaks first
        figures = f"no client of this run is one of version {version}'s, so {metric} cannot be compared"
        return Decision(False, _suspect(flagged, figures) if suspect else f"{figures}: not promoted (promote it by hand if it "
                        "is wanted)", metric, None, None, version, 0, new, on_new, **common)
    candidate = gate_metric(metric, [mine.clients[n] for n in shared], mine.global_accuracy)
    champion = gate_metric(metric, [theirs.clients[n] for n in shared], theirs.global_accuracy)
    drops = {n: theirs.clients[n] - mine.clients[n] for n in shared}
    dropped = dict(sorted(((n, d) for n, d in drops.items() if d > registry.max_client_drop), key=lambda nd: -nd[1]))
    below = {n: f for n, f in floors.items() if f["floor"] is not None and f["candidate"] < f["floor"] - registry.max_client_drop}
    better = candidate >= champion - registry.tolerance
    figures = f"{metric} {candidate:.4f} vs {champion:.4f} of version {version} over {len(shared)} shared clients"
    if suspect:
        reason = _suspect(flagged, figures)
    elif not better:
        reason = f"not promoted: {figures}, below it by more than the tolerance {registry.tolerance:g}"
    elif dropped:
        worst = ", ".join(f"{n} -{d:.4f}" for n, d in list(dropped.items())[:5])
        reason = (f"not promoted: {len(dropped)} client(s) lost more than max_client_drop={registry.max_client_drop:g} "
                  f"({worst}); {figures}")
    elif below:
        worst = ", ".join(f"{n} {f['candidate']:.4f} < {f['floor']:.4f}" for n, f in list(below.items())[:5])
        reason = (f"not promoted: {len(below)} new client(s) fall more than max_client_drop={registry.max_client_drop:g} below "
                  f"the promoted version's model on their data ({worst}); {figures}")
    else:
        reason = f"promoted: {figures} (tolerance {registry.tolerance:g}); no client lost more than {registry.max_client_drop:g}"
    promote = better and not dropped and not below and not suspect
    return Decision(promote, reason, metric, candidate, champion, version, len(shared), new, on_new, dropped, **common)


def _suspect(flagged: list[ClientCheck], figures: str) -> str:
    """The reason of a decision the drop check stopped."""
    named = "; ".join(f"{c.name}: {c.flagged}" for c in flagged[:5])
    return (f"not promoted: the drop check flags {len(flagged)} client(s) ({named}{' ...' if len(flagged) > 5 else ''}): the "
            f"new data looks broken or poisoned for them. Check those clients' files; once the drop is fixed "
            f"retrain, or decide again with `fedpipe models regate` ({figures})")


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


# --- what the gate compares on -----------------------------------------------------------------------------------

def _champion_data(candidate: Run, champ_cfg: RunConfig, record: VersionRecord):
    """The promoted version's own data (its drop read again, its partition made again) and a phrase saying what is
    compared; None when that is this run's data, or cannot be had (the candidate's test splits are used then)."""
    mine = candidate.cfg
    if champ_cfg.data == mine.data and champ_cfg.partition == mine.partition and champ_cfg.run.seed == mine.run.seed:
        return None, "the test splits of the data both versions were trained on"
    if candidate.bundle.sample_ids is None:
        return None, "this run's test splits (the data has no sample identities to match the promoted version's by)"
    try:
        return version_data(champ_cfg), f"the test samples both drops hold, as version {record.version}'s drop holds them"
    except (DataError, ConfigError) as exc:
        log.warning("The gate compares on this run's test splits: version %d's drop could not be read again (%s).",
                    record.version, str(exc)[:300])
        return None, f"this run's test splits: version {record.version}'s drop could not be read again ({str(exc)[:300]})"


def _take(side: Side, rows: np.ndarray) -> LabeledArrays:
    return LabeledArrays(side.bundle.train.x[rows], side.bundle.train.y[rows])


def _shared_sets(cand: Side, champ: Side, known: list[str], own_drop: bool, where: str):
    """(tests, globals, what was compared): the shared test samples from the promoted version's drop (without it:
    the candidate's test splits)."""
    if not own_drop:
        tests = {n: cand.split(n, "test") for n in known}
        glob, _ = cand.global_test()
        globals_ = {"": glob} if glob is not None else {}
    else:
        tests = {}
        for n in known:
            ht = champ.client(n).test
            tests[n] = _take(champ, ht[np.isin(champ.ids(ht), cand.ids(cand.client(n).test))])
        (_, c_ids), (hg, h_ids) = cand.global_test(), champ.global_test()
        keep = np.isin(h_ids, c_ids)
        globals_ = {"": LabeledArrays(hg.x[keep], hg.y[keep])}
    compared = {"on": where, "samples": int(sum(len(t) for t in tests.values())),
                "global_samples": int(sum(len(g) for g in globals_.values())), "clients": len(known)}
    return tests, globals_, compared


def _new_sets(cand: Side, champ: Side, known: list[str]):
    """(new tests, new globals): the candidate's test samples that the promoted version's drop did not hold in its
    test splits (new files, or files under new names), per shared client and of the global test set."""
    new_tests = {}
    for n in known:
        ct = cand.client(n).test
        new_tests[n] = _take(cand, ct[~np.isin(cand.ids(ct), champ.ids(champ.client(n).test))])
    (cg, c_ids), (_, h_ids) = cand.global_test(), champ.global_test()
    if c_ids is None or h_ids is None:
        return new_tests, {}
    fresh = ~np.isin(c_ids, h_ids)
    return new_tests, {"": LabeledArrays(cg.x[fresh], cg.y[fresh])}


def _seen(cand: Side, champ: Side, known: list[str], cfg: RunConfig, device) -> dict[str, Seen]:
    """The promoted version on each shared client's test samples that its own drop held: on the new drop's copies
    of those files and on its own drop's (what the drop check's seen-samples rule reads)."""
    now, then = {}, {}
    for n in known:
        ct, ht = cand.client(n).test, champ.client(n).test
        now[n] = _take(cand, ct[np.isin(cand.ids(ct), champ.ids(ht))])
        then[n] = _take(champ, ht[np.isin(champ.ids(ht), cand.ids(ct))])
    on_now, on_then = score(champ, cfg, device, now).clients, score(champ, cfg, device, then).clients
    return {n: Seen(on_now[n], on_then[n], len(now[n])) for n in on_now if n in on_then}


def _reference_sets(candidate: Run, url: str, known: list[str]):
    """(tests, globals, what was compared) from the pinned reference set `registry.reference`."""
    from fedpipe.data.files import load_files

    ref = load_files(url, candidate.cfg.data.image_size)
    bundle = candidate.bundle
    if tuple(ref.input_shape) != tuple(bundle.input_shape) or tuple(ref.class_names) != tuple(bundle.class_names):
        raise ConfigError(f"registry.reference={url} holds inputs of shape {tuple(ref.input_shape)} with labels {list(ref.class_names)[:10]}, "
                          f"but the line's models take {tuple(bundle.input_shape)} with {list(bundle.class_names)[:10]}: point it at a "
                          "reference set laid out as the training data (same manifest labels, same image size). Nothing was promoted.")
    tests = {n: LabeledArrays(ref.train.x[ref.clients == k], ref.train.y[ref.clients == k])
             for k, n in enumerate(ref.client_names) if n in known}
    compared = {"on": f"the reference set {ref.snapshot['source']}", "snapshot": ref.snapshot["digest"],
                "samples": int(sum(len(t) for t in tests.values())), "global_samples": len(ref.train), "clients": len(tests)}
    return tests, {"": ref.train}, compared


def _weighted(scores: Scores, sets: dict[str, LabeledArrays]) -> float | None:
    n = sum(len(sets[k]) for k in scores.clients)
    return float(sum(a * len(sets[k]) for k, a in scores.clients.items()) / n) if n else None


def _apart(cand: Side, champ: Side, cfg: RunConfig, device, tests: dict, globals_: dict) -> tuple[dict, dict[str, tuple[float, int]]]:
    """Both versions on the candidate's new test samples, reported; and the promoted version's accuracy on each
    client's new test samples with their count (what the drop check's relabelled-new-samples rule reads)."""
    tests = {k: v for k, v in tests.items() if len(v)}
    globals_ = {k: v for k, v in globals_.items() if len(v)}
    out = {"samples": int(sum(len(t) for t in tests.values())), "global_samples": int(sum(len(g) for g in globals_.values()))}
    if not tests and not globals_:
        return out, {}
    mine, theirs = score(cand, cfg, device, tests, globals_), score(champ, cfg, device, tests, globals_)
    out |= {"candidate": _weighted(mine, tests), "champion": _weighted(theirs, tests),
            "candidate_global": mine.global_accuracy, "champion_global": theirs.global_accuracy}
    return out, {n: (a, len(tests[n])) for n, a in theirs.clients.items()}


def _drop_check(cand: Side, champ: Side, line: ModelLine, version: int, known: list[str], registry: RegistryConfig,
                cfg: RunConfig, device, on_new: dict[str, tuple[float, int]] | None,
                on_seen: dict[str, Seen] | None) -> tuple[list[ClientCheck], str]:
    """The promoted version on each shared client's new test split, against its figures at registration; `on_new`,
    `on_seen`: on each client's new test samples, and on those its own drop held (None: which samples are new is not
    known, as the promoted version's drop could not be read again)."""
    if not registry.drop_check.enabled:
        return [], "disabled (registry.drop_check.enabled=false)"
    then = read_evaluation(line, version)
    if then is None:
        return [], f"version {version} recorded no per-client figures (registered before the drop check): not checked"
    tests = {n: cand.split(n, "test") for n in known if n in then}
    now = score(champ, cfg, device, tests).clients
    labels = {n: cand.client(n).label_counts for n in tests}
    note = ""
    if on_new is None:
        note = (f"which test samples are new is not known (version {version}'s drop was not read again): the rules on "
                "the seen and the new samples apart (max_seen_drop, max_new_drop, relabel_below_chance) were not applied")
    return check_drop(then, now, {n: len(t) for n, t in tests.items()}, labels, cand.bundle.num_classes, registry.drop_check,
                      on_new, on_seen), note


def _floors(cand: Side, champ: Side, record: VersionRecord, new: list[str], mine: Scores, cfg: RunConfig, device) -> dict:
    """Each new client's floor: the promoted version's global model on its test split, or (a method without one)
    the promoted client model whose label mix is nearest the new client's."""
    if not new:
        return {}
    tests = {n: cand.split(n, "test") for n in new}
    glob = score(champ, cfg, device, {}, tests).globals or {}
    theirs = [n for n in champ.names.values() if n in set(record.clients)]
    floors = {}
    for n in new:
        if n not in mine.clients:
            continue
        if glob.get(n) is not None:
            floors[n] = {"candidate": mine.clients[n], "floor": glob[n], "from": "the promoted global model"}
        elif theirs:
            counts = cand.client(n).label_counts
            nearest = min(theirs, key=lambda m: (label_shift(champ.client(m).label_counts, counts), m))
            acc = score(champ, cfg, device, {nearest: tests[n]}).clients.get(nearest)
            floors[n] = {"candidate": mine.clients[n], "floor": acc, "from": f"the promoted model of client {nearest}"}
    return floors


def _evaluation(cand: Side, mine: Scores) -> bytes:
    """The candidate's own figures per client, recorded with its version (what a later drop check compares with)."""
    names = {n: cand.client(n) for n in mine.clients}
    return evaluation_bytes(mine.clients, {n: len(c.test) for n, c in names.items()},
                            {n: c.label_counts for n, c in names.items()}, mine.global_accuracy)
