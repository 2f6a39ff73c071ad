"""MNIST-family idx files read directly, as they lie in the original distribution and in Debian's
`dataset-fashion-mnist` package (`/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz`, ...):
gzip-compressed or plain, bounded and verified before a byte of pixels is trusted.

The idx format (LeCun et al., http://yann.lecun.com/exdb/mnist/, "FILE FORMATS FOR THE MNIST DATABASE";
Xiao et al. 2017 keep it for Fashion-MNIST, Cohen et al. 2017 for EMNIST): a 4-byte magic number, two
zero bytes, a type code (0x08 = unsigned byte) and the number of dimensions, then each dimension as a
big-endian uint32, then the values in row-major order and nothing after them. An image file has three
dimensions (N, rows, columns), a label file one (N).

What is checked, each with its own message: the file is at most MAX_IDX_FILE_BYTES on disk; a `.gz`
file is gzip and decompresses without error (its CRC is checked at the end); the magic number; the
dimensions the caller expects (28 x 28 images; as many labels as images); the value bytes are exactly
prod(dims), no fewer (truncated) and no more (trailing data), read in one bounded call so that a
gzip bomb stops at the size the header announced.
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np

from fedpipe.errors import DataError

MAX_IDX_FILE_BYTES = 1 << 30  # 1 GiB on disk; EMNIST byclass's training images are 547 MB uncompressed
MAX_IDX_VALUES = 1 << 30  # values after decompression: the same bound, so a small .gz cannot claim more
UNSIGNED_BYTE = 0x08


def _open(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")


def _exact(stream, n: int, path: Path, what: str) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise DataError(f"{path} is truncated: its {what} needs {n:,} bytes but only {len(data):,} are there. "
                        "Replace it with the original file.")
    return data


def read_idx(path: Path, dims: int, shape: tuple[int, ...] = ()) -> np.ndarray:
    """The uint8 array of one idx file of `dims` dimensions whose trailing dimensions are `shape`
    (e.g. dims=3, shape=(28, 28) for images; dims=1 for labels). Raises DataError naming the file and
    what is wrong with it."""
    size = path.stat().st_size
    if size > MAX_IDX_FILE_BYTES:
        raise DataError(f"{path} is {size:,} bytes, more than the {MAX_IDX_FILE_BYTES:,} any MNIST-family idx file "
                        "takes; it is not one of the dataset's files.")
    try:
        with _open(path) as stream:
            magic = _exact(stream, 4, path, "magic number")
            if magic[:2] != b"\0\0" or magic[2] != UNSIGNED_BYTE or magic[3] != dims:
                raise DataError(
                    f"{path} is not an idx file of {dims}-dimensional unsigned bytes: it starts {magic.hex()} where "
                    f"00 00 08 {dims:02x} was expected. Check that it is the original file, and, for a .gz name, "
                    "that it is really compressed (and for a name without .gz, that it is not)."
                )
            found = tuple(int.from_bytes(_exact(stream, 4, path, "header"), "big") for _ in range(dims))
            if shape and found[1:] != shape:
                raise DataError(f"{path} holds items of shape {found[1:]}, but this dataset's are {shape}: the file "
                                "belongs to another dataset.")
            count = int(np.prod(found, dtype=np.int64))
            if count > MAX_IDX_VALUES:
                raise DataError(f"{path} announces {count:,} values ({found}), more than the {MAX_IDX_VALUES:,} "
                                "any MNIST-family file holds; it is not one of the dataset's files.")
            values = _exact(stream, count, path, f"{found} values")
            if stream.read(1):
                raise DataError(f"{path} has bytes after the {count:,} values its header announces ({found}): it is "
                                "not the original file. Replace it.")
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError; a bad CRC too
        raise DataError(f"{path} could not be read ({exc}). Replace it with the original file.") from exc
    return np.frombuffer(values, dtype=np.uint8).reshape(found).copy()  # writable, as torchvision's arrays


def find_idx(folder: Path, name: str) -> Path | None:
    """`name` (e.g. train-images-idx3-ubyte) in `folder`, plain or as name.gz (the plain one first)."""
    for candidate in (folder / name, folder / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def read_image_split(images: Path, labels: Path, side: int = 28) -> tuple[np.ndarray, np.ndarray]:
    """(images (N, side, side), labels (N,)) from one split's pair of files, checked to agree on N."""
    x = read_idx(images, 3, (side, side))
    y = read_idx(labels, 1)
    if len(x) != len(y):
        raise DataError(f"{images} holds {len(x):,} images but {labels} holds {len(y):,} labels: the two files "
                        "belong to different splits or datasets.")
    return x, y
