"""torch.fx symbolic tracing that traces each distinct block once.

An 80-layer model calls one block class 80 times; symbolic tracing of a block's
forward does not depend on the values flowing in (they are proxies), only on
the module. So the first call of each distinct block (same class, `repr`,
parameter shapes and argument structure) is traced, and later calls copy its
nodes with module paths renamed, which is several times faster.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn


@dataclass
class _Template:
    unit: str
    inputs: list[torch.fx.Node]
    nodes: list[torch.fx.Node]
    output: Any  # the block's return value, proxies inside


def _proxies(tree: Any) -> list[torch.fx.Proxy]:
    return [a for a in torch.utils._pytree.tree_leaves(tree) if isinstance(a, torch.fx.Proxy)]


def _module_key(m: nn.Module) -> str:
    shapes = [(n, tuple(p.shape), p.dtype) for n, p in m.named_parameters()]
    return repr((type(m), repr(m), shapes))


class BlockTracer(torch.fx.Tracer):
    """Keeps modules marked `fx_leaf = True` opaque and copies repeated blocks."""

    def __init__(self, units: dict[str, str]) -> None:
        super().__init__()
        self.units = units  # block path -> module key, computed before tracing patches
        # nn.Module.__getattr__ (under tracing, reading a parameter adds a graph node)
        self.templates: dict[str, _Template | None] = {}
        self._recording: list[list[torch.fx.Node]] = []

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return getattr(m, "fx_leaf", False) or super().is_leaf_module(m, qualname)

    def create_node(self, kind: str, target: Any, args: tuple, kwargs: dict,
                    name: str | None = None, type_expr: Any = None) -> torch.fx.Node:
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        for recording in self._recording:
            recording.append(node)
        return node

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple,
                    kwargs: dict) -> Any:
        path = self.path_of_module(m)
        if path not in self.units or self.is_leaf_module(m, path):
            return super().call_module(m, forward, args, kwargs)
        shape = torch.fx.node.map_aggregate(
            (args, kwargs), lambda a: "proxy" if isinstance(a, torch.fx.Proxy) else a)
        key = self.units[path] + repr(shape)
        template = self.templates.get(key)
        if template is not None:
            return self._copy(template, path, _proxies((args, kwargs)))
        recording: list[torch.fx.Node] = []
        self._recording.append(recording)
        try:
            out = super().call_module(m, forward, args, kwargs)
        finally:
            self._recording.remove(recording)
        inputs = [p.node for p in _proxies((args, kwargs))]
        known = set(recording) | set(inputs)
        closed = all(set(n.all_input_nodes) <= known for n in recording)
        if key not in self.templates:
            self.templates[key] = _Template(path, inputs, recording, out) if closed else None
        return out

    def _copy(self, template: _Template, path: str, proxies: list[torch.fx.Proxy]) -> Any:
        old = template.unit

        def rename(s: str) -> str:
            if s == old:
                return path
            return f"{path}.{s[len(old) + 1:]}" if s.startswith(f"{old}.") else s

        old_name, new_name = old.replace(".", "_"), path.replace(".", "_")
        mapping = {a: p.node for a, p in zip(template.inputs, proxies, strict=True)}
        for node in template.nodes:
            target = node.target
            if isinstance(target, str) and node.op in ("call_module", "get_attr"):
                target = rename(target)
            name = node.name
            if name.startswith(old_name):
                name = new_name + name[len(old_name):]
            new = self.graph.create_node(
                node.op, target, torch.fx.node.map_arg(node.args, lambda n: mapping[n]),
                torch.fx.node.map_arg(node.kwargs, lambda n: mapping[n]), name, node.type)
            new.meta = dict(node.meta)
            stack = node.meta.get("nn_module_stack")
            if stack is not None:
                new.meta["nn_module_stack"] = type(stack)(
                    (rename(k), (rename(v[0]), *v[1:]) if isinstance(v, tuple) else v)
                    for k, v in stack.items())
            mapping[node] = new
        for recording in self._recording:
            recording.extend(mapping[n] for n in template.nodes)
        return torch.utils._pytree.tree_map(
            lambda a: torch.fx.Proxy(mapping[a.node], self) if isinstance(a, torch.fx.Proxy)
            else a, template.output)


def fx_graph(module: nn.Module, units: set[str]) -> tuple[nn.Module, torch.fx.Graph]:
    """The module's fx graph; on failure the exception notes the module being traced."""
    modules = dict(module.named_modules())
    tracer = BlockTracer({path: _module_key(modules[path]) for path in units})
    try:
        graph = tracer.trace(module)
    except Exception as exc:
        where = next(reversed(tracer.module_stack), "") if tracer.module_stack else ""
        exc.add_note(f"planner: in module {where or '<root>'!r}")
        raise
    return tracer.root, graph
