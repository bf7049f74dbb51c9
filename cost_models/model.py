"""The cost-model protocol the solver, simulator and CLI use, and its analytical default.

    costs = AnalyticalCostModel(cluster)
    costs.layer_time(layer, device, tp=2, micro_batch=4, dtype="bf16").fwd
    costs.collective_time(Collective.ALL_REDUCE, 2**30, CommGroup.of(["a-0", "a-1"]))
    costs.memory(stage_layers, device, training, tp=2, zero=1, dp=8, in_flight=4)

Measured profiles enter through the cluster spec: devices carry measured
matmul rates, memory bandwidth, layer timings (and memory), optimizer steps, links
carry measured bandwidth and latency (see `planner profile merge`, `planner profile
import`, `planner tune`). Measured layer memory scales the layers' activation figures
(`cost_models.measured_memory`), wherever they are priced: `activation_bytes` (the
solver's table) and `memory`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from cost_models.comm import (
    Collective,
    CommGroup,
    Priced,
    collective_choice,
    group_links,
    p2p_time,
)
from cost_models.compute import (
    DEFAULT_EFFICIENCY,
    Efficiency,
    LayerTime,
    includes_tp_comm,
    layer_time,
    optimizer_time,
    recompute_time,
)
from cost_models.measured_memory import activation_scale, scaled
from cost_models.memory import activation_bytes, optimizer_state_bytes, stage_memory
from cost_models.tensor_parallel import tp_comm_time
from planner.dtypes import dtype_bytes
from planner.types import ClusterSpec, DeviceSpec, Layer, MemoryBreakdown, TrainingSpec
from planner.types.training import Recompute


class CostModel(Protocol):
    cluster: ClusterSpec

    def layer_time(self, layer: Layer, device: DeviceSpec, *, tp: int, micro_batch: int,
                   dtype: str) -> LayerTime: ...

    def recompute_time(self, layer: Layer, device: DeviceSpec, *, tp: int, micro_batch: int,
                       dtype: str, policy: Recompute) -> float: ...

    def collective_time(self, kind: Collective, nbytes: float, group: CommGroup) -> float: ...

    def collective_choice(self, kind: Collective, nbytes: float, group: CommGroup
                          ) -> Priced: ...

    def tp_comm_time(self, layer: Layer, micro_batch: int, group: CommGroup) -> float: ...

    def p2p_time(self, nbytes: float, src: str, dst: str) -> float: ...

    def memory(self, layers: Sequence[Layer], device: DeviceSpec, training: TrainingSpec, *,
               tp: int, dp: int, zero: int, recompute: Recompute, micro_batch: int,
               in_flight: int, kept: float = 0.0) -> MemoryBreakdown: ...

    def activation_bytes(self, layer: Layer, *, recompute: Recompute, tp: int) -> float: ...

    def optimizer_time(self, params: float, device: DeviceSpec,
                       training: TrainingSpec) -> float: ...


COLLECTIVES_KEPT = 1 << 17  # memoised collectives (and groups' links) at most


@dataclass(frozen=True)
class AnalyticalCostModel:
    """Roofline compute, alpha-beta communication, memory by term (see the modules).

    Prices are memoised per instance (identical layers and replicas repeat a lot);
    the inputs are immutable values, so the memo never goes stale. Collectives are
    memoised apart, at most COLLECTIVES_KEPT of them at once (emptied when full): a
    search prices all-reduces over ever new groups, and the groups in the keys would
    otherwise stay alive as long as the model."""

    cluster: ClusterSpec
    efficiency: Efficiency = DEFAULT_EFFICIENCY
    memo: dict = field(default_factory=dict, compare=False, repr=False)
    collectives: dict = field(default_factory=dict, compare=False, repr=False)

    def layer_time(self, layer: Layer, device: DeviceSpec, *, tp: int, micro_batch: int,
                   dtype: str) -> LayerTime:
        # identical repeated layers share a signature, so 80 transformer blocks are priced
        # once (as the plan's tensor-parallel options run them: `_priced`); the device by
        # identity (hashing a measured device costs more than pricing; the memo keeps it
        # alive, so its id stays unique)
        key = ("layer", _priced(layer), id(device), tp, micro_batch, dtype)
        if key not in self.memo:
            self.memo[key] = layer_time(layer, device, tp=tp, micro_batch=micro_batch,
                                        dtype=dtype, eff=self.efficiency)
            self.memo["alive", key] = (layer, device)
        return self.memo[key]

    def recompute_time(self, layer: Layer, device: DeviceSpec, *, tp: int, micro_batch: int,
                       dtype: str, policy: Recompute) -> float:
        key = ("recompute", _priced(layer), id(device), tp, micro_batch, dtype, policy)
        if key not in self.memo:
            self.memo[key] = recompute_time(layer, device, tp=tp, micro_batch=micro_batch,
                                            dtype=dtype, policy=policy, eff=self.efficiency)
            self.memo["alive", key] = (layer, device)
        return self.memo[key]

    def collective_time(self, kind: Collective, nbytes: float, group: CommGroup) -> float:
        return self.collective_choice(kind, nbytes, group).seconds

    def collective_choice(self, kind: Collective, nbytes: float, group: CommGroup
                          ) -> Priced:
        """The collective's seconds and the algorithm that takes them."""
        memo = self.collectives
        key = (kind, nbytes, group)
        if key not in memo:
            if len(memo) + 2 > COLLECTIVES_KEPT:  # (room for the links and the price)
                memo.clear()
            links = ("links", group)  # a group's links, whatever it moves
            if links not in memo:
                memo[links] = group_links(self.cluster, group)
            memo[key] = collective_choice(kind, nbytes, group, *memo[links])
        return memo[key]

    def tp_comm_time(self, layer: Layer, micro_batch: int, group: CommGroup) -> float:
        """The layer's tensor-parallel traffic over `group` (a stage's tp group, on one
        node), none where its time there is measured with that traffic in it."""
        device = self.cluster.node(group.members[0][0]).device
        if includes_tp_comm(layer, device, group.size):
            return 0.0
        return tp_comm_time(layer, micro_batch, group, self.collective_time)

    def p2p_time(self, nbytes: float, src: str, dst: str) -> float:
        return p2p_time(nbytes, self.cluster.link_between(src, dst))

    def memory(self, layers: Sequence[Layer], device: DeviceSpec, training: TrainingSpec, *,
               tp: int = 1, dp: int = 1, zero: int = 0, recompute: Recompute = Recompute.NONE,
               micro_batch: int = 1, in_flight: int = 1, kept: float = 0.0) -> MemoryBreakdown:
        key = ("memory", tuple(_priced(layer) for layer in layers), id(device), training, tp,
               dp, zero, recompute, micro_batch, in_flight, kept)
        if key not in self.memo:
            layers = [scaled(layer, self._activation_scale(layer)) for layer in layers]
            self.memo[key] = stage_memory(layers, device=device, training=training, tp=tp,
                                          dp=dp, zero=zero, recompute=recompute,
                                          micro_batch=micro_batch, in_flight=in_flight,
                                          kept=kept)
            self.memo["alive", key] = device
        return self.memo[key]

    def activation_bytes(self, layer: Layer, *, recompute: Recompute, tp: int) -> float:
        """Per-sample bytes `layer` keeps under `recompute` on a rank of a tp group
        (`cost_models.memory.activation_bytes`, scaled to measured memory)."""
        return activation_bytes(scaled(layer, self._activation_scale(layer)),
                                recompute=recompute, tp=tp)

    def _activation_scale(self, layer: Layer) -> float | None:
        key = ("activation scale", _priced(layer))
        if key not in self.memo:
            self.memo[key] = activation_scale(layer, self.cluster)
        return self.memo[key]

    def optimizer_time(self, params: float, device: DeviceSpec,
                       training: TrainingSpec) -> float:
        return optimizer_time(params, device, dtype_bytes=dtype_bytes(training.dtype),
                              optimizer=training.optimizer,
                              state_bytes=optimizer_state_bytes(training), eff=self.efficiency)


def _priced(layer: Layer) -> tuple[str, bool, bool]:
    """What sets a layer's prices: its signature, and whether tensor parallelism splits it
    and sequence parallelism runs it (`cost_models.tensor_parallel.as_trained` changes
    both, not the signature, which measured layer timings are matched by)."""
    return layer.signature, layer.tp_sharded, layer.sequence_parallel
