"""Gradient sync (issue 48): sums that overlap backward on a slow link, and local SGD
against every-step sync, measured on this machine's CPU with the real runtime.

    python benchmarks/sync.py            # writes the "sync-*" sections of RESULTS.md
    python benchmarks/sync.py --quick    # fewer steps, no RESULTS.md
    python benchmarks/sync.py --section strategies   # section 3 alone (no run: predicted)

1. sync-overlap. Two workers, one thread each, pinned to cores 0 and 1, joined by a
   slow link: the loopback device of a network namespace of the benchmark's own
   (`unshare --net`, which needs root), its rate capped by a token bucket (`tc qdisc ...
   tbf rate RATE`). Every figure comes from the pipeline a user runs: `planner profile
   --full` times gpt-tiny's layers on a worker core, `planner profile --processes 2`
   measures gloo all-reduce over the slowed link and how computing and an all-reduce in
   flight slow each other there (its `contention`, which joins the layers' profile),
   `profile merge` makes the cluster, and
   `planner estimate --dp 2 --micro-batch` prices even data parallelism (one micro-batch
   a step, whose whole backward a sync may overlap), once with the sync after backward
   and once with `--overlap-sync` in buckets of BUCKET_MB (the plan's
   training.sync.bucket_mb, set in the plan file and priced again with `planner estimate
   --plan`); `planner launch --target local` runs each. Reported: predicted against
   measured step time (median over the steps after warm-up, then over repeats) and
   exposed sync: the mean time from its last backward's end to its sums' end of the rank
   that computed longest, which is what the step model's sync term is (the step is the
   slowest pipeline and then the sync: a faster rank's wait for the slower's buckets is
   the imbalance of the pipelines, not the sync); beside it, summary.json's
   gradient_sync.exposed, the largest rank's. Target: within 15% each.
2. sync-local-sgd. mlp-small learning tests.runtime_data.teacher (the class of a
   Gaussian input given by the signs of its first two features) on two pipelines
   (1x2xcpu, 16 samples a step, SGD): every-step sync against local SGD averaging
   every 4 steps, the two loss curves at equal samples. Target: local SGD ends within
   5% of every-step's loss (mean of the last 8 steps), as tests/test_sync.py checks.

3. sync-strategies. `planner compare --strategies` on three cases: DDP, FSDP ZeRO-2/3,
   local SGD and DiLoCo every 8 steps and the solver's hybrid plan, each at its fastest
   replica count, predicted (no run): throughput, peak memory per device, communication
   per step, convergence risk, and the fastest strategy that keeps every-step sync
   against the hybrid. No target: it shows where each strategy pays.

Like benchmarks/launch_e2e.py, the timings hold only while nothing else runs on the
two cores; each run's workers are compared with their profile and a run computing more
than BUSY_TOLERANCE off it is marked disturbed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_runs import planner, run_local
from results import table, write_section

MODEL = "gpt-tiny"
WORKERS = (("worker-0", "0"), ("worker-1", "1"))
RATE = "300mbit"  # the slowed link (tc's units): gpt-tiny's fp32 sync outlasts its backward
# the bucket's depth: above loopback's 64 KiB packets, or they never pass, and no more (at
# 1mb, a sync after the idle forward and backward passed its first megabyte at loopback
# speed, 15% faster than the back-to-back all-reduces the profile times: no real link
# runs above its rate)
BURST = "128kb"
BATCH = 48  # 24 samples a worker: one micro-batch each, its backward about half the sync
BUCKET_MB = 0.25  # gpt-tiny's 3.5 MB of gradients in 14 buckets or so
BUSY_TOLERANCE = 1.25  # computing this much off the profile: a disturbed run
INSIDE = "PLANNER_SYNC_BENCHMARK_NETNS"  # set in the namespace the benchmark made


@dataclass(frozen=True)
class Settings:
    steps: int  # per run, 2 of them warm-up
    repeats: int  # runs per layout, alternating
    local_steps: int  # training steps of the local-SGD curves


FULL = Settings(steps=12, repeats=3, local_steps=48)
QUICK = Settings(steps=6, repeats=1, local_steps=16)


def slow_link() -> None:
    """Inside the namespace: bring its loopback up and cap its rate."""
    for command in (["ip", "link", "set", "lo", "up"],
                    ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", RATE,
                     "burst", BURST, "latency", "400ms"]):
        subprocess.run(command, check=True)


def cluster(work: Path) -> Path:
    """Profile a worker core (both are alike), measure the link, merge."""
    profile = work / "worker.json"
    planner("profile", "--full", "--model", MODEL, "--devices", "cpu", "--no-comm", "-o",
            str(profile), "--force", "--json", cpus=WORKERS[0][1])
    comm = work / "comm.json"
    planner("profile", "--quick", "--devices", "cpu", "--processes", "2", "-o", str(comm),
            "--force", "--json", cpus=",".join(cpu for _, cpu in WORKERS))
    fit = json.loads(comm.read_text())["communication"]
    n, all_reduce = fit["world_size"], fit["collectives"]["all_reduce"]
    bandwidth = all_reduce["beta_bandwidth"] * 2 * (n - 1) / n  # the ring's per link
    latency = all_reduce["alpha"] / (2 * (n - 1))
    both = work / "worker-comm.json"  # the worker core's profile, its contention measured
    both.write_text(json.dumps(dict(json.loads(profile.read_text()), communication=fit)))
    path = work / "cluster.yaml"
    planner("profile", "merge", str(both), str(both), "--names",
            ",".join(name for name, _ in WORKERS), "--network",
            f"{bandwidth * 8 / 1e9:.6g}Gbps/{latency * 1e6:.6g}us", "-o", str(path), "--force")
    return path


def estimate(cluster_file: Path, out: Path, *overlap: str) -> dict:
    """The plan, priced; an overlapping sync's in buckets of BUCKET_MB (written into the
    plan file, which `planner estimate --plan` prices as written)."""
    planner("estimate", MODEL, "--cluster", str(cluster_file), "--global-batch", str(BATCH),
            "--dtype", "fp32", "--tp", "1", "--pp", "1", "--dp", str(len(WORKERS)),
            "--micro-batch", str(BATCH // len(WORKERS)), *overlap, "-o", str(out), "--force",
            "--json")
    if overlap:
        plan = json.loads(out.read_text())
        plan["training"]["sync"]["bucket_mb"] = BUCKET_MB
        out.write_text(json.dumps(plan))
        planner("estimate", "--plan", str(out), "-o", str(out), "--force", "--json")
    return json.loads(out.read_text())


def launch(plan: Path, out: Path, steps: int) -> dict:
    cpus = [arg for name, cpu in WORKERS for arg in ("--cpus", f"{name}={cpu}")]
    planner("launch", str(plan), "--out", str(out), "--target", "local", "--steps", str(steps),
            "--force", "--master-port", "29741", *cpus, "--runtime-arg=--warmup",
            "--runtime-arg=2", "--runtime-arg=--no-final-checkpoint")
    return run_local(out)


def _error(measured: float, predicted: float) -> float:
    return abs(measured - predicted) / measured


def _exposed_at(plan_file: Path, busy: float) -> float:
    """The step model's exposed sync of the plan had its stage computed `busy` seconds
    (forward and backward as the profile splits them)."""
    from cost_models.model import AnalyticalCostModel
    from planner.explain import retrace
    from planner.planfile import read_plan
    from planner.solver.predict import plan_contention, tail_sync
    from planner.solver.step import exposed

    plan = read_plan(plan_file)
    stage = json.loads(planner("explain", str(plan_file), "--json"))["stages"][0]
    backward = busy * stage["bwd"] / (stage["fwd"] + stage["bwd"])
    costs = AnalyticalCostModel(plan.cluster)
    return exposed(plan.prediction.whole_sync, backward, plan.training.sync,
                   tail_sync(plan, retrace(plan).layers, costs), plan_contention(plan, costs))


def _slowest_rank(summary: dict) -> dict:
    """The rank that computed longest: the step's sync is paid after its backward."""
    return max(summary["ranks"], key=lambda rank: rank["busy_mean"])


def overlap_section(work: Path, settings: Settings) -> str:
    """Section 1 (run inside the namespace)."""
    slow_link()
    cluster_file = cluster(work)
    layouts = {"after backward": (), "overlapping backward": ("--overlap-sync",)}
    plans = {name: estimate(cluster_file, work / f"{i}.json", *flags)
             for i, (name, flags) in enumerate(layouts.items())}
    measured: dict[str, list[dict]] = {name: [] for name in layouts}
    for repeat in range(settings.repeats):
        for i, name in enumerate(layouts):
            summary = launch(work / f"{i}.json", work / f"run-{i}", settings.steps)
            measured[name].append(summary)
            print(f"repeat {repeat + 1}, sync {name}: {summary['step_time']['median']:.3f} s "
                  f"a step, {_slowest_rank(summary)['sync_exposed_mean']:.3f} s exposed "
                  f"({summary['gradient_sync']['exposed']:.3f} s on the rank that waited "
                  "longest)", flush=True)
    rows, met = [], True
    for index, (name, plan) in enumerate(plans.items()):
        runs = measured[name]
        step = statistics.median(r["step_time"]["median"] for r in runs)
        exposed = statistics.median(_slowest_rank(r)["sync_exposed_mean"] for r in runs)
        largest = statistics.median(r["gradient_sync"]["exposed"] for r in runs)
        in_flight = statistics.median(r["gradient_sync"]["in_flight"] for r in runs)
        busy = statistics.median(_slowest_rank(r)["busy_mean"] for r in runs)
        prediction = plan["prediction"]
        disturbed = busy > BUSY_TOLERANCE * prediction["compute"] or (
            busy < prediction["compute"] / BUSY_TOLERANCE)
        errors = (_error(step, prediction["step_time"]), _error(exposed, prediction["dp_comm"]))
        met = met and max(errors) <= 0.15 and not disturbed
        rows.append(f"| {name} | {prediction['step_time']:.3f} s | {step:.3f} s | "
                    f"{errors[0]:.1%} | {prediction['dp_comm']:.3f} s | {exposed:.3f} s | "
                    f"{errors[1]:.1%} | {largest:.3f} s | {prediction['whole_sync']:.3f} s | "
                    f"{in_flight:.3f} s | {busy:.3f} s vs {prediction['compute']:.3f} s"
                    f"{' (disturbed)' if disturbed else ''} | "
                    f"{_exposed_at(work / f'{index}.json', busy):.3f} s |")
    link = json.loads((work / "comm.json").read_text())["communication"]
    bandwidth = link["collectives"]["all_reduce"]["beta_bandwidth"]
    contention = link["contention"]
    return (f"gpt-tiny, fp32, global batch {BATCH} as two one-micro-batch pipelines on two "
            f"cores, joined by loopback capped at {RATE} (tc tbf; gloo all-reduce measured "
            f"at {bandwidth * 8 / 1e6:.0f} Mb/s of bus bandwidth; with an all-reduce in "
            f"flight, computing measured {contention['compute_slowdown']:.1%} slower and the "
            f"all-reduce beside computing {contention['collective_slowdown']:.1%}), buckets "
            f"of {BUCKET_MB} MiB; {settings.repeats} run(s) of {settings.steps} steps each, "
            "alternating.\n\n"
            + table(["sync", "predicted step", "measured step", "error", "predicted exposed",
                     "measured exposed", "error", "exposed on the rank that waited longest",
                     "predicted whole sync", "measured in flight",
                     "computing (measured vs profile)", "exposed at the measured computing"],
                    rows)
            + "\nMeasured exposed and computing are the rank's that computed longest (the "
            "step pays the sync after the slowest pipeline); the rank that waited longest "
            "(summary.json's gradient_sync.exposed) also waited for the other's slower "
            "backward. Predicted computing includes what an overlapped sync slows it by "
            "(`step.slowed`, the profile's contention). The last column is the step model's "
            "exposed sync (`step.exposed`, an "
            "overlapped sync never below its last bucket's all-reduce) with the backward the "
            "run measured (its computing, split as the profile splits forward and backward) "
            "in place of the profile's: the sync model apart from how well the profile held "
            "on the machine at the time.\n"
            + f"\nTarget (predicted vs measured step and exposed sync within 15%, overlap on "
            f"and off): {'met' if met else 'NOT met'}.\n")


def local_sgd_section(work: Path, settings: Settings) -> str:
    """Section 2: the two loss curves."""
    curves = {}
    for name, flags in (("every-step", ()), ("local-sgd:4", ("--sync", "local-sgd:4"))):
        plan = work / f"mlp-{name}.json"
        planner("estimate", "mlp-small", "--cluster", "1x2xcpu", "--global-batch", "16",
                "--dtype", "fp32", "--dp", "2", "--micro-batch", "4", *flags, "-o", str(plan),
                "--force", "--json")
        out = work / f"mlp-{name}"
        planner("launch", str(plan), "--out", str(out), "--target", "local", "--steps",
                str(settings.local_steps), "--force", "--master-port", "29751",
                "--data", "tests.runtime_data:teacher", "--lr", "0.3",
                "--runtime-arg=--optimizer", "--runtime-arg=sgd",
                "--runtime-arg=--no-final-checkpoint")
        curves[name] = [row["loss"] for row in run_local(out)["losses"]]
    every, local = curves["every-step"], curves["local-sgd:4"]
    tail = min(8, len(every))
    end_every, end_local = (statistics.fmean(c[-tail:]) for c in (every, local))
    rows = [f"| {step} | {step * 16} | {every[step - 1]:.4f} | {local[step - 1]:.4f} |"
            for step in range(1, len(every) + 1) if step % 4 == 0 or step == 1]
    within = abs(end_local - end_every) / end_every
    return ("mlp-small on tests.runtime_data.teacher, two pipelines of 8 samples (1x2xcpu, "
            "SGD, lr 0.3); local SGD averages the parameters, weighted by batch share, "
            "after every 4th step.\n\n"
            + table(["step", "samples", "every-step loss", "local-sgd:4 loss"], rows)
            + f"\nMean loss of the last {tail} steps: every-step {end_every:.4f}, local-sgd:4 "
            f"{end_local:.4f} ({within:.1%} apart; target within 5%: "
            f"{'met' if within <= 0.05 else 'NOT met'}). Local SGD syncs a quarter as "
            "often: on a slow link, about a quarter of the sync per step "
            "(`planner estimate --sync local-sgd:4`).\n")


# (model, cluster, global batch, sequence length): a small model on 10 Gb/s consumer
# cards, a 7B model that fits them only as a pipeline, a 1.3B model on the A100/V100 lab
STRATEGY_CASES = (("gpt2-small", "consumer-rtx", 64, 1024), ("llama2-7b", "consumer-rtx", 32, 1024),
                  ("gpt3-1.3b", "a100-v100-lab", 512, 2048))
STRATEGY_TIME_LIMIT = 60  # seconds for each hybrid plan's search


def _strategy_cell(row: dict) -> list[str]:
    """A strategy's figures as table cells; where it fits nowhere, says so."""
    found = row["figures"]
    if found is None:
        return ["-", "-", "-", "-", f"no plan: {row['reason']}"]
    memory = f"{found['peak_memory'] / 2**30:.1f} of {found['capacity'] / 2**30:.0f} GiB"
    if not row["fits"]:
        return ["-", "-", memory, "-", "does not fit at any replica count"]
    return [str(row["replicas"]), f"{found['samples_per_s']:,.0f}", memory,
            f"{found['comm_bytes'] / 2**20:,.0f} MiB, {found['comm_seconds'] * 1e3:.1f} ms",
            found["risk"]]


def strategies_section() -> str:
    """The strategy report of each of STRATEGY_CASES, as one table, and the hybrid
    against the fastest every-step strategy."""
    rows, notes = [], []
    for model, cluster, batch, seq in STRATEGY_CASES:
        report = json.loads(planner("compare", "--strategies", model, "-c", cluster,
                                    "-B", str(batch), "-s", str(seq),
                                    "--time-limit", str(STRATEGY_TIME_LIMIT), "--json"))
        case = f"{model} on {cluster}, B {batch}, seq {seq}"
        for row in report["rows"]:
            rows.append(f"| {case} | {row['name']} | " + " | ".join(_strategy_cell(row)) + " |")
        every_step = [r for r in report["rows"][:3] if r["fits"] and r["figures"]]
        hybrid = report["rows"][-1]
        if hybrid["figures"] and every_step:
            best = max(every_step, key=lambda r: r["figures"]["samples_per_s"])
            ratio = hybrid["figures"]["samples_per_s"] / best["figures"]["samples_per_s"]
            notes.append(f"- {case}: the hybrid plan {ratio:.2f}x {best['name']}'s throughput.")
        elif hybrid["figures"]:
            notes.append(f"- {case}: only the hybrid plan fits "
                         f"({hybrid['figures']['samples_per_s']:,.0f} samples/s).")
    return (table(["case", "strategy", "replicas", "samples/s", "peak memory per device",
                   "communication per step", "convergence risk"], rows)
            + "\n" + "\n".join(notes) + "\n")


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.add_argument("--quick", action="store_true", help="fewer steps; no RESULTS.md")
    options.add_argument("--work", type=Path, default=None, help="Keep the files here.")
    options.add_argument("--section", choices=("overlap", "local-sgd", "strategies"),
                         default=None,
                         help="Run one section only.")
    args = options.parse_args()
    settings = QUICK if args.quick else FULL
    work = args.work or Path(tempfile.mkdtemp(prefix="planner-sync-"))
    work.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/sync.py" + (" --quick" if args.quick else "") + (
        f" --section {args.section}" if args.section else "")
    if os.environ.get(INSIDE):  # (the namespace's half: section 1, to a file)
        (work / "overlap.md").write_text(overlap_section(work, settings))
        return
    print(f"work folder: {work}", flush=True)
    if args.section in (None, "overlap"):
        subprocess.run(["unshare", "--net", sys.executable, __file__, "--work", str(work),
                        *(["--quick"] if args.quick else [])],
                       env=dict(os.environ, **{INSIDE: "1"}), check=True)
        body = (work / "overlap.md").read_text()
        print(body)
        if not args.quick:
            write_section("sync-overlap", command, body)
    if args.section in (None, "local-sgd"):
        body = local_sgd_section(work, settings)
        print(body)
        if not args.quick:
            write_section("sync-local-sgd", command, body)
    if args.section in (None, "strategies"):
        body = strategies_section()
        print(body)
        if not args.quick:
            write_section("sync-strategies", command, body)


if __name__ == "__main__":
    main()
