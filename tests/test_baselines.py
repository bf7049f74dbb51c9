"""The baselines do not depend on the order of the cluster file's nodes: their recipes
take the devices fastest type first and hand the micro-batches an even split leaves
over to the fastest pipelines (reversing one file moved the data-parallel baseline by
37%, so "Nx faster than data parallelism" changed with it)."""

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cost_models.cluster import load_cluster
from cost_models.model import AnalyticalCostModel
from planner.models import model_spec
from planner.solver import Limits, SolveOptions, solve
from planner.solver.baselines import baselines
from planner.solver.uniform import megatron_bounds, uniform_pipelines, uniform_plan
from planner.trace import trace_model
from planner.types import TrainingSpec
from planner.types.training import Recompute

# three device types, nodes of a type that differ in size, device counts that leave
# pipelines mixing types
CLUSTERS = ["1x3xA100-40G,1x3xV100-16G,1x2xT4@100Gbps",
            "1x2xA100-40G,1x4xA100-40G,1x3xV100-16G,1x2xT4@100Gbps"]


@pytest.fixture(scope="module")
def graph():
    return trace_model(model_spec("opt-125m", {"layers": 4}), seq_len=512, dtype="fp16")


def _reordered(cluster, order):
    return dataclasses.replace(cluster, nodes=tuple(cluster.nodes[i] for i in order))


def _baselines(graph, cluster, training, limits):
    def fastest_alone(alone):  # (as `solve` searches it, on the cluster it is handed)
        return solve(graph, alone, training, SolveOptions(gap=0.0, limits=limits,
                                                          with_baselines=False))[0]

    return {b.name: (b.prediction and b.prediction.step_time, b.description, b.reason)
            for b in baselines(layers=graph.layers, model=graph.spec, cluster=cluster,
                               training=training, costs=AnalyticalCostModel(cluster),
                               fastest_alone=fastest_alone, limits=limits)}


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), spec=st.sampled_from(CLUSTERS), batch=st.integers(9, 40),
       limits=st.sampled_from([Limits(), Limits(pp=2), Limits(pp=2, dp=3), Limits(pp=4)]))
def test_reordering_the_cluster_file_leaves_every_baseline_as_it_was(graph, data, spec,
                                                                     batch, limits):
    cluster = load_cluster(spec)
    order = data.draw(st.permutations(range(len(cluster.nodes))))
    training = TrainingSpec(global_batch=batch, seq_len=512, dtype="fp16")
    assert _baselines(graph, _reordered(cluster, order), training, limits) == _baselines(
        graph, cluster, training, limits)


@pytest.mark.parametrize("spec", CLUSTERS)
def test_a_solve_on_the_reversed_file_reports_the_same_baselines(graph, spec):
    cluster = load_cluster(spec)
    training = TrainingSpec(global_batch=30, seq_len=512, dtype="fp16")
    plans = [solve(graph, c, training, SolveOptions(gap=0.0))[0]
             for c in (cluster, _reordered(cluster, range(len(cluster.nodes) - 1, -1, -1)))]
    first, second = ([(b.name, b.prediction and b.prediction.step_time, b.description)
                      for b in plan.baselines] for plan in plans)
    assert first == second


def test_a_fixed_recipe_hands_the_left_over_micro_batches_to_the_fastest_pipelines(graph):
    """`planner estimate` keeps the file's order for placement, but not for the shares:
    6 micro-batches over 4 replicas run 2 on each A100 and 1 on each V100, whichever
    node the file lists first."""
    training = TrainingSpec(global_batch=6, seq_len=512, dtype="fp16")
    steps = []
    for spec in ("1x2xV100-16G,1x2xA100-40G@100Gbps", "1x2xA100-40G,1x2xV100-16G@100Gbps"):
        cluster = load_cluster(spec)
        plan = uniform_plan(layers=graph.layers, model=graph.spec, cluster=cluster,
                            training=training, costs=AnalyticalCostModel(cluster), tp=1, pp=1)
        assert sorted((p.stages[0].device_type, p.num_microbatches) for p in plan.pipelines) == [
            ("A100-40G-SXM", 2), ("A100-40G-SXM", 2), ("V100-16G", 1), ("V100-16G", 1)]
        steps.append(plan.prediction.step_time)
    assert steps[0] == pytest.approx(steps[1], rel=1e-12)


def test_pipelines_alike_in_pace_take_the_left_overs_by_device_type_name(graph):
    """Pipelines paced by the same kind of device are told apart by their types' names,
    not by where the file puts them: 3 micro-batches over an A100 + V100 pipeline and a
    V100 + V100 one run 2 on the first (the faster), in either order of the nodes."""
    training = TrainingSpec(global_batch=3, seq_len=512, dtype="fp16")
    for spec in ("1x1xA100-40G,1x3xV100-16G@100Gbps", "1x3xV100-16G,1x1xA100-40G@100Gbps"):
        cluster = load_cluster(spec)
        plan = uniform_plan(layers=graph.layers, model=graph.spec, cluster=cluster,
                            training=training, costs=AnalyticalCostModel(cluster), tp=1, pp=2)
        counts = {frozenset(s.device_type for s in p.stages): p.num_microbatches
                  for p in plan.pipelines}
        assert counts == {frozenset({"A100-40G-SXM", "V100-16G"}): 2,
                          frozenset({"V100-16G"}): 1}


@pytest.mark.parametrize("spec", ["1x2xA100-80G,1x2xA100-40G@100Gbps",
                                  "1x2xA100-40G,1x2xA100-80G@100Gbps"])
def test_the_fastest_type_baseline_is_the_search_of_the_type_it_names(graph, spec):
    """Two types of one peak FLOP/s (A100 40G and 80G): the faster memory breaks the tie,
    and the solve's search of the fastest type alone and the baseline that reports it
    take the same type whatever the file's order (the search took the first in the file,
    the baseline the first by name)."""
    training = TrainingSpec(global_batch=16, seq_len=512, dtype="fp16")
    options = SolveOptions(gap=0.0, with_baselines=False)
    alone = solve(graph, load_cluster("1x2xA100-80G"), training, options)[0]
    slower = solve(graph, load_cluster("1x2xA100-40G"), training, options)[0]
    assert alone.prediction.step_time < slower.prediction.step_time  # (so they differ)
    plan = solve(graph, load_cluster(spec), training, SolveOptions(gap=0.0))[0]
    (fastest,) = (b for b in plan.baselines if b.name == "fastest-type")
    assert "A100-80G-SXM devices alone" in fastest.description
    assert fastest.prediction.step_time == pytest.approx(alone.prediction.step_time)


GPT3_4096 = "128x8xH100,128x8xA100-80G,128x8xV100-32G,128x8xL4@400Gbps"


@pytest.fixture(scope="module")
def gpt3():
    return trace_model(model_spec("gpt3-175b"), seq_len=2048, dtype="fp16")


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), blocks=st.integers(1, 160))
def test_an_uneven_megatron_split_keeps_the_extra_blocks_off_the_embedding_and_head(
        gpt3, data, blocks):
    """Blocks that do not divide evenly: runs differ by one block at most, and the first
    and last (which hold the embedding and the head too) are never longer than a run
    between them (rounding the even cuts gave 96 blocks in 64 stages 2, 1, 2, ..., 1, 2:
    both ends the extra block)."""
    parts = data.draw(st.integers(1, blocks))
    embedding, block, head = gpt3.layers[0], gpt3.layers[1], gpt3.layers[-1]
    layers = [embedding, *(dataclasses.replace(block, index=i + 1) for i in range(blocks)),
              dataclasses.replace(head, index=blocks + 1)]
    bounds = megatron_bounds(layers, parts)
    assert [a for a, _ in bounds[1:]] == [b for _, b in bounds[:-1]]
    assert (bounds[0][0], bounds[-1][1]) == (0, blocks + 2)
    counts = [b - a for a, b in bounds]
    counts[0] -= 1  # (the embedding)
    counts[-1] -= 1  # (the head)
    assert max(counts) - min(counts) <= 1
    if parts > 2:
        assert max(counts[0], counts[-1]) <= min(counts[1:-1])


def test_a_uniform_recipe_fits_gpt3_175b_down_to_l4s(gpt3):
    """GPT-3 175B on 4,096 GPUs of four types, the smallest 24 GB L4s: tp 4 x pp 64 with
    full recompute fits every device (20.8 GiB of the L4s' 22.5), the embedding and the
    head beside 1 block each. The Megatron split had rounded its 96 blocks over 64 stages
    to 2 beside each (30.4 GiB on the first stage), and the uniform baseline said no
    recipe fits in memory (RESULTS.md had it 4.81x slower than the plan)."""
    cluster = load_cluster(GPT3_4096)
    training = TrainingSpec(global_batch=3072, seq_len=2048, dtype="fp16")
    costs = AnalyticalCostModel(cluster)
    pipelines = uniform_pipelines(layers=gpt3.layers, cluster=cluster, training=training,
                                  costs=costs, tp=4, pp=64, recompute=Recompute.FULL,
                                  must_fit=True)
    assert pipelines is not None
    first, *_, last = pipelines[0].stages
    assert (first.layers, last.layers) == ((0, 2), (96, 98))
    (uniform,) = (b for b in baselines(layers=gpt3.layers, model=gpt3.spec, cluster=cluster,
                                       training=training, costs=costs,
                                       fastest_alone=lambda alone: None)
                  if b.name == "uniform")
    assert uniform.prediction is not None, uniform.reason
