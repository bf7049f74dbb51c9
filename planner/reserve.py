"""`planner solve` on the devices no reservation holds (`planner.schedule.ledger`).

The solver numbers a node's devices from 0 up to its count, so a node whose devices
2 and 3 are reserved is solved as a node of its free devices alone, and the plan's
indices are then mapped back to the node's free ones (index 2 of the solve is the
node's third free device): the plan file names the devices it runs on, and its
cluster is the whole cluster again, so that those indices are in range.
"""

from __future__ import annotations

import dataclasses
import getpass
import time
from collections.abc import Mapping
from dataclasses import dataclass

from planner.errors import PlannerError
from planner.schedule.ledger import Ledger, Reservation, free_devices
from planner.types import ClusterSpec, Plan


@dataclass(frozen=True, kw_only=True)
class FreeCluster:
    """The cluster as the solver sees it: each node with free devices, with as many
    devices as it has free; `free` names them, `reserved` counts the devices left out."""

    cluster: ClusterSpec
    free: Mapping[str, tuple[int, ...]]
    reserved: int
    whole_nodes_reserved: frozenset[str]  # (left out: none of their devices is free)

    def still_excluded(self, exclude: tuple[str, ...]) -> tuple[str, ...]:
        """--exclude less the nodes left out as reserved, which the solver's cluster no
        longer has (a name no node has is kept, for the solver's error)."""
        return tuple(name for name in exclude if name not in self.whole_nodes_reserved)


def free_cluster(cluster: ClusterSpec, held: Mapping[str, set[int]]) -> FreeCluster:
    """`cluster` less the devices `held` (by node); an error where none is left."""
    free = free_devices(cluster.nodes, held)
    nodes = tuple(dataclasses.replace(node, devices=len(free[node.name]))
                  for node in cluster.nodes if free[node.name])
    reserved = cluster.num_devices - sum(len(indices) for indices in free.values())
    if not nodes:
        raise PlannerError("all-reserved", f"Every device of cluster {cluster.name} "
                           f"({cluster.num_devices}) is reserved, so there is nothing to "
                           "plan on.", ["run `planner jobs` to see the reservations, and "
                                        "`planner jobs --cancel ID` to end one",
                                        "or plan on another cluster"])
    return FreeCluster(cluster=dataclasses.replace(cluster, nodes=nodes),
                       free={name: indices for name, indices in free.items() if indices},
                       reserved=reserved, whole_nodes_reserved=frozenset(
                           name for name, indices in free.items() if not indices))


def on_real_devices(plan: Plan, free: FreeCluster, cluster: ClusterSpec) -> Plan:
    """`plan`, solved on `free.cluster`, with each stage's device indices those of the
    node's free devices and the whole `cluster` as its cluster."""
    pipelines = tuple(dataclasses.replace(pipeline, stages=tuple(
        dataclasses.replace(stage, devices=dataclasses.replace(stage.devices, devices=tuple(
            free.free[stage.devices.node][index] for index in stage.devices.devices)))
        for stage in pipeline.stages)) for pipeline in plan.pipelines)
    return dataclasses.replace(plan, pipelines=pipelines, cluster=cluster)


def plan_devices(plan: Plan) -> dict[str, list[int]]:
    """The devices `plan` runs on, by node, in order."""
    devices: dict[str, set[int]] = {}
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:
            devices.setdefault(stage.devices.node, set()).update(stage.devices.devices)
    return {node: sorted(indices) for node, indices in devices.items()}


def reserve_plan(book: Ledger, plan: Plan, *, job: str, lasts: float | None) -> Reservation:
    """Reserve `plan`'s devices for `job` for `lasts` seconds from now (None: until
    cancelled), all or nothing (a PlannerError of kind "reserved" where another planner
    holds one of them now)."""
    until = None if lasts is None else time.time() + lasts
    [reservation] = book.reserve(plan.cluster.name, [(job, plan_devices(plan))],
                                 owner=f"{getpass.getuser()} (planner solve)", until=until)
    return reservation
