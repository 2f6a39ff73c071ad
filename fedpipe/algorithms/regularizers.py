"""Penalty terms shared by several methods, written once and pinned by tests."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from fedpipe.algorithms.base import Params
from fedpipe.errors import ConfigError


def proximal_squared(params: Params, anchor: Params) -> torch.Tensor:
    """(1/2) * ||w - w^t||^2 over every tensor: FedProx's proximal term without mu (Li et al. 2020, Eq. 2)."""
    terms = [(params[n] - anchor[n]).pow(2).sum() for n in params]
    return 0.5 * torch.stack(terms).sum()


def proximal_layer_norms(params: Params, anchor: Params, names: Iterable[str]) -> torch.Tensor:
    """Sum over layers of ||w_l - w_l^t||_2 (not squared): the proximity term of SuPerFed's official
    code (Hahn et al. 2022, Eq. 3, as the official src/algorithm.py's superfed_update computes it), one norm per tensor in `names`
    (the mixed tensors of `mixable_layers`)."""
    return torch.stack([torch.linalg.vector_norm(params[n] - anchor[n]) for n in names]).sum()


def squared_cosine(a: Params, b: Params, names: Iterable[str]) -> torch.Tensor:
    """cos^2 of the concatenated vectors: (sum_l <a_l, b_l>)^2 / (sum_l ||a_l||^2 * sum_l ||b_l||^2).

    SuPerFed's orthogonality term (Eq. 3). The official code adds 1e-6 per element inside the dot
    product; that quirk is left out (docs/methods/superfed.md).
    """
    names = list(names)
    dot = torch.stack([(a[n] * b[n]).sum() for n in names]).sum()
    norm_a = torch.stack([a[n].pow(2).sum() for n in names]).sum()
    norm_b = torch.stack([b[n].pow(2).sum() for n in names]).sum()
    return dot.pow(2) / (norm_a * norm_b)


# --- which tensors SuPerFed mixes (and FedProx's `layer_norms` covers), chosen by module type -------

_CONV_LINEAR = (nn.modules.conv._ConvNd, nn.Linear)
_EMBEDDING = (nn.Embedding, nn.EmbeddingBag)
_RNN = (nn.RNNBase, nn.RNNCellBase)  # RNN, LSTM, GRU and their cells
_NORM = tuple(t for t in (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, getattr(nn, "RMSNorm", None)) if t is not None)
MIXABLE_TYPES = "Conv*/ConvTranspose*, Linear, Embedding/EmbeddingBag, RNN/LSTM/GRU (and their cells), BatchNorm*/InstanceNorm*/LayerNorm/GroupNorm/RMSNorm"


def layer_kind(module: nn.Module) -> str | None:
    """'conv_linear', 'embedding', 'rnn' or 'norm' for a layer type SuPerFed can mix, else None."""
    if isinstance(module, _CONV_LINEAR):
        return "conv_linear"
    if isinstance(module, _EMBEDDING):
        return "embedding"
    if isinstance(module, _RNN):
        return "rnn"
    if isinstance(module, _NORM):
        return "norm"
    return None


def _is_bias(kind: str, name: str) -> bool:
    return name.startswith("bias") if kind == "rnn" else name == "bias"


def _known(kind: str, name: str) -> bool:
    if kind == "rnn":  # weight_ih_l0, weight_hh_l0_reverse, weight_hr_l1 (projections), bias_ih_l0, ...
        return name.startswith(("weight_", "bias_"))
    if kind == "embedding":
        return name == "weight"
    return name in ("weight", "bias")


def mixable_layers(model: nn.Module, *, bias: bool = False, norm: bool = True) -> dict[str, list[str]]:
    """The layers SuPerFed mixes and the parameters of each: {module name: [parameter names]}, in the
    model's order. A layer is a module; it is chosen by its type, never by its parameters' names:

    - Conv*/ConvTranspose*, Linear: `weight`, and `bias` when `bias`;
    - RNN/LSTM/GRU (and cells): every `weight_*` (input-hidden, hidden-hidden, projection, both
      directions, every stacked layer), and every `bias_*` when `bias`;
    - Embedding/EmbeddingBag: `weight`;
    - BatchNorm*/InstanceNorm*/LayerNorm/GroupNorm/RMSNorm: the affine `weight` and `bias`, when `norm`
      (both or neither: the official LinesBN mixes both).

    What is left out (biases without `bias`, norm layers without `norm`) stays shared between the
    global and the local model. A module holding trainable parameters of any other type, or a
    parameter these types do not have, is a ConfigError naming it: mixing it by guess would silently
    leave it unpersonalized or mix something whose role is unknown. SuPerFed's defaults (`mix_bias`
    False, `mix_norm` True) are these arguments' defaults, which FedProx's `layer_norms` uses.
    """
    owned = {name for name, _ in model.named_parameters()}  # tied parameters once, under their first owner
    groups: dict[str, list[str]] = {}
    for path, module in model.named_modules():
        direct = [(f"{path}.{n}" if path else n, n) for n, p in module.named_parameters(recurse=False)]
        direct = [(full, n) for full, n in direct if full in owned]
        if not direct:
            continue
        kind = layer_kind(module)
        where = f"{path!r}" if path else "the model itself"
        if kind is None:
            raise ConfigError(
                f"SuPerFed cannot mix layer {where} of type {type(module).__name__} (trainable parameters "
                f"{', '.join(n for _, n in direct)}): it mixes {MIXABLE_TYPES} layers, chosen by module type. "
                f"Use a model built from those layers."
            )
        unknown = [n for _, n in direct if not _known(kind, n)]
        if unknown:
            raise ConfigError(
                f"SuPerFed cannot mix layer {where} of type {type(module).__name__}: its parameter(s) "
                f"{', '.join(unknown)} are not ones a {kind.replace('_', '/')} layer has, so their role in the "
                f"layer is unknown. Use a model built from plain {MIXABLE_TYPES} layers."
            )
        if kind == "norm":
            picked = [full for full, _ in direct] if norm else []
        else:
            picked = [full for full, n in direct if bias or not _is_bias(kind, n)]
        if picked:
            groups[path] = picked
    if not groups:
        raise ConfigError(f"{type(model).__name__} has no layer SuPerFed can mix (it mixes {MIXABLE_TYPES}).")
    return groups
