"""User-level differential privacy on the upload path (the `privacy` config section), applied by the
engine to what a method declares it uploads, never to its personal state.

DP-FedAvg (McMahan, Ramage, Talwar and Zhang 2018, "Learning differentially private recurrent language
models", Algorithm 1), per communicating round:

1. Poisson sampling: every eligible client joins with probability q (train.client_fraction), on its own
   (`poisson_sample`); the accountant's amplification by sampling assumes exactly this.
2. Client side (`Privacy.privatize`, in whichever process trains the client): the update
   Delta_k = upload_k - download_k is clipped, Delta_k * min(1, C / ||Delta_k||) (flat, Algorithm 1's
   ClipFn), or each tensor to C / sqrt(L) (per layer, Sec. 3: the flat norm stays within C); the norms of
   all of a process's clients at once, from stacked tensors. In local mode the client then adds
   N(0, sigma^2 C^2 I) to its own clipped update.
3. Server side (`Privacy.aggregate`): theta + (sum_k Delta_k + N(0, sigma^2 C^2 I)) / (q W) with equal
   weights w_k = 1 and W the number of eligible clients: the fixed-denominator estimator f~_f of
   Algorithm 1, whose sensitivity is C / (q W) whatever the round's cohort (in local mode no noise is added
   here: each update already carries its own).

A sample-weighted mean would let a client with many samples move the model further than C allows, so
with privacy every client counts once.

Adaptive clipping (`privacy.adaptive_clip`; Andrew, Thakkar, McMahan and Ramaswamy 2021, Algorithm 1): after
each round the server releases the count of clients whose update norm was within C, each bit centred
(1[||Delta_k|| <= C] - 1/2, as TF Privacy's QuantileEstimatorQuery does), with noise N(0, sigma_b^2):
b~ = (sum_k (1[||Delta_k|| <= C] - 1/2) + N(0, sigma_b^2)) / (q W) + 1/2, and moves
C <- C * exp(-eta_C (b~ - gamma)) (the geometric update) towards the gamma-quantile of the norms. Centred,
one client added or removed moves the released sum by exactly 1/2, the sensitivity their Theorem 1 assumes:
two Gaussian releases per round then cost what one at noise multiplier sigma costs when the updates' own
multiplier is sigma_Delta = (sigma^-2 - (2 sigma_b)^-2)^(-1/2), so the accountant keeps counting sigma and the
updates carry sigma_Delta * C. (An uncentred count has sensitivity 1 and would need (sigma_b)^-2 in place of
(2 sigma_b)^-2: the round would then cost more than the accountant counts.)

Every draw (the sample, the central, local and count noise) comes from a generator keyed by (purpose, round,
client) under the run's secret (`privacy_secret`, persisted by the run before its first release): a round
replayed after a crash between its report and its checkpoint draws the same sample and the same noise, so it
repeats its release instead of releasing the round a second time with fresh noise (which the ledger, counting
the round once, would not cover).
"""

from __future__ import annotations

import hashlib
import math
import os

import torch

from fedpipe.algorithms.aggregation import Params
from fedpipe.config import PrivacyConfig
from fedpipe.seeding import torch_generator

#: Bytes of a run's noise secret (256 bits, from the operating system's entropy)
SECRET_BYTES = 32
#: Under secure aggregation, each client's centred clip bit travels inside the masked sum under this name (a (1,) float64
#: tensor, 1[||Delta_k|| <= C] - 1/2), so the server learns only the count adaptive clipping releases, never one bit
CLIP_BIT = "privacy/clip-bit"


def centred_bit(norm: float, clip: float) -> float:
    """A client's contribution to adaptive clipping's count: 1[||Delta_k|| <= C] - 1/2 (Andrew et al. 2021, centred)."""
    return (1.0 if norm <= clip else 0.0) - 0.5


def new_secret() -> bytes:
    """A run's noise secret: drawn once, persisted by the run before its first release."""
    return os.urandom(SECRET_BYTES)


def noise_generator(cfg: PrivacyConfig, seed: int, secret: bytes | None, *key) -> torch.Generator:
    """The generator of one draw, named by `key` (purpose, round, client): seeded by (run seed, key) with
    `seeded_noise` (reproducible, not private); else by SHA-256 of (the run's secret, key), so a replayed round
    draws what it drew the first time while nobody without the secret can; with no secret (a bare `Privacy`
    outside a run), from the operating system's entropy."""
    if cfg.seeded_noise:
        return torch_generator(seed, *key)
    if secret is None:
        return torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
    digest = hashlib.sha256(secret + repr(tuple(key)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def poisson_sample(pool: list[int], q: float, cfg: PrivacyConfig, seed: int, round_: int, secret: bytes | None = None) -> list[int]:
    """Each client of `pool` independently with probability q (the round may be empty)."""
    if q >= 1:
        return list(pool)
    draws = torch.rand(len(pool), generator=noise_generator(cfg, seed, secret, "poisson", round_), dtype=torch.float64)
    return sorted(c for c, u in zip(pool, draws.tolist()) if u < q)


def clip_updates(updates: list[Params], clip: float, per_layer: bool) -> tuple[list[Params], list[float]]:
    """The updates clipped (flat: to L2 norm `clip`; per layer: each tensor to clip / sqrt(L)), in float64,
    and each update's norm before clipping. Norms of all updates at once, from tensors stacked over clients."""
    if not updates:
        return [], []
    names = list(updates[0])
    stacked = {k: torch.stack([u[k].to(torch.float64) for u in updates]) for k in names}
    sq = torch.stack([stacked[k].flatten(1).pow(2).sum(1) for k in names], dim=1)  # (clients, tensors)
    norms = sq.sum(1).sqrt()
    if per_layer:
        bound = clip / math.sqrt(len(names))
        scale = torch.clamp(bound / sq.sqrt().clamp_min(1e-300), max=1.0)  # (clients, tensors)
    else:
        scale = torch.clamp(clip / norms.clamp_min(1e-300), max=1.0)[:, None].expand(-1, len(names))
    out = [{} for _ in updates]
    for j, k in enumerate(names):
        view = (-1,) + (1,) * (stacked[k].dim() - 1)
        clipped = stacked[k] * scale[:, j].reshape(view)
        for i in range(len(updates)):
            out[i][k] = clipped[i]
    return out, norms.tolist()


def gaussian_like(params: Params, std: float, generator: torch.Generator) -> Params:
    """N(0, std^2) per entry, float64, drawn on the CPU tensor after tensor in the order of the sorted names (the
    same numbers on any device, and whatever order a distributed all-reduce returns the names in)."""
    return {k: torch.normal(0.0, std, size=tuple(params[k].shape), generator=generator, dtype=torch.float64).to(params[k].device)
            for k in sorted(params)}


class Privacy:
    """The `privacy` section at work in one phase: `privatize` on the client side, `aggregate` on the
    server's. `eligible` is W, the number of clients that may join the phase's rounds; `q` their sample rate;
    `secret` the run's noise secret (`new_secret`; None: fresh entropy for every draw)."""

    def __init__(self, cfg: PrivacyConfig, seed: int, q: float, eligible: int, secret: bytes | None = None):
        self.cfg, self.seed, self.q, self.eligible, self.secret = cfg, seed, q, eligible, secret
        self.keys: list[str] | None = None  # the names uploaded in this phase (learnt from its first upload)
        self.clip = cfg.clip  # C of the current round (moves with adaptive_clip; kept in the ledger for a resume)
        self.count_std = cfg.clip_count_stddev if cfg.clip_count_stddev is not None else max(q * eligible, 1.0) / 20
        if cfg.adaptive_clip and self.sigma > 0 and 2 * self.count_std <= self.sigma:
            raise ValueError(f"privacy.clip_count_stddev ({self.count_std:g}) must exceed noise_multiplier / 2 "
                             f"({self.sigma / 2:g}): raise it, or lower noise_multiplier (Andrew et al. 2021, Theorem 1)")

    @property
    def sigma(self) -> float:
        """The round's noise multiplier as the accountant counts it."""
        return self.cfg.noise_multiplier

    @property
    def update_sigma(self) -> float:
        """The noise multiplier on the updates' sum: sigma, or with adaptive clipping the larger sigma_Delta that
        leaves room for the count's noise (Andrew et al. 2021, Theorem 1)."""
        if not self.cfg.adaptive_clip or self.sigma == 0:
            return self.sigma
        return (self.sigma ** -2 - (2 * self.count_std) ** -2) ** -0.5

    def generator(self, *key) -> torch.Generator:
        """The generator of the draw named by `key` (see `noise_generator`)."""
        return noise_generator(self.cfg, self.seed, self.secret, *key)

    def noised_count(self, norms: list[float], round_: int, centred: float | None = None) -> float:
        """What adaptive clipping releases of a round: sum_k (1[||Delta_k|| <= C] - 1/2) + N(0, sigma_b^2). The bits
        are centred (TF Privacy's QuantileEstimatorQuery: "a single value in {-0.5, 0.5}"), so adding or removing
        one client moves the sum by 1/2: the sensitivity Andrew et al. 2021's Theorem 1 (and `update_sigma`) assume.
        `centred`: that sum already made (secure aggregation sums the bits under its masks); else from `norms`."""
        within = sum(centred_bit(n, self.clip) for n in norms) if centred is None else float(centred)
        if self.sigma > 0:  # no noise on the count either when the updates carry none (no guarantee to keep)
            within += float(torch.normal(0.0, self.count_std, size=(1,), generator=self.generator("dp-count", round_), dtype=torch.float64))
        return within

    def adapt(self, norms: list[float], round_: int, centred: float | None = None) -> float:
        """The clip after a round whose clients' update norms (before clipping) were `norms` (or whose centred bits
        summed to `centred`): the geometric update of Andrew et al. 2021, Algorithm 1, on the noised fraction of
        clients within the clip, b~ = noised_count / (q W) + 1/2 (the centring undone after the fixed denominator).
        Returns the new C."""
        if not self.cfg.adaptive_clip:
            return self.clip
        fraction = self.noised_count(norms, round_, centred) / max(self.q * self.eligible, 1e-12) + 0.5
        self.clip = self.clip * math.exp(-self.cfg.clip_lr * (fraction - self.cfg.target_quantile))
        return self.clip

    def privatize(self, client_ids: list[int], uploads: list[Params], downloads: list[Params], round_: int) -> tuple[list[Params], list[float]]:
        """Each client's clipped update (upload minus download, float64), with its own noise in local mode;
        and the norms before clipping."""
        updates = [{k: up[k].to(torch.float64) - down[k].to(torch.float64) for k in up} for up, down in zip(uploads, downloads)]
        clipped, norms = clip_updates(updates, self.clip, self.cfg.per_layer)
        if self.cfg.mode == "local" and self.sigma > 0:
            for cid, update in zip(client_ids, clipped):
                noise = gaussian_like(update, self.sigma * self.clip, self.generator("dp-local", round_, cid))
                for k in update:
                    update[k] = update[k] + noise[k]
        return clipped, norms

    def aggregate(self, global_params: Params, summed: Params | None, round_: int) -> Params:
        """The new values of the uploaded tensors: theta + (sum of the clipped updates [+ the central noise]) / (q W).
        `summed` None (nobody uploaded): the noise alone moves the model in central mode (the round is still
        released and accounted); nothing changes in local mode."""
        denominator = max(self.q * self.eligible, 1e-12)
        if summed is None:
            if self.cfg.mode == "local" or self.sigma == 0:
                return {}
            # an empty Poisson round is still released (and accounted): noise alone on what the phase uploads
            # (every global tensor when no upload was seen yet in this process)
            keys = self.keys or list(global_params)
            summed = {k: torch.zeros_like(global_params[k], dtype=torch.float64) for k in keys}
        self.keys = list(summed)
        total = dict(summed)
        if self.cfg.mode == "central" and self.sigma > 0:
            noise = gaussian_like(total, self.update_sigma * self.clip, self.generator("dp-central", round_))
            total = {k: v + noise[k] for k, v in total.items()}
        return {k: (global_params[k].to(torch.float64) + v.to(global_params[k].device) / denominator).to(global_params[k].dtype)
                for k, v in total.items()}


def sum_updates(updates: list[Params]) -> Params | None:
    """sum_k Delta_k, float64, in the order given (None for no update)."""
    if not updates:
        return None
    out = {k: torch.zeros_like(t, dtype=torch.float64) for k, t in updates[0].items()}
    for u in updates:
        for k in out:
            out[k] += u[k].to(torch.float64)
    return out
