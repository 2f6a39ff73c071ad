"""What a study's store, a config or a user's file holds is data, never config or credentials (issue 30,
item 2 and part of 6): a planted chosen.json or a best trial record cannot set a config path of the final
runs, MLflow's credentials go only to MLFLOW_TRACKING_URI's server, a URL with a token in its query is
refused, and a client name cannot run as a spreadsheet formula in clients.csv. No run trains here."""

from __future__ import annotations

import base64
import csv
import io
import json
import logging
import os
import threading
from concurrent.futures import Executor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from fedpipe.errors import ConfigError, CorruptArtifactError
from fedpipe.run.config import load_config
from fedpipe.run.report import clients_csv, clients_markdown
from fedpipe.store import open_store
from fedpipe.study import runner, steps
from fedpipe.study.config import load_study, run_tree
from fedpipe.study.records import StudyRecords
from fedpipe.telemetry import PhaseEvent, RunLabels
from fedpipe.telemetry.mlflow import MlflowSink

STUDY = """
study: {{name: planted, store: {store}}}
base: {{data: {{dataset: digits}}, partition: {{scheme: pathological, num_clients: 4}}}}
methods: [fedavg, superfed_mm]
budget: {{trials: 2, rounds: 1}}
seeds: [0]
workers: 1
{extra}
"""
TOKEN = "tok-s3cret-d0-n0t-send"
GOOD = {"fedavg": {"train.lr": 0.01}, "superfed_mm": {"train.lr": 0.01, "method.mu": 0.01, "method.nu": 1.0, "method.start_fraction": 0.5}}


class NothingRuns(Executor):
    """A pool that fails the test when a run is submitted: a refused record must stop the study first."""

    def submit(self, fn, /, *args, **kwargs):
        raise AssertionError(f"a run was started: {args[0].get('kind')} {args[0].get('params')}")


def _study(tmp_path, extra=""):
    study, base = load_study(None, text=STUDY.format(store=tmp_path, extra=extra))
    records = StudyRecords(open_store(str(tmp_path)), study)
    records.claim()
    return study, base, records


def _plant_chosen(records, fedavg_params):
    records.put(records.chosen_key, {"objective": "val_personalized_accuracy",
                                     "chosen": {"fedavg": {"pathological": fedavg_params}, "superfed_mm": {"pathological": {}}}})


def _plant_trials(records, params_of_best):
    """Every trial of the budget recorded (nothing left to tune), fedavg's best one holding `params_of_best`."""
    for method, best in (("superfed_mm", GOOD["superfed_mm"]), ("fedavg", params_of_best)):
        for number, (params, objective) in enumerate([(GOOD[method], 0.5), (best, 0.99)]):
            records.put(records.trial_key(method, "pathological", number),
                        {"method": method, "split": "pathological", "number": number, "params": params, "objective": objective})


def test_a_planted_choice_with_a_foreign_key_is_refused_before_anything_runs(tmp_path):
    study, base, records = _study(tmp_path)
    _plant_chosen(records, {**GOOD["fedavg"], "telemetry.mlflow": "http://127.0.0.1:9/"})
    with pytest.raises(CorruptArtifactError) as refused:
        runner.run_study(study, base, pool=NothingRuns(), progress=False)
    message = str(refused.value)
    assert "chosen.json" in message and "'telemetry.mlflow'" in message and "does not tune" in message
    assert "train.lr (log-uniform [0.001, 0.1])" in message  # what is allowed
    with pytest.raises(CorruptArtifactError, match="chosen.json"):
        steps.final_jobs(STUDY.format(store=tmp_path, extra=""))  # the pipeline's path reads it the same way
    # a choice within the space is taken as it is (the check refuses the planted key, not every choice)
    _plant_chosen(records, GOOD["fedavg"])
    assert runner.tune(study, base, records, NothingRuns(), progress=False)["fedavg"]["pathological"] == GOOD["fedavg"]


@pytest.mark.parametrize("planted, named", [({**GOOD["fedavg"], "model.name": "os:system"}, "'model.name'"),
                                            ({**GOOD["fedavg"], "run.store": "/tmp/elsewhere"}, "'run.store'"),
                                            ({"train.lr": 1e9}, "train.lr=1000000000.0 is outside"),  # was a traceback
                                            ({"train.lr": "0.01"}, "train.lr='0.01' is outside"),
                                            ({}, "leaves out train.lr")])
def test_a_best_trial_record_outside_the_space_is_refused(tmp_path, planted, named):
    study, base, records = _study(tmp_path)
    _plant_trials(records, planted)
    with pytest.raises(CorruptArtifactError) as refused:
        runner.run_study(study, base, pool=NothingRuns(), progress=False)
    assert "0001.json" in str(refused.value) and named in str(refused.value)
    assert not records.store.exists(records.chosen_key)


def test_hyperparameters_handed_to_a_run_are_checked_too(tmp_path):
    study, base, _ = _study(tmp_path)
    entry = study.methods[0]
    with pytest.raises(ConfigError, match="'data.source', which the study does not tune"):
        run_tree(study, base, entry, "pathological", 0, {"data.source": "s3://other/bucket"}, tuning=False)
    with pytest.raises(ConfigError, match=r"train.lr=2 is outside"):
        steps.run_batch(STUDY.format(store=tmp_path, extra=""),
                        [{"kind": "final", "method": "fedavg", "split": "pathological", "seed": 0, "params": {"train.lr": 2}}])


# --- MLflow's credentials go to MLFLOW_TRACKING_URI's server only -------------------------------------


@pytest.fixture
def listener():
    """An HTTP server on loopback that records every request's headers and answers 400 (not retried)."""
    seen: list[dict[str, str]] = []

    class Record(BaseHTTPRequestHandler):
        def _answer(self):
            seen.append(dict(self.headers.items()))
            body = json.dumps({"error_code": "INVALID_PARAMETER_VALUE", "message": "listener"}).encode()
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Record)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


@pytest.fixture
def credentials(monkeypatch, tmp_path):
    for name, value in (("MLFLOW_TRACKING_TOKEN", TOKEN), ("MLFLOW_TRACKING_USERNAME", "pod"), ("MLFLOW_TRACKING_PASSWORD", TOKEN)):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HOME", str(tmp_path))  # and a credentials file, which MLflow reads when the variables are unset
    (tmp_path / ".mlflow").mkdir()
    (tmp_path / ".mlflow" / "credentials").write_text(f"[mlflow]\nmlflow_tracking_username = pod\nmlflow_tracking_password = {TOKEN}\n")
    for name in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", "FEDPIPE_MLFLOW_PARENT_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


def _start_tracking(uri: str) -> None:
    sink = MlflowSink.from_env(uri, fedpipe_run_id="probe")
    sink.phase_started(PhaseEvent(RunLabels("probe", "local", "fedavg", "train", "digits"), 1, 1))


def _credentials_in(seen: list[dict[str, str]]) -> list[str]:
    return [f"{k}: {v}" for headers in seen for k, v in headers.items() if k.lower() == "authorization" or TOKEN in v]


def test_a_config_naming_another_server_sends_it_no_credentials(listener, credentials, monkeypatch, caplog):
    url, seen = listener
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://mlflow.example.org")
    cfg = load_config(None, [f"telemetry.mlflow={url}"])
    with caplog.at_level(logging.WARNING, logger="fedpipe.telemetry.mlflow"):
        _start_tracking(cfg.telemetry.mlflow)
    assert seen and _credentials_in(seen) == []
    warning = next(r.getMessage() for r in caplog.records if "not the server of MLFLOW_TRACKING_URI" in r.getMessage())
    assert url in warning and "https://mlflow.example.org:443" in warning  # both servers named
    assert os.environ["MLFLOW_TRACKING_TOKEN"] == TOKEN  # hidden for that call only


def test_the_server_of_mlflow_tracking_uri_gets_them(listener, credentials, monkeypatch):
    url, seen = listener
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url + "/")  # the same scheme, host and port
    _start_tracking(url)
    basic = "Basic " + base64.b64encode(f"pod:{TOKEN}".encode()).decode()  # MLflow sends the user and password before a token
    assert seen and all(h.get("Authorization") == basic for h in seen)  # what the checks of no credentials would see


def test_a_study_naming_another_server_sends_it_no_credentials(listener, credentials, monkeypatch, tmp_path):
    url, seen = listener
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")
    study, base, _ = _study(tmp_path, extra=f"mlflow: {url}")
    with pytest.raises(AssertionError, match="a run was started"):
        runner.run_study(study, base, pool=NothingRuns(), progress=False)  # the parent run is asked for first
    assert seen and _credentials_in(seen) == []


# --- URLs, client names ----------------------------------------------------------------------------


@pytest.mark.parametrize("assignment", [f"telemetry.mlflow=https://mlflow.example.org/?access_token={TOKEN}",
                                        f"telemetry.pushgateway=http://pgw:9091/?token={TOKEN}",
                                        f"run.store=s3://bucket/runs?X-Amz-Signature={TOKEN}",
                                        f"data.source=s3://bucket/drops?X-Amz-Credential={TOKEN}",
                                        f"telemetry.mlflow=https://h/#access_token={TOKEN}"])
def test_a_token_in_a_urls_query_is_refused_without_repeating_it(assignment):
    with pytest.raises(ConfigError) as refused:
        load_config(None, [assignment])
    message = str(refused.value)
    assert "credential in its query string" in message and assignment.split("=")[0] in message and TOKEN not in message


def test_a_study_url_with_credentials_is_refused_and_plain_queries_pass(tmp_path):
    with pytest.raises(ConfigError, match="mlflow carries a credential") as refused:
        load_study(None, text=STUDY.format(store=tmp_path, extra=f"mlflow: http://h:5000/?token={TOKEN}"))
    assert TOKEN not in str(refused.value)
    assert load_config(None, ["telemetry.mlflow=https://mlflow.example.org/?page=2"]).telemetry.mlflow.endswith("page=2")


def test_a_client_name_cannot_run_as_a_spreadsheet_formula():
    names = ("=HYPERLINK(\"http://x\",\"y\")", "+1", "-north", "@sum", "\tA", "plain")
    scores = SimpleNamespace(accuracy=0.5, loss=1.0, ece=0.1)
    clients = [SimpleNamespace(client_id=i, test=[scores], chosen=0, on_global_test=None, opt_out=False) for i in range(len(names))]
    pers = SimpleNamespace(candidate_label=None, clients=clients)
    split = [0] * 3
    data = SimpleNamespace(client_names=names, clients=[SimpleNamespace(client_id=i, train=split, val=split, test=split) for i in range(len(names))])
    text = clients_csv(pers, data)
    cells = [row["name"] for row in csv.DictReader(io.StringIO(text))]
    assert all(c.startswith("'") for c in cells[:-1]) and cells[-1] == "plain"  # shown as text by a spreadsheet
    assert [c[1:] for c in cells[:-1]] == list(names[:-1])  # and still readable
    table = "\n".join(clients_markdown(text))
    assert "'" not in table and "HYPERLINK" in table  # the report shows the name as it is
