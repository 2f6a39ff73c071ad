"""The drop check's rule and the gate's decision on scores alone (issue 29), hand-computed; a drops root's
manifest shared by drops that carry none, and in their snapshots."""

from __future__ import annotations

import numpy as np
import pytest
from own_data import write_digit_folders

from fedpipe.config import DropCheckConfig, RegistryConfig
from fedpipe.data.files import current_snapshot, load_files
from fedpipe.errors import DataError
from fedpipe.models.drop_check import ClientFigures, check_drop, label_shift
from fedpipe.models.gate import compare
from fedpipe.models.sides import Scores

CFG = DropCheckConfig()


def _then(acc: float, counts=(5, 5, 0, 0), n: int = 20) -> ClientFigures:
    return ClientFigures(acc, n, counts)


def test_label_shift_is_the_total_variation_distance():
    assert label_shift((5, 5, 0, 0), np.array([5, 5, 0, 0])) == 0.0
    assert label_shift((5, 5, 0, 0), np.array([0, 0, 5, 5])) == 1.0
    assert label_shift((1, 1, 1, 1), np.array([2, 1, 1, 0])) == pytest.approx(0.25)  # |.5-.25| + |0-.25|, halved


def test_a_collapse_a_fall_below_twice_chance_and_a_label_shift_are_flagged():
    then = {"ok": _then(0.90), "collapsed": _then(0.91), "chance": _then(0.25), "moved": _then(0.80),
            "few": _then(0.90), "always-poor": _then(0.08)}
    now = {"ok": 0.85, "collapsed": 0.01, "chance": 0.15, "moved": 0.79, "few": 0.0, "always-poor": 0.05}
    samples = {"ok": 30, "collapsed": 30, "chance": 30, "moved": 30, "few": CFG.min_samples - 1, "always-poor": 30}
    labels = {n: np.array([5, 5, 0, 0]) for n in now} | {"moved": np.array([0, 1, 5, 5])}
    checks = {c.name: c for c in check_drop(then, now, samples, labels, 10, CFG)}  # chance 0.1: the floor is 0.2
    assert "fell 0.910 -> 0.010" in checks["collapsed"].flagged
    assert "below 2x chance (0.200)" in checks["chance"].flagged  # a drop of 0.10 only, but under the floor it was above
    assert "label distribution moved by 0.91" in checks["moved"].flagged
    assert not checks["ok"].flagged and not checks["few"].flagged  # too few test samples to tell: reported, not flagged
    assert not checks["always-poor"].flagged  # never above the floor: no collapse
    assert [c.name for c in check_drop(then, now, samples, labels, 10, CFG)][:3] == ["collapsed", "chance", "moved"]


def _registry(**fields) -> RegistryConfig:
    return RegistryConfig(name="line", **fields)


def test_a_suspect_drop_is_not_promoted_whatever_the_scores():
    then = {"a": _then(0.9), "b": _then(0.9)}
    checks = check_drop(then, {"a": 0.9, "b": 0.02}, {"a": 20, "b": 20}, {"a": np.array([5, 5, 0, 0]), "b": np.array([5, 5, 0, 0])}, 4, CFG)
    mine, theirs = Scores({"a": 0.95, "b": 0.95}, None), Scores({"a": 0.9, "b": 0.5}, None)
    d = compare(mine, theirs, 2, _registry(max_client_drop=1.0), checks=checks)
    assert not d.promote and d.drop_check["suspect"] and [c["client"] for c in d.drop_check["flagged"]] == ["b"]
    assert d.reason.startswith("not promoted: the drop check flags 1 client(s) (b: accuracy fell")
    off = compare(mine, theirs, 2, _registry(max_client_drop=1.0, drop_check=DropCheckConfig(enabled=False)), checks=checks)
    assert off.promote and not off.drop_check["suspect"]
    assert d.settings["drop_check"]["max_drop"] == 0.3 and "name" not in d.settings


def test_a_new_client_below_its_floor_stops_a_promotion():
    mine, theirs = Scores({"a": 0.9, "new": 0.40}, None), Scores({"a": 0.9}, None)
    floors = {"new": {"candidate": 0.40, "floor": 0.50, "from": "the promoted global model"}}
    d = compare(mine, theirs, 1, _registry(max_client_drop=0.05), floors=floors)
    assert not d.promote and "1 new client(s) fall more than max_client_drop=0.05 below" in d.reason and "new 0.4000 < 0.5000" in d.reason
    assert compare(mine, theirs, 1, _registry(max_client_drop=0.2), floors=floors).promote


def test_drops_without_a_manifest_read_the_drops_root_and_the_root_is_in_the_snapshot(tmp_path):
    root = tmp_path / "drops"
    drop = write_digit_folders(root / "2026-01-01", limit=120)
    (drop / "_SUCCESS").write_text("")  # the drop's upload is complete
    with pytest.raises(DataError, match="--root"):
        load_files(str(root / "latest"))
    manifest = "format: fedpipe-data\nversion: 1\nsource: {layout: image_folders, channels: 1}\nlabels: [" + \
        ", ".join(f"'{d}'" for d in range(10)) + "]\n"
    (root / "fedpipe-data.yaml").write_text(manifest)
    bundle = load_files(str(root / "latest"))
    assert bundle.snapshot["source"] == str(drop) and len(bundle.train) == 120 and bundle.snapshot["objects"] == 122  # 120 images, _SUCCESS, the root's manifest
    before = current_snapshot(str(root / "latest"))
    assert before["digest"] == bundle.snapshot["digest"]
    (root / "fedpipe-data.yaml").write_text(manifest.replace("channels: 1", "channels: 3"))  # the shared layout changed
    assert current_snapshot(str(root / "latest"))["digest"] != before["digest"]  # so a run on it is a new run
    (drop / "fedpipe-data.yaml").write_text(manifest)  # a drop's own manifest wins over the root's
    assert load_files(str(drop)).train.x.shape[1] == 1
