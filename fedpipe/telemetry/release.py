"""What a round's telemetry may release beyond the trusted server when privacy is on (issue 40, finding P4).

Under central DP the server process and its run store are trusted; whatever leaves them (the Prometheus
Pushgateway, MLflow, Kubeflow Trainer's status, the report's published figures) is a release, and epsilon
covers only the noised aggregate of the clients' uploaded updates. So with privacy.enabled every sink outside
the server gets `releasable(event)` (through `Released`), and the report draws from `releasable_row`: one
allowlist of figures that are noised, post-processing of noised ones, or fixed by the config.

Released:

- the run's labels and the round indices (round, phase_round, phase_rounds): fixed by the config;
- epsilon, epsilon_against_server (local mode) and privacy_delta (the accountant's), privacy_clip (the config's;
  with adaptive clipping, an update from a noised count: post-processing), the noise multiplier;
- personalized_accuracy and global_accuracy: evaluation on the clients' held-out data, which epsilon does NOT
  cover (left unprivatised, as in the papers; the report says so).

Withheld (None, or left out of `extra` and `details`): clients and failed_clients (the realized size of a
Poisson-sampled cohort), train_loss, bytes (the cohort's size again), seconds and samples_per_second (the
cohort's data, through timing), every other `extra` (the update-norm median and clipped fraction, in a
one-client round that client's exact norm; the evaluation's loss and ECE; a method's scalars) and all
`details` (APFL's alphas, ...). A name this module does not know is withheld too: a new figure is private until
someone adds it here with the reason it may go.

The run store's round log (JSONL) and the progress bar on the server's own terminal keep every figure: they do
not leave the trusted server. Not closed here: WHEN each release happens (Pushgateway push times, MLflow
timestamps) still shows roughly how long each round took.
"""

from __future__ import annotations

import dataclasses

from fedpipe.telemetry.events import PhaseEvent, RoundEvent, RunLabels

__all__ = ["RELEASED_EXTRA", "RELEASED_FIELDS", "Released", "releasable", "releasable_row", "released"]

#: RoundEvent fields a sink outside the server may receive with privacy on (the rest are withheld); the two
#: accuracies are evaluation on the clients' own data, which epsilon does not cover
RELEASED_FIELDS = frozenset({"labels", "round", "phase_round", "phase_rounds", "personalized_accuracy", "global_accuracy"})
#: `extra` scalars that may go: the accountant's figures and the mechanism's parameters
RELEASED_EXTRA = frozenset({"epsilon", "epsilon_against_server", "privacy_delta", "privacy_clip", "privacy_noise_multiplier",
                            "noise_multiplier"})

_LABELS = frozenset(f.name for f in dataclasses.fields(RunLabels))  # a round log's line carries the labels flat


def _extra(extra: dict | None) -> dict:
    return {k: v for k, v in (extra or {}).items() if k in RELEASED_EXTRA}


def releasable(event: RoundEvent) -> RoundEvent:
    """`event` as a sink outside the trusted server may receive it with privacy on: the allowlist's figures, None
    for every other field, `extra` cut to RELEASED_EXTRA, no `details`."""
    withheld = {f.name: None for f in dataclasses.fields(RoundEvent) if f.name not in RELEASED_FIELDS}
    return dataclasses.replace(event, **{**withheld, "extra": _extra(event.extra), "details": {}})


def releasable_row(row: dict) -> dict:
    """A round log's line (`RoundEvent.to_dict`, read back from the store) cut to the same allowlist: what the
    published report may draw from with privacy on."""
    keep = (RELEASED_FIELDS - {"labels"}) | _LABELS
    out = {k: (v if k in keep else None) for k, v in row.items()}
    return {**out, "extra": _extra(row.get("extra")), "details": {}}


class Released:
    """A sink outside the trusted server, given only what `releasable` allows (privacy on); a phase's wall time
    is withheld too (it sums the rounds' times)."""

    def __init__(self, sink):
        self.sink = sink

    def __repr__(self) -> str:
        return f"Released({self.sink!r})"

    def phase_started(self, event: PhaseEvent) -> None:
        self.sink.phase_started(event)  # labels and round counts: fixed by the config

    def round_finished(self, event: RoundEvent) -> None:
        self.sink.round_finished(releasable(event))

    def phase_finished(self, event: PhaseEvent) -> None:
        self.sink.phase_finished(dataclasses.replace(event, seconds=None))

    def close(self) -> None:
        self.sink.close()


def released(sinks: list, private: bool) -> list:
    """`sinks` (each one leaving the trusted server) as they may be used: each behind `Released` with privacy
    on, as given with it off."""
    return [Released(s) for s in sinks] if private else list(sinks)
