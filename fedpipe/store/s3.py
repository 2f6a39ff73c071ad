"""A store in a MinIO / S3 bucket, through the `minio` client.

Each object's sha256 is stored in its metadata (``x-amz-meta-sha256``) by the same PUT that writes
the bytes, and checked on every `get`. An S3 PUT (single or multipart) is atomic: readers see the
old object or the new one, never a partial one.

Endpoint and credentials come from the environment only (`S3Store.from_env`), never from config
files, with the names Kubeflow's own MinIO secret uses:

``FEDPIPE_S3_ENDPOINT``      ``http://minio-service.kubeflow:9000`` (the scheme decides TLS)
``AWS_ACCESS_KEY_ID``        access key
``AWS_SECRET_ACCESS_KEY``    secret key
``AWS_SESSION_TOKEN``        optional, temporary credentials
``AWS_REGION``               optional
``FEDPIPE_S3_RETRY_SECONDS`` optional, how long to keep retrying an unreachable server (default 30)
``FEDPIPE_S3_CREATE_BUCKET`` optional, ``0`` to never create a missing bucket (default ``1``)

Connection errors and server-side 5xx answers are retried with exponential backoff (a few attempts
within the retry budget); then a `StoreError` says which endpoint could not be reached and what to
check. Credentials never appear in messages, logs or ``repr``.
"""

from __future__ import annotations

import io
import logging
import os
import time
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlparse

import urllib3
from minio import Minio
from minio.error import InvalidResponseError, MinioException, S3Error, ServerError
from minio.helpers import check_bucket_name
from tenacity import RetryCallState, Retrying, retry_if_exception

from fedpipe.errors import CorruptArtifactError, StoreError
from fedpipe.store.base import Store, sha256_hex, validate_key, validate_prefix

__all__ = ["DEFAULT_RETRY_SECONDS", "MAX_ATTEMPTS", "S3Store"]

log = logging.getLogger(__name__)

ENV_ENDPOINT = "FEDPIPE_S3_ENDPOINT"
ENV_ACCESS_KEY = "AWS_ACCESS_KEY_ID"
ENV_SECRET_KEY = "AWS_SECRET_ACCESS_KEY"
ENV_SESSION_TOKEN = "AWS_SESSION_TOKEN"
ENV_REGION = "AWS_REGION"
ENV_RETRY_SECONDS = "FEDPIPE_S3_RETRY_SECONDS"
ENV_CREATE_BUCKET = "FEDPIPE_S3_CREATE_BUCKET"

DEFAULT_RETRY_SECONDS = 30.0
MAX_ATTEMPTS = 6
META_SHA256 = "sha256"  # sent as x-amz-meta-sha256
_HEADER_SHA256 = "x-amz-meta-sha256"

_RETRYABLE_S3_CODES = {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout"}
_CREDENTIAL_S3_CODES = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
    "AuthorizationHeaderMalformed",
}

T = TypeVar("T")


def _is_transient(exc: BaseException) -> bool:
    """Errors worth another attempt: the server could not be reached or answered 5xx."""
    if isinstance(exc, (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError):
        return True
    if isinstance(exc, ServerError):
        return exc.status_code >= 500
    if isinstance(exc, InvalidResponseError):
        return getattr(exc, "_code", 0) >= 500
    if isinstance(exc, S3Error):
        return exc.code in _RETRYABLE_S3_CODES
    return False


def _retry_seconds_from_env() -> float:
    raw = os.environ.get(ENV_RETRY_SECONDS, "").strip()
    if not raw:
        return DEFAULT_RETRY_SECONDS
    try:
        value = float(raw)
    except ValueError:
        raise StoreError(
            f"{ENV_RETRY_SECONDS}={raw!r} is not a number: set it to how many seconds to keep "
            f"retrying an unreachable S3 server (default {DEFAULT_RETRY_SECONDS:g})."
        ) from None
    if value < 0:
        raise StoreError(f"{ENV_RETRY_SECONDS}={raw!r} is negative: use 0 or more seconds.")
    return value


def _parse_endpoint(endpoint: str, secure: bool | None) -> tuple[str, bool]:
    """'http://host:9000' -> ('host:9000', False); 'host:9000' keeps `secure` (default True)."""
    endpoint = endpoint.strip()
    if "://" in endpoint:
        parsed = urlparse(endpoint)
        scheme = parsed.scheme.lower()
        if scheme not in ("http", "https") or not parsed.netloc:
            raise StoreError(
                f"S3 endpoint {endpoint!r} is not an http:// or https:// URL; write it like "
                "http://minio-service.kubeflow:9000."
            )
        if parsed.path not in ("", "/") or parsed.query or parsed.fragment:
            raise StoreError(
                f"S3 endpoint {endpoint!r} has a path; give only scheme, host and port, like "
                "http://minio-service.kubeflow:9000 (the bucket goes in the s3:// store URL)."
            )
        if "@" in parsed.netloc:
            raise StoreError(
                "The S3 endpoint URL contains a user name or password; put the credentials in "
                f"{ENV_ACCESS_KEY} and {ENV_SECRET_KEY} instead."
            )
        url_secure = scheme == "https"
        if secure is not None and secure != url_secure:
            raise StoreError(
                f"S3 endpoint {endpoint!r} says {scheme}:// but secure={secure} was asked; "
                "let the scheme decide."
            )
        return parsed.netloc, url_secure
    if not endpoint or "/" in endpoint:
        raise StoreError(
            f"S3 endpoint {endpoint!r} is not valid; write it like http://minio-service.kubeflow:9000."
        )
    return endpoint, True if secure is None else secure


def _settings_from_env(bucket: str, prefix: str) -> dict:
    """`S3Store` keyword arguments from the environment: the endpoint, the credentials, the region and
    whether to create a missing bucket."""
    env = os.environ
    missing = [n for n in (ENV_ENDPOINT, ENV_ACCESS_KEY, ENV_SECRET_KEY) if not env.get(n, "").strip()]
    if missing:
        raise StoreError(
            f"The artifact store s3://{bucket}/{prefix.strip('/')} needs the S3 endpoint and "
            f"credentials in the environment, but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set. Set {ENV_ENDPOINT} (for example "
            f"http://minio-service.kubeflow:9000), {ENV_ACCESS_KEY} and {ENV_SECRET_KEY} "
            "(in Kubeflow, from the mlpipeline-minio-artifact secret); fedpipe never reads "
            "them from config files."
        )
    return {
        "endpoint": env[ENV_ENDPOINT].strip(),
        "access_key": env[ENV_ACCESS_KEY].strip(),
        "secret_key": env[ENV_SECRET_KEY].strip(),
        "region": env.get(ENV_REGION, "").strip() or None,
        "session_token": env.get(ENV_SESSION_TOKEN, "").strip() or None,
        "create_bucket": env.get(ENV_CREATE_BUCKET, "1").strip().lower() not in ("0", "false", "no", "off"),
    }


class _S3Calls:
    """How one store talks to its server: bounded retries on transient errors (tenacity, with a time
    budget), and every other error turned into a `StoreError` that says what to check. Credentials are
    scrubbed from every message and log line."""

    def __init__(self, endpoint_url: str, bucket: str, retry_seconds: float, max_attempts: int, secrets: list[str]):
        self.endpoint_url = endpoint_url
        self.bucket = bucket
        self.retry_seconds = retry_seconds
        self.max_attempts = max_attempts
        self._secrets = secrets

    def scrub(self, text: str) -> str:
        for s in self._secrets:
            text = text.replace(s, "***")
        return text

    def describe(self, exc: BaseException) -> str:
        text = str(exc)
        marker = "Failed to establish a new connection: "
        if marker in text:
            text = text.split(marker, 1)[1]
        elif isinstance(exc, (urllib3.exceptions.TimeoutError, TimeoutError)):
            text = "timed out"
        elif isinstance(exc, S3Error):
            text = f"{exc.code}: {exc.message}"
        text = text.strip().rstrip(")").strip() or type(exc).__name__
        return self.scrub(text[:200])

    def __call__(self, what: str, fn: Callable[[], T]) -> T:
        """Run `fn` with bounded retries on transient errors; map the rest to StoreError."""
        start = time.monotonic()
        budget = self.retry_seconds

        def stop(state: RetryCallState) -> bool:
            return state.attempt_number >= self.max_attempts or time.monotonic() - start >= budget

        def wait(state: RetryCallState) -> float:
            backoff = min(10.0, 2.0 ** (state.attempt_number - 1))
            return max(0.0, min(backoff, budget - (time.monotonic() - start)))

        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning(
                "S3 server %s did not answer %s (%s); attempt %d of %d, retrying in %.1f s.",
                self.endpoint_url,
                what,
                self.describe(exc) if exc else "error",
                state.attempt_number,
                self.max_attempts,
                state.next_action.sleep if state.next_action else 0.0,
            )

        attempts = 0
        try:
            for attempt in Retrying(
                stop=stop,
                wait=wait,
                retry=retry_if_exception(_is_transient),
                before_sleep=before_sleep,
                reraise=True,
            ):
                with attempt:
                    attempts += 1
                    return fn()
        except StoreError:
            raise
        except S3Error as exc:
            raise self.s3_error(what, exc) from None
        except MinioException as exc:
            if _is_transient(exc):
                raise self.unreachable(what, exc, attempts, start) from None
            raise StoreError(
                f"The S3 server at {self.endpoint_url} failed {what}: {self.describe(exc)}."
            ) from None
        except Exception as exc:
            if _is_transient(exc):
                raise self.unreachable(what, exc, attempts, start) from None
            raise
        raise AssertionError("unreachable")  # pragma: no cover

    def unreachable(self, what: str, exc: BaseException, attempts: int, start: float) -> StoreError:
        elapsed = time.monotonic() - start
        return StoreError(
            f"Could not reach the S3 / MinIO server at {self.endpoint_url} ({what}): "
            f"{attempts} attempt{'s' if attempts != 1 else ''} over {elapsed:.1f} s failed, the last "
            f"with: {self.describe(exc)}. Check that {ENV_ENDPOINT} points at the server (in "
            "Kubeflow usually http://minio-service.kubeflow:9000) and that its scheme (http or "
            "https) is right, that this machine or pod can reach it over the network, and that "
            f"{ENV_ACCESS_KEY} / {ENV_SECRET_KEY} hold its credentials; set {ENV_RETRY_SECONDS} "
            f"(now {self.retry_seconds:g}) to wait longer."
        )

    def s3_error(self, what: str, exc: S3Error) -> StoreError:
        if exc.code in _CREDENTIAL_S3_CODES:
            return StoreError(
                f"The S3 server at {self.endpoint_url} refused {what} ({exc.code}): check that "
                f"{ENV_ACCESS_KEY} and {ENV_SECRET_KEY} hold valid credentials for it and that "
                f"they may use the bucket {self.bucket!r}."
            )
        if exc.code == "NoSuchBucket":
            return StoreError(
                f"The bucket {self.bucket!r} does not exist on {self.endpoint_url} ({what}). "
                "Create it, or let fedpipe create it (unset "
                f"{ENV_CREATE_BUCKET}=0), or fix the bucket in the s3:// store URL."
            )
        return StoreError(f"The S3 server at {self.endpoint_url} failed {what}: {self.describe(exc)}.")


class _Bucket:
    """The minio calls on one bucket, each one retryable unit, with S3's "not there" answers turned
    into values (or the store's "No artifact" error) and every other error left to `_S3Calls`."""

    def __init__(self, client: Minio, bucket: str, region: str | None):
        self.client = client
        self.bucket = bucket
        self.region = region

    def exists(self) -> bool:
        return self.client.bucket_exists(self.bucket)

    def create(self) -> None:
        try:
            self.client.make_bucket(self.bucket, location=self.region)
        except S3Error as exc:
            if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise

    def put(self, name: str, data: bytes, digest: str) -> None:
        self.client.put_object(self.bucket, name, io.BytesIO(data), len(data), metadata={META_SHA256: digest})

    def put_if(self, name: str, data: bytes, digest: str, condition: dict[str, str]) -> bool:
        """A PUT with a precondition header (``If-None-Match: *`` or ``If-Match: "<etag>"``); False
        when the server refuses it for the precondition. AWS S3 (since 2024), MinIO and SeaweedFS
        document both on PutObject: 412 PreconditionFailed when the condition does not hold, and AWS
        409 ConditionalRequestConflict when a concurrent conditional write won. minio-py's
        `put_object` turns unknown headers into x-amz-meta-* metadata, so its `_put_object` (the
        single PutObject request, which sends headers as given) carries the condition; moto's server
        (5.2) honours both headers (tests/test_single_writer.py races it)."""
        headers = {"Content-Type": "application/octet-stream", _HEADER_SHA256: digest, **condition}
        try:
            self.client._put_object(self.bucket, name, data, headers=headers)
        except S3Error as exc:
            if exc.code in ("PreconditionFailed", "ConditionalRequestConflict"):
                return False
            raise
        return True

    def etag_and_sha256(self, name: str) -> tuple[str, str | None] | None:
        """The object's ETag and recorded sha256; None when there is no object."""
        try:
            st = self.client.stat_object(self.bucket, name)
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject", "NotFound", "ResourceNotFound"):
                return None
            raise
        meta = {k.lower(): v for k, v in (st.metadata or {}).items()}
        return st.etag or "", meta.get(_HEADER_SHA256)

    def read(self, name: str, where: str) -> tuple[bytes, str | None]:
        """The object's bytes and the sha256 recorded with it (None when there is none)."""
        try:
            resp = self.client.get_object(self.bucket, name)
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject", "NotFound"):
                raise StoreError(
                    f"No artifact at {where}: it was never written, or was deleted. Run the "
                    "step that produces it first (or check the store URL)."
                ) from None
            raise
        try:
            return resp.read(), resp.headers.get(_HEADER_SHA256)
        finally:
            resp.close()
            resp.release_conn()

    def size(self, name: str) -> int | None:
        try:
            return self.client.stat_object(self.bucket, name).size
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject", "NotFound", "NoSuchBucket", "ResourceNotFound"):
                return None
            raise

    def names(self, prefix: str) -> list[str]:
        try:
            objs = self.client.list_objects(self.bucket, prefix=prefix, recursive=True)
            return [o.object_name for o in objs if not o.is_dir]
        except S3Error as exc:
            if exc.code == "NoSuchBucket":
                return []
            raise

    def remove(self, name: str) -> None:
        try:
            self.client.remove_object(self.bucket, name)
        except S3Error as exc:
            if exc.code not in ("NoSuchKey", "NoSuchBucket"):
                raise


def _check_bucket_name(bucket: str) -> None:
    try:
        check_bucket_name(bucket)
    except (ValueError, TypeError) as exc:
        raise StoreError(
            f"S3 bucket name {bucket!r} is not valid ({exc}); bucket names have 3 to 63 "
            "lower-case letters, digits, '.' and '-'."
        ) from None


def _http_client(connect_timeout: float, read_timeout: float, retry_seconds: float) -> urllib3.PoolManager:
    # Retries are done by _S3Calls (tenacity, with a time budget), not inside urllib3. A server that accepts a
    # connection and then says nothing must not hold one attempt for longer than the whole retry budget: the
    # read timeout (the longest silence between bytes, not a transfer's duration) follows it too.
    connect = max(0.5, min(connect_timeout, retry_seconds or connect_timeout))
    read = max(5.0, min(read_timeout, retry_seconds)) if retry_seconds > 0 else read_timeout
    return urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=connect, read=read),
        maxsize=10,
        retries=False,
        cert_reqs="CERT_REQUIRED",
        ca_certs=os.environ.get("SSL_CERT_FILE") or _certifi_where(),
    )


def _check_sha256(where: str, data: bytes, recorded: str | None) -> None:
    """Raise CorruptArtifactError unless `data` has the sha256 recorded when it was written."""
    actual = sha256_hex(data)
    if not recorded:
        raise CorruptArtifactError(
            f"The artifact {where} has no recorded sha256 (no {_HEADER_SHA256} metadata), so "
            "its integrity cannot be checked: it was not written by fedpipe, or was overwritten "
            "by another tool after it was written. Re-run the step that produces it."
        )
    if actual != recorded.strip().lower():
        raise CorruptArtifactError(
            f"The artifact {where} is corrupt: its sha256 is {actual} ({len(data)} bytes) but "
            f"{recorded.strip()} was recorded when it was written, so the object was changed or "
            "truncated after it was written. Delete it and re-run the step that produces it."
        )


class S3Store(Store):
    """Objects under ``s3://bucket/prefix/`` on MinIO or any S3-compatible server."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint: str = "",
        access_key: str | None = None,
        secret_key: str | None = None,
        secure: bool | None = None,
        region: str | None = None,
        *,
        session_token: str | None = None,
        create_bucket: bool = True,
        retry_seconds: float | None = None,
        max_attempts: int = MAX_ATTEMPTS,
        connect_timeout: float = 10.0,
        read_timeout: float = 120.0,
    ):
        _check_bucket_name(bucket)
        prefix = (prefix or "").strip("/")
        if prefix:
            validate_key(prefix, what="prefix")
        self.bucket = bucket
        self.prefix = prefix
        host, self.secure = _parse_endpoint(endpoint, secure)
        self.endpoint = host
        self.endpoint_url = ("https://" if self.secure else "http://") + host
        self.region = region or None
        self.create_bucket = create_bucket
        budget = _retry_seconds_from_env() if retry_seconds is None else float(retry_seconds)
        secrets = [s for s in (access_key, secret_key, session_token) if s]
        self._call = _S3Calls(self.endpoint_url, bucket, budget, max(1, int(max_attempts)), secrets)
        self._bucket_ready = False
        try:
            client = Minio(
                host,
                access_key=access_key or None,
                secret_key=secret_key or None,
                session_token=session_token or None,
                secure=self.secure,
                region=self.region,
                http_client=_http_client(connect_timeout, read_timeout, budget),
            )
        except ValueError as exc:
            raise StoreError(
                f"Cannot set up the S3 client for {self.endpoint_url}: {self._call.scrub(str(exc))}."
            ) from None
        self._bucket = _Bucket(client, bucket, self.region)

    @classmethod
    def from_env(cls, bucket: str, prefix: str = "", **kwargs) -> S3Store:
        """Endpoint and credentials from FEDPIPE_S3_ENDPOINT, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY."""
        settings = _settings_from_env(bucket, prefix)
        kwargs.setdefault("create_bucket", settings.pop("create_bucket"))
        return cls(bucket, prefix, **settings, **kwargs)

    def __repr__(self) -> str:
        return f"S3Store({self.url()!r}, endpoint={self.endpoint_url!r})"

    @property
    def retry_seconds(self) -> float:
        """How long an unreachable server is retried, in seconds."""
        return self._call.retry_seconds

    @property
    def max_attempts(self) -> int:
        return self._call.max_attempts

    # -- helpers -------------------------------------------------------------------------------

    def _name(self, key: str) -> str:
        key = validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def url(self, key: str = "") -> str:
        path = "/".join(p for p in (self.prefix, validate_key(key) if key else "") if p)
        return f"s3://{self.bucket}/{path}" if path else f"s3://{self.bucket}"

    def _ensure_bucket(self) -> None:
        if self._bucket_ready:
            return
        if not self._call(f"checking bucket {self.bucket!r}", self._bucket.exists):
            if not self.create_bucket:
                raise StoreError(
                    f"The bucket {self.bucket!r} does not exist on {self.endpoint_url} and creating "
                    f"it is turned off ({ENV_CREATE_BUCKET}=0). Create it, or fix the bucket in the "
                    "s3:// store URL."
                )
            self._call(f"creating bucket {self.bucket!r}", self._bucket.create)
            log.info("Created bucket %r on %s.", self.bucket, self.endpoint_url)
        self._bucket_ready = True

    # -- Store API -----------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> str:
        name = self._name(key)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise StoreError(f"Can only store bytes under {key!r}, got {type(data).__name__}.")
        data = bytes(data)
        digest = sha256_hex(data)
        self._ensure_bucket()
        self._call(f"writing {self.url(key)}", lambda: self._bucket.put(name, data, digest))
        return digest

    def create(self, key: str, data: bytes) -> bool:
        # A retried request whose first attempt did land answers 412 too: the caller then finds its
        # own bytes under `key` (a run's owner record names its owner), so no winner goes unnoticed.
        name, data = self._name(key), bytes(data)
        self._ensure_bucket()
        return self._call(f"creating {self.url(key)}", lambda: self._bucket.put_if(name, data, sha256_hex(data), {"If-None-Match": "*"}))

    def replace_if(self, key: str, data: bytes, expected_sha256: str) -> bool:
        name, data = self._name(key), bytes(data)
        found = self._call(f"checking {self.url(key)}", lambda: self._bucket.etag_and_sha256(name))
        if found is None or (found[1] or "").strip().lower() != expected_sha256:
            return False
        condition = {"If-Match": f'"{found[0]}"'}  # the ETag read with the sha256: nobody wrote in between
        return self._call(f"replacing {self.url(key)}", lambda: self._bucket.put_if(name, data, sha256_hex(data), condition))

    def get(self, key: str) -> bytes:
        name = self._name(key)
        where = self.url(key)
        data, recorded = self._call(f"reading {where}", lambda: self._bucket.read(name, where))
        _check_sha256(where, data, recorded)
        return data

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def size(self, key: str) -> int | None:
        name = self._name(key)
        return self._call(f"checking {self.url(key)}", lambda: self._bucket.size(name))

    def list(self, prefix: str = "") -> list[str]:
        prefix = validate_prefix(prefix)
        base = f"{self.prefix}/" if self.prefix else ""
        names = self._call(f"listing {self.url()}/{prefix}", lambda: self._bucket.names(base + prefix))
        return sorted(n[len(base) :] for n in names if n.startswith(base) and not n.endswith("/"))

    def delete(self, key: str) -> None:
        name = self._name(key)
        self._call(f"deleting {self.url(key)}", lambda: self._bucket.remove(name))


def _certifi_where() -> str | None:
    try:
        import certifi
    except ImportError:  # pragma: no cover - minio depends on certifi
        return None
    return certifi.where()
