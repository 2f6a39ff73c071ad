"""PrometheusSink against a real Pushgateway, read back through a real Prometheus."""

from __future__ import annotations

import json
import logging
import time
import urllib.parse
import urllib.request
import uuid

import pytest

from fedpipe.telemetry import PhaseEvent, RoundEvent, RunLabels, Telemetry
from fedpipe.telemetry.prometheus import METRICS, PrometheusSink

pytestmark = pytest.mark.services


def labels(phase: str = "federation") -> RunLabels:
    return RunLabels(
        run_id=f"run-{uuid.uuid4().hex[:8]}",
        pipeline="local",
        method="superfed",
        phase=phase,
        dataset="mnist",
    )


def round_event(lab: RunLabels, r: int, *, pacc: float | None, gacc: float | None) -> RoundEvent:
    return RoundEvent(
        labels=lab,
        round=r,
        phase_round=r,
        phase_rounds=3,
        clients=8,
        failed_clients=r - 1,
        train_loss=1.0 / r,
        personalized_accuracy=pacc,
        global_accuracy=gacc,
        bytes_uploaded=1000 * r,
        bytes_downloaded=2000,
        seconds=0.5,
        samples_per_second=400.0 + r,
        extra={"mu": 0.25},
    )


def query(prom: str, expr: str) -> list[dict]:
    url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_for(prom: str, expr: str, expected: int, timeout: float = 15.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        result = query(prom, expr)
        if len(result) >= expected:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"Prometheus has no {expr} after {timeout:g} s: {result}")
        time.sleep(0.25)


def pushed_metrics(gateway: str) -> str:
    with urllib.request.urlopen(f"{gateway}/metrics", timeout=5) as resp:
        return resp.read().decode()


def test_rounds_reach_prometheus_with_labels(pushgateway: str, prometheus: str):
    lab = labels()
    sink = PrometheusSink(pushgateway)
    with Telemetry([sink]) as tel:
        tel.phase_started(PhaseEvent(labels=lab, total_rounds=3, first_round=1))
        tel.round_finished(round_event(lab, 1, pacc=None, gacc=None))
        tel.round_finished(round_event(lab, 2, pacc=0.5, gacc=0.4))
        tel.round_finished(round_event(lab, 3, pacc=0.75, gacc=None))
        tel.phase_finished(PhaseEvent(labels=lab, total_rounds=3, first_round=1, finished=True, seconds=1.5))
    assert sink.lost_pushes == 0 and sink.pushes == 5

    sel = f'{{run_id="{lab.run_id}"}}'
    # Wait until the scrape after the last push arrived (phase_finished is pushed last).
    wait_for(prometheus, f"fedpipe_phase_finished{sel} == 1", 1)
    expected = {
        "fedpipe_round": 3,
        "fedpipe_phase_round": 3,
        "fedpipe_phase_rounds": 3,
        "fedpipe_train_loss": 1 / 3,
        "fedpipe_personalized_accuracy": 0.75,
        "fedpipe_global_accuracy": 0.4,  # round 3 did not evaluate it: the last value stays
        "fedpipe_bytes_uploaded": 3000,
        "fedpipe_bytes_downloaded": 2000,
        "fedpipe_bytes_uploaded_total": 6000,
        "fedpipe_bytes_downloaded_total": 6000,
        "fedpipe_round_seconds": 0.5,
        "fedpipe_samples_per_second": 403,
        "fedpipe_clients": 8,
        "fedpipe_failed_clients": 2,
        "fedpipe_phase_finished": 1,
        "fedpipe_phase_seconds": 1.5,
    }
    assert set(expected) | {"fedpipe_extra"} == set(METRICS)
    for name, value in expected.items():
        (series,) = query(prometheus, f"{name}{sel}")
        metric = series["metric"]
        assert {k: metric[k] for k in ("run_id", "pipeline", "method", "phase", "dataset", "job")} == {
            "run_id": lab.run_id,
            "pipeline": "local",
            "method": "superfed",
            "phase": "federation",
            "dataset": "mnist",
            "job": "fedpipe",
        }, metric
        assert float(series["value"][1]) == pytest.approx(value), name
    (extra,) = query(prometheus, f'fedpipe_extra{{run_id="{lab.run_id}",name="mu"}}')
    assert float(extra["value"][1]) == 0.25

    # Help texts are pushed, and no per-client labels exist.
    text = pushed_metrics(pushgateway)
    assert f"# HELP fedpipe_train_loss {METRICS['fedpipe_train_loss']}" in text
    assert "client=" not in text


def test_accuracy_not_pushed_before_evaluated(pushgateway: str):
    lab = labels()
    sink = PrometheusSink(pushgateway)
    sink.round_finished(round_event(lab, 1, pacc=None, gacc=None))
    text = pushed_metrics(pushgateway)
    lines = [line for line in text.splitlines() if lab.run_id in line]
    assert any(line.startswith("fedpipe_train_loss{") for line in lines)
    assert not any("accuracy" in line for line in lines)


def test_phases_are_separate_groups(pushgateway: str):
    run = labels()
    pre = RunLabels(run.run_id, run.pipeline, run.method, "pretrain", run.dataset)
    sink = PrometheusSink(pushgateway)
    sink.round_finished(round_event(pre, 1, pacc=None, gacc=0.1))
    sink.phase_finished(PhaseEvent(labels=pre, total_rounds=1, first_round=1, finished=True, seconds=1))
    sink.round_finished(round_event(run, 2, pacc=0.3, gacc=None))
    text = pushed_metrics(pushgateway)
    finished = [
        line
        for line in text.splitlines()
        if line.startswith("fedpipe_phase_finished{") and run.run_id in line
    ]
    assert len(finished) == 1 and 'phase="pretrain"' in finished[0]
    rounds = [line for line in text.splitlines() if line.startswith("fedpipe_round{") and run.run_id in line]
    assert len(rounds) == 2


def test_unreachable_gateway_warns_once_and_never_raises(caplog: pytest.LogCaptureFixture, port_factory):
    url = f"http://127.0.0.1:{port_factory()}"
    sink = PrometheusSink(url, timeout=0.5, retry_interval=0.0)  # try every push
    lab = labels()
    caplog.set_level(logging.DEBUG, logger="fedpipe.telemetry.prometheus")
    start = time.monotonic()
    with Telemetry([sink]) as tel:
        tel.phase_started(PhaseEvent(labels=lab, total_rounds=3, first_round=1))
        for r in (1, 2, 3):
            tel.round_finished(round_event(lab, r, pacc=0.5, gacc=0.5))
        tel.phase_finished(PhaseEvent(labels=lab, total_rounds=3, first_round=1, finished=True))
    assert time.monotonic() - start < 5
    assert sink.lost_pushes == 5 and sink.pushes == 0
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    msg = warnings[0].getMessage()
    assert url in msg and "not being pushed" in msg


def test_unreachable_gateway_is_not_retried_every_round(
    caplog: pytest.LogCaptureFixture, pushgateway: str, monkeypatch: pytest.MonkeyPatch, port_factory
):
    import fedpipe.telemetry.prometheus as prom_mod

    caplog.set_level(logging.INFO, logger="fedpipe.telemetry.prometheus")
    sink = PrometheusSink(f"http://127.0.0.1:{port_factory()}", timeout=0.5, retry_interval=3600)
    lab = labels()
    calls = {"n": 0}
    real = prom_mod.push_to_gateway

    def counting(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(prom_mod, "push_to_gateway", counting)
    for r in range(1, 11):
        sink.round_finished(round_event(lab, r, pacc=None, gacc=None))
    assert calls["n"] == 1 and sink.lost_pushes == 10
    # The gateway comes back: after the retry interval, pushes go through again.
    sink.gateway_url = pushgateway
    sink.retry_interval = 0
    sink.round_finished(round_event(lab, 11, pacc=None, gacc=None))
    assert calls["n"] == 2 and sink.pushes == 1 and sink.lost_pushes == 10
    assert "being pushed again" in caplog.text


def test_from_env(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("FEDPIPE_PUSHGATEWAY", raising=False)
    assert PrometheusSink.from_env() is None
    monkeypatch.setenv("FEDPIPE_PUSHGATEWAY", "pushgateway.monitoring:9091")
    sink = PrometheusSink.from_env(job="fedpipe-test")
    assert sink is not None
    assert sink.gateway_url == "http://pushgateway.monitoring:9091" and sink.job == "fedpipe-test"
