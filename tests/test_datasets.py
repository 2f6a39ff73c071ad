"""The dataset registry and loaders: real offline data, and tiny files in each dataset's own format."""

from __future__ import annotations

import hashlib
import string
from pathlib import Path
from urllib.error import URLError

import numpy as np
import pytest
from dataset_files import (
    blocky_rgb64,
    tiny_images,
    write_cifar10,
    write_cifar100,
    write_emnist,
    write_mnist,
    write_tinyimagenet,
)
from pydantic import ValidationError

from fedpipe.data.datasets import (
    DATASETS,
    TINY_IMAGENET_MD5,
    TINY_IMAGENET_URL,
    DataConfig,
    load_dataset,
)
from fedpipe.errors import DataError

CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def load(name: str, root: Path, **kw):
    return load_dataset(DataConfig(dataset=name, root=root, **kw))


# --- offline datasets that ship with pip packages -------------------------------------------------


def test_mnist5k_is_5000_real_digits_500_per_class():
    bundle = load_dataset(DataConfig())
    assert bundle.name == "mnist5k" and bundle.test is None
    assert bundle.train.x.shape == (5000, 1, 28, 28) and bundle.train.x.dtype == np.uint8
    assert bundle.train.y.dtype == np.int64
    assert np.bincount(bundle.train.y).tolist() == [500] * 10
    assert bundle.num_classes == 10 and bundle.class_names == tuple("0123456789")
    assert bundle.input_shape == DATASETS["mnist5k"].input_shape
    assert bundle.train.x.max() == 255  # real pixel range, not 0..1 floats
    assert load_dataset(DataConfig()).fingerprint == bundle.fingerprint


def test_digits_scaled_to_0_255():
    from sklearn.datasets import load_digits

    bundle = load_dataset(DataConfig(dataset="digits"))
    assert bundle.train.x.shape == (1797, 1, 8, 8) and bundle.train.x.dtype == np.uint8
    assert bundle.train.y.dtype == np.int64 and bundle.test is None
    assert bundle.num_classes == 10 and len(np.unique(bundle.train.y)) == 10
    raw = load_digits()
    np.testing.assert_array_equal(bundle.train.x[:, 0], np.round(raw.images * 255 / 16).astype(np.uint8))
    np.testing.assert_array_equal(bundle.train.y, raw.target)
    assert load_dataset(DataConfig(dataset="digits")).fingerprint == bundle.fingerprint


# --- torchvision-backed datasets, read from tiny files in their own format ---------------------------


@pytest.mark.parametrize("name, folder", [("mnist", "MNIST"), ("fashion_mnist", "FashionMNIST")])
def test_mnist_family_round_trips_exactly(tmp_path, name, folder):
    (xtr, ytr), (xte, yte) = tiny_images(7, (1, 28, 28), seed=1), tiny_images(4, (1, 28, 28), seed=2)
    write_mnist(tmp_path, (xtr[:, 0], ytr), (xte[:, 0], yte), folder=folder)
    bundle = load(name, tmp_path)
    np.testing.assert_array_equal(bundle.train.x, xtr)
    np.testing.assert_array_equal(bundle.train.y, ytr)
    np.testing.assert_array_equal(bundle.test.x, xte)
    np.testing.assert_array_equal(bundle.test.y, yte)
    assert bundle.train.x.dtype == np.uint8 and bundle.train.y.dtype == np.int64
    assert len(bundle.class_names) == 10
    if name == "mnist":
        assert bundle.class_names == tuple("0123456789")
    expected = hashlib.sha256(xtr.tobytes() + ytr.tobytes() + xte.tobytes() + yte.tobytes()).hexdigest()
    assert bundle.fingerprint == expected


def test_emnist_byclass_images_come_out_upright(tmp_path):
    upright, ytr = tiny_images(5, (1, 28, 28), seed=3)
    upright[0, 0] = 0
    upright[0, 0, 2, :] = 255  # a horizontal stroke near the top
    test_upright, yte = tiny_images(3, (1, 28, 28), seed=4)
    ytr[-1], yte[-1] = 61, 36  # 'z' and 'a': the top of the 62 classes
    # the real EMNIST files store every image transposed; write them that way
    stored, test_stored = upright[:, 0].transpose(0, 2, 1), test_upright[:, 0].transpose(0, 2, 1)
    write_emnist(tmp_path, "byclass", (stored, ytr), (test_stored, yte))
    bundle = load("emnist", tmp_path)
    np.testing.assert_array_equal(bundle.train.x, upright)
    np.testing.assert_array_equal(bundle.test.x, test_upright)
    assert (bundle.train.x[0, 0, 2] == 255).all() and (bundle.train.x[0, 0, :, 2] == 0).sum() > 0
    np.testing.assert_array_equal(bundle.train.y, ytr)
    np.testing.assert_array_equal(bundle.test.y, yte)
    assert bundle.num_classes == 62
    assert "".join(bundle.class_names) == string.digits + string.ascii_uppercase + string.ascii_lowercase


def test_cifar10_round_trips_exactly(tmp_path):
    (xtr, _), (xte, _) = tiny_images(12, (3, 32, 32), seed=5), tiny_images(3, (3, 32, 32), seed=6)
    ytr, yte = np.arange(12) % 10, np.array([9, 0, 4])
    write_cifar10(tmp_path, (xtr, ytr), (xte, yte), CIFAR10_NAMES)
    bundle = load("cifar10", tmp_path)
    np.testing.assert_array_equal(bundle.train.x, xtr)  # channel order and planes survive
    np.testing.assert_array_equal(bundle.train.y, ytr)
    np.testing.assert_array_equal(bundle.test.x, xte)
    np.testing.assert_array_equal(bundle.test.y, yte)
    assert bundle.class_names == tuple(CIFAR10_NAMES) and bundle.input_shape == (3, 32, 32)
    assert bundle.train.x.flags.c_contiguous and bundle.train.y.dtype == np.int64


def test_cifar100_round_trips_with_fine_labels(tmp_path):
    (xtr, _), (xte, _) = tiny_images(6, (3, 32, 32), seed=7), tiny_images(2, (3, 32, 32), seed=8)
    ytr, yte = np.array([0, 99, 5, 42, 7, 99]), np.array([13, 0])
    names = [f"class_{i}" for i in range(100)]
    write_cifar100(tmp_path, (xtr, ytr), (xte, yte), names)
    bundle = load("cifar100", tmp_path)
    np.testing.assert_array_equal(bundle.train.x, xtr)
    np.testing.assert_array_equal(bundle.train.y, ytr)
    np.testing.assert_array_equal(bundle.test.x, xte)
    np.testing.assert_array_equal(bundle.test.y, yte)
    assert bundle.class_names == tuple(names) and bundle.num_classes == 100


def _tiny_imagenet_fixture(root: Path):
    """All 200 classes (wnids.txt unsorted, as in the real set), a few with two images, one grayscale JPEG."""
    wnids = [f"n{(7919 * i) % 100000:08d}" for i in range(1, 201)]
    ytr = np.array([*range(200), 0, 1, 150])
    xtr = blocky_rgb64(len(ytr), seed=9)
    yva = np.array([2, 0, 199, 1])
    xva = blocky_rgb64(len(yva), seed=10)
    write_tinyimagenet(root, wnids, (xtr, ytr), (xva, yva), grayscale_train=(5,))
    return wnids, (xtr, ytr), (xva, yva)


def _image_folder_order(wnids: list[str], labels: np.ndarray) -> list[int]:
    """The order ImageFolder lists the written train images in: by wnid, then by file name <wnid>_<k>."""
    count: dict[int, int] = {}
    keys = []
    for y in labels.tolist():
        keys.append((wnids[y], count.get(y, 0)))  # the k-th image of a class is <wnid>_<k>.JPEG
        count[y] = count.get(y, 0) + 1
    return sorted(range(len(labels)), key=keys.__getitem__)


def test_tinyimagenet_reads_official_layout(tmp_path):
    wnids, (xtr, ytr), (xva, yva) = _tiny_imagenet_fixture(tmp_path)
    bundle = load("tinyimagenet", tmp_path)
    classes = sorted(wnids)
    assert bundle.class_names == tuple(classes)  # label i is the i-th wnid in sorted order
    order = _image_folder_order(wnids, ytr)
    np.testing.assert_array_equal(bundle.train.y, [classes.index(wnids[ytr[i]]) for i in order])
    np.testing.assert_array_equal(bundle.test.y, [classes.index(wnids[y]) for y in yva])
    assert bundle.train.x.shape == (len(ytr), 3, 64, 64) and bundle.test.x.shape == (4, 3, 64, 64)
    assert bundle.train.x.dtype == np.uint8 and bundle.train.y.dtype == np.int64
    # JPEG is lossy: pixels close, not equal (the grayscale one aside)
    colour = [k for k, i in enumerate(order) if i != 5]
    for got, want in ((bundle.train.x[colour], xtr[order][colour]), (bundle.test.x, xva)):
        diff = np.abs(got.astype(int) - want.astype(int))
        assert diff.mean() < 2 and diff.max() < 40
    grey = bundle.train.x[order.index(5)]  # the 1-channel JPEG comes back as RGB with equal channels
    assert (grey[0] == grey[1]).all() and (grey[1] == grey[2]).all()


def test_tinyimagenet_download_extracts_the_official_zip(tmp_path, monkeypatch):
    calls = []

    def fake_download(url, download_root, md5=None, **kw):
        calls.append((url, md5))
        _tiny_imagenet_fixture(Path(download_root))

    monkeypatch.setattr("torchvision.datasets.utils.download_and_extract_archive", fake_download)
    bundle = load("tinyimagenet", tmp_path, download=True)
    assert calls == [(TINY_IMAGENET_URL, TINY_IMAGENET_MD5)]
    assert len(bundle.train) == 203 and len(bundle.test) == 4
    load("tinyimagenet", tmp_path, download=True)  # already there: no second download
    assert len(calls) == 1


# --- errors a user can act on --------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, folder",
    [
        ("mnist", "MNIST/raw"),
        ("fashion_mnist", "FashionMNIST/raw"),
        ("emnist", "EMNIST/raw"),
        ("cifar10", "cifar-10-batches-py"),
        ("cifar100", "cifar-100-python"),
        ("tinyimagenet", "tiny-imagenet-200"),
    ],
)
def test_missing_files_name_the_path_and_the_fix(tmp_path, name, folder):
    with pytest.raises(DataError) as err:
        load(name, tmp_path)
    message = str(err.value)
    assert str(tmp_path / folder) in message
    assert "data.download=true" in message and "FEDPIPE_DATA" in message
    assert "\n" not in message and "Traceback" not in message


def test_one_missing_file_is_named(tmp_path):
    (x, y) = tiny_images(2, (1, 28, 28))
    write_mnist(tmp_path, (x[:, 0], y), (x[:, 0], y))
    (tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte is missing"):
        load("mnist", tmp_path)


def test_corrupt_cifar_batch_is_a_data_error(tmp_path):
    (x, _) = tiny_images(5, (3, 32, 32))
    folder = write_cifar10(tmp_path, (x, np.arange(5)), (x, np.arange(5)), CIFAR10_NAMES)
    (folder / "data_batch_3").write_bytes(b"not a pickle")
    with pytest.raises(DataError) as err:
        load("cifar10", tmp_path)
    assert "reading them failed" in str(err.value) and str(folder) in str(err.value)
    assert err.value.__cause__ is not None  # the original error stays chained for debugging


def test_wrong_image_size_is_rejected(tmp_path):
    (x, y) = tiny_images(2, (1, 20, 20))
    write_mnist(tmp_path, (x[:, 0], y), (x[:, 0], y))
    with pytest.raises(DataError, match=r"belong to another dataset"):
        load("mnist", tmp_path)


@pytest.mark.parametrize(
    "name, module, folder",
    [
        ("mnist", "torchvision.datasets.mnist", "MNIST/raw"),
        ("emnist", "torchvision.datasets.mnist", "EMNIST/raw"),
        ("cifar10", "torchvision.datasets.cifar", "cifar-10-batches-py"),
        ("tinyimagenet", "torchvision.datasets.utils", "tiny-imagenet-200"),
    ],
)
def test_failed_download_is_a_data_error(tmp_path, monkeypatch, name, module, folder):
    def offline(*args, **kwargs):
        raise URLError("no route to host")

    monkeypatch.setattr(f"{module}.download_and_extract_archive", offline)
    with pytest.raises(DataError) as err:
        load(name, tmp_path, download=True)
    message = str(err.value)
    assert "no route to host" in message and str(tmp_path / folder) in message
    assert "can reach the dataset's server" in message and "\n" not in message


def test_root_defaults_to_fedpipe_data(tmp_path, monkeypatch):
    (x, y) = tiny_images(3, (1, 28, 28))
    write_mnist(tmp_path, (x[:, 0], y), (x[:, 0], y))
    monkeypatch.setenv("FEDPIPE_DATA", str(tmp_path))
    bundle = load_dataset(DataConfig(dataset="mnist"))
    np.testing.assert_array_equal(bundle.train.x, x)


def test_unknown_dataset_lists_the_allowed_names():
    with pytest.raises(ValidationError) as err:
        DataConfig(dataset="imagenet")
    assert err.value.errors()[0]["loc"] == ("dataset",)
    message = str(err.value)
    for name in DATASETS:
        assert name in message


def test_registry_and_config_document_themselves():
    assert list(DATASETS) == [
        "mnist5k", "digits", "mnist", "fashion_mnist", "emnist", "cifar10", "cifar100", "tinyimagenet", "agnews"
    ]
    for key, info in DATASETS.items():
        assert info.name == key and "\n" not in info.description
        assert len(info.input_shape) == (2 if key == "agnews" else 3)  # text: (T, V); images: (C, H, W)
    assert DATASETS["emnist"].num_classes == 62 and DATASETS["tinyimagenet"].input_shape == (3, 64, 64)
    assert DATASETS["agnews"].num_classes == 4
    assert all(field.description for field in DataConfig.model_fields.values())
