"""Splits that never move (issue 29): a sample's split (global test, client test, validation, train) is a
function of its identity and the seed, so across growing data drops no sample of an earlier drop's train or
validation split ever lands in a later drop's test split, and a test sample stays test. The bundled datasets'
partitions are pinned unchanged (they have no identities: positional draws, as before)."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from own_data import write_digit_folders

from fedpipe.data.files import check_files, load_files
from fedpipe.data.partition import NaturalPartition, make_partition
from fedpipe.run.config import load_config

IMAGE_MANIFEST = "format: fedpipe-data\nversion: 1\nsource: {layout: image_folders, channels: 1}\nlabels: [" + \
    ", ".join(f"'{d}'" for d in range(10)) + "]\n"
SIZES = (400, 800, 1200)  # three growing drops: each holds the one before it and more


def _splits(url: str, keys_of) -> dict[str, set]:
    """The drop's samples by split, each named by what the test knows it as (a file key, a row's record)."""
    bundle = load_files(url)
    partition = make_partition(bundle, NaturalPartition(min_client_size=5), seed=0)
    names = keys_of(url)
    out = {"global_test": {names[i] for i in partition.global_test_indices}, "train": set(), "val": set(), "test": set()}
    for c in partition.clients:
        for split in ("train", "val", "test"):
            out[split] |= {names[i] for i in getattr(c, split)}
    return out


def _leaks(drops: list[dict[str, set]]) -> tuple[int, int]:
    """(earlier train/val samples in a later test split, earlier test samples not test later)."""
    leaked = moved = 0
    for k, earlier in enumerate(drops):
        for later in drops[k + 1:]:
            later_test = later["test"] | later["global_test"]
            leaked += len((earlier["train"] | earlier["val"]) & later_test)
            moved += len(earlier["test"] - later["test"]) + len(earlier["global_test"] - later["global_test"])
    return leaked, moved


def _file_keys(url: str) -> list[str]:
    rows = check_files(url).rows
    return [rows.where(i).removeprefix(url + "/") for i in range(len(rows.y))]


def test_image_drops_never_leak_train_into_test(tmp_path):
    drops = []
    for n in SIZES:
        root = write_digit_folders(tmp_path / f"drop-{n}", limit=n)
        (root / "fedpipe-data.yaml").write_text(IMAGE_MANIFEST)
        drops.append(_splits(str(root), _file_keys))
    for d in drops:  # every split is used
        assert all(len(d[s]) > 0 for s in ("global_test", "train", "val", "test"))
    assert _leaks(drops) == (0, 0)
    # the positional draw this replaces does leak: the same drops split by position (no identities)
    positional = []
    for n in SIZES:
        url = str(tmp_path / f"drop-{n}")
        bundle = load_files(url)
        partition = make_partition(replace(bundle, sample_ids=None), NaturalPartition(min_client_size=5), seed=0)
        keys = _file_keys(url)
        split = {"global_test": {keys[i] for i in partition.global_test_indices}, "train": set(), "val": set(), "test": set()}
        for c in partition.clients:
            for s in ("train", "val", "test"):
                split[s] |= {keys[i] for i in getattr(c, s)}
        positional.append(split)
    assert _leaks(positional)[0] > 50


def test_a_relabelled_file_keeps_its_split(tmp_path):
    root = write_digit_folders(tmp_path / "d", limit=300)
    (root / "fedpipe-data.yaml").write_text(IMAGE_MANIFEST)
    before = _splits(str(root), _file_keys)
    site = sorted(p.name for p in root.iterdir() if p.is_dir())[0]
    labels = sorted(p.name for p in (root / site).iterdir())
    for label in labels:  # rotate the site's label folders: 0 -> 1 -> ... (names kept under new labels)
        (root / site / label).rename(root / site / f"tmp-{label}")
    for k, label in enumerate(labels):
        (root / site / f"tmp-{label}").rename(root / site / labels[(k + 1) % len(labels)])
    after = _splits(str(root), _file_keys)

    def unlabelled(keys: set) -> set:
        return {(k.split("/")[0], k.split("/")[2]) for k in keys}

    for split in before:
        assert unlabelled(before[split]) == unlabelled(after[split])


def _cancer_rows() -> pa.Table:
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    columns = {f"f{j}": data.data[:, j] for j in range(8)}
    columns["branch"] = [f"branch-{i % 4}" for i in range(len(data.target))]
    columns["diagnosis"] = [str(data.target_names[t]) for t in data.target]
    columns["record"] = [f"r{i}" for i in range(len(data.target))]
    return pa.table(columns)


@pytest.mark.parametrize("id_column", [None, "record"])
def test_table_drops_never_leak_train_into_test(tmp_path, id_column):
    table = _cancer_rows()
    manifest = ("format: fedpipe-data\nversion: 1\nsource: {layout: table, client_column: branch, label_column: diagnosis, "
                f"features: [{', '.join(f'f{j}' for j in range(8))}]" + (f", id_column: {id_column}" if id_column else "")
                + "}\nlabels: [benign, malignant]\n")
    features = np.stack([table.column(f"f{j}").to_numpy() for j in range(8)], axis=1).astype(np.float32)
    by_values = {row.tobytes(): f"r{i}" for i, row in enumerate(features)}  # what the test knows a row as
    drops = []
    for n in (200, 400, table.num_rows):
        root = tmp_path / f"drop-{n}"
        root.mkdir()
        # the rows come in another order in each drop (a later export sorted differently): position means nothing
        order = np.random.default_rng(n).permutation(n)
        pq.write_table(table.take(pa.array(order)), root / "rows.parquet")
        (root / "fedpipe-data.yaml").write_text(manifest)

        def records(url: str) -> list[str]:
            rows = check_files(url).rows
            return [by_values[row.tobytes()] for row in rows.x]

        drops.append(_splits(str(root), records))
    assert all(len(d["test"]) > 0 and len(d["train"]) > 0 for d in drops)
    assert _leaks(drops) == (0, 0)


def test_bundled_partitions_are_unchanged():
    """The default run's partition (mnist5k, pathological) and a Dirichlet split of the digits, as fedpipe made
    them before sample identities existed: bundled datasets keep their positional draws."""
    from fedpipe.data.datasets import load_dataset

    pinned = {(): "2c5bc4ba86183d2aeaeff86ebbd67647d4f7838fce87f2f828c1eaaa47c5ce9c",
              ("data.dataset=digits", "partition.scheme=dirichlet"): "d663f56034f9f608d874a276e135df23ed0ac4deb7b8af1f8a7c4524d66d9ca2"}
    for overrides, digest in pinned.items():
        cfg = load_config(None, list(overrides))
        partition = make_partition(load_dataset(cfg.data), cfg.partition, cfg.run.seed)
        h = hashlib.sha256()
        for c in partition.clients:
            for a in (c.train, c.val, c.test, c.label_counts):
                h.update(a.tobytes())
        h.update(partition.global_test_indices.tobytes() if partition.global_test_indices is not None else b"none")
        assert h.hexdigest() == digest, overrides
    assert load_config().run_id() == "superfed_mm-mnist5k-pathological-s0-b1159e8b"


def test_split_draws_depend_on_identity_and_seed_only():
    from fedpipe.data.identity import identity_of, uniform

    ids = np.asarray([identity_of("site", f"{i}.png") for i in range(2000)], dtype=np.uint64)
    u = uniform(ids, 0, "client-split")
    assert np.array_equal(uniform(ids[::-1], 0, "client-split"), u[::-1])  # position plays no part
    assert not np.array_equal(uniform(ids, 1, "client-split"), u)  # the seed does
    assert abs(float(np.mean(u < 0.2)) - 0.2) < 0.03 and 0.0 <= u.min() and u.max() < 1.0
    assert identity_of("ab", "c") != identity_of("a", "bc")

