"""A site's SuperNode: Flower 1.42's own (`flower-supernode`, flwr/supernode/cli/flower_supernode.py), started by the
site's worker (`fedpipe.federation.worker`) with a shorter wait between its pulls.

Flower's SuperNode loop (flwr/supernode/start_client_internal.py, `start_client_internal`) pulls the SuperLink for a
message and, when there is none, sleeps 3 s before the next pull; after taking a message it polls its own state for
the reply every 0.5 s. In a synchronous federation every site has just pushed its reply when it pulls again, finds
nothing (the server is still waiting for the other sites) and sleeps the full 3 s, so every round pays about 3 s of
nothing (a SecAgg+ round, four exchanges, 12 s). Here the loop's `time` is a `PullClock`: after a message the site
asks again within 50 ms, then a quarter longer each time, up to `FEDPIPE_SITE_PULL_INTERVAL` seconds (default 1), a
small request over the connection it already holds; its waits on its own memory (the worker's reply) take 20 ms
instead of 0.5 s; and it pulls a message's content with a short backoff (`quick_pulls`). Nothing else of the
SuperNode changes.
"""

from __future__ import annotations

import os
import sys
import time

#: A message's objects may still be on their way when its receiver pulls them (a task is handed out, a reply listed,
#: before all its content has arrived); Flower's `pull_objects` then waits 1 s, doubling up to 10 s
#: (flwr/supercore/constant.py PULL_INITIAL_BACKOFF, PULL_BACKOFF_CAP), which cost every exchange of a round about a
#: second. fedpipe's processes (this SuperNode, the site worker, the ServerApp) retry after 20 ms, doubling up to 0.25 s.
PULL_BACKOFF, PULL_BACKOFF_CAP = 0.02, 0.25
PULL_ENV = "FEDPIPE_SITE_PULL_INTERVAL"
DEFAULT_PULL = 1.0


#: the loop's other waits (0.5 s) poll the SuperNode's own memory: for the worker's reply, for an object's content
LOCAL_WAIT = 0.02
#: the idle pull's first wait after a message, and how much longer each next one is (up to the most)
FIRST_WAIT, GROWTH = 0.05, 1.25


class PullClock:
    """The `time` module, but the loop's idle wait (Flower's `time.sleep(3)`) starts at FIRST_WAIT after each message
    and grows by GROWTH per empty pull up to `most` seconds, and its waits on its own state (Flower's 0.5 s) are
    LOCAL_WAIT. A site that has just answered asks again soon (the next exchange of a round is usually a second or
    two away); an idle site asks at most once every `most` seconds, so a machine of many sites is not kept busy by
    their polls."""

    def __init__(self, most: float):
        self.most, self.wait, self.worked = most, FIRST_WAIT, False

    def sleep(self, seconds: float) -> None:
        if seconds < 3:  # a wait on its own memory: a message is being answered
            self.worked = True
            time.sleep(LOCAL_WAIT)
            return
        if self.worked:
            self.wait, self.worked = FIRST_WAIT, False
        time.sleep(min(self.wait, self.most))
        self.wait = min(self.wait * GROWTH, self.most)

    def __getattr__(self, name):
        return getattr(time, name)


def quick_pulls(module) -> None:
    """Make the `pull_objects` that Flower's `module` calls retry with fedpipe's backoff (PULL_BACKOFF)."""
    from functools import partial

    from flwr.supercore.inflatable.inflatable_utils import pull_objects

    module.pull_objects = partial(pull_objects, initial_backoff=PULL_BACKOFF, backoff_cap=PULL_BACKOFF_CAP)


def main() -> None:
    from flwr.supernode import start_client_internal as loop
    from flwr.supernode.cli.flower_supernode import flower_supernode

    most = float(os.environ.get(PULL_ENV, DEFAULT_PULL))
    if not 0.01 <= most <= 3.0:
        sys.exit(f"{PULL_ENV}={most}: between 0.01 and 3 seconds (Flower's own wait is 3)")
    loop.time = PullClock(most)
    quick_pulls(loop)  # the message's content from the SuperLink (`_pull_and_store_message`)
    sys.argv[0] = "flower-supernode"
    flower_supernode()


if __name__ == "__main__":
    main()
