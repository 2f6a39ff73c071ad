"""The model and the local training: the 2NN of McMahan et al. (784-200-200-C, as fedpipe's `twonn`), trained with
SGD as fedpipe's ClientTrainer does (momentum, weight decay, lr * lr_decay^(round - 1), shuffled mini-batches), on a
site folder written by `fedpipe.federation.sites.export_sites` (data.safetensors: train_x, train_y, ...)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn


class TwoNN(nn.Module):
    def __init__(self, input_size: int, num_classes: int, hidden: int = 200):
        super().__init__()
        # the same parameter names and shapes as fedpipe's TwoNN (fedpipe/nn/networks.py)
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(input_size, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def load_site(site_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    t = load_file(str(Path(site_dir) / "data.safetensors"))
    return t["train_x"], t["train_y"]


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, rc, server_round: int, seed: int) -> float:
    """Local epochs of SGD on (x, y); returns the mean training loss of the last epoch."""
    lr = float(rc["lr"]) * float(rc["lr-decay"]) ** (server_round - 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=float(rc["momentum"]), weight_decay=float(rc["weight-decay"]))
    gen = torch.Generator().manual_seed(seed)
    batch, total, seen = int(rc["batch-size"]), 0.0, 0
    model.train()
    for _ in range(int(rc["local-epochs"])):
        total, seen = 0.0, 0
        for idx in torch.randperm(len(y), generator=gen).split(batch):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            total, seen = total + loss.item() * len(idx), seen + len(idx)
    return total / max(seen, 1)
