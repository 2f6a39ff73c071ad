"""The federation tests' markers and grouping (the Flower environment fixture, `flower_env`, is tests/conftest.py's)."""

from __future__ import annotations

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "federation: runs Flower processes (a SuperLink and sites) from scripts/flower-env.sh's environment")
    # pytest-xdist registers it, but not when it is off (-p no:xdist), and the suite runs with --strict-markers
    config.addinivalue_line("markers", "xdist_group(name): tests that --dist loadgroup keeps on one worker")


# One federation at a time: every module that starts Flower processes carries pytest.mark.xdist_group("federation") in its
# own pytestmark, so that `--dist loadgroup` (the Makefile's) runs them all on one worker. Two loopback federations at
# once (a SuperLink and 4-5 site processes each, a ClientApp process per site per message) on 2 cores slowed a
# restarted site past its round's timeout, and a session fixture used on two workers runs its federation twice.


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """pytest-xdist 3.8's loadgroup under pytest 9: xdist's worker appends "@<group>" to each marked item's node id by
    assigning `item._nodeid` (xdist/remote.py, `WorkerInteractor.pytest_collection_modifyitems`), but pytest 9 reads
    the node id from `item._id` (a `NodeId`, _pytest/nodes.py), so the groups were silently ignored and the federation
    modules ran on both workers. Until xdist follows, the suffix is set where pytest 9 reads it."""
    if not config.getoption("loadgroup", False) or not items or not hasattr(items[0], "_id"):  # False without xdist (-p no:xdist)
        return
    from _pytest.nodeid import NodeId

    for item in items:
        groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")})
        if groups and "@" not in item.nodeid:
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(groups)}")
