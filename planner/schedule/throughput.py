"""A job's throughput (steps/s) on an allocation: from a measured matrix in Gavel's
format, or from the planner's own predictions (the plan `planner solve` finds on the
allocation's devices), memoised by layout.

Both sources answer the same three questions: which shapes a job may take (`shapes`),
how fast it runs on a layout (`rate`, 0 where it cannot run), and how fast two jobs run
sharing one set of devices (`pair`, None where that is not priced).

A job may span two device types (HadarE forks a job across GPU types at once). From a
matrix, such a job of n devices runs data-parallel with batch shares matched to each
device's speed, as the planner's plans do: its n_t devices of type t add
n_t * T_t(n) / n steps/s, T_t(n) being the matrix's figure for n devices of type t
spread over servers (it carries the scaling loss of n devices and the network between
them). The planner prices such an allocation itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol

from planner.errors import PlannerError, closest
from planner.schedule.gavel import Matrix
from planner.schedule.jobs import Job
from planner.schedule.shape import Layout, Shape
from planner.types import ClusterSpec, ModelGraph, Plan, TrainingSpec


class Throughputs(Protocol):
    def shapes(self, job: Job, capacity: Mapping[str, int], *, span: bool) -> list[Shape]:
        """The shapes `job` may take within `capacity` (devices per type); with `span`,
        shapes of two device types too."""
        ...

    def rate(self, job: Job, layout: Layout) -> float:
        """Steps/s of `job` on `layout`; 0 where it cannot run so."""
        ...

    def pair(self, first: Job, second: Job, shape: Shape) -> tuple[float, float] | None:
        """Steps/s of both jobs sharing the devices of `shape`; None if not priced."""
        ...


def two_type_splits(devices: int, first: str, second: str,
                    capacity: Mapping[str, int]) -> list[Shape]:
    """Every split of `devices` between two types, at least one device each, that the
    capacity holds."""
    return [Shape.of({first: k, second: devices - k}) for k in range(1, devices)
            if k <= capacity.get(first, 0) and devices - k <= capacity.get(second, 0)]


@dataclasses.dataclass(frozen=True)
class MatrixThroughputs:
    """Rates from a measured matrix. `worker_of` maps the pool's device types to the
    matrix's worker types (see `match_workers`)."""

    matrix: Matrix
    worker_of: Mapping[str, str]

    def _alone(self, job: Job, kind: str, devices: int, spread: bool) -> float:
        worker = self.worker_of.get(kind)
        if worker is None:
            return 0.0
        figures = self.matrix.alone
        consolidated = figures.get((worker, self._profile(job), devices, False), 0.0)
        return figures.get((worker, self._profile(job), devices, True), consolidated) \
            if spread else consolidated

    def _profile(self, job: Job) -> str:
        if job.profile is None or not any(key[1] == job.profile for key in
                                          self.matrix.alone):
            known = self.matrix.job_types()
            near = closest(job.profile or "", known)
            raise PlannerError(
                "bad-jobs", f"Job {job.name}: profile {job.profile!r} is not a job type of "
                f"the throughput matrix {self.matrix.source}" + (
                    f"; did you mean {', '.join(map(repr, near))}?" if near else "."),
                [f"use one of {', '.join(map(repr, known[:6]))}, ..."])
        return job.profile

    def _sizes(self, job: Job) -> list[int]:
        profile = self._profile(job)
        return sorted({n for _, name, n, _ in self.matrix.alone
                       if name == profile and job.min_devices <= n <= job.max_devices})

    def shapes(self, job: Job, capacity: Mapping[str, int], *, span: bool) -> list[Shape]:
        out = []
        kinds = [k for k in capacity if k in self.worker_of]
        for n in self._sizes(job):
            out += [Shape.of({kind: n}) for kind in kinds
                    if n <= capacity[kind] and self._alone(job, kind, n, False) > 0]
            if span:
                for i, first in enumerate(kinds):
                    for second in kinds[i + 1:]:
                        if (self._alone(job, first, n, True) > 0
                                and self._alone(job, second, n, True) > 0):
                            out += two_type_splits(n, first, second, capacity)
        return out

    def rate(self, job: Job, layout: Layout) -> float:
        shape = layout.shape
        n = shape.devices
        if len(shape.counts) == 1:
            return self._alone(job, shape.types[0], n, layout.spread)
        return sum(k * self._alone(job, kind, n, True) / n for kind, k in shape.counts)

    def pair(self, first: Job, second: Job, shape: Shape) -> tuple[float, float] | None:
        if len(shape.counts) != 1:
            return None
        worker = self.worker_of.get(shape.types[0])
        return self.matrix.together.get((worker or "", self._profile(first),
                                         self._profile(second), shape.devices))


def match_workers(device_types: list[str], matrix: Matrix) -> dict[str, str]:
    """The matrix worker type of each device type that has one: the same name in any
    case, or a name that starts with it and a dash (V100-32G runs as v100)."""
    out = {}
    for kind in device_types:
        lowered = kind.lower()
        for worker in matrix.worker_types:
            if lowered == worker.lower() or lowered.startswith(worker.lower() + "-"):
                out[kind] = worker
                break
    return out


class PredictedThroughputs:
    """Rates from the planner: `1 / step time` of the best plan `planner.solver.solve`
    finds for the job on the layout's devices. Machines of one type are taken as alike,
    so a layout (not the machines it names) is the memo key; plans for launching are
    solved on the very nodes (`plan`). Traces are cached per model, sequence length and
    dtype; a layout the model does not fit in memory runs at 0."""

    def __init__(self, cluster: ClusterSpec, *, dtype: str = "auto",
                 time_limit: float = 5.0) -> None:
        self.cluster = cluster
        self.dtype_asked = dtype
        self.time_limit = time_limit
        self._graphs: dict[tuple, ModelGraph] = {}
        self._rates: dict[tuple, float] = {}

    def shapes(self, job: Job, capacity: Mapping[str, int], *, span: bool) -> list[Shape]:
        sizes = sorted({job.min_devices, job.max_devices, *(
            2 ** k for k in range(job.max_devices.bit_length())
            if job.min_devices <= 2 ** k <= job.max_devices)})
        kinds = list(capacity)
        out = []
        for n in sizes:
            out += [Shape.of({kind: n}) for kind in kinds if n <= capacity[kind]]
            if span and n % 2 == 0:  # (halves only: each split is a solve)
                out += [Shape.of({a: n // 2, b: n // 2}) for i, a in enumerate(kinds)
                        for b in kinds[i + 1:]
                        if n // 2 <= min(capacity[a], capacity[b])]
        return out

    def rate(self, job: Job, layout: Layout) -> float:
        key = (job.model, job.global_batch, job.seq_len, layout)
        if key not in self._rates:
            plan = self._solve(job, self._representative(layout))
            self._rates[key] = 0.0 if plan is None else 1.0 / plan.prediction.step_time
        return self._rates[key]

    def pair(self, first: Job, second: Job, shape: Shape) -> tuple[float, float] | None:
        return None  # (co-locating planner-priced jobs is not priced yet)

    def plan(self, job: Job, nodes: Mapping[str, int]) -> Plan | None:
        """The best plan for `job` on `nodes[name]` devices of each named node (None:
        it does not fit)."""
        chosen = tuple(dataclasses.replace(node, devices=nodes[node.name])
                       for node in self.cluster.nodes if node.name in nodes)
        return self._solve(job, dataclasses.replace(self.cluster, nodes=chosen))

    def _representative(self, layout: Layout) -> ClusterSpec:
        """A sub-cluster with the layout's chunks on distinct nodes of their types."""
        used: set[str] = set()
        nodes = []
        for kind, count in layout.chunks:
            node = next((n for n in self.cluster.nodes if n.device.name == kind
                         and n.devices >= count and n.name not in used), None)
            if node is None:
                raise PlannerError("bad-allocation", f"Cluster {self.cluster.name} has no "
                                   f"free node of {count} {kind} devices for this layout.")
            used.add(node.name)
            nodes.append(dataclasses.replace(node, devices=count))
        return dataclasses.replace(self.cluster, nodes=tuple(nodes))

    @property
    def dtype(self) -> str:
        """The training dtype (`auto`: bf16 where every device runs it fast, else fp16),
        resolved when a job is first priced."""
        from planner.session import resolve_dtype

        return resolve_dtype(self.dtype_asked, self.cluster)

    def _graph(self, job: Job) -> ModelGraph:
        from planner.models import model_spec
        from planner.trace.cache import cached_trace

        key = (job.model, job.seq_len)
        if key not in self._graphs:
            self._graphs[key] = cached_trace(model_spec(str(job.model)), seq_len=job.seq_len,
                                             dtype=self.dtype)
        return self._graphs[key]

    def _solve(self, job: Job, cluster: ClusterSpec) -> Plan | None:
        from planner.solver import SolveOptions, solve

        graph = self._graph(job)
        training = TrainingSpec(global_batch=int(job.global_batch or 1), seq_len=graph.seq_len,
                                dtype=self.dtype)
        try:
            return solve(graph, cluster, training, SolveOptions(
                time_limit=self.time_limit, with_baselines=False))[0]
        except PlannerError as exc:
            if exc.kind != "infeasible":
                raise PlannerError(exc.kind, f"Job {job.name}: {exc.message}",
                                   exc.remedies) from None
            return None


@dataclasses.dataclass(frozen=True)
class ByJob:
    """Measured rates for jobs given by `profile`, the planner's for jobs given by
    `model`; a pair is priced only where both jobs are measured."""

    measured: MatrixThroughputs | None
    predicted: PredictedThroughputs | None

    def _source(self, job: Job) -> Throughputs:
        source = self.measured if job.profile is not None else self.predicted
        if source is None:
            what = ("a throughput matrix (`throughputs:` in the jobs file, or --throughputs)"
                    if job.profile is not None else "a cluster the planner can price (a "
                    "cluster file, example or inline spec, not --gpus)")
            raise PlannerError("bad-jobs", f"Job {job.name} needs {what}.")
        return source

    def shapes(self, job: Job, capacity: Mapping[str, int], *, span: bool) -> list[Shape]:
        return self._source(job).shapes(job, capacity, span=span)

    def rate(self, job: Job, layout: Layout) -> float:
        return self._source(job).rate(job, layout)

    def pair(self, first: Job, second: Job, shape: Shape) -> tuple[float, float] | None:
        if self.measured is None or first.profile is None or second.profile is None:
            return None
        return self.measured.pair(first, second, shape)
