"""One phase over several processes with torch.distributed: gloo on a CPU, NCCL between GPUs.

Rank 0 runs the phase (sampling, server state, evaluation, checkpoints, metrics); every rank,
rank 0 included, trains a share of each round's clients. Per round:

1. rank 0 scatters each rank its clients (download and kept state; a client goes to the least
   loaded rank, largest first, so ranks finish together);
2. every rank trains its clients (one by one or batched, `fedpipe.engine.clients`);
3. when the algorithm declares the plain weighted mean for the phase (`uses_weighted_mean`: sample-weighted averaging, McMahan et al. 2017, Algorithm 1) the
   ranks all-reduce their weighted sums sum_k n_k * theta_k and sum_k n_k (float64), and no upload
   travels; a method with its own aggregation, or any method under a robust rule (`train.robust`: a median, a
   trimmed mean, multi-Krum or a norm bound needs each update), gathers the uploads on rank 0 instead;
4. rank 0 gathers the outcomes (new client states, statistics, failures).

The result equals one process's within float64 rounding of the sum (`weighted_sum` adds in the
same float64 before dividing). Objects travel over a gloo group even when tensors go over NCCL.

`torchrun` (or a PyTorchJob) starts the ranks and sets RANK / WORLD_SIZE / MASTER_ADDR; without
it, `engine.processes > 1` starts the extra ranks on this machine (`spawn_workers`). Either way
`run_ranks` does the choreography: every rank joins the group; rank 0 runs the phase (a callable)
and first tells the other ranks, with one broadcast (`brief`), what to train on, or None when
there is nothing to do; the other ranks build their `ClientTrainer` from that with a
`TrainerRecipe` and serve rounds until rank 0 says stop; all leave the group.
"""

from __future__ import annotations

import datetime
import importlib
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from fedpipe.algorithms.aggregation import Params, uses_weighted_mean, weighted_sum
from fedpipe.engine import choice
from fedpipe.engine.clients import ClientOutcome, ClientTrainer, ClientWork
from fedpipe.errors import TrainingError

log = logging.getLogger(__name__)

T = TypeVar("T")
TIMEOUT = datetime.timedelta(minutes=30)  # a rank silent this long is taken for dead
STARTUP = datetime.timedelta(minutes=2)  # ranks started on this machine must all have joined by then


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


@dataclass
class Group:
    """This process's place in the process group."""

    rank: int
    world: int
    objects: dist.ProcessGroup  # gloo group for pickled objects
    tensors: dist.ProcessGroup  # the all-reduce's group (NCCL between GPUs, else gloo)
    device: torch.device
    briefed: bool = False  # rank 0: whether the other ranks were told what to do (`brief`)


def join(rank: int | None = None, world: int | None = None, address: str | None = None, port: int | None = None) -> Group:
    """Join (or create) the process group; from torchrun's environment when no arguments are given."""
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", rank or 0))
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    if not dist.is_initialized():
        if rank is None:
            dist.init_process_group(backend, timeout=TIMEOUT)
        else:  # ranks this machine started: one that died at startup must not keep rank 0 waiting long
            try:
                dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world, timeout=STARTUP)
            except RuntimeError as e:
                raise TrainingError(
                    f"The {world} processes of this phase did not all start within {STARTUP.seconds} s ({str(e).splitlines()[0]}). "
                    "Look above for a worker's error; engine.processes=1 trains in this process alone."
                ) from None
    # the groups the phase talks over wait as long as a round may take
    objects = dist.new_group(backend="gloo", timeout=TIMEOUT)
    tensors = dist.new_group(backend="nccl", timeout=TIMEOUT) if backend == "nccl" else objects
    return Group(dist.get_rank(), dist.get_world_size(), objects, tensors, device)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def assign(works: list[ClientWork], sizes: dict[int, int], world: int) -> list[list[ClientWork]]:
    """Clients to ranks, largest first to the least loaded rank (ties: lower rank); each rank's
    list keeps the round's order."""
    load = [0] * world
    owner: dict[int, int] = {}
    for w in sorted(works, key=lambda w: (-sizes[w.client_id], w.client_id)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[w.client_id] = r
        load[r] += sizes[w.client_id]
    return [[w for w in works if owner[w.client_id] == r] for r in range(world)]


def _weighted_sums(outcomes: list[ClientOutcome], equal: bool = False) -> tuple[dict[str, torch.Tensor], float, dict[str, tuple]]:
    """sum_k n_k * theta_k (float64, on the CPU) over this rank's uploads, sum_k n_k, and each tensor's
    (shape, dtype); the uploads themselves are dropped (they need not travel). `equal`: every weight is 1
    (with privacy the uploads are clipped updates, summed as they are)."""
    sent = [o for o in outcomes if o.upload is not None and not o.error]
    uploads = [{k: t.detach().cpu() for k, t in o.upload.items()} for o in sent]
    weights = [1.0 if equal else o.num_samples for o in sent]
    sums = weighted_sum(uploads, weights)
    meta = {k: (tuple(t.shape), t.dtype) for k, t in uploads[0].items()} if uploads else {}
    for o in sent:
        o.upload = None
    return sums, float(sum(weights)), meta


class DistributedRound:
    """Both sides of a distributed round: `lead` on rank 0, `serve` on the others."""

    def __init__(self, group: Group, trainer: ClientTrainer):
        self.group, self.trainer = group, trainer
        # a robust rule (train.robust) needs each upload: the ranks gather them on rank 0 instead of all-reducing
        self.reduce = uses_weighted_mean(trainer.algorithm, trainer.phase) and not trainer.train_cfg.robust.active
        # with privacy every rank holds its clients' clipped updates (`ClientTrainer.train`): their plain sum is
        # all-reduced, and rank 0 adds the noise (`fedpipe.engine.privacy`)
        self.private = trainer.privacy is not None

    def _scatter(self, messages: list | None):
        box = [None]
        dist.scatter_object_list(box, messages, src=0, group=self.group.objects)
        return box[0]

    def _train(self, message) -> tuple[list[ClientOutcome], Params | None, float]:
        round_, lr, works, clip = message
        if clip is not None:  # privacy.adaptive_clip: this round's clip, decided by rank 0
            self.trainer.privacy.clip = clip
        outcomes = self.trainer.train(works, round_, lr)
        if not self.reduce:
            return outcomes, None, 0.0
        sums, weight, meta = _weighted_sums(outcomes, equal=self.private)
        # ranks agree on the uploaded tensors first (a rank may have trained nobody, or only failures)
        metas: list = [None] * self.group.world
        dist.all_gather_object(metas, meta, group=self.group.objects)
        shapes = {k: v for m in metas for k, v in m.items()}
        names = sorted(shapes)
        flat = torch.cat([sums.get(k, torch.zeros(shapes[k][0], dtype=torch.float64)).flatten() for k in names]
                         + [torch.tensor([weight], dtype=torch.float64)]).to(self.group.device)
        dist.all_reduce(flat, group=self.group.tensors)
        flat = flat.cpu()
        total = float(flat[-1])
        out, at = {}, 0
        for k in names:
            shape, dtype = shapes[k]
            n = int(torch.Size(shape).numel())
            if self.private:  # the sum of the clipped updates, in float64
                out[k] = flat[at : at + n].view(shape).clone()
            else:
                out[k] = (flat[at : at + n].view(shape) / total).to(dtype) if total > 0 else None
            at += n
        return outcomes, (out if total > 0 and names else None), total

    def lead(self, round_: int, lr: float, works: list[ClientWork]) -> tuple[list[ClientOutcome], Params | None]:
        """Rank 0: run a round over every rank. Returns the outcomes in the order of `works` and,
        when the ranks all-reduced, the sample-weighted average (with privacy: the sum of the clipped
        updates; None otherwise, or when nobody uploaded)."""
        sizes = {w.client_id: len(self.trainer.by_id[w.client_id].train) for w in works}
        shares = assign(works, sizes, self.group.world)
        try:
            clip = self.trainer.privacy.clip if self.private else None
            mine = self._scatter([(round_, lr, share, clip) for share in shares])
            outcomes, sums, total = self._train(mine)
            gathered: list = [None] * self.group.world
            dist.gather_object(outcomes, gathered, dst=0, group=self.group.objects)
        except RuntimeError as e:
            raise TrainingError(
                f"A worker process of this phase stopped answering in round {round_} ({e}). The phase resumes "
                "from its last checkpoint when rerun."
            ) from None
        by_id = {o.client_id: o for part in gathered for o in part}
        averaged = None if sums is None else {k: v.to(self.trainer.device) for k, v in sums.items()}
        return [by_id[w.client_id] for w in works], averaged

    def stop(self) -> None:
        """Rank 0: tell the other ranks the phase is over."""
        try:
            self._scatter([None] * self.group.world)
        except RuntimeError:
            pass  # a rank already gone has nothing to stop

    def serve(self) -> None:
        """Ranks > 0: train what rank 0 sends until it says stop."""
        while True:
            message = self._scatter(None)
            if message is None:
                return
            outcomes, _, _ = self._train(message)
            dist.gather_object(outcomes, None, dst=0, group=self.group.objects)


# --- the ranks of a phase ---------------------------------------------------------------------
@dataclass(frozen=True)
class TrainerRecipe:
    """How a rank > 0 builds its `ClientTrainer`: `factory` names a function ("package.module:function",
    resolved with importlib, so the engine imports nothing of the layer that provides it; spawned
    ranks are fresh processes that receive only text). It is called as factory(spec, briefing,
    device): `spec` is the text every rank starts with (the run's config and phase), `briefing`
    what rank 0 broadcast (`brief`), never None."""

    factory: str
    spec: str

    def build(self, briefing, device: torch.device) -> ClientTrainer:
        module, _, name = self.factory.partition(":")
        return getattr(importlib.import_module(module), name)(self.spec, briefing, device)


def brief(group: Group | None, message) -> None:
    """Rank 0 tells the other ranks what the phase trains on (a picklable), or None: nothing to do."""
    if group is not None:
        dist.broadcast_object_list([message], src=0, group=group.objects)
        group.briefed = True


def serve(group: Group, recipe: TrainerRecipe) -> None:
    """A rank > 0: wait for rank 0's briefing, then train the clients it sends until it says stop."""
    box = [None]
    dist.broadcast_object_list(box, src=0, group=group.objects)
    if box[0] is not None:
        DistributedRound(group, recipe.build(box[0], group.device)).serve()


def _lead(lead: Callable[[Group], T], group: Group) -> T:
    try:
        return lead(group)
    finally:
        if not group.briefed:  # failed before the ranks got work: let them go
            try:
                brief(group, None)
            except RuntimeError:
                pass


def run_ranks(lead: Callable[[Group | None], T], recipe: TrainerRecipe, processes: int, threads: int | None) -> T | None:
    """Run a phase on every rank: `lead(group)` on rank 0 (its result is returned; it calls `brief`
    once), `serve` on the others (None is returned there). Under torchrun the ranks are torchrun's;
    otherwise `processes` ranks on this machine (1: `lead(None)` in this process alone), each with
    `threads` CPU threads (None: the cores shared out)."""
    if launched_by_torchrun():
        group = join()
        try:
            if group.rank > 0:
                serve(group, recipe)
                return None
            return _lead(lead, group)
        finally:
            leave()
    processes, threads = choice.capped(processes, threads)  # never more processes than cores, whoever asked
    if processes == 1:
        return lead(None)
    threads = threads or max(1, (os.cpu_count() or 1) // processes)
    torch.set_num_threads(threads)
    port = free_port()
    workers = spawn_workers(recipe, processes, port, threads)
    try:
        group = join(0, processes, "127.0.0.1", port)
        try:
            return _lead(lead, group)
        finally:
            leave()
    finally:
        for w in workers:
            try:
                w.wait(timeout=30)
            except subprocess.TimeoutExpired:
                w.kill()


# --- starting ranks on this machine --------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_workers(recipe: TrainerRecipe, world: int, port: int, threads: int) -> list[subprocess.Popen]:
    """Start ranks 1..world-1 of a phase on this machine (rank 0 is the caller), as fresh Python
    processes (`python -m fedpipe.engine.distributed`): nothing of the caller's main module is
    re-imported, so scripts, notebooks and pipeline components all work. The recipe's spec goes over stdin."""
    procs = []
    for rank in range(1, world):
        p = subprocess.Popen(
            [sys.executable, "-m", "fedpipe.engine.distributed", recipe.factory, str(rank), str(world), str(port), str(threads)],
            stdin=subprocess.PIPE, text=True,
        )
        p.stdin.write(recipe.spec)
        p.stdin.close()
        procs.append(p)
    return procs


def _worker_main(argv: list[str]) -> None:
    factory, rank, world, port, threads = argv[0], *map(int, argv[1:5])
    recipe = TrainerRecipe(factory, sys.stdin.read())
    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.WARNING, format=f"rank {rank}: %(levelname)s %(message)s")
    group = join(rank, world, "127.0.0.1", port)
    try:
        serve(group, recipe)
    finally:
        leave()


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
