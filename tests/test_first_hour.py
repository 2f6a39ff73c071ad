"""The first hour with your own data (issue 31): each finding of the new user's walkthrough, as a test that fails on
the code before the fix."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from own_data import write_digit_folders
from typer.testing import CliRunner

from fedpipe.cli import app
from fedpipe.run.config import load_config


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedpipe.cli", *args], capture_output=True, text=True, timeout=600)


# 7 -----------------------------------------------------------------------------------------------------------------

def test_a_version_that_does_not_exist_is_named_with_the_ones_that_do(tmp_path):
    from test_model_line import _record

    from fedpipe.models.line import ModelLine
    from fedpipe.store import open_store

    line = ModelLine(open_store(str(tmp_path)), "digits")
    for run in ("a", "b", "c"):
        line.register(_record(run), {"spec.json": b"{}"})
    for command in (["models", "show", "digits@9"], ["predict", "--model", "digits@9", "--client", "0", "x.png"]):
        done = CliRunner().invoke(app, [*command, "--store", str(tmp_path)])
        assert done.exit_code == 2 and "has no version 9; its versions are 1-3" in done.output, done.output


# 6 -----------------------------------------------------------------------------------------------------------------

def test_switching_method_on_an_example_keeps_the_common_sections(caplog):
    with caplog.at_level(logging.WARNING, logger="fedpipe.run.config"):
        cfg = load_config("examples/superfed_mm_mnist5k.yaml", ["method.name=fedavg_ft"])
    written = load_config("examples/superfed_mm_mnist5k.yaml")
    assert cfg.method.name == "fedavg_ft" and cfg.train == written.train and cfg.partition == written.partition
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "method.mu, method.nu, method.start_fraction do not apply to fedavg_ft and were dropped" in warning
    assert load_config("examples/superfed_mm_mnist5k.yaml", ["method.name=superfed_lm"]).method.mu == written.method.mu


# 5 -----------------------------------------------------------------------------------------------------------------

def _branches(folder: Path, lone_label_in_test: bool = False) -> Path:
    """A Parquet table of 3 branches x 30 rows, two features; branch-0 holds one row of label b (with
    `lone_label_in_test`, placed by its feature values so that its identity draws it into branch-0's test split)."""
    from fedpipe.data.files import load_files
    from fedpipe.data.partition import NaturalPartition, make_partition
    from fedpipe.data.partition.natural import unseen_test_classes

    folder.mkdir(parents=True, exist_ok=True)
    n = 90
    client = [f"branch-{i % 3}" for i in range(n)]
    label = ["b" if (i % 3 and i % 2) else "a" for i in range(n)]
    label[0] = "b"  # branch-0's only b
    x = np.random.default_rng(0).normal(size=(n, 2))
    for k in range(500 if lone_label_in_test else 1):
        x[0] = [k + 0.5, k + 0.5] if lone_label_in_test else x[0]
        pq.write_table(pa.table({"branch": client, "outcome": label, "f1": x[:, 0], "f2": x[:, 1]}), folder / "visits.parquet")
        if not lone_label_in_test:
            break
        (folder / "fedpipe-data.yaml").write_text("format: fedpipe-data\nversion: 1\nsource: {layout: table, client_column: branch, "
                                                  "label_column: outcome, features: [f1, f2]}\nlabels: [a, b]\n")
        bundle = load_files(str(folder))
        partition = make_partition(bundle, NaturalPartition(), 0)
        if unseen_test_classes(partition.clients, bundle.train.y, bundle.class_names, bundle.client_names):
            (folder / "fedpipe-data.yaml").unlink()
            break
    return folder / "visits.parquet"


def test_a_table_file_is_a_source_and_its_manifest_has_no_channels(tmp_path):
    table = _branches(tmp_path / "bank")
    done = _cli("data", "init", str(table), "--client-column", "branch", "--label-column", "outcome")
    assert done.returncode == 0, done.stdout + done.stderr
    manifest = (tmp_path / "bank" / "fedpipe-data.yaml").read_text()
    assert "files:\n  - visits.parquet" in manifest and "channels" not in manifest
    check = _cli("data", "check", str(table))
    assert check.returncode == 0 and "samples      90" in check.stdout, check.stdout + check.stderr


def test_a_check_says_each_thing_once(tmp_path):
    table = _branches(tmp_path / "bank", lone_label_in_test=True)
    assert _cli("data", "init", str(table), "--client-column", "branch", "--label-column", "outcome").returncode == 0
    drops = tmp_path / "drops"
    site = write_digit_folders(drops / "2026-01-01", limit=200)
    (site / "_SUCCESS").write_text("")
    assert _cli("data", "init", str(drops / "latest"), "--root").returncode == 0
    check = _cli("data", "check", str(drops / "latest"))
    assert check.returncode == 0 and (check.stdout + check.stderr).count("latest is 2026-01-01") == 1, check.stdout + check.stderr
    check = _cli("data", "check", str(table))
    out = check.stdout + check.stderr
    assert out.count("'branch-0'") == 1 and "in its test split but not in its training split" in out, out


def test_a_run_does_not_print_its_client_state_bookkeeping(tmp_path, caplog):
    from runs import small_run

    with caplog.at_level(logging.INFO):
        small_run(tmp_path, "train.rounds=1", "method.name=fedavg").run_all()
    assert "client states {" not in caplog.text


# 1 -----------------------------------------------------------------------------------------------------------------

def _sites_in_sizes(root: Path) -> Path:
    """Digit images per site in three sizes (8, 12 and 16 pixels), as sites exporting at different resolutions."""
    from own_data import SITES, digit_sites
    from PIL import Image

    images, labels, sites = digit_sites()
    for i in range(300):
        side = (8, 12, 16)[i % 3]
        folder = root / SITES[sites[i]] / str(labels[i])
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(images[i], mode="L").resize((side, side)).save(folder / f"{i}.png")
    return root


def test_mixed_image_sizes_are_one_message_and_init_proposes_a_size(tmp_path):
    root = _sites_in_sizes(tmp_path / "sites")
    done = _cli("data", "init", str(root))
    assert done.returncode == 0 and "the images come in 3 sizes: " in done.stdout, done.stdout + done.stderr
    assert "--set data.image_size=" in done.stdout and f"fedpipe data check {root} --image-size" in done.stdout
    check = _cli("data", "check", str(root))
    assert check.returncode == 2 and check.stdout.count("differing image sizes") == 1, check.stdout
    assert "samples      300 (200 of them in other image sizes" in check.stdout and "in 3 sizes: " in check.stdout
    assert "clients      " not in check.stdout and "client too small" not in check.stdout  # no partial counts
    assert _cli("data", "check", str(root), "--image-size", "12").returncode == 0


# 2 -----------------------------------------------------------------------------------------------------------------

def test_labels_in_the_order_people_read_them():
    from fedpipe.data.files.manifest import label_order

    assert label_order({"eight", "one", "zero", "nine", "two"}) == ["zero", "one", "two", "eight", "nine"]
    assert label_order({"class10", "class2", "Class1"}) == ["Class1", "class2", "class10"]
    assert label_order({"10", "9", "-1"}) == ["-1", "9", "10"]


def test_init_takes_the_class_order_and_the_heatmap_names_classes(tmp_path):
    from matplotlib.figure import Figure

    from fedpipe.plots import _draw_counts

    root = write_digit_folders(tmp_path / "sites", limit=100)
    order = "9,8,7,6,5,4,3,2,1,0"
    assert _cli("data", "init", str(root), "--labels", order).returncode == 0
    assert "- '9'\n- '8'" in (root / "fedpipe-data.yaml").read_text()
    wrong = _cli("data", "init", str(root), "--force", "--labels", "9,8,7")
    assert wrong.returncode == 2 and "missing: 0, 1, 2, 3, 4, 5, 6" in wrong.stderr, wrong.stderr
    fig = Figure()
    ax = fig.add_subplot(1, 1, 1)
    _draw_counts(fig, ax, np.ones((3, 4), dtype=np.int64), ("zero", "one", "two", "three"))
    assert [t.get_text() for t in ax.get_xticklabels()] == ["zero", "one", "two", "three"]


# 3 -----------------------------------------------------------------------------------------------------------------

def test_the_report_names_the_clients_and_the_model(tmp_path):
    from fedpipe.run.report import clients_html, clients_markdown, summary_lines

    csv_text = ("client,name,opt_out,train,val,test,accuracy,loss,ece,global_test_accuracy,chosen_lam\n"
                "0,Klinik Süd,0,40,5,10,0.9000,0.3,0.1,,0.4\n1,<b>site</b>,0,30,4,8,0.5000,0.9,0.2,,0.6\n")
    page = "\n".join(clients_markdown(csv_text))
    assert "| Klinik Süd | 40 / 5 / 10 | 0.9000 | 0.4 |" in page
    assert page.index("&lt;b&gt;site&lt;/b&gt;") < page.index("Klinik Süd")  # worst first, names escaped
    table = clients_html(csv_text)
    assert "<td>Klinik Süd</td>" in table and "&lt;b&gt;site" in table and "<b>site" not in table and "sortable" in table
    from runs import small_run

    run = small_run(tmp_path, "train.rounds=1", "method.name=fedavg", "model.name=auto")
    summary = run.run_all()
    assert summary["model"] == "superfed_cnn" and any("model                  superfed_cnn (model.name=auto picked it" in line
                                                    for line in summary_lines(summary))
    assert "## Clients" in run.store.get_text(run.layout.report("report.md"))
