"""A TrainJob's progress reported to Kubeflow Trainer (v2.2+, feature gate TrainJobStatus) by fedpipe's rounds
(fedpipe/telemetry/trainer_status.py), against a STAND-IN of Trainer's status server on loopback over TLS (not
Kubeflow Trainer; no cluster ran). The stand-in enforces what kubeflow/trainer v2.2.0 does with an update:

- pkg/statusserver/server.go: only ``POST /apis/trainer.kubeflow.org/v1alpha1/namespaces/{ns}/trainjobs/{name}/status``
  (anything else 404), a body of at most 1 << 16 bytes (middleware.go bodySizeLimitMiddleware), a JSON
  ``UpdateTrainJobStatusRequest`` (else 422), a TrainJob that exists (else 404);
- auth.go: ``Authorization: Bearer <token>`` whose audience is that TrainJob (here: the token issued for it;
  else 403);
- the API server's check of the applied status: the CRD's trainerStatus schema at v2.2.0
  (tests/deploy/schemas/trainer.kubeflow.org_trainjobs.v2.2.0.trainerStatus.yaml) and its CEL rule
  ``has(self.lastUpdatedTime)`` (else 422), with RFC 3339 times.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import logging
import re
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jsonschema
import pytest
import yaml

from fedpipe.telemetry import trainer_status
from fedpipe.telemetry.trainer_status import ENV_CA, ENV_TOKEN, ENV_URL, TrainerStatusSink

SCHEMA = yaml.safe_load((Path(__file__).parent / "deploy" / "schemas" / "trainer.kubeflow.org_trainjobs.v2.2.0.trainerStatus.yaml").read_text())
PATH = re.compile(r"^/apis/trainer\.kubeflow\.org/v1alpha1/namespaces/([^/]+)/trainjobs/([^/]+)/status$")
NAMESPACE, TRAINJOB = "team-a", "fedavg-train-7c1e"
MAX_BODY = 1 << 16


def _certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (what Trainer's cert management gives its webhook service)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubeflow-trainer-controller-manager")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "ca.crt", folder / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return cert_path, key_path


class StatusServerStandIn:
    """Trainer v2.2.0's status server, as far as an update goes (see the module); `statuses[(ns, name)]` is the
    TrainJob's status.trainerStatus after each accepted update, `answers` every status code."""

    def __init__(self, folder: Path, token: str):
        self.ca, key = _certificate(folder)
        self.token, self.statuses, self.answers = token, {(NAMESPACE, TRAINJOB): []}, []
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self, code: int, message: str = "") -> None:
                data = json.dumps({"kind": "Status", "code": code, "message": message}).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                standin.answers.append(code)

            def do_POST(self) -> None:
                self._answer(*standin.update(self.path, self.headers, self.rfile))

            def do_GET(self) -> None:
                self._answer(404, "Not found")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.ca, key)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}/apis/trainer.kubeflow.org/v1alpha1/namespaces/{NAMESPACE}/trainjobs/{TRAINJOB}/status"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def update(self, path: str, headers, body) -> tuple[int, str]:
        match = PATH.match(path)
        if not match:
            return 404, "Not found"
        if headers.get("Authorization") != f"Bearer {self.token}":
            return 403, "Forbidden"
        size = int(headers.get("Content-Length") or 0)
        if size > MAX_BODY:
            return 413, "request body too large"
        try:
            request = json.loads(body.read(size))
        except ValueError:
            return 422, "Invalid payload"
        if not isinstance(request, dict) or request.get("trainerStatus") is None:
            return 200, ""
        if (match.group(1), match.group(2)) not in self.statuses:
            return 404, "Train job not found"
        problems = self.problems(request["trainerStatus"])
        if problems:
            return 422, "; ".join(problems)
        self.statuses[(match.group(1), match.group(2))].append(request["trainerStatus"])
        return 200, ""

    @staticmethod
    def problems(status) -> list[str]:
        out = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in jsonschema.Draft7Validator(SCHEMA).iter_errors(status)]
        if isinstance(status, dict):
            if "lastUpdatedTime" not in status:
                out.append("lastUpdatedTime is required when trainerStatus is present")  # the CRD's CEL rule
            elif not re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", str(status["lastUpdatedTime"])):
                out.append("lastUpdatedTime: not an RFC 3339 date-time")
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def trainer(tmp_path, monkeypatch):
    token = tmp_path / "token"
    token.write_text("projected-token-for-fedavg-train-7c1e\n")
    standin = StatusServerStandIn(tmp_path, "projected-token-for-fedavg-train-7c1e")
    monkeypatch.setenv(ENV_URL, standin.url)
    monkeypatch.setenv(ENV_CA, str(standin.ca))
    monkeypatch.setenv(ENV_TOKEN, str(token))
    yield standin
    standin.close()


def test_a_phase_in_a_trainjob_reports_its_progress_and_metrics(tmp_path, trainer, monkeypatch):
    """A real tiny run (2 rounds) as rank 0 of a TrainJob with the gate on: each round's update is accepted,
    the last says 100% with nothing left, and carries the round's metrics as text."""
    from fedpipe.run.config import load_config
    from fedpipe.run.run import Run

    monkeypatch.setattr(trainer_status, "MIN_INTERVAL_S", 0.0)
    run = Run(load_config(None, ["data.dataset=digits", "method.name=fedavg", "train.rounds=2", "partition.num_clients=4",
                                 "telemetry.progress=false", "engine.processes=1", f"run.store={tmp_path / 'runs'}"]))
    assert any(isinstance(s, TrainerStatusSink) for s in run.default_sinks("federation"))
    run.partition()
    run.train("federation")
    updates = trainer.statuses[(NAMESPACE, TRAINJOB)]
    assert set(trainer.answers) == {200} and len(updates) >= 1
    last = updates[-1]
    assert last["progressPercentage"] == 100 and last["estimatedRemainingSeconds"] == 0
    metrics = {m["name"]: m["value"] for m in last["metrics"]}
    assert metrics["round"] == "2" and float(metrics["train_loss"]) > 0 and 0 <= float(metrics["personalized_accuracy"]) <= 1


def test_updates_are_spaced_and_the_last_round_always_goes(trainer):
    from fedpipe.telemetry import PhaseEvent, RoundEvent, RunLabels

    now = [0.0]
    sink = TrainerStatusSink(trainer.url, str(trainer.ca), Path(trainer_status.os.environ[ENV_TOKEN]).as_posix(), clock=lambda: now[0],
                             min_interval=10.0)
    labels = RunLabels("r", "local", "fedavg", "train", "digits")
    sink.phase_started(PhaseEvent(labels, total_rounds=20, first_round=1))
    for r in range(1, 21):
        now[0] = 3.0 * r  # a round every 3 s: one update per 10 s at most
        sink.round_finished(RoundEvent(labels, r, r, 20, 4, 0, 0.5, 0.8 if r % 5 == 0 else None, None, 1, 1, 3.0, 10.0))
    progress = [u["progressPercentage"] for u in trainer.statuses[(NAMESPACE, TRAINJOB)]]
    assert progress == [5, 25, 45, 65, 85, 100]  # rounds 1, 5, 9, 13, 17 (12 s apart) and the last
    first = trainer.statuses[(NAMESPACE, TRAINJOB)][0]
    assert first["estimatedRemainingSeconds"] == 57 and [m["name"] for m in first["metrics"]] == ["train_loss", "round"]


def test_without_the_gate_nothing_is_sent_and_a_refusal_costs_one_warning(trainer, monkeypatch, caplog, tmp_path):
    monkeypatch.delenv(ENV_URL)
    assert TrainerStatusSink.from_env() is None  # TrainJobStatus off (or a PyTorchJob, or a pipeline task): no sink
    monkeypatch.setenv(ENV_URL, trainer.url)
    (tmp_path / "token").write_text("a token for another TrainJob")
    sink = TrainerStatusSink.from_env()
    body = {"trainerStatus": {"progressPercentage": 10, "lastUpdatedTime": "2026-11-26T23:50:00Z"}}
    with caplog.at_level(logging.WARNING):
        assert not sink.post(body) and not sink.post(body)
    assert trainer.answers == [403, 403] and caplog.text.count("could not be reported") == 1


@pytest.mark.parametrize("status, problem", [
    ({"progressPercentage": 101, "lastUpdatedTime": "2026-11-26T23:50:00Z"}, "maximum"),
    ({"progressPercentage": 10}, "lastUpdatedTime is required"),
    ({"metrics": [{"name": "x" * 65, "value": "1"}], "lastUpdatedTime": "2026-11-26T23:50:00Z"}, "too long"),
    ({"metrics": [{"name": "loss", "value": ""}], "lastUpdatedTime": "2026-11-26T23:50:00Z"}, "non-empty"),
    ({"estimatedRemainingSeconds": -1, "lastUpdatedTime": "2026-11-26T23:50:00Z"}, "minimum"),
    ({"lastUpdatedTime": "yesterday"}, "RFC 3339"),
])
def test_the_standin_refuses_what_the_crd_refuses(status, problem):
    assert any(problem in p for p in StatusServerStandIn.problems(status))


def test_the_payload_stays_inside_the_crds_bounds():
    from fedpipe.telemetry import RoundEvent, RunLabels

    sink = TrainerStatusSink("https://x", "", "")
    sink._started = 0.0
    event = RoundEvent(RunLabels("r", "local", "fedavg", "train", "digits"), 1, 1, 10**6, 4, 0, 1e300, 1.0, 0.123456789, 1, 1, 1.0, 1.0)
    payload = sink.payload(event, now=1e9)["trainerStatus"]
    assert StatusServerStandIn.problems(payload) == [] and payload["estimatedRemainingSeconds"] == 2**31 - 1
