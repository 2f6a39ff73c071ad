"""Client data as device tensors, built once per phase: batches are slices, nothing is re-read."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from fedpipe.data import DatasetBundle, LabeledArrays, is_table_shape
from fedpipe.data.partition import Partition
from fedpipe.errors import DataError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Split:
    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return int(self.y.shape[0])


@dataclass(frozen=True)
class ClientData:
    client_id: int
    train: Split
    val: Split
    test: Split
    opt_out: bool


@dataclass(frozen=True)
class FederatedData:
    clients: tuple[ClientData, ...]
    global_test: Split
    num_classes: int
    input_shape: tuple[int, ...]  # (C, H, W) for images, (T, V) for token sequences, (F,) for features (fedpipe.data)
    client_names: tuple[str, ...] = ()  # natural partition: client i is the data's client_names[i]

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    def validation_as_test(self) -> FederatedData:
        """The data a tuning trial sees: each client's test split replaced by its validation split and the
        global test set by the clients' validation splits pooled (the federating clients'), so the test
        tensors are dropped before training and nothing downstream can score them (`eval.split`)."""
        clients = tuple(ClientData(c.client_id, c.train, c.val, c.val, c.opt_out) for c in self.clients)
        pooled = [c.val for c in self.clients if not c.opt_out and len(c.val)]
        if not pooled:
            raise DataError("eval.split=validation needs validation data, but no client has a validation split: set partition.val_fraction > 0.")
        glob = Split(torch.cat([v.x for v in pooled]), torch.cat([v.y for v in pooled]))
        return FederatedData(clients, glob, self.num_classes, self.input_shape, self.client_names)


#: Where the constants that standardise raw inputs come from (data.standardisation; spec.json's normalisation.source).
POOLED, FIXED, DECLARED = "pooled", "fixed", "declared"
#: The data-independent image standardisation: (x / 255 - 0.5) / 0.5 per channel, pixels onto [-1, 1] (the
#: PyTorch tutorials' transforms.Normalize((0.5,), (0.5,))). It reads no client's data, so it releases nothing.
FIXED_IMAGE_MEAN = FIXED_IMAGE_STD = 0.5


@dataclass(frozen=True)
class Standardisation:
    """Where the mean and std that standardise raw inputs come from (`RunConfig.standardisation` resolves it):

    - pooled: computed exactly from the opt-in clients' pooled training data (images per channel, tables per
      column). Removing one client changes them, and every model and exported file carries them: a release of
      the clients' data that no privacy accountant counts, so a private run refuses it (fedpipe.run.config).
    - fixed: data-independent: images (x / 255 - 0.5) / 0.5 per channel, tables as they are (mean 0, std 1).
    - declared: the user's own constants, `mean` and `std` per channel (images, on the 0..1 scale) or per column.
    Token sequences (text) are never standardised, whatever the source."""

    source: str = POOLED
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.source not in (POOLED, FIXED, DECLARED):
            raise ValueError(f"standardisation source must be {POOLED}, {FIXED} or {DECLARED}, not {self.source!r}")
        if (self.source == DECLARED) != (self.mean is not None and self.std is not None):
            raise ValueError("declared standardisation takes a mean and a std; pooled and fixed take neither")


def channel_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std of uint8 images, on the 0..1 scale."""
    flat = x.transpose(1, 0, 2, 3).reshape(x.shape[1], -1).astype(np.float64) / 255.0
    return flat.mean(axis=1), np.maximum(flat.std(axis=1), 1e-6)


FEATURE_SHIFTS = {
    "rotate90": lambda x: np.rot90(x, 1, axes=(2, 3)),
    "rotate180": lambda x: np.rot90(x, 2, axes=(2, 3)),
    "rotate270": lambda x: np.rot90(x, 3, axes=(2, 3)),
    "flip": lambda x: x[..., ::-1],
    "invert": lambda x: 255 - x,
}


#: Clients whose images are converted together (a block's raw pixels are copied once more meanwhile).
CLIENTS_PER_BLOCK = 256


def prepare_data(bundle: DatasetBundle, partition: Partition, device: torch.device,
                 standardisation: Standardisation = Standardisation()) -> FederatedData:
    """Apply each client's feature shift, standardise images as `standardisation` says (pooled: with the
    training pixels' statistics of the clients that take part in federation, since opt-out clients' data must
    not shape anything shared; fixed or declared: with constants no client's data shaped), and move
    everything to `device`. Token sequences (text) go to the device as int64 ids, untouched.

    Each client's raw pixels are gathered only when its tensors are made, so what stays in memory
    is the float tensors the clients train on (at 10,000 clients sharing samples, holding every
    client's raw copy and a float64 copy of all training pixels at once took ~3 GiB more)."""
    if bundle.is_text:
        _nothing_declared_for_text(bundle, standardisation)
        return _prepare_text(bundle, partition, device)
    if is_table_shape(bundle.input_shape):
        return _prepare_table(bundle, partition, device, standardisation)

    _, mean, std = input_standardisation(bundle, partition, standardisation)
    mean_t = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)

    def to_splits(pieces: list[tuple[np.ndarray, np.ndarray]]) -> list[Split]:
        """Many splits standardised in one go (30,000 tiny conversions took seconds at 10,000
        clients), each then a view of the block's one float copy."""
        sizes = [len(y) for _, y in pieces]
        # in place on the one float copy: the same values as (x / 255 - mean) / std, without two temporaries
        xt = torch.from_numpy(np.concatenate([x for x, _ in pieces])).float().div_(255.0).sub_(mean_t).div_(std_t).to(device)
        yt = torch.from_numpy(np.concatenate([y for _, y in pieces])).long().to(device)
        return [Split(x, y) for x, y in zip(xt.split(sizes), yt.split(sizes))]

    def to_split(xy: tuple[np.ndarray, np.ndarray]) -> Split:
        return to_splits([xy])[0]

    made: list[ClientData] = []
    for start in range(0, len(partition.clients), CLIENTS_PER_BLOCK):
        block = partition.clients[start : start + CLIENTS_PER_BLOCK]
        splits = to_splits([_raw_images(bundle.train, getattr(c, s), c.transform) for c in block for s in ("train", "val", "test")])
        made += [ClientData(c.id, *splits[3 * i : 3 * i + 3], c.opt_out) for i, c in enumerate(block)]
    if partition.global_test_indices is None:
        assert bundle.test is not None, "an official-test partition needs the dataset's test split"
        global_test = to_split(_raw_images(bundle.test, None, None))
    else:
        global_test = to_split(_raw_images(bundle.train, partition.global_test_indices, None))
    return FederatedData(tuple(made), global_test, bundle.num_classes, bundle.input_shape, partition.client_names)


def _raw_images(arrays: LabeledArrays, rows: np.ndarray | None, transform: str | None) -> tuple[np.ndarray, np.ndarray]:
    """The uint8 images (and labels) of `rows` (all when None), with a client's feature shift applied."""
    x, y = (arrays.x, arrays.y) if rows is None else (arrays.x[rows], arrays.y[rows])
    return (FEATURE_SHIFTS[transform](x) if transform else x), y


def input_standardisation(bundle: DatasetBundle, partition: Partition, standardisation: Standardisation = Standardisation(),
                          ) -> tuple[str, np.ndarray | None, np.ndarray | None]:
    """(kind, mean, std) of what `prepare_data` does to raw inputs, computed as it computes them (float64):
    ("image", per channel, on the 0..1 scale: (x / 255 - mean) / std), ("table", per column: (x - mean) / std)
    or ("text", None, None: token ids as they are). A model served on raw inputs applies the same (as float32).
    Only a pooled `standardisation` reads the clients' data."""
    if bundle.is_text:
        _nothing_declared_for_text(bundle, standardisation)
        return "text", None, None
    table = is_table_shape(bundle.input_shape)
    kind, width, what = ("table", bundle.input_shape[0], "column") if table else ("image", bundle.input_shape[0], "channel")
    if standardisation.source == POOLED:
        return (kind, *(_table_standardisation(bundle, partition) if table else _standardisation(bundle, partition, _raw_images)))
    if standardisation.source == DECLARED:
        mean, std = np.asarray(standardisation.mean, dtype=np.float64), np.asarray(standardisation.std, dtype=np.float64)
        if mean.shape != (width,) or std.shape != (width,):
            raise DataError(f"data.input_mean and data.input_std declare {mean.size} mean(s) and {std.size} std(s), but {bundle.name} "
                            f"has {width} {what}s: declare one mean and one std per {what}, in the data's {what} order.")
        return kind, mean, std
    if table:  # fixed: no table-wide constant suits every column, so the features go in as they are
        _warn_unscaled_table(bundle.name)
        return kind, np.zeros(width), np.ones(width)
    return kind, np.full(width, FIXED_IMAGE_MEAN), np.full(width, FIXED_IMAGE_STD)


def _nothing_declared_for_text(bundle: DatasetBundle, standardisation: Standardisation) -> None:
    if standardisation.source == DECLARED:
        raise DataError(f"data.input_mean and data.input_std declare standardisation constants, but {bundle.name} holds token "
                        "sequences, which are never standardised: leave them out.")


_warned_tables: set[str] = set()


def _warn_unscaled_table(name: str) -> None:
    """Once per dataset and process: fixed standardisation leaves a table's columns unscaled, which trains poorly
    when they lie on very different scales (an income beside an age)."""
    if name not in _warned_tables:
        _warned_tables.add(name)
        log.warning("data.standardisation is fixed (as auto picks with privacy.enabled): the columns of %s go in unscaled, "
                    "since their pooled mean and std would be a release of the clients' data outside the privacy accountant. If "
                    "the columns lie on very different scales, declare data.input_mean and data.input_std (one value per "
                    "column: public ranges or domain standards, never statistics of the clients' data).", name)


def _standardisation(bundle: DatasetBundle, partition: Partition, raw) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std of the opt-in clients' training images (all clients' when every one
    opts out), after their feature shifts.

    Disjoint clients: the training images concatenated (no more pixels than the dataset has).
    Clients that share samples (`with_replacement`): a sample counts once per client holding it,
    summed in float64 over the distinct rows in chunks, so 10,000 clients cost no 10,000-client copy."""
    members = [c for c in partition.clients if not c.opt_out] or list(partition.clients)
    if not partition.config.clients_share_samples:
        return channel_stats(np.concatenate([raw(bundle.train, c.train, c.transform)[0] for c in members]))
    channels = bundle.train.x.shape[1]
    total, squares, count = np.zeros(channels), np.zeros(channels), 0
    for transform in sorted({c.transform for c in members}, key=str):
        rows = np.concatenate([c.train for c in members if c.transform == transform])
        times = np.bincount(rows)
        distinct = np.flatnonzero(times)
        for start in range(0, distinct.size, 4096):
            part = distinct[start : start + 4096]
            x = raw(bundle.train, part, transform)[0].astype(np.float64) / 255.0  # (n, C, H, W)
            w = times[part].astype(np.float64)
            total += np.einsum("n,nc->c", w, x.sum(axis=(2, 3)))
            squares += np.einsum("n,nc->c", w, np.square(x).sum(axis=(2, 3)))
        count += rows.size * int(np.prod(bundle.train.x.shape[2:]))
    mean = total / count
    return mean, np.maximum(np.sqrt(np.maximum(squares / count - mean**2, 0.0)), 1e-6)


def _no_feature_shift(bundle: DatasetBundle, partition: Partition, what: str, instead: str) -> None:
    shifted = [c.id for c in partition.clients if c.transform]
    if shifted:
        raise DataError(
            f"partition.feature_shift transforms images, but {bundle.name} holds {what} (clients "
            f"{shifted[:5]} have a shift); {instead}."
        )


def _prepare_table(bundle: DatasetBundle, partition: Partition, device: torch.device, standardisation: Standardisation) -> FederatedData:
    """Numeric features standardised per column as `standardisation` says (pooled: with the opt-in clients'
    training rows, as images are per channel: opt-out clients' data must not shape anything shared), float32
    on `device`."""
    _no_feature_shift(bundle, partition, "numeric features", "leave partition.feature_shift empty for tables")
    _, mean, std = input_standardisation(bundle, partition, standardisation)
    mean_t, std_t = torch.tensor(mean, dtype=torch.float32), torch.tensor(std, dtype=torch.float32)

    return _gathered(bundle, partition, device, lambda x: torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).sub_(mean_t).div_(std_t))


def _table_standardisation(bundle: DatasetBundle, partition: Partition) -> tuple[np.ndarray, np.ndarray]:
    """Per-column mean and std (float64) of the opt-in clients' training rows (all clients' when every one
    opts out); a row held by several clients counts once per client."""
    members = [c for c in partition.clients if not c.opt_out] or list(partition.clients)
    rows = np.concatenate([c.train for c in members])
    counts = np.bincount(rows, minlength=len(bundle.train))  # a shared sample counts once per client holding it
    used = np.flatnonzero(counts)
    total, squares = np.zeros(bundle.train.x.shape[1]), np.zeros(bundle.train.x.shape[1])
    for start in range(0, used.size, 65536):  # float64 sums in chunks: no float64 copy of a million rows
        part = used[start : start + 65536]
        x, w = bundle.train.x[part].astype(np.float64), counts[part].astype(np.float64)
        total += w @ x
        squares += w @ np.square(x)
    n = counts.sum()
    mean = total / n
    return mean, np.maximum(np.sqrt(np.maximum(squares / n - mean**2, 0.0)), 1e-6)


def _prepare_text(bundle: DatasetBundle, partition: Partition, device: torch.device) -> FederatedData:
    """Token ids as int64 tensors on `device`: no standardisation, and no feature shift (those are
    image transforms; a partition asking for one on text is refused)."""
    _no_feature_shift(bundle, partition, "token sequences", "leave partition.feature_shift empty for text")

    return _gathered(bundle, partition, device, lambda x: torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64)))


def _gathered(bundle: DatasetBundle, partition: Partition, device: torch.device, inputs) -> FederatedData:
    """Every client's splits and the global test set, rows gathered from the bundle, `inputs` making the
    input tensor of a block of rows (the labels go as they are)."""

    def to_split(arrays: LabeledArrays, rows: np.ndarray | None) -> Split:
        x, y = (arrays.x, arrays.y) if rows is None else (arrays.x[rows], arrays.y[rows])
        return Split(inputs(x).to(device), torch.from_numpy(np.ascontiguousarray(y)).long().to(device))

    clients = tuple(
        ClientData(c.id, to_split(bundle.train, c.train), to_split(bundle.train, c.val), to_split(bundle.train, c.test), c.opt_out)
        for c in partition.clients
    )
    if partition.global_test_indices is None:
        assert bundle.test is not None, "an official-test partition needs the dataset's test split"
        global_test = to_split(bundle.test, None)
    else:
        global_test = to_split(bundle.train, partition.global_test_indices)
    return FederatedData(clients, global_test, bundle.num_classes, bundle.input_shape, partition.client_names)
