"""S3Store against a real S3-compatible server (moto_server over HTTP) through the minio client."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import time
import uuid

import pytest
from minio import Minio

from fedpipe.errors import CorruptArtifactError, StoreError
from fedpipe.store import S3Store, open_store

pytestmark = pytest.mark.services


def new_bucket() -> str:
    return f"fedpipe-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def store(s3_env: str) -> S3Store:
    s = open_store(f"s3://{new_bucket()}/exp-1/")
    assert isinstance(s, S3Store)
    return s


def test_round_trip_small_and_multipart(store: S3Store, raw_client: Minio):
    small = b"hello federated world"
    big = os.urandom(12 * 1024 * 1024)  # > 5 MiB: the minio client uploads it in parts
    assert store.put("run-1/small.bin", small) == hashlib.sha256(small).hexdigest()
    assert store.put("run-1/state/round-0001.pt", big) == hashlib.sha256(big).hexdigest()
    assert store.get("run-1/small.bin") == small
    assert store.get("run-1/state/round-0001.pt") == big
    assert store.exists("run-1/small.bin")
    assert not store.exists("run-1/nothing")

    # The object lies under the prefix and carries its sha256 in metadata.
    stat = raw_client.stat_object(store.bucket, "exp-1/run-1/state/round-0001.pt")
    assert stat.size == len(big)
    assert stat.metadata["x-amz-meta-sha256"] == hashlib.sha256(big).hexdigest()
    assert "-" in stat.etag  # a multipart ETag ("<md5>-<parts>")


def test_list_and_delete(store: S3Store):
    for key in ["r/b", "r/a", "r/sub/c", "other"]:
        store.put_text(key, key)
    assert store.list() == ["other", "r/a", "r/b", "r/sub/c"]
    assert store.list("r/") == ["r/a", "r/b", "r/sub/c"]
    assert store.list("r/s") == ["r/sub/c"]
    store.delete("r/a")
    store.delete("r/a")  # absent: no error
    assert store.list("r/") == ["r/b", "r/sub/c"]
    assert store.get_text("r/sub/c") == "r/sub/c"


def test_prefixes_do_not_mix(s3_env: str):
    bucket = new_bucket()
    a, b = open_store(f"s3://{bucket}/a"), open_store(f"s3://{bucket}/b")
    a.put("k", b"A")
    b.put("k", b"B")
    assert (a.get("k"), b.get("k")) == (b"A", b"B")
    assert open_store(f"s3://{bucket}").list() == ["a/k", "b/k"]


def test_overwritten_without_metadata_is_corrupt(store: S3Store, raw_client: Minio):
    store.put("run/model.pt", b"good bytes")
    raw = raw_client
    raw.put_object(store.bucket, "exp-1/run/model.pt", io.BytesIO(b"evil"), 4)
    with pytest.raises(CorruptArtifactError) as info:
        store.get("run/model.pt")
    assert f"s3://{store.bucket}/exp-1/run/model.pt" in str(info.value)


def test_wrong_metadata_is_corrupt(store: S3Store, raw_client: Minio):
    store.put("run/model.pt", b"good bytes")
    raw = raw_client
    wrong = hashlib.sha256(b"good bytes").hexdigest()
    raw.put_object(
        store.bucket, "exp-1/run/model.pt", io.BytesIO(b"good bytez"), 10, metadata={"sha256": wrong}
    )
    with pytest.raises(CorruptArtifactError, match="changed or truncated after it was written"):
        store.get("run/model.pt")


def test_missing_key_and_bucket(store: S3Store, s3_env: str):
    store.put("present", b"1")  # creates the bucket
    with pytest.raises(StoreError, match="No artifact at") as info:
        store.get("absent/key")
    assert not isinstance(info.value, CorruptArtifactError)

    nobucket = open_store(f"s3://{new_bucket()}/x")
    with pytest.raises(StoreError, match="does not exist"):
        nobucket.get("k")
    assert nobucket.list() == []
    assert not nobucket.exists("k")


def test_bucket_not_created_when_turned_off(s3_env: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FEDPIPE_S3_CREATE_BUCKET", "0")
    s = open_store(f"s3://{new_bucket()}")
    with pytest.raises(StoreError, match="creating it is turned off"):
        s.put("k", b"v")


def test_unreachable_endpoint_fails_within_budget(
    s3_env: str, s3_credentials: tuple[str, str], port_factory, monkeypatch: pytest.MonkeyPatch, caplog
):
    access_key, secret_key = s3_credentials
    port = port_factory()  # nothing listens there
    monkeypatch.setenv("FEDPIPE_S3_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("FEDPIPE_S3_RETRY_SECONDS", "1.5")
    s = open_store("s3://fedpipe-unreachable/x")
    caplog.set_level(logging.DEBUG)
    for op in (lambda: s.put("k", b"v"), lambda: s.get("k"), lambda: s.list()):
        start = time.monotonic()
        with pytest.raises(StoreError) as info:
            op()
        elapsed = time.monotonic() - start
        assert elapsed < 5, elapsed
        msg = str(info.value)
        assert f"http://127.0.0.1:{port}" in msg
        assert "Could not reach" in msg and "FEDPIPE_S3_ENDPOINT" in msg
        assert "\n" not in msg
        assert secret_key not in msg and access_key not in msg
        assert info.value.__cause__ is None
    assert "retrying" in caplog.text  # backoff happened
    assert secret_key not in caplog.text and access_key not in caplog.text


def test_wrong_credentials_message_has_no_secret(s3_env: str, monkeypatch: pytest.MonkeyPatch):
    # moto accepts any credentials by default; this only checks the message path of bad keys.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "another-SECRET-value")
    s = open_store(f"s3://{new_bucket()}")
    s.put("k", b"v")
    assert "another-SECRET-value" not in repr(s)


def test_conditional_writes_are_preconditions_the_server_enforces(store: S3Store, raw_client: Minio):
    """`create` sends If-None-Match: *, `replace_if` If-Match: <etag> (what AWS S3, MinIO and SeaweedFS
    document for PutObject); moto's server answers 412 PreconditionFailed for both, as they do."""
    assert store.create("run-1/owner.json", b"first") is True
    assert store.create("run-1/owner.json", b"second") is False
    assert store.get("run-1/owner.json") == b"first"
    stat = raw_client.stat_object(store.bucket, "exp-1/run-1/owner.json")
    assert stat.metadata["x-amz-meta-sha256"] == hashlib.sha256(b"first").hexdigest()  # the hash travels too
    assert store.replace_if("run-1/owner.json", b"third", "0" * 64) is False
    assert store.replace_if("run-1/owner.json", b"third", hashlib.sha256(b"first").hexdigest()) is True
    assert store.get("run-1/owner.json") == b"third"
    assert store.replace_if("run-1/absent.json", b"x", hashlib.sha256(b"").hexdigest()) is False
