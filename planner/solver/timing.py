"""Closed-form step time of pipelines, shared by the search, `estimate` and the
simulator's cross-check (`planner.simulate` replays the same model event by event).

A pipeline of S stages runs m micro-batches. Stage s takes f_s forward and
b_s backward per micro-batch (tensor-parallel all-reduces and recomputation
included), and sending its output to stage s+1 (or the gradient back) takes
c_s one way. Sends are asynchronous and overlap compute, but every micro-batch
must travel the whole pipeline and back while at most S micro-batches are in
flight, so the steady-state period is bounded by the round trip over S:

    1F1B         P = max( max_s (f_s + b_s),  max_s c_s,  (sum_s (f_s+b_s) + 2 sum_s c_s) / S )
                 T = (m - 1) P + sum_s (f_s + b_s) + 2 sum_s c_s
    GPipe        as 1F1B with max_s f_s + max_s b_s for the first term (all forwards
                 run before all backwards) and without the round-trip term
    interleaved  v model chunks per device (Megatron):
                 P = max( max_s (f_s + b_s), v max_s c_s )
                 T = (m - 1) P + sum_s (f_s + b_s) / v + (1 - 1/v) P + 2 (S v - 1) mean_s c_s

A training step: step = max over pipelines of T(m_p) + gradient sync + optimizer.
These are exact for balanced stages without sends; tests measure the error
against the simulator for unbalanced stages and slow links.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from planner.types import Schedule


@dataclass(frozen=True)
class StageTiming:
    """Seconds per micro-batch of one stage (per device of its tensor-parallel group).

    fwd, bwd:  including tensor-parallel communication (tp_fwd, tp_bwd) and, in
               bwd, recomputation (recompute).
    send:      one-way time of this stage's output to the next stage (0 for the
               last stage); the gradient travels back the same way.
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
        compute_period = max(s.fwd for s in stages) + max(s.bwd for s in stages)
    else:
        compute_period = busy[bottleneck]
    if v > 1:
        period = max(compute_period, v * max(sends, default=0.0))
        comm_fill = 2 * (count * v - 1) * sum(sends) / max(1, len(sends))
        fill = sum(busy) / v + (1 - 1 / v) * period + comm_fill
    else:
        comm_fill = 2 * sum(sends)
        round_trip = (sum(busy) + comm_fill) / count if schedule is not Schedule.GPIPE else 0.0
        period = max(compute_period, max(sends, default=0.0), round_trip)
        fill = sum(busy) + comm_fill
    total = (m - 1) * period + fill
    slow = stages[bottleneck]
    tp = m * (slow.tp_fwd + slow.tp_bwd)
    compute = m * busy[bottleneck] - tp
    pp = comm_fill + (m - 1) * (period - compute_period)
    return PipelineTime(total=total, period=period, fill=fill, compute=compute, tp_comm=tp,
                        pp_comm=pp, bubble=total - compute - tp - pp)


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
