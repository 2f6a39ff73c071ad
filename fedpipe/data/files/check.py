"""`fedpipe data check SOURCE`: what a run would read from a user's data, and every problem, before a run.

The report: clients, samples per client, classes, size on disk, the snapshot, the label heatmap of the
natural partition (the plot a run's report shows), and the problems (errors stop a run before anything is
written; warnings are listed once), each naming its file and row.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedpipe.data import DatasetBundle, LabeledArrays
from fedpipe.data.files import DataCheck, check_files
from fedpipe.data.partition import make_partition
from fedpipe.data.partition.natural import NaturalPartition, unseen_test_classes
from fedpipe.errors import DataError


@dataclass(frozen=True)
class CheckReport:
    lines: list[str]  # what to print
    ok: bool  # no errors
    heatmap: Path | None  # the label heatmap written, when asked and the data could be read


def check_report(url: str, image_size: int | None = None, min_client_size: int = 10, heatmap: Path | None = None) -> CheckReport:
    check = check_files(url, image_size)
    problems, rows = check.problems, check.rows
    lines = [f"source       {check.source}"]
    drawn = None
    if rows is not None and len(rows.y):
        counts = np.bincount(rows.clients, minlength=len(rows.client_names))
        for name, n in zip(rows.client_names, counts, strict=True):
            if n < min_client_size and not rows.skipped:  # with images of other sizes left out, counts are partial
                problems.error("client too small", f"client {name!r}", f"{n} samples, fewer than partition.min_client_size={min_client_size}")
        lines += _statistics(check, counts)
        if not problems.errors:
            drawn = _natural_split(check, min_client_size, heatmap)
    if check.snapshot:
        s = check.snapshot
        lines.append(f"on disk      {s['objects']} files, {s['bytes'] / 1e6:.1f} MB, {check.files_read} read by the layout; "
                     f"snapshot {s['digest'][:16]}...")
    if drawn is not None:
        lines.append(f"heatmap      {drawn}")
    for severity in ("error", "warning"):
        found = problems.summary(severity)
        if found:
            lines += ["", f"{severity.upper()}S (a run {'stops on these; nothing is written' if severity == 'error' else 'goes on'}):", *found]
    lines += ["", "OK: a run can read this data." if not problems.errors else f"{len(problems.errors)} error(s): fix them before a run."]
    return CheckReport(lines, not problems.errors, drawn)


def _statistics(check: DataCheck, counts: np.ndarray) -> list[str]:
    rows, manifest = check.rows, check.manifest
    assert rows is not None and manifest is not None
    shape = "x".join(map(str, rows.x.shape[1:]))
    per_class = np.bincount(rows.y, minlength=len(manifest.labels))
    if rows.skipped:  # images of other sizes were not kept: the counts below cover the first size's alone
        return [f"layout       {manifest.source.layout}, inputs of several sizes ({rows.x.dtype})",
                f"samples      {len(rows.y) + rows.skipped} ({rows.skipped:,} of them in other image sizes than the first: see "
                "the error; clients and classes are counted once one image size is set)"]
    return [
        f"layout       {manifest.source.layout}, inputs {shape} ({rows.x.dtype})",
        f"clients      {len(rows.client_names)}: {int(counts.min())} to {int(counts.max())} samples each (median {int(np.median(counts))})",
        f"samples      {len(rows.y)}",
        f"classes      {len(manifest.labels)}: " + ", ".join(f"{name} {n}" for name, n in zip(manifest.labels[:20], per_class, strict=False))
        + (" ..." if len(manifest.labels) > 20 else ""),
    ]


def _natural_split(check: DataCheck, min_client_size: int, heatmap: Path | None) -> Path | None:
    """The natural partition a run makes by default (seed 0): warns about classes in a client's test split
    that its training split lacks, and draws the label heatmap."""
    rows, manifest = check.rows, check.manifest
    bundle = DatasetBundle("files", LabeledArrays(rows.x, rows.y), None, len(manifest.labels), manifest.labels, "",
                           vocab_size=rows.vocab_size, clients=rows.clients, client_names=rows.client_names,
                           sample_ids=rows.ids)
    try:
        partition = make_partition(bundle, NaturalPartition(min_client_size=min_client_size), 0)
    except DataError as exc:
        check.problems.error("natural partition", check.source, str(exc))
        return None
    for line in unseen_test_classes(partition.clients, rows.y, manifest.labels, rows.client_names):
        check.problems.warning("class in test but not in train", line.split(":")[0], line.split(":", 1)[1].strip())
    if heatmap is None:
        return None
    from fedpipe.plots import partition_heatmap

    return partition_heatmap(partition, rows.y, heatmap, title=f"{check.source}: natural partition", class_names=manifest.labels)
