"""`make_partition`: the global test hold-out, the scheme's split, opt-out, feature shift, per-client splits."""

from __future__ import annotations

from typing import Any

import numpy as np

from fedpipe.data import DatasetBundle
from fedpipe.data.identity import uniform
from fedpipe.data.partition._common import _apportion, _check_labels, _floor, _round_half_up, _stream
from fedpipe.data.partition.feature_shift import feature_transforms
from fedpipe.data.partition.manifest import ClientSplit, Partition
from fedpipe.data.partition.natural import natural_clients
from fedpipe.data.partition.schemes import PARTITIONERS, parse_partition_config
from fedpipe.errors import ConfigError, DataError


def _stratified_holdout(labels: np.ndarray, fraction: float, num_classes: int, rng: np.random.Generator) -> np.ndarray:
    """round(fraction * N) positions, per class in proportion to its size (largest remainder), at random."""
    counts = np.bincount(labels, minlength=num_classes)
    total = _round_half_up(fraction * labels.size)
    if total < 1 or total >= labels.size:
        raise DataError(
            f"partition.global_test_fraction={fraction} of {labels.size} samples gives a global test set of "
            f"{total} samples; choose a fraction that leaves both a test set and a client pool."
        )
    quota = _apportion(total, counts.astype(np.float64))
    picks = [rng.permutation(np.flatnonzero(labels == c))[: quota[c]] for c in range(num_classes)]
    return np.sort(np.concatenate(picks)).astype(np.int64)


def make_partition(bundle: DatasetBundle, cfg: Any, seed: int, share: bool = False) -> Partition:
    """Divide `bundle` over clients according to `cfg` (a PartitionConfig or its mapping).

    Global test set: `bundle.test` when present (recorded as None), else a stratified hold-out of
    `cfg.global_test_fraction` of `bundle.train`. The rest of `bundle.train` is partitioned by the
    scheme. Each client's samples are shuffled and split: test = floor(test_fraction * n),
    val = floor(val_fraction * n), train = the rest (so train >= 1 for any non-empty client; an
    empty client raises DataError). round(opt_out_fraction * K) clients, halves up, drawn at random
    are opt-out; at least one client must stay in the federation. Every draw comes from a
    SeedSequence-derived stream of `seed` (one per purpose), so the result is a pure function of
    (bundle, cfg, seed).

    A bundle with sample identities (`bundle.sample_ids`: a user's own files) draws the global hold-out
    and each client's splits from them instead (`stable_split`): a sample's split is then a function of
    the sample and the seed alone, the same in every data drop that holds it.

    `share`: the bundle is one site's share of a federation's data (`fedpipe.federation.own_data`): the hold-out
    and the splits are drawn sample by sample as above (so each sample lands where the simulation of all sites'
    files puts it), and the site's part of the global test set may be empty."""
    cfg = parse_partition_config(cfg)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"the partition seed must be a non-negative integer, got {seed!r}.")
    seed = int(seed)
    labels = _check_labels(bundle.train.y, bundle.num_classes)
    if labels.size == 0:
        raise DataError(f"dataset {bundle.name!r} has no training samples to partition.")
    stable = bundle.sample_ids is not None
    holdout, pool = (_stable_holdout(bundle, cfg, seed, share) if stable and bundle.test is None
                     else _global_test_and_pool(bundle, labels, cfg, seed))
    if cfg.scheme == "natural":  # the data's own clients (data.dataset=files), not a partitioner's draw
        local = natural_clients(bundle.clients, bundle.client_names, pool, cfg.min_client_size)
    else:
        partitioner = PARTITIONERS[cfg.scheme]
        local = partitioner(labels[pool], bundle.num_classes, _stream(seed, "scheme"), **cfg.partitioner_params())
    k = len(local)
    if k == 0:
        raise DataError(f"partition scheme {cfg.scheme} produced no clients.")
    opt_out = _opt_out(cfg, k, _stream(seed, "opt_out"))
    transforms = feature_transforms(cfg, bundle, k, _stream(seed, "feature_shift"))
    split_rng = _stream(seed, "splits")
    split = (lambda rows: stable_split(rows, bundle.sample_ids, cfg, seed)) if stable else (lambda rows: _shuffled_split(rows, cfg, split_rng))
    names = bundle.client_names if cfg.scheme == "natural" else ()
    clients = tuple(
        _client_split(i, split(pool[np.asarray(positions, dtype=np.int64)]), cfg, labels, bundle.num_classes,
                      opt_out=bool(opt_out[i]), transform=transforms[i], name=names[i] if i < len(names) else str(i))
        for i, positions in enumerate(local)
    )
    return Partition(
        dataset=bundle.name,
        fingerprint=bundle.fingerprint,
        seed=seed,
        config=cfg,
        num_classes=bundle.num_classes,
        pool_size=labels.size,
        clients=clients,
        global_test_indices=holdout,
        client_names=bundle.client_names if cfg.scheme == "natural" else (),
    )


def _global_test_and_pool(bundle: DatasetBundle, labels: np.ndarray, cfg: Any, seed: int) -> tuple[np.ndarray | None, np.ndarray]:
    """The global test hold-out (None: the official test split) and the rows left to the clients."""
    n = labels.size
    if bundle.test is not None:
        return None, np.arange(n, dtype=np.int64)
    holdout = _stratified_holdout(labels, cfg.global_test_fraction, bundle.num_classes, _stream(seed, "holdout"))
    mask = np.ones(n, dtype=bool)
    mask[holdout] = False
    return holdout, np.flatnonzero(mask)


def _stable_holdout(bundle: DatasetBundle, cfg: Any, seed: int, share: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The global test hold-out drawn from the samples' identities: a sample is held out when its draw is
    below global_test_fraction (not stratified by class: stratifying would tie a sample's split to the
    other samples of its drop). Returns (hold-out, pool) as row indices."""
    held = uniform(bundle.sample_ids, seed, "holdout") < cfg.global_test_fraction
    holdout, pool = np.flatnonzero(held).astype(np.int64), np.flatnonzero(~held).astype(np.int64)
    if (holdout.size == 0 and not share) or pool.size == 0:
        raise DataError(
            f"partition.global_test_fraction={cfg.global_test_fraction} of {held.size} samples gives a global test set "
            f"of {holdout.size} samples; choose a fraction that leaves both a test set and a client pool, or add data."
        )
    return holdout, pool


def stable_split(rows: np.ndarray, sample_ids: np.ndarray, cfg: Any, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A client's rows cut into (train, val, test) by each sample's own draw: test below test_fraction, val
    below test_fraction + val_fraction, train above. The sizes are binomial, not exact; what is gained is
    that a sample never moves between splits as the data grows."""
    u = uniform(sample_ids[rows], seed, "client-split")
    test = u < cfg.test_fraction
    val = ~test & (u < cfg.test_fraction + cfg.val_fraction)
    return rows[~test & ~val], rows[val], rows[test]


def _shuffled_split(rows: np.ndarray, cfg: Any, split_rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A client's rows shuffled by `split_rng` and cut into test, val (both rounded down) and train."""
    size = rows.size
    rows = split_rng.permutation(rows)
    n_test = _floor(cfg.test_fraction * size)
    n_val = _floor(cfg.val_fraction * size)
    n_train = size - n_test - n_val
    return rows[:n_train], rows[n_train : n_train + n_val], rows[n_train + n_val :]


def _opt_out(cfg: Any, k: int, rng: np.random.Generator) -> np.ndarray:
    """(k,) flags: round(opt_out_fraction * k) clients, halves up, drawn from `rng`; one must stay in."""
    n_opt = _round_half_up(cfg.opt_out_fraction * k)
    if n_opt >= k:
        raise DataError(
            f"partition.opt_out_fraction={cfg.opt_out_fraction} of {k} clients makes all {n_opt} clients "
            "opt out, leaving none to train the federated model; lower opt_out_fraction."
        )
    opt_out = np.zeros(k, dtype=bool)
    opt_out[rng.choice(k, n_opt, replace=False)] = True
    return opt_out


def _client_split(
    i: int,
    parts: tuple[np.ndarray, np.ndarray, np.ndarray],
    cfg: Any,
    labels: np.ndarray,
    num_classes: int,
    *,
    opt_out: bool,
    transform: str | None,
    name: str,
) -> ClientSplit:
    """Client i's split from its (train, val, test) rows."""
    train, val, test = parts
    size = train.size + val.size + test.size
    if size == 0:
        raise DataError(
            f"partition scheme {cfg.scheme} left client {name!r} without samples; every client needs at least "
            "one training sample. Use fewer clients or a less extreme setting."
        )
    if train.size < 1:  # a shuffled split cannot get here while val_fraction + test_fraction < 1; a stable one can
        raise DataError(
            f"client {name!r} has {size} samples and none fell in its training split; add samples to it, remove it, or "
            "lower partition.val_fraction / partition.test_fraction."
        )
    rows = np.concatenate([train, val, test])
    return ClientSplit(
        id=i,
        train=np.sort(train),
        val=np.sort(val),
        test=np.sort(test),
        opt_out=opt_out,
        label_counts=np.bincount(labels[rows], minlength=num_classes).astype(np.int64),
        transform=transform,
    )
