"""Data hooks of variable-length samples for the data-aware tests, as a user would write
one (see planner/runtime/data.py): each sample's token ids and next-token targets, its
length drawn from a heavy-tailed (lognormal) distribution, the same on every call."""

import math
import random

import torch

VOCAB = 512


def sample_length(step: int, sample: int, *, seq_len: int, seed: int) -> int:
    rng = random.Random(seed * 7919 + step * 1009 + sample)
    return min(seq_len, max(2, round(rng.lognormvariate(math.log(seq_len / 6), 1.0))))


def variable(step: int, start: int, stop: int, *, seq_len: int, seed: int):
    """Samples [start, stop) of the step: one tensor of token ids and one of targets per
    sample, in lists."""
    inputs, targets = [], []
    for sample in range(start, stop):
        length = sample_length(step, sample, seq_len=seq_len, seed=seed)
        g = torch.Generator().manual_seed(seed * 7919 + step * 1009 + sample)
        ids = torch.randint(0, VOCAB, (length + 1,), generator=g)
        inputs.append(ids[:-1])
        targets.append(ids[1:])
    return inputs, targets


def padded(step: int, start: int, stop: int, *, seq_len: int, seed: int):
    """The same samples stacked: padded on the right to seq_len, targets the loss
    skips (-100) on the padding."""
    inputs, targets = variable(step, start, stop, seq_len=seq_len, seed=seed)
    ids = torch.zeros(len(inputs), seq_len, dtype=torch.long)
    wanted = torch.full((len(inputs), seq_len), -100, dtype=torch.long)
    for row, (tokens, target) in enumerate(zip(inputs, targets, strict=True)):
        ids[row, :len(tokens)] = tokens
        wanted[row, :len(target)] = target
    return (ids,), wanted
