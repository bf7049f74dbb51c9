"""Best-first branch and bound over plan structures.

Search space, for every micro-batch size, chunk count (interleaved 1F1B, on the folded
table: `interleave.py`) and tensor-parallel degree allowed, or with `tp_per_class` every
class at any allowed degree of its own, and the mixed class's two blocks each at its
own where neither interleaving nor ZeRO runs (`bound.block_degrees`: a stage wider
than its neighbour's has its first rank broadcast to the others, `runtime/follow.py`,
which `partition.class_costs` prices):

  * up to `Limits.mixed_classes` *mixed* classes (`families.mixed_levels`): each n
    pipelines whose stages chain blocks of two or more types in an order the search
    chooses (A100 -> RTX 4090 -> RTX 3090 as well as any other; the longest chains
    left out where they are too many, `families.chain_limit`), the classes on disjoint
    sets of types (two pairs of nodes of different speeds run as two two-node
    classes; one class where the pairs would be too many, `families.mixed_in`), and
  * for each device type, at most one *homogeneous* class: n pipelines of S
    stages of that type,

placed as `structure.place` describes (the mixed classes first, in the order of their
patterns: `placement_order`), every class's layer split, recompute and ZeRO choices
optimal (`partition`), micro-batches shared optimally (`evaluate.shares`). The
objective is `evaluate`'s step time.

A node of the search tree fixes a mixed class per mixed level (each level's pattern
after the level before it's, so no structure twice), then the homogeneous class of one
type per level, fastest type first; a node that fixes a mixed class has two children
for it where more mixed levels follow: one with the mixed levels closed, one that must
add another mixed class (`_Setup.mixed_after`), which waits in a queue of its own
(`_Search.deferred`) until no other node may beat the best plan: its bound, which
values the types the next mixed class may use per slot, is looser, and most such
nodes are pruned once the search holds the plans the others lead to. A node's last
class stands for 1..n pipelines (fewer are its lazy siblings). Its bound
(`bound.Bound`) is the time the
global batch needs if the fixed classes ran at their lower bounds, in whole
micro-batches, and the open levels' pipelines packed the devices left at the
best per-device rates any of their families could reach (an LP dual: no assignment
of slots does better), plus the gradient sync its fixed classes pay at least
(`sync_floor`, and where two are fixed, on the nodes placement gives them:
`evaluate.cross_class_floor`). Nodes are expanded in order of bound, so when the queue's
best bound reaches the k-th best plan found, no unexplored structure can beat it:
the search is optimal. Before that, a greedy plan (one homogeneous class per
type, fastest first), moves around it that hand a few pipelines to a mixed class,
dives down the tree and the best structure so far tried in every other
configuration give it a good plan to prune with. A time limit stops
the search early, inside the pricing of one structure too, and reports the queue's
best bound (and the structure's, for what its pricing left out).

The space is searched in two parts, each a tree of its own whose nodes share one
queue (`_parts`): structures of several classes run without ZeRO (the runtime
shards only layers one replica set holds), so one part bounds every structure as if
ZeRO-free, which makes its families deeper and its bounds far tighter where the
states are large; the other holds the structures of one class (1F1B, GPipe or
interleaved pipelines), with ZeRO allowed, and its nodes that fix a class are
leaves.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

import planner.solver.families as families_module
from cost_models.comm import Collective, CommGroup
from planner.errors import PlannerError
from planner.solver.bound import (
    Bound,
    best_per_slot,
    crowded,
    fewest_counts,
    optimizer_bound,
    tight_result,
    tighten,
)
from planner.solver.bounds import lower_bound
from planner.solver.evaluate import (
    Config,
    Evaluation,
    Space,
    card_floor,
    cross_class_floor,
    price,
    refine,
    sharded_card_floors,
)
from planner.solver.families import (
    CHAIN_FAMILIES,
    Family,
    chain_limit,
    device_work,
    families,
    gpipe_holds,
    mixed_in,
    mixed_levels,
)
from planner.solver.interleave import choices, fold
from planner.solver.keys import FixedSyncKey, Zero3FamilyKey
from planner.solver.limits import Limits
from planner.solver.links import cheapest_gather
from planner.solver.partition import INF, optimize, zero3_first
from planner.solver.step import synced
from planner.solver.structure import ClassShape, free_after, place, room
from planner.solver.sync_floor import SyncFloor
from planner.solver.table import CostTable
from planner.types import Schedule
from planner.units import fmt_seconds

SEARCH_SPACE = ("{mixed} plus one homogeneous class per device type; one tp degree (with "
                "--tp-per-class one per class, and per block of a two-type class where it "
                "runs 1F1B or GPipe without ZeRO), micro-batch size "
                "and chunk count per plan, each allowed one tried; 1F1B, GPipe over several "
                "stages in structures of one class, or "
                "interleaved 1F1B over several stages with the same cuts in every round and "
                "whole multiples of its stages in micro-batches; exact layer "
                "splits (those no other beats in largest stage and total, and in the "
                "parameters a stage holds where pipelines run no more micro-batches than "
                "stages) and recompute per stage, ZeRO per stage in structures of one class "
                "(ZeRO-3 where its pipelines run equal micro-batch counts); optimal "
                "micro-batch shares")


def search_space(table: CostTable, batch: int, limits: Limits,
                 paired: Sequence[Config] = ()) -> str:
    """What the search covers (`SEARCH_SPACE`, with its most mixed classes), and where it
    is cut for speed: one mixed class in the configurations (`paired`) whose mixed
    families would make too many pairs for a second (`families.mixed_in`), and chains of
    fewer types than the cluster has at some degree, where longer ones would be more
    than `CHAIN_FAMILIES` patterns (`families.chain_limit`)."""
    kinds = len(table.types)
    space = SEARCH_SPACE.format(mixed=_mixed_classes(
        mixed_levels(table, limits), paired, limits.mixed_share_types,
        limits.mixed_classes if limits.mixed else 0))
    if not limits.mixed or kinds < 3:
        return space
    most: dict[int, int] = {}  # per degree, the fewest types a chain may hold
    for config in configs(table, batch, limits):
        for tp in degrees(table, limits) if config.tp is None else [config.tp]:
            most[tp] = min(most.get(tp, kinds), chain_limit(
                fold(table, config.interleave), limits, config, tp))
    cuts = [f"{most[tp]} at tp {tp}" for tp in sorted(most) if most[tp] < kinds]
    if not cuts:
        return space
    return (f"{space}. Cut for speed: a pipeline chains at most "
            f"{', '.join(cuts)} of the cluster's {kinds} device types (longer chains "
            f"would add more than {CHAIN_FAMILIES:,} pipeline patterns per configuration)")


def _mixed_classes(most: int, paired: Sequence[Config], shared: bool = False,
                   asked: int = 1) -> str:
    """The mixed classes of the search space, in words (`search_space`): `paired`, the
    configurations cut to one (`families.mixed_in`); `shared`, whether two may share
    types (`Limits.mixed_share_types`: no cut on them); `asked`, the most the limits
    allow (`Limits.mixed_classes`: more than `most` where disjoint types cap them)."""
    chains = ("pipelines chain blocks of two or more device types in any order, a type "
              "at most once")
    if most == 0:
        return "no mixed pipeline class,"
    if most == 1 and asked > 1 and not shared:  # (too few types for two disjoint ones)
        return (f"one optional mixed pipeline class (a cut for speed: a second would share "
                f"a device type with it, --mixed-share-types searches it; its {chains}),")
    if most == 1:
        return f"one optional mixed pipeline class (its {chains}),"
    cut = ""
    if paired:
        at = sorted({"a degree per class" if c.tp is None else f"tp {c.tp}" for c in paired})
        cut = (f"; cut for speed to one where a configuration's mixed patterns make more "
               f"than {families_module.MIXED_PAIRS:,} pairs on disjoint types: at "
               f"{', '.join(at)}")
    if shared:
        return f"up to {most} mixed pipeline classes on any device types (their {chains}),"
    return (f"up to {most} mixed pipeline classes over disjoint sets of device types (a cut "
            f"for speed: two that share a type are left out, --mixed-share-types searches "
            f"them; their {chains}{cut}),")


# candidates a node's children bound by ranges of their counts at once; beyond, only
# those whose bound as one range is promising (a `many` call costs as much as some
# dozens of rows: at 1,024 GPUs, the roots' hundreds of families)
_RANGED = 32
_DIVE_TRIES = 16  # children a dive settles at each level before it picks one
_MANY_ROWS = 256  # children bounded in one `Bound.many` call (`_Search.many`)
_WAITING = -1  # the level of a configuration's root before it is set up (`_Search.set_up`)


@dataclass(frozen=True)
class Progress:
    """Where a running search stands, for a progress line."""

    explored: int
    best: float | None  # the step time of the best plan so far
    bound: float  # no plan of the search space is faster (up to the gap)

    def describe(self) -> str:
        if self.best is None:
            return f"Searching plans: {self.explored:,} explored"
        gap = (self.best - self.bound) / self.best
        return (f"Searching plans: {self.explored:,} explored, best {fmt_seconds(self.best)} "
                f"step, at most {gap:.1%} from optimal (Ctrl-C stops with it)")


@dataclass
class SearchResult:
    best: list[Evaluation]
    status: str  # "optimal", "feasible" (the time limit) or "interrupted" (Ctrl-C)
    bound: float
    explored: int
    pruned: int
    wall_time: float
    space: str = ""  # what the search covered (`search_space`)


@dataclass(order=True)
class _Node:
    bound: float
    order: int
    config: Config = field(compare=False)
    base: float = field(compare=False)  # the bound before the fixed classes' sync floor
    level: int = field(compare=False)  # 0: mixed class, then one level per type
    chosen: tuple[tuple[tuple[str, ...], int], ...] = field(compare=False)  # families' keys
    counts: tuple[int, ...] = field(compare=False)
    # the last family may still shrink by one pipeline (its siblings are made lazily)
    fewer: frozenset = field(compare=False, default=frozenset())
    # with `fewer`: per count 1..n of the last family, its own bound and base
    counted: tuple = field(compare=False, default=())
    unsynced: bool = field(compare=False, default=False)  # base: `Bound.unsynced`'s


SWAPS = 64  # moves around the greedy plan that are priced (`_Search.swap`)


@dataclass(frozen=True)
class _Setup:
    """A configuration's levels of families, their bound, and its families by key."""

    levels: list[list[Family]]
    bound: Bound
    index: dict[tuple[tuple[str, ...], tuple[int, ...]], Family]
    mixed: int  # the mixed levels, first (one list of families: `families.families`)
    rank: dict[tuple[tuple[str, ...], tuple[int, ...]], int]  # a mixed family's place there
    # per set of types, the place of the last mixed family that can run on none of them
    last_apart: dict[frozenset[str], int] = field(default_factory=dict)
    disjoint: dict[frozenset[str], list[Family]] = field(default_factory=dict)  # (`apart`)
    shared: bool = False  # mixed classes may share types (`Limits.mixed_share_types`)

    def used(self, chosen: Sequence[tuple[tuple[str, ...], tuple[int, ...]]]
             ) -> frozenset[str]:
        """The types a mixed class after these may not use: those of their mixed classes
        (a cut for speed, `search_space`), none where mixed classes may share types."""
        return frozenset() if self.shared else _mixed_types(chosen)

    def mixed_after(self, node: _Node) -> list[Family]:
        """The families a node's level offers: at a mixed level past the first, those
        after the mixed family the node chose last (a structure's mixed classes are
        chosen in their placement order, so none twice) on device types none of its
        mixed classes uses (a cut for speed, `search_space`; `used`)."""
        level = self.levels[node.level]
        if 0 < node.level < self.mixed:
            used = self.used(node.chosen)
            return [f for f in level[self.rank[node.chosen[-1]] + 1:]
                    if used.isdisjoint(f.types)]
        return level

    def apart(self, chosen: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...]
              ) -> list[Family]:
        """The mixed families on none of the types these families' mixed classes use
        (`used`)."""
        used = self.used(chosen)
        if used not in self.disjoint:
            self.disjoint[used] = [f for f in self.levels[0] if used.isdisjoint(f.types)]
        return self.disjoint[used]

    def may_follow(self, chosen: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...]) -> bool:
        """Whether a mixed level may add a class after these (the last of them mixed):
        some family that can run comes after the last in placement order and uses none
        of their types (`used`)."""
        used = self.used(chosen)
        if used not in self.last_apart:
            self.last_apart[used] = max((i for i, f in enumerate(self.levels[0])
                                         if f.min_busy < INF and used.isdisjoint(f.types)),
                                        default=-1)
        return self.rank[chosen[-1]] < self.last_apart[used]


def _mixed_types(chosen: Sequence[tuple[tuple[str, ...], tuple[int, ...]]]) -> frozenset[str]:
    """The types the mixed classes among these families' keys use."""
    return frozenset(k for types, _ in chosen if len(set(types)) > 1 for k in types)


def degrees(table: CostTable, limits: Limits) -> list[int]:
    """The tensor-parallel degrees a class may have."""
    return [t for t in table.tps if (limits.tp is None or t == limits.tp)
            and (limits.max_tp is None or t <= limits.max_tp)
            and any(d % t == 0 for info in table.types for d in info.node_devices)]


def configs(table: CostTable, batch: int, limits: Limits) -> list[Config]:
    allowed = degrees(table, limits)
    if not allowed:
        return []
    out = []
    mbs = [m for m in table.micro_batches if batch % m == 0
           and (limits.micro_batch is None or m == limits.micro_batch)
           and m <= max(limits.max_micro_batch, limits.micro_batch or 0)]
    wanted = limits.interleaves if limits.pp != 1 else (1,)  # (one stage: plain 1F1B)
    chunks = choices(table.num_layers, (limits.interleave,) if limits.interleave else wanted)
    schedule = limits.schedule
    tps: list[int | None] = [None] if limits.tp_per_class else list(allowed)
    for tp, mb, v in itertools.product(tps, mbs, chunks):
        if schedule is None or schedule is (Schedule.INTERLEAVED if v > 1
                                            else Schedule.ONE_F_ONE_B):
            out.append(Config(mb=mb, tp=tp, interleave=v))
    if schedule in (None, Schedule.GPIPE) and limits.pp != 1 and (limits.interleave or 1) == 1:
        out += [Config(mb=mb, tp=tp, gpipe=True) for tp, mb in itertools.product(tps, mbs)]
    return out


class _Search:
    """The state of one search: the queue, the best structures so far, the counters."""

    def __init__(self, table: CostTable, batch: int, limits: Limits, space: Space,
                 top_k: int, gap: float, single: bool, best: list[Evaluation],
                 counter: Iterator[int], deadline: float | None = None,
                 first: Sequence[Config] = ()) -> None:
        """single: search only structures of one class, else bound every structure
        as if ZeRO-free (as those of several classes are; see `_parts`); best: the
        plans found so far, shared with the other part's search; counter: node
        numbers, shared too; deadline: the `time.perf_counter` value at which
        pricing one structure stops with what it found (`evaluate.refine`), and past
        which configurations are set up only when the search takes their root (its
        bound till then `bounds.lower_bound`, which no plan beats) but for those of
        `first` (the seeds'), set up first."""
        self.table, self.batch, self.limits, self.pricing = table, batch, limits, space
        if single:  # (one mixed level: its structures hold one class)
            self.limits = dataclasses.replace(limits, mixed_classes=min(1, limits.mixed_classes))
        # pricing: the whole space, in either part (a structure priced in both gets one
        # price, `_leaf`); space: what this part's bounds and families assume
        self.space = space if single else dataclasses.replace(space, zeros=(0,))
        self.top_k, self.gap, self.single, self.deadline = top_k, gap, single, deadline
        self.heap: list[_Node] = []
        # nodes that must add another mixed class: taken once no node of `heap` may beat
        # the best plan (`upcoming`; their bounds, from families not yet priced, are
        # loose, and most of them rise past the best plan once priced)
        self.deferred: list[_Node] = []
        self.counter = counter
        self.state: dict[Config, _Setup] = {}
        self.best = best
        self.explored = self.pruned = 0
        self.given_up = float("inf")  # smallest bound pruned only because of `gap`
        self._fits: dict[tuple, np.ndarray | None] = {}  # (`fits`)
        self.floor: float | None = None  # `lower_bound`, once a configuration waits
        self.devices = {t.name: sum(t.node_devices) for t in table.types}
        self.gathers = {t.name: cheapest_gather(table, t.name) for t in table.types}
        every = configs(table, batch, limits)
        first = list(dict.fromkeys(c for c in first if c in every))  # (seeds share some)
        gpipe = single and any(c.gpipe for c in every) and gpipe_holds(
            table, batch, space, degrees(table, limits))
        for config in first + [c for c in every if c not in first]:
            if config.gpipe and not gpipe:
                continue  # GPipe runs structures of one class (`evaluate.zero_space`),
                # on devices that hold the batch's activations (`bound.gpipe_holds`)
            if config in first or deadline is None or time.perf_counter() < deadline:
                heapq.heappush(self.heap, self.set_up(config))
                continue
            if self.floor is None:
                self.floor = lower_bound(table, batch)
            heapq.heappush(self.heap, _Node(self.floor, next(self.counter), config, 0.0,
                                            _WAITING, (), ()))

    def set_up(self, config: Config) -> _Node:
        """The configuration's families and bound, and its root node."""
        tps = degrees(self.table, self.limits) if config.tp is None else [config.tp]
        folded, space, table = self.view(config), self.space, self.table
        devices = self.devices
        # a mixed class whose blocks differ in degree runs without ZeRO: in the part of
        # one class, only GPipe's (the other part holds the rest, `_parts`)
        levels = families(folded, config, self.limits, space, self.batch // config.mb, tps,
                          split=not self.single or config.gpipe,
                          least_pipelines=self.least_pipelines(config))
        bound = Bound(levels, self.batch // config.mb, devices, device_work(folded, config, tps),
                      optimizer_bound(folded, float(table.params.sum()), space),
                      SyncFloor(folded, config, space, sorted(devices), self.gathers, tps,
                                _least_degrees(levels)), self.single,
                      self.limits.mixed_share_types)
        mixed = mixed_in(levels[0], mixed_levels(folded, self.limits))
        rank = {f.key: i for i, f in enumerate(levels[0])} if mixed else {}
        self.state[config] = _Setup(levels, bound, {f.key: f for lv in levels for f in lv},
                                    mixed, rank, shared=self.limits.mixed_share_types)
        root = _Node(0.0, next(self.counter), config, 0.0, 0, (), ())
        root.bound, root.base = bound([], range(len(levels)))
        return root

    def least_pipelines(self, config: Config) -> int:
        """The fewest pipelines of a family the cluster must hold for the configuration
        to offer it: in the part of one class, on 1F1B, two where the other part is
        searched (`_parts`), as a class of one pipeline runs without ZeRO
        (`bound.single_space`) and that part holds it, priced with the same space
        (`_leaf`); GPipe's structures are searched only here. On the benchmark's Llama-2
        7B cluster this leaves 6 of the 108 chains at tp 1 here."""
        return 2 if self.single and not config.gpipe and 0 in self.pricing.zeros else 1

    def view(self, config: Config) -> CostTable:
        """The table the configuration's structures are priced on (`interleave.fold`)."""
        return fold(self.table, config.interleave)

    def late(self) -> bool:
        """Whether the time limit has passed."""
        return self.deadline is not None and time.perf_counter() > self.deadline

    def threshold(self) -> float:
        return self.best[self.top_k - 1].step_time if len(self.best) >= self.top_k else \
            float("inf")

    def promising(self, b: float) -> bool:
        """Whether a bound leaves room to beat the k-th best plan by more than `gap`."""
        return b < self.threshold() * (1 - self.gap)

    def keep(self, b: float) -> bool:
        if self.promising(b):
            return True
        if b < self.threshold():
            self.given_up = min(self.given_up, b)
        self.pruned += 1
        return False

    def fixed(self, node: _Node) -> list[tuple[Family, int]]:
        """The node's classes, each family bounded for its count (`bound.crowded`; a
        last class that stands for 1..n pipelines, for one)."""
        index = self.state[node.config].index
        counts = [*node.counts[:-1], 1] if self.shrinks(node) else node.counts
        return [(self.crowded(node.config, index[t], k), n)
                for t, n, k in zip(node.chosen, node.counts, counts, strict=True)]

    def crowded(self, config: Config, family: Family, n: int) -> Family:
        return crowded(self.view(config), config, self.space, family, n,
                       self.batch // config.mb)

    def settle(self, node: _Node) -> bool:
        """Price exactly the node's families and, on each open homogeneous level, the
        family that gives that level's device slots their value in the node's bound
        (the most micro-batches per slot by then; pricing it may hand that role to
        another, priced in turn); False if anything was priced (the bound may rise)."""
        levels, bound = self.state[node.config].levels, self.state[node.config].bound
        fixed = self.fixed(node)
        loose = [f for f, _ in fixed if not f.tight]
        microbatches = self.batch // node.config.mb
        for f in loose:
            tighten(self.view(node.config), node.config, self.space, f, microbatches)
        for level in levels[node.level:]:  # pricing one may make another the best
            while (f := best_per_slot(level, node.bound)) is not None and not f.tight:
                tighten(self.view(node.config), node.config, self.space, f, microbatches)
                loose.append(f)
        if 0 < node.level < self.state[node.config].mixed:  # the mixed class to add, too
            apart = self.state[node.config].apart(node.chosen)
            for f in apart:
                if not f.tight:
                    tighten(self.view(node.config), node.config, self.space, f, microbatches)
                    loose.append(f)
        if not loose:
            return True
        bound.invalidate()
        open_levels = range(node.level, len(levels))
        node.bound, node.base = bound(
            fixed, open_levels, self.shrinks(node), (node.bound, node.base),
            self.fits(node.config, self.fewest(node), open_levels))
        return False

    @staticmethod
    def shrinks(node: _Node) -> bool:
        """Whether the node also stands for fewer pipelines of its last class."""
        return bool(node.counts) and node.counts[-1] > 1 and node.chosen[-1] in node.fewer

    def children(self, node: _Node) -> list[_Node]:
        """The node's children, each the node plus one class of its level (or none),
        bounded (`counts_bound`). A child that adds a mixed class comes twice where more
        mixed levels follow: once with the mixed levels closed (the homogeneous ones
        open, as tightly bounded as with one mixed level) and once with the next mixed
        level open, which must add a class (no class there is the first child)."""
        setup = self.state[node.config]
        levels = setup.levels
        options = self.options(node)
        if options is None:
            return []  # (nor does any structure that adds classes: each keeps its place)
        first_free = self.next_level(levels, max(setup.mixed, node.level + 1))
        if node.level > 0 and node.level < setup.mixed:
            options = options[1:]  # (none here: the parent with the mixed levels closed)
        elif first_free == len(levels) and not node.chosen:
            options = options[1:]  # a structure needs at least one class
        added = [o for o in options if o[0] is not None]
        groups = [(options, first_free)]
        if self.single:  # a class ends the structure: its child is a leaf
            groups = [([o for o in options if o[0] is None], first_free),
                      (added, len(levels))]
        elif node.level + 1 < setup.mixed:
            groups.append(([o for o in added if setup.may_follow((*node.chosen, o[0].key))],
                           node.level + 1))
        out = []
        for group, level in groups:
            if not group:
                continue
            bounds, bases = self.counts_bound(node, self.fixed(node), group,
                                              range(level, len(levels)))
            for (f, n), b, base in zip(group, bounds, bases, strict=True):
                out.append(_Node(float(b), next(self.counter), node.config, float(base),
                                 level, node.chosen + ((f.key,) if f else ()),
                                 node.counts + ((n,) if f else ()),
                                 frozenset([f.key]) if f else frozenset()))
        return out

    def options(self, node: _Node) -> list[tuple[Family | None, int]] | None:
        """No class, then each family of the node's level that fits beside its classes,
        with the most pipelines it may add (its child stands for 1..n of them: the
        smaller counts are its lazy siblings); None where the node's classes do not
        fit."""
        setup = self.state[node.config]
        free = free_after(self.view(node.config), _shapes(node))  # (its children's counts)
        if free is None:
            return None
        used: dict[str, int] = {}  # devices
        for f, n in self.fixed(node):
            for kind, tp in zip(f.types, f.tps, strict=True):
                used[kind] = used.get(kind, 0) + n * tp
        options: list[tuple[Family | None, int]] = [(None, 0)]
        m, devices = setup.bound.m, setup.bound.devices
        for f in setup.mixed_after(node):
            if f.min_busy == float("inf"):
                continue
            # at most as many pipelines as devices and micro-batches are left
            n = min([f.n_max, m - sum(node.counts)]
                    + [(devices[k] - used.get(k, 0)) // f.devices_of(k) for k in set(f.types)]
                    + ([most - sum(node.counts)] if (most := self.limits.most_pipelines)
                       is not None else []))
            if n >= 1:  # and as `place` puts beside the node's classes (the mixed
                # ones first, the others on their own types' nodes)
                n = room(free, f.shape(n))
            if n >= 1:
                options.append((f, n))
        return options

    def counts_bound(self, node: _Node, fixed: list[tuple[Family, int]],
                     group: list[tuple[Family | None, int]], open_levels: range
                     ) -> tuple[np.ndarray, np.ndarray]:
        """Per candidate (f, n) that stands for 1..n pipelines, the bound and base: the
        least over n alone, h..n-1 and 1..h-1, h half n (in one `many` call). The bound
        of a range as one pairs its most pipelines' compute with its fewest's sync,
        below every count's: for 1..n at 4,096 GPUs, about 3% below n's, so that three
        in four such nodes were taken only for every count to be pruned. Where the
        candidates are many (`_RANGED`), only those whose bound of 1..n is promising."""
        bounds, bases = np.zeros(len(group)), np.zeros(len(group))
        filtered = len(group) > _RANGED
        if filtered:  # (a count of one, or no class, is its own range)
            bounds, bases = self.many(node, fixed, group, open_levels, True)
        rows, fewest, owner = [], [], []
        for i, (f, n) in enumerate(group):
            ranged = f is not None and n > 1
            if filtered and not (ranged and self.promising(bounds[i])):
                continue
            half = (n + 1) // 2
            for most, least in ((n, n), (n - 1, half), (half - 1, 1)) if ranged else ((n, n),):
                if most >= least:
                    rows.append((f, most))
                    fewest.append(least)
                    owner.append(i)
        if rows:
            full, base = self.many(node, fixed, rows, open_levels, fewest)
            least_full, least_base = np.full(len(group), INF), np.full(len(group), INF)
            np.minimum.at(least_full, owner, full)
            np.minimum.at(least_base, owner, base)
            at = sorted(set(owner))  # (filtered: either bound holds, so the larger)
            bounds[at] = np.maximum(bounds[at], least_full[at])
            bases[at] = np.maximum(bases[at], least_base[at])
        return bounds, bases

    def many(self, node: _Node, fixed: list[tuple[Family, int]],
             rows: list[tuple[Family | None, int]], open_levels: range,
             fewer: bool | list[int]) -> tuple[np.ndarray, np.ndarray]:
        """`Bound.many` of the node's children (`rows`, on `fewer` terms), `_MANY_ROWS`
        at a time; past the deadline with a plan in hand, the rows left keep the node's
        own bound and base, which hold for its whole subtree (with --mixed-share-types
        every open mixed family bounds every row: on the measured-per-node scenario, one
        root's children took 56 s)."""
        at_least = (node.bound, node.base)
        full, base = np.full(len(rows), at_least[0]), np.full(len(rows), at_least[1])
        bound = self.state[node.config].bound
        for start in range(0, len(rows), _MANY_ROWS):
            if self.late() and self.best:
                break
            part = slice(start, start + _MANY_ROWS)
            some = fewer if isinstance(fewer, bool) else fewer[part]
            full[part], base[part] = bound.many(fixed, rows[part], open_levels, some, at_least,
                                                self.row_fits(node, rows[part], open_levels,
                                                              some))
        return full, base

    def row_fits(self, node: _Node, candidates: Sequence[tuple[Family | None, int]],
                 open_levels: range, fewer: bool | Sequence[int]) -> np.ndarray | None:
        """`fits` for the node's classes plus each candidate class (at its fewest
        pipelines, as `Bound.many` takes `fewer`: a prefix of its pipelines leaves the
        most room): one row per candidate, or one for all where none uses the open
        levels' types (a class of one type leaves the other types' nodes as they are).
        A family's count depends on its own type's nodes alone, so each row is read per
        type off the classes' blocks of that type (few distinct ones, where the
        candidates are many mixed families)."""
        if all(f is None or len(set(f.types)) == 1 for f, _ in candidates):
            return self.fits(node.config, _shapes(node), open_levels)
        kinds = [f.types[0] for f in self.state[node.config].bound.open_families(open_levels)]
        columns = {kind: [i for i, k in enumerate(kinds) if k == kind] for kind in kinds}
        rows = np.zeros((len(candidates), len(kinds)))
        placed = _shapes(node)  # (and each candidate's class placed among them)
        for r, ((f, _), least) in enumerate(zip(candidates, fewest_counts(fewer, candidates),
                                                strict=True)):
            shapes = placed if f is None else tuple(sorted(
                (*placed, ClassShape(types=f.types, n=int(least), tps=f.tps)),
                key=placement_order))
            for kind, at in columns.items():
                alone = tuple(ClassShape((kind,) * count, s.n, tp) for s in shapes
                              for k, count, tp in s.blocks() if k == kind)
                found = self.fits(node.config, alone, open_levels)
                if found is not None:
                    rows[r, at] = found[at]
        return rows

    def fits(self, config: Config, shapes: tuple[ClassShape, ...], open_levels: range
             ) -> np.ndarray | None:
        """Per family of the open homogeneous levels (`Bound.open_families`), the most
        pipelines `place` puts on the devices these classes leave (`structure.room`):
        each level adds a class of its own type, placed after the mixed one, on its own
        type's nodes, so after these classes whatever the other open levels add. None
        where the classes do not fit (no structure below does either). Cached."""
        key = (config, shapes, open_levels.start)
        if key not in self._fits:
            free = free_after(self.view(config), shapes)
            self._fits[key] = None if free is None else np.array([
                float(room(free, f.shape(f.n_max)))
                for f in self.state[config].bound.open_families(open_levels)])
        return self._fits[key]

    @staticmethod
    def next_level(levels: list[list[Family]], level: int) -> int:
        """The first level from `level` on with a family that can run (past the last
        one: the leaves); the levels between add nothing."""
        while level < len(levels) and all(f.min_busy == INF for f in levels[level]):
            level += 1
        return level

    def split(self, node: _Node) -> tuple[_Node, _Node | None] | None:
        """A (settled) node of 1..n pipelines as the node of n alone and its sibling of
        1..k, each bounded by the least of its counts' own bounds (found for all counts
        at once, the first time; None if the node stands for one count). The counts
        from k + 1 to n - 1 are pruned here, their bounds no better than the best plan
        (no sibling if none is left): else each would take a turn of its own."""
        if not self.shrinks(node):
            return None
        levels, bound = self.state[node.config].levels, self.state[node.config].bound
        counted = node.counted
        if not counted:
            family, n = self.state[node.config].index[node.chosen[-1]], node.counts[-1]
            rows = [(self.crowded(node.config, family, k), k) for k in range(1, n + 1)]
            parent = dataclasses.replace(node, chosen=node.chosen[:-1], counts=node.counts[:-1])
            counted = tuple(zip(*bound.many(
                self.fixed(node)[:-1], rows, range(node.level, len(levels)), False,
                (node.bound, node.base), self.row_fits(
                    parent, rows, range(node.level, len(levels)), False)), strict=True))
            if self.is_leaf(node):  # each count's placement prices its first layer's sync
                counted = tuple((self.sync_floor(dataclasses.replace(
                    node, bound=float(b), base=float(base), counts=(*node.counts[:-1], k),
                    fewer=frozenset())) if self.promising(b) else b, base)
                    for k, (b, base) in enumerate(counted, 1))
        exact = dataclasses.replace(node, bound=float(counted[-1][0]),
                                    base=float(counted[-1][1]), fewer=frozenset(), counted=(),
                                    unsynced=False)
        kept = len(counted) - 1
        while kept and not self.promising(counted[kept - 1][0]):
            kept -= 1
        if kept < len(counted) - 1:  # (pruned as one node, as their sibling was)
            self.keep(min(b for b, _ in counted[kept:-1]))
        rest = counted[:kept]
        if not rest:
            return exact, None
        sibling = _Node(float(min(b for b, _ in rest)), next(self.counter), node.config,
                        float(min(b for _, b in rest)), node.level, node.chosen,
                        (*node.counts[:-1], len(rest)), node.fewer, rest)
        return exact, sibling

    def greedy(self, config: Config) -> None:
        """A first plan built one device type at a time, fastest first: each type adds
        the homogeneous class (as many pipelines as fit) that most shortens the step,
        or nothing if none does, each structure priced with its best splits (classes
        that cut the model at different layers sync more). Cheap, and at scale far
        better than one type alone."""
        levels = self.state[config].levels
        microbatches = self.batch // config.mb
        devices = self.state[config].bound.devices
        chosen: list[ClassShape] = []
        best = float("inf")
        for level in levels:
            if not level or len(set(level[0].types)) > 1:
                continue
            kind = level[0].types[0]
            left = devices[kind] - sum(s.n * s.devices_of(kind) for s in chosen)
            pipes = min(microbatches, self.limits.most_pipelines or microbatches) - sum(
                s.n for s in chosen)
            pick = None
            for f in level:
                if self.late() and self.best:  # (at 1,000 layers each pricing takes
                    break  # seconds: what the levels before picked is still priced below)
                n = min(f.n_max, left // f.devices, pipes)
                if n < 1 or not self.limits.allows(f.types):
                    continue
                shape = f.shape(n)
                shapes = tuple(sorted((*chosen, shape), key=placement_order))
                table = self.view(config)
                priced = price(table, config, self.pricing, shapes, microbatches)
                if priced is None or priced.lower >= best:
                    continue
                found, _ = refine(table, priced, microbatches, best, self.gap, self.deadline)
                if found is not None and found.step_time < best:
                    best, pick = found.step_time, shape
            if pick is not None:
                chosen.append(pick)
        if chosen:
            node = _Node(0.0, next(self.counter), config, 0.0, len(levels),
                         tuple((s.types, s.tps) for s in chosen), tuple(s.n for s in chosen))
            self.given_up = min(self.given_up, self.price(node))

    def price(self, node: _Node) -> float:
        """`_leaf` for this search."""
        return _leaf(self.table, node, self.batch, self.limits, self.pricing, self.best,
                     self.top_k, self.gap, self.deadline)

    def leaf(self, node: _Node) -> None:
        """Price a whole structure unless its sync floor already rules it out (what
        its pricing leaves out is no faster than that floor either)."""
        if (floor := self.sync_floor(node)) < self.threshold():
            self.given_up = min(self.given_up, max(floor, self.price(node)))

    def crossed(self, node: _Node) -> float:
        """The node's bound raised by the sync its fixed classes pay beside each other
        (`evaluate.cross_class_floor`) and on their busiest network card
        (`evaluate.card_floor`, where a stage's all-reduce spans nodes with another
        class's stage), whatever the open levels add (their stages only join the
        groups, and the cards) and whatever the splits: the classes' placement follows
        from them alone (the mixed class first, each homogeneous one on its own type's
        nodes left), a last class that stands for 1..n pipelines on its first one's.
        The floor is added to the time the node's micro-batches take before any sync
        (`Bound.unsynced`, found once per node: where levels are open, `many` passes on
        the parent's base, which counts the devices the node's classes hold as theirs)."""
        if self.single or len(node.chosen) < 2:
            return node.bound
        table, shapes = self.view(node.config), self.fewest(node)
        key = FixedSyncKey(shapes)  # (placed once per structure)
        if key not in table.cache:
            placement = place(table, shapes)
            table.cache[key] = placement and max(cross_class_floor(table, shapes, placement),
                                                 card_floor(table, shapes, placement, False))
        if table.cache[key] is None:
            return node.bound  # (it has no children, and is no plan)
        if not node.unsynced and not self.is_leaf(node):
            levels, bound = self.state[node.config].levels, self.state[node.config].bound
            open_levels = range(node.level, len(levels))
            node.base = bound.unsynced(self.fixed(node), open_levels, self.shrinks(node),
                                       node.base, self.fits(node.config, shapes, open_levels))
            node.unsynced = True
        return max(node.bound, synced(node.base, table.cache[key], table.sync))

    def fewest(self, node: _Node) -> tuple[ClassShape, ...]:
        """The node's classes as placed, a last one that stands for 1..n pipelines at one:
        its first pipeline's place, and a prefix of any count's, leaving them the most
        room."""
        counts = (*node.counts[:-1], 1) if self.shrinks(node) else node.counts
        return _shapes(dataclasses.replace(node, counts=counts))

    def sync_floor(self, node: _Node) -> float:
        """A bound on a (settled) leaf's whole step: the first stage of every pipeline
        holds the first layer, whose gradients are all-reduced over all of them unless
        its one class shards that stage with ZeRO-3, which costs its pipelines three
        gathers per micro-batch; and its busiest network card (`evaluate.card_floor`),
        where a class of one may take ZeRO-3 unless a stage on it shards a layer of
        some size or more, and so is busier per micro-batch
        (`evaluate.sharded_card_floors`)."""
        table, config = self.view(node.config), node.config
        shapes = _shapes(node)
        placement = place(table, shapes)
        if placement is None:
            return float("inf")
        holders = CommGroup.of([p[0].node for slots in placement for p in slots])
        grads = float(table.params[0]) * table.grad_bytes
        zero3 = 3 in self.space.zeros and len(shapes) == 1 and shapes[0].n > 1
        # sync is one term of the step: added to the base, the bound before sync floors
        paid = max(synced(node.base, max(table.collective(Collective.ALL_REDUCE, grads, holders),
                                         card_floor(table, shapes, placement, zero3)),
                          table.sync), self.crossed(node))
        if not zero3:
            return max(node.bound, paid)  # no ZeRO-3 (`evaluate.zero_space`)
        bound = self.state[config].bound
        sharded, _ = bound([(self.zero3(config, f), n) for f, n in self.fixed(node)], ())
        out = max(node.bound, min(paid, sharded))
        if config.interleave > 1:  # (the busy time bounds no interleaved period alone)
            return out
        # X: the most parameters a stage on ZeRO-3 shards (0: none is); per range of X
        # between thresholds, the card under the next and the busy time at the last
        floors = sharded_card_floors(table, config, shapes[0], placement[0])
        least = synced(node.base, floors[0][0], table.sync) if floors else out
        for i, (_, busy) in enumerate(floors):
            if least <= out or busy == INF:  # (inf: X cannot reach the threshold)
                break
            full, base = bound([(_busier(f, busy), n) for f, n in self.fixed(node)], ())
            card = floors[i + 1][0] if i + 1 < len(floors) else 0.0
            least = min(least, max(full, synced(max(base, node.base), card, table.sync)))
        return max(out, least)

    def zero3(self, config: Config, family: Family) -> Family:
        """The (tightened) family with its first stage on ZeRO-3."""
        key = Zero3FamilyKey(family.key, family.n_max, config, self.space, self.batch)
        table = self.view(config)
        if key not in table.cache:
            result = tight_result(table, config, self.space, family, self.batch // config.mb)
            kind = family.types[0]
            forced = result and optimize(zero3_first(
                table, result.costs, kind, tp=family.tps[0], mb=config.mb,
                gather=cheapest_gather(table, kind)))
            table.cache[key] = Family(
                types=family.types, tps=family.tps, n_max=family.n_max, tight=True,
                min_busy=forced.min_period if forced else INF,
                total=forced.floor if forced else INF)
        return table.cache[key]

    def is_leaf(self, node: _Node) -> bool:
        return node.level == len(self.state[node.config].levels)

    def dive(self, node: _Node) -> None:
        """Follow one path down the tree, pricing on the way the structure each level's
        pick would be if nothing more were added: a good plan early prunes the rest.
        At each level up to `_DIVE_TRIES` children, best bound first, are settled (their
        families priced until their bounds stand: a chain's first bounds are loose, and
        on the benchmark's Llama-2 7B cluster pricing each child once, and taking
        the next of least bound, found the plan only in the queue), and the one whose
        classes alone would finish soonest is picked (a bound that
        leaves room for more classes says little about the plan they make). Past the
        time limit, only the child with the best bound, towards a first plan if there
        is none yet, and none at all once there is one (settling a node prices its
        families: at 1,024 GPUs with --tp-per-class, seconds)."""
        levels, bound = self.state[node.config].levels, self.state[node.config].bound
        while True:
            if self.late() and self.best:
                return
            if not self.settle(node):
                continue  # (pricing raised its bound: settled again)
            if node.bound == float("inf"):
                return
            if self.is_leaf(node):
                self.leaf(node)
                return
            late = self.late()
            # (not into a node that must add another mixed class: its classes alone are
            # its sibling's, which leaves the homogeneous levels to join them)
            children = [c for c in self.children(node)
                        if not 0 < c.level < self.state[node.config].mixed]
            heapq.heapify(children)
            settled = []
            for _ in range(1 if late else _DIVE_TRIES):  # (late: the first plan, soon)
                if not children or not self.promising(children[0].bound):
                    break
                child = heapq.heappop(children)
                while not self.settle(child):
                    pass
                if self.promising(child.bound):
                    settled.append(child)
            closed = [(bound(self.fixed(c), ()), c.order, c) for c in settled if c.chosen]
            if closed:
                (alone, base), _, node = min(closed)
                if self.promising(alone):
                    self.leaf(_Node(alone, next(self.counter), node.config, base, len(levels),
                                    node.chosen, node.counts))
                if self.is_leaf(node):  # (in the one-class part) priced just now
                    return
            elif children and self.promising(children[0].bound):
                node = children[0]  # settled on the next round
            else:
                return

    def transfer(self) -> None:
        """The best structure so far, tried in every other configuration (the same
        classes, their pipeline counts scaled to the configuration's tensor-parallel
        degree if it fixes one): a structure that wins in one configuration often wins
        in a neighbouring one, which dives, confined to the most promising
        configurations, may not visit."""
        if not self.best or (self.single and len(self.best[0].shapes) > 1):
            return
        model = self.best[0]
        for config, setup in self.state.items():
            levels, bound, index = setup.levels, setup.bound, setup.index
            if self.late():
                return
            keys = [(s.types, s.tps if config.tp is None else (config.tp,) * s.stages)
                    for s in model.shapes]
            if config == model.config or not all(k in index for k in keys):
                continue
            fixed = [(index[k], min(index[k].n_max, max(1, s.n * sum(s.tps) // sum(k[1]))))
                     for k, s in zip(keys, model.shapes, strict=True)]
            used = {k: sum(n * f.devices_of(k) for f, n in fixed) for k in bound.devices}
            if sum(n for _, n in fixed) > bound.m or any(
                    used[k] > bound.devices[k] for k in used):
                continue
            if not self.promising(bound(fixed, ())[0]):  # (on the families as they are)
                continue
            node = _Node(0.0, next(self.counter), config, 0.0, len(levels),
                         tuple(f.key for f, _ in fixed), tuple(n for _, n in fixed))
            self.settle(node)
            node.bound, node.base = bound(fixed, ())
            if self.promising(node.bound):
                self.leaf(node)

    def swap(self, config: Config) -> None:
        """Moves around the best plan, where it was found in this configuration and has
        no mixed class (as the greedy plan's): one of its classes gives up one or two
        pipelines, and up to one more of a mixed family with a block of that class's
        type run on the devices freed and those left over. The `SWAPS` moves with the
        best bounds are priced: a few mixed pipelines often use what whole classes of
        one type leave idle."""
        if self.single or not self.best or self.best[0].config != config or self.late():
            return  # (past the deadline: its moves' bounds alone take seconds at 1,000 layers)
        setup = self.state[config]
        levels, bound, index = setup.levels, setup.bound, setup.index
        keys = [(s.types, s.tps) for s in self.best[0].shapes]
        if (not levels[0] or len(set(levels[0][0].types)) < 2
                or any(len(set(types)) > 1 for types, _ in keys)
                or not all(k in index for k in keys)):  # (a seed's may be no family here)
            return
        fixed = [(index[k], s.n) for k, s in zip(keys, self.best[0].shapes, strict=True)]
        left = {k: bound.devices[k] - sum(n * f.devices_of(k) for f, n in fixed)
                for k in bound.devices}
        moves = []
        for i, (family, n) in enumerate(fixed):
            kind = family.types[0]
            for given in range(1, min(n, 3)):
                rest = [*fixed[:i], (family, n - given), *fixed[i + 1:]]
                free = {**left, kind: left[kind] + given * family.devices}
                most = min(given + 1, bound.m - sum(c for _, c in rest))
                mixed = [(f, k) for f in levels[0]
                         if kind in f.types and f.min_busy < INF and self.limits.allows(f.types)
                         for k in range(1, 1 + min(most, *(free[t] // f.devices_of(t)
                                                          for t in set(f.types))))]
                if mixed:
                    bounds, _ = bound.many([(self.crowded(config, f, c), c) for f, c in rest],
                                           [(self.crowded(config, f, k), k) for f, k in mixed],
                                           ())
                    moves += [(float(b), rest, f, k) for b, (f, k) in zip(
                        bounds, mixed, strict=True) if self.promising(b)]
        for _, rest, f, k in sorted(moves, key=lambda move: move[0])[:SWAPS]:
            if self.late():
                return
            node = _Node(0.0, next(self.counter), config, 0.0, len(levels),
                         (f.key, *(g.key for g, _ in rest)), (k, *(n for _, n in rest)))
            self.settle(node)
            node.bound, node.base = bound(self.fixed(node), ())
            if self.promising(node.bound):
                self.leaf(node)

    def push(self, node: _Node) -> None:
        """Queue a node: on `deferred` if it must add another mixed class."""
        setup = self.state.get(node.config)
        must_add = setup is not None and 0 < node.level < setup.mixed
        heapq.heappush(self.deferred if must_add else self.heap, node)

    def _queue(self) -> list[_Node]:
        """The queue `step` takes from: `heap` while its best may beat the best plan (or
        nothing is deferred), else `deferred`."""
        if self.heap and (not self.deferred or self.promising(self.heap[0].bound)):
            return self.heap
        return self.deferred

    def upcoming(self) -> tuple[bool, _Node]:
        """The node `step` takes next, after any of another part's that is not deferred
        (the search takes the least of these over its parts)."""
        queue = self._queue()
        return queue is self.deferred, queue[0]

    def step(self) -> bool:
        """Expand the most promising node; False when this part's search is over."""
        if not self.heap and not self.deferred:
            return False
        queue = self._queue()
        node = heapq.heappop(queue)
        if not self.keep(node.bound):
            for rest in queue:
                self.keep(rest.bound)
            queue.clear()
            return bool(self.heap or self.deferred)
        if node.level == _WAITING:
            if self.keep((root := self.set_up(node.config)).bound):
                self.push(root)
            return True
        if not self.settle(node):
            if self.keep(node.bound):
                self.push(node)
            return True
        if (parts := self.split(node)) is not None:
            exact, sibling = parts
            if sibling is not None and self.keep(sibling.bound):
                self.push(sibling)
            if exact.bound > node.bound * (1 + 1e-12):  # it may wait its turn again
                if self.keep(exact.bound):
                    self.push(exact)
                return True
            node = exact
        if (raised := self.crossed(node)) > node.bound * (1 + 1e-12):
            node.bound = raised  # it may wait its turn again
            if self.keep(node.bound):
                self.push(node)
            return True
        self.explored += 1
        if self.is_leaf(node):
            self.leaf(node)
            return True
        for child in self.children(node):
            if self.keep(child.bound):
                self.push(child)
        return True


def search(table: CostTable, batch: int, *, limits: Limits | None = None,
           space: Space | None = None, top_k: int = 1, gap: float = 0.0,
           time_limit: float | None = None, dives: int = 1,
           seeds: Sequence[tuple[Config, tuple[ClassShape, ...]]] = (),
           progress: Callable[[Progress], None] | None = None) -> SearchResult:
    """The best `top_k` structures for a global batch of `batch` samples.

    gap: prune structures whose bound is within this fraction of the k-th best
    (0: exact); the returned bound accounts for what was pruned that way.
    dives: how many of the most promising configurations (of each part) first get a greedy plan
    and are followed down the tree to a plan, to start pruning with a good one.
    seeds: structures known to be good (e.g. the best on one device type), priced
    first for the same purpose. A KeyboardInterrupt (Ctrl-C) stops the search like the
    time limit, with the best plans found by then ("interrupted"; none yet: it goes on
    up)."""
    start = time.perf_counter()
    space = space or Space()
    best: list[Evaluation] = []
    counter = itertools.count()
    limits = limits or Limits()
    deadline = None if time_limit is None else start + time_limit
    runs = [_Search(table, batch, limits, space, top_k, gap, single, best, counter, deadline,
                    [config for config, _ in seeds])
            for single in _parts(space, limits)]
    status, taken = "optimal", float("inf")  # taken: the bound of a node mid-step
    try:
        _start(runs, table, batch, seeds, dives, start, time_limit)
        while live := [part for part in runs if part.heap or part.deferred]:
            if time_limit is not None and time.perf_counter() - start > time_limit and best:
                status = "feasible"
                break
            part = min(live, key=lambda part: part.upcoming())
            taken = part.upcoming()[1].bound
            part.step()
            taken = float("inf")
            if progress:
                progress(Progress(sum(part.explored for part in runs),
                                  best[0].step_time if best else None, _bound(runs, best)))
    except KeyboardInterrupt:
        if not best:
            raise
        status = "interrupted"
    if not best:
        raise PlannerError(
            "infeasible", "No plan fits: every structure the search tried runs out of device "
            "memory or has more pipelines than micro-batches.",
            ["allow more pipeline stages (--max-stages) or recompute",
             "allow ZeRO (do not pass --zero 0)", "use a smaller --micro-batch",
             "add devices or use devices with more memory"])
    bound_value = min([best[0].step_time, *(part.given_up for part in runs)])
    if status != "optimal":
        bound_value = min(taken, _bound(runs, best))
    return SearchResult(best=best, status=status, bound=bound_value,
                        explored=sum(part.explored for part in runs),
                        pruned=sum(part.pruned for part in runs),
                        wall_time=time.perf_counter() - start,
                        space=search_space(table, batch, limits, [
                            config for part in runs for config, setup in part.state.items()
                            if setup.mixed < mixed_levels(part.view(config), part.limits)]))


def _start(runs: list[_Search], table: CostTable, batch: int,
           seeds: Sequence[tuple[Config, tuple[ClassShape, ...]]], dives: int, start: float,
           time_limit: float | None) -> None:
    """The first plans to prune with: the seeds, a greedy plan and a dive in the most
    promising configurations (and a greedy plan in the best seed's), then the best
    structure tried in the others."""
    run = runs[0]
    for config, shapes in seeds:
        if config in run.state:
            node = _Node(0.0, next(run.counter), config, 0.0, len(run.state[config].levels),
                         tuple((s.types, s.tps) for s in shapes), tuple(s.n for s in shapes))
            run.given_up = min(run.given_up, run.price(node))
    seeded = run.best[0].config if run.best else None
    greedy: set[Config] = set()  # the configurations a greedy plan was built in
    for part, root in [(p, root) for p in runs
                       for root in sorted(n for n in p.heap if n.level != _WAITING)[:dives]]:
        if time_limit is not None and time.perf_counter() - start > time_limit and run.best:
            break
        if len(table.types) > 1 and not part.single:
            # the seed's: its classes joined by others, also in plain 1F1B where the seed
            # is interleaved (at 4,096 GPUs with up to two chunks, 12.67 s against 13.06 s)
            plain = seeded and dataclasses.replace(seeded, interleave=1)
            for config in (root.config, seeded, plain):
                if config is not None and config in part.state and config not in greedy:
                    greedy.add(config)
                    part.greedy(config)
                    part.swap(config)
        part.dive(dataclasses.replace(root, order=next(run.counter)))
    for part in runs:
        part.transfer()


def _bound(runs: list[_Search], best: list[Evaluation]) -> float:
    """No structure is faster, whether explored, pruned (up to the gap) or still queued."""
    return min([*(e.step_time for e in best[:1]), *(part.given_up for part in runs),
                *(n.bound for part in runs for n in part.heap[:1] + part.deferred[:1])],
               default=float("inf"))


def _parts(space: Space, limits: Limits) -> list[bool]:
    """The search space in two parts with bounds of their own (True: the part of
    structures of one class). Structures of several classes run without ZeRO
    (`evaluate.zero_space`), so their part, which also holds the structures of one
    class that run without it, is bounded without ZeRO; the structures of one class
    are searched on their own with every ZeRO stage allowed (GPipe's only there).
    On one device type the second part holds every structure, yet both are searched:
    within a time limit the ZeRO-free part finds good plans sooner (searching the
    second alone, the fastest type of the 4,096-GPU benchmark found a plan 1.7x
    slower in its 15 s)."""
    gpipe = limits.schedule in (None, Schedule.GPIPE)
    return [single for single, wanted in ((False, 0 in space.zeros),
                                          (True, any(space.zeros) or gpipe)) if wanted]


def _least_degrees(levels: list[list[Family]]) -> dict[str, int]:
    """Per device type, the smallest tensor-parallel degree of a family that uses it."""
    least: dict[str, int] = {}
    for f in (f for level in levels for f in level if f.min_busy < INF):
        for kind, tp in dict(zip(f.types, f.tps, strict=True)).items():  # (one per type)
            least[kind] = min(least.get(kind, tp), tp)
    return least


def placement_order(shape: ClassShape) -> tuple[bool, tuple[str, ...], tuple[int, ...]]:
    """Classes are placed mixed first, in the order of their families' keys (the order
    of a mixed level, `families.families`), then the homogeneous ones by type name."""
    return len(set(shape.types)) == 1, shape.types, shape.tps


def _busier(family: Family, busy: float) -> Family:
    """The family with none of its splits' stages faster than `busy` per micro-batch."""
    return Family(types=family.types, tps=family.tps, n_max=family.n_max, tight=True,
                  min_busy=max(family.min_busy, busy), total=max(family.total, busy))


def _shapes(node: _Node) -> tuple[ClassShape, ...]:
    """A leaf's classes in the order they are placed."""
    return tuple(sorted((ClassShape(types=t, n=n, tps=tps) for (t, tps), n in zip(
        node.chosen, node.counts, strict=True)), key=placement_order))


def _leaf(table: CostTable, node: _Node, batch: int, limits: Limits, space: Space,
          best: list[Evaluation], top_k: int, gap: float, deadline: float | None) -> float:
    """Price a whole structure; add it to `best` where it is among the k best. The
    least step of the splits it left out only for `gap` or the deadline (inf if
    none; past the deadline, the first plan is its classes' first splits)."""
    if limits.dp is not None and sum(node.counts) != limits.dp:
        return INF
    if limits.max_dp is not None and sum(node.counts) > limits.max_dp:
        return INF
    if not all(limits.allows(types) for types, _ in node.chosen):
        return INF  # a seed the stage pins rule out
    shapes = _shapes(node)
    microbatches = batch // node.config.mb
    table = fold(table, node.config.interleave)
    priced = price(table, node.config, space, shapes, microbatches)
    if priced is None:
        return INF
    threshold = best[top_k - 1].step_time if len(best) >= top_k else float("inf")
    if priced.lower >= threshold:
        return INF
    evaluation, skipped = refine(table, priced, microbatches, threshold, gap, deadline)
    if evaluation is None:
        return skipped
    # Already found (by a dive, or in the other part): both parts price a structure with
    # the same, full space (`_Search.pricing`; only their bounds and families are
    # ZeRO-free, `_Search.space`), so the copy held is this structure's exact best too
    # (`refine`), and no better ZeRO pricing is dropped (tests/test_solver_search.py,
    # test_a_structure_the_zero_free_part_prices_first_keeps_its_zero_pricing).
    if any((e.config, e.shapes) == (evaluation.config, evaluation.shapes) for e in best):
        return skipped
    if evaluation.step_time < threshold:
        best.append(evaluation)
        best.sort(key=lambda e: e.step_time)
        del best[top_k:]
    return skipped
