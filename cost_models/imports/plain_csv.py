"""Per-layer profiles as a plain CSV table, for tools with formats of their own.

One row per layer, degree and micro-batch size, with a header row naming the columns:

    layer        the layer's index or name as `planner trace` lists them (0, layers.3,
                 head)
    micro_batch  the micro-batch size measured
    tp           the tensor-parallel degree measured (1 where the column is absent)
    fwd_ms, bwd_ms   forward and backward milliseconds; or fwd_bwd_ms, their sum
                 (split as the layer's FLOPs are)
    memory_mb    optional: MiB one device held for the layer (weights, gradients,
                 optimizer states, the micro-batch's activations)
    tp_comm      optional: true where the times hold the layer's tensor-parallel
                 collectives (false where absent)
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

from cost_models.imports import (
    MIB,
    ImportedProfile,
    LayerMeasurement,
    imported,
    number,
    split_total,
)
from planner.errors import PlannerError, closest
from planner.types import ModelGraph

_FLAGS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False,
          "": False}


def _layer(text: str, graph: ModelGraph, where: str) -> int:
    names = [layer.name for layer in graph.layers]
    if text.strip().isdigit() and int(text) < len(names):
        return int(text)
    if text.strip() in names:
        return names.index(text.strip())
    near = closest(text, names)
    raise PlannerError("bad-profile", f"{where}: layer {text!r} is not one of the model's "
                       f"{len(names)} layers (indices 0 to {len(names) - 1}, or names as "
                       "`planner trace` lists them).",
                       [f"did you mean {', '.join(near)}?" if near else
                        "run `planner trace MODEL` for its layers"])


def _count(row: dict, key: str, where: str, default: int | None = None) -> int:
    text = (row.get(key) or "").strip()
    if not text and default is not None:
        return default
    if not text.isdigit() or int(text) < 1:
        raise PlannerError("bad-profile", f"{where}: column {key!r} must be a positive whole "
                           f"number (got {text!r}).")
    return int(text)


def _value(row: dict, key: str, where: str) -> float:
    try:
        return number(float((row.get(key) or "").strip()), f"{where}: column {key!r}")
    except ValueError:
        raise PlannerError("bad-profile", f"{where}: column {key!r} must be a number (got "
                           f"{row.get(key)!r}).") from None


def _rows(path: Path) -> tuple[list[str], list[dict]]:
    try:
        with path.open(newline="") as handle:
            reader = csv.DictReader(handle)
            return list(reader.fieldnames or []), list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise PlannerError("bad-profile", f"{path}: not a readable CSV file ({exc}).") from None


def read(paths: Sequence[Path], graph: ModelGraph) -> ImportedProfile:
    measurements: list[LayerMeasurement] = []
    for path in paths:
        columns, rows = _rows(path)
        split = "fwd_ms" in columns and "bwd_ms" in columns
        if "layer" not in columns or "micro_batch" not in columns or not (
                split or "fwd_bwd_ms" in columns):
            raise PlannerError("bad-profile", f"{path.name}: its header names the columns "
                               f"{', '.join(columns) or '(none)'}; a per-layer CSV needs "
                               "layer, micro_batch and fwd_ms and bwd_ms (or fwd_bwd_ms).",
                               ["add a header row, e.g. layer,micro_batch,tp,fwd_ms,bwd_ms"])
        if not rows:
            raise PlannerError("bad-profile", f"{path.name} has a header but no rows.")
        for line, row in enumerate(rows, 2):
            where = f"{path.name} line {line}"
            index = _layer(row.get("layer") or "", graph, where)
            if split:
                fwd = _value(row, "fwd_ms", where) / 1e3
                bwd = _value(row, "bwd_ms", where) / 1e3
            else:
                fwd, bwd = split_total(_value(row, "fwd_bwd_ms", where) / 1e3,
                                       graph.layers[index])
            memory = (_value(row, "memory_mb", where) * MIB
                      if (row.get("memory_mb") or "").strip() else None)
            flag = (row.get("tp_comm") or "").strip().lower()
            if flag not in _FLAGS:
                raise PlannerError("bad-profile", f"{where}: column 'tp_comm' must be true or "
                                   f"false (got {flag!r}).")
            measurements.append(LayerMeasurement(
                layer=index, tp=_count(row, "tp", where, 1),
                micro_batch=_count(row, "micro_batch", where), fwd=fwd, bwd=bwd,
                memory=memory, with_tp_comm=_FLAGS[flag]))
    return imported(measurements, graph, None,
                    "CSV profile " + ", ".join(p.name for p in paths))
