"""Progress over a phase's rounds: a tqdm bar on a terminal, one log line per round elsewhere
(Kubeflow task logs, CI), so logs stay readable."""

from __future__ import annotations

import logging
import sys

from tqdm.auto import tqdm

from fedpipe.telemetry.events import PhaseEvent, RoundEvent

log = logging.getLogger("fedpipe.progress")


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record is emitted (not the one at setup, which a
    test runner or a redirect may have closed since)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def log_to_stderr() -> None:
    """fedpipe's messages as plain 'fedpipe: ...' lines on stderr (the CLI, and a pipeline task's log)."""
    logger = logging.getLogger("fedpipe")
    if not logger.handlers:
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("fedpipe: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _fmt(event: RoundEvent) -> dict[str, str]:
    # the server's own terminal: it gets every figure, but copes with an event that withholds some (None)
    post = {}
    if event.train_loss is not None:
        post["loss"] = f"{event.train_loss:.3f}"
    if event.seconds is not None:
        post["s/round"] = f"{event.seconds:.1f}"
    if event.personalized_accuracy is not None:
        post["pers_acc"] = f"{event.personalized_accuracy:.3f}"
    if event.global_accuracy is not None:
        post["glob_acc"] = f"{event.global_accuracy:.3f}"
    if event.failed_clients:
        post["failed"] = str(event.failed_clients)
    return post


class ProgressSink:
    def __init__(self, interactive: bool | None = None) -> None:
        self.interactive = sys.stderr.isatty() if interactive is None else interactive
        self.bar: tqdm | None = None

    def phase_started(self, event: PhaseEvent) -> None:
        name = f"{event.labels.method} · {event.labels.phase}"
        if self.interactive:
            self.bar = tqdm(total=event.total_rounds, desc=name, unit="round", dynamic_ncols=True)
        else:
            log.info("%s: %d rounds", name, event.total_rounds)

    def round_finished(self, event: RoundEvent) -> None:
        post = _fmt(event)
        if self.bar is None:
            log.info("%s round %d/%d: %s", event.labels.phase, event.phase_round, event.phase_rounds,
                     ", ".join(f"{k} {v}" for k, v in post.items()))
            return
        if self.bar.n == 0 and event.phase_round > 1:
            self.bar.update(event.phase_round - 1)  # rounds finished before a restart
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def phase_finished(self, event: PhaseEvent) -> None:
        self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
