"""A plan's steps on variable-length samples: what each pipeline's micro-batches cost
once packed (`packing.py`), replayed by the simulator.

The plan's stage timings are for its micro-batch of `micro_batch` samples of the
plan's sequence length. A packed micro-batch of r rows padded to L tokens scales each
stage's compute by `cost_models.tokens.token_factor` (its attention cores' share of
the stage's time growing with L squared, the rest with L), and its tensor-parallel
collectives and pipeline sends by the tokens it moves (`linear_factor`); the gradient
sync and the optimizer step do not change with the data. The pipelines wait for their
input where the cluster's loaders or devices' inputs are the slower (`loading.py`, the
step model's `fed`): each pipeline's first stage reads the samples packed into it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from cost_models.model import CostModel
from cost_models.tokens import (
    TokenShape,
    linear_factor,
    quadratic_share,
    token_budget,
    token_factor,
)
from planner.data.loading import Feed, InputRates, input_rates, loading_seconds, plan_feeds
from planner.data.packing import Packing, PipelineSlots, Work
from planner.simulate import BWD, FWD, Simulation, simulate
from planner.solver.predict import stage_timings, sync_and_optimizer
from planner.solver.timing import StageTiming, pipeline_time
from planner.types import Layer, Plan, Schedule


@dataclass(frozen=True, kw_only=True)
class PipelineRates:
    """One pipeline's stages as the plan prices them, per planned micro-batch, and the
    share of each stage's compute in attention cores."""

    stages: tuple[StageTiming, ...]
    quadratic: tuple[float, ...]
    micro_batch: int
    micro_batches: int
    batch_share: int
    schedule: Schedule
    interleave: int
    feed: Feed  # its input at the plan's share, read by its first stage

    def time(self) -> float:
        """The pipeline's time for the plan's micro-batches of full-length samples."""
        return pipeline_time(self.stages, self.micro_batches, schedule=self.schedule,
                             interleave=self.interleave).total


@dataclass(frozen=True, kw_only=True)
class PlanRates:
    """What a data-aware step of a plan needs: every pipeline's rates, the sequence length
    the plan was priced at, and the step's sync and optimizer seconds."""

    seq_len: int
    pipelines: tuple[PipelineRates, ...]
    sync: float
    optimizer: float
    inputs: InputRates | None = None  # the cluster's input limits (`loading.input_rates`)

    def slots(self) -> list[PipelineSlots]:
        """The packer's view of the pipelines: speed in planned samples per second of the
        pipeline's own planned time, so each takes work in proportion to it."""
        return [PipelineSlots(micro_batches=p.micro_batches, speed=p.batch_share / p.time(),
                              budget=token_budget(micro_batch=p.micro_batch,
                                                  seq_len=self.seq_len),
                              batch_share=p.batch_share, micro_batch=p.micro_batch)
                for p in self.pipelines]

    def work(self) -> Work:
        """The packer's work measure: the attention share over all stages, weighted by
        their compute time."""
        stages = [(st.busy, q) for p in self.pipelines
                  for st, q in zip(p.stages, p.quadratic, strict=True)]
        total = sum(busy for busy, _ in stages)
        share = sum(busy * q for busy, q in stages) / total if total else 0.0
        return Work(seq_len=self.seq_len, quadratic=share)


def plan_rates(plan: Plan, layers: Sequence[Layer], costs: CostModel) -> PlanRates:
    """The rates of a priced plan's pipelines (layers as `planner.explain.retrace` gives
    them)."""
    timings = stage_timings(plan, layers, costs)
    sync, optimizer = sync_and_optimizer(plan, layers, costs)
    pipelines = []
    for pipeline, stages, feed in zip(plan.pipelines, timings, plan_feeds(plan), strict=True):
        shares = tuple(
            quadratic_share([layers[i] for i in stage.held()],
                            costs.cluster.node(stage.devices.node).device, tp=stage.tp,
                            dtype=plan.training.dtype)
            for stage in pipeline.stages)
        pipelines.append(PipelineRates(
            stages=tuple(stages), quadratic=shares, micro_batch=pipeline.micro_batch,
            micro_batches=pipeline.num_microbatches, batch_share=pipeline.batch_share,
            schedule=pipeline.schedule, interleave=pipeline.interleave, feed=feed))
    return PlanRates(seq_len=plan.training.seq_len, pipelines=tuple(pipelines), sync=sync,
                     optimizer=optimizer, inputs=input_rates(costs.cluster, plan.training))


def scaled(timing: StageTiming, quadratic: float, shape: TokenShape, *, micro_batch: int,
           seq_len: int) -> StageTiming:
    """A stage's timing for a micro-batch of `shape` (see the module docstring)."""
    compute = token_factor(shape, micro_batch=micro_batch, seq_len=seq_len,
                           quadratic=quadratic)
    moved = linear_factor(shape, micro_batch=micro_batch, seq_len=seq_len)
    return StageTiming(
        fwd=(timing.fwd - timing.tp_fwd) * compute + timing.tp_fwd * moved,
        bwd=(timing.bwd - timing.tp_bwd) * compute + timing.tp_bwd * moved,
        tp_fwd=timing.tp_fwd * moved, tp_bwd=timing.tp_bwd * moved,
        recompute=timing.recompute * compute, send=timing.send * moved)


@dataclass(frozen=True, kw_only=True)
class DataStep:
    """One packed step replayed: its time, when the pipelines end, and the device time
    they idle before then (the pipeline bubble, the wait for the slowest pipeline and
    for the step's input)."""

    simulation: Simulation
    busy: float  # device seconds of compute before the sync, all pipelines' devices
    devices: int

    @property
    def step_time(self) -> float:
        return self.simulation.step_time

    @property
    def pipelines_end(self) -> float:
        return self.simulation.pipelines

    @property
    def idle(self) -> float:
        """The share of the devices' time before the sync spent waiting."""
        return 1 - self.busy / (self.devices * self.pipelines_end)


def replay(rates: PlanRates, packing: Packing) -> DataStep:
    """One step of the plan with each pipeline's micro-batches as packed, each fed the
    samples packed into it."""
    own = []
    for p, (pipeline, batches) in enumerate(zip(rates.pipelines, packing.pipelines,
                                                strict=True)):
        if len(batches) != pipeline.micro_batches:
            raise ValueError(f"pipeline {p} runs {pipeline.micro_batches} micro-batches; "
                             f"the packing gives it {len(batches)}")
        own.append([[scaled(st, q, batch.shape, micro_batch=pipeline.micro_batch,
                            seq_len=rates.seq_len)
                     for st, q in zip(pipeline.stages, pipeline.quadratic, strict=True)]
                    for batch in batches])
    simulation = simulate([p.stages for p in rates.pipelines],
                          [p.micro_batches for p in rates.pipelines],
                          schedule=[p.schedule for p in rates.pipelines],
                          interleave=[p.interleave for p in rates.pipelines],
                          sync=rates.sync, optimizer=rates.optimizer, microbatch_timings=own,
                          loading=loading_seconds(rates.inputs, [
                              dataclasses.replace(p.feed, samples=float(len(packing.samples(i))))
                              for i, p in enumerate(rates.pipelines)]))
    busy = sum(e.end - e.start for e in simulation.events if e.kind in (FWD, BWD))
    devices = sum(len(p.stages) for p in rates.pipelines)
    return DataStep(simulation=simulation, busy=busy, devices=devices)
