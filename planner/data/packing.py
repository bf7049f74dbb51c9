"""A step's variable-length samples packed into each pipeline's micro-batches.

A micro-batch runs its samples as rows padded to its longest (right padding: a causal
model's real tokens never see the padding, and the loss skips it), so it costs its
rows times the work of its length (`cost_models.tokens`: linear in the length, the
attention core quadratic). Pipelines run the plan's number of micro-batches each, and
the plan shared the batch among them by speed, as if every sample were as long as the
plan's sequence length.

`balanced`: the samples go to the pipelines by LPT on their work (longest processing
time first, on machines of the pipelines' speeds: each sample, heaviest first, to the
pipeline that would finish it earliest), so each pipeline's work matches its speed;
then each pipeline's samples, sorted longest first, are cut into its micro-batches as
runs of neighbours (which pad little) whose heaviest is as light as a binary search on
that work finds, within the token budget: no micro-batch holds up the others (the
pipeline bubble a heavy one makes). LPT deals the sorted samples out in turn, so each
pipeline's share spans the lengths evenly and its runs stay dense. Where padding would
take a pipeline's micro-batches over their token budgets, the step is packed naively
(the plan's own shape, which always fits).

`naive`: what a packer blind to lengths does, for comparison: the samples in order,
each pipeline its plan share, micro-batches of the plan's size (each still padded
only to its own longest sample).

Both are pure functions of the lengths, so every rank packs a step alike without
communicating.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cost_models.tokens import TokenShape, token_factor
from planner.errors import PlannerError

SEARCH_STEPS = 60  # halvings of the binary search on the heaviest micro-batch's work


@dataclass(frozen=True, kw_only=True)
class MicroBatch:
    """Samples of one micro-batch (indices into the step's samples, longest first) and
    the length its rows are padded to: its longest sample's."""

    samples: tuple[int, ...]
    length: int

    @property
    def shape(self) -> TokenShape:
        return TokenShape(rows=len(self.samples), length=self.length)


@dataclass(frozen=True, kw_only=True)
class PipelineSlots:
    """What the packer needs of one pipeline: its micro-batches per step, its speed (work
    per second, work as `Work.of` counts it) and the most tokens a micro-batch may hold;
    and its plan share and micro-batch size, which naive packing follows."""

    micro_batches: int
    speed: float
    budget: int
    batch_share: int
    micro_batch: int


@dataclass(frozen=True, kw_only=True)
class Work:
    """A micro-batch's work in planned samples (one sample of `seq_len` tokens is 1),
    `quadratic` the share of that in attention cores (`cost_models.tokens`)."""

    seq_len: int
    quadratic: float

    def of(self, shape: TokenShape) -> float:
        return token_factor(shape, micro_batch=1, seq_len=self.seq_len,
                            quadratic=self.quadratic)


@dataclass(frozen=True, kw_only=True)
class Packing:
    """Each pipeline's micro-batches for one step, in the order they run."""

    pipelines: tuple[tuple[MicroBatch, ...], ...]

    def samples(self, pipeline: int) -> list[int]:
        """The pipeline's samples, micro-batch after micro-batch."""
        return [i for batch in self.pipelines[pipeline] for i in batch.samples]


def check_lengths(lengths: Sequence[int], pipelines: Sequence[PipelineSlots]) -> None:
    """An error naming the first sample no micro-batch can hold, or a batch too small."""
    wanted = sum(p.micro_batches for p in pipelines)
    if len(lengths) < wanted:
        raise PlannerError("bad-data", f"A step of {len(lengths)} samples cannot fill the "
                           f"plan's {wanted} micro-batches (each needs a sample).",
                           ["give every step the plan's global batch"])
    budget = min(p.budget for p in pipelines)
    for i, length in enumerate(lengths):
        if not 1 <= length <= budget:
            raise PlannerError("bad-data", f"Sample {i} of the step has {length} tokens; a "
                               f"micro-batch holds 1 to {budget:,} (the plan's micro-batch "
                               "size times its sequence length).",
                               ["cut long samples to the plan's sequence length",
                                "leave empty samples out"])


def naive(lengths: Sequence[int], pipelines: Sequence[PipelineSlots]) -> Packing:
    """The samples in order: each pipeline its plan share, in micro-batches of the plan's
    size, each padded to its own longest sample."""
    check_lengths(lengths, pipelines)
    out, start = [], 0
    for slots in pipelines:
        batches = []
        for first in range(start, start + slots.batch_share, slots.micro_batch):
            taken = tuple(range(first, min(first + slots.micro_batch,
                                           start + slots.batch_share)))
            batches.append(MicroBatch(samples=taken, length=max(lengths[i] for i in taken)))
        out.append(tuple(batches))
        start += slots.batch_share
    if start != len(lengths):
        raise PlannerError("bad-data", f"The plan's shares add up to {start} samples; the "
                           f"step has {len(lengths)}.", ["give every step the plan's "
                                                         "global batch"])
    return Packing(pipelines=tuple(out))


def balanced(lengths: Sequence[int], pipelines: Sequence[PipelineSlots], work: Work
             ) -> Packing:
    """The samples shared out by LPT on their work, then each pipeline's cut into its
    micro-batches by `equal_runs` (see the module docstring)."""
    check_lengths(lengths, pipelines)
    one = [work.of(TokenShape(rows=1, length=n)) for n in lengths]
    shares = lpt(one, lengths, pipelines)
    out = []
    for slots, samples in zip(pipelines, shares, strict=True):
        ordered = sorted(samples, key=lambda i: (-lengths[i], i))
        runs = equal_runs([lengths[i] for i in ordered], slots.micro_batches, work,
                          slots.budget)
        if runs is None:  # padding took the pipeline over its budget: the plan's shape
            return naive(lengths, pipelines)
        out.append(tuple(MicroBatch(samples=tuple(ordered[a:b]), length=lengths[ordered[a]])
                         for a, b in runs))
    return Packing(pipelines=tuple(out))


def lpt(works: Sequence[float], lengths: Sequence[int], pipelines: Sequence[PipelineSlots]
        ) -> list[list[int]]:
    """Samples to pipelines, longest processing time first: each (heaviest first) to the
    pipeline that would finish it earliest at its speed, among those whose micro-batches'
    token budgets still hold it; every pipeline gets at least as many samples as it runs
    micro-batches (once the samples left are as many as the pipelines still lack, only
    those take them). Ties go to the lower index."""
    loads = [0.0] * len(pipelines)
    tokens = [0] * len(pipelines)
    taken: list[list[int]] = [[] for _ in pipelines]
    order = sorted(range(len(works)), key=lambda i: (-works[i], i))
    for left, sample in zip(range(len(order), 0, -1), order, strict=True):
        lacking = [p for p, slots in enumerate(pipelines)
                   if len(taken[p]) < slots.micro_batches]
        short = sum(pipelines[p].micro_batches - len(taken[p]) for p in lacking)
        room = [p for p, slots in enumerate(pipelines)
                if tokens[p] + lengths[sample] <= slots.micro_batches * slots.budget]
        free = lacking if left <= short else room or list(range(len(pipelines)))
        best = min(free, key=lambda p: ((loads[p] + works[sample]) / pipelines[p].speed, p))
        loads[best] += works[sample]
        tokens[best] += lengths[sample]
        taken[best].append(sample)
    return taken


def equal_runs(ordered: Sequence[int], count: int, work: Work, budget: int
               ) -> list[tuple[int, int]] | None:
    """`count` runs [start, stop) of the lengths `ordered` (longest first, at least
    `count` of them), each padded to its first within `budget` tokens, the heaviest run's
    work as small as a binary search finds; None where the budget leaves more runs than
    `count`."""
    one = [work.of(TokenShape(rows=1, length=n)) for n in ordered]
    low, high = max(one), len(ordered) * one[0]
    if len(_greedy_runs(ordered, one, high, budget)) > count:
        return None
    for _ in range(SEARCH_STEPS):
        if high - low <= 1e-9 * high:
            break
        middle = (low + high) / 2
        if len(_greedy_runs(ordered, one, middle, budget)) <= count:
            high = middle
        else:
            low = middle
    runs = _greedy_runs(ordered, one, high, budget)
    while len(runs) < count:  # fewer runs than micro-batches: halve the heaviest
        heaviest = max((r for r in runs if r[1] - r[0] > 1),
                       key=lambda r: ((r[1] - r[0]) * one[r[0]], -r[0]))
        at = runs.index(heaviest)
        middle = (heaviest[0] + heaviest[1]) // 2
        runs[at:at + 1] = [(heaviest[0], middle), (middle, heaviest[1])]
    return runs


def _greedy_runs(ordered: Sequence[int], one: Sequence[float], cap: float, budget: int
                 ) -> list[tuple[int, int]]:
    """Runs from the longest sample on, each taking as many samples as fit under `cap`
    work and `budget` tokens padded to its first (at least one)."""
    runs, start = [], 0
    while start < len(ordered):
        rows = max(1, min(int(cap / one[start] * (1 + 1e-12)), budget // ordered[start]))
        stop = min(len(ordered), start + rows)
        runs.append((start, stop))
        start = stop
    return runs
