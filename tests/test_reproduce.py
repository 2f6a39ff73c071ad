"""Reproductions as data (reproductions/*.yaml, fedpipe.study.reproduction), their runner and report
(fedpipe.study.reproduce, fedpipe.study.reproduce_report) and `fedpipe reproduce`: the files are validated as
hostile input, the paper's numbers are the paper's, claims are checked by hand-computed orderings, and a
reproduction runs end to end (and resumes) on tiny data written in the dataset's own on-disk format."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from dataset_files import write_mnist_original
from typer.testing import CliRunner

from fedpipe.cli import app
from fedpipe.errors import ConfigError
from fedpipe.study.reproduce import departures, matching, read_records
from fedpipe.study.reproduce_report import Measures, claim_rows, verdict
from fedpipe.study.reproduction import find_reproduction, load_reproduction, reproductions_folder
from fedpipe.study.stats import mean_ci

FOLDER = reproductions_folder()
ALL = sorted(p.stem for p in FOLDER.glob("*.yaml"))


@pytest.mark.parametrize("name", ALL)
def test_every_shipped_reproduction_validates_with_its_runs(name):
    from fedpipe.study.reproduce import run_config

    repro = load_reproduction(find_reproduction(name))
    assert repro.name == name and repro.cells and all(c.cite for c in repro.setting.values())
    for point in repro.points():  # every run it describes is a valid run config
        run_config(repro, point, 0, [])


def test_fedmoe_table1_holds_the_papers_numbers():
    repro = load_reproduction(find_reproduction("fedmoe_table1_fashion_mnist"))
    cells = {(c.table, c.row, c.column): c for c in repro.cells}
    assert len(cells) == 40 and len(repro.points()) == 5
    # copied by hand from the paper's Table 1c and 1d (003_0376edf81d2c3b14.txt)
    assert cells[("1c", "p = 0.3", "FedAvg")].paper == 71.12 and cells[("1c", "p = 0.3", "FedAvg")].measure == "fedavg.global"
    assert cells[("1d", "p = 1.0", "Local")].paper == 94.22 and cells[("1d", "p = 1.0", "Local")].measure == "local.local"
    assert cells[("1c", "p = 1.0", "Mixture")].paper == 22.64 and cells[("1c", "p = 1.0", "Mixture")].point() == {"p": "1"}
    assert repro.overrides({"p": "0.3"})["partition.p"] == 0.3 and repro.overrides({"p": "0.3"})["train.select"] == "best_val_loss"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


MINIMAL = """name: t
paper: P
tables: T
data: D
scorer: personalized
setting: {method.name: {value: fedavg, cite: Sec. 1}}
axes: {p: {key: partition.p, values: [0.5], cite: Table 1}}
seeds: 2
seeds_cite: Sec. 4
cells: [{table: "1", row: r, column: c, at: {p: 0.5}, measure: personalized_accuracy, paper: 50}]
"""


@pytest.mark.parametrize("change, message", [
    (("seeds: 2", "seeds: 2\nsede: 3"), "sede: unknown field"),
    (("at: {p: 0.5}", "at: {p: 0.6}"), "p=0.6 is not a label of axis p"),
    (("at: {p: 0.5}", "at: {q: 0.5}"), "axis 'q' is not declared"),
    (("measure: personalized_accuracy", "measure: mixture.local"), "is not one scorer personalized gives"),
    (("method.name: {value: fedavg, cite: Sec. 1}", "method.name: {value: fedavg}"), "setting.method.name.cite"),
    (("seeds: 2\n", "seeds: 2\nclaims: [{says: s, left: nope, relation: '>', right: personalized_accuracy, cite: c}]\n"),
     "measure 'nope' is none of the cells'"),
    # issue 43, A15: a reproduction sets the paper's setting, never where runs report (every run would contact the host)
    (("setting: {method.name: {value: fedavg, cite: Sec. 1}}", "setting: {method.name: {value: fedavg, cite: Sec. 1}, "
      "telemetry.mlflow: {value: 'http://collector.example:5000', cite: x}}"), "'telemetry.mlflow' is not a config path of the paper's setting"),
    (("axes: {p: {key: partition.p,", "axes: {p: {key: telemetry.pushgateway,"), "telemetry.pushgateway"),
    (("seeds: 2\n", "seeds: 2\nspecific: [{at: {p: 0.5}, set: {run.store: 's3://elsewhere/x'}, cite: c}]\n"),
     "'run.store' is not a config path of the paper's setting"),
])
def test_a_bad_reproduction_file_names_what_is_wrong(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        load_reproduction(_write(tmp_path, MINIMAL.replace(*change)))


def test_a_hostile_reproduction_file_is_refused_before_it_is_built(tmp_path):
    laughs = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefg", "bcdefgh"))
    with pytest.raises(ConfigError, match="alias|nodes"):
        load_reproduction(_write(tmp_path, laughs))
    with pytest.raises(ConfigError, match="more than the 64 KiB a reproduction can be"):
        load_reproduction(_write(tmp_path, MINIMAL + "#" * 70_000))
    with pytest.raises(ConfigError, match="No reproduction 'nope'"):
        find_reproduction("nope")


def test_verdicts_by_hand():
    # differences left - right over three seeds: 1, 2, 3 -> mean 2, interval 2 ± t(0.975, 2)·1/√3 = 2 ± 2.48
    spans = mean_ci([1.0, 2.0, 3.0])
    assert math.isclose(spans.low, 2 - 4.302652729911275 / math.sqrt(3))
    assert verdict(">", spans, 1.0) == "yes (interval spans 0)" and verdict("<", spans, 1.0) == "no"
    assert verdict(">", mean_ci([2.0, 2.1, 1.9]), 1.0) == "yes"  # 2 ± 0.25: firmly above 0
    assert verdict("~", mean_ci([0.2, -0.2, 0.0]), 1.0) == "yes" and verdict("~", mean_ci([2.0, 2.1, 1.9]), 1.0) == "no"
    assert verdict(">", mean_ci([0.5]), 1.0) == "yes (one seed)"


def test_claims_on_the_papers_numbers_and_on_ours():
    repro = load_reproduction(find_reproduction("fedmoe_table1_fashion_mnist"))
    # ours at p = 1.0, two seeds: mixture.global 30 and 32, finetuned.global 28 and 29 (percent)
    records = [{"point": {"p": "1"}, "seed": s, "overrides": [], "measures": {"mixture.global": m / 100, "finetuned.global": f / 100}}
               for s, m, f in ((0, 30, 28), (1, 32, 29))]
    rows, data = claim_rows(repro, Measures(records))
    by = {(d["says"][:20], json.dumps(d["where"])): d for d in data}
    generalizes = "The mixture generali"
    # Table 1c at p = 0.8: 61.53 > 58.66; p = 1.0 is outside the claim's `where`
    assert by[(generalizes, '{"p": "0.8"}')]["paper"] == "61.53 vs 58.66: yes" and (generalizes, '{"p": "1"}') not in by
    fedavg_best = "FedAvg generalizes b"
    assert by[(fedavg_best, '{"p": "1"}')]["paper"] == "49.43 vs 22.64: yes" and by[(fedavg_best, '{"p": "1"}')]["ours"] is None
    local_same = "The mixture performs"
    assert by[(local_same, '{"p": "0.7"}')]["paper"] == "74.63 vs 74.86: yes"  # within 1 point


def test_records_are_checked_and_departures_kept_apart(tmp_path):
    path = tmp_path / "runs.jsonl"
    good = {"point": {"p": "1"}, "seed": 0, "overrides": ["data.root=/x"], "measures": {"mixture.local": 0.9}}
    quick = dict(good, overrides=["train.rounds=5"], measures={"mixture.local": 0.5})
    path.write_text(json.dumps(good) + "\n" + json.dumps(quick) + "\n")
    assert departures(["data.root=/x", "engine.clients=batched", "train.rounds=5"]) == ["train.rounds=5"]
    assert departures(["train.select=last", "train.lr=5e-5"]) == departures(['train.select="last"', "train.lr=0.00005"])
    assert [r["measures"]["mixture.local"] for r in matching(read_records(path), [])] == [0.9]
    assert [r["measures"]["mixture.local"] for r in matching(read_records(path), ["train.rounds=5"])] == [0.5]
    path.write_text(json.dumps(dict(good, measures={"mixture.local": "0.9; rm -rf /"})) + "\n")
    with pytest.raises(ConfigError, match="line 1 is not a reproduction record"):
        read_records(path)


def test_an_appendix_becomes_a_section_of_text_and_a_bad_one_is_refused_by_name(tmp_path):
    records = tmp_path / "runs.jsonl"
    records.write_text(json.dumps({"point": {"p": "0.3"}, "seed": 0, "overrides": [], "measures": {"local.global": 0.62}}) + "\n")
    section = {"title": "Local at p = 0.3, one factor at a time", "paragraphs": ["<script>alert(1)</script> is text"],
               "header": ["factor", "Local global"], "rows": [["ours", "62.2"], ["patience 1", "41.0"]], "after": ["Conclusion: patience."]}
    good = tmp_path / "factors.json"
    good.write_text(json.dumps(section))
    out = tmp_path / "out"
    base = ["reproduce", "fedmoe_table1_fashion_mnist", "--report-only", "--out", str(out), "--records", str(records)]
    result = CliRunner().invoke(app, [*base, "--appendix", str(good)])
    assert result.exit_code == 0, result.output
    md = (out / "fedmoe_table1_fashion_mnist.md").read_text()
    assert md.index("## Local at p = 0.3, one factor at a time") > md.index("## The paper's claims")
    assert "| patience 1 | 41\\.0 |" in md or "| patience 1 | 41.0 |" in md, md
    assert "Conclusion: patience" in md and "<script>" not in (out / "fedmoe_table1_fashion_mnist.html").read_text()
    assert json.loads((out / "fedmoe_table1_fashion_mnist.json").read_text())["appendices"][0]["rows"][1] == ["patience 1", "41.0"]
    for bad, message in ((dict(section, rows=[["ours"]]), "row 1 has not the header's 2 cells"),
                         (dict(section, rows="ours"), "rows"), ("[", "is not a valid reproduction appendix: Expecting value"),
                         (dict(section, script="x"), "script")):
        good.write_text(bad if isinstance(bad, str) else json.dumps(bad))
        result = CliRunner().invoke(app, [*base, "--appendix", str(good)])
        assert result.exit_code != 0 and re.search(message, result.output), result.output
    good.write_text(" " * (300 * 2**10))
    result = CliRunner().invoke(app, [*base, "--appendix", str(good)])
    assert result.exit_code != 0 and "more than the 256 KiB a reproduction appendix can be" in result.output, result.output


def tiny_fashion_mnist(root: Path) -> Path:
    """Fashion-MNIST's original layout (Debian's), 10 classes x 24 training and x 6 test images of random pixels."""
    rng = np.random.default_rng(0)
    ytr, yte = np.repeat(np.arange(10), 24), np.repeat(np.arange(10), 6)
    xtr, xte = rng.integers(0, 256, (240, 28, 28), dtype=np.uint8), rng.integers(0, 256, (60, 28, 28), dtype=np.uint8)
    return write_mnist_original(root, (xtr, ytr), (xte, yte))


QUICK = ["partition.num_clients=4", "partition.samples_per_client=12", "train.client_fraction=0.5", "method.max_epochs=1",
         "train.select_every=1"]


def test_fedmoe_reproduction_runs_reports_and_resumes(tmp_path):
    root = tiny_fashion_mnist(tmp_path / "fmnist")
    out = tmp_path / "out"
    args = ["reproduce", "fedmoe_table1_fashion_mnist", "--rounds", "2", "--only", "p=1", "--seed", "0",
            "--out", str(out), "--set", f"data.root={root}", *[a for q in QUICK for a in ("--set", q)]]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    records = read_records(out / "runs.jsonl")
    assert [(r["point"], r["seed"]) for r in records] == [({"p": "1"}, 0)]
    assert set(records[0]["measures"]) == {f"{m}.{s}" for m in ("fedavg", "local", "finetuned", "mixture") for s in ("local", "global")}
    report = (out / "fedmoe_table1_fashion_mnist.md").read_text()
    assert "NOT the paper's setting" in report and "train.rounds=2" in report and "94.22" in report
    summary = json.loads((out / "fedmoe_table1_fashion_mnist.json").read_text())
    assert "p=0.3: seed(s) 0" in summary["missing"] and not any(m.startswith("p=1:") for m in summary["missing"])
    ours = [c for c in summary["cells"] if c["ours"] is not None]
    assert len(ours) == 8 and all(c["row"] == "p = 1.0" and 0 <= c["ours"] <= 100 for c in ours)
    assert (out / "fedmoe_table1_fashion_mnist_vs_paper.png").stat().st_size > 1000
    assert (out / "fedmoe_table1_fashion_mnist_curves.png").stat().st_size > 1000
    again = CliRunner().invoke(app, args)  # everything recorded: nothing reruns
    assert again.exit_code == 0 and len(read_records(out / "runs.jsonl")) == 1


def _tiny_cifar10(root: Path, rng) -> list[str]:
    from dataset_files import write_cifar10

    ytr, yte = np.repeat(np.arange(10), 16), np.repeat(np.arange(10), 4)
    write_cifar10(root, (rng.integers(0, 256, (160, 3, 32, 32), dtype=np.uint8), ytr),
                  (rng.integers(0, 256, (40, 3, 32, 32), dtype=np.uint8), yte),
                  ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"])
    return ["partition.num_clients=4"]


def _tiny_cifar100(root: Path, rng) -> list[str]:
    from dataset_files import write_cifar100

    ytr, yte = np.repeat(np.arange(100), 4), np.repeat(np.arange(100), 1)
    write_cifar100(root, (rng.integers(0, 256, (400, 3, 32, 32), dtype=np.uint8), ytr),
                   (rng.integers(0, 256, (100, 3, 32, 32), dtype=np.uint8), yte), [f"class{i}" for i in range(100)])
    return ["partition.num_clients=4"]


def _tiny_emnist(root: Path, rng) -> list[str]:
    from dataset_files import write_emnist

    ytr, yte = np.repeat(np.arange(62), 4), np.repeat(np.arange(62), 1)
    write_emnist(root, "byclass", (rng.integers(0, 256, (248, 28, 28), dtype=np.uint8), ytr),
                 (rng.integers(0, 256, (62, 28, 28), dtype=np.uint8), yte))
    return ["partition.client_size_min=20", "partition.client_size_max=40"]


def _tiny_tinyimagenet(root: Path, rng) -> list[str]:
    from dataset_files import blocky_rgb64, write_tinyimagenet

    ytr, yva = np.repeat(np.arange(200), 2), np.arange(200)
    write_tinyimagenet(root, [f"n{i:08d}" for i in range(200)], (blocky_rgb64(400, 1), ytr), (blocky_rgb64(200, 2), yva))
    return ["partition.client_size_min=20", "partition.client_size_max=40"]


@pytest.mark.parametrize("name, only, data", [
    ("pfedmb_table2", ["--only", "setting=c10_2classes_15", "--only", "method=pFedMB"], _tiny_cifar10),
    ("pfedmb_table2", ["--only", "setting=c100_20classes_15", "--only", "method=FedAvg"], _tiny_cifar100),
    ("superfed_tables1_2", ["--only", "dataset=cifar10", "--only", "method=SuPerFed-MM"], _tiny_cifar10),
    ("superfed_tables1_2", ["--only", "dataset=emnist", "--only", "method=SuPerFed-LM"], _tiny_emnist),
    ("superfed_tables1_2", ["--only", "dataset=tinyimagenet", "--only", "method=FedAvg"], _tiny_tinyimagenet),
])
def test_other_reproductions_run_on_tiny_files_in_each_format(tmp_path, name, only, data):
    """The other seeds' tables run as written on each dataset's own on-disk format (CIFAR's python batch files,
    EMNIST's idx files, Tiny ImageNet's JPEG folders), at a tiny budget."""
    sized = data(tmp_path / "data", np.random.default_rng(1))
    out = tmp_path / "out"
    tiny = [*sized, "train.client_fraction=1.0", "train.local_epochs=1", "train.batch_size=8"]
    result = CliRunner().invoke(app, ["reproduce", name, "--rounds", "2", "--seed", "0", "--out", str(out), *only,
                                      "--set", f"data.root={tmp_path / 'data'}", *[a for q in tiny for a in ("--set", q)]])
    assert result.exit_code == 0, result.output
    records = read_records(out / "runs.jsonl")
    assert len(records) == 1 and 0 <= records[0]["measures"]["personalized_accuracy"] <= 1
    summary = json.loads((out / f"{name}.json").read_text())
    assert sum(c["ours"] is not None for c in summary["cells"]) == 1


def test_the_queues_mixture_runs_become_records_at_the_papers_setting(tmp_path):
    """benchmarks/mixture_records.py: a mixture.json written with the paper-budget queue's arguments is the
    reproduction's setting exactly (no departure); the same with train.select=last departs by that one field."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from mixture_records import records

    sets = ["data.root=/usr/share/datasets/fashion-mnist", "partition.val_fraction=0.25", "partition.test_fraction=0.25",
            "partition.majority_classes=2", "method.local_lr=5e-5", "method.mixture=probabilities",
            "train.select=best_val_loss", "train.select_every=50", "engine.clients=sequential", "engine.processes=1"]
    args = {"dataset": "fashion_mnist", "clients": 100, "samples_per_client": 200, "per_round": 5, "rounds": 1250,
            "local_epochs": 3, "batch_size": 10, "lr": 5e-5, "finetune_lr": 1e-5, "max_epochs": 500, "patience": 10,
            "model": "lenet5", "set": sets}
    models = {m: {"local": 0.9, "global": 0.3} for m in ("fedavg", "local", "finetuned", "mixture")}
    runs = [{"p": 1.0, "q": 0.0, "seed": 1, "models": models}, {"p": 1.0, "q": 0.5, "seed": 1, "models": models}]
    path = tmp_path / "mixture.json"
    path.write_text(json.dumps({"args": args, "runs": runs}))
    [record] = records(path, "fedmoe_table1_fashion_mnist")  # q = 0.5 is not in the table
    assert record["point"] == {"p": "1"} and record["seed"] == 1 and record["overrides"] == []
    assert record["measures"]["mixture.global"] == 0.3 and len(record["measures"]) == 8
    path.write_text(json.dumps({"args": dict(args, set=[*sets, "train.select=last"]), "runs": runs}))
    assert records(path, "fedmoe_table1_fashion_mnist")[0]["overrides"] == ['train.select="last"']
