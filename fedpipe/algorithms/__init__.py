"""The methods, one file each, and the registry that maps a config's `method.name` to its class."""

from __future__ import annotations

from typing import Annotated, Union

from pydantic import Field

from fedpipe.algorithms.apfl import APFL
from fedpipe.algorithms.base import Algorithm, MethodParams, Phase
from fedpipe.algorithms.ditto import Ditto
from fedpipe.algorithms.fedamp import FedAMP
from fedpipe.algorithms.fedavg import FedAvg
from fedpipe.algorithms.fedfomo import FedFomo
from fedpipe.algorithms.fedmn import FedMN
from fedpipe.algorithms.fedmoe import FedMoE
from fedpipe.algorithms.fedper import FedPer
from fedpipe.algorithms.fedprox import FedProx
from fedpipe.algorithms.finetune import FedAvgFT, FedProxFT, FineTuned, with_finetune
from fedpipe.algorithms.ifca import IFCA
from fedpipe.algorithms.lgfedavg import LGFedAvg
from fedpipe.algorithms.local import Local
from fedpipe.algorithms.pfedmb import PFedMB
from fedpipe.algorithms.pfedme import PFedMe
from fedpipe.algorithms.superfed import SuPerFedLM, SuPerFedMM

ALGORITHMS: dict[str, type[Algorithm]] = {
    cls.name: cls for cls in (FedAvg, FedProx, Local, FedAvgFT, FedProxFT, SuPerFedMM, SuPerFedLM, PFedMB,
                    FedPer, PFedMe, IFCA, FedFomo, FedAMP, Ditto, FedMN,
                    FedMoE, APFL, LGFedAvg)
}

# The `method` section of a run config: one of the methods' parameter classes, chosen by `name`.
MethodConfig = Annotated[Union[tuple(cls.Params for cls in ALGORITHMS.values())], Field(discriminator="name")]


def phases_of(params: MethodParams, rounds: int) -> list[Phase]:
    """A configured method's phases: its own, then `finetune` when method.finetune_epochs > 0."""
    return with_finetune(ALGORITHMS[params.name].phases(params, rounds), params)


def build_algorithm(params: MethodParams, model, seed: int) -> Algorithm:
    algorithm = ALGORITHMS[params.name](params, model, seed)
    return FineTuned(algorithm) if params.finetune_epochs else algorithm


__all__ = ["ALGORITHMS", "Algorithm", "MethodConfig", "MethodParams", "build_algorithm", "phases_of"]
