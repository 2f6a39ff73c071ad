"""Artifact stores: a local folder (`LocalStore`) or a MinIO / S3 bucket (`S3Store`).

`open_store(url)` picks one from a URL:

- a plain path or a ``file://`` URL -> `LocalStore` (objects are plain files under that folder);
- ``s3://bucket/prefix`` -> `S3Store`, with the endpoint and credentials taken from the
  environment only: ``FEDPIPE_S3_ENDPOINT`` (``http://minio-service.kubeflow:9000``; the scheme
  decides TLS), ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` and optionally ``AWS_REGION``.

Keys are relative ``/``-separated paths; `validate_key` is the one check both stores apply.
"""

from __future__ import annotations

from pathlib import PurePosixPath, PureWindowsPath
from urllib.parse import unquote, urlparse

from fedpipe.errors import StoreError
from fedpipe.store.base import Store, sha256_hex

# Names that LocalStore keeps for itself next to the objects; no part of a key may use them.
SIDECAR_DIR = ".sha256"
TEMP_PREFIX = ".fedpipe-tmp-"


def validate_key(key: object, *, what: str = "key") -> str:
    """Return `key` when it is a safe relative '/'-separated path; raise StoreError saying why not."""
    if not isinstance(key, str):
        raise StoreError(f"Artifact {what} must be a string, got {type(key).__name__} ({key!r}).")
    if key == "":
        raise StoreError(f"Artifact {what} is empty: give a relative path such as 'run-1/report.json'.")
    if "\\" in key:
        raise StoreError(
            f"Artifact {what} {key!r} contains a backslash: use '/' to separate the parts of a key."
        )
    if any(ord(c) < 32 or ord(c) == 127 for c in key):
        raise StoreError(f"Artifact {what} {key!r} contains a control character; remove it.")
    if key.startswith("/") or PurePosixPath(key).is_absolute() or PureWindowsPath(key).is_absolute():
        raise StoreError(
            f"Artifact {what} {key!r} is an absolute path: keys are relative to the store "
            "(drop the leading '/')."
        )
    parts = key.split("/")
    if ".." in parts:
        raise StoreError(
            f"Artifact {what} {key!r} contains a '..' part, which would point outside the store; "
            "use a path inside it."
        )
    if any(p in ("", ".") for p in parts):
        raise StoreError(
            f"Artifact {what} {key!r} has an empty or '.' part (a doubled or trailing '/'); "
            "write it as 'a/b/c'."
        )
    if any(p == SIDECAR_DIR or p.startswith(TEMP_PREFIX) for p in parts):
        raise StoreError(
            f"Artifact {what} {key!r} uses a part named '{SIDECAR_DIR}' or starting with '{TEMP_PREFIX}'; "
            "those names are kept for the store's own hash and temporary files; pick another name."
        )
    return key


def validate_prefix(prefix: object) -> str:
    """A listing prefix: '' or a string prefix of keys (it may end with '/')."""
    if prefix == "":
        return ""
    if not isinstance(prefix, str):
        raise StoreError(f"Listing prefix must be a string, got {type(prefix).__name__}.")
    stripped = prefix.rstrip("/")
    if stripped == "":
        raise StoreError("Listing prefix '/' is an absolute path: use '' to list the whole store.")
    # A prefix may end in the middle of a name ('run-1/rou'), so only the complete parts are checked.
    if "\\" in prefix or prefix.startswith("/") or ".." in prefix.split("/"):
        raise StoreError(
            f"Listing prefix {prefix!r} is not a relative '/'-separated path inside the store "
            "(no leading '/', no '..', no backslashes)."
        )
    return prefix


from fedpipe.store.local import LocalStore  # noqa: E402  (needs validate_key above)
from fedpipe.store.s3 import S3Store  # noqa: E402

__all__ = [
    "LocalStore",
    "S3Store",
    "Store",
    "open_store",
    "sha256_hex",
    "validate_key",
]


def open_store(url: str) -> Store:
    """Open the store that `url` names: a path or ``file://`` URL, or ``s3://bucket/prefix``."""
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
