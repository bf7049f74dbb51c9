"""Plan side of the data model: pipelines of stages on concrete devices, the
predicted costs, the solver's report and baselines.

A plan runs one or more pipelines side by side. Each pipeline takes its own
share of the global batch (fast pipelines take more), split into micro-batches
of a common size, and runs its stages on tensor-parallel groups of one node's
devices, each stage at its own degree. Pipelines may split the layers
differently; every layer's gradients are averaged over all pipelines that hold it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum

from planner.types.cluster import ClusterSpec
from planner.types.model import ModelSpec
from planner.types.training import Recompute, TrainingSpec


class Schedule(str, Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved-1f1b"


class SyncAlgorithm(str, Enum):
    """How a collective runs among ranks on several nodes (`cost_models.comm`): a ring
    over all of them, or hierarchical: inside each node, then across the nodes among one
    rank (or one share) per node, then inside each node again."""

    RING = "ring"
    HIERARCHICAL = "hierarchical"


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Bytes per device by term."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    reserve: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.reserve

    def terms(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def largest(self) -> str:
        terms = self.terms()
        return max(terms, key=terms.__getitem__)

    def fits(self, capacity: float) -> bool:
        return self.total <= capacity


@dataclass(frozen=True, kw_only=True)
class DeviceGroup:
    """The devices one stage of one pipeline runs on: `tp` devices of one node."""

    node: str
    devices: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """One pipeline stage.

    layers:  [start, end) layer indices; with an interleaved schedule the stage
             holds several chunks, listed in `chunks` (layers is then the span).
    modules: module names of the layers, for building the stage at run time.
    memory:  predicted bytes per device.
    grad_sync: how the stage's replicas sum its gradients where they span several nodes
             (the faster priced, `predict.grad_syncs`); the runtime runs it. Stages that
             FSDP shards (zero >= 1) keep FSDP's own reductions: ring.
    """

    index: int
    layers: tuple[int, int]
    chunks: tuple[tuple[int, int], ...]
    modules: tuple[str, ...]
    device_type: str
    devices: DeviceGroup
    tp: int
    recompute: Recompute
    zero: int
    memory: MemoryBreakdown
    grad_sync: SyncAlgorithm = SyncAlgorithm.RING

    def holds(self, layer: int) -> bool:
        """Whether one of the stage's chunks holds the layer (the span may not)."""
        return any(a <= layer < b for a, b in self.chunks)

    def held(self) -> list[int]:
        """The indices of the layers the stage holds, in order."""
        return [i for a, b in self.chunks for i in range(a, b)]


@dataclass(frozen=True, kw_only=True)
class PipelinePlan:
    index: int
    stages: tuple[StagePlan, ...]
    batch_share: int  # samples per step
    micro_batch: int
    num_microbatches: int
    schedule: Schedule
    interleave: int = 1

    def schedule_note(self) -> str:
        """The schedule, for tables, where it is not plain 1F1B (else empty)."""
        if self.schedule is Schedule.INTERLEAVED and self.interleave > 1:
            return f", interleaved in {self.interleave} chunks"
        return ", GPipe" if self.schedule is Schedule.GPIPE else ""


@dataclass(frozen=True, kw_only=True)
class CostBreakdown:
    """Predicted seconds per training step by cause, and what they add up to.

    The terms are on the critical path: compute (forward, backward and
    recompute of the slowest pipeline's bottleneck stages), bubble (pipeline
    fill and drain), tp_comm (tensor-parallel all-reduces), pp_comm
    (activations and gradients between stages), dp_comm (gradient
    synchronisation across pipelines), optimizer (the optimizer step).

    whole_sync: seconds of one whole gradient sync (or average, `SyncSpec`), of which
    dp_comm is what a step pays: all of it, less what the last backward hides where the
    sync overlaps it, divided by the steps between syncs. None in plans made before it
    was recorded (then dp_comm).
    """

    step_time: float
    compute: float
    bubble: float
    tp_comm: float
    pp_comm: float
    dp_comm: float
    optimizer: float
    samples_per_s: float
    tokens_per_s: float | None
    mfu: float  # model FLOPs per second / sum of the used devices' peak FLOP/s
    whole_sync: float | None = None

    @property
    def sync_saved(self) -> float:
        """Seconds per step the sync does not add: hidden behind backward or spread over
        the steps between syncs."""
        return max(0.0, (self.dp_comm if self.whole_sync is None else self.whole_sync)
                   - self.dp_comm)

    def terms(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in
                ("compute", "bubble", "tp_comm", "pp_comm", "dp_comm", "optimizer")}


@dataclass(frozen=True, kw_only=True)
class SolverReport:
    """How the plan was found.

    status:      "optimal" (the whole search space was covered), "feasible" (a
                 time limit stopped the search), "interrupted" (Ctrl-C stopped it),
                 "fixed" (the user fixed the plan).
    objective:   predicted step time of the plan (seconds).
    best_bound:  no plan in the search space is faster than this.
    gap:         (objective - best_bound) / objective.
    wall_time:   seconds the solve took to find it: its cost tables and searches
                 (the fastest device type alone, then the whole cluster), not the
                 baselines and predictions after.
    lower_bound: no plan of any shape is faster than this (an LP relaxation
                 that ignores communication and pipeline bubbles).
    """

    status: str
    objective: float
    best_bound: float
    gap: float
    wall_time: float
    lower_bound: float
    explored: int
    pruned: int
    search_space: str


@dataclass(frozen=True, kw_only=True)
class Baseline:
    """Another way to run the same job, predicted by the same cost model."""

    name: str
    description: str
    prediction: CostBreakdown | None
    reason: str = ""  # why there is no prediction (it does not fit, ...)


@dataclass(frozen=True, kw_only=True)
class SolveConstraints:
    """What the solve that made a plan was told to keep to, as `planner solve`'s
    constraint options give it (None or empty: free; `planner.constraints` converts to
    and from the solver's options), recorded so that a re-plan after a node's loss
    (`planner.replan`) keeps to it too: a user who fixed --tp 2 for memory headroom or
    --schedule 1f1b for what the runtime runs keeps it. The gradient sync is the
    training's (`TrainingSpec.sync`), kept with it. Plans made before it was recorded,
    and those no solve made (estimate, written by hand), have none."""

    tp: int | None = None
    max_tp: int | None = None
    tp_per_class: bool = False
    pp: int | None = None
    dp: int | None = None
    max_dp: int | None = None
    micro_batch: int | None = None
    max_stages: int | None = None  # (None: the solver's default)
    recompute: tuple[Recompute, ...] | None = None  # the policies allowed (None: any)
    zero: tuple[int, ...] | None = None  # the ZeRO stages allowed (None: any)
    exclude: tuple[str, ...] = ()  # node names
    first_stage: str | None = None
    last_stage: str | None = None
    mixed: bool = True
    mixed_share_types: bool = False  # two mixed classes may share device types
    interleave: int | None = None
    max_interleave: int | None = None  # (None: the solver's default)
    schedule: Schedule | None = None


@dataclass(frozen=True, kw_only=True)
class Plan:
    schema_version: int
    model: ModelSpec
    training: TrainingSpec
    cluster: ClusterSpec
    pipelines: tuple[PipelinePlan, ...]
    prediction: CostBreakdown
    solver: SolverReport
    baselines: tuple[Baseline, ...] = ()
    constraints: SolveConstraints | None = None  # the solve's (None: not recorded)

    @property
    def num_devices(self) -> int:
        return sum(s.tp for p in self.pipelines for s in p.stages)
