"""The Table II baselines (FedPer, pFedMe, IFCA, FedFomo, FedAMP, Ditto): each update rule against a
hand computation on tiny tensors, the reductions the papers imply (bitwise on the CPU with the same
seed), and one end-to-end run per method with its communication counted."""

import json
import math

import pytest
import torch
from runs import CrashAfterRound, assert_same_params, small_run, train_all
from torch import nn

from fedpipe.algorithms.base import ServerState, Upload
from fedpipe.algorithms.ditto import Ditto, DittoParams
from fedpipe.algorithms.fedamp import FedAMP, FedAMPParams
from fedpipe.algorithms.fedfomo import IDS, WEIGHTS, FedFomo, FedFomoParams, fomo_update
from fedpipe.algorithms.fedper import FedPer, FedPerParams
from fedpipe.algorithms.ifca import IFCA, IFCAParams
from fedpipe.algorithms.pfedme import PFedMe, PFedMeParams
from fedpipe.errors import ConfigError
from fedpipe.run.config import load_config
from fedpipe.run.run import Run


class Head(nn.Module):
    """logits = W x, W of shape (classes, inputs): small enough to differentiate by hand."""

    def __init__(self, inputs=1, classes=2):
        super().__init__()
        self.head = nn.Linear(inputs, classes, bias=False)

    def forward(self, x):
        return self.head(x)


class BodyHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(2, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def ce_grad(w, x, y):
    """Hand gradient of the cross-entropy of logits (w0 x, w1 x) for one sample: (softmax - onehot) * x."""
    z0, z1 = w[0] * x, w[1] * x
    p0 = math.exp(z0) / (math.exp(z0) + math.exp(z1))
    p = [p0, 1 - p0]
    return [(p[c] - (1.0 if c == y else 0.0)) * x for c in range(2)], -math.log(p[y])


def col(values):
    return torch.tensor(values, dtype=torch.float64).reshape(2, 1)


# --- pFedMe ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("warm_start", [True, False])
def test_pfedme_inner_steps_and_local_update_equal_hand_computation(warm_start):
    lam, p, eta, k = 2.0, 0.1, 0.3, 2
    algo = PFedMe(PFedMeParams(lam=lam, personal_lr=p, inner_steps=k, warm_start=warm_start), Head().double(), seed=0)
    w, theta0, x, y = [0.5, -0.5], [0.2, 0.1], 1.5, 0
    slots = {"local": {"head.weight": col(w)}, "personal": {"head.weight": col(theta0)}}
    loss = algo.update(slots, torch.tensor([[x]], dtype=torch.float64), torch.tensor([y]), None, eta)

    theta = list(theta0 if warm_start else w)
    for _ in range(k):  # theta <- theta - p (grad f(theta) + lam (theta - w))   (the inner problem, K steps)
        g, last_loss = ce_grad(theta, x, y)
        theta = [theta[c] - p * (g[c] + lam * (theta[c] - w[c])) for c in range(2)]
    w_new = [w[c] - eta * lam * (w[c] - theta[c]) for c in range(2)]  # Algorithm 1's local update
    assert slots["personal"]["head.weight"].flatten().tolist() == pytest.approx(theta, abs=1e-12)
    assert slots["local"]["head.weight"].flatten().tolist() == pytest.approx(w_new, abs=1e-12)
    assert float(loss) == pytest.approx(last_loss, abs=1e-12)


@pytest.mark.parametrize(("weighting", "beta"), [("uniform", 0.5), ("samples", 1.0), ("uniform", 2.0)])
def test_pfedme_server_mixes_beta_of_the_mean(weighting, beta):
    algo = PFedMe(PFedMeParams(beta=beta, weighting=weighting), Head(), seed=0)
    server = ServerState({"w": torch.tensor([1.0, 0.0])})
    uploads = [Upload(0, 1, {"w": torch.tensor([3.0, 2.0])}), Upload(1, 3, {"w": torch.tensor([-1.0, 6.0])})]
    mean = [1.0, 4.0] if weighting == "uniform" else [0.0, 5.0]  # (3 - 1)/2, (2 + 6)/2  |  (3 - 3)/4, (2 + 18)/4
    expected = [(1 - beta) * old + beta * m for old, m in zip([1.0, 0.0], mean)]
    assert algo.aggregate(None, server, uploads).global_params["w"].tolist() == pytest.approx(expected)


# --- Ditto ----------------------------------------------------------------------------------------
def test_ditto_personal_gradient_has_the_prox_term_toward_the_downloaded_global():
    lam = 0.7
    algo = Ditto(DittoParams(lam=lam), Head().double(), seed=0)
    v, w, x, y = [0.3, -0.2], [1.0, 0.5], 2.0, 1
    vt = col(v).requires_grad_(True)
    loss = algo.personal_loss({"personal": {"head.weight": vt}, "anchor": {"head.weight": col(w)}}, torch.tensor([[x]], dtype=torch.float64), torch.tensor([y]), None)
    loss.backward()
    g, ce = ce_grad(v, x, y)
    # grad h(v; w^t) = grad F(v) + lam (v - w^t)   (Eq. 2)
    assert vt.grad.flatten().tolist() == pytest.approx([g[c] + lam * (v[c] - w[c]) for c in range(2)], abs=1e-12)
    assert float(loss.detach()) == pytest.approx(ce + lam / 2 * sum((v[c] - w[c]) ** 2 for c in range(2)), abs=1e-12)


def test_ditto_trains_the_global_model_first_then_the_personal_one():
    algo = Ditto(DittoParams(personal_epochs=3, personal_lr_scale=0.5), Head(), seed=0)
    first, second = algo.stages(None, 5)
    assert (first.trainable, first.epochs) == (("global",), 5)
    assert (second.trainable, second.epochs, second.lr_scale) == (("personal",), 3, 0.5)
    assert Ditto(DittoParams(), Head(), seed=0).stages(None, 4)[1].epochs == 4  # default: train.local_epochs


# --- FedAMP ---------------------------------------------------------------------------------------
def test_fedamp_attention_weights_and_cloud_model_equal_hand_computation():
    alpha, sigma = 0.5, 2.0
    algo = FedAMP(FedAMPParams(alpha_k=alpha, sigma=sigma), Head(), seed=0)
    w = {0: [0.0, 0.0], 1: [1.0, 0.0], 2: [0.0, 2.0]}
    server = ServerState({"p": torch.tensor([9.0, 9.0])}, {j: {"p": torch.tensor(v)} for j, v in w.items()})
    # xi_0j = alpha * A'(||w_0 - w_j||^2), A'(x) = exp(-x / sigma) / sigma; xi_00 = 1 - sum   (Eq. 6-7)
    xi01 = alpha * math.exp(-1 / sigma) / sigma
    xi02 = alpha * math.exp(-4 / sigma) / sigma
    xi = algo.xi(server, 0)
    assert xi == pytest.approx({1: xi01, 2: xi02, 0: 1 - xi01 - xi02})
    u0 = algo.download(algo.phases(algo.params, 1)[0], server, 0)["p"]
    assert u0.tolist() == pytest.approx([xi01 * 1.0, xi02 * 2.0], abs=1e-7)
    # a client the server has no model of yet counts with the initial model for itself
    d3 = [81 + 81, 64 + 81, 81 + 49]
    assert algo.xi(server, 3)[0] == pytest.approx(alpha * math.exp(-d3[0] / sigma) / sigma)
    # round 1: nobody has uploaded, u_i is the initial model
    assert algo.cloud_model(ServerState({"p": torch.tensor([9.0, 9.0])}), 0)["p"].tolist() == [9.0, 9.0]


def test_fedamp_capped_step_keeps_the_weights_convex_with_the_papers_attention_profile():
    # alpha_k = sigma = 1 and two close models: Eq. 7 as written gives xi_00 = 1 - e^-1 - e^-0.25 < 0
    algo = FedAMP(FedAMPParams(alpha_k=1.0, sigma=1.0, min_self_weight=0.25), Head(), seed=0)
    server = ServerState({"p": torch.zeros(2)}, {0: {"p": torch.tensor([0.0, 0.0])}, 1: {"p": torch.tensor([1.0, 0.0])},
                                                 2: {"p": torch.tensor([0.0, 0.5])}})
    assert 1 - math.exp(-1) - math.exp(-0.25) < 0
    xi, step = algo.weights(server, 0)
    # alpha_{k,0} = (1 - m) / sum_j A'(d_0j): xi_0j = (1 - m) softmax_j(-d_0j / sigma), xi_00 = m
    total = math.exp(-1) + math.exp(-0.25)
    assert step == pytest.approx(0.75 / total)
    assert xi == pytest.approx({1: 0.75 * math.exp(-1) / total, 2: 0.75 * math.exp(-0.25) / total, 0: 0.25}, abs=1e-12)
    u0 = algo.cloud_model(server, 0)["p"]
    assert u0.tolist() == pytest.approx([xi[1] * 1.0, xi[2] * 0.5], abs=1e-7)
    # a tiny sigma (A'(0) = 1e30, A'(d > 0) = 0) still gives finite convex weights: a copy of w_0 takes all of 1 - m
    server.per_client[3] = {"p": torch.tensor([0.0, 0.0])}
    sharp = FedAMP(FedAMPParams(sigma=1e-30, min_self_weight=0.25), Head(), seed=0).xi(server, 0)
    assert sharp == pytest.approx({1: 0.0, 2: 0.0, 3: 0.75, 0: 0.25}, abs=1e-12)


def test_fedamp_fixed_step_rejects_weights_that_are_not_convex_naming_the_fields():
    server = ServerState({"p": torch.zeros(2)}, {0: {"p": torch.tensor([0.0, 0.0])}, 1: {"p": torch.tensor([1.0, 0.0])},
                                                 2: {"p": torch.tensor([0.0, 0.5])}})
    with pytest.raises(ConfigError, match=r"method\.alpha_k=1\.0 and method\.sigma=1\.0.*method\.min_self_weight=0\.0.*method\.step=capped"):
        FedAMP(FedAMPParams(step="fixed", min_self_weight=0.0), Head(), seed=0).xi(server, 0)
    # Eq. 7 as written where it is convex: alpha_k small enough
    fixed = FedAMP(FedAMPParams(step="fixed", alpha_k=0.4, min_self_weight=0.0), Head(), seed=0)
    assert fixed.xi(server, 0)[0] == pytest.approx(1 - 0.4 * (math.exp(-1) + math.exp(-0.25)))
    with pytest.raises(ConfigError, match="min_self_weight"):
        load_config(None, ["method.name=fedamp", "method.min_self_weight=1"])


def test_fedamp_cloud_weights_of_real_client_models_are_convex(tmp_path):
    """On trained client models (digits, 4 clients) Eq. 7 with alpha_k = sigma = 1 gives xi_ii < 0 (about -1.2
    here; -4.8 to -1.5 with 20 clients): the default capped step must keep every xi_ij >= 0 summing to 1."""
    run = small_run(tmp_path, *QUICK, "method.name=fedamp", "train.rounds=1")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Run, "_put_plot", lambda self, name, draw: None)
        state = train_all(run)
    algo, _ = run.build_algorithm()
    assert sorted(state.server.per_client) == [0, 1, 2, 3]
    for cid, w_i in state.server.per_client.items():
        # the paper's raw weights on these models: alpha_k * sum_j A'(d_ij) > 1, so 1 - sum < 0
        raw = sum(math.exp(-float(sum(((w_i[n].double() - w_j[n].double()) ** 2).sum() for n in w_i)))
                  for j, w_j in state.server.per_client.items() if j != cid)
        assert raw > 1, raw
        xi = algo.xi(state.server, cid)
        assert sorted(xi) == [0, 1, 2, 3]
        assert all(v >= 0 for v in xi.values()), xi
        assert sum(xi.values()) == pytest.approx(1.0, abs=1e-12) and xi[cid] >= 0.5 - 1e-12
    details = algo.round_details(state.server, state.clients)  # what the round's JSONL line records
    assert all(v >= 0.5 - 1e-6 for v in details["self_weight"].values()) and all(a < 1 for a in details["alpha_k"].values())


def test_fedamp_client_loss_is_the_proximal_step_toward_the_cloud_model():
    lam, alpha = 3.0, 0.5
    algo = FedAMP(FedAMPParams(lam=lam, alpha_k=alpha), Head().double(), seed=0)
    w, u, x, y = [0.3, -0.2], [1.0, 0.5], 2.0, 1
    loss = algo.loss({"model": {"head.weight": col(w)}, "cloud": {"head.weight": col(u)}}, torch.tensor([[x]], dtype=torch.float64), torch.tensor([y]), None)
    _, ce = ce_grad(w, x, y)
    # F_i(w) + lambda / (2 alpha_k) ||w - u_i||^2   (the client's proximal step)
    assert float(loss) == pytest.approx(ce + lam / (2 * alpha) * sum((w[c] - u[c]) ** 2 for c in range(2)), abs=1e-12)
    slots = algo.client_params(None, {"head.weight": col(u)}, {"head.weight": col(w)})
    assert slots["model"]["head.weight"] is slots["cloud"]["head.weight"]  # starts from u_i by default
    own = FedAMP(FedAMPParams(start_from="own"), Head().double(), seed=0)
    assert own.client_params(None, {"head.weight": col(u)}, {"head.weight": col(w)})["model"]["head.weight"].flatten().tolist() == w


# --- FedFomo --------------------------------------------------------------------------------------
def vec(*v):
    return {"p": torch.tensor(v)}


def test_fedfomo_weights_and_update_equal_hand_computation():
    algo = FedFomo(FedFomoParams(), Head(), seed=0)
    own, a, b, c, d = vec(0.0, 0.0), vec(3.0, 4.0), vec(0.0, 1.0), vec(0.0, 0.0), vec(1.0, 0.0)
    losses = {id(own): 1.0, id(a): 0.5, id(b): 1.2, id(c): 0.9, id(d): 0.8}
    algo.validation_loss = lambda params, x, y: losses[id(params)]
    # w_n = (L(theta_i) - L(theta_n)) / ||theta_n - theta_i||   (Eq. 5); a model equal to theta_i weighs 0
    weights = algo.fomo_weights(own, [a, b, c, d], None, None)
    assert weights == pytest.approx([0.5 / 5, -0.2 / 1, 0.0, 0.2 / 1])
    # theta_i + sum_n max(w_n, 0) / sum max(w, 0) (theta_n - theta_i)   (Eq. 6): 1/3 of a, 2/3 of d
    assert fomo_update(own, [a, b, c, d], weights)["p"].tolist() == pytest.approx([1 + 2 / 3, 4 / 3])
    assert fomo_update(own, [b], [-0.2])["p"] is own["p"]  # nothing helps: theta_i stays
    l1 = FedFomo(FedFomoParams(distance="l1"), Head(), seed=0)
    l1.validation_loss = algo.validation_loss
    assert l1.fomo_weights(own, [a], None, None) == pytest.approx([0.5 / 7])


def test_fedfomo_validation_loss_is_the_mean_cross_entropy():
    algo = FedFomo(FedFomoParams(), Head(), seed=0)
    params = {"head.weight": torch.tensor([[1.0], [-1.0]])}
    x, y = torch.tensor([[1.0], [2.0]]), torch.tensor([0, 1])
    expected = (ce_grad([1.0, -1.0], 1.0, 0)[1] + ce_grad([1.0, -1.0], 2.0, 1)[1]) / 2
    assert algo.validation_loss(params, x, y) == pytest.approx(expected, abs=1e-6)


def test_fedfomo_server_keeps_models_adds_weights_to_affinities_and_downloads_greedily():
    algo = FedFomo(FedFomoParams(models_per_round=2, epsilon=0.0), Head(), seed=0)
    phase = algo.phases(algo.params, 3)[0]
    server = ServerState({"p": torch.zeros(2)})
    assert algo.download(phase, server, 0) == {}  # round 1: nobody has uploaded yet
    up = lambda cid, ids, w: Upload(cid, 10, {"p": torch.full((2,), float(cid)), IDS: torch.tensor(ids), WEIGHTS: torch.tensor(w)})  # noqa: E731
    server = algo.aggregate(phase, server, [up(0, [], []), up(1, [], []), up(2, [], []), up(3, [], [])])
    server = algo.aggregate(phase, server, [up(0, [1, 2, 3], [0.5, -0.25, 0.75])])
    server = algo.aggregate(phase, server, [up(0, [2, 1], [1.0, -0.25])])
    # P_0 = (0, 0.5 - 0.25, -0.25 + 1.0, 0.75)   (Algorithm 1: P_{i,n} += w_n)
    assert server.per_client[0]["fedfomo/affinity"].tolist() == pytest.approx([0.0, 0.25, 0.75, 0.75])
    assert server.per_client[0]["p"].tolist() == [0.0, 0.0] and int(server.per_client[0]["fedfomo/participations"]) == 3
    # epsilon = 0: the two highest affinities (2 and 3, in a seeded random order for the tie)
    got = algo.download(phase, server, 0)
    assert sorted(k.split("/")[0] for k in got) == ["client2", "client3"]
    assert got["client3/p"].tolist() == [3.0, 3.0]
    assert algo.choose(server, 0) == algo.choose(server, 0)  # seeded: the same draw every time
    explore = FedFomo(FedFomoParams(models_per_round=3, epsilon=1.0, epsilon_decay=0.0), Head(), seed=0)
    assert sorted(explore.choose(server, 0)) == [1, 2, 3]  # exploring still never repeats a client


# --- IFCA -----------------------------------------------------------------------------------------
def test_ifca_picks_the_cluster_with_the_lowest_training_loss():
    algo = IFCA(IFCAParams(clusters=3), Head(2, 2), seed=0)
    right = torch.tensor([[2.0, 0.0], [0.0, 2.0]])  # predicts argmax x
    models = {"cluster0/head.weight": -right, "cluster1/head.weight": right, "cluster2/head.weight": torch.zeros(2, 2)}
    x = torch.tensor([[1.0, 0.0], [0.0, 3.0], [2.0, 0.0]])
    y = torch.tensor([0, 1, 0])
    losses = algo.cluster_losses(models, x, y)
    by_hand = []
    for w in (-right, right, torch.zeros(2, 2)):
        z = x @ w.T
        by_hand.append(float((torch.logsumexp(z, 1) - z[torch.arange(3), y]).mean()))
    assert losses == pytest.approx(by_hand, abs=1e-6)
    assert algo.pick(models, x, y) == 1
    assert algo.pick(models, x, 1 - y) == 0
    assert algo.pick({k: torch.zeros(2, 2) for k in models}, x, y) == 0  # a tie goes to the lowest index


@pytest.mark.parametrize("weighting", ["samples", "uniform"])
def test_ifca_averages_each_cluster_over_the_clients_that_picked_it(weighting):
    algo = IFCA(IFCAParams(clusters=3, weighting=weighting), Head(), seed=0)
    server = ServerState({"cluster0/w": torch.tensor([0.0]), "cluster1/w": torch.tensor([10.0]), "cluster2/w": torch.tensor([20.0])})
    uploads = [Upload(0, 1, {"cluster0/w": torch.tensor([1.0])}), Upload(1, 3, {"cluster0/w": torch.tensor([5.0])}),
               Upload(2, 2, {"cluster1/w": torch.tensor([-4.0])})]
    new = algo.aggregate(None, server, uploads).global_params
    assert new["cluster0/w"].item() == pytest.approx((1 + 3 * 5) / 4 if weighting == "samples" else (1 + 5) / 2)
    assert new["cluster1/w"].item() == -4.0
    assert new["cluster2/w"].item() == 20.0  # nobody picked it: unchanged


def test_ifca_averages_uniformly_by_default_as_algorithm_2():
    algo = IFCA(IFCAParams(clusters=2), Head(), seed=0)
    assert algo.params.weighting == "uniform"
    models = algo.clusters(ServerState({"head.weight": torch.zeros(2, 1)}))
    ups = [Upload(0, 1, {"cluster0/head.weight": torch.ones(2, 1)}), Upload(1, 3, {"cluster0/head.weight": torch.full((2, 1), 5.0)})]
    new = algo.aggregate(None, ServerState(models), ups).global_params
    assert new["cluster0/head.weight"].flatten().tolist() == [3.0, 3.0]  # (1 + 5) / 2, not (1 + 3 * 5) / 4
    assert torch.equal(new["cluster1/head.weight"], models["cluster1/head.weight"])  # nobody picked cluster 1


def test_ifca_clusters_start_from_the_initial_model_and_seeded_fresh_ones():
    model = BodyHead()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    a = IFCA(IFCAParams(clusters=3), model, seed=7).clusters(ServerState(initial))
    b = IFCA(IFCAParams(clusters=3), model, seed=7).clusters(ServerState(initial))
    other_seed = IFCA(IFCAParams(clusters=3), model, seed=8).clusters(ServerState(initial))
    assert len(a) == 3 * len(initial)
    assert all(torch.equal(a[f"cluster0/{n}"], initial[n]) for n in initial)
    assert not torch.equal(a["cluster1/body.weight"], a["cluster2/body.weight"])
    assert not torch.equal(a["cluster1/body.weight"], initial["body.weight"])
    assert_same_params(a, b)
    assert not torch.equal(a["cluster1/body.weight"], other_seed["cluster1/body.weight"])


# --- FedPer ---------------------------------------------------------------------------------------
def test_fedper_uploads_and_downloads_only_the_base_layers():
    model = BodyHead()
    algo = FedPer(FedPerParams(), model, seed=0)
    server = ServerState({n: p.detach().clone() for n, p in model.named_parameters()})
    download = algo.download(None, server, 0)
    assert sorted(download) == ["body.bias", "body.weight"]
    own_head = {"head.weight": torch.ones(2, 3), "head.bias": torch.zeros(2)}
    slots = algo.client_params(None, download, own_head)
    upload, state = algo.client_result(None, slots, own_head)
    assert sorted(upload) == ["body.bias", "body.weight"] and sorted(state) == ["head.bias", "head.weight"]
    personal = algo.personalized_candidates(server, own_head, 0)[0][1]
    assert personal["head.weight"] is own_head["head.weight"] and personal["body.weight"] is server.global_params["body.weight"]
    assert algo.global_model(server) is None
    with pytest.raises(ConfigError, match="match no layer"):
        FedPer(FedPerParams(personal_layers=["classifier"]), model, seed=0)


# --- reductions (bitwise, CPU, same seed) ----------------------------------------------------------
QUICK = ("data.dataset=digits", "train.rounds=2", "partition.num_clients=4", "train.batch_size=50")


def final_state(tmp_path, name, *overrides):
    with pytest.MonkeyPatch.context() as mp:  # the partition heatmap is a second of matplotlib per run, and no part of the math
        mp.setattr(Run, "_put_plot", lambda self, name, draw: None)
        return train_all(small_run(tmp_path / name, *QUICK, *overrides))


@pytest.fixture(scope="module")
def fedavg(tmp_path_factory):
    return final_state(tmp_path_factory.mktemp("fedavg"), "a", "method.name=fedavg").server.global_params


def test_fedper_without_personal_layers_is_fedavg(tmp_path, fedavg):
    assert_same_params(final_state(tmp_path, "fedper", "method.name=fedper", "method.personal_layers=[]").server.global_params, fedavg)


def test_ifca_with_one_cluster_is_fedavg(tmp_path, fedavg):
    ifca = final_state(tmp_path, "ifca", "method.name=ifca", "method.clusters=1", "method.weighting=samples").server.global_params
    assert_same_params({n.removeprefix("cluster0/"): t for n, t in ifca.items()}, fedavg)


def test_pfedme_with_one_cold_inner_step_and_beta_one_is_plain_sgd_fedavg(tmp_path):
    # theta = w - p grad f(w) (the prox gradient vanishes at theta = w), so w <- w - eta lam p grad f(w)
    plain = ("train.momentum=0", "train.weight_decay=0")
    fedavg = final_state(tmp_path, "fedavg", "method.name=fedavg", "train.lr=0.02", *plain).server.global_params
    pfedme = final_state(tmp_path, "pfedme", "method.name=pfedme", "train.lr=0.5", "method.lam=4", "method.personal_lr=0.01",
                         "method.inner_steps=1", "method.warm_start=false", "method.beta=1", "method.weighting=samples", *plain)
    for n in fedavg:  # equal up to float rounding: (w - theta) is p grad f(w) rounded
        assert torch.allclose(pfedme.server.global_params[n], fedavg[n], atol=1e-5, rtol=0), n


def test_fedamp_without_attention_from_own_models_is_local_training(tmp_path):
    local = final_state(tmp_path, "local", "method.name=local")
    fedamp = final_state(tmp_path, "fedamp", "method.name=fedamp", "method.lam=0", "method.start_from=own")
    assert local.clients.keys() == fedamp.clients.keys() and local.clients
    for cid in local.clients:
        assert_same_params(fedamp.clients[cid], local.clients[cid])


def test_fedfomo_server_state_resumes_to_the_same_models(tmp_path):
    # the model pool, the affinities and the seeded epsilon-greedy downloads all come back from the checkpoint
    overrides = ("method.name=fedfomo", "train.rounds=3", "method.models_per_round=2")
    expected = final_state(tmp_path, "clean", *overrides)
    run = small_run(tmp_path / "crashed", *QUICK, *overrides)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Run, "_put_plot", lambda self, name, draw: None)
        run.partition()
    with pytest.raises(SystemExit):
        run.train("federation", telemetry_sinks=[CrashAfterRound(2)])
    resumed = train_all(run)
    assert_same_params(resumed.server.global_params, expected.server.global_params)
    assert resumed.server.per_client.keys() == expected.server.per_client.keys()
    for cid in expected.server.per_client:
        assert_same_params(resumed.server.per_client[cid], expected.server.per_client[cid])
    for cid in expected.clients:
        assert_same_params(resumed.clients[cid], expected.clients[cid])


# --- end to end -----------------------------------------------------------------------------------
P = 64 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10  # twonn on scikit-learn's 8x8 digits, 10 classes
HEAD = 200 * 10 + 10
CLIENTS, ROUNDS, F32 = 4, 2, 4


def expected_bytes(method):
    """(uploaded, downloaded) per phase, for 4 clients x 2 rounds, everyone every round."""
    every = CLIENTS * ROUNDS * P * F32
    if method == "fedper":
        return {"federation": (every - CLIENTS * ROUNDS * HEAD * F32,) * 2}
    if method == "ifca":  # k = 2 models down each round, then once more to pick for evaluation
        return {"federation": (every, 2 * every), "assignment": (0, 2 * CLIENTS * P * F32)}
    if method == "fedfomo":  # round 1: nothing to download; round 2: the 3 other clients' models, and 3 weights + ids up
        return {"federation": (every + CLIENTS * 3 * (4 + 8), CLIENTS * 3 * P * F32)}
    return {"federation": (every, every)}


@pytest.mark.parametrize("method", ["fedper", "pfedme", "ifca", "fedfomo", "fedamp", "ditto"])
def test_baseline_runs_end_to_end(tmp_path, method, fedavg):
    faster = ["method.inner_steps=2"] if method == "pfedme" else []  # K = 5 costs 5 gradients per batch
    run = small_run(tmp_path, f"method.name={method}", *QUICK, *faster)  # QUICK: 4 clients, 2 rounds
    summary = run.run_all()
    report = tmp_path / "test" / "report"
    for name in ("summary.json", "clients.csv", "accuracy.png", "report.md"):
        assert (report / name).stat().st_size > 0, name
    p = summary["personalized_accuracy"]
    assert 0 <= p["mean"] <= 1 and p["clients"] == CLIENTS
    if method in ("pfedme", "ditto"):
        assert 0 <= summary["global_model"]["top1"] <= 1
    else:
        assert summary["global_model"] is None
    got = {}
    for phase in run.phases():
        rows = [json.loads(line) for line in (report / f"rounds-{phase.name}.jsonl").read_text().splitlines()]
        got[phase.name] = (sum(r["bytes_uploaded"] for r in rows), sum(r["bytes_downloaded"] for r in rows))
    assert got == expected_bytes(method)
    if method == "ifca":
        details = json.loads((report / "rounds-assignment.jsonl").read_text().splitlines()[-1])["details"]
        assert len(details["cluster_of_client"]) == CLIENTS and sum(details["clients_per_cluster"]) == CLIENTS
    if method == "ditto":  # the global model is FedAvg's (same seed, bitwise); the personal ones are not
        state = run.train("federation")
        assert_same_params(state.server.global_params, fedavg)
        assert all(not torch.equal(s["head.weight"], fedavg["head.weight"]) for s in state.clients.values())
    if method == "fedper":  # each client kept its own head; the server's head is still the initial one
        state = run.train("federation")
        heads = [s["head.weight"] for s in state.clients.values()]
        assert len(heads) == CLIENTS and not torch.equal(heads[0], heads[1])
        assert torch.equal(state.server.global_params["head.weight"], run.build_algorithm()[1]["head.weight"])
