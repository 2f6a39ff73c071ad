"""The round loop of one phase: sample clients, train them, aggregate, evaluate, checkpoint, report."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from fedpipe.algorithms.base import Algorithm, ClientContext, Params, Phase, Upload
from fedpipe.config import RunConfig
from fedpipe.engine.data import FederatedData
from fedpipe.engine.local import train_client
from fedpipe.engine.seeding import torch_generator
from fedpipe.engine.state import Checkpoints, PhaseState
from fedpipe.errors import FedpipeError, TrainingError
from fedpipe.evaluation import evaluate_global, evaluate_personalized
from fedpipe.telemetry import PhaseEvent, RoundEvent, RunLabels, Telemetry

log = logging.getLogger(__name__)


def payload_bytes(params: Params) -> int:
    return sum(t.numel() * t.element_size() for t in params.values())


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


@dataclass(frozen=True)
class _Failure:
    client_id: int
    reason: str


def _check_finite(client_id: int, params: Params | None) -> None:
    if params is not None and not all(torch.isfinite(t).all() for t in params.values()):
        raise FloatingPointError(f"client {client_id} produced non-finite weights")


def run_phase(
    cfg: RunConfig,
    algorithm: Algorithm,
    phase: Phase,
    data: FederatedData,
    state: PhaseState,
    checkpoints: Checkpoints,
    telemetry: Telemetry,
    labels: RunLabels,
) -> PhaseState:
    """Run the rounds of `phase` after `state.round` and return the phase's final state."""
    train, seed = cfg.train, cfg.run.seed
    by_id = {c.client_id: c for c in data.clients}
    start = time.perf_counter()
    telemetry.phase_started(PhaseEvent(labels, len(phase.rounds), max(state.round + 1, phase.first_round)))
    for round_ in phase.rounds:
        if round_ <= state.round:
            continue  # finished before a restart
        t0 = time.perf_counter()
        lr = train.lr * train.lr_decay ** (round_ - 1)
        uploads: list[Upload] = []
        failures: list[_Failure] = []
        loss_sum, samples, bytes_up, bytes_down = 0.0, 0, 0, 0
        chosen = select_clients(data, phase, train.client_fraction, seed, round_)
        if not chosen:
            raise TrainingError(f"No client can take part in phase {phase.name!r}: every client is opt-out. Lower partition.opt_out_fraction.")
        for cid in chosen:
            client = by_id[cid]
            ctx = ClientContext(cid, round_, phase, client)
            download = algorithm.download(phase, state.server, cid)
            kept = state.clients.get(cid)
            try:
                slots = algorithm.client_params(ctx, download, kept)
                slots, stats = train_client(
                    algorithm, ctx, slots, algorithm.stages(ctx, train.local_epochs),
                    batch_size=train.batch_size, lr=lr, optimizer=train.optimizer, momentum=train.momentum,
                    weight_decay=train.weight_decay, generator=torch_generator(seed, "client", round_, cid),
                )
                upload, new_state = algorithm.client_result(ctx, slots, kept)
                _check_finite(cid, upload)
                _check_finite(cid, new_state)
            except (FedpipeError, KeyboardInterrupt):
                raise
            except Exception as e:  # a failing client is left out of the round, not the end of the run
                log.warning("Round %d: client %d failed and is left out of this round: %s", round_, cid, e, exc_info=not failures)
                failures.append(_Failure(cid, f"{type(e).__name__}: {e}"))
                continue
            if phase.downloads:
                bytes_down += payload_bytes(download)
            if new_state is not None:
                state.clients[cid] = new_state
            if upload is not None and phase.communicates:
                uploads.append(Upload(cid, len(client.train), upload))
                bytes_up += payload_bytes(upload)
            loss_sum += stats.loss * stats.samples
            samples += stats.samples
        reported = len(chosen) - len(failures)
        if reported < min(train.min_clients, len(chosen)) or (chosen and reported == 0):
            raise TrainingError(
                f"Round {round_} of phase {phase.name!r}: only {reported} of {len(chosen)} clients reported back "
                f"(train.min_clients={train.min_clients}). First failure: client {failures[0].client_id}: {failures[0].reason}. "
                "Nothing of this round was kept; the phase resumes from its last checkpoint when rerun."
            )
        if phase.communicates:
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
