"""Signed artifacts (opt-in): an HMAC-SHA256 over every object, so that whoever can write the bucket
cannot rewrite an object unnoticed.

A plain store's sha256 catches damage, not tampering: anyone who can write the bucket (or the folder)
rewrites an object and its sha256 together. `SignedStore` wraps any `Store` and keeps, with every
object, an HMAC-SHA256 made with a key the tasks of a run share and the bucket's writers do not have:

``FEDPIPE_SIGNING_KEY``            the key itself (at least 32 bytes; ``openssl rand -hex 32`` makes one)
``FEDPIPE_SIGNING_KEY_FILE``       or a file holding it (a mounted Kubernetes Secret); one trailing
                                   newline is dropped
``FEDPIPE_SIGNING_ALLOW_UNSIGNED`` optional, ``1`` to read objects written before signing was turned
                                   on (with a warning per object); writes are signed all the same

`open_store` wraps every store it opens while a key is set. The key is never logged, never put in a
message, a run record or a written object; objects carry only a key id (a MAC of a constant, which
tells nothing of the key) so that a message can say "signed with another key".

The envelope: the MAC travels IN the object, as one fixed-length header line before the bytes::

    fedpipe-signed-v1 kid=<16 hex> hmac-sha256=<64 hex>\\n<the bytes>

so one atomic write of the wrapped store (one S3 PUT, one rename) puts bytes and MAC in place
together, and the wrapped store needs no change: its sha256 covers the envelope and still catches
damage. A ``<key>.sig`` companion object would be a second write (a reader between the two sees a
fresh object with a stale MAC, a crash leaves them apart) and would show up in listings; S3 user
metadata or a second folder sidecar would need a change to each store. The price: with signing on, a
folder store's files start with that line, so a report PNG does not open straight from the folder.

The MAC covers the object's key as well as its bytes (``HMAC(k, "fedpipe-signed-artifact-v1" NUL key
NUL bytes)``; a key never holds NUL), so an object copied or moved to another key is refused. The
key is the store-relative one, so a whole store copied elsewhere (a bucket mirrored, a run folder
downloaded) still verifies. Not covered: replaying an older signed version of the same key, and
deleting objects (the run manifest that `fedpipe verify` checks names a missing one).

`put` returns, and `replace_if` compares, the sha256 of the caller's bytes (what `get` gives), so run
manifests, state pointers and owner records read the same with signing on or off. A task WITHOUT the key
reading a signed object through a plain store gets the envelope (header line included) and fails to
parse it: the key must reach every task of a run.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
from collections.abc import Callable, Mapping

from fedpipe.errors import ArtifactSignatureError, ConfigError, CorruptArtifactError, StoreError
from fedpipe.store.base import Store, sha256_hex, validate_key

__all__ = [
    "ENV_ALLOW_UNSIGNED",
    "ENV_SIGNING_KEY",
    "ENV_SIGNING_KEY_FILE",
    "HEADER_BYTES",
    "MIN_KEY_BYTES",
    "SignedStore",
    "allow_unsigned_from_env",
    "signing_from_env",
    "signing_key_from_env",
    "verifies_signatures",
]

log = logging.getLogger(__name__)

ENV_SIGNING_KEY = "FEDPIPE_SIGNING_KEY"
ENV_SIGNING_KEY_FILE = "FEDPIPE_SIGNING_KEY_FILE"
ENV_ALLOW_UNSIGNED = "FEDPIPE_SIGNING_ALLOW_UNSIGNED"

MIN_KEY_BYTES = 32
MAX_KEY_FILE_BYTES = 4096

MAGIC = b"fedpipe-signed-v1 "
_DOMAIN = b"fedpipe-signed-artifact-v1\x00"
_KEY_ID_DOMAIN = b"fedpipe-signing-key-id-v1"
_HEADER_RE = re.compile(rb"fedpipe-signed-v1 kid=([0-9a-f]{16}) hmac-sha256=([0-9a-f]{64})\n")
#: Every signed object starts with exactly this many header bytes.
HEADER_BYTES = len(MAGIC) + len("kid=") + 16 + len(" hmac-sha256=") + 64 + 1

_SAME_KEY = f"The signing key ({ENV_SIGNING_KEY} or {ENV_SIGNING_KEY_FILE}) must be the same for every task of a run."


def _strip_newline(raw: bytes) -> bytes:
    """Drop one trailing newline (``echo`` and ``--from-file`` Secrets add one), nothing else."""
    if raw.endswith(b"\r\n"):
        return raw[:-2]
    return raw[:-1] if raw.endswith(b"\n") else raw


def _key_from_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(
            f"{ENV_SIGNING_KEY_FILE}={path!r} cannot be read ({exc.strerror or type(exc).__name__}): point it at "
            "the file that holds the artifact signing key (in a pod, the mounted Secret's file), or unset it to "
            "turn signing off."
        ) from None
    if len(raw) > MAX_KEY_FILE_BYTES:
        raise ConfigError(
            f"{ENV_SIGNING_KEY_FILE}={path!r} is longer than {MAX_KEY_FILE_BYTES} bytes: that is not a signing key "
            "file. Point it at a file holding only the key."
        )
    return _strip_newline(raw)


def signing_key_from_env(env: Mapping[str, str] | None = None) -> bytes | None:
    """The artifact signing key from FEDPIPE_SIGNING_KEY or FEDPIPE_SIGNING_KEY_FILE; None when neither is
    set (signing off). A key shorter than 32 bytes, both set, or one set but empty is a ConfigError; no
    message ever holds the key."""
    env = os.environ if env is None else env
    direct, path = env.get(ENV_SIGNING_KEY), env.get(ENV_SIGNING_KEY_FILE)
    if direct is None and path is None:
        return None
    if direct is not None and path is not None:
        raise ConfigError(
            f"Both {ENV_SIGNING_KEY} and {ENV_SIGNING_KEY_FILE} are set: set only one (the file for a mounted "
            "Secret), so that it is clear which artifact signing key is used."
        )
    name = ENV_SIGNING_KEY if direct is not None else f"{ENV_SIGNING_KEY_FILE} ({path})"
    if direct is not None:
        key = _strip_newline(direct.encode("utf-8"))
    else:
        if not path.strip():
            raise ConfigError(f"{ENV_SIGNING_KEY_FILE} is set but empty: name the key file, or unset it.")
        key = _key_from_file(path)
    if not key.strip():
        raise ConfigError(
            f"{name} is set but the key is empty: artifact signing needs a key of at least {MIN_KEY_BYTES} bytes. "
            f"Unset {name} to turn signing off, or give it a key made with `openssl rand -hex 32`."
        )
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(
            f"The artifact signing key in {name} is {len(key)} bytes long; it must be at least {MIN_KEY_BYTES} "
            "bytes of random data, or a bucket writer could guess it. Make one with `openssl rand -hex 32` "
            "and use the same key for every task of a run."
        )
    return key


def allow_unsigned_from_env(env: Mapping[str, str] | None = None) -> bool:
    """FEDPIPE_SIGNING_ALLOW_UNSIGNED as a bool (unset: False)."""
    env = os.environ if env is None else env
    raw = env.get(ENV_ALLOW_UNSIGNED, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ConfigError(f"{ENV_ALLOW_UNSIGNED}={raw!r} is not a yes/no value: use 1 to read unsigned objects, or 0.")


def _mac(secret: bytes, key: str, data: bytes) -> str:
    return hmac.new(secret, _DOMAIN + key.encode("utf-8") + b"\x00" + data, hashlib.sha256).hexdigest()


def key_id(secret: bytes) -> str:
    """A short public name for a signing key: a MAC of a constant, which tells nothing of the key."""
    return hmac.new(secret, _KEY_ID_DOMAIN, hashlib.sha256).hexdigest()[:16]


class SignedStore(Store):
    """Any store, with every object signed on `put` and its signature checked on `get`."""

    def __init__(self, inner: Store, secret: bytes, *, allow_unsigned: bool = False):
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_KEY_BYTES:
            raise ConfigError(f"An artifact signing key must be at least {MIN_KEY_BYTES} bytes.")
        self.inner = inner
        self.allow_unsigned = allow_unsigned
        self._secret = bytes(secret)
        self.key_id = key_id(self._secret)

    def __repr__(self) -> str:  # never the key
        return f"SignedStore({self.inner!r}, key_id={self.key_id!r})"

    def _envelope(self, key: str, data: bytes) -> bytes:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise StoreError(f"Can only store bytes under {key!r}, got {type(data).__name__}.")
        data = bytes(data)
        mac = _mac(self._secret, key, data)
        return b"%skid=%s hmac-sha256=%s\n" % (MAGIC, self.key_id.encode(), mac.encode()) + data

    def put(self, key: str, data: bytes) -> str:
        key = validate_key(key)
        envelope = self._envelope(key, data)
        self.inner.put(key, envelope)
        return sha256_hex(envelope[HEADER_BYTES:])  # the caller's bytes: what run manifests record and `verify` recomputes

    def put_many(self, items: Mapping[str, bytes]) -> Mapping[str, str]:
        envelopes = {validate_key(k): self._envelope(validate_key(k), d) for k, d in items.items()}
        self.inner.put_many(envelopes)
        return {k: sha256_hex(e[HEADER_BYTES:]) for k, e in envelopes.items()}

    def create(self, key: str, data: bytes) -> bool:
        key = validate_key(key)
        return self.inner.create(key, self._envelope(key, data))

    def replace_if(self, key: str, data: bytes, expected_sha256: str) -> bool:
        """`expected_sha256` is that of the bytes `get` gives (the payload); the wrapped store's
        compare-and-swap then runs on the sha256 of the signed object read here, so a write in between
        still makes it fail. An object that does not verify is never replaced (False), like a plain
        store's object whose sha256 differs."""
        key = validate_key(key)
        envelope = self._envelope(key, data)
        try:
            stored = self.inner.get(key)
            current = self._open(key, stored)
        except CorruptArtifactError:
            return False
        except StoreError:
            if self.inner.exists(key):
                raise
            return False
        if sha256_hex(current) != expected_sha256.strip().lower():
            return False
        return self.inner.replace_if(key, envelope, sha256_hex(stored))

    def get(self, key: str) -> bytes:
        key = validate_key(key)
        return self._open(key, self.inner.get(key))

    def _open(self, key: str, blob: bytes) -> bytes:
        """The bytes inside a signed object, or ArtifactSignatureError naming `key` and saying why not."""
        where = self.inner.url(key)
        if not blob.startswith(MAGIC):
            if self.allow_unsigned:
                log.warning("Reading the unsigned artifact %s (%s is set).", where, ENV_ALLOW_UNSIGNED)
                return blob
            raise ArtifactSignatureError(
                f"The artifact {where} has no signature, but artifact signing is on ({ENV_SIGNING_KEY} or "
                f"{ENV_SIGNING_KEY_FILE} is set), so it is refused: it was written by a task without the signing "
                f"key, or replaced by someone else. {_SAME_KEY} To read a run written before signing was turned "
                f"on, set {ENV_ALLOW_UNSIGNED}=1 (new objects are still signed)."
            )
        match = _HEADER_RE.match(blob)
        if match is None:
            raise ArtifactSignatureError(
                f"The artifact {where} has a malformed signature line, so the signature does not match and it is "
                "refused: it was changed after it was written. Delete it and re-run the step that produces it."
            )
        data = blob[HEADER_BYTES:]
        if hmac.compare_digest(match[2].decode(), _mac(self._secret, key, data)):
            return data
        kid = match[1].decode()
        if kid != self.key_id:
            why = (
                f"it was signed with another signing key (key id {kid}; this task's key has id {self.key_id}), "
                "or changed by someone without the key."
            )
        else:
            why = (
                "it was changed after it was signed (its bytes and plain sha256 rewritten together), or moved "
                "here from another key."
            )
        raise ArtifactSignatureError(
            f"The artifact {where} is refused: its signature does not match; {why} {_SAME_KEY} Delete it and "
            "re-run the step that produces it, or restore it from a trusted copy."
        )

    def size(self, key: str) -> int | None:
        # The envelope's size less the header; an unsigned object read with allow_unsigned is then
        # under-counted by at most HEADER_BYTES, and the reader still checks the bytes it gets.
        stored = self.inner.size(key)
        return None if stored is None else max(0, stored - HEADER_BYTES)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def delete_folder(self, prefix: str) -> None:
        self.inner.delete_folder(prefix)

    def url(self, key: str = "") -> str:
        return self.inner.url(key)


def signing_from_env(env: Mapping[str, str] | None = None) -> Callable[[Store], Store]:
    """What to do to each store opened in this environment: wrap it in a `SignedStore` when a signing key
    is set, else nothing. Read (and its errors raised) before any store is opened."""
    secret = signing_key_from_env(env)
    if secret is None:
        return lambda store: store
    allow_unsigned = allow_unsigned_from_env(env)
    return lambda store: SignedStore(store, secret, allow_unsigned=allow_unsigned)


def verifies_signatures(store: Store) -> bool:
    """Whether every object read through `store` was verified against the signing key: a SignedStore that does
    not let unsigned objects through (FEDPIPE_SIGNING_ALLOW_UNSIGNED unset)."""
    return isinstance(store, SignedStore) and not store.allow_unsigned
