"""A study's records in the store: every finished trial, the frozen choice, every final run.

    studies/<name>/study.json                          the config (a different config under the same name is refused)
    studies/<name>/trials/<method>/<split>/0003.json   one finished tuning trial (params, validation metrics)
    studies/<name>/chosen.json                         the hyperparameters picked on validation, written once
    studies/<name>/finals/<method>/<split>/seed-2.json one final run on test
    studies/<name>/optimistic/<method>/<split>.json    the papers' protocol: every trial rescored on test
    studies/<name>/report/                             study.md, study.html, plots, results.json
    studies/<name>/runs/<run id>/                      the runs themselves (fedpipe's usual run folders)

A record is written once its run has finished, so a killed study resumes with every finished trial
and final run reused. Records are read back bounded and type-checked: they may have been edited.
Hyperparameters in a record are data, never config: a trial's params and the choice are checked
against the study's own search spaces (exactly the tuned paths, each inside its range) before any run
config is built from them, so a store writer cannot set another config path of the final runs.
"""

from __future__ import annotations

import json
import math

from fedpipe.errors import ConfigError, CorruptArtifactError
from fedpipe.safe_load import MAX_RECORD_BYTES, read_store_json
from fedpipe.search_space import point_problem
from fedpipe.store import Store
from fedpipe.study.config import StudyConfig

ADVICE = "Delete it to run that part of the study again."


class StudyRecords:
    """The keys of one study and its records' reading and writing."""

    def __init__(self, store: Store, study: StudyConfig):
        self.store, self.study = store, study
        self.root = f"studies/{study.study.name}"

    def trial_key(self, method: str, split: str, number: int) -> str:
        return f"{self.root}/trials/{method}/{split}/{number:04d}.json"

    def final_key(self, method: str, split: str, seed: int) -> str:
        return f"{self.root}/finals/{method}/{split}/seed-{seed}.json"

    def optimistic_key(self, method: str, split: str) -> str:
        return f"{self.root}/optimistic/{method}/{split}.json"

    @property
    def chosen_key(self) -> str:
        return f"{self.root}/chosen.json"

    @property
    def report_prefix(self) -> str:
        return f"{self.root}/report"

    def claim(self) -> None:
        """Pin the study's config to its name: resuming continues it; another config under the name is refused."""
        key, mine = f"{self.root}/study.json", {"fingerprint": self.study.fingerprint(), "config": self.study.model_dump(mode="json")}
        if self.store.exists(key):
            theirs = self.read(key, "study record")
            if theirs.get("fingerprint") != mine["fingerprint"]:
                raise ConfigError(f"{self.store.url(key)} belongs to another configuration of study {self.study.study.name!r} "
                                  "(methods, spaces, budget, seeds or splits differ). Give this one another study.name, "
                                  "or delete that folder to start over.")
            return
        self.put(key, mine)

    def read(self, key: str, what: str) -> dict:
        tree = read_store_json(self.store, key, what, MAX_RECORD_BYTES, CorruptArtifactError, ADVICE)
        if not isinstance(tree, dict):
            raise CorruptArtifactError(f"{self.store.url(key)} is not a {what} (not a JSON object). {ADVICE}")
        return tree

    def put(self, key: str, record: dict) -> None:
        self.store.put_text(key, json.dumps(_clean(record), indent=1, allow_nan=False))

    def trials(self, method: str, split: str) -> list[dict]:
        """The finished trials of a method on a split, by number; each checked for its params and objective."""
        prefix = f"{self.root}/trials/{method}/{split}/"
        out = []
        for key in sorted(k for k in self.store.list(prefix) if k.endswith(".json")):
            rec = self.read(key, "trial record")
            if not (isinstance(rec.get("params"), dict) and isinstance(rec.get("number"), int) and _number_or_none(rec.get("objective"))):
                raise CorruptArtifactError(f"{self.store.url(key)} is not a trial record (params, number, objective). {ADVICE}")
            self._check_point(key, method, rec["params"], "trial record")
            out.append(rec)
        return sorted(out, key=lambda r: r["number"])

    def chosen(self) -> dict | None:
        """The frozen choice, {method: {split: params}} (None before it is written); each params either {} (no
        trial finished: the defaults) or a point of the method's search space."""
        rec = self.maybe(self.chosen_key, "study choice")
        if rec is None:
            return None
        chosen, url = rec.get("chosen"), self.store.url(self.chosen_key)
        if not (isinstance(chosen, dict) and all(isinstance(v, dict) for v in chosen.values())):
            raise CorruptArtifactError(f"{url} is not a study choice ('chosen': method -> split -> hyperparameters). {ADVICE}")
        methods = [e.name for e in self.study.methods]
        for method, splits in chosen.items():
            if method not in methods:
                raise CorruptArtifactError(f"{url} chooses for method {method[:60]!r}, which is not in the study "
                                           f"(its methods: {', '.join(methods)}). {ADVICE}")
            for params in splits.values():
                if params != {}:  # {}: every trial failed, the final runs take the defaults
                    self._check_point(self.chosen_key, method, params, "study choice")
        return chosen

    def _check_point(self, key: str, method: str, params, what: str) -> None:
        entry = next(e for e in self.study.methods if e.name == method)
        problem = point_problem(entry.search_space(), params)
        if problem:
            raise CorruptArtifactError(f"{self.store.url(key)} is not a {what} of this study: for {method}, {problem}. "
                                       f"A record's hyperparameters must be a point of the study's search space. {ADVICE}")

    def final(self, method: str, split: str, seed: int) -> dict | None:
        """A final run's record (None before it has run), checked for what the report reads."""
        key = self.final_key(method, split, seed)
        rec = self.maybe(key, "final run record")
        if rec is not None and not (rec.get("method") == method and rec.get("split") == split and rec.get("seed") == seed
                                    and isinstance(rec.get("metrics"), dict) and isinstance(rec.get("curve"), list)
                                    and _number_or_none(rec.get("seconds"))):
            raise CorruptArtifactError(f"{self.store.url(key)} is not the final run record of {method} on {split}, seed {seed}. {ADVICE}")
        return rec

    def maybe(self, key: str, what: str) -> dict | None:
        return self.read(key, what) if self.store.exists(key) else None


def _number_or_none(value) -> bool:
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value))


def _clean(value):
    """JSON has no NaN: a non-finite number (a client without test samples) is recorded as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value
