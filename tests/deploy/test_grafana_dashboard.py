"""The Grafana dashboard: valid Grafana 10+ JSON, and every query answered by a real Prometheus.

There is no Grafana server here, so the JSON is checked for the structure Grafana needs; the PromQL
of every panel and variable runs against the real Prometheus of tests/conftest.py, after a
PrometheusSink pushed a run to the real Pushgateway it scrapes.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

import pytest
from deploytools import DASHBOARD_JSON

from fedpipe.telemetry.prometheus import METRICS

VARIABLES = ("run_id", "method", "phase", "dataset")
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
METRIC_NAME = re.compile(r"\bfedpipe_[a-z_]+\b")


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD_JSON.read_text())


def panels(dashboard: dict) -> list[dict]:
    """Every panel that shows data (rows only group them)."""
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def targets(dashboard: dict) -> list[tuple[str, dict]]:
    return [(p["title"], t) for p in panels(dashboard) for t in p["targets"]]


def test_is_a_grafana_10_dashboard(dashboard):
    assert dashboard["schemaVersion"] == 39
    assert dashboard["uid"] and dashboard["title"]
    assert "id" not in dashboard or dashboard["id"] is None  # provisioned dashboards get their own id
    (source,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert source["name"] == "DS_PROMETHEUS" and source["query"] == "prometheus"


def test_template_variables_are_label_values_of_fedpipe_metrics(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"] if v["type"] == "query"}
    assert set(variables) == set(VARIABLES)
    for name, variable in variables.items():
        query = variable["query"]["query"]
        match = re.fullmatch(r"label_values\((fedpipe_[a-z_]+)(\{.*\})?, *(\w+)\)", query)
        assert match, f"${name}: {query}"
        assert match[1] in METRICS and match[3] == name, f"${name}: {query}"
        assert variable["datasource"] == DATASOURCE
        assert variable["includeAll"] and variable["multi"] and variable["allValue"] == ".*"


def test_every_panel_queries_existing_fedpipe_metrics_through_the_variables(dashboard):
    assert panels(dashboard)
    for panel in panels(dashboard):
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], f"{panel['title']} has no query"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
    for title, target in targets(dashboard):
        names = set(METRIC_NAME.findall(target["expr"]))
        assert names and names <= set(METRICS), f"{title}: {target['expr']} names {names - set(METRICS)}"
        for variable in VARIABLES:
            assert f'{variable}=~"${variable}"' in target["expr"], f"{title}: {target['expr']} ignores ${variable}"
        assert target["datasource"] == DATASOURCE, title


def test_every_pushed_metric_is_on_the_dashboard(dashboard):
    shown = {name for _, t in targets(dashboard) for name in METRIC_NAME.findall(t["expr"])}
    assert shown == set(METRICS)


def test_panel_ids_are_unique_and_the_grid_has_no_overlaps(dashboard):
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    taken: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in taken, f"{panel['title']} overlaps {taken[(x, y)]}"
                taken[(x, y)] = panel["title"]


def test_accuracy_is_shown_over_time_and_as_latest_values(dashboard):
    by_type: dict[str, set[str]] = {}
    for panel in panels(dashboard):
        for target in panel["targets"]:
            by_type.setdefault(panel["type"], set()).update(METRIC_NAME.findall(target["expr"]))
    for metric in ("fedpipe_personalized_accuracy", "fedpipe_global_accuracy"):
        assert metric in by_type["timeseries"] and metric in by_type["table"]
    (table,) = [p for p in panels(dashboard) if p["type"] == "table"]
    assert all(t["instant"] and t["format"] == "table" for t in table["targets"])


# -- against a real Prometheus -------------------------------------------------------------------


def prometheus_get(prom: str, path: str, **params: str):
    """The data of a Prometheus API answer; a rejected query fails with Prometheus's reason."""
    url = f"{prom}{path}?" + urllib.parse.urlencode(params, doseq=True)
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = json.load(resp)
    except urllib.error.HTTPError as exc:
        pytest.fail(f"Prometheus rejected {params}: {exc.read().decode(errors='replace')}")
    assert body["status"] == "success", body
    return body["data"]


def push_one_run(pushgateway: str, prometheus: str):
    """Pushes a short run (one phase, three rounds) and waits until Prometheus scraped its end."""
    from fedpipe.telemetry import PhaseEvent, RoundEvent, RunLabels, Telemetry
    from fedpipe.telemetry.prometheus import PrometheusSink

    labels = RunLabels(
        run_id=f"dash-{uuid.uuid4().hex[:8]}", pipeline="fedpipe", method="superfed_mm", phase="federation", dataset="mnist5k"
    )
    sink = PrometheusSink(pushgateway)
    with Telemetry([sink]) as telemetry:
        telemetry.phase_started(PhaseEvent(labels=labels, total_rounds=3, first_round=1))
        for r in (1, 2, 3):
            telemetry.round_finished(
                RoundEvent(
                    labels=labels, round=r, phase_round=r, phase_rounds=3, clients=10, failed_clients=1,
                    train_loss=1.0 / r, personalized_accuracy=0.5 + 0.1 * r, global_accuracy=0.4 + 0.1 * r,
                    bytes_uploaded=1000, bytes_downloaded=2000, seconds=0.5, samples_per_second=400.0,
                    extra={"lam": 0.5},
                )
            )  # fmt: skip
        telemetry.phase_finished(PhaseEvent(labels=labels, total_rounds=3, first_round=1, finished=True, seconds=1.5))
    assert sink.lost_pushes == 0
    deadline = time.monotonic() + 20
    query = f'fedpipe_phase_finished{{run_id="{labels.run_id}"}} == 1'
    while not prometheus_get(prometheus, "/api/v1/query", query=query)["result"]:
        assert time.monotonic() < deadline, "Prometheus did not scrape the pushed run within 20 s"
        time.sleep(0.25)
    return labels


@pytest.mark.services
def test_every_query_runs_on_prometheus_and_returns_the_pushed_run(dashboard, pushgateway: str, prometheus: str):
    labels = push_one_run(pushgateway, prometheus)
    values = {"run_id": labels.run_id, "method": labels.method, "phase": labels.phase, "dataset": labels.dataset}

    def substitute(text: str) -> str:  # the values hold no regex metacharacters
        for name, value in values.items():
            text = text.replace(f"${name}", value)
        return text

    # Variables: Grafana answers label_values(metric{selector}, label) with the label values API.
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        metric, selector, label = re.fullmatch(
            r"label_values\((fedpipe_[a-z_]+)(\{.*\})?, *(\w+)\)", variable["query"]["query"]
        ).groups()
        found = prometheus_get(prometheus, f"/api/v1/label/{label}/values", **{"match[]": metric + substitute(selector or "")})
        assert values[label] in found, f"${variable['name']} does not offer {values[label]}: {found}"

    # Panels: every expression, as an instant query (tables) or a range query (time series).
    now = time.time()
    for title, target in targets(dashboard):
        expr = substitute(target["expr"])
        if target.get("instant"):
            result = prometheus_get(prometheus, "/api/v1/query", query=expr)
        else:
            result = prometheus_get(prometheus, "/api/v1/query_range", query=expr, start=str(now - 300), end=str(now), step="5")
        assert result["result"], f"{title}: {expr} returned no data"
        for series in result["result"]:
            if "run_id" in series["metric"]:
                assert series["metric"]["run_id"] == labels.run_id, f"{title}: {expr} returned another run"
