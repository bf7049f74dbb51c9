"""The step model (`planner.solver.step`): the one rule that turns terms into a step, and
its floors, which the search, predictions, the simulator and the timeline share."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from cost_models.cluster import load_cluster
from cost_models.memory import stage_memory
from cost_models.model import AnalyticalCostModel
from planner.models import model_spec
from planner.simulate import OPTIMIZER, SYNC, simulate
from planner.solver.step import (
    Contention,
    StepTime,
    floor,
    pipelines_within,
    step_time,
    synced,
    unsynced,
)
from planner.solver.table import build_table
from planner.solver.timing import StageTiming
from planner.trace import trace_model
from planner.types import SyncSpec, TrainingSpec


@pytest.mark.parametrize("seed", range(20))
def test_a_floor_of_term_floors_is_below_every_step_of_larger_terms(seed):
    rng = random.Random(seed)
    floors = [rng.uniform(0, 10) for _ in range(3)]
    for _ in range(20):
        terms = [x + rng.choice([0.0, rng.uniform(0, 5)]) for x in floors]
        step = step_time([terms[0], rng.uniform(0, terms[0])], terms[1], terms[2])
        assert floor(*floors) <= step.total
    assert floor(*floors) == pytest.approx(synced(unsynced(floors[0], floors[2]), floors[1]))
    bar = floor(*floors)
    assert pipelines_within(bar, floors[1], floors[2]) == pytest.approx(floors[0])


def test_floors_hold_on_arrays_element_by_element():
    pipelines, sync, optimizer = np.array([1.0, 2.0]), np.array([0.5, 0.0]), 0.25
    assert floor(pipelines, sync, optimizer).tolist() == [1.75, 2.25]
    assert synced(unsynced(pipelines, optimizer), sync).tolist() == [1.75, 2.25]


def test_the_simulators_sync_and_optimizer_are_the_step_models_phases():
    stages = [StageTiming(fwd=1.0, bwd=2.0, send=0.1), StageTiming(fwd=1.5, bwd=2.5)]
    sim = simulate([stages, stages[:1]], [4, 3], sync=0.7, optimizer=0.3)
    step = StepTime(pipelines=max(sim.pipeline_times), sync=0.7, optimizer=0.3)
    assert sim.step_time == step.total
    for phase in step.phases():
        events = [e for e in sim.events if e.kind == phase.kind]
        assert len(events) == 3  # every device of both pipelines
        assert {(e.start, e.end) for e in events} == {(phase.start, phase.end)}
    assert [p.kind for p in step.phases()] == [SYNC, OPTIMIZER]


@pytest.mark.parametrize("zero, shards", list(itertools.product(range(4), (1, 2, 5))))
def test_the_tables_bytes_per_parameter_are_the_memory_models(zero, shards):
    graph = trace_model(model_spec("gpt-tiny"), seq_len=64, dtype="fp16")
    cluster = load_cluster("1x2xA100-80G")
    training = TrainingSpec(global_batch=8, seq_len=64, dtype="fp16")
    table = build_table(graph.layers, cluster, training, AnalyticalCostModel(cluster),
                        tps=(1,), micro_batches=(1,))
    layers = [layer for layer in graph.layers if not layer.tied]
    held = stage_memory(layers, device=cluster.nodes[0].device, training=training,
                        dp=shards, zero=zero)
    params = sum(layer.params for layer in layers)
    assert table.bytes_per_param(zero, shards) * params == pytest.approx(
        held.weights + held.gradients + held.optimizer)


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_the_splits_activation_capacity_is_the_memory_models(policy):
    """One rule for the activations a stage keeps (`cost_models.memory.kept_activations`):
    the most micro-batches in flight the exact splits let a layer range hold
    (`partition._capacity`) fit in memory as the reports price it (`stage_memory`), and
    one more does not."""
    from planner.solver.partition import Option, _capacity
    from planner.types.model import zero_kept
    from planner.types.training import Recompute

    recompute = Recompute(policy)
    graph = trace_model(model_spec("gpt2-small"), seq_len=1024, dtype="fp16")
    cluster = load_cluster("1x1xT4")
    training = TrainingSpec(global_batch=8, seq_len=1024, dtype="fp16")
    table = build_table(graph.layers, cluster, training, AnalyticalCostModel(cluster),
                        tps=(1,), micro_batches=(1, 4))
    info = table.types[0]
    for mb in (1, 4):
        most = _capacity(table, info.name, 1, mb, 1, (Option(recompute, 0),))[0]
        checked = 0
        for a, b in [(0, 1), (1, 3), (0, table.num_layers), (2, table.num_layers - 1)]:
            if not 1 <= most[a, b] < 10**6:
                continue
            layers = list(graph.layers[a:b])
            kept = zero_kept(graph.layers, {x.index for x in layers}, 0)
            flight = int(np.floor(most[a, b] + 1e-9))
            totals = [stage_memory(layers, device=cluster.nodes[0].device, training=training,
                                   recompute=recompute, micro_batch=mb, in_flight=f,
                                   kept=kept).total for f in (flight, flight + 1)]
            assert totals[0] <= info.memory * (1 + 1e-9) < totals[1] * (1 + 2e-9)
            checked += 1
        assert checked


def test_an_overlapped_sync_and_the_backward_beside_it_slow_each_other():
    """Contention (`step.Contention`): computing takes half again as long while the sync
    is in flight, the sync a quarter longer beside it. A 2 s sync over 1 s of backward:
    the backward takes 1.5 s (0.5 s more), the sync does 1.2 s of its work meanwhile and
    pays the other 0.8 s after. Over 2.5 s of backward, the 1.75 s of a 2 s sync before
    its last bucket take 2.1875 s, the backward a third longer meanwhile, and the last
    bucket's 0.25 s come after."""
    overlap, both = SyncSpec(overlap=True), Contention(compute=0.5, sync=0.25)
    step = step_time([3.0], 2.0, 0.5, 1.0, overlap, contention=both)
    assert (step.slowed, step.exposed, step.total) == pytest.approx((0.5, 0.8, 4.8))
    assert step_time([3.0], 2.0, 0.5, 1.0, overlap).total == 4.5  # (without contention)
    step = step_time([3.0], 2.0, 0.5, 2.5, overlap, tail=0.25, contention=both)
    assert (step.slowed, step.exposed) == pytest.approx((2.1875 / 3, 0.25))
    assert step.total == pytest.approx(3.0 + 2.1875 / 3 + 0.25 + 0.5)
    sync, optimizer = step.phases()
    assert (sync.end, optimizer.start) == pytest.approx((3.0 + 2.1875 / 3 + 0.25,) * 2)
    # a sync in one bucket starts as backward ends: nothing runs beside it
    whole = step_time([3.0], 2.0, 0.5, 2.5, overlap, tail=2.0, contention=both)
    assert (whole.slowed, whole.exposed) == (0.0, 2.0)
    # a sync after backward overlaps nothing and slows nothing
    after = step_time([3.0], 2.0, 0.5, 1.0, SyncSpec(), contention=both)
    assert (after.slowed, after.total) == (0.0, 5.5)


@pytest.mark.parametrize("seed", range(10))
def test_contention_only_adds_to_a_step_so_its_floors_hold(seed):
    """A step with contention is never shorter than without it (what backward loses, the
    sync gains back at its own slowed pace at most), so the floors the search builds
    without it stay below."""
    rng = random.Random(seed)
    for _ in range(50):
        policy = rng.choice([SyncSpec(overlap=True), SyncSpec(), SyncSpec(
            mode="local-sgd", interval=4, overlap=True)])
        pipelines, sync, optimizer = (rng.uniform(0, 10) for _ in range(3))
        hidden = rng.uniform(0, pipelines)
        tail = rng.choice([0.0, rng.uniform(0, sync / policy.interval)])
        contention = Contention(compute=rng.choice([0.0, rng.uniform(0, 2)]),
                                sync=rng.choice([0.0, rng.uniform(0, 2)]))
        alone = step_time([pipelines], sync, optimizer, hidden, policy, tail=tail)
        beside = step_time([pipelines], sync, optimizer, hidden, policy, tail=tail,
                           contention=contention)
        assert beside.total >= alone.total * (1 - 1e-12)
        assert floor(pipelines, sync, optimizer, policy) <= beside.total * (1 + 1e-12)
        assert beside.slowed >= 0 and beside.exposed >= tail
