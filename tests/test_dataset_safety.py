"""Dataset files are data, never code: a planted pickle in a shared data folder is refused before it
runs, benign files load exactly as torchvision loads them, and files that are not the official ones
are said to be so (issue 21)."""

from __future__ import annotations

import hashlib
import logging
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from dataset_files import (
    RunsCommand,
    plant_pickle,
    python2_pickle,
    tiny_images,
    write_cifar10,
    write_cifar100,
    write_mnist,
)

from fedpipe.data import datasets
from fedpipe.data.datasets import CIFAR10_FILES, CIFAR100_FILES, DataConfig, load_dataset
from fedpipe.data.safe_pickle import load_cifar_pickle
from fedpipe.errors import DataError

CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
CIFAR100_NAMES = [f"class_{i}" for i in range(100)]


def write_tiny_cifar(name: str, root: Path, python2: bool = False):
    """Tiny benign batches in the official format; returns their folder."""
    if name == "cifar10":
        (xtr, _), (xte, _) = tiny_images(12, (3, 32, 32), seed=5), tiny_images(3, (3, 32, 32), seed=6)
        return write_cifar10(root, (xtr, np.arange(12) % 10), (xte, np.array([9, 0, 4])), CIFAR10_NAMES, python2)
    (xtr, _), (xte, _) = tiny_images(6, (3, 32, 32), seed=7), tiny_images(2, (3, 32, 32), seed=8)
    return write_cifar100(root, (xtr, np.array([0, 99, 5, 42, 7, 99])), (xte, np.array([13, 0])), CIFAR100_NAMES, python2)


# --- a planted pickle is refused, and nothing of it runs ----------------------------------------------


@pytest.mark.parametrize(
    "name, file, protocol",
    [
        ("cifar10", "data_batch_1", 2),
        ("cifar10", "test_batch", 4),  # STACK_GLOBAL instead of GLOBAL: the same find_class
        ("cifar10", "batches.meta", 0),
        ("cifar100", "train", 2),
        ("cifar100", "test", 5),
        ("cifar100", "meta", 2),
    ],
)
def test_planted_pickle_is_refused_naming_the_file_and_never_runs(tmp_path, name, file, protocol):
    folder = write_tiny_cifar(name, tmp_path / "data")
    marker = tmp_path / "planted-code-ran"
    plant_pickle(folder / file, marker, protocol)
    with pytest.raises(DataError) as err:
        load_dataset(DataConfig(dataset=name, root=tmp_path / "data"))
    assert not marker.exists(), "the planted pickle ran its command"
    message = str(err.value)
    assert str(folder / file) in message and "posix.system" in message
    assert "Nothing from it was run" in message and "\n" not in message


def test_planted_pickle_under_fedpipe_data_is_refused(tmp_path, monkeypatch):
    """The shared volume case: no data.root, the folder comes from $FEDPIPE_DATA."""
    folder = write_tiny_cifar("cifar10", tmp_path / "shared")
    marker = tmp_path / "planted-code-ran"
    plant_pickle(folder / "data_batch_3", marker)
    monkeypatch.setenv("FEDPIPE_DATA", str(tmp_path / "shared"))
    with pytest.raises(DataError) as err:
        load_dataset(DataConfig(dataset="cifar10"))
    assert not marker.exists(), "the planted pickle ran its command"
    assert "posix.system" in str(err.value) and str(folder / "data_batch_3") in str(err.value)


@pytest.mark.parametrize(
    "payload, refused",
    [
        (RunsCommand("true"), "posix.system"),
        (np.rec.array([(1, 2)], dtype=[("a", "u1"), ("b", "u1")]), "numpy.rec.recarray"),  # an ndarray subclass
        (np.zeros(3, dtype=np.uint8), "numpy._core.numeric._frombuffer"),  # numpy at protocol 5
    ],
)
def test_only_the_globals_cifar_files_need_are_admitted(payload, refused):
    with pytest.raises(DataError, match=refused.replace(".", r"\.")):
        load_cifar_pickle(pickle.dumps({"data": payload}, protocol=5), "some/file")


def test_bytes_may_be_encoded_with_latin1_only():
    crafted = b"\x80\x02c_codecs\nencode\nX\x03\x00\x00\x00abcX\x04\x00\x00\x00zlib\x86R."
    with pytest.raises(pickle.UnpicklingError, match="latin-1"):
        load_cifar_pickle(crafted, "f")
    assert load_cifar_pickle(pickle.dumps(b"\x00\xff", protocol=2), "f") == b"\x00\xff"


# --- benign files: exactly what torchvision makes of them ----------------------------------------------


def torchvision_reads(name: str, root: Path):
    """torchvision's own loader (md5 checks dropped, as tiny files are not the official bytes)."""
    from torchvision import datasets as tv

    stock = tv.CIFAR10 if name == "cifar10" else tv.CIFAR100
    files_only = type("FilesOnly", (stock,), {
        "train_list": [[f, None] for f, _ in stock.train_list],
        "test_list": [[f, None] for f, _ in stock.test_list],
        "meta": {**stock.meta, "md5": None},
    })
    return files_only(str(root), train=True), files_only(str(root), train=False)


@pytest.mark.parametrize("python2", [False, True], ids=["python3-protocol2", "python2-official-format"])
@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_benign_files_load_exactly_as_torchvision_loads_them(tmp_path, name, python2):
    write_tiny_cifar(name, tmp_path, python2)
    bundle = load_dataset(DataConfig(dataset=name, root=tmp_path))
    tv_train, tv_test = torchvision_reads(name, tmp_path)
    for ours, theirs in ((bundle.train, tv_train), (bundle.test, tv_test)):
        np.testing.assert_array_equal(ours.x, theirs.data.transpose(0, 3, 1, 2))  # torchvision gives HWC
        np.testing.assert_array_equal(ours.y, theirs.targets)
        assert ours.x.dtype == np.uint8 and ours.y.dtype == np.int64 and ours.x.flags.c_contiguous
    assert bundle.class_names == tuple(tv_train.classes)


def test_python2_format_is_what_the_official_files_hold():
    """The writer the test above relies on: BINSTRING opcodes and numpy 1's module name, as Python 2 wrote."""
    data = python2_pickle({"data": np.arange(6, dtype=np.uint8).reshape(2, 3), "labels": [1, 2]})
    assert b"cnumpy.core.multiarray\n_reconstruct\n" in data and b"_codecs" not in data
    loaded = load_cifar_pickle(data, "f")
    np.testing.assert_array_equal(loaded["data"], np.arange(6).reshape(2, 3))
    assert loaded["labels"] == [1, 2]


@pytest.mark.parametrize(
    "entry, problem",
    [
        ({"data": np.zeros((2, 3072), dtype=np.int64), "labels": [0, 1]}, "uint8"),
        ({"data": np.zeros((2, 3072), dtype=np.uint8), "labels": [0]}, "list of 2 integers"),
        ({"labels": [0]}, "not a CIFAR batch"),
    ],
)
def test_a_batch_that_is_no_cifar_batch_is_a_data_error(tmp_path, entry, problem):
    folder = write_tiny_cifar("cifar10", tmp_path)
    (folder / "data_batch_2").write_bytes(pickle.dumps(entry, protocol=2))
    with pytest.raises(DataError, match=problem) as err:
        load_dataset(DataConfig(dataset="cifar10", root=tmp_path))
    assert str(folder / "data_batch_2") in str(err.value) and err.value.__cause__ is not None


# --- the published md5s: pinned in fedpipe, compared, reported ------------------------------------------


def test_pinned_md5s_are_the_published_ones_torchvision_records():
    from torchvision.datasets import CIFAR10, CIFAR100

    for ours, stock in ((CIFAR10_FILES, CIFAR10), (CIFAR100_FILES, CIFAR100)):
        assert ours.folder == stock.base_folder
        assert [list(pair) for pair in ours.train] == stock.train_list
        assert [list(pair) for pair in ours.test] == stock.test_list
        assert ours.meta == (stock.meta["filename"], stock.meta["md5"]) and ours.classes_key == stock.meta["key"]


def test_files_that_are_not_the_official_ones_are_read_with_a_warning(tmp_path, caplog):
    folder = write_tiny_cifar("cifar10", tmp_path)
    with caplog.at_level(logging.WARNING, logger="fedpipe.data.datasets"):
        bundle = load_dataset(DataConfig(dataset="cifar10", root=tmp_path))
    assert len(bundle.train) == 12
    warning = caplog.text
    assert "not the official files" in warning and str(folder) in warning
    assert all(f in warning for f in CIFAR10_FILES.published_md5)


def test_files_with_the_published_md5_raise_no_warning(tmp_path, caplog, monkeypatch):
    folder = write_tiny_cifar("cifar100", tmp_path)
    md5 = {f: hashlib.md5((folder / f).read_bytes()).hexdigest() for f in ("train", "test", "meta")}
    pinned = datasets.CifarFiles("cifar-100-python", (("train", md5["train"]),), (("test", md5["test"]),),
                                 ("meta", md5["meta"]), "fine_label_names")
    monkeypatch.setitem(datasets.CIFAR_FILES, "cifar100", pinned)
    with caplog.at_level(logging.WARNING, logger="fedpipe.data.datasets"):
        load_dataset(DataConfig(dataset="cifar100", root=tmp_path))
    assert "not the official files" not in caplog.text


def test_download_that_leaves_unofficial_files_is_an_error(tmp_path, monkeypatch):
    calls = []

    def fake_download(url, download_root, filename=None, md5=None, **kw):
        calls.append((url, filename, md5))
        write_tiny_cifar("cifar10", Path(download_root))

    monkeypatch.setattr("torchvision.datasets.cifar.download_and_extract_archive", fake_download)
    with pytest.raises(DataError, match="still do not have the md5"):
        load_dataset(DataConfig(dataset="cifar10", root=tmp_path, download=True))
    from torchvision.datasets import CIFAR10

    assert calls == [(CIFAR10.url, CIFAR10.filename, CIFAR10.tgz_md5)]  # the archive itself is md5-checked


# --- the other loaders: no pickle that could run code -------------------------------------------------


def test_a_planted_legacy_mnist_file_is_refused_by_weights_only(tmp_path):
    """torchvision prefers MNIST/processed/{training,test}.pt when they exist and reads them with
    torch.load(weights_only=True): a planted one fails to load and runs nothing."""
    (x, y) = tiny_images(3, (1, 28, 28))
    write_mnist(tmp_path, (x[:, 0], y), (x[:, 0], y))
    marker = tmp_path / "planted-code-ran"
    processed = tmp_path / "MNIST" / "processed"
    processed.mkdir()
    for f in ("training.pt", "test.pt"):
        torch.save(RunsCommand(f"touch {marker}"), processed / f)
    with pytest.raises(DataError, match="reading them failed"):
        load_dataset(DataConfig(dataset="mnist", root=tmp_path))
    assert not marker.exists()
