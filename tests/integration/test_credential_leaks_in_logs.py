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


def test_a_finished_run_leaks_no_credential(s3_env, s3_credentials, caplog):
    access, secret = s3_credentials
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
        for credential in (access, secret):
            assert credential not in text, f"a credential appears in the {where}"
    for name, data in objects.items():
        for credential in (access, secret):
            assert credential.encode() not in data, f"a credential appears in {name}"
