"""`planner schedule`'s policies on Gavel's published traces and throughputs, beside the
baselines (Gavel-style max-min fairness and FIFO), and how long one round takes.

    python benchmarks/schedule.py                 # writes the "schedule" section
    python benchmarks/schedule.py --jobs 100 --traces b436b2 --no-write   # a quick look

Data: ../shared/data/gavel (Gavel's simulation_throughputs.json and its Philly-derived
msr traces, MIT license). Cluster: 36 V100 + 36 P100 + 36 K80 in servers of 4, as in
Gavel's simulations; rounds of 6 minutes; 30 s to checkpoint and 30 s to restore a job
on every start, resume or move. Workload: every msr-seed0 trace of 2,000 jobs, its first
`--jobs` jobs (in arrival order) whose job type and size the matrix has (the others, jobs
of 16 and more GPUs or of sizes the matrix lacks, are left out and counted), unless their
load (`offered_load`) is 1 or more: work then arrives faster than even a cluster of the
fastest devices could do it, the queue and every policy's completion times grow with the
length of the trace, and the average says nothing (Gavel, too, measures below
saturation). Every job runs to completion.

Targets (issue 49): the best policy's average job completion time at least 1.2x better
than the Gavel-style max-min fairness baseline's; one round's allocation at most 1 s at
100 active jobs on 1,000 GPUs.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from results import table, write_section

from planner.schedule.gavel import Matrix, read_matrix, read_trace
from planner.schedule.jobs import Job
from planner.schedule.options import Catalog
from planner.schedule.policies import POLICIES, Policy
from planner.schedule.pool import uniform_pool
from planner.schedule.rounding import place_round
from planner.schedule.simulate import Settings, Simulation, build_problem, simulate
from planner.schedule.throughput import MatrixThroughputs, match_workers

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "gavel"
TRACES = ("11cb48", "6214e9", "6c71a0", "b436b2", "ee9e8c")  # the 2,000-job msr traces
CLUSTER = {"v100": 36, "p100": 36, "k80": 36}
LARGE = {"v100": 336, "p100": 336, "k80": 328}  # 1,000 GPUs, for the round timing
PER_MACHINE = 4
SETTINGS = Settings(round_length=360.0, checkpoint=30.0, restore=30.0)
BASELINE = "gavel"
NOTES = """
Cluster: 36 V100 + 36 P100 + 36 K80 in servers of 4, as in Gavel's simulations.
Throughputs: Gavel's `simulation_throughputs.json` (a job spread over servers runs at its
`_unconsolidated` figure; a job spanning two types adds each device's share of its spread
figure; co-located pairs run at their measured figures). Rounds of 6 minutes, 30 s to
checkpoint and 30 s to restore on every start, resume or move. Workload: the first jobs of
each 2,000-job msr-seed0 trace (Philly-derived) whose type and size the matrix has,
arriving as the trace says, all run to completion. Load: the device-time they need at
their fastest type's rate over the cluster's devices across their arrivals (above 1, work
arrives faster than even 108 of the fastest devices could do it). Baselines, implemented
from the papers' descriptions: `gavel` (heterogeneity-aware max-min fairness: Gavel's
program with its throughput normalisation, each job on one type at its size, Gavel's
priority rounds) and `fifo` (arrival order, fastest type with room, never preempted).
`min-jct, one type, no sharing` is min-jct with the baseline's options: what the
objective alone buys. Jain's index is over each job's (steps / fastest rate) / JCT.
Round: the policy's decision in each round of the simulation (wall time on this shared
machine, two simulations at once).
""".strip().replace("\n", " ") + "\n"


def ablation() -> Policy:
    """min-jct with Gavel's options only (one type, no sharing): what the policy alone
    buys, apart from spanning types and co-location."""
    return dataclasses.replace(POLICIES["min-jct"], name="min-jct, one type, no sharing",
                               span=False, colocate=False)


def policies() -> list[Policy]:
    return [*POLICIES.values(), ablation()]


def load_data() -> Matrix:
    if not (DATA / "simulation_throughputs.json").is_file():
        sys.exit(f"error: Gavel's data is not at {DATA} (simulation_throughputs.json and "
                 "traces/msr-seed0/); it is expected beside the project, in "
                 "../shared/data/gavel.")
    return read_matrix(DATA / "simulation_throughputs.json")


def workload(matrix: Matrix, trace: str, count: int) -> tuple[list[Job], int]:
    """The first `count` jobs of the trace the matrix has figures for, and how many
    jobs before the last of them it had none for."""
    jobs = read_trace(DATA / "traces" / "msr-seed0" / f"{trace}.trace")
    kept, left_out = [], 0
    for job in sorted(jobs, key=lambda j: j.arrival):
        if len(kept) == count:
            break
        if ("v100", job.profile, job.min_devices, False) in matrix.alone:
            kept.append(job)
        else:
            left_out += 1
    return kept, left_out


def offered_load(matrix: Matrix, jobs: list[Job]) -> float:
    """The device-time the jobs need at their fastest type's rate over the devices there
    are across their arrivals: above 1, work arrives faster than even a cluster of the
    fastest type could do it."""
    def best(job: Job) -> float:
        return max(matrix.alone.get((w, job.profile, job.min_devices, False), 0.0)
                   for w in CLUSTER)

    work = sum(job.steps / best(job) * job.min_devices for job in jobs)
    span = max(j.arrival for j in jobs) - min(j.arrival for j in jobs)
    return work / (span * sum(CLUSTER.values()))


def run(trace: str, count: int, policy: Policy) -> tuple[str, str, Simulation, int, float]:
    matrix = load_data()
    jobs, left_out = workload(matrix, trace, count)
    pool = uniform_pool(CLUSTER, PER_MACHINE)
    rates = MatrixThroughputs(matrix, match_workers(list(CLUSTER), matrix))
    start = time.perf_counter()
    sim = simulate(jobs, pool, rates, policy, SETTINGS)
    return trace, policy.name, sim, left_out, time.perf_counter() - start


def round_time(matrix: Matrix, policy: Policy, jobs: list[Job]) -> float:
    """Seconds for one round's allocation of `jobs` (all active) on 1,000 GPUs: options
    priced, the policy's program solved, the placement rounded."""
    pool = uniform_pool(LARGE, PER_MACHINE)
    rates = MatrixThroughputs(matrix, match_workers(list(LARGE), matrix))
    start = time.perf_counter()
    catalog = Catalog(pool, rates, span=policy.span, colocate=policy.colocate)
    active = {job.name: dataclasses.replace(job, arrival=0.0) for job in jobs}
    problem = build_problem(active, {n: float(j.steps) for n, j in active.items()}, catalog,
                            3600.0, pool.capacity())
    shares = policy.shares(problem) if policy.shares is not None else {}
    place_round(pool, problem, shares, rounding=policy.rounding, received={}, previous={},
                throughputs=rates,
                switch=(SETTINGS.checkpoint + SETTINGS.restore) / SETTINGS.round_length)
    return time.perf_counter() - start


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", nargs="+", default=list(TRACES))
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    matrix = load_data()
    timing_jobs, _ = workload(matrix, TRACES[0], 100)
    timing = {}
    for policy in policies():  # (one at a time, nothing else running in this process)
        timing[policy.name] = sorted(round_time(matrix, policy, timing_jobs) for _ in range(3))
        print(f"round of 100 jobs on 1,000 GPUs, {policy.name}: "
              f"{timing[policy.name][1]:.3f} s", flush=True)
    loads = {trace: offered_load(matrix, workload(matrix, trace, args.jobs)[0])
             for trace in args.traces}
    requested = tuple(args.traces)
    args.skipped = [t for t in args.traces if loads[t] >= 1]
    args.traces = [t for t in args.traces if loads[t] < 1]
    print("loads: " + ", ".join(f"{t} {v:.2f}" for t, v in loads.items()), flush=True)
    results: dict[tuple[str, str], tuple[Simulation, int, float]] = {}
    with ProcessPoolExecutor(args.processes) as pool:
        futures = [pool.submit(run, trace, args.jobs, policy)
                   for trace in args.traces for policy in policies()]
        for future in futures:
            trace, name, sim, left_out, wall = future.result()
            results[(trace, name)] = (sim, left_out, wall)
            m = sim.metrics
            print(f"{trace} {name}: average JCT {hours(m.average_jct)}, makespan "
                  f"{hours(m.makespan)}, utilization {m.utilization:.2f}, Jain {m.jain:.3f}, "
                  f"{len(sim.rounds)} rounds in {wall:.0f} s", flush=True)
    body = report(args, results, timing)
    print(body)
    if not args.no_write:
        command = "python benchmarks/schedule.py" + (
            f" --jobs {args.jobs}" if args.jobs != 300 else "") + (
            f" --traces {' '.join(requested)}" if requested != TRACES else "")
        write_section("schedule", command, body)


def report(args: argparse.Namespace, results: dict, timing: dict) -> str:
    rows = []
    ratios: dict[str, list[float]] = {}
    matrix = load_data()
    loads = {trace: offered_load(matrix, workload(matrix, trace, args.jobs)[0])
             for trace in args.traces}
    for trace in args.traces:
        base = results[(trace, BASELINE)][0].metrics.average_jct
        for policy in policies():
            sim, left_out, _ = results[(trace, policy.name)]
            m = sim.metrics
            ratio = base / m.average_jct
            ratios.setdefault(policy.name, []).append(ratio)
            decide = [r.decide_seconds for r in sim.rounds if r.decide_seconds > 0]
            rows.append(f"| {trace} ({args.jobs} jobs, {left_out} left out; load "
                        f"{loads[trace]:.2f}) | {policy.name}"
                        f"{' (baseline)' if policy.baseline else ''} | "
                        f"{hours(m.average_jct)} | {ratio:.2f}x | {hours(m.makespan)} | "
                        f"{m.utilization:.0%} | {m.jain:.3f} | "
                        f"{statistics.median(decide):.3f} s / {max(decide):.3f} s |")
    means = [f"| {name} | " + " | ".join(f"{r:.2f}x" for r in ratios[name])
             + f" | {statistics.geometric_mean(ratios[name]):.2f}x |"
             for name in ratios]
    best = max((n for n in ratios if n != BASELINE),
               key=lambda n: statistics.geometric_mean(ratios[n]))
    best_ratio = statistics.geometric_mean(ratios[best])
    timings = [f"| {name} | {times[1]:.3f} s | {times[-1]:.3f} s |"
               for name, times in timing.items()]
    slowest = max(t[-1] for t in timing.values())
    return (
        "Average job completion time (JCT), the baseline's over the policy's (above 1: "
        "better than the baseline), per trace and as a geometric mean:\n\n"
        + table(["policy", *(f"{t} (load {loads[t]:.2f})" for t in args.traces),
                 "geometric mean"], means) + "\n"
        + f"Best policy: **{best}**, average JCT {best_ratio:.2f}x better than the "
        f"Gavel-style max-min fairness baseline (target 1.2x: "
        f"{'met' if best_ratio >= 1.2 else 'not met'}).\n\n"
        + table(["trace", "policy", "average JCT", "baseline JCT / JCT", "makespan",
                 "utilization", "Jain (1/slowdown)", "round: median / max"], rows) + "\n"
        + "One round's allocation with 100 active jobs (the first 100 of trace "
        f"{TRACES[0]}) on 1,000 GPUs (336 V100, 336 P100, 328 K80 in servers of 4): "
        "every job's options priced, the policy's program solved, the shares rounded to "
        "a placement; median and slowest of 3 runs:\n\n"
        + table(["policy", "median", "slowest"], timings) + "\n"
        + f"Slowest round: {slowest:.3f} s (target 1 s: "
        f"{'met' if slowest <= 1.0 else 'not met'}).\n\n"
        + ("Left out, load 1 or more: " + ", ".join(
            f"{t} (load {offered_load(matrix, workload(matrix, t, args.jobs)[0]):.2f})"
            for t in args.skipped) + ".\n\n" if args.skipped else "")
        + NOTES)


if __name__ == "__main__":
    main()
