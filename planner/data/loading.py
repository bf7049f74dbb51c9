"""Data loading as a floor of the step (issue 51, item 4): the input a plan's pipelines
need each step against what the cluster can feed them.

A pipeline's samples are read by its first stage: that stage's node loads them (its
data loaders, on its CPU cores: the node's `data_loading`, shared by every pipeline
whose first stage it holds), and each of that stage's devices takes them in (the device
type's `input_rate`: a stream's rate, its host link). Loaders prefetch while the
pipelines run, so loading adds nothing until it is the slower of the two; then the
pipelines wait for their input, and a step lasts at least

    loading = max( max over nodes n:  samples of the pipelines n feeds / data_loading(n),
                   max over pipelines p:  samples of p / input_rate(type of p's first stage) )

which `planner.solver.step` takes as the one floor of the pipelines' time (`step.fed`).
Rates in tokens/s count the training's sequence length per sample (its rows are that
long, padded or packed). A cluster without either field has no floor: plans price as
they did without it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from planner.errors import PlannerError
from planner.types import ClusterSpec, Plan, TrainingSpec
from planner.types.cluster import DataRate


@dataclass(frozen=True)
class Feed:
    """One pipeline's input per step: its first stage's node and device type, and the
    samples it reads."""

    node: str
    device_type: str
    samples: float


@dataclass(frozen=True)
class InputRates:
    """Samples per second, where the cluster limits them: what each node's data loaders
    produce, and what one device of each type takes in."""

    nodes: Mapping[str, float]
    types: Mapping[str, float]


@dataclass(frozen=True)
class Loading:
    """The step's loading floor and what sets it: `samples` a step loads at `rate`
    samples/s on `where` (a node's loaders, or a device type's input)."""

    seconds: float
    where: str  # "node NAME" or "device type NAME"
    samples: float
    rate: float


def samples_per_second(rate: DataRate, training: TrainingSpec, where: str) -> float:
    """A rate in samples/s; tokens count the training's sequence length per sample."""
    if rate.unit == "samples":
        return rate.per_second
    if not training.seq_len:
        raise PlannerError(
            "bad-cluster", f"{where} is given in tokens/s, but the model has no sequence "
            "length to count a sample's tokens by.",
            [f"give {where} in samples/s (e.g. 4000 samples/s)",
             "or pass the model's sequence length (--seq-len)"])
    return rate.per_second / training.seq_len


def input_rates(cluster: ClusterSpec, training: TrainingSpec) -> InputRates | None:
    """The cluster's input limits in samples/s; None where it gives none."""
    nodes = {n.name: samples_per_second(n.data_loading, training,
                                        f"node {n.name!r}'s data_loading")
             for n in cluster.nodes if n.data_loading is not None}
    types = {n.device.name: samples_per_second(n.device.input_rate, training,
                                               f"device {n.device.name!r}'s input_rate")
             for n in cluster.nodes if n.device.input_rate is not None}
    return InputRates(nodes=nodes, types=types) if nodes or types else None


def loading(rates: InputRates | None, feeds: Iterable[Feed]) -> Loading | None:
    """The step's loading floor for these pipelines' input (module docstring); None where
    nothing limits it."""
    if rates is None:
        return None
    per_node: dict[str, float] = {}
    limits = []
    for feed in feeds:
        per_node[feed.node] = per_node.get(feed.node, 0.0) + feed.samples
        if feed.device_type in rates.types:
            rate = rates.types[feed.device_type]
            limits.append(Loading(seconds=feed.samples / rate,
                                  where=f"device type {feed.device_type}",
                                  samples=feed.samples, rate=rate))
    limits += [Loading(seconds=samples / rates.nodes[node], where=f"node {node}",
                       samples=samples, rate=rates.nodes[node])
               for node, samples in sorted(per_node.items()) if node in rates.nodes]
    return max(limits, key=lambda limit: limit.seconds, default=None)


def loading_seconds(rates: InputRates | None, feeds: Iterable[Feed]) -> float:
    """`loading`'s seconds, 0 where nothing limits the input (the step model's term)."""
    floor = loading(rates, feeds)
    return 0.0 if floor is None else floor.seconds


def faster_loaders_first(rates: InputRates | None, node: str) -> float:
    """A node's place in the solver's node order (`solver.table.device_types`), least
    first: nodes without a loading limit, then the faster loaders."""
    if rates is None or node not in rates.nodes:
        return -math.inf
    return -rates.nodes[node]


def plan_feeds(plan: Plan) -> list[Feed]:
    """Each pipeline's input per step, read by its first stage."""
    return [Feed(node=p.stages[0].devices.node, device_type=p.stages[0].device_type,
                 samples=float(p.batch_share)) for p in plan.pipelines]


def plan_loading(plan: Plan) -> Loading | None:
    """A plan's loading floor on its own cluster (None: the cluster sets none)."""
    return loading(input_rates(plan.cluster, plan.training), plan_feeds(plan))
