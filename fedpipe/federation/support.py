"""Which methods run federated (over Flower's deployment engine) today, and why the others do not yet.

One line per method. Plain data: no torch, no Flower, so `fedpipe methods` (in .venv, where flwr must not be
installed) can print it. `fedpipe.federation.spec.refusal` refuses a method from this table.
"""

from __future__ import annotations

#: The methods wired to the SuperLink: one download and one upload per round in the download's layout,
#: personal state (if any) kept in the site's own store.
FEDERATED: dict[str, str] = {
    "fedavg": "every phase; the global model equals the simulation's (tests/federation/test_loopback.py)",
    "superfed_mm": "both phases; each site keeps its local model in its own folder (tests/federation/test_superfed_mm.py)",
}

_SAME_LAYOUT = ("one download and one upload, but its upload check and personal store are not wired and tested yet "
                "(the next step: it travels as FedAvg does)")

#: Why a method is refused federated today, in one line.
NOT_YET: dict[str, str] = {
    "fedprox": _SAME_LAYOUT,
    "superfed_lm": _SAME_LAYOUT,
    "ditto": _SAME_LAYOUT,
    "apfl": _SAME_LAYOUT,
    "pfedme": _SAME_LAYOUT,
    "fedavg_ft": "its finetune phase's personal models need a site-side evaluation step after fine-tuning",
    "fedprox_ft": "its finetune phase's personal models need a site-side evaluation step after fine-tuning",
    "local": "nothing crosses the network: run it at each site on its own (no federation needed)",
    "fedper": "it uploads only the shared base layers: the upload check needs the method's upload layout, not the download's",
    "lgfedavg": "it uploads only the global top layers: the upload check needs the method's upload layout, not the download's",
    "pfedmb": "it uploads its branches and alpha: the upload check needs the method's upload layout, not the download's",
    "fedmn": "its selective upload (the modules its route used) varies per site: the check needs a per-site upload layout",
    "ifca": "each site downloads all k cluster models and uploads one: more than one download per round",
    "fedfomo": "each site downloads other clients' models: client-to-client traffic through the server is not wired",
    "fedamp": "the server keeps a model per client (server-side personal state), which a federation must not hold unasked",
    "fedmoe": "opt-out sites train local specialists and a gate and upload nothing: the opt-out path is not wired",
}


#: The methods that may run with `federation.secure_aggregation.enabled` (SecAgg+, Bell et al. 2020): their round's
#: aggregation is the plain sample-weighted mean of the uploads, which Flower's SecAgg+ workflow computes from the
#: masked sum alone (fedpipe/federation/secagg.py), so the server never needs one site's upload.
SECURE_AGGREGATION: dict[str, str] = {
    "fedavg": "the round's weighted mean is computed from the masked sum alone (tests/federation/test_secagg.py)",
}

#: Why a federated method is refused with secure aggregation today (default: its aggregation needs each upload).
SECURE_NOT_YET: dict[str, str] = {
    "superfed_mm": "its aggregation is a weighted mean too, but its secure path is not wired and tested yet",
}
SECURE_DEFAULT = "its aggregation is not a plain weighted sum of the uploads: the server needs each site's upload"


def secure_refusal(method: str) -> str | None:
    """Why `method` cannot run with secure aggregation, in one line; None when it can."""
    if method in SECURE_AGGREGATION:
        return None
    return (f"federation.secure_aggregation is not available for method {method!r}: {SECURE_NOT_YET.get(method, SECURE_DEFAULT)} "
            f"(secure aggregation today: {', '.join(SECURE_AGGREGATION)})")


def federated_status(method: str) -> str:
    """`fedpipe methods`' line: 'yes: ...' or 'not yet: why'."""
    if method in FEDERATED:
        return f"yes: {FEDERATED[method]}"
    return f"not yet: {NOT_YET.get(method, 'not wired to the SuperLink')}"
