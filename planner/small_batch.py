"""Is the global batch too small for the devices a plan uses?

Part of a training step takes as long whatever the batch: the pipeline bubble (its fill
and drain, (stages - 1) micro-batch times, however many micro-batches follow), the
gradient sync (once per step, the size of the weights) and the optimizer step. The rest,
compute and the tensor- and pipeline-parallel communication of each micro-batch, grows
with the batch. Where the fixed part is more than half of the step, devices spend most
of it waiting, not computing (MFU at most half what they reach on compute alone); the
remedy is more samples per step, or fewer devices, not another plan: a larger batch
spreads the fixed part over more samples. This is the trigger of the warning `planner
solve` and `planner what-if` print: `small_batch(plan)` is not None.

Not so where the pipelines wait for their input (the cluster's data loaders or devices'
input rates, `planner.data.loading`): the wait is in the bubble term, and it is the
step's loading, which grows with the batch, its samples over the rates; at any larger
batch the loading still binds (it grows k-fold, the pipelines less), so the bubble is
then no fixed part, and only the sync and the optimizer step are.

The batch it suggests keeps the plan and scales the growing part with the batch: the
batch at which the fixed part would be a quarter of the step (a rough figure, as a new
solve may pick another plan for it; it rounds up to two significant digits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.data.loading import plan_loading
from planner.types import Plan

FIXED_TERMS = ("bubble", "dp_comm", "optimizer")  # `CostBreakdown` terms no batch grows
FED_FIXED_TERMS = ("dp_comm", "optimizer")  # those where the pipelines wait for input
TOO_SMALL = 0.5  # the fixed terms' share of the step beyond which the batch is too small
SUGGESTED = 0.25  # their share at the suggested batch


@dataclass(frozen=True)
class SmallBatch:
    """A plan whose step is mostly time no batch changes (see the module docstring)."""

    global_batch: int
    devices: int  # the devices the plan uses
    fixed_share: float  # of the step: the FIXED_TERMS'
    fixed_terms: tuple[str, ...]  # those of them that take any time
    mfu: float
    suggested_batch: int  # at which the fixed terms would be SUGGESTED of the step

    @property
    def message(self) -> str:
        from planner.explain import TERM_WORDS

        words = [TERM_WORDS[term] for term in self.fixed_terms]
        terms = ", ".join(words[:-1]) + (" and " if len(words) > 1 else "") + words[-1]
        return (f"The global batch ({self.global_batch:,}) is small for the "
                f"{self.devices:,} devices the plan uses: {self.fixed_share:.0%} of its step "
                f"is the {terms}, which take as long at any batch (MFU "
                f"{self.mfu:.1%}). A global batch of about {self.suggested_batch:,} "
                f"(--global-batch {self.suggested_batch}) would bring them to "
                f"{SUGGESTED:.0%} of the step; or use fewer devices.")


def small_batch(plan: Plan) -> SmallBatch | None:
    """The warning's figures where the global batch is too small for `plan`'s devices."""
    prediction = plan.prediction
    terms = prediction.terms()
    fixed_terms = fixed_terms_of(plan)
    fixed = sum(terms[term] for term in fixed_terms)
    growing = prediction.step_time - fixed
    if prediction.step_time <= 0 or fixed <= TOO_SMALL * prediction.step_time \
            or growing <= 0:
        return None
    # fixed / (fixed + growing * k) = SUGGESTED at k times the batch
    scale = fixed * (1 - SUGGESTED) / (SUGGESTED * growing)
    return SmallBatch(global_batch=plan.training.global_batch, devices=plan.num_devices,
                      fixed_share=fixed / prediction.step_time,
                      fixed_terms=tuple(term for term in fixed_terms if terms[term] > 0),
                      mfu=prediction.mfu,
                      suggested_batch=_round_up(plan.training.global_batch * scale))


def fixed_terms_of(plan: Plan) -> tuple[str, ...]:
    """The terms of `plan`'s step no batch grows: FIXED_TERMS, but FED_FIXED_TERMS where
    its step's loading sets the pipelines' time (`step.fed`; the module docstring)."""
    loading = plan_loading(plan)
    prediction = plan.prediction
    pipelines = prediction.step_time - prediction.dp_comm - prediction.optimizer
    if loading is not None and (loading.seconds > pipelines
                                or math.isclose(loading.seconds, pipelines, rel_tol=1e-9)):
        return FED_FIXED_TERMS
    return FIXED_TERMS


def _round_up(value: float) -> int:
    """Up to two significant digits: 3,951 -> 4,000; 87.2 -> 88."""
    unit = 10 ** max(0, math.floor(math.log10(value)) - 1)
    return math.ceil(value / unit) * unit
