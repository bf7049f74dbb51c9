"""One round's placement from a policy's time shares: which options run, on which
machines and devices.

Over many rounds each option should run about its share of the time. As in Gavel, an
option's priority is its share over the fraction of its job's time it has run so far
(new options rank by share alone), so options behind their share come first. Three
ways to pick a round's options:

- "cp-sat" (our policies): the options with a share are chosen together by CP-SAT,
  maximising priority times devices times the part of the round the option will work
  (an option its jobs do not already run on loses what starting, resuming or moving
  costs) under the per-type device counts and host CPU and memory in all (one option
  per job); devices left over are then filled greedily, as below, by the options
  without a share, so no device idles while a job could use it.
- "greedy" (Gavel's mechanism, for its baseline): options in priority order, each taken
  if its jobs are not placed yet and it fits.
- "fifo": running jobs keep their devices; waiting jobs start in arrival order, each
  on its fastest option that fits, until the first that fits nowhere.

Placement on machines keeps a job that goes on with the same option on its devices
(moving it would cost a checkpoint and a restore); the others go largest first, each
type's part on one machine where one holds it (the fullest that does), else spread over
the machines with the most free devices; a job's host cores and memory are spread over
its machines in proportion to its devices there, and every machine's must fit.

Once every option is placed, a job left spread over machines (its devices were
fragmented when it started) moves to the devices still free, its own included, where
that pays for the move within the round: its rate there times the part of the round a
move leaves (1 - switch) beats its rate where it is. Without this a job kept its
fragmented devices for as long as it kept its option: under policies that hold a job on
one option for days (min-jct, max-throughput), a long job ran its whole life at its
spread rate, a third of its compact one for some of Gavel's measured jobs. FIFO never
moves a running job.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from ortools.sat.python import cp_model

from planner.schedule.jobs import Job
from planner.schedule.options import Option
from planner.schedule.policies import Problem
from planner.schedule.pool import Pool
from planner.schedule.shape import Layout, compact_layout
from planner.schedule.throughput import Throughputs

NEW_OPTION = 1e-3  # the fraction of time an option that never ran counts as having had
CP_SAT_TIME = 0.02  # deterministic time limit of the CP-SAT choice (about seconds)
CP_SAT_GAP = 0.01  # and the relative gap it may stop at


@dataclass(frozen=True, kw_only=True)
class Placement:
    """An option on devices: `((machine, (device index, ...)), ...)`, machines in the
    pool's order."""

    option: Option
    devices: tuple[tuple[str, tuple[int, ...]], ...]

    def layout(self, pool: Pool) -> Layout:
        return Layout.of((pool.machine(name).device_type, len(indices))
                         for name, indices in self.devices)


def placement_rate(placement: Placement, job: Job, pool: Pool,
                   throughputs: Throughputs) -> float:
    """The job's rate on the devices it got: its rate on that layout alone; a shared
    option's rate scaled by how the layout compares with the compact one it was priced
    on."""
    option = placement.option
    alone = throughputs.rate(job, placement.layout(pool))
    if len(option.jobs) == 1:
        return alone
    compact = throughputs.rate(job, compact_layout(option.shape, pool))
    return option.rate(job.name) * (alone / compact if compact > 0 else 0.0)


@dataclass
class _Room:
    """What is still free while a round is being placed (mutated as options are)."""

    devices: dict[str, list[int]]  # machine -> free device indices
    cpus: dict[str, float]
    memory: dict[str, float]

    @staticmethod
    def of(pool: Pool, free: Mapping[str, tuple[int, ...]] | None) -> _Room:
        return _Room(devices={m.name: list(range(m.devices) if free is None
                                           else free.get(m.name, ()))
                              for m in pool.machines},
                     cpus={m.name: m.cpus for m in pool.machines},
                     memory={m.name: m.memory for m in pool.machines})

    def count(self, pool: Pool) -> dict[str, int]:
        out: dict[str, int] = {}
        for machine in pool.machines:
            out[machine.device_type] = out.get(machine.device_type, 0) + len(
                self.devices[machine.name])
        return out


def free_totals(pool: Pool, free: Mapping[str, tuple[int, ...]] | None
                ) -> tuple[dict[str, int], float, float]:
    """Free devices per type, and host cores and memory of the machines in all."""
    room = _Room.of(pool, free)
    return (room.count(pool), sum(room.cpus.values()), sum(room.memory.values()))


def place_round(pool: Pool, problem: Problem, shares: Mapping[int, float], *,
                rounding: str, received: Mapping[str, float],
                previous: Mapping[str, Placement], throughputs: Throughputs,
                free: Mapping[str, tuple[int, ...]] | None = None,
                switch: float = 0.0) -> tuple[Placement, ...]:
    """The round's placements (see the module docstring). `received[option key]`: the
    seconds each option has run; `previous[job]`: last round's placements;
    `throughputs`: rates on layouts (whether consolidating a spread job pays); `free`:
    the free device indices per machine (None: every device); `switch`: the fraction of
    a round a job loses to starting, resuming or moving (checkpoint and restore)."""
    room = _Room.of(pool, free)
    age = {a.job.name: a.age for a in problem.active}
    placed: list[Placement] = []
    if rounding == "fifo":
        return _fifo(pool, problem, previous, room)
    priority = {i: _priority(o, shares.get(i, 0.0), received, age)
                for i, o in enumerate(problem.options)}
    best = {a.job.name: a.best for a in problem.active}
    ranked = sorted(range(len(problem.options)), key=lambda i: (
        -priority[i], -shares.get(i, 0.0), -_speed(problem.options[i], best),
        problem.options[i].key))
    if rounding == "cp-sat":
        worth = {i: priority[i] * (1.0 if _continues(problem.options[i], previous)
                                   else max(0.0, 1.0 - switch))
                 for i in priority}
        chosen = _choose(pool, problem, [i for i in ranked if shares.get(i, 0.0) > 0],
                         worth, room)
        # going on in place first, so nothing takes their devices; then largest first
        chosen.sort(key=lambda i: (not _continues(problem.options[i], previous),
                                   -problem.options[i].shape.devices))
        for i in chosen:
            placement = _place(pool, problem.options[i], previous, room)
            if placement is not None:
                placed.append(placement)
    busy = {job for p in placed for job in p.option.jobs}
    for i in ranked:  # greedy, or filling what CP-SAT left
        option = problem.options[i]
        if busy.intersection(option.jobs):
            continue
        placement = _place(pool, option, previous, room)
        if placement is not None:
            placed.append(placement)
            busy.update(option.jobs)
    jobs = {a.job.name: a.job for a in problem.active}
    return tuple(_consolidated(pool, p, jobs, throughputs, room, switch) for p in placed)


def _consolidated(pool: Pool, placement: Placement, jobs: Mapping[str, Job],
                  throughputs: Throughputs, room: _Room, switch: float) -> Placement:
    """The placement, moved to the free devices (its own included) where every job
    of it runs faster there by more than the move costs (see the module docstring);
    `room` is updated."""
    if len(placement.devices) == 1:
        return placement
    _release(placement.option, placement.devices, room)
    devices = _fresh_devices(pool, placement.option, room)
    if devices is not None and len(devices) < len(placement.devices):
        moved = Placement(option=placement.option, devices=devices)
        if all(placement_rate(moved, jobs[name], pool, throughputs) * (1 - switch)
               > placement_rate(placement, jobs[name], pool, throughputs)
               for name in placement.option.jobs):
            placement = moved
    _take(placement.option, placement.devices, room)
    return placement


def _priority(option: Option, share: float, received: Mapping[str, float],
              age: Mapping[str, float]) -> float:
    if share <= 0:
        return 0.0
    active_for = min(age[job] for job in option.jobs)
    had = received.get(option.key, 0.0) / active_for if active_for > 0 else 0.0
    return share / max(had, NEW_OPTION)


def _speed(option: Option, best: Mapping[str, float]) -> float:
    """An option's rates as fractions of its jobs' best rates, summed (a tie-breaker)."""
    return sum(r / best[j] for j, r in zip(option.jobs, option.rates, strict=True)
               if best.get(j))


def _continues(option: Option, previous: Mapping[str, Placement]) -> bool:
    return all(job in previous and previous[job].option.key == option.key
               for job in option.jobs)


def _choose(pool: Pool, problem: Problem, candidates: list[int], worth: Mapping[int, float],
            room: _Room) -> list[int]:
    """The candidates CP-SAT picks: one option per job at most, within the free devices
    per type and the host cores and memory in all, maximising worth x devices (worth:
    priority times the part of the round the option works, what moving it would lose
    taken off)."""
    if not candidates:
        return []
    free = room.count(pool)
    hint = _greedy(problem, candidates, free)
    if len(hint) == len(candidates):  # (all fit at once: nothing to choose)
        return list(candidates)
    model = cp_model.CpModel()
    pick = {i: model.new_bool_var(f"o{i}") for i in candidates}
    by_job: dict[str, list] = {}
    by_type: dict[str, list] = {}
    for i in candidates:
        option = problem.options[i]
        for job in option.jobs:
            by_job.setdefault(job, []).append(pick[i])
        for kind, n in option.shape.counts:
            by_type.setdefault(kind, []).append(n * pick[i])
    for picks in by_job.values():
        model.add(sum(picks) <= 1)
    for kind, uses in by_type.items():
        model.add(sum(uses) <= free.get(kind, 0))
    for field, total, unit in (("cpus", sum(room.cpus.values()), 0.01),
                               ("memory", sum(room.memory.values()), 2.0**20)):
        if math.isfinite(total):  # (in whole hundredths of a core, whole MiB)
            model.add(sum(math.ceil(getattr(problem.options[i], field) / unit) * pick[i]
                          for i in candidates) <= math.floor(total / unit))
    top = max(worth[i] for i in candidates) or 1.0
    ties = len(candidates)  # (equal weights: the earlier candidate in rank order wins)
    model.maximize(sum((max(1, round(1e6 * worth[i] / top))
                        * problem.options[i].shape.devices * ties + ties - rank) * pick[i]
                       for rank, i in enumerate(candidates)))
    for i in hint:  # (a first solution to improve on)
        model.add_hint(pick[i], True)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1  # (deterministic: the same round, the same choice)
    solver.parameters.max_deterministic_time = CP_SAT_TIME
    solver.parameters.relative_gap_limit = CP_SAT_GAP
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return []
    return [i for i in candidates if solver.value(pick[i])]


def _greedy(problem: Problem, ranked: list[int], free: Mapping[str, int]) -> set[int]:
    """The options taken in order where their jobs are free and the device counts hold
    them (host resources aside): the hint CP-SAT starts from."""
    left = dict(free)
    busy: set[str] = set()
    taken = set()
    for i in ranked:
        option = problem.options[i]
        if busy.intersection(option.jobs) or any(left.get(kind, 0) < n
                                                  for kind, n in option.shape.counts):
            continue
        for kind, n in option.shape.counts:
            left[kind] -= n
        busy.update(option.jobs)
        taken.add(i)
    return taken


def _fifo(pool: Pool, problem: Problem, previous: Mapping[str, Placement],
          room: _Room) -> tuple[Placement, ...]:
    active = {a.job.name: a for a in problem.active}
    placed = []
    for placement in previous.values():  # never preempted
        if all(job in active for job in placement.option.jobs):
            kept = _place(pool, placement.option, previous, room)
            if kept is not None:
                placed.append(kept)
    running = {job for p in placed for job in p.option.jobs}
    alone: dict[str, list[Option]] = {}
    for option in problem.options:
        if len(option.jobs) == 1:
            alone.setdefault(option.jobs[0], []).append(option)
    waiting = sorted((a for a in problem.active if a.job.name not in running),
                     key=lambda a: (a.job.arrival, a.job.name))
    for a in waiting:
        options = sorted(alone.get(a.job.name, []), key=lambda o: (-o.rates[0], o.shape))
        placement = next((p for p in (_place(pool, o, previous, room) for o in options)
                          if p is not None), None)
        if placement is None:
            break  # (first in, first out: no job overtakes one that waits)
        placed.append(placement)
    return tuple(placed)


def _place(pool: Pool, option: Option, previous: Mapping[str, Placement],
           room: _Room) -> Placement | None:
    """The option on free devices (its previous ones where it goes on), taken from
    `room`; None where it does not fit."""
    if _continues(option, previous):
        kept = previous[option.jobs[0]].devices
        if all(set(indices) <= set(room.devices[name]) for name, indices in kept) and \
                _host_fits(option, kept, room):
            _take(option, kept, room)
            return Placement(option=option, devices=kept)
    chosen = _fresh_devices(pool, option, room)
    if chosen is None:
        return None
    _take(option, chosen, room)
    return Placement(option=option, devices=chosen)


def _fresh_devices(pool: Pool, option: Option, room: _Room
                   ) -> tuple[tuple[str, tuple[int, ...]], ...] | None:
    """Free devices for the option, each type's part on one machine where one holds
    it, host cores and memory fitting (`room` is left as it is); None: it does not
    fit."""
    devices: list[tuple[str, tuple[int, ...]]] = []
    for kind, count in option.shape.counts:
        part = _devices_of_type(pool, option, kind, count, room, devices)
        if part is None:
            return None
        devices += part
    order = {m.name: i for i, m in enumerate(pool.machines)}
    chosen = tuple(sorted(devices, key=lambda d: order[d[0]]))
    return chosen if _host_fits(option, chosen, room) else None


def _devices_of_type(pool: Pool, option: Option, kind: str, count: int, room: _Room,
                     taken: list[tuple[str, tuple[int, ...]]]
                     ) -> list[tuple[str, tuple[int, ...]]] | None:
    used = {name for name, _ in taken}
    machines = [m for m in pool.machines if m.device_type == kind and m.name not in used
                and room.devices[m.name]]
    share = option.shape.devices
    whole = [m for m in machines if len(room.devices[m.name]) >= count
             and _host_fits_part(option, m.name, count, share, room)]
    if whole:  # the fullest machine that holds it all
        machine = min(whole, key=lambda m: len(room.devices[m.name]))
        return [(machine.name, tuple(room.devices[machine.name][:count]))]
    out, left = [], count
    for machine in sorted(machines, key=lambda m: -len(room.devices[m.name])):
        take = min(left, len(room.devices[machine.name]))
        if take and _host_fits_part(option, machine.name, take, share, room):
            out.append((machine.name, tuple(room.devices[machine.name][:take])))
            left -= take
        if left == 0:
            return out
    return None


def _host_fits_part(option: Option, machine: str, devices: int, total: int,
                    room: _Room) -> bool:
    return (option.cpus * devices / total <= room.cpus[machine] + 1e-9
            and option.memory * devices / total <= room.memory[machine] + 1e-9)


def _host_fits(option: Option, devices: tuple[tuple[str, tuple[int, ...]], ...],
               room: _Room) -> bool:
    total = sum(len(indices) for _, indices in devices)
    return all(_host_fits_part(option, name, len(indices), total, room)
               for name, indices in devices)


def _take(option: Option, devices: tuple[tuple[str, tuple[int, ...]], ...],
          room: _Room) -> None:
    total = sum(len(indices) for _, indices in devices)
    for name, indices in devices:
        room.devices[name] = [d for d in room.devices[name] if d not in indices]
        room.cpus[name] -= option.cpus * len(indices) / total
        room.memory[name] -= option.memory * len(indices) / total


def _release(option: Option, devices: tuple[tuple[str, tuple[int, ...]], ...],
             room: _Room) -> None:
    """What `_take` took, given back."""
    total = sum(len(indices) for _, indices in devices)
    for name, indices in devices:
        room.devices[name] = sorted(room.devices[name] + list(indices))
        room.cpus[name] += option.cpus * len(indices) / total
        room.memory[name] += option.memory * len(indices) / total
