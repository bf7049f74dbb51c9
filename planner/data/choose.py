"""Plans chosen for the data's lengths (`planner solve --data-profile`): the expected
step of each of the solver's best plans on steps drawn from a data profile, packed by
the balanced packer and replayed (`steps.replay`), and the plans ranked by it.

The solver prices every sample at the plan's sequence length: on real data, whose
lengths are mostly far shorter and heavy-tailed, that overstates compute against the
gradient sync and the optimizer, and says nothing of what a step's longest samples cost.
A step's time is its slowest pipeline's, so what a plan is worth on the data is the
expected bottleneck over its steps, E[max over pipelines], which the replay of drawn
steps estimates; a step of mean-length samples (`mean_step`, shown beside it) is the
max of expectations, which is below it. The replay waits for each step's input as the
step model does (`loading.py`: each pipeline's first stage reads the samples packed
into it).

Its limits: the search itself still prices full-length samples, so the distribution
only ranks the plans it found best so (the best CANDIDATES, or `--top-k` if more): a
plan whose shape suits the data better but is not among them is never seen, and each
plan keeps its micro-batch counts and shares. The expectation is the mean of DRAWS
steps, their lengths drawn independently from the profile's quantile table (seed 0,
the same steps for every plan) and cut to the sequence length: an estimate, without an
error bar, of steps whose samples are independent of each other. A loading rate in
tokens/s counts each sample at the sequence length (`loading.samples_per_second`),
more than a short sample holds, so where loading binds the estimate errs slow.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from cost_models.model import CostModel
from planner.data.packing import balanced
from planner.data.profile import DataProfile, draw_lengths
from planner.data.steps import plan_rates, replay
from planner.types import Layer, Plan

DRAWS = 32  # steps drawn per plan
CANDIDATES = 8  # the solver's best plans ranked again


@dataclass(frozen=True, kw_only=True)
class DataCandidate:
    """One plan on the data: its expected step over the drawn steps, the slowest of them,
    the share of device time idle before the sync, and a step of mean-length samples."""

    plan: Plan
    expected: float
    slowest: float
    idle: float
    mean_step: float


def on_data(plan: Plan, layers: Sequence[Layer], costs: CostModel, profile: DataProfile, *,
            draws: int = DRAWS, seed: int = 0) -> DataCandidate:
    """`plan` on `draws` steps of lengths drawn from `profile` (the same steps for every
    plan of one seed), cut to the plan's sequence length."""
    rates = plan_rates(plan, layers, costs)
    slots, work = rates.slots(), rates.work()
    seq, batch = plan.training.seq_len, plan.training.global_batch
    rng = random.Random(seed)
    steps = []
    for _ in range(draws):
        lengths = [min(seq, n) for n in draw_lengths(profile, batch, rng)]
        steps.append(replay(rates, balanced(lengths, slots, work)))
    mean_length = max(1, min(seq, round(profile.mean)))
    at_mean = replay(rates, balanced([mean_length] * batch, slots, work))
    return DataCandidate(plan=plan, expected=statistics.mean(s.step_time for s in steps),
                         slowest=max(s.step_time for s in steps),
                         idle=statistics.mean(s.idle for s in steps),
                         mean_step=at_mean.step_time)


def rank_for_data(plans: Sequence[Plan], layers: Sequence[Layer], costs: CostModel,
                  profile: DataProfile, *, draws: int = DRAWS, seed: int = 0
                  ) -> list[DataCandidate]:
    """The plans on the data, fastest expected step first (ties: the solver's order)."""
    priced = [on_data(plan, layers, costs, profile, draws=draws, seed=seed) for plan in plans]
    order = sorted(range(len(priced)), key=lambda i: (priced[i].expected, i))
    return [priced[i] for i in order]
