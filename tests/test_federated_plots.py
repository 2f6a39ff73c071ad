"""The federated report's pictures read true: the census heatmap's title fits its figure (a one-line title ran off
both edges of a narrow one), and the bytes plot does not make a flat line look like change (an axis spanning
0.442-0.443 MB with an offset did)."""

from __future__ import annotations

from fedpipe.plots import census_figure, rounds_figure


def _census(sites: int, classes: int) -> dict:
    split = {"train": [7] * classes, "val": [1] * classes, "test": [2] * classes, "holdout": [3] * classes}
    return {"sites": [{"client_id": i, "name": f"hospital-{chr(97 + i)}", "counts": split} for i in range(sites)],
            "labels": [f"class-{j}" for j in range(classes)]}


def _rounds(bytes_up: list[int]) -> list[dict]:
    return [{"round": i + 1, "phase": "federation", "loss": 1.0 / (i + 1), "clients": 2, "failed": 0,
             "bytes_up": b, "bytes_down": b + 100} for i, b in enumerate(bytes_up)]


def test_the_census_title_fits_its_figure():
    for sites, classes in ((2, 3), (2, 10), (30, 60)):
        fig = census_figure(_census(sites, classes))
        fig.canvas.draw()
        box = fig._suptitle.get_window_extent(fig.canvas.get_renderer())
        width, height = fig.canvas.get_width_height()
        assert 0 <= box.x0 and box.x1 <= width and box.y1 <= height, (sites, classes, box, width)
        assert " ".join(fig._suptitle.get_text().split()).endswith("as the global test set)")  # whole, wrapped


def test_the_bytes_axis_starts_at_zero_without_an_offset():
    fig = rounds_figure(_rounds([442_100, 442_400, 442_900]), "a run")
    fig.canvas.draw()
    ax_bytes = fig.axes[2]
    low, high = ax_bytes.get_ylim()
    assert low == 0 and high >= 0.4429, (low, high)
    assert ax_bytes.yaxis.get_offset_text().get_text() == ""  # no "+4.42e-1" above the axis
    # a 0.2% wobble is a flat line: it spans well under a tenth of the axis
    assert (0.4429 - 0.4421) / (high - low) < 0.01
