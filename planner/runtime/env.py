"""Check that this process's environment is the one the plan expects, before any
collective or allocation.

torchrun (or the launch scripts) set RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK (the node rank), MASTER_ADDR and MASTER_PORT; the
generated scripts also set PLANNER_NODE (the plan node this host plays). Every
mismatch is collected and reported at once as "expected ..., found ..." so a
wrong --nproc-per-node, node rank or host mapping is obvious.

Under torchrun's c10d rendezvous (what the scripts start: `node.py`), torchrun numbers
the nodes in the order they join, so PLANNER_RANKS=plan says the rank is the plan's:
its node's first rank (PLANNER_NODE) plus LOCAL_RANK; RANK and GROUP_RANK are then
torchrun's own and not checked.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from planner.errors import PlannerError
from planner.runtime.layout import Layout, NodeRanks, RankSlot
from planner.types import SCHEMA_VERSION, Plan

_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Placement:
    """This rank's place: its slot in the layout, its node and its torch device."""

    slot: RankSlot
    node: NodeRanks
    device: torch.device
    backend: str  # "gloo" or "nccl"
    notes: tuple[str, ...] = ()


def _int(env: Mapping[str, str], name: str, found: list[str]) -> int | None:
    value = env.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        found.append(f"{name}: expected an integer, found {value!r}")
        return None


def device_token(device_type: str) -> str:
    """The part of a catalog device name a driver's device name contains: "A100" for
    A100-80G-SXM, "RTX4090" for RTX4090, "MI300X" for MI300X."""
    return device_type.split("@")[0].split("-")[0].lower()


def _normal(name: str) -> str:
    return re.sub(r"[\s_-]+", "", name.lower())


def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def validate_environment(plan: Plan, layout: Layout, env: Mapping[str, str], *,
                         cpu: bool = False, check_device_name: bool = True,
                         cuda_count: Callable[[], int] = torch.cuda.device_count,
                         cuda_name: Callable[[int], str] = _cuda_name) -> Placement:
    """This rank's placement, or a PlannerError listing every expected-vs-found mismatch.

    cpu: run every rank on the CPU with gloo whatever the plan's device types (the
         `local` launch target, for trying a plan on one machine).
    """
    if not cpu and len({n.is_cpu for n in layout.nodes}) > 1:
        raise PlannerError(
            "unsupported-plan", "The plan mixes CPU and GPU nodes; the runtime uses one "
            "backend (gloo or nccl) for all ranks.",
            ["pass --cpu to run every rank on the CPU", "exclude the CPU nodes when solving"])
    problems: list[str] = []
    if plan.schema_version != SCHEMA_VERSION:
        problems.append(f"plan schema_version: expected {SCHEMA_VERSION}, found "
                        f"{plan.schema_version}")
    missing = [name for name in _REQUIRED if name not in env]
    if missing:
        raise PlannerError(
            "bad-environment", f"This process was not started by torchrun or a planner launch "
            f"script: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set "
            f"(the plan needs {layout.world_size} ranks on {len(layout.nodes)} node(s)).",
            ["run the scripts `planner launch plan.json --out DIR` writes",
             "or start it with torchrun (see the README those scripts come with)"])
    planned = env.get("PLANNER_RANKS") == "plan"
    if planned and "PLANNER_NODE" not in env:
        problems.append("PLANNER_NODE: expected the plan node this host plays "
                        "(PLANNER_RANKS=plan numbers ranks from it), found none")
    rank = None if planned else _int(env, "RANK", problems)
    world = _int(env, "WORLD_SIZE", problems)
    local = _int(env, "LOCAL_RANK", problems)
    local_world = _int(env, "LOCAL_WORLD_SIZE", problems)
    node_rank = None if planned else _int(env, "GROUP_RANK", problems)
    port = _int(env, "MASTER_PORT", problems)
    if port is not None and not 0 < port < 65536:
        problems.append(f"MASTER_PORT: expected a TCP port (1-65535), found {port}")
    if world is not None and world != layout.world_size:
        problems.append(f"WORLD_SIZE: expected {layout.world_size} (one rank per device the "
                        f"plan uses), found {world}")
    name = env.get("PLANNER_NODE")
    node: NodeRanks | None = None
    if name is not None:
        node = next((n for n in layout.nodes if n.name == name), None)
        if node is None:
            problems.append(f"PLANNER_NODE: expected one of "
                            f"{', '.join(n.name for n in layout.nodes)}, found {name!r}")
    if node is None and node_rank is not None:
        node = layout.nodes[node_rank] if 0 <= node_rank < len(layout.nodes) else None
        if node is None:
            problems.append(f"GROUP_RANK (node rank): expected 0-{len(layout.nodes) - 1}, "
                            f"found {node_rank}")
    if node is None and rank is not None and 0 <= rank < layout.world_size:
        node = layout.node(layout.of(rank).node)
    if node is not None and planned and local is not None and 0 <= local < node.nproc:
        rank = node.first_rank + local
    if node is not None:
        if node_rank is not None and node_rank != node.node_rank:
            problems.append(f"GROUP_RANK (node rank) of node {node.name}: expected "
                            f"{node.node_rank}, found {node_rank}")
        if local_world is not None and local_world != node.nproc:
            problems.append(f"LOCAL_WORLD_SIZE (--nproc-per-node) on node {node.name}: "
                            f"expected {node.nproc}, found {local_world}")
        if local is not None and not 0 <= local < node.nproc:
            problems.append(f"LOCAL_RANK on node {node.name}: expected 0-{node.nproc - 1}, "
                            f"found {local}")
        elif local is not None and rank is not None and rank != node.first_rank + local:
            problems.append(f"RANK of local rank {local} on node {node.name}: expected "
                            f"{node.first_rank + local}, found {rank}")
    device, backend, notes = torch.device("cpu"), "gloo", []
    if node is not None and local is not None and 0 <= local < node.nproc and not problems:
        device, backend, notes = _device(node, local, cpu, check_device_name, cuda_count,
                                         cuda_name, problems)
    if problems:
        who = f"rank {rank}" if rank is not None else "this process"
        raise PlannerError(
            "bad-environment", f"The environment of {who} does not match the plan: "
            + "; ".join(problems) + ".",
            ["start the scripts `planner launch` wrote for this very plan, each on the host "
             "its name says", "check --hosts (which host plays which node) and "
             "CUDA_VISIBLE_DEVICES", "regenerate the scripts if the plan changed"])
    assert node is not None and rank is not None
    return Placement(slot=layout.of(rank), node=node, device=device, backend=backend,
                     notes=tuple(notes))


def _device(node: NodeRanks, local: int, cpu: bool, check_name: bool,
            cuda_count: Callable[[], int], cuda_name: Callable[[int], str],
            problems: list[str]) -> tuple[torch.device, str, list[str]]:
    if cpu or node.is_cpu:
        note = ([f"node {node.name} plans {node.device_type} devices; running on the CPU "
                 "(--cpu)"] if cpu and not node.is_cpu else [])
        return torch.device("cpu"), "gloo", note
    count = cuda_count()
    if count < node.nproc:
        problems.append(f"CUDA devices on node {node.name}: expected {node.nproc} visible "
                        f"({node.device_type}, devices {list(node.devices)}), found {count}")
        return torch.device("cpu"), "gloo", []
    found = cuda_name(local)
    token = device_token(node.device_type)
    if check_name and token not in _normal(found):
        problems.append(f"device type of local rank {local} on node {node.name}: expected "
                        f"{node.device_type}, found {found!r} (pass --ignore-device-type to "
                        "run anyway)")
    return torch.device("cuda", local), "nccl", []
