"""A site's SuperNode: Flower 1.42's own (`flower-supernode`, flwr/supernode/cli/flower_supernode.py), started by the
site's worker (`fedpipe.federation.worker`) with a shorter wait between its pulls.

Flower's SuperNode loop (flwr/supernode/start_client_internal.py, `start_client_internal`) pulls the SuperLink for a
message and, when there is none, sleeps 3 s before the next pull; after taking a message it polls its own state for
the reply every 0.5 s. In a synchronous federation every site has just pushed its reply when it pulls again, finds
nothing (the server is still waiting for the other sites) and sleeps the full 3 s, so every round pays about 3 s of
nothing. Here the loop's `time` is a clock whose `sleep` is at most `FEDPIPE_SITE_PULL_INTERVAL` seconds (default
0.25): an idle site asks the SuperLink 4 times a second instead of once every 3 seconds, a small request over the
connection it already holds. Nothing else of the SuperNode changes.
"""

from __future__ import annotations

import os
import sys
import time

PULL_ENV = "FEDPIPE_SITE_PULL_INTERVAL"
DEFAULT_PULL = 0.25


class PullClock:
    """The `time` module, but `sleep` waits at most `most` seconds."""

    def __init__(self, most: float):
        self.most = most

    def sleep(self, seconds: float) -> None:
        time.sleep(min(seconds, self.most))

    def __getattr__(self, name):
        return getattr(time, name)


def main() -> None:
    from flwr.supernode import start_client_internal as loop
    from flwr.supernode.cli.flower_supernode import flower_supernode

    most = float(os.environ.get(PULL_ENV, DEFAULT_PULL))
    if not 0.01 <= most <= 3.0:
        sys.exit(f"{PULL_ENV}={most}: between 0.01 and 3 seconds (Flower's own wait is 3)")
    loop.time = PullClock(most)
    sys.argv[0] = "flower-supernode"
    flower_supernode()


if __name__ == "__main__":
    main()
