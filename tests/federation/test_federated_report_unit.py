"""A federated run's report and its gate, from the ServerApp's outputs, without Flower (the loopback run of
test_own_files.py makes them for real): the figures weighted by hand, the gate's rule on the sites' scores of both
global models, and names from the sites' files shown as text, never run (a CSV formula, HTML)."""

from __future__ import annotations

import csv
import io
import json

import pytest

from fedpipe.errors import ConfigError, CorruptArtifactError
from fedpipe.federation.report import write_report
from fedpipe.models.federated import check_registry, decide_federated, site_scores
from fedpipe.models.line import ModelLine
from fedpipe.run.config import load_config
from fedpipe.store import open_store

HOSTILE = "=HYPERLINK(\"http://x\")<script>alert(1)</script>"
CENSUS = {"labels": ["0", "1"], "input_shape": [1, 8, 8], "num_classes": 2,
          "sites": [{"client_id": 0, "name": "a", "node_id": 11, "opt_out": False,
                     "counts": {"train": [6, 4], "val": [1, 1], "test": [2, 2], "holdout": [5, 5]}, "snapshot": "s0",
                     "samples": {"train": 10, "test": 4, "holdout": 10}},
                    {"client_id": 1, "name": HOSTILE, "node_id": 12, "opt_out": False,
                     "counts": {"train": [2, 8], "val": [0, 2], "test": [1, 3], "holdout": [15, 15]}, "snapshot": "s1",
                     "samples": {"train": 10, "test": 4, "holdout": 30}}]}
#: site 0 holds 10 held-out samples, site 1 holds 30: the global figures weigh them 1:3
EVALUATION = {"0": {"accuracy": 0.9, "chosen": 0.5, "holdout-accuracy": 0.8, "holdout-samples": 10.0, "test-samples": 4.0,
                    "champion-holdout-accuracy": 0.7},
              "1": {"accuracy": 0.7, "chosen": 1.0, "holdout-accuracy": 0.6, "holdout-samples": 30.0, "test-samples": 4.0,
                    "champion-holdout-accuracy": 0.64}}
ROUNDS = [{"phase": "federation", "round": 1, "clients": 2, "failed": 1, "loss": 0.9, "bytes_up": 1000, "bytes_down": 2000,
           "seconds": 1.0, "rejected": [{"round": 1, "client": 1, "error": "UploadRejected: NaN"}], "reported": {"0": {}, "1": {}}},
          {"phase": "federation", "round": 2, "clients": 2, "failed": 0, "loss": 0.5, "bytes_up": 2000, "bytes_down": 2000,
           "seconds": 1.0, "rejected": [], "reported": {"0": {}, "1": {}}}]


def _out(tmp_path, census=CENSUS, evaluation=EVALUATION):
    out = tmp_path / "run" / "federation"
    out.mkdir(parents=True)
    (out / "census.json").write_text(json.dumps(census))
    (out / "evaluation.json").write_text(json.dumps(evaluation))
    (out / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROUNDS))
    return out


def test_the_report_weighs_the_sites_and_shows_their_names_as_text(tmp_path):
    out = _out(tmp_path)
    summary = write_report(out, tmp_path / "run" / "report", "fedavg, federated")
    assert summary["global_accuracy"] == pytest.approx((0.8 * 10 + 0.6 * 30) / 40)
    assert summary["personalized_accuracy"] == pytest.approx(0.8)
    assert (summary["rounds"], summary["failed_clients"], summary["bytes_up"]) == (2, 1, 3000)
    assert list(summary["per_site"]) == ["a", HOSTILE] and summary["missing_sites"] == []
    report = tmp_path / "run" / "report"
    rows = list(csv.DictReader(io.StringIO((report / "sites.csv").read_text())))
    assert rows[1]["name"] == "'" + HOSTILE  # a spreadsheet shows it as text, never runs it
    assert [(r["train"], r["val"], r["test"], r["holdout"]) for r in rows] == [("10", "2", "4", "10"), ("10", "2", "4", "30")]
    assert [(r["rounds_answered"], r["rounds_failed"]) for r in rows] == [("2", "0"), ("2", "1")]
    page = (report / "report.html").read_text()
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    for png in ("census.png", "rounds.png"):
        assert (report / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((report / "summary.json").read_text())["report"] == str(report / "report.html")


def test_a_site_that_did_not_evaluate_is_named_and_counts_withheld_draw_no_heatmap(tmp_path):
    census = {**CENSUS, "sites": [{k: v for k, v in s.items() if k not in ("counts", "snapshot")} for s in CENSUS["sites"]]}
    out = _out(tmp_path, census, {"0": EVALUATION["0"]})
    summary = write_report(out, tmp_path / "run" / "report", "private")
    assert summary["missing_sites"] == [HOSTILE] and summary["global_accuracy"] == pytest.approx(0.8)
    assert not (tmp_path / "run" / "report" / "census.png").exists()


def test_a_damaged_output_is_named(tmp_path):
    out = _out(tmp_path)
    (out / "evaluation.json").write_text("{not json")
    with pytest.raises(CorruptArtifactError, match="evaluation.json"):
        write_report(out, tmp_path / "run" / "report", "x")


def _cfg(*sets):
    return load_config(None, ["registry.name=line", "registry.gate_metric=global_accuracy", *sets])


def test_the_gate_compares_both_global_models_on_the_same_held_out_samples(tmp_path):
    line = ModelLine(open_store(str(tmp_path / "store")), "line")
    assert site_scores(EVALUATION, CENSUS, "champion-holdout-accuracy")[1] == pytest.approx((0.7 * 10 + 0.64 * 30) / 40)
    first = decide_federated(_cfg(), EVALUATION, CENSUS, line, None)
    assert first.promote and first.champion is None and first.candidate == pytest.approx(0.65)
    # candidate 0.65 vs champion 0.655 overall; site "a" gains, the other loses 0.04 (within max_client_drop 0.05)
    d = decide_federated(_cfg("registry.tolerance=0.01"), EVALUATION, CENSUS, line, 3)
    assert d.promote and (d.candidate, d.champion, d.champion_version) == (pytest.approx(0.65), pytest.approx(0.655), 3)
    assert d.compared["samples"] == 40 and "not run in a federation" in d.drop_check["note"]
    assert not decide_federated(_cfg(), EVALUATION, CENSUS, line, 3).promote  # below the champion, no tolerance
    strict = decide_federated(_cfg("registry.tolerance=0.01", "registry.max_client_drop=0.03"), EVALUATION, CENSUS, line, 3)
    assert not strict.promote and HOSTILE in strict.dropped and "lost more than max_client_drop" in strict.reason


def test_the_gate_refuses_what_a_federation_cannot_compare(tmp_path):
    line = ModelLine(open_store(str(tmp_path / "store")), "line")
    unscored = {c: {k: v for k, v in e.items() if k != "champion-holdout-accuracy"} for c, e in EVALUATION.items()}
    with pytest.raises(ConfigError, match="no site scored the promoted version 3"):
        decide_federated(_cfg(), unscored, CENSUS, line, 3)
    with pytest.raises(ConfigError, match="registry.gate_metric=global_accuracy"):
        check_registry(load_config(None, ["registry.name=line"]))
    with pytest.raises(ConfigError, match="registry.reference"):
        check_registry(_cfg(f"registry.reference={tmp_path}"))
