"""What-if edits: pure functions from a ClusterSpec or TrainingSpec to a changed copy.

    cluster = add_nodes(cluster, "4x8xV100-32G")          # four more 8-GPU V100 nodes
    cluster = remove_nodes(cluster, ["ws"])                # by name, or "2xV100-32G"
    cluster = resize_node(cluster, "a100-1", 4)            # devices per node
    cluster = set_link(cluster, "network", "25Gbps")       # or nic:NODE, intra:NODE|TYPE,
                                                           # group:NAME; BW[/LATENCY]
    training = edit_training(training, global_batch=1024)

Every function validates its input and raises a `PlannerError` naming what is
wrong; none mutates its argument. `parse_assignment` reads the `--link TARGET=BW` and
`--resize NODE=N` forms the CLI takes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Sequence

from cost_models.cluster import MAX_NODE_DEVICES, clashing_device, too_many_devices
from planner.errors import PlannerError, closest
from planner.types import ClusterSpec, LinkSpec, NodeSpec, TrainingSpec
from planner.units import parse_bandwidth, parse_duration

_COUNT_TYPE = re.compile(r"^\s*(\d+)\s*[xX]\s*([A-Za-z][\w.\-]*)\s*$")
LINK_TARGETS = "network, nic:NODE, intra:NODE (or intra:DEVICE-TYPE), group:NAME"


_EDITED = " (edited)"


def _edited(cluster: ClusterSpec, **changes: object) -> ClusterSpec:
    """The cluster with `changes`, its name marked as edited (once), so that plans and
    reports do not show the old name for another cluster."""
    name = cluster.name if cluster.name.endswith(_EDITED) else cluster.name + _EDITED
    return dataclasses.replace(cluster, name=name, **changes)


def _unknown_node(cluster: ClusterSpec, name: str, types: bool = False) -> PlannerError:
    """No node (or, with `types`, device type either) of that name."""
    names = [n.name for n in cluster.nodes]
    kinds = sorted(cluster.device_types()) if types else []
    near = closest(name, names + kinds)
    hint = f" Did you mean {', '.join(repr(n) for n in near)}?" if near else ""
    return PlannerError("unknown-node", f"Cluster {cluster.name} has no node "
                        + ("or device type " if types else "") + f"{name!r}.{hint}",
                        [f"use one of {', '.join(names + kinds)}"])


def add_nodes(cluster: ClusterSpec, spec: str, *, nic: str | None = None,
              group: str | None = None) -> ClusterSpec:
    """Nodes from an inline item (`4x8xV100-32G`, `8xA100-80G` for one node, several
    comma-separated), named `<device type>-<k>` with the next free k."""
    from cost_models.cluster import parse_inline

    if "@" in spec:
        raise PlannerError("bad-value", f"{spec!r}: give only nodes here (NODESxDEVICESxTYPE); "
                           "change the network with a link edit (network=BANDWIDTH).")
    new = parse_inline(spec).nodes
    if group is not None and group not in {g.name for g in cluster.groups}:
        raise PlannerError("bad-value", f"Cluster {cluster.name} has no group {group!r}.",
                           [f"use one of {', '.join(g.name for g in cluster.groups)}"
                            if cluster.groups else "add nodes without a group"])
    chain: tuple[str, ...] = ()
    if group is not None:
        parents = {g.name: g.parent for g in cluster.groups}
        name: str | None = group
        while name is not None:
            chain = (name, *chain)
            name = parents[name]
    nic_link = _link(nic, "the node's NIC", "per node") if nic is not None else None
    taken = {n.name for n in cluster.nodes}
    added: list[NodeSpec] = []
    for node in new:
        base = node.device.name.lower()
        k = 0
        while f"{base}-{k}" in taken:
            k += 1
        taken.add(f"{base}-{k}")
        added.append(dataclasses.replace(node, name=f"{base}-{k}", nic=nic_link, groups=chain))
    if (clash := clashing_device((*cluster.nodes, *added))) is not None:
        raise PlannerError("bad-value", f"Adding {spec!r}: {clash}.",
                           ["add nodes of another type, or rename the custom device in the "
                            "cluster file"])
    return _edited(cluster, nodes=(*cluster.nodes, *added))


def remove_nodes(cluster: ClusterSpec, targets: Sequence[str]) -> ClusterSpec:
    """Without the named nodes; `NxTYPE` removes the last N nodes of that device type."""
    if not targets:
        raise PlannerError("bad-value", "Name the nodes to remove, e.g. v100-3 or 2xV100-32G.")
    nodes = list(cluster.nodes)
    for target in targets:
        m = _COUNT_TYPE.match(target)
        by_name = [n for n in nodes if n.name == target]
        if by_name:
            nodes.remove(by_name[0])
            continue
        if not m:
            raise _unknown_node(dataclasses.replace(cluster, nodes=tuple(nodes)), target)
        count, kind = int(m[1]), m[2].lower()
        if count < 1:
            raise PlannerError("bad-value", f"{target!r} removes no node; give a count of 1 "
                               "or more.")
        of_type = [n for n in nodes if n.device.name.lower() == kind
                   or n.device.name.split("@")[0].lower() == kind]
        if not of_type:
            from cost_models import catalog

            with contextlib.suppress(PlannerError):
                kind = catalog.device(m[2]).name.lower()
            of_type = [n for n in nodes if n.device.name.split("@")[0].lower() == kind]
        if len(of_type) < count:
            types = sorted({n.device.name for n in nodes})
            raise PlannerError("bad-value", f"Cannot remove {count} {m[2]} node(s): the cluster "
                               f"has {len(of_type)}.", [f"device types here: {', '.join(types)}"])
        for node in of_type[len(of_type) - count:]:
            nodes.remove(node)
    if not nodes:
        raise PlannerError("no-devices", "That would remove every node; a cluster needs at "
                           "least one.")
    return _edited(cluster, nodes=tuple(nodes))


def resize_node(cluster: ClusterSpec, name: str, devices: int) -> ClusterSpec:
    """Node `name` (or every node of device type `name`) with `devices` devices."""
    if devices < 1:
        raise PlannerError("bad-value", f"Resizing {name} to {devices} devices: a node needs "
                           "at least one device.")
    if devices > MAX_NODE_DEVICES:
        raise too_many_devices(f"Resizing {name}", devices)
    hits = [n for n in cluster.nodes if n.name == name]
    if not hits:
        hits = [n for n in cluster.nodes if n.device.name.lower() == name.lower()]
    if not hits:
        raise _unknown_node(cluster, name, types=True)
    chosen = {n.name for n in hits}
    return _edited(cluster, nodes=tuple(
        dataclasses.replace(n, devices=devices) if n.name in chosen else n
        for n in cluster.nodes))


def _link(text: str, what: str, per: str, old: LinkSpec | None = None) -> LinkSpec:
    bandwidth, sep, latency = str(text).rpartition("/")
    if not sep or not re.match(r"^\s*[-+]?[0-9.]", latency):  # "100GB/s": the unit's slash
        bandwidth, latency = str(text), ""
    bw = parse_bandwidth(bandwidth.strip(), what)
    lat = (parse_duration(latency.strip(), what) if latency.strip()
           else old.latency if old is not None else 5e-6)
    return LinkSpec(name=f"{bandwidth.strip()} {per}", bandwidth=bw, latency=lat)


def set_link(cluster: ClusterSpec, target: str, value: str) -> ClusterSpec:
    """A link changed to `value` (BANDWIDTH[/LATENCY], e.g. 25Gbps or 200GB/s/2us).

    target: network (between nodes sharing no group), nic:NODE (a node's network
    card), intra:NODE or intra:DEVICE-TYPE (between devices of a node), group:NAME.
    """
    kind, _, name = target.partition(":")
    kind = kind.strip().lower()
    if kind == "network" and not name:
        return _edited(cluster, network=_link(value, "the network", "network",
                                                          cluster.network))
    if kind == "group" and name:
        hits = [g for g in cluster.groups if g.name == name]
        if not hits:
            raise PlannerError("bad-value", f"Cluster {cluster.name} has no group {name!r}.",
                               [f"groups: {', '.join(g.name for g in cluster.groups) or 'none'}"])
        return _edited(cluster, groups=tuple(
            dataclasses.replace(g, link=_link(value, f"group {name}", f"group {name}", g.link))
            if g.name == name else g for g in cluster.groups))
    if kind in ("nic", "intra") and name:
        hits = [n for n in cluster.nodes if n.name == name]
        if not hits and kind == "intra":
            hits = [n for n in cluster.nodes if n.device.name.lower() == name.lower()]
        if not hits:
            raise _unknown_node(cluster, name, types=kind == "intra")
        chosen = {n.name for n in hits}
        nodes = []
        for n in cluster.nodes:
            if n.name in chosen and kind == "nic":
                n = dataclasses.replace(n, nic=_link(value, f"the NIC of {n.name}", "per node",
                                                     n.nic))
            elif n.name in chosen:
                n = dataclasses.replace(n, intra_link=_link(
                    value, f"the intra-node link of {n.name}", "per device", n.intra_link))
            nodes.append(n)
        return _edited(cluster, nodes=tuple(nodes))
    raise PlannerError("bad-value", f"Unknown link {target!r}; name one of {LINK_TARGETS}.",
                       ["e.g. network=25Gbps, nic:ws=10Gbps, intra:a100-0=300GB/s"])


def edit_training(training: TrainingSpec, *, global_batch: int | None = None,
                  seq_len: int | None = None, dtype: str | None = None) -> TrainingSpec:
    """The training setup with the given fields changed (None: unchanged)."""
    from planner.dtypes import canonical_dtype
    from planner.solver.limits import check_global_batch

    changes: dict = {}
    if global_batch is not None:
        check_global_batch(global_batch)
        changes["global_batch"] = global_batch
    if seq_len is not None:
        if seq_len < 1:
            raise PlannerError("bad-value", f"The sequence length (seq-len) must be "
                               f"positive (got {seq_len}).")
        changes["seq_len"] = seq_len
    if dtype is not None:
        changes["dtype"] = canonical_dtype(dtype)
    return dataclasses.replace(training, **changes)


def parse_assignment(text: str, option: str, example: str) -> tuple[str, str]:
    """`KEY=VALUE` -> (KEY, VALUE), with a clear error naming the option and giving an
    example of it."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip() or not value.strip():
        raise PlannerError("bad-option", f"{option} {text!r} must look like KEY=VALUE "
                           f"(e.g. {option} {example}).")
    return key.strip(), value.strip()


def parse_int(text: str, what: str) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise PlannerError("bad-value", f"{what} must be a whole number (got {text!r}).") from None
    return value


def describe_cluster(cluster: ClusterSpec) -> str:
    """`2x8 A100-80G-SXM + 4x8 V100-32G, network 12.5 GB/s`."""
    from planner.units import fmt_rate

    counts: dict[tuple[str, int], int] = {}
    for n in cluster.nodes:
        counts[(n.device.name, n.devices)] = counts.get((n.device.name, n.devices), 0) + 1
    parts = [f"{c}x{d} {name}" for (name, d), c in counts.items()]
    return (f"{' + '.join(parts)} ({cluster.num_devices} devices), network "
            f"{fmt_rate(cluster.network.bandwidth)}")
