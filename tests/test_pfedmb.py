"""pFedMB's math (Mori et al. 2023): the merge (Eq. 1) against the multi-branch layers (Eq. 2), alpha on
the simplex, Algorithm 1's two stages, alpha-weighted aggregation (Eq. 5) and plain averaging (Eq. 6),
the B = 1 reduction to FedAvg + fine-tuning, the B x P communication, and an end-to-end run."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from runs import small_run, train_all
from torch import nn
from torch.func import functional_call

from fedpipe.algorithms.base import ClientContext, Upload
from fedpipe.algorithms.pfedmb import ALPHA, PFedMB, PFedMBParams, alpha_weighted_average
from fedpipe.data.datasets import load_dataset
from fedpipe.data.federated import ClientData, Split
from fedpipe.data.partition import make_partition
from fedpipe.engine.sequential import train_client
from fedpipe.errors import ConfigError
from fedpipe.nn.multibranch import BranchLayout, MultiBranchConv2d, MultiBranchLinear, project_onto_simplex
from fedpipe.nn.networks import LeNet5, TwoNN
from fedpipe.run.config import load_config


def lenet():
    torch.manual_seed(0)
    model = LeNet5((1, 28, 28), 10)
    return model, {n: p.detach().clone() for n, p in model.named_parameters()}


def random_simplex(rows, cols, seed):
    """Uniform points on the simplex: normalised Exp(1) draws (Dirichlet(1, ..., 1))."""
    e = -torch.log(torch.rand(rows, cols, generator=torch.Generator().manual_seed(seed)))
    return e / e.sum(-1, keepdim=True)


@pytest.mark.parametrize("shared", [False, True], ids=["per_layer", "shared"])
@pytest.mark.parametrize("branched", ["all", ("features",), ("body.2", "head")])
def test_merged_model_equals_the_multi_branch_model(shared, branched):
    model, base = lenet()
    layout = BranchLayout.of(model, 3, branched, shared_alpha=shared)
    branches = layout.branch(model, base, seed=7)
    alpha = random_simplex(layout.alpha_rows, 3, seed=1)
    x = torch.randn(16, 1, 28, 28, generator=torch.Generator().manual_seed(2))

    reference = layout.multibranch_model(model, branches, alpha)  # Eq. 2, branch by branch
    for layer in layout.layers:
        conv = isinstance(model.get_submodule(layer), nn.Conv2d)
        assert isinstance(reference.get_submodule(layer), MultiBranchConv2d if conv else MultiBranchLinear)
    merged = layout.merge(branches, alpha)  # Eq. 1
    assert {n: t.shape for n, t in merged.items()} == {n: t.shape for n, t in base.items()}  # the base model's cost
    with torch.no_grad():
        assert torch.allclose(functional_call(model, merged, (x,)), reference(x), atol=1e-5, rtol=1e-5)
    # the merge is alpha-linear: a one-hot alpha picks that branch exactly
    one_hot = torch.zeros(layout.alpha_rows, 3)
    one_hot[:, 2] = 1
    picked = layout.merge(branches, one_hot)
    assert all(torch.equal(picked[n], branches[n][2]) for n in layout.branched_names)


@pytest.mark.parametrize("init", ["centred", "independent"])
def test_branches_differ_are_seeded_and_start_from_the_base_model(init):
    model, base = lenet()
    layout = BranchLayout.of(model, 4)
    a, b, other = (layout.branch(model, base, seed=s, init=init) for s in (3, 3, 4))
    assert layout.layers == ("features.0", "features.3", "body.0", "body.2", "head")
    start = layout.merge(a, layout.uniform_alpha())
    for n in layout.branched_names:
        assert a[n].shape == (4, *base[n].shape) and torch.equal(a[n], b[n]) and not torch.equal(a[n][1], other[n][1])
        assert all(not torch.equal(a[n][i], a[n][j]) for i in range(4) for j in range(i))
        spread = (a[n][1] - a[n][2]).std() / base[n].std()  # like two independent initialisations: ~sqrt(2)
        assert 0.8 < spread < 2
        if init == "centred":  # the uniform-alpha merge is the base model, at its own scale
            assert torch.allclose(start[n], base[n], atol=1e-6)
        else:
            assert torch.equal(a[n][0], base[n]) and start[n].std() < 0.75 * base[n].std()
    one = BranchLayout.of(model, 1).branch(model, base, seed=3, init=init)
    assert all(torch.equal(one[n][0], base[n]) for n in base)  # B = 1: the base model exactly
    with pytest.raises(ConfigError, match="match no layer"):
        BranchLayout.of(model, 2, ("nope",))


def test_projection_onto_the_simplex():
    v = torch.tensor([[0.5, 0.5, 0.5], [2.0, 0.0, 0.0], [0.6, 0.5, -1.0], [0.2, 0.3, 0.5]])
    expected = torch.tensor([[1 / 3, 1 / 3, 1 / 3], [1.0, 0.0, 0.0], [0.55, 0.45, 0.0], [0.2, 0.3, 0.5]])
    assert torch.allclose(project_onto_simplex(v), expected, atol=1e-6)
    w = torch.randn(200, 5, generator=torch.Generator().manual_seed(0)) * 3
    p = project_onto_simplex(w)
    assert (p >= 0).all() and torch.allclose(p.sum(-1), torch.ones(200), atol=1e-6)
    # it is the nearest simplex point: no random simplex point is closer
    others = random_simplex(1000, 5, seed=1)
    assert ((w[:, None] - others[None]).norm(dim=-1) >= (w - p).norm(dim=-1, keepdim=True) - 1e-6).all()


def client_ctx(algo, n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)
    empty = Split(x[:0], y[:0])
    phase = algo.phases(algo.params, 3)[0]
    return ClientContext(0, 1, phase, ClientData(0, Split(x, y), empty, empty, False))


def train(algo, ctx, slots, stages, lr=0.05):
    return train_client(algo, ctx, slots, stages, batch_size=16, lr=lr, optimizer="sgd", momentum=0.9,
                        weight_decay=1e-4, generator=torch.Generator().manual_seed(1))[0]


@pytest.mark.parametrize("simplex", ["projection", "softmax"])
@pytest.mark.parametrize("scope", ["per_layer", "shared"])
def test_alpha_stays_on_the_simplex_and_each_stage_trains_only_its_part(simplex, scope):
    model, base = lenet()
    algo = PFedMB(PFedMBParams(num_branches=4, simplex=simplex, alpha_scope=scope, lr_alpha=2.0), model, seed=0)
    ctx = client_ctx(algo)
    slots = algo.client_params(ctx, base, None)
    start = algo.alpha_of(slots["alpha"])
    assert torch.allclose(start, torch.full((1 if scope == "shared" else 5, 4), 0.25))  # initialised equal
    fit_alpha, fit_weights = algo.stages(ctx, local_epochs=1)
    after_alpha = train(algo, ctx, slots, [fit_alpha])  # Eq. 3: W fixed
    alpha = algo.alpha_of(after_alpha["alpha"])
    assert (alpha >= 0).all() and torch.allclose(alpha.sum(-1), torch.ones(len(alpha)), atol=1e-6)
    assert not torch.allclose(alpha, start, atol=1e-3)
    assert all(torch.equal(after_alpha["branches"][n], slots["branches"][n]) for n in base)
    after_weights = train(algo, ctx, after_alpha, [fit_weights])  # Eq. 4: alpha fixed
    assert all(torch.equal(after_weights["alpha"][k], after_alpha["alpha"][k]) for k in after_alpha["alpha"])
    assert any(not torch.equal(after_weights["branches"][n], after_alpha["branches"][n]) for n in base)
    # one full round: alpha, then W (Algorithm 1, lines 19-20); alpha ends on the simplex
    both = train(algo, ctx, slots, algo.stages(ctx, 1))
    alpha = algo.alpha_of(both["alpha"])
    assert (alpha >= 0).all() and torch.allclose(alpha.sum(-1), torch.ones(len(alpha)), atol=1e-6)
    upload, kept = algo.client_result(ctx, both, None)
    assert torch.equal(upload[ALPHA], alpha) and set(kept) == set(both["alpha"])


def uploads_for(layout, model, base, alphas, sizes):
    out = []
    for i, (a, n) in enumerate(zip(alphas, sizes)):
        branches = layout.branch(model, base, seed=10 + i)  # a different model per client
        out.append(Upload(i, n, {**branches, ALPHA: a}))
    return out


def test_eq5_is_the_hand_computation_and_eq6_when_every_alpha_is_equal():
    torch.manual_seed(0)
    model = TwoNN((1, 4, 4), 3, hidden=5)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    layout = BranchLayout.of(model, 2, ("body.1", "head"))  # body.3 stays shared
    previous = layout.branch(model, base, seed=0)
    alphas = [torch.tensor([[0.9, 0.1], [0.3, 0.7]]), torch.tensor([[0.2, 0.8], [0.5, 0.5]]), torch.tensor([[0.6, 0.4], [1.0, 0.0]])]
    sizes = [10, 30, 20]
    ups = uploads_for(layout, model, base, alphas, sizes)
    got = alpha_weighted_average(ups, layout, previous)
    for layer, row in (("body.1", 0), ("head", 1)):
        for n in layout.tensors[layer]:
            for b in range(2):
                num = sum(s * a[row, b].double() * u.tensors[n][b].double() for s, a, u in zip(sizes, alphas, ups))
                den = sum(s * a[row, b].double() for s, a in zip(sizes, alphas))
                assert torch.allclose(got[n][b].double(), num / den, atol=1e-6), (n, b)  # Eq. 5
    for n in ("body.3.weight", "body.3.bias"):  # unbranched: FedAvg
        expected = sum(s * u.tensors[n].double() for s, u in zip(sizes, ups)) / sum(sizes)
        assert got[n].shape == base[n].shape and torch.allclose(got[n].double(), expected, atol=1e-6)

    equal = [torch.full((2, 2), 0.5)] * 3
    ups = uploads_for(layout, model, base, equal, sizes)
    eq5, eq6 = alpha_weighted_average(ups, layout, previous), alpha_weighted_average(ups, layout, previous, use_alpha=False)
    for n in eq6:
        assert torch.allclose(eq5[n], eq6[n], rtol=1e-6, atol=0)
        if n in layout.branched_names:
            expected = sum(s * u.tensors[n].double() for s, u in zip(sizes, ups)) / sum(sizes)
            assert torch.allclose(eq6[n].double(), expected, atol=1e-6)  # Eq. 6

    # a branch no participant weighted keeps its previous global value
    ups = uploads_for(layout, model, base, [torch.tensor([[1.0, 0.0], [0.5, 0.5]])] * 3, sizes)
    kept = alpha_weighted_average(ups, layout, previous)
    assert all(torch.equal(kept[n][1], previous[n][1]) for n in layout.tensors["body.1"])


FAST = ["train.rounds=2", "partition.num_clients=4", "eval.every=0", "run.threads=1"]


def rounds_of(run, tmp):
    return [json.loads(line) for ph in run.phases() for line in (tmp / "test" / "report" / f"rounds-{ph.name}.jsonl").read_text().splitlines()]


def test_with_one_branch_pfedmb_is_fedavg_followed_by_fine_tuning(tmp_path):
    runs = {
        name: small_run(tmp_path / name, f"method.name={name}", "method.finetune_epochs=2", *FAST, *extra)
        for name, extra in (("fedavg_ft", []), ("pfedmb", ["method.num_branches=1"]))
    }
    states = {name: train_all(run) for name, run in runs.items()}
    fedavg, pfedmb = states["fedavg_ft"], states["pfedmb"]
    g = pfedmb.server.global_params
    assert g.keys() == fedavg.server.global_params.keys()
    assert all(torch.equal(g[n][0], fedavg.server.global_params[n]) for n in g)  # the one branch is FedAvg's model
    for cid, kept in fedavg.clients.items():
        tuned = {k: v for k, v in pfedmb.clients[cid].items() if k.startswith("finetuned/")}
        assert tuned.keys() == kept.keys() and all(torch.equal(tuned[k], kept[k]) for k in kept)
    # traffic: the same model, plus each client's alpha (1 x B floats) in every upload
    up = {name: sum(r["bytes_uploaded"] for r in rounds_of(run, tmp_path / name)) for name, run in runs.items()}
    assert up["pfedmb"] == up["fedavg_ft"] + 2 * 4 * 3 * 1 * 4  # rounds x clients x (3 layers x 1 branch) x float32


def test_end_to_end_run_counts_b_times_the_traffic_and_draws_the_alpha_heatmap(tmp_path):
    run = small_run(tmp_path, "method.name=pfedmb", "method.num_branches=3", "method.alpha_scope=shared",
                    "method.finetune_epochs=1", *FAST)
    summary = run.run_all()
    report = tmp_path / "test" / "report"
    assert (report / "alpha_heatmap.png").stat().st_size > 0
    assert "alpha_heatmap.png" in (report / "report.md").read_text()
    assert [p.name for p in run.phases()] == ["federation", "finetune"]
    assert 0 <= summary["personalized_accuracy"]["mean"] <= 1 and 0 <= summary["global_model"]["top1"] <= 1
    rows = rounds_of(run, tmp_path)
    fed = [r for r in rows if r["phase"] == "federation"]
    params = sum(p.numel() for p in TwoNN((1, 28, 28), 10).parameters())  # P of FedAvg's MLP
    for r in fed:  # every client sends B x P floats plus its alpha (1 x B), and receives B x P
        assert r["bytes_uploaded"] == 4 * (3 * params * 4 + 3 * 4)
        assert r["bytes_downloaded"] == 4 * (3 * params * 4)
        alphas = torch.tensor(list(r["details"]["alpha"].values()))
        assert alphas.shape == (4, 1, 3) and (alphas >= 0).all() and torch.allclose(alphas.sum(-1), torch.ones(4, 1), atol=1e-3)
    assert fed[-1]["details"]["alpha_rows"] == ["all layers"]


def test_params_are_documented_and_comma_separated_layers_parse():
    cfg = load_config(None, ["method.name=pfedmb", "method.branched_layers=features, head"])
    assert cfg.method.branched_layers == ("features", "head")
    assert load_config(None, ["method.name=pfedmb"]).method.finetune_epochs == 5  # the paper's E
    assert all(f.description for name, f in PFedMBParams.model_fields.items() if name != "name")


EXAMPLES = Path(__file__).parent.parent / "examples"


def test_examples_are_the_papers_settings_and_the_pairs_split_makes_five_pairs():
    table2 = sorted(EXAMPLES.glob("pfedmb_cifar*.yaml"))
    assert len(table2) == 6
    for path in [*table2, EXAMPLES / "pfedmb_pairs_mnist5k.yaml"]:
        cfg = load_config(path)
        assert (cfg.model.name, cfg.train.local_epochs, cfg.train.batch_size, cfg.method.finetune_epochs) == ("lenet5", 5, 64, 5), path.name
    cfg = load_config(EXAMPLES / "pfedmb_pairs_mnist5k.yaml")
    assert (cfg.method.num_branches, cfg.method.alpha_scope) == (5, "shared")
    bundle = load_dataset(cfg.data)
    counts = make_partition(bundle, cfg.partition, cfg.run.seed).label_counts(bundle.train.y)
    classes = [frozenset(np.flatnonzero(row).tolist()) for row in counts]
    assert all(len(c) == 2 for c in classes)
    assert [classes[2 * j] for j in range(5)] == [classes[2 * j + 1] for j in range(5)]  # clients 2j, 2j+1 pair up
    assert len(set(classes)) == 5 and len(frozenset().union(*classes)) == 10  # five disjoint pairs


@pytest.mark.parametrize("simplex", ["projection", "softmax"])
def test_alpha_stage_is_eq3_plain_gradient_step_by_default(simplex):
    """Eq. 3: alpha <- alpha - eta_alpha grad f_i((W, alpha)), W fixed, then the projection: no momentum and no
    weight decay, even when the run's optimiser has both (they drive the weight stage only); the earlier
    behaviour, the run's optimiser on alpha too, is `alpha_step: optimizer`."""
    model, base = lenet()
    algo = PFedMB(PFedMBParams(num_branches=3, simplex=simplex, lr_alpha=0.5), model, seed=0)
    assert algo.params.alpha_step == "plain"
    ctx = client_ctx(algo)
    slots = algo.client_params(ctx, base, None)
    fit_alpha = algo.stages(ctx, local_epochs=2)[0]  # 2 epochs of one full batch: two steps
    got = algo.alpha_of(train_client(algo, ctx, slots, [fit_alpha], batch_size=32, lr=0.01, optimizer="sgd", momentum=0.9,
                                     weight_decay=0.1, generator=torch.Generator().manual_seed(1))[0]["alpha"])
    key = next(iter(slots["alpha"]))
    a = slots["alpha"][key].clone()
    x, y = ctx.data.train.x, ctx.data.train.y
    for _ in range(2):  # by hand
        a.requires_grad_(True)
        (g,) = torch.autograd.grad(algo.loss({"branches": slots["branches"], "alpha": {key: a}}, x, y, None), a)
        a = a.detach() - 0.5 * g
        if simplex == "projection":
            a = project_onto_simplex(a)
    assert torch.allclose(got, algo.alpha_of({key: a}), atol=1e-6)
    with_optimizer = PFedMB(PFedMBParams(num_branches=3, simplex=simplex, lr_alpha=0.5, alpha_step="optimizer"), model, seed=0)
    other = with_optimizer.alpha_of(train_client(with_optimizer, ctx, slots, [with_optimizer.stages(ctx, 2)[0]], batch_size=32, lr=0.01,
                                                 optimizer="sgd", momentum=0.9, weight_decay=0.1,
                                                 generator=torch.Generator().manual_seed(1))[0]["alpha"])
    assert not torch.allclose(other, got, atol=1e-4)  # momentum and weight decay change the step
