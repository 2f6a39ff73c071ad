"""Server-side aggregation, declared as data and kept small and pure.

Every method declares, per phase, how its server combines the round's uploads
(`Algorithm.aggregation(phase)`):

- `WEIGHTED_MEAN`: the sample-weighted mean of the uploaded tensors replaces their global
  counterparts (FedAvg, McMahan et al. 2017, Algorithm 1); `Algorithm.aggregate` is then
  `apply_average(server, weighted_average(uploads, samples))`. Because that mean is a sum divided
  last, a distributed phase may all-reduce the ranks' `weighted_sum`s instead of gathering uploads
  (`uses_weighted_mean` says when);
- `NO_UPLOADS`: the phase does not communicate (local training, fine-tuning, an assignment step);
- `custom(description)`: the method's own rule (cluster models, attention, alpha weights, ...), run
  by its own `aggregate` on the gathered uploads.

The arithmetic is the one float64 weighted sum `weighted_sum`, which the mean and methods with other
rules (FedAMP's cloud models) share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

Params = dict[str, torch.Tensor]  # parameters by the module's names (re-exported by fedpipe.algorithms.base)


@dataclass(frozen=True)
class Aggregation:
    """How a phase's uploads become the next server state: `kind` is "weighted_mean", "none" or
    "custom"; `description` says it in one line (for a custom rule: which rule)."""

    kind: str
    description: str

    @property
    def is_weighted_mean(self) -> bool:
        return self.kind == "weighted_mean"


WEIGHTED_MEAN = Aggregation(
    "weighted_mean", "the sample-weighted mean of the uploaded tensors replaces their global counterparts (FedAvg)")
NO_UPLOADS = Aggregation("none", "the phase does not communicate: nothing is aggregated")


def custom(description: str) -> Aggregation:
    """A method's own aggregation rule, described in one line."""
    return Aggregation("custom", description)


class _Phase(Protocol):  # fedpipe.algorithms.base.Phase (this module sits below base: no import)
    @property
    def communicates(self) -> bool: ...


class _Declares(Protocol):  # fedpipe.algorithms.base.Algorithm
    def aggregation(self, phase) -> Aggregation: ...


def uses_weighted_mean(algorithm: _Declares, phase: _Phase) -> bool:
    """True when `phase` communicates and `algorithm` aggregates it by the plain weighted mean: its
    `aggregate` equals `algorithm.apply_average(server, weighted_average(tensors, num_samples))`,
    so the uploads' weighted sums may be all-reduced instead of gathered."""
    return phase.communicates and algorithm.aggregation(phase).is_weighted_mean


def weighted_sum(tensors: list[Params], weights: list[float]) -> Params:
    """Sum_k w_k * theta_k per tensor, in float64 (no division, no cast back), over the names of the
    first; the terms are added in the order given. Empty lists give an empty dict."""
    out: Params = {}
    if not tensors:
        return out
    for name in tensors[0]:
        acc = torch.zeros_like(tensors[0][name], dtype=torch.float64)
        for t, w in zip(tensors, weights):
            acc.add_(t[name].to(torch.float64), alpha=w)
        out[name] = acc
    return out


def weighted_average(tensors: list[Params], weights: list[float]) -> Params:
    """Sum_k w_k * theta_k / Sum_k w_k, per tensor (FedAvg, McMahan et al. 2017, Algorithm 1).

    The weighted sum is taken in float64 and divided last, then cast back: the result does not depend
    on the clients' order (or on how a distributed phase splits the sum over processes) beyond float64
    rounding.
    """
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("aggregation weights must sum to a positive number")
    sums = weighted_sum(tensors, weights)
    return {name: (acc / total).to(tensors[0][name].dtype) for name, acc in sums.items()}


__all__ = ["NO_UPLOADS", "WEIGHTED_MEAN", "Aggregation", "custom", "uses_weighted_mean", "weighted_average", "weighted_sum"]
