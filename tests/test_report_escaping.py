"""What the report shows from summary.json is text, never markup (issue 21, part 7c): the Markdown
comparison table (the Kubeflow UI renders it, and Markdown passes HTML through), the report's
Markdown and the HTML page escape every value, so a method name holding `|`, a newline or
`<img src=x onerror=alert(1)>` neither breaks the table nor runs in the viewer."""

from __future__ import annotations

import re
from types import SimpleNamespace

from fedpipe.run.report import comparison_table, markdown, render_html

HOSTILE = "evil|name\n| injected | row |\n<img src=x onerror=alert(1)><script>alert(2)</script>`code`[link](javascript:x)"


def summary(method=HOSTILE, **changes) -> dict:
    s = {
        "title": f"{method} on mnist5k", "run_id": "r", "method": method, "dataset": "mnist5k<b>", "partition": "path|ological",
        "num_clients": 3, "rounds": 2, "seed": 0, "training_seconds": 1.0,
        "personalized_accuracy": {"mean": 0.5, "std": 0.1, "weighted": 0.5, "clients": 3},
        "global_model": {"top1": 0.4, "top5": 0.9, "loss": 1.2, "ece": 0.05, "n": 10},
        "communication": {"bytes_uploaded": 2_000_000, "bytes_downloaded": 2_000_000},
    }
    s.update(changes)
    return s


def unescaped_pipes(line: str) -> int:
    return len(re.findall(r"(?<!\\)\|", line))


def test_a_hostile_method_name_renders_an_escaped_table():
    table = comparison_table([summary(), summary(method="fedavg")])
    lines = table.splitlines()
    assert len(lines) == 2 + 2 + 2  # head, blank, header, rule, one row per summary: no injected row
    for row in lines[2:]:
        assert unescaped_pipes(row) == 8  # seven cells
    assert "<img" not in table and "<script" not in table and "<b>" not in table
    assert "&lt;img src=x onerror=alert\\(1\\)&gt;" in table  # shown as text
    assert "`" not in table.replace("\\`", "")
    assert "](javascript" not in table
    assert lines[0].startswith("mnist5k&lt;b&gt;, path\\|ological split")


def test_non_numbers_in_a_summary_are_shown_as_escaped_text():
    hostile_scores = {"mean": "<img src=x onerror=alert(1)>", "std": None, "weighted": 0.5, "clients": 3}
    table = comparison_table([summary(method="fedavg", personalized_accuracy=hostile_scores,
                                      global_model={"top1": "|x|", "top5": 0.9, "loss": 1.0, "ece": 0.1})])
    row = table.splitlines()[-1]
    assert "<img" not in row and unescaped_pipes(row) == 8 and "n/a" in row


def test_md_text_keeps_one_line_and_no_markup():
    from fedpipe.run.report import md_text

    text = md_text("a\r\nb\tc | <x onerror=1> ` * _ [ ]")
    assert "\n" not in text and "\r" not in text and "<" not in text and ">" not in text
    assert unescaped_pipes(text) == 0


def test_the_report_markdown_escapes_the_title_and_fences_its_summary():
    pers = SimpleNamespace(candidate_label=None, clients=[])
    md = markdown(summary(method="fed```avg"), pers)
    assert md.splitlines()[0].startswith("# fed\\`\\`\\`avg") and "<img" not in md.splitlines()[0]
    fence = md.splitlines()[2]
    assert set(fence) == {"`"} and len(fence) > 3  # longer than any backtick run inside, so nothing closes it early
    assert md.count(fence) == 2


def test_the_html_report_escapes_title_lines_and_image_names():
    page = render_html(HOSTILE, [HOSTILE], {'x"><img src=x onerror=alert(3)>.png': b"\x89PNG"})
    assert "<script" not in page and "onerror=alert(1)>" not in page
    assert page.count("<img") == 1  # the embedded plot only
    assert 'alt="x&quot;&gt;&lt;img' in page
