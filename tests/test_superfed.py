"""SuPerFed's pieces: phases, mixing, the lam draws, the local initialisation."""

import torch

from fedpipe.algorithms.base import ClientContext, ServerState
from fedpipe.algorithms.superfed import SuPerFedLM, SuPerFedLMParams, SuPerFedMM, SuPerFedMMParams
from fedpipe.models import SuPerFedCNN


def make(cls=SuPerFedMM, **kw):
    params = (SuPerFedMMParams if cls is SuPerFedMM else SuPerFedLMParams)(**kw)
    torch.manual_seed(0)
    model = SuPerFedCNN((1, 28, 28), 10)
    return cls(params, model, seed=3), {n: p.detach().clone() for n, p in model.named_parameters()}


def test_phases_split_at_floor_L_times_R():
    phases = SuPerFedMM.phases(SuPerFedMMParams(start_fraction=0.6), 25)
    assert [(p.name, p.first_round, p.last_round) for p in phases] == [("federation", 1, 15), ("personalization", 16, 25)]
    # L = 1: no Phase II rounds; L = 0: no Phase I rounds (the phase still exists and passes its state on)
    assert [len(p.rounds) for p in SuPerFedMM.phases(SuPerFedMMParams(start_fraction=1.0), 10)] == [10, 0]
    assert [len(p.rounds) for p in SuPerFedMM.phases(SuPerFedMMParams(start_fraction=0.0), 10)] == [0, 10]


def test_only_weights_are_mixed_by_default_and_biases_when_asked():
    algo, g = make()
    assert all(n.endswith("weight") for n in algo.mixed) and len(algo.mixed) == 5
    algo_b, _ = make(mix_bias=True)
    assert len(algo_b.mixed) == 10 and algo_b.num_layers == 5


def test_mixed_model_at_lam_zero_is_the_global_model_and_at_one_the_local():
    algo, g = make()
    local = algo.init_local(g, client_id=4)
    at0, at1 = algo.mix(g, local, 0.0), algo.mix(g, local, 1.0)
    assert all(torch.equal(at0[n], g[n]) for n in g)
    assert all(torch.equal(at1[n], local[n]) for n in local)
    assert all(torch.equal(at1[n], g[n]) for n in g if n not in local)  # shared biases
    half = algo.mix(g, local, torch.tensor(0.25))
    n = algo.mixed[0]
    assert torch.allclose(half[n], 0.75 * g[n] + 0.25 * local[n])
    # the evaluation grid: lam = 0 is the global model exactly
    cands = algo.personalized_candidates(ServerState(g), local, 4)
    assert [c for c, _ in cands] == [round(0.1 * i, 6) for i in range(11)]
    assert all(torch.equal(cands[0][1][n], g[n]) for n in g)


def test_layer_mixing_draws_one_lam_per_layer_and_model_mixing_one():
    mm, g = make()
    lm, _ = make(SuPerFedLM)
    phase1, phase2 = SuPerFedMM.phases(mm.params, 10)
    gen = torch.Generator().manual_seed(0)
    ctx = ClientContext(client_id=1, round=8, phase=phase2, data=None)
    assert mm.batch_noise(ctx, None, gen).shape == ()
    lam = lm.batch_noise(ctx, None, gen)
    assert lam.shape == (5,) and ((lam >= 0) & (lam <= 1)).all()
    local = lm.init_local(g, 1)
    mixed = lm.mix(g, local, lam)
    for n in lm.mixed:
        t = lam[lm.layer_of[n]]
        assert torch.allclose(mixed[n], (1 - t) * g[n] + t * local[n])
    assert mm.batch_noise(ClientContext(1, 2, phase1, None), None, gen) is None  # Phase I draws nothing: lam = 0


def test_local_model_is_seeded_by_client_and_differs_from_global():
    algo, g = make()
    a, b, a2 = algo.init_local(g, 1), algo.init_local(g, 2), algo.init_local(g, 1)
    n = algo.mixed[0]
    assert torch.equal(a[n], a2[n]) and not torch.equal(a[n], b[n]) and not torch.equal(a[n], g[n])
