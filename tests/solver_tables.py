"""Random cost tables for the solver tests, and brute force over the same search space."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import numpy as np

from cost_models.comm import Collective, CommGroup
from planner.solver.evaluate import (
    Config,
    Space,
    class_links,
    group,
    placement_sharing,
    swept,
    sync_and_optimizer,
    zero_gathers,
    zero_space,
)
from planner.solver.families import stage_counts
from planner.solver.interleave import fold
from planner.solver.limits import Limits
from planner.solver.partition import class_costs
from planner.solver.search import configs, degrees
from planner.solver.step import overlappable, step_time
from planner.solver.structure import ClassShape, blocks, capacity, devices_of, place
from planner.solver.table import POLICIES, CostTable, LayerCosts, TypeInfo
from planner.types import LinkSpec
from planner.types.training import Recompute

GIB = 2.0**30


def random_table(seed: int, *, layers: int, types: list[tuple[str, list[int]]],
                 tps: tuple[int, ...] = (1,), micro_batches: tuple[int, ...] = (1,),
                 memory: float = 8 * GIB, link_speed: float = 1.0) -> CostTable:
    """types: (name, devices per node) for each type; costs random but reproducible."""
    rng = np.random.default_rng(seed)
    infos = []
    for i, (name, devices) in enumerate(types):
        nodes = tuple(f"{name}-{k}" for k in range(len(devices)))
        infos.append(TypeInfo(name=name, nodes=nodes, node_devices=tuple(devices),
                              memory=memory * (1 + i) / len(types), peak_flops=1e12 * (1 + i),
                              reserve=0.1 * GIB))
    # each type its own speed, and per layer its own ratio to the others (a memory-bound
    # layer gains less from a faster device than a compute-bound one)
    speed = {t.name: (0.5 + rng.random()) * rng.uniform(0.8, 1.2, layers) for t in infos}
    base_f = rng.uniform(0.5, 1.5, layers)
    base_b = base_f * rng.uniform(1.5, 2.5, layers)
    rec = {Recompute.NONE: np.zeros(layers), Recompute.SELECTIVE: 0.2 * base_f,
           Recompute.FULL: base_f}

    def layer_costs(kind: str, tp: int, mb: int) -> LayerCosts:
        scale = speed[kind] * mb ** 0.9 / tp ** 0.8
        tp_comm = np.full(layers, 0.05 * (tp - 1) * mb)
        return LayerCosts(fwd=base_f * scale + tp_comm, bwd=base_b * scale + tp_comm,
                          tp_fwd=tp_comm, tp_bwd=tp_comm,
                          recompute={p: rec[p] * scale for p in POLICIES})

    params = rng.uniform(0.2, 1.0, layers) * 1e8
    acts = {p: rng.uniform(0.1, 0.5, layers) * GIB * f
            for p, f in ((Recompute.NONE, 1.0), (Recompute.SELECTIVE, 0.6),
                         (Recompute.FULL, 0.1))}
    def link(a: str, b: str) -> LinkSpec:
        if a == b:
            return LinkSpec(name="intra", bandwidth=50e9, latency=1e-6)
        pair = random.Random(f"{seed}:{min(a, b)}:{max(a, b)}")  # any pair, reproducibly
        return LinkSpec(name="net", bandwidth=link_speed * (0.5 + pair.random()) * 1e9,
                        latency=1e-4)

    def collective(kind: Collective, nbytes: float, group: CommGroup) -> float:
        n = group.size
        if n <= 1:
            return 0.0
        names = [name for name, _ in group.members]
        slow = min((link(a, b) for a in names for b in names), key=lambda x: x.bandwidth)
        factor = 2.0 if kind is Collective.ALL_REDUCE else 1.0
        return factor * (n - 1) / n * nbytes / slow.bandwidth + (n - 1) * slow.latency

    return CostTable(
        num_layers=layers, types=tuple(infos), tps=tps, micro_batches=micro_batches,
        layer_costs=layer_costs, params=params,
        activations=lambda p, tp: acts[p] / tp,
        boundary=rng.uniform(0.01, 0.1, layers) * GIB, weight_bytes=2.0, grad_bytes=2.0,
        state_bytes=12.0, link=link, collective=collective,
        optimizer_time=lambda kind, p: p * 1e-9 * float(speed[kind].mean()),
        layer_flops=base_f * 1e12)


def with_extra_node(table: CostTable, kind: str, devices: int) -> CostTable:
    """The table with one more node of type `kind` (named to sort last)."""
    types = tuple(replace(t, nodes=(*t.nodes, f"{t.name}-zz"),
                          node_devices=(*t.node_devices, devices)) if t.name == kind else t
                  for t in table.types)
    return replace(table, types=types, cache={})


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


def brute_force(table: CostTable, batch: int, limits: Limits, space: Space) -> float:
    """The best step time over every structure, split and micro-batch share."""
    return min((value for _, _, value in every_structure(table, batch, limits, space)),
               default=float("inf"))


def every_structure(table: CostTable, batch: int, limits: Limits, space: Space):
    """(config, class shapes, best step time over their splits and shares) for every
    structure of the search space."""
    for config, shapes in structures(table, batch, limits):
        yield config, shapes, _structure(table, config, space, shapes, batch // config.mb)


def structures(table: CostTable, batch: int, limits: Limits):
    """(config, class shapes) of every structure of the search space: up to
    `Limits.mixed_classes` mixed classes over disjoint sets of types (any types with
    `Limits.mixed_share_types`), placed in the order
    of their patterns (types, then degrees), then one homogeneous class per type at
    most."""
    names = [t.name for t in table.types]
    devices = {t.name: sum(t.node_devices) for t in table.types}
    for config in configs(table, batch, limits):
        lengths = stage_counts(limits, config, fold(table, config.interleave).num_layers)
        choices = degrees(table, limits) if config.tp is None else [config.tp]
        # every class at each degree; with a degree per class, not interleaved, a
        # mixed class's blocks at any two
        per_block = config.tp is None and config.interleave == 1
        mixed = []
        if limits.mixed and len(names) > 1:  # chains of 2 or more types, in every order
            for kinds in range(2, len(names) + 1):
                for order in itertools.permutations(names, kinds):
                    for total in lengths:
                        mixed += [(p, d) for counts in _compositions(total, kinds)
                                  for p in [sum(((k,) * c for k, c in zip(
                                      order, counts, strict=True)), ())]
                                  for d in _block_degrees(p, choices, per_block)]
        mixed = sorted(pattern for pattern in mixed if limits.allows(pattern[0]))
        together = [c for k in range(limits.mixed_classes + 1)
                    for c in itertools.combinations(mixed, k)
                    if limits.mixed_share_types or _apart(c)]
        homogeneous = [[None] + [((k,) * s, (tp,) * s) for s in lengths for tp in choices
                                 if limits.allows((k,) * s)] for k in names]
        for chosen, *alone in itertools.product(together, *homogeneous):
            patterns = [*chosen, *(p for p in alone if p is not None)]
            if not patterns:
                continue
            maxima = [min(capacity(table, tp, k, c) for k, c, tp in blocks(p, d))
                      for p, d in patterns]
            for counts in itertools.product(*(range(1, m + 1) for m in maxima)):
                if limits.dp is not None and sum(counts) != limits.dp:
                    continue
                if limits.max_dp is not None and sum(counts) > limits.max_dp:
                    continue
                if sum(counts) > batch // config.mb or any(  # (no plan: skipped early)
                        sum(n * devices_of(p, d, k) for (p, d), n in zip(
                            patterns, counts, strict=True)) > devices[k] for k in names):
                    continue
                yield config, tuple(ClassShape(types=p, n=n, tps=d) for (p, d), n in zip(
                    patterns, counts, strict=True))


def _apart(patterns: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...]) -> bool:
    """Whether these mixed classes' patterns use disjoint sets of device types."""
    kinds = [k for types, _ in patterns for k in set(types)]
    return len(kinds) == len(set(kinds))


def _block_degrees(pattern: tuple[str, ...], choices: list[int], per_block: bool
                   ) -> list[tuple[int, ...]]:
    """The stage degrees a class of this pattern may have: one of `choices` for all,
    or `per_block` (a class of one or two blocks), one per block."""
    if not per_block or len(set(pattern)) > 2:
        return [(tp,) * len(pattern) for tp in choices]
    counts = [c for _, c, _ in blocks(pattern, (1,) * len(pattern))]
    return [tuple(tp for c, tp in zip(counts, chosen, strict=True) for _ in range(c))
            for chosen in itertools.product(choices, repeat=len(counts))]


def _structure(table: CostTable, config: Config, space: Space,
               shapes: tuple[ClassShape, ...], microbatches: int) -> float:
    table = fold(table, config.interleave)  # v chunks per device: the same cuts each round
    placement = place(table, shapes)
    pipelines = sum(s.n for s in shapes)
    space = zero_space(space, shapes, config, microbatches)  # the runtime's ZeRO: one class
    if placement is None or pipelines > microbatches or space is None:
        return float("inf")
    options = []
    interleaved = config.interleave > 1  # (the last stage sends back to the first)
    flows = placement_sharing(placement, interleaved)  # sends share the nodes' cards
    for shape, slots in zip(shapes, placement, strict=True):
        costs = class_costs(table, shape.types, tps=shape.tps, mb=config.mb, n=shape.n,
                            links=class_links(table, slots, flows, interleaved),
                            gathers=zero_gathers(table, slots), schedule=config.schedule,
                            policies=space.policies, zeros=space.zeros,
                            interleave=config.interleave,
                            microbatches=-(-microbatches // shape.n) if config.gpipe else None)
        splits = []
        for cuts in itertools.combinations(range(1, table.num_layers), shape.stages - 1):
            split = costs.split_at((0, *cuts, table.num_layers))
            if split is not None:
                splits.append(split)
        if not splits:
            return float("inf")
        # the search space's splits: those no other split beats in the largest stage time,
        # the sum of w and, where the pipelines run few micro-batches, the most parameters
        # a stage holds at once (`evaluate._useful_steps`); GPipe's, those none beats in
        # its period and fill (`partition.gpipe_front`) or in its h and w (its first step)
        params = [table.range_params(tp) for tp in shape.tps]
        capped = swept(config, shapes, len(options), microbatches)
        if config.gpipe:
            options.append(_unbeaten(splits, [(x.bottleneck, x.total) for x in splits])
                           + _unbeaten(splits, [(max(costs.h_w(s)[0][a, b] for s, (a, b) in
                                                     enumerate(itertools.pairwise(x.bounds))),
                                                 x.weights) for x in splits]))
            continue
        options.append(_unbeaten(splits, [
            (x.largest_h, x.weights, max(held[a, b] for held, (a, b) in zip(
                params, itertools.pairwise(x.bounds), strict=True)) if capped else 0.0)
            for x in splits]))
    best = float("inf")
    for combo in itertools.product(*options):
        terms = sync_and_optimizer(table, config, shapes, placement, combo)
        pipes = [split for shape, split in zip(shapes, combo, strict=True)
                 for _ in range(shape.n)]
        groups = [group(config, shape) for shape in shapes for _ in range(shape.n)]
        for counts in _compositions(microbatches, len(pipes)):
            if any(m % g for m, g in zip(counts, groups, strict=True)):
                continue  # interleaved pipelines run multiples of their stage count
            times = [split.time(m) for split, m in zip(pipes, counts, strict=True)]
            hidden = overlappable(stage.bwd for split in combo for stage in split.stages)
            best = min(best, step_time(times, terms.sync, terms.optimizer, hidden, table.sync,
                                       tail=terms.tail).total)
    return best


def _unbeaten(splits: list, keys: list[tuple]) -> list:
    """The splits whose keys no other split's are all at most, one below."""
    return [x for x, kx in zip(splits, keys, strict=True) if not any(
        all(a <= b for a, b in zip(ky, kx, strict=True)) and ky != kx for ky in keys)]


def random_instance(rng: random.Random) -> tuple[CostTable, int, Limits]:
    kinds = rng.randint(1, 3)
    types = [(f"t{i}", [rng.randint(1, 3) for _ in range(rng.randint(1, 2))])
             for i in range(kinds)]
    layers = rng.randint(2, 5)
    table = random_table(rng.randrange(10**6), layers=layers, types=types,
                         tps=(1, 2) if rng.random() < 0.3 else (1,),
                         micro_batches=(1, 2) if rng.random() < 0.5 else (1,),
                         memory=rng.choice([2, 4, 8]) * GIB,
                         link_speed=rng.choice([0.1, 1.0, 10.0]))
    batch = rng.choice([2, 4, 6])
    if layers > 2 and rng.random() < 0.3:  # the last layer reads some of the first's weights
        table = replace(table, tied=((layers - 1, 0, float(table.params[0]) / 2),), cache={})
    chunks = (1, 2) if rng.random() < 0.3 else (1,)
    return table, batch, Limits(max_stages=3, interleaves=chunks,
                                tp_per_class=rng.random() < 0.5)
