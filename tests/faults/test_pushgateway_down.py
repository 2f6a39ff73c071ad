"""Fault: the Prometheus Pushgateway is not there, or dies mid-run. Training finishes anyway, with
exactly one warning, and the lost pushes are counted and reported when the phase ends."""

import json
import logging

from runs import small_run
from services import find_binary, free_port, start_server, stop_server

from fedpipe.telemetry.jsonl import JsonlSink
from fedpipe.telemetry.prometheus import PrometheusSink

OVERRIDES = ["method.name=fedavg", "partition.num_clients=2", "train.rounds=3", "run.threads=1"]


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_nothing_listening_training_finishes_with_one_warning(tmp_path, caplog):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    run = small_run(tmp_path, *OVERRIDES, f"telemetry.pushgateway={url}")
    run.partition()
    with caplog.at_level("INFO", logger="fedpipe"):
        state = run.train("federation")
    assert state.round == 3 and (tmp_path / "test" / "phases" / "federation" / "final.pt").exists()
    (warning,) = warnings_of(caplog)
    assert url in warning and "training goes on" in warning
    # phase start, 3 rounds, phase end: 5 pushes, all lost, and the count is reported
    assert f"5 of 5 metric pushes to the Prometheus Pushgateway at {url} were lost" in caplog.text
    assert len((tmp_path / "test" / "report" / "rounds-federation.jsonl").read_text().splitlines()) == 3


class StopGatewayAfterRound:
    """A sink placed before the Prometheus one: stops the real gateway process once round `n` is pushed."""

    def __init__(self, server, n):
        self.server, self.n = server, n

    def phase_started(self, event): ...

    def phase_finished(self, event): ...

    def close(self): ...

    def round_finished(self, event):
        if event.round == self.n + 1:
            stop_server(self.server)


def test_gateway_killed_mid_run_training_finishes_and_counts_what_was_lost(tmp_path, caplog):
    port = free_port()
    binary = find_binary("prometheus-pushgateway", "pushgateway")
    server = start_server("pushgateway", [binary, f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                    f"http://127.0.0.1:{port}", "/-/ready", tmp_path)
    try:
        run = small_run(tmp_path / "store", *OVERRIDES)
        run.partition()
        sink = PrometheusSink(server.url)  # the defaults a run uses: 2 s timeout, 30 s between retries
        sinks = [JsonlSink(run.store, run.layout.rounds("federation")), StopGatewayAfterRound(server, 1), sink]
        with caplog.at_level("INFO", logger="fedpipe"):
            state = run.train("federation", telemetry_sinks=sinks)
    finally:
        stop_server(server)
    assert state.round == 3
    assert sink.pushes == 2 and sink.lost_pushes == 3  # start + round 1 went through; rounds 2, 3 and the end did not
    (warning,) = warnings_of(caplog)
    assert server.url in warning
    assert f"3 of 5 metric pushes to the Prometheus Pushgateway at {server.url} were lost" in caplog.text
    rows = [json.loads(line) for line in (tmp_path / "store" / "test" / "report" / "rounds-federation.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
