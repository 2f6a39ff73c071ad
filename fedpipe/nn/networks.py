"""The networks the papers use, as plain `nn.Module`s, and one registry to build them by name.

Algorithms never hold these modules' parameters: the engine keeps parameters as plain tensors and
calls a module through `torch.func.functional_call`, so one module object serves every client.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from fedpipe.data import PAD_ID, is_table_shape, is_text_shape
from fedpipe.errors import ConfigError
from fedpipe.nn.imported import build_imported, is_import_path


class TwoNN(nn.Module):
    """McMahan et al. (2017) "2NN": a 784-200-200-C perceptron with ReLU (FedAvg's MNIST MLP)."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, hidden: int = 200):
        super().__init__()
        c, h, w = input_shape
        self.body = nn.Sequential(
            nn.Flatten(), nn.Linear(c * h * w, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU()
        )
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class TabularMLP(nn.Module):
    """A 2NN for tables: F-200-200-C with ReLU, for rows of F numeric features (input shape (F,), float32
    [N, F], data.dataset=files). Its layers are named as TwoNN's (`body`, `head`), so every method's
    defaults (FedPer's and LG-FedAvg's `head`, the mixture of experts' gate) apply to it unchanged."""

    def __init__(self, input_shape: tuple[int], num_classes: int, hidden: int = 200):
        super().__init__()
        (features,) = input_shape
        self.body = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class SuPerFedCNN(nn.Module):
    """The 5-layer CNN of SuPerFed's Table 4 (Hahn et al., 2022, appendix).

    conv 32 5x5, pool; conv 64 5x5, pool; conv 32 kxk, pool; fc 512; fc C; ReLU everywhere but the
    output. Table 4 varies the third kernel and the pool size by dataset: 3x3 conv and 2x2 pools for
    32x32 inputs (CIFAR), 2x2 conv and 2x2 pools for 28x28 (EMNIST, MNIST), 2x2 conv and 3x3 pools for
    64x64 (TinyImageNet). Every one of them ends in a 32x1x1 feature map, so fc1 takes 32 inputs.

    Bias-free by default (`bias=False`), as every model of the authors' released code is (its layer
    Builder defaults to bias=False and every model passes it), so SuPerFed personalizes every tensor of
    it; Table 4 lists no biases. Their first implementation of this network (commit ae1803b, Jan 2022)
    had biases, shared between the global and the local model: `bias=True` builds that variant.
    """

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, bias: bool = False):
        super().__init__()
        c, h, _ = input_shape
        conv3_kernel, pool = {28: (2, 2), 32: (3, 2), 64: (2, 3)}.get(h, (2, 2))
        self.features = nn.Sequential(
            nn.Conv2d(c, 32, 5, bias=bias), nn.ReLU(), nn.MaxPool2d(pool),
            nn.Conv2d(32, 64, 5, bias=bias), nn.ReLU(), nn.MaxPool2d(pool),
            nn.Conv2d(64, 32, conv3_kernel, bias=bias), nn.ReLU(), nn.MaxPool2d(pool),
            nn.Flatten(),
        )
        self.body = nn.Sequential(nn.Linear(_flat_size(self.features, input_shape), 512, bias=bias), nn.ReLU())
        self.head = nn.Linear(512, num_classes, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.features(x)))


class LeNet5(nn.Module):
    """The LeNet-style CNN of pFedMB (Mori et al.) and the federated mixture of experts (Listo Zec et al.).

    conv 6 5x5, pool; conv 16 5x5, pool; fc 120; fc 84; fc C; ReLU.
    """

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int):
        super().__init__()
        c = input_shape[0]
        self.features = nn.Sequential(
            nn.Conv2d(c, 6, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.body = nn.Sequential(
            nn.Linear(_flat_size(self.features, input_shape), 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU()
        )
        self.head = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.features(x)))


class McMahanCNN(nn.Module):
    """The MNIST CNN of McMahan et al. (2017): conv 32 5x5, pool; conv 64 5x5, pool; fc 512; fc C.

    Bias-free, as in the peers' throughput setting (docs/speed/index.md, "The peers' setting": 24.7 MFLOP
    per 28x28 sample, forward and backward).
    """

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int):
        super().__init__()
        c = input_shape[0]
        self.features = nn.Sequential(
            nn.Conv2d(c, 32, 5, bias=False), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, bias=False), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.body = nn.Sequential(nn.Linear(_flat_size(self.features, input_shape), 512, bias=False), nn.ReLU())
        self.head = nn.Linear(512, num_classes, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.features(x)))


class BiLSTMClassifier(nn.Module):
    """The AG News network of the federated mixture of experts (Listo Zec et al., Sec. 4): "an embedding
    layer with a dimension size of 100, a bi-directional LSTM layer with 64 nodes followed by an output
    layer".

    Input: int64 token ids [N, T], right-padded with PAD_ID (fedpipe.data); input_shape is (T, V). The
    sequence's representation is the LSTM's last hidden state in each direction over the real tokens
    (padding skipped by packing, as a masked Keras LSTM does): 2 x 64 = 128 features, then `head`.
    """

    def __init__(self, input_shape: tuple[int, int], num_classes: int, embedding_dim: int = 100, hidden: int = 64):
        super().__init__()
        _, vocab_size = input_shape
        self.embedding = nn.Embedding(vocab_size, embedding_dim, padding_idx=PAD_ID)
        self.lstm = nn.LSTM(embedding_dim, hidden, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lengths = (x != PAD_ID).sum(dim=1).clamp_(min=1).cpu()  # an empty text reads one padding token
        packed = nn.utils.rnn.pack_padded_sequence(self.embedding(x), lengths, batch_first=True, enforce_sorted=False)
        _, (h, _) = self.lstm(packed)  # h: [2 directions, N, hidden], in the batch's original order
        return self.head(torch.cat([h[0], h[1]], dim=1))


def _flat_size(features: nn.Module, input_shape: tuple[int, int, int]) -> int:
    with torch.no_grad():
        return int(features(torch.zeros(1, *input_shape)).shape[1])


InputKind = Literal["image", "text", "table"]
KIND_SHAPES = {"image": "images (C, H, W)", "text": "token sequences (T, V)", "table": "rows of numeric features (F,)"}
KIND_NOUNS = {"image": "an image model", "text": "a text model", "table": "a table model"}


def input_kind(shape: tuple[int, ...]) -> InputKind | None:
    """What inputs of `shape` are (the data contract, fedpipe.data): image (C, H, W), text (T, V) or
    table (F,); None for any other shape."""
    if is_table_shape(shape):
        return "table"
    if is_text_shape(shape):
        return "text"
    return "image" if len(shape) == 3 else None


def describe_inputs(shape: tuple[int, ...]) -> str:
    """The dataset's inputs in words, for messages."""
    kind = input_kind(shape)
    if kind == "table":
        return f"a table of {shape[0]} numeric features per row"
    if kind == "text":
        return f"token sequences (length {shape[0]}, vocabulary {shape[1]})"
    if kind == "image":
        return f"images of {shape[0]} channel(s), {shape[1]}x{shape[2]} pixels"
    return f"inputs of shape {tuple(shape)}"


@dataclass(frozen=True)
class ModelInfo:
    name: str
    build: Callable[[tuple[int, ...], int], nn.Module]
    min_side: int  # smallest image side the architecture accepts (text and table models: 1)
    description: str
    reads: InputKind = "image"  # images (C, H, W), token sequences (T, V) or numeric features (F,)


MODELS: dict[str, ModelInfo] = {
    info.name: info
    for info in (
        ModelInfo("twonn", TwoNN, 1, "784-200-200-C MLP of McMahan et al. (FedAvg)"),
        ModelInfo("superfed_cnn", SuPerFedCNN, 28, "5-layer bias-free CNN of SuPerFed's Table 4"),
        ModelInfo("lenet5", LeNet5, 16, "LeNet-style CNN of pFedMB and the federated mixture of experts"),
        ModelInfo("mcmahan_cnn", McMahanCNN, 16, "bias-free MNIST CNN of McMahan et al. (FedAvg)"),
        ModelInfo("bilstm", BiLSTMClassifier, 1, "embedding 100, bidirectional LSTM 64: the mixture of experts' AG News network",
                  reads="text"),
        ModelInfo("tabular_mlp", TabularMLP, 1, "F-200-200-C MLP for tables of numeric features (a 2NN)", reads="table"),
    )
}


def models_reading(kind: InputKind) -> list[str]:
    return [n for n, i in MODELS.items() if i.reads == kind]


def auto_model_name(input_shape: tuple[int, ...]) -> str:
    """What model.name=auto means for inputs of `input_shape`: tabular_mlp for tables, bilstm for token
    sequences, superfed_cnn for images of 28 pixels and more, twonn below."""
    if is_table_shape(input_shape):
        return "tabular_mlp"
    if is_text_shape(input_shape):
        return "bilstm"
    return "superfed_cnn" if min(input_shape[1:]) >= 28 else "twonn"


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build model `name` for inputs of `input_shape`, (C, H, W) for images, (T, V) for token sequences
    or (F,) for tables, and `num_classes` outputs. `name` is a bundled model (MODELS) or an import path,
    `package.module:factory` (fedpipe.nn.imported: checked, then tried on one batch)."""
    input_shape = tuple(int(d) for d in input_shape)
    if is_import_path(name):
        model = build_imported(name, input_shape, num_classes)
    else:
        model = _build_bundled(name, input_shape, num_classes)
    # what the model was built for, so a method that builds companion networks (a gate, a router,
    # modules) can size them without the data
    model.input_shape, model.num_classes = input_shape, num_classes
    return model


def _build_bundled(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if name not in MODELS:
        raise ConfigError(f"model.name={name!r} is not a known model; choose one of {', '.join(MODELS)}, "
                          "or name your own as package.module:function.")
    info = MODELS[name]
    kind = input_kind(input_shape)
    if info.reads != kind:
        fitting = models_reading(kind) if kind else []
        instead = (f"use model.name={' or '.join(fitting)} (or auto)" if fitting
                   else "no bundled model reads them; name your own as package.module:function")
        raise ConfigError(f"model.name={name!r} is {KIND_NOUNS[info.reads]} (it reads {KIND_SHAPES[info.reads]}), but the dataset holds "
                          f"{describe_inputs(input_shape)}; {instead}.")
    if info.reads == "image" and min(input_shape[1:]) < info.min_side:
        raise ConfigError(
            f"model.name={name!r} needs images at least {info.min_side}x{info.min_side}, but the dataset's "
            f"images are {input_shape[1]}x{input_shape[2]}; use model.name=twonn for small images."
        )
    return info.build(input_shape, num_classes)


def lies_under(name: str, prefixes: tuple[str, ...] | list[str]) -> bool:
    """A parameter or module name lies under a prefix when it is the prefix or starts with `prefix.`."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def names_under(names: list[str], prefixes: tuple[str, ...] | list[str], option: str) -> list[str]:
    """The names that lie under one of the prefixes of config option `option` (e.g.
    "method.personal_layers"); a prefix that matches no name is a config error that lists them."""
    unmatched = [p for p in prefixes if not any(lies_under(n, [p]) for n in names)]
    if unmatched:
        raise ConfigError(f"{option}: {', '.join(map(repr, unmatched))} match no layer of the model; its layers are: {', '.join(names)}.")
    return [n for n in names if lies_under(n, prefixes)]
