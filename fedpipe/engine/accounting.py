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
import warnings
from dataclasses import dataclass, field

#: The history of one accountant: [noise_multiplier, sample_rate, rounds] entries, in order.
History = list[list[float]]


#: The default delta is at most 1e-5, the value DP training reports most often (Abadi et al. 2016; Opacus's and
#: TF Privacy's tutorials), and always at least this many times below 1/n.
DELTA_CEILING = 1e-5
DELTA_BELOW_ONE_OVER_N = 100


def default_delta(num_clients: int) -> float:
    """min(1e-5, 0.01 / n): far below 1/n at every size. A mechanism that publishes each user's data whole with
    probability delta is (0, delta)-DP, so delta near 1/n lets it expose about one user (Dwork and Roth 2014, Sec. 2.3:
    delta "less than the inverse of any polynomial in the size of the database"). The former default 1 / n^1.1 was
    barely below 1/n in a small federation (0.08 at 10 clients) and only 4x below at a million; this one is 1e-5 up to
    1,000 clients (10,000 times below 1/n at 10) and 100 times below 1/n beyond."""
    n = max(num_clients, 1)
    return min(DELTA_CEILING, 1.0 / (DELTA_BELOW_ONE_OVER_N * n))


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


#: PRV's epsilon error as a share of the epsilon (at least 0.01, Opacus's default): its grid has about
#: L / mesh points with L growing with epsilon and mesh with the error, so a fixed 0.01 made a run with
#: little noise (q = 1, sigma 0.5, 1,000 rounds) build a grid of ~9 GB for 117 s and return inf; a relative error
#: keeps the grid's size independent of epsilon. The reported value is PRV's upper bound either way.
PRV_RELATIVE_ERROR = 1e-3


def epsilon_of(kind: str, history: History, delta: float) -> float:
    """Epsilon at `delta` spent by the rounds of `history` (0 for none; infinite once a round had no noise).

    Cached by (kind, history, delta): a round's budget check (`Ledger.epsilon_after`) and its report
    (`Ledger.epsilon`) ask for the same history, and a history is a few [sigma, q, rounds] entries."""
    rounds = tuple((float(s), float(q), int(n)) for s, q, n in history if n > 0 and q > 0)
    return _epsilon_cached(kind, rounds, float(delta))


@functools.lru_cache(maxsize=1024)
def _epsilon_cached(kind: str, rounds: tuple[tuple[float, float, int], ...], delta: float) -> float:
    if not rounds:
        return 0.0
    if any(s <= 0 for s, _, _ in rounds):
        return math.inf
    rdp = _rdp_epsilon([list(r) for r in rounds], delta)
    if kind == "rdp":
        return rdp
    from opacus.accountants import PRVAccountant

    acc = PRVAccountant()
    acc.history = list(rounds)
    with warnings.catch_warnings():  # q = 1 rounds: Opacus's PRV takes log(1 - q) = log(0) on its way (harmless)
        warnings.simplefilter("ignore", RuntimeWarning)
        prv = float(acc.get_epsilon(delta=delta, eps_error=max(0.01, PRV_RELATIVE_ERROR * rdp)))
    # both are upper bounds on the true epsilon, so their minimum is one too: PRV's is tighter except where its
    # grid cannot hold the loss (it then says inf)
    return min(prv, rdp)


def epsilon_against_server(kind: str, history: History, delta: float) -> float:
    """privacy.mode=local: the epsilon of what the server itself sees of one client. The server receives each
    client's own noised update, Delta_k clipped to C plus N(0, sigma^2 C^2), and knows who took part, so nothing
    is amplified by sampling (q = 1) and the client may have taken part in every round; two clipped updates of
    one client (its data replaced) differ by up to 2C, so each round is a Gaussian mechanism of noise multiplier
    sigma / 2 (local DP's replace-one neighbours; Dwork and Roth 2014, Theorem A.1 for the Gaussian). The
    central epsilon (`epsilon_of` on the same history) is what anyone seeing only the aggregate learns."""
    return epsilon_of(kind, [[s / 2, 1.0, n] for s, _, n in history], delta)


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
    Kept in the phase state (`to_json` / `from_json`) and carried from phase to phase.

    A private warm start (train.init_from) continues the accountant of the version it starts from: `history`
    then begins with that version's rounds, `inherited_rounds` of them, and `sources` says which versions spent
    them. A history composes whatever the runs' deltas were: it describes the mechanisms themselves, and RDP
    composes additively across mechanisms (Mironov 2017, "Renyi differential privacy", Prop. 1), so epsilon at
    this run's delta covers both runs."""

    kind: str
    delta: float
    history: History = field(default_factory=list)
    stopped_at: int | None = None  # the last round within target_epsilon, once a round would have exceeded it
    clip: float | None = None  # privacy.adaptive_clip: the clip the next round uses (None: privacy.clip)
    inherited_rounds: int = 0  # the first rounds of `history`: spent by the versions this run was warm-started from
    sources: list[dict] = field(default_factory=list)  # those versions, oldest first: {"from": where, "rounds": n}

    # Bounds of a ledger read back (a version's state may have been written by anyone who can write the store):
    # a real history has one entry per change of (sigma, q), a few per phase; its epsilon is computed per entry.
    MAX_HISTORY = 10_000
    MAX_ROUNDS = 10**9
    MAX_SOURCES = 1_000  # the newest warm starts of a chain (older ones still count in history and inherited_rounds)
    MAX_SOURCE_CHARS = 500

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
        if self.clip is not None:
            made["clip"] = self.clip
        if self.inherited_rounds or self.sources:  # only then: a ledger of a cold start keeps its old form
            made["inherited_rounds"] = self.inherited_rounds
            made["sources"] = [dict(s) for s in self.sources]
        return made

    @staticmethod
    def _number(value, name: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"the privacy ledger's {name} is {str(value)[:50]!r}, not a finite number")
        return float(value)

    @staticmethod
    def _count(value, name: str, most: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
            raise ValueError(f"the privacy ledger's {name} is {str(value)[:50]!r}, not a whole number from 0 to {most}")
        return value

    @classmethod
    def from_json(cls, d: dict) -> Ledger:
        """A ledger read back, every field checked (a ValueError naming the first bad one): a forged history with
        a negative sigma or q above 1 would understate epsilon, and a huge one would stall the accountant."""
        if not isinstance(d, dict):
            raise ValueError("the privacy ledger is not an object")
        kind, delta = d.get("accountant"), cls._number(d.get("delta"), "delta")
        if kind not in ("rdp", "prv"):
            raise ValueError(f"the privacy ledger's accountant is {str(kind)[:50]!r}, not rdp or prv")
        if not 0 < delta < 1:
            raise ValueError(f"the privacy ledger's delta is {delta!r}, not within (0, 1)")
        raw = d.get("history", [])
        if not isinstance(raw, list) or len(raw) > cls.MAX_HISTORY:
            raise ValueError(f"the privacy ledger's history is not a list of at most {cls.MAX_HISTORY} entries")
        history = []
        for h in raw:
            if not (isinstance(h, list) and len(h) == 3):
                raise ValueError("an entry of the privacy ledger's history is not [noise_multiplier, sample_rate, rounds]")
            sigma, q, n = cls._number(h[0], "noise_multiplier"), cls._number(h[1], "sample_rate"), cls._count(h[2], "rounds", cls.MAX_ROUNDS)
            if sigma < 0 or not 0 <= q <= 1:
                raise ValueError(f"a privacy ledger entry has noise_multiplier {sigma!r} (must be >= 0) or sample_rate {q!r} (must be in [0, 1])")
            history.append([sigma, q, n])
        stopped, clip = d.get("stopped_at"), d.get("clip")
        if clip is not None and not cls._number(clip, "clip") > 0:
            raise ValueError(f"clip must be a positive number, not {str(clip)[:50]!r}")
        total = int(sum(h[2] for h in history))
        inherited = cls._count(d.get("inherited_rounds", 0), "inherited_rounds", total)
        sources = d.get("sources", [])
        if not isinstance(sources, list) or len(sources) > cls.MAX_SOURCES or not all(
                isinstance(s, dict) and set(s) == {"from", "rounds"} and isinstance(s["from"], str)
                and len(s["from"]) <= cls.MAX_SOURCE_CHARS for s in sources):
            raise ValueError(f"the privacy ledger's sources are not a list of at most {cls.MAX_SOURCES} "
                             f"{{from: text of at most {cls.MAX_SOURCE_CHARS} characters, rounds: n}}")
        sources = [{"from": s["from"], "rounds": cls._count(s["rounds"], "a source's rounds", inherited)} for s in sources]
        return cls(str(kind), delta, history, None if stopped is None else cls._count(stopped, "stopped_at", cls.MAX_ROUNDS),
                   None if clip is None else float(clip), inherited, sources)
