"""The report of a run: a summary (JSON and Markdown), a per-client table, the candidate curve
(SuPerFed's lam curve) and the plots, all under <run>/report/ in the store."""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

from fedpipe import plots
from fedpipe.algorithms.base import Algorithm, Phase
from fedpipe.data.federated import FederatedData
from fedpipe.engine.evaluation import PersonalizedResult, Scores, evaluate_global, evaluate_personalized
from fedpipe.engine.state import PhaseState
from fedpipe.run.config import RunConfig
from fedpipe.run.layout import RunLayout
from fedpipe.run.privacy import privacy_summary
from fedpipe.store import Store
from fedpipe.telemetry.jsonl import read_rounds
from fedpipe.telemetry.release import releasable_row

#: put_plot(name, draw): draw(path) renders a PNG to `path`, which goes into the report folder as `name`
PutPlot = Callable[[str, Callable[[Path], object]], object]


def put_plot(store: Store, layout: RunLayout, name: str, draw: Callable[[Path], object]) -> str:
    """Render a plot into a temporary file and store it in the run's report folder; returns its key."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        draw(path)
        store.put(layout.report(name), path.read_bytes())
    return layout.report(name)


def write_report(cfg: RunConfig, store: Store, layout: RunLayout, algorithm: Algorithm, state: PhaseState,
                 data: FederatedData, phases: list[Phase], put_plot: PutPlot) -> dict:
    pers, glob = _evaluate(cfg, algorithm, state, data, on_global_test=cfg.eval.personalized_on_global_test)
    rows = read_rounds(store, [layout.rounds(p.name) for p in phases])
    summary = build_summary(cfg, layout.run_id, pers, glob, rows, data)
    summary.update(privacy_summary(cfg, state))
    # the report is published (MLflow, Kubeflow's UI): with privacy on its plots draw only what the round
    # telemetry may release (no training loss, no method statistics); the round log in the store keeps the rest
    shown = [releasable_row(r) for r in rows] if cfg.privacy.enabled else rows

    store.put_text(layout.report("summary.json"), json.dumps(summary, indent=2))
    per_client = clients_csv(pers, data)
    store.put_text(layout.report("clients.csv"), per_client)
    put_plot("accuracy.png", lambda p: plots.accuracy_per_round(shown, p, phases, title=summary["title"]))
    if len(pers.clients[0].candidates) > 1:
        store.put_text(layout.report(f"{pers.candidate_label}_curve.csv"), curve_csv(pers))
        put_plot(f"{pers.candidate_label}_curve.png", lambda p: plots.candidate_curve(pers, p, title=summary["title"]))
    extra = algorithm.report_plots(shown)
    for name, draw in extra.items():
        put_plot(name, draw)
    store.put_text(layout.report("report.md"), markdown(summary, pers, list(extra), per_client))
    summary["report"] = store.url(layout.report_dir)
    return summary


def score_summary(cfg: RunConfig, run_id: str, algorithm: Algorithm, state: PhaseState, data: FederatedData) -> dict:
    """The summary's accuracy fields for `state` on `data`, without the round log or any file."""
    return {**build_summary(cfg, run_id, *_evaluate(cfg, algorithm, state, data), [], data), **privacy_summary(cfg, state)}


def _evaluate(cfg: RunConfig, algorithm: Algorithm, state: PhaseState, data: FederatedData,
              on_global_test: bool = False) -> tuple[PersonalizedResult, Scores | None]:
    """The personalized models (chosen as eval.candidates says) and the global model, scored on `data`."""
    pers = evaluate_personalized(algorithm, state.server, state.clients, data, cfg.eval.batch_size, cfg.eval.ece_bins,
                                 on_global_test=on_global_test, candidates=cfg.eval.candidates)
    return pers, evaluate_global(algorithm, state.server, data, cfg.eval.batch_size, cfg.eval.ece_bins)


def _scores(s: Scores | None) -> dict | None:
    return None if s is None else {"top1": s.accuracy, "top5": s.top5, "loss": s.loss, "ece": s.ece, "n": s.n}


def build_summary(cfg: RunConfig, run_id: str, pers: PersonalizedResult, glob: Scores | None, rows: list[dict],
                  data: FederatedData) -> dict:
    personalized = {
        "mean": pers.mean_accuracy,
        "std": pers.std_accuracy,
        "weighted": pers.weighted_accuracy,
        "clients": len(pers.clients),
    }
    if pers.mean_global_test_accuracy is not None:
        personalized["on_global_test"] = pers.mean_global_test_accuracy
    if pers.candidate_label:
        chosen = sorted(c.candidates[c.chosen] for c in pers.clients)
        personalized[f"chosen_{pers.candidate_label}"] = {
            "median": chosen[len(chosen) // 2],
            "mean": sum(chosen) / len(chosen),
            "selected_on": "validation split",
        }
        personalized["test_oracle_mean"] = pers.oracle_mean_accuracy
        if pers.pooled_choice is not None:
            personalized["pooled_choice_mean"] = pers.pooled_mean_accuracy
            personalized[f"pooled_{pers.candidate_label}"] = pers.clients[0].candidates[pers.pooled_choice]
        personalized["selected_by"] = cfg.eval.candidates
    # per client, in client order: what a study's paired tests over clients and its fairness column read
    personalized["client_accuracies"] = [c.accuracy for c in pers.clients]
    # with privacy on, traffic and time are withheld (None): un-noised sums over the rounds' sampled clients
    # (the traffic counts them; the time grows with their data), which the summary would publish
    private = cfg.privacy.enabled
    return {
        "title": f"{cfg.method.name} on {cfg.data.dataset} ({cfg.partition.scheme}, {data.num_clients} clients, seed {cfg.run.seed})",
        "run_id": run_id,
        "method": cfg.method.name,
        "model": cfg.model_name(tuple(data.input_shape)),
        "model_chosen_by": "auto" if cfg.model.name == "auto" else "config",
        "dataset": cfg.data.dataset,
        "partition": cfg.partition.scheme,
        "num_clients": data.num_clients,
        "rounds": cfg.train.rounds,
        "seed": cfg.run.seed,
        "evaluated_on": cfg.eval.split,  # validation: a tuning trial's run (its test splits were never scored)
        "personalized_accuracy": personalized,
        "global_model": _scores(glob),
        "communication": {
            "bytes_uploaded": None if private else int(sum(r["bytes_uploaded"] for r in rows)),
            "bytes_downloaded": None if private else int(sum(r["bytes_downloaded"] for r in rows)),
        },
        "training_seconds": None if private else float(sum(r["seconds"] for r in rows)),
        **({"data": {"source": cfg.data.source, "snapshot": cfg.data.snapshot}} if cfg.data.snapshot else {}),
    }


# A spreadsheet runs a cell that starts with = + - @ (or a tab or carriage return before one) as a formula:
# a client named =HYPERLINK(...) in clients.csv would. OWASP's CSV-injection advice: start such a text cell
# with a single quote, which spreadsheets show as text; the report's tables read the name back without it.
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def csv_text(value: str) -> str:
    """A text cell of a CSV file that a spreadsheet shows as text and never runs as a formula."""
    return "'" + value if value.startswith(_FORMULA_STARTS) else value


def csv_text_read(cell: str) -> str:
    """The text `csv_text` wrote."""
    return cell[1:] if cell.startswith("'") and cell[1:].startswith(_FORMULA_STARTS) else cell


def clients_csv(pers: PersonalizedResult, data: FederatedData) -> str:
    out = io.StringIO()
    w = csv.writer(out)
    label = pers.candidate_label
    head = ["client", *(["name"] if data.client_names else []), "opt_out", "train", "val", "test", "accuracy", "loss", "ece",
            "global_test_accuracy"]
    if label:
        head += [f"chosen_{label}", f"oracle_{label}", "oracle_accuracy"]
    w.writerow(head)
    by_id = {c.client_id: c for c in data.clients}
    for c in pers.clients:
        d, t = by_id[c.client_id], c.test[c.chosen]
        glob = "" if c.on_global_test is None else f"{c.on_global_test.accuracy:.4f}"
        name = [csv_text(data.client_names[c.client_id])] if data.client_names else []  # from the user's files
        row = [c.client_id, *name, int(c.opt_out), len(d.train), len(d.val), len(d.test), f"{t.accuracy:.4f}", f"{t.loss:.4f}", f"{t.ece:.4f}", glob]
        if label:
            row += [c.candidates[c.chosen], c.candidates[c.oracle], f"{c.test[c.oracle].accuracy:.4f}"]
        w.writerow(row)
    return out.getvalue()


def curve_csv(pers: PersonalizedResult) -> str:
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow([pers.candidate_label, "mean_test_accuracy", "std_test_accuracy", "clients_choosing_it"])
    picks = [c.candidates[c.chosen] for c in pers.clients]
    for value, mean, std in pers.curve():
        w.writerow([value, f"{mean:.4f}", f"{std:.4f}", picks.count(value)])
    return out.getvalue()


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}%"


def summary_lines(summary: dict) -> list[str]:
    """The summary as aligned lines for a terminal."""
    p, g, c = summary["personalized_accuracy"], summary["global_model"], summary["communication"]
    lines = [
        summary["title"],
        *([f"  model                  {summary['model']}" + (" (model.name=auto picked it for these inputs)"
                                                         if summary.get("model_chosen_by") == "auto" else "")] if "model" in summary else []),
        f"  personalized accuracy  {_pct(p['mean'])} ± {_pct(p['std'])} (mean over {p['clients']} clients; sample-weighted {_pct(p['weighted'])})",
    ]
    if "on_global_test" in p:
        lines.append(f"  ... on global test    {_pct(p['on_global_test'])} (each client's personalized model on the balanced global test set)")
    for key, val in p.items():
        if key.startswith("chosen_"):
            name = key.removeprefix("chosen_")
            lines.append(f"  chosen {name:<15} median {val['median']:.2f}, mean {val['mean']:.2f} (picked per client on its validation split)")
            lines.append(f"  test-oracle {name:<10} {_pct(p['test_oracle_mean'])} (best {name} on each client's test split: optimistic, for reference)")
    if g is None:
        lines.append("  global model           none (this method trains no global model)")
    else:
        lines.append(f"  global model           top-1 {_pct(g['top1'])}, top-5 {_pct(g['top5'])}, loss {g['loss']:.3f}, ECE {g['ece']:.3f}")
    if c.get("bytes_uploaded") is not None:  # None: withheld with privacy on (the privacy lines say so)
        lines.append(f"  communication          {c['bytes_uploaded'] / 1e6:.1f} MB up, {c['bytes_downloaded'] / 1e6:.1f} MB down")
    if summary.get("training_seconds") is not None:
        lines.append(f"  training time          {summary['training_seconds']:.0f} s")
    if isinstance(summary.get("privacy"), dict):
        lines += privacy_lines(summary["privacy"])
    if isinstance(summary.get("data"), dict):
        d = summary["data"]
        lines.append(f"  data                   {d.get('source')} (snapshot {str(d.get('snapshot'))[:12]}...)")
    if "report" in summary:
        lines.append(f"  report                 {summary['report']}")
    return lines


def privacy_lines(p: dict) -> list[str]:
    """The summary's privacy lines: epsilon at delta, what it covers and what spent it; then what it does not
    cover and what the report withholds (a summary written before these were recorded: the first line only)."""
    stopped = p.get("stopped_after_round")
    covers = f" for {p['covers']}" if p.get("covers") else ""
    lines = [(f"  privacy                epsilon {_number(p.get('epsilon'), '.3f')} at delta {_number(p.get('delta'), '.2g')}{covers} "
              f"({p.get('mode')} DP, {p.get('private_rounds')} private rounds, noise multiplier {_number(p.get('noise_multiplier'), '.3f')}, "
              f"clip {_number(p.get('clip'), 'g')}, {p.get('accountant')} accountant, Poisson sampling)"
              + (f"; target_epsilon {p.get('target_epsilon')} stopped training after round {stopped}" if stopped is not None else "")
              + (f"; against the server (local DP, every round, no amplification): epsilon {_number(p['epsilon_against_server'], '.3f')}"
                 if p.get("epsilon_against_server") is not None else ""))]
    if p.get("not_a_guarantee"):
        lines.append(f"  NOT PRIVATE            {p['not_a_guarantee']}")
    if p.get("not_covered"):
        lines.append(f"  not covered            {p['not_covered']}" + (f"; withheld: {p['withheld']}" if p.get("withheld") else ""))
    return lines


# --- Markdown and HTML from values that may come from a file ---------------------------------------------
# The comparison table is rendered as Markdown by the Kubeflow UI (and Markdown passes HTML through)
# from summary.json objects read back from the store: anything in them (a method name, a title) is
# text, never markup. Each cell is HTML-escaped (so <script> or <img onerror=...> shows as text),
# Markdown's own syntax is backslash-escaped, and a line break or a pipe cannot end a cell or a row.
_MARKDOWN_SPECIALS = re.compile(r"([\\`*_{}\[\]()#+!|~-])")


def md_text(value: object, limit: int = 200) -> str:
    """`value` as inert Markdown text on one line: HTML-escaped, Markdown syntax escaped, at most
    `limit` characters of the original."""
    text = " ".join(str(value).split())  # newlines, tabs and carriage returns become single spaces
    text = text if len(text) <= limit else text[:limit - 3] + "..."
    return _MARKDOWN_SPECIALS.sub(r"\\\1", html.escape(text, quote=False))  # no tag can form, so quotes are inert


def _number(value: object, fmt: str, scale: float = 1.0, suffix: str = "") -> str:
    """A number formatted for a table, or the escaped text of whatever else the summary holds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "n/a" if value is None else md_text(value, 50)
    return f"{scale * value:{fmt}}{suffix}"


def _fence(lines: list[str]) -> str:
    """A code fence longer than any run of backticks in `lines`, so no line can close it."""
    longest = max((len(run) for line in lines for run in re.findall(r"`+", line)), default=0)
    return "`" * max(3, longest + 1)


def markdown(summary: dict, pers: PersonalizedResult, extra_plots: list[str] = (), clients: str = "") -> str:
    body = summary_lines(summary)
    fence = _fence(body)
    lines = [f"# {md_text(summary['title'], 500)}", "", fence, *body, fence, ""]
    lines += ["![accuracy per round](accuracy.png)", ""]
    if pers.candidate_label and len(pers.clients[0].candidates) > 1:
        lines += [f"![{pers.candidate_label} curve]({pers.candidate_label}_curve.png)", ""]
    lines += [f"![{name}]({name})" for name in extra_plots]
    lines += ["![partition](partition_heatmap.png)", ""]
    lines += clients_markdown(clients) if clients else ["Per-client results: [clients.csv](clients.csv).", ""]
    return "\n".join(lines)


MAX_CLIENT_ROWS = 200  # clients listed in a report's table; more: the worst and the best, and clients.csv for all


def _client_rows(clients_csv_text: str) -> tuple[list[str], list[list[str]]]:
    """clients.csv's columns for a report table: client (its name when it has one), samples, accuracy and the
    chosen candidate; rows worst first (what a reader looks for), trimmed to MAX_CLIENT_ROWS."""
    table = list(csv.DictReader(io.StringIO(clients_csv_text)))
    chosen = next((k for k in (table[0] if table else {}) if k.startswith("chosen_")), None)
    head = ["client", "train / val / test", "accuracy", *([chosen.replace("_", " ")] if chosen else []), "opt-out"]
    rows = [[csv_text_read(r.get("name") or "") or r["client"], f"{r['train']} / {r['val']} / {r['test']}", r["accuracy"],
             *([r[chosen]] if chosen else []), "yes" if r.get("opt_out") == "1" else ""]
            for r in sorted(table, key=lambda r: float(r["accuracy"]))]
    if len(rows) > MAX_CLIENT_ROWS:
        rows = rows[: MAX_CLIENT_ROWS - 20] + [["...", "", "", *([""] if chosen else []), ""]] + rows[-20:]
    return head, rows


def clients_markdown(clients_csv_text: str) -> list[str]:
    """The report's per-client table (Markdown, every cell escaped: client names come from the user's files)."""
    head, rows = _client_rows(clients_csv_text)
    n = clients_csv_text.count("\n") - 1
    out = ["## Clients", "", f"{n} client(s), worst accuracy first" + (f" ({MAX_CLIENT_ROWS - 20} worst and 20 best shown; "
                                                                      "all in [clients.csv](clients.csv))" if n > MAX_CLIENT_ROWS else
                                                                      "; also in [clients.csv](clients.csv)") + ".", "",
           "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    out += ["| " + " | ".join(md_text(v, 120) for v in row) + " |" for row in rows]
    return [*out, ""]


_SORTABLE = ("<script>document.querySelectorAll('table.sortable th').forEach((th,i)=>th.onclick=()=>{const b=th.closest('table')"
             ".tBodies[0];const r=[...b.rows];const n=r.every(x=>!isNaN(parseFloat(x.cells[i].textContent)));const d=th.dataset.d="
             "th.dataset.d==='1'?'-1':'1';r.sort((p,q)=>{const a=p.cells[i].textContent,c=q.cells[i].textContent;return d*(n?"
             "parseFloat(a)-parseFloat(c):a.localeCompare(c))});r.forEach(x=>b.appendChild(x))});</script>")


def clients_html(clients_csv_text: str) -> str:
    """The per-client table as HTML, sortable by a click on a column's header (every cell escaped)."""
    head, rows = _client_rows(clients_csv_text)
    cells = "".join(f"<tr>{''.join(f'<td>{html.escape(v)}</td>' for v in row)}</tr>" for row in rows)
    return ("<h3>Clients</h3><p>Worst accuracy first; click a column's header to sort by it.</p>"
            "<table class='sortable' border='1' cellpadding='3' style='border-collapse:collapse'><thead><tr>"
            + "".join(f"<th style='cursor:pointer'>{html.escape(h)}</th>" for h in head)
            + f"</tr></thead><tbody>{cells}</tbody></table>{_SORTABLE}")


def render_html(title: str, lines: list[str], images: dict[str, bytes], extra_html: str = "") -> str:
    """A self-contained HTML page (plots embedded as data URIs) for the Kubeflow UI's HTML viewer; `extra_html`
    (a table this module built, its cells escaped) goes after the plots."""
    body = "".join(
        f'<figure><img alt="{html.escape(name)}" style="max-width:100%" src="data:image/png;base64,{base64.b64encode(png).decode()}"></figure>'
        for name, png in images.items()
    )
    text = f"<pre>{html.escape(chr(10).join(lines))}</pre>" if lines else ""
    return f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head><body><h2>{html.escape(title)}</h2>{text}{body}{extra_html}</body></html>"


def comparison_table(summaries: list[dict]) -> str:
    """One row per method, in the shape of the papers' tables: personalized accuracy and the global
    model's top-1 / top-5 / ECE / loss, and the traffic."""
    lines = [
        "| method | personalized acc. (mean ± std over clients) | global top-1 | global top-5 | ECE | loss | MB up |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in sorted(summaries, key=lambda s: str(s["method"])):
        p, g = s["personalized_accuracy"], s["global_model"]
        pct = lambda x: _number(x, ".2f", 100, "%")  # noqa: E731
        glob = ["n/a"] * 4 if g is None else [pct(g["top1"]), pct(g["top5"]), _number(g["ece"], ".3f"), _number(g["loss"], ".3f")]
        up = _number(s["communication"]["bytes_uploaded"], ".1f", 1e-6)
        lines.append(f"| {md_text(s['method'])} | {pct(p['mean'])} ± {pct(p['std'])} | " + " | ".join(glob) + f" | {up} |")
    first = summaries[0] if summaries else {}
    head = ", ".join(md_text(first.get(k, "?"), 100) + tail for k, tail in
                     (("dataset", ""), ("partition", " split"), ("num_clients", " clients")))
    return f"{head}, seed {md_text(first.get('seed', '?'), 30)}" + "\n\n" + "\n".join(lines)


def model_line_markdown(line: str, rows: list[dict], promoted: int | None, history: list[dict], decision: dict | None = None) -> str:
    """The report's "Model line" page (`report/model_line.md`, written when a run is published): the line's
    versions with their accuracy, data snapshot and the gate's decision, then its promotions and rollbacks.
    `rows`: {version, run_id, created, personalized_accuracy, global_accuracy, data, promoted, reason} each;
    every text from a record is escaped (records are files someone else may have written)."""
    pct = lambda x: _number(x, ".2f", 100, "%")  # noqa: E731
    lines = [f"# Model line {md_text(line, 100)}", "",
             f"Promoted version: {md_text(promoted) if promoted is not None else 'none'}.", "",
             "| version | run | personalized acc. | global top-1 | data snapshot | decision |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        data = r.get("data") if isinstance(r.get("data"), dict) else {}
        digest = str(data.get("digest") or "")[:12]
        snapshot = f"{md_text(data.get('source', ''), 120)} ({md_text(digest, 12)})" if data else "n/a"
        mark = " (promoted now)" if r.get("version") == promoted else ""
        verdict = "promoted" if r.get("promoted") else "not promoted"
        lines.append(f"| {md_text(r.get('version'))}{mark} | {md_text(r.get('run_id'), 120)} | {pct(r.get('personalized_accuracy'))} | "
                     f"{pct(r.get('global_accuracy'))} | {snapshot} | {verdict}: {md_text(r.get('reason', ''), 400)} |")
    if decision:
        lines += decision_markdown(decision)
    if history:
        lines += ["", "Promotions and rollbacks, oldest first:", ""]
        lines += [f"- {md_text(e.get('time'), 40)}: {md_text(e.get('action'), 20)} version {md_text(e.get('version'))}: "
                  f"{md_text(e.get('reason', ''), 400)}" for e in history]
    return "\n".join(lines) + "\n"


def decision_markdown(d: dict) -> list[str]:
    """The gate's decision for this run's version: what it compared on, the new samples apart, the drop check's
    per-client figures and the new clients' floors (every text escaped: the record may come from someone else)."""
    pct = lambda x: _number(x, ".2f", 100, "%")  # noqa: E731
    out = ["", "## This run's version: the gate's decision", "", f"{md_text(d.get('reason', ''), 1000)}", ""]
    c = d.get("compared") if isinstance(d.get("compared"), dict) else {}
    if c:
        out.append(f"- Compared on {md_text(c.get('on', ''), 400)}: {md_text(c.get('samples'))} client test samples over "
                   f"{md_text(c.get('clients'))} shared clients, {md_text(c.get('global_samples'))} global test samples.")
    n = d.get("new_samples") if isinstance(d.get("new_samples"), dict) else {}
    if n.get("samples") or n.get("global_samples"):
        out.append(f"- New test samples, reported apart (not decided on): {md_text(n.get('samples'))} client samples, candidate "
                   f"{pct(n.get('candidate'))} vs promoted {pct(n.get('champion'))}; {md_text(n.get('global_samples'))} global "
                   f"samples, candidate {pct(n.get('candidate_global'))} vs promoted {pct(n.get('champion_global'))}.")
    check = d.get("drop_check") if isinstance(d.get("drop_check"), dict) else {}
    if check:
        state = "suspect" if check.get("suspect") else "not suspect"
        note = f" {md_text(check.get('note'), 400)}" if check.get("note") else ""
        out += ["", f"Drop check: {state}, {md_text(check.get('flagged_count', 0))} of {md_text(check.get('checked', 0))} "
                f"client(s) flagged.{note}", ""]
        rows = check.get("clients") if isinstance(check.get("clients"), list) else []
        if rows:
            out += ["| client | promoted model then | on the new drop | test samples | label shift | flagged |",
                    "| --- | --- | --- | --- | --- | --- |"]
            out += [f"| {md_text(r.get('client'), 100)} | {pct(r.get('then'))} | {pct(r.get('now'))} | {md_text(r.get('test_samples'))} | "
                    f"{_number(r.get('label_shift'), '.2f', 1, '')} | {md_text(r.get('flagged') or 'no', 300)} |"
                    for r in rows if isinstance(r, dict)]
    floors = d.get("new_client_floors") if isinstance(d.get("new_client_floors"), dict) else {}
    if floors:
        out += ["", "New clients and their floors:", ""]
        out += [f"- {md_text(name, 100)}: candidate {pct(f.get('candidate'))}, floor {pct(f.get('floor'))} "
                f"({md_text(f.get('from', ''), 200)})" for name, f in floors.items() if isinstance(f, dict)]
    return out
