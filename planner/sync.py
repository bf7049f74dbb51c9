"""The gradient sync a plan asks for (`SyncSpec`): `--sync` as the CLI takes it, the
checks a plan's sync passes, and what explain and compare say about it.

    --sync every-step          gradients summed every step (the default)
    --sync local-sgd:H         local SGD, parameters averaged every H steps
    --sync average:H           periodic model averaging, one weight per pipeline
    --sync diloco:H            DiLoCo: an outer Nesterov step every H steps
    --sync auto --max-interval H   the solver picks the interval (`solve_auto`)
    --overlap-sync             every-step sums start in backward (DDP's buckets)

What the modes do at run time: `planner/runtime/sync_modes.py` and `overlap.py`; how a
step pays its sync: `planner/solver/step.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.errors import PlannerError
from planner.types import ClusterSpec, ModelGraph, Plan, SyncSpec, TrainingSpec

if TYPE_CHECKING:
    from planner.solver import Progress, SolveOptions
from planner.types.training import SYNC_MODES

AUTO = "auto"
MAX_INTERVAL = 1024  # the most steps between syncs a plan may ask for


@dataclass(frozen=True)
class AutoSync:
    """`--sync auto`: the solver picks H up to `max_interval` (local SGD)."""

    max_interval: int


def parse_sync(text: str, *, overlap: bool = False, max_interval: int | None = None
               ) -> SyncSpec | AutoSync:
    """`--sync`, `--overlap-sync` and `--max-interval` as a SyncSpec (or AutoSync); an
    error naming the option at fault."""
    mode, _, count = text.strip().lower().partition(":")
    if mode == AUTO and not count:
        if max_interval is None:
            raise PlannerError("bad-option", "--sync auto needs --max-interval H: the most "
                               "steps between syncs the solver may choose.",
                               ["--sync auto --max-interval 8"])
        _check_interval(max_interval, "--max-interval")
        if overlap:
            raise PlannerError("bad-option", "--overlap-sync overlaps every step's sums with "
                               "backward; --sync auto may sync less often.",
                               ["drop --overlap-sync", "or give --sync every-step"])
        return AutoSync(max_interval)
    if max_interval is not None:
        raise PlannerError("bad-option", f"--max-interval goes with --sync auto (got --sync "
                           f"{text}).", ["give --sync auto --max-interval H",
                                         "or drop --max-interval"])
    if mode not in SYNC_MODES:
        raise PlannerError("bad-option", f"--sync {text!r} is not one of every-step, "
                           "local-sgd:H, average:H, diloco:H, auto.",
                           ["--sync local-sgd:4 (parameters averaged every 4 steps)"])
    if mode == "every-step":
        if count:
            raise PlannerError("bad-option", f"--sync {text!r}: every-step syncs every step; "
                               "an interval goes with local-sgd, average or diloco.",
                               [f"--sync local-sgd:{count}"])
        return SyncSpec(overlap=overlap)
    if not count.isdigit():
        raise PlannerError("bad-option", f"--sync {text!r} needs the steps between syncs: "
                           f"{mode}:H with H a whole number.", [f"--sync {mode}:4"])
    _check_interval(int(count), f"--sync {mode}:H")
    if overlap:
        raise PlannerError("bad-option", f"--overlap-sync overlaps every step's gradient sums "
                           f"with backward; --sync {text} averages after the optimizer step "
                           "every few steps, so there is nothing to overlap.",
                           ["drop --overlap-sync"])
    return SyncSpec(mode=mode, interval=int(count))


def check_zero(asked: SyncSpec | AutoSync, zero: int | None) -> None:
    """An error where --zero shards what a mode that syncs every few steps keeps whole:
    each pipeline's optimizer state."""
    if zero and (isinstance(asked, AutoSync) or asked.local):
        mode = "auto" if isinstance(asked, AutoSync) else asked.describe()
        raise PlannerError("bad-option", f"--zero {zero} with --sync {mode}: between syncs each "
                           "pipeline steps its own optimizer, whose state ZeRO would shard "
                           "across the pipelines.", ["drop --zero (these modes run without "
                                                     "ZeRO)", "or give --sync every-step"])


def _check_interval(value: int, option: str) -> None:
    if not 1 <= value <= MAX_INTERVAL:
        raise PlannerError("bad-option", f"{option} must be between 1 and {MAX_INTERVAL} "
                           f"steps (got {value}).")


def check_sync(plan: Plan) -> None:
    """An error naming the field where a plan's `training.sync` is one the runtime cannot
    run: an unknown mode, an interval out of range or with every-step, overlap with a
    mode that syncs every few steps, or ZeRO beside such a mode (each pipeline keeps
    its own optimizer state between syncs, which ZeRO would shard across them)."""
    sync = plan.training.sync
    if sync.mode not in SYNC_MODES:
        raise PlannerError("bad-plan", f"training.sync.mode {sync.mode!r} is not one of "
                           f"{', '.join(SYNC_MODES)}.", ["correct training.sync.mode"])
    if not 1 <= sync.interval <= MAX_INTERVAL:
        raise PlannerError("bad-plan", f"training.sync.interval must be between 1 and "
                           f"{MAX_INTERVAL} (got {sync.interval}).",
                           ["correct training.sync.interval"])
    if not sync.local and sync.interval != 1:
        raise PlannerError("bad-plan", f"training.sync.interval is {sync.interval} with mode "
                           "every-step, which syncs every step.",
                           ["give training.sync.interval 1",
                            "or a mode that syncs every few steps (local-sgd)"])
    if sync.local and sync.overlap:
        raise PlannerError("bad-plan", f"training.sync.overlap is true with mode {sync.mode}, "
                           "which averages after the optimizer step every "
                           f"{sync.interval} steps: nothing overlaps backward.",
                           ["set training.sync.overlap to false"])
    if not (sync.bucket_mb > 0 and math.isfinite(sync.bucket_mb)):
        raise PlannerError("bad-plan", "training.sync.bucket_mb must be a positive number of "
                           f"MiB (got {sync.bucket_mb}).",
                           ["give training.sync.bucket_mb 25 (DDP's bucket_cap_mb)"])
    for p in plan.pipelines if sync.local else ():
        for s in p.stages:
            if s.zero:
                raise PlannerError(
                    "bad-plan", f"pipelines[{p.index}].stages[{s.index}].zero is {s.zero} "
                    f"with training.sync.mode {sync.mode}: each pipeline keeps its own "
                    "optimizer state between syncs, which ZeRO would shard across the "
                    "pipelines.", ["plan it with --zero 0", "or with --sync every-step"])


def sync_note(plan: Plan) -> str | None:
    """What explain and compare say about a plan's sync: the communication it saves per
    step and, for the modes that change the optimization, the convergence risk (samples
    each pipeline trains on between syncs, and how stale the others' updates are by
    then); None for a plain every-step sync."""
    sync, prediction = plan.training.sync, plan.prediction
    saved = prediction.sync_saved
    if not sync.local and not sync.overlap:
        return None
    if not sync.local:
        return (f"Gradient sync overlaps backward: {_ms(prediction.dp_comm)} of "
                f"{_ms(prediction.whole_sync or prediction.dp_comm)} exposed per step "
                f"({_ms(saved)} hidden); the optimization is every-step data parallelism's.")
    shares = [p.batch_share for p in plan.pipelines]
    between = f"{min(shares) * sync.interval}" + (
        f"-{max(shares) * sync.interval}" if min(shares) != max(shares) else "")
    what = {"local-sgd": "parameters averaged (weighted by batch share)",
            "average": "parameters averaged (one weight per pipeline)",
            "diloco": "an outer Nesterov step on the averaged change"}[sync.mode]
    return (f"{sync.mode}:{sync.interval}: {what} every {sync.interval} steps, "
            f"{_ms(prediction.dp_comm)} of sync per step instead of "
            f"{_ms(prediction.whole_sync or prediction.dp_comm)} ({_ms(saved)} saved). "
            f"Convergence risk: each pipeline trains {between} samples between syncs "
            f"(up to {sync.interval - 1} steps behind the others' updates); compare its "
            "loss curve with every-step sync's before a long run.")


def convergence_risk(plan: Plan) -> str:
    """How far a plan's pipelines drift between syncs, for compare: none where they
    sync every step; else the samples each trains on alone between syncs and the
    steps the others' updates reach it late."""
    sync = plan.training.sync
    if not sync.local:
        return "none (every step)"
    most = max(p.batch_share for p in plan.pipelines) * sync.interval
    return f"{most:,} samples alone, {sync.interval - 1} step(s) stale"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


AUTO_SHARE = 0.05  # --sync auto: the largest share of a step its sync may take


def auto_interval(plan: Plan, most: int) -> int:
    """The fewest steps between syncs, a power of two up to `most`, at which a plan's
    sync takes at most AUTO_SHARE of its step (each step pays 1/H of it: `step.py`);
    `most` where none does. More steps between syncs cost convergence (the pipelines
    drift apart), so no more than the communication asks for."""
    whole = plan.prediction.whole_sync
    whole = plan.prediction.dp_comm if whole is None else whole
    rest = plan.prediction.step_time - plan.prediction.dp_comm  # the step without its sync
    interval = 1
    while interval < most and whole / interval > AUTO_SHARE * (rest + whole / interval):
        interval *= 2
    return min(interval, most)


def solve_auto(graph: ModelGraph, cluster: ClusterSpec, training: TrainingSpec,
               options: SolveOptions, asked: AutoSync, *,
               progress: Callable[[Progress], None] | None = None) -> list[Plan]:
    """`planner solve --sync auto --max-interval H`: every-step sync overlapping backward
    where its sync takes at most AUTO_SHARE of the step; else local SGD at the interval
    `auto_interval` gives the plan found at the largest interval allowed, solved again
    at that interval (each solve gets a third of the time limit)."""
    import dataclasses

    from planner.solver import solve

    limit = options.time_limit and options.time_limit / 3
    options = dataclasses.replace(options, time_limit=limit)

    def solve_at(sync: SyncSpec) -> list[Plan]:
        return solve(graph, cluster, dataclasses.replace(training, sync=sync), options,
                     progress=progress)

    every = solve_at(SyncSpec(overlap=True))
    if auto_interval(every[0], asked.max_interval) == 1:
        return every
    widest = solve_at(SyncSpec(mode="local-sgd", interval=asked.max_interval))
    interval = max(2, auto_interval(widest[0], asked.max_interval))
    if interval == asked.max_interval:
        return widest
    return solve_at(SyncSpec(mode="local-sgd", interval=interval))
