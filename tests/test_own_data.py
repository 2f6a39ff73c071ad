"""A user's own federated data end to end (issue 22): image folders per client and a Parquet table with a
client column, in a folder and in S3 (the moto server, an S3 emulator), through the default pipeline on
kfp's local runner and through `Run`; the natural partition, the data snapshot in the run id, `latest`,
and bad data stopping a run before anything is written."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from own_data import SITES, breast_cancer_table, digit_sites, upload_folder, write_digit_folders

from fedpipe.errors import ConfigError, DataError
from fedpipe.run.config import load_config, with_data_snapshot
from fedpipe.run.run import Run

FAST = ["data.dataset=files", "partition.scheme=natural", "train.batch_size=20", "telemetry.progress=false",
        "engine.clients=sequential", "run.threads=1"]


def _fedpipe(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedpipe.cli", *args], capture_output=True, text=True, timeout=timeout)


def _init(source: str, *flags: str) -> None:
    done = _fedpipe("data", "init", source, *flags)
    assert done.returncode == 0, done.stdout + done.stderr


def _summary(store: Path) -> tuple[dict, list[dict]]:
    (summary_path,) = store.glob("*/report/summary.json")
    rows = list(csv.DictReader((summary_path.parent / "clients.csv").open()))
    return json.loads(summary_path.read_text()), rows


@pytest.mark.slow
def test_the_default_pipeline_learns_from_image_folders_per_client(tmp_path):
    source = write_digit_folders(tmp_path / "sites")
    _init(str(source))
    check = _fedpipe("data", "check", str(source), f"--heatmap={tmp_path / 'heatmap.png'}")
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"clients      {len(SITES)}:" in check.stdout and "OK: a run can read this data." in check.stdout
    assert (tmp_path / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    store = tmp_path / "runs"
    sets = [*FAST, f"data.source={source}", f"run.store={store}", "train.rounds=3", "train.lr=0.05"]
    done = _fedpipe("run", *(f"--set={s}" for s in sets))  # the default method: SuPerFed-MM, two phases
    assert done.returncode == 0, done.stdout + done.stderr
    summary, clients = _summary(store)
    print(f"image folders: personalized {summary['personalized_accuracy']['mean']:.3f}, global {summary['global_model']['top1']:.3f}")
    # chance is 1/4 for a site's own classes and 1/10 on the global test set
    assert summary["personalized_accuracy"]["mean"] >= 0.6, summary["personalized_accuracy"]
    assert summary["global_model"]["top1"] >= 0.3, summary["global_model"]
    assert summary["partition"] == "natural" and summary["num_clients"] == len(SITES)
    assert [row["name"] for row in clients] == list(SITES)  # the report names the sites the files gave
    assert summary["data"]["source"] == str(source) and len(summary["data"]["snapshot"]) == 64


@pytest.mark.slow
def test_the_default_pipeline_learns_from_a_parquet_table_in_s3(tmp_path, raw_client):
    folder = tmp_path / "table"
    breast_cancer_table(folder / "patients.parquet")
    source = upload_folder(raw_client, folder, "user-data", "cancer")
    _init(source, "--client-column=branch", "--label-column=diagnosis")
    store = tmp_path / "runs"
    sets = [*FAST, f"data.source={source}", f"run.store={store}", "train.rounds=3", "train.lr=0.05"]
    done = _fedpipe("run", *(f"--set={s}" for s in sets))
    assert done.returncode == 0, done.stdout + done.stderr
    summary, clients = _summary(store)
    print(f"parquet in S3: personalized {summary['personalized_accuracy']['mean']:.3f}, global {summary['global_model']['top1']:.3f}")
    assert summary["personalized_accuracy"]["mean"] >= 0.85, summary["personalized_accuracy"]  # chance: 0.5
    assert summary["global_model"]["top1"] >= 0.85, summary["global_model"]
    assert [row["name"] for row in clients] == [f"branch-{b}" for b in range(4)]
    assert summary["data"]["source"] == source


def _files_run(tmp_path: Path, source: Path | str, *extra: str) -> Run:
    return Run(with_data_snapshot(load_config(None, [*FAST, f"data.source={source}", f"run.store={tmp_path / 'runs'}",
                                                     "train.rounds=2", *extra])))


def test_the_natural_partition_keeps_each_sites_samples_and_names(tmp_path):
    source = write_digit_folders(tmp_path / "sites", limit=600)
    _init(str(source))
    run = _files_run(tmp_path, source)
    partition = run.partition()
    _, labels, sites = digit_sites()
    bundle = run.bundle
    assert partition.client_names == SITES[: len(partition.client_names)]
    for client in partition.clients:  # every row of client k comes from site k's folder
        rows = client.indices
        assert set(bundle.clients[rows].tolist()) == {client.id}
        # and the site's own label mix: site k holds only digits 2k .. 2k+3 (mod 10)
        assert {int(c) for c in bundle.train.y[rows]} <= {(2 * client.id + j) % 10 for j in range(4)}
    manifest = json.loads(run.store.get_text(run.layout.partition_manifest))
    assert manifest["client_names"] == list(partition.client_names)


def test_the_same_data_resumes_the_same_run_and_new_data_is_a_new_run(tmp_path):
    source = write_digit_folders(tmp_path / "sites", limit=400)
    _init(str(source))
    first, again = _files_run(tmp_path, source), _files_run(tmp_path, source)
    assert first.layout.run_id == again.layout.run_id and first.cfg.data.snapshot
    pngs = sorted(source.rglob("*.png"))
    pngs[0].write_bytes(pngs[-1].read_bytes())  # one image replaced by another: the same keys, new data
    changed = _files_run(tmp_path, source)
    assert changed.layout.run_id != first.layout.run_id
    # a step of the first run, reading the data after it changed, refuses it instead of mixing old and new
    with pytest.raises(DataError, match="changed since this run recorded it"):
        _ = first.bundle


def test_latest_reads_the_newest_drop_and_the_run_records_which(tmp_path):
    drops = tmp_path / "drops"
    for day, limit in (("2026-11-01", 300), ("2026-11-24", 500)):
        write_digit_folders(drops / day, limit=limit)
        _init(str(drops / day))
    run = _files_run(tmp_path, f"{drops}/latest")
    assert run.cfg.data.source == str(drops / "2026-11-24")
    assert len(run.bundle.train) == 500


def test_a_synthetic_scheme_splits_the_users_data_pooled_over_its_clients(tmp_path):
    source = write_digit_folders(tmp_path / "sites", limit=400)
    _init(str(source))
    run = _files_run(tmp_path, source, "partition.scheme=iid", "partition.num_clients=3")
    assert run.partition().num_clients == 3


def test_natural_needs_clients_and_files_needs_a_source(tmp_path):
    with pytest.raises(DataError, match="no clients"):
        Run(load_config(None, ["data.dataset=digits", "partition.scheme=natural", f"run.store={tmp_path}"])).partition()
    with pytest.raises(ConfigError, match="set data.source"):
        load_config(None, ["data.dataset=files"])
    with pytest.raises(ConfigError, match="belong"):
        load_config(None, ["data.dataset=digits", f"data.source={tmp_path}"])


def test_a_client_below_min_client_size_is_named_and_nothing_is_written(tmp_path):
    source = write_digit_folders(tmp_path / "sites", limit=300)
    _init(str(source))
    run = _files_run(tmp_path, source, "partition.min_client_size=100")
    with pytest.raises(DataError, match="hospital-"):
        run.partition()
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_bad_data_stops_the_run_with_the_file_named_and_nothing_written(tmp_path):
    source = write_digit_folders(tmp_path / "sites", limit=300)
    _init(str(source))
    bad = source / SITES[1] / "7" / "broken.png"
    bad.parent.mkdir(parents=True, exist_ok=True)
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 20)  # a truncated PNG
    store = tmp_path / "runs"
    done = _fedpipe("run", *(f"--set={s}" for s in [*FAST, f"data.source={source}", f"run.store={store}"]), timeout=300)
    assert done.returncode != 0
    assert "broken.png" in done.stderr + done.stdout
    assert not store.exists() or not any(store.rglob("*.json"))
    check = _fedpipe("data", "check", str(source), timeout=300)
    assert check.returncode == 2 and "broken.png" in check.stdout


def test_the_same_image_under_two_clients_is_a_warning_naming_both_files(tmp_path):
    from fedpipe.data.files import check_files

    source = write_digit_folders(tmp_path / "sites", limit=200)
    _init(str(source))
    original = sorted((source / SITES[0]).rglob("*.png"))[0]
    label = original.parent.name
    copy = source / SITES[3] / label / "copied.png"
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_bytes(original.read_bytes())
    (original.parent / "twin.png").write_bytes(original.read_bytes())  # a duplicate inside one client is no leak
    warned = [p for p in check_files(str(source)).problems.warnings if p.kind == "duplicated across clients"]
    assert len(warned) == 1, warned
    assert "copied.png" in str(warned[0]) and str(original) in str(warned[0]) and SITES[0] in str(warned[0])


def test_table_features_are_standardised_on_the_federating_clients_training_rows(tmp_path):
    from fedpipe.data.federated import prepare_data

    breast_cancer_table(tmp_path / "table" / "patients.parquet")
    _init(str(tmp_path / "table"), "--client-column=branch", "--label-column=diagnosis")
    run = _files_run(tmp_path, tmp_path / "table")
    data = prepare_data(run.bundle, run.partition(), run.device)
    train = torch.cat([c.train.x for c in data.clients])
    assert train.shape[1] == 30 and train.dtype.is_floating_point
    assert train.mean(0).abs().max() < 1e-4 and (train.std(0, unbiased=False) - 1).abs().max() < 1e-3
    assert data.global_test.x.mean(0).abs().max() > 1e-3  # held-out rows did not shape the statistics


def test_compiling_a_pipeline_pins_nothing_each_run_reads_its_own_drop(tmp_path):
    """A compiled (or scheduled) pipeline must not freeze the drop `latest` names today, nor need the data's
    credentials where it is compiled: the config task pins data.source and data.snapshot when each run starts."""
    out = tmp_path / "p.yaml"
    done = _fedpipe("compile", "-o", str(out), "--set=data.dataset=files", "--set=data.source=s3://nowhere/drops/latest",
                    "--set=partition.scheme=natural", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    text = out.read_text()
    assert "s3://nowhere/drops/latest" in text and 'snapshot":null' in text
