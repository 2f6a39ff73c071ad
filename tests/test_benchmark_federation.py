"""benchmarks/federation.py without Flower processes: Flower's app trains the same model fedpipe does, its run config
carries every value the benchmark sets, and the table reads rows as the benchmark writes them."""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from pathlib import Path

import torch

from fedpipe.nn.networks import build_model

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "benchmarks" / "flower_fedavg"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bench = _load("bench_federation", ROOT / "benchmarks" / "federation.py")
task = _load("flower_fedavg_task", APP / "flower_fedavg" / "task.py")  # torch and safetensors only, no flwr


def test_flower_app_model_is_fedpipes_twonn():
    ours = build_model("twonn", (1, 28, 28), 10).state_dict()
    theirs = task.TwoNN(784, 10).state_dict()
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    assert bench.model_size() == 4 * sum(v.numel() for v in ours.values()) == 796_840


def test_flower_local_training_moves_the_model():
    torch.manual_seed(0)
    model = task.TwoNN(784, 10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rc = {"lr": 0.01, "lr-decay": 0.999, "momentum": 0.9, "weight-decay": 1e-4, "batch-size": 20, "local-epochs": 1}
    loss = task.train(model, torch.randn(50, 1, 28, 28), torch.randint(0, 10, (50,)), rc, 1, 0)
    assert loss > 0 and any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_run_config_keys_are_the_apps(tmp_path):
    """`flwr run --run-config` may only override keys the app's pyproject.toml declares."""
    declared = tomllib.loads((APP / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    cfg = bench.config(4, 2, tmp_path / "store")

    class Spec:
        input_shape, num_classes, num_sites = [1, 28, 28], 10, 4

    rc = bench.flower_config(cfg, Spec, tmp_path / "out", True, 60)
    assert set(rc) == set(declared)
    assert (rc["lr"], rc["batch-size"], rc["local-epochs"], rc["input-size"]) == (cfg.train.lr, 20, 1, 784)
    assert bench.toml_value(True) == "true" and bench.toml_value("a b") == '"a b"' and bench.toml_value(3) == "3"


def test_table_rows_and_unavailable_row():
    rounds = [{"round": r, "seconds": s, "bytes_up": 4 * 796_840, "bytes_down": 4 * 796_840, "loss": 0.5} for r, s in ((1, 9.0), (2, 2.0), (3, 4.0))]
    ok = bench.summarize("simulation", 4, False, rounds, 20.0, "")
    assert ok["first_round_s"] == 9.0 and ok["median_later_s"] == 3.0 and ok["bytes_up_total"] == 3 * 4 * 796_840
    missing = bench.summarize("federation", 4, True, [], 1.0, "not available: NotImplementedError: not yet")
    text = bench.table([ok, missing], bench.model_size())
    lines = text.splitlines()
    assert len(lines) == 4 and len({line.count("|") for line in lines}) == 1  # every row has every column
    assert "| 1.000 |" in lines[2] and "not available: NotImplementedError" in lines[3]
