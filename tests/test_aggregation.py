"""Aggregation declared as data: which methods, in which phases, aggregate by the plain sample-weighted
mean (and so get the distributed all-reduce fast path), pinned method by method; and the declaration
checked against what each such method's `aggregate` computes on random uploads."""

import pytest
import torch

from fedpipe.algorithms import ALGORITHMS, build_algorithm, phases_of
from fedpipe.algorithms.aggregation import (
    NO_UPLOADS,
    WEIGHTED_MEAN,
    uses_weighted_mean,
    weighted_average,
    weighted_sum,
)
from fedpipe.algorithms.base import ClientContext, ServerState, Upload
from fedpipe.algorithms.fedavg import FedAvg, FedAvgParams
from fedpipe.data.federated import ClientData, Split
from fedpipe.nn.networks import build_model

ROUNDS = 4

# method variants: every registered method with its defaults, plus the settings under which a
# method with its own rule reduces to the weighted mean (and neighbours that must not)
VARIANTS = {name: (name, {}) for name in ALGORITHMS}
VARIANTS.update({
    "pfedme samples": ("pfedme", {"weighting": "samples"}),
    "pfedme samples beta=2": ("pfedme", {"weighting": "samples", "beta": 2.0}),
    "ifca k=1 samples": ("ifca", {"clusters": 1, "weighting": "samples"}),
    "ifca k=1 uniform": ("ifca", {"clusters": 1}),
    "pfedmb plain": ("pfedmb", {"aggregation": "plain"}),
    "fedavg + finetune": ("fedavg", {"finetune_epochs": 1}),
    "ditto + finetune": ("ditto", {"finetune_epochs": 1}),
})

# variant -> {phase: gets the weighted-mean fast path}, every phase of the variant listed
FAST_PATH = {
    "fedavg": {"federation": True},
    "fedprox": {"federation": True},
    "local": {"local": False},
    "fedavg_ft": {"federation": True, "finetune": False},
    "fedprox_ft": {"federation": True, "finetune": False},
    "superfed_mm": {"federation": True, "personalization": True},
    "superfed_lm": {"federation": True, "personalization": True},
    "pfedmb": {"federation": False, "finetune": False},
    "fedper": {"federation": True},
    "pfedme": {"federation": False},
    "ifca": {"federation": False, "assignment": False},
    "fedfomo": {"federation": False},
    "fedamp": {"federation": False},
    "ditto": {"federation": True},
    "fedmn": {"federation": False},
    "fedmoe": {"federation": True, "specialists": False, "gate": False},
    "apfl": {"federation": True},
    "lgfedavg": {"federation": True},
    "pfedme samples": {"federation": True},
    "pfedme samples beta=2": {"federation": False},
    "ifca k=1 samples": {"federation": True, "assignment": False},
    "ifca k=1 uniform": {"federation": False, "assignment": False},
    "pfedmb plain": {"federation": False, "finetune": False},
    "fedavg + finetune": {"federation": True, "finetune": False},
    "ditto + finetune": {"federation": True, "finetune": False},
}


def make(variant: str):
    name, overrides = VARIANTS[variant]
    params = ALGORITHMS[name].Params(**overrides)
    torch.manual_seed(0)
    algorithm = build_algorithm(params, build_model("lenet5", (1, 28, 28), 10), seed=3)
    return algorithm, phases_of(params, ROUNDS)


def test_every_method_and_variant_is_pinned():
    assert set(FAST_PATH) == set(VARIANTS)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_which_methods_and_phases_get_the_weighted_mean_fast_path(variant):
    algorithm, phases = make(variant)
    got = {phase.name: uses_weighted_mean(algorithm, phase) for phase in phases}
    assert got == FAST_PATH[variant]
    for phase in phases:
        declared = algorithm.aggregation(phase)
        assert declared.description
        if not phase.communicates:
            assert declared == NO_UPLOADS
        assert (declared == WEIGHTED_MEAN) == got[phase.name]


def client(cid: int, n: int) -> ClientData:
    g = torch.Generator().manual_seed(100 + cid)
    x, y = torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)
    return ClientData(cid, Split(x, y), Split(x[:4], y[:4]), Split(x[:4], y[:4]), False)


def random_uploads(algorithm, phase, server: ServerState, round_: int) -> list[Upload]:
    """What three clients of different sizes would upload, with random values: each client's real
    upload (its slots untrained) with every float tensor replaced by noise."""
    uploads = []
    g = torch.Generator().manual_seed(round_)
    for cid, n in ((0, 7), (1, 20), (2, 13)):
        ctx = ClientContext(cid, round_, phase, client(cid, n))
        slots = algorithm.client_params(ctx, algorithm.download(phase, server, cid), None)
        upload, _ = algorithm.client_result(ctx, slots, None)
        noisy = {k: (torch.randn(t.shape, generator=g).to(t.dtype) if t.is_floating_point() else t) for k, t in upload.items()}
        uploads.append(Upload(cid, n, noisy))
    return uploads


DECLARED_MEAN = [(v, p) for v, phases in FAST_PATH.items() for p, fast in phases.items() if fast]


@pytest.mark.parametrize(("variant", "phase_name"), DECLARED_MEAN)
def test_a_method_declared_weighted_mean_aggregates_by_the_weighted_mean(variant, phase_name):
    """The declaration cannot lie: `aggregate` equals `apply_average` of `weighted_average` bit for bit
    (what the all-reduce fast path computes), and the uploaded tensors are the hand-computed
    sample-weighted mean; two rounds, so a server state the method has already aggregated counts too."""
    algorithm, phases = make(variant)
    phase = next(p for p in phases if p.name == phase_name)
    server = ServerState({n: p.detach().clone() for n, p in algorithm.model.named_parameters()})
    for round_ in (phase.first_round, phase.first_round + 1):
        uploads = random_uploads(algorithm, phase, server, round_)
        got = algorithm.aggregate(phase, server, uploads)
        fast = algorithm.apply_average(server, weighted_average([u.tensors for u in uploads], [u.num_samples for u in uploads]))
        assert got.global_params.keys() == fast.global_params.keys()
        for k in got.global_params:
            assert torch.equal(got.global_params[k], fast.global_params[k]), k
        assert got.per_client.keys() == fast.per_client.keys()
        total = sum(u.num_samples for u in uploads)
        for k in uploads[0].tensors:
            hand = sum(u.num_samples * u.tensors[k].double() for u in uploads) / total
            assert torch.allclose(got.global_params[k].double(), hand, atol=1e-6), k
        server = got


def test_an_undeclared_aggregate_override_loses_the_fast_path():
    """A method that overrides `aggregate` without declaring its rule is taken as custom (safe)."""

    class Mine(FedAvg):
        def aggregate(self, phase, server, uploads):
            return server

    algorithm = Mine(FedAvgParams(), build_model("twonn", (1, 28, 28), 10), seed=0)
    phase = FedAvg.phases(algorithm.params, 3)[0]
    assert algorithm.aggregation(phase).kind == "custom" and not uses_weighted_mean(algorithm, phase)


def test_weighted_sum_is_the_float64_sum_in_order_without_division():
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0])}
    b = {"w": torch.tensor([4.0, -2.0]), "b": torch.tensor([0.5])}
    out = weighted_sum([a, b], [10, 0.5])
    assert out["w"].dtype == torch.float64 and out["w"].tolist() == [12.0, 19.0] and out["b"].tolist() == [30.25]
    assert weighted_sum([], []) == {}
    averaged = weighted_average([a, b], [10, 0.5])
    assert torch.equal(averaged["w"], (out["w"] / 10.5).float())
