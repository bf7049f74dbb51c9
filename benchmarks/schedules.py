"""What searching GPipe beside 1F1B buys where sends are slow, and what it costs.

    python benchmarks/schedules.py            # writes the "schedules" section

1F1B keeps at most S - s micro-batches in flight at stage s, so on slow links its
stages wait for the round trips of their sends; GPipe runs all forwards, then all
backwards, which overlaps the sends but holds every micro-batch's activations.
For clusters of single-GPU nodes on Ethernet (and one of the solve benchmark's),
this solves each job twice, with every schedule the default search tries and
with `--schedule 1f1b`, and reports both plans, the search times, and the chosen
plan's closed form against the event-driven simulator.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from results import table, write_section

from cost_models.cluster import load_cluster
from cost_models.model import AnalyticalCostModel
from planner.models import model_spec
from planner.solver import Limits, SolveOptions, solve
from planner.solver.predict import replay
from planner.trace import trace_model
from planner.types import Plan, Schedule, TrainingSpec

SCENARIOS = [  # model, cluster, global batch, sequence length
    ("gpt2-medium", "4x1xA100-80G@10Gbps", 32, 1024),
    ("gpt2-large", "8x1xA100-80G@10Gbps", 64, 1024),
    ("gpt2-large", "2x2xA100-80G,2x2xV100-32G@10Gbps", 64, 1024),
    ("gpt3-1.3b", "8x1xV100-32G@25Gbps", 64, 2048),
    ("llama2-7b", "1x3xA100-80G,1x3xRTX4090,1x2xRTX3090@10Gbps", 64, 4096),
]


def describe(plan: Plan) -> str:
    pipe = plan.pipelines[0]
    return (f"{len(plan.pipelines)} x {len(pipe.stages)} stages, {pipe.schedule.value}, "
            f"{pipe.num_microbatches} micro-batches of {pipe.micro_batch}")


def run(name: str, spec: str, batch: int, seq: int) -> str:
    cluster = load_cluster(spec)
    dtype = "bf16" if all("bf16" in d.peak_flops for d in cluster.device_types().values()) \
        else "fp16"
    graph = trace_model(model_spec(name), seq_len=seq, dtype=dtype)
    training = TrainingSpec(global_batch=batch, seq_len=seq, dtype=dtype)
    options = SolveOptions(with_baselines=False, time_limit=60.0)
    best = solve(graph, cluster, training, options)[0]
    plain = solve(graph, cluster, training, dataclasses.replace(
        options, limits=Limits(schedule=Schedule.ONE_F_ONE_B)))[0]
    sim = replay(best, graph.layers, AnalyticalCostModel(cluster)).step_time
    step, before = best.prediction.step_time, plain.prediction.step_time
    return (f"| {name} | {spec} | {batch} | {describe(best)}: {step:.3g} s | "
            f"{describe(plain)}: {before:.3g} s | {before / step:.2f}x | "
            f"{best.solver.wall_time:.2f} s ({best.solver.status}) | "
            f"{plain.solver.wall_time:.2f} s | {(step - sim) / sim:+.2%} |")


def main() -> None:
    rows = []
    for scenario in SCENARIOS:
        row = run(*scenario)
        print(row, flush=True)
        rows.append(row)
    body = (table(["model", "cluster", "batch", "best plan (every schedule)",
                   "best 1F1B plan (`--schedule 1f1b`)", "speedup", "search",
                   "search, 1F1B only", "closed form vs simulator"], rows) + "\n"
            "The default search tries 1F1B, GPipe (in plans of one pipeline class) and "
            "interleaved 1F1B as `--max-interleave` allows (1: none); `--schedule 1f1b` "
            "searches 1F1B alone. Search: the cost tables and searches, "
            "the fastest type's and the whole cluster's (the report's wall time), one run.")
    write_section("schedules", "python benchmarks/schedules.py", body)


if __name__ == "__main__":
    main()
