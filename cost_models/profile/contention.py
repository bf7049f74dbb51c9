"""How computing and a collective in flight slow each other on a device: the last part
of `planner profile`'s communication benchmark (`comm.measure_comm`), in its workers.

A sync that overlaps backward (the plan's `training.sync.overlap`) runs its all-reduces
while backward computes. On a GPU the collective's kernels take streaming multiprocessors
from the GEMMs beside them; on a CPU a rank's gloo threads (the sums, the copies, the
kernel's TCP work) take time on the core its backward runs on. Neither the link nor the
compute alone shows it, so it is measured: every worker (a CPU worker on a core of its
own where there are enough, as `planner launch --cpus` runs a rank) times a matmul of
`SHAPE` alone and a train of all-reduces of `PROBE_BYTES` alone, then both at once: the
all-reduces one after another, each issued as the one before lands, and the matmuls
while they are in flight. Rank 0 keeps

    compute_slowdown     matmul seconds with an all-reduce in flight / alone - 1
    collective_slowdown  all-reduce seconds beside the matmuls / alone - 1

each at least 0 (contention only takes time: a faster figure is noise), which the step
model prices for an overlapped sync (`planner.solver.step.Contention`).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cost_models.profile.timing import Clock

PROBE_BYTES = 4 * 2**20  # a bandwidth-bound all-reduce (`calibration.BIG_MESSAGE`)
SHAPE = {"cpu": 256, "cuda": 4096}  # the matmul's side: calls far shorter than the all-reduce
MeanSeconds = Callable[[Callable[[], object]], float]  # mean seconds per call, every rank alike


@dataclass(frozen=True)
class Overlapped:
    """Mean seconds of a matmul made wholly while an all-reduce was in flight, and of an
    all-reduce made beside matmuls."""

    compute: float
    collective: float


def pin_to_own_cores(rank: int, world: int) -> None:
    """Confine every thread of this process to its share of the cores it may use (rank r
    the r-th share), where each rank can have one at least: a CPU rank's compute and its
    gloo threads then share its core, as a pinned launch runs them."""
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // world
    if share < 1:
        return
    mine = set(cores[rank * share:(rank + 1) * share])
    for thread in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(thread), mine)


def measure_contention(device: torch.device, clock: Clock, mean_seconds: MeanSeconds,
                       budget_s: float) -> dict:
    """The slowdowns (see the module docstring); `mean_seconds` times a call alone on
    every rank alike (`comm._mean_seconds`), and as many all-reduces as rank 0's take
    about `budget_s` alone (3 at least, the same count on every rank) run beside the
    matmuls."""
    side = SHAPE[device.type]
    left, right = torch.randn(side, side, device=device), torch.randn(side, side, device=device)
    out = torch.empty(side, side, device=device)
    buffer = torch.zeros(PROBE_BYTES // 4, device=device)

    def matmul() -> None:
        torch.mm(left, right, out=out)

    compute_alone = mean_seconds(matmul)
    collective_alone = mean_seconds(lambda: dist.all_reduce(buffer))
    calls = torch.tensor([max(3.0, budget_s / collective_alone)], device=device)
    dist.broadcast(calls, 0)
    both = overlapped(matmul, lambda: dist.all_reduce(buffer, async_op=True),
                      int(calls.item()), clock)
    compute = both.compute or compute_alone  # (no matmul fit inside an all-reduce)
    return {"bytes": PROBE_BYTES, "matmul_side": side, "compute_alone": compute_alone,
            "compute_overlapped": compute, "collective_alone": collective_alone,
            "collective_overlapped": both.collective,
            "compute_slowdown": max(0.0, compute / compute_alone - 1),
            "collective_slowdown": max(0.0, both.collective / collective_alone - 1)}


def overlapped(compute: Callable[[], object], start: Callable[[], dist.Work], calls: int,
               clock: Clock) -> Overlapped:
    """Run `calls` collectives (`start` issues one) one after another, each issued after
    the compute call during which the one before landed, computing all the while; the
    mean seconds of a compute call that a collective was in flight for from start to end
    (issued before it, not landed after it), and of a collective, from its issue to its
    landing."""
    dist.barrier()
    clock.sync()
    computed: list[float] = []
    spans: list[float] = []
    for _ in range(calls):
        issued = time.perf_counter()
        landed: list[float] = []
        work = start()
        work.get_future().then(lambda _, landed=landed: landed.append(time.perf_counter()))
        while True:
            begin = clock.mark()
            compute()
            end = clock.mark()
            if work.is_completed():
                break
            computed.append(clock.seconds(begin, end))
        work.wait()
        spans.append((landed[0] if landed else time.perf_counter()) - issued)
    clock.sync()
    return Overlapped(compute=statistics.fmean(computed) if computed else 0.0,
                      collective=statistics.fmean(spans))
