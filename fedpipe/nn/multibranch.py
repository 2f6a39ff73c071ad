"""Multi-branch layers of pFedMB (Mori et al., "Personalized Federated Learning with Multi-branch
Architecture", 2023, Section IV-A), the branched form of a base model's parameters, and the
merge that collapses a client's branches to the base model.

A branched layer l holds B copies W_{1,l} .. W_{B,l} of its weight and a client-specific weight
vector alpha_l on the simplex (alpha_{b,l} >= 0, sum_b alpha_{b,l} = 1):

    W_l = sum_b alpha_{b,l} W_{b,l}                                   (Eq. 1)
    W_l * x = sum_b alpha_{b,l} (W_{b,l} * x)                         (Eq. 2)

Bias: a branch is the whole affine layer, weight and bias, so every branch has its own bias and
the layer outputs sum_b alpha_b (W_b * x + c_b) = W_l * x + sum_b alpha_b c_b: the bias merges by
Eq. 1 like the weight (the paper speaks of weight matrices only; branching the bias keeps each
branch a complete layer and keeps Eq. 2 exact).

Parameters travel as plain tensors: a branched tensor keeps its base name and gains a leading
branch dimension (``features.0.weight``: (6, 1, 5, 5) -> (B, 6, 1, 5, 5)); tensors of layers that
are not branched keep their shape. alpha is one (A, B) tensor: A = 1 when every layer shares one
alpha (the paper's Section V-B), A = number of branched layers otherwise.

`MultiBranchConv2d` / `MultiBranchLinear` compute Eq. 2 literally, branch by branch. Training
and evaluation instead run the base model on the merged weights (Eq. 1): the same function, since
the layer is linear in its weights, with the same gradients (dL/dW_b = alpha_b dL/dW_l), and the
cost of one branch. The modules are the reference the tests hold the merge against.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from fedpipe.errors import ConfigError
from fedpipe.nn.networks import names_under
from fedpipe.seeding import derive_seed

Params = dict[str, torch.Tensor]
BRANCHABLE = (nn.Conv2d, nn.Linear)  # the paper's "linear layers": convolutional and fully connected


class MultiBranchLinear(nn.Module):
    """A fully connected layer split into B branches: y = sum_b alpha_b (x W_b^T + c_b) (Eq. 2)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, alpha: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight)  # (B, out, in)
        self.bias = None if bias is None else nn.Parameter(bias)  # (B, out)
        self.register_buffer("alpha", alpha)  # (B,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(
            self.alpha[b] * F.linear(x, self.weight[b], None if self.bias is None else self.bias[b])
            for b in range(self.weight.shape[0])
        )


class MultiBranchConv2d(nn.Module):
    """A convolution split into B branches: y = sum_b alpha_b (W_b * x + c_b) (Eq. 2), with the
    stride, padding, dilation and groups of the convolution it replaces."""

    def __init__(self, conv: nn.Conv2d, weight: torch.Tensor, bias: torch.Tensor | None, alpha: torch.Tensor):
        super().__init__()
        if conv.padding_mode != "zeros":
            raise ValueError("multi-branch convolutions support padding_mode='zeros' only")
        self.stride, self.padding, self.dilation, self.groups = conv.stride, conv.padding, conv.dilation, conv.groups
        self.weight = nn.Parameter(weight)  # (B, out, in / groups, kh, kw)
        self.bias = None if bias is None else nn.Parameter(bias)  # (B, out)
        self.register_buffer("alpha", alpha)  # (B,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(
            self.alpha[b] * F.conv2d(x, self.weight[b], None if self.bias is None else self.bias[b],
                                     self.stride, self.padding, self.dilation, self.groups)
            for b in range(self.weight.shape[0])
        )


def project_onto_simplex(v: torch.Tensor) -> torch.Tensor:
    """Euclidean projection of each row of `v` onto the probability simplex {a : a >= 0, sum a = 1}
    (the sort-based algorithm of Wang & Carreira-Perpinan, arXiv:1309.1541, Algorithm 1)."""
    u, _ = torch.sort(v, dim=-1, descending=True)
    excess = u.cumsum(-1) - 1  # sum of the k largest, minus 1
    k = torch.arange(1, v.shape[-1] + 1, device=v.device, dtype=v.dtype)
    support = (u - excess / k > 0).sum(-1, keepdim=True)  # rho: how many entries stay positive (>= 1)
    theta = excess.gather(-1, support - 1) / support.to(v.dtype)
    return (v - theta).clamp_min(0)


@dataclass(frozen=True)
class BranchLayout:
    """Which layers of a base model are branched, into how many branches, and which alpha row each uses."""

    num_branches: int  # B
    layers: tuple[str, ...]  # branched module names, in model order
    tensors: dict[str, tuple[str, ...]]  # branched module name -> its parameter names (weight, bias)
    shared_alpha: bool  # one alpha for every layer (A = 1) instead of one per layer

    @classmethod
    def of(cls, model: nn.Module, num_branches: int, branched: str | tuple[str, ...] = "all", shared_alpha: bool = False) -> BranchLayout:
        """The layout for `model`: every Conv2d / Linear (`branched="all"`) or those whose module
        name is, or lies under, one of the given prefixes (e.g. ("features", "head"))."""
        layers = []
        for name, module in model.named_modules():
            if not isinstance(module, BRANCHABLE):
                continue
            layers.append(name)
        if branched != "all":
            layers = names_under(layers, branched, "method.branched_layers (prefixes of Conv2d / Linear layers)")
        if not layers:
            raise ConfigError(f"pFedMB branches Conv2d and Linear layers, and {type(model).__name__} has none; "
                              "use a model built from them.")
        tensors = {name: tuple(f"{name}.{p}" for p, _ in model.get_submodule(name).named_parameters(recurse=False)) for name in layers}
        return cls(num_branches, tuple(layers), tensors, shared_alpha)

    @staticmethod
    def unbranchable(model: nn.Module) -> list[str]:
        """Layers holding trainable parameters of a type pFedMB does not branch (not Conv2d / Linear):
        "name (Type)" strings. Their parameters stay single, shared by the branches, averaged by sample count."""
        return [f"{name or 'the model itself'} ({type(m).__name__})" for name, m in model.named_modules()
                if not isinstance(m, BRANCHABLE) and any(True for _ in m.parameters(recurse=False))]

    # --- alpha ----------------------------------------------------------------------------------
    @property
    def alpha_rows(self) -> int:
        """A: rows of the alpha tensor (1 shared, else one per branched layer)."""
        return 1 if self.shared_alpha else len(self.layers)

    @property
    def alpha_labels(self) -> list[str]:
        return ["all layers"] if self.shared_alpha else list(self.layers)

    def row_of(self, layer: str) -> int:
        return 0 if self.shared_alpha else self.layers.index(layer)

    def uniform_alpha(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Every branch weighted 1/B (the paper's initial alpha: "the same value for all branches")."""
        return torch.full((self.alpha_rows, self.num_branches), 1.0 / self.num_branches, device=device)

    # --- parameters -----------------------------------------------------------------------------
    @property
    def branched_names(self) -> set[str]:
        return {n for names in self.tensors.values() for n in names}

    def is_branched(self, params: Params, base_shapes: dict[str, torch.Size]) -> bool:
        """Whether `params` already has the branch dimension (else it has the base model's shapes)."""
        n = self.tensors[self.layers[0]][0]
        if params[n].shape == base_shapes[n]:
            return False
        if params[n].shape != (self.num_branches, *base_shapes[n]):
            raise ValueError(f"{n} has shape {tuple(params[n].shape)}: neither the base {tuple(base_shapes[n])} nor {self.num_branches} branches of it")
        return True

    def branch(self, model: nn.Module, base: Params, seed: int, init: str = "centred") -> Params:
        """Branched parameters from a base model's. Branches must differ: identical branches get
        identical updates and alpha-gradients and never specialise. N_1 .. N_B are independent draws
        of the layer's own initialisation (`reset_parameters`: PyTorch's default for Conv2d / Linear)
        under generators seeded by (seed, branch, layer), and

        - init="centred": W_b = W + N_b - mean_c N_c. Branches differ from each other exactly as
          independent initialisations do, and their uniform-alpha merge (Eq. 1 at alpha = 1/B, the
          starting point) is the base model W itself, at its own scale.
        - init="independent": W_1 = W, W_b = N_b for b > 1. The uniform-alpha merge averages B
          independent draws, so every layer starts ~1/sqrt(B) too small and a deep net may not
          learn at all (mnist5k, LeNet-5, per-layer alpha, B = 2: the loss stayed at ln 10).

        Either way B = 1 is the base model exactly. Unbranched tensors are kept."""
        if init not in ("centred", "independent"):
            raise ValueError(f"unknown branch init {init!r}: centred or independent")
        out = dict(base)
        for layer in self.layers:
            draws = {n: [] for n in self.tensors[layer]}
            for b in range(self.num_branches):
                fresh = copy.deepcopy(model.get_submodule(layer)).to("cpu")
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(derive_seed(seed, "pfedmb-branch", b, layer))
                    fresh.reset_parameters()
                for p, t in fresh.named_parameters(recurse=False):
                    n = f"{layer}.{p}"
                    draws[n].append(t.detach().to(base[n].device, base[n].dtype))
            for n, drawn in draws.items():
                if self.num_branches == 1:
                    out[n] = base[n].unsqueeze(0)
                elif init == "centred":
                    noise = torch.stack(drawn)
                    out[n] = base[n] + (noise - noise.mean(0))
                else:
                    out[n] = torch.stack([base[n], *drawn[1:]])
        return out

    def merge(self, branches: Params, alpha: torch.Tensor) -> Params:
        """The single-branch parameters W_l = sum_b alpha_{b,l} W_{b,l} (Eq. 1) for alpha of shape
        (A, B); unbranched tensors pass through. The base model on these equals the multi-branch
        model (Eq. 2) and costs what the base model costs."""
        out = dict(branches)
        for layer in self.layers:
            a = alpha[self.row_of(layer)]
            for n in self.tensors[layer]:
                w = branches[n]
                out[n] = (a.reshape(-1, *([1] * (w.dim() - 1))) * w).sum(0)
        return out

    def multibranch_model(self, model: nn.Module, branches: Params, alpha: torch.Tensor) -> nn.Module:
        """A copy of `model` whose branched layers are `MultiBranchConv2d` / `MultiBranchLinear`
        computing Eq. 2 branch by branch: the reference the merged model is checked against."""
        mb = copy.deepcopy(model)
        for layer in self.layers:
            module = model.get_submodule(layer)
            a = alpha[self.row_of(layer)].detach().clone()
            weight = branches[f"{layer}.weight"].detach().clone()
            bias = branches[f"{layer}.bias"].detach().clone() if f"{layer}.bias" in branches else None
            if isinstance(module, nn.Conv2d):
                mb.set_submodule(layer, MultiBranchConv2d(module, weight, bias, a))
            else:
                mb.set_submodule(layer, MultiBranchLinear(weight, bias, a))
        with torch.no_grad():
            own = dict(mb.named_parameters())
            for n, t in branches.items():
                if n not in self.branched_names:
                    own[n].copy_(t)
        return mb

