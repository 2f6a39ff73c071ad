"""Kubeflow Hub registration of a model line's promoted versions (fedpipe.models.hub) through the real
`model-registry` client (kubeflow/model-registry's Python client, 0.3.7), against a STAND-IN of the registry's
REST server on loopback (tests/model_registry_standin.py: not Kubeflow Model Registry; it enforces the
registry's OpenAPI document and its Go server's decoding rules at tag v0.3.7, the release Kubeflow 26.03 ships).
No cluster and no real registry ran here."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request

import pytest
from model_registry_standin import ModelRegistryStandIn
from pydantic import ValidationError

from fedpipe.config import KubeflowHubConfig
from fedpipe.models import hub
from fedpipe.models.line import ModelLine, ModelSpec, VersionRecord
from fedpipe.run.config import load_config
from fedpipe.store import open_store

TOKEN = "hub-test-token-7f3a"  # noqa: S105
SPEC = ModelSpec("twonn", "fedavg", (1, 8, 8), 10, tuple(str(d) for d in range(10)))
API = "/api/model_registry/v1alpha3"


def _record(run_id: str, accuracy: float) -> VersionRecord:
    decision = {"promoted": True, "reason": "candidate 0.810 >= champion 0.790 - 0.000", "metric": "personalized_accuracy",
                "candidate": accuracy, "champion": 0.79, "champion_version": 1, "compared": 4, "new_samples": 120}
    return VersionRecord(0, run_id, SPEC, "method:\n  name: fedavg\n", {"source": "s3://drops/2026-11-24", "digest": "ab" * 32, "objects": 3},
                         {"personalized_accuracy": {"mean": accuracy}}, ("0", "1", "2"), decision)


@pytest.fixture
def line(tmp_path) -> ModelLine:
    line = ModelLine(open_store(str(tmp_path)), "digits")
    line.register(_record("run-a", 0.79), {})
    line.register(_record("run-b", 0.81), {})
    line.register(_record("run-c", 0.70), {})
    line.promote(1, "first")
    line.promote(2, "better")  # version 3 is never promoted
    return line


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setenv(hub.ENV_TOKEN, TOKEN)
    monkeypatch.setattr(hub, "BACKOFF_S", 0.0)
    with ModelRegistryStandIn(TOKEN) as standin:
        monkeypatch.setenv(hub.ENV_URL, standin.url)  # the registry the token belongs to
        yield standin
    assert standin.errors == []  # nothing it answered breaks the document


def _props(version: dict) -> dict:
    """A ModelVersion's customProperties as plain values (MetadataValue: {metadataType, <kind>_value})."""
    out = {}
    for key, value in version["customProperties"].items():
        kind = value["metadataType"]
        out[key] = {"MetadataIntValue": lambda v: int(v["int_value"]), "MetadataDoubleValue": lambda v: v["double_value"],
                    "MetadataStringValue": lambda v: v["string_value"], "MetadataBoolValue": lambda v: v["bool_value"]}[kind](value)
    return out


def test_each_promoted_version_is_registered_with_its_figures_and_snapshot(line, registry, caplog):
    cfg = KubeflowHubConfig(url=registry.url, author="ml-platform")
    with caplog.at_level(logging.INFO):
        statuses = hub.sync_promoted(line, cfg)
    assert [(s["version"], s["registered"]) for s in statuses] == [("1", True), ("2", True)]
    (model,) = registry.models.values()
    assert model["name"] == "digits" and model["owner"] == "ml-platform"
    versions = {v["name"]: v for v in registry.versions.values()}
    assert sorted(versions) == ["1", "2"]  # version 3 was never promoted
    props = _props(versions["2"])
    assert props["fedpipe.run_id"] == "run-b" and props["fedpipe.version"] == 2 and props["fedpipe.clients"] == 3
    assert props["fedpipe.gate.candidate"] == 0.81 and props["fedpipe.gate.champion_version"] == 1 and props["fedpipe.gate.promoted"] is True
    assert props["fedpipe.gate.metric"] == "personalized_accuracy" and props["fedpipe.gate.reason"].startswith("candidate 0.810")
    assert json.loads(props["fedpipe.data.snapshot"]) == {"source": "s3://drops/2026-11-24", "digest": "ab" * 32, "objects": 3}
    assert versions["2"]["author"] == "ml-platform" and versions["2"]["registeredModelId"] == model["id"]
    artifacts = {a["modelVersionId"]: a for a in registry.artifacts.values()}
    artifact = artifacts[versions["2"]["id"]]
    assert artifact["uri"] == line.store.url(line.keys.version(2).rstrip("/")) + "/" and artifact["artifactType"] == "model-artifact"
    assert (artifact["modelFormatName"], artifact["modelFormatVersion"]) == ("fedpipe", "1")
    kept = json.loads(line.store.get_text(line.keys.hub(2)))
    assert kept["registered"] and kept["model_version_id"] == versions["2"]["id"] and kept["uri"] == artifact["uri"]
    # the token is in no record and no log line
    assert TOKEN not in line.store.get_text(line.keys.hub(1)) + line.store.get_text(line.keys.hub(2)) + caplog.text
    # idempotent: a second publication finds both registered and calls nothing
    calls = len(registry.requests)
    assert hub.sync_promoted(line, cfg) == [] and len(registry.requests) == calls


def test_a_registration_that_fails_keeps_the_promotion_and_the_next_publication_retries(line, registry, caplog):
    cfg = KubeflowHubConfig(url=registry.url)
    registry.token = "another-token"  # noqa: S105 (the registry refuses ours: 401, a refusal, not retried)
    with caplog.at_level(logging.WARNING):
        statuses = hub.sync_promoted(line, cfg)
    assert all(not s["registered"] and s["attempts"] == 1 and "401" in s["error"] for s in statuses)
    assert "is promoted but not registered" in caplog.text and "retries" in caplog.text
    assert line.promoted() == 2 and registry.versions == {}
    assert json.loads(line.store.get_text(line.keys.hub(2)))["registered"] is False  # kept for the retry
    registry.token = TOKEN
    registry.fail_next(1, 503)  # transient: tried again at once
    statuses = hub.sync_promoted(line, cfg)
    assert [(s["version"], s["registered"], s["attempts"]) for s in statuses] == [("1", True, 2), ("2", True, 1)]
    assert sorted(v["name"] for v in registry.versions.values()) == ["1", "2"]


def test_an_unreachable_registry_costs_a_warning_not_the_promotion(line, monkeypatch):
    monkeypatch.setenv(hub.ENV_TOKEN, TOKEN)
    monkeypatch.setattr(hub, "BACKOFF_S", 0.0)
    standin = ModelRegistryStandIn(TOKEN)
    url = standin.url
    monkeypatch.setenv(hub.ENV_URL, url)
    standin.server.server_close()  # nothing listens there any more
    (status, *_) = hub.sync_promoted(line, KubeflowHubConfig(url=url))
    assert status["registered"] is False and status["attempts"] == hub.ATTEMPTS and line.promoted() == 2


def test_the_installed_client_speaks_the_api_of_the_registry_kubeflow_ships(line, registry):
    """The client's API root is the v0.3.7 document's (PyPI's model-registry 0.3.16+ call /api/model_registry/v1,
    which a v0.3.x registry answers with 404): a client that drifted fails here, and says so in plain words."""
    import model_registry

    assert model_registry.__version__ == "0.3.7"
    (status, *_) = hub.sync_promoted(line, KubeflowHubConfig(url=registry.url + "/not-the-api"))
    assert status["registered"] is False and "does not serve the API path" in status["error"]
    assert status["attempts"] == 1  # a 404 is a refusal, not worth retrying


def test_a_version_held_with_another_uri_is_an_error_and_nothing_is_overwritten(line, registry, tmp_path):
    other = ModelLine(open_store(str(tmp_path / "other-store")), "digits")
    other.register(_record("run-x", 0.9), {})
    other.promote(1, "first")
    cfg = KubeflowHubConfig(url=registry.url)
    assert hub.sync_promoted(other, cfg)[0]["registered"]
    first, second = hub.sync_promoted(line, cfg)
    assert not first["registered"] and "registry.kubeflow_hub.model" in first["error"] and "nothing was overwritten" in first["error"]
    assert second["registered"]  # its version 2 is no other line's
    assert sorted(a["uri"] for a in registry.artifacts.values()) == [line.store.url(line.keys.version(2).rstrip("/")) + "/",
                                                                     other.store.url(other.keys.version(1).rstrip("/")) + "/"]
    # under a name of its own the line registers
    assert all(s["registered"] for s in hub.sync_promoted(line, KubeflowHubConfig(url=registry.url, model="digits-site-b")))


def _post(registry, path: str, body: dict) -> int:
    request = urllib.request.Request(registry.url + API + path, json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310 (loopback)
            return answer.status
    except urllib.error.HTTPError as e:
        return e.code


def test_the_standin_refuses_what_the_registry_refuses(registry):
    """The stand-in's rules, each one able to fail a registration that breaks it (the real client's calls pass
    them all: the tests above end with `registry.errors == []` and every call under 400 but the 404 finds)."""
    assert _post(registry, "/registered_models", {"name": "m", "owner": "me"}) == 201
    assert _post(registry, "/registered_models", {"name": "m"}) == 409  # a name is unique
    assert _post(registry, "/registered_models", {"name": "n", "ownr": "me"}) == 400  # DisallowUnknownFields
    assert _post(registry, "/registered_models", {"owner": "me"}) == 422  # AssertRegisteredModelCreateRequired: name
    assert _post(registry, "/model_versions", {"name": "1", "registeredModelID": "1"}) in (400, 422)  # a misspelt field
    assert _post(registry, "/model_versions", {"name": "1", "registeredModelId": "99"}) == 404
    bad_value = {"name": "1", "registeredModelId": "1", "customProperties": {"x": {"metadataType": "MetadataStringValue", "int_value": "3"}}}
    assert _post(registry, "/model_versions", bad_value) == 400  # the discriminated type's required string_value
    assert _post(registry, "/model_versions", {**bad_value, "customProperties": {"x": {"metadataType": "Text", "string_value": "3"}}}) == 400
    assert _post(registry, "/model_versions", {"name": "1", "registeredModelId": "1", "state": "GONE"}) == 400  # enum
    assert _post(registry, "/model_versions", {"name": "1", "registeredModelId": "1"}) == 201
    assert _post(registry, "/model_versions/2/artifacts", {"artifactType": "model", "uri": "s3://b/k"}) == 400  # discriminator
    assert _post(registry, "/model_versions/2/artifacts", {"artifactType": "model-artifact", "uri": "s3://b/k", "name": "a"}) == 201
    request = urllib.request.Request(registry.url + API + "/registered_models", method="GET")
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(request, timeout=10)  # noqa: S310 (no token)


def test_the_config_keeps_credentials_out_and_hub_off_by_default(monkeypatch, tmp_path):
    assert load_config(None, []).registry.kubeflow_hub.url == ""
    for url in ("https://user:pw@registry:8443", "https://registry:8443/?access_token=x", "registry:8443", "ftp://registry"):
        with pytest.raises((ValidationError, Exception), match="kubeflow_hub.url"):
            load_config(None, [f"registry.kubeflow_hub.url={url}"])
    cfg = load_config(None, ["registry.kubeflow_hub.url=https://model-registry-service.kubeflow.svc.cluster.local:8443"])
    assert cfg.registry.kubeflow_hub.url.endswith(":8443")
    assert hub.sync_promoted(ModelLine(open_store(str(tmp_path)), "x"), KubeflowHubConfig()) == []  # off: nothing is read
    monkeypatch.delenv(hub.ENV_TOKEN, raising=False)
    monkeypatch.setenv(hub.ENV_TOKEN_FILE, str(tmp_path / "missing-token"))
    with pytest.raises(hub.HubError, match="FEDPIPE_HUB_TOKEN_FILE"):
        hub.token()
    (tmp_path / "token").write_text(TOKEN + "\n")
    monkeypatch.setenv(hub.ENV_TOKEN_FILE, str(tmp_path / "token"))
    assert hub.token() == TOKEN


def test_the_publish_step_registers_the_promoted_version_and_a_rerun_registers_nothing_again(tmp_path, registry):
    """The whole step (fedpipe.models.publish.publish) on a real tiny run: the gate promotes version 1, the step
    registers it in the (stand-in) registry and reports it; the same step run again reuses the version and
    calls the registry for nothing new."""
    from runs import SMALL

    from fedpipe.models.publish import publish
    from fedpipe.run.run import Run

    cfg = load_config(None, [*SMALL, "data.dataset=digits", "partition.num_clients=4", "train.rounds=1", "method.name=fedavg",
                             "run.threads=1", "registry.name=digits", f"run.store={tmp_path}", "run.id=hub-1",
                             f"registry.kubeflow_hub.url={registry.url}"])
    run = Run(cfg)
    run.run_all()
    result = publish(run)
    assert result["promoted"] and result["version"] == 1
    (status,) = result["kubeflow_hub"]
    assert status["registered"] and status["model"] == "digits" and status["version"] == "1"
    assert status["storage_uri"] == "model-registry://digits/1"  # KServe's model-registry storage initializer resolves it
    (version,) = registry.versions.values()
    assert _props(version)["fedpipe.run_id"] == "hub-1" and _props(version)["fedpipe.gate.promoted"] is True
    (artifact,) = registry.artifacts.values()
    assert artifact["uri"] == status["uri"] and run.store.exists("models/digits/versions/1/spec.json")
    assert publish(run).get("reused") and len(registry.versions) == 1


def test_the_token_goes_only_to_the_registry_the_environment_names(line, registry, monkeypatch):
    """Issue 43, A14: a run's parameters can set registry.kubeflow_hub.url; the token must not follow it. A second
    registry on loopback (the "attacker's", any address but FEDPIPE_HUB_URL's) receives no token: with a token
    given the registration stops with an error naming FEDPIPE_HUB_URL; the trusted registry still gets it."""
    with ModelRegistryStandIn("attacker-never-sees-it") as other:
        seen: list[str] = []
        real = other._dispatch

        def spy(method, target, headers, raw):
            seen.append(headers.get("Authorization", ""))
            return real(method, target, headers, raw)

        other._dispatch = spy
        statuses = hub.sync_promoted(line, KubeflowHubConfig(url=other.url))
        assert all(TOKEN not in h for h in seen)
        assert statuses and all(not s["registered"] and "FEDPIPE_HUB_URL" in s["error"] for s in statuses)
    monkeypatch.delenv(hub.ENV_TOKEN)  # only the pod's service-account token (none here): nothing is sent either
    assert hub.is_trusted(registry.url) and not hub.is_trusted(registry.url.replace("127.0.0.1", "localhost"))
    assert all(s["registered"] for s in hub.sync_promoted(line, KubeflowHubConfig(url=registry.url))) is False  # 401: no token
