"""Tuning one method on one split with Optuna: asked in batches, told as trials finish.

The Optuna study lives in memory and is rebuilt from the store's trial records each time (the local
runner's start, a KFP suggest task): the records are the truth, so a killed study, a retried KFP
task or another machine continues with every finished trial, and no Optuna database is needed. The
sampler is seeded from the study's first seed, the method and the split, so the same records give
the same next suggestions.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import optuna

from fedpipe.search_space import Choice, Dimension, IntRange, LogUniform, Uniform
from fedpipe.seeding import derive_seed
from fedpipe.study.config import MethodEntry, StudyConfig

log = logging.getLogger(__name__)


def distribution(dim: Dimension) -> optuna.distributions.BaseDistribution:
    if isinstance(dim, Uniform):
        return optuna.distributions.FloatDistribution(dim.low, dim.high)
    if isinstance(dim, LogUniform):
        return optuna.distributions.FloatDistribution(dim.low, dim.high, log=True)
    if isinstance(dim, IntRange):
        return optuna.distributions.IntDistribution(dim.low, dim.high)
    if isinstance(dim, Choice):
        return optuna.distributions.CategoricalDistribution(list(dim.values))
    raise TypeError(f"not a search-space dimension: {dim!r}")


def sampler(study: StudyConfig, space: dict[str, Dimension], seed: int) -> optuna.samplers.BaseSampler:
    if study.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if study.sampler == "grid":
        # points per range so that the grid has at least `trials` points (a choice keeps its values)
        ranged = [d for d in space.values() if not isinstance(d, Choice)]
        fixed = math.prod(len(d.values) for d in space.values() if isinstance(d, Choice))
        per = max(2, math.ceil((study.budget.trials / fixed) ** (1 / max(len(ranged), 1)))) if ranged else 1
        return optuna.samplers.GridSampler({p: d.grid(per) for p, d in space.items()}, seed=seed)
    # TPE after a few random startup trials (a quarter of the budget, at least 2; Optuna's default is 10)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(2, study.budget.trials // 4), multivariate=True,
                                       constant_liar=True)  # trials asked in a batch before any is told: spread them


class MethodTuner:
    """One method on one split: its space, its Optuna study rebuilt from `finished` records, its budget left."""

    def __init__(self, study: StudyConfig, entry: MethodEntry, split: str, finished: list[dict]):
        self.entry, self.split = entry, split
        self.space = entry.search_space()
        self.distributions = {p: distribution(d) for p, d in self.space.items()}
        # seeded by the records too: a sampler rebuilt after a resume (or for the next KFP batch) must not draw
        # the same startup points again; the same records still give the same suggestions (numpy: 32-bit seeds)
        seed = derive_seed(study.seeds[0], f"study/{entry.name}/{split}", len(finished)) % 2**32
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.optuna = optuna.create_study(direction="maximize", sampler=sampler(study, self.space, seed))
        self.budget = study.budget.trials if self.space else 0
        self.finished = list(finished)
        for rec in finished:
            self._add(rec)
        self.asked = 0
        self.next_number = max((r["number"] for r in finished), default=-1) + 1

    def _add(self, rec: dict) -> None:
        params = {p: v for p, v in rec["params"].items() if p in self.distributions}
        if set(params) != set(self.distributions):
            log.warning("trial %s of %s on %s has other parameters than the space now; not used by the sampler.",
                        rec["number"], self.entry.name, self.split)
            return
        value = rec.get("objective")
        state = optuna.trial.TrialState.COMPLETE if value is not None else optuna.trial.TrialState.FAIL
        self.optuna.add_trial(optuna.trial.create_trial(params=params, distributions=self.distributions,
                                                        value=value if value is not None else None, state=state))

    @property
    def left(self) -> int:
        """Trials still to ask (finished and asked ones count against the budget)."""
        return max(0, self.budget - len(self.finished) - self.asked)

    def ask(self) -> tuple[int, optuna.trial.Trial, dict[str, Any]]:
        trial = self.optuna.ask(self.distributions)
        self.asked += 1
        number, self.next_number = self.next_number, self.next_number + 1
        return number, trial, dict(trial.params)

    def tell(self, trial: optuna.trial.Trial, record: dict) -> None:
        self.asked -= 1
        self.finished.append(record)
        value = record.get("objective")
        if value is None:
            self.optuna.tell(trial, state=optuna.trial.TrialState.FAIL)
        else:
            self.optuna.tell(trial, value)

    def best(self) -> dict[str, Any]:
        """The chosen hyperparameters: the finished trial with the highest validation objective (the
        earliest of equals); {} when the method is not tuned or every trial failed."""
        scored = [r for r in self.finished if r.get("objective") is not None]
        if not scored:
            return {}
        best = max(scored, key=lambda r: (r["objective"], -r["number"]))["params"]
        return {p: best[p] for p in self.space if p in best}  # the tuned paths only, whatever else a record holds
