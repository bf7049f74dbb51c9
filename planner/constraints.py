"""The constraints a plan was solved with, recorded in the plan file (`Plan.constraints`)
so that a re-plan keeps to them.

    plan = dataclasses.replace(plan, constraints=recorded(options))   # planner solve
    options = solve_options(plan.constraints)                          # planner replan
    flags(plan)                                                         # "--tp 2 --max-stages 4"

`recorded` and `solve_options` are each other's inverse on what `planner solve` gives the
solver (its constraint options: limits, recompute policies, ZeRO stages, excluded
nodes), so a re-plan searches the space the first solve searched, less the nodes lost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from planner.solver import Limits, SolveOptions, Space
from planner.solver.limits import schedule_name
from planner.types import Plan
from planner.types.plan import SolveConstraints

_FREE = Limits()  # the solver's defaults, which the record leaves out
_ANY = Space()


def recorded(options: SolveOptions) -> SolveConstraints:
    """The constraints of a solve given `options` (its search settings, such as the time
    limit and the gap, are no constraints: a re-plan sets its own)."""
    limits, space = options.limits, options.space
    return SolveConstraints(
        tp=limits.tp, max_tp=limits.max_tp, tp_per_class=limits.tp_per_class, pp=limits.pp,
        dp=limits.dp, max_dp=limits.max_dp, micro_batch=limits.micro_batch,
        max_stages=None if limits.max_stages == _FREE.max_stages else limits.max_stages,
        recompute=None if set(space.policies) == set(_ANY.policies) else space.policies,
        zero=None if set(space.zeros) == set(_ANY.zeros) else space.zeros,
        exclude=tuple(options.exclude), first_stage=limits.first_stage,
        last_stage=limits.last_stage, mixed=limits.mixed,
        mixed_share_types=limits.mixed_share_types, interleave=limits.interleave,
        max_interleave=None if limits.interleaves == _FREE.interleaves
        else max(limits.interleaves), schedule=limits.schedule)


def solve_options(constraints: SolveConstraints, **settings) -> SolveOptions:
    """The solver's options that keep to `constraints`, with the search `settings`
    (`SolveOptions` fields: time_limit, top_k, ...)."""
    given = constraints
    limits = dataclasses.replace(
        _FREE, tp=given.tp, max_tp=given.max_tp, tp_per_class=given.tp_per_class, pp=given.pp,
        dp=given.dp, max_dp=given.max_dp, micro_batch=given.micro_batch, mixed=given.mixed,
        mixed_share_types=given.mixed_share_types,
        first_stage=given.first_stage, last_stage=given.last_stage,
        interleave=given.interleave, schedule=given.schedule,
        **({} if given.max_stages is None else {"max_stages": given.max_stages}),
        **({} if given.max_interleave is None else {
            "interleaves": tuple(range(1, given.max_interleave + 1))}))
    space = dataclasses.replace(
        _ANY, **({} if given.recompute is None else {"policies": given.recompute}),
        **({} if given.zero is None else {"zeros": given.zero}))
    return SolveOptions(limits=limits, space=space, exclude=given.exclude, **settings)


def without_nodes(constraints: SolveConstraints, gone: Collection[str]) -> SolveConstraints:
    """`constraints` less the --exclude of nodes that are `gone` (a re-plan's cluster
    has no such node to leave out)."""
    return dataclasses.replace(constraints, exclude=tuple(
        name for name in constraints.exclude if name not in gone))


def dropped(constraints: SolveConstraints, gone: Collection[str]) -> tuple[str, ...]:
    """The excluded nodes `without_nodes` drops, in the record's order."""
    return tuple(name for name in constraints.exclude if name in gone)


def flags(constraints: SolveConstraints | None) -> str:
    """The constraint options as `planner solve` takes them, e.g. "--tp 2 --max-stages
    4" ("" where none were given or recorded)."""
    given = constraints or SolveConstraints()
    words: list[str] = []
    for name in ("tp", "max_tp", "pp", "dp", "max_dp", "micro_batch", "max_stages",
                 "interleave", "max_interleave", "first_stage", "last_stage"):
        value = getattr(given, name)
        if value is not None:
            words.append(f"--{name.replace('_', '-')} {value}")
    if given.schedule is not None:
        words.append(f"--schedule {schedule_name(given.schedule)}")
    if given.recompute is not None:
        words.append(f"--recompute {','.join(p.value for p in given.recompute)}")
    if given.zero is not None:
        words.append(f"--zero {','.join(map(str, given.zero))}")
    words += [f"--exclude {name}" for name in given.exclude]
    words += ["--tp-per-class"] if given.tp_per_class else []
    words += ["--no-mixed"] if not given.mixed else []
    words += ["--mixed-share-types"] if given.mixed_share_types else []
    return " ".join(words)


def solved_with(plan: Plan) -> str:
    """`flags` of the plan's constraints and its gradient sync where not the default
    (the training keeps that), e.g. "--tp 2 --sync local-sgd:8"."""
    sync = plan.training.sync
    words = [flags(plan.constraints)]
    words += [f"--sync {sync.describe()}"] if sync.local else []
    words += ["--overlap-sync"] if sync.overlap and not sync.local else []
    return " ".join(word for word in words if word)
