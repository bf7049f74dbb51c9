"""The cost table the solver consumes: per-layer times and memory terms for every
(device type, tensor-parallel degree, micro-batch size), links, and collectives.

The solver never sees the model or the cost model, only this table, so tests
can hand it random tables and compare the solver with brute force.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from cost_models.comm import Collective, CommGroup
from cost_models.compute import recompute_repeats_tp
from cost_models.memory import GIB, optimizer_state_bytes, sync_state_bytes
from cost_models.model import CostModel
from planner.data.loading import InputRates, faster_loaders_first, input_rates
from planner.dtypes import dtype_bytes
from planner.errors import PlannerError
from planner.solver.keys import LayerCostsKey, RangeParamsKey, RankParamsKey, ZeroKeptKey
from planner.solver.step import NO_CONTENTION, Contention, device_contention
from planner.types import ClusterSpec, DeviceSpec, Layer, LinkSpec, SyncSpec, TrainingSpec
from planner.types.training import Recompute

POLICIES = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)


@dataclass(frozen=True)
class TypeInfo:
    """One device type of the cluster: its nodes (canonical order) and capacity."""

    name: str
    nodes: tuple[str, ...]
    node_devices: tuple[int, ...]
    memory: float  # bytes per device
    peak_flops: float  # dense FLOP/s in the training dtype, for MFU and bounds
    reserve: float  # bytes per device the framework keeps
    contention: Contention = NO_CONTENTION  # an overlapped sync's (`step.Contention`)


@dataclass(frozen=True)
class LayerCosts:
    """Per-layer seconds per micro-batch on one device of a tp group of one type.

    fwd/bwd include tensor-parallel all-reduces (tp_fwd/tp_bwd); recompute[p] is
    the extra backward time of policy p.
    """

    fwd: np.ndarray
    bwd: np.ndarray
    tp_fwd: np.ndarray
    tp_bwd: np.ndarray
    recompute: dict[Recompute, np.ndarray]


@dataclass(frozen=True)
class CostTable:
    """Everything the search prices plans with (per-sample bytes, SI units).

    params[l]:             parameters of layer l
    tied:                  (reader layer, owner layer, parameters) of tied weights: a
                           stage holding the reader but not the owner holds a copy
    activations[p][tp][l]: bytes per sample layer l keeps under policy p
    boundary[l]:           bytes per sample crossing the cut after layer l
    weight/grad/state_bytes: bytes per parameter of weights, gradients, optimizer
    """

    num_layers: int
    types: tuple[TypeInfo, ...]
    tps: tuple[int, ...]
    micro_batches: tuple[int, ...]
    layer_costs: Callable[[str, int, int], LayerCosts]
    params: np.ndarray
    activations: Callable[[Recompute, int], np.ndarray]
    boundary: np.ndarray
    weight_bytes: float
    grad_bytes: float
    state_bytes: float
    link: Callable[[str, str], LinkSpec]  # between two nodes (the same node: intra)
    collective: Callable[[Collective, float, CommGroup], float]
    optimizer_time: Callable[[str, float], float]  # (type, local params) -> seconds
    layer_flops: np.ndarray  # training FLOPs per sample (fwd + bwd), for MFU and bounds
    tied: tuple[tuple[int, int, int], ...] = ()
    unsharded: np.ndarray | None = None  # per layer: parameters tensor parallelism keeps whole
    split: np.ndarray | None = None  # per layer: whether tensor parallelism splits it (and
    # so the copy of a tied weight it reads: `types.model.params_per_rank`)
    interleave: int = 1  # folded for this many model chunks per device (`interleave.fold`)
    sync: SyncSpec = field(default_factory=SyncSpec)  # how a step pays its sync (`step.py`)
    inputs: InputRates | None = None  # the cluster's data-loading limits (`step.fed`)
    cache: dict = field(default_factory=dict, compare=False, repr=False)

    def bytes_per_param(self, zero: int, shards: int) -> float:
        """Bytes a device keeps per parameter of its stage with ZeRO stage `zero` over
        `shards` replicas: ZeRO-1 shards the optimizer states, ZeRO-2 the gradients too,
        ZeRO-3 the weights too (`cost_models.memory.stage_memory` alike)."""
        return (self.weight_bytes / (shards if zero >= 3 else 1)
                + self.grad_bytes / (shards if zero >= 2 else 1)
                + self.state_bytes / (shards if zero >= 1 else 1))

    def rank_params(self, tp: int) -> np.ndarray:
        """Per layer, the parameters one rank of a tp-wide group holds (replicated
        layers whole; cached)."""
        key = RankParamsKey(tp)
        if key not in self.cache:
            self.cache[key] = self.params / tp if self.unsharded is None else (
                (self.params - self.unsharded) / tp + self.unsharded)
        return self.cache[key]

    @property
    def tied_weights(self) -> set[tuple[int, float]]:
        """Each tied weight once: (owner layer, parameters)."""
        return {(owner, params) for _, owner, params in self.tied}

    @property
    def tie_readers(self) -> dict[tuple[int, float], list[int]]:
        """Each tied weight's (owner layer, parameters) and the layers that read it."""
        readers: dict[tuple[int, float], list[int]] = {}
        for reader, owner, params in self.tied:  # (T5's table: the decoder and the head)
            readers.setdefault((owner, float(params)), []).append(reader)
        return readers

    def range_params(self, tp: int) -> np.ndarray:
        """[a, b) matrix of the parameters one rank of a tp-wide stage holding layers
        [a, b) keeps: its own plus copies of tied weights owned outside the range, split
        as their readers are (cached)."""
        key = RangeParamsKey(tp)
        if key not in self.cache:
            prefix = np.concatenate([[0.0], np.cumsum(self.rank_params(tp))])
            out = prefix[None, :] - prefix[:, None]
            a = np.arange(self.num_layers + 1)[:, None]
            b = np.arange(self.num_layers + 1)[None, :]
            for reader, owner, params in self.tied:
                share = tp if self.split is not None and self.split[reader] else 1
                out = out + params / share * ((a <= reader) & (reader < b)
                                              & ~((a <= owner) & (owner < b)))
            self.cache[key] = out
        return self.cache[key]

    def zero_kept(self, zero: int) -> np.ndarray:
        """[a, b) matrix of the parameters of tied weights one rank of a stage holding
        layers [a, b) keeps whole under ZeRO stage `zero` (`types.model.zero_kept`:
        the rule, per layer range; cached)."""
        key = ZeroKeptKey(3 if zero >= 3 else min(zero, 1))  # (1 and 2 alike)
        if key not in self.cache:
            size = self.num_layers + 1
            a = np.arange(size)[:, None]
            b = np.arange(size)[None, :]
            groups: dict[tuple[int, float], list[int]] = {}
            for reader, owner, params in self.tied:
                groups.setdefault((owner, float(params)), [owner]).append(reader)
            out = np.zeros((size, size))
            for (_, params), ends in groups.items():
                inside = [(a <= i) & (i < b) for i in ends]
                touched = np.logical_or.reduce(inside)
                whole = np.logical_and.reduce(inside)
                if zero >= 3:
                    out += params * touched
                elif zero >= 1:
                    out += params * (touched & ~whole)
            self.cache[key] = out
        return self.cache[key]

    def type(self, name: str) -> TypeInfo:
        return next(t for t in self.types if t.name == name)

    def costs(self, type_name: str, tp: int, mb: int) -> LayerCosts:
        key = LayerCostsKey(type_name, tp, mb)
        if key not in self.cache:
            self.cache[key] = self.layer_costs(type_name, tp, mb)
        return self.cache[key]


def _divisor_ok(layers: Sequence[Layer], tp: int) -> bool:
    return all(layer.tp_divisor == 0 or layer.tp_divisor % tp == 0 for layer in layers)


def check_tp_divides(layers: Sequence[Layer], tp: int, choices: Sequence[int]) -> None:
    """A PlannerError naming the first layer whose heads or widths `tp` does not divide
    (tensor parallelism shards them evenly); `choices` are the degrees to suggest from."""
    if tp > 1 and not any(layer.tp_sharded for layer in layers):
        raise PlannerError("bad-option", f"--tp {tp}: tensor parallelism shards none of this "
                           "model's layers (the runtime shards transformer blocks, their "
                           "experts included, MLP blocks and layers with a "
                           "tensor_parallel_plan), so "
                           "every rank would run the whole model.", ["use --tp 1"])
    split = next((x for x in layers if x.tp_divisor and x.tp_divisor % tp), None)
    if split is not None:
        fits = [t for t in choices if _divisor_ok(layers, t)]
        raise PlannerError(
            "bad-option", f"--tp {tp} cannot split layer {split.index} ({split.name}): its "
            f"heads or widths divide by {split.tp_divisor}, and tensor parallelism shards "
            "them evenly.", [f"use one of --tp {', '.join(map(str, fits))}"])


def device_types(cluster: ClusterSpec, exclude: Sequence[str] = (),
                 inputs: InputRates | None = None) -> list[tuple[DeviceSpec, list[str]]]:
    """Device types with their usable nodes, canonical order (by type, then node name;
    with `inputs`, the nodes whose loaders are faster first: placement fills them
    first, so first stages read where loading is fastest)."""
    by_type: dict[str, tuple[DeviceSpec, list[str]]] = {}
    for node in sorted(cluster.nodes, key=lambda n: (faster_loaders_first(inputs, n.name),
                                                     n.name)):
        if node.name in exclude:
            continue
        by_type.setdefault(node.device.name, (node.device, []))[1].append(node.name)
    return [by_type[name] for name in sorted(by_type)]


def build_table(layers: Sequence[Layer], cluster: ClusterSpec, training: TrainingSpec,
                costs: CostModel, *, tps: Sequence[int], micro_batches: Sequence[int],
                exclude: Sequence[str] = ()) -> CostTable:
    """Price every layer for every device type, tp degree and micro-batch size."""
    types = []
    devices: dict[str, DeviceSpec] = {}
    inputs = input_rates(cluster, training)
    for device, nodes in device_types(cluster, exclude, inputs):
        devices[device.name] = device
        types.append(TypeInfo(
            name=device.name, nodes=tuple(nodes),
            node_devices=tuple(cluster.node(n).devices for n in nodes), memory=device.memory,
            peak_flops=device.flops(training.dtype),
            reserve=0.25 * GIB if device.is_cpu else GIB,
            contention=device_contention(device)))
    first_node = {t.name: t.nodes[0] for t in types}

    def layer_costs(type_name: str, tp: int, mb: int) -> LayerCosts:
        device = devices[type_name]
        times = [costs.layer_time(layer, device, tp=tp, micro_batch=mb, dtype=training.dtype)
                 for layer in layers]
        group = CommGroup(((first_node[type_name], tp),))
        tp_one = np.array([costs.tp_comm_time(layer, mb, group)
                           for layer in layers]) if tp > 1 else np.zeros(len(layers))
        fwd = np.array([t.fwd for t in times]) + tp_one
        bwd = np.array([t.bwd for t in times]) + tp_one
        recompute = {p: np.array([costs.recompute_time(layer, device, tp=tp, micro_batch=mb,
                                                       dtype=training.dtype, policy=p)
                                  for layer in layers])
                     + (tp_one if recompute_repeats_tp(p) else 0.0) for p in POLICIES}
        return LayerCosts(fwd=fwd, bwd=bwd, tp_fwd=tp_one, tp_bwd=tp_one, recompute=recompute)

    act_cache: dict[tuple[Recompute, int], np.ndarray] = {}

    def activations(policy: Recompute, tp: int) -> np.ndarray:
        if (policy, tp) not in act_cache:
            act_cache[policy, tp] = np.array([costs.activation_bytes(layer, recompute=policy,
                                                                     tp=tp)
                                              for layer in layers])
        return act_cache[policy, tp]

    weight = float(dtype_bytes(training.dtype))
    return CostTable(
        num_layers=len(layers), types=tuple(types),
        tps=tuple(tp for tp in tps if _divisor_ok(layers, tp)
                  and (tp == 1 or any(layer.tp_sharded for layer in layers))),
        micro_batches=tuple(micro_batches), layer_costs=layer_costs,
        params=np.array([float(layer.params) for layer in layers]), activations=activations,
        boundary=np.array([layer.output_bytes for layer in layers]), weight_bytes=weight,
        grad_bytes=float(training.optimizer.grad_bytes or weight),
        state_bytes=optimizer_state_bytes(training) + sync_state_bytes(training),
        link=cluster.link_between,
        collective=costs.collective_time,
        optimizer_time=functools.cache(
            lambda t, p: costs.optimizer_time(p, devices[t], training)),
        layer_flops=np.array([layer.flops for layer in layers]),
        tied=tuple((layer.index, owner, params) for layer in layers
                   for owner, params in layer.tied),
        unsharded=np.array([0.0 if layer.tp_sharded else float(layer.params)
                            for layer in layers]),
        split=np.array([layer.tp_sharded for layer in layers]), sync=training.sync,
        inputs=inputs)
