"""Every random draw is derived from (run seed, purpose, round, client), never from a running state.

So a phase resumed from round r draws exactly what an uninterrupted run draws at round r + 1,
clients run in any order (or at once) draw the same numbers, and adding randomness to one method
does not shift another's.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch


def derive_seed(seed: int, *keys: int | str) -> int:
    """A 63-bit seed for the stream named by `keys` under run seed `seed`."""
    words = [zlib.crc32(k.encode()) if isinstance(k, str) else int(k) for k in keys]
    return int(np.random.SeedSequence(entropy=int(seed), spawn_key=words).generate_state(2, np.uint32).view(np.uint64)[0] >> 1)


def torch_generator(seed: int, *keys: int | str) -> torch.Generator:
    """A CPU torch.Generator for the stream named by `keys`."""
    return torch.Generator().manual_seed(derive_seed(seed, *keys))
