"""The `image_folders` layout: `<source>/<client>/<label>/<image>`, PNG or JPEG files decoded by Pillow.

Every file is read on its own (bounded by MAX_IMAGE_BYTES, its version checked) and decoded straight into
one preallocated uint8 array, so memory holds the decoded dataset and one file, never every file's bytes.
A decoder of someone else's files refuses, as an error naming the file: a format other than PNG or JPEG,
an image whose header claims more than MAX_IMAGE_PIXELS pixels (a decompression bomb: a small file that
inflates to gigabytes), a truncated or corrupt file, and (without data.image_size) a size that differs
from the others'.
"""

from __future__ import annotations

import io
import warnings
from pathlib import PurePosixPath

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from fedpipe.data.files.budget import DecodeBudget
from fedpipe.data.files.manifest import IMAGE_EXTENSIONS, MANIFEST_NAME, DataManifest
from fedpipe.data.files.rows import ClientRows, Problems
from fedpipe.data.identity import identity_of
from fedpipe.errors import DataError
from fedpipe.store.source import SUCCESS_MARKER, DataSource, SourceObject

__all__ = ["MAX_IMAGE_BYTES", "MAX_IMAGE_PIXELS", "ImageStack", "decode_image", "decoding_bytes", "read_image_folders"]

MAX_IMAGE_BYTES = 64 * 2**20  # one image file: a 64 MiB PNG or JPEG is far above a training image
MAX_IMAGE_PIXELS = 64_000_000  # 64 megapixels: decoded, 192 MB as RGB; larger is a bomb, not a sample
PROGRESS_FROM = 1000  # files: show a progress bar when reading more
_FORMATS = ("PNG", "JPEG")
_MODES = {1: "L", 3: "RGB"}
ORIENTATION = ExifTags.Base.Orientation


def _open(data: bytes, where: str, problems: Problems) -> Image.Image | None:
    """The image `data` holds, its header read but not decoded; None (an error recorded) when it is not a
    PNG or JPEG or claims too many pixels."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # bounded below, more tightly
            img = Image.open(io.BytesIO(data), formats=_FORMATS)
    except Image.DecompressionBombError:
        problems.error("image too large", where, f"claims more than {MAX_IMAGE_PIXELS:,} pixels (a decompression bomb, "
                       "or an image far larger than a model's input); shrink or remove it")
        return None
    except UnidentifiedImageError:
        problems.error("not a PNG or JPEG", where, "is not a PNG or JPEG file (by its content, whatever its name); "
                       "convert it, or remove it")
        return None
    except Exception as exc:  # noqa: BLE001 - a header too broken to read
        problems.error("unreadable image", where, f"is an unreadable or truncated image ({type(exc).__name__}: "
                       f"{str(exc)[:200]}); re-export it, or remove it")
        return None
    w, h = img.size
    if w * h > MAX_IMAGE_PIXELS:
        problems.error("image too large", where, f"claims {w}x{h} pixels ({w * h:,}), more than the {MAX_IMAGE_PIXELS:,} "
                       "fedpipe decodes (a decompression bomb, or an image far larger than a model's input); shrink or remove it")
        return None
    return img


def _pixel_bytes(mode: str) -> int:
    """Bytes per pixel of Pillow's storage for `mode`: one for 1, L and P, two for 16-bit modes, else four
    (Pillow keeps RGB, RGBA, LA, CMYK, YCbCr, I and F in 32 bits a pixel)."""
    if mode in ("1", "L", "P"):
        return 1
    return 2 if mode.startswith("I;16") else 4


STRIP_BYTES = 8 * 2**20  # a large image's pixels are copied out of Pillow this much at a time


def decoding_bytes(size: tuple[int, int], mode: str, channels: int, image_size: int | None) -> int:
    """The most memory `decode_image` holds at once for an image of `size` and `mode`, from its header: the decoded
    image and its conversion to `channels`, or the converted image and its resized copy, or the final image and its
    pixels as an array (copied out a strip at a time). An orientation tag is checked again once decoded: turning
    the image holds it twice."""
    w, h = size
    source = w * h * _pixel_bytes(mode)
    target = _pixel_bytes(_MODES[channels])
    convert = mode != _MODES[channels]
    converted = w * h * target if convert else source
    resize = image_size is not None and (w, h) != (image_size, image_size)
    side = (image_size, image_size) if resize else (w, h)
    final = side[0] * side[1] * target if resize else converted
    array = side[0] * side[1] * channels
    return max(source + (converted if convert else 0), converted + (final if resize else 0),
               final + array + 3 * min(array, STRIP_BYTES))


def _pixels(img: Image.Image, channels: int) -> np.ndarray:
    """The image's pixels as a uint8 array (C, H, W). Pillow hands its pixels to numpy as one `bytes` object built
    from pieces (twice the image at once), so a large image is copied out a strip of rows at a time."""
    w, h = img.size
    if w * h * channels <= STRIP_BYTES:
        array = np.asarray(img, dtype=np.uint8)
        return np.ascontiguousarray(array[None] if array.ndim == 2 else array.transpose(2, 0, 1))
    out = np.empty((channels, h, w), dtype=np.uint8)
    rows = max(1, STRIP_BYTES // (w * channels))
    for top in range(0, h, rows):
        strip = np.asarray(img.crop((0, top, w, min(h, top + rows))), dtype=np.uint8)
        out[:, top : top + len(strip)] = strip.reshape(len(strip), w, channels).transpose(2, 0, 1)
    return out


def decode_image(data: bytes, where: str, channels: int, image_size: int | None, problems: Problems,
                 budget: DecodeBudget | None = None) -> np.ndarray | None:
    """The uint8 array (C, H, W) of a PNG or JPEG file's bytes, converted to `channels` (1: grayscale, 3: RGB)
    and resized (bilinear) to image_size x image_size when given; None, with an error in `problems` naming
    `where`, when it cannot be decoded. Without image_size the image keeps its own size: `ImageStack` checks
    that every image shares one. With a `budget`, what decoding needs at once (`decoding_bytes`, from the
    header) must fit what the drop has left before anything is decoded; the caller charges what it keeps."""
    img = _open(data, where, problems)
    if img is None:
        return None
    shown_as = f"this {img.size[0]}x{img.size[1]} {img.mode} image"
    if budget is not None and not budget.fits(decoding_bytes(img.size, img.mode, channels, image_size), where,
                                              f"decoding {shown_as}", problems):
        return None
    try:
        img.load()  # a truncated or corrupt file raises here
        if img.getexif().get(ORIENTATION, 1) in range(2, 9):  # a photo's orientation tag, applied as a viewer would
            turned = img.size[0] * img.size[1] * _pixel_bytes(img.mode)
            if budget is not None and not budget.fits(2 * turned, where, f"turning {shown_as} upright", problems):
                return None
            ImageOps.exif_transpose(img, in_place=True)
        if img.mode != _MODES[channels]:
            img = img.convert(_MODES[channels])
        if image_size is not None and img.size != (image_size, image_size):
            img = img.resize((image_size, image_size), Image.Resampling.BILINEAR)
        return _pixels(img, channels)
    except Exception as exc:  # noqa: BLE001 - any failure of a decoder on someone else's file is "unreadable"
        problems.error("unreadable image", where, f"is an unreadable or truncated image ({type(exc).__name__}: "
                       f"{str(exc)[:200]}); re-export it, or remove it")
        return None


class ImageStack:
    """Decoded images in one preallocated uint8 array [n, C, H, W] (grown by doubling when `capacity` was too
    small). Without image_size the first image fixes the size; a differing one is an error naming it."""

    def __init__(self, channels: int, image_size: int | None, capacity: int = 1024, budget: DecodeBudget | None = None):
        self.channels, self.image_size = channels, image_size
        self.capacity = max(1, int(capacity))
        self.budget = budget if budget is not None else DecodeBudget()
        self.count = 0
        self._x: np.ndarray | None = None
        self._shared = False  # whether `array` handed out a view of `_x`
        self._first = ""  # where the image that fixed the size came from
        self.other_sizes: dict[tuple[int, int], list] = {}  # (h, w) -> [images, the first of them]: not kept

    @property
    def skipped(self) -> int:
        """Images decoded but not kept: of another size than the first (without data.image_size)."""
        return sum(n for n, _ in self.other_sizes.values())

    def finish(self, problems: Problems) -> None:
        """One error for every image of another size than the first: the sizes found, how many of each, the first
        file of each, and the data.image_size that would make them one."""
        if not self.other_sizes or self._x is None:
            return
        h, w = self._x.shape[2:]
        sizes = {(h, w): [self.count, self._first], **self.other_sizes}
        common = max(sizes, key=lambda hw: (sizes[hw][0], -hw[0] * hw[1]))  # the most common; a tie: the smallest
        listed = "; ".join(f"{sw}x{sh}: {n:,} (the first: {first})" for (sh, sw), (n, first) in
                           sorted(sizes.items(), key=lambda kv: -kv[1][0]))
        odd = max(self.other_sizes.values(), key=lambda v: v[0])[1]  # named as where: the first of the largest other size
        problems.error("differing image sizes", odd,
                       f"is one of {sum(n for n, _ in sizes.values()):,} images in {len(sizes)} sizes: {listed}. Set data.image_size={max(common)} (the most common size's "
                       "side) to resize every image to one size (`fedpipe data check SOURCE --image-size "
                       f"{max(common)}` checks it), or resize the files")

    def add(self, data: bytes, where: str, problems: Problems) -> bool:
        """Decode `data` into the next row; False (an error recorded) when it cannot be used."""
        img = decode_image(data, where, self.channels, self.image_size, problems, self.budget)
        if img is None or not self.budget.charge(img.nbytes, where, "this image", problems):
            return False
        if self._x is None:  # room for the images to come, never more than the budget lets them take
            room = (self.budget.limit - self.budget.used) // img.nbytes + 1
            self._x = np.empty((max(1, min(self.capacity, room)), *img.shape), dtype=np.uint8)
            self._first = where
        elif img.shape != self._x.shape[1:]:  # counted, and said once for all (`finish`)
            seen = self.other_sizes.setdefault(tuple(img.shape[1:]), [0, where])
            seen[0] += 1
            return False
        if self.count == len(self._x):
            room = (self.budget.limit - self.budget.used) // img.nbytes + 1  # charged already: never past the budget
            shape = (self.count + max(1, min(self.count, room)), *self._x.shape[1:])
            if self._shared:  # `array` handed out a view of it: it must stay where it is
                grown = np.empty(shape, dtype=np.uint8)
                grown[: self.count] = self._x[: self.count]
                self._x, self._shared = grown, False
            else:  # in place (realloc moves a large block's pages rather than copying them): a copy would hold every
                self._x.resize(shape, refcheck=False)  # image kept so far twice, uncounted
        self._x[self.count] = img
        self.count += 1
        return True

    def array(self) -> np.ndarray:
        """The images added, [count, C, H, W] (an empty array when none)."""
        if self._x is None:
            side = self.image_size or 0
            return np.zeros((0, self.channels, side, side), dtype=np.uint8)
        self._shared = True  # a view: a copy would hold the images twice (rows never filled are never touched)
        return self._x[: self.count]


def _select(source: DataSource, objects: list[SourceObject], manifest: DataManifest,
            problems: Problems) -> list[tuple[SourceObject, str, int]]:
    """The image files of the layout, each with its client and class; a warning for every other file and
    one error per label folder the manifest does not list."""
    index = {name: i for i, name in enumerate(manifest.labels)}
    chosen, unknown = [], {}
    for obj in objects:
        if obj.key in (MANIFEST_NAME, SUCCESS_MARKER):
            continue
        parts = obj.key.split("/")
        if PurePosixPath(obj.key).suffix.lower() not in IMAGE_EXTENSIONS:
            problems.warning("not an image", source.url(obj.key), "not a .png, .jpg or .jpeg file: skipped")
        elif len(parts) != 3:
            problems.warning("not an image", source.url(obj.key), "not in a <client>/<label>/ folder: skipped")
        elif parts[1] not in index:
            folder = f"{parts[0]}/{parts[1]}"
            unknown[folder] = unknown.get(folder, 0) + 1
        else:
            chosen.append((obj, parts[0], index[parts[1]]))
    for folder, n in unknown.items():
        problems.error("unknown label", source.url(folder),
                       f"the label folder {folder.split('/')[1]!r} ({n} file(s)) is not one of the manifest's labels; "
                       f"add it to labels in {MANIFEST_NAME}, or move its files into a listed label's folder")
    return chosen


def read_image_folders(source: DataSource, objects: list[SourceObject], manifest: DataManifest, image_size: int | None,
                       problems: Problems, budget: DecodeBudget | None = None) -> tuple[ClientRows | None, list[SourceObject]]:
    """The rows of `<client>/<label>/<image>` files and the objects they came from; every problem recorded."""
    from tqdm import tqdm

    chosen = _select(source, objects, manifest, problems)
    client_names = sorted({client for _, client, _ in chosen})
    client_index = {name: i for i, name in enumerate(client_names)}
    stack = ImageStack(manifest.source.channels, image_size, len(chosen), budget)
    y = np.empty(len(chosen), dtype=np.int64)
    clients = np.empty(len(chosen), dtype=np.int64)
    used: list[SourceObject] = []
    ids = np.empty(len(chosen), dtype=np.uint64)
    progress = tqdm(chosen, desc="reading images", unit="file", disable=None if len(chosen) > PROGRESS_FROM else True)
    for obj, client, label in progress:
        if stack.budget.exhausted:
            break
        where = source.url(obj.key)
        try:
            data = source.read(obj, MAX_IMAGE_BYTES)
        except DataError as exc:
            problems.error("unreadable file", where, str(exc))
            continue
        if stack.add(data, where, problems):
            y[len(used)], clients[len(used)] = label, client_index[client]
            ids[len(used)] = identity_of(client, obj.key.split("/")[2])  # not the label folder: a relabelled file keeps its split
            used.append(obj)
    stack.finish(problems)
    n = len(used)
    present = np.unique(clients[:n])  # clients with at least one image read, in name order
    keys = [o.key for o in used]
    rows = ClientRows(
        x=stack.array(), y=y[:n].copy(), clients=np.searchsorted(present, clients[:n]).astype(np.int64),
        client_names=tuple(client_names[i] for i in present), where=lambda i: source.url(keys[i]), ids=ids[:n].copy(),
        skipped=stack.skipped,
    )
    return rows, used
