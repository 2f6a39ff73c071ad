"""A phase's state stays in the run's store; between pipeline tasks travels a pointer (store URL, key,
sha256, size). The task that receives one trusts nothing in it: the pointer file may have been written by
anyone who can write KFP's artifact store, and the store object may have changed since."""

import json

import pytest

from fedpipe.components.bodies import POINTER_LIMIT, check_pointer, pointer_metadata, write_pointer
from fedpipe.errors import CorruptArtifactError
from fedpipe.run.config import load_config
from fedpipe.run.run import Run

KEY = "r/phases/federation/final.pt"


@pytest.fixture
def run(tmp_path):
    run = Run(load_config(None, [f"run.store={tmp_path / 'store'}", "run.id=r"]))
    run.store.put(KEY, b"state bytes" * 100)
    return run


def _pointer(run, tmp_path) -> tuple[dict, str]:
    path = str(tmp_path / "artifact" / "state")
    return write_pointer(run, KEY, path), path


def test_a_pointer_names_the_object_and_is_small(run, tmp_path):
    pointer, path = _pointer(run, tmp_path)
    assert pointer["size"] == 1100 and pointer["url"] == run.store.url(KEY) and len(open(path).read()) < 1024
    check_pointer(run, KEY, path)  # the same run, the same bytes: accepted
    assert pointer_metadata(path) == {"store_url": run.store.url(KEY), "sha256": pointer["sha256"], "size_bytes": 1100}


def test_a_rewritten_state_is_refused(run, tmp_path):
    _, path = _pointer(run, tmp_path)
    run.store.put(KEY, b"other bytes")  # rewritten (with a matching store hash) after the pointer was made
    with pytest.raises(CorruptArtifactError, match="not the state the previous task wrote"):
        check_pointer(run, KEY, path)


def test_a_missing_state_says_to_rerun(run, tmp_path):
    _, path = _pointer(run, tmp_path)
    run.store.delete(KEY)
    with pytest.raises(CorruptArtifactError, match="is gone from the store.*Rerun the pipeline"):
        check_pointer(run, KEY, path)


def test_a_pointer_of_another_run_or_store_is_refused(run, tmp_path):
    pointer, path = _pointer(run, tmp_path)
    with pytest.raises(CorruptArtifactError, match="belongs to another run or store"):
        check_pointer(run, "r/phases/personalization/final.pt", path)
    elsewhere = Run(load_config(None, [f"run.store={tmp_path / 'other'}", "run.id=r"]))
    elsewhere.store.put(KEY, b"state bytes" * 100)
    with pytest.raises(CorruptArtifactError, match="belongs to another run or store"):
        check_pointer(elsewhere, KEY, path)


@pytest.mark.parametrize("content, message", [
    (b"\x80\x81 not text", "not valid UTF-8|cannot be decoded|UTF-8"),
    (b"[1, 2]", "is not a fedpipe state pointer"),
    (b'{"format": "something else"}', "is not a fedpipe state pointer"),
    (b"{" * 5000, "nests deeper|not a valid"),
    (b"x" * (POINTER_LIMIT + 1), "more than the 16 KiB a state pointer can be"),
])
def test_a_hostile_pointer_file_is_refused_before_it_is_used(run, tmp_path, content, message):
    path = tmp_path / "state"
    path.write_bytes(content)
    with pytest.raises(CorruptArtifactError, match=message):
        check_pointer(run, KEY, str(path))


@pytest.mark.parametrize("field, value", [("sha256", "zz" * 32), ("sha256", 5), ("size", "1100"), ("size", -1), ("key", None)])
def test_every_field_of_a_pointer_is_checked(run, tmp_path, field, value):
    pointer, path = _pointer(run, tmp_path)
    pointer[field] = value
    open(path, "w").write(json.dumps(pointer))
    with pytest.raises(CorruptArtifactError, match=field if field != "sha256" or isinstance(value, int) else "sha256 or size"):
        check_pointer(run, KEY, path)
