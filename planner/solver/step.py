"""The step model: how a training step's terms make one step, and the floor of a
partial structure from floors of its terms. Every part that prices a step goes
through here: the search's pricing (`evaluate`), its bounds (`bound`, `search`),
predictions of plans (`predict`), the simulator (`planner.simulate`), the timeline
(`planner.timeline`) and the tests' brute force.

    step = slowest pipeline  +  gradient sync  +  optimizer step

The terms come from elsewhere: a pipeline's time from `timing.pipeline_time` (its
floor from `partition`'s staircases and `bound.Family`), the gradient sync from
`evaluate.sync_and_optimizer` or `predict.sync_and_optimizer` (its floors from
`sync_floor` and `evaluate.card_floor`), the optimizer step beside it. Here the
sync starts once every pipeline's last backward has ended (the runtime all-reduces
after the schedule), and the optimizer step after the sync.

The search relies on two properties, which a new way of combining the terms (the
sync overlapping the last backward, a sync every H steps) must keep: `floor` is
non-decreasing in every term and never above `StepTime.total` of terms at least as
large (so a bound built from term floors holds), and a floor found without the sync
(`unsynced`) gives the full one by `synced` (the search adds each class's sync floor
to a base it found once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np

Seconds = TypeVar("Seconds", float, np.ndarray)
SYNC, OPTIMIZER = "sync", "optimizer"  # the phases after the pipelines


@dataclass(frozen=True)
class Phase:
    """One part of the step after the pipelines, on every device."""

    kind: str  # SYNC or OPTIMIZER (`planner.simulate`'s event kinds too)
    start: float
    seconds: float

    @property
    def end(self) -> float:
        return self.start + self.seconds


@dataclass(frozen=True)
class StepTime:
    """A step by cause."""

    pipelines: float  # when the slowest pipeline's last backward ends
    sync: float  # gradient sync
    optimizer: float  # optimizer step

    @property
    def total(self) -> float:
        return floor(self.pipelines, self.sync, self.optimizer)

    def phases(self) -> tuple[Phase, Phase]:
        """The sync and the optimizer step on the step's time line."""
        return (Phase(SYNC, self.pipelines, self.sync),
                Phase(OPTIMIZER, self.pipelines + self.sync, self.optimizer))


def step_time(pipeline_times: list[float] | tuple[float, ...], sync: float,
              optimizer: float) -> StepTime:
    """The step of pipelines that end at these times (each its T(m))."""
    return StepTime(pipelines=max(pipeline_times), sync=sync, optimizer=optimizer)


def floor(pipelines: Seconds, sync: Seconds | float, optimizer: Seconds | float) -> Seconds:
    """The step of terms at these values: with floors of the terms, a floor of the step
    (arrays: element by element)."""
    return pipelines + sync + optimizer  # (`synced(unsynced(...))`, up to rounding)


def unsynced(pipelines: Seconds, optimizer: Seconds | float) -> Seconds:
    """A step's floor before its gradient sync is counted."""
    return pipelines + optimizer


def synced(base: Seconds, sync: Seconds | float) -> Seconds:
    """`unsynced`'s floor with the sync added."""
    return base + sync


def pipelines_within(total: Seconds, sync: Seconds | float, optimizer: Seconds | float
                     ) -> Seconds:
    """The slowest pipeline's time that makes a step of `total` with these terms (the
    inverse of `floor` in its first term): a step below `total` needs pipelines below
    it."""
    return total - sync - optimizer
