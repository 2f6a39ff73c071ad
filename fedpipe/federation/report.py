"""The report of a federated run, made from what the sites reported (no sample, no personal model left a site).

`write_report(out, report_dir, title)` reads the ServerApp's outputs in `out` (`<store>/<run>/federation/`: census.json,
evaluation.json, rounds.jsonl) and writes the run's report where a simulation's goes, `<store>/<run>/report/`:

    summary.json   the headline figures and every site's scores, by site name
    sites.csv      one row per site: its split sizes (the census), its personalized accuracy and chosen candidate,
                   the global model on its held-out share, the rounds it answered and the rounds it failed
    census.png     the census heatmap (with privacy on, of the label counts the sites released with noise)
    rounds.png     per round: the sites' training loss, the sites that answered or failed, the bytes up and down
    report.html    all of it on one self-contained page (the Kubeflow UI's HTML viewer and a browser show it)

The ServerApp's files may sit on a volume the sites' operators can reach: each is bounded and parsed as data
(`fedpipe.safe_load.parse_json`), and every name in them is escaped where it is shown (CSV cells that a
spreadsheet would run as formulas, HTML).
"""

from __future__ import annotations

import csv
import html
import io
import json
import statistics
from collections import Counter
from pathlib import Path

from fedpipe.errors import CorruptArtifactError
from fedpipe.plots import census_heatmap, federated_rounds
from fedpipe.run.report import _number, clients_html, csv_text, md_text, render_html
from fedpipe.safe_load import parse_json

MAX_OUTPUT_BYTES = 64 * 2**20  # census.json / evaluation.json / rounds.jsonl of even a large federation are far smaller
SITES_CSV_COLUMNS = ("client", "name", "train", "val", "test", "holdout", "accuracy", "chosen", "holdout_accuracy",
                     "holdout_samples", "rounds_answered", "rounds_failed", "opt_out")


def read_output(path: Path, what: str):
    """One of the ServerApp's JSON outputs (a .jsonl: its lines), bounded and parsed as data."""
    if not path.exists():
        raise CorruptArtifactError(f"{path} is missing: the federated run did not finish its evaluation (see error.json "
                                   "beside it, or run it again)")
    data = path.read_bytes()[: MAX_OUTPUT_BYTES + 1]
    if path.suffix == ".jsonl":
        return [parse_json(line.encode(), str(path), what, MAX_OUTPUT_BYTES, CorruptArtifactError)
                for line in data.decode("utf-8", "replace").splitlines() if line.strip()]
    return parse_json(data, str(path), what, MAX_OUTPUT_BYTES, CorruptArtifactError)


def write_report(out: Path, report_dir: Path, title: str, urls: tuple[str, str] | None = None, method: str | None = None) -> dict:
    """The federated run's report (see the module's docstring); returns its summary. `urls`: where the outputs and the
    report are shown to be (the run's store), when `out` and `report_dir` are local copies; `method`: the run's, for a
    benchmark's comparison table (`comparison_table`)."""
    census, scores = read_output(out / "census.json", "census"), read_output(out / "evaluation.json", "site evaluation")
    rounds = read_output(out / "rounds.jsonl", "round log")
    report_dir.mkdir(parents=True, exist_ok=True)
    summary = summarise(census, scores, rounds, title, out)
    if method:
        summary["method"] = method
    images = {}
    if census["sites"] and census["sites"][0].get("counts"):  # with privacy noised (or withheld: then none)
        images["census.png"] = census_heatmap(census, report_dir / "census.png").read_bytes()
    if rounds:
        images["rounds.png"] = federated_rounds(rounds, report_dir / "rounds.png", f"{title}: rounds").read_bytes()
    table = sites_csv(census, scores, rounds)
    (report_dir / "sites.csv").write_text(table)
    if urls:
        summary["folder"], summary["report"] = urls
    else:
        summary["report"] = str(report_dir / "report.html")
    (report_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    page = render_html(title, summary_lines(summary), images, _sites_html(table))
    (report_dir / "report.html").write_text(page)
    return summary


def summarise(census: dict, scores: dict, rounds: list[dict], title: str, out: Path) -> dict:
    """The headline figures: the sites by name, each one's scores, the global model's accuracy over the sites' held-out
    shares (weighted by their sizes), per round the sites, failures and bytes; the privacy spent, when private."""
    names = {str(s["client_id"]): s["name"] for s in census["sites"]}
    summary = {
        "title": title, "mode": "federation", "sites": len(census["sites"]),
        "personalized_accuracy": sum(s["accuracy"] for s in scores.values()) / max(len(scores), 1),
        "global_accuracy": held_out_accuracy(scores),
        "rounds": len(rounds), "failed_clients": sum(r["failed"] for r in rounds),
        "bytes_up": sum(r["bytes_up"] for r in rounds), "bytes_down": sum(r["bytes_down"] for r in rounds),
        "per_site": {names.get(cid, cid): s for cid, s in scores.items()},
        "missing_sites": sorted(n for cid, n in names.items() if cid not in scores),  # sites that did not evaluate
        # what the sites refused under their own policies: at the census (they then took no part) and in the rounds
        "refused": [str(r) for r in census.get("refused", [])] + [f"round {r['round']}: {rej['error'].removeprefix('SiteError: ')}"
                                                                  for r in rounds for rej in r.get("rejected", [])
                                                                  if " refused: " in str(rej.get("error", ""))],
        "folder": str(out),
    }
    private = [r["privacy"] for r in rounds if "privacy" in r]
    if private:
        summary["privacy"] = {"epsilon": private[-1]["epsilon"], "delta": private[-1]["delta"], "clip": private[-1]["clip"],
                              "private_rounds": len(private), "mode": "federated"}
        noise = [s["counts_noise"] for s in census["sites"] if s.get("counts_noise")]
        if noise:  # the census released noised label counts: spent once before the first round, part of this epsilon
            summary["privacy"]["census_noise"] = max(noise)
    return summary


def comparison_table(summaries: list[dict]) -> str:
    """A benchmark run as a federation (`fedpipe run --benchmark A --benchmark B` with engine.mode=federation, or the
    benchmark pipeline's federation branch): one row per method, each its own run through the same SuperLink on the
    same sites, in the shape of the simulation's table (`fedpipe.run.report.comparison_table`): the personalized
    accuracy over the sites (each on its own test split), the global model on the sites' held-out shares, the traffic,
    and the epsilon spent when private."""
    pct = lambda x: _number(x, ".2f", 100, "%")  # noqa: E731
    lines = ["| method | personalized acc. (mean ± std over sites) | global model (sites' held-out shares) | rounds | MB up | MB down | epsilon |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for s in sorted(summaries, key=lambda s: str(s.get("method", s.get("title", "")))):
        accs = [float(site["accuracy"]) for site in s.get("per_site", {}).values()]
        std = statistics.pstdev(accs) if accs else None
        eps = s.get("privacy", {}).get("epsilon") if s.get("privacy") else None
        lines.append(f"| {md_text(s.get('method', s.get('title', '?')))} | {pct(s['personalized_accuracy'])} ± {pct(std)} | "
                     f"{pct(s.get('global_accuracy'))} | {md_text(s.get('rounds'))} | {_number(s.get('bytes_up'), '.1f', 1e-6)} | "
                     f"{_number(s.get('bytes_down'), '.1f', 1e-6)} | {_number(eps, '.2f') if eps is not None else '-'} |")
    first = summaries[0] if summaries else {}
    sites = ", ".join(md_text(name, 60) for name in first.get("per_site", {}))
    return f"federated over {md_text(first.get('sites', '?'))} sites ({sites})" + "\n\n" + "\n".join(lines)


def held_out_accuracy(scores: dict, key: str = "holdout-accuracy") -> float | None:
    """A global model's accuracy over the sites' held-out shares (the global test set), each site's figure `key`
    weighted by its held-out samples; sites without it are left out; None when no site has it."""
    reported = [s for s in scores.values() if key in s and s.get("holdout-samples")]
    held = sum(s["holdout-samples"] for s in reported)
    return sum(s[key] * s["holdout-samples"] for s in reported) / held if held else None


def summary_lines(summary: dict) -> list[str]:
    """The summary as aligned lines, for the terminal and the report's page."""
    glob = summary["global_accuracy"]
    lines = [summary["title"],
             f"  sites                  {summary['sites']}: " + ", ".join(summary["per_site"]),
             f"  personalized accuracy  {summary['personalized_accuracy']:.4f} (mean over sites, each on its own test split)",
             f"  global model           {'n/a' if glob is None else f'{glob:.4f}'} (on the sites' held-out shares)",
             f"  rounds                 {summary['rounds']} ({summary['failed_clients']} failed site rounds); "
             f"{summary['bytes_up'] / 1e6:.1f} MB up, {summary['bytes_down'] / 1e6:.1f} MB down"]
    for refusal in summary.get("refused", [])[:20]:
        lines.append(f"  refused                {refusal}")
    if summary.get("missing_sites"):
        lines.append(f"  not evaluated          {', '.join(summary['missing_sites'])} (no answer to the evaluation)")
    if summary.get("privacy"):
        p = summary["privacy"]
        lines.append(f"  privacy                epsilon {p['epsilon']:.3f} at delta {p['delta']:.2g} after {p['private_rounds']} "
                     f"private rounds (clip {p['clip']})"
                     + (f" and the census's label counts (Gaussian noise, std {p['census_noise']:g})" if p.get("census_noise") else ""))
    if summary.get("report"):
        lines.append(f"  report                 {summary['report']}")
    return lines


def sites_csv(census: dict, scores: dict, rounds: list[dict]) -> str:
    """sites.csv: one row per site, in client-id order (see SITES_CSV_COLUMNS)."""
    answered = Counter(cid for r in rounds for cid in r.get("reported", {}))
    failed = Counter(str(rej["client"]) for r in rounds for rej in r.get("rejected", []))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(SITES_CSV_COLUMNS)
    for site in census["sites"]:
        cid = str(site["client_id"])
        counts = site.get("counts") or {}
        sizes = [sum(counts[k]) if counts.get(k) is not None else "" for k in ("train", "val", "test", "holdout")]
        s = scores.get(cid, {})
        w.writerow([cid, csv_text(str(site["name"])), *sizes, _cell(s, "accuracy", ".4f"), _cell(s, "chosen", "g"),
                    _cell(s, "holdout-accuracy", ".4f"), _cell(s, "holdout-samples", ".0f"), answered.get(cid, 0), failed.get(cid, 0),
                    int(bool(site.get("opt_out")))])
    return buf.getvalue()


def _cell(scores: dict, key: str, fmt: str) -> str:
    return format(scores[key], fmt) if key in scores else ""


def _sites_html(table: str) -> str:
    """The sites' table on the report's page (the simulation's sortable client table, fed the census's sizes), then
    the rounds each site answered or failed; every cell escaped."""
    rows = list(csv.DictReader(io.StringIO(table)))
    as_clients = io.StringIO()
    w = csv.DictWriter(as_clients, ["client", "name", "train", "val", "test", "accuracy", "chosen_candidate", "opt_out"],
                       lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({"client": r["client"], "name": r["name"], "train": r["train"], "val": r["val"], "test": r["test"],
                    "accuracy": r["accuracy"] or "nan", "chosen_candidate": r["chosen"], "opt_out": r["opt_out"]})
    rounds = "".join(f"<tr><td>{html.escape(r['name'])}</td><td>{html.escape(r['holdout_accuracy'])}</td>"
                     f"<td>{html.escape(r['rounds_answered'])}</td><td>{html.escape(r['rounds_failed'])}</td></tr>" for r in rows)
    return (clients_html(as_clients.getvalue()).replace("<h3>Clients</h3>", "<h3>Sites</h3>")
            + "<h3>The global model and the rounds, per site</h3><table border='1' cellpadding='3' style='border-collapse:collapse'>"
            "<tr><th>site</th><th>global model on its held-out share</th><th>rounds answered</th><th>rounds failed</th></tr>"
            f"{rounds}</table>")

