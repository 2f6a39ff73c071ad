"""The networks of FedMN (Wang et al., "Personalized Federated Learning via Heterogeneous Modular
Networks", arXiv 2210.14830, 2022, Section II-A): a pool of modular units wired by per-path
decisions, and the routing hypernetwork that makes those decisions from a client's whole dataset.

Module pool. Layer 1 holds n_1 encoder units, layers 2..L hold MLP units (n_l of them in layer l):

    z^(j) = Encoder^(j)(x),  j = 1..n_1                                    (Eq. 1)

Every pair of units in successive layers may be connected, and every unit of layer L may be linked
to the output, so a decision V is a vector of E binary path variables,

    E = sum_{l=1}^{L-1} n_l n_{l+1} + n_L                                  (Section II-A)

ordered layer by layer: the n_1 x n_2 links 1 -> 2 (row major: source, then target), ..., the
n_{L-1} x n_L links L-1 -> L, then the n_L links to the output (`PathLayout`).

Forward pass given V (`ModularNetwork.forward`): unit j of layer l+1 takes the sum of its incoming
units' outputs weighted by their decisions, divided by the sum of those decisions (official code:
"incoming links weighted by the decisions and normalised by their sum"), the output is the same
combination of the layer-L units' class scores. One difference, stated: the divisor is floored at
1, max(sum_i v_ij, 1). For hard decisions that is the official mean over the active links whenever
one is active; a unit none of whose incoming links is on gets a zero input (the official 0/0 is
undefined) and the straight-through gradient with respect to its links stays bounded. For soft
decisions the floor keeps a unit whose links are all nearly off from rescaling near-zero weights to
a full-strength input.

Units are distinct modules with their own weights, each initialised from its own seed (the official
code puts one module object in every slot of a layer, so its "units" share weights).

A unit is *used* by a decision when a chain of active links leads from it to the output
(`PathLayout.used_units`): only then can its weights change the client's prediction. The forward
pass feeds every inactive link's source detached, so an unused unit gets no gradient at all (not a
zero one): an optimiser leaves it bitwise unchanged, which is what lets a client upload only the
units it trained. Inactive links still carry gradient to the decisions (the straight-through
estimator needs dL/dv for links that are off), so in training every unit is computed; in
evaluation (decisions without gradient) only the used units are.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

from fedpipe.seeding import derive_seed

EncoderKind = Literal["cnn", "mlp"]


@dataclass(frozen=True)
class PathLayout:
    """The path variables of a pool with `units[l]` units in layer l+1 (0-based list, 1-based prose)."""

    units: tuple[int, ...]

    def __post_init__(self):
        if not self.units or min(self.units) < 1:
            raise ValueError(f"every layer needs at least one unit, got {self.units}")

    @property
    def num_layers(self) -> int:
        return len(self.units)

    @property
    def num_paths(self) -> int:
        """E = sum_l n_l n_{l+1} + n_L."""
        return sum(a * b for a, b in zip(self.units, self.units[1:])) + self.units[-1]

    def _start(self, l: int) -> int:
        return sum(a * b for a, b in zip(self.units[:l], self.units[1 : l + 1]))

    def links(self, v: torch.Tensor, l: int) -> torch.Tensor:
        """The (n_{l+1}, n_{l+2}) block of `v` (last dim E) for the links from layer l+1 to l+2 (0-based l)."""
        n, m = self.units[l], self.units[l + 1]
        s = self._start(l)
        return v[..., s : s + n * m].reshape(*v.shape[:-1], n, m)

    def output_links(self, v: torch.Tensor) -> torch.Tensor:
        """The n_L links from the last layer's units to the output."""
        return v[..., self.num_paths - self.units[-1] :]

    def unit_names(self) -> list[str]:
        """Units as "L<layer>.<index>", layers 1-based (L1 holds the encoders)."""
        return [f"L{l + 1}.{j}" for l, n in enumerate(self.units) for j in range(n)]

    # --- which units a decision uses -------------------------------------------------------------
    def used_units(self, on: torch.Tensor) -> list[list[bool]]:
        """Per layer, whether each unit has a chain of active links to the output (`on`: E booleans)."""
        on = on.detach().bool().cpu()
        used = [[False] * n for n in self.units]
        used[-1] = self.output_links(on).tolist()
        for l in range(self.num_layers - 2, -1, -1):
            block = self.links(on, l)
            used[l] = [any(bool(block[i, j]) and used[l + 1][j] for j in range(self.units[l + 1])) for i in range(self.units[l])]
        return used

    def used_mask(self, on: torch.Tensor) -> torch.Tensor:
        """`used_units` flattened in `unit_names` order, as a float 0/1 vector."""
        return torch.tensor([float(u) for layer in self.used_units(on) for u in layer])

    def has_complete_path(self, on: torch.Tensor) -> bool:
        """Whether some chain of active links runs from an encoder to the output."""
        return any(self.used_units(on)[0])

    # --- a hard decision from perturbed logits -----------------------------------------------------
    def best_path(self, scores: torch.Tensor) -> list[int]:
        """Indices of the links of the complete encoder -> output path with the highest total score
        (a max-sum recursion over layers; ties go to the lower unit index)."""
        scores = scores.detach().double().cpu()
        best = torch.zeros(self.units[0], dtype=torch.float64)  # best score of a path ending at each unit
        back: list[torch.Tensor] = []
        for l in range(self.num_layers - 1):
            total = best[:, None] + self.links(scores, l)  # (n_l, n_{l+1})
            best, arg = total.max(dim=0)
            back.append(arg)
        j = int((best + self.output_links(scores)).argmax())
        chosen = [self.num_paths - self.units[-1] + j]
        for l in range(self.num_layers - 2, -1, -1):
            i = int(back[l][j])
            chosen.append(self._start(l) + i * self.units[l + 1] + j)
            j = i
        return sorted(chosen)

    def decide(self, scores: torch.Tensor) -> torch.Tensor:
        """The hard decision 1[score > 0] per path (scores: logits plus logistic noise, so link e is on
        with probability sigmoid(logit_e): the Bernoulli of Eq. 3). A decision without any complete
        encoder -> output path would predict nothing; it gets the links of the best-scoring path
        switched on (`best_path`), the smallest change that makes it a network."""
        on = (scores.detach() > 0).to(scores.dtype)
        if not self.has_complete_path(on):
            on[self.best_path(scores)] = 1.0
        return on

    def describe(self, on: torch.Tensor) -> str:
        """A decision as bits, one group per layer of links: e.g. "1001|0110|11"."""
        bits = "".join("1" if b else "0" for b in on.detach().bool().cpu().tolist())
        cuts, start = [], 0
        for l in range(self.num_layers - 1):
            cuts.append(bits[start : start + self.units[l] * self.units[l + 1]])
            start += self.units[l] * self.units[l + 1]
        return "|".join([*cuts, bits[start:]])


def _mlp_unit(d_in: int, d_out: int, last: bool) -> nn.Module:
    return nn.Linear(d_in, d_out) if last else nn.Sequential(nn.Linear(d_in, d_out), nn.ReLU())


def _reset(module: nn.Module) -> None:
    for m in module.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()


def _flat_size(features: nn.Module, input_shape: tuple[int, ...]) -> int:
    with torch.no_grad():
        return int(features(torch.zeros(1, *input_shape)).flatten(1).shape[1])


class ModularNetwork(nn.Module):
    """The module pool: `units[0]` encoders, then MLP units; `widths[l]` is layer l+1's output width
    (the last layer outputs `num_classes` scores).

    Encoders: `cnn` = a copy of `features` (a CNN feature extractor, e.g. LeNet-5's two conv layers)
    followed by a linear layer to widths[0] and ReLU; `mlp` = flatten, linear, ReLU (for inputs no
    CNN fits). MLP units: linear + ReLU (linear only in the last layer). Unit (l, j) is built under
    its own seed derive_seed(seed, "fedmn-unit", l, j).
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, units: tuple[int, ...], hidden: tuple[int, ...],
                 encoder: EncoderKind, seed: int, features: nn.Module | None = None):
        super().__init__()
        if len(hidden) != len(units) - 1:
            raise ValueError(f"{len(units)} layers need {len(units) - 1} hidden widths, got {hidden}")
        if encoder == "cnn" and features is None:
            raise ValueError("cnn encoders copy a CNN feature extractor; none was given")
        self.layout = PathLayout(tuple(units))
        self.widths = (*hidden, num_classes)
        last = len(units) - 1
        flat = _flat_size(features, input_shape) if encoder == "cnn" else int(torch.tensor(input_shape).prod())
        layers = []
        for l, n in enumerate(units):
            layer = []
            for j in range(n):
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(derive_seed(seed, "fedmn-unit", l, j))
                    if l == 0:
                        body = copy.deepcopy(features) if encoder == "cnn" else nn.Identity()
                        _reset(body)
                        unit = nn.Sequential(body, nn.Flatten(), _mlp_unit(flat, self.widths[0], l == last))
                    else:
                        unit = _mlp_unit(self.widths[l - 1], self.widths[l], l == last)
                layer.append(unit)
            layers.append(nn.ModuleList(layer))
        self.units = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Class scores for `x` through the architecture that the path variables `v` (E values in [0, 1];
        hard 0/1 for a decision) select. With `v` requiring no gradient, unused units are not run."""
        lay = self.layout
        on = v.detach() != 0
        grad = v.requires_grad
        needed = [[True] * n for n in lay.units] if grad else lay.used_units(on)
        h = [unit(x) if needed[0][i] else None for i, unit in enumerate(self.units[0])]
        for l in range(1, lay.num_layers):
            w, active = lay.links(v, l - 1), lay.links(on, l - 1)
            h = [
                unit(self._combine(h, w[:, j], active[:, j], (x.shape[0], self.widths[l - 1]), x, grad)) if needed[l][j] else None
                for j, unit in enumerate(self.units[l])
            ]
        return self._combine(h, lay.output_links(v), lay.output_links(on), (x.shape[0], self.widths[-1]), x, grad)

    @staticmethod
    def _combine(h: list, w: torch.Tensor, active: torch.Tensor, shape: tuple[int, int], like: torch.Tensor, grad: bool) -> torch.Tensor:
        """sum_i w_i h_i / max(sum_i w_i, 1); an inactive link's source enters detached (no gradient
        to its unit), and without gradient inactive links are skipped."""
        terms = [w[i] * (h[i] if active[i] else h[i].detach()) for i in range(len(h)) if h[i] is not None and (grad or active[i])]
        total = torch.stack(terms).sum(0) if terms else like.new_zeros(shape)
        return total / w.sum().clamp(min=1.0)


class RoutingHypernetwork(nn.Module):
    """The router: one logit per path from a summary of the client's joint distribution p(x, y).

    Per sample: a CNN embedding of x (conv 5x5 with `channels` maps and stride 2 floor(side / 14),
    so a 28x28 image gives 7x7 maps; ReLU; linear to `feature_dim`, ReLU; for a table's rows (F,): linear
    to `feature_dim`, ReLU) concatenated with an embedding of y (one-hot through a
    linear layer without bias, `label_dim`), L2-normalised; the summary is the mean of those vectors
    over the client's samples; a linear layer maps it to E logits (the authors' PolicyNet/policy_net.py,
    as docs/methods/fedmn.md states it). The router runs
    over the client's whole training set for every batch, so it is kept small: it needs a summary of
    the data's distribution, not the detail a classifier needs.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, num_paths: int, feature_dim: int, label_dim: int,
                 channels: int = 8):
        super().__init__()
        self.num_classes = num_classes
        if len(input_shape) == 1:  # a table's rows (F,): the features through one linear layer
            self.features = nn.Sequential(nn.Linear(input_shape[0], feature_dim), nn.ReLU())
        else:
            stride = 2 * max(1, min(input_shape[1:]) // 14)
            conv = nn.Sequential(nn.Conv2d(input_shape[0], channels, 5, stride=stride, padding=2), nn.ReLU(), nn.Flatten())
            self.features = nn.Sequential(*conv, nn.Linear(_flat_size(conv, input_shape), feature_dim), nn.ReLU())
        self.labels = nn.Linear(num_classes, label_dim, bias=False)
        self.head = nn.Linear(feature_dim + label_dim, num_paths)

    def sample_embeddings(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """(N, feature_dim + label_dim): each sample's normalised [embed(x); embed(y)]."""
        e = torch.cat([self.features(x), self.labels(F.one_hot(y, self.num_classes).to(x.dtype))], dim=1)
        return F.normalize(e, dim=1)

    def summary(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The router's input: the per-sample embeddings averaged over the client's data."""
        return self.sample_embeddings(x, y).mean(dim=0)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.head(self.summary(x, y))
