"""The privacy accountant of a run: how much (epsilon, delta)-DP its rounds have spent, by Opacus's
accountants (not hand-written).

Each communicating round is one sampled Gaussian mechanism on the sum of the clipped client updates:
every client joins with probability q (Poisson sampling), its update has L2 norm at most C, and
Gaussian noise of std sigma * C is added to the sum (DP-FedAvg, McMahan et al. 2018, Algorithm 1 and
Theorem 1; the sampled Gaussian mechanism of Mironov, Talwar and Zhang 2019). The accountant composes
those rounds: `rdp` by Renyi DP (Mironov et al. 2019, Sec. 3; converted to (epsilon, delta) by Balle
et al. 2020, Theorem 21, as Opacus does), `prv` by privacy loss random variables (Gopi, Lee and Wutschitz
2021). Its whole state is the history of (sigma, q, rounds), kept in the phase state, so a resumed run
continues the same accountant.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

#: The history of one accountant: [noise_multiplier, sample_rate, rounds] entries, in order.
History = list[list[float]]


def default_delta(num_clients: int) -> float:
    """1 / n^1.1: below 1/n, as (epsilon, delta)-DP needs for delta to be meaningful at the user level
    (a mechanism that reveals one random user's data whole is (0, 1/n)-DP)."""
    return 1.0 / max(num_clients, 2) ** 1.1


@functools.lru_cache(maxsize=256)
def _rdp_one_round(sigma: float, q: float) -> tuple[float, ...]:
    """Renyi DP of one sampled Gaussian round at Opacus's orders (Mironov et al. 2019; RDP composes by adding,
    so n rounds cost n times this: what RDPAccountant.get_epsilon computes, cached per (sigma, q))."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import compute_rdp

    return tuple(float(v) for v in compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=RDPAccountant.DEFAULT_ALPHAS))


def _rdp_epsilon(history: History, delta: float) -> float:
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import get_privacy_spent

    orders = RDPAccountant.DEFAULT_ALPHAS
    total = [sum(n * _rdp_one_round(float(s), float(q))[i] for s, q, n in history) for i in range(len(orders))]
    eps, _ = get_privacy_spent(orders=orders, rdp=total, delta=delta)
    return float(eps)


def epsilon_of(kind: str, history: History, delta: float) -> float:
    """Epsilon at `delta` spent by the rounds of `history` (0 for none; infinite once a round had no noise)."""
    rounds = [h for h in history if h[2] > 0 and h[1] > 0]
    if not rounds:
        return 0.0
    if any(s <= 0 for s, _, _ in rounds):
        return math.inf
    if kind == "rdp":
        return _rdp_epsilon(rounds, delta)
    from opacus.accountants import PRVAccountant

    acc = PRVAccountant()
    acc.history = [(float(s), float(q), int(n)) for s, q, n in rounds]
    return float(acc.get_epsilon(delta=delta, eps_error=0.01))


def with_round(history: History, sigma: float, q: float) -> History:
    """The history after one more round at (sigma, q): the last entry's count grows when it matches."""
    out = [list(h) for h in history]
    if out and out[-1][0] == sigma and out[-1][1] == q:
        out[-1][2] += 1
    else:
        out.append([sigma, q, 1])
    return out


@functools.lru_cache(maxsize=64)
def calibrate(kind: str, target_epsilon: float, delta: float, plan: tuple[tuple[float, int], ...]) -> float:
    """The smallest noise_multiplier (within 1%) whose planned rounds, [(sample rate q, rounds)] in order, spend at
    most `target_epsilon`: a bisection on sigma over the accountant's epsilon, as Opacus's get_noise_multiplier
    does for one sample rate (here a plan may mix rates: SuPerFed's two phases, a phase of every client)."""
    def spent(sigma: float) -> float:
        return epsilon_of(kind, [[sigma, q, n] for q, n in plan], delta)

    low, high = 0.0, 10.0
    while spent(high) > target_epsilon:
        high *= 2
        if high > 1e4:
            raise ValueError(f"no noise multiplier up to 10,000 keeps epsilon within {target_epsilon} at delta {delta:.3g} "
                             f"over {sum(n for _, n in plan)} rounds; allow a larger privacy.target_epsilon or fewer rounds")
    while high - low > 0.01 * high:
        mid = (low + high) / 2
        low, high = (low, mid) if spent(mid) <= target_epsilon else (mid, high)
    return high


@dataclass
class Ledger:
    """A run's accountant: what it spent so far (`history`) and, with a budget, where it stopped.
    Kept in the phase state (`to_json` / `from_json`) and carried from phase to phase."""

    kind: str
    delta: float
    history: History = field(default_factory=list)
    stopped_at: int | None = None  # the last round within target_epsilon, once a round would have exceeded it
    clip: float | None = None  # privacy.adaptive_clip: the clip the next round uses (None: privacy.clip)

    def epsilon(self) -> float:
        return epsilon_of(self.kind, self.history, self.delta)

    def epsilon_after(self, sigma: float, q: float) -> float:
        """Epsilon if one more round at (sigma, q) were run."""
        return epsilon_of(self.kind, with_round(self.history, sigma, q), self.delta)

    def spend(self, sigma: float, q: float) -> None:
        self.history = with_round(self.history, sigma, q)

    @property
    def rounds(self) -> int:
        return int(sum(h[2] for h in self.history))

    def to_json(self) -> dict:
        made = {"accountant": self.kind, "delta": self.delta, "history": [list(h) for h in self.history], "stopped_at": self.stopped_at}
        return made if self.clip is None else {**made, "clip": self.clip}

    @classmethod
    def from_json(cls, d: dict) -> Ledger:
        history = [[float(s), float(q), int(n)] for s, q, n in d.get("history", [])]
        stopped = d.get("stopped_at")
        clip = d.get("clip")
        if clip is not None and not (math.isfinite(float(clip)) and float(clip) > 0):
            raise ValueError(f"clip must be a positive number, not {str(clip)[:50]!r}")
        return cls(str(d["accountant"]), float(d["delta"]), history, None if stopped is None else int(stopped),
                   None if clip is None else float(clip))
