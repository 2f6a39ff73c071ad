"""A TEST-ONLY fault injector for a site's ClientApp: corrupts the site's own reply so that the federation tests can
show the server refusing it. Off unless FEDPIPE_TEST_FAULT_INJECTOR is set in the site's process environment (only
tests/federation sets it, through `LoopbackFederation.start_site(env=...)`; the try-out strips it from what it passes on).
No Flower import: the tests in .venv read the names from here."""

from __future__ import annotations

import os

import torch

#: TEST-ONLY fault injector, off unless this environment variable is set in the site's process (only the
#: federation tests set it: `LoopbackFederation.start_site(env=...)`). Its value is FAULT or FAULT@ROUND:
#: wrong-shape (the first uploaded tensor loses a row), nan (a NaN in it), oversized (it grows tenfold),
#: hang (the site stops replying: the test kills it mid-round). It corrupts this site's reply, never the server.
FAULT_INJECTOR_ENV = "FEDPIPE_TEST_FAULT_INJECTOR"
FAULTS = ("wrong-shape", "nan", "oversized", "hang")


def injected_fault(round_: int) -> str | None:
    """The fault the test asked this site to inject in `round_`, or None (always None outside the tests)."""
    value = os.environ.get(FAULT_INJECTOR_ENV, "").strip()
    if not value:
        return None
    fault, _, at = value.partition("@")
    if fault not in FAULTS:
        raise ValueError(f"{FAULT_INJECTOR_ENV}={value!r}: unknown fault {fault!r} (one of {', '.join(FAULTS)})")
    return fault if not at or int(at) == round_ else None


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
