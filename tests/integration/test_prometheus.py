"""PrometheusSink against a real Pushgateway, read back through a real Prometheus; a finished run's
groups deleted from that Pushgateway."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
from runs import small_run

from fedpipe.telemetry import PhaseEvent, RoundEvent, RunLabels, Telemetry
from fedpipe.telemetry.prometheus import METRICS, PrometheusSink, delete_run_groups

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


# --- a finished run deletes its groups ------------------------------------------------------------

RUN = ["method.name=superfed_mm", "train.rounds=2", "method.start_fraction=0.5", "run.threads=1"]  # phases: federation, personalization


def groups_of(gateway: str, run_id: str) -> list[dict[str, str]]:
    """The grouping labels of the run's groups, read from the Pushgateway's API."""
    with urllib.request.urlopen(f"{gateway}/api/v1/metrics", timeout=5) as resp:
        data = json.load(resp)["data"]
    return [g["labels"] for g in data if g["labels"].get("run_id") == run_id]


def groups_after_deletion(gateway: str, run_id: str, wait: float = 5.0) -> list[dict[str, str]]:
    """The run's groups once the Pushgateway has applied a deletion it answered 202 to: it queues every write, deletions
    included ("There is no guarantee when a request will be processed", storage/interface.go `SubmitWriteRequest`;
    storage/diskmetricstore.go applies the queue in its own `loop`), so a read right after the DELETE may still list
    the group. Polled for up to `wait` seconds."""
    deadline = time.monotonic() + wait
    while (groups := groups_of(gateway, run_id)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return groups


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder whose phases are trained (no metrics pushed) and not yet evaluated."""
    store = tmp_path_factory.mktemp("trained")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("FEDPIPE_PUSHGATEWAY", raising=False)
        run = small_run(store, *RUN, run_id="trained")
        run.partition()
        for phase in run.phases():
            run.train(phase.name)
    return store / "trained"


def trained_run(trained: Path, tmp_path: Path, *overrides: str):
    """A copy of the trained run under a fresh run id, ready to evaluate."""
    run_id = f"done-{uuid.uuid4().hex[:8]}"
    shutil.copytree(trained, tmp_path / run_id)
    return small_run(tmp_path, *RUN, *overrides, run_id=run_id)


def push_phases(gateway: str, run, final_round: int = 3) -> None:
    """What the run's phase pods push: rounds 1..final_round and the phase end, for every phase."""
    sink = PrometheusSink(gateway)
    for phase in run.phases():
        lab = run.labels(phase.name)
        sink.phase_started(PhaseEvent(labels=lab, total_rounds=final_round, first_round=1))
        for r in range(1, final_round + 1):
            sink.round_finished(round_event(lab, r, pacc=0.5, gacc=0.5))
        sink.phase_finished(PhaseEvent(labels=lab, total_rounds=final_round, first_round=1, finished=True, seconds=1))
    assert sink.lost_pushes == 0


def test_finished_run_deletes_all_its_groups_and_keeps_other_runs(
    tmp_path: Path, pushgateway: str, caplog: pytest.LogCaptureFixture
):
    run_id = f"e2e-{uuid.uuid4().hex[:8]}"
    run = small_run(tmp_path, *RUN, f"telemetry.pushgateway={pushgateway}", "telemetry.pushgateway_retention_seconds=0", run_id=run_id)
    run.partition()
    for phase in run.phases():
        run.train(phase.name)
    # an earlier attempt of the run, pushed under another pipeline label, and another run
    earlier = RunLabels(run_id, "fedpipe-superfed_mm", "superfed_mm", "federation", "mnist5k")
    other = labels()
    sink = PrometheusSink(pushgateway)
    sink.round_finished(round_event(earlier, 1, pacc=None, gacc=None))
    sink.round_finished(round_event(other, 1, pacc=None, gacc=None))
    assert sorted((g["pipeline"], g["phase"]) for g in groups_of(pushgateway, run_id)) == [
        ("fedpipe-superfed_mm", "federation"), ("local", "federation"), ("local", "personalization"),
    ]

    caplog.set_level(logging.INFO, logger="fedpipe.telemetry.prometheus")
    summary = run.evaluate()
    assert summary["report"]
    assert groups_after_deletion(pushgateway, run_id) == []
    assert len(groups_of(pushgateway, other.run_id)) == 1
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Deleted")]
    assert f"3 metric groups of run {run_id}" in line and "federation, personalization" in line


def test_groups_stay_for_the_retention_then_go(trained: Path, tmp_path: Path, pushgateway: str):
    run = trained_run(trained, tmp_path, f"telemetry.pushgateway={pushgateway}", "telemetry.pushgateway_retention_seconds=2")
    run_id = run.layout.run_id
    push_phases(pushgateway, run)
    pushed = time.time()
    errors: list[BaseException] = []

    def evaluate():
        try:
            run.evaluate()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    worker = threading.Thread(target=evaluate)
    worker.start()
    seen: list[tuple[float, int]] = []  # (seconds since the final push, groups on the gateway)
    while worker.is_alive():
        seen.append((time.time() - pushed, len(groups_of(pushgateway, run_id))))
        time.sleep(0.1)
    worker.join()
    finished = time.time() - pushed
    assert not errors, errors
    assert seen and seen[0][1] == 2  # right after the final push: both phases
    assert all(n == 2 for age, n in seen if age < 1.8), seen  # kept for the retention...
    assert any(age >= 1.5 for age, _ in seen), seen  # (observed late in it)
    assert finished >= 2.0
    assert groups_after_deletion(pushgateway, run_id) == []  # ...and gone after


def test_prometheus_scraped_the_final_values_before_deletion(
    trained: Path, tmp_path: Path, pushgateway: str, prometheus: str
):
    run = trained_run(trained, tmp_path, f"telemetry.pushgateway={pushgateway}", "telemetry.pushgateway_retention_seconds=2")
    sel = f'{{run_id="{run.layout.run_id}",phase="personalization"}}'
    push_phases(pushgateway, run, final_round=7)
    run.evaluate()
    assert groups_after_deletion(pushgateway, run.layout.run_id) == []
    # Prometheus holds the final values (scraped while the groups were kept)...
    (final,) = query(prometheus, f"last_over_time(fedpipe_round{sel}[5m])")
    assert float(final["value"][1]) == 7
    (done,) = query(prometheus, f"last_over_time(fedpipe_phase_finished{sel}[5m])")
    assert float(done["value"][1]) == 1
    # ...and, once it scraped the gateway without them, marks the series stale: not live any more.
    deadline = time.monotonic() + 10
    while query(prometheus, f"fedpipe_phase_finished{sel}"):
        assert time.monotonic() < deadline, "the deleted series is still live in Prometheus"
        time.sleep(0.25)


def test_unreachable_gateway_evaluation_succeeds_with_one_warning(
    trained: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, port_factory
):
    url = f"http://127.0.0.1:{port_factory()}"
    run = trained_run(trained, tmp_path, f"telemetry.pushgateway={url}")
    caplog.set_level(logging.DEBUG, logger="fedpipe")
    start = time.monotonic()
    summary = run.evaluate()
    assert time.monotonic() - start < 10
    assert summary["title"] and (tmp_path / run.layout.run_id / "report" / "summary.json").exists()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    msg = warnings[0].getMessage()
    assert url in msg and run.layout.run_id in msg and "Could not delete" in msg


def test_push_time_ahead_of_the_clock_waits_only_the_retention(pushgateway: str):
    lab = labels()
    PrometheusSink(pushgateway).round_finished(round_event(lab, 1, pacc=None, gacc=None))
    slept: list[float] = []
    deleted = delete_run_groups(
        pushgateway, lab.run_id, retention_seconds=30, sleep=slept.append, clock=lambda: time.time() - 3600
    )
    assert slept == [30]
    assert deleted == [PrometheusSink.grouping_key(lab)]
    assert groups_after_deletion(pushgateway, lab.run_id) == []
