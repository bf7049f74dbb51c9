"""Scheduling policies as linear programs over time shares (Gavel's formulation,
generalised to options: a job alone on a shape, spanning two device types, or two jobs
sharing one set of devices), solved with OR-Tools MathOpt and HiGHS.

x[o] in [0, 1] is the share of time option o runs. A job's rate is
rate_m(x) = sum_o x[o] * T[m, o] steps/s. Every policy keeps

    sum_{o holds m} x[o] <= 1                     a job runs at most all the time
    sum_o x[o] * devices[o, t] <= free[t]         per device type
    sum_o x[o] * cpus[o] <= free cpus             host cores, and likewise host memory

and optimises one objective (w_m: the job's weight; eq_m: its rate on an equal share,
`equal_share_rates`; best_m: its fastest rate alone; left_m: steps it has left):

    max-throughput        maximise sum_m w_m rate_m / best_m
    max-min-fairness      maximise min_m rate_m / (w_m eq_m), then raise the jobs that
                          can still go higher the same way (water-filling, so no job
                          is held below what it could get), then the total throughput
    min-jct               maximise sum_m w_m rate_m / left_m: the rate at which the
                          work left is finished, which serves the jobs with the least
                          work (device-time) left first (Smith's rule, fluid SRPT)
    min-makespan          maximise z with rate_m >= z left_m for all m: every job
                          finishes by 1 / z (Gavel's minimum total duration), then
                          the total throughput
    finish-time-fairness  minimise max_m rho_m, rho_m = (age_m + left_m / rate_m) /
                          (steps_m / eq_m): time to finish in the shared cluster over
                          time on an equal share (Themis, as Gavel poses it), by a
                          Dinkelbach-style iteration of max-min programs, then the
                          total throughput
    gavel                 Gavel's heterogeneity-aware max-min fairness (the baseline):
                          the max-min objective above, one program, each job alone on
                          one type at its requested size

Rounding the shares to one round's placement is `rounding.py`'s work.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ortools.math_opt import model_pb2
from ortools.math_opt.python import mathopt

from planner.errors import PlannerError
from planner.schedule.jobs import Job
from planner.schedule.options import Option

LEVELS = 8  # water-filling levels at most (a round's program must stay fast)
FAIRNESS_STEPS = 10  # finish-time-fairness iterations at most
FAIRNESS_GAIN = 0.01  # and it stops once the worst rho falls by less than this fraction
TOLERANCE = 1e-6


@dataclass(frozen=True, kw_only=True)
class Active:
    """An active job as policies see it."""

    job: Job
    left: float  # steps left
    age: float  # seconds since it arrived
    best: float  # its fastest rate alone (steps/s)
    equal: float  # its rate on an equal share (steps/s)


@dataclass(frozen=True, kw_only=True)
class Problem:
    active: tuple[Active, ...]
    options: tuple[Option, ...]
    free: Mapping[str, int]  # devices per type
    cpus: float = math.inf
    memory: float = math.inf


def equal_share_rates(jobs: Mapping[str, Job], alone: Mapping[str, tuple[Option, ...]],
                      capacity: Mapping[str, int]) -> dict[str, float]:
    """Each job's rate on an equal share of every device type (Gavel's X^equal): every
    job gets time share f_t = capacity[t] / (sum of the jobs' min_devices) of type t, at
    its smallest size, scaled down where the f_t sum above 1."""
    demand = sum(job.min_devices for job in jobs.values()) or 1
    share = {kind: count / demand for kind, count in capacity.items()}
    total = sum(share.values())
    if total > 1:
        share = {kind: f / total for kind, f in share.items()}
    out = {}
    for name, job in jobs.items():
        on_type = {o.shape.types[0]: o.rates[0] for o in alone[name]
                   if len(o.shape.counts) == 1 and o.shape.devices == job.min_devices}
        out[name] = sum(share[kind] * on_type.get(kind, 0.0) for kind in share)
    return out


def job_rates(problem: Problem, shares: Mapping[int, float]) -> dict[str, float]:
    """Each active job's rate (steps/s) under time shares: sum_o x[o] T[m, o]."""
    out = {a.job.name: 0.0 for a in problem.active}
    for i, share in shares.items():
        option = problem.options[i]
        for job, rate in zip(option.jobs, option.rates, strict=True):
            out[job] += share * rate
    return out


def normalised_rates(problem: Problem, shares: Mapping[int, float]) -> dict[str, float]:
    """Each active job's rate over its weighted equal-share rate, rate_m / (w_m eq_m):
    what the max-min policies equalise (1: what an equal share would give it)."""
    rates = job_rates(problem, shares)
    return {a.job.name: rates[a.job.name] * _normalised(a) for a in problem.active}


Coefficients = dict[int, float]  # column -> coefficient, a sparse row


class _Program:
    """The program over time shares: columns 0..len(options)-1 are x, one per option;
    the shared rows (per job, per type, host cores and memory) are made here, a policy
    adds its own columns and rows, then `build` hands everything to MathOpt as a model
    proto at once (made term by term through MathOpt's Python expressions, a round's
    program took ten times as long to build as to solve). After `build` a policy
    changes coefficients and bounds through the model, between solves."""

    def __init__(self, problem: Problem, name: str) -> None:
        self.name = name
        self.options = len(problem.options)
        self.bounds: list[tuple[float, float]] = [(0.0, 1.0)] * self.options
        self.rows: list[tuple[float, float, Coefficients]] = []
        self.rates: dict[str, Coefficients] = {a.job.name: {} for a in problem.active}
        held: dict[str, Coefficients] = {a.job.name: {} for a in problem.active}
        per_type: dict[str, Coefficients] = {kind: {} for kind in problem.free}
        cpus: Coefficients = {}
        memory: Coefficients = {}
        for i, option in enumerate(problem.options):
            for job, rate in zip(option.jobs, option.rates, strict=True):
                held[job][i] = 1.0
                self.rates[job][i] = rate
            for kind, n in option.shape.counts:
                per_type[kind][i] = float(n)
            cpus[i], memory[i] = option.cpus, option.memory
        for row in held.values():
            self.row(row, upper=1.0)
        for kind, row in per_type.items():
            self.row(row, upper=float(problem.free[kind]))
        for row, free in ((cpus, problem.cpus), (memory, problem.memory)):
            if math.isfinite(free):  # (as fractions of what is free: bytes run to 1e11,
                # and HiGHS failed on such rows beside rates of a few steps/s)
                self.row({i: v / free for i, v in row.items()} if free > 0 else row,
                         upper=1.0 if free > 0 else 0.0)
        self.model: mathopt.Model | None = None

    def column(self, lower: float = 0.0, upper: float = math.inf) -> int:
        self.bounds.append((lower, upper))
        return len(self.bounds) - 1

    def row(self, coefficients: Coefficients, *, lower: float = -math.inf,
            upper: float = math.inf) -> int:
        self.rows.append((lower, upper, coefficients))
        return len(self.rows) - 1

    def rate(self, job: str, scale: float = 1.0) -> Coefficients:
        """The coefficients of scale * rate_m(x)."""
        return {i: rate * scale for i, rate in self.rates[job].items()}

    def build(self, objective: Coefficients) -> None:
        """The model, maximising `objective`."""
        proto = model_pb2.ModelProto(name=self.name)
        proto.variables.ids.extend(range(len(self.bounds)))
        proto.variables.lower_bounds.extend(b[0] for b in self.bounds)
        proto.variables.upper_bounds.extend(b[1] for b in self.bounds)
        proto.variables.integers.extend([False] * len(self.bounds))
        proto.linear_constraints.ids.extend(range(len(self.rows)))
        proto.linear_constraints.lower_bounds.extend(r[0] for r in self.rows)
        proto.linear_constraints.upper_bounds.extend(r[1] for r in self.rows)
        matrix = proto.linear_constraint_matrix
        for index, (_, _, coefficients) in enumerate(self.rows):
            columns = sorted(c for c, v in coefficients.items() if v != 0)
            matrix.row_ids.extend([index] * len(columns))
            matrix.column_ids.extend(columns)
            matrix.coefficients.extend(coefficients[c] for c in columns)
        proto.objective.maximize = True
        self.model = mathopt.Model.from_model_proto(proto)
        self.maximize(objective)

    def maximize(self, objective: Coefficients) -> None:
        """Set the objective, scaled so its largest coefficient is 1 (the same optimum;
        HiGHS returned inconsistent bases on min-jct's objectives, whose coefficients
        span seven orders of magnitude, unscaled)."""
        assert self.model is not None
        self.model.objective.clear()
        self.model.objective.is_maximize = True
        top = max((abs(v) for v in objective.values()), default=0.0) or 1.0
        for column, value in objective.items():
            if value != 0:
                self.model.objective.set_linear_coefficient(self.variable(column),
                                                            value / top)

    def variable(self, column: int) -> mathopt.Variable:
        assert self.model is not None
        return self.model.get_variable(column)

    def constraint(self, row: int) -> mathopt.LinearConstraint:
        assert self.model is not None
        return self.model.get_linear_constraint(row)

    def solve(self) -> mathopt.SolveResult:
        """The optimum; should HiGHS fail (its default, dual simplex, has returned a
        basis and duals MathOpt rejects on badly scaled programs), primal simplex once
        more."""
        assert self.model is not None
        try:
            result = mathopt.solve(self.model, mathopt.SolverType.HIGHS)
        except Exception:  # (ortools raises what it failed to convert: any type)
            result = mathopt.solve(self.model, mathopt.SolverType.HIGHS,
                                   params=mathopt.SolveParameters(
                                       lp_algorithm=mathopt.LPAlgorithm.PRIMAL_SIMPLEX))
        if result.termination.reason != mathopt.TerminationReason.OPTIMAL:
            raise PlannerError("internal", f"The {self.name} program ended "
                               f"{result.termination.reason.name.lower()}.")
        return result

    def shares(self, result: mathopt.SolveResult) -> dict[int, float]:
        values = result.variable_values([self.variable(i) for i in range(self.options)])
        return {i: v for i, v in enumerate(values) if v > TOLERANCE}


def _merged(*rows: Coefficients) -> Coefficients:
    out: Coefficients = {}
    for row in rows:
        for column, value in row.items():
            out[column] = out.get(column, 0.0) + value
    return out


def _runnable(problem: Problem) -> list[Active]:
    """The active jobs some option can run (the others get nothing, whatever the
    objective)."""
    held = {job for option in problem.options for job in option.jobs}
    return [a for a in problem.active if a.job.name in held and a.best > 0]


def _throughput(program: _Program, runnable: list[Active]) -> Coefficients:
    """The total normalised throughput sum_m w_m rate_m / best_m: the max-throughput
    objective, and the last step of the others, which first hold every job at what
    their objective gives it and then hand out what is left (so no device idles that a
    job could use)."""
    return _merged(*(program.rate(a.job.name, a.job.weight / a.best) for a in runnable))


def max_throughput(problem: Problem) -> dict[int, float]:
    program = _Program(problem, "max-throughput")
    program.build(_throughput(program, _runnable(problem)))
    return program.shares(program.solve())


def min_jct(problem: Problem) -> dict[int, float]:
    """Maximise sum_m w_m rate_m / left_m: each device goes to the option that
    finishes the most (weighted) work left per device-second, i.e. to the job with the
    least device-time left on it. On one machine this is Smith's rule (W. E. Smith,
    "Various optimizers for single-stage production", 1956: weighted shortest
    processing time first minimises the weighted sum of completion times) and, run
    again every round as work is done, shortest remaining processing time first; the
    program extends it to device types of different speeds, as Gavel's policies
    extend theirs, by pricing each job's rate on each option."""
    program = _Program(problem, "min-jct")
    program.build(_merged(*(program.rate(a.job.name, a.job.weight / max(a.left, TOLERANCE))
                            for a in _runnable(problem))))
    return program.shares(program.solve())


def min_makespan(problem: Problem) -> dict[int, float]:
    runnable = _runnable(problem)
    program = _Program(problem, "min-makespan")
    z = program.column()
    for a in runnable:
        program.row({**program.rate(a.job.name), z: -a.left}, lower=0.0)
    program.build({z: 1.0})
    reached = program.solve().variable_values(program.variable(z))
    program.variable(z).lower_bound = reached * (1 - TOLERANCE)
    program.maximize(_throughput(program, runnable))
    return program.shares(program.solve())


def _normalised(active: Active) -> float:
    """1 / (w eq): what a job's rate is multiplied by in the max-min objectives."""
    return 1.0 / (active.job.weight * max(active.equal, TOLERANCE))


def _level_rows(program: _Program, runnable: list[Active], level: int) -> dict[str, int]:
    """A row per job: rate_m / (w_m eq_m) - level >= 0."""
    return {a.job.name: program.row({**program.rate(a.job.name, _normalised(a)), level: -1.0},
                                    lower=0.0) for a in runnable}


def gavel_max_min(problem: Problem) -> dict[int, float]:
    """One program: maximise the least normalised rate (Gavel's LP)."""
    program = _Program(problem, "gavel")
    level = program.column()
    _level_rows(program, _runnable(problem), level)
    program.build({level: 1.0})
    return program.shares(program.solve())


def max_min_fairness(problem: Problem) -> dict[int, float]:
    """Water-filling: raise the least normalised rate; jobs whose constraint binds
    (a nonzero dual) stay at that level, the others are raised again, up to `LEVELS`
    times; then the total normalised rate is raised with every job held at its level.
    One program throughout: a job held at its level has its row's level term dropped
    and the level as its bound."""
    runnable = _runnable(problem)
    program = _Program(problem, "max-min-fairness")
    level = program.column()
    rows = _level_rows(program, runnable, level)
    program.build({level: 1.0})
    bounds = {name: program.constraint(row) for name, row in rows.items()}
    column = program.variable(level)
    reached = 0.0
    for _ in range(LEVELS):
        open_jobs = [name for name, c in bounds.items() if c.get_coefficient(column) != 0]
        if not open_jobs:
            break
        result = program.solve()
        reached = result.variable_values(column) * (1 - TOLERANCE)
        duals = result.dual_values([bounds[name] for name in open_jobs])
        binding = [name for name, dual in zip(open_jobs, duals, strict=True)
                   if abs(dual) > TOLERANCE]
        for name in binding or open_jobs:
            _hold(bounds[name], column, reached)
    for constraint in bounds.values():  # (past LEVELS: the rest stay at the last level)
        if constraint.get_coefficient(column) != 0:
            _hold(constraint, column, reached)
    program.maximize(_throughput(program, runnable))
    return program.shares(program.solve())


def _hold(constraint: mathopt.LinearConstraint, level: mathopt.Variable,
          value: float) -> None:
    constraint.set_coefficient(level, 0.0)
    constraint.lower_bound = value


def finish_time_fairness(problem: Problem) -> dict[int, float]:
    """min max rho. From a cap r that an equal share meets, each step solves
    max lambda s.t. rate_m >= lambda * need_m(r), need_m(r) = left_m / (r T_m - age_m)
    (the rate that makes rho_m = r, T_m = steps_m / eq_m); where lambda >= 1 the shares
    meet the cap, and the largest rho they give is the next, lower cap. It stops when
    the cap falls by less than `FAIRNESS_GAIN`. One program: each step sets the level's
    coefficients; at the end every job is held where the best shares put it and the
    rest is handed out."""
    runnable = [a for a in _runnable(problem) if a.equal > 0]
    if not runnable:
        return {}

    def rho(a: Active, rate: float) -> float:
        alone_time = a.job.steps / a.equal
        return (a.age + a.left / max(rate, TOLERANCE)) / alone_time

    def need(a: Active, cap: float) -> float:  # (the rate that makes rho_m = cap)
        return a.left / max(cap * a.job.steps / a.equal - a.age, TOLERANCE)

    program = _Program(problem, "finish-time-fairness")
    level = program.column()
    rows = {a.job.name: program.row({**program.rate(a.job.name), level: -1.0}, lower=0.0)
            for a in runnable}
    program.build({level: 1.0})
    bounds = {name: program.constraint(row) for name, row in rows.items()}
    column = program.variable(level)
    cap = max(rho(a, a.equal) for a in runnable)
    floors: dict[str, float] = {}  # the rates the best shares so far give each job
    for _ in range(FAIRNESS_STEPS):
        for a in runnable:
            bounds[a.job.name].set_coefficient(column, -need(a, cap))
        result = program.solve()
        reached = result.variable_values(column)
        if reached < 1 - TOLERANCE and floors:
            break
        floors = {a.job.name: min(1.0, reached) * need(a, cap) for a in runnable}
        rates = job_rates(problem, program.shares(result))
        lower = max(rho(a, rates[a.job.name]) for a in runnable)
        if lower > cap * (1 - FAIRNESS_GAIN):
            break
        cap = lower
    for a in runnable:
        _hold(bounds[a.job.name], column, floors[a.job.name] * (1 - TOLERANCE))
    program.maximize(_throughput(program, _runnable(problem)))
    return program.shares(program.solve())


@dataclass(frozen=True, kw_only=True)
class Policy:
    """A policy: its time shares (None: FIFO, which places jobs in arrival order and
    shares nothing), which options it may use, and how its shares become a round's
    placement ("cp-sat" or Gavel's "greedy", see rounding.py)."""

    name: str
    summary: str
    shares: Callable[[Problem], dict[int, float]] | None
    span: bool = True
    colocate: bool = True
    rounding: str = "cp-sat"
    baseline: bool = False


POLICIES = {p.name: p for p in (
    Policy(name="max-throughput", summary="maximum total (normalised) throughput",
           shares=max_throughput),
    Policy(name="max-min-fairness", summary="heterogeneity-aware max-min fairness "
           "(water-filling)", shares=max_min_fairness),
    Policy(name="min-jct", summary="minimum average job completion time",
           shares=min_jct),
    Policy(name="min-makespan", summary="minimum makespan", shares=min_makespan),
    Policy(name="finish-time-fairness", summary="finish-time fairness",
           shares=finish_time_fairness),
    Policy(name="gavel", summary="Gavel's max-min fairness (one type per job, no "
           "sharing, greedy rounds)", shares=gavel_max_min, span=False, colocate=False,
           rounding="greedy", baseline=True),
    Policy(name="fifo", summary="first in, first out, each job on the fastest type with "
           "room, never preempted", shares=None, span=False, colocate=False,
           rounding="fifo", baseline=True),
)}


def policy(name: str) -> Policy:
    if name not in POLICIES:
        from planner.errors import unknown_name_error

        raise unknown_name_error("bad-option", "policy", name, list(POLICIES),
                                 "planner schedule --help")
    return POLICIES[name]
