"""Metis's and Sailor's per-layer profiles (Um et al., USENIX ATC 2024; Sailor's Metis
baseline reads the same files).

One JSON file per device type, tensor-parallel degree and micro-batch size, the three
in its name (`DeviceType.A100_tp2_bs4.json`; Sailor's copies write `tmp2` and `mbs4`).
Each holds the profile of a Megatron-LM training step of the whole model on one device
of a tp group:

    {"model": {"model_name": ..., "num_layers": N,
               "parameters": {"total_parameters_bytes": ...,
                              "parameters_per_layer_bytes": [N numbers]}},
     "execution_time": {"layer_compute_total_ms": [N numbers],   # forward + backward
                        "optimizer_time_ms": ..., "forward_backward_time_ms": ..., ...},
     "execution_memory": {"layer_memory_total_mb": [N numbers],  # MiB
                          "total_memory_mb": ...}}

Its N layers are the embedding, the blocks and the head (the final norm, the LM head
and the loss), this planner's layers of a GPT, so they map one to one. Read here:
each layer's time (split into forward and backward by its FLOPs), its memory, and the
optimizer step of the file at the smallest degree (the longest step, the least
noise), on the model's parameters over that degree (Megatron-LM splits every weight
matrix, the vocabulary's too).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from cost_models.imports import (
    MIB,
    ImportedProfile,
    LayerMeasurement,
    entries_of,
    imported,
    number,
    numbers,
    split_total,
)
from planner.errors import PlannerError
from planner.types import ModelGraph, OptimizerTiming

_TP = re.compile(r"tm?p(\d+)", re.IGNORECASE)
_BATCH = re.compile(r"m?bs(\d+)", re.IGNORECASE)
_NAMES = "name it as Metis does: DeviceType.<GPU>_tp<degree>_bs<micro-batch>.json"


def degree_and_batch(path: Path) -> tuple[int, int]:
    """(tp, micro-batch) from a profile file's name."""
    tp, batch = _TP.search(path.stem), _BATCH.search(path.stem)
    if tp is None or batch is None or int(tp[1]) < 1 or int(batch[1]) < 1:
        raise PlannerError("bad-profile", f"{path.name}: a Metis profile's file name gives "
                           "its tensor-parallel degree and micro-batch size (tp2, bs4); "
                           "this one does not.", [_NAMES])
    return int(tp[1]), int(batch[1])


def _load(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlannerError("bad-profile", f"{path}: not a JSON profile ({exc}).",
                           ["a Metis profile is a JSON file with model, execution_time and "
                            "execution_memory"]) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("execution_time"), dict):
        raise PlannerError("bad-profile", f"{path}: field 'execution_time' is missing; this "
                           "is not a Metis profile.",
                           ["a Metis profile holds execution_time.layer_compute_total_ms"])
    return doc


def read(paths: Sequence[Path], graph: ModelGraph) -> ImportedProfile:
    measurements: list[LayerMeasurement] = []
    optimizer: tuple[int, int, OptimizerTiming] | None = None
    seen: dict[tuple[int, int], Path] = {}
    for path in paths:
        tp, batch = degree_and_batch(path)
        if (tp, batch) in seen:
            raise PlannerError("bad-profile", f"{path.name} and {seen[tp, batch].name} both "
                               f"profile tp {tp} at micro-batch {batch}.",
                               ["pass one file per degree and micro-batch size"])
        seen[tp, batch] = path
        doc = _load(path)
        times = numbers(doc["execution_time"].get("layer_compute_total_ms"),
                        f"{path.name}: execution_time.layer_compute_total_ms")
        memory_doc = doc.get("execution_memory") or {}
        memory = (numbers(memory_doc["layer_memory_total_mb"],
                          f"{path.name}: execution_memory.layer_memory_total_mb")
                  if isinstance(memory_doc, dict) and "layer_memory_total_mb" in memory_doc
                  else None)
        if memory is not None and len(memory) != len(times):
            raise PlannerError("bad-profile", f"{path.name}: layer_memory_total_mb has "
                               f"{len(memory)} layers, layer_compute_total_ms {len(times)}.",
                               ["check the file; both list every layer"])
        entries = entries_of(len(times), graph.layers, around=None, source=path.name,
                             hint="Metis lists the embedding, each block and the head.")
        for index, (layer, taken) in enumerate(zip(graph.layers, entries, strict=True)):
            fwd, bwd = split_total(sum(times[e] for e in taken) / 1e3, layer)
            measurements.append(LayerMeasurement(
                layer=index, tp=tp, micro_batch=batch, fwd=fwd, bwd=bwd, with_tp_comm=tp > 1,
                memory=None if memory is None else sum(memory[e] for e in taken) * MIB))
        step = doc["execution_time"].get("optimizer_time_ms")
        if step is not None and (optimizer is None or (tp, batch) < optimizer[:2]):
            seconds = number(step, f"{path.name}: execution_time.optimizer_time_ms") / 1e3
            optimizer = (tp, batch, OptimizerTiming(params=graph.params / tp, seconds=seconds))
    return imported(measurements, graph, optimizer[2] if optimizer and optimizer[2].seconds
                    else None, "Metis profile " + ", ".join(p.name for p in paths))
