"""The online scheduler, simulated: rounds of fixed length (Gavel's are 6 minutes), jobs
arriving and finishing, each round's placement from the policy, preemption and moves
paid for in checkpoint and restore time.

A round starts at t. Jobs that arrived by t are active; the policy's time shares for
them (over the devices not reserved by others) become the round's placement
(`rounding.place_round`). A job placed where it ran last round, on the same devices,
just goes on. One that starts loses `restore` seconds of the round to starting up; one
that resumes after a pause or moves loses `checkpoint + restore` (its last checkpoint
is written before it stops, which this charges when it next runs). In the rest of the
round it runs at its rate on the devices it holds (`Throughputs.rate` of its layout, so
a job spread over machines runs at its spread rate); one that finishes frees its
devices at the end of the round. With no active job, time skips to the next arrival;
with active jobs none of which can be placed (host cores or memory) and none to come,
the simulation ends and they are reported unfinished. A round that can only repeat
until the next arrival or completion (`_settled`) is run for all those rounds at once,
which is what running them one by one gives: the months-long tails of the Philly-derived
traces then take a few steps.

Metrics: average job completion time (finish - arrival), makespan (last finish - first
arrival), utilization (device-seconds held by jobs, start-up included, over devices x
makespan), and Jain's fairness index (sum x)^2 / (n sum x^2) over each job's x =
(steps / best rate) / completion time: the fraction of its fastest possible speed it got
over its life (1 / slowdown).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from planner.errors import PlannerError
from planner.schedule.jobs import Job
from planner.schedule.options import Catalog
from planner.schedule.policies import Active, Policy, Problem, equal_share_rates
from planner.schedule.pool import Pool
from planner.schedule.rounding import Placement, free_totals, place_round, placement_rate
from planner.schedule.throughput import Throughputs


@dataclass(frozen=True, kw_only=True)
class Settings:
    round_length: float = 360.0  # seconds
    checkpoint: float = 30.0  # seconds to save a job's state before it stops or moves
    restore: float = 30.0  # seconds to start it (and load its state) where it runs next
    horizon: float = math.inf  # stop simulating then; later jobs are reported unfinished


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """One job's run: times on the schedule's clock (None: never started or finished)."""

    name: str
    arrival: float
    start: float | None
    finish: float | None
    steps_left: float
    restarts: int  # times it resumed after a pause or moved
    deadline: float | None = None

    @property
    def jct(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    @property
    def deadline_met(self) -> bool | None:
        if self.deadline is None:
            return None
        return self.finish is not None and self.finish <= self.deadline


@dataclass(frozen=True, kw_only=True)
class Round:
    start: float
    length: float
    placements: tuple[Placement, ...]
    decide_seconds: float  # wall time the policy and placement took (a measure, not a rule)


@dataclass(frozen=True, kw_only=True)
class Metrics:
    average_jct: float  # seconds, over finished jobs (nan: none finished)
    makespan: float
    utilization: float
    jain: float
    finished: int
    unfinished: int
    deadlines_met: int
    deadlines: int

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True, kw_only=True)
class Simulation:
    policy: str
    outcomes: tuple[Outcome, ...]
    rounds: tuple[Round, ...]
    metrics: Metrics


@dataclass
class _Progress:
    """A job's state while the simulation runs (local to `simulate`)."""

    job: Job
    left: float
    start: float | None = None
    finish: float | None = None
    restarts: int = 0
    last: Placement | None = None  # its placement in the round just run (None: idle)
    received: dict[str, float] = field(default_factory=dict)  # option key -> seconds


def check_runnable(jobs: Sequence[Job], catalog: Catalog, *, reserved: bool) -> None:
    """An error naming the first job no option of the cluster can run (`reserved`:
    some devices are left out, held by reservations)."""
    for job in jobs:
        if not catalog.alone(job):
            sizes = (f"{job.min_devices}" if job.min_devices == job.max_devices else
                     f"{job.min_devices} to {job.max_devices}")
            free = ", ".join(f"{n} {kind}" for kind, n in catalog.capacity.items() if n)
            raise PlannerError(
                "infeasible", f"Job {job.name} can run nowhere on this cluster: it needs "
                f"{sizes} devices of one type (or two) where it has a throughput, and "
                + (("the devices no reservation holds are " + free if free else
                    "reservations hold every device") if reserved else
                   "the cluster has " + free) + ".",
                ["lower the job's min_devices", "give it a throughput on a type the "
                 "cluster has (profile jobs: a row of the matrix for that size)",
                 *(["see the reservations with `planner jobs`"] if reserved else [])])


def simulate(jobs: Sequence[Job], pool: Pool, throughputs: Throughputs, policy: Policy,
             settings: Settings | None = None, *,
             free: Mapping[str, tuple[int, ...]] | None = None) -> Simulation:
    """Every job through the cluster under `policy` (see the module docstring); `free`:
    the devices the schedule may use per machine (None: all)."""
    settings = settings or Settings()
    if settings.round_length <= 0:
        raise PlannerError("bad-option", f"The round length must be positive (got "
                           f"{settings.round_length:g} s).")
    capacity, cpus, memory = free_totals(pool, free)
    catalog = Catalog(pool, throughputs, span=policy.span, colocate=policy.colocate,
                      capacity=capacity)
    check_runnable(jobs, catalog, reserved=free is not None)
    progress = {job.name: _Progress(job=job, left=float(job.steps)) for job in jobs}
    waiting = sorted(jobs, key=lambda j: (j.arrival, j.name))
    rounds: list[Round] = []
    now = waiting[0].arrival if waiting else 0.0
    active: dict[str, Job] = {}
    while (waiting or active) and now < settings.horizon:
        while waiting and waiting[0].arrival <= now:
            job = waiting.pop(0)
            active[job.name] = job
        if not active:
            now = waiting[0].arrival
            continue
        clock = time.perf_counter()
        problem = build_problem(active, {name: progress[name].left for name in active},
                                catalog, now, capacity, cpus=cpus, memory=memory)
        shares = policy.shares(problem) if policy.shares is not None else {}
        placements = place_round(pool, problem, shares, rounding=policy.rounding,
                                 received=_received(progress, active),
                                 previous={name: p.last for name, p in progress.items()
                                           if p.last is not None and name in active},
                                 throughputs=throughputs, free=free,
                                 switch=(settings.checkpoint + settings.restore)
                                 / settings.round_length)
        if not placements:  # (host cores or memory per machine hold none of the jobs)
            if not waiting:
                break  # nothing will change: the active jobs never run
            now = max(now + settings.round_length, waiting[0].arrival)
            continue
        rounds.append(Round(start=now, length=settings.round_length, placements=placements,
                            decide_seconds=time.perf_counter() - clock))
        rates = _run(placements, progress, active, pool, throughputs, catalog, now, settings)
        now += settings.round_length
        if _settled(problem, shares, placements, rates, active, policy):
            repeats = _repeats(rates, progress, waiting, now, settings)
            if repeats > 0:
                length = repeats * settings.round_length
                rounds.append(Round(start=now, length=length, placements=placements,
                                    decide_seconds=0.0))
                for placement in placements:
                    for name in placement.option.jobs:
                        state = progress[name]
                        state.left -= rates[name] * length
                        key = placement.option.key
                        state.received[key] = state.received.get(key, 0.0) + length
                now += length
    outcomes = tuple(Outcome(name=p.job.name, arrival=p.job.arrival, start=p.start,
                             finish=p.finish, steps_left=max(p.left, 0.0),
                             restarts=p.restarts, deadline=p.job.deadline)
                     for p in progress.values())
    return Simulation(policy=policy.name, outcomes=outcomes, rounds=tuple(rounds),
                      metrics=metrics(outcomes, rounds, jobs, catalog, pool.num_devices))


def _settled(problem: Problem, shares: Mapping[int, float], placements: Sequence[Placement],
             rates: Mapping[str, float], active: Mapping[str, Job], policy: Policy) -> bool:
    """Whether the round just run repeats until the next arrival or completion: no job
    finished in it and every active job ran; under FIFO that is all (it never preempts),
    under the other policies every job also ran alone at its fastest rate on its whole
    share (every objective here grows with each job's rate, so nothing can beat that
    until the jobs change)."""
    if len(active) != len(problem.active) or len(rates) != len(active):
        return False
    if policy.shares is None:
        return True
    full = {problem.options[i].key for i, share in shares.items() if share >= 1 - 1e-6}
    best = {a.job.name: a.best for a in problem.active}
    return all(len(p.option.jobs) == 1 and p.option.key in full
               and rates[p.option.jobs[0]] >= best[p.option.jobs[0]] * (1 - 1e-9)
               for p in placements)


def _repeats(rates: Mapping[str, float], progress: Mapping[str, _Progress],
             waiting: Sequence[Job], now: float, settings: Settings) -> int:
    """How many rounds from `now` run as the last one did: those that start before the
    next arrival and the horizon, and end before any job finishes."""
    length = settings.round_length
    limit = min(waiting[0].arrival if waiting else math.inf, settings.horizon)
    count = math.ceil((limit - now) / length) if math.isfinite(limit) else 2**62
    for name, rate in rates.items():
        if rate > 0:
            count = min(count, math.ceil(progress[name].left / (rate * length)) - 1)
        else:
            return 0
    return max(0, count)


def build_problem(active: Mapping[str, Job], left: Mapping[str, float], catalog: Catalog,
                  now: float, capacity: Mapping[str, int], *, cpus: float = math.inf,
                  memory: float = math.inf) -> Problem:
    """What the policy sees at `now`: the active jobs (with `left[job]` steps left) and
    their options, over `capacity` free devices per type and host resources in all."""
    alone = {name: catalog.alone(job) for name, job in active.items()}
    equal = equal_share_rates(active, alone, capacity)
    states = tuple(Active(job=job, left=left[name], age=now - job.arrival,
                          best=catalog.best_rate(job), equal=equal[name])
                   for name, job in sorted(active.items()))
    return Problem(active=states, options=catalog.options(active), free=capacity,
                   cpus=cpus, memory=memory)


def _received(progress: Mapping[str, _Progress], active: Mapping[str, Job]
              ) -> dict[str, float]:
    out: dict[str, float] = {}
    for name in active:
        for key, seconds in progress[name].received.items():
            out[key] = seconds
    return out


def _run(placements: Sequence[Placement], progress: Mapping[str, _Progress],
         active: dict[str, Job], pool: Pool, throughputs: Throughputs, catalog: Catalog,
         now: float, settings: Settings) -> dict[str, float]:
    """Advance every job by one round (mutates `progress` and `active`); the rate each
    placed job ran at."""
    length = settings.round_length
    rates = {}
    running = {job for p in placements for job in p.option.jobs}
    for name in active:
        if name not in running:
            progress[name].last = None
    for placement in placements:
        for job_name in placement.option.jobs:
            state = progress[job_name]
            if state.start is None:
                lost = settings.restore
                state.start = now
            elif state.last is not None and state.last.devices == placement.devices \
                    and state.last.option.key == placement.option.key:
                lost = 0.0
            else:
                lost = settings.checkpoint + settings.restore
                state.restarts += 1
            rate = rates[job_name] = placement_rate(placement, catalog.job(job_name), pool,
                                                    throughputs)
            useful = max(0.0, length - lost)
            key = placement.option.key
            state.received[key] = state.received.get(key, 0.0) + length
            state.last = placement
            if rate > 0 and rate * useful >= state.left:
                state.finish = now + lost + state.left / rate
                state.left = 0.0
                del active[job_name]
            else:
                state.left -= rate * useful
    return rates


def metrics(outcomes: Sequence[Outcome], rounds: Sequence[Round], jobs: Sequence[Job],
            catalog: Catalog, devices: int) -> Metrics:
    finished = [o for o in outcomes if o.finish is not None]
    first = min((o.arrival for o in outcomes), default=0.0)
    last = max((o.finish for o in finished), default=first)
    makespan = last - first
    finish = {o.name: o.finish for o in outcomes}
    held = 0.0
    for r in rounds:
        for placement in r.placements:
            ends = [finish[j] for j in placement.option.jobs if finish[j] is not None
                    and finish[j] < r.start + r.length]
            until = max(ends) if len(ends) == len(placement.option.jobs) else r.start + r.length
            held += placement.option.shape.devices * (until - r.start)
    by_name = {job.name: job for job in jobs}
    speeds = []
    for o in finished:
        job = by_name[o.name]
        best = catalog.best_rate(job)
        jct = o.jct or 0.0
        if best > 0 and jct > 0:
            speeds.append(job.steps / best / jct)
    return Metrics(
        average_jct=(sum(o.jct or 0.0 for o in finished) / len(finished)
                     if finished else math.nan),
        makespan=makespan,
        utilization=held / (devices * makespan) if devices and makespan > 0 else 0.0,
        jain=jain_index(speeds),
        finished=len(finished), unfinished=len(outcomes) - len(finished),
        deadlines_met=sum(1 for o in outcomes if o.deadline_met),
        deadlines=sum(1 for o in outcomes if o.deadline is not None))


def jain_index(values: Sequence[float]) -> float:
    """(sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one holds everything."""
    squares = sum(v * v for v in values)
    if not values or squares == 0:
        return math.nan
    return sum(values) ** 2 / (len(values) * squares)
