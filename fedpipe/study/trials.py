"""One run of a study, a tuning trial or a final run, executed in a warm worker.

A worker process imports torch once and keeps every dataset it has loaded (`_BUNDLES`), so the
study's many short runs pay for imports and decoding once per process, not once per run; the runs
themselves are ordinary fedpipe runs (same config, same run id, same numbers as `fedpipe run`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from multiprocessing import get_context

from fedpipe.data import DatasetBundle
from fedpipe.data.datasets import load_dataset
from fedpipe.run import run as run_steps
from fedpipe.run.config import RunConfig
from fedpipe.run.run import Run
from fedpipe.study.stats import worst_fraction_mean
from fedpipe.telemetry.jsonl import read_rounds

log = logging.getLogger(__name__)

#: The datasets this process has loaded, by their data section: a warm worker decodes each once.
_BUNDLES: dict[str, DatasetBundle] = {}
#: What a curve keeps of each round (the report's time-to-accuracy and bands read these).
CURVE_KEYS = ("round", "phase", "personalized_accuracy", "global_accuracy", "train_loss", "bytes_uploaded", "bytes_downloaded", "seconds")


def bundle_for(cfg: RunConfig) -> DatasetBundle:
    key = json.dumps(cfg.data.model_dump(mode="json"), sort_keys=True)
    if key not in _BUNDLES:
        _BUNDLES[key] = load_dataset(cfg.data)
    return _BUNDLES[key]


def execute(job: dict) -> dict:
    """Run one job ({"config": a run config dump, ...}) to its end and return what the study records:
    the metrics (val_* for a trial, test ones for a final run), the curve and the time it took."""
    started = time.perf_counter()
    cfg = RunConfig.model_validate(job["config"])
    run = Run(cfg, bundle=bundle_for(cfg))
    summary = run.run_all()
    rows = read_rounds(run.store, [run.layout.rounds(p.name) for p in run.phases()])
    return {
        **{k: v for k, v in job.items() if k != "config"},
        "run_id": run.layout.run_id,
        "metrics": metrics_of(summary),
        "curve": [{k: r.get(k) for k in CURVE_KEYS} for r in rows],
        "seconds": summary["training_seconds"],  # the rounds' own time (training and aggregation)
        "wall": time.perf_counter() - started,  # the whole run: data, partition, evaluation, report
    }


def rescore(job: dict) -> dict:
    """A finished tuning trial's final state scored on test (the papers' optimistic protocol; after selection)."""
    cfg = RunConfig.model_validate(job["config"])
    run = Run(cfg, bundle=bundle_for(cfg))
    return {**{k: v for k, v in job.items() if k != "config"}, "metrics": metrics_of(run_steps.rescore(run, "test"))}


def metrics_of(summary: dict) -> dict:
    """The numbers a study compares, from a run's summary. Keys carry no split prefix: a trial's are
    validation numbers (its summary says evaluated_on: validation), a final run's are test numbers."""
    p, g = summary["personalized_accuracy"], summary.get("global_model")
    accs = p.get("client_accuracies") or []
    return {
        "personalized_accuracy": p["mean"],
        "pooled_choice_accuracy": p.get("pooled_choice_mean", p["mean"]),
        "test_oracle_accuracy": p.get("test_oracle_mean", p["mean"]),
        "global_accuracy": None if g is None else g["top1"],
        "worst10_accuracy": worst_fraction_mean(accs, 0.1) if accs else None,
        "client_accuracies": accs,
        "evaluated_on": summary.get("evaluated_on", "test"),
    }


def objective_of(metrics: dict, objective: str) -> float | None:
    """A study objective (val_personalized_accuracy, ...) from a trial's metrics; None when the method has no such number."""
    name = {"val_pooled_accuracy": "pooled_choice_accuracy"}.get(objective, objective.removeprefix("val_"))
    value = metrics.get(name)
    return None if value is None else float(value)


def _warm(threads: int, env: dict[str, str]) -> None:
    """A worker's start: its share of the cores, the study's environment, torch imported once."""
    os.environ.update(env)
    import torch

    torch.set_num_threads(threads)


class InProcess(Executor):
    """workers: 1 runs every job in this process, in order (tests, debugging, a KFP task's batch)."""

    def __init__(self, env: dict[str, str] | None = None):
        self.env = env or {}

    def submit(self, fn, /, *args, **kwargs) -> Future:
        os.environ.update(self.env)
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as err:  # noqa: BLE001 - handed to the caller through the future, as a pool would
            future.set_exception(err)
        return future


def worker_pool(workers: int, env: dict[str, str] | None = None) -> Executor:
    """`workers` warm processes (each with cores / workers threads), or this process for 1."""
    if workers <= 1:
        return InProcess(env)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // workers)
    # forkserver: a clean process per worker (no fork of a parent holding torch's threads), started once and reused
    return ProcessPoolExecutor(workers, mp_context=get_context("forkserver"), initializer=_warm, initargs=(threads, env or {}))
