"""The `fedpipe` command line: one module per command group, each adding its commands to `app` (in the order
`fedpipe --help` lists them).

- `common`: the app, the options every group takes, errors as one paragraph and exit code 2;
- `run`: run, partition, train, evaluate, verify, config;
- `deploy`: compile, register, submit, schedule, unschedule (and the deployment flags);
- `check`: what a run needs, checked from a pod; `info`: methods, datasets;
- `data`: your own data (init, check); `site`: a site of a real federation (keygen, join, try); `models`: model lines and predict; `study`: studies;
- `reproduce`: a paper's table run as the paper describes it, reported beside its numbers.
- `privacy`: a run's differential privacy planned (privacy plan).
"""

from __future__ import annotations

import importlib

from fedpipe.cli.common import app

for _group in ("run", "deploy", "check", "info", "data", "site", "federation", "models", "study", "reproduce", "privacy"):  # each adds its commands, in this order
    importlib.import_module(f"fedpipe.cli.{_group}")

__all__ = ["app", "main"]


def main() -> None:
    app()
