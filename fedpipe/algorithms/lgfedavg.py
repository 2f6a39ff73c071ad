"""LG-FedAvg (Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov and Morency, "Think Locally, Act
Globally: Federated Learning with Local and Global Representations", arXiv:2001.01523, 2020),
Algorithm 1 with supervised local representations.

The network is split in two: the lower layers are each client's local representation h(x; theta_m^l),
never sent; the top layers theta^g are a global model acting on those representations, federated
as in FedAvg:

- the server sends theta^g; client m trains (theta_m^l, theta^g) jointly for E epochs on its own data,
  loss l(g(h(x; theta_m^l); theta^g), y), and sends back theta^g only;
- the server averages the returned theta^g by sample count (FedAvg's weighting; the authors' code
  averages them uniformly);
- a client's personalized model is its own local layers under the current global layers.

Which layers are global is `global_layers` (parameter-name prefixes). The default is the output layer,
`head`, that every network here ends in; the authors' scripts keep the last two layers global for
their CIFAR-10 CNN (here lenet5's ["body.2", "head"]) and start from a FedAvg-trained model (run
fedavg first and keep the whole model as every client's start, or accept the initial model as here:
every client's local layers start as the initial model's). FedPer is the mirror image: a global body
and personal top layers.

There is no global model to evaluate on its own: the global layers need a client's representation.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedpipe.algorithms.base import MethodParams, Params
from fedpipe.algorithms.split_model import SplitModelAlgorithm
from fedpipe.errors import ConfigError


class LGFedAvgParams(MethodParams):
    """LG-FedAvg: local representation layers per client, global top layers federated."""

    name: Literal["lgfedavg"] = "lgfedavg"
    global_layers: list[str] = Field(default_factory=lambda: ["head"])
    """Prefixes of the parameter names that are global (federated); every other parameter is a local
    representation layer. ["head"]: the output layer of every network here; ["body.2", "head"] in
    lenet5 is the authors' CIFAR-10 setting (the last two layers global)."""


class LGFedAvg(SplitModelAlgorithm):
    """The global layers theta^g are shared (sent, averaged); each client's local representation
    layers theta_m^l stay on it, trained jointly with theta^g on loss l(g(h(x; theta_m^l); theta^g), y)."""

    name = "lgfedavg"
    Params = LGFedAvgParams
    paper = "Liang et al. 2020, Algorithm 1 (local representations, global top layers)"
    uploads = "the global top layers (its local representation layers stay on the client)"
    departures = (
        "global_layers=[head]: only the output layer is global; the authors' scripts keep the last two layers global "
        "(lenet5: global_layers=[body.2, head])",
        "every layer starts from the run's initial model; the authors' scripts start from a FedAvg-trained model",
        "the server averages the global layers by sample count (FedAvg's rule); the authors' code averages them uniformly",
    )
    params: LGFedAvgParams
    layers_option = "global_layers"
    option_names_shared = True
    own_first = True  # a client's model: its representation, then the global layers on top
    phase_description = "global top layers federated, local representation layers kept on each client"

    def check_split(self) -> None:
        if not self.shared_names or not self.own_names:
            raise ConfigError("method.global_layers must name some but not all layers: LG-FedAvg needs both local "
                              "representation layers and global layers.")

    @property
    def global_names(self) -> list[str]:
        """The global layers' parameter names."""
        return self.shared_names

    @property
    def initial_local(self) -> Params:
        """Where every client's local representation layers start: the initial model's."""
        return self.initial_own
