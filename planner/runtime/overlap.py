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
    rank holds whole: their sums use the tp group, which backward uses too) are summed
    as without overlap;
  * a hierarchical sum (`StagePlan.grad_sync`, `parallel.Hierarchy`) runs its reduce
    inside the node, all-reduce across the nodes and broadcast back one after the other,
    each issued (from a later hook, or after the schedule) once the one before has
    completed, in the order the sums started, on groups of their own for each step.

FSDP2 stages keep FSDP's own reduce-scatters, which overlap backward already. An
accumulation after its bucket started would leave the sum stale: the step stops with
an error naming the parameter instead.

Each step's sync is timed (`SyncTiming`): exposed, from the end of the schedule to the
end of the last sum (what the step waits for); in flight, how long any of the step's sums
was under way, overlapped or not (without overlap, the same).
"""

from __future__ import annotations

import dataclasses
import functools
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
    Hierarchy,
    Topology,
    _Bucket,
    _local,
    flat_gradients,
    sum_bucket,
    write_gradients,
)
from planner.runtime.stage import ModelInfo
from planner.types import StagePlan, SyncSpec

BUCKET_BYTES = int(SyncSpec.bucket_mb * 2**20)  # DDP's default bucket_cap_mb


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


def sync_groups(topo: Topology, rank: int
                ) -> dict[tuple[int, ...], dist.ProcessGroup | Hierarchy]:
    """Process groups of their own for the gradient sums, by the sums' ranks: every rank
    creates each, in one order (new_group is collective); a hierarchical sum's (its
    plan's stages say so, `Topology.hierarchical`) a group of each node's ranks for the
    reduce and another for the broadcast, and one of the nodes' first ranks
    (`Hierarchy`). Those this rank is in."""
    wanted: dict[tuple[int, ...], bool] = {}  # the sum's ranks: whether hierarchical
    for keys in sorted({tuple(sorted(keys)) for keys in topo.holders.values()}):
        if len(keys) > 1:
            wanted.update(dict.fromkeys(topo.sum_groups(keys), topo.hierarchical(keys)))
    out: dict[tuple[int, ...], dist.ProcessGroup | Hierarchy] = {}
    for ranks, hierarchical in wanted.items():
        if not hierarchical:
            group = dist.new_group(list(ranks))
            if rank in ranks:
                out[ranks] = group
            continue
        nodes = topo.by_node(ranks)
        made = {node: (dist.new_group(list(node)), dist.new_group(list(node)))
                for node in nodes if len(node) > 1}
        leaders = tuple(node[0] for node in nodes)
        across = dist.new_group(list(leaders)) if len(nodes) > 1 else None
        if rank in ranks:
            mine = next(node for node in nodes if rank in node)
            local, back = made.get(mine, (None, None))
            out[ranks] = Hierarchy(ranks=ranks, leader=mine[0], local=local, back=back,
                                   across=across if rank in leaders else None)
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
    """Whether a bucket's sum is among its holders alone (no tp group): one all-reduce,
    or a `Hierarchy`'s steps."""
    return not bucket.gather and bucket.slices == 1 and bucket.group is not None


def _ranks(group: dist.ProcessGroup | Hierarchy) -> tuple[int, ...]:
    """A sum's ranks."""
    if isinstance(group, Hierarchy):
        return group.ranks
    return tuple(sorted(dist.get_process_group_ranks(group)))


def _nbytes(param: nn.Parameter) -> int:
    local = _local(param)
    return local.numel() * local.element_size()


def overlap_buckets(gradient_sum: GradientSum, names: Mapping[int, str],
                    positions: Mapping[str, int],
                    groups: Mapping[tuple[int, ...], dist.ProcessGroup | Hierarchy],
                    bucket_bytes: int = BUCKET_BYTES) -> list[_Bucket]:
    """`gradient_sum`'s plain buckets cut into buckets of at most `bucket_bytes` (one
    parameter at least), parameters last model position first, on the sums' own groups
    (`sync_groups`), in the order every rank starts them (see the module docstring)."""
    out = []
    for bucket in filter(_plain, gradient_sum.buckets):
        ranks = _ranks(bucket.group)
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
    """A bucket's sum under way: its collectives (`steps`: one all-reduce, or a
    `Hierarchy`'s), each issued once the one before has completed; `issued` of them so
    far, the last one's handle `work`."""

    bucket: _Bucket
    flat: torch.Tensor
    grads: list[torch.Tensor]
    steps: list[functools.partial]
    started: float
    issued: int = 0
    work: dist.Work | None = None
    ended: float | None = None  # set when its last collective's future completes

    @property
    def all_issued(self) -> bool:
        return self.issued == len(self.steps)

    def issue(self) -> None:
        """Its next collective, asynchronously."""
        self.work = self.steps[self.issued](async_op=True)
        self.issued += 1
        if self.all_issued:
            self.work.get_future().then(self.land)

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
        steps = (bucket.group.steps(flat) if isinstance(bucket.group, Hierarchy) else
                 [functools.partial(dist.all_reduce, flat, op=dist.ReduceOp.SUM,
                                    group=bucket.group)])
        flight = _Flight(bucket, flat, grads, steps, time.perf_counter())
        flight.issue()
        self.flights.append(flight)
        self.next = index + 1
        self._advance()

    def _advance(self) -> None:
        """Issue the next collective of every sum whose last one has completed, in the
        order the sums started: a sum's k-th collective only after every earlier sum's
        k-th (or its last), so that each group's collectives (a hierarchical sum's
        reduces, its all-reduces across, its broadcasts) go in one order on every rank."""
        behind = float("inf")  # collectives issued by the earliest sum not all issued
        for flight in self.flights:
            while (not flight.all_issued and flight.issued < behind
                   and flight.work.is_completed()):
                flight.issue()
            if not flight.all_issued:
                behind = min(behind, flight.issued)

    def __call__(self, schedule_end: float) -> SyncTiming:
        """After the schedule: start the rest, wait for every sum and write it back, then
        the deferred buckets."""
        early = len(self.flights)
        while self.next < len(self.buckets):
            self._start(self.next)
        spans = []
        for flight in self.flights:  # (those before it are done: nothing holds it back)
            flight.work.wait()
            while not flight.all_issued:
                flight.issue()
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
