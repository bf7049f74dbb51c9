"""Each step's health, agreed by every rank in the one all-reduce the step makes anyway.

The all-reduce that sums the global loss also counts the ranks whose gradients hold
NaN or inf and whether any rank was asked to stop (SIGUSR1: SLURM's `--signal`
before a time limit, or a user), so every rank takes the same decision after the
same step without another collective:

  * a non-finite loss or gradient (outside fp16's loss-scale overflows, which skip
    the step as before) stops the run before the update, with an error naming the
    step and the ranks, stages and parameters at fault (`--on-nonfinite stop`, the
    default), or skips the update (`--on-nonfinite skip`) until `MAX_SKIPPED` steps
    in a row did, where the run stops the same way: the update never applies, so no
    checkpoint ever holds a NaN;
  * a stop request ends the run after the step, with a checkpoint (`train.py`).
"""

from __future__ import annotations

import math
import signal
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from planner.errors import PlannerError
from planner.runtime.parallel import _local

ON_NONFINITE = ("stop", "skip")
MAX_SKIPPED = 3  # non-finite steps in a row `skip` tolerates: then the state itself is bad
STOP_SIGNAL = signal.SIGUSR1


class StopRequest:
    """Set by STOP_SIGNAL (a signal handler can only set a flag; the step loop reads it)."""

    def __init__(self) -> None:
        self.requested = False

    def handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def install(self) -> None:
        """Handle STOP_SIGNAL from now on (only the main thread may; elsewhere, as when a
        test runs a rank in a thread, the signal keeps its default)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(STOP_SIGNAL, self.handle)


@dataclass(frozen=True)
class StepCheck:
    """What every rank agrees on after a step's backward."""

    loss: float  # the global loss (any fp16 loss scale removed); NaN or inf when broken
    ranks_with_bad_grads: int  # ranks whose gradients hold NaN or inf
    stop_requested: bool

    @property
    def loss_finite(self) -> bool:
        return math.isfinite(self.loss)


def bad_gradients(named: list[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the parameters whose (local) gradients hold NaN or inf; one device
    sync for all of them."""
    held = [(name, _local(p.grad)) for name, p in named if p.grad is not None]
    if not held:
        return []
    finite = torch.stack([torch.isfinite(grad).all() for _, grad in held]).tolist()
    return [name for (name, _), ok in zip(held, finite, strict=True) if not ok]


def check_step(loss_part: float, grads_ok: bool, stop: bool, device: torch.device,
               loss_scale: float) -> StepCheck:
    """One all-reduce (sum) of [this rank's part of the loss, 1 if its gradients are not
    finite, 1 if it was asked to stop]: the same StepCheck on every rank."""
    values = torch.tensor([loss_part, 0.0 if grads_ok else 1.0, 1.0 if stop else 0.0],
                          dtype=torch.float64, device=device)
    dist.all_reduce(values)
    loss, bad, stops = values.tolist()
    return StepCheck(loss=loss / loss_scale, ranks_with_bad_grads=round(bad),
                     stop_requested=stops > 0)


@dataclass(frozen=True)
class BadRank:
    """A rank whose gradients were not finite, as the error names it."""

    rank: int
    pipeline: int
    stage: int
    params: tuple[str, ...]


def gather_bad_ranks(mine: BadRank | None, world: int) -> list[BadRank]:
    """Every rank's BadRank (a collective: only after a check found some)."""
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    return [b for b in gathered if b is not None]


def nonfinite_error(step: int, steps: int, check: StepCheck, bad: list[BadRank], *,
                    skipped_in_a_row: int, latest_checkpoint: int | None, lr: float,
                    data: str | None) -> PlannerError:
    """The error that stops a run at a non-finite step: what was not finite, where, and
    what the run directory still holds."""
    parts = []
    if not check.loss_finite:
        parts.append(f"a {'NaN' if math.isnan(check.loss) else 'infinite'} loss")
    if bad:
        named = "; ".join(
            f"rank {b.rank} (pipeline {b.pipeline} stage {b.stage}: "
            f"{', '.join(b.params[:3])}{', ...' if len(b.params) > 3 else ''})" for b in bad)
        parts.append(f"NaN or infinite gradients on {len(bad)} rank(s): {named}")
    in_a_row = (f", {skipped_in_a_row} non-finite steps in a row (--on-nonfinite skip "
                f"skips up to {MAX_SKIPPED - 1})" if skipped_in_a_row >= MAX_SKIPPED else "")
    kept = (f"the latest checkpoint (step {latest_checkpoint}) was written before it"
            if latest_checkpoint else "no checkpoint was written")
    remedies = [f"lower the learning rate (--lr {lr:g})"]
    remedies.append(f"check the samples your data hook {data} gives for step {step}"
                    if data else "check the model for operations that overflow")
    if not in_a_row:
        remedies.append("pass --on-nonfinite skip to skip such steps (the run still stops "
                        f"after {MAX_SKIPPED} in a row)")
    return PlannerError(
        "non-finite", f"Step {step} of {steps} gave {' and '.join(parts)}{in_a_row}; the run "
        f"stopped before applying it, so no parameter holds a NaN and {kept}.", remedies)


def check_parameters(params: list[torch.Tensor], step: int, device: torch.device) -> None:
    """Before a checkpoint: an error on every rank if any rank's parameters hold NaN or
    inf (a finite gradient can still overflow an update), so none is ever saved."""
    held = [_local(p) for p in params]
    ok = bool(torch.stack([torch.isfinite(p).all() for p in held]).all()) if held else True
    flag = torch.tensor([0.0 if ok else 1.0], dtype=torch.float64, device=device)
    dist.all_reduce(flag)
    if flag.item():
        raise PlannerError(
            "non-finite", f"After step {step} the parameters of {round(flag.item())} rank(s) "
            "hold NaN or inf, though the loss and gradients were finite (the update "
            "overflowed); the run stopped without saving them.",
            ["lower the learning rate (--lr)", "clip gradients in your model, or use AdamW"])
