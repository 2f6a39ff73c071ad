"""Robust aggregation (`train.robust`): the server's rules against poisoned uploads, pure and in float64.

For a phase whose aggregate is the plain weighted mean (`uses_weighted_mean`), the engine's round
(`fedpipe.engine.rounds.run_round`) replaces `weighted_average` by `robust_average` when `train.robust` is active;
the result goes through `Algorithm.apply_average` as the weighted mean would. Every rule works on the clients'
updates u_k = upload_k - global (the uploaded tensors minus their global counterparts), flattened over the uploaded
tensors in the order of the first upload, and the new value is global + the rule's combination of the updates
(for the median and the trimmed mean that is the same as applying the rule to the uploads themselves):

- norm bounding, u_k <- u_k * min(1, M / ||u_k||_2) (Sun, Kairouz, Suresh and McMahan 2019, "Can you really backdoor
  federated learning?", Sec. 4), applied first, then any rule below (or the weighted mean);
- the coordinate-wise median and the coordinate-wise beta-trimmed mean (Yin, Chen, Ramchandran and Bartlett, ICML
  2018, "Byzantine-robust distributed learning: towards optimal statistical rates", Sec. 3, Options I and II);
- multi-Krum (Blanchard, El Mhamdi, Guerraoui and Stainer, NeurIPS 2017, "Machine learning with adversaries:
  Byzantine tolerant gradient descent", Sec. 4 and 5).

The median, the trimmed mean and multi-Krum are unweighted, as in their papers: the sample counts the clients report
do not enter them (an inflated count moves nothing). An upload with a non-finite value is left out before any rule
(the engine already leaves such a client out of its round, `fedpipe.engine.clients`; this keeps the rule safe when
called on its own). The result does not depend on the order of the uploads, except multi-Krum's ties in score, which
go to the earlier upload.
"""

from __future__ import annotations

import math

import torch

from fedpipe.algorithms.aggregation import Params, uses_weighted_mean, weighted_average
from fedpipe.config import RobustConfig

#: Why SecAgg+ cannot run with a robust rule (federation.secure_aggregation with train.robust active).
SECURE_AGGREGATION_REFUSAL = (
    "train.robust cannot run with federation.secure_aggregation: SecAgg+ hides each single update from the server, so "
    "median, trimmed mean, multi-Krum and server-side norm bounding cannot run there; only a bound each site applies to "
    "its own update fits, which an honest site applies and a dishonest one does not. Set train.robust.rule=mean and "
    "leave train.robust.norm_bound unset, or turn federation.secure_aggregation off")

#: Why privacy.enabled cannot run with a robust rule.
PRIVACY_REFUSAL = (
    "train.robust cannot run with privacy.enabled: privacy's clipping already bounds each update's norm (privacy.clip), "
    "and its accountant assumes the server adds the noised sum of the clipped updates, which a median, trimmed mean or "
    "multi-Krum is not. Set train.robust.rule=mean and leave train.robust.norm_bound unset, or turn privacy off")


# --- the rules, on a matrix of updates (one row per client) -----------------------------------------
def bound_norms(updates: torch.Tensor, bound: float) -> torch.Tensor:
    """Each row u_k scaled by min(1, M / ||u_k||_2) (Sun et al. 2019, Sec. 4: norm bounding); a zero row stays zero."""
    norms = updates.norm(dim=1, keepdim=True)
    return updates * torch.clamp(bound / norms.clamp_min(torch.finfo(updates.dtype).tiny), max=1.0)


def coordinate_median(updates: torch.Tensor) -> torch.Tensor:
    """med{u_k}_j per coordinate j (Yin et al. 2018, Sec. 3, Option I); with an even count, the mean of the two
    middle values (the usual median; torch.median would give the lower one)."""
    ordered, _ = torch.sort(updates, dim=0)
    n = ordered.shape[0]
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2


def trimmed_mean(updates: torch.Tensor, beta: float) -> torch.Tensor:
    """trmean_beta{u_k}_j (Yin et al. 2018, Sec. 3, Option II, Definition 2): per coordinate the floor(beta * n) largest
    and the floor(beta * n) smallest values dropped, the other n - 2 floor(beta * n) averaged (0 <= beta < 1/2, so at
    least one stays)."""
    if not 0 <= beta < 0.5:
        raise ValueError(f"train.robust.trim_fraction={beta} must be at least 0 and below 0.5")
    n = updates.shape[0]
    k = math.floor(beta * n)
    ordered, _ = torch.sort(updates, dim=0)
    return ordered[k : n - k].mean(dim=0)


def krum_scores(updates: torch.Tensor, byzantine: int) -> torch.Tensor:
    """s(k) = sum of ||u_k - u_j||^2 over the n - f - 2 updates u_j (j != k) nearest to u_k (Blanchard et al. 2017,
    Sec. 4: the Krum score), for n > 2f + 2 updates."""
    n = updates.shape[0]
    if n <= 2 * byzantine + 2:
        raise ValueError(f"multi-Krum with train.robust.byzantine={byzantine} needs more than 2f + 2 = {2 * byzantine + 2} "
                         f"uploads in a round, and {n} came: sample more clients a round (train.client_fraction) or lower "
                         "train.robust.byzantine")
    squared = torch.stack([(updates - u).pow(2).sum(dim=1) for u in updates])  # row by row: exact, O(n d) memory a row
    squared.fill_diagonal_(math.inf)  # a client is not its own neighbour
    nearest, _ = torch.sort(squared, dim=1)
    return nearest[:, : n - byzantine - 2].sum(dim=1)


def multi_krum(updates: torch.Tensor, byzantine: int, keep: int | None = None) -> tuple[torch.Tensor, list[int]]:
    """The mean of the m updates with the lowest Krum scores (Blanchard et al. 2017, Sec. 5: multi-Krum; m = 1 is Krum),
    m = `keep` or n - f, and the rows it kept (ascending score, ties to the earlier row)."""
    n = updates.shape[0]
    scores = krum_scores(updates, byzantine)
    m = n - byzantine if keep is None else keep
    if m > n:
        raise ValueError(f"train.robust.krum_keep={m} is more than the {n} uploads of the round: lower it, or leave it unset "
                         "(n - f)")
    chosen = sorted(range(n), key=lambda k: (float(scores[k]), k))[:m]
    return updates[chosen].mean(dim=0), chosen


# --- the server's aggregate ---------------------------------------------------------------------------
def robust_average(global_params: Params, tensors: list[Params], weights: list[float], cfg: RobustConfig) -> Params:
    """What replaces `weighted_average(tensors, weights)` under `cfg`: global + the rule's combination of the (norm
    bounded) updates, per uploaded tensor, cast back to the upload's dtype. `weights` (the sample counts) enter only
    rule=mean. ValueError when no upload is finite, an uploaded tensor has no global counterpart, or multi-Krum has
    too few uploads."""
    names = list(tensors[0]) if tensors else []
    missing = [n for n in names if n not in global_params]
    if missing:
        raise ValueError(f"the uploaded tensor {missing[0]!r} has no global counterpart to take an update against")
    rows, kept = [], []
    for t, w in zip(tensors, weights):
        flat = torch.cat([(t[n].detach().to(torch.float64) - global_params[n].detach().to(torch.float64)).flatten().cpu() for n in names])
        if torch.isfinite(flat).all():
            rows.append(flat)
            kept.append(float(w))
    if not rows:
        raise ValueError("no upload of the round is finite: nothing to aggregate")
    updates = torch.stack(rows)
    if cfg.norm_bound is not None:
        updates = bound_norms(updates, cfg.norm_bound)
    if cfg.rule == "mean":
        combined = weighted_average([{"u": u} for u in updates], kept)["u"]  # FedAvg's weighted mean of the updates
    elif cfg.rule == "median":
        combined = coordinate_median(updates)
    elif cfg.rule == "trimmed_mean":
        combined = trimmed_mean(updates, cfg.trim_fraction)
    elif cfg.rule == "multi_krum":
        combined, _ = multi_krum(updates, cfg.byzantine, cfg.krum_keep)
    else:
        raise ValueError(f"unknown train.robust.rule {cfg.rule!r}")
    out, at = {}, 0
    for n in names:
        g = global_params[n]
        size = g.numel()
        out[n] = (g.detach().to(torch.float64) + combined[at : at + size].view(g.shape).to(g.device)).to(tensors[0][n].dtype)
        at += size
    return out


def robust_problem(algorithm, phases, cfg: RobustConfig) -> str | None:
    """Why `cfg` (active) cannot apply to this configured method, or None: a communicating phase aggregated by a
    rule of the method's own, which the robust rules do not replace."""
    if not cfg.active:
        return None
    for phase in phases:
        if phase.communicates and not uses_weighted_mean(algorithm, phase):
            return (f"{cfg.describe()} applies to methods whose aggregate is a weighted mean (FedAvg, FedProx, ...: `fedpipe "
                    f"methods`); {algorithm.name} aggregates its phase {phase.name!r} by its own rule "
                    f"({algorithm.aggregation(phase).description}): set train.robust.rule=mean and leave "
                    "train.robust.norm_bound unset")
    return None


__all__ = ["PRIVACY_REFUSAL", "SECURE_AGGREGATION_REFUSAL", "bound_norms", "coordinate_median", "krum_scores", "multi_krum",
           "robust_average", "robust_problem", "trimmed_mean"]
