"""Clients' states within a memory budget: spilled to the store and back bitwise, LRU within the
budget, checkpoints that refer to spilled states resume bitwise, damage is reported, and garbage
collection keeps what a kept checkpoint refers to."""

from __future__ import annotations

import pytest
import torch
from runs import CrashAfterRound, assert_same_params, small_run, train_all

from fedpipe.algorithms.base import ServerState
from fedpipe.engine.client_states import ClientStates, params_bytes
from fedpipe.engine.state import Checkpoints, PhaseState
from fedpipe.errors import CorruptArtifactError
from fedpipe.run.layout import RunLayout
from fedpipe.run.run import Run
from fedpipe.store import LocalStore

PHASE = RunLayout("run").phase("p")  # run/phases/p/


def state_of(seed: int) -> dict[str, torch.Tensor]:
    """A state with awkward tensors: several dtypes, NaN and -0.0, a 0-d and an empty tensor, a
    transposed view and a slice of a bigger storage."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(6, 5, generator=g)
    w[0, 0], w[0, 1] = float("nan"), -0.0
    base = torch.randn(100_000, generator=g)
    return {
        "w": w,
        "w_t": w.t(),
        "slice": base[10:20],
        "f64": torch.randn(3, generator=g, dtype=torch.float64),
        "f16": torch.randn(4, generator=g).half(),
        "bf16": torch.randn(4, generator=g).bfloat16(),
        "i64": torch.randint(-5, 5, (7,), generator=g),
        "mask": torch.rand(5, generator=g) > 0.5,
        "scalar": torch.tensor(seed / 7),
        "empty": torch.empty(0, 3),
    }


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), f"{name} differs bitwise"
        if not x.is_floating_point() or not x.isnan().any():
            assert torch.equal(x, y), name


def make_states(tmp_path, budget_states: float) -> ClientStates:
    return ClientStates(LocalStore(tmp_path), PHASE, int(budget_states * params_bytes(state_of(0))))


def test_spilled_and_restored_state_is_bitwise_identical(tmp_path):
    states = make_states(tmp_path, 1)
    originals = {cid: state_of(cid) for cid in range(4)}
    for cid, s in originals.items():
        states[cid] = s
    assert states.stats["spilled"] == 3 and states.stats["writes"] == 3
    for cid in range(4):
        assert_bitwise(states[cid], originals[cid])  # every one read back (reading 0 spilled 3)
    assert states.stats["reads"] == 4 and states.stats["writes"] == 4
    # a view is written as its own elements, not its base storage (400 kB)
    sizes = [p.stat().st_size for p in (tmp_path / "run/phases/p/clients").glob("*.pt")]
    assert max(sizes) < 20_000


def test_lru_keeps_the_recent_states_within_the_budget(tmp_path):
    states = make_states(tmp_path, 3.5)
    for cid in range(10):
        states[cid] = state_of(cid)
        assert states.stats["resident_bytes"] <= states.budget_bytes
    assert list(states._resident) == [7, 8, 9] and len(states) == 10 and states.stats["spilled"] == 7
    states.get(2)  # used again: back in memory, and the least recently used (7) goes
    assert list(states._resident) == [8, 9, 2]
    assert 0 in states and 42 not in states and states.get(42) is None
    assert states.stats["reads"] == 1  # `in` and a miss read nothing
    assert list(states) == list(range(10)) and set(states.keys()) == set(range(10))
    before = states.stats["writes"]
    for cid in (3, 8, 4, 9):  # evict 8 and 9 (never written: written now), then 2 and 3 (read back, unchanged)
        states.get(cid)
    assert list(states._resident) == [8, 4, 9] and states.stats["writes"] == before + 2
    del states[4]
    assert 4 not in states and len(states) == 9 and list(states._resident) == [8, 9]
    huge = {"w": torch.zeros(10 * states.budget_bytes // 4)}
    states[99] = huge  # bigger than the whole budget: it stays, alone
    assert list(states._resident) == [99] and states[99] is not None


def test_damaged_or_missing_spilled_state_is_a_corrupt_artifact(tmp_path):
    store = LocalStore(tmp_path)
    states = make_states(tmp_path, 1)
    for cid in range(3):
        states[cid] = state_of(cid)
    key0, key1 = states._entries[0].key, states._entries[1].key
    path = tmp_path / key0
    path.write_bytes(path.read_bytes()[:-10] + b"0123456789")  # changed behind the store's back
    with pytest.raises(CorruptArtifactError, match="client 0.*damaged"):
        states[0]
    store.put(key1, b"something else")  # hash file rewritten too: the name's hash still catches it
    with pytest.raises(CorruptArtifactError, match="client 1.*do not match the hash in its name"):
        states[1]
    store.delete(key0)
    with pytest.raises(CorruptArtifactError, match="client 0.*missing from the store.*--fresh"):
        states[0]


def test_a_state_is_read_only_as_its_own_clients_and_earlier_versions_states_still_are(tmp_path):
    """Objects are safetensors bytes naming their client; one of another client stored under this client's
    name (its hash made to match) is refused, and so are bytes of neither format. A state that fedpipe's
    earlier versions wrote with torch.save (format 1) still reads back, so their checkpoints resume."""
    import hashlib
    import io

    store = LocalStore(tmp_path)
    states = make_states(tmp_path, 1)
    states[0], states[1] = state_of(0), state_of(1)  # 0 spilled by 1
    key0 = states._entries[0].key
    assert (tmp_path / key0).read_bytes()[8:9] == b"{"  # a safetensors header, no pickle

    def read_as(client: int, data: bytes) -> dict[str, torch.Tensor]:
        """`data` stored under `client`'s name with its hash, read back as that client's state."""
        digest = hashlib.sha256(data).hexdigest()[:16]
        store.put(PHASE.client_state(client, 0, digest), data)
        return load_state(store, PHASE.client_state(client, 0, digest), client, digest)

    from fedpipe.engine.client_states import load_state, serialize
    with pytest.raises(CorruptArtifactError, match="client 5.*holds client '0'"):
        read_as(5, serialize(0, state_of(0)))
    for junk in (b"", b"\x05" * 8 + b"{}", b"\x02\x00\x00\x00\x00\x00\x00\x00{}", b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"[" * 16):
        with pytest.raises(CorruptArtifactError, match="client 2.*not a readable fedpipe client state"):
            read_as(2, junk)
    buf = io.BytesIO()
    torch.save({"format": 1, "client": 3, "params": state_of(3)}, buf)  # as fedpipe wrote it before
    assert_bitwise(read_as(3, buf.getvalue()), state_of(3))
    assert_bitwise(read_as(4, serialize(4, state_of(4))), state_of(4))


def phase_state(states: ClientStates, round_: int) -> PhaseState:
    return PhaseState("superfed_mm", "p", round_, ServerState({"g": torch.ones(2) * round_}), states)


def test_garbage_collection_keeps_what_kept_checkpoints_refer_to(tmp_path):
    store = LocalStore(tmp_path)
    ckpt = Checkpoints(store, PHASE, state_memory_mb=1.5 * params_bytes(state_of(0)) / 2**20)
    state = phase_state(ckpt.client_states({}, "cpu"), 0)
    current, history = {}, {}
    for round_, changed in [(1, [0, 1, 2, 3]), (2, [0, 1]), (3, [0]), (4, [1])]:
        for cid in changed:
            state.clients[cid] = current[cid] = state_of(100 * round_ + cid)
        state.round = round_
        ckpt.save_round(state, keep=2)
        history[round_] = dict(current)
    ckpt.close()  # round 4's checkpoint was written in the background
    # rounds 3 and 4 are kept; each object is named by its client and the round that produced it
    names = {k.rsplit("/", 1)[1][:13] for k in store.list("run/phases/p/clients/")}
    assert names == {"c00000-r00003", "c00001-r00002", "c00001-r00004", "c00002-r00001", "c00003-r00001"}
    # the newest checkpoint damaged: round 3's comes back whole, through an object round 4 no longer uses
    (tmp_path / "run/phases/p/round-00004.pt").write_bytes(b"broken")
    back = Checkpoints(store, PHASE, state_memory_mb=1).latest_good("cpu")
    assert back.round == 3
    for cid in range(4):
        assert_bitwise(back.clients[cid], history[3][cid])
    # the final state keeps only what it refers to
    ckpt.save_final(state)
    assert len(store.list("run/phases/p/clients/")) == 4 and not ckpt.round_keys()
    final = Checkpoints(store, PHASE).load_final("cpu")
    for cid in range(4):
        assert_bitwise(final.clients[cid], history[4][cid])


def test_checkpoint_missing_a_spilled_state_is_skipped(tmp_path, caplog):
    store = LocalStore(tmp_path)
    ckpt = Checkpoints(store, PHASE, state_memory_mb=1.5 * params_bytes(state_of(0)) / 2**20)
    state = phase_state(ckpt.client_states({}, "cpu"), 0)
    for round_ in (1, 2):
        state.clients[round_] = state_of(round_)
        state.clients[10 + round_] = state_of(10 + round_)
        state.round = round_
        ckpt.save_round(state, keep=2)
    ckpt.close()
    newest = max(state.clients.referenced_keys(), key=lambda k: k.split("-r")[1])
    store.delete(newest)
    assert Checkpoints(store, PHASE).latest_good("cpu").round == 1
    assert "Skipping damaged checkpoint of round 2" in caplog.text and "not in the store" in caplog.text


def test_small_states_stay_inside_the_checkpoint(tmp_path):
    store = LocalStore(tmp_path)
    ckpt = Checkpoints(store, PHASE)
    state = phase_state(ckpt.client_states({0: state_of(0), 1: state_of(1)}, "cpu"), 1)
    ckpt.save_final(state)
    assert store.list("run/phases/p/clients/") == []
    loaded = PhaseState.from_bytes(store.get(ckpt.final_key))  # self-contained: readable without the store
    assert_bitwise(loaded.clients[1], state_of(1))


# --- through the run -----------------------------------------------------------------------------

SPILLING = ("data.dataset=digits", "method.name=superfed_mm", "method.start_fraction=0.34", "train.rounds=3",
            "partition.num_clients=6", "engine.state_memory_mb=0.5")  # 2 of digits' twonn local models fit


@pytest.fixture(autouse=True)
def _no_plots(monkeypatch):
    monkeypatch.setattr(Run, "_put_plot", lambda self, name, draw: None)  # matplotlib is no part of this


def test_a_checkpoint_with_spilled_states_resumes_bitwise_equal(tmp_path):
    expected = train_all(small_run(tmp_path / "clean", *SPILLING))
    assert expected.clients.stats["spilled"] > 0 and len(expected.clients) == 6
    run = small_run(tmp_path / "crashed", *SPILLING)
    run.partition()
    run.train("federation")
    with pytest.raises(SystemExit):
        run.train("personalization", telemetry_sinks=[CrashAfterRound(2)])
    checkpoint = run.store.get("test/phases/personalization/round-00002.pt")
    assert b"client_refs" in checkpoint  # the crash left a checkpoint that refers to spilled states
    resumed = train_all(run)
    assert_same_params(resumed.server.global_params, expected.server.global_params)
    assert resumed.clients.keys() == expected.clients.keys()
    for cid in expected.clients:
        assert_bitwise(resumed.clients[cid], expected.clients[cid])


def test_checkpoints_written_in_the_background_resume_as_those_written_at_once(tmp_path, monkeypatch):
    """What a GPU run does (`Checkpoints(background=True)`), on the CPU: the same spilled states and
    checkpoints, and a crash after a round still resumes bitwise to the uninterrupted run's weights."""
    expected = train_all(small_run(tmp_path / "clean", *SPILLING))
    made = []
    plain = Run.checkpoints

    def background(self, phase):
        ckpt = plain(self, phase)
        made.append(ckpt)
        return Checkpoints(ckpt.store.inner, ckpt.layout, self.cfg.engine.state_memory_mb, ckpt.guard, background=True)

    monkeypatch.setattr(Run, "checkpoints", background)
    run = small_run(tmp_path / "crashed", *SPILLING)
    run.partition()
    run.train("federation")
    with pytest.raises(SystemExit):
        run.train("personalization", telemetry_sinks=[CrashAfterRound(2)])
    assert b"client_refs" in run.store.get("test/phases/personalization/round-00002.pt")  # landed before the crash
    resumed = train_all(run)
    assert made and all(not c.store.background for c in made)  # the CPU run's own choice
    assert_same_params(resumed.server.global_params, expected.server.global_params)
    for cid in expected.clients:
        assert_bitwise(resumed.clients[cid], expected.clients[cid])


def test_three_hundred_clients_sharing_samples_within_a_tiny_budget(tmp_path):
    run = small_run(tmp_path, "data.dataset=digits", "method.name=superfed_mm", "partition.scheme=with_replacement",
                    "partition.num_clients=300", "partition.samples_per_client=10", "train.client_fraction=0.05",
                    "method.start_fraction=0.34", "eval.every=0", "engine.state_memory_mb=0.5")
    run.partition()
    states = [run.train(p.name).clients.stats for p in run.phases()]
    kept = states[-1]["clients"]  # 15 clients in each of the 2 personalization rounds
    assert 15 < kept <= 30 and states[-1]["spilled"] >= kept - 2 and states[-1]["resident_bytes"] <= 2**19
    summary = run.evaluate()
    assert summary["num_clients"] == 300 and 0 <= summary["personalized_accuracy"]["mean"] <= 1
    final = run.store.get("test/phases/personalization/final.pt")
    assert len(final) < 2**19  # references, not 30 local models
    assert len(run.store.list("test/phases/personalization/clients/")) == kept
