"""Running one pipeline's schedule with torch.distributed.pipelining.

Each pipeline is its own chain of ranks with its own micro-batch count, so the
library's single-pipeline schedules fit as they are: GPipe, 1F1B and interleaved
1F1B (several chunks per rank) drive `PipelineStage`s over the pipeline's "pp"
process group. Two adjustments:

  * `new_group` orders a group's ranks by global rank, while a pipeline's stages
    may sit on ranks in any order; for GPipe and 1F1B the stage's
    stage-index-to-group-rank map is set from the plan. Interleaved 1F1B derives
    the map itself, so it needs the pipeline's stages on ascending ranks (as
    `planner estimate` and the uniform baselines lay them out).
  * gradients are not divided by the micro-batch count (`scale_grads=False`): the
    loss function already weighs each micro-batch by micro_batch / global_batch.

A pipeline of one stage runs through the same schedules (a group of one rank).
A stage wider than its pipeline's narrowest runs its chain's schedule on its first
rank, the leader, which hands its other ranks' work to them (`follow.py`).
1F1B with fewer micro-batches than stages (torch refuses it) runs as GPipe, which
is the order 1F1B reduces to then: every forward, then every backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from planner.errors import PlannerError
from planner.runtime.follow import Following, Leading, LeadingStage
from planner.runtime.stage import ChunkModule
from planner.types import PipelinePlan, Schedule, StagePlan


class PipelineRunner:
    """This rank's part of its pipeline's schedule."""

    def __init__(self, pipeline: PipelinePlan, stage: StagePlan, chunks: Sequence[ChunkModule],
                 *, device: torch.device, group: dist.ProcessGroup, chain: Sequence[int],
                 loss_fn: Callable[[Any, Any], torch.Tensor],
                 following: Following | None = None) -> None:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        pp = len(pipeline.stages)
        self.leading = None if following is None else Leading(chunks[0], following)
        self.is_first = stage.index == 0
        self.is_last = stage.index == pp - 1
        interleaved = len(chunks) > 1  # several chunks per rank need the looped schedule
        m = pipeline.num_microbatches
        try:
            if interleaved:
                if list(chain) != sorted(chain):
                    raise PlannerError(
                        "unsupported-plan", f"Pipeline {pipeline.index} runs an interleaved "
                        f"schedule on ranks {list(chain)} (stage order); torch's interleaved "
                        "1F1B needs them in ascending order.",
                        ["plan it again with --interleave 1 (plain 1F1B)",
                         "list the cluster's nodes in the pipeline's stage order"])
                stages = [PipelineStage(chunk, j * pp + stage.index, pp * len(chunks), device,
                                        group=group) for j, chunk in enumerate(chunks)]
                self.schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn,
                                                        scale_grads=False)
            else:
                if self.leading is None:
                    one = PipelineStage(chunks[0], stage.index, pp, device, group=group)
                else:  # (interleaved schedules need one degree: `parallel.check_degrees`)
                    one = LeadingStage(self.leading, stage.index, pp, device, group=group)
                order = sorted(chain)
                one.stage_index_to_group_rank = {s: order.index(r) for s, r in enumerate(chain)}
                # with fewer micro-batches than stages 1F1B never reaches its steady
                # state: it runs all forwards, then all backwards, which is GPipe
                gpipe = pipeline.schedule is Schedule.GPIPE or m < pp
                kind = ScheduleGPipe if gpipe else Schedule1F1B
                self.schedule = kind(one, m, loss_fn=loss_fn, scale_grads=False)
        except (ValueError, RuntimeError) as exc:
            raise PlannerError("unsupported-plan", f"Pipeline {pipeline.index} stage "
                               f"{stage.index}: torch.distributed.pipelining cannot run "
                               f"{pipeline.schedule.value} here: {exc}",
                               ["plan it again with plain 1F1B (--interleave 1, and "
                                "no --schedule gpipe in `planner estimate`)",
                                "give the pipeline more micro-batches"]) from exc

    def step(self, inputs: tuple | None, targets: Any) -> list[torch.Tensor]:
        """One optimizer step's forward and backward over all micro-batches; the losses
        of the micro-batches on the last stage (else [])."""
        losses: list[torch.Tensor] = []
        args = inputs if self.is_first else ()
        kwargs: dict[str, Any] = {}
        if self.is_last:
            kwargs = {"target": targets, "losses": losses}
        self.schedule.step(*(args or ()), **kwargs)
        if self.leading is not None:
            self.leading.done()
        return losses
