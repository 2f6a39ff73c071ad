"""What a run does around each round of a phase, as `fedpipe.engine.rounds.RoundCallback`s, in this
order: evaluate (every `eval.every` rounds and the phase's last), report the round's telemetry (with
that evaluation), checkpoint."""

from __future__ import annotations

import copy
import logging
import math
import time

from fedpipe.algorithms.base import Algorithm, Phase
from fedpipe.config import EvalConfig, TrainConfig
from fedpipe.data.federated import FederatedData
from fedpipe.engine.evaluation import evaluate_global, evaluate_model, evaluate_personalized
from fedpipe.engine.rounds import RoundResult, select_clients
from fedpipe.engine.state import Checkpoints, PhaseState, Selection
from fedpipe.telemetry import PhaseEvent, RoundEvent, RunLabels, Telemetry

log = logging.getLogger(__name__)


class Evaluation:
    """Personalized and global accuracy into the round's result, on the rounds `eval.every` asks for."""

    def __init__(self, algorithm: Algorithm, data: FederatedData, cfg: EvalConfig):
        self.algorithm, self.data, self.cfg = algorithm, data, cfg

    def on_phase_start(self, phase: Phase, state: PhaseState) -> None:
        pass

    def on_round_end(self, state: PhaseState, result: RoundResult) -> None:
        cfg, phase = self.cfg, result.phase
        if not (result.last or (cfg.every and (result.round - phase.first_round + 1) % cfg.every == 0)):
            return
        pers = evaluate_personalized(self.algorithm, state.server, state.clients, self.data, cfg.batch_size, cfg.ece_bins,
                                     candidates=cfg.candidates)
        result.scores["personalized"] = pers.mean_accuracy
        glob = evaluate_global(self.algorithm, state.server, self.data, cfg.batch_size, cfg.ece_bins)
        result.scores["global"] = glob.accuracy if glob else None
        if glob:
            result.extra.update(global_loss=glob.loss, global_top5=glob.top5, global_ece=glob.ece)
        if pers.candidate_label:
            result.extra[f"chosen_{pers.candidate_label}_mean"] = float(
                sum(c.candidates[c.chosen] for c in pers.clients) / len(pers.clients)
            )

    def on_phase_end(self, phase: Phase, state: PhaseState) -> None:
        pass


class Reporting:
    """The phase's and each round's telemetry events, with every figure: which of them may leave the trusted server
    with privacy on is decided in one place, `fedpipe.telemetry.release` (applied by `Run.default_sinks`)."""

    def __init__(self, algorithm: Algorithm, telemetry: Telemetry, labels: RunLabels):
        self.algorithm, self.telemetry, self.labels = algorithm, telemetry, labels
        self.start = time.perf_counter()

    def on_phase_start(self, phase: Phase, state: PhaseState) -> None:
        self.start = time.perf_counter()
        self.telemetry.phase_started(PhaseEvent(self.labels, len(phase.rounds), max(state.round + 1, phase.first_round)))

    def on_round_end(self, state: PhaseState, r: RoundResult) -> None:
        phase = r.phase
        self.telemetry.round_finished(
            RoundEvent(
                labels=self.labels, round=r.round, phase_round=r.round - phase.first_round + 1, phase_rounds=len(phase.rounds),
                clients=r.clients, failed_clients=r.failed_clients,
                train_loss=r.loss_sum / r.samples if r.samples else math.nan,
                personalized_accuracy=r.scores.get("personalized"), global_accuracy=r.scores.get("global"),
                bytes_uploaded=r.bytes_uploaded, bytes_downloaded=r.bytes_downloaded, seconds=r.seconds,
                samples_per_second=r.samples / r.seconds if r.seconds > 0 else 0.0, extra=r.extra,
                details=self.algorithm.round_details(state.server, state.clients),
            )
        )

    def on_phase_end(self, phase: Phase, state: PhaseState) -> None:
        seconds = time.perf_counter() - self.start
        self.telemetry.phase_finished(PhaseEvent(self.labels, len(phase.rounds), phase.first_round, finished=True, seconds=seconds))


class Checkpointing:
    """A checkpoint after every round (the newest `keep` kept), the final state at the phase's end.

    Report first, checkpoint second: a process killed between the two redoes the round and its
    JSONL line is replaced on resume; the other order would lose the line of a checkpointed round.
    So this callback comes after `Reporting`."""

    def __init__(self, checkpoints: Checkpoints, keep: int):
        self.checkpoints, self.keep = checkpoints, keep

    def on_phase_start(self, phase: Phase, state: PhaseState) -> None:
        pass

    def on_round_end(self, state: PhaseState, result: RoundResult) -> None:
        self.checkpoints.save_round(state, self.keep)

    def on_phase_end(self, phase: Phase, state: PhaseState) -> None:
        self.checkpoints.save_final(state)


class ModelSelection:
    """`train.select`: the round whose global model scored best on its participating clients' validation
    splits (mean loss or mean accuracy over those clients; the mixture-of-experts paper, Sec. 4), checked every
    `select_every` rounds of a communicating phase and at its last; at the last round the phase's server state
    becomes that round's. The choice rides in the state (`PhaseState.selection`), so it is checkpointed with
    every round and a resumed phase selects as an uninterrupted one would. Comes before `Checkpointing`."""

    def __init__(self, algorithm: Algorithm, data: FederatedData, train: TrainConfig, seed: int, batch_size: int):
        self.algorithm, self.data, self.train, self.seed, self.batch_size = algorithm, data, train, seed, batch_size
        self.by_id = {c.client_id: c for c in data.clients}

    def on_phase_start(self, phase: Phase, state: PhaseState) -> None:
        if state.selection is not None and state.phase != phase.name:
            state.selection = None  # another phase's choice: this phase selects its own

    def on_round_end(self, state: PhaseState, result: RoundResult) -> None:
        phase, train = result.phase, self.train
        if train.select == "last" or not phase.communicates:
            return
        if (result.round - phase.first_round + 1) % train.select_every == 0 or result.last:
            params = self.algorithm.global_model(state.server)
            score = self._score(params, phase, result.round) if params is not None else None
            if score is not None and (state.selection is None or score > state.selection.score):
                state.selection = Selection(result.round, score, copy.deepcopy(state.server))
        if result.last and state.selection is not None:
            log.info("Phase %s ends with round %d's server state (train.select=%s: %.4f; the last round was %d).", phase.name,
                     state.selection.round, train.select, abs(state.selection.score), result.round)
            state.server = copy.deepcopy(state.selection.server)

    def _score(self, params, phase: Phase, round_: int) -> float | None:
        """Higher is better: the mean accuracy, or the negated mean loss, over the round's participants with a
        validation split."""
        clients = [self.by_id[c] for c in select_clients(self.data, phase, self.train.client_fraction, self.seed, round_)]
        scores = [evaluate_model(self.algorithm, params, c.val, self.batch_size, 1) for c in clients if len(c.val)]
        if not scores:
            return None
        if self.train.select == "best_val_accuracy":
            return float(sum(s.accuracy for s in scores) / len(scores))
        return -float(sum(s.loss for s in scores) / len(scores))

    def on_phase_end(self, phase: Phase, state: PhaseState) -> None:
        pass
