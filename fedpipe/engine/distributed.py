"""One phase over several processes with torch.distributed: gloo on a CPU, NCCL between GPUs.

Rank 0 runs the phase (sampling, server state, evaluation, checkpoints, metrics); every rank,
rank 0 included, trains a share of each round's clients. Per round:

1. rank 0 scatters each rank its clients (download and kept state; a client goes to the least
   loaded rank, largest first, so ranks finish together);
2. every rank trains its clients (one by one or batched, `fedpipe.engine.clients`);
3. with the default aggregation (sample-weighted averaging, McMahan et al. 2017, Algorithm 1) the
   ranks all-reduce their weighted sums sum_k n_k * theta_k and sum_k n_k (float64), and no upload
   travels; a method with its own aggregation gathers the uploads on rank 0 instead;
4. rank 0 gathers the outcomes (new client states, statistics, failures).

The result equals one process's within float64 rounding of the sum (weighted_average sums in the
same float64 before dividing). Objects travel over a gloo group even when tensors go over NCCL.

`torchrun` (or a PyTorchJob) starts the ranks and sets RANK / WORLD_SIZE / MASTER_ADDR; without
it, `engine.processes > 1` starts the extra ranks on this machine (`spawn_workers`).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fedpipe.algorithms.base import Algorithm, Params
from fedpipe.engine.clients import ClientOutcome, ClientTrainer, ClientWork
from fedpipe.errors import TrainingError

log = logging.getLogger(__name__)

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


def uses_default_aggregation(algorithm: Algorithm) -> bool:
    return type(algorithm).aggregate is Algorithm.aggregate


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


def _weighted_sums(outcomes: list[ClientOutcome]) -> tuple[dict[str, torch.Tensor], float, dict[str, tuple]]:
    """sum_k n_k * theta_k (float64) over this rank's uploads, sum_k n_k, and each tensor's
    (shape, dtype); the uploads themselves are dropped (they need not travel)."""
    sums: dict[str, torch.Tensor] = {}
    meta: dict[str, tuple] = {}
    weight = 0.0
    for o in outcomes:
        if o.upload is None or o.error:
            continue
        for k, t in o.upload.items():
            if k not in sums:
                sums[k] = torch.zeros(t.shape, dtype=torch.float64)
                meta[k] = (tuple(t.shape), t.dtype)
            sums[k].add_(t.detach().to("cpu", torch.float64), alpha=o.num_samples)
        weight += o.num_samples
        o.upload = None
    return sums, weight, meta


class DistributedRound:
    """Both sides of a distributed round: `lead` on rank 0, `serve` on the others."""

    def __init__(self, group: Group, trainer: ClientTrainer):
        self.group, self.trainer = group, trainer
        self.reduce = trainer.phase.communicates and uses_default_aggregation(trainer.algorithm)

    def _scatter(self, messages: list | None):
        box = [None]
        dist.scatter_object_list(box, messages, src=0, group=self.group.objects)
        return box[0]

    def _train(self, message) -> tuple[list[ClientOutcome], Params | None, float]:
        round_, lr, works = message
        outcomes = self.trainer.train(works, round_, lr)
        if not self.reduce:
            return outcomes, None, 0.0
        sums, weight, meta = _weighted_sums(outcomes)
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
            out[k] = (flat[at : at + n].view(shape) / total).to(dtype) if total > 0 else None
            at += n
        return outcomes, (out if total > 0 and names else None), total

    def lead(self, round_: int, lr: float, works: list[ClientWork]) -> tuple[list[ClientOutcome], Params | None]:
        """Rank 0: run a round over every rank. Returns the outcomes in the order of `works` and,
        when the ranks all-reduced, the sample-weighted average (None otherwise, or when nobody uploaded)."""
        sizes = {w.client_id: len(self.trainer.by_id[w.client_id].train) for w in works}
        shares = assign(works, sizes, self.group.world)
        try:
            mine = self._scatter([(round_, lr, share) for share in shares])
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


# --- starting ranks on this machine --------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_workers(config_json: str, phase: str, world: int, port: int, threads: int) -> list[subprocess.Popen]:
    """Start ranks 1..world-1 of a phase on this machine (rank 0 is the caller), as fresh Python
    processes (`python -m fedpipe.engine.distributed`): nothing of the caller's main module is
    re-imported, so scripts, notebooks and pipeline components all work. The config goes over stdin."""
    procs = []
    for rank in range(1, world):
        p = subprocess.Popen(
            [sys.executable, "-m", "fedpipe.engine.distributed", phase, str(rank), str(world), str(port), str(threads)],
            stdin=subprocess.PIPE, text=True,
        )
        p.stdin.write(config_json)
        p.stdin.close()
        procs.append(p)
    return procs


def _worker_main(argv: list[str]) -> None:
    from fedpipe.run.config import RunConfig
    from fedpipe.run.run import Run

    phase, rank, world, port, threads = argv[0], *map(int, argv[1:5])
    cfg = RunConfig.model_validate(json.loads(sys.stdin.read()))
    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.WARNING, format=f"rank {rank}: %(levelname)s %(message)s")
    group = join(rank, world, "127.0.0.1", port)
    try:
        Run(cfg).serve(phase, group)
    finally:
        leave()


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
