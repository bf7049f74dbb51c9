"""Data hooks for the fault tests (see planner/runtime/data.py): samples that turn NaN at
given steps, a hook that is not deterministic, and one that asks its own rank to stop."""

import os
import signal
import time

import torch

FEATURES, CLASSES = 128, 10  # mlp-small's inputs and classes
VOCAB = 512  # gpt-tiny's


def _features(step: int, start: int, stop: int, seed: int):
    g = torch.Generator().manual_seed(seed * 7919 + step)
    x = torch.randn(stop, FEATURES, generator=g)[start:stop]
    y = torch.randint(0, CLASSES, (stop,), generator=g)[start:stop]
    return x, y


def nan_at_step_2(step: int, start: int, stop: int, *, seq_len, seed: int):
    """mlp-small features, all NaN in step 2 (index 1) only."""
    x, y = _features(step, start, stop, seed)
    return ((torch.full_like(x, float("nan")) if step == 1 else x),), y


def nan_from_step_2(step: int, start: int, stop: int, *, seq_len, seed: int):
    """mlp-small features, all NaN from step 2 on."""
    x, y = _features(step, start, stop, seed)
    return ((torch.full_like(x, float("nan")) if step >= 1 else x),), y


def _tokens(step: int, start: int, stop: int, seq_len: int, seed: int):
    g = torch.Generator().manual_seed(seed * 7919 + step)
    ids = torch.randint(0, VOCAB, (stop, seq_len + 1), generator=g)[start:stop]
    return (ids[:, :-1],), ids[:, 1:]


def unstable(step: int, start: int, stop: int, *, seq_len: int, seed: int):
    """gpt-tiny tokens from the global generator: different on every call."""
    ids = torch.randint(0, VOCAB, (stop - start, seq_len + 1))
    return (ids[:, :-1],), ids[:, 1:]


def stop_in_step_3(step: int, start: int, stop: int, *, seq_len: int, seed: int):
    """gpt-tiny tokens; while giving step 3's, sends its own process SIGUSR1 (what SLURM's
    --signal sends before a time limit)."""
    if step == 2:
        os.kill(os.getpid(), signal.SIGUSR1)
    return _tokens(step, start, stop, seq_len, seed)


def gated(step: int, start: int, stop: int, *, seq_len: int, seed: int):
    """gpt-tiny tokens; from step 4 on, only once the file FAULT_GATE names exists, so a
    test can fault a run that certainly stands at step 3 (waits at most 10 minutes)."""
    gate = os.environ["FAULT_GATE"]
    waited = 0
    while step >= 3 and not os.path.exists(gate):
        if waited > 12_000:
            raise TimeoutError(f"{gate} never appeared")
        time.sleep(0.05)
        waited += 1
    return _tokens(step, start, stop, seq_len, seed)
