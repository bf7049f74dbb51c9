"""Event-driven replay of one training step, to cross-check the closed form in
`planner.solver.timing`.

Every pipeline stage is one device (its tensor-parallel group acts as one). A
device runs one compute op at a time, in the fixed order its schedule gives
(`_device_order`), and starts each op as soon as the device is free and the
op's input has arrived:

- forward of micro-batch i on (virtual) stage k waits for the activation from
  stage k-1 (the first stage's input is there at time 0);
- backward of i on stage k waits for the gradient from stage k+1; the last
  stage's backward waits only for its own forward (the loss is part of it).

Sends are asynchronous: they do not occupy the sending device, but each link
direction carries one transfer at a time, first come first served. Links are
separate resources per (pipeline, boundary, direction): boundary b joins
stage b and stage b+1; with the interleaved schedule boundary S-1 is the
wrap-around link from the last device back to device 0 (next model chunk).
Every transfer over boundary b takes `stages[b].send`, in both directions:
the wrap-around link takes the last stage's (which the other schedules ignore).

Schedules (the per-device order of compute ops):

- GPIPE: forwards of micro-batches 0..m-1, then backwards in reverse order
  m-1..0 (GPipe/torchgpipe: the last stage starts the backward of the
  micro-batch it finished last).
- ONE_F_ONE_B (PipeDream-flush, Megatron's non-interleaved schedule): stage s
  runs min(m, S-s-1) warm-up forwards, then alternates one forward and one
  backward, then the remaining backwards; micro-batches in order.
- INTERLEAVED (Megatron's interleaved 1F1B) with v = `interleave` chunks per
  device: virtual stage j*S + s (chunk j) lives on device s and costs fwd/v
  and bwd/v. Micro-batches go in groups of S; within a group the device runs
  chunk 0 for all S of them, then chunk 1, ... (Megatron's schedule table with
  `microbatch_group_size_per_vp_stage` = S; backwards visit the chunks in
  reverse). Warm-up is min(m*v, 2*(S-s-1) + (v-1)*S) forwards, then 1F1B,
  then cool-down. Requires m % S == 0. With v = 1 it is ONE_F_ONE_B.
  `interleave` is ignored by the other schedules (as in `pipeline_time`).

`schedule` and `interleave` may also be one per pipeline (a plan's pipelines of
one stage run plain 1F1B beside interleaved ones). `microbatch_timings` gives each
micro-batch its own stage timings (micro-batches of different sizes: a step's
variable-length samples packed, `planner.data.steps`); the stage's own are then unused.

After every pipeline's last backward, every device runs the gradient sync
(`sync` seconds) and then the optimizer step (`optimizer` seconds), as the step
model has them (`planner.solver.step`); where the step's input takes `loading`
seconds to load (`planner.data.loading`), the pipelines wait for it first
(`step.fed`: the sync starts once both are done).

Event kinds:

    "fwd", "bwd"   compute of (pipeline, stage, micro-batch, chunk) on device `stage`
    "send"         activation over boundary `stage` (from stage to stage+1, or
                   S-1 to 0 for the wrap-around link); chunk = the sender's chunk
    "send-grad"    gradient over boundary `stage` (from stage+1 back to stage);
                   chunk = the sender's chunk
    "sync", "optimizer"  on every device; micro-batch and chunk are None

`stage` of a transfer is the boundary, i.e. the stage whose `send` it takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from planner.solver.step import (
    EVERY_STEP,
    NO_CONTENTION,
    OPTIMIZER,
    SYNC,
    Contention,
    overlappable,
    step_time,
)
from planner.solver.timing import StageTiming
from planner.types import Schedule, SyncSpec

FWD, BWD, SEND, SEND_GRAD = "fwd", "bwd", "send", "send-grad"
__all__ = ["BWD", "FWD", "OPTIMIZER", "SEND", "SEND_GRAD", "SYNC", "Event", "Simulation",
           "simulate"]


@dataclass(frozen=True)
class Event:
    """One interval on one device (compute, sync, optimizer) or link (transfers)."""

    pipeline: int
    stage: int
    kind: str
    microbatch: int | None
    chunk: int | None
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    step_time: float
    pipeline_times: tuple[float, ...]  # when each pipeline's last backward ends
    pipelines: float  # when the pipelines are done, their input loaded (`step.fed`)
    events: tuple[Event, ...]  # every compute and communication interval, sorted by start


def simulate(pipelines: Sequence[Sequence[StageTiming]], microbatches: Sequence[int], *,
             schedule: Schedule | Sequence[Schedule] = Schedule.ONE_F_ONE_B,
             interleave: int | Sequence[int] = 1,
             sync: float = 0.0, optimizer: float = 0.0,
             microbatch_timings: Sequence[Sequence[Sequence[StageTiming]]] | None = None,
             policy: SyncSpec = EVERY_STEP, loading: float = 0.0,
             tail: float = 0.0, contention: Contention = NO_CONTENTION) -> Simulation:
    """Replay one training step of the pipelines, each with its number of micro-batches;
    `microbatch_timings[p][i][s]`, where given, is stage s's timing for micro-batch i of
    pipeline p; the sync of `sync` seconds is paid as `policy` says (`step.py`; `tail`, its
    last bucket's all-reduce where it overlaps backward, slowed as `contention` says), once
    the pipelines are done and
    the step's input, `loading` seconds of it, is loaded."""
    schedules = ([schedule] * len(pipelines) if isinstance(schedule, Schedule)
                 else list(schedule))
    chunks = [interleave] * len(pipelines) if isinstance(interleave, int) else list(interleave)
    _check(pipelines, microbatches, schedules, chunks, sync, optimizer, loading)
    if microbatch_timings is not None:
        _check_microbatches(pipelines, microbatches, microbatch_timings)
    events: list[Event] = []
    times = []
    for p, (stages, m) in enumerate(zip(pipelines, microbatches, strict=True)):
        kind = schedules[p]
        v = chunks[p] if kind is Schedule.INTERLEAVED else 1
        if v == 1 and kind is Schedule.INTERLEAVED:
            kind = Schedule.ONE_F_ONE_B
        own = None if microbatch_timings is None else microbatch_timings[p]
        pipeline_events = _run_pipeline(p, list(stages), m, kind, v, own)
        events += pipeline_events
        times.append(max(e.end for e in pipeline_events if e.kind == BWD))
    step = step_time(times, sync, optimizer, policy=policy, loading=loading,
                     hidden=overlappable(t.bwd for stages in pipelines for t in stages),
                     tail=tail, contention=contention)
    for p, stages in enumerate(pipelines):
        for s in range(len(stages)):
            events += [Event(p, s, phase.kind, None, None, phase.start, phase.end)
                       for phase in step.phases()]
    events.sort(key=lambda e: (e.start, e.end, e.pipeline, e.stage))
    return Simulation(step_time=step.total, pipeline_times=tuple(times),
                      pipelines=step.pipelines, events=tuple(events))


def _check(pipelines: Sequence[Sequence[StageTiming]], microbatches: Sequence[int],
           schedules: Sequence[Schedule], chunks: Sequence[int], sync: float,
           optimizer: float, loading: float) -> None:
    if not pipelines:
        raise ValueError("simulate needs at least one pipeline")
    for what, values in (("micro-batch counts", microbatches), ("schedules", schedules),
                         ("interleave counts", chunks)):
        if len(values) != len(pipelines):
            raise ValueError(f"got {len(pipelines)} pipelines but {len(values)} {what}; "
                             "give one per pipeline")
    if min(chunks) < 1:
        raise ValueError(f"interleave must be >= 1, got {min(chunks)}")
    if min(sync, optimizer, loading) < 0:
        raise ValueError(f"sync, optimizer and loading times must be >= 0, got {sync}, "
                         f"{optimizer} and {loading}")
    for p, (stages, m) in enumerate(zip(pipelines, microbatches, strict=True)):
        if not stages:
            raise ValueError(f"pipeline {p} has no stages")
        if m < 1:
            raise ValueError(f"pipeline {p} needs at least 1 micro-batch, got {m}")
        if schedules[p] is Schedule.INTERLEAVED and chunks[p] > 1 and m % len(stages):
            raise ValueError(
                f"pipeline {p}: the interleaved schedule needs the number of micro-batches "
                f"({m}) to be a multiple of the number of stages ({len(stages)})")
        for s, st in enumerate(stages):
            if min(st.fwd, st.bwd, st.send) < 0:
                raise ValueError(f"pipeline {p} stage {s}: negative time in {st}")


def _check_microbatches(pipelines: Sequence[Sequence[StageTiming]],
                        microbatches: Sequence[int],
                        timings: Sequence[Sequence[Sequence[StageTiming]]]) -> None:
    if len(timings) != len(pipelines):
        raise ValueError(f"got {len(pipelines)} pipelines but micro-batch timings for "
                         f"{len(timings)}")
    for p, (stages, m, own) in enumerate(zip(pipelines, microbatches, timings, strict=True)):
        if len(own) != m or any(len(row) != len(stages) for row in own):
            raise ValueError(f"pipeline {p}: give a timing per stage ({len(stages)}) for each "
                             f"of its {m} micro-batches")
        for i, row in enumerate(own):
            for s, st in enumerate(row):
                if min(st.fwd, st.bwd, st.send) < 0:
                    raise ValueError(f"pipeline {p} micro-batch {i} stage {s}: negative time "
                                     f"in {st}")


def _device_order(schedule: Schedule, num_stages: int, s: int, m: int, v: int
                  ) -> list[tuple[str, int, int]]:
    """The compute ops of device s in the order it runs them: (kind, micro-batch, chunk)."""
    if schedule is Schedule.GPIPE:
        return [(FWD, i, 0) for i in range(m)] + [(BWD, i, 0) for i in reversed(range(m))]
    if v == 1:
        table = [(i, 0) for i in range(m)]
        warmup = min(m, num_stages - s - 1)
    else:
        table = [(g + i, j) for g in range(0, m, num_stages) for j in range(v)
                 for i in range(num_stages)]
        warmup = min(m * v, 2 * (num_stages - s - 1) + (v - 1) * num_stages)
    fwd = [(FWD, i, j) for i, j in table]
    bwd = [(BWD, i, v - 1 - j) for i, j in table]
    order = fwd[:warmup]
    for k in range(len(fwd) - warmup):
        order += [fwd[warmup + k], bwd[k]]
    return order + bwd[len(bwd) - warmup:]


def _run_pipeline(p: int, stages: list[StageTiming], m: int, schedule: Schedule, v: int,
                  own: Sequence[Sequence[StageTiming]] | None = None) -> list[Event]:
    """List scheduler: each device takes its next op as soon as the op's input is known.

    A link direction only carries the outputs of one device, produced in that
    device's order, so booking transfers as the ops are placed keeps the links
    first come first served.
    """
    num = len(stages)
    last = num * v - 1  # last virtual stage
    # each micro-batch's stage timings: the stages' own, or the micro-batch's
    timing = [stages] * m if own is None else [list(row) for row in own]
    orders = [_device_order(schedule, num, s, m, v) for s in range(num)]
    nxt = [0] * num  # index of each device's next op
    free = [0.0] * num  # when each device is free
    link_free: dict[tuple[int, str], float] = {}
    fwd_end: dict[tuple[int, int], float] = {}  # (virtual stage, micro-batch) -> time
    arrived: dict[tuple[str, int, int], float] = {}  # input of (kind, virtual stage, mb)
    events: list[Event] = []

    def transfer(kind: str, boundary: int, i: int, chunk: int, ready: float) -> float:
        start = max(ready, link_free.get((boundary, kind), 0.0))
        end = start + timing[i][boundary].send
        link_free[(boundary, kind)] = end
        events.append(Event(p, boundary, kind, i, chunk, start, end))
        return end

    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(num):
            while nxt[s] < len(orders[s]):
                kind, i, j = orders[s][nxt[s]]
                k = j * num + s
                if kind == FWD:
                    ready = 0.0 if k == 0 else arrived.get((FWD, k, i))
                elif k == last:
                    ready = fwd_end.get((k, i))
                else:
                    ready = arrived.get((BWD, k, i))
                if ready is None or (kind == BWD and (k, i) not in fwd_end):
                    break
                start = max(free[s], ready)
                dur = (timing[i][s].fwd if kind == FWD else timing[i][s].bwd) / v
                free[s] = start + dur
                events.append(Event(p, s, kind, i, j, start, free[s]))
                if kind == FWD:
                    fwd_end[(k, i)] = free[s]
                    if k < last:
                        arrived[(FWD, k + 1, i)] = transfer(SEND, s, i, j, free[s])
                elif k > 0:
                    boundary = (k - 1) % num
                    arrived[(BWD, k - 1, i)] = transfer(SEND_GRAD, boundary, i, j, free[s])
                nxt[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for the schedules above
            raise RuntimeError(f"pipeline {p}: the {schedule.value} schedule deadlocked")
    return events
