"""Plan structures and their placement on nodes.

A structure is a set of pipeline classes. A class is `n` identical pipelines,
each a sequence of stage device types in which stages of one type are
consecutive (a "block"), each block with its tensor-parallel degree. Each stage
runs on a slot: tp consecutive devices of one node.

Placement packs classes in order onto nodes taken in canonical order (by type, then
the nodes whose data loaders are faster first, then node name: `table.device_types`),
first fit: a block that fits in one node's free devices stays
inside one node (its boundaries use the intra-node link), a longer block takes
whole free nodes. Placement is deterministic, so every plan's links and
collectives follow from its structure alone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from planner.solver.keys import BlocksKey
from planner.solver.table import CostTable


def per_stage(types: tuple[str, ...], tps: tuple[int, ...] | int) -> tuple[int, ...]:
    """Each stage's tensor-parallel degree (an int: every stage's), checked: as many
    as stages, and the stages of a type at one (a class holds one block per type)."""
    if isinstance(tps, int):
        return (tps,) * len(types)
    if len(tps) == len(types) and (len(set(tps)) == 1 or len(set(zip(
            types, tps, strict=True))) == len(set(types))):
        return tuple(tps)
    raise ValueError(f"stages {types} need one tensor-parallel degree per type, got {tps}")


def devices_of(types: tuple[str, ...], tps: tuple[int, ...], kind: str) -> int:
    """Devices of type `kind` one pipeline of these stages takes (its stages of that
    type share one degree: `per_stage`)."""
    count = types.count(kind)
    return count * tps[types.index(kind)] if count else 0


def wider_than_neighbours(tps: Sequence[int]) -> list[tuple[bool, bool]]:
    """Per stage, whether it is wider than the stage before it and than the one after:
    its first rank then broadcasts each forward's input, or each backward's output
    gradient, to its other ranks (`runtime/follow.py`)."""
    return [(s > 0 and tps[s - 1] < tp, s + 1 < len(tps) and tps[s + 1] < tp)
            for s, tp in enumerate(tps)]


def blocks(types: tuple[str, ...], tps: tuple[int, ...]) -> list[tuple[str, int, int]]:
    """(type, stage count, tensor-parallel degree) of each run of same-type stages."""
    out: list[tuple[str, int, int]] = []
    for t, tp in zip(types, tps, strict=True):
        if out and out[-1][0] == t:
            out[-1] = (t, out[-1][1] + 1, tp)
        else:
            out.append((t, 1, tp))
    return out


@dataclass(frozen=True)
class ClassShape:
    """n pipelines of these stage types, each stage at its tensor-parallel degree
    (`tps`, one per type; an int: every stage's)."""

    types: tuple[str, ...]  # device type of each stage
    n: int
    tps: tuple[int, ...] | int = 1  # normalised to one per stage

    def __post_init__(self) -> None:
        object.__setattr__(self, "tps", per_stage(self.types, self.tps))

    @property
    def stages(self) -> int:
        return len(self.types)

    def blocks(self) -> list[tuple[str, int, int]]:
        """(type, stage count, tensor-parallel degree) of each run of same-type stages."""
        return blocks(self.types, self.tps)

    def devices_of(self, kind: str) -> int:
        """Devices of type `kind` one pipeline takes."""
        return devices_of(self.types, self.tps, kind)


@dataclass(frozen=True)
class Slot:
    node: str
    first: int  # the slot's devices on the node: [first, first + tp)
    tp: int = 1


Placement = tuple[tuple[tuple[Slot, ...], ...], ...]  # class -> pipeline -> stage


def _free_devices(table: CostTable) -> dict[str, list[list]]:
    """Per type: [node, next free device, devices] for each node (used front first)."""
    return {t.name: [[node, 0, devices]
                     for node, devices in zip(t.nodes, t.node_devices, strict=True)]
            for t in table.types}


def place(table: CostTable, shapes: tuple[ClassShape, ...]) -> Placement | None:
    """Slots for every stage of every pipeline, or None if the structure does not fit."""
    placed = _place(table, shapes)
    return placed and placed[0]


class Free:
    """What `place` leaves free on each type's nodes once it has put some classes:
    how many nodes have each number of free devices, and the sizes of the empty ones
    in order (what `room` counts on)."""

    def __init__(self, nodes: dict[str, list[list]]) -> None:
        self.spans = {k: Counter(total - start for _, start, total in v)
                      for k, v in nodes.items()}
        self.empty = {k: [total for _, start, total in v if start == 0]
                      for k, v in nodes.items()}
        # per type, the one size its empty nodes share (None: sizes differ, or none is)
        self.alike = {k: sizes[0] if sizes and min(sizes) == max(sizes) else None
                      for k, sizes in self.empty.items()}


def free_after(table: CostTable, shapes: tuple[ClassShape, ...]) -> Free | None:
    """The devices `place` leaves free after these classes (None if they do not fit)."""
    placed = _place(table, shapes, slots=False)
    return placed and Free(placed[1])


def room(free: Free, shape: ClassShape) -> int:
    """How many pipelines of `shape`, at most its n, `place` puts on the devices left
    `free` by the classes placed before it (those placed after it hold none of its
    types' devices): as many as each of its blocks (one per type) fits. A block takes
    the first node with room for it while any has, then whole empty nodes in order,
    each too small alone, as many as it needs (`_take`)."""
    fits = shape.n
    for kind, count, tp in shape.blocks():
        inside = sum(nodes * ((span // tp) // count)
                     for span, nodes in free.spans[kind].items())
        whole, gathered, size = 0, 0, free.alike[kind]
        if size is not None:  # (nodes alike: whole multiples)
            if tp <= size < count * tp:
                whole = len(free.empty[kind]) // -(-count // (size // tp))
        else:
            short = [total // tp for total in free.empty[kind] if tp <= total < count * tp]
            for slots in short:
                gathered += slots
                if gathered >= count:
                    whole, gathered = whole + 1, 0
        fits = min(fits, inside + whole)
    return fits


def _place(table: CostTable, shapes: tuple[ClassShape, ...], slots: bool = True
           ) -> tuple[Placement, dict[str, list[list]]] | None:
    """The placement (empty unless `slots`) and the devices it leaves free (None if
    the classes do not fit)."""
    free, skip = _free_devices(table), {}  # (skip: see `_take`)
    out = []
    for shape in shapes:
        if not slots:  # (a class's blocks are of different types: placed apart)
            if not all(_take_many(free[kind], count, tp, skip, kind, shape.n)
                       for kind, count, tp in shape.blocks()):
                return None
            continue
        pipelines = []
        for _ in range(shape.n):
            stages: list[Slot] = []
            for kind, count, tp in shape.blocks():
                taken = _take(free[kind], count, tp, skip, kind)
                if taken is None:
                    return None
                stages.extend(taken)
            pipelines.append(tuple(stages))
        out.append(tuple(pipelines))
    return tuple(out), free


def _take(nodes: list[list], count: int, tp: int, skip: dict[tuple, int], kind: str
          ) -> list[Slot] | None:
    """Slots for a block of `count` stages on these nodes (taken from them). Nodes only
    fill up, so `skip` remembers, per block size, how many nodes at the front are
    too full for it, and how many are no longer empty: placing many blocks stays
    linear in the nodes."""
    fits = (kind, count, tp)
    for at in range(skip.get(fits, 0), len(nodes)):  # first fit inside one node
        node, start, total = entry = nodes[at]
        if (total - start) // tp >= count:
            entry[1] = start + count * tp
            skip[fits] = at
            return [Slot(node, start + i * tp, tp) for i in range(count)]
    skip[fits] = len(nodes)
    whole = _whole_nodes(nodes, count, tp, skip, kind)
    if whole is None:
        return None
    out: list[Slot] = []
    for entry in whole:
        out.extend(Slot(entry[0], i * tp, tp) for i in range(entry[2] // tp))
    return out[:count]


def _take_many(nodes: list[list], count: int, tp: int, skip: dict[tuple, int], kind: str,
               n: int) -> bool:
    """`_take` n times over, without the slots: whether all n blocks fit."""
    fits = (kind, count, tp)
    at = skip.get(fits, 0)
    while n and at < len(nodes):  # first fit inside one node, as many as it holds
        entry = nodes[at]
        k = min(n, (entry[2] - entry[1]) // tp // count)
        entry[1] += k * count * tp
        n -= k
        if n:
            at += 1
    skip[fits] = at
    return all(_whole_nodes(nodes, count, tp, skip, kind) is not None for _ in range(n))


def _whole_nodes(nodes: list[list], count: int, tp: int, skip: dict[tuple, int], kind: str
                 ) -> list[list] | None:
    """The whole empty nodes, in order, that a block too long for any node's free
    devices takes (marked full), or None if they are too few."""
    empty = (kind, "empty")
    first = next((at for at in range(skip.get(empty, 0), len(nodes)) if nodes[at][1] == 0),
                 len(nodes))
    skip[empty] = first
    whole, short = [], count
    for entry in nodes[first:]:
        if short <= 0:
            break
        if entry[1] == 0 and entry[2] >= tp:
            whole.append(entry)
            short -= entry[2] // tp
    if short > 0:
        return None
    for entry in whole:
        entry[1] = entry[2]
    return whole


def node_labels(table: CostTable, types: tuple[str, ...], tps: tuple[int, ...]
                ) -> list[str]:
    """A label per stage of one pipeline of these stage types: stages with different
    labels are on different nodes wherever `place` puts the pipeline, and stages with
    one label on one node where the type's nodes all hold the same number of slots
    (a block that fits in a node stays in one, a longer one fills whole nodes in
    order); where they do not, a block's stages share a label."""
    out = []
    for b, (kind, count, tp) in enumerate(blocks(types, tps)):
        slots = {d // tp for d in table.type(kind).node_devices} - {0}
        per_node = next(iter(slots)) if len(slots) == 1 else count
        out.extend(f"{b}.{i // per_node if count > per_node else 0}" for i in range(count))
    return out


def capacity(table: CostTable, tp: int, kind: str, count: int) -> int:
    """How many blocks of `count` stages of type `kind` fit on an empty cluster."""
    key = BlocksKey(tp, kind, count)
    if key not in table.cache:
        free, skip = _free_devices(table)[kind], {}
        n = 0
        while _take(free, count, tp, skip, kind) is not None:
            n += 1
        table.cache[key] = n
    return table.cache[key]
