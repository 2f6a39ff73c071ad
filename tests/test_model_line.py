"""The model line (fedpipe.models.line): versions registered once and never rewritten, numbers taken in a race
without losing a registration, the promoted pointer moved by compare-and-swap and checked against the record's
sha256, rollback along the history, and the `fedpipe models` commands over it."""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from fedpipe.cli import app
from fedpipe.errors import ConfigError, CorruptArtifactError, StoreError
from fedpipe.models.line import ModelLine, ModelSpec, VersionRecord
from fedpipe.store import open_store

SPEC = ModelSpec("twonn", "fedavg", (1, 8, 8), 10, tuple(str(d) for d in range(10)))


def _record(run_id: str = "run-a", accuracy: float = 0.8) -> VersionRecord:
    return VersionRecord(0, run_id, SPEC, "method:\n  name: fedavg\n", {"source": "/data/2026-11-24", "digest": "ab" * 32, "objects": 3},
                         {"personalized_accuracy": {"mean": accuracy}, "global_model": {"top1": accuracy - 0.1}}, ("0", "1"),
                         {"promoted": True, "reason": "first version"})


@pytest.fixture
def line(tmp_path) -> ModelLine:
    return ModelLine(open_store(str(tmp_path)), "digits")


def test_register_writes_files_then_the_record_and_reads_it_back(line):
    first = line.register(_record(), {"spec.json": b"{}", "global.pt2": b"g", "clients/0.pt2": b"c0"})
    second = line.register(_record("run-b", 0.9), {"spec.json": b"{}"})
    assert (first.version, second.version) == (1, 2) and line.versions() == [1, 2]
    assert line.record(1) == first and line.record(2).run_id == "run-b" and first.created
    assert line.read(1, "clients/0.pt2", 100) == b"c0"
    with pytest.raises(CorruptArtifactError, match="more than"):
        line.read(1, "clients/0.pt2", 1)
    with pytest.raises(StoreError, match="no file 'global.pt2'"):
        line.read(2, "global.pt2", 100)
    with pytest.raises(StoreError, match="no version 3"):
        line.record(3)
    with pytest.raises(ConfigError, match="written by the model line itself"):
        line.register(_record(), {"version.json": b"{}"})
    with pytest.raises(StoreError, match=r"'\.\.'"):
        line.register(_record(), {"../escape": b""})
    assert line.versions() == [1, 2]  # a refused registration wrote nothing


def test_a_version_is_never_rewritten(line):
    line.register(_record(), {"spec.json": b"{}"})
    key = line.keys.record(1)
    before = line.store.get(key)
    assert not line.store.create(key, b"{}")  # the precondition: a second create of the same number loses
    assert line.store.get(key) == before


def test_registrations_racing_get_distinct_numbers(line):
    barrier, numbers, errors = threading.Barrier(8), [], []

    def register(i: int) -> None:
        try:
            barrier.wait()
            numbers.append(line.register(_record(f"run-{i}"), {"spec.json": f"{i}".encode()}).version)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=register, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sorted(numbers) == list(range(1, 9)) and line.versions() == list(range(1, 9))
    for v in line.versions():  # each version's files are its own registration's, never a racer's
        assert line.read(v, "spec.json", 10) == line.record(v).run_id.removeprefix("run-").encode()


def test_a_claimed_number_without_a_record_is_skipped(line):
    line.store.create(line.keys.claim(1), b"{}")  # a registration that died after taking number 1
    assert line.versions() == [] and line.register(_record(), {}).version == 2


def test_promote_rollback_and_history(line):
    for i in range(3):
        line.register(_record(f"run-{i}"), {})
    assert line.promoted() is None and line.history() == []
    with pytest.raises(StoreError, match="never been promoted"):
        line.rollback()
    line.promote(1, "first")
    with pytest.raises(StoreError, match="no version promoted before"):
        line.rollback()
    line.promote(2, "better")
    line.promote(3, "better still")
    assert line.promoted() == 3
    assert line.rollback() == 2 and line.promoted() == 2
    assert line.rollback() == 1 and line.promoted() == 1  # twice: two promotions back
    line.promote(3, "again")
    assert line.rollback() == 1
    history = line.history()
    assert [(e["seq"], e["action"], e["version"]) for e in history] == [
        (1, "promote", 1), (2, "promote", 2), (3, "promote", 3), (4, "rollback", 2), (5, "rollback", 1), (6, "promote", 3), (7, "rollback", 1)]
    assert history[1]["reason"] == "better" and history[3]["reason"] == "rolled back from version 3"
    with pytest.raises(StoreError, match="no version 9"):
        line.promote(9, "missing")
    assert line.promoted() == 1


def test_two_promoters_cannot_both_win_silently(line):
    line.register(_record(), {})
    line.register(_record("run-b"), {})
    line.promote(1, "first")
    stale = line.log.pointer()
    line.promote(2, "the other promoter, first")
    line.log.pointer = lambda: stale  # this promoter read the pointer before the other one moved it
    with pytest.raises(StoreError, match="another promotion or rollback changed"):
        line.promote(1, "late")
    del line.log.pointer
    assert line.promoted() == 2 and [e["version"] for e in line.history()] == [1, 2]


def test_a_pointer_to_a_missing_version_is_an_error_and_nothing_is_promoted(line):
    line.register(_record(), {})
    line.promote(1, "first")
    line.store.delete(line.keys.record(1))
    with pytest.raises(CorruptArtifactError, match=r"names version 1, whose record .* is tampered or missing"):
        line.promoted()


@pytest.mark.parametrize("how", ["through the store", "by hand"])
def test_a_record_changed_after_promotion_is_an_error_and_nothing_is_promoted(line, tmp_path, how):
    line.register(_record(), {})
    line.register(_record("run-b"), {})
    line.promote(1, "first")
    line.promote(2, "second")
    changed = json.loads(line.store.get(line.keys.record(2)))
    changed["summary"]["personalized_accuracy"]["mean"] = 0.99
    if how == "through the store":  # with a new sha256 recorded: the store's own check passes
        line.store.put(line.keys.record(2), json.dumps(changed).encode())
    else:
        (tmp_path / line.keys.record(2)).write_text(json.dumps(changed))
    with pytest.raises(CorruptArtifactError, match="tampered or missing"):
        line.promoted()
    assert line.rollback() == 1 and line.promoted() == 1  # the way back to an intact version stays open


def test_rollback_to_a_changed_record_is_refused(line):
    line.register(_record(), {})
    line.register(_record("run-b"), {})
    line.promote(1, "first")
    line.promote(2, "second")
    tree = json.loads(line.store.get(line.keys.record(1)))
    line.store.put(line.keys.record(1), json.dumps({**tree, "run_id": "someone-else"}).encode())
    with pytest.raises(CorruptArtifactError, match="tampered or missing"):
        line.rollback()
    assert line.promoted() == 2


@pytest.mark.parametrize("content", [b"{not json", b"[]", b'{"format": "fedpipe.model-version/1"}', b"\x00\x01",
                                     b'{"format": "fedpipe.model-version/1", "version": "1"}'])
def test_a_malformed_record_is_refused_naming_its_key(line, content):
    line.register(_record(), {})
    line.store.put(line.keys.record(1), content)
    with pytest.raises(CorruptArtifactError, match=r"models/digits/versions/1/version\.json"):
        line.record(1)
    with pytest.raises(StoreError, match=r"versions/1/version\.json"):
        line.promote(1, "malformed")
    assert line.promoted() is None


def test_a_record_in_another_versions_folder_is_refused(line):
    line.register(_record(), {})
    line.register(_record("run-b"), {})
    line.store.put(line.keys.record(2), line.store.get(line.keys.record(1)))
    with pytest.raises(CorruptArtifactError, match="says version 1 but lies in the folder of version 2"):
        line.record(2)


def test_malformed_pointer_and_history_are_refused(line):
    line.register(_record(), {})
    line.promote(1, "first")
    line.store.put(line.keys.pointer, b'{"format": "fedpipe.model-promoted/1", "version": 1}')
    with pytest.raises(CorruptArtifactError, match="models/digits/promoted"):
        line.promoted()
    line.store.delete(line.keys.pointer)
    line.store.put(line.keys.entry(1), b"[1, 2]")
    with pytest.raises(CorruptArtifactError, match=r"history/000001\.json"):
        line.history()


def test_an_oversized_record_is_refused_before_it_is_read(line, monkeypatch):
    import fedpipe.models.line as module

    line.register(_record(), {})
    monkeypatch.setattr(module, "MAX_VERSION_RECORD_BYTES", 100)
    with pytest.raises(CorruptArtifactError, match="more than"):
        line.record(1)


def test_a_lost_history_entry_is_shown_from_the_pointer_and_written_by_the_next_move(line):
    line.register(_record(), {})
    line.register(_record("run-b"), {})
    line.promote(1, "first")
    line.promote(2, "second")
    line.store.delete(line.keys.entry(2))  # a promoter that died between the pointer and its history entry
    assert [e["version"] for e in line.history()] == [1, 2]
    assert not line.store.exists(line.keys.entry(2))  # reading writes nothing
    assert line.rollback() == 1 and line.store.exists(line.keys.entry(2))


def test_names_and_versions_are_checked():
    with pytest.raises(ConfigError, match="not allowed"):
        ModelLine(open_store("unused"), "../x")
    with pytest.raises(ConfigError, match="not allowed"):
        ModelLine(open_store("unused"), "Upper")
    with pytest.raises(ConfigError, match="number 1, 2"):
        ModelLine(open_store("unused"), "ok").record(0)


def test_model_spec_mismatch():
    assert SPEC.mismatch(SPEC) == []
    other = replace(SPEC, input_shape=(3, 32, 32), class_names=tuple("abcdefghij"))
    assert SPEC.mismatch(other) == ["input_shape: (1, 8, 8) vs (3, 32, 32)",
                                    f"class_names: {tuple(str(d) for d in range(10))!r} vs {tuple('abcdefghij')!r}"]
    assert ModelSpec.from_json(SPEC.to_json(), "x") == SPEC


def test_a_line_in_s3(s3_env):
    line = ModelLine(open_store("s3://model-lines/prefix"), "digits")
    line.register(_record(), {"spec.json": b"{}"})
    line.register(_record("run-b"), {"spec.json": b"{}"})
    assert not line.store.create(line.keys.record(1), b"{}")
    line.promote(1, "first")
    line.promote(2, "second")
    assert line.rollback() == 1 and line.promoted() == 1
    line.store.delete(line.keys.record(1))
    with pytest.raises(CorruptArtifactError, match="tampered or missing"):
        line.promoted()


def test_the_models_commands(line, tmp_path):
    line.register(_record("run-a", 0.8), {"spec.json": b"{}"})
    line.register(_record("run-b", 0.9), {"spec.json": b"{}"})
    runner = CliRunner()

    def fedpipe(*args: str):
        return runner.invoke(app, [*args, "--store", str(tmp_path)])

    listed = fedpipe("models", "list", "digits")
    assert listed.exit_code == 0, listed.output
    assert "2 version(s), promoted: none" in listed.output and "personalized 90.00%  global 80.00%" in listed.output
    assert fedpipe("models", "promote", "digits", "1", "--reason", "checked by hand").exit_code == 0
    assert fedpipe("models", "promote", "digits", "2").exit_code == 0
    listed = fedpipe("models", "list", "digits")
    assert "* v2" in listed.output and "  v1" in listed.output
    shown = fedpipe("models", "show", "digits@1")
    assert shown.exit_code == 0, shown.output
    assert "run          run-a" in shown.output and "spec.json" in shown.output and "promote v1: checked by hand" in shown.output
    back = fedpipe("models", "rollback", "digits")
    assert back.exit_code == 0 and "version 1 promoted again (rolled back from 2)" in back.output
    bad = fedpipe("models", "rollback", "digits")
    assert bad.exit_code == 2 and "no version promoted before the current one" in bad.output
    missing = fedpipe("models", "show", "digits@7")
    assert missing.exit_code == 2 and "no version 7" in missing.output


def test_a_file_rewritten_through_the_store_after_registration_is_refused(line):
    """The store records a new sha256 with a rewrite, so only the record's own file hashes (pinned by the
    promoted pointer through the record's sha256) show that state.pt or a client's model was swapped."""
    line.register(_record(), {"state.pt": b"the trained state", "clients/0.pt2": b"c0"})
    assert line.record(1).files["state.pt"] == hashlib.sha256(b"the trained state").hexdigest()
    line.store.put(line.keys.version(1) + "state.pt", b"someone else's weights")
    with pytest.raises(CorruptArtifactError, match="changed after registration"):
        line.read(1, "state.pt", 1000)
    assert line.read(1, "clients/0.pt2", 100) == b"c0"
