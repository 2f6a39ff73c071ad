"""Penalty terms shared by several methods, written once and pinned by tests."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fedpipe.algorithms.base import Params


def proximal_squared(params: Params, anchor: Params) -> torch.Tensor:
    """(1/2) * ||w - w^t||^2 over every tensor: FedProx's proximal term without mu (Li et al. 2020, Eq. 2)."""
    terms = [(params[n] - anchor[n]).pow(2).sum() for n in params]
    return 0.5 * torch.stack(terms).sum()


def proximal_layer_norms(params: Params, anchor: Params, names: Iterable[str]) -> torch.Tensor:
    """Sum over layers of ||w_l - w_l^t||_2 (not squared): the proximity term of SuPerFed's official
    code (Hahn et al. 2022, Eq. 3, as restored in reference/superfed.md), over the weight tensors `names`."""
    return torch.stack([torch.linalg.vector_norm(params[n] - anchor[n]) for n in names]).sum()


def squared_cosine(a: Params, b: Params, names: Iterable[str]) -> torch.Tensor:
    """cos^2 of the concatenated vectors: (sum_l <a_l, b_l>)^2 / (sum_l ||a_l||^2 * sum_l ||b_l||^2).

    SuPerFed's orthogonality term (Eq. 3). The official code adds 1e-6 per element inside the dot
    product; that quirk is left out (reference/superfed.md).
    """
    names = list(names)
    dot = torch.stack([(a[n] * b[n]).sum() for n in names]).sum()
    norm_a = torch.stack([a[n].pow(2).sum() for n in names]).sum()
    norm_b = torch.stack([b[n].pow(2).sum() for n in names]).sum()
    return dot.pow(2) / (norm_a * norm_b)


def weight_names(params: Params) -> list[str]:
    """The weight tensors (not biases) of conv / linear layers: where SuPerFed's code applies its terms."""
    return [n for n, t in params.items() if n.endswith("weight") and t.dim() > 1]
