"""The keys of a cost table's cache (`CostTable.cache`), one frozen dataclass per cache:
what each cache holds, and every value it depends on, by name. A dataclass key equals
only a key of its own class, so no two caches can meet in the one dict; each key says
where its values are made.

A table folded for interleaving (`interleave.fold`) has a cache of its own, so nothing
here names the chunk count but where a value of the unfolded table depends on it.
Values that depend on an array's identity (`id`) keep the array in the cache beside
them, so the identity stays valid while the key exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planner.solver.evaluate import Config, Space
    from planner.solver.structure import ClassShape
    from planner.types import Schedule
    from planner.types.training import Recompute

FamilyKey = tuple[tuple[str, ...], tuple[int, ...]]  # `families.Family.key`


# --- the table itself (`table.py`, `interleave.py`, `links.py`, `structure.py`)

@dataclass(frozen=True)
class LayerCostsKey:
    """`CostTable.costs`: the layers' times on one type at a degree and micro-batch."""

    kind: str
    tp: int
    mb: int


@dataclass(frozen=True)
class RankParamsKey:
    """`CostTable.rank_params`: per layer, the parameters one rank holds."""

    tp: int


@dataclass(frozen=True)
class RangeParamsKey:
    """`CostTable.range_params`: per layer range, the parameters one rank keeps."""

    tp: int


@dataclass(frozen=True)
class ZeroKeptKey:
    """`CostTable.zero_kept`: the tied weights' parameters a stage keeps whole."""

    zero: int  # 0, 1 (ZeRO-1 and -2 alike) or 3


@dataclass(frozen=True)
class FoldedKey:
    """`interleave.fold`: the table of `chunks` model chunks per device."""

    chunks: int


@dataclass(frozen=True)
class BestLinkKey:
    """`links.best_link`: the fastest link from a stage of type a to one of type b."""

    a: str
    b: str
    across: bool  # on another node


@dataclass(frozen=True)
class BlocksKey:
    """`structure.capacity`: how many blocks of `count` stages fit an empty cluster."""

    tp: int
    kind: str
    count: int


# --- exact splits (`partition.py`)

@dataclass(frozen=True)
class PrefixesKey:
    """`partition._prefixes`: prefix sums of a type's layer times and their ranges."""

    kind: str
    tp: int
    mb: int


@dataclass(frozen=True)
class RangeCapacityKey:
    """`partition._capacity`: the micro-batches in flight a stage of each layer range
    holds, per option."""

    kind: str
    tp: int
    mb: int
    n: int  # pipelines ZeRO shards over
    options: tuple  # `partition.Option`s


@dataclass(frozen=True)
class ActivationRangesKey:
    """`partition._activation_ranges`: activation bytes per layer range and policy."""

    tp: int


@dataclass(frozen=True)
class GathersKey:
    """`partition._gathers`: one ZeRO-3 all-gather of every layer range's weights."""

    gather: tuple[float, float]  # (latency, seconds per `ZERO_GATHER_REF` bytes)


@dataclass(frozen=True)
class ShardedParamsKey:
    """`partition.sharded_params`: the parameters ZeRO-3 shards per layer range."""


@dataclass(frozen=True)
class Zero3FirstKey:
    """`partition.zero3_first`: a class's costs with its first stage on ZeRO-3."""

    busy: int  # id of the first stage's busy times (kept alive by the class costs)
    kind: str
    tp: int
    mb: int
    gather: tuple[float, float]


@dataclass(frozen=True)
class StageKey:
    """`partition._stage`: busy time and option of every layer range as one stage."""

    kind: str
    tp: int
    mb: int
    n: int
    flight: float  # micro-batches in flight
    gather: tuple[float, float] | None  # (None: no ZeRO sharding, n = 1)
    policies: tuple[Recompute, ...]
    zeros: tuple[int, ...]


@dataclass(frozen=True)
class StageTimesKey:
    """`partition._stage`: per option, the busy times, whatever memory allows."""

    kind: str
    tp: int
    mb: int
    gather: tuple[float, float] | None
    options: tuple


@dataclass(frozen=True)
class LedStageKey:
    """`partition.class_costs`: a stage's busy times with its lead's broadcasts."""

    busy: int  # id of the busy times without them (kept beside)
    leads: tuple[bool, bool]  # (in, out)


@dataclass(frozen=True)
class HwMemoKey:
    """`partition.class_costs`: the memo of `ClassCosts.h_w` the classes of one
    micro-batch size share (by the ids of busy arrays the cache keeps)."""

    mb: int


@dataclass(frozen=True)
class LeadBroadcastsKey:
    """`partition._broadcasts`: per layer boundary, a lead rank's broadcast."""

    kind: str
    tp: int
    mb: int


# --- floors of runs of layers (`run_floors.py`)

@dataclass(frozen=True)
class LeastLargestPartsKey:
    """`run_floors.least_largest_parts`: the least largest part of c-way cuts."""

    kind: str
    tp: int
    mb: int
    most: int
    from_end: bool


@dataclass(frozen=True)
class LeastLargestRangesKey:
    """`run_floors.least_largest_ranges`: the least largest part of `count`-way cuts of
    every range of layers."""

    kind: str
    tp: int
    mb: int
    count: int


@dataclass(frozen=True)
class TailsInMemoryKey:
    """`run_floors.tails_in_memory`: a pipeline's last c stages' least busy time with
    what memory adds."""

    kind: str
    tp: int
    mb: int
    interleave: int
    most_stages: int
    policies: tuple[Recompute, ...]
    per_param: float


@dataclass(frozen=True)
class RecomputeCurveKey:
    """`run_floors.recompute_curve`: a type's least time per activation bytes freed."""

    kind: str
    tp: int
    mb: int
    policies: tuple[Recompute, ...]


# --- families and their bounds (`families.py`, `bound.py`, `search.py`)

@dataclass(frozen=True)
class FitsBy:
    """What the patterns that fit (`families.FamilyFloors.fits`) depend on besides
    their types and degrees: not the micro-batch size, so the keys below keep them
    across configurations."""

    lengths: range  # the stage counts a pipeline may have (`families.stage_counts`)
    first_stage: str | None  # the stage pins (`Limits.allows`)
    last_stage: str | None
    zeros: tuple[int, ...]  # the ZeRO stages allowed
    least_pipelines: int  # the fewest pipelines of a pattern the cluster must hold


@dataclass(frozen=True)
class DeviceWorkKey:
    """`families.device_work`: per type, the device-seconds a micro-batch of the whole
    model takes at least at any of these degrees."""

    mb: int
    tps: tuple[int, ...]


@dataclass(frozen=True)
class HomogeneousShapesKey:
    """`FamilyFloors.homogeneous`: the patterns of one block that fit."""

    kind: str
    tp: int
    by: FitsBy


@dataclass(frozen=True)
class TwoTypeShapesKey:
    """`FamilyFloors.two_type_shapes`: the patterns of a block of a then one of b that
    fit, their states and split points."""

    a: str
    tp_a: int
    b: str
    tp_b: int
    by: FitsBy


@dataclass(frozen=True)
class TwoTypeFlightsKey:
    """`FamilyFloors.two_type_flights`: the micro-batches those patterns' blocks hold
    at least, where they do not depend on the micro-batch count."""

    shapes: TwoTypeShapesKey
    schedule: Schedule
    interleave: int
    runs: tuple[int, ...]  # per pattern, the micro-batches a pipeline runs


@dataclass(frozen=True)
class ChainShapesKey:
    """`FamilyFloors.chains`: the chain patterns of three to `most` types that fit, by
    order of types."""

    tp: int
    most: int
    by: FitsBy


@dataclass(frozen=True)
class ChainLayoutKey:
    """`FamilyFloors.chain_layout`: those patterns as rows, with what pricing their
    blocks reads that does not depend on the micro-batch size (their states' bytes, the
    micro-batches their stages hold, the layers they may hold)."""

    shapes: ChainShapesKey
    schedule: Schedule
    interleave: int
    microbatches: int | None  # GPipe's (its pipelines hold all theirs), else None


@dataclass(frozen=True)
class ChainLimitKey:
    """`families.chain_limit`: the most types a chain may hold at a degree."""

    lengths: range
    tp: int
    patterns: int  # `families.CHAIN_FAMILIES`


@dataclass(frozen=True)
class TightKey:
    """`bound.tight_result`: a family's exact split on optimistic terms."""

    family: FamilyKey
    n_max: int
    config: Config
    space: Space
    held: int | None  # GPipe: micro-batches a pipeline holds at most
    crowd: int


@dataclass(frozen=True)
class CrowdedKey:
    """`bound.crowded`: a family's bounds for a class whose sends crowd its cards."""

    family: FamilyKey
    n_max: int
    crowd: int
    config: Config
    space: Space
    microbatches: int


@dataclass(frozen=True)
class Zero3FamilyKey:
    """`search._Search.zero3`: a tightened family with its first stage on ZeRO-3."""

    family: FamilyKey
    n_max: int
    config: Config
    space: Space
    batch: int


@dataclass(frozen=True)
class FixedSyncKey:
    """`search._Search.sync_floor`: the sync a node's fixed classes pay at least."""

    shapes: tuple[ClassShape, ...]


# --- gradient sync (`sync_floor.py`, `evaluate.py`)

@dataclass(frozen=True)
class OneNodeKey:
    """`SyncFloor.one_node`: all-reduce lines among r ranks on one node of each type."""

    kinds: tuple[str, ...]


@dataclass(frozen=True)
class PipelineCopiesKey:
    """`SyncFloor.copies`: per type of `kinds`, the most pipelines of these stages one
    node holds a stage of (the same in every configuration of a table)."""

    kinds: tuple[str, ...]
    types: tuple[str, ...]
    tps: tuple[int, ...]


@dataclass(frozen=True)
class PipelineRunsKey:
    """`SyncFloor.runs`: the most nodes one pipeline of these stages spans."""

    types: tuple[str, ...]
    tps: tuple[int, ...]


@dataclass(frozen=True)
class SyncLineKey:
    """`sync_floor._floor`: the all-reduce line no group among k of `nodes` beats."""

    nodes: tuple[str, ...]
    k: int  # (2 where the nodes' links differ: the cheapest pair)
    others: tuple[str, ...]


@dataclass(frozen=True)
class SyncLinksKey:
    """`sync_floor._links`: whether the nodes are linked alike, and a pair per link."""

    nodes: tuple[str, ...]
    others: tuple[str, ...]


@dataclass(frozen=True)
class ParameterPrefixKey:
    """`evaluate._prefix`: prefix sums of the parameters per layer."""


@dataclass(frozen=True)
class ClassResultKey:
    """`evaluate.class_result`: a placed class's best split."""

    shape: ClassShape
    config: Config
    space: Space
    links: tuple
    gathers: tuple
    most: int | None  # GPipe: micro-batches a pipeline holds at most


@dataclass(frozen=True)
class CardFloorKey:
    """`evaluate.card_floor`: the sync a structure pays at least on its busiest card."""

    shapes: tuple[ClassShape, ...]


@dataclass(frozen=True)
class ShardedCardFloorsKey:
    """`evaluate.sharded_card_floors`: a class's card floors under ZeRO-3 thresholds."""

    shape: ClassShape
    mb: int


@dataclass(frozen=True)
class HeaviestRunKey:
    """`evaluate.heaviest_run`: the least largest run's gradient cost over cuts."""

    slopes: tuple[float, ...]


@dataclass(frozen=True)
class CrossClassFloorKey:
    """`evaluate.cross_class_floor`: the sync a structure of several classes pays."""

    shapes: tuple[ClassShape, ...]


# memos per class result, by its id (each value keeps its result, so the id stays valid)

@dataclass(frozen=True)
class CappedMemoKey:
    """`evaluate._capped`: per (result, cap), the splits under a parameter cap."""


@dataclass(frozen=True)
class GpipeFrontsMemoKey:
    """`evaluate._gpipe_steps`: per result, GPipe's front of splits up to a limit."""


@dataclass(frozen=True)
class StaircasesMemoKey:
    """`evaluate._staircase`: per result, its `Staircase`."""
