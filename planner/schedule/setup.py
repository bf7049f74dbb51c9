"""What `planner schedule` works on, from its inputs: the jobs, the machines, where
throughputs come from; and what it hands back: the schedule as a JSON document, each
job's allocation now, its plan on those devices and the files that launch it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.errors import PlannerError
from planner.schedule.gavel import read_matrix
from planner.schedule.jobs import JobsFile
from planner.schedule.pool import Pool, pool_from_cluster, uniform_pool, with_resources
from planner.schedule.render import clock
from planner.schedule.rounding import Placement
from planner.schedule.simulate import Settings, Simulation
from planner.schedule.throughput import (
    ByJob,
    MatrixThroughputs,
    PredictedThroughputs,
    match_workers,
)
from planner.types import ClusterSpec, Plan

SCHEMA_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class Setup:
    jobs_file: JobsFile
    pool: Pool
    throughputs: ByJob


def parse_gpus(text: str, per_machine: int) -> Pool:
    """'v100=36,p100=36,k80=36': devices per type (names the catalog need not know, as
    a throughput matrix names them), on machines of `per_machine` devices."""
    counts: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        kind, sep, count = part.partition("=")
        if not sep or not kind.strip() or not count.strip().isdigit() or int(count) < 1:
            raise PlannerError("bad-option", f"--gpus {text!r}: {part!r} is not TYPE=COUNT "
                               "(e.g. v100=36,p100=36,k80=36).")
        if kind.strip() in counts:
            raise PlannerError("bad-option", f"--gpus {text!r} names {kind.strip()} twice.")
        counts[kind.strip()] = int(count)
    return uniform_pool(counts, per_machine)


def load_setup(jobs_file: JobsFile, *, cluster: ClusterSpec | None, gpus: Pool | None,
               matrix_path: Path | None, time_limit: float) -> Setup:
    """The pool (from `cluster` with the file's host resources, or from `gpus`) and the
    throughput sources: the matrix (`matrix_path`, else the file's), which profile jobs
    need; the planner, on `cluster` (none with `gpus`), which model jobs need."""
    if (cluster is None) == (gpus is None):
        raise PlannerError("bad-option", ("Give the cluster once" if cluster else
                                          "Give the cluster") + ": --cluster (a file, "
                           "example or inline spec) or --gpus TYPE=COUNT,...")
    pool = (with_resources(gpus, jobs_file.resources) if gpus is not None
            else pool_from_cluster(cluster, jobs_file.resources))
    path = matrix_path or jobs_file.throughputs
    profiled = next((j for j in jobs_file.jobs if j.profile is not None), None)
    if profiled is not None and path is None:
        raise PlannerError("bad-jobs", f"Job {profiled.name} gives a profile, which is read "
                           "from a throughput matrix, and none is given.",
                           ["add `throughputs: FILE` to the jobs file, or pass "
                            "--throughputs FILE (Gavel's format)"])
    measured = None
    if path is not None:
        matrix = read_matrix(path)
        workers = match_workers(list(pool.capacity()), matrix)
        if not workers:
            raise PlannerError("bad-throughputs", f"No device type of the cluster "
                               f"({', '.join(pool.capacity())}) is a worker type of "
                               f"{matrix.source} ({', '.join(matrix.worker_types)}).",
                               ["name the cluster's types after the matrix's, e.g. --gpus "
                                + ",".join(f"{w}=8" for w in matrix.worker_types)])
        measured = MatrixThroughputs(matrix, workers)
    modelled = next((j for j in jobs_file.jobs if j.model is not None), None)
    if modelled is not None and cluster is None:
        raise PlannerError("bad-option", f"Job {modelled.name} is priced by the planner, "
                           "which needs a cluster of catalog devices, not --gpus.",
                           ["pass --cluster (a file, example or inline spec)"])
    predicted = (PredictedThroughputs(cluster, time_limit=time_limit)
                 if cluster is not None else None)
    return Setup(jobs_file=jobs_file, pool=pool, throughputs=ByJob(measured, predicted))


def starting_now(simulation: Simulation) -> tuple[Placement, ...]:
    """The placements of the round at time 0: what runs now (none if the first round is
    later: no job has arrived yet)."""
    first = simulation.rounds[0] if simulation.rounds else None
    return first.placements if first is not None and first.start <= 0 else ()


def launch_hosts(plan: Plan, placement: Placement) -> dict[str, Any]:
    """Host entries that point each plan node's devices at the machine's devices the
    placement holds: the plan numbers a node's devices from 0, the machine may have given
    the job devices 4-7, so CUDA_VISIBLE_DEVICES lists those (for torchrun's scripts;
    under SLURM, SLURM assigns the devices)."""
    from planner.launch import HostEntry
    from planner.runtime.layout import rank_layout

    held = dict(placement.devices)
    hosts = {}
    for node in rank_layout(plan).nodes:
        physical = [held[node.name][i] for i in node.devices]
        moved = physical != list(node.devices)
        hosts[node.name] = HostEntry(host=node.host or node.name, env={
            "CUDA_VISIBLE_DEVICES": ",".join(map(str, physical))} if moved else {})
    return hosts


def schedule_document(simulation: Simulation, setup: Setup, settings: Settings,
                      plans: Mapping[str, Plan | None]) -> dict[str, Any]:
    """The schedule as JSON-ready data (schema_version 1): settings, metrics, each job
    (its outcome, its allocation now and its plan's step time), every round."""
    now = {job: p for p in starting_now(simulation) for job in p.option.jobs}
    outcome = {o.name: o for o in simulation.outcomes}
    jobs = []
    for job in setup.jobs_file.jobs:
        o = outcome[job.name]
        placement = now.get(job.name)
        plan = plans.get(job.name)
        jobs.append({
            "name": job.name, "trains": job.workload, "steps": job.steps,
            "arrival": job.arrival, "deadline": job.deadline, "weight": job.weight,
            "min_devices": job.min_devices, "max_devices": job.max_devices,
            "now": None if placement is None else _placement(placement),
            "plan": None if plan is None else {
                "step_time": plan.prediction.step_time,
                "devices": sum(len(s.devices.devices) for p in plan.pipelines
                               for s in p.stages)},
            "start": o.start, "finish": o.finish, "completion_time": o.jct,
            "restarts": o.restarts, "deadline_met": o.deadline_met})
    return {
        "kind": "schedule", "schema_version": SCHEMA_VERSION, "policy": simulation.policy,
        "cluster": setup.pool.name, "devices": setup.pool.capacity(),
        "settings": {"round_length": settings.round_length,
                     "checkpoint": settings.checkpoint, "restore": settings.restore},
        "metrics": metrics_dict(simulation),
        "jobs": jobs,
        "rounds": [{"start": r.start, "length": r.length,
                    "placements": [_placement(p) for p in r.placements]}
                   for r in simulation.rounds]}


def metrics_dict(simulation: Simulation) -> dict[str, Any]:
    """The metrics as JSON-ready data (an average of no finished job: null)."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else v)
            for k, v in simulation.metrics.as_dict().items()}


def _placement(placement: Placement) -> dict[str, Any]:
    return {"jobs": list(placement.option.jobs), "shape": placement.option.shape.label,
            "devices": {machine: list(indices) for machine, indices in placement.devices}}


def summary_line(simulation: Simulation) -> str:
    m = simulation.metrics
    jct = "-" if math.isnan(m.average_jct) else clock(m.average_jct)
    return (f"{simulation.policy}: average completion time {jct}, makespan "
            f"{clock(m.makespan)}, utilization {m.utilization:.0%}, Jain's index "
            f"{m.jain:.3f}, {m.finished} of {m.finished + m.unfinished} jobs finished")
