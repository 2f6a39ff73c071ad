"""What SuPerFed mixes and FedProx's `layer_norms` covers: layers chosen by module type (conv, linear,
LSTM, embedding, norm layers as an option), one lam per module for Layer Mixing, and a refusal that
names any layer of another type."""

import math

import pytest
import torch
from torch import nn

from fedpipe.algorithms import regularizers
from fedpipe.algorithms.base import ClientContext
from fedpipe.algorithms.fedprox import FedProx, FedProxParams
from fedpipe.algorithms.superfed import SuPerFedLM, SuPerFedLMParams, SuPerFedMM, SuPerFedMMParams
from fedpipe.errors import ConfigError
from fedpipe.nn.networks import MODELS, build_model

TEXT_SHAPE = (12, 50)  # (tokens, vocabulary): a small BiLSTM
IMAGE_SHAPE = (1, 28, 28)
TABLE_SHAPE = (30,)  # numeric features
SHAPES = {"image": IMAGE_SHAPE, "text": TEXT_SHAPE, "table": TABLE_SHAPE}

# Every bundled model, its layers in order and the tensors mixed with the defaults (biases shared).
EXPECTED = {
    "twonn": {"body.1": ["weight"], "body.3": ["weight"], "head": ["weight"]},
    "superfed_cnn": {"features.0": ["weight"], "features.3": ["weight"], "features.6": ["weight"], "body.0": ["weight"],
                     "head": ["weight"]},
    "lenet5": {"features.0": ["weight"], "features.3": ["weight"], "body.0": ["weight"], "body.2": ["weight"],
               "head": ["weight"]},
    "mcmahan_cnn": {"features.0": ["weight"], "features.3": ["weight"], "body.0": ["weight"], "head": ["weight"]},
    "bilstm": {"embedding": ["weight"], "lstm": ["weight_ih_l0", "weight_hh_l0", "weight_ih_l0_reverse", "weight_hh_l0_reverse"],
               "head": ["weight"]},
    "tabular_mlp": {"body.0": ["weight"], "body.2": ["weight"], "head": ["weight"]},
}


def bundled(name: str) -> nn.Module:
    torch.manual_seed(0)
    return build_model(name, SHAPES[MODELS[name].reads], 4)


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_every_bundled_model_is_listed_here():
    assert set(EXPECTED) == set(MODELS)


@pytest.mark.parametrize("name", EXPECTED)
def test_selection_by_module_type_on_each_bundled_model(name):
    model = bundled(name)
    expected = {m: [f"{m}.{p}" for p in ps] for m, ps in EXPECTED[name].items()}
    assert regularizers.mixable_layers(model) == expected
    # with mix_bias every trainable tensor of the model is mixed, layer by layer
    with_bias = regularizers.mixable_layers(model, bias=True)
    assert [n for names in with_bias.values() for n in names] == [n for n, _ in model.named_parameters()]
    assert list(with_bias) == list(expected)
    # SuPerFed mixes exactly these, one lam per layer (module) for LM; FedProx's layer_norms covers them too
    mixed = [n for names in expected.values() for n in names]
    for cls, params in ((SuPerFedMM, SuPerFedMMParams()), (SuPerFedLM, SuPerFedLMParams())):
        algo = cls(params, model, seed=0)
        assert algo.mixed == mixed and algo.num_layers == len(expected)
        assert all(algo.layer_of[n] == i for i, names in enumerate(expected.values()) for n in names)
    assert FedProx(FedProxParams(proximal="layer_norms"), model, seed=0).prox_names == mixed


def test_superfed_defaults_are_the_selection_defaults_fedprox_uses():
    """SuPerFed with nu = 0 and no Phase II is FedProx with layer_norms (tests/test_reductions.py) only
    while FedProx selects what SuPerFed mixes by default."""
    for params in (SuPerFedMMParams(), SuPerFedLMParams()):
        assert (params.mix_bias, params.mix_norm) == (False, True)
    defaults = regularizers.mixable_layers.__kwdefaults__
    assert defaults == {"bias": False, "norm": True}


def test_the_superfed_cnn_is_bias_free_by_default():
    model = build_model("superfed_cnn", (3, 32, 32), 10)
    assert [n for n, _ in model.named_parameters() if "bias" in n] == []
    assert all(getattr(m, "bias", None) is None for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear)))


def test_layer_mixing_draws_one_lam_per_module_and_the_lstm_is_one_layer():
    model = bundled("bilstm")
    g = params_of(model)
    lm = SuPerFedLM(SuPerFedLMParams(), model, seed=3)
    phase2 = SuPerFedLM.phases(lm.params, 10)[1]
    lam = lm.batch_noise(ClientContext(1, 9, phase2, None), None, torch.Generator().manual_seed(0))
    assert lam.shape == (3,)  # embedding, lstm, head
    local = lm.init_local(g, 1)
    mixed = lm.mix(g, local, lam)
    for n in ("lstm.weight_ih_l0", "lstm.weight_hh_l0", "lstm.weight_ih_l0_reverse", "lstm.weight_hh_l0_reverse"):
        assert torch.allclose(mixed[n], (1 - lam[1]) * g[n] + lam[1] * local[n])
    assert torch.allclose(mixed["embedding.weight"], (1 - lam[0]) * g["embedding.weight"] + lam[0] * local["embedding.weight"])
    assert torch.equal(mixed["lstm.bias_ih_l0"], g["lstm.bias_ih_l0"])  # biases shared by default


def test_local_initialisation_per_layer_type():
    """As the official Lines* layers: conv / linear Xavier-normal, embedding N(0, 1) (padding row zero, as
    nn.Embedding), LSTM U(-1/sqrt(hidden), 1/sqrt(hidden)); seeded by the client."""
    model = bundled("bilstm")
    g = params_of(model)
    algo = SuPerFedMM(SuPerFedMMParams(), model, seed=3)
    local = algo.init_local(g, 2)
    assert local.keys() == set(algo.mixed)
    bound = 1 / math.sqrt(model.lstm.hidden_size)
    for n in ("lstm.weight_ih_l0", "lstm.weight_hh_l0_reverse"):
        assert local[n].abs().max() <= bound and not torch.equal(local[n], g[n])
    emb = local["embedding.weight"]
    assert torch.equal(emb[model.embedding.padding_idx], torch.zeros(emb.shape[1]))
    assert 0.9 < float(emb[1:].std()) < 1.1
    assert torch.equal(algo.init_local(g, 2)["lstm.weight_hh_l0"], local["lstm.weight_hh_l0"])
    assert not torch.equal(algo.init_local(g, 3)["lstm.weight_hh_l0"], local["lstm.weight_hh_l0"])


class NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.flat = nn.Flatten()
        self.ln = nn.LayerNorm(4 * 26 * 26)
        self.head = nn.Linear(4 * 26 * 26, 3)

    def forward(self, x):
        return self.head(self.ln(self.flat(self.bn(self.conv(x)))))


def test_norm_layers_mix_their_affine_parameters_unless_mix_norm_is_off():
    model = NormNet()
    assert regularizers.mixable_layers(model) == {
        "conv": ["conv.weight"], "bn": ["bn.weight", "bn.bias"], "ln": ["ln.weight", "ln.bias"], "head": ["head.weight"],
    }
    assert regularizers.mixable_layers(model, norm=False) == {"conv": ["conv.weight"], "head": ["head.weight"]}
    algo = SuPerFedLM(SuPerFedLMParams(), model, seed=0)
    assert algo.num_layers == 4 and algo.layer_of["bn.weight"] == algo.layer_of["bn.bias"] == 1
    local = algo.init_local(params_of(model), 1)  # the official LinesBN's local copy: ones and zeros
    assert torch.equal(local["bn.weight"], torch.ones(4)) and torch.equal(local["ln.bias"], torch.zeros(4 * 26 * 26))
    assert SuPerFedMM(SuPerFedMMParams(mix_norm=False), model, seed=0).mixed == ["conv.weight", "head.weight"]


class WithPReLU(nn.Module):
    """A trainable activation: a layer type SuPerFed has no mixing rule for."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(784, 16), nn.PReLU())
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.body(x))


class ScaledLinear(nn.Linear):
    """A Linear with a parameter nn.Linear does not have: its role in the layer is unknown."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale = nn.Parameter(torch.ones(()))


def test_a_model_with_a_layer_it_cannot_mix_is_refused_naming_the_layer():
    for cls, params in ((SuPerFedMM, SuPerFedMMParams()), (SuPerFedLM, SuPerFedLMParams())):
        with pytest.raises(ConfigError, match=r"'body\.2' of type PReLU.*weight"):
            cls(params, WithPReLU(), seed=0)
    with pytest.raises(ConfigError, match=r"'body\.2' of type PReLU"):
        FedProx(FedProxParams(proximal="layer_norms"), WithPReLU(), seed=0)
    FedProx(FedProxParams(proximal="squared"), WithPReLU(), seed=0)  # the squared term covers every tensor anyway
    odd = nn.Sequential(nn.Flatten(), ScaledLinear(784, 3))
    with pytest.raises(ConfigError, match=r"'1' of type ScaledLinear.*scale"):
        SuPerFedMM(SuPerFedMMParams(), odd, seed=0)


def test_fedprox_layer_norms_cover_the_lstm():
    """mu * sum_t ||w_t - w_t^prev||: moving only an LSTM weight away from the anchor adds mu * its norm."""
    model = bundled("bilstm")
    w = params_of(model)
    prox = FedProx(FedProxParams(mu=0.5, proximal="layer_norms"), model, seed=0)
    x, y = torch.randint(2, 50, (5, 12)), torch.randint(0, 4, (5,))
    anchor = dict(w, **{"lstm.weight_hh_l0": w["lstm.weight_hh_l0"] + 0.01})
    base = prox.loss({"global": w, "anchor": w}, x, y, None)
    moved = prox.loss({"global": w, "anchor": anchor}, x, y, None)
    expected = 0.5 * 0.01 * math.sqrt(w["lstm.weight_hh_l0"].numel())
    assert float(moved - base) == pytest.approx(expected, rel=1e-4)
    assert {"lstm.weight_ih_l0", "lstm.weight_hh_l0", "lstm.weight_ih_l0_reverse", "lstm.weight_hh_l0_reverse"} <= set(prox.prox_names)


def test_superfed_terms_cover_the_lstm():
    """The proximity and orthogonality terms run over the LSTM's tensors too."""
    model = bundled("bilstm")
    g = params_of(model)
    algo = SuPerFedMM(SuPerFedMMParams(mu=1.0, nu=0.0), model, seed=0)
    x, y = torch.randint(2, 50, (5, 12)), torch.randint(0, 4, (5,))
    anchor = dict(g, **{"lstm.weight_ih_l0_reverse": g["lstm.weight_ih_l0_reverse"] - 0.02})
    base = algo.federation_loss({"global": g, "anchor": g}, x, y, None)
    moved = algo.federation_loss({"global": g, "anchor": anchor}, x, y, None)
    assert float(moved - base) == pytest.approx(0.02 * math.sqrt(g["lstm.weight_ih_l0_reverse"].numel()), rel=1e-4)
