"""What the user fixes or bounds in the search space."""

from __future__ import annotations

from dataclasses import dataclass

from planner.errors import PlannerError
from planner.types import Schedule

MAX_GLOBAL_BATCH = 10**9  # samples per step; the lower bound's LP loses precision beyond


def check_global_batch(samples: int) -> None:
    """An error naming --global-batch unless it is 1 to MAX_GLOBAL_BATCH samples per step
    (solve, estimate and what-if alike)."""
    if not 1 <= samples <= MAX_GLOBAL_BATCH:
        raise PlannerError("bad-option", f"--global-batch must be between 1 and "
                           f"{MAX_GLOBAL_BATCH:,} samples per step (got {samples:,}).")


@dataclass(frozen=True)
class Limits:
    """What the user fixes or bounds (None: free)."""

    tp: int | None = None
    max_tp: int | None = None
    # whether classes, and the two blocks of a mixed class, may differ in tp (searched on
    # request: the search space grows, and on large clusters the search with it;
    # benchmarks/solve.py --tp-per-class)
    tp_per_class: bool = False
    pp: int | None = None  # stages per pipeline
    dp: int | None = None  # number of pipelines
    max_dp: int | None = None  # most pipelines
    micro_batch: int | None = None
    interleave: int | None = None  # model chunks per device (1: plain 1F1B)
    # the chunk counts tried if `interleave` is free (--max-interleave): interleaving only
    # on request, as each chunk count adds configurations to search (Llama-3 70B: 0.82 s
    # plain, 1.09 s with up to 2 chunks in the same hour, against a 1 s target) and its
    # closed form runs above the simulator on unbalanced pipelines (benchmarks/closed_form.py)
    interleaves: tuple[int, ...] = (1,)
    # the schedule (None: 1F1B, GPipe for plans of one pipeline class, and interleaved
    # 1F1B with the chunk counts above)
    schedule: Schedule | None = None
    max_stages: int = 16
    max_micro_batch: int = 16
    mixed: bool = True
    # the most mixed pipeline classes (chains of two or more types) a plan may have: each
    # is a level of the search, and the more levels, the larger its tree (`search.py`)
    mixed_classes: int = 2
    # whether two mixed classes may share device types (--mixed-share-types): without it
    # the search leaves such pairs out for speed and says so (`search._mixed_classes`)
    mixed_share_types: bool = False
    first_stage: str | None = None  # device type of every pipeline's first stage
    last_stage: str | None = None  # ... and of its last stage

    @property
    def most_pipelines(self) -> int | None:
        """The most pipelines a plan may have (None: no limit)."""
        return self.dp if self.dp is not None else self.max_dp

    def allows(self, types: tuple[str, ...]) -> bool:
        """Whether a pipeline of these stage device types obeys the stage pins."""
        return ((self.first_stage is None or types[0] == self.first_stage)
                and (self.last_stage is None or types[-1] == self.last_stage))


SCHEDULE_NAMES = {"1f1b": Schedule.ONE_F_ONE_B, "gpipe": Schedule.GPIPE,
                  "interleaved": Schedule.INTERLEAVED}


def schedule_name(schedule: Schedule) -> str:
    """The name `--schedule` takes for a schedule."""
    return next(k for k, v in SCHEDULE_NAMES.items() if v is schedule)


def parse_schedule(text: str, flag: str = "--schedule") -> Schedule:
    """A schedule by name (`SCHEDULE_NAMES`, or its plan-file value); a clear error for
    another."""
    key = text.strip().lower()
    if key in SCHEDULE_NAMES:
        return SCHEDULE_NAMES[key]
    try:
        return Schedule(key)
    except ValueError:
        raise PlannerError("bad-option", f"{flag} {text!r} is not one of "
                           f"{', '.join(SCHEDULE_NAMES)}.") from None


def check_chunk_flags(interleave: int | None, max_interleave: int | None,
                      schedule: str | None) -> None:
    """An error where --max-interleave contradicts --interleave or --schedule (the
    solver reads the chunk counts it tries from --max-interleave only where --interleave
    fixes none, so either contradiction passed silently)."""
    if interleave is not None and max_interleave is not None and interleave > max_interleave:
        raise PlannerError("bad-option", f"--interleave {interleave} contradicts "
                           f"--max-interleave {max_interleave}.", ["drop one of them"])
    if (max_interleave is not None and max_interleave > 1 and schedule is not None
            and parse_schedule(schedule) is not Schedule.INTERLEAVED):
        raise PlannerError("bad-option", f"--max-interleave {max_interleave} tries "
                           f"interleaved 1F1B, which contradicts --schedule {schedule}.",
                           ["drop one of them"])
