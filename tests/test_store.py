"""LocalStore: plain files with sha256 sidecars, atomic writes, corruption detection; open_store."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import pytest

from fedpipe.errors import CorruptArtifactError, StoreError
from fedpipe.store import LocalStore, S3Store, Store, open_store, validate_key
from fedpipe.store import folder as local_mod
from fedpipe.store.folder import LOCK_NAME


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


def all_files(root: Path) -> list[str]:
    """Every file under `root` but the folders' lock files (`LOCK_NAME`, one per folder written)."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != LOCK_NAME)


def test_round_trip_is_a_plain_file_with_sidecar(store: LocalStore):
    data = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 10
    digest = store.put("run-1/report/accuracy.png", data)
    assert digest == hashlib.sha256(data).hexdigest()
    assert store.get("run-1/report/accuracy.png") == data

    path = store.root / "run-1" / "report" / "accuracy.png"
    assert path.read_bytes() == data  # users open it directly
    sidecar = path.parent / ".sha256" / "accuracy.png"  # hidden beside it
    assert sidecar.read_text() == f"{digest}  accuracy.png\n"  # sha256sum -c format
    assert store.exists("run-1/report/accuracy.png")
    assert store.url("run-1/report/accuracy.png") == str(path)
    assert store.url() == str(store.root)


def test_text_helpers_and_overwrite(store: LocalStore):
    store.put_text("a/b.json", '{"x": 1}')
    store.put_text("a/b.json", '{"x": 2}')
    assert store.get_text("a/b.json") == '{"x": 2}'
    assert all_files(store.root) == ["a/.sha256/b.json", "a/b.json"]


def test_empty_object(store: LocalStore):
    assert store.put("empty", b"") == hashlib.sha256(b"").hexdigest()
    assert store.get("empty") == b""


def test_list_hides_sidecars_and_temp_files(store: LocalStore):
    for key in ["r1/state/round-0002.pt", "r1/state/round-0001.pt", "r1/log.jsonl", "r2/x", "top"]:
        store.put(key, key.encode())
    (store.root / "r1" / "state" / ".fedpipe-tmp-deadbeef").write_bytes(b"junk")
    assert store.list() == ["r1/log.jsonl", "r1/state/round-0001.pt", "r1/state/round-0002.pt", "r2/x", "top"]
    assert store.list("r1/") == ["r1/log.jsonl", "r1/state/round-0001.pt", "r1/state/round-0002.pt"]
    assert store.list("r1/state/round-") == ["r1/state/round-0001.pt", "r1/state/round-0002.pt"]
    assert store.list("r") == ["r1/log.jsonl", "r1/state/round-0001.pt", "r1/state/round-0002.pt", "r2/x"]
    assert store.list("nothing/here/") == []


def test_delete_removes_data_and_sidecar(store: LocalStore):
    store.put("x/y", b"1")
    store.delete("x/y")
    assert not store.exists("x/y")
    assert store.list() == []
    assert all_files(store.root) == []
    store.delete("x/y")  # absent: no error
    store.delete("never/was")


def test_missing_key_is_store_error(store: LocalStore):
    with pytest.raises(StoreError, match="No artifact at") as info:
        store.get("nope/missing.pt")
    assert not isinstance(info.value, CorruptArtifactError)
    assert str(store.root / "nope" / "missing.pt") in str(info.value)
    assert not store.exists("nope/missing.pt")


def test_flipped_byte_is_detected(store: LocalStore):
    store.put("run/model.pt", b"A" * 1000)
    path = store.root / "run" / "model.pt"
    raw = bytearray(path.read_bytes())
    raw[500] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptArtifactError) as info:
        store.get("run/model.pt")
    msg = str(info.value)
    assert str(path) in msg
    assert "changed or truncated after it was written" in msg


def test_truncation_is_detected(store: LocalStore):
    store.put("run/model.pt", os.urandom(4096))
    path = store.root / "run" / "model.pt"
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CorruptArtifactError, match=r"model\.pt"):
        store.get("run/model.pt")


def test_missing_sidecar_is_corrupt(store: LocalStore):
    store.put("k", b"data")
    (store.root / ".sha256" / "k").unlink()
    with pytest.raises(CorruptArtifactError, match="no recorded sha256"):
        store.get("k")


def test_crash_before_any_rename_leaves_nothing(store: LocalStore, monkeypatch: pytest.MonkeyPatch):
    def crash(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(local_mod.os, "replace", crash)
    with pytest.raises(StoreError, match="No space left on device"):
        store.put("run/state/round-0001.pt", b"x" * 10_000)
    monkeypatch.undo()
    assert not store.exists("run/state/round-0001.pt")
    assert store.list() == []
    assert all_files(store.root) == []  # no temp file, no sidecar, no partial data


def test_crash_between_sidecar_and_data_rename(store: LocalStore, monkeypatch: pytest.MonkeyPatch):
    """The data rename fails after the sidecar is in place: a new key leaves nothing behind."""
    real_replace = os.replace
    calls = []

    def replace(src, dst):
        calls.append(Path(dst).relative_to(store.root).as_posix())
        if Path(dst).parent.name != ".sha256":
            raise KeyboardInterrupt  # any interruption, not only OSError
        real_replace(src, dst)

    monkeypatch.setattr(local_mod.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        store.put("run/new.pt", b"new")
    monkeypatch.undo()
    assert calls == ["run/.sha256/new.pt", "run/new.pt"]  # sidecar goes first
    assert not store.exists("run/new.pt")
    assert all_files(store.root) == []


def test_failed_overwrite_keeps_old_object_readable(store: LocalStore, monkeypatch: pytest.MonkeyPatch):
    store.put("run/model.pt", b"old version")
    real_replace = os.replace

    def replace(src, dst):
        if Path(dst).name == "model.pt" and Path(dst).parent.name != ".sha256":
            raise OSError(5, "Input/output error")
        real_replace(src, dst)

    monkeypatch.setattr(local_mod.os, "replace", replace)
    with pytest.raises(StoreError):
        store.put("run/model.pt", b"new version")
    monkeypatch.undo()
    assert store.get("run/model.pt") == b"old version"  # old hash was put back
    assert all_files(store.root) == ["run/.sha256/model.pt", "run/model.pt"]


def test_crash_while_writing_data_leaves_no_temp(store: LocalStore, monkeypatch: pytest.MonkeyPatch):
    real_fsync = os.fsync
    n = {"calls": 0}

    def fsync(fd):
        n["calls"] += 1
        if n["calls"] == 2:  # the data temp file (the sidecar's was the first)
            raise OSError(5, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(local_mod.os, "fsync", fsync)
    with pytest.raises(StoreError):
        store.put("k", b"payload")
    monkeypatch.undo()
    assert all_files(store.root) == []


@pytest.mark.parametrize(
    "key, why",
    [
        ("", "empty"),
        ("../escape", "'..'"),
        ("a/../../b", "'..'"),
        ("/etc/passwd", "absolute"),
        ("C:/Windows/x", "absolute"),
        ("a\\b", "backslash"),
        ("a//b", "empty or '.' part"),
        ("a/b/", "empty or '.' part"),
        ("./a", "empty or '.' part"),
        ("a/.sha256/x", "kept for the store"),
        ("d/.fedpipe-tmp-1", "kept for the store"),
        ("a\x00b", "control character"),
    ],
)
def test_bad_keys_are_rejected(store: LocalStore, key: str, why: str):
    with pytest.raises(StoreError, match=re.escape(why)):
        store.put(key, b"x")
    with pytest.raises(StoreError):
        store.get(key)
    with pytest.raises(StoreError):
        validate_key(key)
    assert all_files(store.root) == []


def test_non_string_key_rejected():
    with pytest.raises(StoreError, match="must be a string"):
        validate_key(None)


def test_bad_list_prefix(store: LocalStore):
    with pytest.raises(StoreError):
        store.list("../")
    with pytest.raises(StoreError):
        store.list("/abs")


def test_folder_in_the_way(store: LocalStore):
    store.put("a/b", b"1")
    with pytest.raises(StoreError, match="folder"):
        store.put("a", b"2")


def test_root_that_is_a_file(tmp_path: Path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(StoreError):
        LocalStore(f)


# -- open_store ------------------------------------------------------------------------------


def test_open_store_local_paths(tmp_path: Path):
    s = open_store(str(tmp_path / "a"))
    assert isinstance(s, LocalStore) and isinstance(s, Store)
    assert s.root == (tmp_path / "a").resolve()
    s2 = open_store(f"file://{tmp_path / 'b'}")
    assert isinstance(s2, LocalStore) and s2.root == (tmp_path / "b").resolve()
    s2.put("k", b"v")
    assert open_store((tmp_path / "b").as_uri()).get("k") == b"v"


@pytest.mark.parametrize("url", ["", "   ", "gs://bucket/x", "file://otherhost/x", "s3:///prefix"])
def test_open_store_rejects(url: str):
    with pytest.raises(StoreError):
        open_store(url)


def test_open_store_s3_needs_env(monkeypatch: pytest.MonkeyPatch):
    for name in ("FEDPIPE_S3_ENDPOINT", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "someone")
    with pytest.raises(StoreError) as info:
        open_store("s3://fedpipe-runs/exp1")
    msg = str(info.value)
    assert "FEDPIPE_S3_ENDPOINT" in msg and "AWS_SECRET_ACCESS_KEY" in msg
    assert "AWS_ACCESS_KEY_ID," not in msg.split("not set")[0]  # the set one is not named missing


def test_open_store_s3_from_env_without_network(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FEDPIPE_S3_ENDPOINT", "http://minio-service.kubeflow:9000")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "minio")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "minio123-secret")
    s = open_store("s3://mlpipeline/fedpipe/exp1/")
    assert isinstance(s, S3Store)
    assert (s.bucket, s.prefix, s.secure, s.endpoint) == (
        "mlpipeline",
        "fedpipe/exp1",
        False,
        "minio-service.kubeflow:9000",
    )
    assert s.url("r/a.pt") == "s3://mlpipeline/fedpipe/exp1/r/a.pt"
    assert "minio123-secret" not in repr(s)
    with pytest.raises(StoreError, match="absolute"):
        s.url("/r")


@pytest.mark.parametrize(
    "endpoint", ["ftp://host:21", "http://host:9000/path", "http://user:pw@host:9000", "host/x"]
)
def test_s3_bad_endpoint(endpoint: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FEDPIPE_S3_ENDPOINT", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    with pytest.raises(StoreError):
        open_store("s3://bucket/x")


def test_s3_bad_bucket_and_retry_env(monkeypatch: pytest.MonkeyPatch):
    with pytest.raises(StoreError, match="bucket name"):
        S3Store("ab", endpoint="http://127.0.0.1:9000", access_key="a", secret_key="b")
    monkeypatch.setenv("FEDPIPE_S3_RETRY_SECONDS", "soon")
    with pytest.raises(StoreError, match="FEDPIPE_S3_RETRY_SECONDS"):
        S3Store("abc", endpoint="http://127.0.0.1:9000", access_key="a", secret_key="b")
    monkeypatch.setenv("FEDPIPE_S3_RETRY_SECONDS", "7.5")
    assert S3Store("abc", endpoint="https://s3.example", access_key="a", secret_key="b").retry_seconds == 7.5


# --- confinement and concurrent writers (issue 21, 7a and 3) ------------------------------------------


@pytest.fixture
def escape(store: LocalStore, tmp_path: Path) -> Path:
    """`<root>/run-1/out` is a symlink to a folder outside the store holding secret.txt (with a
    sidecar, so that only the confinement check can refuse reading it)."""
    outside = tmp_path / "outside"
    (outside / ".sha256").mkdir(parents=True)
    (outside / "secret.txt").write_bytes(b"secret")
    (outside / ".sha256" / "secret.txt").write_text(f"{hashlib.sha256(b'secret').hexdigest()}  secret.txt\n")
    (store.root / "run-1").mkdir(parents=True)
    (store.root / "run-1" / "out").symlink_to(outside, target_is_directory=True)
    (store.root / "run-1" / "leak.txt").symlink_to(outside / "secret.txt")
    return outside


@pytest.mark.parametrize("key", ["run-1/out/secret.txt", "run-1/leak.txt"])
def test_a_symlink_out_of_the_root_is_refused_on_read_write_and_delete(store: LocalStore, escape: Path, key: str):
    refused = re.escape(repr(key)) + ".*leads out of the store folder"
    with pytest.raises(StoreError, match=refused):
        store.get(key)
    with pytest.raises(StoreError, match=refused):
        store.put(key, b"overwritten")
    with pytest.raises(StoreError, match=refused):  # put_many resolves each folder once, each link in full
        store.put_many({"run-1/fine.txt": b"fine", key: b"overwritten"})
    with pytest.raises(StoreError, match=refused):
        store.delete(key)
    with pytest.raises(StoreError, match=refused):
        store.exists(key)
    assert (escape / "secret.txt").read_bytes() == b"secret"  # neither overwritten nor deleted
    assert (escape / ".sha256" / "secret.txt").exists()


def test_listing_refuses_a_symlink_out_of_the_root(store: LocalStore, escape: Path):
    with pytest.raises(StoreError, match="'run-1/leak.txt'.*leads out of the store folder"):
        store.list("run-1/")
    with pytest.raises(StoreError, match="'run-1/out'.*leads out of the store folder"):
        store.list("run-1/out/")


def test_a_symlink_inside_the_root_still_works(store: LocalStore):
    store.put("real/a.txt", b"a")
    (store.root / "alias").symlink_to(store.root / "real", target_is_directory=True)
    assert store.get("alias/a.txt") == b"a"


def _hammer(root: str, i: int, barrier, trials: int, corrupt) -> None:
    store = LocalStore(root)
    for n in range(trials):
        barrier.wait()
        store.put("run-1/state.pt", f"writer {i} trial {n} ".encode() * (2000 + 97 * i))
        barrier.wait()
        if i == 0:
            try:
                store.get("run-1/state.pt")
            except CorruptArtifactError:
                corrupt.value += 1


def test_concurrent_writers_of_one_key_never_leave_an_object_failing_its_hash(store: LocalStore):
    """Before each write held the key's lock, two processes writing one key left one's bytes beside
    the other's hash in 10 of 40 trials."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    writers, trials = 4, 40
    barrier, corrupt = ctx.Barrier(writers), ctx.Value("i", 0)
    procs = [ctx.Process(target=_hammer, args=(str(store.root), i, barrier, trials, corrupt)) for i in range(writers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * writers
    assert corrupt.value == 0, f"{corrupt.value} of {trials} trials left an object failing its hash"


def test_put_many_writes_each_object_with_its_hash_and_one_folder_fsync(store: LocalStore, monkeypatch: pytest.MonkeyPatch):
    """A round's client states: new objects written side by side, each readable and hash-checked;
    a replaced one goes through `put`'s protocol; the folder is fsynced once, not once per object."""
    store.put("run/c/old.pt", b"old")
    dir_syncs = []
    real = local_mod._fsync_dir
    monkeypatch.setattr(local_mod, "_fsync_dir", lambda path: (dir_syncs.append(Path(path).name), real(path))[1])
    items = {f"run/c/state-{i}.pt": bytes([i]) * 1000 for i in range(20)} | {"run/c/old.pt": b"new"}
    digests = store.put_many(items)
    assert digests == {k: hashlib.sha256(v).hexdigest() for k, v in items.items()}
    assert all(store.get(k) == v for k, v in items.items())
    assert dir_syncs.count("c") == 2  # the replaced object's own write, then one for the 20 new ones
    assert not [f for f in all_files(store.root) if ".fedpipe-tmp-" in f]


def test_put_many_interrupted_before_a_data_rename_leaves_no_object_and_no_sidecar(store: LocalStore, monkeypatch: pytest.MonkeyPatch):
    real_replace = os.replace

    def replace(src, dst):
        if Path(dst).name == "state-3.pt" and Path(dst).parent.name != ".sha256":
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(local_mod.os, "replace", replace)
    with pytest.raises(StoreError, match="No space left on device"):
        store.put_many({f"run/c/state-{i}.pt": b"x" * 10 for i in range(6)})
    monkeypatch.undo()
    written = store.list("run/c/")
    assert written == [f"run/c/state-{i}.pt" for i in range(3)]  # renamed before the failure: complete objects
    assert all(store.get(k) == b"x" * 10 for k in written)
    assert sorted(all_files(store.root)) == sorted([f"run/c/state-{i}.pt" for i in range(3)] + [f"run/c/.sha256/state-{i}.pt" for i in range(3)])
