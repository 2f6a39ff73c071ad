"""Where fedpipe's ServerApp may read and write: below the places its SuperLink's deployment fixes, whatever a run
config names.

A run config comes from whoever submitted the run (`flwr run --run-config`), so the ServerApp takes none of its paths
on trust. The deployment fixes them in the SuperLink's environment, which the ServerApp inherits (Flower 1.42's
SuperExec starts it as a subprocess with the SuperLink's environment, flwr/supercore/superexec/executor/
subprocess_executor.py):

    FEDPIPE_SERVER_ROOT    a folder: a run's `out-dir` and `spec-file` (the try-out's kind of run) must resolve below
                           it (symlinks resolved, `..` refused). The try-out sets its own work folder. Unset: such
                           runs are refused.
    FEDPIPE_SERVER_STORE   the run store: a run's `store` must be this one (the chart sets runConfig.run.store; several,
                           separated by commas, when one SuperLink serves runs of more than one store). Unset: store
                           runs are refused.
    FEDPIPE_SERVER_PREFIX  optional: a run's `prefix` must lie below it (e.g. one team's runs in a shared store).

Every refusal names the value and the allowed place, and comes before anything is read, written or deleted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from fedpipe.errors import ConfigError

ROOT_ENV = "FEDPIPE_SERVER_ROOT"
STORE_ENV = "FEDPIPE_SERVER_STORE"
PREFIX_ENV = "FEDPIPE_SERVER_PREFIX"
FEDERATION_SUFFIX = "/federation"  # fedpipe.federation.outputs.federation_prefix: every run's prefix ends with it


class PlaceRefused(ConfigError):
    """A run config named a place outside the one the SuperLink's deployment fixes."""


def local_place(value: str, what: str, environ: Mapping[str, str] = os.environ) -> Path:
    """`value` (the run config's `what`: out-dir or spec-file) resolved, refused unless it lies below FEDPIPE_SERVER_ROOT."""
    root = environ.get(ROOT_ENV, "")
    if not root:
        raise PlaceRefused(f"run config {what}={value!r}: this SuperLink's deployment fixes no folder for its ServerApp "
                           f"({ROOT_ENV} is unset), so it takes no local {what}; submit with the run's store (`fedpipe run`), "
                           f"or start the SuperLink with {ROOT_ENV}")
    if not value:
        raise PlaceRefused(f"run config {what} is empty: name a path below {root}")
    path = Path(value)
    if not path.is_absolute() or ".." in path.parts:
        raise PlaceRefused(f"run config {what}={value!r} is not an absolute path without '..': name a path below {root}")
    allowed, resolved = Path(root).resolve(), path.resolve()  # symlinks resolved, also of parts that exist
    if resolved != allowed and allowed not in resolved.parents:
        raise PlaceRefused(f"run config {what}={value!r} ({resolved}) is outside {allowed}, the folder this SuperLink's "
                           f"deployment lets its ServerApp use ({ROOT_ENV})")
    return resolved


def _same_store(a: str, b: str) -> bool:
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return Path(a).resolve() == Path(b).resolve()  # a folder store: the same folder, however written


def store_place(store: str, prefix: str, environ: Mapping[str, str] = os.environ) -> tuple[str, str]:
    """(store, prefix) of a run config, refused unless the store is FEDPIPE_SERVER_STORE and the prefix a run's
    federation prefix (`<run>/federation`, no '..', no leading '/') below FEDPIPE_SERVER_PREFIX (when set)."""
    fixed = environ.get(STORE_ENV, "")
    if not fixed:
        raise PlaceRefused(f"run config store={store!r}: this SuperLink's deployment names no run store ({STORE_ENV} is "
                           "unset), so its ServerApp writes to none; set it to the store the runs use (the chart sets "
                           "runConfig.run.store)")
    if not any(_same_store(store, one.strip()) for one in fixed.split(",") if one.strip()):
        raise PlaceRefused(f"run config store={store!r} is not {fixed!r}, the run store this SuperLink's deployment serves "
                           f"({STORE_ENV})")
    parts = prefix.split("/")
    if (not prefix.endswith(FEDERATION_SUFFIX) or prefix.startswith("/") or "\\" in prefix
            or any(p in ("", ".", "..") for p in parts)):
        raise PlaceRefused(f"run config prefix={prefix!r} is not a run's federation prefix ('<run>{FEDERATION_SUFFIX}', "
                           f"relative, without '.', '..' or empty parts) inside {fixed}")
    below = environ.get(PREFIX_ENV, "").strip("/")
    if below and not prefix.startswith(below + "/"):
        raise PlaceRefused(f"run config prefix={prefix!r} is not below {below}/ in {fixed}, where this SuperLink's "
                           f"deployment lets its ServerApp write ({PREFIX_ENV})")
    return store, prefix
