"""Cluster side of the data model: devices, links, nodes, groups, measurements.

Bandwidths are bytes/s per direction, what one device (or one node's network
interface) can send; latencies are seconds; memory is bytes; compute is dense
FLOP/s per dtype name ("fp32", "tf32", "bf16", "fp16").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

from planner.errors import PlannerError


@dataclass(frozen=True, kw_only=True)
class BusRate:
    """One size of a measured collective: nccl-tests' bus bandwidth (bytes/s) for a
    message of `size` bytes (the full buffer)."""

    size: float
    bus_bandwidth: float


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """bus_rates: the bus bandwidth measured on the link size by size (NCCL's all-reduce,
    smallest size first), which `cost_models.comm` prices collectives of those sizes at;
    empty where none was measured. `bandwidth` stays the rate of large messages."""

    name: str
    bandwidth: float
    latency: float
    bus_rates: tuple[BusRate, ...] = ()

    def slowest(self, *others: LinkSpec | None) -> LinkSpec:
        """The link a transfer over all of these links sees: the lowest bandwidth and
        the highest latency (a mixed group is limited by its slowest link); the measured
        rates only where every link has the same."""
        links = [self, *(o for o in others if o is not None)]
        if len(links) == 1:
            return self
        bottleneck = min(links, key=lambda link: link.bandwidth)
        shared = all(link.bus_rates == bottleneck.bus_rates for link in links)
        return LinkSpec(name=bottleneck.name, bandwidth=bottleneck.bandwidth,
                        latency=max(link.latency for link in links),
                        bus_rates=bottleneck.bus_rates if shared else ())


@dataclass(frozen=True, kw_only=True)
class DataRate:
    """A rate of training input: `per_second` samples, or tokens, per second (`unit`).
    Tokens count at the training's sequence length per sample
    (`planner.data.loading.samples_per_second`)."""

    per_second: float
    unit: str  # "samples" or "tokens"


@dataclass(frozen=True, kw_only=True)
class LayerTiming:
    """A measured forward and backward time of one traced layer on one device type.

    with_tp_comm: the times include the layer's tensor-parallel collectives (as profilers
                  built on Megatron-LM measure them at tp > 1), which the cost model
                  then does not add again.
    memory:       bytes one device of the tp group held for the layer in the measured
                  step (weights, gradients, optimizer states and the micro-batch's
                  activations), where measured; None otherwise.
    """

    model: str  # ModelSpec.describe()
    layer: str  # Layer.signature
    seq_len: int | None
    dtype: str
    micro_batch: int
    tp: int = 1
    fwd: float
    bwd: float
    with_tp_comm: bool = False
    memory: float | None = None


@dataclass(frozen=True, kw_only=True)
class OptimizerTiming:
    """A measured optimizer step: `seconds` on one device holding `params` parameters."""

    params: float
    seconds: float


@dataclass(frozen=True, kw_only=True)
class MeasuredDevice:
    """What `planner profile` measured on a device, or what `planner profile import`
    and `planner tune` brought from other tools and trial runs; overrides catalog
    figures."""

    matmul_flops: Mapping[str, float] = field(default_factory=dict, hash=False)
    memory_bandwidth: float | None = None
    layer_times: tuple[LayerTiming, ...] = ()
    optimizer: OptimizerTiming | None = None
    source: str = ""
    # an overlapped sync's contention (`planner.solver.step.Contention`): how much longer
    # computing takes while a collective is in flight, and a collective beside computing
    compute_slowdown: float = 0.0
    sync_slowdown: float = 0.0


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """A device type: catalog figures (with their sources) and any measurements.

    compute_units:   streaming multiprocessors (compute units) a GEMM's output tiles are
                     shared among in waves (`cost_models.compute.gemm_efficiency`).
    gemm_efficiency: the share of the dense peak the best large, aligned GEMM reaches
                     (measured maximum achievable matmul FLOP/s over the peak).
    input_rate:      the most input one device takes in (a stream's rate, its host
                     link); None: no limit.
    """

    name: str
    vendor: str
    memory: float
    memory_bandwidth: float
    peak_flops: Mapping[str, float] = field(hash=False)
    intra_link: LinkSpec
    sources: Mapping[str, str] = field(default_factory=dict, hash=False)
    measured: MeasuredDevice | None = None
    compute_units: int | None = None
    gemm_efficiency: float | None = None
    input_rate: DataRate | None = None

    @property
    def is_cpu(self) -> bool:
        return self.name.split("@")[0] == "cpu"

    def flops(self, dtype: str) -> float:
        """Peak dense FLOP/s in `dtype`; a dtype the device has no fast path for runs
        at its fp32 rate (V100 has no bf16 tensor cores)."""
        for name in (dtype, "fp32"):
            if name in self.peak_flops:
                return self.peak_flops[name]
        raise PlannerError("bad-device", f"Device {self.name} has no peak FLOP/s for "
                           f"{dtype} or fp32.", ["add peak_flops to its catalog entry"])


@dataclass(frozen=True, kw_only=True)
class NodeSpec:
    """One machine: `devices` identical devices joined by `intra_link`.

    nic:    this node's network interface, capping its traffic to other nodes
            (None: only the network or group link applies).
    groups: names of the groups (rack, zone, site...) it is in, outermost first.
    data_loading: the input this node's data loaders (its CPU cores) produce, for all
            the pipelines whose first stage it holds; None: no limit.
    """

    name: str
    host: str | None = None
    device: DeviceSpec
    devices: int
    intra_link: LinkSpec
    nic: LinkSpec | None = None
    groups: tuple[str, ...] = ()
    data_loading: DataRate | None = None


@dataclass(frozen=True, kw_only=True)
class GroupSpec:
    """A set of nodes (rack, zone, site) whose members talk over `link`, unless a
    smaller group they share is faster."""

    name: str
    link: LinkSpec
    parent: str | None = None


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    name: str
    nodes: tuple[NodeSpec, ...]
    network: LinkSpec  # between nodes that share no group
    groups: tuple[GroupSpec, ...] = ()

    @property
    def num_devices(self) -> int:
        return sum(n.devices for n in self.nodes)

    @cached_property
    def _by_name(self) -> dict[str, NodeSpec]:
        return {n.name: n for n in self.nodes}

    def node(self, name: str) -> NodeSpec:
        found = self._by_name.get(name)
        if found is not None:
            return found
        raise PlannerError("unknown-node", f"Cluster {self.name} has no node {name!r}.",
                           [f"use one of {', '.join(n.name for n in self.nodes)}"])

    def device_types(self) -> dict[str, DeviceSpec]:
        """Device types by name, in name order."""
        return {d.name: d for d in sorted((n.device for n in self.nodes), key=lambda d: d.name)}

    def link_between(self, a: str, b: str) -> LinkSpec:
        """The link between a device on node `a` and one on node `b`."""
        first, second = self.node(a), self.node(b)
        if first.name == second.name:
            return first.intra_link
        shared = [g for g in first.groups if g in second.groups]
        link = self.network
        if shared:
            link = next(g.link for g in self.groups if g.name == shared[-1])
        return link.slowest(first.nic, second.nic)
