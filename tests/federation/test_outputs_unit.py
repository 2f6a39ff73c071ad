"""Where the submitter and the ServerApp meet: the run's store (`fedpipe.federation.outputs`), without Flower. The
submitter's spec, champion and warm start reach the ServerApp's scratch folder, its outputs reach the store, a stale champion or
answer from an earlier submission never lingers, and what the store hands back is bounded before it is parsed. The
same on S3 (moto's server, an emulator of the S3 API MinIO serves) as in a folder."""

from __future__ import annotations

import json

import pytest

from fedpipe.errors import CorruptArtifactError
from fedpipe.federation.outputs import LIMITS, ServerOutputs, SubmittedRun, federation_prefix


@pytest.fixture(params=["folder", "s3"])
def store_url(request, tmp_path):
    if request.param == "folder":
        return str(tmp_path / "store")
    raw = request.getfixturevalue("raw_client")
    request.getfixturevalue("s3_env")
    bucket = f"outputs-{abs(hash(request.node.name)) % 10**8}"
    raw.make_bucket(bucket)
    return f"s3://{bucket}/runs"


def test_the_submission_reaches_the_serverapp_and_its_answer_comes_back(store_url, tmp_path):
    submitted = SubmittedRun(store_url, "run-1")
    submitted.submit('{"method": {"name": "fedavg"}}', b"champion-bytes")
    server = ServerOutputs(store_url, federation_prefix("run-1"), tmp_path / "scratch")
    server.pull()
    assert (server.folder / "spec.json").read_text() == '{"method": {"name": "fedavg"}}'
    assert (server.folder / "champion.safetensors").read_bytes() == b"champion-bytes"
    assert submitted.answer() is None
    (server.folder / "census.json").write_text(json.dumps({"sites": []}))
    (server.folder / "result.json").write_text(json.dumps({"stage": "census", "sites": 3}))
    server.push("census.json", "result.json", "not-written.json")
    assert submitted.wait(5, poll=0.05) == {"stage": "census", "sites": 3}
    local = submitted.fetch(tmp_path / "copy")
    assert sorted(p.name for p in local.iterdir()) == ["census.json", "champion.safetensors", "result.json", "spec.json"]


def test_a_new_submission_leaves_no_champion_or_answer_of_the_last(store_url, tmp_path):
    submitted = SubmittedRun(store_url, "run-2")
    submitted.submit("{}", b"old champion")
    server = ServerOutputs(store_url, federation_prefix("run-2"), tmp_path / "scratch")
    server.pull()
    (server.folder / "error.json").write_text(json.dumps({"error": "TimeoutError: only 2 of 3 sites answered"}))
    server.push("error.json")
    with pytest.raises(RuntimeError, match="only 2 of 3 sites answered"):
        submitted.answer()
    submitted.submit("{}", None, b"warm start")  # resubmitted, this time without a champion, with a warm start
    assert submitted.answer() is None
    (server.folder / "result.json").write_text("{}")  # a stale answer in the scratch folder...
    server.pull()
    assert not (server.folder / "champion.safetensors").exists()  # ...and the old champion are gone after the pull
    assert not (server.folder / "result.json").exists()
    assert (server.folder / "warm-start.safetensors").read_bytes() == b"warm start"
    submitted.submit("{}", None)  # the next stage's submission: no warm start (it resumes from the checkpoint)
    server.pull()
    assert not (server.folder / "warm-start.safetensors").exists()


def test_a_federated_warm_start_is_refused_by_name_where_it_cannot_work(tmp_path):
    """train.init_from in a federation: unpinned `promoted` and an empty registry.name are refused before anything is
    sent (fedpipe.models.federated.warm_start_for); `none` reads nothing; a private one reads the version as a plain
    one does (and continues its ledger: tests/federation/test_privacy_federated.py)."""
    from fedpipe.errors import ConfigError
    from fedpipe.models.federated import warm_start_for
    from fedpipe.run.config import load_config

    def cfg(*sets):
        return load_config(None, ["engine.mode=federation", "federation.sites=2", f"run.store={tmp_path}", *sets])

    assert warm_start_for(cfg(), 2) is None
    with pytest.raises(ConfigError, match="must be pinned to a version number"):
        warm_start_for(cfg("registry.name=line", "train.init_from=promoted"), 2)
    with pytest.raises(ConfigError, match="registry.name is empty"):
        warm_start_for(cfg("train.init_from=2"), 2)
    with pytest.raises(Exception, match="has no version 2"):
        warm_start_for(cfg("registry.name=line", "train.init_from=2", "privacy.enabled=true"), 2)
    with pytest.raises(Exception, match="has no version 2"):
        warm_start_for(cfg("registry.name=line", "train.init_from=2"), 2)


def test_a_checkpoint_in_the_store_resumes_a_serverapp_on_a_fresh_machine(tmp_path):
    store = str(tmp_path / "store")
    SubmittedRun(store, "run-3").submit("{}", None)
    first = ServerOutputs(store, federation_prefix("run-3"), tmp_path / "pod-1")
    first.pull()
    (first.folder / "server-state.pt").write_bytes(b"state after round 4")
    (first.folder / "rounds.jsonl").write_text('{"round": 4}\n')
    first.push("server-state.pt", "rounds.jsonl")
    second = ServerOutputs(store, federation_prefix("run-3"), tmp_path / "pod-2")  # the SuperLink's pod was replaced
    second.pull()
    assert (second.folder / "server-state.pt").read_bytes() == b"state after round 4"
    assert (second.folder / "rounds.jsonl").read_text() == '{"round": 4}\n'


def test_the_scratch_folder_is_named_by_a_digest_not_by_the_submitted_prefix(tmp_path):
    outputs = ServerOutputs(str(tmp_path / "store"), "run-4/federation", tmp_path / "scratch")
    assert outputs.folder.parent == tmp_path / "scratch" and len(outputs.folder.name) == 24
    with pytest.raises(Exception, match="prefix"):
        ServerOutputs(str(tmp_path / "store"), "../../etc", tmp_path / "scratch")


def test_an_oversized_or_broken_answer_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    store = str(tmp_path / "store")
    submitted = SubmittedRun(store, "run-5")
    submitted.submit("{}", None)
    monkeypatch.setitem(LIMITS, "result.json", 10)
    submitted.store.put(submitted.key("result.json"), b'{"stage": "evaluate", "padding": "xxxxxxxx"}')
    with pytest.raises(CorruptArtifactError, match="more than the 10"):
        submitted.answer()
    monkeypatch.setitem(LIMITS, "result.json", 1000)
    submitted.store.put(submitted.key("result.json"), b"{not json")
    with pytest.raises(CorruptArtifactError, match="not JSON"):
        submitted.answer()


def test_the_wait_ends_with_a_message_that_says_where_to_look(tmp_path):
    submitted = SubmittedRun(str(tmp_path / "store"), "run-6")
    submitted.submit("{}", None)
    with pytest.raises(TimeoutError, match="SuperLink's log"):
        submitted.wait(0.2, poll=0.05)
