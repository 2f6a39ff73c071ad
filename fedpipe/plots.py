"""Figures, drawn off-screen (matplotlib's Agg canvas; no display, no pyplot global state)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

if TYPE_CHECKING:
    from fedpipe.data.partition import Partition

_ANNOTATE_MAX_CELLS = 400  # write counts into the cells only when the grid is this small
_TICK_EVERY_ROW_MAX = 40  # label every client / class up to this many rows / columns
_HEATMAP_MAX_ROWS = 500  # beyond this many clients the heatmap shows an evenly spaced sample of them


def partition_heatmap(partition: Partition, labels: np.ndarray, path: str | Path, title: str | None = None,
                      class_names: tuple[str, ...] = ()) -> Path:
    """Save a clients x classes heatmap of sample counts (train + val + test) as a PNG at `path`.

    Opt-out clients are marked in a red strip beside the heatmap (and their tick labels are red when
    every client is labelled). Small grids carry the counts in the cells; large ones (hundreds of
    clients) get thin rows, a thinned axis and no cell text. Beyond _HEATMAP_MAX_ROWS clients (at
    10,000 a row is a fraction of a pixel) an evenly spaced sample of that many rows is drawn,
    labelled with the clients' ids, and the subtitle says so. Returns the path written."""
    counts = partition.label_counts(labels)
    total = counts.shape[0]
    clients = list(partition.clients)
    sampled = total > _HEATMAP_MAX_ROWS
    if sampled:
        rows_shown = np.unique(np.linspace(0, total - 1, _HEATMAP_MAX_ROWS).round().astype(np.int64))
        counts, clients = counts[rows_shown], [clients[i] for i in rows_shown]
    k, c = counts.shape
    opt_out = np.array([cl.opt_out for cl in clients], dtype=bool)
    show_opt = bool(opt_out.any())

    width = float(np.clip(2.5 + 0.32 * c, 6.0, 18.0))
    height = float(np.clip(1.5 + 0.28 * k, 3.5, 16.0))
    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    if show_opt:
        grid = fig.add_gridspec(1, 2, width_ratios=[1, max(20, round(width / 0.22))], wspace=0.01)  # ~0.2 inch strip
        ax_opt = fig.add_subplot(grid[0, 0])
        ax = fig.add_subplot(grid[0, 1], sharey=ax_opt)
    else:
        ax = fig.add_subplot(1, 1, 1)

    _draw_counts(fig, ax, counts, class_names)
    _label_clients(ax, partition, clients, opt_out, sampled)
    _annotate_counts(ax, counts)
    if show_opt:
        _draw_opt_out_strip(ax_opt, opt_out)
        _label_clients(ax_opt, partition, clients, opt_out, sampled)
        ax.tick_params(axis="y", labelleft=False)
    else:
        ax.set_ylabel("client")

    scheme = getattr(partition.config, "scheme", "?")
    n_opt = sum(cl.opt_out for cl in partition.clients)
    subtitle = f"{partition.dataset}: {total} clients, {c} classes, scheme {scheme}, seed {partition.seed}"
    if partition.global_test_indices is not None:  # the held-out rows are no client's: say what the counts are
        subtitle += f"\ncounts after the global test hold-out ({len(partition.global_test_indices):,} samples, in no client)"
    if n_opt:
        subtitle += f", {n_opt} opt-out"
    if sampled:
        subtitle += f"\n{k} of the {total} clients shown, evenly spaced by id"
    fig.suptitle(title or subtitle, fontsize=11)
    if title:
        ax.set_title(subtitle, fontsize=8)

    return _save(fig, path)


def census_heatmap(census: dict, path: str | Path) -> Path:
    """A federation's partition heatmap, drawn from its census (`fedpipe.federation.census`: each site's label counts
    over its train, validation and test splits, as the sites reported them; no sample left a site). Returns `path`."""
    return _save(census_figure(census), path)


def census_figure(census: dict) -> Figure:
    """`census_heatmap`'s figure. Its title is wrapped to the figure's width: a narrow figure (few classes) cut a
    one-line title off at both edges."""
    sites = census["sites"]
    counts = np.array([np.sum([s["counts"][k] for k in ("train", "val", "test")], axis=0) for s in sites], dtype=np.int64)
    k, c = counts.shape
    width = float(np.clip(2.5 + 0.32 * c, 6.0, 18.0))
    fig = Figure(figsize=(width, float(np.clip(1.5 + 0.28 * k, 3.5, 16.0))), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    _draw_counts(fig, ax, counts, tuple(census.get("labels", ())))
    ax.set_yticks(np.arange(k))
    ax.set_yticklabels([f"{s['name']}{' (opt-out)' if s.get('opt_out') else ''}" for s in sites], fontsize=8)
    ax.set_ylabel("site")
    _annotate_counts(ax, counts)
    held = sum(int(np.sum(s["counts"]["holdout"])) for s in sites)
    noise = max((s.get("counts_noise") or 0 for s in sites), default=0)
    reported = (f"label counts the sites released with Gaussian noise of std {noise:g} (privacy)" if noise
                else "counts the sites reported")
    title = (f"federation census: {k} sites, {c} classes ({reported}; {held:,} samples held out "
             "at the sites as the global test set)")
    fig.suptitle(_wrapped(title, width, fontsize=10), fontsize=10)
    return fig


def _wrapped(text: str, width_inches: float, fontsize: float) -> str:
    """`text` broken into lines that fit a figure `width_inches` wide at `fontsize` points (DejaVu Sans averages
    about 0.6 em per character; the margin leaves room for the widest lines)."""
    import textwrap

    return textwrap.fill(text, width=max(20, int(width_inches * 72 / (0.6 * fontsize) * 0.9)))


def _draw_counts(fig: Figure, ax, counts: np.ndarray, class_names: tuple[str, ...] = ()) -> None:
    """The heatmap of `counts` (clients x classes), its colour bar and its class axis (by name when given)."""
    c = counts.shape[1]
    image = ax.imshow(counts, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0, origin="upper")
    fig.colorbar(image, ax=ax, label="samples", fraction=0.04, pad=0.01)
    ax.set_xlabel("class")
    if c <= _TICK_EVERY_ROW_MAX:
        ax.set_xticks(np.arange(c))
        ax.tick_params(axis="x", labelsize=7 if c > 20 else 9)
        if len(class_names) == c:
            named = [n if len(n) <= 16 else n[:15] + "…" for n in class_names]
            ax.set_xticklabels(named, rotation=45 if max(map(len, named)) > 2 else 0, ha="right" if max(map(len, named)) > 2 else "center")
    else:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=20, integer=True))


def _label_clients(ax, partition: Partition, clients: list, opt_out: np.ndarray, sampled: bool) -> None:
    """The client axis of `ax`: every id (opt-out ones red) for a few clients, else a thinned axis;
    when rows are a sample of the clients, rows are labelled with the ids they show."""
    k = len(clients)
    if k <= _TICK_EVERY_ROW_MAX:
        ax.set_yticks(np.arange(k))
        names = partition.client_names  # a natural partition's clients by their names (a site, a device)
        ax.set_yticklabels([names[cl.id][:24] if names else str(cl.id) for cl in partition.clients], fontsize=7 if k > 20 else 9)
        for tick, out in zip(ax.get_yticklabels(), opt_out, strict=True):
            if out:
                tick.set_color("tab:red")
        return
    ax.yaxis.set_major_locator(MaxNLocator(nbins=20, integer=True))
    if sampled:  # a row is not a client id any more: label rows with the ids they show
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: str(clients[int(v)].id) if 0 <= int(v) < k else ""))


def _annotate_counts(ax, counts: np.ndarray) -> None:
    """Write each non-zero count into its cell, when the grid is small enough to read them."""
    k, c = counts.shape
    if k * c > _ANNOTATE_MAX_CELLS:
        return
    top = counts.max() if counts.size else 0
    for i in range(k):
        for j in range(c):
            if counts[i, j]:
                color = "black" if counts[i, j] > 0.6 * top else "white"
                ax.text(j, i, str(counts[i, j]), ha="center", va="center", fontsize=6, color=color)


def _draw_opt_out_strip(ax_opt, opt_out: np.ndarray) -> None:
    """The red strip beside the heatmap marking opt-out clients."""
    ax_opt.imshow(
        opt_out[:, None].astype(float),
        aspect="auto",
        interpolation="nearest",
        cmap=ListedColormap(["white", "tab:red"]),
        vmin=0,
        vmax=1,
    )
    ax_opt.set_xticks([0])
    ax_opt.set_xticklabels(["opt-out"], rotation=90, fontsize=8)
    ax_opt.set_ylabel("client")


def _save(fig: Figure, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def accuracy_per_round(rows: list[dict], path: str | Path, phases: list, title: str | None = None) -> Path:
    """Personalized and global accuracy per round (rounds that were evaluated), and the training loss,
    with the phases shaded so Phase I / Phase II (or federation / fine-tuning) read at a glance."""
    fig = Figure(figsize=(8, 5.5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax, ax_loss = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    for key, label, style in (
        ("personalized_accuracy", "personalized (mean over clients)", "-o"),
        ("global_accuracy", "global model, global test set", "-s"),
    ):
        pts = [(r["round"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, [100 * y for y in ys], style, markersize=3, label=label)
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    losses = [(r["round"], r["train_loss"]) for r in rows if r.get("train_loss") is not None]
    if losses:
        ax_loss.plot(*zip(*losses), color="tab:gray")
    ax_loss.set_ylabel("train loss")
    ax_loss.set_xlabel("round")
    ax_loss.grid(alpha=0.3)
    ax_loss.xaxis.set_major_locator(MaxNLocator(integer=True))
    for i, phase in enumerate(phases):
        for a in (ax, ax_loss):
            a.axvspan(phase.first_round - 0.5, phase.last_round + 0.5, color=f"C{i}", alpha=0.06, lw=0)
        ax.text((phase.first_round + phase.last_round) / 2, 98, phase.name, ha="center", va="top", fontsize=8, color="dimgray")
    fig.suptitle(title or "accuracy per round", fontsize=11)
    return _save(fig, path)


def candidate_curve(result, path: str | Path, title: str | None = None) -> Path:
    """Test accuracy against the candidate value (SuPerFed's lam curve): each client as a thin line,
    the mean over clients with its standard deviation, and how many clients chose each value on
    their validation split."""
    label = result.candidate_label or "candidate"
    values = np.array(result.clients[0].candidates)
    per_client = np.array([[s.accuracy for s in c.test] for c in result.clients]) * 100
    fig = Figure(figsize=(8, 5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for row in per_client:
        ax.plot(values, row, color="tab:blue", alpha=0.12, lw=0.8)
    mean, std = per_client.mean(axis=0), per_client.std(axis=0)
    ax.fill_between(values, mean - std, mean + std, color="tab:blue", alpha=0.2, lw=0)
    ax.plot(values, mean, "-o", color="tab:blue", markersize=4, label="mean over clients (± std)")
    chosen = [c.candidates[c.chosen] for c in result.clients]
    twin = ax.twinx()
    counts = [chosen.count(v) for v in values]
    width = (values[1] - values[0]) * 0.6 if len(values) > 1 else 0.05
    twin.bar(values, counts, width=width, color="tab:orange", alpha=0.3, label=f"clients choosing this {label} (validation)")
    twin.set_ylabel("clients")
    twin.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_zorder(twin.get_zorder() + 1)
    ax.patch.set_visible(False)
    ax.set_xlabel(f"{label}  (0 = global model, 1 = local model)" if label == "lam" else label)
    ax.set_ylabel("personalized test accuracy (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    lines = ax.get_legend_handles_labels()
    bars = twin.get_legend_handles_labels()
    ax.legend(lines[0] + bars[0], lines[1] + bars[1], loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, fontsize=8)
    fig.suptitle(title or f"{label} curve", fontsize=11)
    return _save(fig, path)


def _alpha_matrix(row: dict, clients: list[str], branches: int, layer: int | None) -> np.ndarray:
    """clients x branches alpha of one round line (NaN for a client with no alpha yet); per-layer
    alpha is averaged over layers (layer None) or taken at row `layer`."""
    out = np.full((len(clients), branches), np.nan)
    for i, cid in enumerate(clients):
        alpha = row["details"]["alpha"].get(cid)
        if alpha is not None:
            a = np.asarray(alpha, dtype=float)
            out[i] = a.mean(axis=0) if layer is None else a[layer]
    return out


def alpha_heatmap(rounds: list[dict], path: str | Path, layer: int | str | None = None, max_panels: int = 8,
                  title: str | None = None) -> Path:
    """pFedMB's branch weights (the paper's Fig. 3): one clients x branches heatmap of alpha per
    shown round, up to `max_panels` rounds evenly spaced from the first to the last.

    `rounds` are round lines whose `details` hold {"alpha": {client: [[alpha_b] per alpha row]},
    "alpha_rows": [row labels]}. With one alpha per layer the cells show the mean over layers
    (`layer` None; still on the simplex) or one layer (`layer`: its index or module name). A client
    not yet sampled has no alpha (grey)."""
    labels = rounds[-1]["details"].get("alpha_rows", [])
    if isinstance(layer, str):
        layer = labels.index(layer)
    clients = sorted({c for r in rounds for c in r["details"]["alpha"]}, key=int)
    branches = len(next(iter(rounds[-1]["details"]["alpha"].values()))[0])
    shown = sorted({int(i) for i in np.linspace(0, len(rounds) - 1, min(max_panels, len(rounds))).round()})
    k, c = len(clients), branches
    fig = Figure(figsize=(float(np.clip(1.2 + 0.35 * c * len(shown) + 0.3 * len(shown), 5.0, 20.0)),
                          float(np.clip(1.8 + 0.26 * k, 3.0, 16.0))), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = np.atleast_1d(fig.subplots(1, len(shown), sharey=True))
    from matplotlib import colormaps

    cmap = colormaps["viridis"].with_extremes(bad="lightgrey")  # grey: a client with no alpha yet
    image = None
    for ax, i in zip(axes, shown):
        m = _alpha_matrix(rounds[i], clients, branches, layer)
        image = ax.imshow(np.ma.masked_invalid(m), aspect="auto", interpolation="nearest", cmap=cmap, vmin=0, vmax=1)
        ax.set_title(f"round {rounds[i]['round']}", fontsize=9)
        ax.set_xticks(np.arange(c))
        ax.set_xticklabels([str(b + 1) for b in range(c)], fontsize=7)
        ax.set_xlabel("branch", fontsize=8)
        if k * c <= 120 and c <= 10:
            for (r, b), v in np.ndenumerate(m):
                if np.isfinite(v):
                    ax.text(b, r, f"{v:.2f}".removeprefix("0"), ha="center", va="center", fontsize=5.5,
                            color="black" if v > 0.6 else "white")
    axes[0].set_ylabel("client")
    if k <= _TICK_EVERY_ROW_MAX:
        axes[0].set_yticks(np.arange(k))
        axes[0].set_yticklabels(clients, fontsize=7 if k > 20 else 8)
    else:
        axes[0].yaxis.set_major_locator(MaxNLocator(nbins=20, integer=True))
    fig.colorbar(image, ax=list(axes), label="alpha", fraction=0.04, pad=0.01)
    which = "shared by all layers" if labels == ["all layers"] else ("mean over layers" if layer is None else f"layer {labels[layer]}")
    fig.suptitle(title or f"pFedMB branch weights alpha per client ({which})", fontsize=11)
    return _save(fig, path)


def accuracy_vs_branches(results, path: str | Path, title: str | None = None) -> Path:
    """pFedMB's accuracy against the number of branches B (the paper's Fig. 5): `results` maps B to
    the personalized accuracies (0..1) of its runs (e.g. one per seed); mean ± std over runs."""
    bs = sorted(results)
    acc = [100 * np.asarray(results[b], dtype=float) for b in bs]
    mean = np.array([a.mean() for a in acc])
    std = np.array([a.std() for a in acc])
    fig = Figure(figsize=(6.5, 4.2), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.errorbar(bs, mean, yerr=std, fmt="-o", capsize=3, markersize=4, color="tab:blue",
                label="mean over clients" + (" (± std over runs)" if max(len(a) for a in acc) > 1 else ""))
    ax.set_xticks(bs)
    ax.set_xlabel("number of branches B (B = 1: FedAvg + fine-tuning)")
    ax.set_ylabel("personalized test accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(title or "pFedMB: accuracy vs number of branches", fontsize=11)
    return _save(fig, path)


def architecture_clusters(rounds: list[dict], path: str | Path, max_colors: int = 12, title: str | None = None) -> Path:
    """FedMN's implicit clusters: which clients share an architecture, round by round.

    `rounds` are round lines whose `details` hold {"architecture": {client: decision bits},
    "clusters": [{"architecture", "clients", "units"}]}. Top: how many distinct architectures the
    clients hold (the clusters) and the size of the largest. Bottom: clients x rounds, a cell coloured
    by the client's architecture, one colour per architecture in every round (the `max_colors` - 1
    most frequent get their own, the rest share grey-brown "other"); light grey: no decision yet. The
    legend names each coloured architecture by its decision bits and the units it uses."""
    from collections import Counter

    from matplotlib import colormaps
    from matplotlib.patches import Patch

    clients = sorted({c for r in rounds for c in r["details"]["architecture"]}, key=int)
    ranked = [a for a, _ in Counter(a for r in rounds for a in r["details"]["architecture"].values()).most_common()]
    own = ranked[: max_colors - 1] if len(ranked) > max_colors else ranked
    index = {a: i for i, a in enumerate(own)}
    other = len(own)
    units = {c["architecture"]: c["units"] for r in rounds for c in r["details"].get("clusters", [])}
    grid = np.full((len(clients), len(rounds)), np.nan)
    for t, r in enumerate(rounds):
        for i, cid in enumerate(clients):
            a = r["details"]["architecture"].get(cid)
            if a is not None:
                grid[i, t] = index.get(a, other)
    palette = [colormaps["tab20"](i % 20) for i in range(len(own))] + ([(0.55, 0.45, 0.35, 1.0)] if len(ranked) > len(own) else [])
    cmap = ListedColormap(palette).with_extremes(bad="lightgrey")
    xs = [r["round"] for r in rounds]
    k = len(clients)
    fig = Figure(figsize=(float(np.clip(4.5 + 0.18 * len(rounds), 7.0, 16.0)), float(np.clip(3.2 + 0.22 * k, 4.5, 16.0))),
                 dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    top, ax = fig.subplots(2, 1, sharex=True, height_ratios=[1, 3])
    distinct = [len(set(r["details"]["architecture"].values())) for r in rounds]
    largest = [max(Counter(r["details"]["architecture"].values()).values()) for r in rounds]
    top.plot(xs, distinct, "-o", markersize=3, label="distinct architectures (clusters)")
    top.plot(xs, largest, "-s", markersize=3, label="clients in the largest cluster")
    top.set_ylim(0, max(k, max(distinct)) + 0.5)
    top.yaxis.set_major_locator(MaxNLocator(integer=True))
    top.grid(alpha=0.3)
    top.legend(loc="upper right", fontsize=7)
    ax.imshow(np.ma.masked_invalid(grid), aspect="auto", interpolation="nearest", cmap=cmap, vmin=-0.5, vmax=len(palette) - 0.5,
              extent=(xs[0] - 0.5, xs[-1] + 0.5, k - 0.5, -0.5))
    ax.set_xlabel("round")
    ax.set_ylabel("client")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if k <= _TICK_EVERY_ROW_MAX:
        ax.set_yticks(np.arange(k))
        ax.set_yticklabels(clients, fontsize=7 if k > 20 else 8)
    handles = [Patch(color=palette[i], label=f"{a}  ({' '.join(units.get(a, []))})") for i, a in enumerate(own)]
    if len(ranked) > len(own):
        handles.append(Patch(color=palette[-1], label=f"{len(ranked) - len(own)} other architectures"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, title="architecture (units used)",
              title_fontsize=7, frameon=False)
    fig.suptitle(title or "FedMN: clients sharing an architecture (implicit clusters), per round", fontsize=11)
    return _save(fig, path)


_MIXTURE_METHODS = {"fedavg": ("FedAvg", "tab:blue", "o"), "local": ("Local", "tab:gray", "s"),
                    "finetuned": ("Fine-tuned", "tab:orange", "^"), "mixture": ("Mixture", "tab:green", "D")}


def global_vs_local_accuracy(rows: list[dict], path: str | Path, title: str | None = None) -> Path:
    """The federated mixture of experts' Fig. 3 (Listo Zec et al.): accuracy on the balanced global test
    set (x) against accuracy on the clients' own skewed test sets (y), one colour per method, one point
    per majority-class fraction p (written beside it), joined in order of p; one panel per opt-out
    fraction q. `rows`: dicts with method (fedavg, local, finetuned, mixture, or any other name), p, q,
    global and local (0..1, e.g. means over seeds)."""
    qs = sorted({r["q"] for r in rows})
    methods = [m for m in _MIXTURE_METHODS if any(r["method"] == m for r in rows)]
    methods += sorted({r["method"] for r in rows} - set(methods))
    fig = Figure(figsize=(4.6 * len(qs) + 0.8, 4.6), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(qs), sharex=True, sharey=True, squeeze=False)[0]
    for ax, q in zip(axes, qs):
        for i, method in enumerate(methods):
            label, color, marker = _MIXTURE_METHODS.get(method, (method, f"C{4 + i}", "v"))
            pts = sorted((r["p"], 100 * r["global"], 100 * r["local"]) for r in rows if r["method"] == method and r["q"] == q)
            if not pts:
                continue
            ps, xs, ys = zip(*pts)
            ax.plot(xs, ys, "-", color=color, alpha=0.35, linewidth=1)
            ax.scatter(xs, ys, color=color, marker=marker, s=28, label=label, zorder=3)
            for p, x, y in pts:
                ax.annotate(f"{p:g}", (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7, color=color)
        ax.set_title(f"opt-out fraction q = {q:g}", fontsize=10)
        ax.set_xlabel("global (balanced) test accuracy (%)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("local (client's own) test accuracy (%)")
    axes[-1].legend(loc="lower right", fontsize=8, title="numbers: majority fraction p", title_fontsize=7)
    fig.suptitle(title or "Global vs local test accuracy per method and majority-class fraction p", fontsize=11)
    return _save(fig, path)


def federated_rounds(rounds: list[dict], path: str | Path, title: str | None = None) -> Path:
    """A federated run per round (rounds.jsonl of `fedpipe.federation.server_app`): the sites' mean training loss, how
    many sites answered and how many failed (timed out, errored, or had their upload refused), and the megabytes up
    and down, with the phases named over the rounds they ran."""
    return _save(rounds_figure(rounds, title), path)


def rounds_figure(rounds: list[dict], title: str | None = None) -> Figure:
    """`federated_rounds`' figure. The megabytes' axis starts at 0 and shows plain values (no offset): the same
    upload every round is a flat line at its size, not a line wandering over 0.442-0.443 MB."""
    fig = Figure(figsize=(8, 6), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_sites, ax_bytes = fig.subplots(3, 1, sharex=True, height_ratios=[2, 1, 1])
    xs = [r["round"] for r in rounds]
    ax_loss.plot(xs, [r["loss"] for r in rounds], "-o", markersize=3, color="tab:gray")
    ax_loss.set_ylabel("train loss (sites' mean)")
    answered = [r["clients"] - r["failed"] for r in rounds]
    ax_sites.bar(xs, answered, color="tab:green", label="answered")
    ax_sites.bar(xs, [r["failed"] for r in rounds], bottom=answered, color="tab:red", label="failed")
    ax_sites.set_ylabel("sites")
    ax_sites.legend(loc="lower right", fontsize=8)
    ax_bytes.plot(xs, [r["bytes_up"] / 1e6 for r in rounds], "-^", markersize=3, label="up")
    ax_bytes.plot(xs, [r["bytes_down"] / 1e6 for r in rounds], "-v", markersize=3, label="down")
    ax_bytes.set_ylabel("MB")
    most = max([r["bytes_up"] / 1e6 for r in rounds] + [r["bytes_down"] / 1e6 for r in rounds] + [0.0])
    ax_bytes.set_ylim(0, most * 1.25 if most > 0 else 1.0)
    ax_bytes.ticklabel_format(axis="y", style="plain", useOffset=False)
    ax_bytes.set_xlabel("round")
    ax_bytes.legend(loc="upper right", fontsize=8)
    for a in (ax_loss, ax_sites, ax_bytes):
        a.grid(alpha=0.3)
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
    phases: dict[str, list[int]] = {}
    for r in rounds:
        phases.setdefault(r["phase"], []).append(r["round"])
    for i, (name, rs) in enumerate(phases.items()):
        for a in (ax_loss, ax_sites, ax_bytes):
            a.axvspan(min(rs) - 0.5, max(rs) + 0.5, color=f"C{i}", alpha=0.06, lw=0)
        ax_loss.text((min(rs) + max(rs)) / 2, 0.97, name, ha="center", va="top", fontsize=8, color="dimgray",
                     transform=ax_loss.get_xaxis_transform())
    fig.suptitle(_wrapped(title or "federated rounds", 8, fontsize=11), fontsize=11)
    return fig
