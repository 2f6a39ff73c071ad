"""One writer per run (issue 21, parts 2 and 3): `--fresh` deletes only what fedpipe wrote, two writers
of one run cannot both proceed, a stale owner can be taken over, checkpoint GC keeps what a
checkpoint may still need, and keys are matched whole."""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from fedpipe.errors import CorruptArtifactError, StoreError
from fedpipe.run import record
from fedpipe.run.layout import RunLayout
from fedpipe.run.record import RunOwner
from fedpipe.store import LocalStore, Store, open_store
from tests.runs import small_run

N = 6  # racers of each kind
RUN = RunLayout("race")


# --- --fresh ----------------------------------------------------------------------------------------


def foreign_files(folder: Path) -> dict[str, bytes]:
    """A source tree that a misconfigured store (run.store=., run.id=src) would point at."""
    files = {"main.py": b"print('hello')\n", ".git/HEAD": b"ref: refs/heads/main\n"}
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return files


def test_fresh_deletes_only_what_fedpipe_wrote_and_names_the_rest(tmp_path: Path, caplog):
    run = small_run(tmp_path, run_id="src")
    run.partition()
    run.store.put(run.layout.phase("federation").round(2), b"checkpoint")
    ours = run.store.list("src/")
    assert run.layout.run_record in ours and run.layout.partition_manifest in ours
    files = foreign_files(tmp_path / "src")

    with caplog.at_level(logging.WARNING, logger="fedpipe.run.run"):
        run.fresh()

    for name, data in files.items():  # the source tree survives, byte for byte
        assert (tmp_path / "src" / name).read_bytes() == data
    assert sorted(run.store.list("src/")) == ["src/.git/HEAD", "src/main.py"]  # every fedpipe key is gone
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "src/main.py" in warnings[0] and "src/.git/HEAD" in warnings[0]


@pytest.mark.parametrize("run_json", [None, b'{"name": "my-web-app", "version": 2}', b"not json"])
def test_fresh_refuses_a_prefix_without_a_fedpipe_run_record(tmp_path: Path, run_json: bytes | None):
    run = small_run(tmp_path, run_id="src")
    files = foreign_files(tmp_path / "src")
    if run_json is not None:
        (tmp_path / "src" / "run.json").write_bytes(run_json)  # another tool's file of the same name
        files["run.json"] = run_json
    with pytest.raises(StoreError, match="Refusing --fresh.*nothing was deleted"):
        run.fresh()
    for name, data in files.items():
        assert (tmp_path / "src" / name).read_bytes() == data


def test_fresh_refuses_a_fedpipe_record_of_another_run(tmp_path: Path):
    other = small_run(tmp_path, run_id="other")
    other.partition()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "main.py").write_text("x")
    other.store.put(RunLayout("src").run_record, other.store.get(other.layout.run_record))  # a copied record
    with pytest.raises(StoreError, match="records run 'other', not 'src'"):
        small_run(tmp_path, run_id="src").fresh()
    assert (tmp_path / "src" / "main.py").read_text() == "x"


def test_layout_owns_only_the_keys_it_names():
    layout = RunLayout("r")
    for key in ["r/run.json", "r/owner.json", "r/manifest.json", "r/partition/manifest.json", "r/phases/p/final.pt",
                "r/phases/p/round-00003.pt", "r/phases/p/engine.json", "r/report/accuracy.png",
                f"r/phases/p/clients/c00001-r00002-{'a' * 16}.pt"]:
        assert layout.owns(key), key
    for key in ["r/main.py", "r/.git/HEAD", "r/phases/p/old-round-00003.pt", "r/phases/p/round-00003.pt.bak",
                "rr/run.json", "r/partition/notes.txt", "r/report/sub/x.png", "run.json"]:
        assert not layout.owns(key), key


def test_keys_are_matched_whole_not_by_a_pattern_inside_them():
    phase = RunLayout("r").phase("p")
    assert phase.round_of("r/phases/p/round-00003.pt") == 3
    assert phase.round_of("r/phases/p/old-round-00003.pt") is None  # unanchored, this was a checkpoint
    assert phase.round_of("r/phases/q/round-00003.pt") is None  # another phase's
    digest = "0123456789abcdef"
    assert phase.client_state_of(f"r/phases/p/clients/c00001-r00002-{digest}.pt") == (1, 2, digest)
    assert phase.client_state_of(f"r/phases/p/clients/backup-c00001-r00002-{digest}.pt") is None
    assert phase.client_state_of(f"r/phases/p/c00001-r00002-{digest}.pt") is None


# --- two writers --------------------------------------------------------------------------------------


def _claim(store: Store, token: str | None) -> tuple[str, str]:
    """(this racer's token, "won" or the refusal's message)."""
    owner = RunOwner(store, RUN, token)
    try:
        owner.claim()
    except StoreError as exc:
        return owner.token, str(exc)
    return owner.token, "won"


def _process_racer(url: str, i: int, barrier, results) -> None:
    store = open_store(url)
    barrier.wait()
    token, outcome = _claim(store, f"process-{i}")
    barrier.wait()  # every racer has claimed: no winner exits first (a dead owner on this host is taken over)
    # every racer also writes one shared key while the others do (a torn write fails its hash)
    for n in range(10):
        store.put("race/shared.bin", f"{i}-{n}-".encode() * 5000)
    results.put((token, outcome))


def race(url: str) -> list[tuple[str, str]]:
    """N processes and N threads claim run "race" of the store at `url` at once."""
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(2 * N), ctx.Queue()
    outcomes: list[tuple[str, str]] = []
    thread_barrier = threading.Barrier(N)

    def thread_racer(i: int) -> None:
        store = open_store(url)
        barrier.wait()
        thread_barrier.wait()
        outcomes.append(_claim(store, None))  # the default token: host, pid and thread
        barrier.wait()
        for n in range(10):
            store.put("race/shared.bin", f"t{i}-{n}-".encode() * 5000)

    procs = [ctx.Process(target=_process_racer, args=(url, i, barrier, results)) for i in range(N)]
    threads = [threading.Thread(target=thread_racer, args=(i,)) for i in range(N)]
    for t in [*procs, *threads]:
        t.start()
    for t in [*procs, *threads]:
        t.join(120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    outcomes += [results.get(timeout=10) for _ in procs]
    return outcomes


def check_race(url: str) -> None:
    outcomes = race(url)
    assert len(outcomes) == 2 * N
    winners = [token for token, outcome in outcomes if outcome == "won"]
    assert len(winners) == 1, outcomes  # exactly one writer proceeds
    for token, outcome in outcomes:
        if token != winners[0]:
            assert f"being written by {winners[0]!r}" in outcome, outcome  # the others are told who
    store = open_store(url)
    for key in store.list(""):
        store.get(key)  # 0 objects failing their hash
    assert store.list("") == ["race/owner.json", "race/shared.bin"]


@pytest.fixture
def own_tokens(monkeypatch):
    """Each racer is its own writer: no owner token from the environment (FEDPIPE_OWNER, KFP_RUN_ID)."""
    monkeypatch.delenv("FEDPIPE_OWNER", raising=False)
    monkeypatch.delenv("KFP_RUN_ID", raising=False)


def test_two_writers_race_on_a_folder_store(tmp_path: Path, own_tokens):
    check_race(str(tmp_path / "store"))


@pytest.mark.services
def test_two_writers_race_on_the_s3_server(s3_env: str, own_tokens):
    check_race(f"s3://fedpipe-race-{uuid.uuid4().hex[:12]}/prefix")


def test_folder_conditional_writes(tmp_path: Path):
    store = LocalStore(tmp_path)
    assert store.create("a/k", b"first") is True
    assert store.create("a/k", b"second") is False
    assert store.replace_if("a/k", b"third", "0" * 64) is False
    assert store.replace_if("a/k", b"third", record.sha256_hex(b"first")) is True
    assert store.get("a/k") == b"third"


def test_a_second_run_writer_stops_with_the_owners_name_and_the_same_owner_resumes(tmp_path: Path):
    first = small_run(tmp_path, run_id="shared")
    first.owner.token = "kfp-run-1234"
    with first.owner:
        second = small_run(tmp_path, run_id="shared")
        second.owner.token = "laptop:pid99"
        with pytest.raises(StoreError, match="being written by 'kfp-run-1234'"):
            second.partition()
        assert not second.store.exists(second.layout.run_record)  # it wrote nothing
        retried = small_run(tmp_path, run_id="shared")  # a retried KFP task: the same job id
        retried.owner.token = "kfp-run-1234"
        retried.partition()
        assert retried.store.exists(retried.layout.partition_manifest)
    assert not first.store.exists(first.layout.owner)  # released once the outermost step ended
    second.partition()  # and then the other writer may go on


def test_owner_token_is_the_kfp_run_when_set(monkeypatch):
    monkeypatch.delenv(record.ENV_OWNER, raising=False)
    monkeypatch.setenv(record.ENV_KFP_RUN, "run-abc")
    assert record.owner_token() == "run-abc"
    monkeypatch.setenv(record.ENV_OWNER, "me")
    assert record.owner_token() == "me"


# --- take-over ----------------------------------------------------------------------------------------


def test_a_stale_owner_is_taken_over_only_when_asked(tmp_path: Path):
    store = LocalStore(tmp_path)
    now = [1000.0]
    dead = RunOwner(store, RUN, "crashed-pod", stale_seconds=60, clock=lambda: now[0])
    dead.claim()
    now[0] += 30  # heartbeat 30 s old: alive
    late = RunOwner(store, RUN, "new-pod", stale_seconds=60, clock=lambda: now[0])
    with pytest.raises(StoreError, match="'crashed-pod'.*looks alive: --take-over refused"):
        late.claim(take_over=True)
    now[0] += 60  # 90 s: stale
    with pytest.raises(StoreError, match="being written by 'crashed-pod'.*pass --take-over"):
        late.claim()  # not without asking
    late.claim(take_over=True)
    assert late.current()[0]["owner"] == "new-pod"
    with pytest.raises(StoreError, match="now owned by 'new-pod'"):
        dead.beat()  # the old writer, should it wake up, stops at its next checkpoint
    late.beat()
    late.release()
    assert not store.exists(RUN.owner)


def test_an_owner_whose_process_is_gone_on_this_host_is_taken_over(tmp_path: Path):
    store = LocalStore(tmp_path)
    proc = multiprocessing.get_context("fork").Process(target=_claim, args=(store, "gone"))
    proc.start()
    proc.join()
    assert RunOwner(store, RUN).current()[0]["owner"] == "gone"
    assert _claim(store, "next")[1] == "won"


def test_a_writer_taken_over_stops_before_its_next_checkpoint(tmp_path: Path):
    from fedpipe.engine.state import Checkpoints

    store = LocalStore(tmp_path)
    now = [0.0]
    old = RunOwner(store, RUN, "old", stale_seconds=10, clock=lambda: now[0])
    old.claim()
    now[0] = 100.0
    RunOwner(store, RUN, "new", stale_seconds=10, clock=lambda: now[0]).claim(take_over=True)
    ckpt = Checkpoints(store, RUN.phase("p"), guard=old.beat)
    with pytest.raises(StoreError, match="now owned by 'new'"):
        ckpt.save_final(_state(3))
    assert not store.exists(RUN.phase("p").final)


# --- checkpoint GC --------------------------------------------------------------------------------


def _state(round_: int):
    from fedpipe.algorithms.base import ServerState
    from fedpipe.engine.state import PhaseState

    return PhaseState("fedavg", "p", round_, ServerState({"w": torch.zeros(2)}), {})


def test_gc_keeps_client_states_younger_than_the_newest_checkpoint_and_foreign_files(tmp_path: Path):
    from fedpipe.engine.state import Checkpoints

    store = LocalStore(tmp_path)
    phase = RUN.phase("p")
    younger = phase.client_state(7, 5, "ab" * 8)  # written during round 5, its checkpoint not yet saved
    older = phase.client_state(7, 2, "cd" * 8)  # no checkpoint refers to it
    foreign = phase.clients + "README.txt"
    for key in (younger, older, foreign):
        store.put(key, b"x")
    ckpt = Checkpoints(store, phase)
    ckpt.save_round(_state(4), keep=2)
    ckpt.close()  # the collection runs on the writer thread, after the checkpoint
    assert store.exists(younger) and store.exists(foreign)
    assert not store.exists(older)


# --- folder store writes ------------------------------------------------------------------------------


def test_a_reader_never_sees_bytes_paired_with_another_writers_hash(tmp_path: Path):
    store = LocalStore(tmp_path)
    store.put("k", b"0" * 100_000)
    stop = time.monotonic() + 2
    bad: list[str] = []

    def write(i: int) -> None:
        n = 0
        while time.monotonic() < stop:
            store.put("k", f"{i}-{n}".encode() * 20_000)
            n += 1

    def read() -> None:
        while time.monotonic() < stop:
            try:
                store.get("k")
            except CorruptArtifactError as exc:
                bad.append(str(exc))

    threads = [threading.Thread(target=write, args=(i,)) for i in range(3)] + [threading.Thread(target=read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []
    store.get("k")
