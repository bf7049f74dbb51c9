"""A plain multi-layer perceptron: the smallest model the planner and runtime handle."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from planner.models.configs import MLPConfig
from planner.models.stack import Stack


class MLPBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.linear(x))


class MLPModel(Stack):
    """Features [batch, inputs] -> class logits."""

    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Linear(cfg.inputs, cfg.hidden)
        self.layers = nn.ModuleList(MLPBlock(cfg.hidden) for _ in range(cfg.layers))
        self.head = nn.Linear(cfg.hidden, cfg.classes)

    @staticmethod
    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), labels)

    def example_batch(self, batch: int, seq_len: int | None, device: torch.device | str,
                      generator: torch.Generator | None = None):
        if torch.device(device).type == "meta":
            return ((torch.zeros(batch, self.cfg.inputs, device=device),),
                    torch.zeros(batch, dtype=torch.long, device=device))
        x = torch.randn(batch, self.cfg.inputs, generator=generator).to(device)
        y = torch.randint(0, self.cfg.classes, (batch,), generator=generator).to(device)
        return (x,), y
