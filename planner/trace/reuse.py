"""Replay each distinct block once; copy its records for identical repeats.

Meta execution dominates tracing time, and an 80-layer model repeats one block
80 times. A block's records depend only on its graph (ops, constants, wiring),
its module (parameter shapes and attributes, via `repr`) and the metadata of
the values flowing in. When all three equal those of a block already replayed,
its records are copied with names, parameters and tensor identities remapped,
and only the values leaving the block are created (empty meta tensors).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx
from torch import nn

from planner.trace.blocks import block_units, unit_of
from planner.trace.ops import tensors


@dataclass(frozen=True)
class Run:
    """The contiguous graph nodes of one block."""

    unit: str
    nodes: tuple[torch.fx.Node, ...]
    externals: tuple[torch.fx.Node, ...]  # nodes outside the run it reads, first-use order
    escaping: frozenset[str]  # names of its nodes read outside the run
    fingerprint: str


@dataclass
class Reference:
    """What a fully replayed run left behind, for copying."""

    unit: str
    records: list  # NodeRecord, one per run node
    external_keys: list[list[int]]
    outputs: dict[str, tuple[Any, list[int]]] = field(default_factory=dict)  # name -> meta, keys


def _relative(path: str, unit: str) -> str:
    return "" if path == unit else path.removeprefix(f"{unit}.")


def find_runs(graph: torch.fx.Graph, modules: dict[str, nn.Module],
              module_of: Callable[[torch.fx.Node], str]) -> dict[str, Run]:
    """Runs keyed by the name of their first node (blocks that run contiguously once)."""
    units = set(block_units(modules))
    segments: list[tuple[str, list[torch.fx.Node]]] = []
    for node in graph.nodes:
        unit = unit_of(module_of(node), units) if node.op not in ("placeholder", "output") \
            else None
        if unit is None:
            segments.append(("", [node]))
        elif segments and segments[-1][0] == unit:
            segments[-1][1].append(node)
        else:
            segments.append((unit, [node]))
    counts: dict[str, int] = {}
    for unit, _ in segments:
        counts[unit] = counts.get(unit, 0) + 1
    runs = {}
    for unit, nodes in segments:
        if unit and counts[unit] == 1:
            run = _make_run(unit, nodes, modules[unit], module_of)
            runs[nodes[0].name] = run
    return runs


def _make_run(unit: str, nodes: list[torch.fx.Node], module: nn.Module,
              module_of: Callable[[torch.fx.Node], str]) -> Run:
    local = {n: i for i, n in enumerate(nodes)}
    externals: list[torch.fx.Node] = []

    def ref(a: torch.fx.Node) -> Any:
        if a in local:
            return ("local", local[a])
        if a not in externals:
            externals.append(a)
        return ("external", externals.index(a))

    parts: list[Any] = [repr(module),
                        [(_relative(n, ""), tuple(p.shape), p.dtype, p.requires_grad)
                         for n, p in module.named_parameters()],
                        [(n, tuple(b.shape), b.dtype) for n, b in module.named_buffers()]]
    for n in nodes:
        target = _relative(n.target, unit) if isinstance(n.target, str) else n.target
        parts.append((n.op, repr(target), _relative(module_of(n), unit),
                      repr(torch.fx.node.map_arg(n.args, ref)),
                      repr(torch.fx.node.map_arg(n.kwargs, ref))))
    escaping = frozenset(n.name for n in nodes if any(u not in local for u in n.users))
    return Run(unit=unit, nodes=tuple(nodes), externals=tuple(externals), escaping=escaping,
               fingerprint=repr(parts))


def value_meta(value: Any, fixed: dict[int, frozenset[str]]) -> Any:
    """Everything about a value a block's replay can depend on."""
    def meta(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return ("tensor", tuple(v.shape), v.stride(), v.dtype, v.requires_grad,
                    fixed.get(id(v)))
        return ("value", repr(v))
    return torch.utils._pytree.tree_map(meta, value)


def fabricate(meta: Any, rename: Callable[[str], str], fixed: dict[int, frozenset[str]],
              keep: list) -> Any:
    """Empty meta tensors with the recorded metadata (fixedness carried over)."""
    def make(m: Any) -> Any:
        if not (isinstance(m, tuple) and m and m[0] == "tensor"):
            return m
        _, shape, stride, dtype, requires_grad, sources = m
        t = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        if requires_grad:
            t.requires_grad_(True)
        fixed.pop(id(t), None)  # made under the replay's dispatch mode, which marks it
        if sources is not None:
            fixed[id(t)] = frozenset(rename(s) for s in sources)
        keep.append(t)
        return t
    return torch.utils._pytree.tree_map(make, meta, is_leaf=lambda m: isinstance(m, tuple)
                                        and bool(m) and m[0] in ("tensor", "value"))


def copy_records(ref: Reference, run: Run, external_values: list[Any],
                 fresh: itertools.count, storage_key: Callable[[torch.Tensor], int],
                 fixed: dict[int, frozenset[str]], keep: list
                 ) -> tuple[list, dict[str, Any]]:
    """Records for `run` copied from `ref`, and the values of its escaping nodes."""
    old_prefix, new_prefix = f"{ref.unit}.", f"{run.unit}."

    def rename(name: str) -> str:
        if name == ref.unit:
            return run.unit
        return new_prefix + name[len(old_prefix):] if name.startswith(old_prefix) else name

    key_map: dict[int, int] = {}
    for old_keys, value in zip(ref.external_keys, external_values, strict=True):
        key_map.update(zip(old_keys, (storage_key(t) for t in tensors(value)), strict=True))
    values: dict[str, Any] = {}
    for node, old in zip(run.nodes, ref.records, strict=True):
        if node.name in run.escaping:
            meta, old_keys = ref.outputs[old.name]
            value = fabricate(meta, rename, fixed, keep)
            values[node.name] = value
            for k, t in zip(old_keys, tensors(value), strict=True):
                key_map.setdefault(k, storage_key(t))

    def key(k: int) -> int:
        if k not in key_map:
            key_map[k] = next(fresh)
        return key_map[k]

    records = []
    for node, old in zip(run.nodes, ref.records, strict=True):
        records.append(replace(
            old, name=node.name,
            target=node.target if isinstance(node.target, str) else old.target,
            module=rename(old.module),
            inputs=[a.name for a in node.all_input_nodes],
            costs=list(old.costs),
            saved={key(k): v for k, v in old.saved.items()},
            in_keys={key(k) for k in old.in_keys},
            out_keys={key(k): v for k, v in old.out_keys.items()},
            params={rename(p) for p in old.params}))
    return records, values
