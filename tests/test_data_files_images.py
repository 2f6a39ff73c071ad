"""A user's own federated images (`data.dataset: files`, layout image_folders): scikit-learn's digits
written as PNG files into `<client>/<label>/<n>.png` folders, read from a folder and from an S3 server,
with their manifest from `fedpipe data init`; the snapshot; `latest`; and every kind of bad file refused
with an error naming it."""

from __future__ import annotations

import io
import logging
import re
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedpipe.data.files import check_files, load_files, read_manifest
from fedpipe.data.files.images import MAX_IMAGE_BYTES
from fedpipe.data.files.init import init_manifest, write_manifest
from fedpipe.data.files.manifest import MANIFEST_NAME
from fedpipe.errors import DataError, FedpipeError
from fedpipe.store import source as source_module
from fedpipe.store.source import FolderSource, SourceObject, open_source

# Each client holds a different mix of labels (the natural partition); together they hold all ten.
CLIENTS = {"hospital-a": (0, 1, 2, 3, 4), "hospital-b": (3, 4, 5, 6, 7, 8, 9), "hospital-c": (0, 2, 4, 6, 8),
           "hospital-d": (1, 5, 9)}
PER_LABEL = 4


def png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return np.round(d.images * (255 / 16)).astype(np.uint8), d.target.astype(np.int64)


def write_digits(root: Path, clients: dict[str, tuple[int, ...]] = CLIENTS) -> dict[str, tuple[np.ndarray, int, str]]:
    """The digits as `<root>/<client>/<label>/<n>.png` (8x8 grayscale), each image used once; returns
    {key: (image, label, client)}."""
    images, labels = digits()
    unused = {c: list(np.flatnonzero(labels == c)) for c in range(10)}
    written = {}
    for client, held in clients.items():
        for label in held:
            for n in range(PER_LABEL):
                image = images[unused[label].pop()]
                key = f"{client}/{label}/{n:03d}.png"
                (root / key).parent.mkdir(parents=True, exist_ok=True)
                (root / key).write_bytes(png(image))
                written[key] = (image, label, client)
    return written


def with_manifest(root: Path) -> None:
    manifest, _ = init_manifest(str(root))
    write_manifest(str(root), manifest)


def files_under(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder` with its size and modification time: what a write would change."""
    return {str(p): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in folder.rglob("*")}


def bomb_png(side: int) -> bytes:
    """A valid PNG of side x side black grayscale pixels: a small file whose header claims `side**2` pixels."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    packer = zlib.compressobj(9)
    row = b"\0" * (side + 1)  # filter byte + pixels
    idat = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()
    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)  # 8-bit grayscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


@pytest.fixture
def data_root(tmp_path: Path) -> tuple[Path, dict]:
    root = tmp_path / "data"
    written = write_digits(root)
    return root, written


def test_init_proposes_the_layout_and_writes_a_commented_manifest(data_root):
    root, _ = data_root
    manifest, where = init_manifest(str(root))
    assert where == str(root / MANIFEST_NAME)
    assert manifest.source.layout == "image_folders"
    assert manifest.source.channels == 1  # every digit is grayscale
    assert manifest.labels == tuple(str(i) for i in range(10))
    assert not (root / MANIFEST_NAME).exists()  # init only proposes

    assert write_manifest(str(root), manifest) == str(root / MANIFEST_NAME)
    text = (root / MANIFEST_NAME).read_text()
    assert text.startswith(f"# {MANIFEST_NAME}")
    for field in ("#   layout:", "#   channels:", "# labels:"):
        assert field in text  # a comment explains each field of the layout written
    source = FolderSource(root)
    assert read_manifest(source, source.list()) == manifest

    with pytest.raises(DataError, match="already exists"):
        write_manifest(str(root), manifest)
    (root / MANIFEST_NAME).write_text("# edited\n" + text)
    write_manifest(str(root), manifest, force=True)
    assert (root / MANIFEST_NAME).read_text() == text


def test_init_orders_integer_labels_numerically_and_sees_colour(tmp_path):
    rng = np.random.default_rng(0)
    for label in ("1", "2", "10"):
        for client in ("x", "y"):
            path = tmp_path / client / label / "a.png"
            path.parent.mkdir(parents=True)
            path.write_bytes(png(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)))
    manifest, _ = init_manifest(str(tmp_path))
    assert manifest.labels == ("1", "2", "10")  # not the string order ("1", "10", "2")
    assert manifest.source.channels == 3


def test_init_says_when_no_layout_fits(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(DataError, match="<client>/<label>/<image>"):
        init_manifest(str(tmp_path))


def test_folder_loads_as_the_folders_say(data_root):
    root, written = data_root
    with_manifest(root)
    bundle = load_files(str(root))
    keys = sorted(written)
    assert bundle.train.x.dtype == np.uint8 and bundle.train.x.shape == (len(keys), 1, 8, 8)
    np.testing.assert_array_equal(bundle.train.x[:, 0], np.stack([written[k][0] for k in keys]))
    np.testing.assert_array_equal(bundle.train.y, [written[k][1] for k in keys])
    assert bundle.client_names == tuple(sorted(CLIENTS))
    np.testing.assert_array_equal(bundle.clients, [bundle.client_names.index(written[k][2]) for k in keys])
    assert bundle.num_classes == 10 and bundle.class_names == tuple(str(i) for i in range(10))
    for client, held in CLIENTS.items():  # each client's label mix, as its folders hold it
        assert set(bundle.train.y[bundle.clients == bundle.client_names.index(client)]) == set(held)
    assert bundle.snapshot["source"] == str(root) and bundle.snapshot["objects"] == len(keys) + 1  # + the manifest


def test_snapshot_is_stable_and_changes_with_one_file(data_root):
    root, written = data_root
    with_manifest(root)
    first = load_files(str(root)).snapshot
    assert load_files(str(root)).snapshot == first
    again = load_files(str(root), expected_snapshot=first["digest"])  # the same data resumes the same run
    assert again.snapshot["digest"] == first["digest"]

    key = sorted(written)[5]
    (root / key).write_bytes(png(255 - written[key][0]))
    changed = load_files(str(root)).snapshot
    assert changed["digest"] != first["digest"]
    with pytest.raises(DataError, match="changed since this run recorded it"):
        load_files(str(root), expected_snapshot=first["digest"])


def test_image_size_resizes_every_image(data_root):
    root, written = data_root
    with_manifest(root)
    bundle = load_files(str(root), image_size=16)
    first = written[sorted(written)[0]][0]
    assert bundle.train.x.shape == (len(written), 1, 16, 16) and bundle.train.x.dtype == np.uint8
    expected = np.asarray(Image.fromarray(first).resize((16, 16), Image.Resampling.BILINEAR))
    np.testing.assert_array_equal(bundle.train.x[0, 0], expected)


def test_files_that_are_not_images_are_skipped_with_a_warning(data_root):
    root, written = data_root
    with_manifest(root)
    (root / "README.md").write_text("our data")
    (root / "hospital-a" / "notes.txt").write_text("notes")
    (root / "hospital-a" / "0" / "scan.dcm").write_bytes(b"DICM")
    check = check_files(str(root))
    assert not check.problems.errors
    assert sorted(p.where for p in check.problems.warnings) == sorted(
        str(root / k) for k in ("README.md", "hospital-a/notes.txt", "hospital-a/0/scan.dcm"))
    assert {p.kind for p in check.problems.warnings} == {"not an image"}
    assert len(check.rows.y) == len(written)


def _truncated(root: Path) -> Path:
    path = root / "hospital-b" / "5" / "001.png"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 30])  # cut inside the image data
    return path


def _text(root: Path) -> Path:
    path = root / "hospital-c" / "2" / "notes.png"
    path.write_bytes(b"these are my notes, not an image\n")
    return path


def _gif(root: Path) -> Path:
    path = root / "hospital-a" / "1" / "anim.png"
    buf = io.BytesIO()
    Image.new("L", (8, 8), 3).save(buf, format="GIF")
    path.write_bytes(buf.getvalue())
    return path


def _unknown_label(root: Path) -> Path:
    folder = root / "hospital-a" / "cat"
    folder.mkdir()
    (folder / "000.png").write_bytes(png(np.zeros((8, 8), np.uint8)))
    return folder


def _other_size(root: Path) -> Path:
    path = root / "hospital-d" / "9" / "zzz.png"  # read last: the others fixed the size at 8x8
    path.write_bytes(png(np.full((10, 12), 7, np.uint8)))
    return path


def _bomb(root: Path) -> Path:
    path = root / "hospital-b" / "3" / "bomb.png"
    data = bomb_png(10_000)  # 100 megapixels; 100 MB decoded
    assert len(data) < 2**20  # ...from a file of about 100 kB
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(("make_bad", "kind", "says"), [
    (_truncated, "unreadable image", "unreadable or truncated image"),
    (_text, "not a PNG or JPEG", "not a PNG or JPEG"),
    (_gif, "not a PNG or JPEG", "not a PNG or JPEG"),
    (_unknown_label, "unknown label", "'cat' .* is not one of the manifest's labels"),
    (_other_size, "differing image sizes", r"in 2 sizes: 8x8: \d+ \(the first: .*\); 12x10: 1 .* Set data.image_size=8"),
    (_bomb, "image too large", "claims 10000x10000 pixels"),
])
def test_a_bad_file_is_an_error_naming_it_and_nothing_is_written(data_root, make_bad, kind, says):
    root, _ = data_root
    with_manifest(root)
    bad = make_bad(root)
    before = files_under(root.parent)
    with pytest.raises(DataError) as raised:
        load_files(str(root))
    message = str(raised.value)
    assert str(bad) in message and "nothing was written" in message
    assert re.search(says, message)
    check = check_files(str(root))
    assert [(p.kind, p.where) for p in check.problems.errors] == [(kind, str(bad))]  # that file, and only it
    assert files_under(root.parent) == before


def test_differing_sizes_load_when_image_size_is_set(data_root):
    root, written = data_root
    with_manifest(root)
    _other_size(root)
    bundle = load_files(str(root), image_size=8)
    assert bundle.train.x.shape == (len(written) + 1, 1, 8, 8)


def test_a_missing_manifest_says_to_run_data_init(data_root):
    root, _ = data_root
    with pytest.raises(DataError, match=f"no {MANIFEST_NAME}.*`fedpipe data init {root}`"):
        load_files(str(root))


def test_a_folder_lists_only_files_inside_it(data_root, tmp_path):
    root, written = data_root
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.png").write_bytes(png(np.ones((8, 8), np.uint8)))
    (root / "hospital-a" / "0" / "link.png").symlink_to(outside / "secret.png")
    (root / "hospital-e").symlink_to(outside, target_is_directory=True)  # a linked folder leaving the root
    (root / "hospital-a" / "0" / "inside.png").symlink_to(root / "hospital-a" / "0" / "000.png")
    (root / ".DS_Store").write_bytes(b"x")
    (root / "hospital-b" / ".cache").mkdir()
    (root / "hospital-b" / ".cache" / "0.png").write_bytes(png(np.ones((8, 8), np.uint8)))

    source = FolderSource(root)
    keys = [o.key for o in source.list()]
    assert keys == sorted([*written, "hospital-a/0/inside.png"])  # no link out, no hidden name
    forged = SourceObject("hospital-a/0/link.png", 64, "0" * 64)
    with pytest.raises(DataError, match="leads out of the data folder"):
        source.read(forged, MAX_IMAGE_BYTES)
    with pytest.raises(DataError, match="not a path inside"):
        source.read(SourceObject("../outside/secret.png", 64, "0" * 64), MAX_IMAGE_BYTES)


def test_a_file_changed_since_listed_or_too_large_is_refused(data_root):
    root, written = data_root
    source = FolderSource(root)
    obj = next(o for o in source.list() if o.key == sorted(written)[0])
    assert source.read(obj, MAX_IMAGE_BYTES) == (root / obj.key).read_bytes()
    with pytest.raises(DataError, match=f"{root / obj.key} is {obj.size:,} bytes, more than the {obj.size - 1:,}"):
        source.read(obj, obj.size - 1)
    (root / obj.key).write_bytes(png(255 - written[obj.key][0]))
    with pytest.raises(DataError, match="changed since it was listed"):
        source.read(obj, MAX_IMAGE_BYTES)


def test_listing_is_bounded(data_root, monkeypatch):
    root, _ = data_root
    monkeypatch.setattr(source_module, "MAX_SOURCE_OBJECTS", 5)
    with pytest.raises(DataError, match="more than 5 files"):
        FolderSource(root).list()


def test_latest_is_the_newest_sub_folder_by_name(tmp_path, caplog):
    drops = tmp_path / "drops"
    write_digits(drops / "2026-01-05")
    newer = {c: CLIENTS[c] for c in ("hospital-a", "hospital-c")}
    write_digits(drops / "2026-02-01", newer)
    (drops / "zz-notes.txt").write_text("a file sorts last but is no folder")
    (drops / ".staging").mkdir()
    with_manifest(drops / "2026-02-01")
    with caplog.at_level(logging.INFO, logger="fedpipe.store.source"):
        source = open_source(str(drops / "latest"))
    assert source.url() == str(drops / "2026-02-01")
    assert "2026-02-01" in caplog.text
    bundle = load_files(str(drops / "latest"))
    assert bundle.client_names == ("hospital-a", "hospital-c")
    assert bundle.snapshot["source"] == str(drops / "2026-02-01")  # the run records the drop it read

    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="has no sub-folder named as a drop"):
        open_source(str(tmp_path / "empty" / "latest"))
    with pytest.raises(DataError, match=f"{tmp_path / 'missing'} does not exist"):
        open_source(str(tmp_path / "missing"))


def test_credentials_in_a_source_url_are_refused():
    with pytest.raises(DataError, match="user name or password") as raised:
        open_source("s3://key:hunter2@bucket/data")
    assert "hunter2" not in str(raised.value)


def test_s3_needs_the_endpoint_and_credentials_from_the_environment(monkeypatch):
    for name in ("FEDPIPE_S3_ENDPOINT", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(DataError, match="data source s3://bucket/data.*FEDPIPE_S3_ENDPOINT.*AWS_ACCESS_KEY_ID"):
        open_source("s3://bucket/data")


def test_an_unreachable_s3_endpoint_names_it_and_what_to_set(monkeypatch, port_factory):
    endpoint = f"http://127.0.0.1:{port_factory()}"  # nothing listens there
    monkeypatch.setenv("FEDPIPE_S3_ENDPOINT", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    monkeypatch.setenv("FEDPIPE_S3_RETRY_SECONDS", "0")
    with pytest.raises(FedpipeError, match=f"Could not reach the S3 / MinIO server at {endpoint}.*FEDPIPE_S3_ENDPOINT"):
        open_source("s3://bucket/data")


def upload(raw_client, folder: Path, bucket: str, prefix: str) -> None:
    """Put every file under `folder` at s3://bucket/prefix/<relative path>, as another tool would."""
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = path.read_bytes()
        raw_client.put_object(bucket, f"{prefix}/{path.relative_to(folder).as_posix()}", io.BytesIO(data), len(data))


@pytest.mark.services
def test_s3_gives_the_same_arrays_as_the_folder(data_root, raw_client):
    """The same files on an S3 server. The server is moto's S3 emulator (over HTTP, through the minio
    client), not MinIO or AWS: it speaks the same API, ETags included."""
    root, _ = data_root
    raw_client.make_bucket("fed-data")
    upload(raw_client, root, "fed-data", "drops/2026-01-05")
    url = "s3://fed-data/drops/2026-01-05"
    manifest, where = init_manifest(url)
    assert where == f"{url}/{MANIFEST_NAME}" and manifest.source.channels == 1
    assert write_manifest(url, manifest) == where
    with pytest.raises(DataError, match="already exists"):
        write_manifest(url, manifest)
    write_manifest(str(root), manifest)

    local, remote = load_files(str(root)), load_files(url)
    for a, b in ((local.train.x, remote.train.x), (local.train.y, remote.train.y), (local.clients, remote.clients)):
        np.testing.assert_array_equal(a, b)
    assert remote.client_names == local.client_names and remote.snapshot["source"] == url
    assert remote.snapshot["objects"] == local.snapshot["objects"]
    assert load_files(url).snapshot == remote.snapshot

    # a newer drop, and `latest` picks it
    newer = root.parent / "newer"
    write_digits(newer, {"hospital-b": CLIENTS["hospital-b"]})
    shutil.copy(root / MANIFEST_NAME, newer / MANIFEST_NAME)
    upload(raw_client, newer, "fed-data", "drops/2026-02-01")
    raw_client.put_object("fed-data", "drops/2026-02-01/_SUCCESS", io.BytesIO(b""), 0)  # the upload is complete
    assert open_source("s3://fed-data/drops/latest").url() == "s3://fed-data/drops/2026-02-01"
    bundle = load_files("s3://fed-data/drops/latest")
    assert bundle.client_names == ("hospital-b",) and bundle.snapshot["source"] == "s3://fed-data/drops/2026-02-01"

    with pytest.raises(DataError, match="Nothing is stored under s3://fed-data/drops/2027"):
        open_source("s3://fed-data/drops/2027")
    with pytest.raises(DataError, match="bucket 'no-such-bucket' does not exist"):
        open_source("s3://no-such-bucket/data")


@pytest.mark.services
def test_s3_refuses_an_object_changed_since_listed(data_root, raw_client):
    root, written = data_root
    raw_client.make_bucket("fed-change")
    upload(raw_client, root, "fed-change", "d")
    source = open_source("s3://fed-change/d")
    obj = next(o for o in source.list() if o.key == sorted(written)[0])
    assert source.read(obj, MAX_IMAGE_BYTES) == (root / obj.key).read_bytes()
    with pytest.raises(DataError, match=f"s3://fed-change/d/{obj.key} is {obj.size:,} bytes, more than"):
        source.read(obj, obj.size - 1)
    data = png(255 - written[obj.key][0])
    raw_client.put_object("fed-change", f"d/{obj.key}", io.BytesIO(data), len(data))
    with pytest.raises(DataError, match=f"s3://fed-change/d/{obj.key} changed since it was listed"):
        source.read(obj, MAX_IMAGE_BYTES)
