"""A study cut into the steps of a Kubeflow pipeline: suggest a batch of trials, run a batch (in one warm
task), freeze the choice, run the final runs, rescore for the papers' protocol, report.

Every step reads the study's records from the store and writes its own, so a retried task redoes only
what has no record, and the steps agree with the local runner (`fedpipe.study.runner`) record for
record: a study started on a laptop can be finished on a cluster sharing its store, and back.
"""

from __future__ import annotations

from fedpipe.errors import FedpipeError
from fedpipe.store import open_store
from fedpipe.study import runner, trials
from fedpipe.study.config import StudyConfig, load_study, run_tree, split_names
from fedpipe.study.records import StudyRecords


class StudyIncomplete(FedpipeError):
    """A step that needs the tuning finished ran before it (a pipeline edited by hand, a task run alone)."""


def _open(study_yaml: str) -> tuple[StudyConfig, dict, StudyRecords]:
    study, base = load_study(None, text=study_yaml)
    records = StudyRecords(open_store(study.study.store), study)
    records.claim()
    return study, base, records


def suggest_batch(study_yaml: str, size: int) -> list[dict]:
    """Up to `size` new trials, shared fairly over the methods and splits with budget left (Optuna's
    samplers, rebuilt from the finished trials: the same records give the same batch); [] when the
    budget is spent or the choice is frozen. Each item is a job `run_batch` takes."""
    study, base, records = _open(study_yaml)
    if records.store.exists(records.chosen_key):
        return []
    tuners = runner.tuners_of(study, base, records)
    jobs = []
    for tuner in runner.fair_share(tuners, size):
        number, _, params = tuner.ask()
        jobs.append({"kind": "trial", "method": tuner.entry.name, "split": tuner.split, "number": number, "params": params})
    return jobs


def final_jobs(study_yaml: str) -> list[dict]:
    """Every final run not yet recorded (method x split x seed), with the frozen choice's hyperparameters."""
    study, base, records = _open(study_yaml)
    chosen = _freeze(study, base, records)
    return [{"kind": "final", "method": e.name, "split": split, "seed": seed, "params": chosen.get(e.name, {}).get(split, {})}
            for split in split_names(study, base) for e in study.methods for seed in study.seeds
            if not records.store.exists(records.final_key(e.name, split, seed))]


def run_batch(study_yaml: str, jobs: list[dict]) -> list[dict]:
    """Run a batch of jobs (trials or final runs) one after another in this process, which stays warm
    (torch imported and each dataset loaded once); each job's record is written as it finishes."""
    study, base, records = _open(study_yaml)
    entries = {e.name: e for e in study.methods}
    out = []
    for job in jobs:
        entry = entries[job["method"]]
        seed = job.get("seed", study.seeds[0])
        cfg = run_tree(study, base, entry, job["split"], seed, job["params"], tuning=job["kind"] == "trial")
        full = {**job, "config": cfg.model_dump(mode="json")}
        if job["kind"] == "trial":
            key = records.trial_key(entry.name, job["split"], job["number"])
            if not records.store.exists(key):
                records.put(key, runner.trial_record(study, full, trials.InProcess().submit(trials.execute, full)))
            out.append(records.read(key, "trial record"))
        else:
            key = records.final_key(entry.name, job["split"], seed)
            if not records.store.exists(key):
                records.put(key, trials.execute(full))
            out.append({k: v for k, v in records.final(entry.name, job["split"], seed).items() if k != "curve"})
    return out


def freeze(study_yaml: str) -> dict:
    """The choice, written once: each method's best finished trial on validation per split."""
    return _freeze(*_open(study_yaml))


def _freeze(study: StudyConfig, base: dict, records: StudyRecords) -> dict:
    if not (records.store.exists(records.chosen_key) or all(t.left == 0 for t in runner.tuners_of(study, base, records))):
        raise StudyIncomplete(f"Study {study.study.name}: trials are still missing in {records.store.url(records.root)}; the choice "
                              "is frozen only once every method has used its budget (run the tuning batches first).")
    return runner.tune(study, base, records, trials.InProcess(), progress=False)


def report(study_yaml: str) -> tuple[dict, dict]:
    """Rescore the trials (the papers' protocol), assemble every record and write the report; returns
    (the results, the KFP metrics)."""
    study, base, records = _open(study_yaml)
    chosen = _freeze(study, base, records)
    pool = trials.InProcess()
    finals = runner.run_finals(study, base, records, chosen, pool, progress=False)  # all recorded by now: read back
    optimistic = runner.rescore_trials(study, base, records, pool, progress=False)
    results = runner.assemble(study, base, records, chosen, finals, optimistic)
    metrics = runner.publish(results, records, None)
    return results, metrics
