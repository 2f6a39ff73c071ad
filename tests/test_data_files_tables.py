"""The `table` layout of a user's own data (fedpipe/data/files/tables.py), on data made here: scikit-learn's
bundled breast cancer table (569 rows, 30 numeric features, 2 classes) split into 4 `branch` clients by the
quartiles of "mean texture", written as Parquet and as CSV; tiny image tables (PNG bytes, and paths);
a text table. Every bad case is an error naming its file and row, and the reader leaves the source as it was."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
from PIL import Image
from sklearn.datasets import load_breast_cancer

from fedpipe.data.files import tables
from fedpipe.data.files.manifest import DataManifest, TableLayout
from fedpipe.data.files.rows import ClientRows, Problems
from fedpipe.data.files.table_manifest import infer_table_manifest
from fedpipe.data.files.tables import read_table
from fedpipe.data.text import TEXT_MAX_LENGTH as AGNEWS_MAX_LENGTH
from fedpipe.data.text import TEXT_VOCAB_SIZE as AGNEWS_VOCAB_SIZE
from fedpipe.data.text import build_vocabulary, encode, tokenize
from fedpipe.errors import DataError
from fedpipe.store.source import open_source

CANCER = load_breast_cancer()
FEATURES = tuple(str(n) for n in CANCER.feature_names)
CLASS_NAMES = ("malignant", "benign")  # sklearn's order: target 0 is malignant


def _branches() -> np.ndarray:
    """Each row's branch: the quartile of its "mean texture" (4 clients of about 142 rows)."""
    texture = CANCER.data[:, FEATURES.index("mean texture")]
    quartile = np.digitize(texture, np.quantile(texture, [0.25, 0.5, 0.75]))
    return np.asarray(["north", "east", "south", "west"])[quartile]


BRANCHES = _branches()


def _cancer_table(rows: slice = slice(None), label_names: bool = True) -> pa.Table:
    columns = {"branch": pa.array(BRANCHES[rows])}
    columns |= {name: pa.array(CANCER.data[rows, j]) for j, name in enumerate(FEATURES)}
    target = CANCER.target[rows]
    columns["diagnosis"] = pa.array(np.asarray(CLASS_NAMES)[target] if label_names else target.astype(np.int64))
    return pa.table(columns)


def _manifest(**layout) -> DataManifest:
    labels = layout.pop("labels", CLASS_NAMES)
    base = {"client_column": "branch", "label_column": "diagnosis", "features": FEATURES}
    if "image_column" in layout or "text_column" in layout:
        base.pop("features")
    return DataManifest(source=TableLayout(**(base | layout)), labels=labels)


def _read(folder: Path, manifest: DataManifest, image_size: int | None = None) -> tuple[ClientRows | None, list, Problems]:
    source = open_source(str(folder))
    before = sorted((p.name, p.stat().st_size) for p in folder.rglob("*"))
    problems = Problems()
    rows, used = read_table(source, source.list(), manifest, image_size, problems)
    assert sorted((p.name, p.stat().st_size) for p in folder.rglob("*")) == before  # the reader writes nothing
    return rows, used, problems


def _only_error(problems: Problems, kind: str) -> str:
    """The one error found, as "<where>: <what>", after checking its kind."""
    assert len(problems.errors) == 1, [str(p) for p in problems.errors]
    assert problems.errors[0].kind == kind
    return str(problems.errors[0])


# --- the breast cancer table -----------------------------------------------------------------------


def _check_cancer(rows: ClientRows | None, problems: Problems) -> None:
    assert problems.found == []
    assert rows is not None
    assert rows.x.dtype == np.float32 and rows.x.shape == (569, 30)
    np.testing.assert_array_equal(rows.x, CANCER.data.astype(np.float32))
    assert rows.y.dtype == np.int64
    np.testing.assert_array_equal(rows.y, CANCER.target)
    assert rows.client_names == ("east", "north", "south", "west")  # sorted
    assert rows.clients.dtype == np.int64
    np.testing.assert_array_equal(np.asarray(rows.client_names)[rows.clients], BRANCHES)
    assert rows.vocab_size is None


@pytest.mark.parametrize("batch_rows", [tables.BATCH_ROWS, 50])
def test_parquet_table_reads_features_labels_and_clients(tmp_path, monkeypatch, batch_rows):
    monkeypatch.setattr(tables, "BATCH_ROWS", batch_rows)  # 50: many batches, row groups of 100 across them
    pq.write_table(_cancer_table(), tmp_path / "cancer.parquet", row_group_size=100)
    rows, used, problems = _read(tmp_path, _manifest())
    _check_cancer(rows, problems)
    assert [o.key for o in used] == ["cancer.parquet"]
    assert rows.where(0) == f"{tmp_path / 'cancer.parquet'} row 1"
    assert rows.where(568) == f"{tmp_path / 'cancer.parquet'} row 569"


def test_csv_tables_in_two_files_with_integer_labels(tmp_path, monkeypatch):
    monkeypatch.setattr(tables, "CSV_BLOCK_BYTES", 16_384)  # many streamed blocks per file
    pcsv.write_csv(_cancer_table(slice(0, 300), label_names=False), tmp_path / "a.csv")
    pcsv.write_csv(_cancer_table(slice(300, None), label_names=False), tmp_path / "b.csv")
    rows, used, problems = _read(tmp_path, _manifest())  # 0/1 are indices into the names
    _check_cancer(rows, problems)
    assert [o.key for o in used] == ["a.csv", "b.csv"]
    assert rows.where(299) == f"{tmp_path / 'a.csv'} row 300"
    assert rows.where(300) == f"{tmp_path / 'b.csv'} row 1"


def test_named_files_only_are_read(tmp_path):
    pq.write_table(_cancer_table(), tmp_path / "cancer.parquet")
    pq.write_table(_cancer_table(slice(0, 5)), tmp_path / "other.parquet")
    rows, used, problems = _read(tmp_path, _manifest(files=("cancer.parquet",)))
    _check_cancer(rows, problems)
    assert [o.key for o in used] == ["cancer.parquet"]


def test_labels_that_are_integers_match_by_name_not_by_position(tmp_path):
    table = pa.table({"site": ["a", "b", "a"], "y": [1, 2, 0], "f": [0.5, 1.5, 2.5]})
    pq.write_table(table, tmp_path / "t.parquet")
    manifest = DataManifest(source=TableLayout(client_column="site", label_column="y", features=("f",)),
                            labels=("2", "1"))
    rows, _, problems = _read(tmp_path, manifest)
    assert rows is None
    assert _only_error(problems, "unknown label").startswith(f"{tmp_path / 't.parquet'} row 3: label '0'")
    pq.write_table(table.slice(0, 2), tmp_path / "t.parquet")
    rows, _, problems = _read(tmp_path, manifest)
    assert problems.found == [] and rows is not None
    np.testing.assert_array_equal(rows.y, [1, 0])  # "1" is labels[1], "2" is labels[0]


# --- proposing a manifest --------------------------------------------------------------------------


def test_infer_proposes_the_columns_and_labels(tmp_path):
    pq.write_table(_cancer_table(), tmp_path / "cancer.parquet")
    source = open_source(str(tmp_path))
    with pytest.raises(DataError, match="--label-column"):  # "diagnosis" is no usual label column name
        infer_table_manifest(source, source.list())
    manifest = infer_table_manifest(source, source.list(), label_column="diagnosis")
    layout = manifest.source
    assert (layout.client_column, layout.label_column) == ("branch", "diagnosis")
    assert layout.features == FEATURES and layout.image_column is None and layout.text_column is None
    assert manifest.labels == ("benign", "malignant")  # sorted names
    rows, _, problems = _read(tmp_path, manifest)
    assert problems.found == [] and rows is not None
    np.testing.assert_array_equal(rows.y, 1 - CANCER.target)  # the proposed order reads back consistently


def test_infer_sorts_integer_labels_numerically_over_every_file(tmp_path):
    pcsv.write_csv(pa.table({"Hospital": ["h1"] * 3, "Target": [0, 2, 10], "age": [1.0, 2.0, 3.0]}), tmp_path / "a.csv")
    pcsv.write_csv(pa.table({"Hospital": ["h2"] * 2, "Target": [1, 11], "age": [4.0, 5.0]}), tmp_path / "b.csv")
    source = open_source(str(tmp_path))
    manifest = infer_table_manifest(source, source.list())
    assert manifest.labels == ("0", "1", "2", "10", "11")  # b.csv's labels too; 10 after 2
    assert (manifest.source.client_column, manifest.source.label_column) == ("Hospital", "Target")
    assert manifest.source.features == ("age",)


def test_infer_asks_for_columns_it_cannot_tell(tmp_path):
    pq.write_table(pa.table({"place": ["a", "b"], "outcome": ["x", "y"], "f": [1.0, 2.0]}), tmp_path / "t.parquet")
    source = open_source(str(tmp_path))
    with pytest.raises(DataError, match="--client-column"):
        infer_table_manifest(source, source.list())
    with pytest.raises(DataError, match="--label-column"):
        infer_table_manifest(source, source.list(), client_column="place")
    manifest = infer_table_manifest(source, source.list(), client_column="place", label_column="outcome")
    assert manifest.source.features == ("f",) and manifest.labels == ("x", "y")
    with pytest.raises(DataError, match="no column 'nope'"):
        infer_table_manifest(source, source.list(), client_column="nope", label_column="outcome")


def test_infer_finds_image_and_text_columns(tmp_path):
    pq.write_table(pa.table({"user": ["a", "b"], "label": ["x", "y"], "picture": ["i/1.png", "i/2.JPG"],
                             "n": [1, 2]}), tmp_path / "t.parquet")
    source = open_source(str(tmp_path))
    assert infer_table_manifest(source, source.list()).source.image_column == "picture"
    pq.write_table(pa.table({"user": ["a", "b"], "label": ["x", "y"], "png": [b"\x89PNG", b"\x89PNG"]}),
                   tmp_path / "t.parquet")
    assert infer_table_manifest(source, source.list()).source.image_column == "png"
    pq.write_table(pa.table({"user": ["a", "b"], "label": ["x", "y"], "Review": ["good", "bad"], "n": [1, 2]}),
                   tmp_path / "t.parquet")
    layout = infer_table_manifest(source, source.list()).source
    assert layout.text_column == "Review" and layout.features == ()


# --- images and text -------------------------------------------------------------------------------


def _png(image: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image.transpose(1, 2, 0)).save(out, format="PNG")
    return out.getvalue()


IMAGES = np.random.default_rng(0).integers(0, 256, size=(6, 3, 4, 5), dtype=np.uint8)


def test_image_bytes_column(tmp_path):
    table = pa.table({"client": ["a", "b", "a", "b", "c", "c"], "label": ["cat", "dog"] * 3,
                      "image": pa.array([_png(x) for x in IMAGES], pa.binary())})
    pq.write_table(table, tmp_path / "t.parquet")
    rows, used, problems = _read(tmp_path, _manifest(client_column="client", label_column="label",
                                                     image_column="image", labels=("cat", "dog")))
    assert problems.found == [] and rows is not None
    assert rows.x.dtype == np.uint8 and rows.x.shape == (6, 3, 4, 5)
    np.testing.assert_array_equal(rows.x, IMAGES)
    np.testing.assert_array_equal(rows.y, [0, 1] * 3)
    assert rows.client_names == ("a", "b", "c")
    np.testing.assert_array_equal(rows.clients, [0, 1, 0, 1, 2, 2])
    assert [o.key for o in used] == ["t.parquet"]


def _image_paths(tmp_path: Path, paths: list[str]) -> DataManifest:
    (tmp_path / "img").mkdir()
    for i, x in enumerate(IMAGES):
        (tmp_path / "img" / f"{i}.png").write_bytes(_png(x))
    pcsv.write_csv(pa.table({"client": ["a", "b"] * 3, "label": [0, 1, 1, 0, 0, 1], "path": paths}), tmp_path / "t.csv")
    return _manifest(client_column="client", label_column="label", image_column="path", channels=1,
                     labels=("cat", "dog"))


def test_image_path_column(tmp_path):
    manifest = _image_paths(tmp_path, [f"img/{i}.png" for i in range(6)])
    rows, used, problems = _read(tmp_path, manifest)
    assert problems.found == [] and rows is not None
    gray = np.stack([np.asarray(Image.fromarray(x.transpose(1, 2, 0)).convert("L"))[None] for x in IMAGES])
    assert rows.x.shape == (6, 1, 4, 5)
    np.testing.assert_array_equal(rows.x, gray)
    np.testing.assert_array_equal(rows.y, [0, 1, 1, 0, 0, 1])
    assert [o.key for o in used] == ["t.csv"] + [f"img/{i}.png" for i in range(6)]
    rows, _, _ = _read(tmp_path, manifest, image_size=8)
    assert rows is not None and rows.x.shape == (6, 1, 8, 8)


def test_missing_image_path_is_an_error_naming_row_and_path(tmp_path):
    manifest = _image_paths(tmp_path, [f"img/{i}.png" for i in range(5)] + ["img/gone.png"])
    rows, _, problems = _read(tmp_path, manifest)
    assert rows is None
    message = _only_error(problems, "missing image")
    assert message.startswith(f"{tmp_path / 't.csv'} row 6: image 'img/gone.png' is not a file under the source")


def test_text_column(tmp_path):
    texts = ["The cat sat on the mat.", "Dogs bark; cats don't!", "A mat, a cat, a hat.", "Stocks fell 3% today"]
    pq.write_table(pa.table({"writer": ["w1", "w2", "w1", "w3"], "topic": ["pets", "pets", "pets", "money"],
                             "text": texts}), tmp_path / "t.parquet")
    rows, _, problems = _read(tmp_path, _manifest(client_column="writer", label_column="topic", text_column="text",
                                                  labels=("money", "pets")))
    assert problems.found == [] and rows is not None
    words = [tokenize(t) for t in texts]
    expected = encode(words, build_vocabulary(words, AGNEWS_VOCAB_SIZE), AGNEWS_MAX_LENGTH)
    assert rows.x.dtype == np.int64 and rows.x.shape == (4, AGNEWS_MAX_LENGTH)
    np.testing.assert_array_equal(rows.x, expected)
    assert rows.vocab_size == AGNEWS_VOCAB_SIZE
    assert rows.x[0, 1] == rows.x[2, 3] != 1  # "cat" has one id in every row, and is in the vocabulary
    np.testing.assert_array_equal(rows.y, [1, 1, 1, 0])
    np.testing.assert_array_equal(rows.clients, [0, 1, 0, 2])


# --- bad tables: each an error naming its file and row ---------------------------------------------


def test_nan_features_are_errors_naming_file_row_and_column(tmp_path):
    table = _cancer_table()
    area = FEATURES.index("mean area") + 1
    values = CANCER.data[:, area - 1].copy()
    values[[10, 400]] = np.nan
    values[20] = np.inf
    pq.write_table(table.set_column(area, "mean area", pa.array(values)), tmp_path / "t.parquet")
    rows, _, problems = _read(tmp_path, _manifest())
    assert rows is None
    assert [p.kind for p in problems.found] == ["bad feature value"] * 3
    url = tmp_path / "t.parquet"
    assert [p.where for p in problems.found] == [f"{url} row 11", f"{url} row 21", f"{url} row 401"]
    assert "feature 'mean area' is nan, not a finite float32" in problems.found[0].what
    assert "feature 'mean area' is inf" in problems.found[1].what
    with pytest.raises(DataError, match=r"t\.parquet row 401: feature 'mean area'"):
        problems.raise_if_errors(str(tmp_path))


def test_missing_and_out_of_range_features_are_errors(tmp_path):
    pq.write_table(pa.table({"branch": ["a", "b", "a"], "diagnosis": ["benign"] * 3,
                             "f": pa.array([1.0, None, 2.0]), "g": pa.array([1e300, 0.0, 1.0])}), tmp_path / "t.parquet")
    rows, _, problems = _read(tmp_path, _manifest(features=("f", "g")))
    assert rows is None
    url = tmp_path / "t.parquet"
    assert [str(p).split(" (rows")[0] for p in problems.errors] == [
        f"{url} row 1: feature 'g' is 1e+300, not a finite float32", f"{url} row 2: feature 'f' is missing"]


def test_text_in_a_numeric_csv_column_is_an_error_naming_the_row(tmp_path, monkeypatch):
    monkeypatch.setattr(tables, "CSV_BLOCK_BYTES", 16_384)  # the bad value far from the first block
    pcsv.write_csv(_cancer_table(label_names=False), tmp_path / "t.csv")
    lines = (tmp_path / "t.csv").read_text().splitlines()
    cells = lines[501].split(",")
    cells[1 + FEATURES.index("worst area")] = "n/a"
    lines[501] = ",".join(cells)
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    rows, _, problems = _read(tmp_path, _manifest())
    assert rows is None
    message = _only_error(problems, "not a number")
    assert message.startswith(f"{tmp_path / 't.csv'} row 501: column 'worst area' holds 'n/a', not a number")
    assert "header line is not counted" in message


def test_a_non_numeric_feature_type_is_an_error_naming_the_column(tmp_path):
    pq.write_table(pa.table({"branch": ["a"], "diagnosis": ["benign"], "f": pa.array([[1.0]])}), tmp_path / "t.parquet")
    rows, _, problems = _read(tmp_path, _manifest(features=("f",)))
    assert rows is None
    assert _only_error(problems, "wrong column type").startswith(f"{tmp_path / 't.parquet'}: column 'f' has type list")


def test_unknown_and_missing_labels_are_errors_naming_the_row(tmp_path):
    labels = np.asarray(CLASS_NAMES, dtype=object)[CANCER.target]
    labels[7], labels[300] = "maybe", None
    pq.write_table(_cancer_table().set_column(31, "diagnosis", pa.array(labels, pa.string())), tmp_path / "t.parquet")
    rows, _, problems = _read(tmp_path, _manifest())
    assert rows is None
    url = tmp_path / "t.parquet"
    assert [(p.kind, p.where) for p in problems.errors] == [("missing label", f"{url} row 301"),
                                                           ("unknown label", f"{url} row 8")]
    assert "label 'maybe' is not a label of the manifest; the manifest's labels are 'malignant', 'benign'" \
        in problems.errors[1].what
    assert "label column 'diagnosis' is empty" in problems.errors[0].what


def test_a_label_index_out_of_range_is_unknown(tmp_path):
    target = CANCER.target.copy()
    target[3] = 2
    pq.write_table(_cancer_table().set_column(31, "diagnosis", pa.array(target)), tmp_path / "t.parquet")
    rows, _, problems = _read(tmp_path, _manifest())
    assert rows is None
    assert _only_error(problems, "unknown label").startswith(f"{tmp_path / 't.parquet'} row 4: label '2'")


def test_a_missing_client_is_an_error(tmp_path):
    branches = BRANCHES.astype(object)
    branches[5] = None
    pq.write_table(_cancer_table().set_column(0, "branch", pa.array(branches, pa.string())), tmp_path / "t.parquet")
    rows, _, problems = _read(tmp_path, _manifest())
    assert rows is None
    assert _only_error(problems, "missing client").startswith(f"{tmp_path / 't.parquet'} row 6:")


def test_a_missing_column_names_the_file_and_its_columns(tmp_path):
    pq.write_table(_cancer_table(), tmp_path / "a.parquet")
    pq.write_table(_cancer_table().drop(["mean radius"]), tmp_path / "b.parquet")
    rows, _, problems = _read(tmp_path, _manifest())
    assert rows is None
    message = _only_error(problems, "missing column")
    assert message.startswith(f"{tmp_path / 'b.parquet'}: no column 'mean radius' (the manifest names it); "
                              "the file has 'branch', 'mean texture',")


def test_a_named_file_that_is_missing_is_an_error(tmp_path):
    pq.write_table(_cancer_table(), tmp_path / "a.parquet")
    rows, _, problems = _read(tmp_path, _manifest(files=("a.parquet", "gone.csv")))
    assert rows is None
    assert _only_error(problems, "missing table").startswith(f"{tmp_path / 'gone.csv'}: the manifest's `files` names it")


def test_an_unreadable_table_is_an_error_naming_it(tmp_path):
    (tmp_path / "t.parquet").write_bytes(b"not parquet at all")
    rows, _, problems = _read(tmp_path, _manifest())
    assert rows is None
    assert _only_error(problems, "unreadable table").startswith(f"{tmp_path / 't.parquet'}: not a readable parquet file")


def test_row_problems_are_counted_past_the_listed_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(tables, "MAX_ROW_PROBLEMS", 3)
    pq.write_table(_cancer_table().set_column(31, "diagnosis", pa.array(["maybe"] * 569)), tmp_path / "t.parquet")
    _, _, problems = _read(tmp_path, _manifest())
    assert [p.where for p in problems.errors] == [f"{tmp_path / 't.parquet'} row {i}" for i in (1, 2, 3)] + \
        [str(tmp_path / "t.parquet")]
    assert problems.errors[-1].what == "566 more rows like the ones above (569 in all)"


def test_csv_values_are_read_as_written_whatever_their_look(tmp_path):
    (tmp_path / "t.csv").write_text("site,label,f\n2024-01-02,1,1.5\n2024-01-01,0, 2\n2024-01-02,1,1e-3\n")
    manifest = DataManifest(source=TableLayout(client_column="site", label_column="label", features=("f",)),
                            labels=("no", "yes"))
    rows, _, problems = _read(tmp_path, manifest)
    assert problems.found == [] and rows is not None
    assert rows.client_names == ("2024-01-01", "2024-01-02")  # dates stay the text they are
    np.testing.assert_array_equal(rows.clients, [1, 0, 1])
    np.testing.assert_array_equal(rows.y, [1, 0, 1])
    np.testing.assert_array_equal(rows.x, np.asarray([[1.5], [2.0], [1e-3]], dtype=np.float32))
