"""Write tiny datasets in each dataset's own on-disk format, so the real loaders can be tested offline.

Each writer takes uint8 NCHW images and integer labels and lays them out exactly where and how
torchvision (or the official Tiny ImageNet zip) puts them under a data root.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import numpy as np
from PIL import Image


def tiny_images(n: int, shape: tuple[int, int, int], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """n random uint8 images of shape (C, H, W) and labels cycling 0, 1, 2, ..."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, *shape), dtype=np.uint8), np.arange(n, dtype=np.int64) % 3


def write_idx(path: Path, array: np.ndarray) -> None:
    """An idx-ubyte file: magic 0x00 0x00 0x08 (uint8) <ndim>, each dim as big-endian uint32, then the bytes."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header + array.tobytes())


def write_mnist(root: Path, train: tuple, test: tuple, folder: str = "MNIST") -> Path:
    """MNIST / FashionMNIST: ROOT/<folder>/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte (unzipped, as
    torchvision keeps them after extracting the .gz downloads). Images as (N, H, W)."""
    raw = root / folder / "raw"
    for prefix, (x, y) in (("train", train), ("t10k", test)):
        write_idx(raw / f"{prefix}-images-idx3-ubyte", x)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", y)
    return raw


def write_mnist_original(root: Path, train: tuple, test: tuple, compress: bool = True) -> Path:
    """The original distribution's layout, as Debian's dataset-fashion-mnist installs it under
    /usr/share/datasets/fashion-mnist: ROOT/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz, gzip-compressed
    (plain files with compress=False). Images as (N, H, W)."""
    import gzip

    for prefix, (x, y) in (("train", train), ("t10k", test)):
        for part, array in (("images-idx3", x), ("labels-idx1", y)):
            path = root / f"{prefix}-{part}-ubyte"
            write_idx(path, array)
            if compress:
                path.with_name(path.name + ".gz").write_bytes(gzip.compress(path.read_bytes(), mtime=0))
                path.unlink()
    return root


def write_emnist(root: Path, split: str, train: tuple, test: tuple) -> Path:
    """EMNIST: ROOT/EMNIST/raw/emnist-<split>-{train,test}-{images-idx3,labels-idx1}-ubyte. The images are
    written as given: callers pass them transposed, the way the real EMNIST files store them."""
    raw = root / "EMNIST" / "raw"
    for part, (x, y) in (("train", train), ("test", test)):
        write_idx(raw / f"emnist-{split}-{part}-images-idx3-ubyte", x)
        write_idx(raw / f"emnist-{split}-{part}-labels-idx1-ubyte", y)
    return raw


class _Python2Pickler(pickle._Pickler):
    """Protocol 2 as Python 2's cPickle wrote the official CIFAR files: `str` and byte strings as
    BINSTRING opcodes (read back with encoding="latin1"), not Python 3's BINUNICODE and _codecs.encode."""

    dispatch = dict(pickle._Pickler.dispatch)

    def _save_binstring(self, obj: bytes | str) -> None:
        data = obj.encode("latin-1") if isinstance(obj, str) else obj
        if len(data) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else:
            self.write(pickle.BINSTRING + len(data).to_bytes(4, "little") + data)
        self.memoize(obj)

    dispatch[bytes] = _save_binstring
    dispatch[str] = _save_binstring


def python2_pickle(obj: object) -> bytes:
    """`obj` pickled the way the official CIFAR batch files are: protocol 2 from Python 2, numpy arrays
    through numpy.core.multiarray._reconstruct (numpy 1's module name)."""
    buffer = io.BytesIO()
    _Python2Pickler(buffer, protocol=2).dump(obj)
    return buffer.getvalue().replace(b"cnumpy._core.multiarray\n_reconstruct\n", b"cnumpy.core.multiarray\n_reconstruct\n")


def _pickle(path: Path, obj: dict, python2: bool = False) -> None:
    """Protocol 2 from Python 3 (bytes through _codecs.encode), or with `python2` byte for byte the way
    Python 2 wrote the official files."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if python2:
        path.write_bytes(python2_pickle(obj))
        return
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


class RunsCommand:
    """What a planted pickle holds: unpickling it calls os.system(command), which is `posix.system`
    on Linux (the name the pickle stores)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def plant_pickle(path: Path, marker: Path, protocol: int = 2) -> None:
    """Overwrite `path` with a CIFAR-looking batch whose 'data' runs `touch marker` when unpickled."""
    batch = {"batch_label": "training batch 1 of 5", "labels": [0], "data": RunsCommand(f"touch {marker}")}
    path.write_bytes(pickle.dumps(batch, protocol=protocol))


def _cifar_rows(x: np.ndarray) -> np.ndarray:
    """CIFAR's row format: 3072 bytes per image, the red plane, then green, then blue, each row-major."""
    return np.ascontiguousarray(x, dtype=np.uint8).reshape(len(x), 3 * 32 * 32)


def write_cifar10(root: Path, train: tuple, test: tuple, label_names: list[str], python2: bool = False) -> Path:
    """ROOT/cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}: pickled dicts (see _pickle)."""
    folder = root / "cifar-10-batches-py"
    for i, idx in enumerate(np.array_split(np.arange(len(train[1])), 5), start=1):
        _pickle(folder / f"data_batch_{i}", python2=python2, obj={
            "batch_label": f"training batch {i} of 5",
            "labels": [int(v) for v in train[1][idx]],
            "data": _cifar_rows(train[0][idx]),
            "filenames": [f"img_{j}.png" for j in idx],
        })
    _pickle(folder / "test_batch", python2=python2, obj={
        "batch_label": "testing batch 1 of 1",
        "labels": [int(v) for v in test[1]],
        "data": _cifar_rows(test[0]),
        "filenames": [f"test_{j}.png" for j in range(len(test[1]))],
    })
    _pickle(folder / "batches.meta", python2=python2, obj={"label_names": label_names, "num_cases_per_batch": 10000, "num_vis": 3072})
    return folder


def write_cifar100(root: Path, train: tuple, test: tuple, fine_label_names: list[str], python2: bool = False) -> Path:
    """ROOT/cifar-100-python/{train, test, meta}: pickled dicts with fine and coarse labels (see _pickle)."""
    folder = root / "cifar-100-python"
    for part, (x, y) in (("train", train), ("test", test)):
        _pickle(folder / part, python2=python2, obj={
            "batch_label": f"{part} batch",
            "fine_labels": [int(v) for v in y],
            "coarse_labels": [int(v) // 5 for v in y],
            "data": _cifar_rows(x),
            "filenames": [f"{part}_{j}.png" for j in range(len(y))],
        })
    _pickle(folder / "meta", python2=python2, obj={
        "fine_label_names": fine_label_names,
        "coarse_label_names": [f"super_{i}" for i in range(20)],
    })
    return folder


def blocky_rgb64(n: int, seed: int = 0) -> np.ndarray:
    """(n, 3, 64, 64) images made of flat 16x16 colour blocks: JPEG keeps them almost exactly."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, 3, 4, 4), dtype=np.uint8)
    return blocks.repeat(16, axis=2).repeat(16, axis=3)


def _save_jpeg(path: Path, chw: np.ndarray, grayscale: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.fromarray(np.ascontiguousarray(chw.transpose(1, 2, 0)))
    if grayscale:
        image = image.convert("L")
    image.save(path, format="JPEG", quality=95, subsampling=0)


def write_tinyimagenet(
    root: Path, wnids: list[str], train: tuple, val: tuple, grayscale_train: tuple[int, ...] = ()
) -> Path:
    """The official tiny-imagenet-200 layout: wnids.txt, train/<wnid>/images/<wnid>_<i>.JPEG with
    <wnid>_boxes.txt, val/images/val_<i>.JPEG and val/val_annotations.txt (file, wnid, box, tab-separated).
    Labels index `wnids`; train images listed in grayscale_train are saved as 1-channel JPEGs (the real
    set has some)."""
    folder = root / "tiny-imagenet-200"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "wnids.txt").write_text("".join(f"{w}\n" for w in wnids))
    counts: dict[str, int] = {}
    for i, (x, label) in enumerate(zip(*train)):
        wnid = wnids[int(label)]
        k = counts[wnid] = counts.get(wnid, -1) + 1
        _save_jpeg(folder / "train" / wnid / "images" / f"{wnid}_{k}.JPEG", x, grayscale=i in grayscale_train)
        with open(folder / "train" / wnid / f"{wnid}_boxes.txt", "a") as f:
            f.write(f"{wnid}_{k}.JPEG\t0\t0\t63\t63\n")
    lines = []
    for i, (x, label) in enumerate(zip(*val)):
        _save_jpeg(folder / "val" / "images" / f"val_{i}.JPEG", x)
        lines.append(f"val_{i}.JPEG\t{wnids[int(label)]}\t0\t0\t63\t63\n")
    (folder / "val" / "val_annotations.txt").write_text("".join(lines))
    return folder
