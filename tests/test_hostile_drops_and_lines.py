"""Lower-severity findings of the audit (issue 30, item 6) in the data drops and the model line, each a test that
fails on the code before the fix: a 5,000-digit label, a file name that is not UTF-8, a Parquet footer claiming
2^40 rows, a manifest of 100,000 labels (reachable again), a hand promotion made while the gate decided, and a
rollback to a version whose files were swapped."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest
from own_data import write_digit_folders
from test_model_line import _record

from fedpipe.data.files import check_files, load_files
from fedpipe.data.files import tables as tables_module
from fedpipe.errors import CorruptArtifactError, DataError, StoreError
from fedpipe.models.line import ModelLine, abandoned, remove_abandoned
from fedpipe.models.publish import finish_promotion
from fedpipe.store import open_store

CSV_MANIFEST = "format: fedpipe-data\nversion: 1\nsource: {layout: table, client_column: client, label_column: label, features: [f]}\nlabels: [a, b]\n"


def test_a_5000_digit_label_is_an_unknown_label_not_a_traceback(tmp_path):
    rows = ["client,label,f"] + [f"x,{'7' * 5000 if i == 3 else 'a'},{i}" for i in range(20)]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    (tmp_path / "fedpipe-data.yaml").write_text(CSV_MANIFEST)
    check = check_files(str(tmp_path))
    (problem,) = check.problems.errors
    assert problem.kind == "unknown label" and "row 4" in problem.where and len(problem.what) < 400


def test_a_file_name_that_is_not_utf8_is_named_not_a_traceback(tmp_path):
    root = write_digit_folders(tmp_path / "d", limit=30)
    folder = next(p for p in root.rglob("*") if p.is_dir() and p.parent != root)
    with open(os.fsencode(folder) + b"/caf\xe9.png", "wb") as f:
        f.write(b"not even an image")
    with pytest.raises(DataError, match=r"not UTF-8 text .*caf\\xe9\.png.*rename it"):
        load_files(str(root))


def test_a_footer_claiming_2_to_the_40_rows_is_refused_by_the_budget(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"client": ["x"] * 20, "label": ["a", "b"] * 10, "f": np.arange(20.0)}), tmp_path / "t.parquet")
    (tmp_path / "fedpipe-data.yaml").write_text(CSV_MANIFEST)
    opened = tables_module._open_table
    monkeypatch.setattr(tables_module, "_open_table", lambda data, key: replace(opened(data, key), num_rows=2**40))
    check = check_files(str(tmp_path))  # np.empty of 2^40 rows would be 28 TB
    assert check.problems.errors[0].kind == "over the decoding budget" and "1,099,511,627,776 rows" in check.problems.errors[0].what


def test_a_manifest_of_100000_labels_can_be_read(tmp_path):
    labels = [f"class-{k:06d}" for k in range(100_000)]  # ~1.4 MB of YAML: MAX_LABELS, under MANIFEST_MAX_BYTES
    (tmp_path / "t.csv").write_text("client,label,f\n" + "".join(f"x,{labels[k % 7]},{k}\n" for k in range(30)))
    (tmp_path / "fedpipe-data.yaml").write_text(
        "format: fedpipe-data\nversion: 1\nsource: {layout: table, client_column: client, label_column: label, features: [f]}\n"
        "labels: [" + ", ".join(labels) + "]\n")
    check = check_files(str(tmp_path))
    assert not check.problems.errors and len(check.manifest.labels) == 100_000


@pytest.fixture
def line(tmp_path) -> ModelLine:
    line = ModelLine(open_store(str(tmp_path)), "digits")
    for run in ("run-1", "run-2"):
        line.register(_record(run), {"spec.json": b"{}", "global.pt2": run.encode()})
    return line


def test_the_gate_promotes_only_over_the_champion_it_decided_against(line):
    line.promote(1, "first")
    decided = line.register(replace(_record("run-3"), decision={"promoted": True, "reason": "better", "champion_version": 1}),
                            {"spec.json": b"{}"})
    line.promote(2, "by hand, while run-3 was being gated")
    with pytest.raises(StoreError, match="the promoted version is 2 now, not 1"):
        finish_promotion(line, decided)
    assert line.promoted() == 2


def test_a_rollback_to_a_version_whose_files_were_swapped_is_refused(line, tmp_path):
    line.promote(1, "first")
    line.promote(2, "second")
    (tmp_path / "models" / "digits" / "versions" / "1" / "global.pt2").write_bytes(b"swapped")
    with pytest.raises(CorruptArtifactError, match="corrupt|changed after registration"):
        line.rollback()
    assert line.promoted() == 2


def test_an_abandoned_claim_is_listed_and_cleaned(line, tmp_path):
    from typer.testing import CliRunner

    from fedpipe.cli import app

    line.store.create(line.keys.claim(3), b'{"run_id": "crashed", "time": "2026-01-01T00:00:00+00:00"}')
    line.store.put(line.keys.version(3) + "state.pt", b"half written")  # died before its record
    assert [n for n, _ in abandoned(line)] == [3]
    listed = CliRunner().invoke(app, ["models", "list", "digits", "--store", str(tmp_path)])
    assert listed.exit_code == 0 and "v3" in listed.output and "crashed" in listed.output and "never registered" in listed.output
    assert remove_abandoned(line, older_than_seconds=3600) == [3] and abandoned(line) == []
    assert line.versions() == [1, 2] and line.store.list(line.keys.version(3)) == []
    assert line.register(_record("run-4"), {"spec.json": b"{}"}).version == 3  # the number is free again
