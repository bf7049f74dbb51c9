"""The gradient sync a partial structure's fixed classes pay at least, for the bounds.

Every pipeline holds every layer, so the stage of class c that holds the most
parameters (x >= P / S_c, S_c its stages) is all-reduced among one stage of every
pipeline of every class (`evaluate.sync_and_optimizer`). On the stage's type t its
group spans at least k = ceil(n_c / (pipelines of c one node holds a stage of:
`copies`)) nodes, and for each other class d it holds a stage of one of d's types.
A collective costs at least what it costs among a subset of its members (a ring
over fewer ranks and links no slower), and one rank per node costs what the
nodes' links allow: so where all nodes of a type are linked alike, the step pays
at least the all-reduce of x's gradients over k of them (plus one node of d's
type); elsewhere, over the cheapest pair of different nodes. Where k is 1 the
group may sit on one node: then it pays at least the all-reduce over that node's
own link among its ranks (a stage of every pipeline: at least the classes'
fewest pipelines, and no more than the node's devices), or, spanning more nodes,
that over two of them.

Unless that stage is on ZeRO-3: then only each device's 1/n_c shard is all-reduced
across classes, and nothing within c, but every micro-batch the stage computes its
layers (at least the cheapest range holding x parameters) and gathers its weights
three times (at least `partition`'s cheapest gather): a period the class's pipelines
take at least. `Bound` takes, per class, the smaller of the two.

Without ZeRO-3 the step also pays its busiest network card (`evaluate.card_floor`):
where every stage's replicas span two or more nodes, the stages one pipeline holds
on one node all-reduce through that node's card in turn, and a pipeline spans at
most `runs` nodes, so one of them carries at least the heaviest of `runs` runs of
whole layers (`evaluate.heaviest_run`), at the least per-byte cost of an all-reduce
over that many nodes of any of its types.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from cost_models.comm import CommGroup
from planner.solver.evaluate import Config, Space, all_reduce_line, heaviest_run
from planner.solver.interleave import fold
from planner.solver.keys import (
    OneNodeKey,
    PipelineCopiesKey,
    PipelineRunsKey,
    SyncLineKey,
    SyncLinksKey,
)
from planner.solver.partition import INF, ZERO_GATHER_REF
from planner.solver.structure import blocks
from planner.solver.table import CostTable


class SyncFloor:
    """Per-class sync floors of (partial) structures of one configuration."""

    def __init__(self, table: CostTable, config: Config, space: Space,
                 kinds: Sequence[str], gathers: dict[str, tuple[float, float]],
                 tps: Sequence[int], least: dict[str, int]) -> None:
        """gathers: per type, a ZeRO-3 all-gather of 1 byte and of ZERO_GATHER_REF bytes
        that no group of its replicas beats; tps: the classes' tensor-parallel degrees;
        least: per type, the smallest degree of a class using it (absent: none does)."""
        table = fold(table, config.interleave)
        self.kinds = list(kinds)
        self._infos = infos = [table.type(k) for k in self.kinds]
        self.params = float(table.params.sum())
        self.largest = float(table.params.max())
        self.grad_bytes = table.grad_bytes
        self.zero3 = 3 in space.zeros
        self.tps = sorted(tps)
        self._per_node = {tp: np.array([max(1, *(d // tp for d in t.node_devices))
                                        for t in infos], dtype=float) for tp in self.tps}
        # stages of any class one node holds
        self.most_per_node = np.array([self._per_node[least.get(k, self.tps[0])][i]
                                       for i, k in enumerate(self.kinds)])
        self.nodes = np.array([len(t.nodes) for t in infos])
        self.node_slots = np.array([max(t.node_devices) for t in infos])
        self._diagonal = np.eye(len(infos), dtype=bool)[None]
        self._copies: dict[tuple[str, ...], np.ndarray] = {}
        self._table, self._config, self._gathers = table, config, gathers
        self.policy = table.sync  # how a step pays these floors (`step.synced`)

    @functools.cached_property
    def floor(self) -> np.ndarray:
        """[:, t, k, u]: intercept and slope of the all-reduce among k nodes of type t and
        one of type u (u = the number of types: none). Built when first needed (most
        configurations are never searched deep enough to fix a class)."""
        infos = self._infos
        size = len(infos)
        widest = int(self.nodes.max())
        floor = np.zeros((2, size, widest + 1, size + 1))
        for i, t in enumerate(infos):
            for k in range(1, widest + 1):
                alone = _floor(self._table, t.nodes, min(k, len(t.nodes)), ())
                floor[:, i, k, size] = alone
                for j, u in enumerate(infos):
                    floor[:, i, k, j] = alone if i == j else np.maximum(
                        alone, _floor(self._table, t.nodes, min(k, len(t.nodes)), u.nodes))
        return floor

    @functools.cached_property
    def one_node(self) -> np.ndarray:
        """[:, t, r]: intercept and slope of the all-reduce among r ranks on one node of
        type t (the fastest of its nodes' links; r up to the most devices a node of any
        type has, fewer than 2: nothing)."""
        key = OneNodeKey(tuple(self.kinds))
        if key not in self._table.cache:
            widest = int(self.node_slots.max())
            out = np.zeros((2, len(self._infos), widest + 1))
            for i, t in enumerate(self._infos):
                nodes = list({self._table.link(n, n): n for n in t.nodes}.values())
                for r in range(2, widest + 1):
                    out[:, i, r] = _affine(self._table, [[n] * r for n in nodes])
            self._table.cache[key] = out
        return self._table.cache[key]

    @functools.cached_property
    def two_nodes(self) -> np.ndarray:
        """[:, t, u]: intercept and slope of an all-reduce among a node of type t and one
        of type u (u = t: two of t's, infinite where it has one)."""
        size = len(self.kinds)
        out = self.floor[:, :, 1, :size].copy()
        for i in range(size):
            out[:, i, i] = self.floor[:, i, 2, size] if self.nodes[i] > 1 else (INF, 0.0)
        return out

    def _within(self, volume: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """[row, t]: the all-reduce of `volume` bytes among `ranks` (a row each) that
        holds a node of type t costs at least: on that node alone, among at most as
        many ranks as it has devices, or across it and one more node."""
        t = np.arange(len(self.kinds))[None, :]
        r = np.minimum(ranks[:, None], self.node_slots[None, :]).astype(int)
        one = self.one_node[0][t, r] + self.one_node[1][t, r] * volume[:, None]
        two = (self.two_nodes[0][None] + self.two_nodes[1][None] * volume[:, None, None]
               ).min(axis=2)
        return np.minimum(one, two)

    def per_node(self, tp: int) -> np.ndarray:
        """Per type, the most stages of tp devices one node holds (at least 1)."""
        return self._per_node[tp]

    def tp_index(self, tps: tuple[int, ...] | None) -> int:
        """Where `period` keeps the periods of a class of these stages' degrees (None,
        or degrees that differ: any degree's)."""
        return self.tps.index(tps[0]) if tps and len(set(tps)) == 1 else len(self.tps)

    @functools.cached_property
    def period(self) -> np.ndarray:
        """[i, t, s]: the period of a stage of type t at the i-th tensor-parallel degree
        holding P / s parameters on ZeRO-3 (i past the degrees: the least of them)."""
        table, config = self._table, self._config
        layers = table.num_layers
        held = np.concatenate([[0.0], np.cumsum(table.params)])
        need = np.maximum(self.params / np.arange(1, layers + 1), self.largest)
        # less the tied weights it may own, which ZeRO-3 keeps whole: not gathered
        gathered = np.maximum(need - sum(p for _, p in table.tied_weights), 0.0)
        period = np.zeros((len(self.tps) + 1, len(self.kinds), layers + 1))
        for j, tp in enumerate(self.tps):
            for i, k in enumerate(self.kinds):
                costs = table.costs(k, tp, config.mb)
                work = np.concatenate([[0.0], np.cumsum(costs.fwd + costs.bwd)])
                low, high = self._gathers[k]
                gather = 3 * (low + (high - low) * gathered * table.weight_bytes
                              / ZERO_GATHER_REF)
                period[j, i, 1:] = gather + _least_work(held, work, need)
        period[-1] = period[:-1].min(axis=0)
        return period

    def copies(self, types: tuple[str, ...] | None, tps: tuple[int, ...] = ()
               ) -> np.ndarray:
        """Per type, the most pipelines of a class of these stage types and their
        tensor-parallel degrees one node holds a stage of (None: of any class): a block
        that fits in a node stays in one, beside others as long as they fit, and a
        longer one takes whole nodes (`structure.place`)."""
        if types is None:
            return self.most_per_node
        if (types, tps) not in self._copies:  # (this configuration's, then the table's)
            key = PipelineCopiesKey(tuple(self.kinds), types, tps)
            if key not in self._table.cache:
                degree = dict(zip(types, tps, strict=True))
                per_node = np.array([self.per_node(degree.get(k, min(tps)))[i]
                                     for i, k in enumerate(self.kinds)])
                counts = np.array([types.count(k) for k in self.kinds], dtype=float)
                self._table.cache[key] = np.where(
                    (counts > 0) & (counts <= per_node),
                    np.floor(per_node / np.maximum(counts, 1)), np.where(
                        counts > 0, 1.0, per_node))
            self._copies[types, tps] = self._table.cache[key]
        return self._copies[types, tps]

    def runs(self, types: tuple[str, ...] | None, tps: tuple[int, ...] = ()) -> float:
        """The most nodes one pipeline of these stage types and their tensor-parallel
        degrees spans (infinite for none): a block that fits in a node's free devices
        stays in one, a longer one takes whole nodes, each with at least its fewest
        slots (`structure.place`)."""
        if types is None:
            return INF
        key = PipelineRunsKey(types, tps)
        if key not in self._table.cache:
            runs = 0
            for kind, count, tp in blocks(types, tps):
                slots = min((d // tp for d in self._table.type(kind).node_devices
                             if d >= tp), default=1)
                runs += max(1, -(-count // slots))
            self._table.cache[key] = float(runs)
        return self._table.cache[key]

    def _card(self, mask: np.ndarray, spread: np.ndarray, runs: np.ndarray) -> np.ndarray:
        """Per row, the sync a class pays at least on its busiest network card
        (`evaluate.card_floor`) where every stage's replicas span several nodes of its
        type (`spread`): the parameters' bytes over the runs of a pipeline on one node
        each, at the least slope of any of its types, the busiest run at least
        `heaviest_run` of them (0 elsewhere)."""
        size = len(self.kinds)
        k = np.minimum(spread, self.nodes[None, :])
        t = np.arange(size)[None, :]
        intercept = np.where(mask, self.floor[0][t, k, size], INF).min(axis=1)
        slope = np.where(mask, self.floor[1][t, k, size], INF).min(axis=1)
        crossed = np.where(mask, k >= 2, True).all(axis=1) & mask.any(axis=1)
        known = np.isfinite(runs)
        heaviest = {r: heaviest_run(self._table, (1.0,) * int(r)) for r in set(runs[known])}
        held = np.array([heaviest.get(r, 0.0) for r in runs])
        return np.where(crossed & known, intercept + slope * held, 0.0)

    def terms(self, classes: Sequence[tuple[np.ndarray, ...]]
              ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per class (a mask of its types, its stages, its fewest and most pipelines,
        `copies` per type, `tp_index` and `runs`, a row each): the sync it pays at least
        if its largest stage is not on ZeRO-3 (nor any other where it may be: then on
        its busiest network card too), if it is (infinite where ZeRO-3 is not allowed),
        and the period its pipelines then take at least."""
        out = []
        ranks = np.sum([c[2] for c in classes], axis=0)  # one per pipeline of every class
        for c, (mask, stages, fewest, most, copies, degree, runs) in enumerate(classes):
            volume = np.maximum(self.params / stages, self.largest) * self.grad_bytes
            partners = [m[0] for d, m in enumerate(classes) if d != c]
            spread = np.ceil(fewest[:, None] / copies).astype(int)
            joined = np.maximum(spread, np.ceil(
                (fewest[:, None] + 1) / self.most_per_node[None, :]).astype(int))
            full = self._least(mask, volume, partners, spread, ranks, joined=joined)
            if not self.zero3:
                full = np.maximum(full, self._card(mask, spread, runs))
            if self.zero3:
                spread = np.ceil(most[:, None] / copies).astype(int)
                sharded = np.where(most > 1, self._least(
                    mask, volume / np.maximum(most, 1), partners, spread, ranks, alone=0.0),
                    INF)
                steps = np.clip(stages.astype(int), 1, self.period.shape[2] - 1)
                per_type = self.period[degree.astype(int)[:, None],
                                       np.arange(len(self.kinds))[None, :], steps[:, None]]
                period = np.where(mask, per_type, INF).min(axis=1)
            else:
                sharded, period = np.full(len(volume), INF), np.zeros(len(volume))
            out.append((full, sharded, period))
        return out

    def open_floors(self, masks: np.ndarray, stages: np.ndarray, partners: list[np.ndarray],
                    spread: np.ndarray, joined: np.ndarray, fewest: np.ndarray,
                    runs: np.ndarray) -> np.ndarray:
        """[row, f, r]: the sync a class of family f (its types `masks[f]`, `stages[f]`
        stages, its pipelines on at most `runs[f]` nodes each) pays at least beside the
        partner classes (a mask row each, as in `terms`), were it added with at least
        `fewest[f, r]` pipelines, its stage copies on `spread[f, r]` nodes of its type
        at least (`joined[f, r]` with a partner's stage): its largest stage all-reduced
        with a stage of each partner, and (without ZeRO-3) its busiest network card."""
        rows = partners[0].shape[0] if partners else 1
        count, rungs = spread.shape
        entries = rows * count * rungs
        volume = np.maximum(self.params / stages, self.largest) * self.grad_bytes
        size = len(self.kinds)
        present = np.sum([p.any(axis=1) for p in partners], axis=0) if partners else 0
        held = self._least(
            np.tile(np.repeat(masks, rungs, axis=0), (rows, 1)),
            np.tile(np.repeat(volume, rungs), rows),
            [np.repeat(p, count * rungs, axis=0) for p in partners],
            np.broadcast_to(np.tile(spread.reshape(-1), rows)[:, None], (entries, size)
                            ).astype(int),
            np.tile(fewest.reshape(-1), rows) + np.repeat(present, count * rungs),
            joined=np.broadcast_to(np.tile(joined.reshape(-1), rows)[:, None],
                                   (entries, size)).astype(int)
            ).reshape(rows, count, rungs)
        if self.zero3:
            return held
        card = self._card(np.repeat(masks, rungs, axis=0),
                          np.repeat(spread.reshape(-1, 1), size, axis=1).astype(int),
                          np.repeat(runs, rungs)).reshape(count, rungs)
        return np.maximum(held, card[None])

    def _least(self, mask: np.ndarray, volume: np.ndarray, partners: list[np.ndarray],
               spread: np.ndarray, ranks: np.ndarray, alone: float | None = None,
               joined: np.ndarray | None = None) -> np.ndarray:
        """The smallest, over the stage's type t, of the largest all-reduce floor its
        group must hold: k of t's nodes (`spread`), with one of some type of every
        partner class; `alone`: the value without partners (None: the k nodes');
        `joined`: the nodes of type t the group spans at least with one more stage of
        that type (a partner's on type t may share none of the k nodes)."""
        rows, size = mask.shape
        k = np.minimum(spread, self.nodes[None, :])
        t = np.arange(size)[None, :]
        price = self.floor[0][t, k, :] + self.floor[1][t, k, :] * volume[:, None, None]
        within = self._within(volume, ranks)

        def nodes_of_t(count: np.ndarray) -> np.ndarray:
            """Among `count` nodes of type t (one: `_within`)."""
            value = self.floor[0][t, count, size] + self.floor[1][t, count, size] * volume[:, None]
            return np.where(count == 1, within, value)

        value = nodes_of_t(k) if alone is None else np.full((rows, size), alone)
        same = nodes_of_t(k if joined is None else np.minimum(joined, self.nodes[None, :]))
        cross = np.where(self._diagonal, same[:, :, None], price[:, :, :size])
        for partner in partners:
            present = partner.any(axis=1)[:, None]
            held = np.where(partner[:, None, :], cross, INF).min(axis=2)
            value = np.maximum(value, np.where(present, held, 0.0))
        return np.where(mask, value, INF).min(axis=1)


def _least_work(held: np.ndarray, work: np.ndarray, need: np.ndarray) -> np.ndarray:
    """Per entry of `need`, the least work of a contiguous layer range holding at least
    that many parameters (prefix sums `held` and `work`)."""
    ends = np.searchsorted(held, held[:, None] + need[None, :] * (1 - 1e-12), side="left")
    inside = ends < len(held)
    spans = work[np.minimum(ends, len(held) - 1)] - work[:, None]
    return np.where(inside, spans, INF).min(axis=0)


def _floor(table: CostTable, nodes: Sequence[str], k: int, others: Sequence[str]
           ) -> np.ndarray:
    """(intercept, slope in bytes) no all-reduce among k different nodes of `nodes`
    (and one of `others`, if given) beats. Where the nodes and their links to `others`
    are all alike, that group priced on one rank per node; else the cheapest pair of
    different nodes among them. Cached in the table."""
    if k + (1 if others else 0) < 2:
        return np.zeros(2)
    alike, pairs = _links(table, tuple(nodes), tuple(others))
    key = SyncLineKey(tuple(nodes), k if alike else 2, tuple(others))
    if key not in table.cache:
        table.cache[key] = _affine(table, [[*nodes[:k], *others[:1]]] if alike else pairs)
    return table.cache[key]


def _links(table: CostTable, nodes: tuple[str, ...], others: tuple[str, ...]
           ) -> tuple[bool, list[list[str]]]:
    """Whether all nodes are linked alike (to each other and to `others`), and one pair
    of different nodes per distinct link (between `nodes` and `others` if given)."""
    key = SyncLinksKey(nodes, others)
    if key not in table.cache:
        inner = {table.link(a, b): [a, b] for a in nodes for b in nodes if a != b}
        cross = {table.link(a, b): [a, b] for a in nodes for b in others}
        table.cache[key] = (len(inner) <= 1 and len(cross) <= 1,
                            list((cross if others else inner).values()))
    return table.cache[key]


def _affine(table: CostTable, groups: list[list[str]]) -> np.ndarray:
    """(intercept, slope) below the all-reduce of every group (one rank per node)."""
    lines = np.array([all_reduce_line(table, CommGroup.of(group)) for group in groups])
    return lines.min(axis=0)
