"""Which methods run federated (over Flower's deployment engine) today, and why the others do not yet.

One line per method. Plain data: no torch, no Flower, so `fedpipe methods` (in .venv, where flwr must not be
installed) can print it. `fedpipe.federation.spec.refusal` refuses a method from this table.
"""

from __future__ import annotations

#: The methods wired to the SuperLink: one download and one upload per round (the upload in the method's declared
#: layout, `Algorithm.upload_layout`, which the server checks), personal state (if any) kept in the site's own store.
FEDERATED: dict[str, str] = {
    "fedavg": "every phase; the global model equals the simulation's (tests/federation/test_loopback.py)",
    "fedprox": "as FedAvg: the global model down and up; the proximal term is the site's (tests/federation/test_methods.py)",
    "superfed_mm": "both phases; each site keeps its local model in its own folder (tests/federation/test_superfed_mm.py)",
    "superfed_lm": "as SuPerFed-MM (Layer Mixing draws its lam per layer at the site)",
    "ditto": "the global model down and up; each site keeps its personal model in its own folder (tests/federation/test_methods.py)",
    "apfl": "the global model down and up; each site keeps its local model and alpha in its own folder",
    "pfedme": "the global model down, the local model w_i up; each site keeps its personalized theta_i in its own folder",
    "fedper": "only the shared base layers travel, both ways; each site keeps its personalization layers",
    "lgfedavg": "only the global top layers travel, both ways; each site keeps its local representation layers "
                "(tests/federation/test_methods.py)",
    "pfedmb": "the branches down, the branches and its alpha up (the server uses the alpha for that round's "
              "aggregation only); each site keeps its alpha, then fine-tunes at the site (tests/federation/test_methods.py)",
    "fedavg_ft": "FedAvg, then each site fine-tunes the global model and keeps and evaluates it in its own folder",
    "fedprox_ft": "FedProx, then each site fine-tunes the global model and keeps and evaluates it in its own folder",
}

#: Why a method is refused federated today, in one line.
NOT_YET: dict[str, str] = {
    "local": "nothing crosses the network: each site trains alone, so a SuperLink adds only round trips "
             "(run `local` on each site's data instead)",
    "fedmn": "its selective upload (the modules its route used) varies per site: the check needs a per-site upload layout",
    "ifca": "each site downloads all k cluster models and uploads one: more than one download per round",
    "fedfomo": "each site downloads other clients' models: client-to-client traffic through the server is not wired",
    "fedamp": "the server keeps a model per client (server-side personal state), which a federation must not hold unasked",
    "fedmoe": "opt-out sites train local specialists and a gate and upload nothing: the opt-out path is not wired and tested yet",
}


#: The methods that may run with `federation.secure_aggregation.enabled` (SecAgg+, Bell et al. 2020): their round's
#: aggregation is a mean of the uploads (sample-weighted, or uniform: `Algorithm.secure_weighting`) followed by the
#: method's own step from it (`Algorithm.apply_mean`), which Flower's SecAgg+ workflow computes from the masked sum
#: alone (fedpipe/federation/secagg.py), so the server never needs one site's upload.
SECURE_AGGREGATION: dict[str, str] = {
    "fedavg": "the round's weighted mean is computed from the masked sum alone (tests/federation/test_secagg.py)",
    "fedprox": "as FedAvg: the global model's weighted mean",
    "superfed_mm": "both phases: the global model's weighted mean; each site's local model stays in its folder "
                   "(tests/federation/test_secagg.py)",
    "superfed_lm": "as SuPerFed-MM",
    "ditto": "the global model's weighted mean; the personal models stay at the sites",
    "apfl": "the global model's weighted mean; the local models and alphas stay at the sites",
    "fedper": "the shared base layers' weighted mean; the personalization layers stay at the sites",
    "lgfedavg": "the global top layers' weighted mean; the representation layers stay at the sites (tests/federation/test_secagg.py)",
    "pfedme": "the sites' w_i averaged under the masks with method.weighting's weights (uniform: every site max_weight), then "
              "the server's mix w = (1 - beta) w + beta * mean (tests/federation/test_secagg.py)",
    "pfedmb": "Eq. 5 as a quotient of two masked sums: each site sends alpha * branch and its alpha, the server divides the "
              "means branch by branch; its finetune phase sends nothing (tests/federation/test_secagg.py)",
    "fedavg_ft": "FedAvg's weighted mean under the masks; the finetune phase sends nothing, so its rounds are plain ones",
    "fedprox_ft": "as FedAvg-FT",
}

#: Why a method outside SECURE_AGGREGATION is refused with it (every federated method is in it today).
SECURE_DEFAULT = "its aggregation is not a mean of the uploads: the server needs each site's upload"


def secure_refusal(method: str) -> str | None:
    """Why `method` cannot run with secure aggregation, in one line; None when it can."""
    if method in SECURE_AGGREGATION:
        return None
    return (f"federation.secure_aggregation is not available for method {method!r}: {SECURE_DEFAULT} "
            f"(secure aggregation today: {', '.join(SECURE_AGGREGATION)})")


def federated_status(method: str) -> str:
    """`fedpipe methods`' line: 'yes: ...' or 'not yet: why'."""
    if method in FEDERATED:
        return f"yes: {FEDERATED[method]}"
    return f"not yet: {NOT_YET.get(method, 'not wired to the SuperLink')}"
