"""`planner tune`: short trial runs of the best plans, re-ranked by measured step time, and
what they measured written back into the cluster so the next solve prices with it (the
real-trial loop of AMP, Li et al. 2022, closed).

    trials = [run_trial(plan, out / f"plan-{k}", steps=6) for k, plan in enumerate(plans, 1)]
    ranked = rank(trials)                       # fastest measured first, failed runs last
    cluster = calibrate(cluster, trials, layers, costs)

Each trial is the plan's own launch (`planner.launch.render_launch`, target local: every
rank a process on this machine's CPU with gloo) for a few steps; its run summary
(`RUN_DIR/summary.json`) gives the median step time after the warm-up step. The local
target measures this machine's CPUs, so plans for CPU devices only are tried.

Write-back (`calibrate`): what a step's prediction holds least faithfully before a
trial is its compute (the catalog's CPU figures are datasheet guesses), so each trial
scales the predicted time its layers take on the critical path (compute and the
pipeline bubble it makes) to the time its ranks measured running their pipeline
schedules (`busy_mean` in the summary; the longest rank's), their tensor-parallel and
pipeline traffic charged as predicted:

    scale = (busy - tp traffic - pipeline traffic) / (compute + bubble)

Every layer of each of its stages gets a measured time at the stage's degree and the
pipeline's micro-batch size: the time the cost model gave it there, times the scale
(the scales of several trials at one device type, degree and size averaged). What each
rank spent after its schedule (its mean step less its busy time, less the gradient
sync as predicted) is its optimizer step, over the parameters it holds: each device
type's measured optimizer step, pooled over its ranks (`OptimizerTiming`).
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cost_models.imports import attach
from cost_models.model import CostModel
from planner.errors import PlannerError
from planner.types import (
    ClusterSpec,
    Layer,
    LayerTiming,
    MeasuredDevice,
    OptimizerTiming,
    Plan,
)

RUN_SCRIPT = "run-local.sh"


@dataclass(frozen=True, kw_only=True)
class RankFigures:
    """What a trial's summary says of one rank."""

    node: str
    busy: float  # mean seconds a step running its pipeline schedule
    step: float  # mean seconds a step
    params: float  # parameters it holds


@dataclass(frozen=True, kw_only=True)
class Trial:
    """One plan's trial run: `measured` its median step seconds (None where it failed,
    and `failure` says why), `ranks` each rank's figures."""

    index: int  # the plan's rank before the trials, 1 = predicted fastest
    plan: Plan
    folder: Path
    measured: float | None
    ranks: tuple[RankFigures, ...] = ()
    failure: str | None = None

    @property
    def predicted(self) -> float:
        return self.plan.prediction.step_time


def check_cpu_plans(plans: Sequence[Plan]) -> None:
    """Trials run on this machine's CPUs: refuse plans for other devices, whose measured
    times would say nothing about them."""
    for plan in plans:
        other = sorted({s.device_type for p in plan.pipelines for s in p.stages
                        if not plan.cluster.node(s.devices.node).device.is_cpu})
        if other:
            raise PlannerError(
                "bad-option", f"`planner tune` runs its trials on this machine's CPU (the "
                f"launch's local target), so it can measure plans for CPU devices only; this "
                f"plan runs on {', '.join(other)}.",
                ["tune a plan for a cluster of CPU nodes (e.g. --cluster 2x2xcpu)",
                 "for GPUs: run `planner launch` on the cluster and bring its per-layer "
                 "profile with `planner profile import`"])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def read_run(run_dir: Path) -> tuple[float, tuple[RankFigures, ...]]:
    """A run's median step seconds after its warm-up, and its ranks' figures."""
    path = run_dir / "summary.json"
    try:
        summary = json.loads(path.read_text())
        ranks = tuple(RankFigures(node=str(r["node"]), busy=float(r["busy_mean"]),
                                  step=float(r["step_time_mean"]), params=float(r["params"]))
                      for r in summary["ranks"])
        return float(summary["step_time"]["median"]), ranks
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PlannerError("trial-failed", f"{path} holds no step time ({exc}).",
                           ["run the trial with more --steps (the first is warm-up)"]
                           ) from None


def run_trial(plan: Plan, folder: Path, index: int, *, steps: int, timeout: float,
              force: bool = False) -> Trial:
    """Write the plan's local launch into `folder`, run it for `steps` steps and read its
    summary; a run that fails or outlasts `timeout` seconds is a Trial with its failure."""
    from planner.launch import render_launch, write_launch

    files = render_launch(plan, target="local", master_port=free_port(), python=sys.executable,
                          runtime_args=("--steps", str(steps), "--no-final-checkpoint"),
                          folder=str(folder.resolve()))
    write_launch(files, folder, force=force)
    try:
        done = subprocess.run(["bash", str(folder / RUN_SCRIPT)], capture_output=True,
                              text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return Trial(index=index, plan=plan, folder=folder, measured=None,
                     failure=f"ran past {timeout:g} s (logs: {folder / 'logs'})")
    (folder / "trial.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["no output"]
        return Trial(index=index, plan=plan, folder=folder, measured=None,
                     failure=f"exit {done.returncode}: {last[0]}")
    measured, ranks = read_run(folder / "run")
    return Trial(index=index, plan=plan, folder=folder, measured=measured, ranks=ranks)


def rank(trials: Sequence[Trial]) -> list[Trial]:
    """Fastest measured step first; failed trials last, in their predicted order."""
    return sorted(trials, key=lambda t: (t.measured is None, t.measured or 0.0, t.index))


def compute_scale(trial: Trial) -> float | None:
    """The factor on the time the trial's layers take on its predicted critical path that
    makes what its ranks measured (the module docstring's rule); None where it failed."""
    if trial.measured is None or not trial.ranks:
        return None
    prediction = trial.plan.prediction
    made = prediction.compute + prediction.bubble
    busy = max(r.busy for r in trial.ranks) - prediction.tp_comm - prediction.pp_comm
    return busy / made if made > 0 and busy > 0 else None


def optimizer_steps(trial: Trial) -> dict[str, tuple[float, float]]:
    """Per device type, (parameters, seconds) of the optimizer steps its ranks measured
    (the module docstring's rule), summed over them."""
    out: dict[str, tuple[float, float]] = {}
    for rank in trial.ranks:
        seconds = rank.step - rank.busy - trial.plan.prediction.dp_comm
        if seconds > 0 and rank.params > 0:
            kind = trial.plan.cluster.node(rank.node).device.name
            params, total = out.get(kind, (0.0, 0.0))
            out[kind] = (params + rank.params, total + seconds)
    return out


def calibrate(cluster: ClusterSpec, trials: Sequence[Trial], layers: Sequence[Layer],
              costs: CostModel) -> ClusterSpec:
    """`cluster` with the trials' measured layer times and optimizer steps (module
    docstring) on each device type they ran on; the cluster as it was where none
    succeeded."""
    found: dict[tuple[str, str, int, int], tuple[Layer, list[float]]] = {}
    steps: dict[str, tuple[float, float]] = {}
    for trial in trials:
        scale = compute_scale(trial)
        if scale is None:
            continue
        for pipe in trial.plan.pipelines:
            for stage in pipe.stages:
                for index in stage.held():
                    key = (stage.device_type, layers[index].signature, stage.tp,
                           pipe.micro_batch)
                    found.setdefault(key, (layers[index], []))[1].append(scale)
        for kind, (params, seconds) in optimizer_steps(trial).items():
            before = steps.get(kind, (0.0, 0.0))
            steps[kind] = (before[0] + params, before[1] + seconds)
    if not found:
        return cluster
    devices = cluster.device_types()
    first = trials[0].plan
    timings: dict[str, list[LayerTiming]] = {}
    for (kind, signature, tp, mb), (layer, scales) in found.items():
        base = costs.layer_time(layer, devices[kind], tp=tp, micro_batch=mb,
                                dtype=first.training.dtype)
        scale = statistics.fmean(scales)
        timings.setdefault(kind, []).append(LayerTiming(
            model=first.model.describe(), layer=signature, seq_len=first.training.seq_len,
            dtype=first.training.dtype, micro_batch=mb, tp=tp, fwd=base.fwd * scale,
            bwd=base.bwd * scale))
    folders = ", ".join(str(t.folder) for t in trials if compute_scale(t) is not None)
    for kind in sorted(timings):
        step = steps.get(kind)
        cluster = attach(cluster, kind, MeasuredDevice(
            layer_times=tuple(timings[kind]),
            optimizer=OptimizerTiming(params=step[0], seconds=step[1]) if step else None,
            source=f"planner tune trials {folders}"))
    return cluster
