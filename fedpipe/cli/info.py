"""What fedpipe offers: methods, datasets."""

from __future__ import annotations

import typer

from fedpipe.cli.common import _guarded, app


@app.command()
@_guarded
def methods():
    """List the methods, their phases, the papers their update rules come from, every default that
    departs from its paper or fills a gap the paper leaves (a method's `departures`; docs/faithfulness.md
    has the equations and the reasons), and each method's private surface: what a client uploads, and
    whether differential privacy (privacy.enabled) covers it or refuses the method, and why; and whether
    engine.amp=auto trains it in bf16 on a GPU (a method whose results bf16 would change opts out)."""
    from fedpipe.algorithms import ALGORITHMS, phases_of
    from fedpipe.federation.support import federated_status, secure_status

    for name, cls in ALGORITHMS.items():
        phases = ", ".join(p.name for p in phases_of(cls.Params(), 10))
        typer.echo(f"{name:<12} phases: {phases:<32} {cls.paper}")
        departures = getattr(cls, "departures", None)
        if departures is None:
            typer.echo("    defaults vs the paper: not listed here yet, see docs/faithfulness.md")
        elif not departures:
            typer.echo("    defaults vs the paper: the paper's")
        for line in departures or ():
            typer.echo(f"    default departs from the paper: {line}")
        typer.echo(f"    uploads: {cls.uploads}")
        if cls.server_holds:
            typer.echo(f"    the server holds, per client: {cls.server_holds}")
        if cls.uploads.startswith("nothing"):
            typer.echo("    privacy: nothing to cover (it never uploads: epsilon 0)")
        elif cls.privacy_refusal:
            typer.echo(f"    privacy: refused ({cls.privacy_refusal})")
        else:
            typer.echo("    privacy: covered (the upload is clipped and noised; what stays on the client needs no noise)"
                       + (f"; {cls.privacy_caveat}" if cls.privacy_caveat else ""))
        typer.echo(f"    bf16 (engine.amp=auto on a GPU): {f'off, {cls.bf16_refusal}' if cls.bf16_refusal else 'on'}")
        typer.echo(f"    federated (Flower deployment engine, docs/federation.md): {federated_status(name)}")
        typer.echo(f"    under SecAgg+ (federation.secure_aggregation): {secure_status(name)}")


@app.command()
@_guarded
def datasets():
    """List the datasets and where each comes from."""
    from fedpipe.data.datasets import DATASETS

    for name, info in DATASETS.items():
        typer.echo(f"{name:<14} {info.num_classes:>3} classes  {'x'.join(map(str, info.input_shape)):<8} {info.description}")
    typer.echo(f"{'files':<14} {'your':>3} classes  {'any':<8} Your own federated data: images per client, or a Parquet/CSV "
               "table with a client column, in a folder or s3://bucket/prefix (data.dataset=files, data.source=...). "
               "Start with `fedpipe data init SOURCE`, then `fedpipe data check SOURCE`.")
