"""A run's differential privacy (the `privacy` section) from its config: the rounds the accountant counts, the
noise multiplier calibrated to a budget (`privacy.on_target=calibrate`, `fedpipe privacy plan`), the engine's
`Privacy` for a phase, and the report's privacy figures."""

from __future__ import annotations

import logging
from collections.abc import Callable

from fedpipe.algorithms import phases_of
from fedpipe.algorithms.base import Algorithm, Phase, privacy_problem
from fedpipe.config import PrivacyConfig
from fedpipe.data.federated import FederatedData
from fedpipe.engine.accounting import Ledger, calibrate, default_delta, epsilon_against_server, epsilon_of
from fedpipe.engine.privacy import Privacy
from fedpipe.engine.rounds import eligible_clients
from fedpipe.engine.state import PhaseState
from fedpipe.errors import ConfigError
from fedpipe.run.config import RunConfig

log = logging.getLogger(__name__)


def sample_rate(cfg: RunConfig, phase: Phase) -> float:
    """q of a communicating phase: train.client_fraction when it samples clients (by Poisson), else 1."""
    return cfg.train.client_fraction if phase.sample_clients else 1.0


def accounted_rounds(cfg: RunConfig) -> list[tuple[float, int]]:
    """The planned private rounds, [(q, rounds)] per communicating phase in order (non-communicating phases,
    such as fine-tuning or Local's training, release nothing and cost nothing)."""
    return [(sample_rate(cfg, p), len(p.rounds)) for p in phases_of(cfg.method, cfg.train.rounds) if p.communicates]


def delta_of(cfg: RunConfig, num_clients: int) -> float:
    return cfg.privacy.delta if cfg.privacy.delta is not None else default_delta(num_clients)


def effective(cfg: RunConfig, num_clients: int) -> PrivacyConfig:
    """privacy as the run applies it: with on_target=calibrate, noise_multiplier set to the smallest that keeps
    the planned rounds within target_epsilon (deterministic: every phase, rank and resume computes the same)."""
    p = cfg.privacy
    plan = accounted_rounds(cfg)
    if not (p.enabled and p.on_target == "calibrate" and p.target_epsilon is not None and plan):
        return p
    try:
        sigma = calibrate(p.accountant, p.target_epsilon, delta_of(cfg, num_clients), tuple(plan))
    except ValueError as e:
        raise ConfigError(f"privacy.target_epsilon={p.target_epsilon}: {e}.") from None
    return p.model_copy(update={"noise_multiplier": sigma})


def phase_privacy(cfg: RunConfig, algorithm: Algorithm, phase: Phase, data: FederatedData,
                  secret: Callable[[], bytes] | None = None) -> Privacy | None:
    """The engine's `Privacy` for a communicating phase of a run with privacy.enabled (None otherwise); refuses a
    method it cannot cover (`privacy_problem`) and a phase no client may join. `secret` reads the run's noise
    secret (not needed with seeded_noise; None: fresh entropy for every draw, for a phase outside a run)."""
    if not cfg.privacy.enabled or not phase.communicates:
        return None
    problem = privacy_problem(algorithm, phases_of(cfg.method, cfg.train.rounds))
    if problem:
        raise ConfigError(f"{problem}. Choose a method that `fedpipe methods` lists as covered, or turn privacy off.")
    pool = eligible_clients(data, phase)
    if not pool:
        raise ConfigError(f"No client can take part in phase {phase.name!r}: every client is opt-out. Lower partition.opt_out_fraction.")
    if algorithm.privacy_caveat:
        log.warning("privacy: %s: %s", algorithm.name, algorithm.privacy_caveat)
    try:
        made = Privacy(effective(cfg, data.num_clients), cfg.run.seed, sample_rate(cfg, phase), len(pool))
    except ValueError as e:
        raise ConfigError(f"{e}.") from None
    if secret is not None and not cfg.privacy.seeded_noise:
        made.secret = secret()
    return made


def plan(cfg: RunConfig, num_clients: int, points: int = 10) -> dict:
    """What `fedpipe privacy plan` prints: the noise multiplier (calibrated to target_epsilon when one is set), the
    delta, the private rounds and the epsilon after each of up to `points` of them."""
    rounds = accounted_rounds(cfg)
    p = cfg.privacy
    delta = delta_of(cfg, num_clients)
    sigma = p.noise_multiplier
    calibrated = p.target_epsilon is not None and bool(rounds)
    if calibrated:
        try:
            sigma = calibrate(p.accountant, p.target_epsilon, delta, tuple(rounds))
        except ValueError as e:
            raise ConfigError(f"privacy.target_epsilon={p.target_epsilon}: {e}.") from None
    total = sum(n for _, n in rounds)
    step = max(1, -(-total // points))
    marks = sorted({*range(step, total + 1, step), total} - {0})
    return {"noise_multiplier": sigma, "calibrated": calibrated, "delta": delta, "accountant": p.accountant, "rounds": rounds,
            "private_rounds": total, "clip": p.clip, "mode": p.mode,
            "schedule": [(r, epsilon_of(p.accountant, _first_rounds(rounds, sigma, r), delta)) for r in marks]}


def _first_rounds(rounds: list[tuple[float, int]], sigma: float, count: int) -> list[list[float]]:
    """The accountant's history of the first `count` planned private rounds."""
    out, left = [], count
    for q, n in rounds:
        if left <= 0:
            break
        out.append([sigma, q, min(n, left)])
        left -= n
    return out


def privacy_summary(cfg: RunConfig, state: PhaseState) -> dict:
    """The report's privacy figures ({} with privacy off): epsilon at delta spent by the whole run, and how; what
    epsilon covers, what it does not, and what the report withholds (the summary's reader is told, not left to guess)."""
    if not cfg.privacy.enabled:
        return {}
    ledger: Ledger | None = state.privacy
    p = cfg.privacy
    # epsilon bounds what the noised aggregates of the uploads reveal; evaluation is unprivatised (as in the papers),
    # and the personalized models are each client's own, trained on its data without noise
    scope = {"covers": "the uploaded model updates of the communicating rounds",
             "not_covered": "evaluation on clients' data (accuracies, per-client table, partition heatmap); the personalized models "
                            "(trained without noise, kept by the server, stored by the model line)",
             "withheld": "per-round loss, clients, traffic, time, update norms, method statistics (run store only)"}
    if p.seeded_noise:  # anyone who holds the config can redraw the noise and subtract it
        scope["not_a_guarantee"] = "privacy.seeded_noise=true: the noise and the sample come from run.seed, so this epsilon protects nobody"
    if ledger is None:  # nothing was ever released (Local; a phase stopped before its first round)
        return {"privacy": {"epsilon": 0.0, "delta": p.delta, "private_rounds": 0, "accountant": p.accountant, "mode": p.mode,
                            "clip": p.clip, "noise_multiplier": p.noise_multiplier, "target_epsilon": p.target_epsilon, "stopped_after_round": None,
                            **scope}}
    sigma = ledger.history[-1][0] if ledger.history else p.noise_multiplier
    return {"privacy": {"epsilon": ledger.epsilon(), "delta": ledger.delta, "private_rounds": ledger.rounds, "accountant": ledger.kind,
                        "mode": p.mode, "clip": p.clip, "per_layer": p.per_layer, "noise_multiplier": sigma,
                        **({"adaptive_clip": {"target_quantile": p.target_quantile, "clip_lr": p.clip_lr, "final_clip": ledger.clip}}
                           if p.adaptive_clip else {}),
                        "target_epsilon": p.target_epsilon, "stopped_after_round": ledger.stopped_at,
                        "sampling": "Poisson, rate train.client_fraction", **scope,
                        # a warm start's rounds (train.init_from) are part of the epsilon: say how many and whose
                        **({"inherited_rounds": ledger.inherited_rounds, "sources": ledger.sources} if ledger.inherited_rounds else {}),
                        # local mode: what the server itself learns of one client (no amplification; `epsilon_against_server`)
                        **({"epsilon_against_server": epsilon_against_server(ledger.kind, ledger.history, ledger.delta)}
                           if p.mode == "local" else {})}}
