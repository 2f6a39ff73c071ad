"""Bad input ends with one clear paragraph, a non-zero exit, and no artifact written."""

import time

import pytest
from runs import SMALL, small_run
from typer.testing import CliRunner

from fedpipe.cli import app
from fedpipe.errors import ConfigError, CorruptArtifactError
from fedpipe.run.config import load_config


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


# --- files a user hands fedpipe: read within bounds, every problem one paragraph naming the file ---------

ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 10)}]\n" for a, b in zip("abcdefghi", "bcdefghij"))  # 10^10 values once expanded


@pytest.mark.parametrize(
    "content, expected",
    [
        (ALIAS_BOMB.encode(), ["aliases expand to more than", "line "]),
        (b"a: &a [1, *a]\n", ["*a", "contains it"]),
        (b"train:\n  rounds: 3\n  optimizer: \xff\xfe sgd\n", ["not UTF-8", "byte offset 32"]),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", ["binary", "NUL byte at byte offset 8"]),
        (b"x: [" + b"1, " * 40_000 + b"1]\n", ["KiB, more than the 64 KiB a config can be"]),
        (b"x: " + b"[" * 500 + b"]" * 500 + b"\n", ["nests deeper than 32 levels"]),
        (b"run:\n  seed: " + b"7" * 5_000 + b"\n", ["holds a value YAML cannot represent"]),
        (b"data:\n  dataset: 2001-13-01\n", ["holds a value YAML cannot represent", "month"]),
    ],
    ids=["alias-bomb", "recursive-alias", "not-utf8", "binary", "too-big", "deep-nesting", "huge-integer", "impossible-date"],
)
def test_a_hostile_config_file_is_refused_quickly_naming_the_file(tmp_path, content, expected):
    config = tmp_path / "config.yaml"
    config.write_bytes(content)
    start = time.perf_counter()
    with pytest.raises(ConfigError):
        load_config(config)
    assert time.perf_counter() - start < 1.0, "reading a config must take well under a second"
    code, out = invoke("run", "--config", config, f"--set=run.store={tmp_path / 'store'}")
    assert code == 2 and out.startswith("error: ") and "Traceback" not in out, out
    assert str(config) in out, out
    for word in expected:
        assert word in out, f"{word!r} missing from: {out}"
    assert not (tmp_path / "store").exists()


def test_a_set_value_is_parsed_within_the_same_bounds(tmp_path):
    code, out = invoke("run", f"--set=run.store={tmp_path / 'store'}", "--set=partition.label_families={" + ", ".join(ALIAS_BOMB.splitlines()) + "}")
    assert code == 2 and "--set partition.label_families" in out and "Traceback" not in out, out
    # text that is not YAML (or not constructible) stays text, and the field says what it wants
    code, out = invoke("run", f"--set=run.store={tmp_path / 'store'}", "--set=data.dataset=2001-13-01")
    assert code == 2 and "data.dataset" in out and "2001-13-01" in out and "Traceback" not in out, out


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda data: b"\xff" + data, ["not UTF-8", "byte offset 0"]),
        (lambda data: b"[" * 2_000 + b"]" * 2_000, ["nests deeper than"]),
        (lambda data: data + b" " * (4 << 20), ["more than the", "can be"])  # past both caps for a digits run,
    ],
    ids=["not-utf8", "deep-nesting", "too-big"],
)
@pytest.mark.parametrize("artifact", ["run.json", "partition/manifest.json"])
def test_a_damaged_run_record_or_manifest_is_named_and_refused(tmp_path, artifact, damage, expected):
    """The run record and the manifest are checked by their sha256, but a user or another tool can
    rewrite one together with its hash file: they are read within bounds too."""
    from fedpipe.store import LocalStore

    store_dir = tmp_path / "store"
    run = small_run(store_dir, "method.name=fedavg", "data.dataset=digits")
    run.partition()
    key = f"test/{artifact}"
    store = LocalStore(store_dir)
    data = damage(store.get(key))
    store.put(key, data)  # consistent hash: only the content is wrong
    start = time.perf_counter()
    with pytest.raises(CorruptArtifactError) as e:
        small_run(store_dir, "method.name=fedavg", "data.dataset=digits").load_partition() if "manifest" in artifact else \
            small_run(store_dir, "method.name=fedavg", "data.dataset=digits").check_record(create=False)
    assert time.perf_counter() - start < 1.0
    message = str(e.value)
    assert str(store_dir / "test" / artifact) in message and "--fresh" in message, message
    for word in expected:
        assert word in message, message
