"""`fedpipe data`: your own federated data (init, check)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from fedpipe.cli.common import _guarded, app

data_app = typer.Typer(
    help="Your own federated data (data.dataset=files): images in <source>/<client>/<label>/<image>, or a Parquet "
         "or CSV table with a client column, in a folder or s3://bucket/prefix. `init` writes the manifest that says "
         "how the files are laid out; `check` reads them as a run would and lists every problem.",
    no_args_is_help=True,
)
app.add_typer(data_app, name="data")
SourceArg = Annotated[str, typer.Argument(help="A folder, or s3://bucket/prefix (endpoint and credentials from FEDPIPE_S3_ENDPOINT, "
                                               "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY); a final /latest means the newest sub-prefix by name.")]


@data_app.command("init")
@_guarded
def data_init(source: SourceArg,
              client_column: Annotated[Optional[str], typer.Option(help="Tables: the column naming each row's client (default: a column named client, site, device, user, ...).")] = None,
              label_column: Annotated[Optional[str], typer.Option(help="Tables: the column holding the label (default: label, target, class, y).")] = None,
              force: Annotated[bool, typer.Option("--force", help="Replace an existing fedpipe-data.yaml.")] = False,
              root: Annotated[bool, typer.Option("--root", help="Write it in the folder above SOURCE (the drops root: "
                                                 "drops/fedpipe-data.yaml), where every drop without a manifest of its own finds it.")] = False,
              labels: Annotated[Optional[str], typer.Option(help="The class order, comma-separated (class 0 first), e.g. "
                                                            "--labels zero,one,two; default: numbers and number words counted, other names in natural order.")] = None):
    """Look at the files under SOURCE and write its manifest, fedpipe-data.yaml: the layout, the columns and
    the label names. Read it, edit it if a guess is wrong, then run `fedpipe data check SOURCE`.

    For dated drops (drops/2026-01-01, drops/2026-02-01, ... read as drops/latest), write it once at the
    root with `fedpipe data init drops/latest --root`: a drop that has no fedpipe-data.yaml of its own uses
    the root's, so a scheduled run needs nothing written into each new drop (list every label the drops
    will ever hold: a label missing from it stops a run)."""
    from fedpipe.data.files.init import init_manifest, propose_image_size, reorder_labels, write_manifest

    manifest, where = init_manifest(source, client_column=client_column, label_column=label_column)
    if labels is not None:
        manifest = reorder_labels(manifest, labels.split(","))
    written = write_manifest(source, manifest, force=force, root=root)
    typer.echo(f"wrote {written}: layout {manifest.source.layout}, {len(manifest.labels)} labels "
               f"({', '.join(manifest.labels[:10])}{' ...' if len(manifest.labels) > 10 else ''})")
    proposal = propose_image_size(source) if manifest.source.layout == "image_folders" else None
    if proposal is not None:
        side, found = proposal
        typer.echo(f"image sizes: {found}.")
        typer.echo(f"A run needs one size: data.image_size={side} resizes every image to {side}x{side} (bilinear, the aspect "
                   f"ratio not kept). Set it with `--set data.image_size={side}`, or `image_size: {side}` under `data:` in your config.")
        typer.echo(f"next: fedpipe data check {source} --image-size {side}")
        return
    typer.echo(f"next: fedpipe data check {source}")


@data_app.command("check")
@_guarded
def data_check(source: SourceArg,
               image_size: Annotated[Optional[int], typer.Option(help="Resize images to this side, as data.image_size does.")] = None,
               min_client_size: Annotated[int, typer.Option(help="Fewest samples a client may have (partition.min_client_size).")] = 10,
               heatmap: Annotated[Optional[Path], typer.Option(help="Write the clients x labels heatmap of the natural partition here (PNG).")] = None):
    """Read SOURCE as a run would: clients, samples per client, classes, size on disk, and every problem
    (unreadable image, unknown label, NaN feature, a client too small, ...) naming its file and row.
    Exits 2 when a run would stop on an error."""
    from fedpipe.data.files.check import check_report

    report = check_report(source, image_size, min_client_size, heatmap)
    typer.echo("\n".join(report.lines))
    if not report.ok:
        raise typer.Exit(2)
