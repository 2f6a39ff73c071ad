"""Training a round's clients in one process: one by one, or batched (`fedpipe.engine.batched`),
whichever `engine.clients` asks for (`auto`: `fedpipe.engine.choice.clients_mode`, from the device,
never from timings). The two ways agree within float tolerance, not bitwise; a method whose stages
cannot be batched falls back to one by one, which depends only on the method.

A client that fails (raises, or returns non-finite weights) becomes an outcome with an error: it is
left out of the round, not the end of the run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fedpipe.algorithms.base import Algorithm, ClientContext, Params, Phase, Slots
from fedpipe.config import EngineConfig, TrainConfig
from fedpipe.data.federated import FederatedData
from fedpipe.engine.batched import BatchJob, batchable, stage_key, train_batched
from fedpipe.engine.choice import amp_mode, clients_mode
from fedpipe.engine.chunking import SAFETY, auto_chunk, client_bytes, memory_budget
from fedpipe.engine.privacy import Privacy
from fedpipe.engine.sequential import ClientStats, train_client
from fedpipe.errors import FedpipeError
from fedpipe.seeding import torch_generator

log = logging.getLogger(__name__)


def payload_bytes(params: Params | None) -> int:
    return 0 if params is None else sum(t.numel() * t.element_size() for t in params.values())


@dataclass
class ClientWork:
    """What the server hands a client for a round: its download and the state it kept (None: none yet)."""

    client_id: int
    download: Params
    kept: Params | None


@dataclass
class ClientOutcome:
    """What came back from one client's round."""

    client_id: int
    num_samples: int  # training samples held: the weight of sample-weighted aggregation
    upload: Params | None = None
    new_state: Params | None = None
    stats: ClientStats | None = None
    upload_bytes: int = 0
    error: str | None = None
    update_norm: float | None = None  # with privacy: the L2 norm of the update before clipping (`upload` is then the clipped update)


def _check_finite(client_id: int, params: Params | None) -> None:
    if params is not None and not all(torch.isfinite(t).all() for t in params.values()):
        raise FloatingPointError(f"client {client_id} produced non-finite weights")


def privatize(privacy: Privacy, works: list[ClientWork], outcomes: list[ClientOutcome], round_: int) -> None:
    """Each upload that came back replaced by the client's clipped (in local mode also noised) update, and its
    norm before clipping kept in the outcome (`Privacy.privatize`)."""
    sent = [(w, o) for w, o in zip(works, outcomes) if o.upload is not None and not o.error]
    if not sent:
        return
    updates, norms = privacy.privatize([o.client_id for _, o in sent], [o.upload for _, o in sent], [w.download for w, _ in sent], round_)
    for (_, o), update, norm in zip(sent, updates, norms):
        o.upload, o.update_norm = update, norm


class ClientTrainer:
    """Trains lists of clients for one phase in this process: the local optimisation `train` asks
    for, in the way `engine` asks for, each client's shuffles and noise drawn from a generator
    seeded by (`seed`, "client", round, client id)."""

    def __init__(self, algorithm: Algorithm, phase: Phase, data: FederatedData, train: TrainConfig,
                 engine: EngineConfig, seed: int, on_chunk: Callable[[int, str], None] | None = None,
                 privacy: Privacy | None = None):
        self.algorithm, self.phase = algorithm, phase
        self.privacy = privacy if phase.communicates else None  # clips (and in local mode noises) what leaves a client
        self.train_cfg, self.engine, self.seed = train, engine, seed
        self.by_id = {c.client_id: c for c in data.clients}
        self.device = data.global_test.y.device
        self.mode = clients_mode(engine.clients, self.device.type)
        convolutional = any(isinstance(m, nn.Conv2d) for m in algorithm.model.modules())
        self.channels_last = engine.channels_last == "on" or (engine.channels_last == "auto" and convolutional)
        self.amp = amp_mode(engine.amp, self.device, algorithm.bf16_refusal) == "bf16"  # a phase under torchrun resolves auto here
        self.failed_once = False  # only the first failing client's warning carries a traceback
        self.chunk = engine.chunk if engine.chunk != "auto" else None  # auto: sized at the first batched round
        self.on_chunk = on_chunk  # told the chunk `auto` chose (the run records it)

    # --- one by one ---------------------------------------------------------------------------
    def _context(self, cid: int, round_: int) -> ClientContext:
        return ClientContext(cid, round_, self.phase, self.by_id[cid])

    def _finish(self, ctx: ClientContext, work: ClientWork, slots: Slots, stats: ClientStats) -> ClientOutcome:
        upload, new_state = self.algorithm.client_result(ctx, slots, work.kept)
        _check_finite(ctx.client_id, upload)
        _check_finite(ctx.client_id, new_state)
        return ClientOutcome(ctx.client_id, len(ctx.data.train), upload, new_state, stats, payload_bytes(upload))

    def _failed(self, ctx: ClientContext, e: Exception) -> ClientOutcome:
        log.warning("Round %d: client %d failed and is left out of this round: %s", ctx.round, ctx.client_id, e, exc_info=not self.failed_once)
        self.failed_once = True
        return ClientOutcome(ctx.client_id, len(ctx.data.train), error=f"{type(e).__name__}: {e}")

    def _train_kwargs(self, lr: float) -> dict:
        t = self.train_cfg
        return dict(batch_size=t.batch_size, lr=lr, optimizer=t.optimizer, momentum=t.momentum, weight_decay=t.weight_decay)

    def train_one(self, work: ClientWork, round_: int, lr: float) -> ClientOutcome:
        ctx = self._context(work.client_id, round_)
        try:
            slots = self.algorithm.client_params(ctx, work.download, work.kept)
            slots, stats = train_client(
                self.algorithm, ctx, slots, self.algorithm.stages(ctx, self.train_cfg.local_epochs),
                generator=torch_generator(self.seed, "client", round_, ctx.client_id),
                memory_format_cl=self.channels_last, amp=self.amp, **self._train_kwargs(lr),
            )
            return self._finish(ctx, work, slots, stats)
        except (FedpipeError, KeyboardInterrupt):
            raise
        except Exception as e:  # a failing client is left out of the round, not the end of the run
            return self._failed(ctx, e)

    # --- batched ------------------------------------------------------------------------------
    def _jobs(self, works: list[ClientWork], round_: int) -> list[tuple[ClientWork, BatchJob]] | str:
        """Batch jobs for `works`, or the reason they cannot run batched."""
        jobs = []
        for work in works:
            ctx = self._context(work.client_id, round_)
            stages = self.algorithm.stages(ctx, self.train_cfg.local_epochs)
            reason = batchable(stages, self.train_cfg.optimizer)
            if reason:
                return reason
            slots = self.algorithm.client_params(ctx, work.download, work.kept)
            jobs.append((work, BatchJob(ctx, slots, stages, torch_generator(self.seed, "client", round_, work.client_id))))
        return jobs

    def _train_chunk(self, pairs: list[tuple[ClientWork, BatchJob]], round_: int, lr: float) -> list[ClientOutcome]:
        kw = self._train_kwargs(lr)
        results = train_batched(self.algorithm, [job for _, job in pairs], batch_size=kw["batch_size"], lr=lr,
                                momentum=kw["momentum"], weight_decay=kw["weight_decay"], amp=self.amp,
                                graphs=self.engine.graphs == "on")
        outcomes = []
        for (work, job), (slots, stats) in zip(pairs, results):
            try:
                outcomes.append(self._finish(job.ctx, work, slots, stats))
            except (FedpipeError, KeyboardInterrupt):
                raise
            except Exception as e:
                outcomes.append(self._failed(job.ctx, e))
        return outcomes

    def train_batched(self, works: list[ClientWork], round_: int, lr: float) -> list[ClientOutcome] | str:
        """Outcomes in the order of `works`, or why these clients cannot be batched."""
        try:
            jobs = self._jobs(works, round_)
        except (FedpipeError, KeyboardInterrupt):
            raise
        except Exception as e:  # client_params failed for some client: let the one-by-one path name it
            return f"building a client's slots failed ({type(e).__name__}: {e})"
        if isinstance(jobs, str):
            return jobs
        groups: dict[tuple, list[int]] = {}
        for i, (_, job) in enumerate(jobs):
            layout = tuple((name, tuple((k, tuple(t.shape)) for k, t in tensors.items())) for name, tensors in job.slots.items())
            groups.setdefault((layout, tuple(stage_key(s) for s in job.stages)), []).append(i)
        out: dict[int, ClientOutcome] = {}
        chunk = self.chunk or self._size_chunk(jobs[0][1], len(works))
        for rows in groups.values():
            for start in range(0, len(rows), chunk):
                part = rows[start : start + chunk]
                try:
                    for i, outcome in zip(part, self._train_chunk([jobs[i] for i in part], round_, lr)):
                        out[i] = outcome
                except (FedpipeError, KeyboardInterrupt):
                    raise
                except Exception as e:  # no vmap rule for a layer, or one client broke the chunk
                    return f"the batched step failed ({type(e).__name__}: {e})"
        return [out[i] for i in range(len(works))]

    def _size_chunk(self, job: BatchJob, clients: int) -> int:
        """engine.chunk=auto: the largest chunk within the memory budget, from one probe (`chunking`)."""
        per_client = client_bytes(self.algorithm, job.ctx, job.slots, job.stages, self.train_cfg.batch_size,
                                  torch_generator(self.seed, "chunk-probe"))
        budget = memory_budget(self.device, self.engine.chunk_memory_fraction)
        self.chunk = auto_chunk(per_client, budget, clients)
        why = (f"{per_client / 2**20:.1f} MiB a client (x{SAFETY} for the step's temporaries) within "
               f"{budget / 2**30:.1f} GiB ({self.engine.chunk_memory_fraction:g} of the {self.device.type}'s free memory), "
               f"at most the {clients} clients of a round")
        log.info("Batched chunk: %d clients (%s).", self.chunk, why)
        if self.on_chunk is not None:
            self.on_chunk(self.chunk, why)
        return self.chunk

    # --- the choice -----------------------------------------------------------------------------
    def train(self, works: list[ClientWork], round_: int, lr: float) -> list[ClientOutcome]:
        """Outcomes of `works`, in their order; with privacy, each upload is the client's clipped update
        (`fedpipe.engine.privacy`), computed here, on the client's side of the round."""
        outcomes = self._train(works, round_, lr)
        if self.privacy is not None:
            privatize(self.privacy, works, outcomes, round_)
        return outcomes

    def _train(self, works: list[ClientWork], round_: int, lr: float) -> list[ClientOutcome]:
        if self.mode == "sequential" or not works:
            return [self.train_one(w, round_, lr) for w in works]
        if self.mode == "batched":
            outcomes = self.train_batched(works, round_, lr)
            if not isinstance(outcomes, str):
                return outcomes
            self._settle("sequential", f"clients cannot be batched for {self.algorithm.name} in phase {self.phase.name!r}: {outcomes}")
            return [self.train_one(w, round_, lr) for w in works]
        raise ValueError(f"unknown client training mode {self.mode!r}")

    def _settle(self, mode: str, why: str) -> None:
        self.mode = mode
        log.info("Client training: %s.", why)
