"""Timing work on a device: wall time on the CPU, CUDA events on a GPU."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

_MIN_SAMPLE = 1e-3  # seconds; shorter calls are timed in batches


class Clock:
    """Marks points in a device's work and measures the seconds between two marks.

    On CUDA a mark is an event recorded on the device's current stream, so the time
    is the GPU's, not the time the host took to queue the work.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def best_seconds(fn: Callable[[], object], clock: Clock, *, repeats: int,
                 budget: float) -> float:
    """The best time of one call of `fn`, after a warm-up call: up to `repeats` samples,
    fewer once `budget` seconds are spent. Calls shorter than a millisecond are timed
    in batches (one sample = the batch time / its size)."""
    fn()
    clock.sync()
    deadline = time.perf_counter() + budget
    start = clock.mark()
    fn()
    samples = [clock.seconds(start, clock.mark())]
    batch = max(1, int(_MIN_SAMPLE / max(samples[0], 1e-9)))
    while len(samples) < repeats and time.perf_counter() < deadline:
        start = clock.mark()
        for _ in range(batch):
            fn()
        samples.append(clock.seconds(start, clock.mark()) / batch)
    return min(samples)


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    """Let CUDA fp32 matmuls use TF32 tensor cores (or forbid it) inside the block."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
