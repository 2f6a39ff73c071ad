"""The math of aggregation and of the penalty terms, against hand computation."""

import math

import pytest
import torch

from fedpipe.algorithms.aggregation import weighted_average
from fedpipe.algorithms.base import ServerState, Upload
from fedpipe.algorithms.fedavg import FedAvg, FedAvgParams
from fedpipe.algorithms.regularizers import mixable_layers, proximal_layer_norms, proximal_squared, squared_cosine
from fedpipe.nn.networks import TwoNN


def test_weighted_average_equals_hand_computation():
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0])}
    b = {"w": torch.tensor([4.0, -2.0]), "b": torch.tensor([0.0])}
    c = {"w": torch.tensor([0.5, 0.5]), "b": torch.tensor([1.0])}
    out = weighted_average([a, b, c], [10, 30, 60])
    # (10*1 + 30*4 + 60*0.5) / 100 = 1.6 ; (10*2 - 30*2 + 60*0.5) / 100 = -0.1 ; (10*3 + 0 + 60) / 100 = 0.9
    assert torch.allclose(out["w"], torch.tensor([1.6, -0.1]), atol=1e-7)
    assert torch.allclose(out["b"], torch.tensor([0.9]), atol=1e-7)


def test_fedavg_aggregate_is_sample_weighted_and_keeps_unsent_tensors():
    algo = FedAvg(FedAvgParams(), TwoNN((1, 2, 2), 2), seed=0)
    server = ServerState({"x": torch.tensor([0.0]), "kept": torch.tensor([7.0])})
    uploads = [Upload(0, 1, {"x": torch.tensor([1.0])}), Upload(1, 3, {"x": torch.tensor([5.0])})]
    new = algo.aggregate(None, server, uploads)
    assert new.global_params["x"].item() == pytest.approx((1 * 1 + 3 * 5) / 4)
    assert new.global_params["kept"].item() == 7.0


def test_proximal_terms_equal_hand_computation():
    w = {"l1.weight": torch.tensor([[1.0, 2.0]]), "l1.bias": torch.tensor([1.0])}
    a = {"l1.weight": torch.tensor([[0.0, 0.0]]), "l1.bias": torch.tensor([0.0])}
    # FedProx: 1/2 * (1 + 4 + 1) = 3
    assert proximal_squared(w, a).item() == pytest.approx(3.0)
    # SuPerFed: ||(1, 2)||_2 = sqrt(5), over weights only (the bias has no local copy)
    model = torch.nn.Module()
    model.l1 = torch.nn.Linear(2, 1)
    assert mixable_layers(model) == {"l1": ["l1.weight"]}
    assert proximal_layer_norms(w, a, mixable_layers(model)["l1"]).item() == pytest.approx(math.sqrt(5))


def test_proximal_layer_norm_gradient_is_finite_at_the_anchor():
    w = {"l.weight": torch.ones(2, 2, requires_grad=True)}
    proximal_layer_norms(w, {"l.weight": torch.ones(2, 2)}, ["l.weight"]).backward()
    assert torch.equal(w["l.weight"].grad, torch.zeros(2, 2))


def test_squared_cosine_equals_hand_computation():
    g = {"a.weight": torch.tensor([[1.0, 0.0]]), "b.weight": torch.tensor([[1.0]])}
    l = {"a.weight": torch.tensor([[1.0, 1.0]]), "b.weight": torch.tensor([[0.0]])}
    # concatenated: g = (1, 0, 1), l = (1, 1, 0): <g,l> = 1, |g|^2 = 2, |l|^2 = 2 -> cos^2 = 1/4
    assert squared_cosine(g, l, ["a.weight", "b.weight"]).item() == pytest.approx(0.25)
    # orthogonal vectors give 0, parallel ones 1
    orthogonal = {"a.weight": torch.tensor([[0.0, 3.0]]), "b.weight": torch.tensor([[0.0]])}
    assert squared_cosine(g, orthogonal, ["a.weight", "b.weight"]).item() == 0.0
    assert squared_cosine(g, {k: 2 * v for k, v in g.items()}, ["a.weight", "b.weight"]).item() == pytest.approx(1.0)
