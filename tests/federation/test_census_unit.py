"""A site's own splits and the census, without Flower: a site that reads only its client's folder makes exactly the
simulation's splits of that client; the census refuses sites that do not make one federation; what a federation
cannot do with a config is refused before anything starts."""

from __future__ import annotations

import shutil

import pytest
import torch
from own_data import SITES, write_digit_folders

from fedpipe.data.files.init import init_manifest, write_manifest
from fedpipe.data.partition import make_partition
from fedpipe.errors import ConfigError, DataError
from fedpipe.federation.census import CensusError, take_census
from fedpipe.federation.own_data import prepare_own, site_params
from fedpipe.run.config import load_config
from fedpipe.run.run import Run, federated_data

FILES = ["data.dataset=files", "partition.scheme=natural", "engine.mode=federation", "data.source=/nowhere"]


@pytest.fixture(scope="module")
def pooled(tmp_path_factory):
    root = write_digit_folders(tmp_path_factory.mktemp("pooled") / "all")
    manifest, _ = init_manifest(str(root))
    write_manifest(str(root), manifest)
    return root


def _site(pooled, tmp_path, name):
    files = tmp_path / name / "files"
    shutil.copytree(pooled / name, files / name)
    shutil.copy(pooled / "fedpipe-data.yaml", files / "fedpipe-data.yaml")
    return files


def test_a_site_splits_its_own_files_as_the_simulation_splits_its_client(pooled, tmp_path):
    cfg = load_config(None, [*FILES, f"data.source={pooled}", "run.seed=3"])
    run = Run(cfg)
    sim = federated_data(run, make_partition(run.bundle, cfg.partition, cfg.run.seed), torch.device("cpu"))
    params = site_params(cfg)
    assert params["standardisation"]["source"] == "fixed"  # auto is fixed in a federation: no site's pixels shape it
    held = 0
    for k, name in enumerate(sorted(SITES)):
        splits, census = prepare_own(str(_site(pooled, tmp_path, name)), params, tmp_path / name, torch.device("cpu"))
        assert census["name"] == name
        for split in ("train", "val", "test"):
            assert torch.equal(splits[split].x, getattr(sim.clients[k], split).x), (name, split)
            assert torch.equal(splits[split].y, getattr(sim.clients[k], split).y), (name, split)
        held += len(splits["holdout"])
        again, _ = prepare_own(str(tmp_path / name / "files"), params, tmp_path / name, torch.device("cpu"))  # the cache
        assert torch.equal(again["train"].x, splits["train"].x)
    assert held == len(sim.global_test)  # the sites' hold-out shares are the simulation's global test set


def test_a_site_with_two_clients_is_refused(pooled, tmp_path):
    files = tmp_path / "two"
    for name in SITES[:2]:
        shutil.copytree(pooled / name, files / name)
    shutil.copy(pooled / "fedpipe-data.yaml", files / "fedpipe-data.yaml")
    cfg = load_config(None, [*FILES, f"data.source={pooled}"])
    with pytest.raises(DataError, match="holds 2 clients"):
        prepare_own(str(files), site_params(cfg), tmp_path / "state", torch.device("cpu"))


def _answer(name, labels=("0", "1"), shape=(1, 8, 8)):
    counts = {s: [1, 1] for s in ("train", "val", "test", "holdout")}
    return {"client-id": -1, "opt-out": False, "census": {"name": name, "labels": list(labels), "input_shape": list(shape),
                                                         "num_classes": len(labels), "counts": counts, "snapshot": {"digest": "x"}}}


def test_census_numbers_sites_by_sorted_name_and_refuses_what_is_not_one_federation():
    census = take_census([(11, _answer("site-b")), (12, _answer("site-a")), (13, _answer("site-c"))])
    assert [(s.name, s.client_id, s.node_id) for s in census.sites] == [("site-a", 0, 12), ("site-b", 1, 11), ("site-c", 2, 13)]
    assert census.input_shape == (1, 8, 8) and census.num_classes == 2
    with pytest.raises(CensusError, match="same labels"):
        take_census([(1, _answer("a")), (2, _answer("b", labels=("1", "0")))])
    with pytest.raises(CensusError, match="shape"):
        take_census([(1, _answer("a")), (2, _answer("b", shape=(1, 16, 16)))])
    with pytest.raises(CensusError, match="same name"):
        take_census([(1, _answer("a")), (2, _answer("a"))])
    with pytest.raises(CensusError, match="one kind of site"):
        take_census([(1, _answer("a")), (2, {"client-id": 0, "opt-out": False, "census": None})])
    exported = take_census([(5, {"client-id": 1, "opt-out": False}), (6, {"client-id": 0, "opt-out": True})])
    assert [(s.client_id, s.node_id, s.opt_out) for s in exported.sites] == [(0, 6, True), (1, 5, False)]


@pytest.mark.parametrize("sets, match", [
    (["data.dataset=mnist5k", "partition.scheme=iid"], "data.dataset=files"),
    ([*FILES, "partition.opt_out_fraction=0.2"], "opts out itself"),
    ([*FILES, "data.standardisation=pooled"], "pooled needs every site"),
])
def test_what_a_federation_cannot_do_is_refused_by_name(sets, match):
    with pytest.raises(ConfigError, match=match):
        site_params(load_config(None, ["engine.mode=federation", *sets]))


def test_secrets_stay_where_they_are_drawn(tmp_path):
    """Without seeded noise the server keys its draws (sampling, central noise) by a secret in its own folder and each
    site its local noise by a secret in the site's folder: neither can reproduce the other's noise."""
    from fedpipe.federation.private import server_privacy, site_privacy
    from fedpipe.federation.spec import FederationSpec

    cfg = load_config(None, ["method.name=fedavg", "privacy.enabled=true", "privacy.mode=local", "partition.num_clients=4"])
    spec = FederationSpec.from_run_config(cfg, (1, 28, 28), 10, 4)
    phase = spec.phases()[0]
    server = server_privacy(spec, phase, 4, tmp_path / "server")
    site_a = site_privacy(spec, phase, 1.0, tmp_path / "site-a")
    site_b = site_privacy(spec, phase, 1.0, tmp_path / "site-b")
    secrets = {server.secret, site_a.secret, site_b.secret}
    assert len(secrets) == 3 and all(len(s) == 32 for s in secrets)
    assert (tmp_path / "site-a" / "privacy-secret").read_bytes() == site_a.secret  # kept: a rerun draws the same
    assert site_privacy(spec, phase, 1.0, tmp_path / "site-a").secret == site_a.secret
    with pytest.raises(ValueError, match="privacy-clip"):
        site_privacy(spec, phase, None, tmp_path / "site-a")


def test_a_private_census_noises_each_count_with_the_sites_own_draws():
    """`noised_counts`, the Gaussian mechanism on a site's histogram: whole, non-negative counts; noise of std z around
    the exact ones (many counts: the sample std within 10% of z, the mean near 0 where no count is floored); the same
    numbers again for the same data and secret (a retaken census releases nothing new), other numbers for new data
    (another snapshot digest) or another site's secret."""
    from fedpipe.federation.private import noised_counts

    cfg = load_config(None, ["privacy.enabled=true", "privacy.census_noise_multiplier=4"]).privacy
    exact = {"train": [1000] * 5000, "val": [0, 1, 2, 3]}
    secret = bytes(range(32))
    got = noised_counts(cfg, 0, secret, "digest-a", exact)
    assert all(isinstance(c, int) and c >= 0 for split in got.values() for c in split)
    diffs = torch.tensor([g - e for g, e in zip(got["train"], exact["train"])], dtype=torch.float64)
    assert abs(float(diffs.std()) - 4) < 0.4 and abs(float(diffs.mean())) < 0.3
    assert noised_counts(cfg, 0, secret, "digest-a", exact) == got
    assert noised_counts(cfg, 0, secret, "digest-b", exact)["train"] != got["train"]
    assert noised_counts(cfg, 0, bytes(32), "digest-a", exact)["train"] != got["train"]


def test_a_noised_census_keeps_the_exact_sizes_at_the_server():
    """census.json of a private census carries the noised counts and their noise, not the exact split sizes (the server
    keeps those, in memory, to weigh by)."""
    from fedpipe.federation.census import read_answer

    own = {"name": "a", "labels": ["0", "1"], "input_shape": [1, 8, 8], "num_classes": 2, "counts_noise": 3.0,
           "counts": {"train": [3, 5], "val": [0, 1], "test": [2, 2], "holdout": [4, 4]}, "snapshot": {"digest": "ab"}}
    import json

    answer = read_answer(1, {"client-id": -1, "opt-out": False, "census": json.dumps(own),
                             "samples": json.dumps({"train": 7, "test": 4, "holdout": 9})})
    census = take_census([(1, answer)])
    (site,) = census.summary()["sites"]
    assert census.noised and site["counts_noise"] == 3.0 and "samples" not in site and site["counts"]["train"] == [3, 5]
    assert census.sites[0].samples.train == 7
    plain = take_census([(1, read_answer(1, {"client-id": -1, "opt-out": False, "census": json.dumps({**own, "counts_noise": None}),
                                             "samples": json.dumps({"train": 7, "test": 4, "holdout": 9})}))])
    assert not plain.noised and plain.summary()["sites"][0]["samples"]["train"] == 7
