"""The CP-SAT assignment model beside the branch and bound (`planner/solver/assign.py`,
issue 53): its bound holds for every structure, its loop equals brute force over the
same space (structures of several classes without ZeRO, 1F1B), and a loop cut short
reports an honest bound."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from planner.solver.assign import assign_search, done_by, least_step, relax, structure_at
from planner.solver.evaluate import Space
from planner.solver.limits import Limits
from planner.solver.search import configs, search
from planner.types import Schedule
from tests.solver_tables import GIB, brute_force, every_structure, random_instance, random_table

SPACE = Space(zeros=(0,))


def _one_f_one_b(limits: Limits) -> Limits:
    return dataclasses.replace(limits, schedule=Schedule.ONE_F_ONE_B, interleaves=(1,))


def _instances():
    """Random instances of up to three types that have plans, and four single-GPU types
    (where two mixed classes win)."""
    for seed in (0, 1, 3, 5, 7, 9):
        table, batch, limits = random_instance(random.Random(seed))
        yield table, batch, _one_f_one_b(limits)
    table = random_table(2, layers=4, types=[("a", [1]), ("b", [1]), ("c", [1]), ("d", [1])],
                         memory=4 * GIB, link_speed=10.0)
    yield table, 4, _one_f_one_b(Limits(max_stages=2))


@pytest.mark.parametrize("instance", range(7))
def test_every_structure_meets_the_model_at_its_own_step(instance):
    """The model relaxes the space: every structure, at its exact step, satisfies the
    constraints (its classes' pipelines finish the batch by then, as `done_by` counts),
    so no structure is faster than the least step the model allows."""
    table, batch, limits = list(_instances())[instance]
    relaxed = {c: relax(table, c, limits, SPACE, batch // c.mb)
               for c in configs(table, batch, limits)}
    checked: dict = {}
    for config, shapes, value in every_structure(table, batch, limits, SPACE):
        if not np.isfinite(value):
            continue
        model = relaxed[config]
        index = {(f.types, f.tps): i for i, f in enumerate(model.families)}
        counts = {index[(s.types, s.tps)]: s.n for s in shapes}
        done = done_by(model, value * (1 + 1e-9), batch // config.mb)
        assert sum(done[f] * n for f, n in counts.items()) >= batch // config.mb
        checked[config] = checked.get(config, 0) + 1
        if checked[config] <= 3:  # (CP-SAT on a few: each takes a bisection)
            assert structure_at(model, value * (1 + 1e-9), table, limits,
                                batch // config.mb) is not None
            least_step(model, table, limits, batch // config.mb, value * (1 + 1e-9))
            assert model.bound <= value * (1 + 1e-9)
            model.bound = 0.0
    assert checked


# Fixed seeds, not hypothesis: the loop excludes one priced structure per iteration, so on
# some instances (seeds 611178002 and 846885253 of `random_instance`) it runs for minutes
# before it proves its plan optimal; a random draw of those would stall the suite.
@pytest.mark.parametrize("seed", [1, 3, 4, 5, 7, 8, 9, 10])
def test_the_cpsat_loop_equals_brute_force(seed):
    table, batch, limits = random_instance(random.Random(seed))
    limits = _one_f_one_b(limits)
    expected = brute_force(table, batch, limits, SPACE)
    if not np.isfinite(expected):
        return
    found = assign_search(table, batch, limits=limits, space=SPACE)
    assert found.status == "optimal"
    assert found.best[0].step_time == pytest.approx(expected, rel=1e-9)
    assert found.bound <= expected * (1 + 1e-9)


def test_the_cpsat_loop_finds_two_mixed_classes_where_they_win():
    table, batch, limits = list(_instances())[-1]
    found = assign_search(table, batch, limits=limits, space=SPACE)
    assert found.best[0].step_time == pytest.approx(
        search(table, batch, limits=limits, space=SPACE).best[0].step_time, rel=1e-9)
    assert sum(len(set(s.types)) > 1 for s in found.best[0].shapes) == 2


def test_a_priced_structure_is_never_returned_again():
    table, batch, limits = list(_instances())[-1]
    config = configs(table, batch, limits)[0]
    model = relax(table, config, limits, SPACE, batch // config.mb)
    step = 1e9
    first = structure_at(model, step, table, limits, batch // config.mb)
    model.priced.append(first)
    second = structure_at(model, step, table, limits, batch // config.mb)
    assert second is not None and second != first


@pytest.mark.parametrize("seed", [0, 5, 12])
def test_a_loop_cut_short_keeps_its_bound_honest(seed):
    """With no time at all, the loop stops at its first plan: "feasible", its bound the
    least of the configurations' model bounds, below every structure."""
    table, batch, limits = random_instance(random.Random(seed))
    limits = _one_f_one_b(limits)
    expected = brute_force(table, batch, limits, SPACE)
    found = assign_search(table, batch, limits=limits, space=SPACE, time_limit=0.0)
    assert found.bound <= expected * (1 + 1e-9)
    assert found.best[0].step_time >= expected * (1 - 1e-9)
    assert found.status in ("feasible", "optimal")
