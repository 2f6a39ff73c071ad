"""Unattended retraining you can trust (issue 29), re-enacted on digit images per site in S3 (the S3 test server,
an emulator), through the pipeline's own tasks as the chart's recurring run configures them:

- the drops carry only images: the manifest is written once at the drops root (`fedpipe data init --root`);
- drop 3 holds one site's label folders rotated (every image of that site, train and test, carries another of
  the site's digits): a poisoned drop, consistent with itself, so its own test splits agree with it;
- the gate compares on the test samples drops 2 and 3 both hold, read from drop 2, and the drop check sees the
  promoted version collapse on that site: not promoted, even with max_client_drop=1.0;
- the same candidate weighed without the drop check on its own test splits (the promoted version's drop
  deleted, as a retention policy would) wins: the check is what stops it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from own_data import SITES, upload_folder, write_digit_folders
from test_model_line_runs import Schedule

from fedpipe.config import DropCheckConfig
from fedpipe.models.gate import decide

POISONED = SITES[2]


def _rotate_labels(folder: Path, site: str) -> None:
    """Rename the site's label folders in a cycle (a -> b -> c -> d -> a)."""
    labels = sorted(p.name for p in (folder / site).iterdir())
    for label in labels:
        (folder / site / label).rename(folder / site / f"was-{label}")
    for k, label in enumerate(labels):
        (folder / site / f"was-{label}").rename(folder / site / labels[(k + 1) % len(labels)])


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedpipe.cli", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.services
def test_a_poisoned_drop_is_flagged_by_the_drop_check_and_not_promoted(tmp_path, raw_client):
    s = Schedule(raw_client, tmp_path)
    config = s.config(registry={"name": "digits-sites", "gate_metric": "personalized_accuracy", "tolerance": 0.0,
                                "max_client_drop": 1.0})

    def drop(day: str, limit: int, poison: bool = False) -> str:
        folder = write_digit_folders(tmp_path / "drops" / day, limit=limit)  # images only: no manifest in the drop
        if poison:
            _rotate_labels(folder, POISONED)
        return upload_folder(s.raw, folder, s.bucket, f"drops/{day}")

    drop("2026-01-01", 400)
    no_manifest = _cli("data", "check", f"s3://{s.bucket}/drops/latest")
    assert no_manifest.returncode == 2 and "--root" in no_manifest.stdout + no_manifest.stderr, no_manifest.stdout
    done = _cli("data", "init", f"s3://{s.bucket}/drops/latest", "--root")
    assert done.returncode == 0 and f"s3://{s.bucket}/drops/fedpipe-data.yaml" in done.stdout, done.stdout + done.stderr
    run1, published1 = s.run("job-1", config)
    assert published1["promoted"] and published1["version"] == 1

    drop("2026-02-01", 800)
    run2, published2 = s.run("job-2", config)
    assert published2["promoted"], published2["reason"]
    compared, apart, check = published2["compared"], published2["new_samples"], published2["drop_check"]
    assert "both drops hold" in compared["on"] and compared["samples"] > 50 and apart["samples"] > 50
    assert check["checked"] == len(SITES) and not check["suspect"]

    drop("2026-03-01", 1200, poison=True)
    run3, published3 = s.run("job-3", config)
    assert run3.cfg.data.source.endswith("/2026-03-01") and run3.cfg.train.init_from == "2"
    check = published3["drop_check"]
    print("drop check:", *(f"{c['client']}: {c['then']:.3f} -> {c['now']:.3f}" for c in check["clients"]))
    assert not published3["promoted"] and s.line.promoted() == 2
    assert check["suspect"] and [c["client"] for c in check["flagged"]] == [POISONED], check
    assert published3["reason"].startswith("not promoted: the drop check flags 1 client(s)") and POISONED in published3["reason"]
    flagged = check["flagged"][0]
    assert flagged["then"] > 0.6 and flagged["now"] < 0.2
    page = run3.store.get_text(run3.layout.report("model_line.md"))
    assert "Drop check: suspect, 1 of 5 client(s) flagged." in page and "New test samples, reported apart" in page

    # the same candidate without the drop check: compared on drop 2's copies of the shared test samples, the
    # poisoned site's true labels still sink it ...
    unchecked = run3.cfg.registry.model_copy(update={"drop_check": DropCheckConfig(enabled=False)})
    trusted = decide(run3, s.line, unchecked)
    assert not trusted.promote and "below it by more than the tolerance" in trusted.reason, trusted.reason
    # ... but with drop 2 gone, only the candidate's own (poisoned) test splits are left, and it wins
    for obj in list(s.raw.list_objects(s.bucket, prefix="drops/2026-02-01/", recursive=True)):
        s.raw.remove_object(s.bucket, obj.object_name)
    blind = decide(run3, s.line, unchecked)
    assert blind.promote and "could not be read again" in blind.compared["on"], blind.reason
    assert blind.candidate > blind.champion + 0.1
    guarded = decide(run3, s.line, run3.cfg.registry)
    assert not guarded.promote and guarded.drop_check["suspect"]

    # a rerun with other registry settings says the registration is reused; regate decides again
    _, again = s.run("job-3", config, "registry.tolerance=0.5")
    assert again["reused"] and "registry.tolerance: 0.0 then, 0.5 now" in again["note"] and again["version"] == 3
    regated = _cli("models", "regate", "digits-sites@3", f"--store={s.store}", "--set=registry.drop_check.enabled=false")
    assert regated.returncode == 0 and "version 3: promoted" in regated.stdout, regated.stdout + regated.stderr
    assert s.line.promoted() == 3 and s.line.history()[-1]["reason"].startswith("regated: promoted")
    unknown = _cli("models", "list", "nosuchline", f"--store={s.store}")
    assert unknown.returncode == 2 and "the lines there: digits-sites" in unknown.stderr, unknown.stderr
