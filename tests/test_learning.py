"""Every method learns, and the methods that claim something of their own show it, on the 8x8 digits
(1,797 real images, offline) with the small MLP: a few seconds each. The thresholds are far from what a
faithful implementation reaches and far above what an untrained model or a method that never moves
its weights scores, so they hold for any faithful implementation and fail for a broken one."""

from __future__ import annotations

import pytest
import torch
from runs import small_run

from fedpipe.algorithms import ALGORITHMS
from fedpipe.algorithms.base import ServerState
from fedpipe.data.federated import prepare_data
from fedpipe.engine.evaluation import eval_mode, evaluate_model, evaluate_personalized, predict
from fedpipe.nn.networks import build_model

CHANCE = 0.1  # 10 digit classes
LEARNED = 4 * CHANCE  # a faithful method reaches 0.65-0.95 here; an untrained MLP scores 0.1-0.2
GAIN = 0.2  # and it must beat its own round-0 accuracy by this much

# 4 clients, IID split, 3 rounds of 1 epoch: every client sees all classes, so personalized and global
# accuracy measure the same thing, and chance is 10% for both.
DIGITS = ["data.dataset=digits", "model.name=twonn", "partition.scheme=iid", "partition.num_clients=4",
          "train.rounds=3", "train.lr=0.05", "run.threads=1", "engine.clients=sequential"]


def _round0(run):
    """(personalized mean, global) accuracy of the untrained initial model, scored as the run scores it."""
    algorithm, initial = run.build_algorithm()
    data = prepare_data(run.bundle, run.load_partition(), run.device)
    personalized = evaluate_personalized(algorithm, ServerState(initial), {}, data, 1000, 15).mean_accuracy
    plain = build_model(run.cfg.model_name(), run.bundle.input_shape, run.bundle.num_classes).to(run.device)  # what `initial` is for
    with eval_mode(plain):
        logits = torch.func.functional_call(plain, initial, (data.global_test.x,))
    return personalized, float((logits.argmax(1) == data.global_test.y).double().mean())


@pytest.mark.parametrize("method", list(ALGORITHMS))
def test_every_method_learns(tmp_path, method):
    run = small_run(tmp_path, f"method.name={method}", *DIGITS)
    run.partition()
    before_personalized, before_global = _round0(run)
    summary = run.run_all()
    personalized = summary["personalized_accuracy"]["mean"]
    assert personalized >= LEARNED and personalized >= before_personalized + GAIN, (personalized, before_personalized)
    if summary["global_model"] is not None:  # a method with a global model must have trained it too
        glob = summary["global_model"]["top1"]
        assert glob >= LEARNED and glob >= before_global + GAIN, (glob, before_global)


# --- the methods' own claims ----------------------------------------------------------------------------


def _trained(tmp_path, *overrides):
    run = small_run(tmp_path, *overrides)
    run.partition()
    state = None
    for phase in run.phases():
        state = run.train(phase.name)
    algorithm, _ = run.build_algorithm()
    return run, algorithm, state, prepare_data(run.bundle, run.load_partition(), run.device)


@pytest.mark.parametrize("method", ["superfed_mm", "superfed_lm"])
def test_superfed_personalized_models_beat_the_global_model_on_a_pathological_split(tmp_path, method):
    """SuPerFed's claim: on clients with two classes each, the personalized mix (its lam picked on the
    client's validation split) scores at least as well as the global model on the client's own test data."""
    run, algorithm, state, data = _trained(tmp_path, f"method.name={method}", "data.dataset=digits", "partition.scheme=pathological",
                                           "partition.num_clients=5", "train.rounds=4", "method.start_fraction=0.5",
                                           "train.lr=0.05", "run.threads=1", "engine.clients=sequential")
    personalized = evaluate_personalized(algorithm, state.server, state.clients, data, 1000, 15)
    glob = algorithm.global_model(state.server)
    on_own_test = [evaluate_model(algorithm, glob, c.test, 1000, 15).accuracy for c in data.clients]
    global_mean = sum(on_own_test) / len(on_own_test)
    assert personalized.mean_accuracy >= LEARNED and personalized.mean_accuracy >= global_mean, (personalized.mean_accuracy, global_mean)
    assert any(c.candidates[c.chosen] > 0 for c in personalized.clients)  # some client actually uses its local model


def test_fedmoe_gate_beats_the_global_model_for_opt_out_clients(tmp_path):
    """FedMoE's claim: a client that never joined the federation (opt-out), whose classes the global
    model may never have seen, does better with its gated mixture than with the global model."""
    run, algorithm, state, data = _trained(tmp_path, "method.name=fedmoe", "data.dataset=digits", "partition.scheme=pathological",
                                           "partition.num_clients=6", "partition.opt_out_fraction=0.5", "train.rounds=3",
                                           "method.max_epochs=5", "train.lr=0.05", "run.threads=1", "engine.clients=sequential")
    result = evaluate_personalized(algorithm, state.server, state.clients, data, 1000, 15)
    opt_out = [c for c in result.clients if c.opt_out]
    assert opt_out, "the split has no opt-out client"
    glob = algorithm.global_model(state.server)
    clients = {c.client_id: c for c in data.clients}
    for c in opt_out:
        assert algorithm._gate_key in state.clients[c.client_id]  # its personalized model is the gated mixture
    mixture = sum(c.accuracy for c in opt_out) / len(opt_out)
    global_ = sum(evaluate_model(algorithm, glob, clients[c.client_id].test, 1000, 15).accuracy for c in opt_out) / len(opt_out)
    assert mixture > global_ + 0.1 and mixture >= LEARNED, (mixture, global_)


def test_pfedmb_merged_model_predicts_as_the_branched_model_after_training(tmp_path):
    """pFedMB's claim: each client's merged single-branch model (Eq. 1, the base model's size) is the
    trained multi-branch model (Eq. 2): the same predictions on the client's test data."""
    run, algorithm, state, data = _trained(tmp_path, "method.name=pfedmb", "method.finetune_epochs=0", *DIGITS)  # the branched model itself, not fine-tuned
    checked = 0
    for client in data.clients:
        kept = state.clients.get(client.client_id)
        if not algorithm._has_alpha(kept):
            continue
        (_, merged), = algorithm.personalized_candidates(state.server, kept, client.client_id)
        branched = algorithm.layout.multibranch_model(algorithm.model, algorithm.branches(state.server.global_params), algorithm.alpha_of(kept))
        with eval_mode(algorithm.model), torch.no_grad():
            a = predict(algorithm, merged, client.test.x, 1000)
            branched.eval()
            b = branched(client.test.x)
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
        assert torch.equal(a.argmax(1), b.argmax(1))
        checked += 1
    assert checked == len(data.clients)
    assert evaluate_personalized(algorithm, state.server, state.clients, data, 1000, 15).mean_accuracy >= LEARNED
