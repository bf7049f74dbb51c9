"""The shape most zoo models share: an embedding, a list of blocks, a head."""

from __future__ import annotations

import torch
from torch import nn


class Stack(nn.Module):
    """forward = head(blocks(embed(x))); subclasses set `embed`, `layers` and `head`.

    Pipelines split on exactly these modules (one stage keeps a contiguous run)."""

    embed: nn.Module
    layers: nn.ModuleList
    head: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.layers:
            h = block(h)
        return self.head(h)
