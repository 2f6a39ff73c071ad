"""Bad input ends with one clear paragraph, a non-zero exit, and no artifact written."""

import pytest
from runs import SMALL, small_run
from typer.testing import CliRunner

from fedpipe.cli import app


def invoke(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def run_args(store, *overrides):
    return ["run", *[f"--set={s}" for s in [*SMALL, f"run.store={store}", *overrides]]]


def files_under(path):
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.exists() else []


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["method.name=fedsomething"], ["method", "fedsomething", "'fedavg'", "'superfed_mm'"]),
        (["train.lr=-0.1"], ["train.lr", "greater than 0"]),
        (["partition.scheme=classes_per_client", "partition.classes_per_client=12"], ["classes_per_client", "12", "10 classes"]),
        (["data.dataset=cifar10"], ["cifar10", "cifar-10-batches-py", "data.download", "FEDPIPE_DATA"]),
        (["train.rounds=ten"], ["train.rounds", "integer"]),
        (["partition.alpha=0.3"], ["partition", "alpha", "unknown field"]),
    ],
    ids=["unknown-method", "negative-rate", "unsatisfiable-split", "missing-dataset", "not-a-number", "unknown-field"],
)
def test_bad_input_is_one_clear_paragraph_and_writes_nothing(tmp_path, monkeypatch, overrides, expected):
    monkeypatch.setenv("FEDPIPE_DATA", str(tmp_path / "no-data-here"))
    store = tmp_path / "store"
    code, out = invoke(*run_args(store, *overrides))
    assert code == 2, out
    assert out.startswith("error: ") and "Traceback" not in out
    for word in expected:
        assert word in out, f"{word!r} missing from: {out}"
    assert files_under(store) == [] and not store.exists()


def test_corrupted_phase_state_is_named_and_nothing_is_written(tmp_path):
    store = tmp_path / "store"
    run = small_run(store, "method.name=superfed_mm", "method.start_fraction=0.5", "train.rounds=2")
    run.partition()
    run.train("federation")
    state = store / "test" / "phases" / "federation" / "final.pt"
    data = bytearray(state.read_bytes())
    data[100] ^= 0x01  # a single flipped bit
    state.write_bytes(bytes(data))
    before = files_under(store)

    args = [f"--set={s}" for s in [*SMALL, f"run.store={store}", "run.id=test", "method.name=superfed_mm",
                                   "method.start_fraction=0.5", "train.rounds=2"]]
    code, out = invoke("train", "--phase", "personalization", *args)
    assert code == 2, out
    assert "error: " in out and str(state) in out and "corrupt" in out and "Traceback" not in out
    assert files_under(store) == before


def test_config_of_another_run_is_refused(tmp_path):
    store = tmp_path / "store"
    small_run(store, "method.name=fedavg").partition()
    code, out = invoke(*run_args(store, "run.id=test", "method.name=fedavg", "train.rounds=5"))
    assert code == 2 and "different configuration" in out and "train.rounds: 3 -> 5" in out and "--fresh" in out
