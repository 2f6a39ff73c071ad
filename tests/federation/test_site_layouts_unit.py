"""Each site's upload is checked against its own layout (`Algorithm.upload_layout(phase, download, sent)`): the names
the upload holds pick one of the forms the method allows, and anything that is not wholly that form is refused before
it is aggregated (`fedpipe.federation.transport.check_upload`, `Algorithm.upload_problem`). The attacks are a dishonest
site's: IFCA tensors of two clusters in one upload, a FedMN unit sent in part or the router left out, FedFomo weights
naming models the site was never sent. The honest forms pass (and the loopback federation runs them end to end:
tests/federation/test_methods.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedpipe.algorithms.base import ServerState
from fedpipe.algorithms.fedfomo import IDS, WEIGHTS, client_prefix
from fedpipe.federation.spec import FederationSpec
from fedpipe.federation.transport import UploadRejected, check_upload
from fedpipe.run.config import load_config

BASE = ["partition.num_clients=4", "model.name=twonn", "train.rounds=2"]


class _Array:
    """What check_upload reads of one of Flower's `Array`s: its bytes and its values."""

    def __init__(self, t: torch.Tensor):
        self.value = t.detach().cpu().numpy()
        self.data = self.value.tobytes()

    def numpy(self) -> np.ndarray:
        return self.value


def record(params: dict[str, torch.Tensor]) -> dict[str, _Array]:
    return {k: _Array(t) for k, t in params.items()}


def built(method: str, *extra: str):
    cfg = load_config(None, [*BASE, f"method.name={method}", *extra])
    spec = FederationSpec.from_run_config(cfg, (1, 28, 28), 10, 4)
    algorithm, initial = spec.build(torch.device("cpu"))
    return algorithm, spec.phases()[0], ServerState(initial)


def checked(algorithm, phase, download, upload):
    layout = algorithm.upload_layout(phase, download, upload.keys())
    got = check_upload("site 1", layout, record(upload))
    problem = algorithm.upload_problem(phase, download, got)
    if problem:
        raise UploadRejected(problem)
    return got


def test_ifca_takes_one_clusters_model_and_refuses_a_mix():
    algorithm, phase, server = built("ifca", "method.clusters=3")
    download = algorithm.download(phase, server, 1)
    one = {n: t for n, t in download.items() if n.startswith("cluster2/")}
    assert checked(algorithm, phase, download, one).keys() == one.keys()
    mixed = {**one, **{n: t for n, t in download.items() if n.startswith("cluster0/")}}
    with pytest.raises(UploadRejected, match="unexpected"):
        checked(algorithm, phase, download, mixed)
    with pytest.raises(UploadRejected, match="missing"):  # half of cluster 2's model
        checked(algorithm, phase, download, dict(list(one.items())[:1]))


def test_fedmn_takes_the_router_and_whole_units_only():
    algorithm, phase, server = built("fedmn")
    download = algorithm.download(phase, server, 1)
    router = {n: download[n] for n in algorithm.router_tensors}
    unit, names = next(iter(algorithm.unit_tensors.items()))
    honest = {**router, **{n: download[n] for n in names}}
    assert checked(algorithm, phase, download, honest).keys() == honest.keys()
    assert checked(algorithm, phase, download, router).keys() == router.keys()  # no unit trained: the router alone
    if len(names) > 1:
        with pytest.raises(UploadRejected, match="missing"):  # a unit in part
            checked(algorithm, phase, download, {**router, names[0]: download[names[0]]})
    with pytest.raises(UploadRejected, match="missing"):  # the router left out
        checked(algorithm, phase, download, {n: download[n] for n in names})


def test_fedfomo_refuses_weights_for_models_it_was_not_sent():
    algorithm, phase, server = built("fedfomo", "method.models_per_round=2")
    model = {n: p.detach() for n, p in algorithm.model.named_parameters()}
    server = ServerState(server.global_params, {j: dict(model) for j in range(4)})
    download = algorithm.download(phase, server, 1)
    sent = sorted({int(n.split("/", 1)[0].removeprefix("client")) for n in download})
    assert len(sent) == 2 and all(n.startswith(tuple(client_prefix(j) for j in sent)) for n in download)
    honest = {**model, WEIGHTS: torch.tensor([0.5, -0.1]), IDS: torch.tensor(sent)}
    assert checked(algorithm, phase, download, honest)[IDS].tolist() == sent
    other = next(j for j in range(4) if j not in sent and j != 1)
    with pytest.raises(UploadRejected, match="it was sent the models of"):  # a forged id would steer its affinities
        checked(algorithm, phase, download, {**honest, IDS: torch.tensor([sent[0], other])})
    with pytest.raises(UploadRejected, match="it was sent the models of"):  # an id far past the clients (memory)
        checked(algorithm, phase, download, {**honest, IDS: torch.tensor([sent[0], 10**12])})
    with pytest.raises(UploadRejected, match="shape"):  # more weights than models sent
        checked(algorithm, phase, download, {**honest, WEIGHTS: torch.zeros(3), IDS: torch.tensor([*sent, other])})
