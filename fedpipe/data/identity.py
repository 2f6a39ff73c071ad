"""Sample identities and the draws made from them: what keeps a sample in the same split across data drops.

A user's data grows drop by drop (`drops/2026-01-01`, `drops/2026-02-01`, ...). If a sample's split were
drawn from its position in the drop, every drop would reshuffle it: a file in one drop's training split
would land in the next drop's test split, and a model line's later versions would be scored on what the
earlier ones learned. So each sample of a user's data carries an identity (`sample_ids`): a 64-bit hash of
what names it, independent of its position and of its label:

- image folders: the client's name and the file's name (`<client>/<label>/<file>` minus the label folder,
  so a relabelled file keeps its identity and therefore its split);
- tables: the client's value and the manifest's `id_column` when it names one, else the client's value
  and the row's input values (features, the image path or bytes, the text), never its label.

`uniform(ids, seed, purpose)` is then a keyed hash of (seed, purpose, identity) mapped to [0, 1): each
split is a threshold on it (`fedpipe.data.partition.make`), a pure function of the sample and the seed.
Two samples with the same identity (a duplicate) always fall in the same split.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

__all__ = ["identity_of", "identities", "uniform"]

_PERSON = b"fedpipe-sample"  # the hash's personalisation: identities are fedpipe's own 64-bit names
_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def identity_of(*parts: str | bytes) -> int:
    """The 64-bit identity of a sample named by `parts` (client, file name; or client, id or values)."""
    h = hashlib.blake2b(digest_size=8, person=_PERSON)
    for part in parts:
        data = part.encode("utf-8", "surrogatepass") if isinstance(part, str) else bytes(part)
        h.update(len(data).to_bytes(8, "little"))  # length-prefixed: ("ab", "c") is not ("a", "bc")
        h.update(data)
    return int.from_bytes(h.digest(), "little")


def identities(rows: Iterable[tuple[str | bytes, ...]]) -> np.ndarray:
    """uint64 identities of many samples, each given by its parts."""
    return np.fromiter((identity_of(*parts) for parts in rows), dtype=np.uint64)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (Steele et al. 2014), vectorised: a bijective mix of 64-bit words."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK
        return x ^ (x >> np.uint64(31))


def uniform(ids: np.ndarray, seed: int, purpose: str) -> np.ndarray:
    """A draw in [0, 1) per identity, fixed by (seed, purpose, identity) alone: float64 with 53 random bits."""
    key = np.uint64(identity_of("split-key", str(int(seed)), purpose))
    mixed = _splitmix64(_splitmix64(np.asarray(ids, dtype=np.uint64) ^ key))
    return (mixed >> np.uint64(11)).astype(np.float64) * 2.0**-53
