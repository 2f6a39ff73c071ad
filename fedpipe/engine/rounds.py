"""The round loop of one phase: sample clients, train them, aggregate; whatever else happens around
the rounds (evaluation, telemetry, checkpoints) is a `RoundCallback`, as pfl-research wraps its loop."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from fedpipe.algorithms.aggregation import uses_weighted_mean
from fedpipe.algorithms.base import Algorithm, Phase, Upload
from fedpipe.algorithms.robust import PRIVACY_REFUSAL, robust_average, robust_problem
from fedpipe.config import TrainConfig
from fedpipe.data.federated import FederatedData
from fedpipe.engine.accounting import Ledger, default_delta, epsilon_against_server
from fedpipe.engine.clients import ClientOutcome, ClientWork, payload_bytes
from fedpipe.engine.privacy import CLIP_BIT, Privacy, poisson_sample, sum_updates
from fedpipe.engine.state import PhaseState
from fedpipe.errors import ConfigError, TrainingError
from fedpipe.seeding import torch_generator

log = logging.getLogger(__name__)


def eligible_clients(data: FederatedData, phase: Phase) -> list[int]:
    """Who may join the phase's rounds: every client, but opt-out clients never join a communicating phase."""
    return [c.client_id for c in data.clients if not (phase.communicates and c.opt_out)]


def select_clients(data: FederatedData, phase: Phase, fraction: float, seed: int, round_: int,
                   privacy: Privacy | None = None) -> list[int]:
    """The clients of a round, without replacement, seeded by (seed, round).

    m = max(1, round(C * K)) with K all clients; opt-out clients never join a communicating phase,
    and the round keeps m participants when there are enough opt-in clients (as the mixture-of-experts
    paper does). Phases that do not sample take every eligible client. With privacy, a communicating
    phase samples by Poisson instead: each eligible client with probability C, on its own (the round's
    size varies and may be 0; the accountant assumes it, `fedpipe.engine.privacy`).
    """
    pool = eligible_clients(data, phase)
    if not phase.sample_clients:
        return pool
    if privacy is not None and phase.communicates:
        return poisson_sample(pool, fraction, privacy.cfg, privacy.seed, round_, privacy.secret)
    m = min(len(pool), max(1, round(fraction * data.num_clients)))
    order = torch.randperm(len(pool), generator=torch_generator(seed, "sample", round_))
    return sorted(pool[i] for i in order[:m].tolist())


#: Trains a round's clients and returns their outcomes (in the order given) and, when the ranks of a
#: distributed phase already all-reduced the uploads, their sample-weighted average (else None); with
#: privacy, the sum of the clients' clipped updates instead (`fedpipe.engine.privacy`).
RoundTrainer = Callable[[int, float, list[ClientWork]], "tuple[list[ClientOutcome], dict | None]"]


@dataclass
class RoundResult:
    """What one finished round did; callbacks read it and may add to `scores` and `extra` (the
    evaluation does, so that the round's telemetry reports its accuracy)."""

    phase: Phase
    round: int
    clients: int  # reported back
    failed_clients: int
    loss_sum: float  # sum of the clients' mean training loss times their samples
    samples: int
    bytes_uploaded: int
    bytes_downloaded: int
    seconds: float
    scores: dict[str, float | None] = field(default_factory=dict)  # "personalized", "global"
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def last(self) -> bool:
        return self.round == self.phase.last_round


class RoundCallback(Protocol):
    """Called around a phase's rounds: `on_phase_start` before the first round left to run,
    `on_round_end` after each round (the state holds the round's result), `on_phase_end` after the
    last. They run in the order given, but phase-end callbacks in reverse, as nested context
    managers exit: a phase is reported finished only once its final state is saved."""

    def on_phase_start(self, phase: Phase, state: PhaseState) -> None: ...

    def on_round_end(self, state: PhaseState, result: RoundResult) -> None: ...

    def on_phase_end(self, phase: Phase, state: PhaseState) -> None: ...


def run_phase(algorithm: Algorithm, phase: Phase, data: FederatedData, state: PhaseState, train: TrainConfig, seed: int,
              train_round: RoundTrainer, callbacks: Sequence[RoundCallback] = (), privacy: Privacy | None = None) -> PhaseState:
    """Run the rounds of `phase` after `state.round` and return the phase's final state.

    `train_round` trains each round's clients (in this process, `ClientTrainer.train`; a distributed
    phase passes rank 0's side of `fedpipe.engine.distributed.DistributedRound`). With `privacy`
    (a communicating phase), the phase ends early, cleanly, after the last round whose epsilon stays
    within privacy.target_epsilon (`within_budget`); its final state is then that round's. A robust rule
    (`train.robust`) that cannot apply to the phase, or privacy with one, is refused before the first round."""
    check_robust(algorithm, phase, train, privacy)
    for cb in callbacks:
        cb.on_phase_start(phase, state)
    if privacy is not None and state.privacy is not None and state.privacy.clip is not None:
        privacy.clip = state.privacy.clip  # adaptive clipping resumes (or goes on to this phase) where it was
    for round_ in phase.rounds:
        if round_ <= state.round:
            continue  # finished before a restart
        if privacy is not None and not within_budget(privacy, state, data, round_):
            break
        result = run_round(algorithm, phase, data, state, train, seed, train_round, round_, privacy)
        for cb in callbacks:
            cb.on_round_end(state, result)
    state.phase = phase.name
    for cb in reversed(callbacks):
        cb.on_phase_end(phase, state)
    return state


def check_robust(algorithm: Algorithm, phase: Phase, train: TrainConfig, privacy: Privacy | None = None) -> None:
    """ConfigError when `train.robust` is active and the phase aggregates by a rule of the method's own
    (`robust_problem`), or runs with privacy (`PRIVACY_REFUSAL`)."""
    problem = robust_problem(algorithm, [phase], train.robust)
    if problem:
        raise ConfigError(f"{problem}.")
    if privacy is not None and train.robust.active and phase.communicates:
        raise ConfigError(f"{PRIVACY_REFUSAL}.")


def ledger_of(privacy: Privacy, state: PhaseState, data: FederatedData) -> Ledger:
    """The run's accountant, kept in the state (a new one before the first private round)."""
    if state.privacy is None:
        cfg = privacy.cfg
        state.privacy = Ledger(cfg.accountant, cfg.delta if cfg.delta is not None else default_delta(data.num_clients))
    return state.privacy


def within_budget(privacy: Privacy, state: PhaseState, data: FederatedData, round_: int) -> bool:
    """Whether round `round_` may run: always without privacy.target_epsilon; else only when the epsilon after
    it stays within the target (once a round would exceed it, no later communicating round runs either). With
    on_target=calibrate too, as a backstop: calibration plans this run's rounds, while a warm start's inherited
    rounds (`train.init_from`) are spent already, so such a run stops at the target instead of passing it."""
    target = privacy.cfg.target_epsilon
    if target is None:
        return True
    ledger = ledger_of(privacy, state, data)
    if ledger.stopped_at is None and ledger.epsilon_after(privacy.sigma, privacy.q) <= target:
        return True
    if ledger.stopped_at is None:
        ledger.stopped_at = state.round
        log.warning("privacy.target_epsilon=%g reached: round %d would spend epsilon %.3f (delta %.3g); training stops after "
                    "round %d at epsilon %.3f, and the run goes on to evaluate as usual.", target, round_,
                    ledger.epsilon_after(privacy.sigma, privacy.q), ledger.delta, state.round, ledger.epsilon())
    return False


def run_round(algorithm: Algorithm, phase: Phase, data: FederatedData, state: PhaseState, train: TrainConfig, seed: int,
              train_round: RoundTrainer, round_: int, privacy: Privacy | None = None) -> RoundResult:
    """One round: sample, train, keep the clients' new states, aggregate; `state` then holds its result."""
    t0 = time.perf_counter()
    lr = train.lr * train.lr_decay ** (round_ - 1)
    private = privacy is not None and phase.communicates
    chosen = select_clients(data, phase, train.client_fraction, seed, round_, privacy if private else None)
    if not chosen and not private:
        raise TrainingError(f"No client can take part in phase {phase.name!r}: every client is opt-out. Lower partition.opt_out_fraction.")
    works = [ClientWork(cid, algorithm.download(phase, state.server, cid), state.clients.get(cid)) for cid in chosen]
    outcomes, averaged = train_round(round_, lr, works)
    failures = [o for o in outcomes if o.error]
    uploads: list[Upload] = []
    result = RoundResult(phase, round_, len(chosen) - len(failures), len(failures), 0.0, 0, 0, 0, 0.0)
    for work, o in zip(works, outcomes):
        if o.error:
            continue
        if phase.downloads:
            result.bytes_downloaded += payload_bytes(work.download)
        if o.new_state is not None:
            state.clients[o.client_id] = o.new_state
        if phase.communicates and (o.upload is not None or o.upload_bytes):
            result.bytes_uploaded += o.upload_bytes
            if o.upload is not None:
                uploads.append(Upload(o.client_id, o.num_samples, o.upload))
        result.loss_sum += o.stats.loss * o.stats.samples
        result.samples += o.stats.samples
    reported = result.clients
    norms: list[float] = []
    if private:
        norms = [o.update_norm for o in outcomes if o.update_norm is not None]
        result.extra["privacy_clip"] = privacy.clip
        if norms:  # how the clip compares with the updates (to choose privacy.clip: near their median, Andrew et al. 2021)
            result.extra["privacy_clipped_fraction"] = sum(n > privacy.clip for n in norms) / len(norms)
            result.extra["privacy_update_norm_median"] = sorted(norms)[len(norms) // 2]
    if reported < min(train.min_clients, len(chosen)) or (chosen and reported == 0):
        raise TrainingError(
            f"Round {round_} of phase {phase.name!r}: only {reported} of {len(chosen)} clients reported back "
            f"(train.min_clients={train.min_clients}). First failure: client {failures[0].client_id}: {failures[0].error}. "
            "Nothing of this round was kept; the phase resumes from its last checkpoint when rerun."
        )
    if private:
        _aggregate_private(algorithm, privacy, data, state, uploads, averaged, round_, result, norms)
    elif phase.communicates:
        state.server = _aggregate(algorithm, phase, state, train, uploads, averaged, round_)
    result.seconds = time.perf_counter() - t0
    state.round = round_
    state.phase = phase.name
    return result


def _aggregate(algorithm: Algorithm, phase: Phase, state: PhaseState, train: TrainConfig, uploads: list[Upload],
               averaged: dict | None, round_: int):
    """The server state after a round without privacy: with train.robust active on a weighted-mean phase (`check_robust`),
    the robust aggregate of the uploads (`fedpipe.algorithms.robust.robust_average`) applied by `apply_average` as the
    weighted mean would be; else the round's mean (`averaged`: the ranks' all-reduce, SecAgg+'s unmasked sum) applied by
    `apply_mean`, or the method's own `aggregate`."""
    if train.robust.active and uses_weighted_mean(algorithm, phase):
        if averaged is not None:  # a distributed phase gathers the uploads under a robust rule (`DistributedRound`)
            raise TrainingError(f"Round {round_}: {train.robust.describe()} needs each upload, and only their mean came back.")
        if not uploads:
            return state.server
        try:
            robust = robust_average(state.server.global_params, [u.tensors for u in uploads], [u.num_samples for u in uploads],
                                    train.robust)
        except ValueError as e:
            raise TrainingError(f"Round {round_} of phase {phase.name!r}: {e}. Nothing of this round was kept; the phase resumes from its last checkpoint when rerun.") from None
        return algorithm.apply_average(state.server, robust)
    if averaged is not None:  # the ranks' all-reduced weighted mean, or SecAgg+'s (`Algorithm.secure_weighting`)
        return algorithm.apply_mean(state.server, averaged)
    return algorithm.aggregate(phase, state.server, uploads)


def _aggregate_private(algorithm: Algorithm, privacy: Privacy, data: FederatedData, state: PhaseState, uploads: list[Upload],
                       summed: dict | None, round_: int, result: RoundResult, norms: list[float]) -> None:
    """The private aggregate (`Privacy.aggregate`) of the round's clipped updates (`uploads`, or `summed`: the
    sum the ranks of a distributed phase all-reduced), the round spent in the accountant, and with adaptive
    clipping the next round's clip from the round's update norms (kept in the ledger)."""
    total = dict(summed) if summed is not None else sum_updates([u.tensors for u in uploads])
    # under secure aggregation the clients' centred clip bits come summed with their updates (`CLIP_BIT`), never one by one
    centred = float(total.pop(CLIP_BIT).sum()) if total is not None and CLIP_BIT in total else None
    new = privacy.aggregate(state.server.global_params, total, round_)
    if new:
        state.server = algorithm.apply_private(state.server, new)
    ledger = ledger_of(privacy, state, data)
    ledger.spend(privacy.sigma, privacy.q)
    if privacy.cfg.adaptive_clip:
        ledger.clip = privacy.adapt(norms, round_, centred)
    result.extra["epsilon"] = ledger.epsilon()
    if privacy.cfg.mode == "local":  # against the server, which sees each noised update and who sent it
        result.extra["epsilon_against_server"] = epsilon_against_server(ledger.kind, ledger.history, ledger.delta)
    result.extra["privacy_delta"] = ledger.delta
    result.extra["privacy_noise_multiplier"] = privacy.sigma  # the accountant's sigma (fixed by the config, or calibrated from it)
