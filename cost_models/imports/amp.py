"""AMP's profile arrays (Li et al., NeurIPS 2022: AMP, Automatically Finding Model
Parallel Strategies with Heterogeneity Awareness).

AMP times the forward of each layer of its DeepSpeed pipeline module in a training
step at micro-batch 1, one run per model-parallel degree, and saves the seconds as a
numpy array `known_cost/<model>_<gpu>_<degree>.npy`; its cost model takes the backward
as twice the forward and the times at degree d as measured there, the degree's
tensor-parallel traffic included. Its GPT layout puts two entries before the blocks
(the embedding and a transpose) and four after (a transpose, the final norm, the head
and the loss), which map to this planner's embedding and head. A JSON list of the same
numbers (`<model>_<gpu>_<degree>.json`) reads the same way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from cost_models.imports import (
    ImportedProfile,
    LayerMeasurement,
    backward_of,
    entries_of,
    imported,
    numbers,
)
from planner.errors import PlannerError
from planner.types import ModelGraph

_DEGREE = re.compile(r"_(\d+)$")
AROUND = (2, 4)  # entries of AMP's GPT pipeline before its blocks and after them


def degree(path: Path) -> int:
    found = _DEGREE.search(path.stem)
    if found is None or int(found[1]) < 1:
        raise PlannerError("bad-profile", f"{path.name}: an AMP profile's file name ends with "
                           "its model-parallel degree (gpt2_G4_2.npy); this one does not.",
                           ["name it <model>_<gpu>_<degree>.npy, as AMP's "
                            "generate_known_cost.py does"])
    return int(found[1])


def _array(path: Path) -> list[float]:
    if path.suffix == ".npy":
        import numpy as np

        try:
            values = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise PlannerError("bad-profile", f"{path}: not a numpy array file ({exc}).",
                               ["AMP saves its profile with numpy.save"]) from None
        if values.ndim != 1:
            raise PlannerError("bad-profile", f"{path.name}: an AMP profile is one row of "
                               f"per-layer seconds; this array has shape {values.shape}.")
        return numbers([float(v) for v in values], path.name)
    try:
        return numbers(json.loads(path.read_text()), path.name)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlannerError("bad-profile", f"{path}: neither a .npy array nor a JSON list "
                           f"({exc}).", ["pass AMP's known_cost/*.npy files"]) from None


def read(paths: Sequence[Path], graph: ModelGraph) -> ImportedProfile:
    measurements: list[LayerMeasurement] = []
    seen: dict[int, Path] = {}
    for path in paths:
        tp = degree(path)
        if tp in seen:
            raise PlannerError("bad-profile", f"{path.name} and {seen[tp].name} both profile "
                               f"degree {tp}.", ["pass one file per degree"])
        seen[tp] = path
        forward = _array(path)
        entries = entries_of(len(forward), graph.layers, around=AROUND, source=path.name,
                             hint=f"AMP's GPT pipeline lists {AROUND[0]} entries before the "
                             f"blocks, each block, and {AROUND[1]} after them.")
        for index, (layer, taken) in enumerate(zip(graph.layers, entries, strict=True)):
            fwd = sum(forward[e] for e in taken)
            measurements.append(LayerMeasurement(layer=index, tp=tp, micro_batch=1, fwd=fwd,
                                                 bwd=backward_of(fwd, layer),
                                                 with_tp_comm=tp > 1))
    return imported(measurements, graph, None,
                    "AMP profile " + ", ".join(p.name for p in paths))
