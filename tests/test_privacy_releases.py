"""What leaves the trusted server with privacy on (issue 40, finding P4 and the report part of P9): the round
telemetry that the sinks outside the server receive (Prometheus Pushgateway, MLflow, Kubeflow Trainer's status)
carries only what `fedpipe.telemetry.release` allows, the run store's round log keeps every figure, and the
published report says what epsilon covers and what it does not. Privacy off: everything goes out as before.

The sinks are the real ones, reached through `Run.default_sinks`, against one loopback HTTP stand-in that keeps
what each receives (the Pushgateway's pushes, Trainer's status updates); MLflow's place holds a recording sink
(no MLflow server here), which is also what the report step hands its artifacts to. The runs are real fedpipe
runs on mnist5k (6 clients, 2 rounds)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client.parser import text_string_to_metric_families
from runs import small_run

import fedpipe.run.run
from fedpipe.telemetry.mlflow import round_metrics
from fedpipe.telemetry.trainer_status import ENV_CA, ENV_TOKEN, ENV_URL

PRIVATE = ["privacy.enabled=true", "privacy.seeded_noise=true", "privacy.noise_multiplier=1.0", "privacy.clip=0.5"]
BASE = ["method.name=fedavg", "train.rounds=2", "train.client_fraction=0.5", "eval.every=1",
        "telemetry.pushgateway_retention_seconds=0"]
#: what a sink outside the server may see of a private round: indices, the accuracies (evaluation, not covered),
#: the accountant's figures and the clip
RELEASED_METRICS = {"fedpipe_round", "fedpipe_phase_round", "fedpipe_phase_rounds", "fedpipe_personalized_accuracy",
                    "fedpipe_global_accuracy", "fedpipe_phase_finished", "fedpipe_extra"}
RELEASED_EXTRA = {"epsilon", "privacy_delta", "privacy_clip", "privacy_noise_multiplier"}  # central mode: the accountant's figures and the mechanism's
CLIENT_FIGURES = ("clients", "failed_clients", "train_loss", "bytes_uploaded", "bytes_downloaded", "seconds", "samples_per_second")


class StandIn:
    """One loopback HTTP server standing in for the Pushgateway (PUT of a group: kept; GET of its groups: none) and
    for Trainer's status server (POST: kept); `received` is [(method, path, body)]."""

    def __init__(self):
        self.received: list[tuple[str, str, bytes]] = []
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _keep(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                standin.received.append((self.command, self.path, body))
                answer = b'{"status": "success", "data": []}' if self.command == "GET" else b""
                self.send_response(200)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            do_PUT = do_POST = do_GET = do_DELETE = _keep

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def pushed(self) -> list[tuple[str, str, dict]]:
        """Every sample pushed to the Pushgateway: (metric, its `name` label or "", value)."""
        out = []
        for method, path, body in self.received:
            if method == "PUT" and path.startswith("/metrics/"):
                for family in text_string_to_metric_families(body.decode()):
                    out += [(s.name, s.labels.get("name", ""), s.value) for s in family.samples]
        return out

    def statuses(self) -> list[dict]:
        return [json.loads(body)["trainerStatus"] for method, path, body in self.received if method == "POST"]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class InMlflowsPlace:
    """Stands where the MLflow sink would (`mlflow_sinks`): keeps the round events it is given and the report
    files the run's evaluation hands it as artifacts."""

    def __init__(self):
        self.events, self.artifacts = [], {}

    def phase_started(self, event): ...

    def phase_finished(self, event): ...

    def close(self): ...

    def round_finished(self, event):
        self.events.append(event)

    def log_report(self, files, finish=True):
        self.artifacts = dict(files() if callable(files) else files)
        return True


def _run(tmp_path, *overrides):
    """A whole run (partition, 2 rounds, evaluation) with the Pushgateway, Trainer's status server and MLflow's
    place taken by the stand-ins; returns (run, summary, stand-in, MLflow's place, the rows accuracy.png drew)."""
    standin, mlflow, drawn = StandIn(), InMlflowsPlace(), []
    token = tmp_path / "token"
    token.write_text("a-token\n")
    run = small_run(tmp_path / "store", *BASE, *overrides, f"telemetry.pushgateway={standin.url}")
    real_plot = fedpipe.run.report.plots.accuracy_per_round
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_URL, standin.url + "/trainer/status")
        mp.setenv(ENV_CA, "")
        mp.setenv(ENV_TOKEN, str(token))
        mp.setattr(fedpipe.run.run, "mlflow_sinks", lambda run: [mlflow])
        mp.setattr(fedpipe.run.report.plots, "accuracy_per_round", lambda rows, *a, **k: drawn.extend(rows) or real_plot(rows, *a, **k))
        try:
            summary = run.run_all()
        finally:
            standin.close()
    return run, summary, standin, mlflow, drawn


@pytest.fixture(scope="module")
def private(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("private"), *PRIVATE)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("plain"))


def _log(run) -> list[dict]:
    return [json.loads(line) for line in run.store.get_text(run.layout.rounds("federation")).splitlines()]


def test_outside_the_server_a_private_round_carries_no_client_statistic_while_the_store_keeps_them(private, plain):
    run, _, standin, mlflow, _ = private
    # MLflow's place: no cohort, loss, traffic or time; no update norms, no method statistics or details
    assert [e.round for e in mlflow.events] == [1, 2]
    for event in mlflow.events:
        assert all(getattr(event, name) is None for name in CLIENT_FIGURES), event
        assert set(event.extra) <= RELEASED_EXTRA and "epsilon" in event.extra and event.details == {}
        assert event.personalized_accuracy is not None  # evaluation: released, named not covered by the report
        assert set(round_metrics(event)) <= {"personalized_accuracy", "global_accuracy", *RELEASED_EXTRA}
    # the Pushgateway: only the allowlist's gauges were pushed, and no extra but the accountant's and the clip
    pushed = standin.pushed()
    assert {name for name, _, _ in pushed} <= RELEASED_METRICS, sorted({n for n, _, _ in pushed} - RELEASED_METRICS)
    assert {label for name, label, _ in pushed if name == "fedpipe_extra"} == RELEASED_EXTRA
    # Trainer's status: progress and accuracies, no training loss and no time estimate
    statuses = standin.statuses()
    assert statuses and statuses[-1]["progressPercentage"] == 100
    assert all("estimatedRemainingSeconds" not in s for s in statuses)
    assert {m["name"] for s in statuses for m in s["metrics"]} <= {"round", "personalized_accuracy", "global_accuracy"}
    # the round log in the run store (trusted) keeps every figure
    log = _log(run)
    assert all(isinstance(row[name], (int, float)) for row in log for name in CLIENT_FIGURES)
    assert all({"privacy_update_norm_median", "privacy_clipped_fraction", "global_loss"} <= set(row["extra"]) for row in log)

    # without privacy the same sinks get everything, as before
    run, _, standin, mlflow, _ = plain
    assert all(getattr(e, name) is not None for e in mlflow.events for name in CLIENT_FIGURES)
    assert [e.train_loss for e in mlflow.events] == pytest.approx([row["train_loss"] for row in _log(run)])
    names = {name for name, _, _ in standin.pushed()}
    assert {"fedpipe_train_loss", "fedpipe_clients", "fedpipe_bytes_uploaded", "fedpipe_round_seconds", "fedpipe_phase_seconds"} <= names
    assert any("estimatedRemainingSeconds" in s for s in standin.statuses())


def test_the_published_report_of_a_private_run_names_what_epsilon_does_not_cover(private, plain):
    run, summary, _, _, _ = private
    p = json.loads(run.store.get_text(run.layout.report("summary.json")))["privacy"]
    assert p["covers"] == "the uploaded model updates of the communicating rounds"
    assert "evaluation on clients' data" in p["not_covered"] and "personalized models" in p["not_covered"]
    assert "trained without noise" in p["not_covered"]
    report = run.store.get_text(run.layout.report("report.md"))
    lines = [line for line in report.splitlines() if line.strip().startswith(("privacy ", "not covered "))]
    assert len(lines) == 2, lines  # two lines at most
    assert "for the uploaded model updates of the communicating rounds" in lines[0]
    assert "evaluation on clients' data" in lines[1] and "personalized models" in lines[1] and "withheld" in lines[1]
    # the cohort's traffic and the rounds' time are withheld from the published summary
    assert summary["communication"] == {"bytes_uploaded": None, "bytes_downloaded": None} and summary["training_seconds"] is None
    assert "MB up" not in report and "training time" not in report

    run, summary, _, _, _ = plain  # without privacy: no privacy lines, traffic and time as before
    report = run.store.get_text(run.layout.report("report.md"))
    assert "not covered" not in report and "MB up" in report and summary["communication"]["bytes_uploaded"] > 0


def test_a_private_reports_plots_draw_no_training_loss_and_mlflow_gets_no_round_log(private, plain):
    run, _, _, mlflow, drawn = private
    assert drawn and all(row["train_loss"] is None and row["clients"] is None for row in drawn)
    assert all(set(row["extra"]) <= RELEASED_EXTRA and row["details"] == {} for row in drawn)
    assert any(row["personalized_accuracy"] is not None for row in drawn)  # the accuracy curve is still drawn
    assert "summary.json" in mlflow.artifacts and "report.md" in mlflow.artifacts
    assert not any(name.endswith(".jsonl") for name in mlflow.artifacts), sorted(mlflow.artifacts)

    run, _, _, mlflow, drawn = plain
    assert all(isinstance(row["train_loss"], float) for row in drawn)
    assert "rounds-federation.jsonl" in mlflow.artifacts


def test_a_one_client_rounds_update_norm_is_withheld_and_an_unknown_figure_too():
    """The allowlist itself, on a round with one client (whose exact update norm the median would be) and a figure
    no one has cleared for release."""
    from fedpipe.telemetry import RoundEvent, RunLabels
    from fedpipe.telemetry.release import Released, releasable

    event = RoundEvent(RunLabels("r", "local", "fedavg", "federation", "mnist5k"), 3, 3, 5, 1, 0, 0.7, 0.8, None, 100, 100, 0.5,
                       200.0, extra={"epsilon": 1.5, "privacy_delta": 1e-5, "privacy_clip": 0.5, "privacy_update_norm_median": 2.3,
                                     "privacy_clipped_fraction": 1.0, "a_new_statistic": 4.0}, details={"alpha": {"0": 0.4}})
    out = releasable(event)
    assert (out.round, out.phase_round, out.phase_rounds, out.personalized_accuracy, out.labels) == (3, 3, 5, 0.8, event.labels)
    assert out.extra == {"epsilon": 1.5, "privacy_delta": 1e-5, "privacy_clip": 0.5} and out.details == {}
    assert all(getattr(out, name) is None for name in CLIENT_FIGURES)
    got = []
    sink = type("Keep", (), {"round_finished": lambda self, e: got.append(e)})()
    Released(sink).round_finished(event)
    assert got == [out]
