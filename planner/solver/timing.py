"""Closed-form step time of pipelines, shared by the search, `estimate` and the
simulator's cross-check (`planner.simulate` replays the same model event by event).

A pipeline of S stages runs m micro-batches. Stage s takes f_s forward and
b_s backward per micro-batch (tensor-parallel all-reduces and recomputation
included), and sending its output to stage s+1 (or the gradient back) takes
c_s one way. Sends are asynchronous and overlap compute, but every micro-batch
must travel the whole pipeline and back while at most S micro-batches are in
flight, so the steady-state period is bounded by the round trip over S:

    1F1B         P = max( max_s c_s,  max over windows s <= u of
                              (sum_{s..u} (f_t+b_t) + 2 sum_{s..u-1} c_t) / (u - s + 1) )
                 T = (m - 1) P + sum_s (f_s + b_s) + 2 sum_s c_s

    (the windows: stage s keeps S - s micro-batches in flight, so the round trip from
    stage s to stage u and back, which stage u's own order paces, passes u - s + 1
    micro-batches per period; the window of one stage is its busy time, the whole
    pipeline the full round trip, and two stages joined by a slow link the pair)
    GPipe        P = max(max_s f_s, max_s c_s) + max(max_s b_s, max_s c_s)
                 T as 1F1B (all forwards run before all backwards: a forward
                 pipeline, then a backward one, each paced by its slowest compute or
                 send; no in-flight limit, so no round trips)
    interleaved  v model chunks per device (Megatron), c_S-1 the wrap-around send
                 from the last device back to the first (a round's output on to the
                 next round's first chunk; S > 1):
                 P = max_s max( f_s + b_s, b_s + v c_s )
                 T = (m - 1) P + sum_s (f_s + b_s) / v + (1 - 1/v) P
                     + 2 (v sum_{s<S-1} c_s + (v - 1) c_S-1)
                 (a micro-batch crosses each inner link v times and the wrap-around
                 v - 1 times, each way; each chunk's gradient crosses the link before
                 the next backward of its sender: where a send is long against a
                 chunk's compute, the period grows by about v per second of send,
                 which b_s + v c_s bounds from above in the simulator; max_s v c_s, the
                 link's load alone, came out up to a quarter too fast there:
                 benchmarks/closed_form.py)

A training step: step = max over pipelines of T(m_p) + gradient sync + optimizer.
These are exact for balanced stages without sends; tests measure the error
against the simulator for unbalanced stages and slow links.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.types import Schedule


@dataclass(frozen=True)
class StageTiming:
    """Seconds per micro-batch of one stage (per device of its tensor-parallel group).

    fwd, bwd:  including tensor-parallel communication (tp_fwd, tp_bwd) and, in
               bwd, recomputation (recompute).
    send:      one-way time of this stage's output to the next stage; the gradient
               travels back the same way. The last stage's is the interleaved
               schedule's wrap-around send to the first (the other schedules ignore it).
    """

    fwd: float
    bwd: float
    tp_fwd: float = 0.0
    tp_bwd: float = 0.0
    recompute: float = 0.0
    send: float = 0.0

    @property
    def busy(self) -> float:
        return self.fwd + self.bwd


@dataclass(frozen=True)
class PipelineTime:
    total: float
    period: float
    fill: float
    compute: float  # the terms of `total` (see CostBreakdown)
    tp_comm: float
    pp_comm: float
    bubble: float


def pipeline_time(stages: Sequence[StageTiming], m: int, *,
                  schedule: Schedule = Schedule.ONE_F_ONE_B, interleave: int = 1
                  ) -> PipelineTime:
    """Step time of one pipeline for m micro-batches, split into its causes."""
    v = interleave if schedule is Schedule.INTERLEAVED else 1
    count = len(stages)
    busy = [s.busy for s in stages]
    sends = [s.send for s in stages[:-1]]
    bottleneck = max(range(count), key=lambda i: busy[i])
    if schedule is Schedule.GPIPE:
        fwd, bwd = max(s.fwd for s in stages), max(s.bwd for s in stages)
        compute_period = fwd + bwd
    else:
        compute_period = busy[bottleneck]
    if v > 1:
        period = max(compute_period, *(stage_period(st, v) for st in stages))
        comm_fill = 2 * (v * sum(sends) + (v - 1) * stages[-1].send) if count > 1 else 0.0
        fill = sum(busy) / v + (1 - 1 / v) * period + comm_fill
    else:
        comm_fill = 2 * sum(sends)
        slowest = max(sends, default=0.0)
        if schedule is Schedule.GPIPE:  # a forward pipeline, then a backward one
            period = max(fwd, slowest) + max(bwd, slowest)
        else:
            period = max(compute_period, slowest, round_trip(busy, sends))
        fill = sum(busy) + comm_fill
    total = (m - 1) * period + fill
    slow = stages[bottleneck]
    tp = m * (slow.tp_fwd + slow.tp_bwd)
    compute = m * busy[bottleneck] - tp
    pp = comm_fill + (m - 1) * (period - compute_period)
    return PipelineTime(total=total, period=period, fill=fill, compute=compute, tp_comm=tp,
                        pp_comm=pp, bubble=total - compute - tp - pp)


def stage_period(stage: StageTiming, interleave: int) -> float:
    """h_s, the period one stage allows on its own: max(busy, send) (1F1B, with the
    round trips on top; the last stage sends nothing), or interleaved max(busy, bwd +
    v send) (see the module docstring; the last stage's send is the wrap-around)."""
    if interleave == 1:
        return max(stage.busy, stage.send)
    return max(stage.busy, stage.bwd + interleave * stage.send)


def round_trip(busy: Sequence[float], sends: Sequence[float]) -> float:
    """1F1B's period floor from its in-flight limits: the largest window mean
    (sum of busy over stages s..u plus both ways over the sends between them) / (u-s+1)
    (see the module docstring)."""
    busy_prefix = np.concatenate([[0.0], np.cumsum(busy)])
    send_prefix = np.concatenate([[0.0], np.cumsum(sends), [0.0]])[:len(busy)]
    first = np.arange(len(busy))[:, None]
    last = np.arange(len(busy))[None, :]
    windows = ((busy_prefix[1:][None, :] - busy_prefix[:-1][:, None]
                + 2 * (send_prefix[None, :] - send_prefix[:, None]))
               / np.maximum(last - first + 1, 1))
    return float(np.where(last >= first, windows, 0.0).max())


def in_flight(stage: int, num_stages: int, m: int, schedule: Schedule, interleave: int = 1
              ) -> float:
    """Micro-batches whose activations stage `stage` holds at its peak, in units of
    one micro-batch of the whole stage."""
    if schedule is Schedule.GPIPE:
        return float(m)
    if schedule is Schedule.INTERLEAVED and interleave > 1:
        # Megatron's warm-up: 2(S-s-1) + (v-1)S chunk micro-batches, plus the one running
        warmup = 2 * (num_stages - stage - 1) + (interleave - 1) * num_stages + 1
        return min(float(m), warmup / interleave)
    return float(min(m, num_stages - stage))
