"""Gradient sums that overlap backward (the plan's `training.sync.overlap`): DDP's
buckets, beside the pipeline schedule.

Without overlap every rank sums its gradients after its schedule's last backward
(`parallel.GradientSum`: one flat all-reduce per set of holders, `AfterBackward`). With
it (`Overlapped`), each plain bucket of `GradientSum` (holders of one tensor-parallel
degree, parameters sharded over the tp ranks or on one rank: see `parallel._Bucket`) is
cut into buckets of at most BUCKET_BYTES, parameters in reverse model order (the order
backward makes their gradients in), and a bucket's all-reduce starts as soon as
backward has made its last gradient:

  * a parameter's gradient is final once backward has accumulated it as often as the
    step does: once per micro-batch for every chunk of this rank whose layers read it
    (`accumulations`), counted by a post-accumulate-grad hook on the parameter;
  * buckets start in one order on every rank (by the last model position of their
    parameters, which backward reaches first), each only after those before it, so
    ranks that share groups issue their collectives in the same order;
  * the sums run on process groups of their own (`sync_groups`), never queued behind
    or ahead of a pipeline send or a tensor-parallel collective of the backward;
  * after the schedule, the buckets that have not started start (a parameter the
    step gave no gradient leaves its bucket waiting), every sum is waited for and
    written back, and the other buckets (holders of mixed degrees, parameters each tp
    rank holds whole: their sums use the tp group, which backward uses too; sums a plan
    written by hand makes hierarchical, `StagePlan.grad_sync`: the solver picks rings
    where sums overlap) are summed as without overlap.

FSDP2 stages keep FSDP's own reduce-scatters, which overlap backward already. An
accumulation after its bucket started would leave the sum stale: the step stops with
an error naming the parameter instead.

Each step's sync is timed (`SyncTiming`): exposed, from the end of the schedule to the
end of the last sum (what the step waits for); in flight, how long any of the step's sums
was under way, overlapped or not (without overlap, the same).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from planner.errors import PlannerError
from planner.runtime.parallel import (
    GradientSum,
    Topology,
    _Bucket,
    _local,
    flat_gradients,
    sum_bucket,
    write_gradients,
)
from planner.runtime.stage import ModelInfo
from planner.types import StagePlan

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


@dataclass(frozen=True)
class SyncTiming:
    """One step's gradient sync, in seconds: `exposed`, after the schedule's last
    backward until the sums were done; `in_flight`, while any sum was under way; and
    its all-reduces: how many, and how many of them backward started."""

    exposed: float
    in_flight: float
    sums: int = 0
    started_in_backward: int = 0

    def then(self, seconds: float) -> SyncTiming:
        """This sync followed by one of `seconds` after the optimizer step (the
        averaging of the sync modes, `sync_modes.py`)."""
        return dataclasses.replace(self, exposed=self.exposed + seconds,
                                   in_flight=self.in_flight + seconds)


def sync_groups(topo: Topology, rank: int) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """Process groups of their own for the gradient sums, by their ranks: every rank
    creates each, in one order (new_group is collective); those this rank is in."""
    wanted: dict[tuple[int, ...], None] = {}
    for keys in sorted({tuple(sorted(keys)) for keys in topo.holders.values()}):
        if len(keys) > 1:
            wanted.update(dict.fromkeys(topo.sum_groups(keys)))
    out = {}
    for ranks in wanted:
        group = dist.new_group(list(ranks))
        if rank in ranks:
            out[ranks] = group
    return out


def accumulations(info: ModelInfo, stage: StagePlan, microbatches: int) -> Counter[str]:
    """How often one step's backward accumulates each parameter's gradient on a rank of
    `stage`: once per micro-batch for every chunk whose layers read it."""
    counts: Counter[str] = Counter()
    for start, end in stage.chunks:
        for name in frozenset().union(*info.uses[start:end]):
            counts[name] += microbatches
    return counts


def _plain(bucket: _Bucket) -> bool:
    """Whether a bucket's sum is one all-reduce among its holders (no tp group, not
    hierarchical: a `Hierarchy`'s three steps run after the schedule)."""
    return (not bucket.gather and bucket.slices == 1
            and isinstance(bucket.group, dist.ProcessGroup))


def _nbytes(param: nn.Parameter) -> int:
    local = _local(param)
    return local.numel() * local.element_size()


def overlap_buckets(gradient_sum: GradientSum, names: Mapping[int, str],
                    positions: Mapping[str, int], groups: Mapping[tuple[int, ...],
                                                                  dist.ProcessGroup],
                    bucket_bytes: int = BUCKET_BYTES) -> list[_Bucket]:
    """`gradient_sum`'s plain buckets cut into buckets of at most `bucket_bytes` (one
    parameter at least), parameters last model position first, on the sums' own groups
    (`sync_groups`), in the order every rank starts them (see the module docstring)."""
    out = []
    for bucket in filter(_plain, gradient_sum.buckets):
        ranks = tuple(sorted(dist.get_process_group_ranks(bucket.group)))
        params = sorted(bucket.params, key=lambda p: -positions[names[id(p)]])
        cut: list[list[nn.Parameter]] = [[]]
        size = 0
        for param in params:
            if cut[-1] and size + _nbytes(param) > bucket_bytes:
                cut.append([])
                size = 0
            cut[-1].append(param)
            size += _nbytes(param)
        out += [_Bucket(part, groups[ranks]) for part in cut]
    return sorted(out, key=lambda b: -positions[names[id(b.params[0])]])


@dataclass
class _Flight:
    """A bucket's all-reduce under way."""

    bucket: _Bucket
    flat: torch.Tensor
    grads: list[torch.Tensor]
    work: dist.Work
    started: float
    ended: float | None = None  # set when its future completes

    def land(self, _future: torch.futures.Future) -> None:
        self.ended = time.perf_counter()


def _union(intervals: Sequence[tuple[float, float]]) -> float:
    """The length of the union of intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class AfterBackward:
    """The sums after the schedule (`GradientSum`), timed."""

    def __init__(self, gradient_sum: GradientSum) -> None:
        self.gradient_sum = gradient_sum

    def start_step(self) -> None:
        """Nothing starts before the schedule ends."""

    def __call__(self, schedule_end: float) -> SyncTiming:
        began = time.perf_counter()
        self.gradient_sum()
        ended = time.perf_counter()
        return SyncTiming(exposed=ended - schedule_end, in_flight=ended - began,
                          sums=len(self.gradient_sum.buckets))


class Overlapped:
    """The sums started in backward (see the module docstring)."""

    def __init__(self, gradient_sum: GradientSum, buckets: list[_Bucket],
                 names: Mapping[int, str], expected: Mapping[str, int]) -> None:
        """buckets: `overlap_buckets`; names: each parameter's by id; expected: per name,
        its accumulations per step (`accumulations`)."""
        self.buckets = buckets
        self.deferred = [b for b in gradient_sum.buckets if not _plain(b)]
        self.names = names
        self.bucket_of = {id(p): i for i, b in enumerate(buckets) for p in b.params}
        self.expected = {id(p): expected.get(names[id(p)], 0) for b in buckets
                         for p in b.params}
        self.handles = [p.register_post_accumulate_grad_hook(self._accumulated)
                        for b in buckets for p in b.params]
        self.start_step()

    def start_step(self) -> None:
        """Before the schedule: no gradient accumulated, no bucket started."""
        self.counts: Counter[int] = Counter()
        self.missing = [len(b.params) for b in self.buckets]
        self.next = 0  # the first bucket not started
        self.flights: list[_Flight] = []
        self.late: set[str] = set()

    def _accumulated(self, param: torch.Tensor) -> None:
        """A post-accumulate-grad hook: count, and start the buckets now complete."""
        key = id(param)
        self.counts[key] += 1
        index = self.bucket_of[key]
        if index < self.next:
            self.late.add(self.names[key])
        elif self.counts[key] == self.expected[key]:
            self.missing[index] -= 1
            while self.next < len(self.buckets) and self.missing[self.next] == 0:
                self._start(self.next)

    def _start(self, index: int) -> None:
        bucket = self.buckets[index]
        flat, grads = flat_gradients(bucket)
        started = time.perf_counter()
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=bucket.group, async_op=True)
        flight = _Flight(bucket, flat, grads, work, started)
        work.get_future().then(flight.land)
        self.flights.append(flight)
        self.next = index + 1

    def __call__(self, schedule_end: float) -> SyncTiming:
        """After the schedule: start the rest, wait for every sum and write it back, then
        the deferred buckets."""
        early = len(self.flights)
        while self.next < len(self.buckets):
            self._start(self.next)
        spans = []
        for flight in self.flights:
            flight.work.wait()
            spans.append((flight.started, flight.ended or time.perf_counter()))
            write_gradients(flight.bucket, flight.flat, flight.grads)
        for bucket in self.deferred:
            began = time.perf_counter()
            sum_bucket(bucket)
            spans.append((began, time.perf_counter()))
        if self.late:
            names = ", ".join(sorted(self.late)[:3])
            raise PlannerError(
                "runtime-error", f"Backward accumulated the gradient of {names} after its "
                "sum had started (more often than once per micro-batch for each chunk "
                "whose layers read it), so the overlapped sum would be stale.",
                ["run the plan without overlap (solve without --overlap-sync)"])
        return SyncTiming(exposed=time.perf_counter() - schedule_end, in_flight=_union(spans),
                          sums=len(spans), started_in_backward=early)
