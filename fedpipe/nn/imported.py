"""Models named by import path: `model.name: mypackage.nets:build`, your own network, installed in the
environment the run's tasks run in (for a Kubeflow pipeline: an image derived from fedpipe's).

The name is `module:attribute`, a dotted module path and a function or class in it. fedpipe imports
the module and calls `attribute(input_shape, num_classes)` with the dataset's input shape as a tuple of
ints, (C, H, W) for images, (T, V) for token sequences, (F,) for tables (fedpipe.data), and the number
of classes. It must return a `torch.nn.Module` mapping a batch [N, *input_shape] (float32 images and
tables, int64 token ids) to float class scores [N, num_classes]. That is checked on one batch of 2
inputs before anything trains (`check_model`), with the other things the engine relies on: trainable
parameters, all of them meant to be trained, and no buffer that the forward pass changes (see
`check_buffers`). Name the last linear layer `head` and the rest `body` (as the bundled models do)
and every method's defaults apply; each method checks what it needs of the network when it is built.

The name can arrive as a pipeline parameter typed into the Kubeflow UI by someone other than whoever
installed the image, and importing a module runs its code; so before anything is imported
(`import_path_problem`):

- the name must be `module:attribute` with Python identifiers only, none starting with `_`;
- the module must not be part of Python's standard library (`sys.stdlib_module_names`), of fedpipe,
  or of the libraries fedpipe runs on (`REFUSED_PACKAGES`: torch, numpy, kfp, ...);
- the module's top-level package must be listed in the environment variable FEDPIPE_MODEL_PACKAGES
  (comma-separated top-level package names): the derived image that installs the package sets it
  (`ENV FEDPIPE_MODEL_PACKAGES=mypackage`), and so does whoever runs their own network on a laptop.
  Unset or empty, no package is allowed and only fedpipe's bundled models are built (fail closed: the
  name can also come from a study's records or a model line's version record, which a bucket writer
  can plant);

and after the import the attribute must be a function or class defined in that top-level package (a
function of another package imported into it, such as `os.system`, is refused).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import re
import sys

import torch
from torch import nn

from fedpipe.data import UNK_ID, is_table_shape, is_text_shape
from fedpipe.errors import ConfigError

log = logging.getLogger(__name__)

MAX_IMPORT_PATH = 200  # characters of model.name
IMPORT_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
PACKAGES_ENV = "FEDPIPE_MODEL_PACKAGES"

#: Top-level packages never imported as a model: fedpipe, and the libraries it runs on and their
#: tools (none of them has a model factory with fedpipe's signature; they do have functions that
#: act on the pod: processes, files, the cluster, the store).
REFUSED_PACKAGES = frozenset({
    "fedpipe", "torch", "torchvision", "torchaudio", "functorch", "numpy", "scipy", "sklearn", "mlxtend", "matplotlib",
    "pydantic", "pydantic_core", "yaml", "typer", "click", "tqdm", "minio", "boto3", "botocore", "urllib3", "requests",
    "prometheus_client", "tenacity", "pyarrow", "kfp", "kubernetes", "google", "pip", "setuptools", "pkg_resources",
    "wheel", "pytest", "hypothesis",
})

PROBE_BATCH = 2  # inputs in the batch a model is tried on


def is_import_path(name: str) -> bool:
    """Whether model.name names a model by import path (`module:attribute`) rather than a bundled one."""
    return ":" in name


def _parts(name: str) -> tuple[str, str, str]:
    module, attribute = name.split(":")
    return module, attribute, module.split(".")[0]


def import_path_problem(name: str) -> str | None:
    """What is wrong with import path `name` on its face (its form, a private part, a refused package),
    or None. Needs neither the environment nor an import: config validation calls it."""
    if len(name) > MAX_IMPORT_PATH:
        return f"model.name is {len(name)} characters long; an import path has at most {MAX_IMPORT_PATH}"
    if not IMPORT_PATH.fullmatch(name):
        return (f"model.name={name!r} is not an import path: write package.module:function (a dotted module path, one "
                "colon, then the name of a function or class in that module, e.g. mynets.models:build)")
    module, attribute, top = _parts(name)
    private = [p for p in [*module.split("."), attribute] if p.startswith("_")]
    if private:
        return (f"model.name={name!r} names private parts ({', '.join(private)}): only public modules, functions and "
                "classes (names not starting with '_') are imported as models")
    if top in sys.stdlib_module_names:
        return (f"model.name={name!r} names module {module!r} of Python's standard library; a model by import path "
                "must come from your own installed package")
    if top == "fedpipe":
        return (f"model.name={name!r} names a module of fedpipe itself; its bundled models are named by their names "
                "(twonn, superfed_cnn, lenet5, mcmahan_cnn, bilstm, tabular_mlp)")
    if top in REFUSED_PACKAGES:
        return (f"model.name={name!r} names module {module!r} of {top}, a library fedpipe runs on, which is never "
                "imported as a model; wrap the network in a function of your own package")
    return None


def allowed_packages() -> frozenset[str]:
    """The top-level packages FEDPIPE_MODEL_PACKAGES allows; unset or empty: none (only the bundled models)."""
    value = os.environ.get(PACKAGES_ENV) or ""
    return frozenset(p.strip() for p in value.split(",") if p.strip())


def policy_problem(name: str) -> str | None:
    """`import_path_problem`, then whether this environment allows the package (FEDPIPE_MODEL_PACKAGES)."""
    problem = import_path_problem(name)
    if problem:
        return problem
    allowed, top = allowed_packages(), _parts(name)[2]
    if top in allowed:
        return None
    if not allowed:
        return (f"model.name={name!r} names package {top!r}, but {PACKAGES_ENV} is unset or empty, so only fedpipe's bundled "
                f"models are built: allow your package with `export {PACKAGES_ENV}={top}` (in a derived image: "
                f"`ENV {PACKAGES_ENV}={top}`), where the run's tasks run")
    return (f"model.name={name!r} names package {top!r}, which this deployment does not allow: {PACKAGES_ENV} "
            f"(set by the platform team in the image) lists the packages models may come from: {', '.join(sorted(allowed))}")


def _import(name: str, module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            raise ConfigError(
                f"model.name={name!r}: module {module_name!r} is not installed in this environment (for a pipeline: in the "
                f"image its tasks run in). Build an image that has it: a Dockerfile `FROM ghcr.io/fedpipe/fedpipe:<tag>` "
                f"(and one FROM the `<tag>-cuda` image for the training tasks) with `RUN pip install <your package>`, pushed "
                f"and passed to fedpipe with --image-repository / --image-tag / --training-image-tag. For a run on this "
                f"machine, pip install the package into fedpipe's Python environment or put the folder holding it on "
                f"PYTHONPATH."
            ) from None
        raise ConfigError(f"model.name={name!r}: importing {module_name!r} failed because it imports {missing!r}, which is "
                          "not installed in this environment; install that dependency with your package.") from None
    except Exception as e:
        raise ConfigError(f"model.name={name!r}: importing {module_name!r} failed: {type(e).__name__}: {e}") from e


def _defined_in(obj, top: str) -> bool:
    owner = getattr(obj, "__module__", None) or ""
    return owner == top or owner.startswith(top + ".")


def load_factory(name: str):
    """The function or class `name` (module:attribute) names, after the checks of the module docstring."""
    problem = policy_problem(name)
    if problem:
        raise ConfigError(problem + ".")
    module_name, attribute, top = _parts(name)
    module = _import(name, module_name)
    factory = getattr(module, attribute, None)
    if factory is None:
        public = sorted(n for n, v in vars(module).items()
                        if not n.startswith("_") and (inspect.isfunction(v) or inspect.isclass(v)) and _defined_in(v, top))
        offer = f"its public functions and classes: {', '.join(public[:20])}" if public else "it defines no public function or class"
        raise ConfigError(f"model.name={name!r}: module {module_name!r} has no attribute {attribute!r} ({offer}).")
    if not (inspect.isfunction(factory) or inspect.isclass(factory)):
        raise ConfigError(f"model.name={name!r}: {attribute!r} is a {type(factory).__name__}, not a function or class; "
                          "name a function (or class) called as f(input_shape, num_classes) that returns an nn.Module.")
    if not _defined_in(factory, top):
        raise ConfigError(f"model.name={name!r}: {attribute!r} is defined in module {factory.__module__!r}, outside package "
                          f"{top!r}; fedpipe calls only functions and classes defined in the package named (name it where "
                          "it is defined, in your own package).")
    return factory


def build_imported(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The model `name` (module:attribute) builds for `input_shape` and `num_classes`, checked on one batch."""
    factory = load_factory(name)
    shape = tuple(int(d) for d in input_shape)
    try:
        model = factory(shape, num_classes)
    except Exception as e:
        raise ConfigError(f"model.name={name!r} failed to build a model for input shape {shape} and {num_classes} classes: "
                          f"{type(e).__name__}: {e}") from e
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.name={name!r} returned a {type(model).__name__} for input shape {shape} and {num_classes} "
                          "classes, not a torch nn.Module.")
    check_model(name, model, shape, num_classes)
    log.info("Model %s: %s from %s, %s parameters.", name, type(model).__name__,
             getattr(sys.modules.get(name.split(":")[0]), "__file__", "?"), f"{sum(p.numel() for p in model.parameters()):,}")
    return model


# --- what the engine needs of a model, tried on one batch -------------------------------------------


def probe_batch(input_shape: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """A batch of 2 inputs of the dataset's kind: zeros (float32) for images and tables, the unknown
    word's id (int64) for token sequences."""
    if is_text_shape(input_shape):
        return torch.full((PROBE_BATCH, input_shape[0]), UNK_ID, dtype=torch.int64, device=device)
    return torch.zeros((PROBE_BATCH, *input_shape), dtype=torch.float32, device=device)


def _kind(input_shape: tuple[int, ...]) -> str:
    if is_table_shape(input_shape):
        return "a table's rows, float32"
    if is_text_shape(input_shape):
        return "token ids, int64"
    return "images, float32"


def _described(out) -> str:
    if isinstance(out, torch.Tensor):
        return f"a {out.dtype} tensor of shape {tuple(out.shape)}"
    return f"a {type(out).__name__}"


def check_model(name: str, model: nn.Module, input_shape: tuple[int, ...], num_classes: int) -> None:
    """Refuse, with a ConfigError naming `name`, a model the engine cannot train: one without
    parameters, with frozen parameters, whose output on one batch is not float scores of shape
    (2, num_classes), or whose forward pass changes its buffers."""
    params = dict(model.named_parameters())
    if not params:
        raise ConfigError(f"model.name={name!r} built a {type(model).__name__} without parameters: there is nothing to train.")
    frozen = [n for n, p in params.items() if not p.requires_grad]
    if frozen:
        raise ConfigError(
            f"model.name={name!r} has parameters that do not require gradients ({', '.join(frozen[:10])}): fedpipe trains "
            "every parameter of the model (the engine optimises them as plain tensors), so freezing them would not hold. "
            "Keep fixed tensors as buffers (register_buffer) instead, or leave requires_grad on."
        )
    device = next(iter(params.values())).device
    x = probe_batch(input_shape, device)
    batch = f"a batch of {PROBE_BATCH} inputs of shape {tuple(input_shape)} ({_kind(input_shape)})"
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            out = torch.func.functional_call(model, {n: p.detach() for n, p in params.items()}, (x,))
    except Exception as e:
        raise ConfigError(f"model.name={name!r}: the forward pass on {batch} failed: {type(e).__name__}: {e}") from e
    finally:
        model.train(was_training)
    if not (isinstance(out, torch.Tensor) and out.is_floating_point() and tuple(out.shape) == (PROBE_BATCH, num_classes)):
        raise ConfigError(
            f"model.name={name!r} must return float class scores of shape (N, {num_classes}) for inputs of shape "
            f"(N, {', '.join(map(str, input_shape))}); on {batch} it returned {_described(out)}, not one of shape "
            f"({PROBE_BATCH}, {num_classes})."
        )
    check_buffers(name, model, x)


def check_buffers(name: str, model: nn.Module, x: torch.Tensor) -> None:
    """Refuse a model whose forward pass in training mode changes a buffer (BatchNorm's running
    statistics). The engine holds parameters only: every client's parameters are plain tensors, passed
    to one shared module by `torch.func.functional_call`, kept per client, averaged and checkpointed;
    buffers are none of these. Running statistics would be one set updated by every client in turn,
    lost between pipeline tasks, and what evaluation normalised with. Constant buffers are fine."""
    before = {n: b.detach().clone() for n, b in model.named_buffers()}
    if not before:
        return
    was_training = model.training
    try:
        model.train()
        with torch.no_grad():
            model(x)
    except Exception as e:
        raise ConfigError(f"model.name={name!r}: the forward pass in training mode failed: {type(e).__name__}: {e}") from e
    finally:
        model.train(was_training)
        after = dict(model.named_buffers())
        changed = [n for n, b in before.items() if n not in after or after[n].shape != b.shape or not torch.equal(after[n], b)]
        with torch.no_grad():
            for n in changed:  # leave the model as it was built
                if n in after and after[n].shape == before[n].shape:
                    after[n].copy_(before[n])
    if changed:
        raise ConfigError(
            f"model.name={name!r} changes buffers in its forward pass ({', '.join(changed[:10])}): fedpipe trains, keeps per "
            "client and averages parameters only, so running statistics (BatchNorm's) would be shared by every client, "
            "lost between pipeline steps and wrong at evaluation. Build norm layers with track_running_stats=False (batch "
            "statistics in training and evaluation), or use LayerNorm / GroupNorm."
        )
