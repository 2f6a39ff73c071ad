"""The report of a study: per split, each method's test accuracy over seeds with its confidence interval, the
worst clients, the time to a target accuracy, paired tests against the best method, the hyperparameters chosen
on validation, and the honest protocols side by side with the papers' optimistic one, so a reader sees whether
the ranking of the methods holds or flips. Written as study.md, a self-contained study.html and PNG plots.

The results come from a JSON file someone else wrote: every string in them (a method name, a parameter value)
is text, never markup (escaped for Markdown and HTML as fedpipe.run.report does), and any value that is not a
number where a number belongs is shown as missing rather than trusted.
"""

from __future__ import annotations

import base64
import html
import io
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fedpipe.run.report import md_text
from fedpipe.study.stats import (
    Interval,
    PairedTest,
    band_over_seeds,
    mean_ci,
    min_two_sided_pvalue,
    rounds_to_target,
    wilcoxon_paired,
    worst_fraction_mean,
)

OPTIMISTIC = "OPTIMISTIC"
BEST = "★"
DEFAULT_TARGET_SHARE = 0.95  # no target given: 95% of the best method's final mean accuracy


# --- reading the results (possibly hostile) --------------------------------------------------------------


def _num(value: object) -> float | None:
    """A finite number, or None for anything else (a string, a bool, nan, a missing value)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _dict(value: object) -> dict:
    return value if isinstance(value, dict) else {}


def _list(value: object) -> list:
    return value if isinstance(value, list) else []


@dataclass(frozen=True)
class Final:
    """One final run (a method with its chosen hyperparameters, on one split and seed), its numbers checked."""

    seed: str
    accuracy: float
    pooled: float | None
    global_accuracy: float | None
    clients: tuple[float, ...]
    curve: tuple[dict, ...]
    seconds: float | None


def _curve_row(row: object) -> dict | None:
    row = _dict(row)
    rnd = _num(row.get("round"))
    if rnd is None:
        return None
    return {"round": int(rnd), "personalized_accuracy": _num(row.get("personalized_accuracy")),
            "bytes_uploaded": int(_num(row.get("bytes_uploaded")) or 0), "bytes_downloaded": int(_num(row.get("bytes_downloaded")) or 0)}


def _finals(method: dict, split: str) -> list[Final]:
    """The method's final runs on `split` that carry a test accuracy, one per seed (the first of a repeated seed)."""
    out: dict[str, Final] = {}
    for raw in _list(method.get("finals")):
        raw = _dict(raw)
        test = _dict(raw.get("test"))
        accuracy = _num(test.get("personalized_accuracy"))
        seed = str(raw.get("seed"))
        if str(raw.get("split")) != split or accuracy is None or seed in out:
            continue
        clients = [_num(c) for c in _list(test.get("client_accuracies"))]
        curve = [r for r in map(_curve_row, _list(raw.get("curve"))) if r is not None]
        out[seed] = Final(seed, accuracy, _num(test.get("pooled_choice_accuracy")), _num(test.get("global_accuracy")),
                          tuple(clients) if None not in clients else (), tuple(curve), _num(raw.get("seconds")))
    return list(out.values())


def _methods(results: dict) -> dict[str, dict]:
    if not isinstance(results, dict) or not isinstance(results.get("methods"), dict) or not results["methods"]:
        raise ValueError("The study results hold no methods: expected {'methods': {name: {...}}, ...}; nothing to report.")
    bad = [str(name)[:60] for name, m in results["methods"].items() if not isinstance(m, dict)]
    if bad:
        raise ValueError(f"The study results describe method(s) {', '.join(map(repr, bad))} by something other than an object.")
    return {str(name): m for name, m in results["methods"].items()}


def _splits(results: dict, methods: dict[str, dict]) -> list[str]:
    """The splits the study names, then any other split a final run was made on."""
    named = [str(s) for s in _list(results.get("splits"))]
    seen = [str(f["split"]) for m in methods.values() for f in map(_dict, _list(m.get("finals"))) if f.get("split") is not None]
    return list(dict.fromkeys(named + seen))


def _slugs(names: list[str]) -> dict[str, str]:
    """A distinct [a-zA-Z0-9_] name for each name (KFP metric names and file names), in the order given."""
    out, taken = {}, set()
    for name in names:
        base = re.sub(r"_+", "_", re.sub(r"[^A-Za-z0-9_]", "_", name)).strip("_")[:60] or "x"
        slug, k = base, 1
        while slug in taken:
            k += 1
            slug = f"{base}_{k}"
        out[name] = slug
        taken.add(slug)
    return out


# --- formatting -----------------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}%"


def _mean_std(values: list[float]) -> str:
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{_pct(values[0])} (1 seed)"
    return f"{_pct(float(np.mean(values)))} ± {_pct(float(np.std(values, ddof=1)))}"


def _ci(interval: Interval) -> str:
    return "n/a (1 seed)" if interval.n < 2 else f"{_pct(interval.low)} – {_pct(interval.high)}"


def _value(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _params(params: object) -> str:
    return ", ".join(f"{k} = {_value(v)}" for k, v in _dict(params).items()) or "none"


def _p(test: PairedTest) -> str:
    """A test as one cell; a minus sign rather than a hyphen, which Markdown would need escaped."""
    if math.isnan(test.pvalue):
        return f"n/a: {test.reason}"
    p = f"p = {test.pvalue:.3g}" if test.pvalue >= 1e-4 else "p < 0.0001"
    note = f"; {test.reason}" if test.reason else ""
    median = f"{100 * test.median_difference:+.2f}".replace("-", "\N{MINUS SIGN}")
    return f"{p}, n = {test.n}, median difference {median} pp{note}"


class Page:
    """The report as a list of blocks, rendered to Markdown and to HTML from the same content. Blocks hold raw
    text; each renderer escapes all of it, so no caller can forget to."""

    def __init__(self) -> None:
        self.blocks: list[tuple] = []

    def heading(self, level: int, text: str) -> None:
        self.blocks.append(("h", level, text))

    def text(self, text: str) -> None:
        self.blocks.append(("p", text))

    def table(self, header: list[str], rows: list[list[str]], marked: int | None = None) -> None:
        self.blocks.append(("table", header, rows, marked))

    def image(self, name: str, alt: str) -> None:
        self.blocks.append(("img", name, alt))

    def markdown(self) -> str:
        lines = []
        for kind, *rest in self.blocks:
            if kind == "h":
                lines += ["#" * rest[0] + " " + md_text(rest[1], 300), ""]
            elif kind == "p":
                lines += [md_text(rest[0], 4000), ""]
            elif kind == "img":
                lines += [f"![{md_text(rest[1], 300)}]({rest[0]})", ""]
            else:
                lines += [*_markdown_table(*rest), ""]
        return "\n".join(lines)

    def html(self, title: str, images: dict[str, bytes]) -> str:
        e = html.escape
        parts = []
        for kind, *rest in self.blocks:
            if kind == "h":
                parts.append(f"<h{rest[0]}>{e(rest[1])}</h{rest[0]}>")
            elif kind == "p":
                parts.append(f"<p>{e(rest[0])}</p>")
            elif kind == "img" and rest[0] in images:
                data = base64.b64encode(images[rest[0]]).decode()
                parts.append(f'<figure><img alt="{e(rest[1])}" style="max-width:100%" src="data:image/png;base64,{data}"></figure>')
            elif kind == "table":
                parts.append(_html_table(*rest))
        style = "<style>table{border-collapse:collapse}td,th{border:1px solid #bbb;padding:2px 8px;text-align:left}</style>"
        return (f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title>{style}</head>"
                f"<body>{''.join(parts)}</body></html>")


def _markdown_table(header: list[str], rows: list[list[str]], marked: int | None) -> list[str]:
    """A Markdown table, every cell escaped (a '|' cannot split a cell); the marked row's first cell in bold with BEST."""
    def cells(row: list[str], i: int) -> list[str]:
        return [f"**{md_text(c)}** {BEST}" if i == marked and j == 0 else md_text(c) for j, c in enumerate(row)]

    lines = ["| " + " | ".join(map(md_text, header)) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return lines + ["| " + " | ".join(cells(row, i)) + " |" for i, row in enumerate(rows)]


def _html_table(header: list[str], rows: list[list[str]], marked: int | None) -> str:
    """An HTML table, every cell escaped; the marked row's first cell in bold with BEST."""
    def cell(text: str, i: int, j: int) -> str:
        return f"<strong>{html.escape(text)}</strong> {BEST}" if i == marked and j == 0 else html.escape(text)

    body = "".join("<tr>" + "".join(f"<td>{cell(c, i, j)}</td>" for j, c in enumerate(row)) + "</tr>" for i, row in enumerate(rows))
    return "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + f"</tr>{body}</table>"


# --- one split ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SplitView:
    """Every method's finals on one split, the best method (highest mean test accuracy) and the target accuracy."""

    split: str
    runs: dict[str, list[Final]]
    best: str | None
    target: float | None
    target_note: str


def _split_view(split: str, methods: dict[str, dict], target: object) -> SplitView:
    """The split's finals per method; without a target given, DEFAULT_TARGET_SHARE of the best mean (and a note saying so)."""
    runs = {name: _finals(m, split) for name, m in methods.items()}
    means = {name: float(np.mean([f.accuracy for f in fs])) for name, fs in runs.items() if fs}
    best = max(means, key=lambda n: means[n]) if means else None
    given = _num(target)
    if given is not None:
        return SplitView(split, runs, best, given, f"the study's target, {_pct(given)}")
    if best is None:
        return SplitView(split, runs, best, None, "none (no final runs)")
    value = DEFAULT_TARGET_SHARE * means[best]
    note = (f"{_pct(value)}: the study gave none, so {DEFAULT_TARGET_SHARE:g} × the best method's ({best}) "
            f"final mean test accuracy {_pct(means[best])}")
    return SplitView(split, runs, best, value, note)


def _to_target(finals: list[Final], target: float | None) -> tuple[str, str, float | None, float | None]:
    """Cells (rounds, MB) to reach the target, mean over seeds, and those means; 'not reached' when a seed never does."""
    if target is None or not finals:
        return "n/a", "n/a", None, None
    reached = [rounds_to_target(f.curve, target) for f in finals]
    missed = sum(r is None for r in reached)
    if missed:
        cell = f"not reached by {missed} of {len(finals)} seeds"
        return cell, cell, None, None
    rounds, sent = float(np.mean([r.round for r in reached])), float(np.mean([r.bytes for r in reached]))
    return f"{rounds:.1f}", f"{sent / 1e6:.3f} MB", rounds, sent


def _method_row(name: str, finals: list[Final], target: float | None) -> tuple[list[str], dict[str, float]]:
    """One method's row of the split table and its metrics (finite numbers only)."""
    if not finals:
        return [name, "no final runs", "n/a", "n/a", "n/a", "n/a", "n/a", "n/a"], {}
    accuracy = mean_ci([f.accuracy for f in finals])
    glob = [f.global_accuracy for f in finals if f.global_accuracy is not None]
    worst = [worst_fraction_mean(f.clients) for f in finals if f.clients]
    seconds = [f.seconds for f in finals if f.seconds is not None]
    rounds_cell, bytes_cell, rounds, sent = _to_target(finals, target)
    row = [name, _mean_std([f.accuracy for f in finals]), _ci(accuracy), _mean_std(glob), _mean_std(worst),
           rounds_cell, bytes_cell, f"{np.mean(seconds):.1f} s" if seconds else "n/a"]
    metrics = {"test_accuracy_mean": accuracy.mean, "test_accuracy_std": accuracy.std, "test_accuracy_ci_low": accuracy.low,
               "test_accuracy_ci_high": accuracy.high, "seeds": float(accuracy.n),
               "global_accuracy_mean": float(np.mean(glob)) if glob else None,
               "worst10_accuracy_mean": float(np.mean(worst)) if worst else None,
               "rounds_to_target_mean": rounds, "bytes_to_target_mean": sent,
               "seconds_mean": float(np.mean(seconds)) if seconds else None}
    return row, {k: v for k, v in metrics.items() if v is not None and math.isfinite(v)}


def _paired(mine: list[Final], best: list[Final]) -> tuple[PairedTest, PairedTest]:
    """Against the best method: over seeds (per-seed mean accuracies), and over clients (the same client and seed)."""
    theirs = {f.seed: f for f in best}
    shared = [(f, theirs[f.seed]) for f in mine if f.seed in theirs]
    seeds = wilcoxon_paired([a.accuracy for a, _ in shared], [b.accuracy for _, b in shared])
    pairs = [(x, y) for a, b in shared if a.clients and len(a.clients) == len(b.clients) for x, y in zip(a.clients, b.clients)]
    clients = wilcoxon_paired([x for x, _ in pairs], [y for _, y in pairs])
    return seeds, clients


def _tests_section(page: Page, view: SplitView) -> dict[str, dict[str, float]]:
    """Each other method against the best one; with few seeds, the floor under the p-value over seeds, said outright."""
    if view.best is None:
        return {}
    rows, metrics, seed_counts = [], {}, set()
    for name, finals in view.runs.items():
        if name == view.best or not finals:
            continue
        seeds, clients = _paired(finals, view.runs[view.best])
        seed_counts.add(seeds.n)
        rows.append([name, _p(seeds), _p(clients)])
        metrics[name] = {k: v for k, v in (("pvalue_seeds_vs_best", seeds.pvalue), ("pvalue_clients_vs_best", clients.pvalue))
                         if math.isfinite(v)}
    if not rows:
        return {}
    page.text(f"Paired two-sided Wilcoxon signed-rank tests against the best method, {view.best} (differences: method − best).")
    page.table(["method", "over seeds (per-seed mean test accuracy)", "over clients (same client and seed, pooled over seeds)"], rows)
    for n in sorted(seed_counts):
        if n >= 2:
            page.text(f"With {n} seeds the test over seeds cannot give a p-value below {min_two_sided_pvalue(n):.3g} "
                      "(every seed on the same side): a large p there may only mean too few seeds.")
    return metrics


def _protocol_ranking(values: dict[str, float | None]) -> tuple[dict[str, int], list[str]]:
    ranked = sorted((n for n, v in values.items() if v is not None), key=lambda n: -values[n])
    return {n: i + 1 for i, n in enumerate(ranked)}, ranked


def _protocols_section(page: Page, view: SplitView, methods: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Honest (validation pick), honest-pooled and the papers' OPTIMISTIC protocol side by side, each with its ranking."""
    honest, pooled, optimistic, params, protocols = {}, {}, {}, {}, []
    for name, finals in view.runs.items():
        honest[name] = float(np.mean([f.accuracy for f in finals])) if finals else None
        values = [f.pooled for f in finals if f.pooled is not None]
        pooled[name] = float(np.mean(values)) if values else None
        entry = _dict(_dict(methods[name].get("optimistic")).get(view.split))
        optimistic[name], params[name] = _num(entry.get("accuracy")), _params(entry.get("params")) if entry else "n/a"
        if entry.get("protocol") is not None:
            protocols.append(str(entry["protocol"]))
    columns = [("honest", honest), ("honest-pooled", pooled), (OPTIMISTIC, optimistic)]
    ranks = [_protocol_ranking(values) for _, values in columns]
    cell = lambda v, rank: "n/a" if v is None else f"{_pct(v)}, rank {rank}"  # noqa: E731
    rows = [[name] + [cell(values[name], r[0].get(name)) for (_, values), r in zip(columns, ranks)] + [params[name]] for name in view.runs]
    page.heading(3, "Two protocols, side by side")
    page.table(["method", "honest: chosen on validation, per-client validation pick, mean over seeds",
                "honest-pooled: the pooled estimator, mean over seeds", f"{OPTIMISTIC}: test-oracle pick, best over hyperparameters",
                f"{OPTIMISTIC} hyperparameters"], rows)
    page.text(f"{OPTIMISTIC} is the protocol of the papers, selected on the test data: it overstates accuracy and is shown only to "
              f"compare rankings. As reported: {'; '.join(dict.fromkeys(protocols)) or 'no optimistic figures given'}.")
    page.text(" ".join(f"Ranking, {label}: {' > '.join(r[1]) or 'none'}." for (label, _), r in zip(columns, ranks)))
    flips = [label for (label, _), r in zip(columns[1:], ranks[1:]) if _order_differs(ranks[0][1], r[1])]
    page.text(f"The ranking flips under {', '.join(flips)} compared with the honest protocol." if flips
              else "The ranking of the methods compared under each protocol is the same as the honest one.")
    metrics = {name: {"pooled_accuracy_mean": pooled[name], "optimistic_accuracy": optimistic[name]} for name in view.runs}
    return {name: {k: v for k, v in values.items() if v is not None} for name, values in metrics.items()}


def _order_differs(reference: list[str], other: list[str]) -> bool:
    """Whether two rankings order the methods they share differently."""
    shared = set(reference) & set(other)
    return [n for n in reference if n in shared] != [n for n in other if n in shared]


def _split_section(page: Page, view: SplitView, methods: dict[str, dict]) -> dict[str, dict[str, float]]:
    """The split's tables; returns {method: {metric: value}}."""
    page.heading(2, f"Split {view.split}")
    page.text(f"Target accuracy for the time to accuracy: {view.target_note}.")
    rows, metrics = [], {}
    for name, finals in view.runs.items():
        row, metrics[name] = _method_row(name, finals, view.target)
        if finals:
            metrics[name]["is_best"] = float(name == view.best)
        rows.append(row)
    names = list(view.runs)
    page.table(["method", "test personalized acc. (mean ± std over seeds)", "95% CI of the mean", "global acc.",
                "worst-10% client acc.", "rounds to target", "bytes to target", "seconds per run"], rows,
               names.index(view.best) if view.best is not None else None)
    page.text(f"{BEST}: the best method (highest mean test personalized accuracy). Worst-10%: the mean of each seed's lowest "
              "10% of client accuracies, then the mean over seeds. Time to target: per-round personalized accuracy of each seed's curve.")
    for extra in (_tests_section(page, view), _protocols_section(page, view, methods)):
        for name, values in extra.items():
            metrics[name].update(values)
    return metrics


# --- plots ----------------------------------------------------------------------------------------------

MAX_PANELS = 8  # hyperparameters drawn per method


def _label(text: object, limit: int = 40) -> str:
    """User text for a plot: one line, shortened, '$' escaped (matplotlib would read it as mathematics and may fail)."""
    text = " ".join(str(text).split())
    return (text if len(text) <= limit else text[: limit - 3] + "...").replace("$", r"\$")


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _accuracy_plot(view: SplitView) -> bytes:
    """Test personalized accuracy per round: one line per method (mean over seeds) with its band over seeds."""
    fig = Figure(figsize=(8, 4.8), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    bands = set()
    for i, (name, finals) in enumerate(view.runs.items()):
        rounds, mean, low, high = band_over_seeds([list(f.curve) for f in finals])
        if rounds:
            ax.plot(rounds, 100 * np.array(mean), "-o", markersize=3, color=f"C{i % 10}", label=f"{_label(name)} ({len(finals)} seeds)")
            ax.fill_between(rounds, 100 * np.array(low), 100 * np.array(high), color=f"C{i % 10}", alpha=0.15, lw=0)
            bands.add("95% CI of the mean" if len(finals) >= 3 else "min to max")
    if view.target is not None:
        ax.axhline(100 * view.target, ls="--", lw=0.8, color="dimgray", label="target accuracy")
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("personalized accuracy (%)")
    ax.grid(alpha=0.3)
    if ax.has_data():
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"split {_label(view.split)}: accuracy per round (band over seeds: {', '.join(sorted(bands)) or 'none'})", fontsize=10)
    return _png(fig)


def _sensitivity_panel(ax, param: str, trials: list[dict], chosen: dict, log: bool) -> None:
    """One hyperparameter: each complete trial's objective against its value, per split, the chosen trials ringed."""
    values = [_dict(t.get("params")).get(param) for t in trials]
    numeric = all(_num(v) is not None for v in values)
    categories = sorted({str(v) for v in values})
    xs = np.array([_num(v) if numeric else categories.index(str(v)) for v in values], dtype=float)
    ys = np.array([_num(t.get("objective")) for t in trials], dtype=float)
    for i, split in enumerate(dict.fromkeys(str(t.get("split")) for t in trials)):
        mine = [k for k, t in enumerate(trials) if str(t.get("split")) == split]
        ax.scatter(xs[mine], ys[mine], s=18, color=f"C{i % 10}", label=f"split {_label(split, 24)}")
        picked = [k for k in mine if _dict(trials[k].get("params")) == _dict(chosen.get(split)) and chosen.get(split)]
        ax.scatter(xs[picked], ys[picked], s=130, facecolors="none", edgecolors="red", linewidths=1.6,
                   label="chosen" if picked and i == 0 else None)
    if not numeric:
        ax.set_xticks(range(len(categories)))
        ax.set_xticklabels([_label(c, 16) for c in categories], rotation=30, fontsize=7)
    elif log and xs.size and np.all(xs > 0):
        ax.set_xscale("log")
    ax.set_xlabel(_label(param) + (" (log scale)" if log and numeric else ""))
    ax.grid(alpha=0.3)


def _sensitivity_figure(name: str, method: dict, objective: str) -> Figure | None:
    """The method's objective against each tuned hyperparameter (one panel each), or None with no complete trial."""
    space = _dict(method.get("space"))
    trials = [t for t in map(_dict, _list(method.get("trials")))
              if str(t.get("state", "complete")) == "complete" and _num(t.get("objective")) is not None]
    params = [str(k) for k in space] or list(dict.fromkeys(str(k) for t in trials for k in _dict(t.get("params"))))
    params = params[:MAX_PANELS]
    if not params or not trials:
        return None
    fig = Figure(figsize=(float(np.clip(3.8 * len(params) + 1, 6.5, 20)), 3.8), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = np.atleast_1d(fig.subplots(1, len(params), sharey=True))
    for ax, param in zip(axes, params):
        _sensitivity_panel(ax, param, trials, _dict(method.get("chosen")), str(space.get(param, "")).startswith("log-uniform"))
    axes[0].set_ylabel(_label(objective))
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{_label(name)}: sensitivity to its hyperparameters (tuning trials)", fontsize=10)
    return fig


# --- the whole study ------------------------------------------------------------------------------------


def _budget(results: dict) -> str:
    budget = _dict(results.get("budget"))
    seeds = ", ".join(str(s) for s in _list(results.get("seeds"))) or "none given"
    return (f"Budget, the same for every method: {budget.get('trials', '?')} tuning trials per method and split, "
            f"{budget.get('rounds', '?')} rounds per trial, sampler {budget.get('sampler', '?')}; the chosen hyperparameters "
            f"rerun on seeds {seeds}; tuned on {results.get('objective', '?')}.")


def _hyperparameter_section(page: Page, results: dict, methods: dict[str, dict], slugs: dict[str, str]) -> dict[str, bytes]:
    """The hyperparameters chosen per method and split, the budget, and each method's sensitivity plot."""
    page.heading(2, "Hyperparameters chosen on validation")
    page.text(_budget(results))
    rows = []
    for name, method in methods.items():
        space = ", ".join(f"{k}: {v}" for k, v in _dict(method.get("space")).items()) or "none"
        chosen = _dict(method.get("chosen"))
        rows += [[name, str(split), _params(params), space] for split, params in chosen.items()] or [[name, "n/a", "none", space]]
    page.table(["method", "split", "chosen hyperparameters", "search space"], rows)
    images = {}
    for name, method in methods.items():
        fig = _sensitivity_figure(name, method, str(results.get("objective", "objective")))
        if fig is not None:
            images[f"sensitivity_{slugs[name]}.png"] = _png(fig)
            page.image(f"sensitivity_{slugs[name]}.png", f"{name}: objective against each hyperparameter")
    return images


def write_study_report(results: dict, out_dir: Path) -> dict[str, float]:
    """Render the study into `out_dir` (study.md, study.html with its plots inlined, the PNGs) and return its KFP
    metrics, {name: value} with names like `<method>__<split>__test_accuracy_mean` ([a-zA-Z0-9_], finite values)."""
    methods = _methods(results)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    title = f"Study {results.get('study', '')}".strip()
    page, images, metrics = Page(), {}, {}
    page.heading(1, title)
    page.text(f"Dataset {results.get('dataset', '?')}; methods {', '.join(methods)}; objective {results.get('objective', '?')}. "
              "Accuracies are test accuracies of the final runs, with hyperparameters chosen on validation.")
    method_slugs, splits = _slugs(list(methods)), _splits(results, methods)
    split_slugs = _slugs(splits)
    for split in splits:
        view = _split_view(split, methods, results.get("target_accuracy"))
        for name, values in _split_section(page, view, methods).items():
            metrics |= {f"{method_slugs[name]}__{split_slugs[split]}__{k}": float(v) for k, v in values.items()}
        if view.target is not None:
            metrics[f"target_accuracy__{split_slugs[split]}"] = float(view.target)
        plot = f"accuracy_{split_slugs[split]}.png"
        images[plot] = _accuracy_plot(view)
        page.image(plot, f"accuracy per round, split {split}")
    images |= _hyperparameter_section(page, results, methods, method_slugs)
    for name, png in images.items():
        (out_dir / name).write_bytes(png)
    (out_dir / "study.md").write_text(page.markdown(), encoding="utf-8")
    (out_dir / "study.html").write_text(page.html(title, images), encoding="utf-8")
    return metrics
