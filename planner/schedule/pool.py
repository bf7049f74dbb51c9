"""The cluster as the scheduler sees it: machines with devices of one type each, host
CPU cores and memory. From a cluster spec (with the jobs file's host resources), or
from per-type counts (Gavel's clusters, whose device types the catalog may not know)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from planner.errors import PlannerError
from planner.schedule.jobs import HostResources
from planner.types import ClusterSpec


@dataclass(frozen=True, kw_only=True)
class Machine:
    name: str
    device_type: str
    devices: int
    cpus: float = math.inf
    memory: float = math.inf


@dataclass(frozen=True, kw_only=True)
class Pool:
    """Machines in a fixed order: placement walks them in it, so it is deterministic."""

    name: str
    machines: tuple[Machine, ...]

    def capacity(self) -> dict[str, int]:
        """Devices per type, in type order."""
        out: dict[str, int] = {}
        for machine in sorted(self.machines, key=lambda m: m.device_type):
            out[machine.device_type] = out.get(machine.device_type, 0) + machine.devices
        return out

    @property
    def num_devices(self) -> int:
        return sum(m.devices for m in self.machines)

    def machine(self, name: str) -> Machine:
        for machine in self.machines:
            if machine.name == name:
                return machine
        raise PlannerError("unknown-node", f"The cluster {self.name} has no node {name!r}.")


def pool_from_cluster(cluster: ClusterSpec,
                      resources: Mapping[str, HostResources] | None = None) -> Pool:
    """`cluster`'s nodes as machines, with host resources (`with_resources`)."""
    pool = Pool(name=cluster.name, machines=tuple(
        Machine(name=node.name, device_type=node.device.name, devices=node.devices)
        for node in cluster.nodes))
    return with_resources(pool, resources or {})


def with_resources(pool: Pool, resources: Mapping[str, HostResources]) -> Pool:
    """The machines with host resources looked up by machine name, then device type,
    then "default" (none: not limited). A key naming no machine or type is an error: a
    misspelt node would silently leave its limits out."""
    known = ({m.name for m in pool.machines} | {m.device_type for m in pool.machines}
             | {"default"})
    unknown = sorted(set(resources) - known)
    if unknown:
        raise PlannerError("bad-jobs", f"resources.{unknown[0]}: cluster {pool.name} has no "
                           "node or device type of that name.",
                           [f"use a node name, a device type or default "
                            f"({', '.join(sorted(known))})"])
    machines = []
    for machine in pool.machines:
        host = (resources.get(machine.name) or resources.get(machine.device_type)
                or resources.get("default") or HostResources())
        machines.append(dataclasses.replace(machine, cpus=host.cpus, memory=host.memory))
    return Pool(name=pool.name, machines=tuple(machines))


def uniform_pool(counts: Mapping[str, int], per_machine: int) -> Pool:
    """`counts[type]` devices of each type on machines of `per_machine` devices (the last
    one of a type takes what is left), named `<type>-<i>`."""
    if per_machine < 1:
        raise PlannerError("bad-option", f"devices per machine must be at least 1 (got "
                           f"{per_machine}).")
    machines = []
    for kind, count in counts.items():
        for i, start in enumerate(range(0, count, per_machine)):
            machines.append(Machine(name=f"{kind}-{i}", device_type=kind,
                                    devices=min(per_machine, count - start)))
    name = "+".join(f"{count}x{kind}" for kind, count in counts.items())
    return Pool(name=name, machines=tuple(machines))
