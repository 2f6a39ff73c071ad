"""The `fedpipe` command line."""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from fedpipe.errors import FedpipeError

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
        logging.basicConfig(level=logging.INFO, format="fedpipe: %(message)s", stream=sys.stderr)
        logging.getLogger("fedpipe").setLevel(logging.INFO)
        try:
            return fn(*args, **kwargs)
        except FedpipeError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None

    return wrapper


def _load(config: Optional[Path], overrides: Optional[list[str]], run_id: Optional[str] = None):
    from fedpipe.config import load_config

    sets = list(overrides or [])
    if run_id:
        sets.append(f"run.id={run_id}")
    return load_config(config, sets)


def _print_summary(summary: dict) -> None:
    from fedpipe.report import summary_lines

    typer.echo("\n".join(summary_lines(summary)))


@app.command()
@_guarded
def run(config: ConfigOpt = None, set: SetOpt = None, run_id: RunIdOpt = None,
        fresh: Annotated[bool, typer.Option("--fresh", help="Delete the run's earlier artifacts and start over.")] = False):
    """Run every step of the method: partition, each training phase, evaluation; print a summary.

    A run that was interrupted resumes from its last finished round; a finished step is reused.
    """
    from fedpipe.steps import Run

    r = Run(_load(config, set, run_id))
    if fresh:
        r.fresh()
    _print_summary(r.run_all())


@app.command()
@_guarded
def partition(config: ConfigOpt = None, set: SetOpt = None, run_id: RunIdOpt = None):
    """Split the dataset over clients: writes the manifest (client -> sample indices) and a label heatmap."""
    from fedpipe.steps import Run

    r = Run(_load(config, set, run_id))
    p = r.partition()
    sizes = [len(c.train) + len(c.val) + len(c.test) for c in p.clients]
    typer.echo(f"{len(p.clients)} clients, {min(sizes)}-{max(sizes)} samples each; manifest: {r.store.url(r.paths.manifest)}")


@app.command()
@_guarded
def train(phase: Annotated[str, typer.Option("--phase", "-p", help="The phase to run (see `fedpipe methods`), e.g. federation.")],
          config: ConfigOpt = None, set: SetOpt = None, run_id: RunIdOpt = None):
    """Run one training phase; it reads the previous phase's state and resumes from its own last checkpoint."""
    from fedpipe.steps import Run

    r = Run(_load(config, set, run_id))
    state = r.train(phase)
    typer.echo(f"phase {phase} finished at round {state.round}; state: {r.store.url(f'{r.paths.run_id}/phases/{phase}/final.pt')}")


@app.command()
@_guarded
def evaluate(config: ConfigOpt = None, set: SetOpt = None, run_id: RunIdOpt = None):
    """Evaluate the last phase's models and write the report (summary, per-client table, plots)."""
    from fedpipe.steps import Run

    _print_summary(Run(_load(config, set, run_id)).evaluate())


@app.command("config")
@_guarded
def show_config(config: ConfigOpt = None, set: SetOpt = None,
                explain: Annotated[bool, typer.Option("--explain", help="List every field with its meaning instead.")] = False):
    """Print the resolved config as YAML (defaults + file + --set), or explain every field."""
    cfg = _load(config, set)
    if not explain:
        typer.echo(cfg.to_yaml().rstrip())
        return
    for line in _explain(cfg):
        typer.echo(line)


def _explain(cfg) -> list[str]:
    lines = []
    for section_name in type(cfg).model_fields:
        section = getattr(cfg, section_name)
        lines.append(f"{section_name}:  ({type(section).__doc__.strip().splitlines()[0] if type(section).__doc__ else ''})")
        for name, field in type(section).model_fields.items():
            doc = " ".join((field.description or "").split())
            lines.append(f"  {section_name}.{name} = {getattr(section, name)!r}\n      {doc}")
    return lines


@app.command()
@_guarded
def methods():
    """List the methods, their phases and the papers their update rules come from."""
    from fedpipe.algorithms import ALGORITHMS

    for name, cls in ALGORITHMS.items():
        phases = ", ".join(p.name for p in cls.phases(cls.Params(), 10))
        typer.echo(f"{name:<12} phases: {phases:<32} {cls.paper}")


@app.command()
@_guarded
def datasets():
    """List the datasets and where each comes from."""
    from fedpipe.data.datasets import DATASETS

    for name, info in DATASETS.items():
        typer.echo(f"{name:<14} {info.num_classes:>3} classes  {'x'.join(map(str, info.input_shape)):<8} {info.description}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
