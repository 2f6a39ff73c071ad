"""Fixtures of the federation tests: the Flower environment (scripts/flower-env.sh), built or reused once a session."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLOWER_ENV = ROOT / ".cache" / "flower-venv"


def pytest_configure(config):
    config.addinivalue_line("markers", "federation: runs Flower processes (a SuperLink and sites) from scripts/flower-env.sh's environment")
    # pytest-xdist registers it, but not when it is off (-p no:xdist), and the suite runs with --strict-markers
    config.addinivalue_line("markers", "xdist_group(name): tests that --dist loadgroup keeps on one worker")


def pytest_collection_modifyitems(items):
    """One federation at a time: under pytest-xdist (`--dist loadgroup`, the Makefile's) every federation test runs
    on one worker. Two loopback federations at once (a SuperLink and 4-5 site processes each, a ClientApp process
    per site per round) on 2 cores slowed a restarted site past its round's timeout."""
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.xdist_group("federation"))


@pytest.fixture(scope="session")
def flower_env() -> Path:
    """The Flower 1.42 environment; built by scripts/flower-env.sh when missing or stale (about a minute here)."""
    r = subprocess.run(["nice", "-n", "10", "bash", str(ROOT / "scripts" / "flower-env.sh"), str(FLOWER_ENV)],
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        pytest.fail(f"scripts/flower-env.sh could not build the Flower environment at {FLOWER_ENV} (exit {r.returncode}); "
                    f"the federation tests need it:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return FLOWER_ENV
