"""A TEST-ONLY fault injector for a site's ClientApp: corrupts the site's own reply so that the federation tests can
show the server refusing it. Off unless FEDPIPE_TEST_FAULT_INJECTOR is set in the site's process environment (only
tests/federation sets it, through `LoopbackFederation.start_site(env=...)`; the try-out strips it from what it passes on).
No Flower import: the tests in .venv read the names from here."""

from __future__ import annotations

import os

import torch

#: TEST-ONLY fault injector, off unless this environment variable is set in the site's process (only the
#: federation tests set it: `LoopbackFederation.start_site(env=...)`). Its value is a comma-separated list of FAULT or
#: FAULT@ROUND (without a round: every round). Upload faults (one per round): wrong-shape (the first uploaded tensor
#: loses a row), nan (a NaN in it), oversized (it grows tenfold), hang (the site stops replying: the test kills it
#: mid-round). Claims (what an audit's dishonest site states): samples-huge, samples-nan, samples-negative (the train
#: reply's sample count: 10^6, NaN, -700) and evaluation-inflated (its evaluation claims a perfect score on 10^9 samples).
#: It corrupts this site's reply, never the server.
FAULT_INJECTOR_ENV = "FEDPIPE_TEST_FAULT_INJECTOR"
UPLOAD_FAULTS = ("wrong-shape", "nan", "oversized", "hang")
CLAIMS = {"samples-huge": 10**6, "samples-nan": float("nan"), "samples-negative": -700}
FAULTS = (*UPLOAD_FAULTS, *CLAIMS, "evaluation-inflated")


def injected(round_: int) -> set[str]:
    """The faults the test asked this site to inject in `round_` (0: the evaluation); empty outside the tests."""
    value = os.environ.get(FAULT_INJECTOR_ENV, "").strip()
    active = set()
    for entry in filter(None, (v.strip() for v in value.split(","))):
        fault, _, at = entry.partition("@")
        if fault not in FAULTS:
            raise ValueError(f"{FAULT_INJECTOR_ENV}={value!r}: unknown fault {fault!r} (one of {', '.join(FAULTS)})")
        if not at or int(at) == round_:
            active.add(fault)
    return active


def injected_fault(round_: int) -> str | None:
    """The upload fault the test asked this site to inject in `round_`, or None (always None outside the tests)."""
    return next((f for f in UPLOAD_FAULTS if f in injected(round_)), None)


def claimed_samples(round_: int, true: int) -> int | float:
    """The training-sample count this site's reply states in `round_`: its true count, outside the tests."""
    return next((CLAIMS[f] for f in CLAIMS if f in injected(round_)), true)


def inflated_evaluation(metrics: dict) -> dict:
    """The evaluation figures a dishonest site states (test-only): a perfect score on 10^9 samples."""
    if "evaluation-inflated" not in injected(0):
        return metrics
    return {**metrics, **{k: 1.0 for k in ("accuracy", "holdout-accuracy", "global-accuracy") if k in metrics},
            "test-samples": 1e9, **({"holdout-samples": 1e9} if "holdout-samples" in metrics else {})}


def corrupt(upload: dict[str, torch.Tensor], fault: str) -> dict[str, torch.Tensor]:
    """The upload with `fault` injected into its first tensor (test-only; see FAULT_INJECTOR_ENV)."""
    out = dict(upload)
    name = next(iter(out))
    t = out[name].clone()
    if fault == "wrong-shape":
        t = t[:-1]
    elif fault == "nan":
        t.view(-1)[0] = float("nan")
    elif fault == "oversized":
        t = torch.cat([t] * 10)
    out[name] = t
    return out
