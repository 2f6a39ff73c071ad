"""The report of a reproduction: for every number of the paper's table, the paper's value, ours (the mean over
seeds with its 95% Student-t interval, fedpipe.study.stats.mean_ci), the difference and whether the paper's value
lies in our interval; for every claim of the paper (an ordering of two of its numbers), whether it holds on the
paper's own numbers and on ours, at each point of the table; the setting with its citations; what is missing.
Written as <name>.md, <name>.html (self-contained), <name>.json and <name>_vs_paper.png.

The records may come from another machine: every label is text, escaped by the Page renderer (never markup).
So may an appendix (`--appendix FILE`: a section of the report from a JSON file, e.g. the table of an experiment on a
gap, as benchmarks/fedmoe_local_factors.py writes one): bounded, validated field by field, and rendered as text.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from pydantic import Field, ValidationError, model_validator

from fedpipe.config import Section, format_validation_error
from fedpipe.errors import ConfigError
from fedpipe.safe_load import parse_json, read_file
from fedpipe.study.report import Page, _png
from fedpipe.study.reproduction import Claim, Reproduction
from fedpipe.study.stats import Interval, mean_ci

MINUS = "\N{MINUS SIGN}"
MAX_APPENDIX_BYTES = 256 * 2**10


class Appendix(Section):
    """A section of the report from a file: a title, paragraphs, one table and paragraphs after it (all text)."""

    title: str = Field(min_length=1, max_length=200)
    paragraphs: list[str] = Field(default_factory=list, max_length=20)
    header: list[str] = Field(default_factory=list, max_length=16)
    rows: list[list[str]] = Field(default_factory=list, max_length=400)
    after: list[str] = Field(default_factory=list, max_length=20)

    @model_validator(mode="after")
    def _bounded_and_square(self):
        if any(len(t) > 4000 for t in [*self.paragraphs, *self.after]):
            raise ValueError("a paragraph is longer than 4,000 characters")
        if any(len(t) > 300 for t in [*self.header, *(c for r in self.rows for c in r)]):
            raise ValueError("a table cell is longer than 300 characters")
        if bad := [i for i, r in enumerate(self.rows, 1) if len(r) != len(self.header)]:
            raise ValueError(f"row {bad[0]} has not the header's {len(self.header)} cells")
        return self


def read_appendix(path: Path) -> Appendix:
    """An appendix file (JSON: title, paragraphs, header, rows, after), bounded and validated. Raises ConfigError."""
    where = f"--appendix {path}"
    if not Path(path).is_file():
        raise ConfigError(f"{where}: no such file.")
    tree = parse_json(read_file(path, MAX_APPENDIX_BYTES, "reproduction appendix").encode(), where, "reproduction appendix", MAX_APPENDIX_BYTES, ConfigError)
    try:
        return Appendix.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(f"{where} is not an appendix ({{title, paragraphs, header, rows, after}}): " + format_validation_error(e)) from None


def _key(point: dict[str, str]) -> tuple:
    return tuple(sorted(point.items()))


def _where(point: dict[str, str]) -> str:
    return ", ".join(f"{a}={v}" for a, v in point.items()) or "(all)"


def _signed(x: float) -> str:
    return f"{x:+.2f}".replace("-", MINUS)


class Measures:
    """Our values by (point, measure): {seed: value in percent}."""

    def __init__(self, records: list[dict]):
        self.by: dict[tuple, dict[str, dict[int, float]]] = {}
        for r in records:
            slot = self.by.setdefault(_key(r["point"]), {})
            for measure, value in r["measures"].items():
                slot.setdefault(measure, {})[r["seed"]] = 100.0 * value

    def seeds(self, point: dict[str, str], measure: str) -> dict[int, float]:
        return self.by.get(_key(point), {}).get(measure, {})

    def interval(self, point: dict[str, str], measure: str) -> Interval | None:
        values = list(self.seeds(point, measure).values())
        return mean_ci(values) if values else None


def _ci(iv: Interval) -> str:
    if iv.n < 2:
        return f"{iv.mean:.2f} (n = 1, no interval)"
    return f"{iv.mean:.2f} [{iv.low:.2f}, {iv.high:.2f}] (n = {iv.n})"


def cell_rows(repro: Reproduction, ours: Measures) -> tuple[list[list[str]], list[dict]]:
    rows, data = [], []
    for cell in repro.cells:
        iv = ours.interval(cell.point(), cell.measure)
        said = "lost: " + cell.note if cell.paper is None else f"{cell.paper:.2f}"
        if iv is None:
            rows.append([cell.table, cell.row, cell.column, said, "missing: not run", "", ""])
            data.append({"table": cell.table, "row": cell.row, "column": cell.column, "paper": cell.paper, "ours": None})
            continue
        if cell.paper is None:
            rows.append([cell.table, cell.row, cell.column, said, _ci(iv), "", ""])
        else:
            inside = "n/a (n = 1)" if iv.n < 2 else ("yes" if iv.low <= cell.paper <= iv.high else "no")
            rows.append([cell.table, cell.row, cell.column, said, _ci(iv), _signed(iv.mean - cell.paper), inside])
        data.append({"table": cell.table, "row": cell.row, "column": cell.column, "paper": cell.paper, "ours": iv.mean,
                     "low": None if iv.n < 2 else iv.low, "high": None if iv.n < 2 else iv.high, "n": iv.n,
                     "seeds": ours.seeds(cell.point(), cell.measure)})
    return rows, data


def verdict(relation: str, diff: Interval, tolerance: float) -> str:
    """Whether left (relation) right holds given the paired differences left - right over seeds, in points:
    '>' holds when the mean difference is above 0 (and is called significant when the 95% interval is too);
    '~' when |mean| <= tolerance (and firmly when the whole interval lies within ±tolerance)."""
    firm = diff.n >= 2
    if relation == "~":
        if abs(diff.mean) > tolerance:
            return "no"
        return "yes" if firm and -tolerance <= diff.low and diff.high <= tolerance else "yes (interval wider than the tolerance)" if firm else "yes (one seed)"
    sign = 1 if relation == ">" else -1
    if sign * diff.mean <= 0:
        return "no"
    if not firm:
        return "yes (one seed)"
    return "yes" if (diff.low > 0 if sign > 0 else diff.high < 0) else "yes (interval spans 0)"


def paper_verdict(relation: str, left: float, right: float, tolerance: float) -> str:
    if relation == "~":
        return "yes" if abs(left - right) <= tolerance else "no"
    return "yes" if (left > right if relation == ">" else left < right) else "no"


def claim_points(repro: Reproduction, claim: Claim) -> list[tuple[dict, dict, dict]]:
    """(where, left point, right point) for each point of the table the claim speaks about."""
    (lm, lfix), (rm, rfix) = claim.terms()
    region, out, seen = claim.region(), [], set()
    for cell in repro.cells:
        point = cell.point()
        if cell.measure != lm or any(point.get(a) != v for a, v in lfix.items()):
            continue
        where = {a: v for a, v in point.items() if a not in lfix}
        if any(where.get(a) not in labels for a, labels in region.items()) or _key(where) in seen:
            continue
        seen.add(_key(where))
        out.append((where, point, {**where, **rfix}))
    return out


def claim_rows(repro: Reproduction, ours: Measures) -> tuple[list[list[str]], list[dict]]:
    paper = {(_key(c.point()), c.measure): c.paper for c in repro.cells if c.paper is not None}
    rows, data = [], []
    for claim in repro.claims:
        (lm, _), (rm, _) = claim.terms()
        for where, lp, rp in claim_points(repro, claim):
            pl, pr = paper.get((_key(lp), lm)), paper.get((_key(rp), rm))
            said = "n/a" if pl is None or pr is None else f"{pl:.2f} vs {pr:.2f}: {paper_verdict(claim.relation, pl, pr, claim.tolerance)}"
            left, right = ours.seeds(lp, lm), ours.seeds(rp, rm)
            common = sorted(set(left) & set(right))
            if not common:
                found, result = "missing: not run", None
            else:
                diff = mean_ci([left[s] - right[s] for s in common])
                result = verdict(claim.relation, diff, claim.tolerance)
                spread = "" if diff.n < 2 else f" [{_signed(diff.low)}, {_signed(diff.high)}]"
                found = (f"{np.mean([left[s] for s in common]):.2f} vs {np.mean([right[s] for s in common]):.2f}, "
                         f"difference {_signed(diff.mean)}{spread}: {result}")
            rows.append([claim.says, _where(where), said, found])
            data.append({"says": claim.says, "where": where, "paper": said, "ours": result})
    return rows, data


def _figure(repro: Reproduction, cells: list[dict]) -> bytes | None:
    have = [c for c in cells if c["ours"] is not None and c["paper"] is not None]
    if not have:
        return None
    fig = Figure(figsize=(5.5, 5.2))
    ax = fig.add_subplot()
    columns = sorted({c["column"] for c in have})
    for i, column in enumerate(columns):
        sel = [c for c in have if c["column"] == column]
        x, y = [c["paper"] for c in sel], [c["ours"] for c in sel]
        err = [[c["ours"] - c["low"] if c["low"] is not None else 0 for c in sel],
               [c["high"] - c["ours"] if c["high"] is not None else 0 for c in sel]]
        ax.errorbar(x, y, yerr=err, fmt="o", color=f"C{i % 10}", label=column[:30], capsize=2)
    values = [v for c in have for v in (c["paper"], c["ours"])]
    lo, hi = min(values) - 3, max(values) + 3
    ax.plot([lo, hi], [lo, hi], color="0.6", lw=1, ls="--")
    ax.set(xlim=(lo, hi), ylim=(lo, hi), xlabel=f"paper ({repro.unit})", ylabel=f"ours: mean, 95% interval ({repro.unit})",
           title=f"{repro.name}: ours vs the paper")
    ax.legend(fontsize=7)
    return _png(fig)


def _numeric_axis(repro: Reproduction) -> str | None:
    """The table's one axis whose labels are all numbers (the mixture paper's p), or None."""
    if len(repro.axes) != 1:
        return None
    name, axis = next(iter(repro.axes.items()))
    try:
        [float(v) for v in axis.overrides()]
    except ValueError:
        return None
    return name


def _curves(repro: Reproduction, cells: list[dict]) -> bytes | None:
    """Per measure family (the part after the last dot: local, global), each measure against the numeric axis:
    the paper's numbers dashed, ours solid with their 95% intervals."""
    axis = _numeric_axis(repro)
    if axis is None or not any(c["ours"] is not None for c in cells):
        return None
    rows = [(cell, data) for cell, data in zip(repro.cells, cells)]
    families = sorted({cell.measure.rsplit(".", 1)[-1] for cell, _ in rows})
    fig = Figure(figsize=(5.2 * len(families), 4.2))
    for k, family in enumerate(families):
        ax = fig.add_subplot(1, len(families), k + 1)
        measures = sorted({cell.measure for cell, _ in rows if cell.measure.rsplit(".", 1)[-1] == family})
        for i, measure in enumerate(measures):
            sel = sorted(((float(cell.point()[axis]), cell, data) for cell, data in rows if cell.measure == measure), key=lambda t: t[0])
            color = f"C{i % 10}"
            paper = [(x, c.paper) for x, c, _ in sel if c.paper is not None]
            if paper:
                ax.plot(*zip(*paper), ls="--", color=color, alpha=0.6)
            ours = [(x, d) for x, _, d in sel if d["ours"] is not None]
            if ours:
                ax.errorbar([x for x, _ in ours], [d["ours"] for _, d in ours], fmt="-o", color=color, capsize=2,
                            yerr=[[d["ours"] - d["low"] if d["low"] is not None else 0 for _, d in ours],
                                  [d["high"] - d["ours"] if d["high"] is not None else 0 for _, d in ours]],
                            label=measure.rsplit(".", 1)[0][:24])
        ax.set(xlabel=axis, ylabel=f"{family} ({repro.unit})", title=f"{family}: ours (solid) and the paper's (dashed)")
        ax.legend(fontsize=7)
    return _png(fig)


def _missing(repro: Reproduction, ours: Measures, seeds: list[int]) -> list[str]:
    out = []
    for point in repro.points():
        have = set().union(*[set(v) for v in ours.by.get(_key(point), {}).values()] or [set()])
        lacking = [s for s in seeds if s not in have]
        if lacking:
            out.append(f"{_where(point)}: seed(s) {', '.join(map(str, lacking))}")
    return out


def _appendix(page: Page, section: Appendix) -> None:
    page.heading(2, section.title)
    for text in section.paragraphs:
        page.text(text)
    if section.header:
        page.table(section.header, section.rows)
    for text in section.after:
        page.text(text)


def write_reproduction_report(repro: Reproduction, records: list[dict], out: Path, seeds: list[int],
                              departures: list[str], note: str = "", appendices: list[Appendix] = ()) -> Path:
    """Write <out>/<name>.md, .html, .json and the figure; returns the Markdown's path. Each appendix is a section
    after the claims."""
    ours = Measures(records)
    page = Page()
    page.heading(1, f"Reproduction: {repro.name}")
    page.text(f"{repro.paper}: {repro.tables}.")
    page.text("Setting: the paper's, as cited below." if not departures else
              "NOT the paper's setting: these overrides depart from it, so the numbers below do not test the paper: "
              + "; ".join(departures) + ".")
    if note:
        page.text(note)
    missing = _missing(repro, ours, seeds)
    page.text(f"Runs: {len(records)} recorded (seeds {', '.join(map(str, seeds))} wanted per point; the paper averages "
              f"{repro.seeds}: {repro.seeds_cite}). " + ("Missing: " + "; ".join(missing) + "." if missing else "None missing."))
    page.heading(2, "The paper's numbers and ours")
    page.text(f"Ours: the mean over seeds with its 95% Student-t interval, in {repro.unit}; difference: ours minus the paper's.")
    rows, cells = cell_rows(repro, ours)
    page.table(["table", "row", "column", "paper", "ours", "difference", "paper inside our interval"], rows)
    images = {}
    figure = _figure(repro, cells)
    if figure is not None:
        images[f"{repro.name}_vs_paper.png"] = figure
        page.image(f"{repro.name}_vs_paper.png", "ours against the paper's number, one point per cell")
    curves = _curves(repro, cells)
    if curves is not None:
        images[f"{repro.name}_curves.png"] = curves
        page.image(f"{repro.name}_curves.png", "each measure against the table's axis: ours solid, the paper's dashed")
    claims: list[dict] = []
    if repro.claims:
        page.heading(2, "The paper's claims")
        page.text("Each claim is an ordering of two numbers, checked at each point: on the paper's own numbers, and on ours "
                  "(paired over seeds: the mean difference, its 95% interval). '>' holds when the mean difference is above 0; "
                  "'~' when it is within the claim's tolerance.")
        rows, claims = claim_rows(repro, ours)
        page.table(["claim", "at", "paper", "ours"], rows)
    for section in appendices:
        _appendix(page, section)
    page.heading(2, "Setting")
    page.table(["config", "value", "from the paper"], [[k, json.dumps(v.value), v.cite] for k, v in repro.setting.items()]
               + [[f"{name} ({a.key or 'sets'})", ", ".join(a.overrides()), a.cite] for name, a in repro.axes.items()])
    if repro.departures:
        page.heading(2, "Where this reproduction departs from the paper")
        for text in repro.departures:
            page.text("- " + text)
    page.text(f"Data: {repro.data}")
    out.mkdir(parents=True, exist_ok=True)
    for name, data in images.items():
        (out / name).write_bytes(data)
    (out / f"{repro.name}.md").write_text(page.markdown())
    (out / f"{repro.name}.html").write_text(page.html(f"Reproduction: {repro.name}", images))
    summary = {"name": repro.name, "departures": departures, "seeds": seeds, "cells": cells, "claims": claims, "missing": missing,
               "appendices": [a.model_dump() for a in appendices]}
    (out / f"{repro.name}.json").write_text(json.dumps(summary, indent=1, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v))
    return out / f"{repro.name}.md"
