"""Data-aware packing against naive packing on heavy-tailed sample lengths (issue 51):
the step time and the time devices wait, in the simulator and on the CPU runtime.

    python benchmarks/data_balance.py                    # both parts, writes "data-balance"
    python benchmarks/data_balance.py --simulator-only --no-write   # a quick look
    python benchmarks/data_balance.py --loading          # writes "data-loading"

Data: a synthetic lognormal length distribution (median an eighth of the sequence length,
sigma 1, clipped to [16, seq]; on the CPU runtime median 48 tokens, sigma 1.2, up to 512),
the same samples for both packers. Naive packing takes the samples in order, each
pipeline its plan share, micro-batches of the plan's size, each padded to its own longest
sample; balanced packing (`planner.data.packing.balanced`) shares them out by LPT on
their work and cuts each pipeline's into micro-batches of equal work.

Simulator: the solver's plan for each scenario, every step's packed micro-batches
replayed event by event (`planner.data.steps.replay`: each micro-batch's stage timings
scaled by its tokens, attention's share quadratically). Runtime: `python -m
planner.runtime --cpu --lengths PROFILE --packing MODE` under torchrun on this machine,
gpt-tiny widened (hidden 256, 4 blocks, sequence 512), each rank one thread; the two
packers alternate, the median step time of each run, the median over runs.

Target (issue 51): balanced at least 1.3x faster than naive in both.

Loading (`--loading`, issue 51 item 4): per scenario, the solver's plan on the cluster as
given, then the data loaders of the node it reads most on slowed to half the rate it
reads there (`data_loading`): what that plan would take there (waiting for its input, as `predict`
prices it), and the plan the solver finds for the slowed cluster.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from results import table, write_section

from cost_models.cluster import load_cluster
from cost_models.model import AnalyticalCostModel
from planner.data.loading import plan_feeds
from planner.data.packing import balanced, naive
from planner.data.profile import Sample, lognormal_lengths, profile_json, summarize
from planner.data.steps import plan_rates, replay
from planner.explain import structure
from planner.models import load_model, model_spec
from planner.planfile import write_plan
from planner.solver import SolveOptions, solve
from planner.solver.predict import predict
from planner.trace import trace_loaded, trace_model
from planner.types import TrainingSpec
from planner.types.cluster import DataRate

SCENARIOS = [
    ("llama2-7b", "1x8xA100-40G,1x8xV100-32G@100Gbps", 128, 4096, "fp16",
     "Llama-2 7B, 8x A100-40GB + 8x V100-32GB"),
    ("gpt3-1.3b", "1x8xA100-40G,1x8xV100-16G@100Gbps", 512, 2048, "fp16",
     "GPT-3 1.3B, 8x A100-40GB + 8x V100-16GB"),
    ("llama2-7b", "1x3xA100-80G,1x3xRTX4090,1x2xRTX3090@10Gbps", 64, 4096, "bf16",
     "Llama-2 7B, 3x A100 + 3x RTX 4090 + 2x RTX 3090, 10 Gb/s Ethernet"),
]
STEPS = 50  # simulated steps per scenario, each its own draw of lengths
TARGET = 1.3

# the CPU runtime: gpt-tiny widened so that tokens, not per-kernel overheads, set the time
RUNTIME_MODEL = {"max_positions": 512, "hidden": 256, "heads": 4, "layers": 4}
RUNTIME_SEQ = 512
RUNTIME_LAYOUTS = [  # (label, pipelines, stages, micro-batch size)
    ("2 pipelines of 1 stage (data parallel)", 2, 1, 4),
    ("1 pipeline of 2 stages", 1, 2, 2),
]
RUNTIME_BATCH = 32
RUNTIME_STEPS, RUNTIME_WARMUP, RUNTIME_REPEATS = 12, 2, 3


def lengths_for(seq: int, count: int, rng: random.Random) -> list[int]:
    return lognormal_lengths(count, median=seq / 8, sigma=1.0, low=16, high=seq, rng=rng)


def simulated(scenario: tuple) -> tuple[str, float]:
    name, spec, batch, seq, dtype, label = scenario
    cluster = load_cluster(spec)
    graph = trace_model(model_spec(name), seq_len=seq, dtype=dtype)
    training = TrainingSpec(global_batch=batch, seq_len=seq, dtype=dtype)
    plan = solve(graph, cluster, training, SolveOptions(time_limit=30.0,
                                                        with_baselines=False))[0]
    rates = plan_rates(plan, graph.layers, AnalyticalCostModel(cluster))
    slots, work = rates.slots(), rates.work()
    rng = random.Random(51)
    times: dict[str, list[float]] = {"naive": [], "balanced": []}
    idle: dict[str, list[float]] = {"naive": [], "balanced": []}
    packing_seconds = []
    for _ in range(STEPS):
        lengths = lengths_for(seq, batch, rng)
        began = time.perf_counter()
        packed = balanced(lengths, slots, work)
        packing_seconds.append(time.perf_counter() - began)
        for mode, packing in (("naive", naive(lengths, slots)), ("balanced", packed)):
            step = replay(rates, packing)
            times[mode].append(step.step_time)
            idle[mode].append(step.idle)
    naive_step, balanced_step = (statistics.mean(times[m]) for m in ("naive", "balanced"))
    speedup = naive_step / balanced_step
    depths = "/".join(sorted({str(len(p.stages)) for p in plan.pipelines}))
    pipelines = f"{len(plan.pipelines)} x {depths} stages"
    row = (f"| {label} | {batch} x {seq} | {pipelines} | {plan.prediction.step_time:.2f} s | "
           f"{naive_step:.2f} s | {balanced_step:.2f} s | **{speedup:.2f}x** | "
           f"{statistics.mean(idle['naive']):.0%} | {statistics.mean(idle['balanced']):.0%} | "
           f"{1000 * statistics.median(packing_seconds):.1f} ms |")
    print(row, flush=True)
    return row, speedup


LOADING_SCENARIOS = [  # (model, shape options, cluster, batch, seq, dtype, label)
    ("opt-125m", {"layers": 4}, "2x2xA100-40G", 64, 512, "fp16",
     "OPT-125M (4 layers), 2 nodes of 2x A100-40GB"),
    ("gpt3-1.3b", {}, "a100-v100-lab", 512, 2048, "fp16",
     "GPT-3 1.3B, a100-v100-lab (16 A100, 32 V100, 2 RTX 4090)"),
]


def loading_row(scenario: tuple) -> str:
    name, options, spec, batch, seq, dtype, label = scenario
    cluster = load_cluster(spec)
    graph = trace_model(model_spec(name, options), seq_len=seq, dtype=dtype)
    training = TrainingSpec(global_batch=batch, seq_len=seq, dtype=dtype)
    solve_options = SolveOptions(time_limit=60.0, with_baselines=False)
    began = time.perf_counter()
    free = solve(graph, cluster, training, solve_options)[0]
    free_seconds = time.perf_counter() - began
    reads: dict[str, float] = {}
    for feed in plan_feeds(free):
        reads[feed.node] = reads.get(feed.node, 0.0) + feed.samples
    node = max(sorted(reads), key=reads.__getitem__)  # where the plan reads most
    read = reads[node]
    rate = read / free.prediction.step_time / 2  # half what the free plan reads there
    slowed = dataclasses.replace(cluster, nodes=tuple(
        dataclasses.replace(n, data_loading=DataRate(per_second=rate, unit="samples"))
        if n.name == node else n for n in cluster.nodes))
    waiting = predict(dataclasses.replace(free, cluster=slowed), graph.layers,
                      AnalyticalCostModel(slowed)).step_time
    began = time.perf_counter()
    plan = solve(graph, slowed, training, solve_options)[0]
    slowed_seconds = time.perf_counter() - began
    step = plan.prediction.step_time
    row = (f"| {label} | {batch} x {seq} | {structure(free)} | "
           f"{free.prediction.step_time * 1000:.1f} ms | {node}: {read:.0f} samples at "
           f"{rate:.0f} samples/s | {waiting * 1000:.1f} ms | {structure(plan)} | "
           f"{step * 1000:.1f} ms | **{waiting / step:.2f}x** | "
           f"{free_seconds:.1f} s / {slowed_seconds:.1f} s |")
    print(row, flush=True)
    return row


def loading_section() -> str:
    rows = [loading_row(scenario) for scenario in LOADING_SCENARIOS]
    return ("Data loading as a floor of the step: the solver's plan on the cluster as given; "
            "the loaders of the node it reads most on slowed to half the rate it reads there; "
            "that plan "
            "there (its pipelines waiting for their input) and the solver's plan for the "
            "slowed cluster.\n\n"
            + table(["scenario", "batch x seq", "plan", "step", "slowed loaders",
                     "that plan there", "plan for the slowed cluster", "step",
                     "faster than waiting", "solve, given / slowed"], rows))


def runtime_plan(folder: Path, pipelines: int, stages: int, micro_batch: int) -> Path:
    from planner.solver.uniform import uniform_plan

    cluster = load_cluster(f"1x{pipelines * stages}xcpu")
    graph = trace_loaded(load_model(model_spec("gpt-tiny", RUNTIME_MODEL), seq_len=RUNTIME_SEQ),
                         dtype="fp32")
    training = TrainingSpec(global_batch=RUNTIME_BATCH, seq_len=RUNTIME_SEQ, dtype="fp32")
    plan = uniform_plan(layers=graph.layers, model=graph.spec, cluster=cluster,
                        training=training, costs=AnalyticalCostModel(cluster), tp=1, pp=stages,
                        dp=pipelines, micro_batch=micro_batch)
    path = folder / f"plan-{pipelines}x{stages}.json"
    write_plan(plan, path, force=True)
    return path


def run_once(plan: Path, profile: Path, mode: str, run_dir: Path, ranks: int
             ) -> tuple[float, float]:
    """(median step seconds, mean share of the step the ranks spent outside their
    schedule's compute and waits: gradient sums, optimizer) of one runtime run."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={ranks}", "-m", "planner.runtime", "--plan", str(plan),
                    "--cpu", "--lengths", str(profile), "--packing", mode,
                    "--steps", str(RUNTIME_STEPS), "--warmup", str(RUNTIME_WARMUP),
                    "--run-dir", str(run_dir), "--no-final-checkpoint"],
                   check=True, env=env, capture_output=True)
    summary = json.loads((run_dir / "summary.json").read_text())
    busy = statistics.mean(r["busy_mean"] / r["step_time_mean"] for r in summary["ranks"])
    return summary["step_time"]["median"], busy


def on_runtime(folder: Path) -> tuple[list[str], list[float], list[str]]:
    lengths = lognormal_lengths(20_000, median=48, sigma=1.2, low=4, high=RUNTIME_SEQ,
                                rng=random.Random(51))
    profile = folder / "lengths.json"
    profile.write_text(profile_json(summarize([Sample(tokens=n) for n in lengths],
                                              "lognormal")))
    rows, speedups, details = [], [], []
    for label, pipelines, stages, micro_batch in RUNTIME_LAYOUTS:
        plan = runtime_plan(folder, pipelines, stages, micro_batch)
        runs: dict[str, list[tuple[float, float]]] = {"naive": [], "balanced": []}
        for repeat in range(RUNTIME_REPEATS):
            for mode in ("naive", "balanced"):
                run_dir = folder / f"run-{pipelines}x{stages}-{mode}-{repeat}"
                runs[mode].append(run_once(plan, profile, mode, run_dir, pipelines * stages))
        step = {m: statistics.median(t for t, _ in runs[m]) for m in runs}
        busy = {m: statistics.mean(b for _, b in runs[m]) for m in runs}
        speedup = step["naive"] / step["balanced"]
        speedups.append(speedup)
        rows.append(f"| {label} | {RUNTIME_BATCH} x {RUNTIME_SEQ} | {micro_batch} | "
                    f"{step['naive']:.3f} s | {step['balanced']:.3f} s | **{speedup:.2f}x** | "
                    f"{1 - busy['naive']:.0%} | {1 - busy['balanced']:.0%} |")
        details.append(f"{label}: naive " + ", ".join(f"{t:.3f}" for t, _ in runs["naive"])
                       + " s; balanced " + ", ".join(f"{t:.3f}" for t, _ in runs["balanced"])
                       + " s")
        print(rows[-1], flush=True)
    return rows, speedups, details


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulator-only", action="store_true")
    parser.add_argument("--runtime-only", action="store_true")
    parser.add_argument("--no-write", action="store_true", help="Print only.")
    parser.add_argument("--loading", action="store_true",
                        help="Only the data-loading part (its own section).")
    args = parser.parse_args()
    if args.loading:
        body = loading_section()
        print(body)
        if not args.no_write:
            write_section("data-loading", "python benchmarks/data_balance.py --loading", body)
        return
    began = time.perf_counter()
    parts, speedups = [], []
    if not args.runtime_only:
        rows = []
        for scenario in SCENARIOS:
            row, speedup = simulated(scenario)
            rows.append(row)
            speedups.append(speedup)
        parts.append(
            "Simulator: the solver's plan per scenario, the mean over "
            f"{STEPS} steps of lognormal lengths (median seq / 8, sigma 1, 16 to seq).\n\n"
            + table(["scenario", "batch x seq", "plan", "plan's step at full length",
                     "naive step", "balanced step", "speedup", "idle, naive",
                     "idle, balanced", "packing a step"], rows)
            + "\nIdle: the share of the devices' time before the gradient sync spent waiting "
            "(the pipeline bubble and the wait for the slowest pipeline). The plan's step at "
            "full length is its prediction for samples all of the sequence length, what the "
            "solver plans for today. Packing a step: the balanced packer's time (pure Python), "
            "the median over steps.")
    if not args.simulator_only:
        with tempfile.TemporaryDirectory() as folder:
            rows, runtime_speedups, details = on_runtime(Path(folder))
        speedups += runtime_speedups
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        parts.append(
            "CPU runtime: gpt-tiny widened (hidden 256, 4 blocks, 4 heads, sequence 512), "
            f"global batch {RUNTIME_BATCH}, lengths lognormal (median 48, sigma 1.2, 4 to "
            f"512), fp32, gloo, each rank one thread; {RUNTIME_STEPS} steps of which "
            f"{RUNTIME_WARMUP} warm-up, {RUNTIME_REPEATS} runs per packer, alternating.\n\n"
            + table(["layout", "batch x seq", "micro-batch", "naive step", "balanced step",
                     "speedup", "outside compute, naive", "outside compute, balanced"], rows)
            + "\nStep: the median over runs of each run's median step. Outside compute: the "
            "share of a rank's step outside its schedule (waiting for the other pipeline at "
            "the gradient sum, the sum and the optimizer), mean over ranks and runs; a "
            "pipeline's bubble is inside its schedule. Runs: " + "; ".join(details)
            + f". Load average at the end: {load} (other work on the machine perturbs the "
            "timings; the packers alternate to share it).")
    met = "met" if speedups and min(speedups) >= TARGET else "not met"
    body = "\n\n".join(parts) + (
        f"\n\nTarget (issue 51): balanced at least {TARGET}x faster than naive: **{met}** "
        f"(least {min(speedups):.2f}x). Wall time {time.perf_counter() - began:.0f} s.")
    print(body)
    if not args.no_write and not (args.simulator_only or args.runtime_only):
        write_section("data-balance", "python benchmarks/data_balance.py", body)


if __name__ == "__main__":
    main()
