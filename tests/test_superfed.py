"""SuPerFed's pieces: phases, mixing, the lam draws, the local initialisation; on the BiLSTM, end to end."""

import pytest
import torch

from fedpipe.algorithms.base import ClientContext, ServerState
from fedpipe.algorithms.superfed import SuPerFedLM, SuPerFedLMParams, SuPerFedMM, SuPerFedMMParams
from fedpipe.nn.networks import SuPerFedCNN


def make(cls=SuPerFedMM, bias=False, **kw):
    params = (SuPerFedMMParams if cls is SuPerFedMM else SuPerFedLMParams)(**kw)
    torch.manual_seed(0)
    model = SuPerFedCNN((1, 28, 28), 10, bias=bias)
    return cls(params, model, seed=3), {n: p.detach().clone() for n, p in model.named_parameters()}


def test_phases_split_at_floor_L_times_R():
    phases = SuPerFedMM.phases(SuPerFedMMParams(start_fraction=0.6), 25)
    assert [(p.name, p.first_round, p.last_round) for p in phases] == [("federation", 1, 15), ("personalization", 16, 25)]
    # L = 1: no Phase II rounds; L = 0: no Phase I rounds (the phase still exists and passes its state on)
    assert [len(p.rounds) for p in SuPerFedMM.phases(SuPerFedMMParams(start_fraction=1.0), 10)] == [10, 0]
    assert [len(p.rounds) for p in SuPerFedMM.phases(SuPerFedMMParams(start_fraction=0.0), 10)] == [0, 10]


def test_the_superfed_cnn_is_bias_free_and_every_tensor_of_it_is_mixed():
    algo, g = make()
    assert not any("bias" in n for n in g)  # as every model of the authors' released code
    assert algo.mixed == list(g) and len(algo.mixed) == 5 and algo.num_layers == 5


def test_only_weights_are_mixed_by_default_and_biases_when_asked():
    algo, g = make(bias=True)  # the Table 4 CNN with biases (the authors' first implementation)
    assert all(n.endswith("weight") for n in algo.mixed) and len(algo.mixed) == 5
    local = algo.init_local(g, 1)
    assert all(torch.equal(algo.mix(g, local, 0.7)[n], g[n]) for n in g if n.endswith("bias"))  # shared
    algo_b, _ = make(bias=True, mix_bias=True)
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


def _agnews_run(tmp_path, method):
    from runs import small_run
    from test_agnews import write_agnews

    write_agnews(tmp_path / "data" / "ag_news_csv", per_class_train=8, per_class_test=2)
    return small_run(
        tmp_path / "runs", "data.dataset=agnews", f"data.root={tmp_path / 'data'}", "model.name=bilstm",
        f"method.name={method}", "partition.scheme=iid", "partition.num_clients=3", "train.rounds=2",
        "method.start_fraction=0.5", "train.batch_size=8", "train.lr=0.05", "run.threads=1",
    )


@pytest.mark.parametrize("method", ["superfed_mm", "superfed_lm"])
def test_superfed_personalizes_the_lstm(tmp_path, method):
    """SuPerFed on the BiLSTM (embedding, LSTM, linear head): after Phase II every client's local model
    holds its own LSTM weights (all four: input-hidden and hidden-hidden, both directions), different
    from the other clients' and from the global ones, and so does its embedding."""
    from runs import train_all

    run = _agnews_run(tmp_path, method)
    state = train_all(run)
    algorithm, _ = run.build_algorithm()
    g = state.server.global_params
    lstm = ["lstm.weight_ih_l0", "lstm.weight_hh_l0", "lstm.weight_ih_l0_reverse", "lstm.weight_hh_l0_reverse"]
    assert len(state.clients) == 3
    for cid, local in state.clients.items():
        for n in [*lstm, "embedding.weight", "head.weight"]:
            assert n in local, f"client {cid} has no local {n}"
            assert local[n].shape == g[n].shape and not torch.allclose(local[n], g[n]), (cid, n)
        assert not any("bias" in n for n in local)  # mix_bias false: the LSTM's and head's biases are shared
        start = algorithm.init_local(g, cid)  # Phase II trained the local LSTM, not only initialised it
        assert all(not torch.allclose(local[n], start[n]) for n in lstm), cid
    a, b, c = state.clients.values()
    for n in lstm:
        assert not torch.allclose(a[n], b[n]) and not torch.allclose(b[n], c[n]) and not torch.allclose(a[n], c[n]), n


def test_the_candidates_evaluated_together_score_as_each_on_its_own(monkeypatch):
    """The evaluation's fast path: the lam grid made at once (rows of one tensor per layer, read in place),
    the forward mapped over the candidates, clients in blocks; the same scores as mixing and running each
    candidate alone, with the same pick."""
    import fedpipe.engine.evaluation as ev
    from fedpipe.data.federated import ClientData, FederatedData, Split

    algo, g = make()
    locals_ = {cid: algo.init_local(g, cid) for cid in (0, 2)}  # client 1 never reached Phase II
    for cid, local in locals_.items():
        cands = algo.personalized_candidates(ServerState(g), local, cid)
        assert all(torch.equal(cands[-1][1][n], local[n]) for n in local)  # lam = 1: w_l exactly
        for lam, params in cands:
            assert all(torch.allclose(params[n], algo.mix(g, local, lam)[n], rtol=0, atol=1e-6) for n in g)
        stacked = ev._stacked([p[algo.mixed[0]] for _, p in cands])
        assert stacked.data_ptr() == cands[0][1][algo.mixed[0]].data_ptr()  # no copy
    gen = torch.Generator().manual_seed(0)

    def split(n):
        return Split(torch.randn(n, 1, 28, 28, generator=gen), torch.randint(0, 10, (n,), generator=gen))

    data = FederatedData(tuple(ClientData(c, split(8), split(6), split(7), False) for c in range(3)), split(5), 10, (1, 28, 28))
    fast = ev.evaluate_personalized(algo, ServerState(g), locals_, data, 4, 5)
    monkeypatch.setattr(ev, "EVAL_BLOCK_BYTES", 1)  # a block per client
    monkeypatch.setattr(algo, "vmap_eval", False)  # one candidate at a time
    monkeypatch.setattr(algo, "personalized_candidates",  # and mixed one by one
                        lambda server, state, cid: [(lam, g if state is None else algo.mix(g, state, lam)) for lam in algo.lam_grid()])
    slow = ev.evaluate_personalized(algo, ServerState(g), locals_, data, 4, 5)
    for a, b in zip(fast.clients, slow.clients):
        assert (a.chosen, a.oracle) == (b.chosen, b.oracle)
        for sa, sb in zip(a.val + a.test, b.val + b.test):
            assert sa.accuracy == sb.accuracy and sa.top5 == sb.top5 and sa.n == sb.n
            assert sa.loss == pytest.approx(sb.loss, abs=1e-5) and sa.ece == pytest.approx(sb.ece, abs=1e-5, nan_ok=True)
