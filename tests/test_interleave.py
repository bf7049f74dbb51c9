"""Interleaved 1F1B in the search: the folded table, shares in whole groups, and
solver plans that interleave (priced as `estimate` prices them, runnable ranks)."""

import dataclasses
import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cost_models.cluster import load_cluster
from cost_models.comm import Collective, CommGroup
from cost_models.model import AnalyticalCostModel
from planner.explain import traffic
from planner.models import model_spec
from planner.runtime.layout import rank_layout
from planner.solver import Limits, SolveOptions, Space, solve
from planner.solver.interleave import chunks, fold
from planner.solver.partition import ZERO_GATHER_REF
from planner.solver.predict import replay, stage_timings
from planner.solver.shares import grouped_shares
from planner.solver.timing import in_flight
from planner.trace import trace_model
from planner.types import Schedule, TrainingSpec
from planner.types.training import Recompute
from tests.solver_tables import random_table


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_grouped_shares_are_the_best_counts_in_whole_groups(seed):
    """Against every way to give each pipeline a multiple of its class's group."""
    rng = random.Random(seed)
    lines = [(rng.randint(1, 2), rng.uniform(0.5, 2.0), rng.uniform(1.0, 6.0))
             for _ in range(rng.randint(1, 3))]
    groups = [rng.choice([1, 2, 3]) for _ in lines]
    total = rng.randint(1, 14)
    pipes = [(b, c, g) for (n, b, c), g in zip(lines, groups, strict=True) for _ in range(n)]
    best = min((max((m - 1) * b + c for m, (b, c, _) in zip(counts, pipes, strict=True))
                for counts in itertools.product(*(range(g, total + 1, g) for _, _, g in pipes))
                if sum(counts) == total), default=None)
    got = grouped_shares(lines, groups, total)
    if best is None:
        assert got is None
        return
    assert got is not None and sum(got) == total
    assert all(m >= g and m % g == 0 for m, (_, _, g) in zip(got, pipes, strict=True))
    slowest = max((m - 1) * b + c for m, (b, c, _) in zip(got, pipes, strict=True))
    assert slowest == pytest.approx(best, rel=1e-12)


def test_a_folded_range_holds_what_its_chunks_hold():
    table = random_table(4, layers=6, types=[("a", [2])])
    table = dataclasses.replace(table, tied=((5, 0, 1e7),))
    folded = fold(table, 2)
    assert folded.num_layers == 3 and fold(folded, 2) is folded
    base, half = table.costs("a", 1, 1), folded.costs("a", 1, 1)
    for a, b in ((0, 1), (1, 3), (0, 3)):
        held = [i for lo, hi in chunks((a, b), 6, 2) for i in range(lo, hi)]
        assert float(half.fwd[a:b].sum()) == pytest.approx(float(base.fwd[held].sum()))
        assert float(folded.params[a:b].sum()) == pytest.approx(float(table.params[held].sum()))
        # the head (layer 5) reads the embedding's (layer 0) weights: a copy unless both held
        copy = 1e7 if (5 in held) != (0 in held) and 5 in held else 0.0
        assert folded.range_params(1)[a, b] == pytest.approx(
            float(table.params[held].sum()) + copy)
    assert chunks((1, 3), 6, 2) == ((1, 3), (4, 6))
    assert folded.boundary[1] == max(table.boundary[1], table.boundary[4])
    with pytest.raises(ValueError, match="equal rounds"):
        fold(random_table(4, layers=5, types=[("a", [2])]), 2)


def test_a_folded_table_outlives_the_table_it_was_folded_from():
    """The folded table refers back to its table weakly (its cache holds the folded
    one: no cycle); once that table is gone it prices layers itself, alike."""
    import gc

    table = random_table(4, layers=6, types=[("a", [2])])
    folded = fold(table, 2)
    kept = folded.costs("a", 1, 1)
    fresh = dataclasses.replace(folded, cache={})  # nothing cached, the same functions
    del table
    gc.collect()
    alone = fresh.costs("a", 1, 1)
    assert alone is not kept
    for a, b in ((kept.fwd, alone.fwd), (kept.bwd, alone.bwd),
                 (kept.recompute[Recompute.FULL], alone.recompute[Recompute.FULL])):
        assert a == pytest.approx(b)


@pytest.fixture(scope="module")
def interleaved():
    """A solve forced to interleave, its pipelines from the A100 node to the V100 one,
    on a cluster that lists the V100 node first (ranks follow the file's order)."""
    graph = trace_model(model_spec("opt-125m", {"layers": 6}), seq_len=512, dtype="fp16")
    cluster = load_cluster("1x2xA100-40G,1x2xV100-16G@100Gbps")
    cluster = dataclasses.replace(cluster, nodes=tuple(reversed(cluster.nodes)))
    assert cluster.nodes[0].device.name == "V100-16G"
    training = TrainingSpec(global_batch=32, seq_len=512, dtype="fp16")
    options = SolveOptions(gap=0.0, limits=Limits(interleave=2, pp=2, first_stage="A100-40G-SXM",
                                                       last_stage="V100-16G"),
                           with_baselines=False)
    return graph, cluster, solve(graph, cluster, training, options)[0]


def test_an_interleaved_solver_plan_is_priced_as_estimate_prices_it(interleaved):
    graph, cluster, plan = interleaved
    assert plan.solver.objective == pytest.approx(plan.prediction.step_time, rel=1e-9)
    sim = replay(plan, graph.layers, AnalyticalCostModel(cluster))
    # interleaved 1F1B's closed form runs above the event replay where stages are
    # unbalanced (benchmarks/RESULTS.md, closed-form): 2.3% on this plan since GEMMs are
    # priced by their shapes (the V100's small GEMMs slower than the A100's)
    assert plan.prediction.step_time * 0.97 <= sim.step_time <= plan.prediction.step_time
    for p in plan.pipelines:
        assert p.schedule is Schedule.INTERLEAVED and p.interleave == 2
        assert p.num_microbatches % len(p.stages) == 0
        held = sorted(c for s in p.stages for c in s.chunks)  # round-robin, every layer once
        assert [s.index for c in held for s in p.stages if c in s.chunks] == [0, 1, 0, 1]
        assert list(itertools.chain(*held)) == sorted(itertools.chain(*held))
        assert held[0][0] == 0 and held[-1][1] == len(graph.layers)


def test_interleaved_zero3_gathers_each_chunk_on_its_own():
    """On ZeRO-3 every chunk gathers its weights: the search and the plan's prediction
    both pay a latency per chunk, the bytes once."""
    graph = trace_model(model_spec("opt-125m", {"layers": 6}), seq_len=512, dtype="fp16")
    cluster = load_cluster("2x2xV100-16G@10Gbps")
    training = TrainingSpec(global_batch=16, seq_len=512, dtype="fp16")
    options = SolveOptions(gap=0.0, limits=Limits(interleave=2, pp=2, dp=2, micro_batch=2),
                           space=Space(zeros=(3,)), with_baselines=False)
    plan = solve(graph, cluster, training, options)[0]
    assert {s.zero for p in plan.pipelines for s in p.stages} == {3}
    assert plan.solver.objective == pytest.approx(plan.prediction.step_time, rel=1e-9)
    costs = AnalyticalCostModel(cluster)
    sim = replay(plan, graph.layers, costs)
    assert sim.step_time == pytest.approx(plan.prediction.step_time, rel=0.02)
    stage = plan.pipelines[0].stages[1]  # (stage 0 owns the tied token table)
    group = CommGroup.of([p.stages[1].devices.node for p in plan.pipelines])
    g0, g1 = (costs.collective_time(Collective.ALL_GATHER, b, group)
              for b in (1.0, ZERO_GATHER_REF))
    weight = sum(graph.layers[i].params for i in stage.held()) * 2  # fp16
    gathered = stage_timings(plan, graph.layers, costs)[0][1]
    ungathered = stage_timings(_zero(plan, 2), graph.layers, costs)[0][1]
    assert gathered.fwd - ungathered.fwd == pytest.approx(
        2 * g0 + (g1 - g0) * weight / ZERO_GATHER_REF, rel=1e-9)
    # `planner explain`'s traffic table too: two gathers per forward, not one
    m = plan.pipelines[0].num_microbatches
    row = [r for r in traffic(plan, graph.layers, costs) if r.kind == "zero-3 gather"][1]
    assert row.seconds > 3 * m * costs.collective_time(Collective.ALL_GATHER, weight, group)


def _zero(plan, zero):
    return dataclasses.replace(plan, pipelines=tuple(dataclasses.replace(
        p, stages=tuple(dataclasses.replace(s, zero=zero) for s in p.stages))
        for p in plan.pipelines))


def test_interleaved_pipelines_sit_on_ascending_ranks(interleaved):
    """torch's interleaved 1F1B needs each pipeline's stages on ascending ranks: the
    plan orders the cluster's nodes so (ranks follow the plan's node order)."""
    _, cluster, plan = interleaved
    slots = rank_layout(plan).slots
    for p in plan.pipelines:
        ranks = [next(r.rank for r in slots if (r.pipeline, r.stage, r.tp_rank) ==
                      (p.index, s.index, 0)) for s in p.stages]
        assert ranks == sorted(ranks)
    assert {n.name for n in plan.cluster.nodes} == {n.name for n in cluster.nodes}
    assert [n.name for n in plan.cluster.nodes] != [n.name for n in cluster.nodes]


def test_interleaving_holds_more_micro_batches_in_flight(interleaved):
    """Stage 0 keeps Megatron's warm-up of (2 (S-1) + (v-1) S + 1) / v micro-batches of
    activations (2.5 here), more than 1F1B's S."""
    graph, cluster, plan = interleaved
    pipe = plan.pipelines[0]
    first = pipe.stages[0]
    costs = AnalyticalCostModel(cluster)

    def memory(flight: float):
        return costs.memory([graph.layers[i] for i in first.held()],
                            cluster.node(first.devices.node).device, plan.training,
                            tp=first.tp, dp=len(plan.pipelines), zero=first.zero,
                            recompute=first.recompute, micro_batch=pipe.micro_batch,
                            in_flight=flight)

    assert in_flight(0, 2, pipe.num_microbatches, Schedule.INTERLEAVED, 2) == 2.5
    # (the states differ: ZeRO keeps the token table whole, the head reads it too)
    assert first.memory.activations == memory(2.5).activations
    assert memory(2.5).activations > memory(2.0).activations


def test_explain_counts_each_chunks_own_sends(interleaved):
    """An interleaved stage sends each chunk's output on (and its gradient back), the
    last stage's first chunk back to the first stage (the wrap-around): `planner
    explain`'s traffic table counts each chunk's bytes, not the span's last layer's
    once per chunk."""
    graph, cluster, plan = interleaved
    layers = [dataclasses.replace(layer, output_bytes=1000.0 * (i + 1))
              for i, layer in enumerate(graph.layers)]
    expected: dict[str, float] = {}  # one pipeline's, the most of any (they run side by side)
    for p in plan.pipelines:
        assert all(len(s.chunks) == 2 for s in p.stages)
        # the model's chunks in order, each on its stage's node, hand on to the next
        order = sorted((chunk, s.devices.node) for s in p.stages for chunk in s.chunks)
        sent: dict[str, float] = {}
        for ((_, end), a), (_, b) in itertools.pairwise(order):
            sent[f"{a} -> {b}"] = sent.get(f"{a} -> {b}", 0.0) + 2 * p.num_microbatches * (
                p.micro_batch * layers[end - 1].output_bytes)
        expected = {k: max(v, expected.get(k, 0.0)) for k, v in sent.items()}
    assert len(expected) == 2  # both ways between the nodes
    rows = {r.where.split(",")[0]: r for r in traffic(plan, layers, AnalyticalCostModel(cluster))
            if r.kind == "pp activations"}
    assert {k: r.bytes_per_step for k, r in rows.items()} == pytest.approx(expected)


def test_the_last_stage_sends_each_rounds_output_back_to_the_first(interleaved):
    """Interleaved, the last stage hands each round's output but the final one's to the
    first stage's next chunk: `stage_timings` prices that wrap-around as the last
    stage's send, sharing the cards with the other sends, and the closed form pays it
    v - 1 times each way in the fill."""
    from cost_models.comm import shared_by
    from planner.solver.predict import plan_send_sharing, stage_timings
    from planner.solver.timing import pipeline_time

    graph, cluster, plan = interleaved
    costs = AnalyticalCostModel(cluster)
    flows = plan_send_sharing(plan)
    # two pipelines, each a send A100 -> V100 and one back, through each node's card
    assert flows == {n.name: 4 for n in cluster.nodes}
    for p, timings in zip(plan.pipelines, stage_timings(plan, graph.layers, costs), strict=True):
        first, last = p.stages[0].devices.node, p.stages[-1].devices.node
        (_, end), _ = p.stages[-1].chunks
        nbytes = graph.layers[end - 1].output_bytes * p.micro_batch
        wrap = costs.p2p_time(nbytes * shared_by(flows, last, first), last, first)
        assert wrap > 0 and timings[-1].send == pytest.approx(wrap)
        alone = pipeline_time([*timings[:-1], dataclasses.replace(timings[-1], send=0.0)],
                              p.num_microbatches, schedule=p.schedule, interleave=2)
        both = pipeline_time(timings, p.num_microbatches, schedule=p.schedule, interleave=2)
        assert both.pp_comm - alone.pp_comm >= 2 * wrap * (1 - 1e-9)
        # `planner explain` shows one pipeline's sends each way, both of its chunks' on
        # and its first chunk's back, at the prediction's prices
        rows = {r.where.split(",")[0]: r for r in traffic(plan, graph.layers, costs)
                if r.kind == "pp activations"}
        m = p.num_microbatches
        assert rows[f"{first} -> {last}"].seconds == pytest.approx(2 * m * 2 * timings[0].send)
        assert rows[f"{last} -> {first}"].seconds == pytest.approx(2 * m * timings[-1].send)
        assert all("each of 2 pipelines" in r.where for r in rows.values())
