"""The search against brute force over the same space, and properties of its plans."""

import dataclasses
import importlib
import itertools
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cost_models.comm import Collective, CommGroup
from planner.errors import PlannerError
from planner.solver.evaluate import Space, price, refine
from planner.solver.limits import Limits
from planner.solver.partition import (
    _enumerated_front,
    _walked_front,
    class_costs,
    gpipe_front,
)
from planner.solver.search import search
from planner.solver.timing import pipeline_time
from planner.types import LinkSpec, Schedule
from planner.types.training import Recompute
from tests.solver_tables import (
    GIB,
    brute_force,
    every_structure,
    random_instance,
    random_table,
    structures,
    with_extra_node,
)


def best_or_none(table, batch, limits, space=None):
    try:
        return search(table, batch, limits=limits, space=space).best[0]
    except PlannerError:
        return None


def best_or_inf(table, batch, limits, space=None):
    best = best_or_none(table, batch, limits, space)
    return best.step_time if best else float("inf")


def assert_equals_brute_force(table, batch, limits, space=None):
    """The search's best plan is brute force's, and it obeys the limits' stage pins."""
    expected = brute_force(table, batch, limits, space or Space())
    best = best_or_none(table, batch, limits, space)
    got = best.step_time if best else float("inf")
    assert got == pytest.approx(expected, rel=1e-9) or got == expected == float("inf")
    assert best is None or all(limits.allows(shape.types) for shape in best.shapes)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_search_equals_brute_force(seed):
    assert_equals_brute_force(*random_instance(random.Random(seed)))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_search_equals_brute_force_with_fixed_choices(seed):
    rng = random.Random(seed)
    table, batch, _ = random_instance(rng)
    space = Space(policies=(rng.choice(list(Space().policies)),), zeros=(rng.choice([0, 3]),))
    limits = Limits(max_stages=3, pp=rng.choice([None, 2]), mixed=rng.random() < 0.5)
    assert_equals_brute_force(table, batch, limits, space)


@pytest.mark.slow  # seconds to a minute a run: `pytest -m slow` (CI) runs it
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_search_equals_brute_force_tp_per_class(seed):
    """Each class at a tensor-parallel degree of its own (random instances mostly have
    one degree): two or three types on nodes where tp 1 and 2 both fit, the smaller
    types' memory often needing tp 2 while the larger run tp 1."""
    assert_equals_brute_force(*_tp_per_class_instance(random.Random(seed)))


def _tp_per_class_instance(rng):
    types = [(f"t{i}", [rng.choice([2, 4]) for _ in range(rng.randint(1, 2))])
             for i in range(rng.randint(2, 3))]
    table = random_table(rng.randrange(10**6), layers=rng.randint(2, 4), types=types,
                         tps=(1, 2), memory=rng.choice([4, 8, 16]) * GIB,
                         link_speed=rng.choice([1.0, 10.0]))
    return table, rng.choice([4, 6]), Limits(max_stages=2, tp_per_class=True)


def test_classes_of_different_degrees_beat_one_degree():
    """On this instance the best plan runs t0's pipelines at tp 1 beside t1's at tp 2,
    faster than any plan of one degree."""
    table, batch, limits = _tp_per_class_instance(random.Random(14))
    best = best_or_none(table, batch, limits, None)
    assert sorted((s.types[0], s.tps) for s in best.shapes) == [("t0", (1,)), ("t1", (2,))]
    same = best_or_none(table, batch, dataclasses.replace(limits, tp_per_class=False), None)
    assert best.step_time < same.step_time * 0.999


def test_a_mixed_class_whose_blocks_differ_in_degree_beats_one_degree_per_class():
    """On this instance the best plan's mixed class runs its t2 block at tp 1 and its
    t0 block at tp 2 (whose first ranks broadcast each input to their second): 10%
    faster than any structure whose classes each keep one degree (brute force)."""
    table, batch, limits = _tp_per_class_instance(random.Random(13))
    best = best_or_none(table, batch, limits, None)
    mixed = next(s for s in best.shapes if len(set(s.types)) > 1)
    assert (mixed.types, mixed.tps) == (("t2", "t0"), (1, 2))
    uniform = min(value for _, shapes, value in every_structure(table, batch, limits, Space())
                  if all(len(set(s.tps)) == 1 for s in shapes))
    assert best.step_time < uniform * 0.95


def test_a_wider_stage_pays_the_broadcasts_of_its_inputs_and_output_gradients():
    """A stage wider than the one before it broadcasts each forward's input among its
    ranks, and one wider than the one after it each backward's output gradient: on the
    boundary's bytes, in the stage's busy time and its split's timings."""
    table = random_table(3, layers=4, types=[("a", [2]), ("b", [2])], tps=(1, 2))
    links = [LinkSpec(name="l", bandwidth=1e9, latency=1e-5)] * 2
    args = dict(mb=1, n=1, links=links, gathers=[(0.0, 0.0)] * 3,
                schedule=Schedule.ONE_F_ONE_B, policies=(Recompute.NONE,), zeros=(0,))
    plain = class_costs(table, ("a", "b", "b"), tps=(1, 1, 1), **args)
    wide = class_costs(table, ("a", "b", "b"), tps=(1, 2, 2), **args)
    narrow = class_costs(table, ("a", "b", "b"), tps=(2, 1, 1), **args)
    bounds = (0, 1, 3, 4)

    def broadcast(kind, tp, layer):
        group = CommGroup(((table.type(kind).nodes[0], tp),))
        return table.collective(Collective.BROADCAST, float(table.boundary[layer]), group)

    lead_in = broadcast("b", 2, 0)  # (layer 0's output enters the wider stage 1)
    lead_out = broadcast("a", 2, 0)  # (its gradient leaves the wider stage 0)
    assert lead_in > 0 and lead_out > 0
    alone = class_costs(table, ("b", "b"), tps=(2, 2), **{**args, "links": links[:1],
                                                          "gathers": [(0.0, 0.0)] * 2})
    assert wide.busy[1][1, 3] == pytest.approx(alone.busy[0][1, 3] + lead_in)
    assert wide.busy[2][3, 4] == pytest.approx(alone.busy[1][3, 4])  # (as wide as before)
    split = wide.split_at(bounds)
    assert split.stages[1].fwd == pytest.approx(
        float(alone.parts[0]["fwd"][3] - alone.parts[0]["fwd"][1]) + lead_in)
    first = class_costs(table, ("a",), tps=(2,), **{**args, "links": [],
                                                   "gathers": [(0.0, 0.0)]})
    assert narrow.busy[0][0, 1] == pytest.approx(first.busy[0][0, 1] + lead_out)
    assert narrow.split_at(bounds).stages[0].bwd == pytest.approx(
        first.split_at((0, 1)).stages[0].bwd + lead_out)
    assert split.stages[1].tp_fwd == pytest.approx(  # (tensor-parallel communication)
        float(alone.parts[0]["tp_fwd"][3] - alone.parts[0]["tp_fwd"][1]) + lead_in)
    assert plain.split_at(bounds).stages[1].tp_fwd == 0.0


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_search_equals_brute_force_interleaved(seed):
    """Two chunks per device only: every round cut alike, ZeRO in structures of one
    class (each chunk gathering its own weights on ZeRO-3), pipelines of several
    stages running whole multiples of their stages (random instances rarely pick it
    when plain 1F1B may compete)."""
    table, batch, limits = random_instance(random.Random(seed))
    if table.num_layers % 2:
        table = random_table(seed, layers=table.num_layers + 1,
                             types=[(t.name, list(t.node_devices)) for t in table.types])
    assert_equals_brute_force(table, batch, dataclasses.replace(limits, interleave=2))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_search_equals_brute_force_gpipe(seed):
    """GPipe alone: structures of one class of several stages, each holding all its
    micro-batches, on its staircase of (period, fill) (random instances rarely pick it
    where 1F1B competes)."""
    table, batch, limits = random_instance(random.Random(seed))
    assert_equals_brute_force(table, batch, dataclasses.replace(
        limits, schedule=Schedule.GPIPE, interleaves=(1,)))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_gpipe_front_is_every_split_no_other_beats(seed):
    """GPipe's staircase (`partition.gpipe_front`, both ways of finding it) against
    every split of a random class: the splits no other beats in both period and fill,
    by period, those below a limit where one is given."""
    rng = random.Random(seed)
    types = [(f"t{i}", [rng.randint(1, 2)]) for i in range(rng.randint(1, 2))]
    table = random_table(rng.randrange(10**6), layers=rng.randint(3, 7), types=types,
                         link_speed=rng.choice([0.01, 0.1, 1.0]))
    stages = tuple(rng.choice([t for t, _ in types]) for _ in range(rng.randint(2, 4)))
    stages = tuple(sorted(stages))  # a block per type
    if len(stages) > table.num_layers:
        return
    links = [LinkSpec(name="l", bandwidth=rng.choice([1e6, 1e8, 1e10]), latency=1e-5)
             for _ in stages[1:]]
    costs = class_costs(table, stages, tps=(1,) * len(stages), mb=1, n=1, links=links,
                        gathers=[(0.0, 0.0)] * len(stages), schedule=Schedule.GPIPE,
                        policies=tuple(Recompute), zeros=(0,), microbatches=rng.randint(1, 4))
    splits = [s for cuts in itertools.combinations(range(1, table.num_layers), len(stages) - 1)
              if (s := costs.split_at((0, *cuts, table.num_layers))) is not None]
    expected = sorted({(round(x.bottleneck, 12), round(x.weights, 12)) for x in splits
                       if not any((y.bottleneck <= x.bottleneck and y.weights < x.weights)
                                  or (y.bottleneck < x.bottleneck and y.weights <= x.weights)
                                  for y in splits)})
    phi, beta = costs.phi_beta()
    fill = [costs.h_w(s)[1] for s in range(costs.stages)]
    for front in (_walked_front, _enumerated_front):  # (gpipe_front picks one by size and limit)
        got = [(round(x.bottleneck, 12), round(x.weights, 12))
               for x in front(costs, phi, beta, fill, float("inf"))]
        assert got == expected, front.__name__
    if expected:  # (nothing may fit)
        limit = expected[len(expected) // 2][0] - 1e-9  # (between two of its periods)
        assert [(round(x.bottleneck, 12), round(x.weights, 12))
                for x in gpipe_front(costs, limit)] == [p for p in expected if p[0] < limit]
    for split in splits:  # the period is GPipe's (timing.py)
        assert split.bottleneck == pytest.approx(pipeline_time(
            split.stages, 1, schedule=Schedule.GPIPE).period)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
@example(64192)  # GPipe: a split of its front off the (largest stage, total) staircase
def test_search_equals_brute_force_with_few_pipelines(seed):
    """--dp fixes the number of pipelines side by side, --max-dp bounds it."""
    rng = random.Random(seed)
    table, batch, limits = random_instance(rng)
    fixed = rng.random() < 0.5
    count = rng.randint(1, 3)
    limits = dataclasses.replace(limits, dp=count if fixed else None,
                                 max_dp=None if fixed else count)
    assert_equals_brute_force(table, batch, limits)
    best = best_or_none(table, batch, limits)
    assert best is None or (sum(s.n for s in best.shapes) == count if fixed
                            else sum(s.n for s in best.shapes) <= count)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_search_equals_brute_force_with_pinned_stages(seed):
    rng = random.Random(seed)
    table, batch, limits = random_instance(rng)
    names = [t.name for t in table.types]
    assert_equals_brute_force(table, batch, dataclasses.replace(
        limits, first_stage=rng.choice([None, *names]), last_stage=rng.choice([None, *names])))


@pytest.mark.slow  # seconds to a minute a run: `pytest -m slow` (CI) runs it
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
@example(581)  # a step that cannot win whose later steps can
def test_refine_keeps_every_staircase_step_that_can_beat_the_bar(seed):
    """refine walks each class's staircase only as far as a step may still beat the bar;
    it finds every structure's brute-force best, or None when that does not beat it."""
    rng = random.Random(seed)
    table, batch, limits = random_instance(rng)
    for config, shapes, expected in every_structure(table, batch, limits, Space()):
        priced = price(table, config, Space(), shapes, batch // config.mb)
        if priced is None:
            assert expected == float("inf")
            continue
        bar = expected * rng.choice([float("inf"), 1.02, 1.0, 0.99])
        got, skipped = refine(table, priced, batch // config.mb, bar)
        assert skipped == float("inf")  # (no gap: nothing left out for it)
        if expected < bar:
            assert got is not None and got.step_time == pytest.approx(expected, rel=1e-9)
        else:
            assert got is None or got.step_time < bar


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9), st.integers(1, 3))
def test_adding_devices_never_makes_the_best_plan_slower(seed, devices):
    table, batch, limits = random_instance(random.Random(seed))
    before = best_or_inf(table, batch, limits)
    kind = random.Random(seed + 1).choice(table.types).name
    after = best_or_inf(with_extra_node(table, kind, devices), batch, limits)
    assert after <= before * (1 + 1e-12)


def test_top_k_plans_are_distinct_and_ordered():
    table = random_table(3, layers=4, types=[("a", [2]), ("b", [2])])
    result = search(table, 4, limits=Limits(max_stages=2), top_k=3)
    times = [e.step_time for e in result.best]
    assert times == sorted(times) and len(times) == 3
    keys = {(e.config, e.shapes) for e in result.best}
    assert len(keys) == 3


@pytest.mark.parametrize("seed", [1, 4, 13, 15, 18])
def test_a_structure_the_zero_free_part_prices_first_keeps_its_zero_pricing(seed, monkeypatch):
    """Both parts of the search (`search._parts`) price a leaf with the same, full space
    (`_Search.pricing`; only their bounds are ZeRO-free), and `_leaf` skips a structure
    already among the best plans. On these instances the best plan is one class with a
    ZeRO stage, priced first in the ZeRO-free part: were that part to price it without
    ZeRO, the ZeRO pricing of the other part would be skipped as a copy and the search
    would return a plan 0.6-7.3% slower than brute force (checked by pricing with
    `_Search.space` there)."""
    search_module = importlib.import_module("planner.solver.search")
    table, batch, limits = random_instance(random.Random(seed))
    parts = []  # per structure priced, whether in the part of one class
    pricing = search_module._Search.price

    def recording(part, node):
        parts.append((part.single, node.config, search_module._shapes(node)))
        return pricing(part, node)

    monkeypatch.setattr(search_module._Search, "price", recording)
    best = search(table, batch, limits=limits).best[0]
    assert best.step_time == pytest.approx(brute_force(table, batch, limits, Space()),
                                           rel=1e-9)
    assert len(best.shapes) == 1
    assert any(option.zero for split in best.splits for option in split.options)
    first = next(single for single, config, shapes in parts
                 if (config, shapes) == (best.config, best.shapes))
    assert not first  # (the case this test is about: else pick other seeds)


def test_two_speed_data_parallel_split_matches_closed_form():
    """Two replicas of speeds t1, t2 per micro-batch: the best integer split of M
    micro-batches minimises max(m1 t1, m2 t2) with m1 + m2 = M."""
    table = random_table(7, layers=1, types=[("fast", [1]), ("slow", [1])])
    m = 12
    result = search(table, m, limits=Limits(pp=1, mixed=False))
    best = result.best[0]
    assert sum(c for counts in best.microbatches for c in counts) == m
    times = {shape.types[0]: split.time(1) for shape, split in zip(best.shapes, best.splits,
                                                                    strict=True)}
    if len(best.shapes) == 2:
        t1, t2 = times["fast"], times["slow"]
        closed = min(max(k * t1, (m - k) * t2) for k in range(1, m))
        assert max(max(t) for t in best.pipeline_times) == pytest.approx(closed)
        fast = dict(zip([s.types[0] for s in best.shapes], best.microbatches, strict=True))
        assert fast["fast"][0] >= fast["slow"][0]


def test_gap_tolerance_reports_an_honest_bound():
    table = random_table(11, layers=5, types=[("a", [2, 2]), ("b", [3])])
    exact = search(table, 6, limits=Limits(max_stages=3))
    loose = search(table, 6, limits=Limits(max_stages=3), gap=0.05)
    assert loose.bound <= exact.best[0].step_time * (1 + 1e-12)
    assert loose.best[0].step_time <= exact.best[0].step_time / (1 - 0.05) * (1 + 1e-12)


def test_time_limit_returns_a_feasible_plan_and_a_bound():
    table = random_table(5, layers=5, types=[("a", [3, 3]), ("b", [3, 3]), ("c", [2])])
    result = search(table, 6, limits=Limits(max_stages=4), time_limit=0.0)
    assert result.best and result.bound <= result.best[0].step_time
    assert result.status in ("feasible", "optimal")


def test_children_are_bounded_a_chunk_at_a_time_until_the_deadline(monkeypatch):
    """`_Search.many` bounds a node's children `_MANY_ROWS` at a time, as one
    `Bound.many` call would (rows are bounded apart); past the deadline with a plan in
    hand, the rows left keep the node's own bound and base, which hold for its subtree
    (with --mixed-share-types one root's children took 56 s, past the time limit)."""
    from planner.solver.search import _Search

    module = importlib.import_module("planner.solver.search")  # (its name: the function)
    table = random_table(5, layers=5, types=[("a", [3, 3]), ("b", [3, 3]), ("c", [2])])
    limits = Limits(max_stages=4)
    run = _Search(table, 6, limits, Space(), 1, 0.0, False, [], itertools.count())
    node = min(run.heap)
    rows = run.options(node)[1:]
    open_levels = range(0, len(run.state[node.config].levels))
    assert len(rows) > 4
    whole = run.state[node.config].bound.many(
        [], rows, open_levels, True, (node.bound, node.base),
        run.row_fits(node, rows, open_levels, True))
    monkeypatch.setattr(module, "_MANY_ROWS", 2)
    chunked = run.many(node, [], rows, open_levels, True)
    assert np.allclose(chunked, whole, rtol=1e-12)
    run.best.append(search(table, 6, limits=limits).best[0])
    run.deadline = 0.0
    late = run.many(node, [], rows, open_levels, True)
    assert np.all(late[0] == node.bound) and np.all(late[1] == node.base)


def test_configurations_past_the_deadline_wait_at_the_floor_until_taken():
    """Past its deadline the search stops setting configurations up (their families are
    much of a big search's set-up): the seeds' are set up first, the others wait in the
    queue at `bounds.lower_bound`, which no plan beats, and are set up when the search
    takes them; without a deadline none waits. A search with a time limit of 0 returns
    its seed's plan with a bound that holds."""
    from planner.solver.bounds import lower_bound
    from planner.solver.search import _WAITING, _Search, configs

    table = random_table(5, layers=5, types=[("a", [3, 3]), ("b", [3, 3]), ("c", [2])])
    limits = Limits(max_stages=4)
    exact = search(table, 6, limits=limits)
    seed = exact.best[0]
    every = [c for c in configs(table, 6, limits) if not c.gpipe]
    run = _Search(table, 6, limits, Space(), 1, 0.0, False, [], itertools.count(),
                  deadline=0.0, first=[seed.config])
    assert list(run.state) == [seed.config]
    waiting = [n for n in run.heap if n.level == _WAITING]
    assert sorted(n.config.mb for n in waiting) == sorted(
        c.mb for c in every if c != seed.config)
    assert all(n.bound == lower_bound(table, 6) for n in waiting)
    while any(n.level == _WAITING for n in run.heap):
        run.step()
    assert set(run.state) == set(every)
    unlimited = _Search(table, 6, limits, Space(), 1, 0.0, False, [], itertools.count())
    assert set(unlimited.state) == set(every)
    cut = search(table, 6, limits=limits, time_limit=0.0, seeds=[(seed.config, seed.shapes)])
    assert cut.best[0].step_time == seed.step_time
    assert cut.bound <= seed.step_time * (1 + 1e-12)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**9))
def test_gpipe_is_set_up_unless_the_devices_cannot_hold_the_batchs_activations(seed):
    """`families.gpipe_holds`: GPipe's pipelines keep all their micro-batches, so where the
    devices cannot hold the leanest activations of the whole batch, every GPipe family
    overflows and the search sets up no GPipe configuration (Llama-3 70B on 64 GPUs:
    40 of its 120 set-ups; batches drawn around that threshold, both sides)."""
    from planner.solver.families import gpipe_holds
    from planner.solver.search import _Search, configs, degrees

    rng = random.Random(seed)
    table = random_table(seed, layers=rng.randint(2, 5), tps=(1, 2),
                         types=[(k, [rng.choice([1, 2, 4]) for _ in range(rng.randint(1, 3))])
                                for k in "ab"[:rng.randint(1, 2)]],
                         memory=rng.choice([1, 2, 4]) * GIB)
    limits, space = Limits(max_stages=3), Space()
    room = sum((t.memory - t.reserve) * sum(t.node_devices) for t in table.types)
    kept = min(tp * float(sum(min(table.activations(p, tp)[i] for p in space.policies)
                              for i in range(table.num_layers))) for tp in table.tps)
    batch = max(1, round(room / kept * rng.uniform(0.5, 2.0)))
    holds = gpipe_holds(table, batch, space, degrees(table, limits))
    assert holds == (batch * kept <= room * 1.01)
    run = _Search(table, batch, limits, space, 1, 0.0, True, [], itertools.count())
    gpipe = [c for c in configs(table, batch, limits) if c.gpipe]
    assert gpipe and (holds == any(c in run.state for c in gpipe))
    if not holds:  # (what setting them up would have found)
        assert all(run.set_up(c).bound == float("inf") for c in gpipe)


def test_a_dive_past_the_deadline_settles_one_child_per_level():
    """Settling a child prices its families (at a thousand layers, most of a second
    each): past the deadline a dive with no plan yet settles only the child with the
    best bound on its way to a first plan, and one with a plan settles nothing."""
    from planner.solver.search import _Search

    table = random_table(5, layers=5, types=[("a", [3, 3]), ("b", [3, 3]), ("c", [2])])
    limits = Limits(max_stages=4)
    settled = {}
    for deadline in (None, 0.0):
        run = _Search(table, 6, limits, Space(), 1, 0.0, False, [], itertools.count())
        run.deadline = deadline
        count = [0]
        settle = run.settle

        def counting(node, settle=settle, count=count):
            count[0] += 1
            return settle(node)

        run.settle = counting
        root = min(run.heap)
        run.dive(root)
        assert run.best
        settled[deadline] = count[0]
        count[0] = 0
        run.dive(min(run.heap))
        if deadline is not None:
            assert count[0] == 0  # (it has a plan)
    assert settled[0.0] < settled[None]


def test_a_greedy_plan_past_the_deadline_prices_nothing_once_a_plan_is_held(monkeypatch):
    """Each structure the greedy plan tries is priced (at a thousand layers, about a
    second each): past the deadline it tries none once the search holds a plan, and
    builds its plan as before when it holds none."""
    search_module = importlib.import_module("planner.solver.search")
    table = random_table(5, layers=5, types=[("a", [3, 3]), ("b", [3, 3]), ("c", [2])])
    limits = Limits(max_stages=4)
    plan = search(table, 6, limits=limits).best[0]
    priced = []

    def counting(*args, **kwargs):
        priced.append(args[3])
        return price(*args, **kwargs)

    monkeypatch.setattr(search_module, "price", counting)
    counts = {}
    for deadline, held in ((None, [plan]), (0.0, []), (0.0, [plan])):
        run = search_module._Search(table, 6, limits, Space(), 1, 0.0, False, list(held),
                                    itertools.count())
        run.deadline = deadline
        priced.clear()
        run.greedy(plan.config)
        counts[deadline, bool(held)] = len(priced)
    assert counts[None, True] > 0 and counts[0.0, False] == counts[None, True]
    assert counts[0.0, True] == 0


def test_moves_around_the_best_plan_past_the_deadline_bound_nothing():
    """The moves around the best plan (`swap`) bound each move's families first (at a
    thousand layers, seconds in all): past the deadline it makes none."""
    from planner.solver.search import _Search

    table = random_table(5, layers=5, types=[("a", [3, 3]), ("b", [3, 3]), ("c", [2])])
    limits = Limits(max_stages=4)
    plan = search(table, 6, limits=limits).best[0]
    counts = {}
    for deadline in (None, 0.0):
        run = _Search(table, 6, limits, Space(), 1, 0.0, False, [plan], itertools.count())
        run.deadline = deadline
        crowded, calls = run.crowded, []
        run.crowded = lambda *args, crowded=crowded, calls=calls: (
            calls.append(args), crowded(*args))[1]
        run.swap(plan.config)
        counts[deadline] = len(calls)
    assert counts[None] > 0 and counts[0.0] == 0


def test_past_the_deadline_the_first_plan_is_its_classes_first_splits():
    """Pricing a structure's best splits can take seconds on a thousand layers; past the
    deadline even the first plan stops at its classes' first splits (`Priced.upper`,
    an achievable plan), and what refining it would have found is bounded by the
    structure's lower bound, not left out."""
    from planner.solver.search import _leaf, _Node

    table = random_table(5, layers=5, types=[("a", [3, 3]), ("b", [3, 3]), ("c", [2])])
    limits, space = Limits(max_stages=4), Space()
    plan = search(table, 6, limits=limits).best[0]
    node = _Node(0.0, 0, plan.config, 0.0, 0, tuple((s.types, s.tps) for s in plan.shapes),
                 tuple(s.n for s in plan.shapes))
    priced = price(table, plan.config, space, plan.shapes, 6 // plan.config.mb)
    best: list = []
    assert _leaf(table, node, 6, limits, space, best, 1, 0.0, deadline=0.0) == priced.lower
    assert best == [priced.upper]
    refined: list = []
    assert _leaf(table, node, 6, limits, space, refined, 1, 0.0, deadline=None) == float("inf")
    assert refined[0].step_time == plan.step_time <= priced.upper.step_time


@pytest.mark.slow  # seconds to a minute a run: `pytest -m slow` (CI) runs it
@pytest.mark.parametrize("cut", [{"gap": 0.05}, {"time_limit": 0.0}])
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_a_search_cut_short_keeps_its_bound_honest(cut, seed):
    """With a gap, refine leaves out splits under a parameter cap that can beat a
    structure's best by less than the gap; past the time limit, the pricing of a
    structure stops with what it found (the first plan: its first splits). Either way the search's
    bound and plan enclose the optimum, the plan within the gap."""
    rng = random.Random(seed)
    table, batch, limits = random_instance(rng)
    optimum = brute_force(table, batch, limits, Space())
    try:
        result = search(table, batch, limits=limits, **cut)
    except PlannerError:
        assert optimum == float("inf")
        return
    assert result.bound <= optimum * (1 + 1e-12) <= result.best[0].step_time * (1 + 2e-12)
    if "gap" in cut:
        assert result.best[0].step_time <= optimum / (1 - cut["gap"]) * (1 + 1e-12)


@pytest.mark.slow  # seconds to a minute a run: `pytest -m slow` (CI) runs it
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_refine_past_its_deadline_stops_with_a_plan_and_the_structures_bound(seed):
    """What refine leaves out at its deadline is bounded by the structure's bound."""
    rng = random.Random(seed)
    table, batch, limits = random_instance(rng)
    for config, shapes, expected in every_structure(table, batch, limits, Space()):
        priced = price(table, config, Space(), shapes, batch // config.mb)
        if priced is None:
            continue
        got, skipped = refine(table, priced, batch // config.mb, deadline=0.0)
        assert got is priced.upper  # (the plan priced before refine)
        if skipped == float("inf"):  # nothing was left to try: no split can beat it
            assert got.step_time == pytest.approx(expected, rel=1e-9)
        else:
            assert skipped == priced.lower <= expected * (1 + 1e-9)


class _CtrlC:
    """A progress callback that presses Ctrl-C at its `at`-th call."""

    def __init__(self, at: int) -> None:
        self.at, self.calls, self.seen = at, 0, []

    def __call__(self, now) -> None:
        self.calls += 1
        self.seen.append(now)
        if self.calls == self.at:
            raise KeyboardInterrupt


@pytest.mark.parametrize("at", [1, 2, 4])
def test_ctrl_c_stops_with_the_best_plan_so_far_and_an_honest_bound(at):
    table = random_table(10, layers=6, types=[("a", [4, 4]), ("b", [4, 4]), ("c", [2])])
    exact = search(table, 24, limits=Limits(max_stages=4))
    assert exact.explored > 10 * at  # (so each press lands mid-search)
    press = _CtrlC(at)
    stopped = search(table, 24, limits=Limits(max_stages=4), progress=press)
    assert stopped.status == "interrupted" and press.calls == at
    assert stopped.explored < exact.explored
    optimum = exact.best[0].step_time
    assert stopped.bound <= optimum * (1 + 1e-12) <= stopped.best[0].step_time * (1 + 1e-12)
    for now in press.seen:  # what the progress line said held too
        assert now.bound <= optimum * (1 + 1e-12) and now.best >= optimum * (1 - 1e-12)
        assert "explored" in now.describe()


def test_ctrl_c_before_any_plan_stops_the_search():
    table = random_table(5, layers=5, types=[("a", [3, 3]), ("b", [3, 3]), ("c", [2])])

    def press(table, *args) -> None:
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(importlib.import_module("planner.solver.search"), "_leaf", press)
        with pytest.raises(KeyboardInterrupt):
            search(table, 6, limits=Limits(max_stages=4))


@pytest.mark.slow  # seconds to a minute a run: `pytest -m slow` (CI) runs it
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_cross_class_sync_floors_hold_for_every_split(seed):
    """With several classes, each class's largest stage is all-reduced with a stage of
    every pipeline of the others (`evaluate.cross_class_floor`), and a split's own
    stages are, whatever the other classes' splits (`_split_sync_floor`): no
    combination of splits pays less sync than either floor."""
    from planner.solver.evaluate import (
        Config,
        _split_sync_floor,
        cross_class_floor,
        sync_and_optimizer,
    )

    rng = random.Random(seed)
    table = random_table(seed, layers=4, types=[("a", [2] * rng.randint(1, 3)),
                                                ("b", [rng.randint(1, 3)] * rng.randint(1, 3))],
                         link_speed=rng.choice([0.1, 1.0]))
    if rng.random() < 0.5:  # the last layer reads some of the first's weights
        table = dataclasses.replace(table, tied=((3, 0, float(table.params[0]) / 2),),
                                    cache={})
    config, space, checked = Config(mb=1, tp=1), Space(zeros=(0,)), 0
    for _, shapes in structures(table, 8, Limits(max_stages=3)):
        if len(shapes) < 2 or (priced := price(table, config, space, shapes, 8)) is None:
            continue
        floor = cross_class_floor(table, shapes)
        every = [[split for cuts in itertools.combinations(range(1, 4), shape.stages - 1)
                  if (split := result.costs.split_at((0, *cuts, 4))) is not None]
                 for shape, result in zip(shapes, priced.results, strict=True)]
        for combo in itertools.product(*every):
            sync = sync_and_optimizer(table, config, shapes, priced.placement, combo).sync
            assert priced.sync <= sync * (1 + 1e-9) and floor <= sync * (1 + 1e-9)
            for c, split in enumerate(combo):
                assert _split_sync_floor(table, priced, c, split) <= sync * (1 + 1e-9)
            checked += 1
    assert checked


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_card_floor_holds_for_every_split(seed):
    """Stages on one node whose replicas sit on other nodes all-reduce through that
    node's network card, one after the other: no combination of splits pays less sync
    than `evaluate.card_floor`, which on such clusters is above the largest stage's
    all-reduce alone (the floor before cards were shared), and no pipeline spans more
    nodes than `SyncFloor.runs` says."""
    from planner.solver.evaluate import Config, card_floor, sync_and_optimizer
    from planner.solver.links import cheapest_gather
    from planner.solver.sync_floor import SyncFloor

    rng = random.Random(seed)
    table = random_table(seed, layers=4, types=[("a", [2, 2]), ("b", [2] * rng.randint(1, 2))],
                         link_speed=rng.choice([0.1, 1.0]))
    if rng.random() < 0.5:  # the last layer reads some of the first's weights
        table = dataclasses.replace(table, tied=((3, 0, float(table.params[0]) / 2),),
                                    cache={})
    config, space, above = Config(mb=1, tp=1), Space(zeros=(0,)), 0
    kinds = ["a", "b"]
    floors = SyncFloor(table, config, space, kinds, {k: cheapest_gather(table, k)
                                                     for k in kinds}, [1], {})
    for _, shapes in structures(table, 4, Limits(max_stages=3)):
        if (priced := price(table, config, space, shapes, 4)) is None:
            continue
        for shape, slots in zip(shapes, priced.placement, strict=True):
            assert all(len({slot.node for slot in p}) <= floors.runs(shape.types, shape.tps)
                       for p in slots)
        floor = card_floor(table, shapes, priced.placement, False)
        assert floor <= priced.sync * (1 + 1e-9)
        every = [[split for cuts in itertools.combinations(range(1, 4), shape.stages - 1)
                  if (split := result.costs.split_at((0, *cuts, 4))) is not None]
                 for shape, result in zip(shapes, priced.results, strict=True)]
        for combo in itertools.product(*every):
            sync = sync_and_optimizer(table, config, shapes, priced.placement, combo).sync
            assert floor <= sync * (1 + 1e-9)
            largest = max(table.collective(
                Collective.ALL_REDUCE, float(table.params[a:b].sum()) * table.grad_bytes,
                CommGroup.of([p[s].node for p in slots]))
                for split, slots in zip(combo, priced.placement, strict=True)
                for s, (a, b) in enumerate(itertools.pairwise(split.bounds)))
            above += floor > largest * (1 + 1e-6)
    assert above


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10**9))
def test_heaviest_run_is_the_least_over_every_cut(seed):
    """`evaluate.heaviest_run` against every cut of a few layers into runs in order
    (some empty): no cut's busiest run costs less, and the best one costs no more."""
    from planner.solver.evaluate import heaviest_run

    rng = random.Random(seed)
    layers = rng.randint(1, 6)
    table = random_table(seed, layers=layers, types=[("a", [2])])
    slopes = [rng.choice([1.0, 2.0, 0.5 + rng.random()]) for _ in range(rng.randint(1, 4))]
    grads = table.params * table.grad_bytes
    best = min(max(b * float(grads[a:z].sum()) for b, a, z in zip(
        slopes, (0, *cuts), (*cuts, layers), strict=True))
        for cuts in itertools.combinations_with_replacement(range(layers + 1),
                                                            len(slopes) - 1))
    assert heaviest_run(table, slopes) == pytest.approx(best, rel=1e-6)
    assert heaviest_run(table, slopes) <= best * (1 + 1e-12)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_sharded_card_floors_hold_for_every_split_and_zero_choice(seed):
    """A class of one whose stages may take ZeRO-3: for every split and every choice of
    stages on it, each of `evaluate.sharded_card_floors`'s pairs holds one way, the
    sync pays the card floor or a stage on ZeRO-3 is at least that busy per
    micro-batch; and a floor is above nothing somewhere."""
    from planner.solver.evaluate import (
        Config,
        class_links,
        sharded_card_floors,
        sync_and_optimizer,
        zero_gathers,
    )
    from planner.solver.structure import place

    rng = random.Random(seed)
    table = random_table(seed, layers=4, types=[("a", [2, 2]), ("b", [2] * rng.randint(1, 2))],
                         link_speed=rng.choice([0.1, 1.0]), memory=64 * GIB)
    if rng.random() < 0.5:  # the last layer reads some of the first's weights
        table = dataclasses.replace(table, tied=((3, 0, float(table.params[0]) / 2),),
                                    cache={})
    config, checked = Config(mb=1, tp=1), 0
    for _, shapes in structures(table, 4, Limits(max_stages=3)):
        if len(shapes) > 1 or shapes[0].n < 2 or (placement := place(table, shapes)) is None:
            continue
        shape, slots = shapes[0], placement[0]
        floors = sharded_card_floors(table, config, shape, slots)
        costs = {zero: class_costs(
            table, shape.types, tps=shape.tps, mb=1, n=shape.n, links=class_links(table, slots),
            gathers=zero_gathers(table, slots), schedule=config.schedule,
            policies=(Recompute.NONE,), zeros=(zero,)) for zero in (0, 3)}
        for cuts in itertools.combinations(range(1, 4), shape.stages - 1):
            splits = {zero: c.split_at((0, *cuts, 4)) for zero, c in costs.items()}
            if None in splits.values():
                continue
            for choice in itertools.product((0, 3), repeat=shape.stages):
                split = dataclasses.replace(splits[0], options=tuple(
                    splits[zero].options[s] for s, zero in enumerate(choice)))
                sync = sync_and_optimizer(table, config, shapes, placement, [split]).sync
                busiest = max((splits[3].stages[s].busy for s, zero in enumerate(choice)
                               if zero == 3), default=0.0)
                for card, busy in floors:
                    assert sync >= card * (1 - 1e-9) or busiest >= busy * (1 - 1e-9)
                    checked += card > 0
    assert checked


def test_moves_leave_a_best_plan_of_no_family_alone():
    """`_Search.swap` moves pipelines of the best plan's classes to a mixed class; a
    best plan whose classes are no family of the configuration (a seed priced with
    ZeRO, say) is left alone rather than looked up."""
    from planner.solver.search import _Search
    from planner.solver.structure import ClassShape

    table = random_table(3, layers=4, types=[("a", [2, 2]), ("b", [2, 2])])
    found = search(table, 8).best[0]
    part = _Search(table, 8, Limits(), Space(zeros=(0,)), 1, 0.0, False, [],
                   itertools.count())
    assert found.config in part.state
    part.best.append(dataclasses.replace(found, shapes=(ClassShape(("a",) * 9, 1),)))
    part.swap(found.config)
    assert len(part.best) == 1


def test_an_interleaved_seed_gets_a_first_plan_in_plain_1f1b_too(monkeypatch):
    """The first plan is built (`_Search.greedy`) in the most promising configuration
    and the seed's; where the seed runs interleaved, in its plain 1F1B configuration
    too (at 4,096 GPUs with up to two chunks the search otherwise kept a 13.06 s plan,
    where plain 1F1B reaches 12.67 s)."""
    from planner.solver.evaluate import Config
    from planner.solver.search import _Search
    from planner.solver.structure import ClassShape

    built, greedy = [], _Search.greedy

    def spy(self, config):
        built.append(config)
        greedy(self, config)

    monkeypatch.setattr(_Search, "greedy", spy)
    table = random_table(3, layers=4, types=[("a", [2, 2]), ("b", [2, 2])],
                         micro_batches=(1, 2))
    seed = (Config(2, tp=1, interleave=2), (ClassShape(("a", "a"), 2),))
    search(table, 8, limits=Limits(interleaves=(1, 2)), seeds=[seed])
    assert seed[0] in built and Config(2, tp=1, interleave=1) in built


def test_stages_sharing_a_node_take_turns_on_its_card():
    """Two pipelines of two stages, each pipeline on a node of its own: both stages'
    all-reduces cross the network from the same two nodes, so the sync is the two of
    them back to back, not the longer one (the same in the solver and in `predict`)."""
    from planner.solver.evaluate import Config, sync_and_optimizer
    from planner.solver.structure import ClassShape, place

    table = random_table(5, layers=4, types=[("a", [2, 2])], link_speed=0.1)
    shapes = (ClassShape(("a", "a"), 2),)
    placement = place(table, shapes)
    assert [[slot.node for slot in p] for p in placement[0]] == [["a-0", "a-0"], ["a-1", "a-1"]]
    priced = price(table, Config(1), Space(zeros=(0,)), shapes, 8)
    split = priced.results[0].costs.split_at((0, 1, 4))
    sync = sync_and_optimizer(table, Config(1), shapes, placement, [split]).sync
    each = [table.collective(Collective.ALL_REDUCE, float(table.params[a:b].sum())
                             * table.grad_bytes, CommGroup.of(["a-0", "a-1"]))
            for a, b in ((0, 1), (1, 4))]
    assert sync == pytest.approx(sum(each))
    assert sync > max(each) * 1.01


def test_zero3_shards_are_still_synchronised_across_classes():
    """ZeRO-3 reduce-scatters within a class; two classes holding the same layers must
    still all-reduce each device's shard once per step, one class alone need not."""
    from planner.solver.evaluate import Config, class_links, sync_and_optimizer
    from planner.solver.partition import class_costs
    from planner.solver.structure import ClassShape, place

    table = random_table(3, layers=3, types=[("t0", [2]), ("t1", [2])], memory=64 * GIB)
    space = Space(zeros=(3,))

    def sync(shapes):
        placement = place(table, shapes)
        splits = []
        for shape, slots in zip(shapes, placement, strict=True):
            costs = class_costs(table, shape.types, tps=shape.tps, mb=1, n=shape.n,
                                links=class_links(table, slots),
                                gathers=[(0.0, 0.0)] * shape.stages,
                                schedule=Config(1).schedule, policies=space.policies,
                                zeros=space.zeros)
            splits.append(costs.split_at((0, table.num_layers)))
        assert all(stage.zero == 3 for split in splits for stage in split.options)
        return sync_and_optimizer(table, Config(1), shapes, placement, splits).sync

    alone = sync((ClassShape(("t0",), 2),))
    together = sync((ClassShape(("t0",), 2), ClassShape(("t1",), 2)))
    assert alone == 0.0
    shard = table.params.sum() * table.grad_bytes / 2  # each class shards over 2 pipelines
    assert together == pytest.approx(table.collective(
        Collective.ALL_REDUCE, shard, CommGroup.of(["t0-0", "t0-0", "t1-0", "t1-0"])))


def test_sync_floor_prices_pipelines_on_one_node():
    """Pipelines of one stage on one node all-reduce the whole model over its own link,
    which the sync floor prices exactly (it counted nothing within a node); beside a
    class on another node's type, the group crosses the network."""
    import numpy as np

    from planner.solver.evaluate import Config
    from planner.solver.links import cheapest_gather
    from planner.solver.sync_floor import SyncFloor

    table = random_table(3, layers=3, types=[("t0", [8]), ("t1", [8])])
    kinds = ["t0", "t1"]
    floor = SyncFloor(table, Config(1), Space(zeros=(0,)), kinds,
                      {k: cheapest_gather(table, k) for k in kinds}, [1], {"t0": 1, "t1": 1})
    volume = float(table.params.sum()) * table.grad_bytes

    def one_stage_class(kind: str, n: int) -> tuple:
        return (np.array([[k == kind for k in kinds]]), np.array([1.0]), np.array([float(n)]),
                np.array([float(n)]), floor.copies((kind,), (1,))[None], np.array([0]),
                np.array([floor.runs((kind,), (1,))]))

    for n in (2, 5, 8):
        paid = floor.terms([one_stage_class("t0", n)])[0][0][0]
        assert paid > 0
        assert paid == pytest.approx(table.collective(
            Collective.ALL_REDUCE, volume, CommGroup.of(["t0-0"] * n)))
    crossing = floor.terms([one_stage_class("t0", 2), one_stage_class("t1", 2)])[0][0][0]
    assert 0 < crossing <= table.collective(
        Collective.ALL_REDUCE, volume, CommGroup.of(["t0-0", "t0-0", "t1-0", "t1-0"]))


@pytest.mark.parametrize("seed", range(4))
def test_pipelines_that_change_type_share_the_cards_there(seed):
    """n pipelines whose stages change type there change nodes, all at once: here one
    node per type carries every pipeline's sends. A class's bounds count that
    (`bound.crowded`), rising with n, and no split of the class as placed beats them."""
    from planner.solver.bound import crowded, tighten
    from planner.solver.evaluate import Config
    from planner.solver.families import families
    from planner.solver.structure import ClassShape

    table = random_table(seed, layers=4, types=[("t0", [8]), ("t1", [8])], link_speed=0.1,
                         memory=64 * GIB)
    config, space, microbatches = Config(1), Space(zeros=(0,)), 8
    family = next(f for f in families(table, config, Limits(max_stages=2), space,
                                      microbatches, [1])[0] if f.types == ("t0", "t1"))
    tighten(table, config, space, family, microbatches)
    assert crowded(table, config, space, family, 1, microbatches) is family
    previous = family
    for n in (2, 4, 8):
        bounded = crowded(table, config, space, family, n, microbatches)
        assert bounded.total > previous.total  # (the fill pays each send both ways)
        assert bounded.min_busy >= previous.min_busy
        priced = price(table, config, space, (ClassShape(family.types, n),), microbatches)
        placed = priced.results[0]  # the class as placed: its fastest split, its least fill
        assert bounded.min_busy <= placed.first.bottleneck * (1 + 1e-9)
        assert bounded.total <= placed.floor * (1 + 1e-9)
        previous = bounded


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10**9))
def test_least_largest_parts_are_those_of_every_cut(seed):
    """`run_floors.least_largest_parts`: for every part count and layer boundary, the least
    largest busy time over every cut of the layers before it, and after it, into that
    many parts (a hair lower against rounding)."""
    from planner.solver.run_floors import least_largest_parts

    rng = random.Random(seed)
    layers = rng.randint(1, 7)
    table = random_table(seed, layers=layers, types=[("t0", [2])])
    costs = table.costs("t0", 1, 1)
    busy = costs.fwd + costs.bwd
    heads = least_largest_parts(table, "t0", 1, 1, layers)
    tails = least_largest_parts(table, "t0", 1, 1, layers, from_end=True)

    def least(lo, hi, parts):
        cuts = itertools.combinations(range(lo + 1, hi), parts - 1)
        return min((max(busy[a:b].sum() for a, b in itertools.pairwise((lo, *c, hi)))
                    for c in cuts), default=float("inf")) if hi > lo else float("inf")

    for parts in range(1, layers + 1):
        for j in range(layers + 1):
            for got, want in ((heads[parts - 1, j], least(0, j, parts)),
                              (tails[parts - 1, j], least(j, layers, parts))):
                assert got == want == float("inf") or got == pytest.approx(want, rel=1e-8)
                assert got <= want


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**9), st.sampled_from([
    (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL), (Recompute.NONE, Recompute.FULL),
    (Recompute.SELECTIVE, Recompute.FULL)]))
def test_recompute_curve_is_below_every_choice_of_policies(seed, policies):
    """`run_floors.RecomputeCurve`: no choice of a policy per layer frees y bytes in fewer
    seconds than the curve gives for y, it frees no more than the leanest policies
    do, and it is the cheapest choice where that frees as much (the hulls' ends);
    without keeping everything allowed, freeing is free."""
    from planner.solver.run_floors import RecomputeCurve

    rng = random.Random(seed)
    layers = rng.randint(1, 5)
    table = random_table(seed, layers=layers, types=[("t0", [2])])
    curve = RecomputeCurve(table, "t0", 1, 2, policies)
    costs = table.costs("t0", 1, 2)
    kept = table.activations(Recompute.NONE, 1) * 2
    leanest = sum(kept - np.min([table.activations(p, 1) * 2 for p in policies], axis=0))
    at_end = float("inf")  # the cheapest choice that frees as much as the leanest
    for choice in itertools.product(policies, repeat=layers):
        freed = sum(kept[i] - table.activations(p, 1)[i] * 2 for i, p in enumerate(choice))
        seconds = sum(costs.recompute[p][i] for i, p in enumerate(choice))
        if Recompute.NONE not in policies:
            seconds = 0.0
        assert float(curve(np.array(freed))) <= seconds * (1 + 1e-9) + 1e-12
        if freed >= leanest * (1 - 1e-12):
            at_end = min(at_end, seconds)
    assert curve.bytes[-1] == pytest.approx(leanest, rel=1e-9)
    assert float(curve(np.array(leanest))) == pytest.approx(at_end, rel=1e-9, abs=1e-12)
    assert float(curve(np.array(leanest * 1.01 + 2))) == float("inf")
    assert np.all(np.diff(curve.rates) >= 0)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**9))
def test_tails_in_memory_are_those_of_every_cut(seed):
    """`run_floors.tails_in_memory`: for every stage count c and layer boundary j, the least
    largest and the least summed busy time over every cut of the layers from j on into
    a pipeline's last c stages, stage q from the end holding q + 1 micro-batches and
    taking the cheapest recompute policy that fits (memory tight enough that few layers
    do)."""
    from planner.solver.evaluate import Config
    from planner.solver.run_floors import tails_in_memory

    rng = random.Random(seed)
    layers, mb = rng.randint(1, 6), rng.choice([1, 2])
    table = random_table(seed, layers=layers, types=[("t0", [4])], micro_batches=(mb,),
                         memory=rng.choice([1, 2, 4, 8]) * GIB)
    space = Space(zeros=(0,))
    per_param = table.weight_bytes + table.grad_bytes + table.state_bytes
    largest, sums = tails_in_memory(table, "t0", 1, Config(mb), space, 4, per_param)
    costs = table.costs("t0", 1, mb)
    room = table.type("t0").memory - table.type("t0").reserve

    def stage(a, b, held):
        fits = [float((costs.fwd + costs.bwd + costs.recompute[p])[a:b].sum())
                for p in space.policies
                if table.rank_params(1)[a:b].sum() * per_param
                + held * table.activations(p, 1)[a:b].sum() * mb <= room]
        return min(fits, default=float("inf"))

    for c in range(1, 5):
        for j in range(layers + 1):
            cuts = itertools.combinations(range(j + 1, layers), c - 1) if j < layers else ()
            times = [[stage(a, b, c - i) for i, (a, b) in enumerate(
                itertools.pairwise((j, *cut, layers)))] for cut in cuts]
            for got, want in ((largest[c - 1, j], min(map(max, times), default=float("inf"))),
                              (sums[c - 1, j], min(map(sum, times), default=float("inf")))):
                assert got == want == float("inf") or got == pytest.approx(want, rel=1e-8)
                assert got <= want


def _sampled_families(rng, seed, *, layers, memory, max_stages, count, zero3=False):
    """A random table of two types (1-4 devices each), a configuration with or without
    interleaving, and a sample of its runnable families (from `families.families`); with
    `zero3`, GPipe's schedule too and every ZeRO stage or ZeRO-3 alone."""
    from planner.solver.evaluate import Config
    from planner.solver.families import families
    from planner.solver.interleave import fold

    table = random_table(seed, layers=layers,
                         types=[("t0", [rng.randint(1, 4)]), ("t1", [rng.randint(1, 4)])],
                         link_speed=rng.choice([0.1, 1.0]), memory=memory, tps=(1, 2))
    config, space, tp = Config(1, interleave=rng.choice([1, 2])), Space(zeros=(0,)), 1
    if zero3:  # with tp 2, layers tp keeps partly whole and a tied weight, at times
        config = rng.choice([config, Config(1, gpipe=True)])
        space = Space(zeros=rng.choice([(0, 1, 2, 3), (0, 3), (3,)]))
        tp = rng.choice([1, 2])
        table = dataclasses.replace(table, unsharded=table.params * np.array(
            [rng.choice([0.0, 0.5, 1.0]) for _ in range(layers)]), cache={})
        if rng.random() < 0.5:
            table = dataclasses.replace(table, tied=((layers - 1, 0, float(
                table.params[0]) / 2),), cache={})
    view = fold(table, config.interleave)
    options = [f for level in families(view, config, Limits(max_stages=max_stages), space, 8,
                                       [tp]) for f in level if f.min_busy < float("inf")]
    return table, config, space, view, rng.sample(options, min(count, len(options)))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9), st.booleans())
@example(673, True)  # the least time shards part of the states (`memory`)
@example(313672, True)  # layers that gather fewer bytes per rank's parameter than others
def test_every_split_is_within_its_familys_first_bounds(seed, zero3):
    """A family's bounds from per-layer times alone (before `tighten`) hold for every
    split of its pipelines on the terms `tighten` prices them (no placement does
    better): no split has a shorter bottleneck or a smaller fill, homogeneous or mixed,
    interleaved or not, with memory tight enough to need recompute, with ZeRO-3 (its
    gathers) and GPipe (its stages holding all their micro-batches) too."""
    from planner.solver.bound import tight_result

    rng = random.Random(seed)
    table, config, space, view, sample = _sampled_families(
        rng, seed, layers=rng.choice([4, 6, 8]), memory=rng.choice([2, 8]) * GIB,
        max_stages=4, count=6, zero3=zero3)
    for family in sample:
        result = tight_result(table, config, space, family, 8)
        if result is None:
            continue
        costs, stages = result.costs, len(family.types)
        splits = [s for cuts in itertools.combinations(range(1, view.num_layers), stages - 1)
                  if (s := costs.split_at((0, *cuts, view.num_layers))) is not None]
        assert splits
        assert min(s.bottleneck for s in splits) >= family.min_busy * (1 - 1e-9)
        assert min(s.total for s in splits) >= family.total * (1 - 1e-9)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_every_split_runs_on_or_above_a_floor_pair(seed):
    """`families.floor_pairs`: every split of a class has a period and a fill at least one
    pair's, checked on each step of its staircase (the splits that make its time exact
    for every micro-batch count), also with the class slowed to a longer period as
    the ZeRO-3 bound slows it; the pairs' periods rise and their fills fall."""
    from planner.solver.bound import tight_result
    from planner.solver.families import floor_pairs, pair_staircase
    from planner.solver.partition import Staircase

    rng = random.Random(seed)
    table, config, space, _, sample = _sampled_families(
        rng, seed, layers=rng.choice([4, 6]), memory=32 * GIB, max_stages=3, count=4)
    for family in sample:
        result = tight_result(table, config, space, family, 8)
        if result is None:
            continue
        pairs = floor_pairs(result, result.min_period, result.floor)
        assert all(a[0] < b[0] and a[1] > b[1] for a, b in itertools.pairwise(pairs))
        steps = Staircase(result)
        while steps.extend():
            pass
        slower = rng.uniform(0.5, 2.0) * result.min_period
        raised = pair_staircase((max(p, slower), max(f, slower)) for p, f in pairs)
        for split in steps.points:
            assert any(split.bottleneck >= p * (1 - 1e-9) and split.total >= f * (1 - 1e-9)
                       for p, f in pairs)
            period, fill = max(split.bottleneck, slower), max(split.total, slower)
            assert any(period >= p * (1 - 1e-9) and fill >= f * (1 - 1e-9)
                       for p, f in raised)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10**9))
def test_the_open_levels_catch_up_within_the_last_interval(seed):
    """`finish.catch_up`: where the open levels (whole micro-batches of pipelines
    starting at random times, at random paces) finish the rest before the next fixed
    completion, the bound moves up to within 0.1% of the first t they do, and never
    past it."""
    import numpy as np

    from planner.solver.finish import catch_up

    rng = random.Random(seed)
    rows = 6
    begins = np.array([[rng.uniform(0.0, 5.0) for _ in range(4)] for _ in range(rows)])
    paces = np.array([[rng.uniform(0.2, 3.0) for _ in range(4)] for _ in range(rows)])
    fixed = np.array([float(rng.randint(0, 20)) for _ in range(rows)])
    goal = fixed + np.array([float(rng.randint(1, 30)) for _ in range(rows)])

    def done(t):
        ends = np.floor(1 + (t[:, None] - begins) * paces + 1e-9)
        return fixed + np.where(t[:, None] >= begins, ends, 0.0).sum(axis=1)

    grid = np.linspace(0.0, 40.0, 100_001)  # the first t each row reaches its goal
    first = np.array([grid[np.argmax(fixed[r] + np.where(
        grid[:, None] >= begins[r], np.floor(1 + (grid[:, None] - begins[r]) * paces[r]
                                             + 1e-9), 0.0).sum(axis=1) >= goal[r])]
        for r in range(rows)])
    times = np.array([rng.uniform(0.0, f) for f in first])
    after = first + np.array([rng.uniform(0.0, 3.0) for _ in range(rows)])
    caught = catch_up(times, after, np.minimum(goal - done(after), 0.0), done, goal)
    assert (caught >= times).all() and (caught <= first).all()
    moved = after - times > 2e-3 * after
    assert (first[moved] - caught[moved] <= 1e-3 * after[moved] + 4e-4).all()


def _consistent(shapes, node, setup, shrinks: bool) -> bool:
    """Whether a full structure lies in the subtree of a search node: its mixed classes
    (in their placement order) begin with those the node chose, and are no more where
    the node's level is past the mixed levels, and more where it is a mixed level past
    the first; its homogeneous classes are those the node chose on the levels before
    its own."""
    chosen = list(zip(node.chosen, node.counts, strict=True))

    def matches(shape, i: int) -> bool:
        family, n = chosen[i]  # (a family's key: types, degrees)
        last = i == len(chosen) - 1
        return (shape.types, shape.tps) == family and (
            shape.n == n or (shrinks and last and shape.n < n))

    ours = sorted((s for s in shapes if len(set(s.types)) > 1), key=lambda s: (s.types, s.tps))
    alone = {s.types[0]: s for s in shapes if len(set(s.types)) == 1}
    mixed = [i for i, ((types, _), _) in enumerate(chosen) if len(set(types)) > 1]
    if len(ours) < len(mixed) or not all(matches(ours[j], i) for j, i in enumerate(mixed)):
        return False
    if node.level < setup.mixed:  # the homogeneous levels are all open
        return node.level == 0 or len(ours) > len(mixed)
    if len(ours) != len(mixed):
        return False
    picked = {types[0]: i for i, ((types, _), _) in enumerate(chosen) if len(set(types)) == 1}
    for level in setup.levels[setup.mixed:node.level]:
        kind = level[0].types[0] if level else None
        if kind in picked and not (kind in alone and matches(alone[kind], picked[kind])):
            return False
        if kind not in picked and kind in alone:
            return False
    return True


@pytest.mark.slow  # seconds to a minute a run: `pytest -m slow` (CI) runs it
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
@example(1393)  # layer times not proportional across types broke the fluid family bound
@example(12)  # a sync floor added to a bound that already held one
@example(33)  # a class escapes its sync floor through ZeRO-3
@example(5)  # the one mixed class counted with fewer pipelines than it may hold
@example(8299)  # whole micro-batches of fractional per-slot values summed just under m
def test_every_node_bound_is_below_every_structure_in_its_subtree(seed):
    """The branch and bound's bounds, before and after pricing a node's classes, for every
    node of the tree of each part of the search (a child stands for 1..n pipelines of its
    last class), and a leaf's bound with its first layer's sync. A part bounds what it
    is responsible for: the ZeRO-free structures, or those of one class."""
    table, batch, limits = random_instance(random.Random(seed))
    check_both_parts_subtree_bounds(table, batch, limits, seed)


@pytest.mark.slow  # seconds to a minute a run: `pytest -m slow` (CI) runs it
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_node_bounds_hold_on_clusters_of_many_nodes(seed):
    """As above, on clusters whose classes span several nodes (the bounds' node counts,
    pipeline counts and open classes' sync by count), each structure priced by
    `refine` (equal to brute force, as tested above); children bounded by ranges of
    their counts whatever their number, or only where their bound of 1..n is
    promising (`_RANGED`)."""
    rng = random.Random(seed)
    table = random_table(seed, layers=4, types=[("a", [2] * rng.randint(3, 5)),
                                                ("b", [1] * rng.randint(3, 5))],
                         link_speed=rng.choice([0.1, 1.0]))
    batch, limits, space = 8, Limits(max_stages=3), Space(zeros=(0,))
    values = []
    for config, shapes in structures(table, batch, limits):
        if sum(s.n for s in shapes) <= batch // config.mb:
            priced = price(table, config, space, shapes, batch // config.mb)
            best = priced and refine(table, priced, batch // config.mb)[0]
            values.append((config, shapes, best.step_time if best else float("inf")))
    with _ranged_or_filtered(rng):
        _check_subtree_bounds(table, batch, limits, False, values, rng)


def _ranged_or_filtered(rng: random.Random):
    """Children bounded by ranges of their counts whatever their number of candidates,
    or (as the search does beyond `_RANGED`) only where their bound of 1..n is
    promising: one of the two, drawn."""
    from unittest import mock

    search_module = importlib.import_module("planner.solver.search")
    return mock.patch.object(search_module, "_RANGED", rng.choice([0, search_module._RANGED]))


def _walk_many_nodes(seed: int, steps: int):
    """A random walk over the tree of the ZeRO-free part of the search on a cluster of
    several nodes per type: each node as taken and settled, and as split off its smaller
    counts (the same node if it stands for one), with the search."""
    from planner.solver.search import _Search

    rng = random.Random(seed)
    table = random_table(seed, layers=4, types=[("a", [2] * rng.randint(2, 4)),
                                                ("b", [1] * rng.randint(2, 4))],
                         link_speed=rng.choice([0.1, 1.0]))
    run = _Search(table, 8, Limits(max_stages=3), Space(zeros=(0,)), 1, 0.0, False, [],
                  itertools.count())
    stack = list(run.heap)
    for _ in range(steps):
        if not stack:
            return
        taken = node = stack.pop(rng.randrange(len(stack)))
        while not run.settle(node):
            pass
        if (parts := run.split(node)) is not None:
            node, sibling = parts
            stack.extend([sibling] if sibling else [])
        yield run, taken, node
        if not run.is_leaf(node):
            stack.extend(run.children(node))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
@example(19)
def test_classes_that_leave_the_open_levels_no_room_pay_their_floor_as_at_their_leaf(seed):
    """Where a node's fixed classes leave the open levels no room, no class is added
    below it, so its sync floor on their placement (`_Search.crossed`) raises it as
    much as the leaf of those classes alone: the floor is added to the time their
    micro-batches take (`Bound.unsynced`), not to the base the parent passed on, which
    counted the devices those classes now hold as the open levels'."""
    from planner.solver.search import _Node

    checked = 0
    for run, _, node in _walk_many_nodes(seed, 400):
        levels, bound = run.state[node.config].levels, run.state[node.config].bound
        if run.is_leaf(node) or len(node.chosen) < 2:
            continue
        fits = run.fits(node.config, run.fewest(node), range(node.level, len(levels)))
        if fits is not None and not fits.any():
            leaf = _Node(0.0, -1, node.config, 0.0, len(levels), node.chosen, node.counts)
            leaf.bound, leaf.base = bound(run.fixed(leaf), ())
            assert run.crossed(node) >= run.crossed(leaf) * (1 - 1e-9)
            checked += 1
    if seed == 19:  # (one that reaches such nodes: the check is not empty)
        assert checked


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
@example(3)
def test_a_split_prunes_the_counts_that_cannot_beat_the_best_plan(seed):
    """Splitting a node of 1..n pipelines off its count n leaves a sibling of 1..k, k
    the largest count below n whose bound may beat the best plan (none if no count
    may): the counts between are pruned at once, as one node, each bound no better
    than that plan."""
    from types import SimpleNamespace

    checked = 0
    for run, node, _ in _walk_many_nodes(seed, 200):
        if not run.shrinks(node):
            continue
        _, whole = run.split(dataclasses.replace(node, counted=()))  # no plan yet
        # (counts that cannot run are pruned even then: their bounds are infinite)
        bounds = [b for b, _ in whole.counted] if whole else []
        if not any(b < float("inf") for b in bounds):
            continue
        best = 1.001 * sorted(bounds)[sum(b < float("inf") for b in bounds) // 2]
        run.best[:] = [SimpleNamespace(step_time=best)]  # some counts beat it
        pruned = run.pruned
        _, sibling = run.split(dataclasses.replace(node, counted=()))
        kept = [k for k, b in enumerate(bounds, 1) if b < best]
        if not kept:
            assert sibling is None
        else:
            assert sibling.counts[-1] == len(sibling.counted) == max(kept)
        assert run.pruned - pruned == (max(kept, default=0) < node.counts[-1] - 1)
        checked += 1
        run.best[:] = []
    if seed == 3:  # (one that reaches such nodes: the check is not empty)
        assert checked


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
@example(472485147)
def test_rows_of_their_own_fewest_counts_are_bounded_as_in_a_call_of_their_own(seed):
    """`Bound.many` with the fewest count each candidate stands for (children bound 1..n
    pipelines as the least over n alone, h..n-1 and 1..h-1, in one call): each row's
    bound and base are those of a call of its own (with True, for a fewest of one).
    (472485147: rows of different optimizer floors, whose classes' floors were once cut
    where the row of the largest starts, so another row's walk stopped at completions
    of lines that never lead for it.)"""
    rng = random.Random(seed)
    checked = 0
    for run, _, node in _walk_many_nodes(seed, 60):
        levels, bound = run.state[node.config].levels, run.state[node.config].bound
        if run.is_leaf(node):
            continue
        fixed, opened = run.fixed(node), range(node.level + 1, len(levels))
        rows = [(f, rng.randint(1, 4)) for f in levels[node.level] if f.min_busy < np.inf]
        fewest = [rng.randint(1, n) for _, n in rows]  # (a row of no class, alone, is
        # bounded without the sync of a class the open levels add: not with others)
        fits = run.row_fits(node, rows, opened, fewest)
        both = bound.many(fixed, rows, opened, fewest, (node.bound, node.base), fits)
        for i, (row, least) in enumerate(zip(rows, fewest, strict=True)):
            one = fits if fits is None or fits.ndim == 1 else fits[i:i + 1]
            for fewer in ([least], *([True] if least == 1 else [])):
                alone = bound.many(fixed, [row], opened, fewer, (node.bound, node.base), one)
                assert both[0][i] == pytest.approx(alone[0][0], rel=1e-12)
                assert both[1][i] == pytest.approx(alone[1][0], rel=1e-12)
            checked += 1
    assert checked


def test_catching_up_a_row_does_not_depend_on_the_other_rows():
    """`finish.catch_up` leaves a row whose bracket has no room for more than the
    search's gap where it is, whether or not another row of the call has room (the
    open levels finish one micro-batch a second, ten wanted)."""
    from planner.solver.finish import catch_up

    times, after = np.array([9.985, 5.0]), np.array([10.0, 20.0])
    short_after = np.array([-1.0, -1.0])
    both = catch_up(times, after, short_after, np.floor, 10.0)
    for row in range(2):
        alone = catch_up(times[row:row + 1], after[row:row + 1], short_after[row:row + 1],
                         np.floor, 10.0)
        assert both[row] == alone[0]
    assert both[0] == 9.985 and 9.99 < both[1] < 10.0


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
@example(1)
def test_a_child_of_up_to_n_pipelines_is_bounded_below_each_counts_own_bound(seed):
    """A child whose last class stands for 1..n pipelines is bounded by the least over
    ranges of its counts (`_Search.counts_bound`): no higher than any count's own
    bound, however many its siblings (`_RANGED`). (Each is found to within 0.1%
    below the time the micro-batches are done, `finish.first_enough`.)"""
    rng = random.Random(seed)
    checked = 0
    with _ranged_or_filtered(rng):
        for run, _, node in _walk_many_nodes(seed, 40):
            if run.is_leaf(node):
                continue
            levels, bound, index = (run.state[node.config].levels, run.state[node.config].bound,
                                   run.state[node.config].index)
            for child in run.children(node):
                if not run.shrinks(child):
                    continue
                f, n = index[child.chosen[-1]], child.counts[-1]
                opened = range(child.level, len(levels))
                for k in range(1, n + 1):
                    own, _ = bound.many(run.fixed(node), [(f, k)], opened, False,
                                        (node.bound, node.base),
                                        run.row_fits(node, [(f, k)], opened, False))
                    assert child.bound <= own[0] * (1 + 2e-3)  # (each within 0.1%)
                checked += n > 3
    if seed == 1:  # (one that reaches children of four pipelines or more)
        assert checked


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_a_bound_for_up_to_n_pipelines_is_below_each_counts_bound(seed):
    """A node's last class stands for 1..n pipelines (or a child's row for k..n): its
    bound before sync is no higher than that of any one of those counts, the open
    families paying the same sync, more the more pipelines (a count between the ends
    can leave the open levels more than either end)."""
    import numpy as np

    from planner.solver.search import _Search

    rng = random.Random(seed)
    table = random_table(seed, layers=4, types=[("a", [2] * rng.randint(3, 6)),
                                                ("b", [1] * rng.randint(3, 6))])
    run = _Search(table, 12, Limits(max_stages=3), Space(), 1, 0.0, False, [],
                  itertools.count())
    stack = list(run.heap)
    for _ in range(200):
        if not stack:
            break
        node = stack.pop(rng.randrange(len(stack)))
        levels, bound = run.state[node.config].levels, run.state[node.config].bound
        families = bound._open_families(range(node.level, len(levels)))
        if run.shrinks(node) and len(families.stages):
            fixed, opened = run.fixed(node), range(node.level, len(levels))
            f, n = fixed[-1]
            shift = (np.cumsum([[[rng.random() for _ in range(families.caps.shape[1])]
                                for _ in families.stages]], axis=2), families.optimizer)
            least = rng.choice([1, rng.randint(1, n)])
            with np.errstate(divide="ignore", invalid="ignore"):  # as `Bound.many` calls it
                up_to_n = bound._core(fixed[:-1], [(f, n)], opened,
                                      True if least == 1 else [least], 0.0, shift)
                for count in range(least, n + 1):
                    exact = bound._core(fixed[:-1], [(f, count)], opened, False, 0.0, shift)
                    assert up_to_n[0] <= exact[0] * (1 + 2e-3)  # (each within 0.1%)
        if not run.is_leaf(node):
            stack.extend(run.children(node))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_the_one_class_root_bound_is_the_least_over_every_class(seed):
    """The one-class part's root bound skips the classes whose cheap floor is past the
    best bound found: it is still the least bound (and base) over all of them."""
    from planner.solver.bound import INF
    from planner.solver.search import _Search

    table, batch, limits = random_instance(random.Random(seed))
    run = _Search(table, batch, limits, Space(), 1, 0.0, True, [], itertools.count())
    for setup in run.state.values():
        levels, bound = setup.levels, setup.bound
        opened = range(len(levels))
        options = []
        for f in (f for level in levels for f in level if f.min_busy < INF):
            n = min([f.n_max, bound.m] + [bound.devices[k] // f.devices_of(k)
                                          for k in set(f.types)])
            if n >= 1:
                options.append((f, n))
        full, base = bound.many([], options, (), True) if options else ([INF], [INF])
        assert bound._best_alone(opened) == (min(full), min(base))


def check_both_parts_subtree_bounds(table, batch, limits, seed: int) -> None:
    """`_check_subtree_bounds` for both parts of a search: the ZeRO-free structures, and
    those of one class (a class whose blocks differ in degree runs without ZeRO: the
    ZeRO-free part holds it, but GPipe's; so does a pattern of which the cluster holds
    one pipeline, `_Search.least_pipelines`)."""
    for single in (False, True):
        space = Space() if single else Space(zeros=(0,))
        values = [(config, shapes, v) for config, shapes, v in every_structure(
            table, batch, limits, space) if not single or (len(shapes) == 1 and (
                config.gpipe or (len(set(shapes[0].tps)) == 1
                                 and _holds_two(table, shapes[0]))))]
        _check_subtree_bounds(table, batch, limits, single, values, random.Random(seed))


def _holds_two(table, shape) -> bool:
    """Whether the cluster holds two pipelines of the class's pattern."""
    from planner.solver.structure import blocks, capacity

    return min(capacity(table, tp, kind, count)
               for kind, count, tp in blocks(shape.types, shape.tps)) >= 2


def _check_subtree_bounds(table, batch, limits, single, values, rng):
    from planner.solver.search import _Search

    run = _Search(table, batch, limits, Space(), 1, 0.0, single, [], itertools.count())
    stack = list(run.heap)
    ranked: dict = {}  # per configuration, its structures fastest first
    for config, shapes, v in sorted(values, key=lambda value: value[2]):
        ranked.setdefault(config, []).append((shapes, v))

    def least(node, setup, shrinks: bool) -> float:
        """The fastest structure in the node's subtree (inf: none)."""
        return next((v for shapes, v in ranked.get(node.config, ())
                     if _consistent(shapes, node, setup, shrinks)), float("inf"))

    for _ in range(300):  # a random walk over the tree: it can be large
        if not stack:
            break
        node = stack.pop(rng.randrange(len(stack)))
        setup = run.state[node.config]
        shrinks = run.shrinks(node)
        best = least(node, setup, shrinks)
        assert node.bound <= best * (1 + 1e-9)
        while not run.settle(node):
            pass
        assert max(node.bound, run.crossed(node)) <= best * (1 + 1e-9)
        exact = least(node, setup, False)
        if (parts := run.split(node)) is not None:  # n alone, and a sibling of 1..k
            node, sibling = parts
            assert max(node.bound, run.crossed(node)) <= exact * (1 + 1e-9)
            stack.extend([sibling] if sibling else [])
        if run.is_leaf(node):  # what decides whether a leaf (its counts as they are) is priced
            assert run.sync_floor(node) <= exact * (1 + 1e-9)
        else:
            stack.extend(run.children(node))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**9))
@example(135)  # a bisection point above where the window floor meets it
def test_no_split_has_a_shorter_period_than_the_class_floor(seed):
    """`optimize`'s period floor (windows of the whole pipeline, of the stage pairs
    around its slow sends and of all neighbours) and total floor hold for every split,
    on links of mixed speeds; the neighbours' windows fit a period exactly when some
    split's do."""
    from planner.solver.partition import class_costs, optimize
    from planner.types import LinkSpec, Schedule

    rng = random.Random(seed)
    layers = rng.randint(3, 8)
    table = random_table(seed, layers=layers, types=[("a", [2]), ("b", [2])],
                         memory=rng.choice([2, 8]) * 2.0**30)
    stages = rng.randint(2, min(layers, 5))
    types = tuple(sorted(rng.choice("ab") for _ in range(stages)))
    links = [LinkSpec(name="l", bandwidth=rng.choice([1e8, 1e9, 5e10]), latency=1e-4)
             for _ in range(stages - 1)]
    costs = class_costs(table, types, tps=(1,) * stages, mb=1, n=1, links=links,
                        gathers=[(0.0, 0.0)] * stages, schedule=Schedule.ONE_F_ONE_B,
                        policies=Space().policies, zeros=(0,))
    result = optimize(costs)
    splits = [s for cuts in itertools.combinations(range(1, layers), stages - 1)
              if (s := costs.split_at((0, *cuts, layers))) is not None]
    if result is None:
        assert not splits
        return
    assert result.min_period >= max(result.smallest_max, result.floor / stages)
    for split in splits:
        assert split.bottleneck >= result.min_period * (1 - 1e-12)
        assert split.total >= result.floor * (1 - 1e-12)
    if stages == 2:  # the neighbours' windows are all of a two-stage period
        assert result.min_period >= min(s.bottleneck for s in splits) / (1 + 1e-3)

    def neighbours(split):
        busy = [s.busy for s in split.stages]
        return max(max(max(s.busy, s.send) for s in split.stages),
                   *((busy[s] + busy[s + 1] + 2 * split.stages[s].send) / 2
                     for s in range(stages - 1)))

    needs = sorted(neighbours(s) for s in splits)
    for period in [*needs, *(rng.uniform(0, 2 * needs[-1]) for _ in range(10))]:
        for nudge in (1 - 1e-9, 1 + 1e-9):  # (sums in another order round apart)
            assert costs.windows_fit(period * nudge) == (needs[0] <= period * nudge)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**9))
def test_node_labels_tell_which_stages_placement_puts_together(seed):
    """Stages with different labels are on different nodes in every placement, and on
    one node where the type's nodes all hold as many slots."""
    from planner.solver.structure import ClassShape, node_labels, place

    rng = random.Random(seed)
    uniform = {k: rng.random() < 0.6 for k in "ab"}
    types = [(k, [rng.randint(1, 4)] * rng.randint(1, 3) if uniform[k]
              else [rng.randint(1, 4) for _ in range(rng.randint(1, 3))]) for k in "ab"]
    table = random_table(seed, layers=8, types=types)
    shapes = []
    for _ in range(rng.randint(1, 3)):
        blocks = [(k, rng.randint(1, 5), rng.choice([1, 1, 2]))  # (a degree per block)
                  for k in rng.sample("ab", rng.randint(1, 2))]
        shapes.append(ClassShape(tuple(k for k, c, _ in blocks for _ in range(c)),
                                 rng.randint(1, 3),
                                 tuple(tp for _, c, tp in blocks for _ in range(c))))
    placement = place(table, tuple(shapes))
    if placement is None:
        return
    for shape, slots in zip(shapes, placement, strict=True):
        labels = node_labels(table, shape.types, shape.tps)
        for pipeline in slots:
            for i, j in itertools.combinations(range(shape.stages), 2):
                if labels[i] != labels[j]:
                    assert pipeline[i].node != pipeline[j].node
                elif uniform[shape.types[i]]:
                    assert pipeline[i].node == pipeline[j].node


def _first_fit(table, shapes):
    """Placement as `structure` documents it, scanning every node for every block: a
    block that fits in one node's free devices takes the first such node, a longer
    one the first whole free nodes it needs (None: the structure does not fit)."""
    free = {t.name: [[n, 0, d] for n, d in zip(t.nodes, t.node_devices, strict=True)]
            for t in table.types}
    out = []
    for shape in shapes:
        pipelines = []
        for _ in range(shape.n):
            stages = []
            for kind, count, tp in shape.blocks():
                nodes = free[kind]
                room = next((e for e in nodes if (e[2] - e[1]) // tp >= count), None)
                if room is not None:
                    stages += [(room[0], room[1] + i * tp) for i in range(count)]
                    room[1] += count * tp
                    continue
                whole = [e for e in nodes if e[1] == 0 and e[2] >= tp]
                if sum(e[2] // tp for e in whole) < count:
                    return None
                taken = []
                for e in whole:
                    if len(taken) >= count:
                        break
                    taken += [(e[0], i * tp) for i in range(e[2] // tp)]
                    e[1] = e[2]
                stages += taken[:count]
            pipelines.append(stages)
        out.append(pipelines)
    return out


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**9))
def test_placement_is_first_fit_in_canonical_order(seed):
    """`structure.place` (which skips the nodes too full for a block) puts every stage
    where first fit over all nodes does, and fits exactly the same structures."""
    from planner.solver.structure import ClassShape, place

    rng = random.Random(seed)
    types = [(k, [rng.choice([1, 2, 4, 8]) for _ in range(rng.randint(1, 12))])
             for k in "ab"[:rng.randint(1, 2)]]
    table = random_table(seed, layers=4, types=types)
    shapes = tuple(ClassShape(tuple(sorted((rng.choice([k for k, _ in types])
                                            for _ in range(rng.randint(1, 8))),
                                           reverse=rng.random() < 0.5)),
                              rng.randint(1, 6), rng.choice([1, 2, 4]))
                   for _ in range(rng.randint(1, 3)))
    placement = place(table, shapes)
    expected = _first_fit(table, shapes)
    assert (placement is None) == (expected is None)
    if placement is not None:
        assert [[[(s.node, s.first) for s in p] for p in c] for c in placement] == expected


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**9))
def test_room_is_the_most_pipelines_place_puts_after_the_classes_before(seed):
    """`structure.room`: how many pipelines of a class, up to its count, `place` fits
    after the classes placed before it (0 where those do not fit)."""
    from planner.solver.structure import ClassShape, free_after, place, room

    rng = random.Random(seed)
    types = [(k, [rng.choice([1, 2, 4, 8]) for _ in range(rng.randint(1, 6))])
             for k in "ab"[:rng.randint(1, 2)]]
    table = random_table(seed, layers=4, types=types)
    *placed, last = (ClassShape(tuple(sorted(rng.choice([k for k, _ in types])
                                             for _ in range(rng.randint(1, 6)))),
                                rng.randint(1, 8), rng.choice([1, 2]))
                     for _ in range(rng.randint(1, 3)))
    fits = [n for n in range(1, last.n + 1)
            if place(table, (*placed, dataclasses.replace(last, n=n))) is not None]
    free = free_after(table, tuple(placed))
    assert (0 if free is None else room(free, last)) == max(fits, default=0)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**9))
def test_free_after_counts_what_place_leaves_without_making_slots(seed):
    """`free_after` places each block of a class's pipelines at once (as many as a
    node holds, without their slots): after every class it leaves every node as
    `place` does, stage by stage, and it fails where that fails."""
    from planner.solver.structure import ClassShape, Free, _place, free_after

    rng = random.Random(seed)
    types = [(k, [rng.choice([1, 2, 4, 8]) for _ in range(rng.randint(1, 8))]) for k in "ab"]
    table = random_table(seed, layers=4, types=types)
    shapes: tuple[ClassShape, ...] = ()
    for _ in range(rng.randint(1, 5)):
        kinds = rng.sample("ab", rng.randint(1, 2))
        counts = [rng.choice([1, 2, 3, 9]) for _ in kinds]  # (few sizes: blocks recur)
        degrees = [rng.choice([1, 2]) for _ in kinds]
        shapes += (ClassShape(sum(((k,) * c for k, c in zip(kinds, counts, strict=True)), ()),
                              rng.randint(1, 4), sum(((tp,) * c for tp, c in zip(
                                  degrees, counts, strict=True)), ())),)
        placed, free = _place(table, shapes), free_after(table, shapes)
        assert (placed is None) == (free is None)
        if placed is None:
            break
        expected = Free(placed[1])
        assert (free.spans, free.empty, free.alike) == (expected.spans, expected.empty,
                                                        expected.alike)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**9))
def test_a_types_free_devices_follow_from_the_classes_blocks_of_that_type_alone(seed):
    """What `place` leaves free on one type's nodes depends only on the classes' blocks
    of that type, in order (`_Search.row_fits` reads each open family's count off them:
    a few distinct block lists where the candidates are many mixed families)."""
    from planner.solver.structure import ClassShape, free_after

    rng = random.Random(seed)
    types = [(k, [rng.choice([1, 2, 4, 8]) for _ in range(rng.randint(1, 6))]) for k in "abc"]
    table = random_table(seed, layers=4, types=types)
    shapes = []
    for _ in range(rng.randint(1, 3)):
        a, b = rng.sample("abc", 2)
        count = rng.randint(1, 6)
        cut = rng.randint(1, count)
        degrees = (rng.choice([1, 2]),) * cut + (rng.choice([1, 2]),) * (count - cut)
        shapes.append(ClassShape((a,) * cut + (b,) * (count - cut), rng.randint(1, 4),
                                 degrees))
    whole = free_after(table, tuple(shapes))
    for kind in "abc":
        alone = free_after(table, tuple(ClassShape((kind,) * count, s.n, tp) for s in shapes
                                        for k, count, tp in s.blocks() if k == kind))
        if whole is not None:
            assert alone is not None
            assert (alone.spans[kind], alone.empty[kind]) == (whole.spans[kind],
                                                              whole.empty[kind])


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
@example(301)  # a dive's node stands for 1..n pipelines; its children for n of them
def test_the_search_queues_no_structure_placement_cannot_fit(seed):
    """A child stands for 1..n pipelines of its new class: n is what `place` fits beside
    the node's classes, not only what the devices left hold (a block longer than a node
    takes whole nodes and leaves the rest of the last one idle), and a node whose
    classes do not fit has no children."""
    search_module = importlib.import_module("planner.solver.search")
    rng = random.Random(seed)
    table = random_table(seed, layers=4, types=[("a", [2] * rng.randint(3, 5)),
                                                ("b", [1] * rng.randint(3, 5))])
    queued = []
    children = search_module._Search.children

    def spy(self, node):
        out = children(self, node)
        queued.extend((self.view(c.config), c) for c in out if c.chosen)
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(search_module._Search, "children", spy)
        search(table, 8, limits=Limits(max_stages=3), space=Space(zeros=(0,)))
    assert queued
    for view, child in queued:
        assert search_module.place(view, search_module._shapes(child)) is not None


def test_open_levels_count_the_pipelines_placement_fits_beside_the_fixed_classes():
    """Below the root, each open level may add a class of its own type, placed after the
    mixed one on its own type's nodes: it fits no more pipelines than `place` puts on
    what the fixed classes leave (a mixed block of two stages on a node of four leaves
    two devices a block of three cannot use), fewer than the devices left hold. The
    bound counts those (`Bound._whole_levels`'s `fits`), and the search still finds the
    brute-force optimum."""
    bound_module = importlib.import_module("planner.solver.bound")
    whole_levels = bound_module.Bound._whole_levels
    capped = []

    def spy(self, open_levels, later, free, fits=None):
        if fits is not None:
            found = self._open_families(open_levels)
            held = np.minimum(found.n_max[None, :],
                              np.floor(free[:, found.homes] / found.size[None, :] + 1e-9))
            capped.append(bool((np.broadcast_to(fits, held.shape) < held).any()))
        return whole_levels(self, open_levels, later, free, fits)

    limits, space = Limits(max_stages=3), Space(zeros=(0,))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bound_module.Bound, "_whole_levels", spy)
        for seed in (3, 4, 5):
            rng = random.Random(seed)
            table = random_table(seed, layers=4, types=[
                ("a", [4] * rng.randint(1, 2)), ("b", [rng.randint(1, 2)] * rng.randint(1, 3))])
            found = search(table, 6, limits=limits, space=space).best[0].step_time
            assert found == pytest.approx(brute_force(table, 6, limits, space), rel=1e-9)
    assert any(capped)


def _cache_keys(table):
    """The keys of a table's cache and of the caches of the tables folded from it."""
    for key, value in table.cache.items():
        yield key
        if isinstance(value, type(table)):
            yield from _cache_keys(value)


def test_every_table_cache_key_is_a_named_key():
    """A search (mixed classes, chains of three types, interleaving, GPipe, ZeRO-3, tied
    weights) leaves in the cost table's caches only keys of `planner/solver/keys.py`:
    each names every value its cache depends on, and equals no other cache's key."""
    from planner.solver import keys

    named = {cls for cls in vars(keys).values()
             if isinstance(cls, type) and dataclasses.is_dataclass(cls)
             and cls.__module__ == keys.__name__}
    table = random_table(5, layers=4, types=[("a", [2]), ("b", [2]), ("c", [1]), ("d", [1])],
                         tps=(1, 2), micro_batches=(1, 2), memory=4 * GIB, link_speed=1.0)
    table = dataclasses.replace(table, tied=((3, 0, float(table.params[0]) / 2),), cache={})
    search(table, 4, limits=Limits(max_stages=3, interleaves=(1, 2)))
    found = list(_cache_keys(table))
    assert {type(key) for key in found} <= named, {
        key for key in found if type(key) not in named}
    assert {keys.FoldedKey, keys.ChainShapesKey, keys.ChainLayoutKey, keys.TwoTypeShapesKey,
            keys.DeviceWorkKey, keys.StageKey} <= {type(key) for key in found}
