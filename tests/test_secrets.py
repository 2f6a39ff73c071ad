"""Secrets stay out of what others can read (issue 21, part 6): the KFP token is never taken from the
command line (argv is visible in `ps`), and no URL field takes credentials (a URL is printed by
`fedpipe config`, stored in run.json and logged); the messages say where credentials go instead,
and never repeat them."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import fedpipe.pipelines.client
from fedpipe.cli import app
from fedpipe.errors import ConfigError, FedpipeError
from fedpipe.run.config import load_config

PASSWORD = "hunter2-s3cret"


def invoke(*args, env=None):
    result = CliRunner().invoke(app, [str(a) for a in args], env=env)
    return result.exit_code, " ".join(result.output.replace("│", " ").split())  # the box of a usage error unwrapped


def test_a_token_on_the_command_line_is_refused_naming_the_alternatives():
    code, out = invoke("check", "kfp", "--token", PASSWORD, env={"FEDPIPE_KFP_TOKEN": ""})
    assert code == 2
    assert "--token" in out and "FEDPIPE_KFP_TOKEN" in out and "--token-file" in out and "ps" in out
    assert PASSWORD not in out


@pytest.mark.parametrize("command", [["check", "kfp"], ["submit"], ["register"], ["schedule", "--cron", "0 0 3 * * *"],
                                     ["unschedule", "job"]])
def test_every_command_refuses_a_token_flag(command):
    code, out = invoke(*command, "--token", PASSWORD)
    assert code == 2 and "FEDPIPE_KFP_TOKEN" in out and PASSWORD not in out


def test_the_token_from_the_environment_is_used(monkeypatch):
    seen = {}

    def connect(host, namespace=None, token=None, token_file=None):
        seen.update(host=host, token=token, token_file=token_file)
        return object()

    monkeypatch.setattr(fedpipe.pipelines.client, "connect", connect)
    monkeypatch.setattr(fedpipe.pipelines.client, "describe_backend", lambda client, host: "KFP ok")
    code, out = invoke("check", "kfp", "--host", "http://kfp:8888", env={"FEDPIPE_KFP_TOKEN": PASSWORD})
    assert code == 0, out
    assert seen["token"] == PASSWORD and "KFP ok" in out


@pytest.mark.parametrize("url", [f"http://user:{PASSWORD}@pushgateway:9091", f"user:{PASSWORD}@pushgateway:9091",
                                 f"https://{PASSWORD}@pushgateway"])
def test_a_pushgateway_url_with_credentials_is_refused(url):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"telemetry.pushgateway={url}"])
    message = str(e.value)
    assert "telemetry.pushgateway" in message and "user name or password" in message and "proxy" in message
    assert PASSWORD not in message


def test_fedpipe_config_never_prints_pushgateway_credentials():
    code, out = invoke("config", "--set", f"telemetry.pushgateway=http://admin:{PASSWORD}@pgw:9091")
    assert code == 2 and "telemetry.pushgateway" in out
    assert PASSWORD not in out


def test_a_store_url_with_credentials_is_refused_and_a_folder_with_an_at_sign_is_not():
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"run.store=s3://AKIAEXAMPLE:{PASSWORD}@bucket/runs"])
    assert "run.store" in str(e.value) and "AWS_ACCESS_KEY_ID" in str(e.value) and PASSWORD not in str(e.value)
    assert load_config(None, ["run.store=/data/team@lab/runs"]).run.store == "/data/team@lab/runs"


def test_plain_urls_are_accepted():
    cfg = load_config(None, ["telemetry.pushgateway=http://fedpipe-pushgateway.kubeflow:9091", "run.store=s3://mlpipeline/fedpipe"])
    assert cfg.telemetry.pushgateway == "http://fedpipe-pushgateway.kubeflow:9091"


@pytest.mark.parametrize("where", ["flag", "env"])
def test_a_kfp_host_with_credentials_is_refused_before_connecting(monkeypatch, where):
    url = f"http://admin:{PASSWORD}@ml-pipeline-ui:80"
    monkeypatch.setenv("KF_PIPELINES_ENDPOINT", url if where == "env" else "")
    with pytest.raises(FedpipeError) as e:
        fedpipe.pipelines.client.connect(url if where == "flag" else None, "ns", None, None)
    assert "user name or password" in str(e.value) and "FEDPIPE_KFP_TOKEN" in str(e.value)
    assert PASSWORD not in str(e.value)


def test_a_pushgateway_with_credentials_in_the_environment_is_refused(monkeypatch):
    from fedpipe.telemetry.prometheus import PrometheusSink

    monkeypatch.setenv("FEDPIPE_PUSHGATEWAY", f"http://user:{PASSWORD}@pgw:9091")
    with pytest.raises(FedpipeError) as e:
        PrometheusSink.from_env()
    assert "FEDPIPE_PUSHGATEWAY" in str(e.value) and PASSWORD not in str(e.value)
