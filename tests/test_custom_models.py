"""Models named by import path (`model.name: package.module:function`, fedpipe/nn/imported.py) and the
bundled table model (tabular_mlp): built, checked on one batch, refused with a plain message when unsafe
or unfit, trained by every method, and run by the pipeline in kfp's local runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from pydantic import TypeAdapter
from runs import SMALL, small_run

from fedpipe.algorithms import ALGORITHMS, MethodConfig, build_algorithm, phases_of
from fedpipe.algorithms.base import ServerState
from fedpipe.config import EngineConfig, TrainConfig
from fedpipe.data.federated import ClientData, FederatedData, Split
from fedpipe.engine.clients import ClientTrainer
from fedpipe.engine.evaluation import eval_mode, evaluate_personalized
from fedpipe.engine.rounds import run_phase
from fedpipe.engine.state import PhaseState
from fedpipe.errors import ConfigError
from fedpipe.nn import imported
from fedpipe.nn.networks import MODELS, TabularMLP, auto_model_name, build_model
from fedpipe.run.config import load_config

# --- a package of the user's, written into a temporary folder ------------------------------------------

NETS = '''
import torch
from torch import nn

from os import system  # a re-exported function of another package: never callable as a model


class SmallCNN(nn.Module):
    """conv 8 3x3, pool, then body and head: the layout the bundled models have."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        c, h, w = input_shape
        self.features = nn.Sequential(nn.Conv2d(c, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
        self.body = nn.Sequential(nn.Linear(8 * (h // 2) * (w // 2), 32), nn.ReLU())
        self.head = nn.Linear(32, num_classes)

    def forward(self, x):
        return self.head(self.body(self.features(x)))


def build(input_shape, num_classes):
    return SmallCNN(input_shape, num_classes)


def not_a_module(input_shape, num_classes):
    return "a string"


def wrong_output(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), num_classes + 1))


def crashes(input_shape, num_classes):
    raise RuntimeError("no GPU here")


def batch_norm(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), 16), nn.BatchNorm1d(16), nn.ReLU(),
                         nn.Linear(16, num_classes))


def batch_norm_without_statistics(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), 16),
                         nn.BatchNorm1d(16, track_running_stats=False), nn.ReLU(), nn.Linear(16, num_classes))


def frozen(input_shape, num_classes):
    model = nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), num_classes))
    model[1].bias.requires_grad_(False)
    return model


def prelu(input_shape, num_classes):
    """A trainable activation: SuPerFed has no rule to mix it."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), 16), nn.PReLU(), nn.Linear(16, num_classes))
    return model


def headless(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), num_classes))


class Bare(nn.Module):
    """A linear map held as a bare parameter: a layer type no method knows."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.weight = nn.Parameter(0.01 * torch.randn(int(torch.tensor(input_shape).prod()), num_classes))

    def forward(self, x):
        return x.flatten(1) @ self.weight


def bare(input_shape, num_classes):
    return Bare(input_shape, num_classes)


number = 3
'''


@pytest.fixture
def nets(tmp_path, monkeypatch) -> Path:
    """The package `mynets` (mynets/__init__.py and mynets/models.py) on sys.path; the folder holding it."""
    root = tmp_path / "site"
    (root / "mynets").mkdir(parents=True)
    (root / "mynets" / "__init__.py").write_text("from mynets.models import build  # re-exported inside its own package\n")
    (root / "mynets" / "models.py").write_text(textwrap.dedent(NETS))
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv(imported.PACKAGES_ENV, "mynets,nothere")  # what a derived image sets (nothere: not installed)
    yield root
    for name in [m for m in sys.modules if m == "mynets" or m.startswith("mynets.")]:
        del sys.modules[name]


IMAGES = (1, 8, 8)


def test_a_model_by_import_path_builds_and_is_checked_on_one_batch(nets):
    model = build_model("mynets.models:build", IMAGES, 10)
    assert type(model).__name__ == "SmallCNN" and model.input_shape == IMAGES and model.num_classes == 10
    assert build_model("mynets:build", IMAGES, 10).head.out_features == 10  # re-exported within its own package
    assert model.training  # the check left it as built
    # a norm layer without running statistics holds no buffers: accepted
    assert build_model("mynets.models:batch_norm_without_statistics", IMAGES, 3)[2].running_mean is None


def test_a_model_by_import_path_trains_under_fedavg_and_superfed(nets, tmp_path):
    digits = ["data.dataset=digits", "model.name=mynets.models:build", "partition.scheme=iid", "partition.num_clients=4",
              "train.rounds=3", "train.lr=0.05", "run.threads=1"]
    for method in ("fedavg", "superfed_mm"):
        run = small_run(tmp_path, f"method.name={method}", *digits, run_id=method)
        summary = run.run_all()
        assert summary["personalized_accuracy"]["mean"] > 0.4, (method, summary["personalized_accuracy"])  # chance: 0.1
        assert summary["global_model"]["top1"] > 0.4, method


@pytest.mark.parametrize("name, message", [
    ("nothere.models:build", r"module 'nothere.models' is not installed in this environment.*FROM ghcr.io/fedpipe/fedpipe.*pip install.*PYTHONPATH"),
    ("mynets.models:missing", r"has no attribute 'missing' \(its public functions and classes: .*SmallCNN, .*build"),
    ("os:system", r"Python's standard library"),
    ("mynets.models:system", r"'system' is a builtin_function_or_method, not a function or class"),
    ("mynets.models:number", r"'number' is a int, not a function or class"),
    ("mynets.models:not_a_module", r"returned a str .*not a torch nn.Module"),
    ("mynets.models:wrong_output", r"mynets.models:wrong_output.*inputs of shape \(N, 1, 8, 8\).*batch of 2 inputs of shape "
                                   r"\(1, 8, 8\).*shape \(2, 4\), not one of shape \(2, 3\)"),
    ("mynets.models:crashes", r"failed to build a model for input shape \(1, 8, 8\) and 3 classes: RuntimeError: no GPU here"),
    ("mynets.models:batch_norm", r"changes buffers in its forward pass \(2.running_mean, 2.running_var, 2.num_batches_tracked\)"),
    ("mynets.models:frozen", r"do not require gradients \(1.bias\)"),
    ("mynets._private:build", r"private parts \(_private\)"),
    ("torch.nn:Linear", r"a library fedpipe runs on"),
    ("fedpipe.nn.networks:TwoNN", r"a module of fedpipe itself"),
])
def test_unsafe_or_unfit_models_are_refused_with_a_plain_message(nets, name, message):
    with pytest.raises(ConfigError, match=message):
        build_model(name, IMAGES, 3)


def test_a_function_of_another_package_reexported_is_refused(nets):
    (nets / "mynets" / "tools.py").write_text("from shutil import rmtree\nfrom json import loads as build\n")
    for attribute in ("rmtree", "build"):
        with pytest.raises(ConfigError, match=rf"'{attribute}' is defined in module '(shutil|json)', outside package 'mynets'"):
            build_model(f"mynets.tools:{attribute}", IMAGES, 3)


def test_a_missing_dependency_of_the_package_is_named(nets):
    (nets / "mynets" / "needs.py").write_text("import some_library_not_installed\n\ndef build(s, c):\n    pass\n")
    with pytest.raises(ConfigError, match="imports 'some_library_not_installed', which is not installed"):
        build_model("mynets.needs:build", IMAGES, 3)


def test_the_allowed_packages_variable_limits_where_models_come_from(nets, monkeypatch):
    monkeypatch.setenv(imported.PACKAGES_ENV, "othernets, thirdnets")
    with pytest.raises(ConfigError, match=r"package 'mynets', which this deployment does not allow: FEDPIPE_MODEL_PACKAGES .*othernets, thirdnets"):
        build_model("mynets.models:build", IMAGES, 3)
    assert "mynets" not in sys.modules  # refused before anything was imported
    monkeypatch.setenv(imported.PACKAGES_ENV, "othernets,mynets")
    assert build_model("mynets.models:build", IMAGES, 3).head.out_features == 3
    for unset in (lambda: monkeypatch.setenv(imported.PACKAGES_ENV, ""), lambda: monkeypatch.delenv(imported.PACKAGES_ENV)):
        unset()  # unset or empty: fail closed, only the bundled models
        with pytest.raises(ConfigError, match=r"FEDPIPE_MODEL_PACKAGES is unset or empty, so only fedpipe's bundled models "
                                              r"are built: allow your package with `export FEDPIPE_MODEL_PACKAGES=mynets`"):
            build_model("mynets.models:build", IMAGES, 3)
    assert build_model("twonn", IMAGES, 3) is not None  # the bundled ones need no variable


@pytest.mark.parametrize("value, message", [
    ("os:system", "standard library"),
    ("subprocess:run", "standard library"),
    ("mynets.models:_hidden", "private parts"),
    ("mynets.models:build:x", "not an import path"),
    ("mynets..models:build", "not an import path"),
    ("mynets.models:build()", "not an import path"),
    ("mynets/models:build", "not an import path"),
    ("numpy:zeros", "a library fedpipe runs on"),
    ("resnet", "unknown model 'resnet'"),
    ("m:" + "a" * 300, "at most 200 characters"),
])
def test_the_config_refuses_a_bad_model_name_before_anything_runs(value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"model.name={value}"])


def test_the_config_keeps_auto_the_bundled_names_and_import_paths():
    for value in ("auto", *MODELS, "mynets.models:build", "My_Nets2.v1:Net"):
        assert load_config(None, [f"model.name={value}"]).model.name == value


@pytest.mark.parametrize("method", list(ALGORITHMS))
def test_every_method_takes_a_model_laid_out_as_the_bundled_ones(nets, method):
    """features / body / head, Conv2d, Linear and ReLU: every method's defaults apply."""
    params = TypeAdapter(MethodConfig).validate_python({"name": method})
    build_algorithm(params, build_model("mynets.models:build", IMAGES, 10), seed=0)


@pytest.mark.parametrize("method, options, factory, message", [
    ("superfed_mm", {}, "prelu", r"SuPerFed cannot mix layer '2' of type PReLU \(trainable parameters weight\)"),
    ("superfed_lm", {}, "bare", r"SuPerFed cannot mix layer the model itself of type Bare"),
    ("fedprox", {"proximal": "layer_norms"}, "prelu", r"'2' of type PReLU"),
    ("fedper", {}, "headless", r"method.personal_layers: 'head' match no layer of the model; its layers are: 1.weight, 1.bias"),
    ("lgfedavg", {}, "headless", r"method.global_layers: 'head' match no layer"),
    ("fedmoe", {}, "headless", r"needs the output layer as an nn.Linear named `head`, and Sequential has none"),
    ("pfedmb", {}, "bare", r"pFedMB branches Conv2d and Linear layers, and Bare has none"),
    ("fedmn", {"encoder": "cnn"}, "headless", r"method.encoder=cnn copies the model's convolutional `features`, and Sequential has none"),
])
def test_a_method_names_what_it_cannot_handle_in_the_model(nets, method, options, factory, message):
    params = TypeAdapter(MethodConfig).validate_python({"name": method, **options})
    model = build_model(f"mynets.models:{factory}", IMAGES, 3)  # a model fit to train: the method refuses it
    with pytest.raises(ConfigError, match=message):
        build_algorithm(params, model, seed=0)


def test_layers_a_method_leaves_alone_are_named_in_a_warning(nets, caplog):
    """pFedMB keeps layers it does not branch single (FedAvg'd), IFCA cannot redraw layers without
    reset_parameters: both go on, and say which layers."""
    params = TypeAdapter(MethodConfig).validate_python({"name": "pfedmb"})
    build_algorithm(params, build_model("mynets.models:prelu", IMAGES, 3), seed=0)
    assert "pFedMB branches Conv2d and Linear layers only: 2 (PReLU) of Sequential stay single" in caplog.text
    params = TypeAdapter(MethodConfig).validate_python({"name": "ifca"})
    build_algorithm(params, build_model("mynets.models:bare", IMAGES, 3), seed=0)
    assert "the layers holding weight of Bare do not have: those parameters start equal in every cluster" in caplog.text


# --- the table model --------------------------------------------------------------------------------


def test_tabular_mlp_reads_rows_of_features():
    assert auto_model_name((30,)) == "tabular_mlp" and MODELS["tabular_mlp"].reads == "table"
    model = build_model("tabular_mlp", (30,), 4)
    assert isinstance(model, TabularMLP) and model.input_shape == (30,)
    assert [n for n, _ in model.named_parameters()] == ["body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias",
                                                         "head.weight", "head.bias"]
    assert model(torch.randn(5, 30)).shape == (5, 4)
    with pytest.raises(ConfigError, match=r"'lenet5' is an image model .* a table of 30 numeric features per row; use model.name=tabular_mlp"):
        build_model("lenet5", (30,), 4)
    with pytest.raises(ConfigError, match=r"'tabular_mlp' is a table model .* images of 1 channel\(s\), 28x28 pixels; use model.name=twonn"):
        build_model("tabular_mlp", (1, 28, 28), 4)
    with pytest.raises(ConfigError, match=r"'bilstm' is a text model .*use model.name=tabular_mlp"):
        build_model("bilstm", (30,), 4)


FEATURES, CLASSES = 30, 3
# per method: few epochs, so every phase of every method runs in well under a second
QUICK = {"fedmoe": {"max_epochs": 2}, "pfedmb": {"finetune_epochs": 1}, "fedmn": {"hidden": (16, 8)}}


def table_data(clients: int = 3, seed: int = 0) -> FederatedData:
    """Clients of random float features; the label is the argmax of a fixed linear map (learnable)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(FEATURES, CLASSES, generator=gen)

    def split(n: int) -> Split:
        x = torch.randn(n, FEATURES, generator=gen)
        return Split(x, (x @ w).argmax(1))

    return FederatedData(tuple(ClientData(c, split(40), split(10), split(10), False) for c in range(clients)), split(30),
                         CLASSES, (FEATURES,))


@pytest.mark.parametrize("mode", ["sequential", "batched"])
@pytest.mark.parametrize("method", list(ALGORITHMS))
def test_every_method_trains_the_table_model(method, mode):
    """Every phase of every method, 2 rounds, on tabular_mlp, clients one by one or batched (vmap):
    trained, and every client scored."""
    params = TypeAdapter(MethodConfig).validate_python({"name": method, **QUICK.get(method, {})})
    torch.manual_seed(0)
    model = build_model("tabular_mlp", (FEATURES,), CLASSES)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    algorithm = build_algorithm(params, model, seed=0)
    data = table_data()
    x = data.clients[0].test.x

    def personalized_logits(server, kept):
        with eval_mode(algorithm.model):
            return algorithm.forward(algorithm.personalized_candidates(server, kept, 0)[0][1], x)

    before = personalized_logits(ServerState(initial), None)
    train = TrainConfig(rounds=2, local_epochs=1, batch_size=8, lr=0.05)
    state = PhaseState(method, "init", 0, ServerState(initial))
    for phase in phases_of(params, train.rounds):
        trainer = ClientTrainer(algorithm, phase, data, train, EngineConfig(clients=mode), seed=0)
        state = run_phase(algorithm, phase, data, state, train, 0, lambda r, lr, works, t=trainer: (t.train(works, r, lr), None))
    assert state.round == phases_of(params, train.rounds)[-1].last_round
    result = evaluate_personalized(algorithm, state.server, dict(state.clients), data, 100, 15)
    assert len(result.clients) == 3 and 0 <= result.mean_accuracy <= 1
    after = personalized_logits(state.server, state.clients.get(0))
    assert after.shape == (len(x), CLASSES) and torch.isfinite(after).all() and not torch.allclose(after, before), "nothing was trained"


# --- the pipeline, in kfp's local runner ----------------------------------------------------------


@pytest.mark.slow
def test_the_pipeline_runs_a_model_by_import_path_in_the_local_runner(nets, tmp_path):
    """`fedpipe run` executes the compiled pipeline with kfp.local.SubprocessRunner: every task is its own
    Python process, started with this process's environment, so a package on PYTHONPATH reaches each."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(nets), os.environ.get("PYTHONPATH")) if p)}
    args = [f"--set={s}" for s in [*SMALL, f"run.store={tmp_path / 'runs'}", "run.id=pipe", "method.name=fedavg",
                                   "data.dataset=digits", "model.name=mynets.models:build", "partition.num_clients=3",
                                   "train.rounds=2", "train.lr=0.05"]]
    done = subprocess.run([sys.executable, "-m", "fedpipe.cli", "run", *args], capture_output=True, text=True, timeout=900,
                          env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    for task in ("resolve-config", "partition", "train-phase", "evaluate"):
        assert f"Task '{task}' finished with status SUCCESS" in done.stderr, task
    summary = json.loads((tmp_path / "runs" / "pipe" / "report" / "summary.json").read_text())
    assert summary["method"] == "fedavg" and summary["global_model"]["top1"] > 0.2  # chance: 0.1 (it reaches 0.38)
    # without the package where the tasks run: refused before any task starts, saying how to install it
    env.pop("PYTHONPATH")
    done = subprocess.run([sys.executable, "-m", "fedpipe.cli", "run", *args[:-1], "--set=run.id=other"], capture_output=True,
                          text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode != 0 and "module 'mynets.models' is not installed in this environment" in done.stdout + done.stderr
