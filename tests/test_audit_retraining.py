"""The audit's second round (issue 43), retraining: each finding re-enacted, each test failing on the code before its fix.

- A1: a drop with two digits' labels swapped and the moved files renamed (new samples, so no sample both drops hold
  shows it) is refused by the drop check's relabelled-new-samples rule, naming the clients; a benign growing drop is
  promoted. Real runs on digit images per site in local dated drops (the chart's recurring run, as `fedpipe run`
  pins it: the newest drop, a warm start from the promoted version).
- A2: an impossible date (9999-99-99) or a future one never becomes `latest`, in a folder and in S3, with a warning.
- A3: `models promote` / `rollback` to a version the gate refused needs --force, and says so.
- A4: `models regate` says its verdict once, its history entry names the settings it changed, the checks they turned
  off and what it compared on (its fallback to the candidate's test splits); `models list` shows a regated version's
  promotion beside the gate's refusal at registration.
- A5: a symbolic link named as a drop, or linked inside one, is named in a warning.
- A7: the manifest's duplicate-label check is linear (an 80,000-label manifest with a repeat took minutes).
- A8: `models clean` removes the temp files a killed registration left inside `versions/N/clients/`.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from own_data import SITES, upload_folder, write_digit_folders
from test_model_line import _record
from typer.testing import CliRunner

from fedpipe.cli import app
from fedpipe.config import DropCheckConfig
from fedpipe.errors import ConfigError, DataError
from fedpipe.models.gate import decide
from fedpipe.models.line import ModelLine
from fedpipe.models.publish import publish
from fedpipe.models.warm import attach, pin_init_from
from fedpipe.run.config import load_config, with_data_snapshot
from fedpipe.run.run import Run
from fedpipe.store import open_store
from fedpipe.store.source import open_source

LINE = "digits"
MANIFEST = ("format: fedpipe-data\nversion: 1\nsource: {layout: image_folders, channels: 1}\nlabels: ["
            + ", ".join(f"'{d}'" for d in range(10)) + "]\n")
SWAPPED = ("0", "5")  # site k holds digits 2k .. 2k+3 (mod 10): no site holds both, so each affected site loses a quarter
# the chart's recurring run, small; max_drop 0.4: on these small drops a quarter of a site's test split relabelled
# falls 0.29-0.31 (the audit's larger drops fell 0.16-0.22), so the limit is put where the audit's falls were: under it
RUN = ["data.dataset=files", "partition.scheme=natural", "method.name=fedper", "train.rounds=6", "train.local_epochs=2",
       "train.lr=0.02", "train.batch_size=20", "train.init_from=promoted", f"registry.name={LINE}", "registry.tolerance=0.02",
       "registry.max_client_drop=0.1", "registry.drop_check.max_drop=0.4", "telemetry.progress=false",
       "engine.clients=sequential", "run.threads=1"]


def _drop(root: Path, day: str, limit: int, relabel: bool = False) -> Path:
    """The first `limit` digit images as <root>/drops/<day>/<site>/<digit>/<n>.png, complete; with `relabel`, every
    image of the two SWAPPED digits moved to the other's folder under a new name (the audit's drop)."""
    drop = write_digit_folders(root / "drops" / day, limit=limit)
    if relabel:
        a, b = SWAPPED
        for site in SITES:
            moves = [(p, b) for p in (drop / site / a).glob("*.png")] + [(p, a) for p in (drop / site / b).glob("*.png")]
            for path, label in moves:
                (drop / site / label).mkdir(exist_ok=True)
                path.rename(drop / site / label / f"relabelled-{path.name}")
    (drop / "_SUCCESS").write_text("")
    return drop


def _published(root: Path, run_id: str, *sets: str) -> tuple[Run, dict]:
    cfg = load_config(None, [*RUN, f"data.source={root}/drops/latest", f"run.store={root}/store", f"run.id={run_id}", *sets])
    run = attach(Run(pin_init_from(with_data_snapshot(cfg))))
    run.run_all()
    return run, publish(run)


@pytest.fixture(scope="module")
def three_drops(tmp_path_factory):
    """v1 on drop 1 (1,200 images), promoted; v2 on the audit's drop (the same images, digits 0 and 5 swapped and
    renamed), refused; v3 on a benign growing drop (all 1,797 images), promoted over v1."""
    root = tmp_path_factory.mktemp("a1")
    (root / "drops").mkdir()
    (root / "drops" / "fedpipe-data.yaml").write_text(MANIFEST)  # the drops root's manifest, shared by every drop
    _drop(root, "2026-01-01", 1200)
    _, first = _published(root, "one")
    _drop(root, "2026-02-01", 1200, relabel=True)
    relabelled, second = _published(root, "two")
    # the same candidate decided again without the rule, nor issue 55's new-samples rule that also catches it (what the
    # gate did before both), while version 1 is promoted
    registry = relabelled.cfg.registry
    without = registry.model_copy(update={"drop_check": registry.drop_check.model_copy(update={"relabel_below_chance": 0.0,
                                                                                               "max_new_drop": 1.0})})
    unchecked = decide(relabelled, ModelLine(open_store(str(root / "store")), LINE), without)
    _drop(root, "2026-03-01", 1797)
    _, third = _published(root, "three")
    return root, first, (relabelled, second, unchecked), third


@pytest.mark.slow
def test_a1_a_relabelled_drop_with_renamed_files_is_refused_and_a_benign_growing_drop_promoted(three_drops):
    root, first, (relabelled, second, unchecked), third = three_drops
    assert first["promoted"] and relabelled.cfg.train.init_from == "1"
    # the audit's figures: the candidate agrees with its relabelled files, the promoted version is far below chance on them
    apart, check = second["new_samples"], second["drop_check"]
    assert apart["candidate"] > 0.8 and apart["champion"] < 0.05, apart
    print("drop check:", *(f"{c['client']}: {c['then']:.3f} -> {c['now']:.3f}, new {c.get('on_new')} of {c.get('new_test_samples')}"
                           for c in check["clients"]))
    assert not second["promoted"], second["reason"]
    flagged = {c["client"]: c for c in check["flagged"]}
    assert check["suspect"] and len(flagged) >= 2, second["reason"]
    assert all("new test samples look relabelled" in c["flagged"] and c["on_new"] < 0.05 and c["then"] > 0.8 for c in flagged.values())
    assert all(c["then"] - c["now"] <= 0.4 for c in check["clients"])  # every whole-split fall under max_drop, as the audit's
    assert second["reason"].startswith("not promoted: the drop check flags") and all(n in second["reason"] for n in flagged)
    assert "relabel_below_chance" in second["reason"]
    # the rules on the new samples are what stop it: without them the same candidate is promoted (as before the rules)
    assert unchecked.promote and not unchecked.drop_check["suspect"], unchecked.reason
    assert "the drop check's relabelled-new-samples rule (registry.drop_check.relabel_below_chance=0)" in unchecked.to_json()["checks_off"]
    # a benign growing drop: new samples from the same sources, scored by the promoted model as its old ones were
    assert third["promoted"] and third["version"] == 3 and third["champion_version"] == 1, third["reason"]
    assert not third["drop_check"]["flagged"] and third["new_samples"]["champion"] > 0.8
    assert all(c["new_test_samples"] >= 10 and c["on_new"] > 0.5 for c in third["drop_check"]["clients"])


def test_a1_the_relabel_rule_hand_computed():
    from fedpipe.models.drop_check import ClientFigures, check_drop

    cfg = DropCheckConfig()  # 10 classes: below 0.5 x 0.1 = 0.05 on the new samples, having scored >= 0.2 then
    then = {n: ClientFigures(a, 40, (10, 10, 10, 10)) for n, a in
            (("relabelled", 0.95), ("benign", 0.95), ("few", 0.95), ("never-good", 0.15), ("only-old", 0.95))}
    now = {"relabelled": 0.78, "benign": 0.93, "few": 0.9, "never-good": 0.12, "only-old": 0.95}  # falls under max_drop 0.3
    on_new = {"relabelled": (0.01, 12), "benign": (0.92, 30), "few": (0.0, 9), "never-good": (0.0, 20)}
    labels = {n: np.array([10, 10, 10, 10]) for n in now}
    checks = {c.name: c for c in check_drop(then, now, dict.fromkeys(now, 50), labels, 10, cfg, on_new)}
    assert checks["relabelled"].flagged.startswith("its 12 new test samples look relabelled: the promoted model scores 0.010")
    assert "below 0.5x chance (0.050), having scored 0.950 on this client at registration" in checks["relabelled"].flagged
    assert not any(checks[n].flagged for n in ("benign", "few", "never-good", "only-old"))
    assert checks["relabelled"].to_json()["on_new"] == 0.01 and checks["only-old"].to_json()["on_new"] is None
    off = DropCheckConfig(relabel_below_chance=0.0, max_new_drop=1.0)  # issue 55's new-samples rule catches it too
    assert not any(c.flagged for c in check_drop(then, now, dict.fromkeys(now, 50), labels, 10, off, on_new))


# --- A2, A5: which drop is `latest` -----------------------------------------------------------------------------------

def _complete(path: Path, limit: int = 30) -> Path:
    write_digit_folders(path, limit=limit)
    (path / "_SUCCESS").write_text("")
    return path


def test_a2_an_impossible_or_future_date_never_becomes_latest_and_is_named(tmp_path, caplog):
    drops = tmp_path / "drops"
    _complete(drops / "2026-01-01")
    _complete(drops / "9999-99-99")  # sorts after every real date
    _complete(drops / "2026-02-30")  # no such day
    _complete(drops / "2999-01-01")  # a real day, centuries ahead
    with caplog.at_level(logging.WARNING, logger="fedpipe.store.source"):
        assert open_source(str(drops / "latest")).url() == str(drops / "2026-01-01")
    said = caplog.text
    assert "3 drop(s) skipped for their date" in said and "9999-99-99: not a calendar date" in said
    assert "2026-02-30: not a calendar date" in said and "2999-01-01: dated in the future" in said
    for bad in ("9999-99-99", "2026-02-30", "2999-01-01"):
        shutil.rmtree(drops / bad)
    tomorrow = time.strftime("%Y-%m-%d", time.gmtime(time.time() + 86400))  # a time zone ahead of UTC: still taken
    _complete(drops / tomorrow)
    assert open_source(str(drops / "latest")).url() == str(drops / tomorrow)
    only = tmp_path / "only"
    _complete(only / "9999-99-99")
    with pytest.raises(DataError, match=r"its only drop\(s\) are misdated \(9999-99-99: not a calendar date\)"):
        open_source(str(only / "latest"))


@pytest.mark.services
def test_a2_in_s3_an_impossible_date_never_becomes_latest(tmp_path, raw_client, caplog):
    bucket = "drops-misdated"
    upload_folder(raw_client, write_digit_folders(tmp_path / "a", limit=20), bucket, "drops/2026-01-01")
    upload_folder(raw_client, write_digit_folders(tmp_path / "b", limit=20), bucket, "drops/9999-99-99")
    with caplog.at_level(logging.WARNING, logger="fedpipe.store.source"):
        assert open_source(f"s3://{bucket}/drops/latest").url() == f"s3://{bucket}/drops/2026-01-01"
    assert "9999-99-99: not a calendar date" in caplog.text
    raw_client.put_object(bucket, "drops/2999-12-31/x/0/0.png", io.BytesIO(b"x"), 1)
    raw_client.put_object(bucket, "drops/2999-12-31/_SUCCESS", io.BytesIO(b""), 0)
    assert open_source(f"s3://{bucket}/drops/latest").url() == f"s3://{bucket}/drops/2026-01-01"


def test_a5_a_linked_drop_and_a_linked_folder_inside_one_are_named_in_a_warning(tmp_path, caplog):
    drops = tmp_path / "drops"
    real = _complete(drops / "2026-01-01")
    elsewhere = _complete(tmp_path / "elsewhere" / "2026-05-01")
    os.symlink(elsewhere, drops / "2026-05-01")  # the newest name, but a link: never `latest`
    os.symlink(elsewhere / SITES[0], real / "linked-site")  # a client folder linked into the drop: never read
    with caplog.at_level(logging.WARNING, logger="fedpipe.store.source"):
        source = open_source(str(drops / "latest"))
        keys = {o.key for o in source.list()}
    assert source.url() == str(real.resolve()) and not any(k.startswith("linked-site/") for k in keys)
    assert f"{drops.resolve() / '2026-05-01'} is a symbolic link (to {elsewhere}), not a folder" in caplog.text
    assert f"{real.resolve() / 'linked-site'} is a symbolic link to a folder" in caplog.text


# --- A3, A4, A8: the model line's commands ---------------------------------------------------------------------------

def _cli(*args: str):
    return CliRunner().invoke(app, list(args))


def test_a3_promoting_or_rolling_back_to_a_version_the_gate_refused_needs_force(tmp_path):
    line = ModelLine(open_store(str(tmp_path)), LINE)
    refused = {"promoted": False, "reason": "not promoted: the drop check flags 2 client(s) (hospital-a: ...)"}
    line.register(_record("run-1"), {"spec.json": b"{}"})
    line.register(replace(_record("run-2"), decision=refused), {"spec.json": b"{}"})
    line.register(_record("run-3"), {"spec.json": b"{}"})
    line.promote(1, "first")
    store = f"--store={tmp_path}"
    said = _cli("models", "promote", LINE, "2", store)
    assert said.exit_code == 2 and line.promoted() == 1, said.output
    assert "the gate refused version 2 at registration (not promoted: the drop check flags 2 client(s)" in said.output
    assert "pass --force" in said.output and "Nothing was changed" in said.output
    forced = _cli("models", "promote", LINE, "2", store, "--force")
    assert forced.exit_code == 0 and line.promoted() == 2, forced.output
    assert "warning: the gate refused version 2" in forced.output
    assert "--force, over the gate's refusal: not promoted: the drop check" in line.history()[-1]["reason"]
    assert _cli("models", "promote", LINE, "3", store).exit_code == 0 and line.promoted() == 3  # the gate's: no --force
    back = _cli("models", "rollback", LINE, store)  # back to 2, which the gate refused
    assert back.exit_code == 2 and line.promoted() == 3 and "the gate refused version 2" in back.output, back.output
    back = _cli("models", "rollback", LINE, store, "--force")
    assert back.exit_code == 0 and line.promoted() == 2 and "warning: the gate refused version 2" in back.output, back.output
    assert "to a version the gate refused" in line.history()[-1]["reason"]
    with pytest.raises(ConfigError, match="the gate refused version 2"):
        line.promote(2, "again", over_refusal=False)


@pytest.mark.slow
def test_a4_regate_says_its_verdict_once_and_what_it_turned_off_and_list_agrees(three_drops):
    root, *_ = three_drops
    line = ModelLine(open_store(str(root / "store")), LINE)
    store = f"--store={root / 'store'}"
    assert line.promoted() == 3 and line.record(2).decision["promoted"] is False
    # the audit's drop promoted after all: its relabelling checked by hand, say (and past version 3, which is better)
    opened = ["--set=registry.drop_check.relabel_below_chance=0", "--set=registry.drop_check.max_new_drop=1",
              "--set=registry.drop_check.max_drop=1", "--set=registry.tolerance=1", "--set=registry.max_client_drop=1"]
    regated = _cli("models", "regate", f"{LINE}@2", store, *opened)
    out = regated.output
    assert regated.exit_code == 0 and f"model line {LINE}, version 2: promoted: " in out, out
    assert "promoted: promoted:" not in out and "not promoted: not promoted:" not in out
    off = ("checks off: the drop check's accuracy-fall rule (registry.drop_check.max_drop=1); the drop check's relabelled-new-samples "
           "rule (registry.drop_check.relabel_below_chance=0); the drop check's new-samples rule (registry.drop_check.max_new_drop=1); "
           "the per-client loss limit (registry.max_client_drop=1); the metric comparison (registry.tolerance=1)")
    assert f"decided      with registry.drop_check.relabel_below_chance=0, registry.drop_check.max_new_drop=1, registry.drop_check.max_drop=1, registry.tolerance=1, " \
           f"registry.max_client_drop=1; {off}; compared on the test samples both drops hold" in out, out
    entry = line.history()[-1]
    assert line.promoted() == 2 and entry["reason"].startswith("regated: promoted (with registry.drop_check.relabel_below_chance=0")
    assert off in entry["reason"] and "compared on the test samples both drops hold" in entry["reason"]
    listed = _cli("models", "list", LINE, store).output
    row = next(r for r in listed.splitlines() if r.startswith("* v2"))
    assert f"regated (history #{entry['seq']}" in row and "gate at registration: not promoted: the drop check flags" in row, row
    # the promoted version's drop gone (a retention policy): the candidate's own test splits, and the record says so
    shutil.rmtree(root / "drops" / "2026-02-01")
    again = _cli("models", "regate", f"{LINE}@3", store, "--set=registry.drop_check.enabled=false", "--set=registry.tolerance=1",
                 "--set=registry.max_client_drop=1").output
    fell_back = "compared on this run's test splits: version 2's drop could not be read again"
    assert "checks off: the drop check (registry.drop_check.enabled=false)" in again and fell_back in again, again
    assert f"model line {LINE}, version 3: promoted: " in again and line.promoted() == 3
    assert "promoted: promoted:" not in again and fell_back in line.history()[-1]["reason"]


def test_a8_clean_removes_the_temp_files_a_killed_registration_left(tmp_path):
    from fedpipe.store.folder import _write_temp

    line = ModelLine(open_store(str(tmp_path)), LINE)
    line.register(_record("run-1"), {"spec.json": b"{}"})
    line.store.create(line.keys.claim(2), b'{"run_id": "killed", "time": "2026-01-01T00:00:00+00:00"}')
    line.store.put(line.keys.version(2) + "clients/hospital-a.pt2", b"written")
    clients = tmp_path / "models" / LINE / "versions" / "2" / "clients"
    _write_temp(clients, b"half of hospital-b's model")  # killed before its rename: what `put` leaves
    _write_temp(clients / ".sha256", b"its hash")
    cleaned = _cli("models", "clean", LINE, f"--store={tmp_path}")
    assert cleaned.exit_code == 0 and "v2" in cleaned.output, cleaned.output
    assert not (tmp_path / "models" / LINE / "versions" / "2").exists(), list((tmp_path / "models" / LINE / "versions" / "2").rglob("*"))
    assert line.versions() == [1] and line.read(1, "spec.json", 100) == b"{}"


# --- A7 --------------------------------------------------------------------------------------------------------------

def test_a7_a_manifest_of_80000_labels_with_a_repeat_is_refused_in_well_under_a_second():
    from pydantic import ValidationError

    from fedpipe.data.files.init import reorder_labels
    from fedpipe.data.files.manifest import DataManifest

    labels = [f"c{k}" for k in range(80_000)]  # the audit's 629 KB manifest: 80,000 labels, one of them twice
    start = time.perf_counter()
    with pytest.raises(ValidationError, match="labels must be distinct; repeated: c0"):
        DataManifest.model_validate({"source": {"layout": "image_folders"}, "labels": [*labels[:-1], "c0"]})
    manifest = DataManifest.model_validate({"source": {"layout": "image_folders"}, "labels": labels})
    with pytest.raises(DataError, match="missing: c79999"):  # `fedpipe data init --labels` with one left out
        reorder_labels(manifest, labels[::-1][1:] + ["c0"])
    assert reorder_labels(manifest, labels[::-1]).labels[0] == "c79999"
    took = time.perf_counter() - start
    assert took < 1.0, f"{took:.1f} s"  # was ~190 s (list.count per label), and ~50 s for --labels
