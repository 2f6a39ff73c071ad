"""FedPer (Arivazhagan et al., "Federated Learning with Personalization Layers", arXiv:1912.00818, 2019).

The network is split into base layers W_B, federated as in FedAvg, and personalization layers W_P,
which never leave the client (Algorithms 1 and 2):

- the server sends W_B^t; client j trains (W_B, W_P,j) together for E epochs with SGD on its own data
  (Algorithm 1) and sends back W_B only;
- the server averages the base layers by sample count, W_B^{t+1} = sum_j n_j W_B,j / n (Algorithm 2);
- a client's personalized model is the current global base with its own personalization layers.

Which layers are personal is `personal_layers` (parameter-name prefixes; the paper's experiments
personalize the last one or two fully connected layers; every network here ends in a `head` Linear,
the default). A client's personalization layers start, on its first round, as the initial model's
(every client starts from the one initial model, as in FedAvg; the paper leaves their
initialisation open). With no personal layers FedPer is FedAvg.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedpipe.algorithms.base import MethodParams
from fedpipe.algorithms.split_model import SplitModelAlgorithm
from fedpipe.errors import ConfigError


class FedPerParams(MethodParams):
    """FedPer: federated base layers, personalization layers kept on each client."""

    name: Literal["fedper"] = "fedper"
    personal_layers: list[str] = Field(default_factory=lambda: ["head"])
    """Prefixes of the parameter names that stay on the client (a prefix matches the name itself or
    `prefix.` + anything): ["head"] is the output layer of every network here; ["body.3", "head"] in
    `twonn` would also keep the second hidden layer. []: nothing is personal, which is FedAvg."""


class FedPer(SplitModelAlgorithm):
    """The base layers W_B are shared (Algorithm 2 sends and averages only them); the personalization
    layers W_P stay on each client and are trained with W_B (Algorithm 1)."""

    name = "fedper"
    Params = FedPerParams
    paper = "Arivazhagan et al. 2019, Algorithms 1 and 2"
    uploads = "the shared base layers (its personalization head stays on the client)"
    departures = (
        "personal_layers=[head]: only the output layer is personal; the paper's experiments personalise the last one or "
        "two fully connected layers (SuPerFed describes FedPer's personalization layer as the penultimate one)",
        "a client's personalization layers start as the run's initial model's (the paper does not say)",
        "train.* are the run-wide defaults (SGD lr 0.01, momentum 0.9, weight decay 1e-4, B = 10, E = 5), SuPerFed's "
        "settings, not the paper's",
    )
    params: FedPerParams
    layers_option = "personal_layers"
    option_names_shared = False
    phase_description = "base layers federated, personalization layers kept on each client"

    def check_split(self) -> None:
        if not self.shared_names:
            raise ConfigError("method.personal_layers covers every parameter: nothing would be federated. Keep some base layers.")

    @property
    def personal(self) -> list[str]:
        """The personalization layers' parameter names."""
        return self.own_names
