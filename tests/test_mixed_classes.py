"""Several mixed pipeline classes (issue 53): a plan may hold up to `Limits.mixed_classes`
mixed classes over disjoint sets of device types (two pairs of nodes of different speeds
run as two two-node classes, not one four-node one), each a level of the search, and with
`Limits.mixed_share_types` (--mixed-share-types) on any types. The search equals brute
force over either space, its bounds hold there, and it says in its report how many mixed
classes it allows and whether two may share a type."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.solver.evaluate import Space
from planner.solver.families import mixed_levels
from planner.solver.limits import Limits
from planner.solver.search import search
from tests.solver_tables import GIB, every_structure, random_table
from tests.test_solver_search import (
    _check_subtree_bounds,
    assert_equals_brute_force,
    check_both_parts_subtree_bounds,
)


def _instance(rng: random.Random):
    """Four or five types on at most 7 devices, pipelines of two or three stages: pairs
    of two-type classes fit beside each other."""
    kinds = rng.randint(4, 5)
    while True:
        types = [(f"t{i}", [rng.randint(1, 2) for _ in range(rng.randint(1, 2))])
                 for i in range(kinds)]
        if sum(sum(devices) for _, devices in types) <= 7:
            break
    table = random_table(rng.randrange(10**6), layers=rng.randint(3, 4), types=types,
                         memory=rng.choice([2, 4, 8]) * GIB,
                         link_speed=rng.choice([0.1, 1.0, 10.0]))
    return table, rng.choice([2, 4]), Limits(max_stages=rng.choice([2, 3]))


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_search_equals_brute_force_over_several_mixed_classes(seed):
    assert_equals_brute_force(*_instance(random.Random(seed)), Space(zeros=(0,)))


@pytest.mark.slow  # seconds to a minute a run: `pytest -m slow` (CI) runs it
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_search_equals_brute_force_over_several_mixed_classes_with_zero(seed):
    assert_equals_brute_force(*_instance(random.Random(seed)))


def _four_single_gpus(seed: int):
    """Four types, one device each: the classes' sync is cheap next to their work."""
    table = random_table(seed, layers=4, types=[("a", [1]), ("b", [1]), ("c", [1]),
                                                ("d", [1])],
                         memory=4 * GIB, link_speed=10.0)
    return table, 4, Space(zeros=(0,))


@pytest.mark.parametrize("seed", [1, 2, 7, 25, 29])
def test_two_mixed_classes_win_on_these_instances(seed):
    """Instances where the best plan is two two-type classes on disjoint pairs of types,
    faster than any plan of one mixed class: the brute force above would pass without
    them in the space on instances where none wins."""
    table, batch, space = _four_single_gpus(seed)
    limits = Limits(max_stages=2)
    best = search(table, batch, limits=limits, space=space).best[0]
    assert_equals_brute_force(table, batch, limits, space)
    assert sum(len(set(shape.types)) > 1 for shape in best.shapes) == 2, best.shapes
    one = search(table, batch, limits=Limits(max_stages=2, mixed_classes=1), space=space)
    assert best.step_time < one.best[0].step_time * (1 - 1e-6)


@pytest.mark.slow  # seconds to a minute a run: `pytest -m slow` (CI) runs it
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_every_node_bound_is_below_every_structure_of_its_subtree_over_mixed_classes(seed):
    """`test_every_node_bound_is_below_every_structure_in_its_subtree` where two mixed
    levels are open at the root and one below each node that fixes a mixed class and
    must add another."""
    table, batch, limits = _instance(random.Random(seed))
    check_both_parts_subtree_bounds(table, batch, limits, seed)


def test_node_bounds_hold_where_two_mixed_classes_win():
    """The same on an instance whose best plan has two mixed classes (quick)."""
    table, batch, space = _four_single_gpus(2)
    limits = Limits(max_stages=2)
    values = list(every_structure(table, batch, limits, space))
    assert any(sum(len(set(s.types)) > 1 for s in shapes) == 2 for _, shapes, _ in values)
    _check_subtree_bounds(table, batch, limits, False, values, random.Random(2))


@pytest.mark.parametrize(("kinds", "mixed", "most", "expected"), [
    (1, True, 2, 0), (2, True, 2, 1), (3, True, 2, 1), (4, True, 2, 2), (5, True, 2, 2),
    (8, True, 2, 2), (8, True, 3, 3), (6, True, 3, 3), (4, True, 1, 1), (4, False, 2, 0)])
def test_a_plan_holds_a_mixed_class_per_two_types_up_to_the_limit(kinds, mixed, most,
                                                                  expected):
    table = random_table(0, layers=3, types=[(f"t{i}", [1]) for i in range(kinds)])
    assert mixed_levels(table, Limits(mixed=mixed, mixed_classes=most)) == expected
    # mixed classes that may share types: up to the limit on two types or more
    assert mixed_levels(table, Limits(mixed=mixed, mixed_classes=most,
                                      mixed_share_types=True)) == (
        most if mixed and kinds > 1 else 0)


def test_the_search_says_how_many_mixed_classes_it_allows():
    table, batch, space = _four_single_gpus(2)
    found = search(table, batch, limits=Limits(max_stages=2), space=space).space
    assert found.startswith("up to 2 mixed pipeline classes over disjoint sets of device "
                            "types (a cut for speed: two that share a type are left out, "
                            "--mixed-share-types searches them;")
    found = search(table, batch, limits=Limits(max_stages=2, mixed_share_types=True),
                   space=space).space
    assert found.startswith("up to 2 mixed pipeline classes on any device types (their ")
    assert "cut for speed" not in found
    three = random_table(0, layers=3, types=[("a", [1]), ("b", [1]), ("c", [1])])
    found = search(three, 2, limits=Limits(max_stages=2), space=space).space
    assert found.startswith("one optional mixed pipeline class (a cut for speed: a second "
                            "would share a device type with it, --mixed-share-types "
                            "searches it;")
    found = search(three, 2, limits=Limits(max_stages=2, mixed_classes=1), space=space).space
    assert found.startswith("one optional mixed pipeline class (its pipelines chain")
    found = search(three, 2, limits=Limits(max_stages=2, mixed_share_types=True),
                   space=space).space
    assert found.startswith("up to 2 mixed pipeline classes on any device types")
    found = search(table, batch, limits=Limits(max_stages=2, mixed=False), space=space).space
    assert found.startswith("no mixed pipeline class")


def test_one_mixed_class_where_pairs_would_be_too_many(monkeypatch):
    """Beyond `MIXED_PAIRS` pairs of mixed families on disjoint types, a configuration
    holds one mixed class, and the search says where."""
    import planner.solver.families as module

    table, batch, space = _four_single_gpus(2)
    limits = Limits(max_stages=2)
    monkeypatch.setattr(module, "MIXED_PAIRS", 0)
    cut = search(table, batch, limits=limits, space=space)
    assert sum(len(set(shape.types)) > 1 for shape in cut.best[0].shapes) == 1
    assert cut.best[0].step_time == pytest.approx(search(
        table, batch, limits=Limits(max_stages=2, mixed_classes=1), space=space
    ).best[0].step_time, rel=1e-12)
    assert ("cut for speed to one where a configuration's mixed patterns make more than 0 "
            "pairs on disjoint types: at tp 1),") in cut.space
    monkeypatch.setattr(module, "MIXED_PAIRS", 10**6)
    assert "pairs on disjoint types" not in search(table, batch, limits=limits,
                                                   space=space).space


def _shared_types(seed: int):
    """Two devices of one type and one each of two others, pipelines of two stages:
    two mixed classes that share the first type (a -> b and a -> c, say) use every
    device, which no plan of mixed classes on disjoint types does where the model fits
    no device alone."""
    rng = random.Random(seed)
    table = random_table(seed, layers=rng.randint(3, 4),
                         types=[("a", [2]), ("b", [1]), ("c", [1])],
                         memory=rng.choice([2, 4]) * GIB, link_speed=rng.choice([1.0, 10.0]))
    return table, 4, Limits(max_stages=2, mixed_share_types=True)


@pytest.mark.parametrize("seed", [4, 6, 10, 20, 56])
def test_two_mixed_classes_that_share_a_type_win_on_these_instances(seed):
    """Instances where the best plan is two mixed classes sharing a type, faster than
    every plan of mixed classes on disjoint types (the search without the option): with
    --mixed-share-types the search finds it and equals brute force over that space."""
    table, batch, limits = _shared_types(seed)
    space = Space(zeros=(0,))
    best = search(table, batch, limits=limits, space=space).best[0]
    assert_equals_brute_force(table, batch, limits, space)
    mixed = [set(shape.types) for shape in best.shapes if len(set(shape.types)) > 1]
    assert len(mixed) == 2 and mixed[0] & mixed[1], best.shapes
    apart = search(table, batch, limits=Limits(max_stages=2), space=space).best[0]
    assert best.step_time < apart.step_time * (1 - 1e-6)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_search_equals_brute_force_where_mixed_classes_share_types(seed):
    assert_equals_brute_force(*_shared_types(seed), Space(zeros=(0,)))


@pytest.mark.slow  # seconds to a minute a run: `pytest -m slow` (CI) runs it
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_search_equals_brute_force_over_mixed_classes_sharing_types_with_zero(seed):
    """The same with every ZeRO stage allowed."""
    assert_equals_brute_force(*_shared_types(seed))


@pytest.mark.slow  # seconds to a minute a run: `pytest -m slow` (CI) runs it
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_every_node_bound_is_below_every_structure_of_its_subtree_sharing_types(seed):
    """The generic floor test with --mixed-share-types: two mixed levels open at the
    root on any types, and one below each node that fixes a mixed class, on any too."""
    table, batch, limits = _shared_types(seed)
    check_both_parts_subtree_bounds(table, batch, limits, seed)


def test_node_bounds_hold_where_mixed_classes_that_share_a_type_win():
    """The same on an instance whose best plan has two mixed classes sharing a type."""
    table, batch, limits = _shared_types(4)
    space = Space(zeros=(0,))
    values = list(every_structure(table, batch, limits, space))
    assert any(len([s for s in shapes if len(set(s.types)) > 1]) == 2
               and len({k for s in shapes for k in s.types}) < sum(
                   len(set(s.types)) for s in shapes) for _, shapes, _ in values)
    _check_subtree_bounds(table, batch, limits, False, values, random.Random(4))


def test_solve_searches_mixed_classes_sharing_types_when_asked(tmp_path):
    """`planner solve --mixed-share-types`: the plan file records it (a re-plan keeps to
    it, and `constraints.flags` gives it back) and the search space it reports has no cut
    on shared types; without it, the report's cut names the option."""
    from typer.testing import CliRunner

    from cli.main import app
    from planner.constraints import flags, recorded, solve_options
    from planner.planfile import read_plan
    from planner.solver import SolveOptions

    solve = ["solve", "gpt-tiny", "-c", "1x2xA100-80G,1x1xV100-32G,1x1xRTX4090", "-B", "8",
             "--time-limit", "30"]
    for option, name in ((["--mixed-share-types"], "shared.json"), ([], "apart.json")):
        result = CliRunner().invoke(app, [*solve, *option, "-o", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
    shared, apart = (read_plan(tmp_path / name) for name in ("shared.json", "apart.json"))
    assert shared.constraints.mixed_share_types and not apart.constraints.mixed_share_types
    assert flags(shared.constraints) == "--mixed-share-types"
    assert "on any device types" in shared.solver.search_space
    assert "cut for speed: a second would share" not in shared.solver.search_space
    assert "--mixed-share-types searches it" in apart.solver.search_space
    assert shared.prediction.step_time <= apart.prediction.step_time * (1 + 1e-9)
    options = SolveOptions(limits=Limits(mixed_share_types=True))
    assert solve_options(recorded(options)) == options
