"""The networks the papers use, as plain `nn.Module`s, and one registry to build them by name.

Algorithms never hold these modules' parameters: the engine keeps parameters as plain tensors and
calls a module through `torch.func.functional_call`, so one module object serves every client.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fedpipe.data import PAD_ID, is_text_shape
from fedpipe.errors import ConfigError


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

    Bias-free, as in the throughput comparisons of ../shared/reference/peers.md (24.7 MFLOP per
    28x28 sample, forward and backward).
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


@dataclass(frozen=True)
class ModelInfo:
    name: str
    build: Callable[[tuple[int, ...], int], nn.Module]
    min_side: int  # smallest image side the architecture accepts (text models: 1)
    description: str
    text: bool = False  # reads token sequences (input_shape (T, V)) instead of images (C, H, W)


MODELS: dict[str, ModelInfo] = {
    info.name: info
    for info in (
        ModelInfo("twonn", TwoNN, 1, "784-200-200-C MLP of McMahan et al. (FedAvg)"),
        ModelInfo("superfed_cnn", SuPerFedCNN, 28, "5-layer bias-free CNN of SuPerFed's Table 4"),
        ModelInfo("lenet5", LeNet5, 16, "LeNet-style CNN of pFedMB and the federated mixture of experts"),
        ModelInfo("mcmahan_cnn", McMahanCNN, 16, "bias-free MNIST CNN of McMahan et al. (FedAvg)"),
        ModelInfo("bilstm", BiLSTMClassifier, 1, "embedding 100, bidirectional LSTM 64: the mixture of experts' AG News network",
                  text=True),
    )
}


def auto_model_name(input_shape: tuple[int, ...]) -> str:
    """What model.name=auto means for inputs of `input_shape`: bilstm for token sequences,
    superfed_cnn for images of 28 pixels and more, twonn below."""
    if is_text_shape(input_shape):
        return "bilstm"
    return "superfed_cnn" if min(input_shape[1:]) >= 28 else "twonn"


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build model `name` for inputs of `input_shape`, (C, H, W) for images or (T, V) for token
    sequences, and `num_classes` outputs."""
    if name not in MODELS:
        raise ConfigError(f"model.name={name!r} is not a known model; choose one of {', '.join(MODELS)}.")
    info = MODELS[name]
    text_models = ", ".join(n for n, i in MODELS.items() if i.text)
    if info.text != is_text_shape(input_shape):
        if info.text:
            raise ConfigError(f"model.name={name!r} reads token sequences, but the dataset holds images of shape "
                              f"{tuple(input_shape)}; pick an image model ({', '.join(n for n, i in MODELS.items() if not i.text)}).")
        raise ConfigError(f"model.name={name!r} is an image model, but the dataset holds token sequences (length "
                          f"{input_shape[0]}, vocabulary {input_shape[1]}); use model.name={text_models}.")
    side = min(input_shape[1:]) if not info.text else 1
    if side < info.min_side:
        raise ConfigError(
            f"model.name={name!r} needs images at least {info.min_side}x{info.min_side}, but the dataset's "
            f"images are {input_shape[1]}x{input_shape[2]}; use model.name=twonn for small images."
        )
    model = info.build(input_shape, num_classes)
    # what the model was built for, so a method that builds companion networks (a gate, a router,
    # modules) can size them without the data
    model.input_shape, model.num_classes = tuple(input_shape), num_classes
    return model


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
