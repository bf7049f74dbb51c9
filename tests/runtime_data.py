"""A data hook for the runtime tests, as a user would write one (see planner/runtime/data.py):
samples [start, stop) of step `step`'s global batch, the same on every call."""

import torch

VOCAB = 512


def tokens(step: int, start: int, stop: int, *, seq_len: int, seed: int):
    rows = []
    for sample in range(start, stop):
        g = torch.Generator().manual_seed(seed * 7919 + step * 1009 + sample)
        rows.append(torch.randint(0, VOCAB, (seq_len + 1,), generator=g))
    ids = torch.stack(rows)
    return (ids[:, :-1],), ids[:, 1:]


class Residual(torch.nn.Module):
    """Blocks joined by a skip connection outside them: not a chain of layers."""

    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.relu(layer(x))
        return x

    @staticmethod
    def loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(out, targets)

    def example_batch(self, batch: int, seq_len, device):
        return (torch.zeros(batch, 16, device=device),), torch.zeros(batch, 16, device=device)


def residual_model(width: int = 16, depth: int = 3) -> Residual:
    return Residual(width, depth)


def floats(step: int, start: int, stop: int, *, seq_len: int, seed: int):
    """Token inputs as floats (the model's embedding takes integer ids)."""
    ids, targets = tokens(step, start, stop, seq_len=seq_len, seed=seed)
    return (ids[0].float(),), targets


def lists(step: int, start: int, stop: int, *, seq_len: int, seed: int):
    ids, targets = tokens(step, start, stop, seq_len=seq_len, seed=seed)
    return (ids[0].tolist(),), targets


def no_targets(step: int, start: int, stop: int, *, seq_len: int, seed: int):
    return tokens(step, start, stop, seq_len=seq_len, seed=seed)[0], None


def longer(step: int, start: int, stop: int, *, seq_len: int, seed: int):
    return tokens(step, start, stop, seq_len=seq_len + 7, seed=seed)


def past_vocab(step: int, start: int, stop: int, *, seq_len: int, seed: int):
    """Token ids of a tokenizer with a larger vocabulary than the model's (512 + 88)."""
    (ids,), targets = tokens(step, start, stop, seq_len=seq_len, seed=seed)
    ids = ids.clone()
    ids[0, 1] = VOCAB + 88
    return (ids,), targets


def negative_ids(step: int, start: int, stop: int, *, seq_len: int, seed: int):
    (ids,), targets = tokens(step, start, stop, seq_len=seq_len, seed=seed)
    ids = ids.clone()
    ids[-1, -1] = -3
    return (ids,), targets


def past_classes(step: int, start: int, stop: int, *, seq_len: int, seed: int):
    """Next-token targets of a tokenizer with a larger vocabulary than the model's output
    (512 + 88), beside input ids the model's table holds."""
    inputs, targets = tokens(step, start, stop, seq_len=seq_len, seed=seed)
    targets = targets.clone()
    targets[1, 2] = VOCAB + 88
    return inputs, targets


def negative_targets(step: int, start: int, stop: int, *, seq_len: int, seed: int):
    inputs, targets = tokens(step, start, stop, seq_len=seq_len, seed=seed)
    targets = targets.clone()
    targets[0, 0] = -1
    return inputs, targets


def ignored_targets(step: int, start: int, stop: int, *, seq_len: int, seed: int):
    """Targets the loss skips (-100, cross-entropy's ignore index) on the first half of
    every sample, like a prompt the model is not trained to produce."""
    inputs, targets = tokens(step, start, stop, seq_len=seq_len, seed=seed)
    targets = targets.clone()
    targets[:, : seq_len // 2] = -100
    return inputs, targets


def narrow(step: int, start: int, stop: int, *, seq_len: int, seed: int):
    """Token ids and targets as int32 and int16, as numpy tokenizers and compact data
    files give them."""
    inputs, targets = tokens(step, start, stop, seq_len=seq_len, seed=seed)
    return (inputs[0].int(),), targets.short()




def teacher(step: int, start: int, stop: int, *, seq_len, seed: int):
    """A task mlp-small (128 inputs, 10 classes) learns in a few dozen steps: Gaussian
    inputs, the class given by the signs of the first two (four classes of the ten)."""
    rows = []
    for sample in range(start, stop):
        g = torch.Generator().manual_seed(seed * 7919 + step * 1009 + sample)
        rows.append(torch.randn(128, generator=g))
    inputs = torch.stack(rows)
    return (inputs,), (inputs[:, 0] > 0).long() + 2 * (inputs[:, 1] > 0).long()
