"""The steps of a run: partition, train one phase, evaluate. The CLI, the Kubeflow components and the
tests all call these; each reads its inputs from the store and writes its outputs there.

Bad input is found before anything is written: a step validates the config, loads the data and
builds the partition (or reads the previous phase's state) first, and only then writes.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import ValidationError

from fedpipe.algorithms import Algorithm, build_algorithm, phases_of
from fedpipe.algorithms.base import Phase, ServerState
from fedpipe.data import DatasetBundle
from fedpipe.data.datasets import load_dataset
from fedpipe.data.federated import prepare_data
from fedpipe.data.partition import Partition, make_partition
from fedpipe.engine import distributed
from fedpipe.engine.clients import ClientTrainer
from fedpipe.engine.distributed import DistributedRound, launched_by_torchrun
from fedpipe.engine.rounds import run_phase
from fedpipe.engine.state import Checkpoints, PhaseState
from fedpipe.errors import ConfigError, CorruptArtifactError, StoreError
from fedpipe.nn.networks import build_model
from fedpipe.run.config import RunConfig
from fedpipe.run.verify import manifest_key, write_run_manifest
from fedpipe.safe_load import MAX_RECORD_BYTES, manifest_byte_limit, read_store_json
from fedpipe.seeding import derive_seed
from fedpipe.store import Store, open_store
from fedpipe.telemetry import RunLabels, Telemetry
from fedpipe.telemetry.jsonl import JsonlSink
from fedpipe.telemetry.progress import ProgressSink

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunPaths:
    """Where a run's artifacts live in the store (one place for every key)."""

    run_id: str

    @property
    def run_record(self) -> str:
        return f"{self.run_id}/run.json"

    @property
    def manifest(self) -> str:
        return f"{self.run_id}/partition/manifest.json"

    @property
    def run_manifest(self) -> str:
        return manifest_key(self.run_id)

    @property
    def report_dir(self) -> str:
        return f"{self.run_id}/report"

    def report(self, name: str) -> str:
        return f"{self.report_dir}/{name}"

    def rounds(self, phase: str) -> str:
        return self.report(f"rounds-{phase}.jsonl")


class Run:
    """A configured run bound to its store: the dataset, model and algorithm are built on demand."""

    def __init__(self, cfg: RunConfig, store: Store | None = None):
        self.cfg = cfg
        self.store = store if store is not None else open_store(cfg.run.store)
        self.paths = RunPaths(cfg.run_id())
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self._bundle: DatasetBundle | None = None

    # --- building blocks --------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        want = self.cfg.run.device
        if want == "cuda" and not torch.cuda.is_available():
            raise ConfigError("run.device=cuda but no GPU is visible to PyTorch; use run.device=auto or cpu.")
        return torch.device("cuda" if want == "cuda" or (want == "auto" and torch.cuda.is_available()) else "cpu")

    @property
    def bundle(self) -> DatasetBundle:
        if self._bundle is None:
            self._bundle = load_dataset(self.cfg.data)
        return self._bundle

    def build_algorithm(self, device: torch.device | None = None) -> tuple[Algorithm, dict]:
        """The algorithm and the initial global parameters (seeded: same seed, same weights)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.cfg.run.seed, "init-global"))
            model = build_model(self.cfg.model_name(), self.bundle.input_shape, self.bundle.num_classes)
        model = model.to(device or self.device)
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        return build_algorithm(self.cfg.method, model, self.cfg.run.seed), initial

    def phases(self) -> list[Phase]:
        return phases_of(self.cfg.method, self.cfg.train.rounds)

    def labels(self, phase: str) -> RunLabels:
        return RunLabels(self.paths.run_id, self.cfg.telemetry.pipeline, self.cfg.method.name, phase, self.cfg.data.dataset)

    # --- the run record: one config per run -------------------------------------------------------
    def check_record(self, *, create: bool) -> None:
        """The run folder belongs to one configuration; refuse to mix another into it."""
        key = self.paths.run_record
        if not self.store.exists(key):
            if create:
                record = {"run_id": self.paths.run_id, "fingerprint": self.cfg.fingerprint(), "config": self.cfg.model_dump(mode="json")}
                self.store.put_text(key, json.dumps(record, indent=2))
                return
            raise StoreError(f"Run {self.paths.run_id!r} has not been partitioned yet ({self.store.url(key)} is missing). Run `fedpipe partition` (or `fedpipe run`) first.")
        record = read_store_json(self.store, key, "run record", MAX_RECORD_BYTES, CorruptArtifactError, _FRESH)
        if not isinstance(record, dict):
            raise CorruptArtifactError(f"{self.store.url(key)} is not a valid run record: not a JSON object. {_FRESH}")
        if record.get("fingerprint") != self.cfg.fingerprint():
            old = record.get("config")
            diff = _config_diff(old if isinstance(old, dict) else {}, self.cfg.model_dump(mode="json"))
            raise ConfigError(
                f"Run {self.paths.run_id!r} in {self.store.url()} was made with a different configuration "
                f"({diff}). Give this config another run.id, or pass --fresh to start that run over."
            )

    def fresh(self) -> None:
        """Delete everything the run has written."""
        for key in self.store.list(f"{self.paths.run_id}/"):
            self.store.delete(key)

    def preflight(self) -> None:
        """Check what can be checked before anything is written: the data, the split, the model,
        and that the run folder (if any) belongs to this config."""
        make_partition(self.bundle, self.cfg.partition, self.cfg.run.seed)
        self.build_algorithm()
        if self.store.exists(self.paths.run_record):
            self.check_record(create=False)

    # --- step 1: partition ------------------------------------------------------------------------
    def partition(self) -> Partition:
        """Split the dataset over clients; write the manifest and the label heatmap."""
        partition = make_partition(self.bundle, self.cfg.partition, self.cfg.run.seed)  # may raise: nothing written yet
        if self.store.exists(self.paths.manifest):
            self.check_record(create=False)
            log.info("Partition of run %s already exists; reusing it.", self.paths.run_id)
            return self.load_partition()
        self.check_record(create=True)
        from fedpipe.plots import partition_heatmap

        self.store.put_text(self.paths.manifest, json.dumps(partition.to_manifest()))
        self._put_plot(
            "partition_heatmap.png",
            lambda path: partition_heatmap(partition, self.bundle.train.y, path, title=f"{self.cfg.data.dataset}: {self.cfg.partition.scheme} split"),
        )
        return partition

    def load_partition(self) -> Partition:
        if not self.store.exists(self.paths.manifest):
            raise StoreError(f"{self.store.url(self.paths.manifest)} is missing: run `fedpipe partition` first.")
        url = self.store.url(self.paths.manifest)
        # bounded by what this config's split of this dataset can produce (semantic_groups: <= one client per row)
        p, pool = self.cfg.partition, len(self.bundle.train)
        clients = getattr(p, "num_clients", None) or pool
        shared = clients * getattr(p, "samples_per_client", 0) if p.clients_share_samples else None
        limit = manifest_byte_limit(pool, clients, self.bundle.num_classes, shared)
        tree = read_store_json(self.store, self.paths.manifest, "partition manifest", limit, CorruptArtifactError, _FRESH)
        try:
            partition = Partition.from_manifest(tree)
        except ValidationError as e:  # pydantic's first line names only the model: name the fields
            raise CorruptArtifactError(f"{url} is not a valid partition manifest: {_manifest_errors(e)}. Start the run over with `fedpipe run --fresh`.") from None
        except ValueError as e:  # not JSON (or not UTF-8): the file's content is wrong
            raise CorruptArtifactError(f"{url} is not a valid partition manifest: {str(e).splitlines()[0]}. Start the run over with `fedpipe run --fresh`.") from None
        partition.check_matches(self.bundle)
        return partition

    # --- step 2: one training phase ---------------------------------------------------------------
    def train(self, phase_name: str, telemetry_sinks: list | None = None) -> PhaseState | None:
        """Run one phase, resuming from its last good checkpoint; returns the phase's final state.

        Under torchrun (or a PyTorchJob) every rank calls this: rank 0 runs the phase and returns its
        state, the other ranks train the clients rank 0 hands them and return None. Otherwise
        `engine.processes > 1` starts that many ranks on this machine."""
        if launched_by_torchrun():
            group = distributed.join()
            try:
                if group.rank > 0:
                    self.serve(phase_name, group)
                    return None
                return self._train(phase_name, telemetry_sinks, group)
            finally:
                distributed.leave()
        world = self.cfg.engine.processes
        if world == 1:
            return self._train(phase_name, telemetry_sinks, None)
        threads = self.cfg.run.threads or max(1, (os.cpu_count() or 1) // world)
        torch.set_num_threads(threads)
        port = distributed.free_port()
        workers = distributed.spawn_workers(json.dumps(self.cfg.model_dump(mode="json")), phase_name, world, port, threads)
        try:
            group = distributed.join(0, world, "127.0.0.1", port)
            try:
                return self._train(phase_name, telemetry_sinks, group)
            finally:
                distributed.leave()
        finally:
            for w in workers:
                try:
                    w.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    w.kill()

    def _announce(self, group: distributed.Group | None, partition: Partition | None) -> None:
        """Rank 0 tells the other ranks the partition to train on, or None: nothing to do."""
        if group is not None:
            box = [None if partition is None else partition.to_manifest()]
            torch.distributed.broadcast_object_list(box, src=0, group=group.objects)

    def serve(self, phase_name: str, group: distributed.Group) -> None:
        """A rank > 0 of a distributed phase: train the clients rank 0 sends until it says stop."""
        box = [None]
        torch.distributed.broadcast_object_list(box, src=0, group=group.objects)
        if box[0] is None:
            return
        phase = {p.name: p for p in self.phases()}[phase_name]
        algorithm, _ = self.build_algorithm(group.device)
        data = prepare_data(self.bundle, Partition.from_manifest(box[0]), group.device)
        DistributedRound(group, ClientTrainer(self.cfg, algorithm, phase, data)).serve()

    def _train(self, phase_name: str, telemetry_sinks: list | None, group: distributed.Group | None) -> PhaseState:
        told: list[bool] = []  # whether the other ranks have been told what to do

        def announce(partition: Partition | None) -> None:
            self._announce(group, partition)
            told.append(True)

        try:
            return self._run_phase(phase_name, telemetry_sinks, group, announce)
        finally:
            if not told and group is not None:  # failed before the ranks got work: let them go
                try:
                    self._announce(group, None)
                except RuntimeError:
                    pass

    def _run_phase(self, phase_name: str, telemetry_sinks: list | None, group: distributed.Group | None, announce) -> PhaseState:
        phases = self.phases()
        names = [p.name for p in phases]
        if phase_name not in names:
            raise ConfigError(f"method {self.cfg.method.name!r} has no phase {phase_name!r}; its phases are: {', '.join(names)}.")
        self.check_record(create=False)
        phase = phases[names.index(phase_name)]
        ckpt = self.checkpoints(phase.name)
        device = group.device if group is not None else self.device
        if ckpt.has_final():
            log.info("Phase %s of run %s already finished; reusing its state.", phase.name, self.paths.run_id)
            state = ckpt.load_final(device)
            announce(None)
            return state
        algorithm, initial = self.build_algorithm(device)
        index = names.index(phase_name)
        if index == 0:
            start = PhaseState(self.cfg.method.name, "init", 0, ServerState(initial), {}, self.cfg.fingerprint())
        else:
            start = self.checkpoints(names[index - 1]).load_final(device)
        partition = self.load_partition()
        data = prepare_data(self.bundle, partition, device)
        resumed = ckpt.latest_good(device)
        if resumed is not None and resumed.round >= start.round:
            log.info("Resuming phase %s of run %s after round %d.", phase.name, self.paths.run_id, resumed.round)
            start = resumed
        # the clients' states within engine.state_memory_mb, the rest spilled into this phase's folder
        start.clients = ckpt.client_states(start.clients, device)
        announce(partition)
        train_round = None
        if group is not None:
            ranks = DistributedRound(group, ClientTrainer(self.cfg, algorithm, phase, data))
            train_round = ranks.lead
            log.info("Phase %s runs over %d processes (%s).", phase.name, group.world, torch.distributed.get_backend())
        try:
            with Telemetry(telemetry_sinks if telemetry_sinks is not None else self.default_sinks(phase.name)) as telemetry:
                state = run_phase(self.cfg, algorithm, phase, data, start, ckpt, telemetry, self.labels(phase.name), train_round)
        finally:
            if group is not None:
                ranks.stop()
        log.info("Phase %s: client states %s", phase.name, getattr(state.clients, "stats", len(state.clients)))
        return state

    def checkpoints(self, phase: str) -> Checkpoints:
        return Checkpoints(self.store, self.paths.run_id, phase, self.cfg.engine.state_memory_mb)

    def default_sinks(self, phase: str) -> list:
        sinks: list = [JsonlSink(self.store, self.paths.rounds(phase))]
        if self.cfg.telemetry.progress:
            sinks.append(ProgressSink())
        url = self.cfg.telemetry.pushgateway or os.environ.get("FEDPIPE_PUSHGATEWAY")
        if url:
            from fedpipe.telemetry.prometheus import PrometheusSink

            sinks.append(PrometheusSink(url))
        return sinks

    # --- step 3: evaluate -------------------------------------------------------------------------
    def evaluate(self) -> dict:
        """Evaluate the last phase's state and write the report; returns the summary."""
        from fedpipe.run.report import write_report

        self.check_record(create=False)
        phases = self.phases()
        state = self.checkpoints(phases[-1].name).load_final(self.device)
        algorithm, _ = self.build_algorithm()
        data = prepare_data(self.bundle, self.load_partition(), self.device)
        summary = write_report(self, algorithm, state, data, phases)
        # last: a run manifest exists only for a finished run (`fedpipe verify` checks against it)
        write_run_manifest(self.store, self.paths.run_id)
        self.delete_pushed_metrics()
        return summary

    def delete_pushed_metrics(self) -> None:
        """The run is over: delete its groups (every phase's) from the Pushgateway, once its newest push
        is telemetry.pushgateway_retention_seconds old. Never raises (an unreachable gateway warns)."""
        url = self.cfg.telemetry.pushgateway or os.environ.get("FEDPIPE_PUSHGATEWAY")
        if url:
            from fedpipe.telemetry.prometheus import delete_run_groups

            delete_run_groups(url, self.paths.run_id, retention_seconds=self.cfg.telemetry.pushgateway_retention_seconds)

    # --- all steps ----------------------------------------------------------------------------------
    def run_all(self) -> dict:
        self.partition()
        for phase in self.phases():
            self.train(phase.name)
        return self.evaluate()

    # --- helpers ----------------------------------------------------------------------------------
    def _put_plot(self, name: str, draw) -> str:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / name
            draw(path)
            self.store.put(self.paths.report(name), path.read_bytes())
        return self.paths.report(name)


_FRESH = "Start the run over with `fedpipe run --fresh`."


def _manifest_errors(err: ValidationError, most: int = 3) -> str:
    """'clients.0.sizes.train: Input should be ... (got -1)' for the first few errors."""
    parts = []
    for e in err.errors()[:most]:
        loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith(("tagged-union", "function-")))
        got = repr(e.get("input"))
        got = got if len(got) <= 40 else got[:37] + "..."
        parts.append(f"{loc or '(top level)'}: {e['msg']}" + ("" if e["type"] == "missing" else f" (got {got})"))
    more = err.error_count() - most
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def _config_diff(old: dict, new: dict, prefix: str = "") -> str:
    changes = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            sub = _config_diff(a, b, f"{prefix}{key}.")
            if sub:
                changes.append(sub)
        elif a != b:
            changes.append(f"{prefix}{key}: {json.dumps(a)} -> {json.dumps(b)}")
    return "; ".join(changes)
