"""The "measured per node" scenario of `solve.py --measured`: a cluster whose every node
carries its own measured layer times, and pipelines written by hand across its nodes.

A cluster merged from `planner profile` runs (or written with `measured:` blocks) has one
device type per node (`A100-80G-SXM@a100-a`): two nodes of the same GPU measured apart
are two types to the solver. This machine has no GPUs, so each node's `layer_times` are
what `planner profile --model` would write if its GPU ran the catalog's roofline times
scaled by the node's own factor (clocks, cooling, PCIe against SXM): each layer of the
model at micro-batches 1, 2 and 4, in the cluster YAML.

The hand-written plans are what a user or a peer planner writes for such a cluster,
priced as written with the cost model (`planner.price.price_file`, the function behind
`planner estimate --plan`): pipelines that run through every node, their layers split in
proportion to the nodes' measured speed, the batch shared evenly.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from cost_models import catalog
from cost_models.cluster import load_cluster
from cost_models.model import AnalyticalCostModel
from planner.types import ModelGraph, Plan


@dataclass(frozen=True)
class MeasuredNode:
    name: str
    device: str  # a catalog name
    devices: int
    slowdown: float  # its measured layer times over the catalog's roofline


@dataclass(frozen=True)
class MeasuredScenario:
    model: str
    nodes: tuple[MeasuredNode, ...]
    batch: int
    seq: int
    dtype: str
    label: str


SCENARIO = MeasuredScenario(
    model="gpt3-13b",
    nodes=(MeasuredNode("a100-a", "A100-80G", 4, 1.00),
           MeasuredNode("a100-b", "A100-80G", 4, 1.12),
           MeasuredNode("v100-a", "V100-32G", 4, 0.95),
           MeasuredNode("v100-b", "V100-32G", 4, 1.18)),
    batch=256, seq=2048, dtype="fp16",
    label="GPT-3 13B, measured per node: 2 nodes of 4x A100-80GB and 2 of 4x V100-32GB, "
          "each node its own layer times (4 device types), 100 Gb/s")
MICRO_BATCHES = (1, 2, 4)  # the micro-batch sizes each node's layers are timed at


def write_cluster(scenario: MeasuredScenario, graph: ModelGraph, folder: Path) -> Path:
    """The scenario's cluster YAML, each node with its measured layer times."""
    nodes = []
    for node in scenario.nodes:
        device = catalog.device(node.device)
        costs = AnalyticalCostModel(load_cluster(f"1x1x{node.device}"))
        times, seen = [], set()
        for layer in graph.layers:
            if layer.signature in seen:
                continue
            seen.add(layer.signature)
            for mb in MICRO_BATCHES:
                t = costs.layer_time(layer, device, tp=1, micro_batch=mb, dtype=scenario.dtype)
                times.append({"model": graph.spec.describe(), "layer": layer.signature,
                              "seq_len": scenario.seq, "dtype": scenario.dtype,
                              "micro_batch": mb, "fwd": t.fwd * node.slowdown,
                              "bwd": t.bwd * node.slowdown})
        nodes.append({"name": node.name, "device": node.device, "devices": node.devices,
                      "measured": {"layer_times": times,
                                   "source": f"catalog roofline x {node.slowdown} (emulated)"}})
    path = folder / "measured-per-node.yaml"
    path.write_text(yaml.safe_dump({"schema_version": 1, "name": "measured-per-node",
                                    "network": {"bandwidth": "100Gbps"}, "nodes": nodes}))
    return path


def speed(node: MeasuredNode, dtype: str) -> float:
    """A node's devices' speed for the hand-written splits: the catalog's peak rate over
    its measured slowdown."""
    return catalog.device(node.device).flops(dtype) / node.slowdown


@dataclass(frozen=True)
class Handwritten:
    """Pipelines through every node: `per_node` stages on each, at degree tp."""

    name: str
    per_node: int
    tp: int
    micro_batch: int = 1


HANDWRITTEN = (
    Handwritten("one pipeline through every device", per_node=4, tp=1),
    Handwritten("4 pipelines through every node, a device each", per_node=1, tp=1),
    Handwritten("1 pipeline through every node, tp 4", per_node=1, tp=4),
    Handwritten("2 pipelines through every node, tp 2", per_node=1, tp=2),
)


def handwritten_plan(scenario: MeasuredScenario, shape: Handwritten, layers: int,
                     cluster: Path, folder: Path) -> Path:
    """A plan file of `shape` for the scenario: as many pipelines as the nodes' devices
    allow, each through every node in the file's order, layers split by speed."""
    pipes = min(node.devices for node in scenario.nodes) // (shape.per_node * shape.tp)
    pipelines = []
    for p in range(pipes):
        stages = [(node, [(p * shape.per_node + s) * shape.tp + i for i in range(shape.tp)])
                  for node in scenario.nodes for s in range(shape.per_node)]
        bounds = _split(layers, [speed(node, scenario.dtype) for node, _ in stages])
        pipelines.append({
            "batch_share": scenario.batch // pipes, "micro_batch": shape.micro_batch,
            "stages": [{"layers": [a, b], "tp": shape.tp,
                        "devices": {"node": node.name, "devices": devices}}
                       for (node, devices), (a, b) in zip(stages, itertools.pairwise(bounds),
                                                          strict=True)]})
    doc = {"kind": "plan", "schema_version": 1,
           "model": {"source": "zoo", "name": scenario.model, "overrides": {}},
           "training": {"global_batch": scenario.batch, "seq_len": scenario.seq,
                        "dtype": scenario.dtype},
           "cluster": str(cluster), "pipelines": pipelines}
    path = folder / f"hand-{shape.per_node}-{shape.tp}.json"
    path.write_text(json.dumps(doc, indent=1))
    return path


def _split(layers: int, speeds: Sequence[float]) -> list[int]:
    """Layer bounds giving each stage a share of the layers in proportion to its speed,
    at least one each."""
    total, out, done = sum(speeds), [0], 0.0
    for i, s in enumerate(speeds[:-1]):
        done += s
        left = len(speeds) - 1 - i
        out.append(max(out[-1] + 1, min(layers - left, round(done / total * layers))))
    return [*out, layers]


def price_handwritten(path: Path) -> Plan:
    """The plan file priced as written (`planner estimate --plan`)."""
    from planner.price import price_file

    return price_file(path).plan
