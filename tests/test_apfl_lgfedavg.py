"""APFL (adaptive mixing weight per client) and LG-FedAvg (local representations, global head): their
update rules against hand computations, what they send, and a small run each."""

from __future__ import annotations

import json

import pytest
import torch
from runs import small_run
from torch.func import functional_call
from torch.nn import functional as F

from fedpipe.algorithms.apfl import APFL, APFLParams
from fedpipe.algorithms.base import ClientContext, ServerState
from fedpipe.nn.networks import build_model

SMALL = ["partition.num_clients=4", "train.rounds=2", "run.threads=1"]


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _apfl_slots(algo: APFL, alpha: float, gen: torch.Generator):
    w = {n: p.detach().clone() for n, p in algo.model.named_parameters()}
    v = {n: t + 0.05 * torch.randn(t.shape, generator=gen) for n, t in w.items()}
    slots = {"global": w, "local": v, "alpha": {"alpha": torch.tensor(alpha)}}
    for tensors in slots.values():
        for t in tensors.values():
            t.requires_grad_(True)
    return slots


@pytest.mark.parametrize("alpha_lr", [None, 0.3])
def test_apfl_step_matches_algorithm_1_and_the_adaptive_alpha_update(alpha_lr):
    """One APFL step by hand (Deng et al. 2020, Algorithm 1, Eq. 10), all gradients at the batch's start:
    w' = w - eta grad f(w); v' = v - eta alpha grad f(v_bar); alpha' = alpha - eta_a <v - w, grad f(v_bar)>,
    with v_bar = alpha v + (1 - alpha) w."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    algo = APFL(APFLParams(alpha_lr=alpha_lr), build_model("twonn", (1, 8, 8), 3), seed=0)
    slots = _apfl_slots(algo, 0.4, gen)
    x, y = torch.randn(6, 1, 8, 8, generator=gen), torch.tensor([0, 1, 2, 2, 1, 0])
    w = {n: t.detach().clone() for n, t in slots["global"].items()}
    v = {n: t.detach().clone() for n, t in slots["local"].items()}
    eta, eta_a, alpha = 0.1, alpha_lr or 0.1, 0.4

    def grad_at(params):
        leaves = {n: t.clone().requires_grad_(True) for n, t in params.items()}
        loss = F.cross_entropy(functional_call(algo.model, leaves, (x,)), y)
        return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values())))), loss

    grad_w, _ = grad_at(w)
    v_bar = {n: alpha * v[n] + (1 - alpha) * w[n] for n in w}
    grad_bar, loss_bar = grad_at(v_bar)
    inner = sum(float(((v[n] - w[n]) * grad_bar[n]).sum()) for n in w)  # <v - w, grad f(v_bar)>
    expected_alpha = min(max(alpha - eta_a * inner, 0.0), 1.0)

    loss = algo.update(slots, x, y, None, eta)
    torch.testing.assert_close(loss, loss_bar.detach(), rtol=0, atol=1e-6)
    assert abs(inner) > 1e-4  # a real move of alpha
    assert float(slots["alpha"]["alpha"].detach()) == pytest.approx(expected_alpha, abs=1e-6)
    for n in w:
        torch.testing.assert_close(slots["global"][n].detach(), w[n] - eta * grad_w[n], rtol=0, atol=1e-6)
        torch.testing.assert_close(slots["local"][n].detach(), v[n] - eta * alpha * grad_bar[n], rtol=0, atol=1e-6)


def test_apfl_alpha_stays_in_0_1_and_can_be_fixed():
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 1, 8, 8, generator=gen), torch.tensor([0, 1, 2, 2, 1, 0])
    algo = APFL(APFLParams(alpha_lr=1e6), build_model("twonn", (1, 8, 8), 3), seed=0)
    slots = _apfl_slots(algo, 0.5, gen)
    algo.update(slots, x, y, None, 0.01)
    assert float(slots["alpha"]["alpha"].detach()) in (0.0, 1.0)  # projected on [0, 1]
    fixed = APFL(APFLParams(adaptive_alpha=False), algo.model, seed=0)
    slots = _apfl_slots(fixed, 0.5, gen)
    fixed.update(slots, x, y, None, 0.01)
    assert float(slots["alpha"]["alpha"].detach()) == 0.5


def test_apfl_personalized_model_is_the_weight_space_mixture():
    algo = APFL(APFLParams(), build_model("twonn", (1, 8, 8), 3), seed=0)
    w = {n: torch.randn(p.shape) for n, p in algo.model.named_parameters()}
    v = {n: torch.randn(t.shape) for n, t in w.items()}
    state = {**{f"local.{n}": t for n, t in v.items()}, "alpha": torch.tensor(0.3)}
    [(_, mixed)] = algo.personalized_candidates(ServerState(w), state, 0)
    for n in w:
        torch.testing.assert_close(mixed[n], 0.3 * v[n] + 0.7 * w[n])
    assert algo.personalized_candidates(ServerState(w), None, 0)[0][1] is w  # never trained: the global model


def test_apfl_runs_end_to_end_and_learns_an_alpha_per_client(tmp_path):
    run = small_run(tmp_path, "method.name=apfl", *SMALL)
    summary = run.run_all()
    assert 0 < summary["personalized_accuracy"]["mean"] <= 1 and 0 < summary["global_model"]["top1"] <= 1
    rows = [json.loads(line) for line in (tmp_path / "test" / "report" / "rounds-federation.jsonl").read_text().splitlines()]
    alphas = rows[-1]["details"]["alpha"]
    assert len(alphas) == 4 and all(0 <= a <= 1 for a in alphas.values()) and len(set(alphas.values())) > 1
    params = sum(p.numel() for p in run.build_algorithm()[0].model.parameters())
    assert sum(r["bytes_uploaded"] for r in rows) == 2 * 4 * params * 4  # w only, never v or alpha


def test_lgfedavg_sends_only_the_global_layers_and_keeps_representations_local(tmp_path):
    run = small_run(tmp_path, "method.name=lgfedavg", *SMALL)
    summary = run.run_all()
    assert summary["global_model"] is None and 0 < summary["personalized_accuracy"]["mean"] <= 1
    algorithm, initial = run.build_algorithm()
    assert algorithm.global_names == ["head.weight", "head.bias"]  # twonn: the 200 -> 10 output layer
    rows = [json.loads(line) for line in (tmp_path / "test" / "report" / "rounds-federation.jsonl").read_text().splitlines()]
    head = 200 * 10 + 10
    assert [r["bytes_uploaded"] for r in rows] == [4 * head * 4] * 2
    assert [r["bytes_downloaded"] for r in rows] == [4 * head * 4] * 2

    from fedpipe.engine.state import Checkpoints

    state = Checkpoints(run.store, run.layout.phase("federation")).load_final(torch.device("cpu"))
    for cid, kept in state.clients.items():
        assert set(kept) == set(initial) - {"head.weight", "head.bias"}, cid  # local layers only
    # the server never received a representation layer: its copy is still the initial model's
    for n, t in state.server.global_params.items():
        assert torch.equal(t, initial[n]) == (n not in algorithm.global_names), n
    # a client's personalized model: its own representation under the federated head
    [(_, personal)] = algorithm.personalized_candidates(state.server, state.clients[0], 0)
    assert torch.equal(personal["head.weight"], state.server.global_params["head.weight"])
    assert torch.equal(personal["body.1.weight"], state.clients[0]["body.1.weight"])


def test_lgfedavg_rejects_layer_choices_that_leave_nothing_local_or_global():
    from fedpipe.algorithms.lgfedavg import LGFedAvg, LGFedAvgParams
    from fedpipe.errors import ConfigError

    model = build_model("lenet5", (1, 28, 28), 10)
    assert LGFedAvg(LGFedAvgParams(global_layers=["body.2", "head"]), model, 0).global_names == [
        "body.2.weight", "body.2.bias", "head.weight", "head.bias"]
    for bad in (["nothing"], ["features", "body", "head"], []):
        with pytest.raises(ConfigError):
            LGFedAvg(LGFedAvgParams(global_layers=bad), model, 0)


def test_lgfedavg_client_trains_its_representation_and_the_head_jointly():
    from fedpipe.algorithms.lgfedavg import LGFedAvg, LGFedAvgParams
    from fedpipe.data.federated import ClientData, Split
    from fedpipe.engine.sequential import train_client

    gen = torch.Generator().manual_seed(0)
    model = build_model("twonn", (1, 8, 8), 3)
    algo = LGFedAvg(LGFedAvgParams(), model, 0)
    x, y = torch.randn(20, 1, 8, 8, generator=gen), torch.randint(0, 3, (20,), generator=gen)
    split = Split(x, y)
    phase = algo.phases(algo.params, 1)[0]
    ctx = ClientContext(0, 1, phase, ClientData(0, split, Split(x[:0], y[:0]), split, False))
    download = algo.download(phase, ServerState({n: p.detach() for n, p in model.named_parameters()}), 0)
    assert set(download) == {"head.weight", "head.bias"}
    slots, _ = train_client(algo, ctx, algo.client_params(ctx, download, None), algo.stages(ctx, 1), batch_size=5, lr=0.1,
                            optimizer="sgd", momentum=0.0, weight_decay=0.0, generator=gen)
    upload, kept = algo.client_result(ctx, slots, None)
    assert set(upload) == {"head.weight", "head.bias"} and "head.weight" not in kept
    assert not torch.equal(kept["body.1.weight"], algo.initial_local["body.1.weight"])  # trained locally
    assert not torch.equal(upload["head.weight"], download["head.weight"])
