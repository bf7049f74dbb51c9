"""Traced models as files: JSON (schema-versioned node-link), GraphML and DOT."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import networkx as nx

from planner.errors import PlannerError
from planner.files import check_writable
from planner.trace.summary import count_blocks, flop_check
from planner.types import SCHEMA_VERSION, ModelGraph

FORMATS = {".json": "json", ".graphml": "graphml", ".dot": "dot", ".gv": "dot"}


def _plain(value: Any) -> Any:
    """Dataclasses, enums and tuples as JSON-ready values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if f.name != "graph"}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "value") and isinstance(value, str):  # str enums
        return value.value
    return value


def summary_dict(model: ModelGraph) -> dict[str, Any]:
    """What `planner trace --json` prints: the model, its layers and totals."""
    check = flop_check(model)
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "model-trace",
        "model": _plain(model.spec),
        "family": model.family,
        "batch": model.batch,
        "seq_len": model.seq_len,
        "dtype": model.dtype,
        "tracer": model.tracer,
        "params": model.params,
        "param_bytes": model.param_bytes,
        "blocks": count_blocks(model),
        "repeated_groups": model.repeated_groups(),
        "per_sample": {
            "fwd_flops": model.fwd_flops,
            "bwd_flops": model.bwd_flops,
            "activation_bytes": sum(layer.activation_bytes for layer in model.layers),
        },
        "flop_check": None if check is None else {
            **_plain(check), "ratio": check.ratio},
        "config": _plain(dict(model.config)),
        "layers": [_plain(layer) for layer in model.layers],
    }


def graph_dict(model: ModelGraph) -> dict[str, Any]:
    """The whole trace: summary plus the op graph as networkx node-link data."""
    return {**summary_dict(model), "kind": "model-graph",
            "graph": nx.node_link_data(model.graph, edges="edges")}


def _flat_graph(graph: nx.DiGraph) -> nx.DiGraph:
    """A copy with only GraphML-friendly attribute values (no lists, no None)."""
    flat = nx.DiGraph()
    for node, data in graph.nodes(data=True):
        flat.add_node(node, **{k: (",".join(map(str, v)) if isinstance(v, list) else
                                   "" if v is None else v) for k, v in data.items()})
    flat.add_edges_from(graph.edges)
    flat.graph.update({k: v for k, v in graph.graph.items()
                       if isinstance(v, (str, int, float, bool))})
    return flat


def _dot(model: ModelGraph) -> str:
    def quote(s: object) -> str:
        escaped = str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{escaped}"'

    lines = [f"digraph {quote(model.spec.describe())} {{", "  rankdir=TB;",
             "  node [shape=box, fontsize=10];"]
    by_layer: dict[int, list[str]] = {}
    for node, data in model.graph.nodes(data=True):
        by_layer.setdefault(data["layer"], []).append(node)
    for index, nodes in sorted(by_layer.items()):
        name = model.layers[index].name if 0 <= index < len(model.layers) else "other"
        lines.append(f"  subgraph {quote(f'cluster_{index}')} {{ label={quote(name)};")
        for node in nodes:
            data = model.graph.nodes[node]
            gflops = (data["fwd_flops"] or 0) / 1e9
            label = f"{node}\n{data['op_class']}" + (f" {gflops:.3g} GF" if gflops else "")
            lines.append(f"    {quote(node)} [label={quote(label)}];")
        lines.append("  }")
    lines += [f"  {quote(a)} -> {quote(b)};" for a, b in model.graph.edges]
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_graph(model: ModelGraph, path: Path, *, force: bool = False) -> str:
    """Write the trace to `path` in the format its suffix names; returns the format."""
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise PlannerError("bad-value", f"Cannot tell the graph format from {str(path)!r}; "
                           f"use a file ending in {', '.join(FORMATS)}.")
    check_writable(path, force=force)
    if fmt == "json":
        path.write_text(json.dumps(graph_dict(model), indent=1) + "\n")
    elif fmt == "graphml":
        nx.write_graphml(_flat_graph(model.graph), path)
    else:
        path.write_text(_dot(model))
    return fmt
