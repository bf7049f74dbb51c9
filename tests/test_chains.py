"""Pipelines over three or more device types (chains, issue 53): the search equals brute
force over every order of types and every block length, its bounds hold there, and a
cluster of three single-GPU nodes gets one pipeline over all three where that is
faster (or the only plan that fits)."""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cost_models.cluster import load_cluster
from cost_models.model import AnalyticalCostModel
from planner.models import model_spec
from planner.solver import SolveOptions, solve
from planner.solver.evaluate import Config, Space
from planner.solver.families import (
    CHAIN_FAMILIES,
    chain_limit,
    chain_patterns,
    families,
)
from planner.solver.limits import Limits
from planner.solver.search import search
from planner.trace import trace_model
from planner.types import TrainingSpec
from tests.solver_tables import GIB, random_table
from tests.test_solver_search import (
    assert_equals_brute_force,
    check_both_parts_subtree_bounds,
)


def _chain_instance(rng: random.Random):
    """Three or four types on at most 8 devices, pipelines of up to as many stages as
    there are types (so chains of every length are in the space), one mixed class (two,
    on four types, are `test_mixed_classes.py`'s: brute force over their pairs here takes
    twice as long)."""
    kinds = rng.randint(3, 4)
    while True:
        types = [(f"t{i}", [rng.randint(1, 2) for _ in range(rng.randint(1, 2))])
                 for i in range(kinds)]
        if sum(sum(devices) for _, devices in types) <= 8:
            break
    table = random_table(rng.randrange(10**6), layers=rng.randint(kinds, 5), types=types,
                         memory=rng.choice([1, 2, 4, 8]) * GIB,
                         link_speed=rng.choice([0.1, 1.0, 10.0]))
    return table, rng.choice([2, 4, 6]), Limits(max_stages=kinds, mixed_classes=1)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_search_equals_brute_force_over_chains(seed):
    assert_equals_brute_force(*_chain_instance(random.Random(seed)), Space(zeros=(0,)))


@pytest.mark.slow  # seconds to a minute a run: `pytest -m slow` (CI) runs it
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_search_equals_brute_force_over_chains_with_zero(seed):
    assert_equals_brute_force(*_chain_instance(random.Random(seed)))


@pytest.mark.parametrize("seed", range(4))
def test_search_equals_brute_force_over_chains_per_class_degree_and_chunks(seed):
    """Chains at every degree a class may take (with --tp-per-class each class its own,
    a chain of three or more types one for all its blocks), and interleaved."""
    rng = random.Random(seed)
    table = random_table(seed, layers=rng.randint(3, 4), tps=(1, 2),
                         types=[(f"t{i}", [rng.choice([1, 2])]) for i in range(3)],
                         memory=rng.choice([2, 4, 8]) * GIB)
    for limits in (Limits(max_stages=3, tp_per_class=True),
                   Limits(max_stages=3, interleaves=(1, 2))):
        assert_equals_brute_force(table, 4, limits, Space(zeros=(0,)))


@pytest.mark.parametrize("seed", [2, 5, 7, 11])
def test_chains_win_on_these_instances(seed):
    """Instances where the best plan is a chain of three types: the brute force above
    would pass without chains in the space on instances where none wins."""
    table = random_table(seed, layers=5, types=[("a", [1]), ("b", [1]), ("c", [1])],
                         memory=3 * GIB)
    limits, space = Limits(max_stages=3), Space(zeros=(0,))
    best = search(table, 4, limits=limits, space=space).best[0]
    assert_equals_brute_force(table, 4, limits, space)
    assert any(len(set(shape.types)) == 3 for shape in best.shapes), best.shapes


@pytest.mark.slow  # seconds to a minute a run: `pytest -m slow` (CI) runs it
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_every_node_bound_is_below_every_structure_of_its_subtree_over_chains(seed):
    """`test_every_node_bound_is_below_every_structure_in_its_subtree` on instances of
    three or four types, where the mixed level holds chains of every length."""
    table, batch, limits = _chain_instance(random.Random(seed))
    check_both_parts_subtree_bounds(table, batch, limits, seed)


@pytest.mark.parametrize("seed", range(6))
def test_a_chains_first_bounds_are_below_every_split(seed):
    """A chain family's first bounds (`FamilyFloors.chains`): no split of its pipeline,
    priced as the search prices it on the fastest links, has a shorter period or fill."""
    from planner.solver.bound import tight_result

    rng = random.Random(seed)
    table = random_table(seed, layers=rng.randint(4, 7), types=[
        ("a", [2]), ("b", [2]), ("c", [1, 1]), ("d", [2])], memory=rng.choice([2, 4, 8]) * GIB)
    limits, config = Limits(max_stages=5), Config(mb=1)
    for space in (Space(zeros=(0,)), Space()):
        level = families(table, config, limits, space, 4, [1])[0]
        chains = [f for f in level if len(set(f.types)) >= 3]
        assert chains
        for family in chains:
            exact = tight_result(table, config, space, family, 4)
            if exact is not None:
                assert family.min_busy <= exact.min_period * (1 + 1e-9)
                assert family.total <= exact.floor * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_least_largest_ranges_is_the_least_largest_part_of_every_cut(seed):
    """`run_floors.least_largest_ranges` against every cut of every range of layers into
    that many parts (infinite where there are fewer layers than parts)."""
    from planner.solver.partition import INF
    from planner.solver.run_floors import least_largest_ranges

    table = random_table(seed, layers=random.Random(seed).randint(3, 6), types=[("a", [2])])
    costs = table.costs("a", 1, 1)
    times = list(costs.fwd + costs.bwd)
    size = len(times) + 1
    for count in (1, 2, 3):
        found = least_largest_ranges(table, "a", 1, 1, count)
        for i, j in itertools.product(range(size), repeat=2):
            if j - i < count:
                assert found[i, j] == INF
                continue
            least = min(max(sum(times[a:b]) for a, b in itertools.pairwise((i, *inner, j)))
                        for inner in itertools.combinations(range(i + 1, j), count - 1))
            assert found[i, j] == pytest.approx(least, rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_a_middle_blocks_least_largest_part_raises_its_chains_periods(seed, monkeypatch):
    """A chain's middle block has no stage less busy than its layers' least largest part
    (`FamilyFloors.largest_stage`), not only than their mean: against the mean alone, no
    chain's first period is lower and, where layers are uneven, some are higher (and
    still below every split: `test_a_chains_first_bounds_are_below_every_split`, on the
    same instances)."""
    import planner.solver.families as families_module

    def periods(cells: int) -> dict:
        monkeypatch.setattr(families_module, "RANGE_CELLS", cells)
        rng = random.Random(seed)
        table = random_table(seed, layers=rng.randint(4, 7), types=[
            ("a", [2]), ("b", [2]), ("c", [1, 1]), ("d", [2])],
            memory=rng.choice([2, 4, 8]) * GIB)
        level = families(table, Config(mb=1), Limits(max_stages=5), Space(zeros=(0,)), 4,
                         [1])[0]
        return {f.key: f.min_busy for f in level if len(set(f.types)) >= 3}

    mean_only, raised = periods(0), periods(1 << 21)
    assert raised.keys() == mean_only.keys()
    assert all(raised[k] >= mean_only[k] for k in raised)
    if seed in (0, 1, 3, 5):  # (uneven layers here: 21 to 39 chains raised)
        assert sum(raised[k] > mean_only[k] * (1 + 1e-9) for k in raised) >= 10


def test_chain_families_are_every_order_and_length_up_to_the_limit():
    table = random_table(0, layers=6, types=[("a", [2]), ("b", [1]), ("c", [2]), ("d", [1])])
    config = Config(mb=1)
    limits = Limits(max_stages=5)
    three = set(chain_patterns(table, limits, config, 1, 3))
    four = set(chain_patterns(table, limits, config, 1, 4))
    slots = {"a": 2, "b": 1, "c": 2, "d": 1}
    for found, blocks in ((three, 3), (four, 4)):
        assert found == {(order, counts) for order in itertools.permutations(slots, blocks)
                         for counts in itertools.product(*(range(1, slots[k] + 1)
                                                           for k in order))
                         if sum(counts) <= 5}
    assert chain_limit(table, limits, config, 1) == 4
    level = families(table, config, limits, Space(zeros=(0,)), 4, [1])[0]
    assert {tuple(dict.fromkeys(f.types)) for f in level if len(set(f.types)) > 2} <= {
        order for order, _ in three | four}


def test_the_longest_chains_are_left_out_where_they_are_too_many(monkeypatch):
    """Beyond `CHAIN_FAMILIES` patterns, the longest chains go first, and the search
    says so in the space it reports."""
    import planner.solver.families as module

    table = random_table(0, layers=6, types=[("a", [2]), ("b", [1]), ("c", [2]), ("d", [1])])
    config, limits = Config(mb=1), Limits(max_stages=5)
    four = sum(1 for _ in chain_patterns(table, limits, config, 1, 4))
    three = sum(1 for _ in chain_patterns(table, limits, config, 1, 3))
    monkeypatch.setattr(module, "CHAIN_FAMILIES", three + four - 1)
    assert chain_limit(table, limits, config, 1) == 3
    monkeypatch.setattr(module, "CHAIN_FAMILIES", three - 1)
    assert chain_limit(table, limits, config, 1) == 2
    result = search(table, 4, limits=limits, space=Space(zeros=(0,)))
    assert "chains at most 2 at tp 1 of the cluster's 4 device types" in result.space
    assert three + four < CHAIN_FAMILIES  # (the default keeps them all here)


def _three_gpus(layers: int, exclude: tuple[str, ...] = ()):
    """The issue's example: three single-GPU nodes on 10 Gb/s Ethernet."""
    cluster = load_cluster("1x1xA100-40G,1x1xRTX4090,1x1xRTX3090@10Gbps")
    graph = trace_model(model_spec("gpt3-6.7b", {"layers": layers}), seq_len=1024, dtype="bf16")
    training = TrainingSpec(global_batch=16, seq_len=1024, dtype="bf16")
    return solve(graph, cluster, training, SolveOptions(exclude=exclude),
                 costs=AnalyticalCostModel(cluster))[0]


def test_three_single_gpu_nodes_run_one_pipeline_over_all_three():
    """18 layers fit only on all three GPUs together: one pipeline over the three."""
    plan = _three_gpus(18)
    assert len(plan.pipelines) == 1
    assert {s.device_type for s in plan.pipelines[0].stages} == {
        "A100-40G-SXM", "RTX4090", "RTX3090"}


def test_the_third_gpu_is_used_where_that_is_faster():
    """With 16 layers two GPUs hold the model too: the plan is no slower than the best
    without the RTX 3090, and uses it exactly where it is faster."""
    plan, without = _three_gpus(16), _three_gpus(16, exclude=("rtx3090-0",))
    uses = any(s.device_type == "RTX3090" for p in plan.pipelines for s in p.stages)
    assert plan.prediction.step_time <= without.prediction.step_time * (1 + 1e-9)
    assert uses == (plan.prediction.step_time < without.prediction.step_time * (1 - 1e-9))


@pytest.mark.parametrize("seed", range(4))
def test_chains_of_every_order_are_bounded_together_as_one_at_a_time(seed, monkeypatch):
    """`FamilyFloors.chains` bounds the chains of every order together (`ChainRows`): the
    same families and first bounds as an order at a time, each first and last block's
    type priced once for all the orders that put it there (issue 53's time target: six
    orders of three types priced their ends six times each)."""
    from planner.solver.families import FamilyFloors
    from planner.solver.keys import ChainShapesKey

    rng = random.Random(seed)
    table = random_table(seed, layers=rng.randint(4, 7), types=[
        ("a", [2]), ("b", [2]), ("c", [1, 1])], memory=rng.choice([2, 4, 8]) * GIB)
    limits, orders = Limits(max_stages=5), 0
    priced: list[str] = []  # the ends' pricing calls of one `chains`
    for config, space in ((Config(mb=1), Space(zeros=(0,))), (Config(mb=1), Space()),
                          (Config(mb=1, gpipe=True), Space())):
        floors = FamilyFloors(table, config, limits, space, 4)
        priced.clear()
        for method in ("head_time", "tail_time"):
            original = getattr(FamilyFloors, method)
            monkeypatch.setattr(FamilyFloors, method, lambda self, kind, *rest, _f=original,
                                _m=method: (priced.append(_m), _f(self, kind, *rest))[1])
        together = [(f.types, f.tps, f.n_max, f.total, f.min_busy) for f in floors.chains(1, 3)]
        monkeypatch.undo()
        by_order = table.cache[ChainShapesKey(1, 3, floors.fits_by)]
        assert sorted(priced) == (["head_time"] * len({order[0] for order in by_order})
                                  + ["tail_time"] * len({order[-1] for order in by_order}))
        orders = max(orders, len(by_order))
        apart = []
        for order, rows in by_order.items():  # (a table that holds this order's chains)
            alone = dataclasses.replace(table, cache={
                ChainShapesKey(1, 3, floors.fits_by): {order: rows}})
            apart += [(f.types, f.tps, f.n_max, f.total, f.min_busy) for f in FamilyFloors(
                alone, config, limits, space, 4).chains(1, 3)]
        assert together == apart
    assert orders == 6  # (every order of the three types has a chain that fits)


def test_a_dive_settles_the_children_it_tries(monkeypatch):
    """A dive settles each child it tries (`_Search.dive`): on the benchmark's Llama-2 7B
    cluster the chains' first bounds are loose, and pricing each child once, taking the
    next of least bound, left the dives with a plan 5% slower (three pipelines of an
    A100 and an RTX 4090); settled, the one over all eight GPUs, the optimum, is the
    child whose classes alone finish soonest, so the queue starts pruning with it."""
    search_module = importlib.import_module("planner.solver.search")
    first: list[float] = []  # the best plan once the dives are done, per search

    def start(runs, *args):
        original(runs, *args)
        first.append(runs[0].best[0].step_time)

    original = search_module._start
    monkeypatch.setattr(search_module, "_start", start)
    cluster = load_cluster("1x3xA100-80G,1x3xRTX4090,1x2xRTX3090@10Gbps")
    graph = trace_model(model_spec("llama2-7b"), seq_len=4096, dtype="bf16")
    plan = solve(graph, cluster, TrainingSpec(global_batch=64, seq_len=4096, dtype="bf16"),
                 costs=AnalyticalCostModel(cluster))[0]
    assert {s.device_type for s in plan.pipelines[0].stages} == {
        "A100-80G-SXM", "RTX4090", "RTX3090"}
    assert first[-1] == pytest.approx(plan.prediction.step_time, rel=1e-9)


@pytest.mark.parametrize("zeros", [(0, 1, 3), (1, 3)])
def test_the_part_of_one_class_leaves_patterns_of_one_pipeline_to_the_other(zeros):
    """A class of one pipeline runs without ZeRO, so where the ZeRO-free part is searched
    it holds those structures, priced alike: the part of one class offers on 1F1B only
    the patterns the cluster holds two pipelines of (`_Search.least_pipelines`), GPipe
    (searched only there) every pattern, and so does 1F1B where ZeRO-0 is not allowed
    (no other part)."""
    from planner.solver.search import _Search

    table = random_table(3, layers=5, types=[("a", [2]), ("b", [2]), ("c", [1, 1])],
                         memory=8 * GIB)
    single = _Search(table, 4, Limits(max_stages=4), Space(zeros=zeros), 1, 0.0, True, [],
                     itertools.count())
    fewest = {config: min(f.n_max for level in setup.levels for f in level)
              for config, setup in single.state.items()}
    assert any(config.gpipe for config in fewest) and any(
        not config.gpipe for config in fewest)
    for config, least in fewest.items():
        assert least == (2 if 0 in zeros and not config.gpipe else 1)
