"""`fedpipe verify RUN`: a finished run's manifest lists every artifact with its sha256 and size;
verify reads each back and names every missing or changed one (exit 1), or says all are intact (exit 0)."""

import json

import pytest
from runs import small_run
from typer.testing import CliRunner

from fedpipe.cli import app
from fedpipe.store.base import sha256_hex

OVERRIDES = ["method.name=fedavg", "partition.num_clients=2", "train.rounds=2", "run.threads=1"]


def verify(*args):
    result = CliRunner().invoke(app, ["verify", *map(str, args)])
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    store = tmp_path_factory.mktemp("store")
    small_run(store, *OVERRIDES).run_all()
    return store


def test_the_manifest_lists_every_artifact_of_the_finished_run(finished):
    manifest = json.loads((finished / "test" / "manifest.json").read_text())
    files = {p.relative_to(finished).as_posix() for p in (finished / "test").rglob("*") if p.is_file() and ".sha256" not in p.parts}
    assert set(manifest["artifacts"]) == files - {"test/manifest.json"}
    final = finished / "test" / "phases" / "federation" / "final.pt"
    entry = manifest["artifacts"]["test/phases/federation/final.pt"]
    assert entry == {"sha256": sha256_hex(final.read_bytes()), "size": final.stat().st_size}


def test_an_intact_run_verifies(finished):
    code, out = verify("test", "--store", finished)
    assert code == 0, out
    n = len(json.loads((finished / "test" / "manifest.json").read_text())["artifacts"])
    assert f"run test: all {n} artifacts intact" in out and out.count("  intact   ") == n


def test_a_flipped_byte_and_a_missing_file_are_named(tmp_path):
    small_run(tmp_path, *OVERRIDES).run_all()
    state = tmp_path / "test" / "phases" / "federation" / "final.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x01
    state.write_bytes(bytes(data))
    (tmp_path / "test" / "report" / "clients.csv").unlink()

    code, out = verify("test", "--store", tmp_path, "--quiet")
    assert code == 1, out
    assert f"DAMAGED  {state}" in out and f"MISSING  {tmp_path / 'test' / 'report' / 'clients.csv'}" in out
    assert "2 of " in out and "intact   " not in out  # --quiet lists only the bad ones


def test_a_consistent_rewrite_is_still_caught_by_the_manifest(tmp_path):
    run = small_run(tmp_path, *OVERRIDES)
    run.run_all()
    run.store.put_text("test/report/summary.json", "{}")  # new bytes with a matching store hash
    code, out = verify("test", "--store", tmp_path)
    assert code == 1 and "DAMAGED" in out and "summary.json: sha256" in out and "the manifest has" in out



def test_an_artifact_grown_past_its_recorded_size_is_damaged_without_being_read(tmp_path, monkeypatch):
    run = small_run(tmp_path, *OVERRIDES)
    run.run_all()
    run.store.put("test/report/summary.json", b"x" * 10_000_000)  # a consistent rewrite, far larger than recorded
    from fedpipe.store.folder import LocalStore

    fetched = []
    original = LocalStore.get
    monkeypatch.setattr(LocalStore, "get", lambda self, key: fetched.append(key) or original(self, key))
    code, out = verify("test", "--store", tmp_path)
    assert code == 1 and "DAMAGED" in out and "more than the" in out
    assert "test/report/summary.json" not in fetched

def test_an_unfinished_run_has_no_manifest_and_says_so(tmp_path):
    small_run(tmp_path, *OVERRIDES).partition()
    code, out = verify("test", "--store", tmp_path)
    assert code == 2 and out.startswith("error: Run 'test' has no run manifest") and "Traceback" not in out


def test_the_store_comes_from_the_config_without_store(finished):
    code, out = verify("test", "--set", f"run.store={finished}")
    assert code == 0 and "all" in out


def test_help_teaches():
    result = CliRunner().invoke(app, ["verify", "--help"])
    assert result.exit_code == 0
    for words in ("manifest.json", "sha256", "exit 0", "--store", "s3://"):
        assert words in result.output


@pytest.mark.services
def test_verify_against_s3(s3_env, s3_credentials):
    from minio import Minio

    store = "s3://verified/team-b"
    small_run(store, *OVERRIDES).run_all()
    code, out = verify("test", "--store", store)
    assert code == 0 and "run test: all" in out and "s3://verified/team-b/test/phases/federation/final.pt" in out

    access, secret = s3_credentials
    client = Minio(s3_env.removeprefix("http://"), access_key=access, secret_key=secret, secure=False)
    name = "team-b/test/report/rounds-federation.jsonl"
    obj = client.get_object("verified", name)
    data, meta = bytearray(obj.read()), obj.headers.get("x-amz-meta-sha256")
    obj.close()
    data[0] ^= 0x01  # one flipped bit, the recorded hash kept: bit rot on the server
    import io

    client.put_object("verified", name, io.BytesIO(bytes(data)), len(data), metadata={"sha256": meta})
    code, out = verify("test", "--store", store)
    assert code == 1 and f"DAMAGED  s3://verified/{name}" in out


def test_a_file_copied_into_the_run_folder_is_named_not_fatal(tmp_path):
    """A foreign object under <run>/ (no hash fedpipe recorded) used to make every evaluate fail with advice to
    re-run the step, which found it again (issue 30): the manifest now leaves it out and says so; verify names it."""
    from fedpipe.run.verify import write_run_manifest
    from fedpipe.store import open_store

    run = small_run(tmp_path, *OVERRIDES)
    run.run_all()
    (tmp_path / "test" / "report" / "notes.txt").write_text("copied in by hand")
    manifest = write_run_manifest(open_store(str(tmp_path)), "test")
    assert "test/report/notes.txt" not in manifest["artifacts"] and "test/report/summary.json" in manifest["artifacts"]
    code, out = verify("test", "--store", tmp_path)
    assert code == 0 and "notes.txt" in out, out
