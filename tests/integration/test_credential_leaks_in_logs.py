"""The S3 credentials from the environment appear nowhere in what a run leaves behind: the commands'
stdout and stderr, fedpipe's log records (at DEBUG), the JSONL round events and every other object
the run writes to the store. (tests/deploy/test_credential_leaks.py does the same for the YAML.)"""

import logging

import pytest
from minio import Minio
from runs import SMALL
from typer.testing import CliRunner

from fedpipe.cli import app

pytestmark = pytest.mark.services

OVERRIDES = ["method.name=fedavg", "partition.num_clients=2", "train.rounds=2", "run.threads=1"]


# A KFP token in the environment, as `fedpipe submit` wants it (never on the command line): nothing
# a run leaves behind may hold it either.
KFP_TOKEN = "LEAKCHECK-KFP-TOKEN-3c9e51"


def test_a_finished_run_leaks_no_credential(s3_env, s3_credentials, caplog, monkeypatch):
    access, secret = s3_credentials
    monkeypatch.setenv("FEDPIPE_KFP_TOKEN", KFP_TOKEN)
    sets = [f"--set={s}" for s in [*SMALL, *OVERRIDES, "run.store=s3://leakcheck/runs", "run.id=test"]]
    outputs = []
    caplog.set_level(logging.DEBUG)  # every logger, the S3 client's included
    for argv in (["partition", *sets], ["train", "--phase", "federation", *sets], ["evaluate", *sets],
                 ["verify", "test", "--store", "s3://leakcheck/runs"]):
        result = CliRunner().invoke(app, argv)
        assert result.exit_code == 0, result.output
        outputs.append(result.output)
    # a failing command too: its error message is what users paste into issues
    failed = CliRunner().invoke(app, ["train", "--phase", "nope", *sets])
    assert failed.exit_code == 2
    outputs.append(failed.output)

    client = Minio(s3_env.removeprefix("http://"), access_key=access, secret_key=secret, secure=False)
    objects = {o.object_name: client.get_object("leakcheck", o.object_name).read()
               for o in client.list_objects("leakcheck", prefix="runs/", recursive=True)}
    assert "runs/test/report/rounds-federation.jsonl" in objects and "runs/test/manifest.json" in objects

    texts = {"stdout/stderr": "\n".join(outputs), "log records": caplog.text}
    assert "fedpipe" in texts["stdout/stderr"] and texts["log records"]
    for where, text in texts.items():
        for credential in (access, secret, KFP_TOKEN):
            assert credential not in text, f"a credential appears in the {where}"
    for name, data in objects.items():
        for credential in (access, secret, KFP_TOKEN):
            assert credential.encode() not in data, f"a credential appears in {name}"


def test_a_pushgateway_password_is_refused_and_repeated_nowhere(s3_env, caplog, monkeypatch):
    # the env variable a task pod gets, with credentials in it: the run stops before anything is pushed or
    # stored, and neither the error nor a log record repeats the password
    password = "LEAKCHECK-PGW-PASSWORD-91d0"
    monkeypatch.setenv("FEDPIPE_PUSHGATEWAY", f"http://admin:{password}@127.0.0.1:9")
    caplog.set_level(logging.DEBUG)
    sets = [f"--set={s}" for s in [*SMALL, *OVERRIDES, "run.store=s3://leakcheck/pgw", "run.id=pgw"]]
    assert CliRunner().invoke(app, ["partition", *sets]).exit_code == 0
    result = CliRunner().invoke(app, ["train", "--phase", "federation", *sets])
    assert result.exit_code == 2 and "FEDPIPE_PUSHGATEWAY" in result.output
    assert password not in result.output and password not in caplog.text
