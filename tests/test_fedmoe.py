"""The federated mixture of experts (fedmoe): opt-out data never reaches the global model, the mixture is
Eq. 6's convex combination with the global model frozen, early stopping keeps the best epoch, every
client gets a specialist and a gate, and the method runs as a pipeline with one task per phase."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import yaml
from kfp_backend import flat_tasks
from runs import SMALL, assert_same_params, small_run
from torch.func import functional_call
from torch.nn import functional as F

import fedpipe.run.run
from fedpipe.algorithms.base import ClientContext, ServerState
from fedpipe.algorithms.fedmoe import FedMoE, FedMoEParams, part, prefixed
from fedpipe.data import LabeledArrays
from fedpipe.data.federated import ClientData, Split
from fedpipe.engine.sequential import train_client
from fedpipe.nn.networks import build_model

# 6 clients of 60 real mnist5k digits (majority classes 80%), half of them opt-out, the MLP, Adam,
# 2 federated rounds, then specialists and gates with at most 3 epochs: a few seconds per phase.
MOE = [
    "method.name=fedmoe", "partition.scheme=majority_class", "partition.num_clients=6", "partition.samples_per_client=60",
    "partition.p=0.8", "partition.opt_out_fraction=0.5", "train.rounds=2", "train.optimizer=adam", "train.lr=0.001",
    "train.weight_decay=0", "method.max_epochs=3", "method.patience=2", "method.finetune_lr=0.001", "eval.every=0",
    "run.threads=1",  # on a busy 2-core machine two threads per step are many times slower than one
]


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _altered_data(monkeypatch, which):
    """Make every later `prepare_data` see other images and labels in the rows of the clients `which`
    picks (a function of the partition's client): the dataset arrays themselves are changed."""
    real = fedpipe.run.run.prepare_data

    def altered(bundle, partition, device):
        x, y = bundle.train.x.copy(), bundle.train.y.copy()
        rng = np.random.default_rng(123)
        for client in partition.clients:
            if which(client):
                rows = client.indices
                x[rows] = rng.integers(0, 256, size=x[rows].shape, dtype=np.uint8)
                y[rows] = (y[rows] + 1) % bundle.num_classes
        return real(dataclasses.replace(bundle, train=LabeledArrays(x, y)), partition, device)

    monkeypatch.setattr(fedpipe.run.run, "prepare_data", altered)


def test_opt_out_clients_data_never_reaches_the_global_model(tmp_path, monkeypatch):
    """Must-show 1: change every opt-out client's data and the global model is bitwise the same (CPU,
    same seed); change one opt-in client's data and it is not. The opt-out clients' own specialists do
    see their data."""
    runs, states = {}, {}
    for name, which in (("same", None), ("opt_out_changed", lambda c: c.opt_out), ("opt_in_changed", None)):
        run = runs[name] = small_run(tmp_path / name, *MOE)
        partition = run.partition()
        if name == "opt_in_changed":
            first_in = next(c.id for c in partition.clients if not c.opt_out)
            which = lambda c, first_in=first_in: c.id == first_in  # noqa: E731
        if which is not None:
            _altered_data(monkeypatch, which)
        states[name] = run.train("federation"), run.train("specialists")
        monkeypatch.undo()
    opt_out = set(runs["same"].load_partition().opt_out_ids)
    assert len(opt_out) == 3

    (fed_a, spec_a), (fed_b, spec_b), (fed_c, _) = states["same"], states["opt_out_changed"], states["opt_in_changed"]
    assert_same_params(fed_a.server.global_params, fed_b.server.global_params)
    assert any(not torch.equal(fed_a.server.global_params[n], t) for n, t in fed_c.server.global_params.items())
    # phase 2 trains every client on its own data: opt-in specialists are unchanged, opt-out ones are not
    for cid in range(6):
        a, b = part("finetuned", spec_a.clients[cid]), part("finetuned", spec_b.clients[cid])
        same = all(torch.equal(a[n], b[n]) for n in a)
        assert same == (cid not in opt_out), cid


def _random_params(module: torch.nn.Module, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {n: torch.randn(p.shape, generator=gen) * 0.1 for n, p in module.named_parameters()}


@pytest.mark.parametrize("mixture", ["probabilities", "log_probabilities"])
def test_the_mixture_is_the_hand_computed_convex_combination(mixture):
    """Must-show 2 (first half): y = h(x) f_s(x) + (1 - h(x)) f_g(x) (Eq. 6) on softmax outputs, with h
    the gate's sigmoid; the authors' geometric variant mixes log-probabilities."""
    model = build_model("twonn", (1, 8, 8), 3)
    algo = FedMoE(FedMoEParams(mixture=mixture), model, seed=0)
    gen = torch.Generator().manual_seed(1)
    g, s, gate = _random_params(model, gen), _random_params(model, gen), _random_params(algo.gate_net, gen)
    x, y = torch.randn(5, 1, 8, 8, generator=gen), torch.tensor([0, 1, 2, 0, 1])

    # by hand, with the modules called on their own
    p_g = F.softmax(functional_call(model, g, (x,)), dim=1)
    p_s = F.softmax(functional_call(model, s, (x,)), dim=1)
    h = torch.sigmoid(functional_call(algo.gate_net, gate, (x,)))
    assert h.shape == (5, 1) and algo.gate_net.head.out_features == 1
    assert 0.05 < float(h.min()) and float(h.max()) < 0.95  # a real mixture, not one expert
    if mixture == "probabilities":
        expected_log = torch.log(h * p_s + (1 - h) * p_g)
    else:
        expected_log = h * torch.log(p_s) + (1 - h) * torch.log(p_g)

    state = {**prefixed("specialist", s), **prefixed("gate", gate)}
    [(_, params)] = algo.personalized_candidates(ServerState(g), state, client_id=0)
    out = algo.forward(params, x)
    torch.testing.assert_close(out, expected_log, rtol=0, atol=1e-6)
    if mixture == "probabilities":
        torch.testing.assert_close(out.exp().sum(dim=1), torch.ones(5), rtol=0, atol=1e-6)
    loss = algo.mixture_loss({"global": g, "specialist": s, "gate": gate}, x, y, None)
    torch.testing.assert_close(loss, -expected_log[torch.arange(5), y].mean(), rtol=0, atol=1e-6)


def test_phases_freeze_the_global_model_and_every_client_gets_a_specialist_and_a_gate(tmp_path):
    """Must-show 2 (second half): phase 3 leaves the global model bitwise unchanged, in the server's
    state and in the slot a client trains beside it. Opt-out clients get specialists and gates too."""
    run = small_run(tmp_path, *MOE)
    run.partition()
    fed, spec, gate = (run.train(p) for p in ("federation", "specialists", "gate"))
    assert [p.name for p in run.phases()] == ["federation", "specialists", "gate"]
    assert_same_params(fed.server.global_params, spec.server.global_params)
    assert_same_params(fed.server.global_params, gate.server.global_params)

    algorithm, _ = run.build_algorithm()
    g = fed.server.global_params
    opt_out = set(run.load_partition().opt_out_ids)
    for cid, kept in gate.clients.items():
        names = {k.split(".", 1)[0] for k in kept}
        assert names == {"finetuned", "local", "specialist", "gate"}, (cid, names)
        assert any(not torch.equal(part("finetuned", kept)[n], g[n]) for n in g)  # fine-tuned away from w_g
        assert set(algorithm.compared_models(gate.server, kept)) == {"fedavg", "local", "finetuned", "mixture"}
        [(_, personal)] = algorithm.personalized_candidates(gate.server, kept, cid)
        assert "gate.head.weight" in personal and "global.head.weight" in personal
    assert opt_out and opt_out <= set(gate.clients) and set(gate.clients) == set(range(6))

    # one client's phase 3 by hand: the downloaded global tensors are read, never written
    data = fedpipe.run.run.prepare_data(run.bundle, run.load_partition(), torch.device("cpu"))
    phase = run.phases()[2]
    client = data.clients[sorted(opt_out)[0]]
    ctx = ClientContext(client.client_id, phase.first_round, phase, client)
    download = {n: t.clone() for n, t in g.items()}
    slots = algorithm.client_params(ctx, download, spec.clients[client.client_id])
    trained, _ = train_client(algorithm, ctx, slots, algorithm.stages(ctx, 1), batch_size=20, lr=1e-3, optimizer="adam",
                              momentum=0.0, weight_decay=0.0, generator=torch.Generator().manual_seed(0))
    assert_same_params(trained["global"], g)
    assert_same_params(download, g)
    assert any(not torch.equal(trained["gate"][n], t) for n, t in algorithm.initial_gate.items())


def _client(x_train, y_train, x_val, y_val) -> ClientData:
    empty = Split(x_val[:0], y_val[:0])
    return ClientData(0, Split(x_train, y_train), Split(x_val, y_val), empty, opt_out=False)


def test_early_stopping_keeps_the_best_epoch():
    """The specialist's stage stops when its validation loss has not improved for `patience` epochs and
    keeps the best epoch's tensors. Training labels are all 0 and validation labels all 1, so every
    epoch makes the validation loss worse: the best epoch is the first, and training stops after
    1 + patience epochs."""
    gen = torch.Generator().manual_seed(0)
    model = build_model("twonn", (1, 8, 8), 3)
    x, xv = torch.randn(40, 1, 8, 8, generator=gen), torch.randn(20, 1, 8, 8, generator=gen)
    client = _client(x, torch.zeros(40, dtype=torch.long), xv, torch.ones(20, dtype=torch.long))
    w_g = {n: p.detach().clone() for n, p in model.named_parameters()}

    def specialist(max_epochs: int, patience: int, early_stopping: bool = True):
        algo = FedMoE(FedMoEParams(max_epochs=max_epochs, patience=patience, finetune_lr=1e-3, baselines=False), model, seed=0)
        phase = algo.phases(algo.params, 1)[1]
        ctx = ClientContext(0, phase.first_round, phase, client)
        stages = algo.stages(ctx, 1)
        assert len(stages) == 1 and stages[0].early_stopping.patience == patience and stages[0].epochs == max_epochs
        if not early_stopping:  # the same stage without it: the last epoch's tensors
            stages = [dataclasses.replace(stages[0], early_stopping=None)]
        slots, stats = train_client(algo, ctx, algo.client_params(ctx, w_g, None), stages, batch_size=10, lr=1e-3,
                                    optimizer="adam", momentum=0.0, weight_decay=0.0,
                                    generator=torch.Generator().manual_seed(7))
        val = float(algo.specialist_loss(slots, xv, client.val.y, None))
        return slots["specialist"], stats.samples, val

    best, samples, best_val = specialist(max_epochs=50, patience=2)
    one_epoch, _, _ = specialist(max_epochs=1, patience=2)
    three_epochs, _, last_val = specialist(max_epochs=3, patience=2, early_stopping=False)
    assert samples == 3 * 40  # epoch 1 (best), then 2 epochs without improvement: stopped long before 50
    assert_same_params(best, one_epoch)
    assert last_val > best_val and any(not torch.equal(best[n], three_epochs[n]) for n in best)


def test_fedmoe_runs_end_to_end_and_reports(tmp_path):
    run = small_run(tmp_path, *MOE, "eval.personalized_on_global_test=true", "partition.opt_out_fraction=0.0")
    summary = run.run_all()
    p = summary["personalized_accuracy"]
    assert 0 < p["mean"] <= 1 and 0 < p["on_global_test"] <= 1 and 0 < summary["global_model"]["top1"] <= 1
    import json

    report = tmp_path / "test" / "report"
    lines = {ph.name: [json.loads(line) for line in (report / f"rounds-{ph.name}.jsonl").read_text().splitlines()]
             for ph in run.phases()}
    assert [r["round"] for r in lines["federation"] + lines["specialists"] + lines["gate"]] == [1, 2, 3, 4]
    assert all(r["bytes_uploaded"] > 0 for r in lines["federation"])
    assert all(r["bytes_uploaded"] == 0 for r in lines["specialists"] + lines["gate"])  # phases 2-3 are local


def test_one_pipeline_task_per_phase_without_new_pipeline_code(tmp_path):
    """Must-show 4: the generic pipeline builder makes one training task per phase of fedmoe, each
    after the one before it."""
    from fedpipe.pipelines.builder import compile_pipeline, method_pipeline
    from fedpipe.run.config import load_config

    cfg = load_config(None, ["method.name=fedmoe"])
    spec = next(yaml.safe_load_all(compile_pipeline(method_pipeline(cfg), tmp_path / "fedmoe.yaml").read_text()))
    tasks = flat_tasks(spec)
    training = {t["inputs"]["parameters"]["phase"]["runtimeValue"]["constant"]: t for t in tasks.values()
                if t["componentRef"]["name"].startswith("comp-train-phase")}
    assert sorted(training) == ["federation", "gate", "specialists"]
    assert "previous" not in training["federation"]["inputs"].get("artifacts", {})
    for phase, before in (("specialists", "federation"), ("gate", "specialists")):
        producer = training[phase]["inputs"]["artifacts"]["previous"]["taskOutputArtifact"]["producerTask"]
        assert tasks[producer]["inputs"]["parameters"]["phase"]["runtimeValue"]["constant"] == before


@pytest.mark.slow
def test_the_fedmoe_pipeline_runs_locally(tmp_path):
    """Must-show 4, executed: kfp's local runner runs config, partition, the three phases and evaluate,
    each task in its own process."""
    from fedpipe.pipelines.builder import method_pipeline
    from fedpipe.pipelines.local_runner import run_locally
    from fedpipe.run.config import load_config

    cfg = load_config(None, [*SMALL, *MOE, f"run.store={tmp_path}", "run.id=pipe"])
    artifacts = run_locally(method_pipeline(cfg), {"base_config": cfg.to_yaml()}, tmp_path / "_kfp")
    for phase in ("federation", "specialists", "gate"):
        assert (tmp_path / "pipe" / "phases" / phase / "final.pt").exists(), phase
    assert (tmp_path / "pipe" / "report" / "summary.json").exists() and artifacts.exists()


def test_local_trainings_default_to_the_papers_500_epochs_with_early_stopping():
    """The paper trains specialist, Local model and mixture 'using early stopping for 500 epochs' (Sec. 4)."""
    params = FedMoEParams()
    assert params.max_epochs == 500
    algo = FedMoE(params, build_model("twonn", (1, 28, 28), 10), seed=0)
    for phase in algo.phases(params, 2)[1:]:
        ctx = ClientContext(0, phase.first_round, phase, None)
        assert [(s.epochs, s.early_stopping.patience) for s in algo.stages(ctx, 1)] == [(500, 3)] * (2 if phase.name == "specialists" else 1)
