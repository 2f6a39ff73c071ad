"""A whole run against the real services: its artifacts and checkpoints in an S3-compatible server
(moto, over HTTP through the minio client), its round metrics in a Pushgateway scraped by Prometheus."""

import json
import time
import urllib.parse
import urllib.request

import pytest
from minio import Minio
from runs import CrashAfterRound, assert_same_params, small_run

pytestmark = pytest.mark.services

OVERRIDES = ["method.name=superfed_mm", "train.rounds=4", "method.start_fraction=0.5", "train.keep_checkpoints=3"]


def test_run_in_s3_resumes_from_its_checkpoint_there(tmp_path, s3_env, s3_credentials):
    reference = small_run(tmp_path / "local", *OVERRIDES)
    reference.partition()
    expected = [reference.train(p.name) for p in reference.phases()][-1]

    run = small_run("s3://fedpipe-runs/team-a", *OVERRIDES)
    run.partition()
    run.train("federation")
    with pytest.raises(SystemExit):  # the process dies right after round 3's checkpoint is stored
        run.train("personalization", telemetry_sinks=[CrashAfterRound(3)])

    access, secret = s3_credentials
    client = Minio(s3_env.removeprefix("http://"), access_key=access, secret_key=secret, secure=False)
    keys = {o.object_name for o in client.list_objects("fedpipe-runs", prefix="team-a/", recursive=True)}
    assert "team-a/test/partition/manifest.json" in keys and "team-a/test/phases/federation/final.pt" in keys
    assert "team-a/test/phases/personalization/round-00003.pt" in keys
    assert "team-a/test/phases/personalization/final.pt" not in keys
    stat = client.stat_object("fedpipe-runs", "team-a/test/phases/personalization/round-00003.pt")
    assert len(stat.metadata["x-amz-meta-sha256"]) == 64  # the hash travels with the object

    resumed = small_run("s3://fedpipe-runs/team-a", *OVERRIDES).train("personalization")
    assert resumed.round == 4
    assert_same_params(resumed.server.global_params, expected.server.global_params)
    summary = small_run("s3://fedpipe-runs/team-a", *OVERRIDES).evaluate()
    assert summary["report"] == "s3://fedpipe-runs/team-a/test/report"
    assert client.stat_object("fedpipe-runs", "team-a/test/report/lam_curve.png").size > 0


def prom_query(prometheus: str, expr: str) -> list[dict]:
    url = f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)["data"]["result"]


def test_run_pushes_its_round_metrics_that_prometheus_scrapes(tmp_path, prometheus, pushgateway):
    run = small_run(tmp_path, *OVERRIDES, f"telemetry.pushgateway={pushgateway}", run_id="metrics-run")
    run.partition()
    for phase in run.phases():  # training only: an evaluation would delete the run's groups (test_prometheus.py)
        run.train(phase.name)
    rows = [json.loads(line) for line in (tmp_path / "metrics-run" / "report" / "rounds-personalization.jsonl").read_text().splitlines()]
    selector = '{run_id="metrics-run",method="superfed_mm",dataset="mnist5k",pipeline="local"}'
    last_round = selector[:-1] + ',phase="personalization"}'
    deadline = time.time() + 20
    while True:  # until Prometheus has scraped the last round's push (it scrapes every second, mid-run too)
        result = prom_query(prometheus, f"fedpipe_train_loss{selector}")
        latest = prom_query(prometheus, f"fedpipe_round{last_round}")
        done = len(result) == 2 and latest and float(latest[0]["value"][1]) == rows[-1]["round"]  # one series per phase
        if done or time.time() > deadline:
            break
        time.sleep(0.5)
    by_phase = {r["metric"]["phase"]: float(r["value"][1]) for r in result}
    assert by_phase.keys() == {"federation", "personalization"}
    assert by_phase["personalization"] == pytest.approx(rows[-1]["train_loss"])
    rounds = prom_query(prometheus, f'fedpipe_round{selector[:-1]},phase="personalization"}}')
    assert float(rounds[0]["value"][1]) == 4
    uploaded = prom_query(prometheus, f"sum(fedpipe_bytes_uploaded_total{selector})")
    assert float(uploaded[0]["value"][1]) > 0
