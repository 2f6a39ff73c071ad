"""FedMN: the module pool and its paths, the router, the per-epoch decisions and their straight-through
gradient, the temperature schedule, selective upload and aggregation, the bytes counted, the clusters."""

import json

import pytest
import torch
from kfp_backend import flat_tasks
from runs import small_run

from fedpipe.algorithms import ALGORITHMS
from fedpipe.algorithms.base import ClientContext, ServerState, Upload
from fedpipe.algorithms.fedmn import DECISION, UPLOADED, FedMN, FedMNParams, temperature
from fedpipe.data.federated import ClientData, Split
from fedpipe.engine.clients import payload_bytes
from fedpipe.engine.sequential import train_client
from fedpipe.errors import ConfigError
from fedpipe.nn.modular import PathLayout
from fedpipe.nn.networks import build_model
from fedpipe.run.config import load_config
from fedpipe.seeding import torch_generator


def make(model="lenet5", **kw) -> FedMN:
    kw.setdefault("hidden", (32, 16))
    return FedMN(FedMNParams(**kw), build_model(model, (1, 28, 28), 10), seed=5)


def client_data(n=40, seed=0, cid=0) -> ClientData:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)
    return ClientData(cid, Split(x, y), Split(x[:0], y[:0]), Split(x[:8], y[:8]), False)


def context(algo: FedMN, round_=1, rounds=10, cid=0, data=None) -> ClientContext:
    return ClientContext(cid, round_, FedMN.phases(algo.params, rounds)[0], data or client_data(cid=cid))


def unit_bytes(algo: FedMN, unit: str) -> int:
    return sum(algo.initial[n].numel() * algo.initial[n].element_size() for n in algo.unit_tensors[unit])


class Recording(FedMN):
    """FedMN that records every batch's path variables and the noise they came from."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (noise, v, relaxed sample)

    def path_variables(self, slots, noise):
        v = super().path_variables(slots, noise)
        with torch.no_grad():
            logits = self.router_logits(slots["router"], slots["data"]["x"], slots["data"]["y"])
            soft = torch.sigmoid((logits + noise[:-1]) / noise[-1])
        self.seen.append((noise, v.detach().clone(), soft))
        return v


def local_round(algo: FedMN, epochs=3, round_=1, weight_decay=5e-4):
    ctx = context(algo, round_=round_)
    slots = algo.client_params(ctx, algo.initial, None)
    slots, _ = train_client(algo, ctx, slots, algo.stages(ctx, epochs), batch_size=10, lr=0.05, optimizer="sgd",
                            momentum=0.9, weight_decay=weight_decay, generator=torch_generator(0, "client", round_, 0))
    return ctx, slots


# --- the module pool and its paths ------------------------------------------------------------------
def test_paths_are_every_link_between_successive_layers_and_to_the_output():
    assert PathLayout((2, 2, 2)).num_paths == 2 * 2 + 2 * 2 + 2
    lay = PathLayout((3, 4, 2))
    assert lay.num_paths == 3 * 4 + 4 * 2 + 2
    v = torch.arange(lay.num_paths)
    assert lay.links(v, 0).shape == (3, 4) and lay.links(v, 1).shape == (4, 2)
    assert lay.links(v, 0)[1, 2] == 1 * 4 + 2 and lay.links(v, 1)[3, 1] == 12 + 3 * 2 + 1
    assert lay.output_links(v).tolist() == [20, 21]
    assert lay.unit_names() == ["L1.0", "L1.1", "L1.2", "L2.0", "L2.1", "L2.2", "L2.3", "L3.0", "L3.1"]


def test_units_are_distinct_modules_with_their_own_weights():
    algo = make()
    net = algo.model["net"]
    modules = [u for layer in net.units for u in layer]
    assert len({id(m) for m in modules}) == len(modules) == 6
    tensors = [t for u in modules for t in u.parameters()]
    assert len({t.data_ptr() for t in tensors}) == len(tensors)  # no storage shared
    for layer in net.units:  # same shapes, different initial weights
        a, b = (torch.cat([p.flatten() for p in u.parameters()]) for u in layer)
        assert a.shape == b.shape and not torch.equal(a, b)
    # encoders: copies of LeNet-5's conv features (6 and 16 maps of 5x5), then a linear layer to hidden[0]
    shapes = [tuple(p.shape) for p in net.units[0][0].parameters()]
    assert shapes[:4] == [(6, 1, 5, 5), (6,), (16, 6, 5, 5), (16,)] and shapes[4] == (32, 256)
    # the pool does not depend on the configured model's own initial weights, only on the seed
    assert all(torch.equal(t, make().initial[n]) for n, t in algo.initial.items())


def test_encoders_follow_the_model_and_a_model_without_features_needs_mlp_encoders():
    assert make(model="twonn").encoder == "mlp"  # auto
    with pytest.raises(ConfigError, match="method.encoder=mlp"):
        make(model="twonn", encoder="cnn")
    algo = make(model="twonn", encoder="mlp")
    out = algo.network({n: t for n, t in algo.initial.items() if n.startswith("net.")}, torch.randn(3, 1, 28, 28),
                       torch.ones(algo.layout.num_paths))
    assert out.shape == (3, 10)


def test_incoming_links_are_averaged_over_the_active_ones():
    algo = make()
    units = {n: t for n, t in algo.initial.items() if n.startswith("net.")}
    x = torch.randn(5, 1, 28, 28)
    # links: L1->L2 [e0->u0, e0->u1, e1->u0, e1->u1], L2->L3 [u0->o0, u0->o1, u1->o0, u1->o1], out [o0, o1]
    through = {
        "o0": torch.tensor([1, 0, 0, 0, 1, 0, 0, 0, 1, 0.0]),
        "o1": torch.tensor([1, 0, 0, 0, 0, 1, 0, 0, 0, 1.0]),
        "both": torch.tensor([1, 0, 0, 0, 1, 1, 0, 0, 1, 1.0]),
    }
    out = {k: algo.network(units, x, v) for k, v in through.items()}
    assert torch.allclose(out["both"], (out["o0"] + out["o1"]) / 2, atol=1e-6)
    # two encoders into one unit: the unit sees the mean of their embeddings
    e0, e1 = (algo.model["net"].units[0][i](x) for i in range(2))
    two = torch.tensor([1, 0, 1, 0, 1, 0, 0, 0, 1, 0.0])
    expected = algo.model["net"].units[2][0](algo.model["net"].units[1][0]((e0 + e1) / 2))
    assert torch.allclose(algo.network(units, x, two), expected, atol=1e-5)


def test_a_unit_off_the_active_paths_neither_changes_the_output_nor_gets_a_gradient():
    algo = make()
    units = {n: t.clone().requires_grad_() for n, t in algo.initial.items() if n.startswith("net.")}
    x, y = torch.randn(6, 1, 28, 28), torch.randint(0, 10, (6,))
    # e0 -> u0 -> o0 -> out is a path; e1 -> u1 is on but u1 leads nowhere
    hard = torch.tensor([1, 0, 0, 1, 1, 0, 0, 0, 1, 0.0])
    assert algo.layout.used_units(hard) == [[True, False], [True, False], [True, False]]
    v = hard + torch.zeros_like(hard, requires_grad=True)  # a decision that carries gradient (as in training)
    torch.nn.functional.cross_entropy(algo.network(units, x, v), y).backward()
    for unit, names in algo.unit_tensors.items():
        used = unit in ("L1.0", "L2.0", "L3.0")
        assert all((units[n].grad is not None) == used for n in names), unit
    with torch.no_grad():
        before = algo.network(units, x, hard)
        for n in algo.unit_tensors["L1.1"] + algo.unit_tensors["L2.1"] + algo.unit_tensors["L3.1"]:
            units[n].add_(1.0)
        assert torch.equal(algo.network(units, x, hard), before)


def test_a_decision_without_a_complete_path_gets_its_best_path():
    lay = PathLayout((2, 2, 2))
    scores = torch.tensor([-1, -2, -3, -0.5, -4, -1, -0.1, -2, -0.2, -3])
    on = lay.decide(scores)
    assert lay.has_complete_path(on)
    # best: e0 -> u0 (-1) -> o0 (-4) = -5.2 ... e1 -> u1 (-0.5) -> o0 (-0.1) -> out (-0.2) = -0.8
    assert on.tolist() == [0, 0, 0, 1, 0, 0, 1, 0, 1, 0]
    ok = torch.tensor([1, -1, -1, -1, 1, -1, -1, -1, 1, -1.0])
    assert lay.decide(ok).tolist() == (ok > 0).float().tolist()  # a network already: untouched


# --- the router ---------------------------------------------------------------------------------------
def test_router_input_averages_per_sample_embeddings_of_x_and_y_over_the_clients_data():
    router = make().model["router"]
    data = client_data(n=12)
    x, y = data.train.x, data.train.y
    with torch.no_grad():
        summary = router.summary(x, y)
        per_sample = torch.stack([router.summary(x[i : i + 1], y[i : i + 1]) for i in range(len(y))])
        assert torch.allclose(summary, per_sample.mean(0), atol=1e-6)
        assert torch.allclose(per_sample.norm(dim=1), torch.ones(len(y)), atol=1e-5)  # each sample normalised
        perm = torch.randperm(len(y))
        assert torch.allclose(router.summary(x[perm], y[perm]), summary, atol=1e-6)  # a set function
        assert torch.allclose(router.summary(torch.cat([x, x]), torch.cat([y, y])), summary, atol=1e-6)
        assert not torch.allclose(router.summary(x, (y + 1) % 10), summary)  # the labels enter
        assert not torch.allclose(router.summary(-x, y), summary)  # and so do the images
        assert router(x, y).shape == (make().layout.num_paths,)


def test_the_routers_input_is_the_clients_whole_training_set():
    algo = make()
    ctx = context(algo, data=client_data(n=33))
    slots = algo.client_params(ctx, algo.initial, None)
    assert slots["data"]["x"] is ctx.data.train.x and slots["data"]["y"] is ctx.data.train.y
    router = {n: algo.initial[n] for n in algo.router_tensors}
    assert torch.allclose(slots["start"]["logits"], algo.router_logits(router, ctx.data.train.x, ctx.data.train.y))


# --- decisions, relaxation, temperature ---------------------------------------------------------------
def test_gradients_reach_every_router_parameter_from_the_task_loss():
    for straight_through in (True, False):
        algo = make(straight_through=straight_through)
        ctx = context(algo)
        slots = algo.client_params(ctx, algo.initial, None)
        slots = {k: ({n: t.clone().requires_grad_() for n, t in s.items()} if k in ("units", "router") else s) for k, s in slots.items()}
        noise = algo.batch_noise(ctx, None, torch.Generator().manual_seed(1))
        algo.loss(slots, ctx.data.train.x[:10], ctx.data.train.y[:10], noise).backward()
        for name, t in slots["router"].items():  # image CNN, label embedding, output layer
            assert t.grad is not None and t.grad.abs().sum() > 0, (straight_through, name)


def test_straight_through_gives_hard_decisions_forward_and_gradients_backward():
    algo = make()
    ctx = context(algo)
    slots = algo.client_params(ctx, algo.initial, None)
    router = {n: t.clone().requires_grad_() for n, t in slots["router"].items()}
    noise = algo.batch_noise(ctx, None, torch.Generator().manual_seed(2))
    v = algo.path_variables({**slots, "router": router}, noise)
    hard = algo.layout.decide(slots["start"]["logits"] + noise[:-1])
    assert torch.equal(v.detach(), hard) and set(v.detach().tolist()) <= {0.0, 1.0}  # exactly hard
    weights = torch.linspace(-1, 1, len(v))
    (v * weights).sum().backward()
    logits = algo.router_logits(slots["router"], slots["data"]["x"], slots["data"]["y"]).detach()
    soft = torch.sigmoid((logits + noise[:-1]) / noise[-1])
    head = router["router.head.bias"].grad  # dL/dlogit_e = w_e * sigmoid' / tau: the relaxed sample's gradient
    assert torch.allclose(head, weights * soft * (1 - soft) / noise[-1], atol=1e-6)
    # without straight-through the forward pass is the relaxed sample itself
    soft_algo = make(straight_through=False)
    v_soft = soft_algo.path_variables(soft_algo.client_params(ctx, soft_algo.initial, None), noise)
    assert torch.allclose(v_soft.detach(), soft, atol=1e-6) and ((v_soft > 0) & (v_soft < 1)).all()


def test_decisions_are_bernoulli_with_the_routers_probabilities():
    lay = PathLayout((2, 2, 2))
    logits = torch.tensor([3.0, -3.0, 0.0, 1.0, -1.0, 2.0, 0.5, -0.5, 4.0, 4.0])  # o0 and o1 always on: no repair
    algo = make()
    ctx = context(algo)
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([lay.decide(logits + algo.batch_noise(ctx, None, gen)[:-1]) for _ in range(3000)])
    assert torch.allclose(draws.mean(0), torch.sigmoid(logits), atol=0.03)  # Eq. 3, independent links


def test_the_temperature_anneals_over_the_rounds():
    p = FedMNParams()
    taus = [temperature(p, r, 1, 30) for r in range(1, 31)]
    assert taus[0] == pytest.approx(1.0) and taus[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(taus, taus[1:]))
    assert taus[15] == pytest.approx(0.1 ** (15 / 29))  # geometric
    lin = [temperature(FedMNParams(tau_schedule="linear", tau_start=2.0, tau_end=0.5), r, 1, 4) for r in range(1, 5)]
    assert lin == pytest.approx([2.0, 1.5, 1.0, 0.5])
    assert {temperature(FedMNParams(tau_schedule="constant"), r, 1, 9) for r in range(1, 10)} == {1.0}
    # and it reaches the loss: the per-epoch noise carries the round's tau
    algo = make()
    gen = torch.Generator().manual_seed(0)
    drawn = [float(algo.batch_noise(context(algo, round_=r, rounds=30), None, gen)[-1]) for r in (1, 2, 15, 30)]
    assert drawn == pytest.approx([taus[0], taus[1], taus[14], taus[29]])


def test_the_architecture_is_fixed_for_an_epoch_and_drawn_anew_each_epoch():
    algo = Recording(FedMNParams(hidden=(32, 16), router_lr_scale=50.0), build_model("lenet5", (1, 28, 28), 10), seed=5)
    local_round(algo, epochs=4)
    assert len(algo.seen) == 4 * 4  # 40 samples in batches of 10
    epochs = [algo.seen[i : i + 4] for i in range(0, 16, 4)]
    for epoch in epochs:
        assert all(noise is epoch[0][0] for noise, _, _ in epoch)  # one draw per epoch
        assert all(torch.equal(v, epoch[0][1]) for _, v, _ in epoch)  # one architecture per epoch
        assert not torch.equal(epoch[0][2], epoch[-1][2])  # while the router trains
    assert len({tuple(e[0][0].tolist()) for e in epochs}) == 4  # fresh noise every epoch


# --- upload, bytes, aggregation -----------------------------------------------------------------------
def test_a_client_uploads_the_router_and_exactly_the_units_it_trained():
    algo = Recording(FedMNParams(hidden=(32, 16)), build_model("lenet5", (1, 28, 28), 10), seed=5)
    ctx, slots = local_round(algo, epochs=2)
    used = set()
    for _, v, _ in algo.seen:
        used |= {n for n, u in zip(algo.layout.unit_names(), algo.layout.used_mask(v).tolist()) if u}
    upload, kept = algo.client_result(ctx, slots, None)
    assert set(algo.trained_units(slots)) == used and used != set(algo.unit_tensors)  # this seed leaves a unit out
    for unit, names in algo.unit_tensors.items():  # the others are bitwise the download (momentum, weight decay and all)
        assert all(torch.equal(slots["units"][n], algo.initial[n]) != (unit in used) for n in names), unit
    assert set(upload) == set(algo.router_tensors) | {n for u in used for n in algo.unit_tensors[u]}
    router_bytes = sum(algo.initial[n].numel() * 4 for n in algo.router_tensors)
    assert payload_bytes(upload) == router_bytes + sum(unit_bytes(algo, u) for u in used)
    assert kept[UPLOADED].tolist() == [float(u in used) for u in algo.unit_tensors]
    # its kept decision is its most probable architecture, and its personalized model runs it
    logits = algo.router_logits(slots["router"], ctx.data.train.x, ctx.data.train.y)
    assert torch.equal(kept[DECISION], algo.layout.decide(logits))
    (_, params), = algo.personalized_candidates(ServerState(algo.initial), kept, 0)
    x = ctx.data.test.x
    assert torch.equal(algo.forward(params, x), algo.network(params, x, kept[DECISION]))


def test_aggregation_averages_each_unit_over_its_users_and_the_router_over_all():
    algo = make()
    prev = algo.initial
    names = algo.unit_tensors

    def upload(cid, n, units, value):
        tensors = {t: torch.full_like(prev[t], value) for u in units for t in names[u]}
        tensors.update({t: torch.full_like(prev[t], value) for t in algo.router_tensors})
        return Upload(cid, n, tensors)

    ups = [upload(0, 30, ["L1.0", "L2.0", "L3.0"], 1.0), upload(1, 10, ["L1.0", "L2.1", "L3.0"], 3.0)]
    new = algo.aggregate(FedMN.phases(algo.params, 5)[0], ServerState(prev), ups).global_params
    for t in names["L1.1"] + names["L3.1"]:  # no client used them: unchanged
        assert torch.equal(new[t], prev[t])
    for t in names["L1.0"] + names["L3.0"]:  # both: (30 * 1 + 10 * 3) / 40
        assert torch.allclose(new[t], torch.full_like(prev[t], 1.5))
    assert all(torch.equal(new[t], torch.ones_like(prev[t])) for t in names["L2.0"])  # client 0 alone
    assert all(torch.equal(new[t], torch.full_like(prev[t], 3.0)) for t in names["L2.1"])  # client 1 alone
    assert all(torch.allclose(new[t], torch.full_like(prev[t], 1.5)) for t in algo.router_tensors)
    # no uploads at all: nothing changes
    assert algo.aggregate(FedMN.phases(algo.params, 5)[0], ServerState(new), []).global_params is new
    with pytest.raises(ValueError, match="travels whole"):
        broken = upload(2, 5, ["L1.0"], 0.0)
        broken.tensors.pop(names["L1.0"][0])
        algo.aggregate(FedMN.phases(algo.params, 5)[0], ServerState(prev), [broken, upload(3, 5, ["L1.0"], 0.0)])


def test_clusters_group_clients_with_the_same_architecture():
    algo = make()
    a = torch.tensor([1, 0, 0, 0, 1, 0, 0, 0, 1, 0.0])
    b = torch.tensor([0, 0, 0, 1, 0, 0, 0, 1, 0, 1.0])
    sent = torch.tensor([1, 0, 1, 0, 1, 0.0])
    states = {cid: {DECISION: d, UPLOADED: sent, "round": torch.tensor(float(r))} for cid, d, r in
              [(0, a, 3), (1, b, 3), (2, a, 3), (3, a, 2)]}
    details = algo.round_details(ServerState(algo.initial), states)
    assert details["architecture"]["1"] == "0001|0001|01"
    assert details["clusters"] == [
        {"architecture": "1000|1000|10", "clients": [0, 2, 3], "units": ["L1.0", "L2.0", "L3.0"]},
        {"architecture": "0001|0001|01", "clients": [1], "units": ["L1.1", "L2.1", "L3.1"]},
    ]
    assert details["uploaded_units"] == {c: ["L1.0", "L2.0", "L3.0"] for c in ("0", "1", "2")}  # client 3: not this round
    json.dumps(details)


# --- end to end -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fedmn_run(tmp_path_factory):
    store = tmp_path_factory.mktemp("fedmn")
    # SMALL's MLP has no conv features, so the encoders are MLP units (the CNN encoders are tested above)
    run = small_run(store, "method.name=fedmn", "method.hidden=[32,16]", "train.rounds=2", "partition.num_clients=6",
                    "train.batch_size=32", "method.units=2,2,2")
    return run, run.run_all(), store / "test" / "report"


def test_a_small_run_writes_the_report_with_the_clusters(fedmn_run):
    run, summary, report = fedmn_run
    for name in ("summary.json", "clients.csv", "accuracy.png", "architecture_clusters.png", "report.md"):
        assert (report / name).stat().st_size > 0, name
    assert summary["method"] == "fedmn" and summary["global_model"] is None
    assert 0 <= summary["personalized_accuracy"]["mean"] <= 1 and summary["personalized_accuracy"]["clients"] == 6
    rounds = [json.loads(line) for line in (report / "rounds-federation.jsonl").read_text().splitlines()]
    for r in rounds:
        clusters = r["details"]["clusters"]
        assert sorted(c for cl in clusters for c in cl["clients"]) == list(range(6))
        assert all(r["details"]["architecture"][str(c)] == cl["architecture"] for cl in clusters for c in cl["clients"])


def test_the_bytes_counted_equal_the_sizes_of_the_tensors_sent(fedmn_run):
    run, _, report = fedmn_run
    algo, _ = run.build_algorithm()
    router = sum(algo.initial[n].numel() * algo.initial[n].element_size() for n in algo.router_tensors)
    pool = sum(t.numel() * t.element_size() for t in algo.initial.values())
    rounds = [json.loads(line) for line in (report / "rounds-federation.jsonl").read_text().splitlines()]
    for r in rounds:
        sent = r["details"]["uploaded_units"]
        assert sorted(sent, key=int) == [str(c) for c in range(6)]
        assert r["bytes_uploaded"] == sum(router + sum(unit_bytes(algo, u) for u in units) for units in sent.values())
        assert r["bytes_downloaded"] == 6 * pool  # the whole pool goes down
    assert sum(r["bytes_uploaded"] for r in rounds) < 2 * 6 * pool  # and less than all of it comes back


def test_fedmn_is_registered_and_its_pipeline_comes_from_the_phase_list(tmp_path):
    import yaml

    from fedpipe.pipelines.builder import compile_pipeline, method_pipeline

    assert ALGORITHMS["fedmn"] is FedMN
    cfg = load_config(None, ["method.name=fedmn", "method.units=3,2", "method.hidden=64"])
    assert cfg.method.units == (3, 2) and cfg.method.hidden == (64,)
    with pytest.raises(ConfigError, match="hidden"):
        load_config(None, ["method.name=fedmn", "method.units=[2,2,2]", "method.hidden=[64]"])
    spec = next(yaml.safe_load_all(compile_pipeline(method_pipeline(load_config(None, ["method.name=fedmn"])), tmp_path / "p.yaml").read_text()))
    tasks = flat_tasks(spec).values()
    training = [t["inputs"]["parameters"]["phase"]["runtimeValue"]["constant"] for t in tasks
                if t["componentRef"]["name"].startswith("comp-train-phase")]
    assert training == ["federation"]
    assert {"method_tau_start", "method_straight_through"} <= set(spec["root"]["inputDefinitions"]["parameters"])
