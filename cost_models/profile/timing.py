"""Timing work on a device: wall time on the CPU, CUDA events on a GPU."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

_MIN_SAMPLE = 1e-3  # seconds; shorter calls are timed in batches
MIN_SAMPLES = 3  # samples of each measurement, however long its calls: a median needs them


class Clock:
    """Marks points in a device's work and measures the seconds between two marks.

    On CUDA a mark is an event recorded on the device's current stream, so the time
    is the GPU's, not the time the host took to queue the work. `timer` is the host's
    clock (for the CPU's marks and for time budgets); tests give a fake one.
    """

    def __init__(self, device: torch.device,
                 timer: Callable[[], float] = time.perf_counter) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.timer = timer

    def mark(self) -> Any:
        if not self.cuda:
            return self.timer()
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


@dataclass(frozen=True)
class Samples:
    """Seconds of one call of some work, one sample after another (warm-up excluded).

    Matmul and copy figures are the median: on a shared machine a sample now and then
    is slowed by other work (a scheduler tick stalls one of the threads a matmul waits
    for), and the median ignores a few such samples where a mean would not (layer
    steps keep the fastest instead, see `layers`). How far the middle half of the
    samples lies apart (`spread`, the upper quartile over the lower) says whether the
    figure can be trusted: a lone slow sample leaves it at 1, and it grows only when
    slow samples are common enough to move the median.
    """

    seconds: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def middle_half(self) -> tuple[float, float]:
        """(lower quartile, upper quartile) of the seconds."""
        if len(self.seconds) < 2:
            return self.seconds[0], self.seconds[0]
        lower, _, upper = statistics.quantiles(self.seconds, n=4, method="inclusive")
        return lower, upper

    @property
    def spread(self) -> float:
        lower, upper = self.middle_half
        return upper / lower if lower > 0 else 1.0

    def record(self) -> dict:
        """The samples and their spread, as a profile's sweep point carries them."""
        return {"samples": list(self.seconds), "spread": self.spread}


Sampler = Callable[..., Samples]  # (work, clock, *, repeats, budget): `sample_seconds`


def sample_seconds(fn: Callable[[], object], clock: Clock, *, repeats: int,
                   budget: float) -> Samples:
    """Seconds of one call of `fn`: `repeats` samples, fewer (but at least
    `MIN_SAMPLES`) once `budget` seconds are spent. A warm-up call comes first and a
    pilot call after it sizes the batches: calls shorter than a millisecond are timed
    in batches (one sample = the batch time / its size), and the pilot is no sample,
    as a lone call pays overheads that a batch shares out."""
    fn()
    clock.sync()
    start = clock.mark()
    fn()
    pilot = clock.seconds(start, clock.mark())
    batch = max(1, int(_MIN_SAMPLE / max(pilot, 1e-9)))
    deadline = clock.timer() + budget
    samples: list[float] = []
    while len(samples) < repeats and (len(samples) < MIN_SAMPLES or clock.timer() < deadline):
        start = clock.mark()
        for _ in range(batch):
            fn()
        samples.append(clock.seconds(start, clock.mark()) / batch)
    return Samples(tuple(samples))


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    """Let CUDA fp32 matmuls use TF32 tensor cores (or forbid it) inside the block."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
