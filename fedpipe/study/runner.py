"""A study, start to end on this machine: tune every method on validation, freeze the choice, rerun
it on every seed and split on test, rescore the trials for the papers' protocol, write the report.

    study, base = load_study("examples/study_digits.yaml")
    results = run_study(study, base)

Selection never sees test data: trials run with `eval.split=validation` (their test splits are
dropped before training), the choice is written to chosen.json before any run reads a test split,
and a resumed study takes the frozen choice as it is.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from pathlib import Path

from tqdm import tqdm

from fedpipe.store import Store, open_store
from fedpipe.study import trials
from fedpipe.study.config import StudyConfig, run_tree, split_names
from fedpipe.study.records import StudyRecords
from fedpipe.study.tuning import MethodTuner

log = logging.getLogger(__name__)


def run_study(study: StudyConfig, base: dict, *, store: Store | None = None, progress: bool = True,
              pool: Executor | None = None) -> dict:
    """Run (or resume) the whole study; returns the results that the report shows (also in report/results.json)."""
    records = StudyRecords(store if store is not None else open_store(study.study.store), study)
    records.claim()
    tracking = _mlflow_parent(study)
    env = {"FEDPIPE_MLFLOW_PARENT_RUN_ID": tracking[1]} if tracking else {}
    started = time.perf_counter()
    own = pool is None
    pool = pool if pool is not None else trials.worker_pool(study.workers, env)
    try:
        chosen = tune(study, base, records, pool, progress)
        finals = run_finals(study, base, records, chosen, pool, progress)
        optimistic = rescore_trials(study, base, records, pool, progress)
    finally:
        if own:
            pool.shutdown(wait=True)
    results = assemble(study, base, records, chosen, finals, optimistic, wall=time.perf_counter() - started)
    publish(results, records, tracking)
    return results


def tuners_of(study: StudyConfig, base: dict, records: StudyRecords) -> list[MethodTuner]:
    return [MethodTuner(study, entry, split, records.trials(entry.name, split))
            for split in split_names(study, base) for entry in study.methods]


def tune(study: StudyConfig, base: dict, records: StudyRecords, pool: Executor, progress: bool = True) -> dict:
    """Every method's trials on every split (resumed from their records), then the frozen choice."""
    frozen = records.chosen()  # checked against the study's search spaces: a record is data, not config
    if frozen is not None:
        log.info("Study %s: the choice was frozen earlier (%s); tuning is not run again.", study.study.name,
                 records.store.url(records.chosen_key))
        return frozen
    tuners = tuners_of(study, base, records)
    bar = tqdm(total=sum(t.left for t in tuners), desc="tuning trials", unit="trial", disable=not progress)
    pending: dict[Future, tuple] = {}
    capacity = max(1, study.workers)
    while True:
        for tuner in fair_share(tuners, capacity - len(pending)):
            number, trial, params = tuner.ask()
            job = {"kind": "trial", "method": tuner.entry.name, "split": tuner.split, "number": number, "params": params,
                   "config": run_tree(study, base, tuner.entry, tuner.split, study.seeds[0], params, tuning=True).model_dump(mode="json")}
            pending[pool.submit(trials.execute, job)] = (tuner, trial, job)
        if not pending:
            break
        done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
        for future in done:
            tuner, trial, job = pending.pop(future)
            record = trial_record(study, job, future)
            records.put(records.trial_key(tuner.entry.name, tuner.split, job["number"]), record)
            tuner.tell(trial, record)
            bar.update()
    bar.close()
    chosen: dict = {}
    for t in tuners:
        chosen.setdefault(t.entry.name, {})[t.split] = t.best()
    records.put(records.chosen_key, {"objective": study.objective, "chosen": chosen,
                                     "note": "picked on validation splits only; written before any final run read a test split"})
    return chosen


def fair_share(tuners: list[MethodTuner], room: int):
    """Up to `room` tuners to ask once each, round robin over those with budget left (no method waits on another)."""
    while room > 0:
        ready = sorted((t for t in tuners if t.left), key=lambda t: (t.asked + len(t.finished)))
        if not ready:
            return
        yield ready[0]
        room -= 1


def trial_record(study: StudyConfig, job: dict, future: Future) -> dict:
    base = {k: job[k] for k in ("method", "split", "number", "params")}
    try:
        result = future.result()
    except Exception as err:  # a trial that fails (diverges, bad hyperparameters) is recorded as failed, not retried
        log.warning("Trial %d of %s on %s failed: %s", job["number"], job["method"], job["split"], err)
        return {**base, "objective": None, "state": "failed", "error": str(err)[:2000], "seconds": 0.0}
    objective = trials.objective_of(result["metrics"], study.objective)
    return {**base, "objective": objective, "state": "complete" if objective is not None else "failed",
            "metrics": result["metrics"], "run_id": result["run_id"], "seconds": result["seconds"], "wall": result["wall"]}


def run_finals(study: StudyConfig, base: dict, records: StudyRecords, chosen: dict, pool: Executor, progress: bool = True) -> list[dict]:
    """Each method with its chosen hyperparameters on every split and seed, scored on test (reused when recorded)."""
    entries = {e.name: e for e in study.methods}
    out, pending = [], {}
    for split in split_names(study, base):
        for name, entry in entries.items():
            for seed in study.seeds:
                key = records.final_key(name, split, seed)
                rec = records.final(name, split, seed)
                if rec is not None:
                    out.append(rec)
                    continue
                params = chosen.get(name, {}).get(split, {})
                job = {"kind": "final", "method": name, "split": split, "seed": seed, "params": params,
                       "config": run_tree(study, base, entry, split, seed, params, tuning=False).model_dump(mode="json")}
                pending[pool.submit(trials.execute, job)] = key
    bar = tqdm(total=len(pending), desc="final runs", unit="run", disable=not progress)
    for future in _as_done(pending):
        result = future.result()  # a final run that fails stops the study: its comparison would be incomplete
        records.put(pending[future], result)
        out.append(result)
        bar.update()
    bar.close()
    return out


def rescore_trials(study: StudyConfig, base: dict, records: StudyRecords, pool: Executor, progress: bool = True) -> dict:
    """The papers' protocol, after the choice is frozen: every finished trial's model scored on test with
    the test-oracle candidate, and each method's best over its hyperparameters (labelled optimistic)."""
    entries = {e.name: e for e in study.methods}
    out: dict = {}
    for split in split_names(study, base):
        for name, entry in entries.items():
            key = records.optimistic_key(name, split)
            rec = records.maybe(key, "optimistic record")
            if rec is None:
                done = [r for r in records.trials(name, split) if r.get("objective") is not None]
                jobs = [{"number": r["number"], "params": r["params"],
                         "config": run_tree(study, base, entry, split, study.seeds[0], r["params"], tuning=True).model_dump(mode="json")}
                        for r in done]
                scored = [f.result() for f in [pool.submit(trials.rescore, j) for j in jobs]]
                if not scored:
                    continue
                best = max(scored, key=lambda s: (s["metrics"]["test_oracle_accuracy"], -s["number"]))
                rec = {"accuracy": best["metrics"]["test_oracle_accuracy"], "params": best["params"],
                       "protocol": "best test-oracle accuracy over the tuning trials (seed of tuning)",
                       "trials": [{"number": s["number"], **{k: s["metrics"][k] for k in ("personalized_accuracy", "test_oracle_accuracy")}}
                                  for s in scored]}
                records.put(key, rec)
            out.setdefault(name, {})[split] = rec
    return out


def _as_done(pending: dict):
    left = list(pending)
    while left:
        done, _ = wait(left, return_when=FIRST_COMPLETED)
        for f in done:
            left.remove(f)
            yield f


def assemble(study: StudyConfig, base: dict, records: StudyRecords, chosen: dict, finals: list[dict], optimistic: dict,
             wall: float = 0.0) -> dict:
    """The report's input: per method, its space, trials, choice, final runs and the optimistic protocol."""
    from fedpipe.search_space import describe

    methods = {}
    for entry in study.methods:
        trials_ = [{**r, "state": r.get("state", "complete")} for split in split_names(study, base) for r in records.trials(entry.name, split)]
        methods[entry.name] = {
            "space": {p: describe(d) for p, d in entry.search_space().items()},
            "trials": trials_,
            "chosen": chosen.get(entry.name, {}),
            "finals": [{"split": f["split"], "seed": f["seed"], "test": f["metrics"], "curve": f["curve"], "seconds": f["seconds"],
                        "wall": f.get("wall")} for f in finals if f["method"] == entry.name],
            "optimistic": optimistic.get(entry.name, {}),
        }
    data = base.get("data") or {}
    return {"study": study.study.name, "objective": study.objective, "dataset": data.get("dataset", "mnist5k"),
            "budget": {"trials": study.budget.trials, "rounds": study.budget.rounds, "sampler": study.sampler},
            "seeds": study.seeds, "splits": list(split_names(study, base)), "target_accuracy": study.target_accuracy,
            "methods": methods, "wall_seconds": wall}


def publish(results: dict, records: StudyRecords, tracking: tuple[str, str] | None) -> dict:
    """The report (Markdown, HTML, plots, results.json) into the study's report folder; returns its KFP metrics."""
    from fedpipe.study.report import write_study_report

    with tempfile.TemporaryDirectory() as tmp:
        metrics = write_study_report(results, Path(tmp))
        records.put(f"{records.report_prefix}/results.json", results)
        for path in sorted(Path(tmp).iterdir()):
            records.store.put(f"{records.report_prefix}/{path.name}", path.read_bytes())
        if tracking:
            from fedpipe.telemetry import mlflow as tracking_sink

            tracking_sink.log_artifacts(tracking[0], tracking[1], tmp)
            tracking_sink.finish_run(tracking[0], tracking[1], "FINISHED")
    results["report"] = records.store.url(records.report_prefix)
    return metrics


def _mlflow_parent(study: StudyConfig) -> tuple[str, str] | None:
    """The study's parent MLflow run (its trials and final runs nest under it), when tracking is configured."""
    uri = study.mlflow or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return None
    from fedpipe.telemetry import mlflow as tracking_sink

    run_id = tracking_sink.start_parent_run(uri, "fedpipe", f"study {study.study.name}",
                                            {"budget.trials": study.budget.trials, "budget.rounds": study.budget.rounds,
                                             "sampler": study.sampler, "objective": study.objective,
                                             "methods": ",".join(e.name for e in study.methods)},
                                            {"fedpipe.study": study.study.name})
    return (uri, run_id) if run_id else None
