"""MNIST-family idx files read directly, in the original distribution's layout (Debian's dataset-fashion-mnist:
the four .gz files in data.root), bounded and verified before parsing; and a few seconds' training on the real
Fashion-MNIST when the Debian package is installed (`make test` installs it: scripts/test-services.sh)."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
from dataset_files import tiny_images, write_idx, write_mnist, write_mnist_original

from fedpipe.data import idx
from fedpipe.data.datasets import DataConfig, load_dataset
from fedpipe.errors import DataError

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")


def _tiny(tmp_path: Path, compress: bool = True):
    (xtr, ytr), (xte, yte) = tiny_images(6, (1, 28, 28), seed=1), tiny_images(3, (1, 28, 28), seed=2)
    write_mnist_original(tmp_path, (xtr[:, 0], ytr), (xte[:, 0], yte), compress=compress)
    return xtr, ytr, xte, yte


@pytest.mark.parametrize("compress", [True, False])
def test_original_layout_reads_the_same_arrays_as_torchvisions(tmp_path, compress):
    xtr, ytr, xte, yte = _tiny(tmp_path / "flat", compress)
    write_mnist(tmp_path / "tv", (xtr[:, 0], ytr), (xte[:, 0], yte), folder="FashionMNIST")
    flat = load_dataset(DataConfig(dataset="fashion_mnist", root=tmp_path / "flat"))
    tv = load_dataset(DataConfig(dataset="fashion_mnist", root=tmp_path / "tv"))
    np.testing.assert_array_equal(flat.train.x, xtr)
    np.testing.assert_array_equal(flat.test.y, yte)
    assert flat.fingerprint == tv.fingerprint and flat.class_names == tv.class_names
    assert flat.class_names[0] == "T-shirt/top" and flat.train.y.dtype == np.int64


def test_a_missing_file_names_both_layouts(tmp_path):
    _tiny(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError) as err:
        load_dataset(DataConfig(dataset="fashion_mnist", root=tmp_path))
    assert "/usr/share/datasets/fashion-mnist" in str(err.value) and "torchvision's layout" in str(err.value)


def _rewrite(path: Path, data: bytes) -> None:
    path.write_bytes(gzip.compress(data, mtime=0))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda b: b[:3] + b"\x02" + b[4:], r"starts 00000802 where 00 00 08 03 was expected"),  # wrong ndim
        (lambda b: b"\x1f\x8b" + b[2:], r"is not an idx file"),  # a twice-compressed or foreign file
        (lambda b: b[:-5], r"is truncated"),
        (lambda b: b + b"\0", r"has bytes after"),
        (lambda b: b[:8] + (27).to_bytes(4, "big") + b[12:], r"items of shape \(27, 28\)"),
    ],
)
def test_a_damaged_image_file_is_refused_naming_it(tmp_path, change, message):
    _tiny(tmp_path)
    path = tmp_path / "train-images-idx3-ubyte.gz"
    _rewrite(path, change(gzip.decompress(path.read_bytes())))
    with pytest.raises(DataError, match=message) as err:
        load_dataset(DataConfig(dataset="fashion_mnist", root=tmp_path))
    assert str(path) in str(err.value)


def test_a_file_that_is_not_gzip_despite_its_name_is_refused(tmp_path):
    _tiny(tmp_path)
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(gzip.decompress(path.read_bytes()))
    with pytest.raises(DataError, match="could not be read"):
        load_dataset(DataConfig(dataset="fashion_mnist", root=tmp_path))


def test_labels_and_images_must_agree_on_the_count(tmp_path):
    _tiny(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(5, np.uint8))  # the plain file is found first
    with pytest.raises(DataError, match="holds 6 images but .* holds 5 labels"):
        load_dataset(DataConfig(dataset="fashion_mnist", root=tmp_path))


def test_a_header_announcing_too_much_stops_before_reading(tmp_path, monkeypatch):
    """A small .gz whose header claims more values than any MNIST-family file holds is refused from its
    header: nothing is decompressed beyond it (a gzip bomb stops there)."""
    path = tmp_path / "bomb-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(bytes([0, 0, 8, 3]) + b"".join(n.to_bytes(4, "big") for n in (2000, 28, 28)), mtime=0))
    monkeypatch.setattr(idx, "MAX_IDX_VALUES", 1000 * 28 * 28)
    with pytest.raises(DataError, match="announces 1,568,000 values"):
        idx.read_idx(path, 3, (28, 28))
    monkeypatch.setattr(idx, "MAX_IDX_FILE_BYTES", 10)
    with pytest.raises(DataError, match="more than the 10"):
        idx.read_idx(path, 3, (28, 28))


@pytest.mark.skipif(not (DEBIAN_FASHION_MNIST / "train-images-idx3-ubyte.gz").is_file(),
                    reason="the real Fashion-MNIST is not installed: apt-get install dataset-fashion-mnist "
                           "(scripts/test-services.sh does, under make test)")
def test_trains_on_the_real_fashion_mnist(tmp_path):
    """The Debian package's files as they lie: 60,000 + 10,000 28x28 images, 6,000 + 1,000 per class; then a
    FedAvg run of a few seconds on 10 clients of them learns far above chance (10%) on the official test split."""
    from fedpipe.data.federated import prepare_data
    from fedpipe.engine.evaluation import evaluate_model
    from fedpipe.run.config import load_config
    from fedpipe.run.run import Run

    bundle = load_dataset(DataConfig(dataset="fashion_mnist", root=DEBIAN_FASHION_MNIST))
    assert bundle.train.x.shape == (60000, 1, 28, 28) and bundle.test.x.shape == (10000, 1, 28, 28)
    assert np.bincount(bundle.train.y).tolist() == [6000] * 10 and np.bincount(bundle.test.y).tolist() == [1000] * 10
    cfg = load_config(None, [
        "data.dataset=fashion_mnist", f"data.root={DEBIAN_FASHION_MNIST}", "method.name=fedavg", "model.name=lenet5",
        "partition.scheme=majority_class", "partition.p=0.2", "partition.num_clients=10", "partition.samples_per_client=150",
        "train.rounds=3", "train.client_fraction=1.0", "train.local_epochs=1", "train.batch_size=20", "train.optimizer=adam",
        "train.lr=0.002", "eval.every=0", f"run.store={tmp_path}", "telemetry.progress=false", "run.seed=0",
    ])
    run = Run(cfg)
    run.partition()
    state = run.train("federation")
    algorithm, _ = run.build_algorithm()
    data = prepare_data(run.bundle, run.load_partition(), run.device)
    scores = evaluate_model(algorithm, algorithm.global_model(state.server), data.global_test, 500, 10)
    assert scores.n == 10000 and scores.accuracy > 0.35, scores  # the official test split; chance is 0.1 (0.457 seen)
