"""The pipeline families of a configuration and their first bounds.

A family is a pipeline pattern before its count is chosen: a chain of blocks (runs of
stages of one device type), each at a tensor-parallel degree. The search's levels
(`families`) are the mixed patterns (chains of two or more types, in every order) and
one level of homogeneous patterns (one block) per type.

Each family starts with bounds from per-layer times alone (`FamilyFloors`). A split
puts layers [0, j) on the c_a stages of type a and [j, L) on the c_b stages of type b
(one block for a homogeneous family), each block at its degree, so its total is at
least the smallest prefix_a(j) + suffix_b(j) and its bottleneck at least the smallest
max(prefix_a(j) / c_a, suffix_b(j) / c_b) over the j that leave every stage a layer
and each block room for its layers' parameter states (ZeRO-sharded over the most
pipelines), each block's mean raised to the least largest stage any cut of its layers
into its stages has (`run_floors.least_largest_parts`: whole layers make a block of 7
stages holding 24 like ones as slow as 4 of them, not 24 / 7; a pipeline's last
block's stages, their memory too, `run_floors.tails_in_memory`, which bounds its
total as well), and at least the largest layer's time on its faster type (with v
chunks per device, of the folded table; the total bounds the fill, 1/v of the busy
time plus (1 - 1/v) bottlenecks). (Layer times are not proportional across types, so
the plain fluid bound 1 / sum_k c_k / W_k is not one.) Where a block's states and kept
activations (at least the fewest micro-batches any of its stages holds) overflow its
devices, the least time that frees the bytes over is added to its time: recompute at
the layers' convex rates (`RecomputeCurve`), or ZeRO-3 sharding a share of the states
for its gathers (`FamilyFloors.memory`; GPipe's stages hold all their micro-batches:
at least their even share over the most pipelines); infinite where even the leanest
policies' activations overflow. A family whose devices cannot hold the states however
the layers are split is dropped.

A chain of three or more blocks (`FamilyFloors.chains`) is bounded the same way at its
first and last blocks; a middle block adds its layers' time on its type and what its
memory adds (a dynamic program over the blocks' boundaries; on long models its memory
left out), and its largest stage is at least its mean and its layers' least largest
part over its stages (`run_floors.least_largest_ranges`, for every range of layers:
on long models, the mean alone): the period is at least the least largest stage of
any block over every placement of the blocks' boundaries, and at least the total over
the stages.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from planner.solver.evaluate import Config, Space
from planner.solver.interleave import fold
from planner.solver.keys import (
    ChainLayoutKey,
    ChainLimitKey,
    ChainShapesKey,
    DeviceWorkKey,
    FitsBy,
    HomogeneousShapesKey,
    TwoTypeFlightsKey,
    TwoTypeShapesKey,
)
from planner.solver.limits import Limits
from planner.solver.links import cheapest_gather
from planner.solver.partition import INF, ZERO_GATHER_REF, ClassResult
from planner.solver.run_floors import (
    RANGE_CELLS,
    RecomputeCurve,
    least_largest_parts,
    least_largest_ranges,
    recompute_curve,
    tails_in_memory,
)
from planner.solver.structure import ClassShape, capacity, devices_of
from planner.solver.table import CostTable
from planner.solver.timing import in_flight
from planner.types.training import Recompute

# chain patterns (three or more types) a configuration may have at one degree: beyond,
# the longest chains are left out, and the search says so (`chain_limit`). Four nodes of
# four GPUs, a type each (a measured cluster), have 7,680 at tp 1: at 4,000 their chains
# through all four nodes were left out, and with them a plan 9% faster (RESULTS.md,
# solve-measured); at 8,000 the 1,024- and 4,096-GPU scenarios keep their chains cut as
# before and stay optimal within their time targets (RESULTS.md, solve)
CHAIN_FAMILIES = 8000
# pairs of mixed families on disjoint types a configuration may have for a second mixed
# class: beyond, it holds one (`mixed_in`), and the search says so (at 1,024 GPUs of four
# types, 13,000 to 88,000 pairs a configuration, whose loose bounds took the search from
# optimal in 4 s to 11 s; a cluster of four measured nodes of 4 GPUs has up to 1,238)
MIXED_PAIRS = 2000
# middle blocks are priced over every layer range [i, j) up to this many ranges (and
# memory left out, their layers at their types' least time, beyond)
_WHOLE_MIDDLES = 40_000
_MIDDLE_CELLS = 1 << 20  # (rows of chains times ranges priced at once)


@dataclass
class Family:
    """Pipelines of one stage pattern, before choosing how many.

    min_busy and total start as bounds from per-layer times alone; `tight` marks
    that they were replaced by the class's exact first bottleneck and floor (at
    n_max pipelines, whose ZeRO sharding makes every split of fewer pipelines no
    faster)."""

    types: tuple[str, ...]
    tps: tuple[int, ...]  # each stage's tensor-parallel degree (one per type: `per_stage`)
    n_max: int
    min_busy: float  # no split has a bottleneck below this
    total: float  # no split has a total below this
    tight: bool = False
    # (period, fill) pairs, periods rising: every split's period and fill are at least
    # one pair's (`floor_pairs`, of `result` when first asked for); none: (min_busy, total)
    lines: tuple[tuple[float, float], ...] = ()
    result: ClassResult | None = dataclasses.field(default=None, compare=False, repr=False)

    def floors(self) -> tuple[tuple[float, float], ...]:
        if not self.lines and self.result is not None:  # (most families never need them)
            self.lines = floor_pairs(self.result, self.min_busy, self.total)
        return self.lines or ((self.min_busy, self.total),)

    @property
    def key(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """What tells the family apart from the others of its configuration."""
        return self.types, self.tps

    @property
    def devices(self) -> int:
        """Devices one of its pipelines takes."""
        return sum(self.tps)

    def devices_of(self, kind: str) -> int:
        """Devices of type `kind` one of its pipelines takes."""
        return devices_of(self.types, self.tps, kind)

    def shape(self, n: int) -> ClassShape:
        """A class of n of its pipelines."""
        return ClassShape(self.types, n, self.tps)


_SAMPLES, _RISE = 3, 0.08  # where `floor_pairs` samples G: r = 8% apart above its first step


def floor_pairs(result: ClassResult, least_period: float, least_fill: float
                ) -> tuple[tuple[float, float], ...]:
    """Pairs (period, fill), periods rising and fills falling, such that every split of
    the class has a period and a fill at least one pair's. G(M), the least sum of w_s
    of the splits whose largest h_s is at most M, is sampled at M_i = M_0 (1 + r)^i:
    a split whose largest h_s lies in (M_i-1, M_i] has a period above M_i-1 (a period
    is at least the largest h_s) and a sum at least G(M_i); one at M_0 sums G(M_0),
    one above the last sample G(inf). Each period is at least `least_period`, each
    fill at least `least_fill` and the sum plus interleaving's (1 - 1/v) periods. A
    fixed class of few micro-batches runs on its fill, which its fastest split pays
    most of: the bound then sees it."""
    costs, v = result.costs, result.costs.interleave
    marks = [result.smallest_max * (1 + _RISE) ** i for i in range(_SAMPLES + 1)]
    pairs = [(result.smallest_max, result.first.weights),
             *((low, costs.cost(high)) for low, high in itertools.pairwise(marks)),
             (marks[-1], result.least_weights)]
    return pair_staircase(
        (period, max(least_fill, weights + (1 - 1 / v) * period))
        for period, weights in ((max(low, least_period), weights) for low, weights in pairs))


def pair_staircase(pairs: Iterable[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """(period, fill) pairs in order of period, less those another pair is below
    everywhere (a period no shorter and a fill no shorter)."""
    out: list[tuple[float, float]] = []
    for period, fill in pairs:
        if out and fill >= out[-1][1]:
            continue
        if out and period <= out[-1][0]:
            out.pop()  # the same period, a shorter fill
        out.append((period, fill))
    return tuple(out)


def device_work(table: CostTable, config: Config, tps: Sequence[int]) -> dict[str, float]:
    """Per type, the fewest device-seconds a micro-batch of the whole model takes on it
    at any of these tensor-parallel degrees (on the folded table; cached: the search
    and the families ask for it alike)."""
    table = fold(table, config.interleave)
    key = DeviceWorkKey(config.mb, tuple(tps))
    if key not in table.cache:
        table.cache[key] = {t.name: min(tp * float((c := table.costs(t.name, tp, config.mb)
                                                    ).fwd.sum() + c.bwd.sum()) for tp in tps)
                            for t in table.types}
    return table.cache[key]


def families(table: CostTable, config: Config, limits: Limits, space: Space,
             microbatches: int, tps: Sequence[int], split: bool = False,
             least_pipelines: int = 1) -> list[list[Family]]:
    """The levels of mixed patterns first (`mixed_levels` of them, absent with `mixed`
    off or a single type), then one level of homogeneous patterns per device type,
    fastest type first (the fewest device-seconds per micro-batch); each level holds its
    patterns at every tensor-parallel degree of `tps`, and with `split` (see
    `block_degrees`) the two-type ones also at every two different degrees of their
    blocks. A mixed level holds chains of up to `chain_limit` types in the order of
    their keys (`Family.key`), which is the order their classes are placed in
    (`search.placement_order`): each mixed level is one list, the same families.
    least_pipelines: the patterns of which the cluster holds fewer pipelines are left
    out (`FamilyFloors.fits`)."""
    table = fold(table, config.interleave)
    floors = FamilyFloors(table, config, limits, space, microbatches, least_pipelines)
    kinds = [t.name for t in table.types]
    work = device_work(table, config, tps)
    levels = [[f for tp in tps for f in floors.homogeneous(k, tp)]
              for k in sorted(work, key=lambda k: (work[k], k))]
    if limits.mixed and len(kinds) > 1:
        degrees = [(tp, tp) for tp in tps]
        if split and block_degrees(config, space, tps):
            degrees += list(itertools.permutations(tps, 2))
        pairs = list(itertools.permutations(sorted(kinds), 2))
        mixed = [f for tp_a, tp_b in degrees for a, b in pairs
                 for f in floors.two_types(a, tp_a, b, tp_b)]
        mixed += [f for tp in tps
                  for f in floors.chains(tp, chain_limit(table, limits, config, tp))]
        mixed.sort(key=lambda f: f.key)
        levels[:0] = [mixed] * mixed_in(mixed, mixed_levels(table, limits),
                                        limits.mixed_share_types)
    return levels


def mixed_in(mixed: list[Family], most: int, shared: bool = False) -> int:
    """The mixed classes a configuration's plans may have, of `most`: one where its
    mixed families that can run make more than `MIXED_PAIRS` pairs on disjoint types (a
    second mixed level would take longer than the rest of the search), but where mixed
    classes may share types (`Limits.mixed_share_types`: the user asked for the whole
    space)."""
    if most < 2 or shared:
        return most
    sets: dict[frozenset[str], int] = {}
    for f in mixed:
        if f.min_busy < INF:
            kinds = frozenset(f.types)
            sets[kinds] = sets.get(kinds, 0) + 1
    pairs = sum(sets[a] * sets[b] for a, b in itertools.combinations(sets, 2)
                if a.isdisjoint(b))
    return most if pairs <= MIXED_PAIRS else 1


def mixed_levels(table: CostTable, limits: Limits) -> int:
    """How many mixed classes a plan may have, a level of the search each: at most
    `Limits.mixed_classes`, and where a plan's mixed classes use disjoint sets of two or
    more types (`search._Setup.mixed_after`; unless `Limits.mixed_share_types`), at most
    one per two types (none with `mixed` off or a single type)."""
    kinds = len(table.types)
    if not limits.mixed or kinds < 2:
        return 0
    return limits.mixed_classes if limits.mixed_share_types else min(
        limits.mixed_classes, max(1, kinds // 2))


def chain_patterns(table: CostTable, limits: Limits, config: Config, tp: int, blocks: int
                   ) -> Iterator[tuple[tuple[str, ...], tuple[int, ...]]]:
    """Every chain of `blocks` distinct types (in every order) and its blocks' stage
    counts at degree tp: each block within its type's slots, the stages within the
    configuration's stage counts (`stage_counts`)."""
    lengths = stage_counts(limits, config, table.num_layers)
    if not lengths:
        return
    slots = {t.name: sum(d // tp for d in t.node_devices) for t in table.types}
    for order in itertools.permutations(sorted(slots), blocks):
        if any(slots[k] < 1 for k in order):
            continue
        yield from ((order, counts) for counts in _compositions(
            [slots[k] for k in order], lengths.start, lengths.stop - 1))


def _compositions(most: Sequence[int], least_total: int, most_total: int
                  ) -> Iterator[tuple[int, ...]]:
    """Positive counts, the i-th at most most[i], summing to least_total..most_total."""
    if not most:
        if least_total <= 0:
            yield ()
        return
    rest = len(most) - 1
    for first in range(1, min(most[0], most_total - rest) + 1):
        for tail in _compositions(most[1:], least_total - first, most_total - first):
            yield (first, *tail)


def chain_limit(table: CostTable, limits: Limits, config: Config, tp: int) -> int:
    """The most types a chain of the configuration may hold at degree tp: every type,
    unless the chains of three or more would be more than `CHAIN_FAMILIES` patterns;
    then the longest are left out until they are not (2: none). Cached."""
    kinds = len(table.types)
    if not limits.mixed:
        return 1
    key = ChainLimitKey(stage_counts(limits, config, table.num_layers), tp, CHAIN_FAMILIES)
    if key not in table.cache:
        table.cache[key], counted = kinds, 0
        for blocks in range(3, kinds + 1):
            counted += sum(1 for _ in itertools.islice(
                chain_patterns(table, limits, config, tp, blocks), CHAIN_FAMILIES + 1))
            if counted > CHAIN_FAMILIES:
                table.cache[key] = blocks - 1
                break
    return table.cache[key]


def gpipe_holds(table: CostTable, batch: int, space: Space, tps: Sequence[int]) -> bool:
    """Whether the devices could hold the leanest activations every layer keeps (at its
    cheapest allowed degree in bytes) for the whole global batch at once, as GPipe
    does: each pipeline keeps all its micro-batches, so where they cannot (with 1% to
    spare), every GPipe family's blocks overflow (`families`, each block's states and
    kept activations within its devices: summed over the most pipelines of a family
    that fit, they would hold at least the batch's; at 4096 tokens Llama-3 70B keeps
    5.5 GB a sample, past any 64 GPUs)."""
    room = sum((t.memory - t.reserve) * sum(t.node_devices) for t in table.types)
    kept = np.min([tp * np.min([table.activations(p, tp) for p in space.policies], axis=0)
                   for tp in tps], axis=0).sum()
    return batch * float(kept) <= room * 1.01


def block_degrees(config: Config, space: Space, tps: Sequence[int]) -> bool:
    """Whether a two-type class's two blocks may differ in tensor-parallel degree: where
    the classes choose their own (`Config.tp` None), on 1F1B or GPipe (the runtime
    runs such pipelines with one chain per rank of their narrowest stage,
    `runtime/follow.py`, not interleaved) and without ZeRO (their wider stages'
    followers do not shard: `evaluate.zero_space`). Chains of three or more types keep
    one degree."""
    return (config.tp is None and len(tps) > 1 and config.interleave == 1
            and 0 in space.zeros)


def stage_counts(limits: Limits, config: Config, layers: int) -> range:
    """Stages per pipeline of a table of `layers` (folded) layers: --pp or 1 to
    --max-stages, never more than the layers; at least 2 interleaved (one stage
    holding every chunk is plain 1F1B, which the configuration without chunks has) or
    with GPipe (one stage holding every micro-batch runs as 1F1B's one stage does, in
    less memory)."""
    least = 2 if config.interleave > 1 or config.gpipe else 1
    most = limits.pp if limits.pp else limits.max_stages
    return range(max(limits.pp or least, least), min(most, layers) + 1)


Result = TypeVar("Result")


def _memo(method: Callable[..., Result]) -> Callable[..., Result]:
    """A method's results kept per instance, by its arguments."""
    @functools.wraps(method)
    def cached(self: FamilyFloors, *args: object) -> Result:
        key = (method.__name__, *args)
        if key not in self.memo:
            self.memo[key] = method(self, *args)
        return self.memo[key]

    return cached


@dataclass(frozen=True)
class Fitting:
    """A pattern whose devices may hold its states: its stages' types and degrees, and
    the most of its pipelines the cluster holds."""

    types: tuple[str, ...]
    tps: tuple[int, ...]
    n_max: int


@dataclass(frozen=True)
class ChainRows:
    """Chains of three or more types at one degree, a row each, every order of types
    together: its order, what fits (`Fitting`) and its blocks' stage counts ([row,
    block], zero past a chain's last block), so that what depends on a block's type is
    priced once for the rows of every order that put that type there."""

    orders: list[tuple[str, ...]]
    fitting: list[Fitting]
    counts: np.ndarray  # [row, block]
    last_counts: np.ndarray  # [row, 1]: the last block's stages
    stages: np.ndarray  # [row]

    @staticmethod
    def of(by_order: dict[tuple[str, ...], list[tuple[Fitting, tuple[int, ...]]]]
           ) -> ChainRows:
        """The rows of the chains that fit (`FamilyFloors.chains`'s cache), an order
        after another, as they were found."""
        rows = [(order, found, counts) for order, found_counts in by_order.items()
                for found, counts in found_counts]
        blocks = max((len(order) for order, _, _ in rows), default=0)
        counts = np.array([[*c, *[0] * (blocks - len(c))] for _, _, c in rows],
                          dtype=float).reshape(len(rows), blocks)
        return ChainRows([order for order, _, _ in rows], [found for _, found, _ in rows],
                         counts, np.array([[c[-1]] for _, _, c in rows], dtype=float
                                          ).reshape(-1, 1), counts.sum(axis=1))

    def by(self, part: Callable[[tuple[str, ...]], object]) -> dict[object, np.ndarray]:
        """The rows by a part of their order (its first type, say), in order."""
        groups: dict[object, list[int]] = {}
        for r, order in enumerate(self.orders):
            groups.setdefault(part(order), []).append(r)
        return {k: np.array(members) for k, members in groups.items()}


@dataclass(frozen=True)
class MiddleBlock:
    """A middle block of a chain, as its least busy time depends on it besides its type:
    its stages, the fewest micro-batches one of them holds, and the bytes of states per
    parameter without ZeRO-3 and with it (`FamilyFloors.bytes_per_param`)."""

    count: int
    flight: float
    plain: float
    zero3: float


@dataclass(frozen=True)
class EndRows:
    """The chains (rows of `ChainRows`) whose first block, or last, is of one type, with
    what pricing that block reads that does not depend on the micro-batch size
    (`FamilyFloors.chain_ends`)."""

    members: np.ndarray  # the rows
    count: np.ndarray  # [row, 1]: the block's stages
    states: tuple[np.ndarray, np.ndarray]  # [row, j]: bytes of its layers' states (first
    # block: [0, j), last: [j, L)) without ZeRO-3 and with it (`bytes_per_param`)
    flight: np.ndarray  # [row, 1]: micro-batches its last stage holds
    ok: np.ndarray  # [row, j]: whether it may end (first block) or start (last) at j


@dataclass(frozen=True)
class ChainLayout:
    """The chains of `ChainRows` with what of them does not depend on the micro-batch
    size (`FamilyFloors.chain_layout`): their first and last blocks by type
    (`EndRows`), and per middle block (the second, then the third, ...) the rows by
    type and `MiddleBlock`."""

    rows: ChainRows
    heads: dict[str, EndRows]
    tails: dict[str, EndRows]
    middles: list[dict[tuple[str, MiddleBlock], list[int]]]


@dataclass(frozen=True)
class ChainEnds:
    """Per row of `ChainRows` and layer boundary j: the first block's least busy time
    holding layers [0, j) and least largest stage, the last block's holding [j, L)
    (infinite where the block cannot)."""

    head_busy: np.ndarray
    head_max: np.ndarray
    tail_busy: np.ndarray
    tail_max: np.ndarray


class FamilyFloors:
    """The first bounds of one configuration's families (see the module), from what
    they are built of: per type and degree the layers' busy times and prefix sums,
    the parameters and activations a block keeps, and the time a block must add where
    they overflow its memory (`memory`). What does not depend on the micro-batch size
    is kept in the table's cache across configurations."""

    def __init__(self, table: CostTable, config: Config, limits: Limits, space: Space,
                 microbatches: int, least_pipelines: int = 1) -> None:
        self.table, self.config, self.limits, self.space = table, config, limits, space
        self.microbatches, self.least_pipelines = microbatches, least_pipelines
        self.lengths = stage_counts(limits, config, table.num_layers)
        self.longest = max(self.lengths, default=1)
        self.rooms = {t.name: t.memory - t.reserve for t in table.types}
        self.memo: dict[tuple, object] = {}
        # ZeRO-3 gathers each layer's weights whole (less tied weights, kept whole), so
        # no share of a block's states it shards gathers fewer weight bytes per parameter
        # a rank holds than the block's fewest: those of [0, j) and of [j, L); and per
        # type the seconds three gathers of a byte take at least per micro-batch
        self.gatherable = table.params.copy()
        for owner, weights in table.tied_weights:
            self.gatherable[owner] -= weights
        self.gather_rate = {}
        for info in table.types:
            one, ref = cheapest_gather(table, info.name)
            self.gather_rate[info.name] = 3 * (ref - one) / ZERO_GATHER_REF

    @_memo
    def busy(self, kind: str, tp: int) -> np.ndarray:
        costs = self.table.costs(kind, tp, self.config.mb)
        return costs.fwd + costs.bwd

    @_memo
    def work(self, kind: str, tp: int) -> float:
        return float(self.busy(kind, tp).sum())

    @_memo
    def prefix(self, kind: str, tp: int) -> np.ndarray:
        return np.concatenate([[0.0], np.cumsum(self.busy(kind, tp))])

    @_memo
    def slots(self, kind: str, tp: int) -> int:
        return sum(d // tp for d in self.table.type(kind).node_devices)

    @_memo
    def heads(self, kind: str, tp: int) -> np.ndarray:
        return least_largest_parts(self.table, kind, tp, self.config.mb, self.longest)

    def largest_layer(self, parts: Sequence[tuple[str, int]]) -> float:
        """The largest layer's time on the fastest of these (type, degree) for it."""
        return float(np.min([self.busy(kind, tp) for kind, tp in parts], axis=0).max())

    @_memo
    def held(self, tp: int) -> np.ndarray:
        """Prefix sums of the parameters one rank holds per layer."""
        return np.concatenate([[0.0], np.cumsum(self.table.rank_params(tp))])

    @_memo
    def acts(self, tp: int) -> tuple[np.ndarray, np.ndarray]:
        """Prefix sums of the activations kept per layer without recompute, and of the
        fewest any allowed policy keeps."""
        table, mb = self.table, self.config.mb
        return (np.concatenate([[0.0], np.cumsum(table.activations(Recompute.NONE, tp))])
                * mb, np.concatenate([[0.0], np.cumsum(np.min(
                    [table.activations(p, tp) for p in self.space.policies], axis=0))]) * mb)

    @_memo
    def fewest(self, tp: int) -> tuple[np.ndarray, np.ndarray]:
        """The fewest weight bytes ZeRO-3 gathers per parameter a rank holds of the
        layers [0, j) and of [j, L)."""
        rank = self.table.rank_params(tp)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(rank > 0, np.maximum(self.gatherable, 0.0) / rank, INF
                             ) * self.table.weight_bytes
        return (np.concatenate([[INF], np.minimum.accumulate(ratio)]),
                np.concatenate([np.minimum.accumulate(ratio[::-1])[::-1], [INF]]))

    @staticmethod
    def gather_bytes(params: np.ndarray, per_param: np.ndarray) -> np.ndarray:
        """The weight bytes ZeRO-3 gathers at least for states of `params` per rank."""
        return np.where(params > 0, params * np.minimum(per_param, 1e300), 0.0)

    def memory(self, kind: str, tp: int, states: tuple[np.ndarray, np.ndarray],
               gathered: np.ndarray, kept: tuple[np.ndarray, np.ndarray],
               stages: np.ndarray, flight: np.ndarray) -> np.ndarray:
        """Time a block of type `kind` at degree `tp` must add at least where its
        parameter states and the activations it keeps, at least `flight` micro-batches
        per stage, overflow its memory: summed over its stages, the bytes over are what
        recompute must free (`RecomputeCurve`), unless ZeRO-3 shards the states of some
        of its parameters, for three gathers of their weights (`gathered` bytes for
        all, `gather_bytes`) per micro-batch.
        Any share x of the parameters may be sharded: the time is convex in x, least
        where recomputing more would cost more per byte than sharding more, or where
        the block first fits (or at 0 or 1).
        states: the bytes of the states without ZeRO-3 and with it (`bytes_per_param`);
        kept: the activations without recompute, and the fewest any allowed policy
        keeps of each layer; infinite where even those overflow."""
        space = self.space
        plain, zero3 = states
        room = stages * self.rooms[kind]
        curve = self.curve(kind, tp)
        gather = gathered * self.gather_rate[kind]

        def at(x: np.ndarray | float) -> np.ndarray:
            held_states = plain - x * (plain - zero3)
            over = held_states + flight * kept[0] - room
            seconds = x * gather
            if np.any(over > 0):
                seconds = seconds + curve(np.maximum(over, 0.0) / flight)
            over_least = held_states + flight * kept[1] - room
            return np.where(over_least > 1.0, INF, seconds)  # (a byte: rounding)

        if 3 not in space.zeros or not any(z < 3 for z in space.zeros):
            return at(float(3 in space.zeros))
        if not np.any(plain + flight * kept[0] > room):
            return at(0.0)  # (everything fits without ZeRO-3)
        # sharding pays where it costs less than recomputing the same bytes: down to the
        # bytes recompute frees for less (`worth`), and at least as far as fits
        shrink = plain - zero3
        with np.errstate(divide="ignore", invalid="ignore"):  # (where ZeRO-3 frees nothing)
            freed = curve.worth(np.where(shrink > 0, gather * flight / shrink, INF))
            fits, pays = (np.where(shrink > 0, (plain + flight * a - room) / shrink, 0.0)
                          for a in (kept[1], kept[0] - freed))
        return at(np.clip(np.maximum(fits, pays), 0.0, 1.0))

    @_memo
    def curve(self, kind: str, tp: int) -> RecomputeCurve:
        """`run_floors.recompute_curve` of a type at a degree (kept: `memory` asks often)."""
        return recompute_curve(self.table, kind, tp, self.config.mb, self.space.policies)

    @_memo
    def bytes_per_param(self, n: int) -> tuple[float, float]:
        """Fewest bytes per parameter a device can keep, with ZeRO over n pipelines:
        without ZeRO-3 (unless only it is allowed) and with any allowed stage."""
        table, zeros = self.table, self.space.zeros
        shard = n if n > 1 else 1
        plain = min((table.bytes_per_param(z, shard) for z in zeros if z < 3),
                    default=table.bytes_per_param(3, shard))
        return plain, min(table.bytes_per_param(z, shard) for z in zeros)

    @_memo
    def tails(self, kind: str, tp: int) -> tuple[np.ndarray, np.ndarray]:
        """[c - 1, j]: no stage of the last c stages of a pipeline holding layers
        [j, L) is busy for less, and they are not busy for less in all (the states as
        ZeRO over the most pipelines the type holds keeps them); c up to the stages
        the type's slots hold."""
        table, config = self.table, self.config
        most = max(1, min(self.longest, self.slots(kind, tp)))
        if config.gpipe:
            plain = least_largest_parts(table, kind, tp, config.mb, most, from_end=True)
            return plain, np.zeros_like(plain)
        return tails_in_memory(table, kind, tp, config, self.space, most,
                               self.bytes_per_param(self.slots(kind, tp))[1])

    def runs(self, n: int) -> int:
        """Micro-batches a pipeline of n side by side runs at least (for in_flight)."""
        return -(-self.microbatches // n) if self.config.gpipe else 10**9

    @_memo
    def flight(self, stage: int, stages: int, n: int) -> float:
        """Micro-batches stage `stage` of a pipeline of `stages`, one of n, holds."""
        config = self.config
        return float(in_flight(stage, stages, self.runs(n), config.schedule, config.interleave))

    @_memo
    def most(self, kind: str, count: int, tp: int) -> int:
        return capacity(self.table, tp, kind, count)

    def fits(self, parts: Sequence[tuple[str, int, int]]) -> Fitting | None:
        """The pattern of these blocks (type, stages, degree), or None if the stage pins
        rule it out, the cluster holds fewer than `least_pipelines` of its pipelines or
        its devices cannot hold the states however the layers are split (each rank holds
        at least its share at the widest degree)."""
        n_max = min(self.most(k, c, tp) for k, c, tp in parts)
        if n_max < self.least_pipelines:
            return None
        widest = max(tp for _, _, tp in parts)
        least = self.held(widest)[-1] * self.bytes_per_param(n_max)[1] if n_max >= 1 else INF
        if sum(c * self.rooms[k] for k, c, _ in parts) < least:
            return None
        types = tuple(k for k, c, _ in parts for _ in range(c))
        degrees = tuple(tp for _, c, tp in parts for _ in range(c))
        return Fitting(types, degrees, n_max) if self.limits.allows(types) else None

    @functools.cached_property
    def fits_by(self) -> FitsBy:
        """What the patterns that fit depend on besides their types and degrees."""
        limits = self.limits
        return FitsBy(self.lengths, limits.first_stage, limits.last_stage, self.space.zeros,
                      self.least_pipelines)

    def fill(self, busy: float | np.ndarray, period: float | np.ndarray) -> float | np.ndarray:
        """The least fill of a pipeline whose stages are busy this long in all and whose
        period is at least `period`: the busy time, or interleaved (`timing.py`) its
        1/v plus (1 - 1/v) periods."""
        v = self.config.interleave
        return busy if v == 1 else busy / v + (1 - 1 / v) * period

    def homogeneous(self, kind: str, tp: int) -> list[Family]:
        """All families of one block of type `kind` at degree `tp` at once (an entry per
        length)."""
        table = self.table
        key = HomogeneousShapesKey(kind, tp, self.fits_by)
        whole = self.held(tp)[-1]
        if key not in table.cache:  # (the same at every micro-batch size)
            found = [(s, found) for s in self.lengths
                     if s <= self.slots(kind, tp) and (found := self.fits([(kind, s, tp)]))]
            per = np.array([self.bytes_per_param(f.n_max) for _, f in found]).reshape(-1, 2)
            table.cache[key] = found, np.array([s for s, _ in found]), whole * per.T
        found, counts, states = table.cache[key]
        if not found:
            return []
        largest, least = (x[counts - 1, 0] for x in self.tails(kind, tp))
        flights = np.array([self.flight(s - 1, s, f.n_max) for s, f in found])
        kept = self.acts(tp)
        extra = self.memory(kind, tp, tuple(states),
                            self.gather_bytes(whole, self.fewest(tp)[0][-1]),
                            (kept[0][-1], kept[1][-1]), counts, flights)
        total = np.maximum(self.work(kind, tp) + extra, least)
        period = np.maximum.reduce([total / counts, np.full(len(counts), self.largest_layer(
            [(kind, tp)])), self.heads(kind, tp)[counts - 1, -1], largest])
        return [Family(types=f.types, tps=f.tps, n_max=f.n_max, min_busy=m, total=t)
                for (_, f), t, m in zip(found, self.fill(total, period).tolist(),
                                        period.tolist(), strict=True)]

    def two_type_shapes(self, a: str, tp_a: int, b: str, tp_b: int) -> tuple:
        """The families of a block of type a then one of type b (at these degrees) that
        fit, with their block lengths (ca, cb), the bytes of states (without ZeRO-3 and
        with it) of their first j layers on a's ranks and of the rest on b's, and which
        split points j leave every stage a layer and each block room for its states:
        the same at every micro-batch size (cached in the table)."""
        table, rooms = self.table, self.rooms
        key = TwoTypeShapesKey(a, tp_a, b, tp_b, self.fits_by)
        if key not in table.cache:
            kept = [(found, ca, total - ca) for total in self.lengths
                    for ca in range(1, min(total, self.slots(a, tp_a) + 1))
                    if 1 <= total - ca <= self.slots(b, tp_b)
                    and (found := self.fits([(a, ca, tp_a), (b, total - ca, tp_b)]))]
            ca = np.array([float(ca) for _, ca, _ in kept])[:, None]
            cb = np.array([float(cb) for _, _, cb in kept])[:, None]
            per = np.array([self.bytes_per_param(found.n_max) for found, _, _ in kept]
                           ).reshape(-1, 2)
            head, tail = self.held(tp_a)[None, :], (self.held(tp_b)[-1] - self.held(tp_b))[None, :]
            heads_states = (head * per[:, :1], head * per[:, 1:])
            tails_states = (tail * per[:, :1], tail * per[:, 1:])
            j = np.arange(table.num_layers + 1)[None, :]
            ok = ((j >= ca) & (j <= table.num_layers - cb) & (heads_states[1] <= ca * rooms[a])
                  & (tails_states[1] <= cb * rooms[b]))
            table.cache[key] = kept, ca, cb, heads_states, tails_states, ok
        return table.cache[key]

    def two_type_flights(self, a: str, tp_a: int, b: str, tp_b: int, kept: list,
                         ca: np.ndarray, cb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Micro-batches the last stage of each family's blocks holds at least, the
        fewest of the block's (cached where they do not depend on the micro-batch count:
        all but GPipe)."""
        config = self.config
        counts = tuple(self.runs(found.n_max) for found, _, _ in kept)
        key = TwoTypeFlightsKey(TwoTypeShapesKey(a, tp_a, b, tp_b, self.fits_by),
                                config.schedule, config.interleave, counts)
        if key not in self.table.cache:
            ends = (ca + cb)[:, 0].astype(int).tolist()

            def held_by(starts: list[int]) -> np.ndarray:
                return np.array([float(in_flight(s, e, m, config.schedule, config.interleave))
                                 for s, e, m in zip(starts, ends, counts, strict=True)])[:, None]

            self.table.cache[key] = (held_by([int(c) - 1 for c in ca[:, 0]]),
                                     held_by([e - 1 for e in ends]))
        return self.table.cache[key]

    def two_types(self, a: str, tp_a: int, b: str, tp_b: int) -> list[Family]:
        """All families of a block of type a then one of type b, at these degrees, at
        once: a row per family, a column per split point j."""
        kept, ca, cb, head_states, tail_states, ok = self.two_type_shapes(a, tp_a, b, tp_b)
        live = np.flatnonzero(ok.any(axis=1))
        if not len(live):
            return []
        first, last = self.two_type_flights(a, tp_a, b, tp_b, kept, ca, cb)
        ca, cb, ok, first, last = (x[live] for x in (ca, cb, ok, first, last))
        head_states, tail_states = (tuple(x[live] for x in states)
                                    for states in (head_states, tail_states))
        head = self.head_time(a, tp_a, head_states, ca, first)
        tail = self.tail_time(b, tp_b, tail_states, cb, last)
        largest, least = (x[cb[:, 0].astype(int) - 1] for x in self.tails(b, tp_b))
        tail = np.maximum(tail, least)
        total = np.where(ok, head + tail, INF).min(axis=1)
        # a block's largest stage: at least its mean and its layers' least largest part
        head_max = np.maximum(head / ca, self.heads(a, tp_a)[ca[:, 0].astype(int) - 1])
        tail_max = np.maximum(tail / cb, largest)
        period = np.maximum(np.where(ok, np.maximum(head_max, tail_max), INF).min(axis=1),
                            self.largest_layer([(a, tp_a), (b, tp_b)]))
        return [Family(types=kept[i][0].types, tps=kept[i][0].tps, n_max=kept[i][0].n_max,
                       total=t, min_busy=m)
                for i, t, m in zip(live.tolist(), self.fill(total, period).tolist(),
                                   period.tolist(), strict=True)]

    def head_time(self, kind: str, tp: int, states: tuple[np.ndarray, np.ndarray],
                  stages: np.ndarray, flight: np.ndarray) -> np.ndarray:
        """Per row and layer boundary j, the least busy time of a pipeline's first block
        of type `kind` holding layers [0, j) (`memory` added; `states` of [0, j))."""
        kept = self.acts(tp)
        return self.prefix(kind, tp)[None, :] + self.memory(
            kind, tp, states, self.gather_bytes(self.held(tp), self.fewest(tp)[0])[None, :],
            (kept[0][None, :], kept[1][None, :]), stages, flight)

    def tail_time(self, kind: str, tp: int, states: tuple[np.ndarray, np.ndarray],
                  stages: np.ndarray, flight: np.ndarray) -> np.ndarray:
        """Per row and layer boundary j, the least busy time of a pipeline's last block
        of type `kind` holding layers [j, L) (`memory` added; `states` of [j, L))."""
        kept, held = self.acts(tp), self.held(tp)
        return (self.work(kind, tp) - self.prefix(kind, tp))[None, :] + self.memory(
            kind, tp, states, self.gather_bytes(held[-1] - held, self.fewest(tp)[1])[None, :],
            (kept[0][-1] - kept[0][None, :], kept[1][-1] - kept[1][None, :]), stages, flight)

    def chains(self, tp: int, most: int) -> list[Family]:
        """The families of chains of three to `most` types at degree tp (see the
        module), every order of types at once, a row per family (`ChainRows`)."""
        layout = self.chain_layout(tp, most)
        rows = layout.rows
        if not rows.fitting:
            return []
        ends = self.chain_ends(tp, layout)
        if (self.table.num_layers + 1) ** 2 <= _WHOLE_MIDDLES:
            done, reach = self.middles(tp, layout, ends.head_busy, ends.head_max)
        else:  # (long models: each middle block its layers' time, no memory, any period)
            done, reach = ends.head_busy.copy(), ends.head_max.copy()
            for order, members in rows.by(lambda order: order).items():
                for b, kind in enumerate(order[1:-1], 1):
                    prefix = self.prefix(kind, tp)[None, :]
                    done[members] = prefix + _shifted(np.minimum.accumulate(
                        done[members] - prefix, axis=1), rows.counts[members, b].astype(int))
                reach[members] = _shifted(np.minimum.accumulate(
                    ends.head_max[members], axis=1),
                    (rows.stages[members] - rows.counts[members, 0]
                     - rows.last_counts[members, 0]).astype(int))
        total = (done + ends.tail_busy).min(axis=1)
        largest = {order: self.largest_layer([(kind, tp) for kind in order])
                   for order in dict.fromkeys(rows.orders)}
        period = np.maximum.reduce([
            np.maximum(reach, ends.tail_max).min(axis=1), total / rows.stages,
            np.array([largest[order] for order in rows.orders])])
        return [Family(types=f.types, tps=f.tps, n_max=f.n_max, total=t, min_busy=m)
                for f, t, m in zip(rows.fitting, self.fill(total, period).tolist(),
                                   period.tolist(), strict=True) if m < INF]

    def chain_layout(self, tp: int, most: int) -> ChainLayout:
        """The chains of three to `most` types at degree tp that fit, as rows
        (`ChainRows`), with what of them does not depend on the micro-batch size
        (`ChainLayout`; both cached in the table)."""
        shapes = ChainShapesKey(tp, most, self.fits_by)
        if shapes not in self.table.cache:
            by_order: dict[tuple[str, ...], list[tuple[Fitting, tuple[int, ...]]]] = {}
            for blocks in range(3, most + 1):
                for order, counts in chain_patterns(self.table, self.limits, self.config, tp,
                                                    blocks):
                    found = self.fits([(k, c, tp) for k, c in zip(order, counts, strict=True)])
                    if found is not None:
                        by_order.setdefault(order, []).append((found, counts))
            self.table.cache[shapes] = by_order
        config = self.config
        key = ChainLayoutKey(shapes, config.schedule, config.interleave,
                             self.microbatches if config.gpipe else None)
        if key not in self.table.cache:
            rows = ChainRows.of(self.table.cache[shapes])
            counts = rows.counts.astype(int).tolist()
            stages = rows.stages.astype(int).tolist()
            middles = []
            for b in range(1, max((len(order) for order in rows.orders), default=2) - 1):
                groups: dict[tuple[str, MiddleBlock], list[int]] = {}
                for r, (order, f) in enumerate(zip(rows.orders, rows.fitting, strict=True)):
                    if b < len(order) - 1:
                        groups.setdefault((order[b], MiddleBlock(counts[r][b], self.flight(
                            sum(counts[r][:b + 1]) - 1, stages[r], f.n_max),
                            *self.bytes_per_param(f.n_max))), []).append(r)
                middles.append(groups)
            self.table.cache[key] = ChainLayout(
                rows, *(self.end_rows(tp, rows) if rows.fitting else ({}, {})), middles)
        return self.table.cache[key]

    def end_rows(self, tp: int, rows: ChainRows
                 ) -> tuple[dict[str, EndRows], dict[str, EndRows]]:
        """The chains' first blocks by type and their last blocks by type (`EndRows`)."""
        layers, rooms = self.table.num_layers, self.rooms
        counts, stages = rows.counts.astype(int).tolist(), rows.stages.astype(int).tolist()
        first_count, last_count = rows.counts[:, :1], rows.last_counts
        per = np.array([self.bytes_per_param(f.n_max) for f in rows.fitting]).reshape(-1, 2)
        first = np.array([self.flight(c[0] - 1, s, f.n_max) for f, c, s in zip(
            rows.fitting, counts, stages, strict=True)]).reshape(-1, 1)
        last = np.array([self.flight(s - 1, s, f.n_max) for f, s in zip(
            rows.fitting, stages, strict=True)]).reshape(-1, 1)
        held = self.held(tp)
        head, tail = held[None, :], (held[-1] - held)[None, :]
        head_states = (head * per[:, :1], head * per[:, 1:])
        tail_states = (tail * per[:, :1], tail * per[:, 1:])
        j = np.arange(layers + 1)[None, :]
        first_rooms = np.array([[rooms[order[0]]] for order in rows.orders])
        last_rooms = np.array([[rooms[order[-1]]] for order in rows.orders])
        head_ok = (j >= first_count) & (head_states[1] <= first_count * first_rooms)
        tail_ok = (j <= layers - last_count) & (tail_states[1] <= last_count * last_rooms)
        return ({kind: EndRows(members, first_count[members],
                               tuple(s[members] for s in head_states), first[members],
                               head_ok[members])
                 for kind, members in rows.by(lambda order: order[0]).items()},
                {kind: EndRows(members, last_count[members],
                               tuple(s[members] for s in tail_states), last[members],
                               tail_ok[members])
                 for kind, members in rows.by(lambda order: order[-1]).items()})

    def chain_ends(self, tp: int, layout: ChainLayout) -> ChainEnds:
        """The first and last blocks of these chains (`ChainLayout`), a type at a time:
        per row and layer boundary j, the first block's least busy time holding layers
        [0, j) and its least largest stage, the last block's holding [j, L) and its
        least largest stage (`head_time`, `tail_time`, raised to the least largest
        parts)."""
        shape = (len(layout.rows.orders), self.table.num_layers + 1)
        head_busy, head_max, tail_busy, tail_max = (np.full(shape, INF) for _ in range(4))
        for kind, end in layout.heads.items():
            members, count = end.members, end.count
            head_busy[members] = np.where(end.ok, self.head_time(
                kind, tp, end.states, count, end.flight), INF)
            head_max[members] = np.where(end.ok, np.maximum(head_busy[members] / count, self.heads(
                kind, tp)[count[:, 0].astype(int) - 1]), INF)
        for kind, end in layout.tails.items():
            members, count = end.members, end.count
            largest, least = (x[count[:, 0].astype(int) - 1] for x in self.tails(kind, tp))
            busy = self.tail_time(kind, tp, end.states, count, end.flight)
            tail_busy[members] = np.where(end.ok, np.maximum(busy, least), INF)
            tail_max[members] = np.maximum(tail_busy[members] / count, largest)
        return ChainEnds(head_busy, head_max, tail_busy, tail_max)

    def middles(self, tp: int, layout: ChainLayout, head_busy: np.ndarray,
                head_max: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Through the middle blocks of these chains, a block at a time: per row and
        layer boundary j, the least busy time of the blocks before the last holding
        layers [0, j), and the least largest stage of a block among them (from the
        first block's, `head_busy` and `head_max`; `middle_busy` prices a block and
        `largest_stage` its largest stage, the same for the rows of every order with the
        same middle block)."""
        done, reach = head_busy.copy(), head_max.copy()
        step = max(1, _MIDDLE_CELLS // (self.table.num_layers + 1) ** 2)  # rows at a time
        for groups in layout.middles:
            busies: dict[tuple[str, MiddleBlock], np.ndarray] = {}
            for kind in dict.fromkeys(kind for kind, _ in groups):
                blocks = [block for k, block in groups if k == kind]
                busies.update(((kind, block), busy) for block, busy in zip(
                    blocks, self.middle_busy(kind, tp, blocks), strict=True))
            # every row of the block at once (`step` rows at a time), each its own block's
            members = [r for rows in groups.values() for r in rows]
            stage_floors = {key: self.largest_stage(key[0], tp, key[1].count, busies[key])
                            for key in groups}
            priced = [(busies[key], stage_floors[key]) for key, rows in groups.items()
                      for _ in rows]  # (per member: its block's busy times and largest stage)
            for at in range(0, len(members), step):
                part = members[at:at + step]
                busy = np.stack([matrix for matrix, _ in priced[at:at + step]])
                largest = np.stack([matrix for _, matrix in priced[at:at + step]])
                done[part] = (done[part][:, :, None] + busy).min(axis=1)
                reach[part] = np.maximum(reach[part][:, :, None], largest).min(axis=1)
        return done, reach

    def largest_stage(self, kind: str, tp: int, count: int, busy: np.ndarray) -> np.ndarray:
        """[i, j]: no stage of a middle block of `count` stages of type `kind` holding
        layers [i, j), whose least busy time is `busy`, is busy for less: the block's
        mean, and its layers' least largest part (`least_largest_ranges`, slightly
        lowered against rounding as `least_largest_parts` is; where the model is short
        enough for it)."""
        mean = busy / count
        if len(busy) ** 3 > RANGE_CELLS:
            return mean
        parts = least_largest_ranges(self.table, kind, tp, self.config.mb, count)
        return np.maximum(mean, parts * (1 - 1e-9))

    def middle_busy(self, kind: str, tp: int, blocks: Sequence[MiddleBlock]
                    ) -> list[np.ndarray]:
        """Per middle block of type `kind` (`MiddleBlock`), [i, j]: its least busy time
        holding layers [i, j): its layers' time plus what memory adds (`memory`),
        infinite where its states cannot fit or it has fewer layers than stages. Those
        not priced yet are priced together (a stack of them, as many as
        `_MIDDLE_CELLS` allows at once), and kept."""
        held, kept = self.held(tp), self.acts(tp)
        todo = [b for b in dict.fromkeys(blocks) if ("middle_busy", kind, tp, b) not in self.memo]
        at_once = max(1, _MIDDLE_CELLS // len(held) ** 2)
        for start in range(0, len(todo), at_once):
            part = todo[start:start + at_once]
            count, flight, plain, zero3 = (np.array([float(getattr(b, name)) for b in part]
                                                    )[:, None, None]
                                           for name in ("count", "flight", "plain", "zero3"))
            params = held[None, :] - held[:, None]  # layers [i, j) one rank holds
            width = np.arange(len(held))[None, :] - np.arange(len(held))[:, None]
            states = (params[None] * plain, params[None] * zero3)
            prefix = self.prefix(kind, tp)
            busy = (prefix[None, :] - prefix[:, None])[None] + self.memory(
                kind, tp, states,
                self.gather_bytes(np.maximum(params, 0.0), self.fewest(tp)[0][-1]),
                tuple(a[None, :] - a[:, None] for a in kept), count, flight)
            busy = np.where((width[None] >= count) & (states[1] <= count * self.rooms[kind]),
                            busy, INF)
            for b, matrix in zip(part, busy, strict=True):
                self.memo["middle_busy", kind, tp, b] = matrix
        return [self.memo["middle_busy", kind, tp, b] for b in blocks]


def _shifted(values: np.ndarray, by: np.ndarray) -> np.ndarray:
    """Each row moved right by its own count of columns (infinite where nothing moved
    in): values[r, j - by[r]] at [r, j]."""
    columns = np.arange(values.shape[1])[None, :] - by[:, None]
    taken = np.take_along_axis(values, np.clip(columns, 0, None), axis=1)
    return np.where(columns >= 0, taken, INF)
