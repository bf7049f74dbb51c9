"""Trace a model on the meta device into an op graph and the layers pipelines split on.

    graph = trace_model(model_spec("llama3-8b"), seq_len=4096)
    graph.layers[1].fwd_flops   # per sample

No weights are allocated, so a 405B model traces in seconds on a laptop.
`planner.trace.cache` keeps traces on disk; torch and networkx are imported where a
model is traced, so reading a cached trace (which imports this package) needs neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.collector import paused
from planner.dtypes import canonical_dtype, torch_dtype
from planner.errors import PlannerError
from planner.models import LoadedModel, load_model
from planner.types import ModelGraph, ModelSpec

if TYPE_CHECKING:
    import networkx as nx
    import torch

    from planner.trace.capture import Capture

__all__ = ["trace_loaded", "trace_model", "trace_module"]


def _cast(tree: object, dtype: torch.dtype) -> object:
    import torch

    return torch.utils._pytree.tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
        tree)


def _op_graph(capture: Capture, node_layer: dict[str, int]) -> nx.DiGraph:
    import networkx as nx

    graph = nx.DiGraph()
    special = {"placeholder": "input", "get_attr": "parameter", "output": "output"}
    for r in capture.records:
        op_class = special.get(r.op) or (
            "constant" if r.fixed and not r.costs else r.op_class.value)
        graph.add_node(
            r.name, op=r.op, target=r.target, module=r.module, module_type=r.module_type,
            layer=node_layer.get(r.name, -1), op_class=op_class,
            fwd_flops=sum(c.flops for c in r.costs),
            bwd_flops=sum(c.bwd_flops for c in r.costs),
            bytes=sum(c.bytes + c.bytes_fixed for c in r.costs),
            param_bytes=sum(capture.params[p][1] for p in r.params if p in capture.params),
            output_bytes=sum(r.out_keys.values()),
            saved_bytes=sum(r.saved.values()) + r.stats_saved,
            params=sorted(p for p in r.params if p in capture.params),
            shape=list(r.shape) if r.shape is not None else None, dtype=r.dtype)
        for source in r.inputs:
            graph.add_edge(source, r.name)
    graph.graph["parameters"] = {name: numel for name, (numel, _) in capture.params.items()}
    return graph


def trace_loaded(loaded: LoadedModel, *, batch: int = 1, dtype: str = "bf16",
                 reuse: bool = True) -> ModelGraph:
    """Trace an already built (meta) model. `reuse=False` replays every block
    instead of copying identical ones (same result, slower; for checking)."""
    if batch <= 0:
        raise PlannerError("bad-value", f"--batch must be positive (got {batch}).")
    with paused():  # (it leaves a few thousand objects in cycles, at most)
        return _trace(loaded, batch, dtype, reuse)


def _trace(loaded: LoadedModel, batch: int, dtype: str, reuse: bool) -> ModelGraph:
    from planner.trace.capture import acquire_graph, replay
    from planner.trace.layers import build_layers

    dtype = canonical_dtype(dtype)
    module = loaded.module.to(torch_dtype(dtype)).train()
    args, kwargs, targets = loaded.example(batch, "meta")
    args, kwargs = _cast(args, torch_dtype(dtype)), _cast(kwargs, torch_dtype(dtype))
    traced = acquire_graph(module, args, kwargs, loaded.spec.describe())
    loss = None
    if loaded.loss is not None and targets is not None:
        def loss(out: object) -> torch.Tensor:
            return loaded.loss(out, targets)
    capture = replay(module, traced, args, kwargs, loss, batch, reuse=reuse)
    layers, node_layer = build_layers(capture)
    graph = _op_graph(capture, node_layer)
    graph.graph.update(model=loaded.spec.describe(), batch=batch, seq_len=loaded.seq_len or 0,
                       dtype=dtype, tracer=traced.tracer)
    return ModelGraph(spec=loaded.spec, family=loaded.family, batch=batch,
                      seq_len=loaded.seq_len, dtype=dtype, tracer=traced.tracer, layers=layers,
                      graph=graph, config=loaded.config)


def trace_module(module: torch.nn.Module, inputs: tuple, *, targets: object = None,
                 loss: object = None, dtype: str = "fp32", name: str = "module",
                 reuse: bool = True) -> ModelGraph:
    """Trace any module with example inputs (moved to meta; the batch is the first
    input's leading dimension). `loss(output, targets)` is traced too if given."""
    import torch

    def meta(tree: object) -> object:
        return torch.utils._pytree.tree_map(
            lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, tree)

    inputs, targets = meta(tuple(inputs)), meta(targets)
    first = next(t for t in torch.utils._pytree.tree_leaves(inputs)
                 if isinstance(t, torch.Tensor))
    loaded = LoadedModel(spec=ModelSpec(source="module", name=name), family="custom",
                         module=module.to("meta"), config={}, seq_len=None,
                         example=lambda b, d: (inputs, {}, targets), loss=loss)
    return trace_loaded(loaded, batch=first.shape[0], dtype=dtype, reuse=reuse)


def trace_model(spec: ModelSpec, *, batch: int = 1, seq_len: int | None = None,
                dtype: str = "bf16") -> ModelGraph:
    """Build the model on meta and trace one training step's forward (and loss)."""
    with paused():  # (building the model too)
        return trace_loaded(load_model(spec, seq_len=seq_len), batch=batch, dtype=dtype)
