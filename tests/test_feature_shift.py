"""Feature skew on top of a label split: some clients see transformed images (FedMN's setting)."""

import numpy as np
import pytest
import torch

from fedpipe.data.datasets import load_dataset
from fedpipe.data.federated import prepare_data
from fedpipe.data.partition import Partition, make_partition
from fedpipe.run.config import load_config


@pytest.fixture(scope="module")
def mnist():
    return load_dataset(load_config().data)


def shifted_partition(bundle, fraction=0.5, shifts=("rotate90", "invert"), seed=0):
    cfg = load_config(None, ["partition.num_clients=8", f"partition.feature_shift={list(shifts)}",
                             f"partition.feature_shift_fraction={fraction}"]).partition
    return make_partition(bundle, cfg, seed)


def test_the_fraction_of_clients_gets_the_shifts_in_turn_and_the_manifest_keeps_them(mnist):
    p = shifted_partition(mnist)
    transforms = [c.transform for c in p.clients]
    assert sum(t is not None for t in transforms) == 4
    assert [t for t in transforms if t] == ["rotate90", "invert", "rotate90", "invert"]
    assert shifted_partition(mnist) == p and Partition.from_manifest(p.to_json()) == p
    assert [c.transform for c in shifted_partition(mnist, seed=3).clients] != transforms
    bad = p.to_manifest()
    bad["clients"][0]["transform"] = "blur"
    with pytest.raises(Exception, match="transform"):
        Partition.from_manifest(bad)


def test_images_are_transformed_before_standardisation_and_the_global_test_set_is_not(mnist):
    p = shifted_partition(mnist, fraction=1.0, shifts=("rotate90",))
    plain = make_partition(mnist, load_config(None, ["partition.num_clients=8"]).partition, 0)
    shifted, unshifted = prepare_data(mnist, p, torch.device("cpu")), prepare_data(mnist, plain, torch.device("cpu"))
    a, b = shifted.clients[0].train.x, unshifted.clients[0].train.x
    assert torch.allclose(a, torch.rot90(b, 1, dims=(2, 3)), atol=1e-5)  # rotation leaves the pixel statistics alone
    assert torch.equal(shifted.global_test.x, unshifted.global_test.x)
    inverted = prepare_data(mnist, shifted_partition(mnist, fraction=1.0, shifts=("invert",)), torch.device("cpu"))
    corr = np.corrcoef(inverted.clients[0].train.x.flatten().numpy(), b.flatten().numpy())[0, 1]
    assert corr < -0.99
