"""Cluster specs: a YAML file a person writes, a built-in example by name, or an
inline shorthand like `2x8xA100-80G,4x8xV100-32G@100Gbps`.

File format (schema_version 1), human units everywhere:

    schema_version: 1
    name: lab
    network: {bandwidth: 100Gbps, latency: 5us}   # per node, between nodes sharing no group
    groups:                                       # optional: racks, zones, sites
      - {name: site-a, bandwidth: 400Gbps, latency: 2us}
      - {name: rack-1, parent: site-a, bandwidth: 800Gbps, latency: 1us}
    nodes:
      - name: a100            # with count: a100-0, a100-1; or list hosts: [...]
        count: 2
        device: A100-80G-SXM  # a catalog name, or a mapping (custom or `base:` + overrides)
        devices: 8            # devices per node
        intra_link: nvlink3   # optional: a catalog link or {bandwidth, latency}
        nic: 25Gbps           # optional: caps this node's network traffic
        group: rack-1         # optional: the innermost group it is in
        data_loading: 4000 samples/s  # optional: what its data loaders produce (or tokens/s)

Intra-node links are per device (what one device sends); network, group and
NIC bandwidths are per node (what one node sends).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from cost_models import catalog
from cost_models.memory import framework_reserve
from cost_models.yamlfile import CLUSTER_FILE, SEE_FORMAT, Fields, folder_given, read_yaml
from planner.dtypes import DTYPES
from planner.errors import PlannerError, closest
from planner.types import (
    ClusterSpec,
    DeviceSpec,
    GroupSpec,
    LayerTiming,
    LinkSpec,
    MeasuredDevice,
    NodeSpec,
    OptimizerTiming,
)
from planner.types.cluster import DataRate
from planner.units import parse_bandwidth, parse_bytes, parse_duration, parse_flops

SCHEMA_VERSION = 1
EXAMPLES = Path(__file__).with_name("examples")
DEFAULT_NETWORK = LinkSpec(name="100 Gb/s Ethernet (default)", bandwidth=100e9 / 8,
                           latency=5e-6)
# the most nodes a cluster may have: the search sets up per pair of node groups, which
# takes about 7 s at 1,000 nodes (the 4,096-GPU benchmark has 512)
MAX_NODES = 4096
# devices per node: NVLink domains reach 72 (GB200 NVL72); far more is a typo, and the
# search's set-up grows with it before any time limit can stop it
MAX_NODE_DEVICES = 1024
# a data rate: "4000 samples/s", "1.5M tokens/s" (prefixes k, M, G in any case)
_DATA_RATE = re.compile(r"^\s*(?P<sign>-?)(?P<num>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"
                        r"(?P<prefix>(?i:[kmg])?)\s*(?P<unit>(?i:samples?|tokens?))\s*/\s*"
                        r"(?i:s|sec|second)\s*$")
_RATE_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}
_INLINE_ITEM = re.compile(r"^\s*(?:(\d+)\s*[xX]\s*)?(\d+)\s*[xX]\s*([A-Za-z][\w.\-]*)\s*$")


def example_names() -> list[str]:
    return sorted(p.stem for p in EXAMPLES.glob("*.yaml"))


def load_cluster(spec: str) -> ClusterSpec:
    """A cluster from a file path, a built-in example name or an inline shorthand."""
    path = Path(spec)
    if path.suffix in (".yaml", ".yml", ".json") or path.is_file():
        return parse_cluster(read_yaml(path), str(path))
    if spec in example_names():
        return parse_cluster(read_yaml(EXAMPLES / f"{spec}.yaml"), f"example {spec}")
    if any(_INLINE_ITEM.match(item) for item in spec.split("@", 1)[0].split(",")):
        return parse_inline(spec)
    if path.is_dir():
        raise folder_given(path)
    near = closest(spec, example_names())
    hint = f" Did you mean {', '.join(repr(n) for n in near)}?" if near else ""
    raise PlannerError(
        "unknown-cluster",
        f"Cluster {spec!r} is not a file, a built-in example or an inline spec.{hint}",
        ["pass a YAML file (see docs/clusters.md)",
         f"use an example: {', '.join(example_names())}",
         "or write it inline: 2x8xA100-80G,4x8xV100-32G@100Gbps (nodes x devices x type)"])


def parse_inline_network(text: str) -> LinkSpec:
    """The network of an inline spec, after its `@`: `BANDWIDTH[/LATENCY]`, e.g. `100Gbps`,
    `25GB/s/2us` (5 us without a latency)."""
    bandwidth, _, latency = text.partition("/")
    if latency.strip()[:1] in ("s", "S"):  # "25GB/s[/2us]": that '/' is part of the unit
        unit, _, latency = latency.partition("/")
        bandwidth = f"{bandwidth}/{unit}"
    return LinkSpec(name=f"{bandwidth.strip()} network",
                    bandwidth=parse_bandwidth(bandwidth.strip(), "the inline network"),
                    latency=parse_duration(latency.strip() or "5us", "the inline network"))


def parse_inline(spec: str) -> ClusterSpec:
    """`[NODES x] DEVICES x TYPE, ... [@BANDWIDTH[/LATENCY]]`, e.g. `2x8xA100-80G@100Gbps`."""
    body, at, net = spec.partition("@")
    network = parse_inline_network(net) if at else DEFAULT_NETWORK
    nodes: list[NodeSpec] = []
    counters: dict[str, int] = {}
    for item in body.split(","):
        m = _INLINE_ITEM.match(item)
        if not m:
            raise PlannerError("bad-cluster", f"Inline cluster {spec!r}: cannot read {item!r}; "
                               "write NODESxDEVICESxTYPE, e.g. 2x8xA100-80G.",
                               ["run `planner devices` for device type names"])
        count, per_node, kind = int(m[1] or 1), int(m[2]), m[3]
        if count <= 0 or per_node <= 0:
            raise PlannerError("bad-cluster", f"Inline cluster {spec!r}: {item!r} has zero "
                               "nodes or devices; every node needs at least one device.")
        if per_node > MAX_NODE_DEVICES:
            raise too_many_devices(f"Inline cluster {spec!r}: {item!r}", per_node)
        if len(nodes) + count > MAX_NODES:
            raise _too_many(f"Inline cluster {spec!r}", len(nodes) + count)
        device = catalog.device(kind)
        for _ in range(count):
            index = counters.get(device.name, 0)
            counters[device.name] = index + 1
            nodes.append(NodeSpec(name=f"{device.name.lower()}-{index}", device=device,
                                  devices=per_node, intra_link=device.intra_link))
    return ClusterSpec(name=spec, nodes=tuple(nodes), network=network)


def _same_figures(a: DeviceSpec, b: DeviceSpec) -> bool:
    """Whether two devices of one name have the same figures, a file written before the
    catalog gave GEMM figures (`compute_units`, `gemm_efficiency`: both None) agreeing
    with the catalog on all the others."""
    if a == b:
        return True
    older = any(d.compute_units is None and d.gemm_efficiency is None for d in (a, b))
    bare = {"compute_units": None, "gemm_efficiency": None, "sources": {}}
    return older and replace(a, **bare) == replace(b, **bare)


def clashing_device(nodes: Sequence[NodeSpec]) -> str | None:
    """Where two nodes give one device type name different figures (a custom device
    named like a catalog one, say), a sentence naming them; else None. The planner
    keeps a type's figures by its name, so one of them would be priced as the other."""
    first: dict[str, NodeSpec] = {}
    for node in nodes:
        seen = first.setdefault(node.device.name, node)
        if not _same_figures(seen.device, node.device):
            memory = (f" (memory {seen.device.memory / 2**30:g} and "
                      f"{node.device.memory / 2**30:g} GiB)"
                      if seen.device.memory != node.device.memory else "")
            return (f"nodes {seen.name!r} and {node.name!r} both have device type "
                    f"{node.device.name!r}, with different figures{memory}; a custom device "
                    "needs a name of its own")
    return None


def too_many_devices(what: str, devices: int) -> PlannerError:
    """The error for a node of more than `MAX_NODE_DEVICES` (`what` puts them there)."""
    return PlannerError("bad-cluster", f"{what}{' puts ' if what else ''}{devices:,} devices "
                        f"in one node; the planner plans for nodes of up to "
                        f"{MAX_NODE_DEVICES:,}.",
                        ["describe the node as several nodes (a node is what one network "
                         "card serves, its devices linked inside it)"])


def _too_many(what: str, nodes: int) -> PlannerError:
    return PlannerError("bad-cluster", f"{what} has {nodes:,} nodes (or more); the planner "
                        f"plans for clusters of up to {MAX_NODES:,} nodes.",
                        ["describe fewer, larger nodes, or plan for part of the cluster"])


def _link(fields: Fields, key: str, default: LinkSpec | None, *, per: str) -> LinkSpec | None:
    """A link given as a catalog name, a bandwidth string, or {bandwidth, latency, name}."""
    value = fields.get(key)
    if value is None:
        return default
    if isinstance(value, str) and not re.match(r"^\s*-?[0-9.]", value):  # (-5Gbps: a number)
        try:
            return catalog.link(value)
        except PlannerError as exc:
            raise fields.error(exc.message, key, list(exc.remedies)) from None
    if isinstance(value, (str, int, float)):
        bandwidth = fields.parse(key, parse_bandwidth)
        return LinkSpec(name=f"{value} {per}", bandwidth=bandwidth,
                        latency=default.latency if default else 5e-6)
    sub = fields.sub(key, value)
    link = LinkSpec(name=str(sub.get("name", f"{sub.get('bandwidth')} {per}")),
                    bandwidth=sub.parse("bandwidth", parse_bandwidth),
                    latency=sub.parse("latency", parse_duration,
                                      default.latency if default else 5e-6))
    sub.check_unknown()
    return link


def _flops(fields: Fields, key: str) -> dict[str, float] | None:
    """{dtype: FLOP/s} from a mapping like {bf16: 100TFLOPS}; None when absent."""
    value = fields.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise fields.error("must map dtypes to FLOP/s, e.g. {bf16: 100TFLOPS}", key)
    rates = fields.sub(key, value)
    for dtype in value:
        if dtype not in DTYPES:
            raise rates.error(f"unknown dtype {dtype!r}", str(dtype),
                              [f"use one of {', '.join(DTYPES)}"])
    return {dtype: rates.parse(dtype, parse_flops) for dtype in value}


def _flag(fields: Fields, key: str) -> bool:
    value = fields.get(key, False)
    if not isinstance(value, bool):
        raise fields.error(f"must be true or false (got {value!r})", key)
    return value


def _measured(fields: Fields) -> MeasuredDevice:
    times = []
    for i, item in enumerate(fields.get("layer_times", []) or []):
        t = fields.sub("layer_times", item, i)
        memory = t.parse("memory", parse_bytes, -1.0)
        times.append(LayerTiming(
            model=str(t.get("model", "")), layer=str(t.get("layer", required=True)),
            seq_len=t.get("seq_len"), dtype=str(t.get("dtype", "fp32")),
            micro_batch=t.positive_int("micro_batch"), tp=t.positive_int("tp", 1),
            fwd=t.parse("fwd", parse_duration), bwd=t.parse("bwd", parse_duration),
            with_tp_comm=_flag(t, "tp_comm"), memory=None if memory < 0 else memory))
        t.check_unknown()
    optimizer = None
    if fields.get("optimizer") is not None:
        o = fields.sub("optimizer", fields.get("optimizer"))
        optimizer = OptimizerTiming(params=o.parse("params", _positive_count),
                                    seconds=o.parse("seconds", parse_duration))
        o.check_unknown()
    fields.get("name")  # (the device type's name after '@': `_device`)
    slowdown = fields.sub("overlap_slowdown", fields.get("overlap_slowdown", {}))
    measured = MeasuredDevice(
        matmul_flops=_flops(fields, "matmul_flops") or {},
        memory_bandwidth=fields.parse("memory_bandwidth", parse_bandwidth, 0.0) or None,
        layer_times=tuple(times), optimizer=optimizer, source=str(fields.get("source", "")),
        compute_slowdown=slowdown.parse("compute", _slowdown, 0.0),
        sync_slowdown=slowdown.parse("sync", _slowdown, 0.0))
    slowdown.check_unknown()
    fields.check_unknown()
    return measured


def _slowdown(value: Any) -> float:
    """A measured slowdown (`MeasuredDevice.compute_slowdown`): a fraction, 0 or more."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            0 <= value < math.inf):
        raise PlannerError("bad-cluster", f"must be a number, 0 or more (got {value!r}): how "
                           "much longer it takes, 0.25 for a quarter")
    return float(value)


def parse_data_rate(fields: Fields, key: str, node_name: str) -> DataRate | None:
    """An input rate (`data_loading`, `input_rate`): samples or tokens per second, above
    zero; None when absent. Its errors name the field and the node."""
    value = fields.get(key)
    if value is None:
        return None
    match = _DATA_RATE.match(str(value)) if isinstance(value, str) else None
    examples = ["e.g. 4000 samples/s, or 2M tokens/s (tokens count at the training's "
                "sequence length per sample)"]
    if match is None:
        raise fields.error(f"must be a rate in samples/s or tokens/s for node {node_name!r} "
                           f"(got {value!r})", key, examples)
    rate = float(match["num"]) * _RATE_PREFIX[match["prefix"].lower()]
    if match["sign"] or not 0 < rate < math.inf:
        raise fields.error(f"must be a finite rate above zero for node {node_name!r} (got "
                           f"{value!r}); leave the field out where nothing limits it", key,
                           examples)
    unit = "tokens" if match["unit"].lower().startswith("token") else "samples"
    return DataRate(per_second=rate, unit=unit)


def _positive_count(value: Any) -> float:
    """A count of parameters: a positive number (1.3e9; YAML reads that as text)."""
    try:
        count = float(value) if isinstance(value, int | float | str) else math.nan
    except ValueError:
        count = math.nan
    if isinstance(value, bool) or not 0 < count < math.inf:
        raise PlannerError("bad-cluster", f"must be a positive number (got {value!r})")
    return count


def _device(fields: Fields, node_name: str) -> DeviceSpec:
    value = fields.get("device", required=True)
    if isinstance(value, str):
        try:
            device = catalog.device(value)
        except PlannerError as exc:
            raise fields.error(exc.message, "device", list(exc.remedies)) from None
    elif not isinstance(value, dict):
        raise fields.error(f"must be a catalog device name (like V100-16G) or a mapping for "
                           f"a custom device (got {type(value).__name__} {value!r})", "device",
                           ["run `planner devices` for the catalog's names"])
    else:
        sub = fields.sub("device", value)
        base = sub.get("base")
        try:
            device = catalog.device(str(base)) if base else None
        except PlannerError as exc:
            raise sub.error(exc.message, "base", list(exc.remedies)) from None
        peak = {**(device.peak_flops if device else {}), **(_flops(sub, "peak_flops") or {})}
        if "fp32" not in peak:
            raise sub.error("a custom device needs peak_flops with an fp32 rate (dtypes "
                            "without their own rate run at it), or a catalog `base`",
                            "peak_flops" if "peak_flops" in sub.data else None,
                            ["e.g. peak_flops: {fp32: 25TFLOPS, bf16: 100TFLOPS}"])
        memory = sub.parse("memory", parse_bytes, device.memory if device else None)
        if memory <= 0:
            raise sub.error(f"must be positive (got {sub.data['memory']!r})", "memory")
        name = str(sub.get("name", base or "", required=device is None))
        _one_line(sub, "name", name)
        default_link = device.intra_link if device else catalog.link("pcie4")
        inherited = device.compute_units if device else None
        units = (sub.positive_int("compute_units", inherited)
                 if "compute_units" in sub.data or inherited else None)
        gemm = sub.get("gemm_efficiency", device.gemm_efficiency if device else None)
        input_rate = parse_data_rate(sub, "input_rate", node_name) or (
            device.input_rate if device else None)
        if gemm is not None and (isinstance(gemm, bool) or not isinstance(gemm, int | float)
                                 or not 0 < gemm <= 1):
            raise sub.error(f"must be a share of the peak in (0, 1] (got {gemm!r})",
                            "gemm_efficiency", ["e.g. gemm_efficiency: 0.8"])
        device = DeviceSpec(
            name=name, vendor=str(sub.get("vendor", device.vendor if device else "custom")),
            memory=memory,
            memory_bandwidth=sub.parse("memory_bandwidth", parse_bandwidth,
                                       device.memory_bandwidth if device else None),
            peak_flops=peak,
            intra_link=_link(sub, "intra_link", default_link, per="per device"),
            sources={**(device.sources if device else {}), "custom": "given in the cluster spec"},
            compute_units=units, gemm_efficiency=None if gemm is None else float(gemm),
            input_rate=input_rate)
        sub.check_unknown()
        reserve = framework_reserve(device)
        if memory <= reserve:
            raise sub.error(f"{_human(memory, _BYTES)} is no more than the "
                            f"{_human(reserve, _BYTES)} the framework keeps on every device "
                            "(CUDA context, allocator)", "memory",
                            ["give the device's memory with its unit, e.g. memory: 24GiB"])
    measured = fields.get("measured")
    if measured is not None:
        sub = fields.sub("measured", measured)
        shared = sub.get("name")  # nodes whose measurements are one type's share its name
        if shared is not None and (not isinstance(shared, str) or not shared.strip()):
            raise sub.error(f"must be a name (got {shared!r})", "name")
        if shared is not None:
            _one_line(sub, "name", shared)
        device = replace(device, name=f"{device.name}@{shared or node_name}",
                         measured=_measured(sub))
    return device


def _groups(top: Fields) -> dict[str, GroupSpec]:
    groups: dict[str, GroupSpec] = {}
    for i, item in enumerate(top.get("groups", []) or []):
        g = top.sub("groups", item, i)
        name = str(g.get("name", required=True))
        if name in groups:
            raise g.error(f"duplicate group name {name!r}", "name")
        link = LinkSpec(name=f"group {name}", bandwidth=g.parse("bandwidth", parse_bandwidth),
                        latency=g.parse("latency", parse_duration, 5e-6))
        parent = g.get("parent")
        groups[name] = GroupSpec(name=name, link=link, parent=str(parent) if parent else None)
        g.check_unknown()
    for name, group in groups.items():
        seen = {name}
        parent = group.parent
        while parent is not None:
            if parent not in groups:
                raise top.error(f"group {name!r} has unknown parent {parent!r}", "groups")
            if parent in seen:
                raise top.error(f"groups {sorted(seen)} form a cycle of parents", "groups")
            seen.add(parent)
            parent = groups[parent].parent
    return groups


def _chain(groups: dict[str, GroupSpec], innermost: str | None) -> tuple[str, ...]:
    chain: list[str] = []
    while innermost is not None:
        chain.insert(0, innermost)
        innermost = groups[innermost].parent
    return tuple(chain)


def parse_cluster(data: Any, source: str) -> ClusterSpec:
    """A validated ClusterSpec from parsed YAML; errors name the file, line and field."""
    if data is None:  # (no YAML value: nothing, or only comments)
        raise PlannerError("bad-cluster", f"{source} is empty; {CLUSTER_FILE}.", [SEE_FORMAT])
    top = Fields(data, source)
    version = top.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise top.error(f"schema_version {version!r} is not supported (this planner reads "
                        f"version {SCHEMA_VERSION})", "schema_version",
                        ["write the file for schema_version 1 (see docs/clusters.md)"])
    top.check_unknown("schema_version", "name", "network", "groups", "nodes")
    groups = _groups(top)
    items = top.get("nodes", required=True)
    if not isinstance(items, list) or not items:
        raise top.error("must be a non-empty list of node entries", "nodes")
    nodes: list[NodeSpec] = []
    hosts_seen: dict[str, str] = {}
    for i, item in enumerate(items):
        f = top.sub("nodes", item, i)
        f.check_unknown("name", "count", "hosts", "device", "devices", "intra_link", "nic",
                        "group", "measured", "data_loading")
        hosts = f.get("hosts")
        if hosts is not None and (not isinstance(hosts, list) or not hosts):
            raise f.error("must be a non-empty list of host names", "hosts")
        count = len(hosts) if hosts else f.positive_int("count", 1)
        if hosts and f.get("count") is not None and f.positive_int("count") != count:
            raise f.error(f"gives {f.get('count')} nodes but lists {count} hosts", "count",
                          ["drop count: a hosts list makes one node per host"])
        if len(nodes) + count > MAX_NODES:
            raise f.error(_too_many("the cluster", len(nodes) + count).message,
                          "hosts" if hosts else "count")
        base = str(f.get("name", "" if hosts else None) or "") or None
        if base is None and not hosts:
            raise f.error("is missing field 'name' (or a hosts list)")
        for text, key in ((base, "name"), *((str(h), "hosts") for h in hosts or [])):
            _one_line(f, key, text)
        devices = f.positive_int("devices")
        if devices > MAX_NODE_DEVICES:
            raise f.error(too_many_devices("", devices).message, "devices")
        group = f.get("group")
        if group is not None and group not in groups:
            raise f.error(f"unknown group {group!r}", "group",
                          [f"define it under groups: ({', '.join(groups) or 'none defined'})"])
        nic = _link(f, "nic", None, per="per node")
        for k in range(count):
            host = str(hosts[k]) if hosts else None
            name = (f"{base}-{k}" if base and count > 1 else base) or host
            if host is not None and host in hosts_seen:
                raise f.error(f"host {host!r} is listed twice (also in {hosts_seen[host]})",
                              "hosts", ["each host can appear once"])
            if host is not None:
                hosts_seen[host] = f.where("hosts")
            device = _device(f, name)
            nodes.append(NodeSpec(
                name=name, host=host, device=device, devices=devices,
                intra_link=_link(f, "intra_link", device.intra_link, per="per device"),
                nic=nic, groups=_chain(groups, group),
                data_loading=parse_data_rate(f, "data_loading", name)))
    names = [n.name for n in nodes]
    duplicates = sorted(n for n, times in Counter(names).items() if times > 1)
    if duplicates:
        raise top.error(f"node name {duplicates[0]!r} is used twice", "nodes",
                        ["give each node entry its own name"])
    if (clash := clashing_device(nodes)) is not None:
        raise top.error(clash, "nodes", ["name the custom device, e.g. name: A100-80G-custom"])
    network = _link(top, "network", None, per="per node")
    if network is None:
        if len(nodes) > 1:
            raise top.error("is missing field 'network' (the link between nodes)", None,
                            ["add e.g. network: {bandwidth: 100Gbps, latency: 5us}"])
        network = DEFAULT_NETWORK
    name = str(top.get("name", Path(source).stem))
    _one_line(top, "name", name)
    return ClusterSpec(name=name, nodes=tuple(nodes), network=network,
                       groups=tuple(groups.values()))


def _one_line(fields: Fields, key: str, text: str | None) -> None:
    """Names go into launch scripts and READMEs: one line of printable text."""
    if text and not text.isprintable():
        raise fields.error(f"{text!r} has a line break or another control character", key,
                           ["write it on one line"])


def _human(value: float, units: tuple[tuple[str, float], ...]) -> str:
    for unit, scale in units:
        if value >= scale:
            return f"{value / scale:.12g}{unit}"
    return f"{value / units[-1][1]:.12g}{units[-1][0]}"


_RATE = (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3), ("B/s", 1.0))
_BYTES = (("TiB", 2.0**40), ("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10), ("B", 1.0))
_TIME = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9))
_FLOPS = (("PFLOPS", 1e15), ("TFLOPS", 1e12), ("GFLOPS", 1e9), ("MFLOPS", 1e6), ("FLOPS", 1.0))


def _data_rate_text(rate: DataRate) -> str:
    return f"{rate.per_second:.12g} {rate.unit}/s"


def _link_dict(link: LinkSpec) -> str | dict[str, Any]:
    for key, known in catalog.load_catalog().links.items():
        if known == link:
            return key
    return {"name": link.name, "bandwidth": _human(link.bandwidth, _RATE),
            "latency": _human(link.latency, _TIME)}


def _device_dict(device: DeviceSpec) -> str | dict[str, Any]:
    base_name = device.name.split("@")[0]
    try:
        base = catalog.device(base_name)
    except PlannerError:
        base = None
    bare = replace(device, name=base_name, measured=None)
    if base is not None and bare == base:
        return base.name
    gemm = {key: getattr(device, key) for key in ("compute_units", "gemm_efficiency")
            if getattr(device, key) is not None}
    if device.input_rate is not None:
        gemm["input_rate"] = _data_rate_text(device.input_rate)
    return {"name": base_name, "vendor": device.vendor,
            "memory": _human(device.memory, _BYTES),
            "memory_bandwidth": _human(device.memory_bandwidth, _RATE),
            "peak_flops": {k: _human(v, _FLOPS) for k, v in device.peak_flops.items()},
            "intra_link": _link_dict(device.intra_link), **gemm}


def _timing_dict(t: LayerTiming) -> dict[str, Any]:
    out = {"model": t.model, "layer": t.layer, "seq_len": t.seq_len, "dtype": t.dtype,
           "micro_batch": t.micro_batch, "tp": t.tp, "fwd": _human(t.fwd, _TIME),
           "bwd": _human(t.bwd, _TIME)}
    if t.with_tp_comm:
        out["tp_comm"] = True
    if t.memory is not None:
        out["memory"] = _human(t.memory, _BYTES)
    return out


def _measured_dict(measured: MeasuredDevice, name: str | None = None) -> dict[str, Any]:
    """`name`: the device type's name after '@' where it is not the node's own."""
    out: dict[str, Any] = {"name": name} if name else {}
    out["matmul_flops"] = {k: _human(v, _FLOPS) for k, v in measured.matmul_flops.items()}
    if measured.memory_bandwidth:
        out["memory_bandwidth"] = _human(measured.memory_bandwidth, _RATE)
    if measured.layer_times:
        out["layer_times"] = [_timing_dict(t) for t in measured.layer_times]
    if measured.optimizer is not None:
        out["optimizer"] = {"params": measured.optimizer.params,
                            "seconds": _human(measured.optimizer.seconds, _TIME)}
    if measured.source:
        out["source"] = measured.source
    if measured.compute_slowdown or measured.sync_slowdown:
        out["overlap_slowdown"] = {"compute": measured.compute_slowdown,
                                   "sync": measured.sync_slowdown}
    return out


def cluster_to_dict(cluster: ClusterSpec) -> dict[str, Any]:
    """The cluster as a schema_version 1 mapping (write it with yaml.safe_dump)."""
    nodes = []
    for n in cluster.nodes:
        entry: dict[str, Any] = {"name": n.name}
        if n.host is not None:
            entry["hosts"] = [n.host]
        entry["device"] = _device_dict(n.device)
        entry["devices"] = n.devices
        if n.intra_link != n.device.intra_link:
            entry["intra_link"] = _link_dict(n.intra_link)
        if n.nic is not None:
            entry["nic"] = _link_dict(n.nic)
        if n.groups:
            entry["group"] = n.groups[-1]
        if n.data_loading is not None:
            entry["data_loading"] = _data_rate_text(n.data_loading)
        if n.device.measured is not None:
            shared = n.device.name.partition("@")[2]
            entry["measured"] = _measured_dict(n.device.measured,
                                               shared if shared != n.name else None)
        nodes.append(entry)
    out: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "name": cluster.name,
                           "network": _link_dict(cluster.network)}
    if cluster.groups:
        out["groups"] = [{"name": g.name, **({"parent": g.parent} if g.parent else {}),
                          "bandwidth": _human(g.link.bandwidth, _RATE),
                          "latency": _human(g.link.latency, _TIME)} for g in cluster.groups]
    out["nodes"] = nodes
    return out
