"""Signed artifacts (fedpipe/store/signed.py): an HMAC-SHA256 of each object's key and bytes, with a key
from FEDPIPE_SIGNING_KEY / FEDPIPE_SIGNING_KEY_FILE, checked on every read.

The attacker of these tests can write the store (the folder, or the bucket with the plain minio client)
but has no signing key: a plain store's sha256 does not stop them (shown first in each case), the
signed store does. The S3 tests run against the real S3 server (``-m services``).
"""

from __future__ import annotations

import hashlib
import io
import logging
import uuid
from pathlib import Path

import pytest

from fedpipe.errors import ArtifactSignatureError, ConfigError, CorruptArtifactError, StoreError
from fedpipe.store import LocalStore, S3Store, SignedStore, open_store
from fedpipe.store.signed import HEADER_BYTES, MAGIC

KEY = "k3y-" + "9f2c" * 15  # 64 bytes; the tests look for it, and for its bytes, everywhere
OTHER_KEY = "0th3r-" + "a1" * 20
PAYLOAD = b"round 3 state: the federated weights"


@pytest.fixture
def signing(monkeypatch: pytest.MonkeyPatch) -> str:
    """Signing on, with KEY in FEDPIPE_SIGNING_KEY."""
    monkeypatch.setenv("FEDPIPE_SIGNING_KEY", KEY)
    monkeypatch.delenv("FEDPIPE_SIGNING_KEY_FILE", raising=False)
    monkeypatch.delenv("FEDPIPE_SIGNING_ALLOW_UNSIGNED", raising=False)
    return KEY


@pytest.fixture
def no_signing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("FEDPIPE_SIGNING_KEY", "FEDPIPE_SIGNING_KEY_FILE", "FEDPIPE_SIGNING_ALLOW_UNSIGNED"):
        monkeypatch.delenv(name, raising=False)


def refused(store, key: str) -> str:
    """The message of the signature error that reading `key` raises (a CorruptArtifactError)."""
    with pytest.raises(ArtifactSignatureError) as info:
        store.get(key)
    assert isinstance(info.value, CorruptArtifactError)
    message = str(info.value)
    assert store.url(key) in message, message
    assert KEY not in message
    return message


def assert_key_absent(*texts: str | bytes) -> None:
    for text in texts:
        data = text if isinstance(text, bytes) else text.encode()
        assert KEY.encode() not in data and OTHER_KEY.encode() not in data


def files_under(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def rewrite_with_sidecar(root: Path, key: str, data: bytes) -> None:
    """What a folder writer without the key does: new bytes, and a sha256 sidecar recomputed to match."""
    path = root / key
    path.write_bytes(data)
    (path.parent / ".sha256" / path.name).write_text(f"{hashlib.sha256(data).hexdigest()}  {path.name}\n")


def tampered(envelope: bytes) -> bytes:
    """The object with its header kept and its payload changed."""
    return envelope[:HEADER_BYTES] + b"poisoned: " + envelope[HEADER_BYTES:]


# -- the folder store --------------------------------------------------------------------------------------


def test_open_store_signs_only_while_a_key_is_set(tmp_path: Path, no_signing, monkeypatch: pytest.MonkeyPatch):
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    monkeypatch.setenv("FEDPIPE_SIGNING_KEY", KEY)
    store = open_store(str(tmp_path))
    assert isinstance(store, SignedStore) and isinstance(store.inner, LocalStore)
    assert_key_absent(repr(store))


def test_folder_round_trip(tmp_path: Path, signing):
    store = open_store(str(tmp_path))
    # put returns the sha256 of the caller's bytes: what run manifests record and `fedpipe verify` recomputes
    assert store.put("run-1/state.pt", PAYLOAD) == hashlib.sha256(PAYLOAD).hexdigest()
    store.put_text("run-1/report.json", "{}")
    store.put("run-1/empty", b"")
    assert store.get("run-1/state.pt") == PAYLOAD
    assert store.get_text("run-1/report.json") == "{}"
    assert store.get("run-1/empty") == b""
    assert store.size("run-1/state.pt") == len(PAYLOAD) and store.size("run-1/none") is None
    assert store.list("run-1/") == ["run-1/empty", "run-1/report.json", "run-1/state.pt"]  # no companion objects
    assert store.exists("run-1/state.pt")
    store.delete("run-1/empty")
    assert not store.exists("run-1/empty")
    # On disk: one header line, then the bytes; the plain sha256 sidecar covers both (damage is still caught).
    on_disk = (tmp_path / "run-1/state.pt").read_bytes()
    assert on_disk.startswith(MAGIC) and on_disk[HEADER_BYTES:] == PAYLOAD and on_disk[HEADER_BYTES - 1 :][:1] == b"\n"
    assert LocalStore(tmp_path).get("run-1/state.pt") == on_disk


def test_folder_damage_is_still_caught_by_the_sha256(tmp_path: Path, signing):
    store = open_store(str(tmp_path))
    store.put("a", PAYLOAD)
    path = tmp_path / "a"
    path.write_bytes(path.read_bytes()[:-1])  # truncated, sidecar untouched
    with pytest.raises(CorruptArtifactError, match="sha256"):
        store.get("a")


def test_folder_tampering_with_a_recomputed_sha256(tmp_path: Path, signing):
    store = open_store(str(tmp_path))
    store.put("run-1/state.pt", PAYLOAD)
    plain = LocalStore(tmp_path)
    forged = tampered(plain.get("run-1/state.pt"))
    rewrite_with_sidecar(tmp_path, "run-1/state.pt", forged)
    assert plain.get("run-1/state.pt") == forged  # today's store: the sha256 matches, the forgery passes
    message = refused(store, "run-1/state.pt")
    assert "signature does not match" in message
    assert "must be the same for every task of a run" in message


def test_folder_object_rewritten_without_signature_is_refused(tmp_path: Path, signing):
    store = open_store(str(tmp_path))
    store.put("run-1/state.pt", PAYLOAD)
    LocalStore(tmp_path).put("run-1/state.pt", b"evil")  # a complete, plainly valid object
    message = refused(store, "run-1/state.pt")
    assert "no signature" in message and "FEDPIPE_SIGNING_ALLOW_UNSIGNED" in message


def test_forged_header_is_refused(tmp_path: Path, signing):
    store = open_store(str(tmp_path))
    store.put("a", PAYLOAD)
    plain = LocalStore(tmp_path)
    envelope = plain.get("a")
    plain.put("a", envelope[:40] + b"X" + envelope[41:])  # a broken header line
    assert "signature does not match" in refused(store, "a")
    # a header of the right shape with a MAC made without the key
    plain.put("a", MAGIC + b"kid=" + envelope[22:38] + b" hmac-sha256=" + b"0" * 64 + b"\n" + b"evil")
    assert "signature does not match" in refused(store, "a")


def test_moved_object_is_refused(tmp_path: Path, signing):
    # The MAC covers the key: a valid object of one run copied over another run's is refused.
    store = open_store(str(tmp_path))
    store.put("run-1/state/final.pt", b"run 1's state")
    store.put("run-2/state/final.pt", b"run 2's state")
    plain = LocalStore(tmp_path)
    plain.put("run-2/state/final.pt", plain.get("run-1/state/final.pt"))
    assert plain.get("run-2/state/final.pt").endswith(b"run 1's state")
    assert "signature does not match" in refused(store, "run-2/state/final.pt")
    assert store.get("run-1/state/final.pt") == b"run 1's state"


def test_whole_store_copied_elsewhere_still_verifies(tmp_path: Path, signing):
    # Bound to the store-relative key, not the location: a downloaded run folder reads back.
    open_store(str(tmp_path / "a")).put("run-1/x", PAYLOAD)
    plain_a, plain_b = LocalStore(tmp_path / "a"), LocalStore(tmp_path / "b")
    plain_b.put("run-1/x", plain_a.get("run-1/x"))
    assert open_store(str(tmp_path / "b")).get("run-1/x") == PAYLOAD


def test_wrong_key_is_refused(tmp_path: Path, signing, monkeypatch: pytest.MonkeyPatch):
    open_store(str(tmp_path)).put("run-1/state.pt", PAYLOAD)
    monkeypatch.setenv("FEDPIPE_SIGNING_KEY", OTHER_KEY)
    message = refused(open_store(str(tmp_path)), "run-1/state.pt")
    assert "signature does not match" in message and "another signing key" in message
    assert "must be the same for every task of a run" in message
    assert_key_absent(message)


def test_missing_signature_is_refused_unless_reading_old_runs_is_allowed(
    tmp_path: Path, signing, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    LocalStore(tmp_path).put("old-run/report.json", b"{}")  # written before signing was turned on
    assert "no signature" in refused(open_store(str(tmp_path)), "old-run/report.json")
    monkeypatch.setenv("FEDPIPE_SIGNING_ALLOW_UNSIGNED", "1")
    store = open_store(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="fedpipe.store.signed"):
        assert store.get("old-run/report.json") == b"{}"
    assert "unsigned" in caplog.text and "old-run/report.json" in caplog.text
    store.put("new-run/report.json", b"{}")  # writes are signed all the same
    assert LocalStore(tmp_path).get("new-run/report.json").startswith(MAGIC)
    # ... and a signed object that does not verify is still refused
    plain = LocalStore(tmp_path)
    plain.put("new-run/report.json", tampered(plain.get("new-run/report.json")))
    refused(store, "new-run/report.json")


def test_conditional_writes_are_signed_and_compare_the_caller_s_bytes(tmp_path: Path, signing):
    # create / replace_if (a run's owner and run records): the caller's sha256 is that of what `get` gives.
    store = open_store(str(tmp_path))
    assert store.create("run-1/owner.json", b"first") and not store.create("run-1/owner.json", b"second")
    assert store.get("run-1/owner.json") == b"first"
    assert not store.replace_if("run-1/owner.json", b"third", hashlib.sha256(b"other").hexdigest())
    assert store.replace_if("run-1/owner.json", b"third", hashlib.sha256(b"first").hexdigest())
    assert store.get("run-1/owner.json") == b"third"
    assert not store.replace_if("run-1/none.json", b"x", hashlib.sha256(b"").hexdigest())
    # a forged object is never the one a compare-and-swap expects, even with the forger's sha256
    plain = LocalStore(tmp_path)
    forged = tampered(plain.get("run-1/owner.json"))
    plain.put("run-1/owner.json", forged)
    assert not store.replace_if("run-1/owner.json", b"mine", hashlib.sha256(forged[HEADER_BYTES:]).hexdigest())
    assert plain.get("run-1/owner.json") == forged


# -- the key ------------------------------------------------------------------------------------------------


def test_key_file_is_the_same_key(tmp_path: Path, no_signing, monkeypatch: pytest.MonkeyPatch):
    # A mounted Secret's file; a trailing newline (echo, --from-file) is not part of the key.
    key_file = tmp_path / "signing-key"
    key_file.write_text(KEY + "\n")
    monkeypatch.setenv("FEDPIPE_SIGNING_KEY_FILE", str(key_file))
    open_store(str(tmp_path / "store")).put("a", PAYLOAD)
    monkeypatch.delenv("FEDPIPE_SIGNING_KEY_FILE")
    monkeypatch.setenv("FEDPIPE_SIGNING_KEY", KEY)
    assert open_store(str(tmp_path / "store")).get("a") == PAYLOAD


@pytest.mark.parametrize(
    "env, message",
    [
        ({"FEDPIPE_SIGNING_KEY": KEY[:31]}, "31 bytes long; it must be at least 32 bytes"),
        ({"FEDPIPE_SIGNING_KEY": ""}, "set but the key is empty"),
        ({"FEDPIPE_SIGNING_KEY": KEY, "FEDPIPE_SIGNING_KEY_FILE": "/k"}, "set only one"),
        ({"FEDPIPE_SIGNING_KEY_FILE": "/nonexistent/fedpipe-signing-key"}, "cannot be read"),
        ({"FEDPIPE_SIGNING_KEY": KEY, "FEDPIPE_SIGNING_ALLOW_UNSIGNED": "maybe"}, "not a yes/no value"),
    ],
    ids=["short", "empty", "both", "missing-file", "allow-unsigned-typo"],
)
def test_bad_signing_settings_are_config_errors(
    tmp_path: Path, no_signing, monkeypatch: pytest.MonkeyPatch, env: dict, message: str
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message) as info:
        open_store(str(tmp_path))
    assert KEY[:31] not in str(info.value)
    assert not (tmp_path / ".sha256").exists()


def test_short_key_file_is_a_config_error_without_the_key(tmp_path: Path, no_signing, monkeypatch: pytest.MonkeyPatch):
    key_file = tmp_path / "k"
    key_file.write_text("s3cret-but-short\n")
    monkeypatch.setenv("FEDPIPE_SIGNING_KEY_FILE", str(key_file))
    with pytest.raises(ConfigError, match="16 bytes long") as info:
        open_store(str(tmp_path))
    assert "s3cret-but-short" not in str(info.value) and str(key_file) in str(info.value)


def test_the_key_appears_in_no_message_log_record_or_object(
    tmp_path: Path, signing, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.DEBUG)
    messages = []
    store = open_store(str(tmp_path))
    store.put("run-1/a", PAYLOAD)
    store.put_text("run-1/b", KEY[:8])  # even a payload that starts like the key: only the payload is written
    plain = LocalStore(tmp_path)
    plain.put("run-1/b", tampered(plain.get("run-1/a")))
    plain.put("run-1/c", b"unsigned")
    for key in ("run-1/b", "run-1/c"):
        with pytest.raises(StoreError) as info:
            store.get(key)
        messages.append(str(info.value))
    monkeypatch.setenv("FEDPIPE_SIGNING_KEY", OTHER_KEY)
    with pytest.raises(StoreError) as info:
        open_store(str(tmp_path)).get("run-1/a")
    messages.append(str(info.value))
    monkeypatch.setenv("FEDPIPE_SIGNING_ALLOW_UNSIGNED", "1")
    open_store(str(tmp_path)).get("run-1/c")
    assert len(messages) == 3 and caplog.records
    assert_key_absent(*messages, repr(store), *(r.getMessage() for r in caplog.records), *files_under(tmp_path).values())


# -- a run, end to end ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_signed_run_verifies_and_holds_no_key(tmp_path: Path, signing):
    from runs import small_run, train_all

    from fedpipe.run.verify import verify_run

    run = small_run(tmp_path, "train.rounds=1")
    assert isinstance(run.store, SignedStore)
    train_all(run)
    run.evaluate()
    result = verify_run(open_store(str(tmp_path)), "test")
    assert result.intact and not result.missing and not result.damaged
    written = files_under(tmp_path)
    assert_key_absent(*written.values())
    objects = [p for p in written if ".sha256" not in p.parts]
    assert objects and all(written[p].startswith(MAGIC) for p in objects)


# -- S3 (the real S3 server) ---------------------------------------------------------------------------------


@pytest.fixture
def s3_url(s3_env: str) -> str:
    return f"s3://fedpipe-signed-{uuid.uuid4().hex[:12]}/exp-1"


def raw_put(client, bucket: str, name: str, data: bytes) -> None:
    """Re-put an object with the sha256 metadata a fedpipe store would have written for it."""
    client.put_object(bucket, name, io.BytesIO(data), len(data), metadata={"sha256": hashlib.sha256(data).hexdigest()})


def raw_get(client, bucket: str, name: str) -> tuple[bytes, dict]:
    resp = client.get_object(bucket, name)
    try:
        return resp.read(), dict(resp.headers)
    finally:
        resp.close()
        resp.release_conn()


@pytest.mark.services
def test_s3_round_trip(s3_url: str, signing, raw_client):
    store = open_store(s3_url)
    assert isinstance(store, SignedStore) and isinstance(store.inner, S3Store)
    assert store.put("run-1/state.pt", PAYLOAD) == hashlib.sha256(PAYLOAD).hexdigest()
    assert store.get("run-1/state.pt") == PAYLOAD
    assert store.size("run-1/state.pt") == len(PAYLOAD)
    assert store.list() == ["run-1/state.pt"] and store.exists("run-1/state.pt")
    # One PUT: the signed envelope as the object, its plain sha256 in the metadata of the same PUT.
    data, headers = raw_get(raw_client, store.inner.bucket, "exp-1/run-1/state.pt")
    assert data.startswith(MAGIC) and data[HEADER_BYTES:] == PAYLOAD
    assert headers["x-amz-meta-sha256"] == hashlib.sha256(data).hexdigest()
    assert_key_absent(data, repr(headers))
    store.delete("run-1/state.pt")
    assert store.list() == []
    # conditional writes (S3 If-None-Match / If-Match) go through the envelope too
    assert store.create("run-1/owner.json", b"a") and not store.create("run-1/owner.json", b"b")
    assert store.replace_if("run-1/owner.json", b"c", hashlib.sha256(b"a").hexdigest())
    assert not store.replace_if("run-1/owner.json", b"d", hashlib.sha256(b"a").hexdigest())
    assert store.get("run-1/owner.json") == b"c"


@pytest.mark.services
def test_s3_tampering_with_matching_metadata(s3_url: str, signing, raw_client):
    store = open_store(s3_url)
    store.put("run-1/state.pt", PAYLOAD)
    bucket, name = store.inner.bucket, "exp-1/run-1/state.pt"
    forged = tampered(raw_get(raw_client, bucket, name)[0])
    raw_put(raw_client, bucket, name, forged)
    assert store.inner.get("run-1/state.pt") == forged  # today's store: the metadata matches, the forgery passes
    message = refused(store, "run-1/state.pt")
    assert "signature does not match" in message and "must be the same for every task of a run" in message
    assert message.startswith(f"The artifact {s3_url}/run-1/state.pt ")


@pytest.mark.services
def test_s3_moved_unsigned_and_wrong_key_are_refused(s3_url: str, signing, raw_client, monkeypatch: pytest.MonkeyPatch):
    store = open_store(s3_url)
    store.put("run-1/final.pt", b"run 1")
    store.put("run-2/final.pt", b"run 2")
    bucket = store.inner.bucket
    raw_put(raw_client, bucket, "exp-1/run-2/final.pt", raw_get(raw_client, bucket, "exp-1/run-1/final.pt")[0])
    assert "signature does not match" in refused(store, "run-2/final.pt")
    raw_put(raw_client, bucket, "exp-1/run-3/final.pt", b"unsigned")
    assert "no signature" in refused(store, "run-3/final.pt")
    monkeypatch.setenv("FEDPIPE_SIGNING_KEY", OTHER_KEY)
    assert "another signing key" in refused(open_store(s3_url), "run-1/final.pt")
