"""The study report on a results dict built by hand: two methods x three seeds x one split, with figures worked
out by hand in the comments, a method name that tries to inject markup, and a method that never reaches the
target accuracy."""

from __future__ import annotations

import copy
import re

import pytest

from fedpipe.study.report import _sensitivity_figure, write_study_report

HOSTILE = "<script>alert(1)</script>|evil $\\frac{$"
HOSTILE_MD = "&lt;script&gt;alert\\(1\\)&lt;/script&gt;\\|evil $\\\\frac\\{$"  # md_text: HTML-escaped, then \ ( ) | { escaped
HOSTILE_SLUG = "script_alert_1_script_evil_frac"
SPLIT = "pathological"
PNG = b"\x89PNG\r\n\x1a\n"


def final(seed: int, accuracy: float, global_accuracy, pooled, lowest: float, others: float, curve_accuracies: list) -> dict:
    """A final run: 12 clients, the lowest two at `lowest` and `lowest` + 0.1, ten at `others`; a curve of 1000 bytes
    up and 2000 down a round."""
    return {"split": SPLIT, "seed": seed, "seconds": 30.0 + seed,
            "test": {"personalized_accuracy": accuracy, "pooled_choice_accuracy": pooled, "test_oracle_accuracy": None,
                     "global_accuracy": global_accuracy, "client_accuracies": [lowest, lowest + 0.1] + [others] * 10},
            "curve": [{"round": r, "personalized_accuracy": a, "global_accuracy": None, "bytes_uploaded": 1000, "bytes_downloaded": 2000}
                      for r, a in enumerate(curve_accuracies, start=1)]}


def results() -> dict:
    fedavg = {
        "space": {"train.lr": "log-uniform [0.003, 0.3]", "train.mu": "uniform [0, 1]"},
        "trials": [{"number": i, "split": SPLIT, "params": {"train.lr": lr, "train.mu": mu}, "objective": obj, "state": "complete", "seconds": 1.0}
                   for i, (lr, mu, obj) in enumerate([(0.003, 0.1, 0.7), (0.01, 0.5, 0.88), (0.1, 0.9, 0.8)])]
        + [{"number": 3, "split": SPLIT, "params": {"train.lr": 0.3, "train.mu": 0.2}, "objective": None, "state": "fail"}],
        "chosen": {SPLIT: {"train.lr": 0.01, "train.mu": 0.5}},
        # accuracies 0.90, 0.92, 0.94; global 0.80, 0.82, 0.84; lowest clients 0.70 + 0.02 seed and 0.10 more; reaches 0.91 at round 3
        "finals": [final(s, 0.90 + 0.02 * s, 0.80 + 0.02 * s, 0.89, 0.70 + 0.02 * s, 0.95, [0.5, None, 0.91]) for s in range(3)],
        "optimistic": {SPLIT: {"accuracy": 0.95, "params": {"train.lr": 0.02}, "protocol": "best test-oracle accuracy over the tuning trials"}},
    }
    hostile = {
        "space": {"model.kind": "choice [a, b]"},
        "trials": [{"number": i, "split": SPLIT, "params": {"model.kind": k}, "objective": o, "state": "complete"}
                   for i, (k, o) in enumerate([("a", 0.6), ("b", 0.8)])],
        "chosen": {SPLIT: {"model.kind": "b<img src=x onerror=alert(2)>"}},
        # accuracies 0.80, 0.83, 0.86; no global model; lowest clients 0.60 + 0.02 seed and 0.10 more; never above 0.85
        "finals": [final(s, 0.80 + 0.03 * s, None, None, 0.60 + 0.02 * s, 0.90, [0.4, 0.85]) for s in range(3)],
        "optimistic": {SPLIT: {"accuracy": 0.97, "params": {"model.kind": "b"}, "protocol": "best test-oracle accuracy over the tuning trials"}},
    }
    return {"study": "demo", "objective": "val_personalized_accuracy", "dataset": "mnist5k",
            "budget": {"trials": 4, "rounds": 3, "sampler": "tpe"}, "seeds": [0, 1, 2], "splits": [SPLIT],
            "target_accuracy": 0.9, "methods": {"fedavg": fedavg, HOSTILE: hostile}}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    metrics = write_study_report(results(), out)
    return out, metrics, (out / "study.md").read_text(encoding="utf-8"), (out / "study.html").read_text(encoding="utf-8")


def table_row(md: str, first_cell_start: str) -> str:
    rows = [line for line in md.splitlines() if line.startswith("| " + first_cell_start)]
    assert rows, first_cell_start
    return rows[0]


def test_files_are_written_and_the_plots_are_pngs(rendered):
    out, _, md, page = rendered
    for name in ("accuracy_pathological.png", "sensitivity_fedavg.png", f"sensitivity_{HOSTILE_SLUG}.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 1000, name
        assert f"]({name})" in md
    assert md.startswith("# Study demo") and page.startswith("<!doctype html>")
    assert page.count("<img ") == 3 and page.count('src="data:image/png;base64,') == 3  # self-contained


def test_the_split_table_shows_the_hand_computed_figures(rendered):
    _, _, md, _ = rendered
    # fedavg: 0.90, 0.92, 0.94 -> mean 0.92, std 0.02, CI 0.92 ± 4.302653 * 0.02 / sqrt(3) = 0.92 ± 0.049683 -> 87.03% – 96.97%;
    # global 0.80, 0.82, 0.84 -> 82.00% ± 2.00%; worst 10% of 12 clients = the ceil(1.2) = 2 lowest: (0.70 + 0.80) / 2 = 0.75,
    # then 0.77, 0.79 -> 77.00% ± 2.00%;
    # target 0.9 first reached at round 3 by every seed, after 3 rounds x 3000 bytes = 9000 bytes = 0.009 MB; 30, 31, 32 s -> 31.0 s
    assert table_row(md, "**fedavg**") == ("| **fedavg** ★ | 92.00% ± 2.00% | 87.03% – 96.97% | 82.00% ± 2.00% | 77.00% ± 2.00% | 3.0 | "
                                           "0.009 MB | 31.0 s |")
    # the other: 0.80, 0.83, 0.86 -> mean 0.83, std 0.03, CI 0.83 ± 4.302653 * 0.03 / sqrt(3) = 0.83 ± 0.074524 -> 75.55% – 90.45%;
    # no global model; worst 10%: (0.60 + 0.70) / 2 = 0.65, 0.67, 0.69 -> 67.00% ± 2.00%; its curves top out at 0.85 < 0.9
    assert table_row(md, HOSTILE_MD) == (f"| {HOSTILE_MD} | 83.00% ± 3.00% | 75.55% – 90.45% | n/a | 67.00% ± 2.00% | "
                                         "not reached by 3 of 3 seeds | not reached by 3 of 3 seeds | 31.0 s |")
    assert md.count("★ |") == 1  # one best method, fedavg


def test_the_paired_tests_and_their_floor(rendered):
    _, metrics, md, _ = rendered
    row = table_row(md, HOSTILE_MD + " | p")
    # over seeds: differences -0.10, -0.09, -0.08, all negative: exact two-sided p = 2 / 2^3 = 0.25, its floor
    assert "p = 0.25, n = 3, median difference −9.00 pp |" in row
    assert "With 3 seeds the test over seeds cannot give a p\\-value below 0.25" in md
    # over clients: 3 seeds x 12 clients = 36 pairs, all lower (two by 0.10, ten by 0.05 per seed): median -0.05
    assert "| p &lt; 0.0001, n = 36, median difference −5.00 pp |" in row  # "<" HTML-escaped
    assert metrics[f"{HOSTILE_SLUG}__{SPLIT}__pvalue_seeds_vs_best"] == pytest.approx(0.25)
    assert metrics[f"{HOSTILE_SLUG}__{SPLIT}__pvalue_clients_vs_best"] < 1e-4


def test_the_protocol_table_shows_each_ranking_and_the_flip(rendered):
    _, _, md, page = rendered
    section = md.split("### Two protocols, side by side")[1]
    assert "OPTIMISTIC: test\\-oracle pick, best over hyperparameters" in section
    assert table_row(section, "fedavg") == "| fedavg | 92.00%, rank 1 | 89.00%, rank 1 | 95.00%, rank 2 | train.lr = 0.02 |"
    assert table_row(section, HOSTILE_MD) == f"| {HOSTILE_MD} | 83.00%, rank 2 | n/a | 97.00%, rank 1 | model.kind = b |"
    assert f"Ranking, honest: fedavg &gt; {HOSTILE_MD}." in section
    assert f"Ranking, OPTIMISTIC: {HOSTILE_MD} &gt; fedavg." in section
    assert "The ranking flips under OPTIMISTIC" in section
    assert "OPTIMISTIC: test-oracle pick" in page


def test_hyperparameters_and_budget_are_reported(rendered):
    _, _, md, _ = rendered
    assert "Budget, the same for every method: 4 tuning trials per method and split, 3 rounds per trial, sampler tpe" in md
    assert "seeds 0, 1, 2" in md
    assert table_row(md, "fedavg | pathological") == ("| fedavg | pathological | train.lr = 0.01, train.mu = 0.5 | "
                                                      "train.lr: log\\-uniform \\[0.003, 0.3\\], train.mu: uniform \\[0, 1\\] |")


def test_user_text_is_escaped_in_markdown_and_html(rendered):
    _, _, md, page = rendered
    for text in (md, page):
        assert "<script" not in text and "<img src=x" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;|evil $\\frac{$" in page
    assert "b&lt;img src=x onerror=alert\\(2\\)&gt;" in md
    for line in md.splitlines():
        if line.startswith("|"):
            assert len(re.findall(r"(?<!\\)\|", line)) == line.count(" | ") + 2  # every unescaped pipe is a cell border


def test_the_metrics(rendered):
    _, metrics, _, _ = rendered
    assert all(re.fullmatch(r"[a-zA-Z0-9_]+", k) for k in metrics)
    mine = {k.removeprefix(f"fedavg__{SPLIT}__"): v for k, v in metrics.items() if k.startswith("fedavg__")}
    assert set(mine) == {"test_accuracy_mean", "test_accuracy_std", "test_accuracy_ci_low", "test_accuracy_ci_high", "seeds",
                         "global_accuracy_mean", "worst10_accuracy_mean", "rounds_to_target_mean", "bytes_to_target_mean",
                         "seconds_mean", "is_best", "pooled_accuracy_mean", "optimistic_accuracy"}
    assert mine["test_accuracy_mean"] == pytest.approx(0.92) and mine["test_accuracy_std"] == pytest.approx(0.02)
    assert mine["test_accuracy_ci_low"] == pytest.approx(0.870317, abs=1e-6)
    assert mine["test_accuracy_ci_high"] == pytest.approx(0.969683, abs=1e-6)
    assert mine["worst10_accuracy_mean"] == pytest.approx(0.77) and mine["global_accuracy_mean"] == pytest.approx(0.82)
    assert (mine["rounds_to_target_mean"], mine["bytes_to_target_mean"], mine["is_best"]) == (3.0, 9000.0, 1.0)
    assert mine["optimistic_accuracy"] == 0.95 and mine["pooled_accuracy_mean"] == pytest.approx(0.89)
    theirs = {k.removeprefix(f"{HOSTILE_SLUG}__{SPLIT}__") for k in metrics if k.startswith(HOSTILE_SLUG + "__")}
    assert theirs == {"test_accuracy_mean", "test_accuracy_std", "test_accuracy_ci_low", "test_accuracy_ci_high", "seeds",
                      "worst10_accuracy_mean", "seconds_mean", "is_best", "optimistic_accuracy", "pvalue_seeds_vs_best",
                      "pvalue_clients_vs_best"}  # no global model, target not reached, no pooled estimator
    assert metrics[f"{HOSTILE_SLUG}__{SPLIT}__is_best"] == 0.0 and metrics[f"target_accuracy__{SPLIT}"] == 0.9


def test_without_a_target_the_report_takes_95_percent_of_the_best_and_says_so(tmp_path):
    data = results()
    data["target_accuracy"] = None
    metrics = write_study_report(data, tmp_path)
    md = (tmp_path / "study.md").read_text(encoding="utf-8")
    # 0.95 x fedavg's 0.92 = 0.874: fedavg's curves reach 0.91 at round 3; the other's 0.85 never does
    assert metrics[f"target_accuracy__{SPLIT}"] == pytest.approx(0.874)
    assert "87.40%: the study gave none, so 0.95 × the best method's \\(fedavg\\) final mean test accuracy 92.00%" in md
    assert metrics[f"fedavg__{SPLIT}__rounds_to_target_mean"] == 3.0
    assert "not reached by 3 of 3 seeds" in table_row(md, HOSTILE_MD)


def test_a_seed_that_misses_the_target_makes_it_not_reached(tmp_path):
    data = copy.deepcopy(results())
    data["methods"]["fedavg"]["finals"][1]["curve"][2]["personalized_accuracy"] = 0.89
    metrics = write_study_report(data, tmp_path)
    assert "| 77.00% ± 2.00% | not reached by 1 of 3 seeds |" in table_row((tmp_path / "study.md").read_text(), "**fedavg**")
    assert f"fedavg__{SPLIT}__rounds_to_target_mean" not in metrics


def test_the_sensitivity_plot_uses_a_log_axis_for_log_uniform_and_rings_the_chosen_trial():
    fig = _sensitivity_figure("fedavg", results()["methods"]["fedavg"], "val_personalized_accuracy")
    lr, mu = fig.axes
    # train.lr is "log-uniform [...]", train.mu "uniform [...]"; the failed trial (no objective) is left out
    assert lr.get_xscale() == "log" and mu.get_xscale() == "linear"
    points, ring = lr.collections
    assert len(points.get_offsets()) == 3 and ring.get_offsets().tolist() == [[0.01, 0.88]]  # the chosen lr and its objective
    assert mu.collections[1].get_offsets().tolist() == [[0.5, 0.88]]
    assert _sensitivity_figure("x", {"space": {"a": "uniform"}, "trials": []}, "objective") is None


def test_results_without_methods_are_refused(tmp_path):
    with pytest.raises(ValueError, match="no methods"):
        write_study_report({"study": "x", "methods": {}}, tmp_path)
    with pytest.raises(ValueError, match="other than an object"):
        write_study_report({"methods": {"a": [1]}}, tmp_path)


def test_malformed_values_are_shown_as_missing_not_trusted(tmp_path):
    data = {"study": ["x"], "target_accuracy": "0.9", "seeds": "abc", "budget": [1], "splits": None, "methods": {
        "m": {"space": ["x"], "chosen": [], "optimistic": "x", "trials": [1, {"params": "p", "objective": "1"}],
              "finals": [None, {"split": "s", "seed": [1], "test": {"personalized_accuracy": float("nan")}},
                         {"split": "s", "seed": 0, "seconds": "3", "curve": [{"round": "1"}, None],
                          "test": {"personalized_accuracy": 0.5, "client_accuracies": [0.1, "x"], "global_accuracy": True}}]}}}
    metrics = write_study_report(data, tmp_path)
    md = (tmp_path / "study.md").read_text(encoding="utf-8")
    # only the one well-formed final counts; a bool is no accuracy, a list with a string no client accuracies
    assert metrics == {"m__s__test_accuracy_mean": 0.5, "m__s__seeds": 1.0, "m__s__is_best": 1.0, "target_accuracy__s": 0.475}
    assert "| **m** ★ | 50.00% \\(1 seed\\) | n/a \\(1 seed\\) | n/a | n/a | not reached by 1 of 1 seeds |" in md
    assert "Split None" not in md
