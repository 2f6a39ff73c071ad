"""Every method runs through all its steps on real data and writes a complete report."""

import json

import pytest
from runs import small_run, swap_algorithm_class

from fedpipe.algorithms import ALGORITHMS
from fedpipe.algorithms.fedavg import FedAvg
from fedpipe.data.federated import prepare_data
from fedpipe.engine.rounds import select_clients

# methods whose clients send exactly their whole model every round (the others are pinned in their own tests)
WHOLE_MODEL_UPLOADS = {"fedavg", "fedprox", "fedavg_ft", "fedprox_ft", "superfed_mm", "superfed_lm", "ditto", "pfedme"}


@pytest.mark.parametrize("method", list(ALGORITHMS))
def test_method_runs_end_to_end_and_reports(tmp_path, method):
    run = small_run(tmp_path, f"method.name={method}", "train.rounds=2", "partition.num_clients=4")
    summary = run.run_all()
    report = tmp_path / "test" / "report"
    for name in ("summary.json", "clients.csv", "accuracy.png", "partition_heatmap.png", "report.md"):
        assert (report / name).stat().st_size > 0, name
    assert json.loads((report / "summary.json").read_text())["method"] == method
    p = summary["personalized_accuracy"]
    assert 0 <= p["mean"] <= 1 and p["clients"] == 4
    rounds = [json.loads(line) for ph in run.phases() for line in (report / f"rounds-{ph.name}.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == list(range(1, len(rounds) + 1))
    uploaded = sum(r["bytes_uploaded"] for r in rounds)
    glob = summary["global_model"]
    assert glob is None or 0 <= glob["top1"] <= 1
    if method == "local":
        assert glob is None and uploaded == 0
    if method in WHOLE_MODEL_UPLOADS:
        # every round every client sends the whole MLP once (784*200 + 200 + 200*200 + 200 + 200*10 + 10 floats)
        params = 784 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10
        assert uploaded == 2 * 4 * params * 4 and glob is not None
    if method.startswith("superfed"):
        assert (report / "lam_curve.png").stat().st_size > 0
        assert "test_oracle_mean" in p and 0 <= p["chosen_lam"]["median"] <= 1
    if method.endswith("_ft"):
        assert [ph.name for ph in run.phases()] == ["federation", "finetune"] and len(rounds) == 3


FAILING = {1, 4, 7}  # these clients raise whenever they are sampled


class FailingSomeClients(FedAvg):
    def client_result(self, ctx, slots, state):
        if ctx.client_id in FAILING:
            raise RuntimeError("simulated client crash")
        return super().client_result(ctx, slots, state)


def test_client_sampling_fraction_and_failures_are_counted(tmp_path, monkeypatch):
    """C = 0.3 of 10 clients: 3 sampled per round; the sampled ones that fail are counted apart from
    the ones that reported, every round, and the run still finishes with a model that learned."""
    swap_algorithm_class(monkeypatch, FailingSomeClients)
    run = small_run(tmp_path, "method.name=fedavg", "partition.num_clients=10", "train.client_fraction=0.3", "train.rounds=4",
                    "partition.scheme=iid")
    summary = run.run_all()
    rounds = [json.loads(line) for line in (tmp_path / "test" / "report" / "rounds-federation.jsonl").read_text().splitlines()]
    data = prepare_data(run.bundle, run.load_partition(), run.device)
    phase = run.phases()[0]
    expected = [select_clients(data, phase, 0.3, run.cfg.run.seed, r) for r in phase.rounds]
    assert all(len(chosen) == 3 for chosen in expected)
    assert [r["failed_clients"] for r in rounds] == [len(FAILING & set(c)) for c in expected]
    assert [r["clients"] for r in rounds] == [len(set(c) - FAILING) for c in expected]
    assert sum(r["failed_clients"] for r in rounds) > 0  # the sampling met a failing client at least once
    assert summary["global_model"]["top1"] > 0.3  # the failures were left out, the others' work kept


def test_personalized_models_can_be_scored_on_the_global_test_set(tmp_path):
    run = small_run(tmp_path, "method.name=local", "train.rounds=1", "partition.num_clients=3", "eval.personalized_on_global_test=true")
    summary = run.run_all()
    p = summary["personalized_accuracy"]
    assert 0 < p["on_global_test"] < p["mean"]  # a 2-class local model generalises worse than it specialises
    rows = (tmp_path / "test" / "report" / "clients.csv").read_text().splitlines()
    assert rows[0].endswith("global_test_accuracy") and all(r.split(",")[-1] for r in rows[1:])
