"""How each method runs federated (over Flower's deployment engine), and which run under SecAgg+ (and why not).

One line per method. Plain data: no torch, no Flower, so `fedpipe methods` (in .venv, where flwr must not be
installed) can print it. `fedpipe.federation.spec.refusal` refuses a method from this table.
"""

from __future__ import annotations

#: How each method travels over the SuperLink: each site gets its own download (`Algorithm.download`) and the server
#: checks each site's upload against the method's declared layout for that site (`Algorithm.upload_layout`), before it
#: aggregates; personal state (if any) is kept in the site's own store. Every method fedpipe implements is here.
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
    "fedmn": "the module pool down (a site's route is sampled at the site each epoch, so any unit may be used); the router "
             "and only the units the site trained up, each unit whole (checked per site); each site keeps its "
             "architecture (tests/federation/test_methods.py)",
    "fedmoe": "the global model down and up (FedAvg on the opt-in sites); then each site trains its specialist and gate "
              "and keeps them; an opt-out site (`fedpipe site join --opt-out`, or `opt_out: true` in its policy) takes "
              "part in no communicating round and uploads nothing (tests/federation/test_methods.py)",
    "ifca": "all k cluster models down; the picked cluster's model up, its index in the tensor names (the server checks "
            "the upload is wholly one cluster's); each site keeps its pick (tests/federation/test_methods.py)",
    "fedfomo": "the M models the server picks for that site down; its model and its M weights up. The server holds "
               "each site's latest model and its affinities to the others (the method's definition, Algorithm 1), and "
               "sends a site's model to the sites that pick it (tests/federation/test_methods.py)",
    "fedamp": "that site's own attentive cloud model u_i down, its model up. The server holds each site's latest model "
              "(the method's definition: u_i is built from them, Eq. 6-7) (tests/federation/test_methods.py)",
    "local": "nothing is sent either way: each site trains alone in the rounds it is picked; the federation still runs "
             "its rounds and its evaluation, so Local sits in the same report as the methods it is compared with",
}

#: Why a method would be refused federated (none is today; a method added later without its federation says so).
NOT_YET: dict[str, str] = {}


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
    "fedmoe": "FedAvg's weighted mean of the opt-in sites' global models under the masks; the specialist and gate "
              "phases send nothing, so their rounds are plain ones",
    "local": "nothing is ever sent, so nothing is masked: every round is a plain one",
}

#: Why a method is refused with SecAgg+: its aggregate needs something of each upload that a masked sum hides.
SECURE_REFUSED: dict[str, str] = {
    "fedmn": "each unit is averaged over the sites that trained it, so the server must see which units each upload holds",
    "ifca": "each cluster model is averaged over the sites that picked it, so the server must see each upload's cluster",
    "fedfomo": "the server keeps each site's model and sends it to the sites that pick it: it needs each upload in the clear",
    "fedamp": "the server keeps each site's model to build every site's attentive cloud model: it needs each upload in the clear",
}
SECURE_DEFAULT = "its aggregation is not a mean of the uploads: the server needs each site's upload"


def secure_refusal(method: str) -> str | None:
    """Why `method` cannot run with secure aggregation, in one line; None when it can."""
    if method in SECURE_AGGREGATION:
        return None
    return (f"federation.secure_aggregation is not available for method {method!r}: {SECURE_REFUSED.get(method, SECURE_DEFAULT)} "
            f"(secure aggregation today: {', '.join(SECURE_AGGREGATION)})")


def secure_status(method: str) -> str:
    """`fedpipe methods`' SecAgg+ line: 'yes: how' or 'refused: why (the method's math)'."""
    if method in SECURE_AGGREGATION:
        return f"yes: {SECURE_AGGREGATION[method]}"
    return f"refused: {SECURE_REFUSED.get(method, SECURE_DEFAULT)}"


def federated_status(method: str) -> str:
    """`fedpipe methods`' line: 'yes: ...' or 'not yet: why'."""
    if method in FEDERATED:
        return f"yes: {FEDERATED[method]}"
    return f"not yet: {NOT_YET.get(method, 'not wired to the SuperLink')}"
