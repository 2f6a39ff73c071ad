"""Figures, drawn off-screen (matplotlib's Agg canvas; no display, no pyplot global state)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

if TYPE_CHECKING:
    from fedpipe.data.partition import Partition

_ANNOTATE_MAX_CELLS = 400  # write counts into the cells only when the grid is this small
_TICK_EVERY_ROW_MAX = 40  # label every client / class up to this many rows / columns


def partition_heatmap(partition: Partition, labels: np.ndarray, path: str | Path, title: str | None = None) -> Path:
    """Save a clients x classes heatmap of sample counts (train + val + test) as a PNG at `path`.

    Opt-out clients are marked in a red strip beside the heatmap (and their tick labels are red when
    every client is labelled). Small grids carry the counts in the cells; large ones (hundreds of
    clients) get thin rows, a thinned axis and no cell text. Returns the path written."""
    counts = partition.label_counts(labels)
    k, c = counts.shape
    opt_out = np.array([cl.opt_out for cl in partition.clients], dtype=bool)
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

    image = ax.imshow(counts, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0, origin="upper")
    fig.colorbar(image, ax=ax, label="samples", fraction=0.04, pad=0.01)
    ax.set_xlabel("class")
    if c <= _TICK_EVERY_ROW_MAX:
        ax.set_xticks(np.arange(c))
        ax.tick_params(axis="x", labelsize=7 if c > 20 else 9)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=20, integer=True))

    if k <= _TICK_EVERY_ROW_MAX:
        rows = np.arange(k)
        ax.set_yticks(rows)
        ax.set_yticklabels([str(cl.id) for cl in partition.clients], fontsize=7 if k > 20 else 9)
        for tick, out in zip(ax.get_yticklabels(), opt_out, strict=True):
            if out:
                tick.set_color("tab:red")
    else:
        ax.yaxis.set_major_locator(MaxNLocator(nbins=20, integer=True))

    if k * c <= _ANNOTATE_MAX_CELLS:
        top = counts.max() if counts.size else 0
        for i in range(k):
            for j in range(c):
                if counts[i, j]:
                    color = "black" if counts[i, j] > 0.6 * top else "white"
                    ax.text(j, i, str(counts[i, j]), ha="center", va="center", fontsize=6, color=color)

    if show_opt:
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
        if k > _TICK_EVERY_ROW_MAX:
            ax_opt.yaxis.set_major_locator(MaxNLocator(nbins=20, integer=True))
        else:
            ax_opt.set_yticks(np.arange(k))
            ax_opt.set_yticklabels([str(cl.id) for cl in partition.clients], fontsize=7 if k > 20 else 9)
            for tick, out in zip(ax_opt.get_yticklabels(), opt_out, strict=True):
                if out:
                    tick.set_color("tab:red")
        ax.tick_params(axis="y", labelleft=False)
    else:
        ax.set_ylabel("client")

    scheme = getattr(partition.config, "scheme", "?")
    n_opt = int(opt_out.sum())
    subtitle = f"{partition.dataset}: {k} clients, {c} classes, scheme {scheme}, seed {partition.seed}"
    if n_opt:
        subtitle += f", {n_opt} opt-out"
    fig.suptitle(title or subtitle, fontsize=11)
    if title:
        ax.set_title(subtitle, fontsize=8)

    return _save(fig, path)


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
