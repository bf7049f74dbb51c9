"""Lower bounds for the search: the families of a configuration (`families.py`, first
bounded from per-layer times alone) bounded by their exact split on optimistic terms
(`tighten`), and `Bound`, which bounds a partial structure whose open levels may still
add pipelines of any family on the devices left (with the sync its fixed classes pay at
least, from `sync_floor`)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from planner.solver.evaluate import Config, Space, degree_space
from planner.solver.families import Family, pair_staircase
from planner.solver.finish import (
    Finished,
    FixedLines,
    LevelView,
    OpenLevels,
    OpenValue,
    SlotValues,
    WholeLevels,
    first_enough,
    floors_after,
    walk_whole,
)
from planner.solver.interleave import fold
from planner.solver.keys import CrowdedKey, TightKey
from planner.solver.links import boundary_links, cheapest_gather
from planner.solver.partition import INF, ClassResult, class_costs, optimize
from planner.solver.step import pipelines_within, sync_beyond, synced, unsynced
from planner.solver.structure import devices_of
from planner.solver.sync_floor import SyncFloor
from planner.solver.table import CostTable


@dataclass(frozen=True)
class OpenFamilies:
    """Per family of the open homogeneous levels (in `OpenLevels`' order), and per
    family and rung of its counts (`_rungs`), what `Bound` prices them with
    (`Bound._open_families`)."""

    masks: np.ndarray  # [family, type]: its type
    stages: np.ndarray
    optimizer: np.ndarray  # its optimizer floor at its most pipelines
    homes: np.ndarray  # its type's index
    n_max: np.ndarray  # its most pipelines
    caps: np.ndarray  # [family, rung]: the rung's most pipelines
    lows: np.ndarray  # [family, rung]: the rung below's most
    spread: np.ndarray  # [family, rung]: nodes of its type the rung's fewest span at least
    size: np.ndarray  # devices one pipeline takes
    per_node: np.ndarray  # stages of its degree one node of its type holds
    runs: np.ndarray  # the most nodes one pipeline spans


@dataclass(frozen=True)
class Traits:
    """What `Bound` reads of a family's pattern, or of no class, found once per pattern
    (`Bound._traits`): the rows of a call are many families, and many calls the same."""

    mask: np.ndarray  # [type]: which types its stages use
    stages: float  # (no class: 1)
    copies: np.ndarray  # [type]: `SyncFloor.copies`
    tp_index: int  # `SyncFloor.tp_index`
    runs: float  # `SyncFloor.runs` (no class: inf)
    counts: np.ndarray  # [type]: devices one of its pipelines takes


@dataclass(frozen=True)
class Rows:
    """The fixed classes plus each row's candidate class, as `Bound._core` bounds them."""

    free: np.ndarray  # [row, type]: devices they leave
    counts: np.ndarray  # [row, type]: devices one of the candidate's pipelines takes
    pipes: np.ndarray  # the candidate's pipelines (0: no class)
    spare: np.ndarray  # pipelines the candidate may drop (`fewer`)
    optimizer: np.ndarray  # the optimizer step's floor
    start: np.ndarray  # no micro-batch is done before
    dead: np.ndarray  # no plan


def tight_result(table: CostTable, config: Config, space: Space, family: Family,
                 microbatches: int, crowd: int = 1) -> ClassResult | None:
    """The family's exact split on optimistic terms, which no placement and no smaller
    count of its pipelines beats: ZeRO sharded over n_max pipelines (the most memory
    relief, and GPipe's fewest micro-batches held), the fastest links any placement
    could give (`links.boundary_links`; `crowd`: see `crowded`), and the cheapest ZeRO-3
    gathers any group could have (cached)."""
    table = fold(table, config.interleave)
    held = -(-microbatches // family.n_max) if config.gpipe else None
    space = single_space(degree_space(space, family.tps), family.n_max)
    key = TightKey(family.key, family.n_max, config, space, held, crowd)
    if key not in table.cache:
        table.cache[key] = optimize(class_costs(
            table, family.types, tps=family.tps, mb=config.mb, n=family.n_max,
            links=boundary_links(table, family.types, family.tps, crowd,
                                 config.interleave > 1),
            gathers=[cheapest_gather(table, kind) for kind in family.types],
            schedule=config.schedule, policies=space.policies, zeros=space.zeros,
            interleave=config.interleave, microbatches=held))
    return table.cache[key]


def single_space(space: Space, n_max: int) -> Space:
    """The choices of a class of at most one pipeline: ZeRO shards over pipelines, so
    it has no ZeRO stage (`partition._options` gives it the same options whatever else
    is allowed), and the search's two parts, which allow different ZeRO stages
    (`search._parts`), price its family once (`tight_result`)."""
    if n_max > 1:
        return space
    return dataclasses.replace(space, zeros=tuple(z for z in space.zeros if z == 0))


def tighten(table: CostTable, config: Config, space: Space, family: Family,
            microbatches: int) -> None:
    """Replace the family's bounds by those of its `tight_result`."""
    result = tight_result(table, config, space, family, microbatches)
    family.tight = True
    if result is None:
        family.min_busy = family.total = float("inf")
    else:
        family.min_busy = max(family.min_busy, result.min_period)
        family.total = max(family.total, result.floor)
        family.result = result


def crowded(table: CostTable, config: Config, space: Space, family: Family, n: int,
            microbatches: int) -> Family:
    """The family's bounds for a class of n of its pipelines. Where its stages change
    type they change nodes, and the n pipelines' sends there, each by its c chains (the
    narrower stage's ranks), meet on the nodes of either type: some card carries at
    least n c / (the rarer type's nodes) of them (`comm.send_sharing`), and the class's
    slowest pipeline pays
    that (`evaluate.class_links`): at every change of type, the fewest of any change.
    The family itself where that is no more than one pipeline's own sends (cached)."""
    table = fold(table, config.interleave)
    changes = [(len(table.type(a).nodes), len(table.type(b).nodes), min(tp_a, tp_b))
               for (a, tp_a), (b, tp_b) in itertools.pairwise(zip(
                   family.types, family.tps, strict=True)) if a != b]
    if not changes:
        return family
    crowd = min(-(-n * chains // min(nodes_a, nodes_b)) for nodes_a, nodes_b, chains in changes)
    if crowd <= min(chains for _, _, chains in changes):
        return family
    key = CrowdedKey(family.key, family.n_max, crowd, config, space, microbatches)
    if key not in table.cache:
        result = tight_result(table, config, space, family, microbatches, crowd)
        least = (INF, INF) if result is None else (max(family.min_busy, result.min_period),
                                                   max(family.total, result.floor))
        table.cache[key] = Family(
            types=family.types, tps=family.tps, n_max=family.n_max, tight=True,
            min_busy=least[0], total=least[1],
            result=result)
    return table.cache[key]


def best_per_slot(level: list[Family], t: float, mixed: bool = False) -> Family | None:
    """The family of a homogeneous level (or with `mixed`, of any list of families)
    whose pipelines finish the most micro-batches per device by time t (None for a mixed
    level, or none at all)."""
    if not level or (len(set(level[0].types)) > 1 and not mixed) or not np.isfinite(t):
        return None
    return max(level, key=lambda f: (1 + (t - f.total) / f.min_busy) / f.devices
               if t >= f.total and np.isfinite(f.min_busy) else 0.0)


class Bound:
    """Lower bounds on the step time of (partial) structures of one config.

    A "slot" below is one device: a family's pipeline takes `Family.devices` of them
    (its stages times its tensor-parallel degree), so families of different degrees
    compete for the same devices.

    A pipeline of family f finishes c_f(t) = 1 + floor((t - total_f) / min_busy_f)
    micro-batches by time t at most (none before total_f; without the floor, run
    fluidly, to find where to start). Fixed classes finish n_f c_f(t), c_f the largest
    such count over the (period, fill) pairs of `Family.floors`. Pipelines of
    the open levels, on the device slots the fixed classes left (free_k of type k),
    finish at most free . y(t) for any per-slot values y >= 0 that cover every open
    family (sum_k count_fk y_k >= c_f(t): LP duality for the fractional packing of
    pipelines into slots). Four such y are tried and the smallest result kept: each
    open homogeneous level's best c_f / S_f on its own type raised to every mixed
    family's c_f / |f| on each of its types; the same raised to the fluid rate
    t / W_k scaled by the best mixed family's share of it; the homogeneous values
    scaled up until they cover the mixed families; and the homogeneous values alone,
    with each pipeline of each open mixed level's class (at most as many as fit in the
    devices left) adding what its c_f exceeds its slots' worth by (`finish.SlotValues`).
    Where only homogeneous levels are open (below the root), each adds one class on its
    own type's free slots, so it finishes at most what its best family's whole
    pipelines that fit do (`_whole_levels`): in the devices left, and as placement puts
    them beside the fixed classes (`fits`, from the search: a block of a mixed pipeline
    may leave part of a node a longer block cannot use). Where a mixed level is open
    below the root (the node fixes a mixed class and must add another, on other
    types: `_excluded`), the homogeneous levels of the fixed mixed classes' types are
    valued so, and the other types' per slot (`_open_value`). The bound is
    the smallest t at which fixed and open pipelines can have finished the global
    number of micro-batches (found fluidly, then walked on to the next time a fixed
    pipeline completes one while even the open levels' count by then falls short,
    then on within that interval, where the fixed count stays put, to where the open
    levels' count makes up the rest: `finish.catch_up`),
    plus the optimizer step of the fixed classes (some stage holds 1/S of the
    parameters) and, per fixed class, its sync floor (`many`).

    With classes fixed, a structure below either adds none from the open levels
    (bounded with the fixed classes alone) or adds one or more, and then the smaller
    of the two bounds holds: the added class's stages join the fixed classes' sync
    groups, it pays a floor of its own (its stages at most the longest open
    family's), and, as the step pays the largest sync and the largest optimizer
    step of any class, each open homogeneous family must finish that much earlier
    than the fixed classes by what its own floors exceed theirs (`_open_shift`).
    Its own sync grows with its pipelines' count, so each count pays that of the
    smallest count of its rung (1, 2, ..., 8, 9-16, 17-32, ... times the pipelines
    one node holds a stage of: `_rungs`).

    `fewer`: the last fixed class stands for 1..n pipelines (its smaller counts
    are searched later), or for k..n (a child's bound is the least over a few such
    ranges); it pays the sync of its fewest, and the slots the fewer leave go to
    the open levels. On the types it
    uses they are valued per slot as above (linear in its count, so the larger of
    the two ends bounds them all: whole classes are not, and a count between could
    finish more); the other types' levels do not depend on its count.
    """

    def __init__(self, levels: list[list[Family]], microbatches: int,
                 devices: dict[str, int], work: dict[str, float],
                 optimizer: Callable[[Family, int], float], sync: SyncFloor,
                 single: bool = False, shared: bool = False) -> None:
        """devices: per type; work: per type, device-seconds per micro-batch of the whole
        model at least (`device_work`); sync: the floors, its kinds the devices' in
        sorted order; single: structures have one class (the open levels of a structure
        with none add one, alone); shared: mixed classes may share types
        (`Limits.mixed_share_types`: no type is left out of an open mixed level,
        `_excluded`)."""
        self.m, self.levels, self.devices = microbatches, levels, devices
        self.shared = shared
        self.optimizer, self.single = optimizer, single
        self.kinds = sorted(devices)
        self._kind_names = tuple(self.kinds)
        assert sync.kinds == self.kinds
        self.sync = sync
        self.work = np.array([work[k] for k in self.kinds])
        # per level and types left out (see `_members`)
        self._members_of: dict[tuple[int, frozenset[str]], list[Family]] = {}
        self._static: dict[tuple[int, frozenset[str]], LevelView] = {}
        self._n_maxes: dict[tuple[int, frozenset[str]], np.ndarray] = {}
        self._bounds: dict[tuple[int, frozenset[str]], LevelView] = {}
        self._masks: dict[tuple[str, ...], np.ndarray] = {}
        self._traits_of: dict[tuple | None, Traits] = {}
        self._joiners: dict[tuple[int, ...], tuple[float, np.ndarray] | None] = {}
        self._open: dict[tuple[int, ...], OpenLevels] = {}
        self._alone: dict[tuple[int, ...], tuple[float, float]] = {}
        self._families: dict[tuple[int, ...], OpenFamilies] = {}
        self._owns: dict[tuple, np.ndarray] = {}  # `_open_shift`'s floors

    def _members(self, level: int, excluded: frozenset[str] = frozenset()) -> list[Family]:
        """The level's families that use none of the `excluded` types (a mixed level
        past the first offers no type a mixed class before it uses: `search._Setup`)."""
        key = (level, excluded)
        if key not in self._members_of:
            self._members_of[key] = [f for f in self.levels[level]
                                     if excluded.isdisjoint(f.types)]
        return self._members_of[key]

    def _level_static(self, level: int, excluded: frozenset[str] = frozenset()) -> LevelView:
        """The part of `_level` that tightening leaves as it is (its rates empty)."""
        static = self._static.get((level, excluded))
        if static is None:
            families = self._members(level, excluded)
            counts = np.array([self._counts(f) for f in families],
                              dtype=float).reshape(len(families), len(self.kinds))
            kinds = {k for f in families for k in f.types}
            static = LevelView(
                counts=counts, inv_size=1 / counts.sum(axis=1).clip(1),
                holding=[np.flatnonzero(counts[:, i]) for i in range(len(self.kinds))],
                inv_fluid=1 / counts.dot(1 / self.work).clip(1e-300),
                home=self.kinds.index(kinds.pop()) if len(kinds) == 1 else -1,
                inv_busy=np.zeros(0), total=np.zeros(0))
            self._static[level, excluded] = static
        return static

    def _is_mixed(self, level: int) -> bool:
        return self._level_static(level).home < 0

    def _level(self, level: int, excluded: frozenset[str] = frozenset()) -> LevelView:
        """A level's families (`_members`) as `Bound` values them; the rates (`inv_busy`,
        `total`) are dropped by `invalidate` when families were tightened."""
        view = self._bounds.get((level, excluded))
        if view is None:
            members = self._members(level, excluded)
            live = [np.isfinite(f.min_busy) for f in members]
            view = dataclasses.replace(
                self._level_static(level, excluded),
                inv_busy=np.array([1 / f.min_busy if ok else 0.0
                                   for f, ok in zip(members, live, strict=True)]),
                total=np.array([f.total if ok else INF
                                for f, ok in zip(members, live, strict=True)]))
            self._bounds[level, excluded] = view
        return view

    def invalidate(self) -> None:
        self._bounds.clear()
        self._open.clear()  # (the joiners and classes alone stay valid, if looser)

    def _counts(self, f: Family | None) -> np.ndarray:
        """Devices of each type one of the family's pipelines takes."""
        return _devices_per_pipeline(self._kind_names, *(f.key if f else ((), ())))

    def _traits(self, f: Family | None) -> Traits:
        """The family's `Traits` (None: no class), kept per pattern."""
        key = f.key if f else None
        found = self._traits_of.get(key)
        if found is None:
            types, tps = f.key if f else (None, None)
            found = Traits(self._mask(f), float(len(types)) if types else 1.0,
                           self.sync.copies(types, tps) if types else self.sync.copies(None),
                           self.sync.tp_index(tps), self.sync.runs(types, tps) if types
                           else INF, self._counts(f))
            self._traits_of[key] = found
        return found

    def _slot_values(self, open_levels: Sequence[int], room: np.ndarray | None,
                     excluded: frozenset[str], later: np.ndarray | float) -> SlotValues:
        """The open levels valued per slot (see the class); room: per row and mixed
        family, the most of its pipelines that fit in the devices left (`_mixed_room`);
        excluded: the types no open mixed family may use (`_excluded`); later: as
        `_whole_levels` takes it, of which each homogeneous family starts its least (its
        first rung's). (Levels are
        valued so where a mixed one is open: at the root, and below it while more mixed
        classes may join, where no open family starting later than the fixed classes'
        sync makes it is counted: valid, and looser.)"""
        mixed = [level for level in open_levels if self._is_mixed(level)]
        return SlotValues(self._homogeneous(open_levels),
                          later.min(axis=2) if np.ndim(later) == 3 else later,
                          self._level(mixed[0], excluded) if mixed else None,
                          len(mixed), room, self.work, len(self.kinds))

    def _homogeneous(self, open_levels: Sequence[int]) -> OpenLevels:
        """The open homogeneous levels' families side by side."""
        key = tuple(open_levels)
        if key not in self._open:
            views = [self._level(level) for level in open_levels]
            views = [v for v in views if v.home >= 0 and len(v.counts)]
            sizes = [len(v.counts) for v in views]

            def joined(field: str) -> np.ndarray:
                return (np.concatenate([getattr(v, field) for v in views]) if views
                        else np.zeros(0))

            self._open[key] = OpenLevels(
                homes=np.array([v.home for v in views], dtype=int),
                starts=np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int) if views
                else np.zeros(0, dtype=int),
                inv_size=joined("inv_size"), inv_busy=joined("inv_busy"), total=joined("total"))
        return self._open[key]

    def open_families(self, open_levels: Sequence[int]) -> list[Family]:
        """The families of the open homogeneous levels, in the order `fits` takes them."""
        return [f for level in open_levels if self.levels[level] and not self._is_mixed(level)
                for f in self.levels[level]]

    def _open_families(self, open_levels: Sequence[int]) -> OpenFamilies:
        """The open homogeneous levels' families as `OpenFamilies`."""
        key = tuple(open_levels)
        if key not in self._families:
            families = [f for level in open_levels if not self._is_mixed(level)
                        for f in self.levels[level]]
            homes = np.array([self.kinds.index(f.types[0]) for f in families], dtype=int)
            copies = np.array([self.sync.copies(f.types, f.tps)[k] for f, k in zip(
                families, homes, strict=True)])
            n_max = np.array([float(f.n_max) for f in families])
            caps = copies[:, None] * _rungs(max(1.0, *(n_max / copies)) if families else 1.0)
            lows = np.concatenate([np.zeros((len(families), 1)), caps[:, :-1]], axis=1)
            self._families[key] = OpenFamilies(
                masks=np.array([self._mask(f) for f in families]).reshape(-1, len(self.kinds)),
                stages=np.array([float(len(f.types)) for f in families]),
                optimizer=np.array([self.optimizer(f, f.n_max) for f in families]),
                homes=homes, n_max=n_max, caps=caps, lows=lows,
                spread=np.ceil((lows + 1) / copies[:, None]),
                size=np.array([float(f.devices) for f in families]),
                per_node=np.array([self.sync.per_node(f.tps[0])[k] for f, k in zip(
                    families, homes, strict=True)]),
                runs=np.array([self.sync.runs(f.types, f.tps) for f in families]))
        return self._families[key]

    def _whole_levels(self, open_levels: Sequence[int], later: np.ndarray | float,
                      free: np.ndarray, fits: np.ndarray | None = None) -> WholeLevels:
        """Per open homogeneous level, the most micro-batches it can finish on `free`
        slots per type (a row each; `WholeLevels`). A level adds one class, so at most
        the best of its families' pipelines that fit (in its type's devices and, where
        given, as placement puts them beside the classes before: `fits`, per family), an
        open family starting `later` [row, family, rung]: a rung stands for its counts
        above the rung below, all paying at least the sync of the smallest (more nodes
        never sync faster), so none finishes more than the rung's most at that sync; per
        slot, the first rung's pace."""
        opened, found = self._homogeneous(open_levels), self._open_families(open_levels)
        if not len(found.size):
            nothing = np.zeros((len(free), 0, 1))
            return WholeLevels(nothing, nothing, nothing, opened.starts, opened.inv_size,
                               opened.homes)
        n = np.minimum(found.n_max[None, :], np.floor(
            np.maximum(free[:, found.homes], 0.0) / found.size[None, :] + 1e-9))
        if fits is not None:
            n = np.minimum(n, fits)
        if np.ndim(later) < 3:  # no sync beyond the fixed classes': the most pipelines
            pipes = n[:, :, None]
            begins, pace = (opened.total + later)[..., None], opened.inv_busy[:, None]
        else:
            pipes = np.where(n[:, :, None] > found.lows[None],
                             np.minimum(n[:, :, None], found.caps[None]), 0.0)
            begins, pace = opened.total[None, :, None] + later, opened.inv_busy[None, :, None]
        return WholeLevels(pipes, begins, pace, opened.starts, opened.inv_size, opened.homes)

    def _open_shift(self, open_levels: Sequence[int], classes: list, terms: list,
                    live: np.ndarray, candidate: int) -> tuple[np.ndarray, np.ndarray] | None:
        """How much later than the fixed classes each open homogeneous family must finish
        its micro-batches ([candidate, family, rung of counts]), were it added: the sync
        it pays beyond the largest floor the classes pay (the step pays the largest sync
        of any class, so the fixed classes' floor leaves the rest to finish earlier),
        and its optimizer floor (with the floors to compare it to in `_core`). terms: the sync
        floors of the classes and the one added (`SyncFloor.terms`)."""
        found = self._open_families(open_levels)
        if not len(found.stages):
            return None
        paid = [np.where(live, p, 0.0) if c == candidate else p
                for c, (p, _, _) in enumerate(terms)]
        # the floors depend on the classes' types alone, which few rows tell apart
        together = np.concatenate([c[0] for c in classes], axis=1)
        firsts: dict[bytes, int] = {}  # each distinct row's first index, in order
        seen = [firsts.setdefault(row.tobytes(), i) for i, row in enumerate(together)]
        kinds = together[list(firsts.values())]
        rows = np.searchsorted(list(firsts.values()), seen)
        key = (tuple(open_levels), kinds.tobytes(), kinds.shape)
        if key not in self._owns:
            joined = np.maximum(found.spread, np.ceil((found.lows + 2) / found.per_node[:, None]))
            self._owns[key] = self.sync.open_floors(
                found.masks, found.stages, np.split(kinds, len(classes), axis=1), found.spread,
                joined, found.lows + 1, found.runs)
        own = self._owns[key][rows.reshape(-1)]
        return (sync_beyond(np.maximum(0.0, own - np.max(paid, axis=0)[:, None, None]),
                            self.sync.policy), found.optimizer)

    def _mixed_room(self, open_levels: Sequence[int], free: np.ndarray,
                    excluded: frozenset[str]) -> np.ndarray | None:
        """Per row of `free` devices (per type) and family of the open mixed levels (less
        those using `excluded` types), the most of its pipelines that fit in them (None
        where no mixed level is open)."""
        mixed = next((level for level in open_levels if self._is_mixed(level)), None)
        if mixed is None:
            return None
        counts = self._level_static(mixed, excluded).counts  # [family, type]
        fit = np.where(counts[None] > 0, np.floor(np.maximum(free, 0.0)[:, None, :] / np.where(
            counts > 0, counts, 1.0)[None] + 1e-9), INF).min(axis=2)
        return np.minimum(self._n_max(mixed, excluded)[None, :], fit)

    def _excluded(self, fixed: Sequence[tuple[Family, int]],
                  candidates: Sequence[tuple[Family | None, int]]) -> list[frozenset[str]]:
        """Per candidate, the types an open mixed level's families may not use: those of
        the mixed classes before it, fixed or the candidate (a plan's mixed classes use
        disjoint types: `search._Setup.mixed_after`)."""
        if self.shared:
            return [frozenset()] * len(candidates)
        used = frozenset(k for f, _ in fixed if len(set(f.types)) > 1 for k in f.types)
        return [used | frozenset(f.types) if f and len(set(f.types)) > 1 else used
                for f, _ in candidates]

    def _n_max(self, level: int, excluded: frozenset[str] = frozenset()) -> np.ndarray:
        """The most pipelines of each family of a level (`_members`)."""
        key = (level, excluded)
        if key not in self._n_maxes:
            self._n_maxes[key] = np.array([float(f.n_max)
                                           for f in self._members(level, excluded)])
        return self._n_maxes[key]

    def many(self, fixed: Sequence[tuple[Family, int]],
             candidates: Sequence[tuple[Family | None, int]], open_levels: Sequence[int],
             fewer: bool | Sequence[int] = False,
             at_least: tuple[float, float] = (0.0, 0.0),
             fits: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The bound of `fixed` plus each candidate class (f, n) (None: no class), all at
        once, and the same without the fixed classes' sync floor (the base); with
        `fewer`, a candidate stands for 1..n pipelines (or, given per candidate, for its
        fewest count here to n). `at_least`: a bound and base
        already known for all of them (e.g. the parent's). `fits`: per family of the
        open homogeneous levels (`Bound.open_families`), the most pipelines placement
        puts beside the fixed classes and any candidate (see `_whole_levels`).

        Sync is one term of the step, so each class's floor is added on its own: the
        class pays its sync floor, or its largest stage is on ZeRO-3 and the bound
        with its period raised pays the sharded floor (`sync_floor`); the bound is
        the largest over the classes of the smaller of the two."""
        # families that cannot run have infinite times, and no micro-batches: (t - inf) * 0
        with np.errstate(divide="ignore", invalid="ignore"):
            if not any(self._is_mixed(level) for level in open_levels if self.levels[level]):
                return self._many(fixed, candidates, open_levels, fewer, at_least, fits)
            # an open mixed level's families depend on the candidate's types: the rows
            # bounded in groups of one such set each
            sets = self._excluded(fixed, candidates)
            full, base = np.zeros(len(candidates)), np.zeros(len(candidates))
            for excluded in dict.fromkeys(sets):
                rows = [i for i, e in enumerate(sets) if e == excluded]
                full[rows], base[rows] = self._many(
                    fixed, [candidates[i] for i in rows], open_levels,
                    fewer if isinstance(fewer, bool) else [fewer[i] for i in rows], at_least,
                    fits[rows] if fits is not None and fits.ndim == 2 else fits)
            return full, base

    def _many(self, fixed: Sequence[tuple[Family, int]],
              candidates: Sequence[tuple[Family | None, int]], open_levels: Sequence[int],
              fewer: bool | Sequence[int], at_least: tuple[float, float],
              fits: np.ndarray | None
              ) -> tuple[np.ndarray, np.ndarray]:
        rows = len(candidates)
        if self.single and open_levels:  # then nothing is fixed and no candidate live
            full, base = self._best_alone(open_levels)
            return (np.full(rows, max(full, at_least[0])),
                    np.full(rows, max(base, at_least[1])))
        size = (rows, len(self.kinds))
        classes = [(np.broadcast_to((t := self._traits(f)).mask, size),
                    np.full(rows, t.stages), np.full(rows, float(n)), np.full(rows, float(n)),
                    np.broadcast_to(t.copies, size), np.full(rows, t.tp_index),
                    np.full(rows, t.runs))
                   for f, n in fixed]
        live = np.array([f is not None for f, _ in candidates])
        if live.any():
            traits = [self._traits(f) for f, _ in candidates]
            classes.append((np.array([t.mask for t in traits]),
                            np.array([t.stages for t in traits]),
                            fewest_counts(fewer, candidates),
                            np.array([float(max(n, 1)) for _, n in candidates]),
                            np.array([t.copies for t in traits]),
                            np.array([t.tp_index for t in traits]),
                            np.array([t.runs for t in traits])))
        joiner = self._joiner(open_levels)
        if joiner is None or not classes:
            base = self._core(fixed, candidates, open_levels, fewer, at_least[1], fits=fits)
            full = self._synced(fixed, candidates, open_levels, fewer, at_least[1], base,
                                classes, live, fits=fits)
        else:  # the open levels add a class, whose sync joins the fixed ones', or none
            stages, mask = joiner
            ones = np.ones(rows)
            joined = [*classes, (np.broadcast_to(mask, size), np.full(rows, stages), ones,
                                 ones, np.broadcast_to(self.sync.copies(None), size),
                                 np.full(rows, self.sync.tp_index(None)), np.full(rows, INF))]
            terms = self.sync.terms(joined)
            shift = None if self.sync.zero3 else self._open_shift(
                open_levels, classes, terms, live, len(fixed) if live.any() else -1)
            base = self._core(fixed, candidates, open_levels, fewer, at_least[1], shift, fits)
            full = self._synced(fixed, candidates, open_levels, fewer, at_least[1], base,
                                joined, live, terms, fits)
            if shift is not None:  # that base holds some sync: the parent's stays valid
                base = np.full(rows, at_least[1])
            alone = self._core(fixed, candidates, (), fewer, at_least[1])
            if (alone < full).any():  # the sync floors only raise it
                full = np.minimum(full, self._synced(fixed, candidates, (), fewer,
                                                     at_least[1], alone, classes, live))
        return np.maximum(full, at_least[0]), base

    def _best_alone(self, open_levels: Sequence[int]) -> tuple[float, float]:
        """With one class to a structure: the smallest bound and base of any class the
        open levels may add (as many of its pipelines as fit: alone, fewer are slower).
        The classes are bounded in order of a cheap floor, n pipelines finishing the
        micro-batches at their least period after their least fill (`_core` is no
        lower), until that floor reaches the smallest bound found: the rest cannot
        be smaller, in bound or base (a base is at most its bound). They are bounded
        in chunks growing from `_ALONE_CHUNK` (each row as in a call of its own, so the
        chunks change the cost alone)."""
        key = tuple(open_levels)
        if key not in self._alone:
            options, floors = [], []
            devices = np.array([float(self.devices[k]) for k in self.kinds])
            for level in open_levels:
                if not self.levels[level] or (level - 1 in open_levels and (
                        self.levels[level] is self.levels[level - 1])):
                    continue  # (a mixed level past the first: the same families)
                view = self._level(level)
                counts, inv_busy, total = view.counts, view.inv_busy, view.total
                fit = np.where(counts > 0, np.floor(devices / np.where(counts > 0, counts, 1.0)),
                               INF).min(axis=1)
                n = np.minimum(np.minimum(self._n_max(level), self.m), fit)
                floor = total + (self.m / np.maximum(n, 1.0) - 1) / np.where(
                    inv_busy > 0, inv_busy, 1.0)
                for i in np.flatnonzero((n >= 1) & (inv_busy > 0)):
                    options.append((self.levels[level][i], int(n[i])))
                    floors.append(floor[i])
            order = np.argsort(floors, kind="stable")
            full, base, done, size = INF, INF, 0, _ALONE_CHUNK
            while done < len(order) and floors[order[done]] < full:
                chunk = [options[i] for i in order[done:done + size] if floors[i] < full]
                bounds, bases = self.many([], chunk, (), True)
                full, base = min(full, float(np.min(bounds))), min(base, float(np.min(bases)))
                done, size = done + size, 4 * size
            self._alone[key] = (full, base)
        return self._alone[key]

    def _joiner(self, open_levels: Sequence[int]) -> tuple[float, np.ndarray] | None:
        """The most stages of a class the open levels may add and the types it may use
        (None if they can add none)."""
        key = tuple(open_levels)
        if key not in self._joiners:
            runnable = [f for level in open_levels for f in self.levels[level]
                        if np.isfinite(f.min_busy)]
            self._joiners[key] = (float(max(len(f.types) for f in runnable)), np.array(
                [any(k in f.types for f in runnable) for k in self.kinds])) if runnable else None
        return self._joiners[key]

    def _synced(self, fixed: Sequence[tuple[Family, int]],
                candidates: Sequence[tuple[Family | None, int]], open_levels: Sequence[int],
                fewer: bool | Sequence[int], at_least: float, base: np.ndarray, classes: list,
                live: np.ndarray, terms: list | None = None, fits: np.ndarray | None = None
                ) -> np.ndarray:
        """`many`'s bound from its base and the sync floors of the classes (the fixed
        ones, the candidates' if any is live, then maybe one the open levels add, which
        never takes ZeRO-3: they are searched without it where they join others);
        `terms`: their floors if already known."""
        full = base
        if len(classes) < 2 and not any(np.any(c[2] > 1) for c in classes):
            return full
        candidate = len(fixed) if live.any() else -1
        searched = len(fixed) + (candidate >= 0)  # classes past these: the one added
        for c, (paid, sharded, period) in enumerate(terms or self.sync.terms(classes)):
            if c == candidate:
                paid = np.where(live, paid, 0.0)
                sharded = np.where(live, sharded, INF)
            term = synced(base, paid, self.sync.policy)
            cheaper = (sharded < paid) & (c < searched)
            if cheaper.any():
                raised = self._raised(fixed, candidates, open_levels, fewer, at_least, c,
                                      period, cheaper, base, fits)
                term = np.where(cheaper, np.minimum(term, synced(raised, sharded,
                                                                   self.sync.policy)), term)
            full = np.maximum(full, term)
        return full

    def _mask(self, f: Family | None) -> np.ndarray:
        """Which types the family's stages use (none for no family)."""
        key = f.types if f else ()
        if key not in self._masks:
            self._masks[key] = np.array([k in key for k in self.kinds])
        return self._masks[key]

    def _raised(self, fixed: Sequence[tuple[Family, int]],
                candidates: Sequence[tuple[Family | None, int]], open_levels: Sequence[int],
                fewer: bool | Sequence[int], at_least: float, c: int, period: np.ndarray,
                rows: np.ndarray, base: np.ndarray, fits: np.ndarray | None
                ) -> np.ndarray:
        """The base bound with class c (a fixed one, or the candidates' if c is past
        them) at least `period` per micro-batch, on the given rows."""
        def slower(f: Family, p: float) -> Family:
            return dataclasses.replace(f, min_busy=max(f.min_busy, p),
                                       total=max(f.total, p), result=None, lines=pair_staircase(
                                           (max(a, p), max(b, p)) for a, b in f.floors()))

        if c < len(fixed):
            f, n = fixed[c]
            if f.min_busy >= period[0]:
                return base
            fixed = [*fixed[:c], (slower(f, float(period[0])), n), *fixed[c + 1:]]
        else:
            rows = rows & np.array([f is not None and f.min_busy < p for (f, _), p
                                    in zip(candidates, period, strict=True)])
            if not rows.any():
                return base
            candidates = [(slower(f, float(p)) if take else f, n) for (f, n), p, take
                          in zip(candidates, period, rows, strict=True)]
        return self._core(fixed, candidates, open_levels, fewer, at_least, fits=fits)

    def _core(self, fixed: Sequence[tuple[Family, int]],
              candidates: Sequence[tuple[Family | None, int]], open_levels: Sequence[int],
              fewer: bool | Sequence[int], at_least: float,
              shift: tuple[np.ndarray, np.ndarray] | None = None,
              fits: np.ndarray | None = None) -> np.ndarray:
        """`many`'s bound before sync: the first time the fixed classes, each row's
        candidate and the open levels finish the global batch (`finish.py`), plus the
        optimizer step; `shift`: per row and open homogeneous family, sync it pays
        beyond the classes' floors, and per family its optimizer floor (see
        `_open_shift`); `fits`: as `many`."""
        rows = self._rows(fixed, candidates, fewer)
        open_levels = [level for level in open_levels if self.levels[level]]
        # per row, each class's `floors` that can matter: no t below the row's `after` is
        # asked (the search below starts at `at_least`, less the row's own optimizer
        # step: not the largest of any row's, or a row's bound would depend on the others)
        after = pipelines_within(at_least, 0.0, rows.optimizer)
        lines = FixedLines.of(
            [(n, floors_per_row(f.floors(), after)) for f, n in fixed],
            [(n if f else 0, floors_after(f.floors(), cut) if f else ((INF, -INF),))
             for (f, n), cut in zip(candidates, after.tolist(), strict=True)])
        opened = None
        if open_levels:
            later = 0.0 if shift is None else shift[0] + np.maximum(
                0.0, shift[1][None, :] - rows.optimizer[:, None])[:, :, None]
            opened = self._open_value(fixed, candidates, open_levels, rows, later, fits)
        finished = Finished(lines, opened, self.m)
        if not open_levels:  # every pipeline is busy from `start` on: a line in t
            # (on the pairs' least period and fill; then on all pairs from there)
            times = lines.line_times(rows.start, self.m)
            if lines.width > 1:  # (nan: a class that cannot run, a dead row)
                times = first_enough(finished.shortfall, np.where(np.isnan(times), INF, times),
                                     after)
        else:
            start = rows.start
            if not fixed:
                first = min(float(self._level(level).total.min()) for level in open_levels)
                start = np.where(rows.pipes > 0, start, first)
            times = first_enough(finished.shortfall, np.where(np.isfinite(start), start, INF),
                                 after)
        times = walk_whole(finished, np.maximum(times, after))
        return np.where(rows.dead, INF, np.maximum(at_least, unsynced(times, rows.optimizer)))

    def _rows(self, fixed: Sequence[tuple[Family, int]],
              candidates: Sequence[tuple[Family | None, int]], fewer: bool | Sequence[int]
              ) -> Rows:
        """The fixed classes plus each candidate, as `_core` bounds them."""
        free = np.array([float(self.devices[k]) for k in self.kinds])
        for f, n in fixed:
            free -= n * self._traits(f).counts
        counts = np.array([self._traits(f).counts for f, _ in candidates]
                          ).reshape(-1, len(self.kinds))
        pipes = np.array([float(n) if f else 0.0 for f, n in candidates])
        busy = np.array([f.min_busy if f else INF for f, _ in candidates])
        total = np.array([f.total if f else -INF for f, _ in candidates])
        dead = (any(f.min_busy == INF for f, _ in fixed)
                | (sum(n for _, n in fixed) + pipes > self.m) | (pipes > 0) & (busy == INF))
        optimizer = np.maximum(max((self.optimizer(f, n) for f, n in fixed), default=0.0),
                               [self.optimizer(f, n) if f else 0.0 for f, n in candidates])
        return Rows(free=free[None, :] - pipes[:, None] * counts, counts=counts, pipes=pipes,
                    spare=pipes - fewest_counts(fewer, candidates), optimizer=optimizer,
                    start=np.maximum(max((f.total for f, _ in fixed), default=0.0), total),
                    dead=dead)

    def _open_value(self, fixed: Sequence[tuple[Family, int]],
                    candidates: Sequence[tuple[Family | None, int]], open_levels: list[int],
                    rows: Rows, later: np.ndarray | float, fits: np.ndarray | None
                    ) -> OpenValue:
        """What the open levels add (`finish.OpenValue`): each homogeneous level whole
        pipelines of one class on its type's free slots, where no mixed level is open;
        where one is, the levels at per-slot values, but for the homogeneous levels of
        the types no open mixed family may use (the rows' mixed classes', `_excluded`),
        valued as whole pipelines on those types' slots still."""
        mixed = any(self._is_mixed(level) for level in open_levels)
        kinds = np.zeros(len(self.kinds), dtype=bool)  # the types valued per slot
        slots = None
        if mixed:
            excluded = frozenset.intersection(*self._excluded(fixed, candidates))
            kinds = np.array([k not in excluded for k in self.kinds])
            # (the most free: the candidates' dropped pipelines leave theirs)
            room = self._mixed_room(open_levels, rows.free + rows.spare[:, None] * rows.counts,
                                    excluded)
            slots = self._slot_values(open_levels, room, excluded, later)
        counted = ~kinds[self._homogeneous(open_levels).homes]
        whole = self._whole_levels(open_levels, later, rows.free, fits) if (
            counted.any()) else None
        return OpenValue(whole, counted, slots, rows.free, kinds, rows.counts, rows.spare)

    def unsynced(self, fixed: Sequence[tuple[Family, int]], open_levels: Sequence[int],
                 fewer: bool = False, at_least: float = 0.0, fits: np.ndarray | None = None
                 ) -> float:
        """The time a (partial) structure's micro-batches and optimizer step take at
        least, before any sync: `many`'s base where no level is open. Where one is, that
        base holds the sync a class the open levels add pays beyond the fixed classes'
        floors (`_open_shift`), so `many` passes on the base it was given instead."""
        last = [fixed[-1]] if fixed else [(None, 0)]
        with np.errstate(divide="ignore", invalid="ignore"):
            return float(self._core(fixed[:-1], last, open_levels, fewer, at_least,
                                    fits=fits)[0])

    def __call__(self, fixed: Sequence[tuple[Family, int]], open_levels: Sequence[int],
                 fewer: bool = False, at_least: tuple[float, float] = (0.0, 0.0),
                 fits: np.ndarray | None = None) -> tuple[float, float]:
        """The bound and base of one (partial) structure; `fewer` applies to its last
        class; `fits` as `many`."""
        last = [fixed[-1]] if fixed else [(None, 0)]
        full, base = self.many(fixed[:-1], last, open_levels, fewer, at_least, fits)
        return float(full[0]), float(base[0])


def fewest_counts(fewer: bool | Sequence[int],
                  candidates: Sequence[tuple[Family | None, int]]) -> np.ndarray:
    """Per candidate (f, n), the fewest pipelines it stands for (`Bound.many`'s `fewer`:
    True for one each, False for n; none for no class)."""
    if isinstance(fewer, bool):
        return np.array([(1.0 if fewer else float(n)) if f else 0.0 for f, n in candidates])
    return np.array([float(k) if f else 0.0 for (f, _), k in zip(candidates, fewer,
                                                                  strict=True)])


def floors_per_row(pairs: tuple[tuple[float, float], ...], after: np.ndarray
                   ) -> list[tuple[tuple[float, float], ...]]:
    """A fixed class's `floors_after` each row's own `after` (each distinct one cut once):
    a row's lines do not depend on the other rows of the call."""
    kept = {cut: floors_after(pairs, cut) for cut in set(after.tolist())}
    return [kept[cut] for cut in after.tolist()]


# the classes `Bound._best_alone` bounds first, then four times as many at a time: the
# floor order is good (Llama-2 7B on three types, 140 classes alone: the first 4 hold
# the least bound of every root), and a call's cost grows with its rows
_ALONE_CHUNK = 4
_LINEAR_RUNGS = 8  # rungs of counts one node's worth apart, before they double


def _rungs(most: float) -> np.ndarray:
    """The multiples of the pipelines one node holds a stage of that end the rungs of
    counts (see `Bound`), up to at least `most`: 1, 2, ..., _LINEAR_RUNGS, then
    doubling. Each rung pays the sync of its fewest pipelines, so the finer the
    rungs the tighter the bound; many rungs cost time where pipelines are many
    (gpt-tiny on the example cluster: 6,543 nodes with rungs doubling from the
    first, 3,395 with these; GPT-2 small on 4,096 GPUs, a node's worth apart all
    the way: 23 nodes explored in 60 s, against 455)."""
    out = [1.0]
    while out[-1] < most:
        out.append(out[-1] + 1.0 if out[-1] < _LINEAR_RUNGS else 2.0 * out[-1])
    return np.array(out)[None, :]


@functools.lru_cache(maxsize=1 << 16)
def _devices_per_pipeline(kinds: tuple[str, ...], types: tuple[str, ...],
                          tps: tuple[int, ...]) -> np.ndarray:
    """Devices of each of `kinds` a pipeline of these stage types and degrees takes
    (cached across configurations and searches: the same families recur; read only)."""
    return np.array([devices_of(types, tps, k) for k in kinds], dtype=float)


def optimizer_bound(table: CostTable, params: float, space: Space
                    ) -> Callable[[Family, int], float]:
    """The optimizer step n pipelines of family f pay at least: some stage holds 1/S of
    the parameters, split over its tp ranks and sharded by ZeRO over the n pipelines if
    ZeRO is allowed."""
    memo: dict[tuple, float] = {}

    def bound(f: Family, n: int) -> float:
        key = (frozenset(f.types), len(f.types), max(f.tps), n)
        if key not in memo:  # (each rank holds its share at the widest degree at least)
            shard = max(f.tps) * len(f.types) * (n if max(space.zeros) >= 1 else 1)
            memo[key] = min(table.optimizer_time(k, params / shard) for k in set(f.types))
        return memo[key]

    return bound
