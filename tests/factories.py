"""Model factories the tests load by `tests.factories:NAME`, like a user's package."""

import torch
from torch import nn


class TinyMLP(nn.Module):
    def __init__(self, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def mlp(width: int = 32, depth: int = 3):
    """A module plus an example-input factory."""
    return TinyMLP(width, depth), lambda batch, seq_len, device: (
        torch.zeros(batch, width, device=device),)


def named(name: str = "mlp", width: int = 32, depth: int = 3):
    """`mlp` with a name, which the model's description shows (`name=...`)."""
    return mlp(width, depth)


def module_only():
    return TinyMLP()


def raises():
    raise ValueError("no such checkpoint shape")


def not_a_module():
    return {"weights": 1}


class Branchy(nn.Module):
    """Data-dependent control flow: neither fx nor export on meta can trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gate(x)
        if y.sum() > 0:
            return y * 2
        return y


def branchy():
    return Branchy(), lambda batch, seq_len, device: (torch.zeros(batch, 8, device=device),)


class SeqMLP(TinyMLP):
    """Inputs from `example_batch`, which needs a sequence length."""

    def example_batch(self, batch: int, seq_len: int, device):
        x = torch.zeros(batch, seq_len, 32, device=device)
        return (x,), x


def needs_seq_len():
    return SeqMLP()


def inputs_raise():
    def inputs(batch, seq_len, device):
        raise KeyError("no data here")

    return TinyMLP(), inputs
