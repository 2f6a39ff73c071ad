"""The steps of a run: partition, train one phase, evaluate. The CLI, the Kubeflow components and the
tests all call these; each reads its inputs from the store and writes its outputs there.

Bad input is found before anything is written: a step validates the config, loads the data and
builds the partition (or reads the previous phase's state) first, and only then writes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fedpipe.algorithms import Algorithm, build_algorithm, phases_of
from fedpipe.algorithms.base import Phase, ServerState
from fedpipe.algorithms.robust import robust_problem
from fedpipe.data import DatasetBundle
from fedpipe.data.datasets import load_dataset
from fedpipe.data.federated import FederatedData, Standardisation, prepare_data
from fedpipe.data.partition import Partition, make_partition
from fedpipe.data.partition.natural import unseen_test_classes
from fedpipe.engine import distributed
from fedpipe.engine.accounting import Ledger
from fedpipe.engine.choice import EngineChoice, amp_mode, choose, clients_mode, usable_cores
from fedpipe.engine.clients import ClientTrainer
from fedpipe.engine.devices import resolve_device
from fedpipe.engine.distributed import DistributedRound, TrainerRecipe
from fedpipe.engine.privacy import SECRET_BYTES, new_secret
from fedpipe.engine.rounds import run_phase
from fedpipe.engine.state import Checkpoints, PhaseState
from fedpipe.errors import ConfigError, CorruptArtifactError, StoreError
from fedpipe.nn.networks import build_model
from fedpipe.run import callbacks, inputs, record
from fedpipe.run.config import RunConfig
from fedpipe.run.layout import RunLayout
from fedpipe.run.privacy import phase_privacy
from fedpipe.run.report import put_plot, score_summary, write_report
from fedpipe.run.verify import write_run_manifest
from fedpipe.safe_load import MAX_RECORD_BYTES, read_store_json
from fedpipe.seeding import derive_seed
from fedpipe.store import Store, open_store
from fedpipe.telemetry import RunLabels, Telemetry
from fedpipe.telemetry.jsonl import JsonlSink
from fedpipe.telemetry.progress import ProgressSink
from fedpipe.telemetry.release import released
from fedpipe.telemetry.trainer_status import TrainerStatusSink

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmStart:
    """Where a run's first phase starts instead of the seeded random weights: a model line's version
    (built by the entry layer through `fedpipe.models.warm`; the run layer only uses it). Tensors on the CPU,
    keyed by THIS run's client ids (the version's clients matched by name; a client the version lacks
    starts without a state)."""

    server: ServerState
    clients: dict[int, dict] = field(default_factory=dict)
    source: str = ""  # for the log: which line and version
    # privacy.enabled: the accountant the run starts with, the version's spend composed in (None: a fresh one,
    # allowed only with privacy.public_init: a private run never starts from weights nobody accounted for)
    privacy: Ledger | None = None


#: What `Run.warm_start` holds (None: the seeded random weights): the warm start, or a function that reads it
#: when the first phase starts (a phase that resumes from a checkpoint or has finished never calls it)
WarmStarter = WarmStart | Callable[[], WarmStart | None] | None


class Run:  # size: a run's three steps and the building blocks they share (dataset, algorithm, checkpoints, sinks)
    """A configured run bound to its store (its one writer while a step writes: `with self.owner:`); the dataset, model and algorithm are built on demand."""

    def __init__(self, cfg: RunConfig, store: Store | None = None, *, take_over: bool = False, owner: str | None = None,
                 bundle: DatasetBundle | None = None):
        self.cfg, self.warm_start = cfg, None  # warm_start: a WarmStart, or a function reading it (`WarmStarter`)
        self.store = store if store is not None else open_store(cfg.run.store)
        self.layout = RunLayout(cfg.run_id())
        self.owner = record.RunOwner(self.store, self.layout, owner, take_over=take_over)
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self._bundle = bundle  # the loaded dataset, when the caller holds it already (a study's warm worker): else loaded on first use
        self.unrecorded_choice: EngineChoice | None = None  # decided by `train`, written once the phase has read its inputs
        self._partition: Partition | None = None  # the manifest, read and verified once (a run's manifest never changes)

    # --- building blocks --------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """run.device resolved (`fedpipe.engine.devices`): a GPU this process was given but PyTorch
        cannot use stops the run instead of leaving it idle while the CPU trains."""
        return resolve_device(self.cfg.run.device)

    @property
    def bundle(self) -> DatasetBundle:
        if self._bundle is None:
            self._bundle = load_dataset(self.cfg.data)
        return self._bundle

    def build_algorithm(self, device: torch.device | None = None) -> tuple[Algorithm, dict]:
        """The algorithm and the initial global parameters (seeded: same seed, same weights)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.cfg.run.seed, "init-global"))
            model = build_model(self.cfg.model_name(self.bundle.input_shape), self.bundle.input_shape, self.bundle.num_classes)
        model = model.to(device or self.device)
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        algorithm = build_algorithm(self.cfg.method, model, self.cfg.run.seed)
        problem = robust_problem(algorithm, self.phases(), self.cfg.train.robust)  # before any phase starts (preflight)
        if problem:
            raise ConfigError(f"{problem}.")
        return algorithm, initial

    def phases(self) -> list[Phase]:
        return phases_of(self.cfg.method, self.cfg.train.rounds)

    def labels(self, phase: str) -> RunLabels:
        return RunLabels(self.layout.run_id, self.cfg.telemetry.pipeline, self.cfg.method.name, phase, self.cfg.data.dataset)

    def trainer(self, algorithm: Algorithm, phase: Phase, data: FederatedData, record_chunk: bool = False) -> ClientTrainer:
        """The phase's client trainer; with `record_chunk`, the chunk `engine.chunk=auto` picks is added
        to the phase's engine.json (rank 0 only: one writer); with privacy.enabled it clips (and in local mode
        noises) every upload."""
        on_chunk = (lambda chunk, why: self._record_chunk(phase.name, chunk, why)) if record_chunk else None
        privacy = phase_privacy(self.cfg, algorithm, phase, data, self.noise_secret)
        return ClientTrainer(algorithm, phase, data, self.cfg.train, self.cfg.engine, self.cfg.run.seed, on_chunk, privacy=privacy)

    def noise_secret(self, create: bool = False) -> bytes:
        """The run's noise secret (privacy.enabled without seeded_noise): read from the store, or with `create`
        (the owner, before the run's first private round) drawn and written first when the run has none yet.
        Every draw of the sample and the noise is keyed under it (`fedpipe.engine.privacy`), so it must land
        before the first release: a replayed round then repeats its release rather than releasing it again."""
        key = self.layout.privacy_secret
        if create and not self.store.exists(key):
            self.store.create(key, new_secret().hex().encode())
        size = self.store.size(key)
        if size is None:
            raise StoreError(f"{self.store.url(key)} is missing: the run's noise secret is written when its first private phase "
                             "starts (`fedpipe train`); train the phase from its start, or rerun with --fresh.")
        if size != 2 * SECRET_BYTES:
            raise CorruptArtifactError(f"{self.store.url(key)} is not a noise secret ({size} bytes, not {2 * SECRET_BYTES}). "
                                       "Rerun the run with --fresh (its noise cannot be recovered).")
        text = self.store.get(key).decode("ascii", errors="replace")
        try:
            return bytes.fromhex(text)
        except ValueError:
            raise CorruptArtifactError(f"{self.store.url(key)} is not a noise secret (not hex). Rerun the run with --fresh.") from None

    def _record_chunk(self, phase: str, chunk: int, why: str) -> None:
        key = self.layout.phase(phase).engine_choice
        if self.store.exists(key):  # absent when nothing was auto but the chunk: then it is the whole record
            made = EngineChoice.from_json(read_store_json(self.store, key, "engine choice", MAX_RECORD_BYTES, CorruptArtifactError,
                                                          "Delete it to choose again."))
        else:
            e = self.cfg.engine  # under torchrun: the world size is torchrun's, not a choice
            made = EngineChoice(clients_mode(e.clients, self.device.type), e.processes if isinstance(e.processes, int) else 1, None,
                                "as configured", amp=amp_mode(e.amp, self.device, self.bf16_refusal))
        self.store.put_text(key, json.dumps({**dataclasses.replace(made, chunk=chunk).to_json(), "chunk_why": why}, indent=2))

    def checkpoints(self, phase: str) -> Checkpoints:
        guard = self.owner.beat if self.owner.held else None  # a writer taken over stops before its next checkpoint
        # in the background beside a GPU, whose host cores wait; on a CPU the writes slowed the rounds as much (WriteBehind)
        return Checkpoints(self.store, self.layout.phase(phase), self.cfg.engine.state_memory_mb, guard,
                           background=self.device.type == "cuda")

    def check_record(self, *, create: bool) -> None:
        """The run folder belongs to one configuration; refuse to mix another into it."""
        record.check_record(self.store, self.layout, self.cfg, create=create)

    @property
    def bf16_refusal(self) -> str | None:
        """Why the method opts out of bf16 autocast (`Algorithm.bf16_refusal`), or None."""
        from fedpipe.algorithms import ALGORITHMS

        return ALGORITHMS[self.cfg.method.name].bf16_refusal

    def load_partition(self) -> Partition:
        """The run's partition manifest, read, bounded and verified against the data on first use; later
        calls (the engine choice, then each phase) reuse it: at 10,000 clients a read costs seconds."""
        if self._partition is None:
            self._partition = inputs.load_partition(self.store, self.layout, self.cfg, self.bundle)
        return self._partition

    def fresh(self) -> None:
        """Delete what fedpipe wrote for this run, and only that (`delete_run`)."""
        self._partition = None
        delete_run(self)

    def preflight(self) -> None:
        """Check what can be checked before anything is written: the data, the split, the model,
        and that the run folder (if any) belongs to this config."""
        make_partition(self.bundle, self.cfg.partition, self.cfg.run.seed)
        self.build_algorithm()
        if self.store.exists(self.layout.run_record):
            self.check_record(create=False)

    # --- step 1: partition ------------------------------------------------------------------------
    def partition(self) -> Partition:
        """Split the dataset over clients; write the manifest and the label heatmap."""
        partition = make_partition(self.bundle, self.cfg.partition, self.cfg.run.seed)  # may raise: nothing written yet
        with self.owner:  # the run's one writer (`record.RunOwner`): a second one stops here, naming the owner
            if self.store.exists(self.layout.partition_manifest):
                self.check_record(create=False)
                log.info("Partition of run %s already exists; reusing it.", self.layout.run_id)
                return self.load_partition()
            self.check_record(create=True)
            from fedpipe.plots import partition_heatmap

            self.store.put_text(self.layout.partition_manifest, json.dumps(partition.to_manifest()))
            if partition.client_names:  # a natural partition: once, when the run's partition is made
                for line in unseen_test_classes(partition.clients, self.bundle.train.y, self.bundle.class_names, partition.client_names):
                    log.warning("%s", line)
            title = f"{self.cfg.data.dataset}: {self.cfg.partition.scheme} split"
            if self.cfg.eval.split == "test":  # a tuning trial draws nothing: its plots cost more than its rounds
                self._put_plot("partition_heatmap.png", lambda path: partition_heatmap(partition, self.bundle.train.y, path, title=title,
                                                                                    class_names=self.bundle.class_names))
            return partition

    # --- step 2: one training phase ---------------------------------------------------------------
    def train(self, phase_name: str, telemetry_sinks: list | None = None) -> PhaseState | None:
        """Run one phase, resuming from its last good checkpoint; returns the phase's final state.

        Under torchrun (or a PyTorchJob) every rank calls this: rank 0 runs the phase and returns its
        state, the other ranks train the clients rank 0 hands them and return None. Otherwise
        `engine.processes > 1` starts that many ranks on this machine (`distributed.run_ranks`)."""
        resolve_device(self.cfg.run.device)  # a GPU given but unusable stops the phase here, before any rank starts
        choice = None if distributed.launched_by_torchrun() else engine_choice(self, phase_name)
        run = self if choice is None else Run(self.cfg.model_copy(update={"engine": self.cfg.engine.model_copy(
            update={"clients": choice.clients, "processes": choice.processes, "amp": choice.amp,
                   **({"chunk": choice.chunk} if choice.chunk is not None and self.cfg.engine.chunk == "auto" else {})})}), self.store)
        run._bundle, run.warm_start = self._bundle, self.warm_start
        run.owner = self.owner  # one claim: the copy's step must not release a claim this Run holds
        run.unrecorded_choice = choice if choice is not None and not choice.recorded else None
        spec = json.dumps({"config": run.cfg.model_dump(mode="json"), "phase": phase_name})
        recipe = TrainerRecipe("fedpipe.run.run:rank_trainer", spec)
        lead = lambda group: train_phase(run, phase_name, telemetry_sinks, group)  # noqa: E731
        processes = 1 if choice is None else choice.processes
        threads = self.cfg.run.threads or (None if choice is None else choice.threads)
        return distributed.run_ranks(lead, recipe, processes, threads)

    def default_sinks(self, phase: str) -> list:
        # inside the trusted server: the run store's round log and the progress bar on this process's terminal
        # keep every figure, privacy on or off (the report reads the log)
        sinks: list = [JsonlSink(self.store, self.layout.rounds(phase))]
        if self.cfg.telemetry.progress:
            sinks.append(ProgressSink())
        outside: list = []  # every sink below leaves the server: with privacy on it gets only what `releasable` allows
        url = self.cfg.telemetry.pushgateway or os.environ.get("FEDPIPE_PUSHGATEWAY")
        if url:
            from fedpipe.telemetry.prometheus import PrometheusSink

            outside.append(PrometheusSink(url))
        # MLflow's: none unless telemetry.mlflow or MLFLOW_TRACKING_URI is set; Kubeflow Trainer's (a TrainJob's
        # status.trainerStatus): none unless Trainer injected its status server (feature gate TrainJobStatus on)
        trainer = TrainerStatusSink.from_env()
        outside += mlflow_sinks(self) + ([trainer] if trainer is not None else [])
        return sinks + released(outside, self.cfg.privacy.enabled)

    # --- step 3: evaluate -------------------------------------------------------------------------
    def evaluate(self) -> dict:
        """Evaluate the last phase's state and write the report; returns the summary."""
        self.check_record(create=False)
        phases = self.phases()
        state = self.checkpoints(phases[-1].name).load_final(self.device)
        algorithm, _ = self.build_algorithm()
        data = federated_data(self, self.load_partition(), self.device)
        with self.owner:
            plot = self._put_plot if self.cfg.eval.split == "test" else (lambda name, draw: None)
            summary = write_report(self.cfg, self.store, self.layout, algorithm, state, data, phases, plot)
        # last: a run manifest exists only for a finished run (`fedpipe verify` checks against it); after
        # the claim's release, so the manifest does not list the owner record (which then disappears)
        write_run_manifest(self.store, self.layout.run_id)
        self.delete_pushed_metrics()
        return track_report(self, summary)  # MLflow: the report as artifacts of the run's MLflow run, which then ends

    def delete_pushed_metrics(self) -> None:
        """The run is over: delete its groups (every phase's) from the Pushgateway, once its newest push
        is telemetry.pushgateway_retention_seconds old. Never raises (an unreachable gateway warns)."""
        url = self.cfg.telemetry.pushgateway or os.environ.get("FEDPIPE_PUSHGATEWAY")
        if url:
            from fedpipe.telemetry.prometheus import delete_run_groups

            delete_run_groups(url, self.layout.run_id, retention_seconds=self.cfg.telemetry.pushgateway_retention_seconds)

    # --- all steps ----------------------------------------------------------------------------------
    def run_all(self) -> dict:
        self.partition()
        for phase in self.phases():
            self.train(phase.name)
        return self.evaluate()

    def _put_plot(self, name: str, draw) -> str:
        return put_plot(self.store, self.layout, name, draw)


# --- MLflow tracking (fedpipe.telemetry.mlflow) ---------------------------------------------------
def mlflow_sinks(run: Run) -> list:
    """The run's MLflow sink, or none (and mlflow never imported) when neither telemetry.mlflow nor
    MLFLOW_TRACKING_URI is set."""
    t, cfg = run.cfg.telemetry, run.cfg
    if not (t.mlflow or os.environ.get("MLFLOW_TRACKING_URI", "").strip()):
        return []
    from fedpipe.telemetry.mlflow import MlflowSink, flat_params

    tags = {"method": cfg.method.name, "dataset": cfg.data.dataset, "split": cfg.partition.scheme, "seed": cfg.run.seed,
            "phases": ",".join(p.name for p in run.phases()), "pipeline": t.pipeline}
    sink = MlflowSink.from_env(t.mlflow, fedpipe_run_id=run.layout.run_id, experiment=t.mlflow_experiment,
                               params=flat_params(cfg.model_dump(mode="json")), tags=tags)
    return [sink] if sink is not None else []


def track_report(run: Run, summary: dict) -> dict:
    """Log everything under the run's report/ keys as artifacts of its MLflow run and end that run (when it
    is fedpipe's, not a KFP task's); returns `summary`. Reads the report only when the server answers; never raises.
    With privacy on the round logs stay in the store: they hold the un-noised figures `releasable` withholds."""
    prefix = run.layout.report_dir + "/"
    kept = {run.layout.rounds(p.name) for p in run.phases()} if run.cfg.privacy.enabled else set()
    for sink in mlflow_sinks(run):
        sink.log_report(lambda: {key[len(prefix):]: run.store.get(key) for key in run.store.list(prefix) if key not in kept})
    return summary


def federated_data(run: Run, partition: Partition, device: torch.device, split: str | None = None) -> FederatedData:
    """The clients' tensors on `device`; scored on `split` (default eval.split): with "validation" (a study's
    trial), the test splits are dropped."""
    chosen = run.cfg.standardisation()  # data.standardisation: every path that standardises uses the run's choice
    # pooled is prepare_data's default: passed only when it is not, so that wrappers of prepare_data(bundle, partition,
    # device) (tests that alter the data a run sees) still fit
    data = prepare_data(run.bundle, partition, device, **({} if chosen == Standardisation() else {"standardisation": chosen}))
    return data.validation_as_test() if (split or run.cfg.eval.split) == "validation" else data


def rescore(run: Run, split: str = "test") -> dict:
    """A finished run's final state scored again on `split` ("test" or "validation"), nothing written: a
    study's papers' protocol scores its tuning trials on test this way, after their selection is frozen."""
    state = run.checkpoints(run.phases()[-1].name).load_final(run.device)
    algorithm, _ = run.build_algorithm()
    cfg = run.cfg.model_copy(update={"eval": run.cfg.eval.model_copy(update={"split": split})})
    return score_summary(cfg, run.layout.run_id, algorithm, state, federated_data(run, run.load_partition(), run.device, split))


def delete_run(run: Run) -> None:
    """Delete what fedpipe wrote for this run, and only that: the prefix must hold a fedpipe run
    record for this run id (else nothing is deleted), and only keys the run's layout names are
    deleted (`RunLayout.owns`); anything else there is left and named in one warning. The run
    manifest is no proof of ownership: it lists whatever lay in the folder when the run finished."""
    keys = run.store.list(run.layout.folder)
    if not keys:
        return
    problem = record.fedpipe_record_problem(run.store, run.layout)
    if problem is not None:
        raise StoreError(
            f"Refusing --fresh: {run.store.url(run.layout.run_id)} holds {len(keys)} file(s) but {problem}, so "
            "they are not a fedpipe run's and nothing was deleted. Check run.store and run.id (a fedpipe run "
            "folder starts with run.json), or give this config another run.id."
        )
    with run.owner:
        ours = [k for k in keys if run.layout.owns(k) and k not in (run.layout.run_record, run.layout.owner)]
        for key in ours:
            run.store.delete(key)
        run.store.delete(run.layout.run_record)  # last: an interrupted --fresh can be repeated
    foreign = [k for k in keys if not run.layout.owns(k)]
    if foreign:
        log.warning("--fresh left %d file(s) in %s that fedpipe did not write: %s", len(foreign),
                    run.store.url(run.layout.run_id), ", ".join(foreign))


def _phase_and_start(run: Run, phase_name: str) -> tuple[Phase, str | None]:
    """The phase named, and the phase before it (whose final state it starts from), if any."""
    phases = run.phases()
    names = [p.name for p in phases]
    if phase_name not in names:
        raise ConfigError(f"method {run.cfg.method.name!r} has no phase {phase_name!r}; its phases are: {', '.join(names)}.")
    index = names.index(phase_name)
    return phases[index], (names[index - 1] if index > 0 else None)


def train_phase(run: Run, phase_name: str, telemetry_sinks: list | None, group: distributed.Group | None) -> PhaseState:
    """Rank 0's side of `Run.train` (the only side without other ranks): brief the other ranks on
    the partition, run the rounds with evaluation, telemetry and checkpoints around them."""
    phase, previous = _phase_and_start(run, phase_name)
    run.check_record(create=False)
    with run.owner:
        return _train_owned(run, phase, previous, telemetry_sinks, group)


def _train_owned(run: Run, phase: Phase, previous: str | None, telemetry_sinks: list | None,
                 group: distributed.Group | None) -> PhaseState:
    """`train_phase` once the run's single-writer claim is held."""
    ckpt = run.checkpoints(phase.name)
    device = group.device if group is not None else run.device
    if ckpt.has_final():
        log.info("Phase %s of run %s already finished; reusing its state.", phase.name, run.layout.run_id)
        state = ckpt.load_final(device)
        distributed.brief(group, None)
        return state
    algorithm, initial = run.build_algorithm(device)
    if previous is None:
        start = _initial_state(run, initial, device)
    else:
        start = run.checkpoints(previous).load_final(device)
    partition = run.load_partition()
    data = federated_data(run, partition, device)
    resumed = ckpt.latest_good(device)
    if resumed is not None and resumed.round >= start.round:
        log.info("Resuming phase %s of run %s after round %d.", phase.name, run.layout.run_id, resumed.round)
        start = resumed
    # the clients' states within engine.state_memory_mb, the rest spilled into this phase's folder
    start.clients = ckpt.client_states(start.clients, device)
    if run.cfg.privacy.enabled and phase.communicates and not run.cfg.privacy.seeded_noise:
        run.noise_secret(create=True)  # before the first release, and before the other ranks read it
    if run.unrecorded_choice is not None:
        run.store.put_text(run.layout.phase(phase.name).engine_choice, json.dumps(run.unrecorded_choice.to_json(), indent=2))
    distributed.brief(group, partition.to_manifest())
    trainer = run.trainer(algorithm, phase, data, record_chunk=True)
    ranks = DistributedRound(group, trainer) if group is not None else None
    if ranks is not None:
        log.info("Phase %s runs over %d processes (%s).", phase.name, group.world, torch.distributed.get_backend())
    train_round = ranks.lead if ranks is not None else lambda round_, lr, works: (trainer.train(works, round_, lr), None)
    sinks = telemetry_sinks if telemetry_sinks is not None else run.default_sinks(phase.name)
    cfg = run.cfg
    try:
        with Telemetry(sinks) as telemetry:
            # evaluate, report, checkpoint: the order `callbacks.Checkpointing` explains
            around = [callbacks.Evaluation(algorithm, data, cfg.eval), callbacks.Reporting(algorithm, telemetry, run.labels(phase.name)),
                      callbacks.ModelSelection(algorithm, data, cfg.train, cfg.run.seed, cfg.eval.batch_size),
                      callbacks.Checkpointing(ckpt, cfg.train.keep_checkpoints)]
            state = run_phase(algorithm, phase, data, start, cfg.train, cfg.run.seed, train_round, around, privacy=trainer.privacy)
    except BaseException:
        try:  # the last checkpoint still lands (a rerun resumes from it), while the run is still ours
            ckpt.close()
        except StoreError as e:
            log.error("The phase's last checkpoint could not be written either: %s", e)
        raise
    finally:
        if ranks is not None:
            ranks.stop()
    log.debug("Phase %s: client states %s", phase.name, getattr(state.clients, "stats", len(state.clients)))
    return state


def _initial_state(run: Run, initial: dict, device: torch.device) -> PhaseState:
    """The first phase's start: the seeded random weights, or the run's warm start with the accountant it brings."""
    given: WarmStarter = run.warm_start
    warm = given() if callable(given) else given
    cfg = run.cfg
    if warm is None:
        return PhaseState(cfg.method.name, "init", 0, ServerState(initial), {}, cfg.fingerprint())
    missing = sorted(set(initial) - set(warm.server.global_params))
    if missing:
        raise ConfigError(f"The warm start {warm.source} lacks parameters of this run's model ({', '.join(missing[:3])}).")
    if cfg.privacy.enabled and warm.privacy is None and not cfg.privacy.public_init:
        # the starting weights carry their training data; an accountant that starts at zero would understate epsilon
        raise ConfigError(f"This run has privacy.enabled=true, but its warm start {warm.source} brings no privacy ledger, "
                          "so its epsilon would leave out what trained the starting weights. Start from a version trained "
                          "with privacy, or from random weights (train.init_from=none); or, if the starting model was "
                          "trained on public data only, set privacy.public_init=true.")
    on = lambda params: {k: v.to(device) for k, v in params.items()}  # noqa: E731
    server = ServerState(on(warm.server.global_params), {c: on(p) for c, p in warm.server.per_client.items()})
    log.info("Run %s starts from %s (%d client states).", run.layout.run_id, warm.source, len(warm.clients))
    ledger = Ledger.from_json(warm.privacy.to_json()) if cfg.privacy.enabled and warm.privacy is not None else None  # a copy
    return PhaseState(cfg.method.name, "init", 0, server, {c: on(p) for c, p in warm.clients.items()}, cfg.fingerprint(),
                      privacy=ledger)


def engine_choice(run: Run, phase_name: str) -> EngineChoice:
    """engine.clients and engine.processes resolved for a phase: what an earlier attempt of the phase
    recorded (a rerun or resume computes what the first attempt computed), else decided from static
    facts (`fedpipe.engine.choice`) and recorded. Only `auto` fields are resolved."""
    e, key = run.cfg.engine, run.layout.phase(phase_name).engine_choice
    if "auto" not in (e.clients, e.processes, e.amp, e.chunk):  # nothing to decide, nothing to record
        return EngineChoice(e.clients, e.processes, None, "as configured", recorded=True, amp=e.amp)
    phase, _ = _phase_and_start(run, phase_name)
    run.check_record(create=False)  # the run's own errors first (not partitioned, another config)
    if run.store.exists(key):
        tree = read_store_json(run.store, key, "engine choice", MAX_RECORD_BYTES, CorruptArtifactError, "Delete it to choose again.")
        try:
            made = EngineChoice.from_json(tree, recorded=True)
        except (TypeError, KeyError, ValueError, AttributeError):
            raise CorruptArtifactError(f"{run.store.url(key)} is not a valid engine choice. Delete it to choose again.") from None
        resolved = EngineChoice(made.clients if e.clients == "auto" else e.clients, made.processes if e.processes == "auto" else e.processes,
                                made.threads if e.processes == "auto" else None, made.why, recorded=True,
                                amp=made.amp if e.amp == "auto" else e.amp, chunk=made.chunk if e.chunk == "auto" else None)
        log.info("Phase %s: %s (%s; recorded in %s).", phase_name, _mode_words(resolved), resolved.why, run.store.url(key))
        return resolved
    if run.checkpoints(phase_name).has_final():  # nothing left to train: nothing to decide
        return EngineChoice(clients_mode(e.clients, run.device.type), 1, None, "the phase has finished", recorded=True,
                            amp=amp_mode(e.amp, run.device, run.bf16_refusal))
    clients = run.load_partition().clients
    pool = [c for c in clients if not (phase.communicates and c.opt_out)]
    per_round = min(len(pool), max(1, round(run.cfg.train.client_fraction * len(clients)))) if phase.sample_clients else len(pool)
    mean_train = sum(len(c.train) for c in pool) / max(len(pool), 1)
    made = choose(clients=e.clients, processes=e.processes, threads=None, device_type=run.device.type, cores=usable_cores(),
                  clients_per_round=per_round, samples_per_round=round(per_round * mean_train * run.cfg.train.local_epochs))
    made = dataclasses.replace(made, amp=amp_mode(e.amp, run.device, run.bf16_refusal))
    if e.amp == "bf16" and run.bf16_refusal:
        log.warning("engine.amp=bf16 for %s, which opts out of bf16 (%s): its results may differ from fp32 beyond rounding. "
                    "engine.amp=auto keeps it in fp32.", run.cfg.method.name, run.bf16_refusal)
    log.info("Phase %s: %s (%s).", phase_name, _mode_words(made), made.why)
    return made  # recorded by train_phase once the phase's inputs have been read (bad input writes nothing)


def _mode_words(choice: EngineChoice) -> str:
    ways = "batched" if choice.clients == "batched" else "one by one"
    amp = ", bf16 autocast" if choice.amp == "bf16" else ""
    return f"clients trained {ways} in {choice.processes} process{'es' * (choice.processes > 1)}{amp}"


def rank_trainer(spec: str, briefing: dict, device: torch.device) -> ClientTrainer:
    """A rank > 0's trainer (the `TrainerRecipe` factory of `Run.train`): `spec` holds the run's config
    and the phase, `briefing` the manifest of the partition rank 0 trains on."""
    given = json.loads(spec)
    run = Run(RunConfig.model_validate(given["config"]))
    phase = {p.name: p for p in run.phases()}[given["phase"]]
    algorithm, _ = run.build_algorithm(device)
    return run.trainer(algorithm, phase, federated_data(run, Partition.from_manifest(briefing), device))
