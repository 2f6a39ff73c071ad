"""Differential privacy in a federation: the `privacy` section's two modes, split between the server and the sites.

The mechanism is the engine's (`fedpipe.engine.privacy.Privacy`, DP-FedAvg of McMahan et al. 2018 with the adaptive
clip of Andrew et al. 2021), used on both sides exactly as the simulation uses it:

- the server (`server_privacy`) samples each round's sites by Poisson sampling, keeps the accountant's ledger, adapts
  the clip, and in central mode adds the Gaussian noise to the sum of the sites' clipped updates
  (`fedpipe.engine.rounds.run_round`'s private path); its draws are keyed by its own secret, `privacy-secret` in the
  ServerApp's out folder (32 bytes from os.urandom, written before the first private round, so a resumed round repeats
  its release), as `Run.noise_secret` keys the simulation's;
- each site (`site_privacy`) clips its own update with the clip the server sends (`privacy-clip` in the round's
  config) and, in local mode, adds its own noise before anything leaves it (`Privacy.privatize`), keyed by the site's
  own secret (`privacy-secret` in its folder, never sent): the server cannot subtract it. The site reports its
  update's norm before clipping (`update-norm`), which adaptive clipping counts, as the simulation's server does;
  under SecAgg+ it masks its centred clip bit with its update instead (`masked_layout`), and reports no norm.

With `privacy.seeded_noise` every draw is keyed by the seed instead (tests and reproductions only: the noise is then
known to anyone with the config), and a federation then releases exactly what the simulation releases.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fedpipe.algorithms.base import Phase
from fedpipe.engine.privacy import CLIP_BIT, Privacy, noise_generator

SECRET = "privacy-secret"


def secret_in(folder: str | Path) -> bytes:
    """The 32-byte noise secret kept in `folder`, made (atomically) on first use."""
    path = Path(folder) / SECRET
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(os.urandom(32))
        tmp.chmod(0o600)
        tmp.replace(path)
    data = path.read_bytes()
    if len(data) != 32:
        raise ValueError(f"{path} holds {len(data)} bytes, not a 32-byte noise secret: remove it only if no private round ran")
    return data


def sample_rate(spec, phase: Phase) -> float:
    """q of a communicating phase: train.client_fraction when it samples clients (Poisson), else 1 (as
    `fedpipe.run.privacy.sample_rate` computes it for the simulation)."""
    return spec.train_cfg.client_fraction if phase.sample_clients else 1.0


def server_privacy(spec, phase: Phase, eligible: int, out: str | Path) -> Privacy | None:
    """The server's Privacy for `phase` (None without privacy or for a phase that sends nothing); `eligible`: the
    sites that may join its rounds (W)."""
    cfg = spec.privacy_cfg
    if cfg is None or not phase.communicates:
        return None
    if eligible < 1:
        raise ValueError(f"no site can take part in phase {phase.name!r}: every site opted out")
    return Privacy(cfg, spec.seed, sample_rate(spec, phase), eligible, None if cfg.seeded_noise else secret_in(out))


def site_privacy(spec, phase: Phase, clip: float | None, folder: str | Path) -> Privacy | None:
    """A site's Privacy for its round of `phase`: it clips with the server's `clip` and, in local mode, noises with its
    own secret. q and W only size the server's count noise; the site's Privacy takes them as 1."""
    cfg = spec.privacy_cfg
    if cfg is None or not phase.communicates:
        return None
    if clip is None:
        raise ValueError("a private round's config carries the server's clip (privacy-clip); this one did not")
    made = Privacy(cfg.model_copy(update={"adaptive_clip": False}), spec.seed, 1.0, 1,
                   None if cfg.seeded_noise else secret_in(folder))
    made.clip = float(clip)
    return made


def noised_counts(cfg, seed: int, secret: bytes | None, digest: str, counts: dict[str, list[int]]) -> dict[str, list[int]]:
    """A site's label histogram as a private census releases it: the Gaussian mechanism, each count plus
    N(0, census_noise_multiplier^2) (one record added or removed changes one count by 1: L2 sensitivity 1), then
    rounded and floored at 0 (post-processing). The draws are keyed by the site's own secret and its data's snapshot
    digest: a census of the same data releases the same numbers again (nothing new to count), new data fresh ones."""
    z = float(cfg.census_noise_multiplier)
    out = {}
    for split in sorted(counts):
        gen = noise_generator(cfg, seed, secret, "dp-census", digest, split)
        noise = torch.normal(0.0, z, size=(len(counts[split]),), generator=gen, dtype=torch.float64).tolist()
        out[split] = [max(0, round(c + n)) for c, n in zip(counts[split], noise)]
    return out


def census_release(spec) -> float | None:
    """The noise multiplier of a private census's label counts (`privacy.census_noise_multiplier`), which the accountant
    spends once at sample rate 1; None when nothing is released that way (no privacy, or the counts withheld)."""
    cfg = spec.privacy_cfg
    if cfg is None or cfg.census_noise_multiplier is None or not spec.site_data:
        return None
    return float(cfg.census_noise_multiplier)


def masked_layout(layout: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """What a private site puts under SecAgg+'s masks, for `layout` the method's upload: its clipped update, float64 (as
    `Privacy.privatize` makes it), and with adaptive clipping its centred clip bit (`CLIP_BIT`, one value), so that the
    server learns only the bits' sum. The site builds its upload in this layout and the server reads the sum by it."""
    masked = {k: t.to(torch.float64) for k, t in layout.items()}
    if cfg.adaptive_clip:
        masked[CLIP_BIT] = torch.zeros(1, dtype=torch.float64)
    return masked
