"""How much memory a drop may take once decoded (`data.max_decoded_mb`), and the count kept while it is read.

A drop's files are small on disk and can be huge decoded (a PNG of one colour, a Parquet column of one repeated
value, a text of one repeated word), so what they take is counted, not what they weigh. Readers ask the budget
before they allocate: `fits` for what a step needs for a moment (decoding one image, tokenizing one text) and
`charge` for what is kept (the pixels, the rows). The first request past the budget is an error that names the
file, what it would take, the budget and how to raise it.

`data.max_decoded_mb: auto` (the default) is a share of the memory this process may use (`auto_decoded_mb`):
AUTO_FRACTION of the smallest of the container's memory limit (cgroup v2 `memory.max`, or v1
`memory.limit_in_bytes`, the smallest along the process's cgroup and its parents), the process's own
address-space limit (`ulimit -v`) and what the machine has available (MemAvailable); at least AUTO_FLOOR_MB, at
most AUTO_CAP_MB. A quarter, because what is decoded is then
copied and converted for training (uint8 pixels become float32), and the process holds more besides.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from fedpipe.data.files.rows import Problems

__all__ = ["AUTO_CAP_MB", "AUTO_FLOOR_MB", "AUTO_FRACTION", "DecodeBudget", "auto_decoded_mb", "available_memory"]

AUTO_FRACTION = 0.25  # of the memory the process may use
AUTO_FLOOR_MB = 256  # never less: a small drop must load on a small pod
AUTO_CAP_MB = 16_384  # never more (the fixed default before `auto`): a larger drop is a choice, made by setting it
FALLBACK_BYTES = 4 * 2**30  # what is assumed when neither a limit nor /proc/meminfo can be read
_UNLIMITED = 2**60  # cgroup v1 writes "no limit" as a number near 2^63


def _limit(path: Path) -> int | None:
    """The memory limit a cgroup file holds, in bytes; None when unset ("max", a near-2^63 number) or unreadable."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit() or int(text) >= _UNLIMITED:
        return None
    return int(text)


def _cgroup_limit(proc: Path, cgroup: Path) -> tuple[int, str] | None:
    """The smallest memory limit on this process's cgroup and its parents (v2, else v1), and its file."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    found: list[tuple[int, str]] = []
    for line in lines:
        hid, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0" and controllers == "":  # v2: one unified hierarchy
            base, name = cgroup, "memory.max"
        elif "memory" in controllers.split(","):  # v1: the memory controller's hierarchy
            base, name = cgroup / "memory", "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.strip().split("/") if p and p != ".."]
        for depth in range(len(parts), -1, -1):  # the process's own group, then each parent up to the root
            file = base.joinpath(*parts[:depth], name)
            limit = _limit(file)
            if limit is not None:
                found.append((limit, str(file)))
    return min(found) if found else None


def _meminfo(proc: Path, field: str) -> int | None:
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _rlimit() -> int | None:
    """The process's own address-space limit (`ulimit -v`, RLIMIT_AS), when set."""
    try:
        import resource
    except ImportError:  # not on Linux or macOS
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY or soft <= 0 else int(soft)


def available_memory(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup"),
                     rlimit: int | None | Literal["read"] = "read") -> tuple[int, str]:
    """The bytes this process may use and where that figure comes from: the smallest of the container's memory
    limit (cgroup), the process's address-space limit (`ulimit -v`) and the machine's available memory
    (MemAvailable; physical memory when /proc/meminfo has none)."""
    found: list[tuple[int, str]] = []
    limit = _cgroup_limit(proc, cgroup)
    if limit is not None:
        found.append((limit[0], f"the memory limit in {limit[1]}"))
    own = _rlimit() if rlimit == "read" else rlimit
    if own is not None:
        found.append((own, "the process's address-space limit, ulimit -v"))
    free = _meminfo(proc, "MemAvailable")
    if free is not None:
        found.append((free, "MemAvailable in /proc/meminfo"))
    else:
        try:
            found.append((os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "physical memory"))
        except (OSError, ValueError, AttributeError):
            pass
    return min(found) if found else (FALLBACK_BYTES, "an assumed 4 GiB: no limit and no /proc/meminfo could be read")


def auto_decoded_mb(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup"),
                    rlimit: int | None | Literal["read"] = "read") -> tuple[int, str]:
    """`data.max_decoded_mb: auto`: (MB, how it was chosen) — AUTO_FRACTION of `available_memory`, within
    AUTO_FLOOR_MB..AUTO_CAP_MB."""
    nbytes, source = available_memory(proc, cgroup, rlimit)
    mb = min(AUTO_CAP_MB, max(AUTO_FLOOR_MB, int(nbytes * AUTO_FRACTION) // 2**20))
    return mb, (f"data.max_decoded_mb=auto: {AUTO_FRACTION:.0%} of the {nbytes / 2**30:,.1f} GiB this process may use ({source}), "
                f"within {AUTO_FLOOR_MB:,}..{AUTO_CAP_MB:,} MB")


class DecodeBudget:
    """The bytes a whole drop may take once decoded (images as pixels, table values after dictionary expansion,
    the words of a text column): bounds per file alone let a few small, highly compressible files claim gigabytes.
    Readers `charge` what they keep and ask `fits` for what one step needs for a moment, both before allocating;
    the first request past the budget is an error naming the file, the size and the budget."""

    def __init__(self, max_mb: int | Literal["auto"] = "auto"):
        if max_mb == "auto":
            max_mb, self.chosen = auto_decoded_mb()
        else:
            self.chosen = "data.max_decoded_mb"
        self.limit, self.used, self.exhausted = int(max_mb) * 2**20, 0, False

    @property
    def left(self) -> int:
        return self.limit - self.used

    def _refuse(self, nbytes: int, where: str, what: str, problems: Problems) -> bool:
        self.exhausted = True
        problems.error("over the decoding budget", where,
                       f"{what} would take {nbytes / 2**20:,.1f} MB decoded, past the drop's budget of {self.limit // 2**20:,} MB "
                       f"({self.chosen}; {self.used / 2**20:,.1f} MB used by the files before it); the data is far larger "
                       "than its files or a compression bomb. Shrink or remove it, or raise data.max_decoded_mb (in MB, "
                       "e.g. --set data.max_decoded_mb=32768) if the data is really this large and the memory is there")
        return False

    def charge(self, nbytes: int, where: str, what: str, problems: Problems) -> bool:
        """Count `nbytes` about to be decoded from `where` and kept; False (an error recorded) when past the budget."""
        if self.exhausted:
            return False
        if nbytes > self.left:
            return self._refuse(nbytes, where, what, problems)
        self.used += nbytes
        return True

    def fits(self, nbytes: int, where: str, what: str, problems: Problems) -> bool:
        """Whether a step needing `nbytes` for a moment (freed when it ends) fits what the drop has left; False (an
        error recorded) when not. Nothing is counted."""
        if self.exhausted:
            return False
        return True if nbytes <= self.left else self._refuse(nbytes, where, what, problems)
