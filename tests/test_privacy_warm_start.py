"""A private warm start (train.init_from with privacy.enabled, issue 40, P2 and P9): the version's privacy ledger is
recorded, read back as hostile input, and composed into the new run's accountant, so every epsilon the run reports
and the version it publishes cover both runs; a private run from a version that is not private is refused unless
privacy.public_init; and `fedpipe models show` says each version's epsilon and delta and what the guarantee leaves
out (the personalized models the line stores).

The runs are real fedpipe runs on mnist5k (tests/runs.py), published into a model line in a local store; the
accountant is Opacus's, through `epsilon_of`."""

from __future__ import annotations

import json
import math

import pytest
from runs import SMALL, train_all
from typer.testing import CliRunner

from fedpipe.cli import app
from fedpipe.engine.accounting import Ledger, default_delta, epsilon_of
from fedpipe.errors import ConfigError, CorruptArtifactError
from fedpipe.models.line import ModelLine, ModelSpec, VersionRecord
from fedpipe.models.publish import publish
from fedpipe.models.warm import attach, pin_init_from
from fedpipe.run.config import load_config
from fedpipe.run.run import Run
from fedpipe.store import open_store

CLIENTS = 6  # tests/runs.py SMALL
Q = 0.5
FIRST_SIGMA, SECOND_SIGMA = 1.0, 1.5
FIRST_DELTA = 1e-3  # the first run's own delta; the second run keeps the default one, which the composition must use
PRIVATE = ["method.name=fedavg", "train.rounds=2", f"train.client_fraction={Q}", "privacy.enabled=true", "privacy.seeded_noise=true"]


def _run(store, run_id: str, *overrides: str) -> Run:
    """A small run of the line `dp` (registry.name), warm-started as train.init_from says (as `fedpipe run` does)."""
    cfg = load_config(None, [*SMALL, f"run.store={store}", f"run.id={run_id}", "registry.name=dp", *overrides])
    return attach(Run(pin_init_from(cfg)))


def _published(run: Run) -> tuple[dict, int]:
    """Train, evaluate and publish `run`: its summary and its version."""
    train_all(run)
    summary = run.evaluate()
    return summary, publish(run)["version"]


def _round_epsilons(run: Run) -> list[float]:
    rows = [json.loads(line) for line in run.store.get_text(run.layout.rounds("federation")).splitlines() if line.strip()]
    return [r["extra"]["epsilon"] for r in rows]


@pytest.fixture(scope="module")
def private_line(tmp_path_factory):
    """v1: a private run (sigma 1.0, delta 1e-3); v2: a private run warm-started from v1 (sigma 1.5, the default delta)."""
    store = tmp_path_factory.mktemp("private-line")
    first = _run(store, "first", *PRIVATE, f"privacy.noise_multiplier={FIRST_SIGMA}", f"privacy.delta={FIRST_DELTA}")
    first_summary, v1 = _published(first)
    second = _run(store, "second", *PRIVATE, f"privacy.noise_multiplier={SECOND_SIGMA}", f"train.init_from={v1}")
    second_summary, v2 = _published(second)
    return {"store": store, "first": first_summary, "second": second_summary, "second_run": second, "versions": (v1, v2)}


def test_a_private_warm_start_composes_the_versions_ledger(private_line):
    """P2: the second run's epsilon is the accountant's over the joined history (the first run's rounds, then its
    own) at the second run's delta: every round's, the summary's and its published version's; more than its own
    rounds alone would spend."""
    first, second, run = private_line["first"], private_line["second"], private_line["second_run"]
    delta = default_delta(CLIENTS)
    assert first["privacy"]["delta"] == pytest.approx(FIRST_DELTA) and second["privacy"]["delta"] == pytest.approx(delta)
    joined = [[FIRST_SIGMA, Q, 2], [SECOND_SIGMA, Q, 2]]
    composed = epsilon_of("rdp", joined, delta)
    alone = epsilon_of("rdp", [[SECOND_SIGMA, Q, 2]], delta)
    assert composed > alone * 1.2 and math.isfinite(composed)
    assert second["privacy"]["epsilon"] == pytest.approx(composed, rel=1e-9)
    assert second["privacy"]["private_rounds"] == 4
    # every round's epsilon already counts the first run's two rounds
    assert _round_epsilons(run) == pytest.approx([epsilon_of("rdp", [[FIRST_SIGMA, Q, 2], [SECOND_SIGMA, Q, r]], delta) for r in (1, 2)],
                                                 rel=1e-9)
    line = ModelLine(open_store(str(private_line["store"])), "dp")
    v1, v2 = private_line["versions"]
    ledger = line.record(v2).privacy
    assert ledger is not None and ledger.history == joined and ledger.delta == pytest.approx(delta)
    assert ledger.epsilon() == pytest.approx(composed, rel=1e-9)
    assert ledger.inherited_rounds == 2 and ledger.sources == [{"from": f"model line 'dp' version {v1} (run first)", "rounds": 2}]
    assert line.record(v1).privacy.history == [[FIRST_SIGMA, Q, 2]]


def test_models_show_names_epsilon_delta_and_what_the_guarantee_leaves_out(private_line, tmp_path):
    """P9: `fedpipe models show` prints a version's epsilon and delta, where inherited rounds came from, and that its
    personalized models are not covered; a version without privacy says "not private" and no caveat."""
    store = str(private_line["store"])
    _, v2 = private_line["versions"]
    runner = CliRunner()
    shown = runner.invoke(app, ["models", "show", f"dp@{v2}", "--store", store])
    assert shown.exit_code == 0, shown.output
    assert "privacy      epsilon" in shown.output and "NOT covered" in shown.output, shown.output
    ledger = ModelLine(open_store(store), "dp").record(v2).privacy
    assert f"privacy      epsilon {ledger.epsilon():.3f} at delta {ledger.delta:.3g} (rdp, 4 private rounds, 2 of them inherited)" in shown.output
    assert "inherited    2 rounds from model line 'dp' version 1 (run first)" in shown.output
    assert "NOT covered" in shown.output and "personalized models" in shown.output and "without noise" in shown.output
    listed = runner.invoke(app, ["models", "list", "dp", "--store", store])
    assert listed.exit_code == 0 and f"epsilon {ledger.epsilon():.3f} at delta {ledger.delta:.3g}" in listed.output

    plain = tmp_path / "plain"
    _published(_run(plain, "plain", "method.name=fedavg", "train.rounds=1"))
    shown = runner.invoke(app, ["models", "show", "dp@1", "--store", str(plain)])
    assert shown.exit_code == 0, shown.output
    assert "privacy      not private" in shown.output and "NOT covered" not in shown.output


def test_a_private_run_from_a_version_that_is_not_private_is_refused_unless_public_init(tmp_path):
    """P2: a version trained without privacy gives the private run no bound to continue: refused, saying why and
    how to go on; with privacy.public_init=true it starts, and its epsilon is its own rounds' alone."""
    _, v1 = _published(_run(tmp_path, "plain", "method.name=fedavg", "train.rounds=1"))
    private = [*PRIVATE, f"privacy.noise_multiplier={SECOND_SIGMA}", f"train.init_from={v1}"]
    refused = _run(tmp_path, "refused", *private)
    refused.partition()
    with pytest.raises(ConfigError) as e:
        refused.train("federation")
    words = str(e.value)
    assert "not private" in words and "no privacy ledger" in words and "privacy.public_init=true" in words
    assert "train.init_from=none" in words and f"version {v1}" in words

    public = _run(tmp_path, "public", *private, "privacy.public_init=true")
    state = train_all(public)
    assert state.privacy.history == [[SECOND_SIGMA, Q, 2]] and state.privacy.inherited_rounds == 0
    assert public.evaluate()["privacy"]["epsilon"] == pytest.approx(epsilon_of("rdp", [[SECOND_SIGMA, Q, 2]], default_delta(CLIENTS)))


# --- the ledger read back as hostile input ---------------------------------------------------------------------


def test_starting_ledger_refuses_an_infinite_one_and_public_init_still_composes_a_private_one():
    from fedpipe.models.warm import starting_ledger

    cfg = load_config(None, [*SMALL, *PRIVATE, "train.init_from=3", "registry.name=dp"])
    noiseless = Ledger("rdp", 1e-3, [[0.0, 1.0, 5]])
    with pytest.raises(ConfigError, match="infinite epsilon"):
        starting_ledger(cfg, noiseless, "version 3", CLIENTS)
    public = cfg.model_copy(update={"privacy": cfg.privacy.model_copy(update={"public_init": True})})
    assert starting_ledger(public, noiseless, "version 3", CLIENTS) is None
    private = Ledger("prv", 1e-3, [[1.0, 0.5, 3]], stopped_at=3, clip=0.7, inherited_rounds=1, sources=[{"from": "version 2", "rounds": 1}])
    for given in (cfg, public):
        started = starting_ledger(given, private, "version 3", CLIENTS)
        # the new run's accountant and delta; the budget stop and the adaptive clip are the old run's, not carried
        assert (started.kind, started.delta, started.history) == ("rdp", default_delta(CLIENTS), [[1.0, 0.5, 3]])
        assert started.stopped_at is None and started.clip is None and started.inherited_rounds == 3
        assert started.sources == [{"from": "version 2", "rounds": 1}, {"from": "version 3", "rounds": 2}]


@pytest.mark.parametrize("bad", [
    {"history": [[-1.0, 0.5, 3]]},  # a negative noise multiplier would count as a private round
    {"history": [[1.0, 1.5, 3]]},  # a sample rate above 1
    {"history": [[1.0, 0.5, -3]]},
    {"history": [[float("nan"), 0.5, 3]]},
    {"history": [[1.0, 0.5, 1]] * 10_001},  # Ledger.MAX_HISTORY + 1: the accountant would work per entry
    {"accountant": "moments"},
    {"delta": 1.0},
    {"inherited_rounds": 4},  # more than the history holds
    {"sources": [{"from": "x" * 501, "rounds": 1}]},  # Ledger.MAX_SOURCE_CHARS + 1
    {"stopped_at": "3"},
])
def test_a_forged_ledger_is_refused(bad, tmp_path):
    good = {"accountant": "rdp", "delta": 1e-3, "history": [[1.0, 0.5, 3]], "stopped_at": None}
    assert Ledger.from_json(good).epsilon() > 0
    with pytest.raises(ValueError):
        Ledger.from_json({**good, **bad})
    # in a version's record: a CorruptArtifactError naming the record
    line = ModelLine(open_store(str(tmp_path)), "dp")
    spec = ModelSpec("twonn", "fedavg", (1, 8, 8), 10, tuple("0123456789"))
    record = line.register(VersionRecord(0, "run-a", spec, "", None, {}, ("0",), privacy=Ledger.from_json(good)), {"spec.json": b"{}"})
    assert line.record(record.version).privacy == Ledger.from_json(good)  # read back as written
    key = line.keys.record(record.version)
    tree = json.loads(line.store.get(key))
    tree["privacy"] = {**good, **bad}
    line.store.put(key, json.dumps(tree).encode())
    with pytest.raises(CorruptArtifactError, match="'privacy' is not a privacy ledger"):
        line.record(record.version)
