"""What every command group shares: the app, the common options, and turning a user-fixable error into one
paragraph and exit code 2."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated, Optional

import typer

from fedpipe.errors import FedpipeError
from fedpipe.telemetry.progress import log_to_stderr

app = typer.Typer(
    name="fedpipe",
    help=(
        "Personalized federated learning (SuPerFed and its baselines) as a pipeline of steps: "
        "partition -> train each phase -> evaluate.\n\n"
        "Every command reads one config (YAML, see examples/; without --config the defaults run "
        "SuPerFed-MM on mnist5k, pathological split, 20 clients) and takes --set overrides such as "
        "--set train.rounds=50 --set method.name=fedavg. Artifacts go to the store (run.store: a "
        "folder, or s3://bucket/prefix) under the run's id; rerunning the same config resumes it."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="YAML run config (see examples/). Default: built-in defaults.")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", "-s", help="Override one field, e.g. --set train.rounds=50 (repeatable).")]
RunIdOpt = Annotated[Optional[str], typer.Option("--run-id", help="Folder name of the run in the store (default: derived from the config).")]


def _guarded(fn):
    """Turn a user-fixable error into one plain paragraph and exit code 2 (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        log_to_stderr()
        try:
            return fn(*args, **kwargs)
        except FedpipeError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None

    return wrapper


def _load(config: Optional[Path], overrides: Optional[list[str]], run_id: Optional[str] = None):
    """The config as written (defaults, file, --set): what is compiled into a pipeline or shown."""
    from fedpipe.run.config import load_config

    sets = list(overrides or [])
    if run_id:
        sets.append(f"run.id={run_id}")
    return load_config(config, sets)


def _load_for_run(config: Optional[Path], overrides: Optional[list[str]], run_id: Optional[str] = None):
    """The config of a run that starts here, with what it starts from pinned: its own data's snapshot (and
    the `latest` drop it reads) and the model-line version it warm-starts from, so both are in its id. Never
    for a compiled pipeline: its config task pins them when each run starts (a schedule must not freeze
    today's drop or today's promoted version)."""
    from fedpipe.models.warm import pin_init_from
    from fedpipe.run.config import with_data_snapshot

    return pin_init_from(with_data_snapshot(_load(config, overrides, run_id)))


def _print_summary(summary: dict) -> None:
    from fedpipe.run.report import summary_lines

    typer.echo("\n".join(summary_lines(summary)))
