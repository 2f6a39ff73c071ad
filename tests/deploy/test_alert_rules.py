"""The chart's alert rule (issue 29): FedpipeDataDropSuspect fires when the drop check flags a retraining run's
data, evaluated by Prometheus's own rule engine (`promtool test rules`, from the prometheus package the test
services install) on the series the publish task pushes, and the PrometheusRule is checked against the Prometheus
Operator's models (generated from its CRDs) as the ServiceMonitor is."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from deploytools import CHART, CLUSTER, import_tool, parse_docs

API = ["--api-versions", "monitoring.coreos.com/v1/PrometheusRule"]


def _rule(helm: str, *values: str) -> dict | None:
    done = subprocess.run([helm, "template", "fedpipe", str(CHART), *CLUSTER, *values], capture_output=True, text=True, check=True)
    docs = [d for d in parse_docs(done.stdout) if d.get("kind") == "PrometheusRule"]
    return docs[0] if docs else None


def test_the_rule_is_rendered_where_the_operator_serves_it(helm):
    assert _rule(helm) is None  # auto, and no PrometheusRule API on the cluster: helm install still works
    assert _rule(helm, *API, "--set", "alerts.enabled=false") is None
    doc = _rule(helm, *API)
    models = import_tool("cloudcoil.models.prometheus_operator.v1", "cloudcoil-models-prometheus-operator")
    model = models.PrometheusRule.model_validate(doc, strict=True)
    assert model.model_dump(mode="json", by_alias=True, exclude_unset=True) == doc
    assert doc["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_drop_suspect_fires_on_the_pushed_series(helm, tmp_path: Path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian's prometheus package, installed by scripts/test-services.sh) is not on PATH")
    doc = _rule(helm, *API, "--set", "alerts.severity=critical")
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": doc["spec"]["groups"]}))
    series = '{job="fedpipe-models",instance="",line="digits-sites",version="%s"}'
    tests = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                {"series": "fedpipe_model_drop_suspect" + series % 3, "values": "0 0 1 1 1"},
                {"series": "fedpipe_model_drop_flagged_clients" + series % 3, "values": "0 0 2 2 2"},
                {"series": "fedpipe_model_drop_suspect" + series % 2, "values": "0 0 0 0 0"},
            ],
            "alert_rule_test": [
                {"eval_time": "1m", "alertname": "FedpipeDataDropSuspect", "exp_alerts": []},
                {"eval_time": "3m", "alertname": "FedpipeDataDropSuspect", "exp_alerts": [{
                    "exp_labels": {"severity": "critical", "line": "digits-sites", "version": "3"},
                    "exp_annotations": {
                        "summary": "Model line digits-sites: the data of version 3 looks broken or poisoned",
                        "description": (
                            "The drop check flagged 2 client(s) of model line digits-sites's newest drop: the promoted version's "
                            "accuracy collapsed on them. The version was not promoted. See `fedpipe models show digits-sites@3` "
                            "(drop_check.flagged names the clients and their figures), check those clients' files, then retrain "
                            "or run `fedpipe models regate`."),
                    },
                }]},
            ],
        }],
    }
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests, width=1000))
    done = subprocess.run([promtool, "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
