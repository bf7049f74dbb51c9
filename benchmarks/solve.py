"""Solver benchmark: wall time, gap, predicted throughput, baselines, simulator agreement.

    python benchmarks/solve.py               # all scenarios, writes the "solve" section
    python benchmarks/solve.py --only 0 2    # some scenarios, printed only
    python benchmarks/solve.py --max-interleave 2   # interleaved 1F1B searched too: its
                                                    # own section, "solve-interleaved"
    python benchmarks/solve.py --tp-per-class       # a tp degree per class: its own
                                                    # section, "solve-tp-per-class"
    python benchmarks/solve.py --small-batch        # small global batches (few
                                                    # micro-batches, GPipe's fronts):
                                                    # "solve-small-batch", no targets
    python benchmarks/solve.py --measured           # every node its own measured layer
                                                    # times (`measured.py`), against
                                                    # pipelines written by hand across
                                                    # the nodes: "solve-measured"
    python benchmarks/solve.py --measured --mixed-share-types  # the same scenario solved
                                                    # with mixed classes on any types: a
                                                    # row added to "solve-measured"
    python benchmarks/solve.py --cpsat              # the branch and bound against the
                                                    # CP-SAT assignment loop
                                                    # (`planner/solver/assign.py`) on
                                                    # one space: "solve-cpsat"
    python benchmarks/solve.py --ab OLD_CHECKOUT    # the scenarios solved by another
                                                    # checkout's code and by this one,
                                                    # back to back, the old plans priced
                                                    # by this cost model: "solve-ab"

Targets: search at most 1 s up to 64 GPUs, 10 s at 1,024 and 60 s at 4,096, each
with a reported gap of at most 1%, and never slower than a baseline; the simulator
within 2% of the closed form.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from measured import HANDWRITTEN, SCENARIO, handwritten_plan, price_handwritten, write_cluster
from results import RESULTS, table, write_section

from cost_models.cluster import load_cluster
from cost_models.memory import GIB
from cost_models.model import AnalyticalCostModel
from planner.models import model_spec
from planner.planfile import to_jsonable
from planner.price import price_file
from planner.solver import Limits, SolveOptions, solve
from planner.solver.assign import assign_search
from planner.solver.evaluate import Space
from planner.solver.predict import replay
from planner.solver.search import search
from planner.solver.table import build_table
from planner.trace import trace_model
from planner.types import Plan, Schedule, TrainingSpec

SCENARIOS = [
    ("opt-350m", "1x8xA100-40G,1x8xV100-16G@100Gbps", 512, 2048,
     "OPT-350M, 8x A100-40GB + 8x V100-16GB"),
    ("gpt3-1.3b", "1x8xA100-40G,1x8xV100-16G@100Gbps", 512, 2048,
     "GPT-3 1.3B, 8x A100-40GB + 8x V100-16GB"),
    ("llama3-70b", "4x8xA100-80G,4x8xV100-32G@200Gbps", 1024, 4096,
     "Llama-3 70B, 32x A100-80GB + 32x V100-32GB"),
    ("llama2-7b", "1x3xA100-80G,1x3xRTX4090,1x2xRTX3090@10Gbps", 64, 4096,
     "Llama-2 7B, 3x A100 + 3x RTX 4090 + 2x RTX 3090, 10 Gb/s Ethernet"),
    ("gpt3-175b", "four-type-1024", 1536, 2048,
     "GPT-3 175B, 1,024 GPUs of four types in 128 nodes (example four-type-1024)"),
    ("gpt3-175b", "128x8xH100,128x8xA100-80G,128x8xV100-32G,128x8xL4@400Gbps", 3072, 2048,
     "GPT-3 175B, 4,096 GPUs of four types in 512 nodes"),
]

# a few micro-batches per pipeline: GPipe's fronts and the parameter-cap sweeps decide
SMALL_BATCH = [
    ("llama3-70b", "4x8xA100-80G,4x8xV100-32G@200Gbps", 8, 4096,
     "Llama-3 70B at batch 8, 32x A100-80GB + 32x V100-32GB"),
    ("gpt3-175b", "8x8xA100-80G,8x8xV100-32G@200Gbps", 8, 2048,
     "GPT-3 175B at batch 8, 64x A100-80GB + 64x V100-32GB"),
]


REPEATS = 3  # solves up to 64 GPUs run this often; the fastest time is reported


def dtype_for(cluster) -> str:
    kinds = cluster.device_types().values()
    return "bf16" if all("bf16" in d.peak_flops for d in kinds) else "fp16"


def time_limit(cluster) -> float | None:
    """The targets as time limits for the big clusters (the gap says what they left
    open): 10 s above 64 GPUs, 60 s above 1,024; none up to 64."""
    if cluster.num_devices > 1024:
        return 60.0
    return 10.0 if cluster.num_devices > 64 else None


def run(scenario: tuple, max_interleave: int = 1, tp_per_class: bool = False) -> str:
    name, spec, batch, seq, label = scenario
    cluster = load_cluster(spec)
    dtype = dtype_for(cluster)
    graph = trace_model(model_spec(name), seq_len=seq, dtype=dtype)
    training = TrainingSpec(global_batch=batch, seq_len=seq, dtype=dtype)
    limit = time_limit(cluster)
    searches, totals = [], []
    for _ in range(REPEATS if limit is None else 1):  # this machine is shared and noisy
        start = time.perf_counter()
        limits = Limits(interleaves=tuple(range(1, max_interleave + 1)),
                        tp_per_class=tp_per_class)
        plan = solve(graph, cluster, training, SolveOptions(time_limit=limit, limits=limits))[0]
        totals.append(time.perf_counter() - start)
        searches.append(plan.solver.wall_time)
    total, search_time = min(totals), min(searches)
    report, pred = plan.solver, plan.prediction
    sim = replay(plan, graph.layers, AnalyticalCostModel(cluster))
    sim_error = (pred.step_time - sim.step_time) / sim.step_time
    ratios = []
    for b in plan.baselines:
        ratios.append(f"{b.name} {b.prediction.step_time / pred.step_time:.2f}x"
                      if b.prediction else f"{b.name} n/a")
    tps = {s.tp for p in plan.pipelines for s in p.stages}
    shape = f"{len(plan.pipelines)} pipelines, " + ", ".join(sorted({
        f"{len(p.stages)} stages of {'+'.join(dict.fromkeys(s.device_type for s in p.stages))}"
        + (f" tp {p.stages[0].tp}" if len(tps) > 1 else "")
        + (f" ({p.interleave} chunks)" if p.interleave > 1 else "") for p in plan.pipelines}))
    if len(tps) == 1:
        shape += f"; tp {tps.pop()}"
    row = (f"| {label} | {cluster.num_devices} | {dtype} | {search_time:.2f} s | "
           f"{total:.1f} s | {report.status} | {report.gap:.2%} | "
           f"{pred.step_time:.3g} s | {pred.samples_per_s:,.1f} | {pred.mfu:.1%} | "
           f"{'; '.join(ratios)} | {sim_error:+.2%} | {shape} |")
    print(row, flush=True)
    return row


CPSAT_LIMIT = 60.0  # seconds each search may take


def run_cpsat(name: str, cluster, batch: int, seq: int, label: str) -> str:
    """The branch and bound and the CP-SAT loop on the same space (structures of several
    classes without ZeRO, 1F1B, `assign.assign_search`), the same cost table, gap 0.5%:
    the time each takes to its certificate."""
    dtype = dtype_for(cluster)
    graph = trace_model(model_spec(name), seq_len=seq, dtype=dtype)
    training = TrainingSpec(global_batch=batch, seq_len=seq, dtype=dtype)
    costs = AnalyticalCostModel(cluster)
    limits, space = Limits(schedule=Schedule.ONE_F_ONE_B), Space(zeros=(0,))
    cells = []
    for searcher in (search, assign_search):
        table = build_table(graph.layers, cluster, training, costs, tps=(1, 2, 4, 8, 16),
                            micro_batches=(1, 2, 4, 8, 16))
        start = time.process_time()
        found = searcher(table, batch, limits=limits, space=space, gap=0.005,
                         time_limit=CPSAT_LIMIT)
        step = found.best[0].step_time
        cells.append(f"{time.process_time() - start:.2f} s, {found.status}, gap "
                     f"{(step - found.bound) / step:.2%}, {step:.3g} s")
    row = f"| {label} | {cluster.num_devices} | {' | '.join(cells)} |"
    print(row, flush=True)
    return row


def _measured_solve(graph, cluster, training: TrainingSpec, limits: Limits):
    """The measured scenario's plan as the CLI's defaults solve it (60 s, 0.5% gap), and
    the seconds the whole solve took."""
    start = time.perf_counter()
    plan = solve(graph, cluster, training, SolveOptions(time_limit=60.0, limits=limits))[0]
    return plan, time.perf_counter() - start


def _plan_row(label: str, plan: Plan, total: float, reference: float) -> str:
    """A plan's row of the measured section: status, gap, times, its step over
    `reference`, and its pipelines through the nodes."""
    report, step = plan.solver, plan.prediction.step_time
    return (f"| {label} ({report.status}, gap {report.gap:.2%}, search "
            f"{report.wall_time:.1f} s, solve {total:.1f} s) | {step:.3g} s | "
            f"{step / reference:.2f}x | "
            + "; ".join(" -> ".join(dict.fromkeys(s.devices.node for s in p.stages))
                        + f" ({len(p.stages)} stages, tp {p.stages[0].tp}, "
                          f"{p.num_microbatches} micro-batches)" for p in plan.pipelines) + " |")


_SHARED_ROW = "| the plan with --mixed-share-types"


def add_measured_shared() -> None:
    """The measured scenario solved with --mixed-share-types (two mixed classes on any
    types) beside the plan without it: a row added to the "solve-measured" section after
    the plan's (any such row before replaced), the rest of the section as it was."""
    scenario = SCENARIO
    graph = trace_model(model_spec(scenario.model), seq_len=scenario.seq, dtype=scenario.dtype)
    cluster = load_cluster(str(write_cluster(scenario, graph, Path(tempfile.mkdtemp(
        prefix="measured-")))))
    training = TrainingSpec(global_batch=scenario.batch, seq_len=scenario.seq,
                            dtype=scenario.dtype)
    plan, _ = _measured_solve(graph, cluster, training, Limits())
    shared, total = _measured_solve(graph, cluster, training, Limits(mixed_share_types=True))
    row = _plan_row(_SHARED_ROW[2:], shared, total, plan.prediction.step_time)
    print(row, flush=True)
    text = RESULTS.read_text()
    start, end = text.index("<!-- solve-measured:start -->"), text.index(
        "<!-- solve-measured:end -->")
    _, written, body = text[start:end].split("\n\n", 2)  # (the title, command and run)
    command = written.split("`")[1].split("; ")[0]
    if "(run " not in command:  # (the section's other rows keep the time they ran)
        command += f" (run {written.split('Run: ')[1].split(' on ')[0]})"
    lines = [line for line in body.split("\n") if not line.startswith(_SHARED_ROW)]
    at = next(i for i, line in enumerate(lines) if line.startswith("| the plan (")) + 1
    write_section("solve-measured", f"{command}; the row with --mixed-share-types: python "
                  "benchmarks/solve.py --measured --mixed-share-types",
                  "\n".join([*lines[:at], row, *lines[at:]]))


def run_measured() -> str:
    """The measured-per-node scenario: the plan, its baselines and the hand-written plans
    priced as written, each with its step over the plan's."""
    scenario = SCENARIO
    graph = trace_model(model_spec(scenario.model), seq_len=scenario.seq, dtype=scenario.dtype)
    folder = Path(tempfile.mkdtemp(prefix="measured-"))
    path = write_cluster(scenario, graph, folder)
    cluster = load_cluster(str(path))
    training = TrainingSpec(global_batch=scenario.batch, seq_len=scenario.seq,
                            dtype=scenario.dtype)
    plan, total = _measured_solve(graph, cluster, training, Limits())
    pred, report = plan.prediction, plan.solver
    rows = [_plan_row("the plan", plan, total, pred.step_time)]
    for b in plan.baselines:
        rows.append(f"| baseline {b.name} | "
                    + (f"{b.prediction.step_time:.3g} s | "
                       f"{b.prediction.step_time / pred.step_time:.2f}x | {b.description} |"
                       if b.prediction else f"n/a | | {b.description} |"))
    for shape in HANDWRITTEN:
        hand = price_handwritten(handwritten_plan(scenario, shape, len(graph.layers), path,
                                                  folder))
        rows.append(f"| hand-written: {shape.name} | {hand.prediction.step_time:.3g} s | "
                    f"{hand.prediction.step_time / pred.step_time:.2f}x | "
                    f"`planner estimate --plan`, layers in proportion to the nodes' speed |")
    for row in rows:
        print(row, flush=True)
    return (f"{scenario.label}, global batch {scenario.batch}, sequence {scenario.seq}, "
            f"{scenario.dtype}, the CLI's defaults (60 s, 0.5% gap).\n\n"
            + table(["plan", "step time", "its step / the plan's", "how"], rows)
            + "\nSearch space: " + report.search_space + ".")


# One scenario solved in another checkout (`solve_in`): run there by `python -c`, so that
# the checkout's own planner is imported; it writes the plan file and prints the solve's
# times, status and gap as JSON. Only what every checkout since issue 45 has is used.
_SOLVE_THERE = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, str(Path.cwd()))
from cost_models.cluster import load_cluster
from planner.models import model_spec
from planner.planfile import write_plan
from planner.solver import SolveOptions, solve
from planner.trace import trace_model
from planner.types import TrainingSpec
name, spec, batch, seq, dtype, limit, repeats, out = json.loads(sys.argv[1])
cluster = load_cluster(spec)
graph = trace_model(model_spec(name), seq_len=seq, dtype=dtype)
training = TrainingSpec(global_batch=batch, seq_len=seq, dtype=dtype)
walls, cpus = [], []
for _ in range(repeats):
    start = time.process_time()
    plan = solve(graph, cluster, training, SolveOptions(time_limit=limit))[0]
    cpus.append(time.process_time() - start)
    walls.append(plan.solver.wall_time)
write_plan(plan, Path(out), force=True)
print(json.dumps(dict(wall=min(walls), cpu=min(cpus), status=plan.solver.status,
                      gap=plan.solver.gap, step=plan.prediction.step_time)))
"""


@dataclass(frozen=True)
class Solved:
    """A scenario's solve in one checkout (`solve_in`)."""

    wall: float  # the search (`SolverReport.wall_time`), the fastest of the repeats
    cpu: float  # CPU seconds of the whole solve() call, the fastest of the repeats
    status: str
    gap: float
    step: float  # the plan's step, priced by that checkout's cost model
    plan: Path  # the plan file it wrote

    def describe(self) -> str:
        return (f"{self.wall:.2f} s ({self.cpu:.2f} s CPU), {self.status}, "
                f"gap {self.gap:.2%}")


def solve_in(checkout: Path, scenario: tuple, out: Path) -> Solved:
    """`scenario` solved by the code of `checkout`, as `run` solves it (its time limit,
    the fastest of `REPEATS` up to 64 GPUs), in a process of its own."""
    name, spec, batch, seq, _ = scenario
    cluster = load_cluster(spec)
    limit = time_limit(cluster)
    given = [name, spec, batch, seq, dtype_for(cluster), limit,
             REPEATS if limit is None else 1, str(out)]
    done = subprocess.run([sys.executable, "-c", _SOLVE_THERE, json.dumps(given)],
                          cwd=checkout, capture_output=True, text=True, check=True)
    return Solved(**json.loads(done.stdout.splitlines()[-1]), plan=out)


def price_now(path: Path, cluster) -> tuple[float, list[str]]:
    """A plan file another checkout wrote, priced as written by this checkout's cost model
    (`planner estimate --plan`), on `cluster` as this checkout's catalog describes it (a
    plan file holds the device specs of the catalog that wrote it), and the stages that
    would not fit their devices' memory under this cost model."""
    written = json.loads(path.read_text())
    written["cluster"] = to_jsonable(cluster)
    for figures in ("prediction", "solver", "baselines"):  # (pricing gives them again)
        written.pop(figures, None)
    now = path.with_name(f"{path.stem}-now.json")
    now.write_text(json.dumps(written))
    plan = price_file(now).plan
    unfit = []
    for p in plan.pipelines:
        for s in p.stages:
            capacity = cluster.node(s.devices.node).device.memory
            if s.memory.total > capacity:
                unfit.append(f"{s.device_type} stage {s.index} of pipeline {p.index}: "
                             f"{s.memory.total / GIB:.1f} of {capacity / GIB:.0f} GiB")
    return plan.prediction.step_time, unfit


def run_ab(old: Path, scenario: tuple) -> str:
    """A scenario solved by the code of checkout `old` and by this one, back to back on
    this machine, and the old plan priced by this checkout's cost model: a row."""
    cluster = load_cluster(scenario[1])
    folder = Path(tempfile.mkdtemp(prefix="solve-ab-"))
    before = solve_in(old, scenario, folder / "old.json")
    after = solve_in(Path(__file__).resolve().parent.parent, scenario, folder / "new.json")
    old_step, unfit = price_now(before.plan, cluster)
    priced = f"{old_step:.4g} s ({old_step / after.step:.3f}x the new plan's)"
    if unfit:
        priced += f"; does not fit: {unfit[0]}" + (
            f" and {len(unfit) - 1} more stages" if len(unfit) > 1 else "")
    row = (f"| {scenario[4]} | {before.describe()} | {after.describe()} | "
           f"{after.wall / before.wall:.2f}x | {priced} | {after.step:.4g} s |")
    print(row, flush=True)
    return row


_AB_NOTE = (
    "Both checkouts solve each scenario in a process of their own, the old first, back "
    "to back on this machine, as `python benchmarks/solve.py` does (the fastest of "
    f"{REPEATS} runs up to 64 GPUs, the targets as time limits above: 10 s, 60 s). Search: "
    "the report's wall time; CPU: the whole solve() call's CPU seconds (the machine is "
    "shared, so wall times at the limits say less than CPU times). The old plan, priced "
    "now: its plan file priced as written by this checkout's cost model (`planner "
    "estimate --plan`) on the cluster as this catalog describes it; a stage that does not "
    "fit is named (the cost model's recompute and memory changed between the two: its "
    "plan is then no plan of this model's space). A ratio above 1: the new plan is that "
    "much faster.")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", type=int, nargs="*")
    parser.add_argument("--max-interleave", type=int, default=1)
    parser.add_argument("--tp-per-class", action="store_true")
    parser.add_argument("--small-batch", action="store_true")
    parser.add_argument("--measured", action="store_true")
    parser.add_argument("--mixed-share-types", action="store_true")
    parser.add_argument("--cpsat", action="store_true")
    parser.add_argument("--ab", type=Path, metavar="OLD_CHECKOUT")
    args = parser.parse_args()
    if args.ab:
        indices = args.only if args.only is not None else range(len(SCENARIOS))
        rows = [run_ab(args.ab, SCENARIOS[i]) for i in indices]
        if args.only is None:
            commit = subprocess.run(["git", "-C", str(args.ab), "log", "-1",
                                     "--format=%h (%ad)", "--date=short"],
                                    capture_output=True, text=True, check=True).stdout.strip()
            write_section("solve-ab", f"python benchmarks/solve.py --ab {args.ab}",
                          f"Old: {args.ab} holds the code of commit {commit}; new: this "
                          "checkout.\n\n"
                          + table(["scenario", "old search", "new search", "new / old search",
                                   "old plan, priced now", "new plan"], rows) + "\n" + _AB_NOTE)
        return
    if args.cpsat:
        rows = [run_cpsat(name, load_cluster(spec), batch, seq, label)
                for name, spec, batch, seq, label in SCENARIOS[:5]]
        folder = Path(tempfile.mkdtemp(prefix="measured-"))
        graph = trace_model(model_spec(SCENARIO.model), seq_len=SCENARIO.seq,
                            dtype=SCENARIO.dtype)
        rows.append(run_cpsat(SCENARIO.model, load_cluster(str(write_cluster(
            SCENARIO, graph, folder))), SCENARIO.batch, SCENARIO.seq,
            "GPT-3 13B, measured per node (`--measured`)"))
        write_section("solve-cpsat", "python benchmarks/solve.py --cpsat",
                      table(["scenario", "GPUs", "branch and bound", "CP-SAT loop"], rows)
                      + "\n" + _CPSAT_NOTE)
        return
    if args.measured and args.mixed_share_types:
        add_measured_shared()
        return
    if args.measured:
        body = run_measured()
        write_section("solve-measured", "python benchmarks/solve.py --measured",
                      body + "\n\n" + _MEASURED_NOTE)
        return
    scenarios = SMALL_BATCH if args.small_batch else SCENARIOS
    indices = args.only if args.only is not None else range(len(scenarios))
    rows = [run(scenarios[i], args.max_interleave, args.tp_per_class) for i in indices]
    if args.only is not None:
        return
    body = ("| scenario | GPUs | dtype | search | solve incl. baselines | status | gap | "
            "step time | samples/s | MFU | baseline step / plan step | closed form vs "
            "simulator | plan |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
            + "\n".join(rows) + "\n\n"
            "Search: the cost tables and searches, the fastest type's and the whole "
            "cluster's (`SolverReport.wall_time`), the fastest of "
            f"{REPEATS} runs up to 64 GPUs (the machine is shared and its timings vary by up "
            "to 2x), one run with the targets as time limits above (10 s, 60 s); solve: the "
            "whole "
            "`solve()` call, cost table and baselines (three of them, one a second search) "
            "included. Gap: how far the best bound is below the plan (the search stops at "
            "0.5%). Baselines: data-parallel (every device a replica, even shares), uniform "
            "(best Megatron-style recipe with even layers and shares), fastest-type (the best "
            "plan on the fastest device type alone); a ratio above 1 means the plan is that "
            "much faster. Closed form vs simulator: the plan's predicted step time against "
            "the event-driven replay of the same plan.")
    if args.small_batch:
        write_section("solve-small-batch", "python benchmarks/solve.py --small-batch",
                      body + " Small global batches run a few micro-batches per pipeline, "
                      "where GPipe's fronts (its splits no other beats in period and fill) "
                      "and the splits under parameter caps are searched; the issue sets no "
                      "target here.")
        return
    if args.tp_per_class:
        write_section("solve-tp-per-class", "python benchmarks/solve.py --tp-per-class",
                      body + " Each pipeline class may take its own tensor-parallel degree, "
                      "and the two blocks of a two-type class theirs where it runs without "
                      "ZeRO or interleaving (`--tp-per-class`; the default is one degree per "
                      "plan). The blocks' degrees multiply the two-type families (at 1,024 "
                      "GPUs 6,495 per configuration), so within the time limits the large "
                      "searches leave wider gaps than with one degree per class.")
        return
    if args.max_interleave > 1:
        write_section("solve-interleaved",
                      f"python benchmarks/solve.py --max-interleave {args.max_interleave}",
                      body + f" Interleaved 1F1B with up to {args.max_interleave} chunks per "
                      "device is searched too (`--max-interleave`; the default is 1).")
        return
    write_section("solve", "python benchmarks/solve.py", body)


_CPSAT_NOTE = (
    "Both on the same space (structures of several classes without ZeRO, 1F1B: the "
    "branch and bound's ZeRO-free part), the same cost table and gap (0.5%), "
    f"{CPSAT_LIMIT:.0f} s each at most, one thread; times are CPU seconds of this "
    "process (the machine is shared). Each cell: time, status, certified gap, the plan's "
    "step. The CP-SAT loop (`planner/solver/assign.py`) bounds every structure of a "
    "configuration at once by the least step its assignment model allows (a bisection, "
    "a CP-SAT feasibility problem each step), prices the structure CP-SAT returns there "
    "exactly and excludes it by a no-good cut, tightening the floors of the families it "
    "uses first; the branch and bound bounds partial structures with far tighter terms "
    "(whole pipelines per level, placement, sync groups) and prices few leaves.")

_MEASURED_NOTE = (
    "Every node carries its own measured layer times (`benchmarks/measured.py`: this "
    "machine has no GPUs, so they are the catalog roofline scaled by a per-node factor, "
    "1.00 and 1.12 for the A100 nodes, 0.95 and 1.18 for the V100 ones, written as "
    "`planner profile --model` writes them), so the solver sees one device type per "
    "node. The hand-written plans run pipelines through every node in the file's order, "
    "their layers in proportion to the nodes' measured speed, the batch shared evenly, "
    "priced as written with the cost model (`planner estimate --plan`); a ratio above 1 "
    "means the plan is that much faster.")


if __name__ == "__main__":
    main()
