"""A study end to end on real data (scikit-learn's digits): 2 methods x 4 trials, 2 seeds, its report;
a killed study resumes without redoing a finished trial; selection cannot see test data."""

from __future__ import annotations

import json
from concurrent.futures import Executor

import pytest
import torch

import fedpipe.run.run
from fedpipe.data.federated import ClientData, FederatedData, Split
from fedpipe.errors import ConfigError, CorruptArtifactError
from fedpipe.store import open_store
from fedpipe.study import runner, trials
from fedpipe.study.config import load_study
from fedpipe.study.records import StudyRecords

pytestmark = pytest.mark.slow

STUDY = """
study: {{name: {name}, store: {store}}}
base:
  data: {{dataset: digits}}
  partition: {{scheme: pathological, num_clients: 6}}
  model: {{name: twonn}}
  train: {{local_epochs: 1, batch_size: 20}}
  engine: {{clients: sequential}}
methods: [fedavg_ft, superfed_mm]
budget: {{trials: {trials}, rounds: 2}}
seeds: [0, 1]
workers: {workers}
"""


def _study(tmp_path, name="digits", trials_=4, workers=1):
    return load_study(None, text=STUDY.format(name=name, store=tmp_path, trials=trials_, workers=workers))


def test_a_small_study_end_to_end_with_its_report(tmp_path):
    study, base = _study(tmp_path, workers=2)  # two warm worker processes
    results = runner.run_study(study, base, progress=False)
    store = open_store(str(tmp_path))
    for method in ("fedavg_ft", "superfed_mm"):
        m = results["methods"][method]
        assert len(m["trials"]) == 4 and all(t["state"] == "complete" for t in m["trials"])
        assert len({json.dumps(t["params"], sort_keys=True) for t in m["trials"]}) == 4  # four different configurations
        best = max(m["trials"], key=lambda t: t["objective"])
        assert m["chosen"]["pathological"] == best["params"]  # the choice is the best validation objective
        assert sorted(f["seed"] for f in m["finals"]) == [0, 1]
        for f in m["finals"]:
            assert f["test"]["evaluated_on"] == "test"
            assert f["test"]["personalized_accuracy"] > 0.5  # learns: 6 clients of 2 digits each, chance 0.5 at best
            assert [r["round"] for r in f["curve"]][-1] >= 2
        assert m["optimistic"]["pathological"]["accuracy"] >= max(t["test_oracle_accuracy"] for t in m["optimistic"]["pathological"]["trials"]) - 1e-12
        for t in m["trials"]:
            assert t["metrics"]["evaluated_on"] == "validation"
    keys = store.list("studies/digits/report/")
    assert {"studies/digits/report/study.md", "studies/digits/report/study.html", "studies/digits/report/results.json"} <= set(keys)
    md = store.get("studies/digits/report/study.md").decode()
    assert "fedavg\\_ft" in md and "superfed\\_mm" in md and "OPTIMISTIC" in md
    # a final run's record edited in the store is refused by name, not read as numbers
    key = "studies/digits/finals/fedavg_ft/pathological/seed-1.json"
    store.put_text(key, json.dumps({"method": "fedavg_ft", "split": "pathological", "seed": 1, "metrics": [], "curve": []}))
    with pytest.raises(CorruptArtifactError, match="seed-1.json is not the final run record"):
        runner.run_study(study, base, progress=False)


class _KilledAfter(Executor):
    """Runs `n` jobs in this process, then dies as a killed study would (nothing of the next job is recorded)."""

    def __init__(self, n):
        self.n, self.inner = n, trials.InProcess()

    def submit(self, fn, /, *args, **kwargs):
        if self.n == 0:
            raise KeyboardInterrupt
        self.n -= 1
        return self.inner.submit(fn, *args, **kwargs)


def test_a_killed_study_resumes_without_redoing_a_finished_trial(tmp_path, monkeypatch):
    study, base = _study(tmp_path, name="resumed", trials_=3)
    records = StudyRecords(open_store(str(tmp_path)), study)
    records.claim()
    with pytest.raises(KeyboardInterrupt):
        runner.tune(study, base, records, _KilledAfter(4), progress=False)
    before = {k: open_store(str(tmp_path)).get(k) for k in open_store(str(tmp_path)).list("studies/resumed/trials/")}
    assert len(before) == 4 and not records.store.exists(records.chosen_key)
    ran = []
    real = trials.execute
    monkeypatch.setattr(trials, "execute", lambda job: ran.append((job["method"], job["number"])) or real(job))
    chosen = runner.tune(study, base, records, trials.InProcess(), progress=False)
    assert len(ran) == 2  # 6 trials in all, 4 finished before the kill: only the 2 missing ones run
    assert all(n >= 2 for _, n in ran) and len(set(ran)) == 2
    after = records.store.list("studies/resumed/trials/")
    assert len(after) == 6
    assert all(records.store.get(k) == v for k, v in before.items())  # finished records untouched
    assert set(chosen) == {"fedavg_ft", "superfed_mm"}


def _scrambled(prepare):
    """prepare_data with every test label permuted (each client's test split and the global test set)."""

    def scrambled(bundle, partition, device):
        data = prepare(bundle, partition, device)
        g = torch.Generator().manual_seed(1)

        def perm(split: Split) -> Split:
            return Split(split.x, (split.y + 1 + torch.randint(0, 9, split.y.shape, generator=g)) % 10)  # every label wrong

        clients = tuple(ClientData(c.client_id, c.train, c.val, perm(c.test), c.opt_out) for c in data.clients)
        return FederatedData(clients, perm(data.global_test), data.num_classes, data.input_shape, data.client_names)

    return scrambled


def test_selection_cannot_see_test_data(tmp_path, monkeypatch):
    clean_study, base = _study(tmp_path / "clean", name="clean", trials_=2)
    clean = StudyRecords(open_store(str(tmp_path / "clean")), clean_study)
    chosen_clean = runner.tune(clean_study, base, clean, trials.InProcess(), progress=False)
    opt_clean = runner.rescore_trials(clean_study, base, clean, trials.InProcess(), progress=False)

    monkeypatch.setattr(fedpipe.run.run, "prepare_data", _scrambled(fedpipe.run.run.prepare_data))
    dirty_study, base = _study(tmp_path / "dirty", name="dirty", trials_=2)
    dirty = StudyRecords(open_store(str(tmp_path / "dirty")), dirty_study)
    chosen_dirty = runner.tune(dirty_study, base, dirty, trials.InProcess(), progress=False)

    assert chosen_dirty == chosen_clean
    for method in ("fedavg_ft", "superfed_mm"):
        assert [t["objective"] for t in dirty.trials(method, "pathological")] == [t["objective"] for t in clean.trials(method, "pathological")]
    # the scramble is live: the same trial's model scored on test reads the scrambled labels (every label wrong,
    # so only a model that predicts a wrong class by chance scores at all)
    opt = runner.rescore_trials(dirty_study, base, dirty, trials.InProcess(), progress=False)
    assert opt["fedavg_ft"]["pathological"]["accuracy"] < 0.3 < 0.7 < opt_clean["fedavg_ft"]["pathological"]["accuracy"]


def test_a_study_refuses_bad_configs_by_name(tmp_path):
    with pytest.raises(ConfigError, match="unknown method 'fedsgd'"):
        load_study(None, text=STUDY.format(name="x", store=tmp_path, trials=2, workers=1).replace("fedavg_ft", "fedsgd"))
    with pytest.raises(ConfigError, match="listed twice"):
        load_study(None, text=STUDY.format(name="x", store=tmp_path, trials=2, workers=1).replace("superfed_mm", "fedavg_ft"))
    with pytest.raises(ConfigError, match="log-uniform range needs 0 < low < high"):
        load_study(None, text=STUDY.format(name="x", store=tmp_path, trials=2, workers=1).replace(
            "methods: [fedavg_ft, superfed_mm]", "methods: [{name: fedavg, space: {train.lr: {log_uniform: [0, 1]}}}]"))
    # a study from a UI parameter is bounded, and names no file of the pod it runs in
    with pytest.raises(ConfigError, match="more than the 64 KiB"):
        load_study(None, text="methods: [fedavg]\n" + "#" * 70_000)
    with pytest.raises(ConfigError, match="cannot name a base_config file"):
        load_study(None, text="methods: [fedavg]\nbase_config: /etc/passwd\n")
    (tmp_path / "notaconfig.yaml").write_text("just text\n")
    (tmp_path / "study.yaml").write_text("methods: [fedavg]\nbase_config: notaconfig.yaml\n")
    with pytest.raises(ConfigError, match="is not a run config"):
        load_study(tmp_path / "study.yaml")
    study, base = _study(tmp_path, name="pinned", trials_=2)
    StudyRecords(open_store(str(tmp_path)), study).claim()
    other, _ = _study(tmp_path, name="pinned", trials_=3)
    with pytest.raises(ConfigError, match="belongs to another configuration"):
        StudyRecords(open_store(str(tmp_path)), other).claim()
