"""The round loop of one phase: sample clients, train them, aggregate, evaluate, checkpoint, report."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from fedpipe.algorithms.base import Algorithm, Phase, Upload
from fedpipe.data.federated import FederatedData
from fedpipe.engine.clients import ClientOutcome, ClientTrainer, ClientWork, payload_bytes
from fedpipe.engine.evaluation import evaluate_global, evaluate_personalized
from fedpipe.engine.state import Checkpoints, PhaseState
from fedpipe.errors import TrainingError
from fedpipe.seeding import torch_generator
from fedpipe.telemetry import PhaseEvent, RoundEvent, RunLabels, Telemetry

if TYPE_CHECKING:
    from fedpipe.run.config import RunConfig

log = logging.getLogger(__name__)


def select_clients(data: FederatedData, phase: Phase, fraction: float, seed: int, round_: int) -> list[int]:
    """The clients of a round, without replacement, seeded by (seed, round).

    m = max(1, round(C * K)) with K all clients; opt-out clients never join a communicating phase,
    and the round keeps m participants when there are enough opt-in clients (as the mixture-of-experts
    paper does). Phases that do not sample take every eligible client.
    """
    pool = [c.client_id for c in data.clients if not (phase.communicates and c.opt_out)]
    if not phase.sample_clients:
        return pool
    m = min(len(pool), max(1, round(fraction * data.num_clients)))
    order = torch.randperm(len(pool), generator=torch_generator(seed, "sample", round_))
    return sorted(pool[i] for i in order[:m].tolist())


#: Trains a round's clients and returns their outcomes (in the order given) and, when the ranks of a
#: distributed phase already all-reduced the uploads, their sample-weighted average (else None).
RoundTrainer = Callable[[int, float, list[ClientWork]], "tuple[list[ClientOutcome], dict | None]"]


def run_phase(
    cfg: RunConfig,
    algorithm: Algorithm,
    phase: Phase,
    data: FederatedData,
    state: PhaseState,
    checkpoints: Checkpoints,
    telemetry: Telemetry,
    labels: RunLabels,
    train_round: RoundTrainer | None = None,
) -> PhaseState:
    """Run the rounds of `phase` after `state.round` and return the phase's final state.

    `train_round` trains each round's clients (default: in this process, `ClientTrainer`; a
    distributed phase passes rank 0's side of `fedpipe.engine.distributed.DistributedRound`)."""
    train, seed = cfg.train, cfg.run.seed
    if train_round is None:
        trainer = ClientTrainer(cfg, algorithm, phase, data)
        train_round = lambda round_, lr, works: (trainer.train(works, round_, lr), None)  # noqa: E731
    start = time.perf_counter()
    telemetry.phase_started(PhaseEvent(labels, len(phase.rounds), max(state.round + 1, phase.first_round)))
    for round_ in phase.rounds:
        if round_ <= state.round:
            continue  # finished before a restart
        t0 = time.perf_counter()
        lr = train.lr * train.lr_decay ** (round_ - 1)
        chosen = select_clients(data, phase, train.client_fraction, seed, round_)
        if not chosen:
            raise TrainingError(f"No client can take part in phase {phase.name!r}: every client is opt-out. Lower partition.opt_out_fraction.")
        works = [ClientWork(cid, algorithm.download(phase, state.server, cid), state.clients.get(cid)) for cid in chosen]
        outcomes, averaged = train_round(round_, lr, works)
        failures = [o for o in outcomes if o.error]
        uploads: list[Upload] = []
        loss_sum, samples, bytes_up, bytes_down = 0.0, 0, 0, 0
        for work, o in zip(works, outcomes):
            if o.error:
                continue
            if phase.downloads:
                bytes_down += payload_bytes(work.download)
            if o.new_state is not None:
                state.clients[o.client_id] = o.new_state
            if phase.communicates and (o.upload is not None or o.upload_bytes):
                bytes_up += o.upload_bytes
                if o.upload is not None:
                    uploads.append(Upload(o.client_id, o.num_samples, o.upload))
            loss_sum += o.stats.loss * o.stats.samples
            samples += o.stats.samples
        reported = len(chosen) - len(failures)
        if reported < min(train.min_clients, len(chosen)) or (chosen and reported == 0):
            raise TrainingError(
                f"Round {round_} of phase {phase.name!r}: only {reported} of {len(chosen)} clients reported back "
                f"(train.min_clients={train.min_clients}). First failure: client {failures[0].client_id}: {failures[0].error}. "
                "Nothing of this round was kept; the phase resumes from its last checkpoint when rerun."
            )
        if phase.communicates:
            if averaged is not None:
                state.server = algorithm.apply_average(state.server, averaged)
            else:
                state.server = algorithm.aggregate(phase, state.server, uploads)
        seconds = time.perf_counter() - t0
        state.round = round_
        state.phase = phase.name

        personalized = global_acc = None
        extra: dict[str, float] = {}
        last = round_ == phase.last_round
        if last or (cfg.eval.every and (round_ - phase.first_round + 1) % cfg.eval.every == 0):
            pers = evaluate_personalized(algorithm, state.server, state.clients, data, cfg.eval.batch_size, cfg.eval.ece_bins)
            personalized = pers.mean_accuracy
            glob = evaluate_global(algorithm, state.server, data, cfg.eval.batch_size, cfg.eval.ece_bins)
            global_acc = glob.accuracy if glob else None
            if glob:
                extra.update(global_loss=glob.loss, global_top5=glob.top5, global_ece=glob.ece)
            if pers.candidate_label:
                extra[f"chosen_{pers.candidate_label}_mean"] = float(
                    sum(c.candidates[c.chosen] for c in pers.clients) / len(pers.clients)
                )
        # Report first, checkpoint second: a process killed between the two redoes the round and its
        # JSONL line is replaced on resume; the other order would lose the line of a checkpointed round.
        telemetry.round_finished(
            RoundEvent(
                labels=labels, round=round_, phase_round=round_ - phase.first_round + 1, phase_rounds=len(phase.rounds),
                clients=reported, failed_clients=len(failures),
                train_loss=loss_sum / samples if samples else math.nan,
                personalized_accuracy=personalized, global_accuracy=global_acc,
                bytes_uploaded=bytes_up, bytes_downloaded=bytes_down, seconds=seconds,
                samples_per_second=samples / seconds if seconds > 0 else 0.0, extra=extra,
                details=algorithm.round_details(state.server, state.clients),
            )
        )
        checkpoints.save_round(state, train.keep_checkpoints)
    state.phase = phase.name
    checkpoints.save_final(state)
    telemetry.phase_finished(PhaseEvent(labels, len(phase.rounds), phase.first_round, finished=True, seconds=time.perf_counter() - start))
    return state
