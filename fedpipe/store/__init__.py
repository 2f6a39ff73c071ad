"""Artifact stores: a local folder (`LocalStore`) or a MinIO / S3 bucket (`S3Store`).

`open_store(url)` picks one from a URL:

- a plain path or a ``file://`` URL -> `LocalStore` (objects are plain files under that folder);
- ``s3://bucket/prefix`` -> `S3Store`, with the endpoint and credentials taken from the
  environment only: ``FEDPIPE_S3_ENDPOINT`` (``http://minio-service.kubeflow:9000``; the scheme
  decides TLS), ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` and optionally ``AWS_REGION``.

Keys are relative ``/``-separated paths; `validate_key` is the one check both stores apply.

Signed artifacts (opt-in, `fedpipe.store.signed`): while ``FEDPIPE_SIGNING_KEY`` (or
``FEDPIPE_SIGNING_KEY_FILE``, a mounted Secret) is set, every store `open_store` opens is a
`SignedStore` around the plain one: each object carries an HMAC-SHA256 of its key and bytes, checked
on every read, so an object rewritten together with its sha256 by someone without the key is refused.
"""

from __future__ import annotations

from urllib.parse import unquote, urlparse

from fedpipe.errors import StoreError
from fedpipe.store.base import Store, sha256_hex, validate_key, validate_prefix
from fedpipe.store.folder import LocalStore
from fedpipe.store.s3 import S3Store
from fedpipe.store.signed import SignedStore, signing_from_env

__all__ = [
    "LocalStore",
    "S3Store",
    "SignedStore",
    "Store",
    "open_store",
    "sha256_hex",
    "validate_key",
    "validate_prefix",
]


def open_store(url: str) -> Store:
    """Open the store that `url` names: a path or ``file://`` URL, or ``s3://bucket/prefix``; signed when
    ``FEDPIPE_SIGNING_KEY`` / ``FEDPIPE_SIGNING_KEY_FILE`` is set (a bad key is a ConfigError)."""
    sign = signing_from_env()
    return sign(_open_plain(url))


def _open_plain(url: str) -> Store:
    if not isinstance(url, str) or not url.strip():
        raise StoreError("No artifact store given: pass a folder path, a file:// URL or s3://bucket/prefix.")
    url = url.strip()
    if "://" not in url:
        return LocalStore(url)
    parsed = urlparse(url)
    scheme = parsed.scheme.lower()
    if scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise StoreError(
                f"Store URL {url!r} names host {parsed.netloc!r}; a file:// URL must be "
                "file:///absolute/path (three slashes) or a plain path."
            )
        path = unquote(parsed.path)
        if not path:
            raise StoreError(f"Store URL {url!r} has no path; write file:///absolute/path.")
        return LocalStore(path)
    if scheme == "s3":
        bucket = parsed.netloc
        if not bucket:
            raise StoreError(f"Store URL {url!r} has no bucket; write s3://bucket/prefix.")
        prefix = parsed.path.strip("/")
        return S3Store.from_env(bucket, prefix)
    raise StoreError(
        f"Store URL {url!r} uses the unsupported scheme {parsed.scheme!r}: use a folder path, "
        "file:///path, or s3://bucket/prefix (MinIO or any S3-compatible server)."
    )
