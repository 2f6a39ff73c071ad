"""`fedpipe reproduce`: a paper's table, run as the paper describes it, reported beside the paper's numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from fedpipe.cli.common import SetOpt, _guarded, app
from fedpipe.errors import ConfigError


@app.command()
@_guarded
def reproduce(
    name: Annotated[Optional[str], typer.Argument(help="A reproduction's name (reproductions/NAME.yaml) or the path of a reproduction file.")] = None,
    list_: Annotated[bool, typer.Option("--list", help="List the reproductions (name, paper, tables, runs) and exit.")] = False,
    seeds: Annotated[Optional[list[int]], typer.Option("--seed", help="A seed to run (repeatable). Default: as many as the paper averages, 0, 1, ...")] = None,
    rounds: Annotated[Optional[int], typer.Option(help="train.rounds of every run, for a quick look (a departure: the report says so).")] = None,
    set: SetOpt = None,
    only: Annotated[Optional[list[str]], typer.Option(help="Run only these labels of an axis, AXIS=LABEL[,LABEL] (repeatable), e.g. --only p=0.3,1.")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Folder of the records (runs.jsonl) and the report. Default: reproductions-out/NAME.")] = None,
    records: Annotated[Optional[list[Path]], typer.Option("--records", help="Also read these runs.jsonl files (runs made elsewhere).")] = None,
    report_only: Annotated[bool, typer.Option("--report-only", help="Run nothing: write the report from the records there are.")] = False,
    note: Annotated[str, typer.Option(help="A paragraph for the report's head (e.g. which runs are still going, and where; at most 2,000 characters are kept).")] = "",
    appendix: Annotated[Optional[list[Path]], typer.Option("--appendix", help="A section to add after the claims, from a JSON file "
                        "{title, paragraphs, header, rows, after} (repeatable), e.g. the factor table benchmarks/fedmoe_local_factors.py writes.")] = None,
):
    """Run a paper's table (reproductions/NAME.yaml: the setting of the paper's section, every value cited, and the
    paper's numbers with their table and cell) and write a report with, per cell, the paper's number, ours (mean and
    95% interval over seeds), the difference, and whether each of the paper's claims holds, on its numbers and ours.

    Every run appends a record to OUT/runs.jsonl, so a stopped reproduction resumes where it stopped. Runs on a
    machine that has the data: give its folder with --set data.root=FOLDER. A quick look: --rounds 5 --seed 0
    (the report then says it departs from the paper's setting, and never mixes it with full runs).

        fedpipe reproduce --list
        fedpipe reproduce fedmoe_table1_fashion_mnist --set data.root=/usr/share/datasets/fashion-mnist --only p=1 --seed 0
    """
    from fedpipe.study.reproduce import departures, matching, read_records
    from fedpipe.study.reproduce import reproduce as run_reproduction
    from fedpipe.study.reproduce_report import read_appendix, write_reproduction_report
    from fedpipe.study.reproduction import find_reproduction, load_reproduction, reproductions_folder

    if list_:
        for path in sorted(reproductions_folder().glob("*.yaml")):
            repro = load_reproduction(path)
            typer.echo(f"{repro.name:<34} {len(repro.points()):>3} runs x {repro.seeds} seeds  {repro.paper[:60]}: {repro.tables[:80]}")
        return
    if name is None:
        raise ConfigError("Name a reproduction (`fedpipe reproduce --list` lists them), or pass --list.")
    repro = load_reproduction(find_reproduction(name))
    sections = [read_appendix(path) for path in appendix or []]  # before any run: a bad file fails now, not after hours
    extra = [*(set or []), *([f"train.rounds={rounds}"] if rounds is not None else [])]
    wanted = sorted(seeds) if seeds else list(range(repro.seeds))
    folder = out or Path("reproductions-out") / repro.name
    chosen = _only(only or [])
    if report_only:
        from fedpipe.study.reproduce import RECORDS

        found = matching(read_records(folder / RECORDS), extra)
    else:
        found = run_reproduction(repro, folder, wanted, extra, chosen)
    for extra_file in records or []:
        if not extra_file.is_file():
            raise ConfigError(f"--records {extra_file}: no such file.")
        found = matching(found + matching(read_records(extra_file), extra), extra)
    report = write_reproduction_report(repro, found, folder, wanted, departures(extra), note[:2000],
                                       sections)
    typer.echo(f"{len(found)} run(s) recorded; report: {report}")


def _only(items: list[str]) -> dict[str, frozenset[str]]:
    """--only AXIS=LABEL[,LABEL] (repeatable) as {axis: labels}."""
    from fedpipe.study.reproduction import label

    chosen: dict[str, frozenset[str]] = {}
    for item in items:
        axis, sep, labels = item.partition("=")
        if not sep or not labels:
            raise ConfigError(f"--only {item!r}: expected AXIS=LABEL[,LABEL], e.g. --only p=0.3,1")
        chosen[axis.strip()] = chosen.get(axis.strip(), frozenset()) | {label(_number(v.strip())) for v in labels.split(",")}
    return chosen


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return text
