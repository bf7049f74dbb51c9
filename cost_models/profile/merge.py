"""`planner profile merge`: a cluster spec from per-node profiles, measurements carried along.

Each profile becomes one node: its CUDA devices (matched to the catalog by the
name torch reports) or, without CUDA, its CPU as one device. The node's device
carries what was measured (matmul FLOP/s per dtype, memory bandwidth, layer
timings), which the cost model prefers to catalog figures. The node's intra-node
link is calibrated from the measured all-reduce (the ring model's bandwidth and
latency that reproduce it for the measured process count). Links between nodes
cannot be measured by per-node profiles: give `network` (e.g. "100Gbps/5us"), or
"measured" when the nodes share one machine (an emulated cluster) to use the
slowest measured all-reduce link.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from cost_models import catalog
from cost_models.profile import load_profile
from planner.errors import PlannerError
from planner.types import ClusterSpec, DeviceSpec, LayerTiming, LinkSpec, MeasuredDevice, NodeSpec
from planner.units import parse_bandwidth, parse_duration


def _measured(device: dict, source: str, comm: dict | None) -> MeasuredDevice:
    """What the profile measured of `device`; `comm`, its communication where measured
    on devices of its kind (its `contention`, an overlapped sync's slowdowns)."""
    layers = device.get("layers") or {}
    contention = (comm or {}).get("contention") or {}
    times = tuple(
        LayerTiming(model=layers["model"], layer=t["signature"],
                    seq_len=int(layers["seq_len"]) if layers.get("seq_len") else None,
                    dtype=layers["dtype"], micro_batch=int(t["micro_batch"]), fwd=t["fwd"],
                    bwd=t["bwd"])
        for t in layers.get("timings", []))
    return MeasuredDevice(
        matmul_flops={dtype: m["best_flops"] for dtype, m in device["matmul"].items()
                      if m["best_flops"] > 0},
        memory_bandwidth=device["memory_bandwidth"]["best"] or None, layer_times=times,
        source=source, compute_slowdown=contention.get("compute_slowdown", 0.0),
        sync_slowdown=contention.get("collective_slowdown", 0.0))


def _base(device: dict) -> DeviceSpec:
    """The catalog entry for a measured device, its memory as measured."""
    if device["kind"] == "cpu":
        base = catalog.device("cpu")
    else:
        try:
            base = catalog.device(device["name"])
        except PlannerError as exc:
            raise PlannerError(
                "unknown-device", f"The profile's device {device['name']!r} is not in the "
                "catalog, so its peak figures are unknown.",
                ["add it to cost_models/data/devices.yaml",
                 "or describe the node by hand in the cluster YAML"]) from exc
    memory = device.get("memory_bytes") or base.memory
    return dataclasses.replace(base, memory=float(memory))


def _link(comm: dict | None, fallback: LinkSpec) -> LinkSpec:
    """The ring link that reproduces the measured all-reduce of `world_size` ranks:
    t = 2 (n-1)/n * S / B + 2 (n-1) * latency, fitted as t = alpha + S / beta."""
    if not comm or comm["world_size"] < 2:
        return fallback
    n = comm["world_size"]
    fit = comm["collectives"]["all_reduce"]
    return LinkSpec(name=f"measured {comm['backend']} all-reduce",
                    bandwidth=fit["beta_bandwidth"] * 2 * (n - 1) / n,
                    latency=fit["alpha"] / (2 * (n - 1)))


def merge_profiles(paths: Sequence[Path], *, network: str = "100Gbps/5us",
                   names: Sequence[str] | None = None, name: str = "profiled") -> ClusterSpec:
    """One node per profile (see the module docstring)."""
    if not paths:
        raise PlannerError("bad-option", "Give at least one profile to merge.")
    if names is not None and len(names) != len(paths):
        raise PlannerError("bad-option", f"--names gives {len(names)} names for "
                           f"{len(paths)} profiles.", ["give one name per profile"])
    if not name.strip() or (names is not None and not all(n.strip() for n in names)):
        raise PlannerError("bad-option", "--name and every --names entry must be non-empty "
                           f"(got {name!r}" + (f", {list(names)!r}" if names else "") + ").")
    docs = [load_profile(path) for path in paths]
    hosts = [doc["host"] for doc in docs]
    distinct = len(set(hosts)) == len(hosts)  # workers of one machine share a host name
    nodes: list[NodeSpec] = []
    comm_links = []
    seen: dict[str, int] = {}
    for i, (path, doc) in enumerate(zip(paths, docs, strict=True)):
        cuda = [d for d in doc["devices"] if d["kind"] == "cuda"]
        devices = cuda or [d for d in doc["devices"] if d["kind"] == "cpu"]
        if not devices:
            raise PlannerError("bad-profile", f"Profile {str(path)!r} measured no device.",
                               ["profile again with `planner profile`"])
        host = doc["host"]
        node_name = names[i] if names else host
        seen[node_name] = seen.get(node_name, 0) + 1
        if seen[node_name] > 1:
            node_name = f"{node_name}-{seen[node_name] - 1}"
        first = devices[0]
        kinds = sorted({d.get("name", "?") for d in devices})
        if len(kinds) > 1:  # a node is one device type (the cluster model's unit)
            raise PlannerError("bad-profile", f"Profile {str(path)!r} measured different "
                               f"devices on one host ({', '.join(kinds)}); a node of the "
                               "cluster has one device type.",
                               ["profile one type at a time (CUDA_VISIBLE_DEVICES) and "
                                "merge the profiles as separate nodes"])
        base = _base(first)
        source = f"{Path(path).name} ({host}, {doc['timestamp']})"
        comm = doc.get("communication")
        comm = comm if comm and comm.get("device") == first["kind"] else None
        device = dataclasses.replace(base, name=f"{base.name}@{node_name}",
                                     measured=_measured(first, source, comm))
        intra = _link(comm, base.intra_link)
        comm_links.append(intra)
        nodes.append(NodeSpec(name=node_name, host=host if distinct else None,
                              device=device, devices=len(devices), intra_link=intra))
    if network == "measured":
        if not any(doc.get("communication") for doc in docs):
            raise PlannerError("bad-option", "--network measured takes the slowest measured "
                               "all-reduce link, but no profile measured communication "
                               "(they were made with --no-comm).",
                               ["give the network, e.g. --network 100Gbps/5us",
                                "profile again without --no-comm"])
        link = comm_links[0].slowest(*comm_links[1:])
        link = dataclasses.replace(link, name="measured (same machine)")
    else:
        bandwidth, _, latency = network.partition("/")
        link = LinkSpec(name=f"{network} network", bandwidth=parse_bandwidth(bandwidth,
                                                                             "--network"),
                        latency=parse_duration(latency or "5us", "--network"))
    return ClusterSpec(name=name, nodes=tuple(nodes), network=link)
