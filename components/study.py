"""The study pipeline's components (pipelines/study.py) and the work they do, over `fedpipe.study.steps`.

    suggest -> ParallelFor(run_trials) -> suggest (Collected) -> ... -> final_chunks -> ParallelFor(run_trials) -> report

Every task gets the study's text (`study_yaml`, the pipeline parameter) and reads and writes the study's
records in its store, so a retried task redoes only what has no record. What travels between tasks as KFP
parameters is small: the jobs of a batch, cut into one list per task (`chunks`), and a few fields per
finished job (`summary`); the records themselves stay in the store (KFP keeps output parameters in its
metadata database).

A list of chunks is never empty: a loop over no items has no iteration for `dsl.Collected` to collect,
and the KFP driver then fails the task downstream (2.14.0 backend/src/v2/driver/resolve.go:
getParallelForIterationCount is 0, so resolveUpstreamParameters falls through to GetProducerTask and
fails with "subTaskName ... not in tasks"). With nothing left to run (a rerun on a finished store) the
one chunk is empty and its task does nothing.
"""

import logging
import math
from pathlib import Path

from kfp.dsl import HTML, Markdown, Metrics, Output

log = logging.getLogger(__name__)

#: What a finished job hands on (the rest is in its record in the store).
SUMMARY_KEYS = ("kind", "method", "split", "number", "seed", "state", "objective", "run_id")


# --- the work (runs in the task's container) ------------------------------------------------------------

def chunks(jobs: list, per_task: int) -> list[list]:
    """`jobs` cut into lists of `per_task` (the last one shorter); [[]] for no jobs (see the module's docstring)."""
    per_task = max(1, int(per_task))
    return [jobs[i:i + per_task] for i in range(0, len(jobs), per_task)] or [[]]


def per_task(jobs_left: int, parallelism: int, trials_per_task: int, batches_left: int) -> int:
    """Jobs per task: `trials_per_task`, or more when the compiled batches would not spend what is left
    (a study edited in the UI with a larger budget, or a smaller trials_per_task than compiled), so that
    the last batch always asks for every trial still missing."""
    room = max(1, parallelism) * max(1, batches_left)
    return max(1, trials_per_task, math.ceil(jobs_left / room))


def trials_left(study_yaml: str) -> int:
    """Tuning trials not yet recorded, over every method and split (0 once the choice is frozen)."""
    from fedpipe.store import open_store
    from fedpipe.study import runner
    from fedpipe.study.config import load_study
    from fedpipe.study.records import StudyRecords

    study, base = load_study(None, text=study_yaml)
    records = StudyRecords(open_store(study.study.store), study)
    if records.store.exists(records.chosen_key):
        return 0
    return sum(t.left for t in runner.tuners_of(study, base, records))


def suggest_chunks(study_yaml: str, parallelism: int, trials_per_task: int, batches_left: int) -> list[list[dict]]:
    """The next batch of trials (Optuna, from every trial recorded so far), one list per run_trials task."""
    from fedpipe.study import steps

    size = per_task(trials_left(study_yaml), parallelism, trials_per_task, batches_left)
    jobs = steps.suggest_batch(study_yaml, parallelism * size)
    log.info("fedpipe: suggested %d trials in tasks of %d (%d batches left)", len(jobs), size, batches_left)
    return chunks(jobs, size)


def final_chunks(study_yaml: str, parallelism: int, trials_per_task: int) -> list[list[dict]]:
    """Every final run not yet recorded (the choice frozen first), one list per run_trials task: at most
    `parallelism` tasks' worth of `trials_per_task` each, more per task when there are more runs."""
    from fedpipe.study import steps

    jobs = steps.final_jobs(study_yaml)
    return chunks(jobs, per_task(len(jobs), parallelism, trials_per_task, 1))


def run_jobs(study_yaml: str, jobs: list[dict]) -> list[dict]:
    """Run one task's jobs (trials or final runs) in this process; each one's record goes to the store as
    it finishes. Returns a summary per job."""
    from fedpipe.study import steps

    return [summary(record) for record in steps.run_batch(study_yaml, [_job(j) for j in jobs])] if jobs else []


def _job(job: dict) -> dict:
    """A job as suggest made it: a KFP parameter is a protobuf Value, whose every number is a double, so the
    trial's number and the seed come back as 3.0 (and `f"{3.0:04d}"` fails): whole numbers again."""
    return {**job, **{k: int(job[k]) for k in ("number", "seed") if isinstance(job.get(k), float)}}


def summary(record: dict) -> dict:
    return {k: record[k] for k in SUMMARY_KEYS if record.get(k) is not None}


def report(study_yaml: str, finals: list, html_path: str, markdown_path: str) -> dict[str, float]:
    """Rescore, assemble and write the study's report (in its store); copies study.html and study.md to
    the task's artifacts and returns the KFP metrics. `finals`: the final runs' tasks' summaries."""
    from fedpipe.store import open_store
    from fedpipe.study import steps
    from fedpipe.study.config import load_study
    from fedpipe.study.records import StudyRecords

    log.info("fedpipe: %d final runs done in this pipeline run", sum(len(c) for c in finals))
    _, metrics = steps.report(study_yaml)
    study, _ = load_study(None, text=study_yaml)
    records = StudyRecords(open_store(study.study.store), study)
    for name, path in (("study.html", html_path), ("study.md", markdown_path)):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(records.store.get(f"{records.report_prefix}/{name}"))
    return metrics


# --- the components (their source is what runs in the task: it only calls the functions above) -----------

# The lists of chunks are typed list[list]: the loop item is then declared LIST. An item declared STRING (what
# kfp gives a bare `list`) is turned into JSON text by the iteration's driver, and the run_trials task's
# LIST input refuses text (tests/kfp_backend.py, _validate_and_convert).
def suggest(study_yaml: str, parallelism: int, trials_per_task: int, batches_left: int, previous: list = None) -> list[list]:
    """The next batch of tuning trials, one list per task. `previous`: the last batch's results (collected
    from its tasks): this task waits for all of them, and Optuna reads them from the store."""
    from fedpipe.components import study

    return study.suggest_chunks(study_yaml, parallelism, trials_per_task, batches_left)


def run_trials(study_yaml: str, jobs: list, requested_accelerators: str = "") -> list:
    """Run a list of trials or final runs one after another in this (warm) task; returns their summaries.
    `requested_accelerators`: the GPUs the task asked for (as train_phase's)."""
    import os

    from fedpipe.components import study

    if requested_accelerators:
        os.environ["FEDPIPE_ACCELERATOR_COUNT"] = requested_accelerators
    return study.run_jobs(study_yaml, jobs)


def final_runs(study_yaml: str, parallelism: int, trials_per_task: int, tuned: list) -> list[list]:
    """Freeze the choice (every trial is recorded once `tuned`, the last batch's results, arrives) and list
    the final runs, one list per task."""
    from fedpipe.components import study

    return study.final_chunks(study_yaml, parallelism, trials_per_task)


def study_report(study_yaml: str, finals: list, metrics: Output[Metrics], report: Output[HTML], summary: Output[Markdown]):
    """The study's report: every metric of the comparison, study.html (with its plots) and study.md."""
    from fedpipe.components import study

    for name, value in study.report(study_yaml, finals, report.path, summary.path).items():
        metrics.log_metric(name, float(value))


STUDY_FUNCTIONS = (suggest, run_trials, final_runs, study_report)
