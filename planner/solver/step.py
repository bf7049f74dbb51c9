"""The step model: how a training step's terms make one step, and the floor of a
partial structure from floors of its terms. Every part that prices a step goes
through here: the search's pricing (`evaluate`), its bounds (`bound`, `search`),
predictions of plans (`predict`), the simulator (`planner.simulate`), the timeline
(`planner.timeline`) and the tests' brute force.

    step = slowest pipeline  +  gradient sync  +  optimizer step

where the sync term is what a step pays of one whole sync (`exposed`): all of it, after
the last backward, by default; with a sync that overlaps backward (`SyncSpec.overlap`:
each stage's buckets start as its last micro-batch's backward makes them), what the
least one-micro-batch backward of any stage does not hide (`overlappable`), and never
less than the all-reduce of the last bucket (`last_bucket`: the first layers' gradients,
made only as backward ends, so nothing is left to hide it); with a sync every H steps
(local SGD, model averaging, DiLoCo: `SyncSpec.interval`), 1/H of it. A sync that
overlaps backward also slows it where the two share a device (`Contention`, measured by
`planner profile`): backward computes slower while a collective is in flight, and the
collective runs slower beside it, so the pipelines end later by what the overlap slows
them (`slowed`) and the sync hides less (`exposed`).
The slowest pipeline's time is at least the step's data loading (`fed`): its input's
samples over what the nodes' loaders and the devices' inputs take in per second
(`planner.data.loading`), 0 where the cluster sets no such rates.

The terms come from elsewhere: a pipeline's time from `timing.pipeline_time` (its
floor from `partition`'s staircases and `bound.Family`), the gradient sync from
`evaluate.sync_and_optimizer` or `predict.sync_and_optimizer` (its floors from
`sync_floor` and `evaluate.card_floor`), the optimizer step beside it, an overlapped
sync's last bucket from the same (`predict.tail_sync`: no floor counts it, as none counts
the backward it hides). The sync starts
once every pipeline's last backward has ended (the runtime sums after the schedule),
or overlapping it, and the optimizer step after the sync.

The search relies on two properties, which a new way of combining the terms (the
sync overlapping the last backward, a sync every H steps) must keep: `floor` is
non-decreasing in every term and never above `StepTime.total` of terms at least as
large (so a bound built from term floors holds), and a floor found without the sync
(`unsynced`) gives the full one by `synced` (the search adds each class's sync floor
to a base it found once).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from planner.types import DeviceSpec
from planner.types.training import SyncSpec

Seconds = TypeVar("Seconds", float, np.ndarray)
SYNC, OPTIMIZER = "sync", "optimizer"  # the phases after the pipelines
EVERY_STEP = SyncSpec()  # the sync after the schedule, every step


@dataclass(frozen=True)
class Contention:
    """How a sync that overlaps backward and backward slow each other on a device: while
    a collective is in flight a computation takes `compute` more of its time (0.25: a
    quarter longer), and while a computation runs a collective takes `sync` more. A GPU's
    collective kernels take streaming multiprocessors from the GEMMs beside them; a CPU
    rank's gloo threads (sums, copies, the kernel's TCP work) take time on the core its
    backward runs on. `planner profile` measures both on the machine
    (`cost_models.profile.contention`); catalog devices have none."""

    compute: float = 0.0
    sync: float = 0.0


NO_CONTENTION = Contention()


def device_contention(device: DeviceSpec) -> Contention:
    """What `planner profile` measured of a device's contention (none where nothing was)."""
    if device.measured is None:
        return NO_CONTENTION
    return Contention(compute=device.measured.compute_slowdown,
                      sync=device.measured.sync_slowdown)


def worst(contentions: Iterable[Contention]) -> Contention:
    """A step's contention, of its devices': the largest of each kind (every stage
    computes beside its own sums, and the step waits for the slowest)."""
    found = list(contentions)
    return Contention(compute=max((c.compute for c in found), default=0.0),
                      sync=max((c.sync for c in found), default=0.0))


def _together(per_step: float, hidden: float, tail: float, contention: Contention) -> float:
    """The seconds an overlapped sync of `per_step` seconds alone (its last bucket's
    `tail` of them only after backward) and the backward of `hidden` seconds alone it
    overlaps run side by side, each slowed by the other (`Contention`): until the sooner
    of the two ends."""
    return min(hidden * (1 + contention.compute),
               max(0.0, per_step - tail) * (1 + contention.sync))


def exposed(sync: float, hidden: float, policy: SyncSpec = EVERY_STEP,
            tail: float = 0.0, contention: Contention = NO_CONTENTION) -> float:
    """The seconds per step a whole sync of `sync` seconds adds to the step after the
    pipelines: spread over the steps between syncs, less what of it runs beside the
    backward it overlaps (`hidden`) where it does (slowed by `contention`, as `slowed`
    slows the backward), but never less than its last bucket's all-reduce (`tail`, at
    most `sync`), which starts only once backward has ended."""
    per_step = sync / policy.interval
    if not policy.overlap:
        return per_step
    beside = _together(per_step, hidden, tail, contention) / (1 + contention.sync)
    return max(tail, per_step - beside)


def slowed(sync: float, hidden: float, policy: SyncSpec = EVERY_STEP, tail: float = 0.0,
           contention: Contention = NO_CONTENTION) -> float:
    """The seconds an overlapped sync (as `exposed`) adds to the pipelines by slowing
    the backward it runs beside (`Contention.compute`); nothing where it does not
    overlap backward. With `exposed`, never less than the sync without contention adds:
    what backward loses, the sync gains back only at its own slowed pace."""
    if not policy.overlap:
        return 0.0
    together = _together(sync / policy.interval, hidden, tail, contention)
    return together * contention.compute / (1 + contention.compute)


def last_bucket(volume: float, bucket_mb: float) -> float:
    """The bytes of a stage's last overlapped all-reduce, of `volume` bytes of gradients
    cut into buckets of at most `bucket_mb` MiB (`SyncSpec.bucket_mb`, the runtime's
    `overlap_buckets`): a whole bucket, or all of them where they fit one. Priced as
    the sync is (`comm.collective_time`), it is the step's `tail`."""
    return min(volume, bucket_mb * 2**20)


def fed(pipelines: Seconds, loading: Seconds | float) -> Seconds:
    """The pipelines' time once they wait for their input: loaders prefetch while the
    pipelines run, so loading (`planner.data.loading`) adds nothing until it is the
    longer; a floor of either term stays a floor (monotone in both)."""
    return np.maximum(pipelines, loading)


def overlappable(stage_backwards: Iterable[float]) -> float:
    """The backward a sync that overlaps it hides at least: every stage's buckets start
    within its last micro-batch's backward, so the least such backward of any stage
    (the step's sync lasts as long as its slowest stage's or busiest card's)."""
    return min(stage_backwards, default=0.0)


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

    pipelines: float  # when the slowest pipeline's last backward ends, its input loaded
    sync: float  # one whole gradient sync
    optimizer: float  # optimizer step
    hidden: float = 0.0  # the backward an overlapping sync hides (`overlappable`)
    policy: SyncSpec = EVERY_STEP
    tail: float = 0.0  # an overlapping sync's last bucket, never hidden (`last_bucket`)
    loading: float = 0.0  # the step's data loading (`fed`), in `pipelines` already
    contention: Contention = NO_CONTENTION  # an overlapping sync's and backward's

    @property
    def exposed(self) -> float:
        """What the step pays of the sync after the pipelines (`exposed`)."""
        return exposed(self.sync, self.hidden, self.policy, self.tail, self.contention)

    @property
    def slowed(self) -> float:
        """What an overlapping sync slows the pipelines by (`slowed`)."""
        return slowed(self.sync, self.hidden, self.policy, self.tail, self.contention)

    @property
    def total(self) -> float:
        # (as `floor` adds; contention only adds, so `floor` stays below)
        return unsynced(self.pipelines + self.slowed, self.optimizer) + self.exposed

    def phases(self) -> tuple[Phase, Phase]:
        """The sync (its share of this step, started within the last backward where it
        overlaps it) and the optimizer step on the step's time line."""
        per_step = self.sync / self.policy.interval
        end = self.pipelines + self.slowed + self.exposed
        return (Phase(SYNC, end - per_step, per_step), Phase(OPTIMIZER, end, self.optimizer))


def step_time(pipeline_times: list[float] | tuple[float, ...], sync: float,
              optimizer: float, hidden: float = 0.0, policy: SyncSpec = EVERY_STEP,
              loading: float = 0.0, tail: float = 0.0,
              contention: Contention = NO_CONTENTION) -> StepTime:
    """The step of pipelines that end at these times (each its T(m)), fed by data
    loading of `loading` seconds."""
    return StepTime(pipelines=float(fed(max(pipeline_times), loading)), sync=sync,
                    optimizer=optimizer, hidden=hidden, policy=policy, loading=loading,
                    tail=tail, contention=contention)


def floor(pipelines: Seconds, sync: Seconds | float, optimizer: Seconds | float,
          policy: SyncSpec = EVERY_STEP) -> Seconds:
    """The step of terms at these values: with floors of the terms, a floor of the step
    (arrays: element by element); the total itself for a sync after the schedule, below
    it where the sync overlaps backward (`synced`)."""
    return synced(unsynced(pipelines, optimizer), sync, policy)


def unsynced(pipelines: Seconds, optimizer: Seconds | float) -> Seconds:
    """A step's floor before its gradient sync is counted."""
    return pipelines + optimizer


def synced(base: Seconds, sync: Seconds | float, policy: SyncSpec = EVERY_STEP) -> Seconds:
    """`unsynced`'s floor with the sync added: its share of a step (1/H of it), or where
    it overlaps backward, the larger of the base and that share: the backward it hides
    is part of the pipelines' time, so a step lasts at least as long as its sync,
    whatever the backward hides (pipelines + max(0, sync - hidden) >= sync)."""
    per_step = sync / policy.interval
    return np.maximum(base, per_step) if policy.overlap else base + per_step


def sync_beyond(extra: Seconds, policy: SyncSpec = EVERY_STEP) -> Seconds:
    """What `extra` seconds of sync beyond another's add to a step for certain (pipelines
    that pay it end that much earlier within the same step): its share of a step, or
    nothing where the sync overlaps backward (it may hide behind the pipelines'
    backward, whatever its length: `synced`)."""
    return extra * 0.0 if policy.overlap else extra / policy.interval


def pipelines_within(total: Seconds, sync: Seconds | float, optimizer: Seconds | float,
                     policy: SyncSpec = EVERY_STEP) -> Seconds:
    """The slowest pipeline's time that makes a step of `total` with these terms (the
    inverse of `floor` in its first term): a step below `total` needs pipelines below
    it (where the sync overlaps backward, whatever the sync: `synced`)."""
    if policy.overlap:
        return total - optimizer
    return total - sync / policy.interval - optimizer
