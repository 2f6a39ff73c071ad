"""The drop check: is the new data drop what the line has been learning from, or broken or poisoned?

A drop whose labels were rotated for one site (or whose images were swapped) looks fine to a gate that scores
both versions on the drop's own test splits: the candidate learned the wrong labels and agrees with them. What
gives it away is the promoted version: its accuracy on that site's new test split collapses (~0.9 at
registration, ~0.01 now). So before comparing, the gate scores the promoted version on each client's new test
split and compares with the figures the version recorded of itself when it was registered
(`evaluation.json`: each client's accuracy on its own test split, its test sample count and label counts).

A client is flagged when it has at least `min_samples` test samples now and
- its accuracy fell by more than `max_drop`, or
- it fell below `chance_multiple` x chance (1 / classes) having been above it, or
- its label distribution moved by more than `max_label_shift` (total variation distance);
and, when the promoted version's drop can be read again (so which samples are new is known), on each part of the
client's test split apart (at least `min_samples` samples in the part):
- seen samples (`max_seen_drop`): on the test files the promoted version's drop held (same client, same file
  name: `fedpipe.data.identity`), the promoted model scored on the new drop's copies loses more than
  `max_seen_drop` against its own drop's copies of the same files. Paired on the same files, an unchanged drop
  loses exactly nothing, so the bound can be tight: a file relabelled or swapped under its old name shows, however
  many new files dilute the whole split;
- new samples (`max_new_drop`): on the client's NEW test samples, the promoted model scores more than
  `max_new_drop` + NEW_SAMPLE_Z standard errors below its accuracy on that client at registration. New files from
  the same sources score what the client's old test files scored (both were unseen in training), within sampling
  error: sqrt(p (1 - p) (1 / n_new + 1 / n_then)), p the accuracy at registration;
- relabelled new samples (`relabel_below_chance`): on the new samples the promoted model scores below
  `relabel_below_chance` x chance, while it scored at least `chance_multiple` x chance on that client at
  registration.
Any flagged client marks the drop as suspect: the candidate is not promoted.

Why the parts apart: files moved to another label folder AND renamed are new samples, so no sample both drops
hold shows the change, and when a quarter of a client's files move, its whole test split falls by only ~0.2,
under `max_drop`. Compared with chance, the new samples gave it away only while few unchanged files were renamed
with them: the audit renamed every second unchanged file too, and the promoted model scored 0.44 on the "new"
samples, above 0.5 x chance. Compared with what the client scored at registration, the new part falls by the
moved files' share of it, which is smallest when EVERY file is renamed: then the new part is the whole split, and
its fall (the moved share x the accuracy, 0.20-0.28 in the audit) must exceed `max_new_drop` plus sampling error
(~0.05 for 90 samples at 0.9) to be caught. Renaming fewer files only concentrates the moved ones in the new part,
and relabelling files under their old names shows on the seen part; so no choice of how many files to rename or
how many honest files to add keeps a quarter of a client relabelled under both bounds. What still passes: a
relabelled share below about `max_new_drop` / accuracy (~0.1) of a client's test files. A benign drop's new
samples (more of the same sources) score what the client scored before. A site whose new data really differs
(a label it never had, another scanner) looks the same to the promoted model and is flagged too: if the change is
real, decide again with `fedpipe models regate LINE@V --set registry.drop_check.max_new_drop=1` (or another rule's
setting, each named in the reason).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from fedpipe.config import DropCheckConfig
from fedpipe.errors import CorruptArtifactError
from fedpipe.models.line import ModelLine
from fedpipe.safe_load import parse_json

EVALUATION_FILE = "evaluation.json"
EVALUATION_FORMAT = "fedpipe.version-evaluation/1"
NEW_SAMPLE_Z = 2.0  # standard errors of sampling allowed on the new samples: ~2% of benign clients past max_new_drop's
#                    margin by chance alone is then what that margin must absorb
MAX_EVALUATION_BYTES = 256 * 2**20  # 100,000 clients x 1,000 label counts is ~200 MB of JSON; more is not a record


@dataclass(frozen=True)
class ClientFigures:
    """What a version recorded of one client when it was registered."""

    accuracy: float
    test_samples: int
    label_counts: tuple[int, ...]


def evaluation_bytes(accuracy: dict[str, float], test_samples: dict[str, int], label_counts: dict[str, np.ndarray],
                     global_accuracy: float | None) -> bytes:
    """The version's own figures, written beside its models at registration."""
    clients = {n: {"accuracy": float(a), "test_samples": int(test_samples[n]), "label_counts": [int(v) for v in label_counts[n]]}
               for n, a in accuracy.items()}
    return json.dumps({"format": EVALUATION_FORMAT, "global_accuracy": global_accuracy, "clients": clients}).encode()


def read_evaluation(line: ModelLine, version: int) -> dict[str, ClientFigures] | None:
    """Version `version`'s recorded figures per client; None when it has none (registered before the drop
    check existed). Checked against the sha256 its record holds, bounded, and type-checked."""
    if EVALUATION_FILE not in line.record(version).files:
        return None
    where = line.store.url(line.keys.version(version) + EVALUATION_FILE)
    tree = parse_json(line.read(version, EVALUATION_FILE, MAX_EVALUATION_BYTES), where, "version evaluation record",
                      MAX_EVALUATION_BYTES, CorruptArtifactError, "Restore it, or promote another version.")
    if not isinstance(tree, dict) or tree.get("format") != EVALUATION_FORMAT or not isinstance(tree.get("clients"), dict):
        raise CorruptArtifactError(f"{where} is not a version's evaluation record; restore it, or promote another version.")
    out = {}
    for name, c in tree["clients"].items():
        ok = (isinstance(c, dict) and isinstance(c.get("accuracy"), (int, float)) and 0.0 <= c["accuracy"] <= 1.0
              and isinstance(c.get("test_samples"), int) and c["test_samples"] >= 0 and isinstance(c.get("label_counts"), list)
              and all(isinstance(v, int) and v >= 0 for v in c["label_counts"]))
        if not ok:
            raise CorruptArtifactError(f"{where}: client {str(name)[:100]!r} has malformed figures; restore the file, or promote "
                                       "another version.")
        out[name] = ClientFigures(float(c["accuracy"]), c["test_samples"], tuple(c["label_counts"]))
    return out


def label_shift(then: tuple[int, ...] | np.ndarray, now: np.ndarray) -> float:
    """Total variation distance between two label distributions given as counts (0: the same mix, 1: disjoint)."""
    a, b = np.asarray(then, dtype=np.float64), np.asarray(now, dtype=np.float64)
    if a.shape != b.shape or a.sum() == 0 or b.sum() == 0:
        return 0.0
    return float(0.5 * np.abs(a / a.sum() - b / b.sum()).sum())


@dataclass(frozen=True)
class ClientCheck:
    """One client's figures in the drop check."""

    name: str
    then: float  # the promoted version's accuracy on the client at registration
    now: float  # ... on the client's test split of the new drop
    samples: int  # test samples in the new drop
    shift: float  # total variation distance of its label distribution since
    flagged: str = ""  # why it is flagged ("" when it is not)
    on_new: float | None = None  # ... on the client's new test samples alone (None: none, or not known)
    new_samples: int = 0  # how many of the client's test samples are new
    seen: Seen | None = None  # ... on the test samples the promoted version's drop held (None: none, or not known)

    def to_json(self) -> dict:
        r = lambda v: None if v is None else round(v, 6)  # noqa: E731
        return {"client": self.name, "then": round(self.then, 6), "now": round(self.now, 6), "test_samples": self.samples,
                "label_shift": round(self.shift, 6), "on_new": r(self.on_new), "new_test_samples": self.new_samples,
                "on_seen": r(self.seen and self.seen.now), "on_seen_then": r(self.seen and self.seen.then),
                "seen_test_samples": self.seen.samples if self.seen else 0, "flagged": self.flagged}


@dataclass(frozen=True)
class Seen:
    """The promoted version on a client's test samples that its own drop held: on the new drop's copies of those
    files (`now`) and on its own drop's copies (`then`)."""

    now: float
    then: float
    samples: int


def seen_fell(seen: Seen | None, cfg: DropCheckConfig) -> str:
    """The seen-samples rule (the module's docstring): why it flags a client ("" when it does not)."""
    if seen is None or seen.samples < cfg.min_samples or not seen.then - seen.now > cfg.max_seen_drop:
        return ""
    return (f"on its {seen.samples} test samples the promoted version's drop held, the promoted model fell {seen.then:.3f} -> "
            f"{seen.now:.3f} on the new drop's copies of the same files (more than {cfg.max_seen_drop:g}; max_seen_drop): "
            "files changed or relabelled under their old names")


def new_fell(before: float, then_samples: int, on_new: float | None, new_samples: int, cfg: DropCheckConfig) -> str:
    """The new-samples rule (the module's docstring): why it flags a client ("" when it does not)."""
    if on_new is None or new_samples < cfg.min_samples:
        return ""
    p = min(max(before, 0.0), 1.0)
    error = NEW_SAMPLE_Z * math.sqrt(p * (1 - p) * (1 / new_samples + 1 / max(1, then_samples)))
    if not before - on_new > cfg.max_new_drop + error:
        return ""
    return (f"on its {new_samples} new test samples the promoted model scores {on_new:.3f}, more than {cfg.max_new_drop:g} "
            f"(max_new_drop) + {error:.3f} (sampling) below the {before:.3f} it scored on this client at registration: "
            "files moved to other labels and renamed, or new data unlike the client's")


def relabelled(before: float, on_new: float | None, new_samples: int, num_classes: int, cfg: DropCheckConfig) -> str:
    """The relabelled-new-samples rule (the module's docstring): why it flags a client ("" when it does not)."""
    chance = 1 / max(1, num_classes)
    below, fine = cfg.relabel_below_chance * chance, cfg.chance_multiple * chance
    if on_new is None or new_samples < cfg.min_samples or not on_new < below or before < fine:
        return ""
    return (f"its {new_samples} new test samples look relabelled: the promoted model scores {on_new:.3f} on them, below "
            f"{cfg.relabel_below_chance:g}x chance ({below:.3f}), having scored {before:.3f} on this client at registration "
            "(relabel_below_chance)")


def check_drop(then: dict[str, ClientFigures], now: dict[str, float], samples: dict[str, int],
               labels_now: dict[str, np.ndarray], num_classes: int, cfg: DropCheckConfig,
               on_new: dict[str, tuple[float, int]] | None = None, on_seen: dict[str, Seen] | None = None) -> list[ClientCheck]:
    """Every client the promoted version recorded and the new drop holds, with why it is flagged (if it is);
    flagged clients first, worst first. `on_new`: the promoted version's accuracy on each client's new test
    samples and their count; `on_seen`: its figures on the samples its own drop held (without them, the rules on
    those parts are not applied)."""
    floor = cfg.chance_multiple / max(1, num_classes)
    on_new, on_seen = on_new or {}, on_seen or {}
    checks = []
    for name in sorted(set(then) & set(now)):
        before, after, n = then[name].accuracy, now[name], samples.get(name, 0)
        shift = label_shift(then[name].label_counts, labels_now[name]) if name in labels_now else 0.0
        fresh, fresh_n = on_new.get(name, (None, 0))
        why = ""
        if n >= cfg.min_samples:
            if before - after > cfg.max_drop:
                why = f"accuracy fell {before:.3f} -> {after:.3f} (more than {cfg.max_drop:g})"
            elif after < floor <= before:
                why = f"accuracy fell to {after:.3f}, below {cfg.chance_multiple:g}x chance ({floor:.3f}), from {before:.3f}"
            elif shift > cfg.max_label_shift:
                why = f"label distribution moved by {shift:.2f} (total variation; more than {cfg.max_label_shift:g})"
        why = (why or seen_fell(on_seen.get(name), cfg) or relabelled(before, fresh, fresh_n, num_classes, cfg)
               or new_fell(before, then[name].test_samples, fresh, fresh_n, cfg))
        checks.append(ClientCheck(name, before, after, n, shift, why, fresh, fresh_n, on_seen.get(name)))
    return sorted(checks, key=lambda c: (not c.flagged, c.now - c.then, c.name))
