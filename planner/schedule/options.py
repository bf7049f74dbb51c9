"""The ways a job may run in a round, which policies give time shares to: alone on a
shape, or sharing a shape's devices with one other job (co-location: two data-parallel
jobs on one device set, each computing while the other communicates or waits, as
CrossoverScheduler and Gavel's space sharing do).

A pair is offered only where it wins: if the two jobs' shared rates, each as a fraction
of its rate alone on the shape, sum to 1 or less, running them one after the other on
the same devices does as much (it is never needed); and a job is offered only its
`PARTNERS` best partners, which keeps the programs small (Gavel's packing policies
restrict pairs by job type to the same end).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

from planner.schedule.jobs import Job
from planner.schedule.pool import Pool
from planner.schedule.shape import Shape, compact_layout
from planner.schedule.throughput import Throughputs

PARTNERS = 3  # the best co-location partners offered to each job


@dataclass(frozen=True, kw_only=True)
class Option:
    """`jobs` (one, or two sharing the devices) on `shape`, each at `rates` steps/s (on
    the shape's compact layout)."""

    jobs: tuple[str, ...]
    shape: Shape
    rates: tuple[float, ...]
    cpus: float = 0.0  # host cores the jobs need in all
    memory: float = 0.0  # host bytes

    @cached_property
    def key(self) -> str:
        """'resnet@4xv100', 'a+b@1xk80': what a job's time on it is kept under."""
        return f"{'+'.join(self.jobs)}@{self.shape.label}"

    def rate(self, job: str) -> float:
        return self.rates[self.jobs.index(job)]


class Catalog:
    """Every job's options, made once per job (and per pair) and kept: rates do not
    change while a job waits or runs, so each round reads them instead of pricing
    again."""

    def __init__(self, pool: Pool, throughputs: Throughputs, *, span: bool,
                 colocate: bool, capacity: Mapping[str, int] | None = None) -> None:
        """`capacity`: the devices per type jobs may use (default: all of the pool's);
        no option takes more."""
        self.pool, self.throughputs = pool, throughputs
        self.span, self.colocate = span, colocate
        self.capacity = dict(capacity if capacity is not None else pool.capacity())
        self._jobs: dict[str, Job] = {}
        self._alone: dict[str, tuple[Option, ...]] = {}
        self._pairs: dict[tuple[str, str], tuple[tuple[Option, float], ...]] = {}

    def alone(self, job: Job) -> tuple[Option, ...]:
        """The job's options by itself, fastest first."""
        if job.name not in self._alone:
            self._jobs[job.name] = job
            options = []
            for shape in self.throughputs.shapes(job, self.capacity, span=self.span):
                rate = self.throughputs.rate(job, compact_layout(shape, self.pool))
                if rate > 0:
                    options.append(Option(jobs=(job.name,), shape=shape, rates=(rate,),
                                          cpus=job.cpus, memory=job.memory))
            self._alone[job.name] = tuple(sorted(options, key=lambda o: (-o.rates[0],
                                                                          o.shape)))
        return self._alone[job.name]

    def job(self, name: str) -> Job:
        """A job whose options were made."""
        return self._jobs[name]

    def best_rate(self, job: Job) -> float:
        """The job's fastest rate alone (0: it fits nowhere)."""
        options = self.alone(job)
        return options[0].rates[0] if options else 0.0

    def pairs(self, first: Job, second: Job) -> tuple[tuple[Option, float], ...]:
        """The winning co-located options of two jobs, each with its gain (the sum of
        both jobs' shared rates as fractions of their rates alone, above 1)."""
        key = (first.name, second.name) if first.name < second.name else (second.name,
                                                                           first.name)
        if key not in self._pairs:
            self._pairs[key] = self._price_pairs(first, second) if self.colocate else ()
        return self._pairs[key]

    def _price_pairs(self, first: Job, second: Job) -> tuple[tuple[Option, float], ...]:
        alone_first = {o.shape: o.rates[0] for o in self.alone(first)
                       if len(o.shape.counts) == 1}
        alone_second = {o.shape: o.rates[0] for o in self.alone(second)
                        if len(o.shape.counts) == 1}
        out = []
        for shape in sorted(set(alone_first) & set(alone_second)):
            rates = self.throughputs.pair(first, second, shape)
            if rates is None:
                continue
            gain = rates[0] / alone_first[shape] + rates[1] / alone_second[shape]
            if gain > 1:
                out.append((Option(jobs=(first.name, second.name), shape=shape, rates=rates,
                                   cpus=first.cpus + second.cpus,
                                   memory=first.memory + second.memory), gain))
        return tuple(out)

    def options(self, jobs: Mapping[str, Job]) -> tuple[Option, ...]:
        """The options of these jobs: each alone, and the pairs among them that win,
        each job's `PARTNERS` best (by gain)."""
        out = [o for job in jobs.values() for o in self.alone(job)]
        if not self.colocate:
            return tuple(out)
        names = sorted(jobs)
        best: dict[str, list[tuple[float, Option]]] = {name: [] for name in names}
        for i, first in enumerate(names):
            for second in names[i + 1:]:
                for option, gain in self.pairs(jobs[first], jobs[second]):
                    best[first].append((gain, option))
                    best[second].append((gain, option))
        chosen: dict[str, Option] = {}
        for name in names:
            for _, option in sorted(best[name], key=lambda g: (-g[0], g[1].key))[:PARTNERS]:
                chosen[option.key] = option
        return tuple(out) + tuple(chosen[k] for k in sorted(chosen))
