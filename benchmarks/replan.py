"""What losing a node costs: re-planning on the survivors, and plans with slack.

    python benchmarks/replan.py            # writes the "replan" section
    python benchmarks/replan.py --no-live  # the planning tables only (no CPU run)

Planning (no GPU): for each job, the plan a solve finds (the run when a node is lost);
`planner replan` without one of its nodes (the warm start, the surviving pipelines
rebalanced, then a search within its default 10 s), its latency and step time against
the best plan for the survivors (a solve of 30 s); then `--spare 0.5`: the fastest plan
that survives any one node's loss by a rebalance, what the slack costs against the best
plan, and its step after its worst node's loss (rebalance only) against the best plan for
those survivors.

Live (CPU, gloo): `planner launch --supervise` of gpt-tiny on 2 nodes of 2 ranks, a
checkpoint every 4 steps; node cpu-1's ranks are killed at step 7. The supervisor's
re-plan latency, the steps lost, the seconds from the kill to the first step of the new
plan, and the measured throughput before and after.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from results import table, write_section

from cost_models.cluster import load_cluster
from planner.errors import PlannerError
from planner.models import model_spec
from planner.replan import replan, spare_plan, used_nodes
from planner.solver import SolveOptions, solve
from planner.trace import trace_model
from planner.types import Plan, TrainingSpec
from planner.whatif import remove_nodes

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = [  # model, cluster, global batch, sequence length
    ("gpt2-large", "4x1xA100-80G,4x1xV100-32G@10Gbps", 64, 1024),
    ("gpt3-1.3b", "2x4xA100-80G,2x4xV100-32G@100Gbps", 64, 2048),
    ("llama2-7b", "1x3xA100-80G,1x3xRTX4090,1x2xRTX3090@10Gbps", 64, 4096),
]
REFERENCE_LIMIT = 30.0  # seconds of the solves the re-plans are held against
SPARE = 0.5


def describe(plan: Plan) -> str:
    stages = sorted({len(p.stages) for p in plan.pipelines})
    return (f"{len(plan.pipelines)} pipeline(s) of {'/'.join(map(str, stages))} stage(s) on "
            f"{len(used_nodes(plan))} node(s)")


def best_plan(graph, cluster, training) -> Plan:
    return solve(graph, cluster, training, SolveOptions(
        time_limit=REFERENCE_LIMIT, with_baselines=False))[0]


def planning(name: str, spec: str, batch: int, seq: int) -> tuple[str, str]:
    cluster = load_cluster(spec)
    dtype = "bf16" if all("bf16" in d.peak_flops for d in cluster.device_types().values()) \
        else "fp16"
    graph = trace_model(model_spec(name), seq_len=seq, dtype=dtype)
    training = TrainingSpec(global_batch=batch, seq_len=seq, dtype=dtype)
    plan = best_plan(graph, cluster, training)
    lost = used_nodes(plan)[0]
    result = replan(plan, lost=[lost], graph=graph)
    left = remove_nodes(cluster, [lost])
    survivors = best_plan(graph, left, training)
    rebalanced = result.rebalanced.plan
    after = result.new.prediction.step_time
    replan_row = (
        f"| {name} | {spec} | {describe(plan)}: {plan.prediction.step_time:.3g} s | {lost} | "
        f"{result.seconds:.2f} s | "
        + (f"{rebalanced.prediction.step_time:.3g} s" if rebalanced else
           f"none ({result.rebalanced.reason})")
        + f" | {result.kept}: {after:.3g} s | {survivors.prediction.step_time:.3g} s | "
        f"{survivors.prediction.step_time / after:.1%} |")
    try:
        found = spare_plan(graph, cluster, training, spare=SPARE, time_limit=REFERENCE_LIMIT)
    except PlannerError as exc:  # none within the slack: how much the fastest one needs
        return replan_row, (f"| {name} | {spec} | {plan.prediction.step_time:.3g} s | "
                            f"none within {SPARE:.0%}: "
                            f"{exc.message.rpartition('; ')[2].rstrip('.')} | | | |")
    worst = found.worst
    kept = worst.rebalanced.plan
    assert kept is not None
    best_left = best_plan(graph, remove_nodes(cluster, [worst.node]), training)
    spare_row = (
        f"| {name} | {spec} | {plan.prediction.step_time:.3g} s | {describe(found.plan)}: "
        f"{found.plan.prediction.step_time:.3g} s (+{found.slack:.1%}) | {worst.node} | "
        f"{kept.prediction.step_time:.3g} s | "
        f"{best_left.prediction.step_time / kept.prediction.step_time:.1%} |")
    return replan_row, spare_row


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "losses.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() \
        else []


def live() -> str:
    """The supervised CPU run (see the module docstring); its table rows."""
    from planner.planfile import write_plan
    from tests.runtime_helpers import free_port, tiny_plan
    from tests.test_replan_supervise import _ranks_of

    steps, every, kill_at = 12, 4, 7
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        plan = tiny_plan("2x2xcpu", pp=2, dp=2)
        write_plan(plan, tmp / "plan.json")
        out, gate = tmp / "launch", tmp / "gate"
        subprocess.run([sys.executable, "-m", "cli.main", "launch", str(tmp / "plan.json"),
                        "--out", str(out), "--target", "local", "--python", sys.executable,
                        "--supervise", "--steps", str(steps), "--checkpoint-every",
                        str(every), "--data", "tests.fault_data:gated", "--master-port",
                        str(free_port())], check=True, cwd=ROOT, capture_output=True)
        gate.touch()  # (the test's deterministic hook; open from the start)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "FAULT_GATE": str(gate)}
        run_dir = out / "run"
        proc = subprocess.Popen(["bash", str(out / "supervise.sh")], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            while len(_steps(run_dir)) < kill_at:
                assert proc.poll() is None, "the run ended early"
                time.sleep(0.01)
            killed = time.time()
            for pid in _ranks_of("cpu-1", proc.pid):
                os.kill(pid, signal.SIGKILL)
            assert proc.wait(timeout=900) == 0, "the supervised run failed"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        entry = json.loads((run_dir / "supervisor.jsonl").read_text().splitlines()[0])
        rows = _steps(run_dir)
        resumed = [r for r in rows if r["time"] > killed]
        first_after = min(r["time"] for r in resumed)
        before = [r["seconds"] for r in rows if r["time"] <= killed][1:]
        after = [r["seconds"] for r in resumed][1:]
    return table(["supervised run", "value"], [
        f"| plan | gpt-tiny, 2 nodes x 2 CPU ranks (2 stages x 2 pipelines), {steps} steps, "
        f"checkpoint every {every} |",
        f"| lost | node cpu-1's ranks killed after step {entry['last_step']} |",
        f"| re-plan | {entry['replan_seconds']:.2f} s ({entry['kept']}), predicted step "
        f"{entry['step_time_before'] * 1e3:.2f} ms -> {entry['step_time_after'] * 1e3:.2f} ms |",
        f"| steps lost | {entry['steps_lost']} (resumed from step {entry['resume_step']}; at "
        f"most {every}) |",
        f"| kill to the new plan's first step | {first_after - killed:.1f} s: "
        f"{entry['time'] - killed:.1f} s until the re-plan was written (the run's end "
        f"noticed, the verdict, the re-plan), {first_after - entry['time']:.1f} s to start "
        "the new plan's ranks, load the checkpoint and run a step |",
        f"| measured step | {sum(before) / len(before) * 1e3:.1f} ms on 4 ranks -> "
        f"{sum(after) / len(after) * 1e3:.1f} ms on 2 |",
        f"| load average at the end (other work on this machine) | {os.getloadavg()[0]:.1f} |"])


def main() -> None:
    replans, spares = [], []
    for scenario in SCENARIOS:
        replan_row, spare_row = planning(*scenario)
        print(replan_row, spare_row, sep="\n", flush=True)
        replans.append(replan_row)
        spares.append(spare_row)
    body = (table(["model", "cluster", "plan (solve, 30 s)", "lost", "re-plan",
                   "warm start (rebalance)", "kept", "best for survivors (30 s)",
                   "throughput vs best"], replans) + "\n"
            "Re-plan: `planner replan PLAN --lost NODE` (its default 10 s search), wall time "
            "on this machine; the plan is the solve's, the lost node the first it uses. "
            "Throughput vs best: the re-plan's samples/s as a share of the best plan's for "
            "the same survivors.\n\n"
            + table(["model", "cluster", "best plan", f"--spare {SPARE:g} plan (slack cost)",
                     "worst node lost", "step after (rebalance only)",
                     "throughput vs best for survivors"], spares) + "\n"
            "A `--spare` plan survives the loss of any one of its nodes by a rebalance of its "
            "batch shares alone (no search, no new layout of the layers); the worst node is "
            "the one whose loss leaves the slowest rebalance.\n")
    if "--no-live" not in sys.argv:
        body += "\n" + live()
    write_section("replan", "python benchmarks/replan.py", body)


if __name__ == "__main__":
    main()
