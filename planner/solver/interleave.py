"""Interleaved 1F1B in the search: a pipeline's layers cut into the same split v times.

With v model chunks per device (Megatron's interleaved 1F1B), the L layers run as v
rounds of q = L / v layers; round r's layers [r q, (r + 1) q) are split over the S
stages, and stage s holds chunk [r q + b_s, r q + b_s+1) of every round. The search
uses the same cut points b_s in every round, so a split of the *folded* table (q
layers, layer j standing for layers j, q + j, ..., (v - 1) q + j) is such a plan:
its per-layer times, parameters and activations are sums over the rounds, a stage's
range [b_s, b_s+1) of the folded table holds exactly what the device holds, and its
send the largest of its v chunks' outputs. The last stage's send is the wrap-around
back to the first stage, of every round's output but the final round's (the folded
table's last boundary). The rest of the solver prices the folded table with
interleaved 1F1B's closed form (`timing.py`); `chunks` maps a split back.
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np

from planner.solver.keys import FoldedKey
from planner.solver.table import CostTable, LayerCosts


def fold(table: CostTable, v: int) -> CostTable:
    """The table of v chunks per device (cached; a table already folded for v is
    returned as it is, so functions given a configuration may fold what they get)."""
    if v == table.interleave:
        return table
    if table.interleave != 1:
        raise ValueError(f"a table folded for {table.interleave} chunks cannot be folded "
                         f"for {v}")
    if table.num_layers % v:
        raise ValueError(f"{table.num_layers} layers do not split into {v} equal rounds")
    key = FoldedKey(v)
    if key not in table.cache:
        q = table.num_layers // v

        def add(values: np.ndarray) -> np.ndarray:
            return np.asarray(values, dtype=float).reshape(v, q).sum(axis=0)

        # the table's cache holds the folded table: a reference back would be a cycle,
        # which keeps both, and every array they cache, until a full garbage collection
        parent, raw, acts = weakref.ref(table), table.layer_costs, table.activations
        rounds = np.asarray(table.boundary, dtype=float).reshape(v, q)
        boundary = rounds.max(axis=0)
        boundary[-1] = rounds[:-1, -1].max()  # (the model's output goes nowhere)

        def layer_costs(kind: str, tp: int, mb: int) -> LayerCosts:
            owner = parent()
            c = raw(kind, tp, mb) if owner is None else owner.costs(kind, tp, mb)
            return LayerCosts(fwd=add(c.fwd), bwd=add(c.bwd), tp_fwd=add(c.tp_fwd),
                              tp_bwd=add(c.tp_bwd),
                              recompute={p: add(r) for p, r in c.recompute.items()})

        table.cache[key] = dataclasses.replace(
            table, num_layers=q, layer_costs=layer_costs, params=add(table.params),
            activations=lambda policy, tp: add(acts(policy, tp)),
            boundary=boundary,
            layer_flops=add(table.layer_flops),
            tied=tuple((reader % q, owner % q, params) for reader, owner, params in table.tied),
            unsharded=None if table.unsharded is None else add(table.unsharded), interleave=v,
            cache={})
    return table.cache[key]


def chunks(bounds: tuple[int, int], num_layers: int, v: int) -> tuple[tuple[int, int], ...]:
    """The layer ranges of the v chunks a folded stage range [a, b) stands for."""
    q = num_layers // v
    return tuple((r * q + bounds[0], r * q + bounds[1]) for r in range(v))


def choices(num_layers: int, allowed: tuple[int, ...]) -> tuple[int, ...]:
    """The chunk counts of `allowed` that split the layers into equal rounds, of at
    least two layers where there are several (a chunk on each of two stages or more)."""
    return tuple(v for v in allowed if v == 1 or (v > 1 and num_layers % v == 0
                                                  and num_layers >= 2 * v))
