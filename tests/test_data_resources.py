"""Input rates as constraints (issue 51, item 4): a node's data-loading budget and a
device type's input rate in the cluster spec, the step's loading floor (`step.fed`),
the solver avoiding plans it slows, `explain` naming it, and bad values refused."""

import dataclasses
import random
import textwrap

import pytest
import yaml
from typer.testing import CliRunner

from cli.main import app
from cost_models.cluster import cluster_to_dict, load_cluster, parse_cluster
from cost_models.model import AnalyticalCostModel
from planner.data.choose import on_data
from planner.data.loading import Feed, InputRates, input_rates, loading, plan_loading
from planner.data.profile import Sample, lognormal_lengths, summarize
from planner.errors import PlannerError
from planner.explain import explain
from planner.models import model_spec
from planner.simulate import OPTIMIZER, SYNC, simulate
from planner.small_batch import small_batch
from planner.solver import SolveOptions, solve
from planner.solver.limits import Limits
from planner.solver.predict import pipeline_times, predict, replay, stage_timings
from planner.solver.step import floor, step_time
from planner.solver.timing import StageTiming
from planner.timeline import build_timeline
from planner.trace import trace_model
from planner.types import TrainingSpec
from planner.types.cluster import DataRate

TWO_NODES = """\
    schema_version: 1
    name: fed
    network: {bandwidth: 100Gbps, latency: 5us}
    nodes:
      - name: a
        device: A100-40G-SXM
        devices: 2
        data_loading: 2k samples/s
      - name: b
        device: {base: A100-40G-SXM, name: A100-streamed, input_rate: 1.5M tokens/s}
        devices: 2
        data_loading: 200 samples/s
    """


def write(tmp_path, text: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.fixture(scope="module")
def opt():
    graph = trace_model(model_spec("opt-125m", {"layers": 4}), seq_len=512, dtype="fp16")
    return graph, TrainingSpec(global_batch=64, seq_len=512, dtype="fp16")


def with_loading(cluster, node: str, per_second: float):
    """`cluster` with node `node`'s loaders producing `per_second` samples/s."""
    return dataclasses.replace(cluster, nodes=tuple(
        dataclasses.replace(n, data_loading=DataRate(per_second=per_second, unit="samples"))
        if n.name == node else n for n in cluster.nodes))


def placed(plan) -> list[tuple[int, str]]:
    """Each pipeline's samples and its first stage's node."""
    return sorted((p.batch_share, p.stages[0].devices.node) for p in plan.pipelines)


# ---------------------------------------------------------------- the cluster spec

def test_rates_are_read_and_written_back(tmp_path):
    cluster = load_cluster(write(tmp_path, TWO_NODES))
    a, b = cluster.nodes
    assert a.data_loading == DataRate(per_second=2000.0, unit="samples")
    assert b.data_loading == DataRate(per_second=200.0, unit="samples")
    assert a.device.input_rate is None
    assert b.device.input_rate == DataRate(per_second=1.5e6, unit="tokens")
    again = parse_cluster(yaml.safe_load(yaml.safe_dump(cluster_to_dict(cluster))), "again")
    assert [(n.data_loading, n.device.input_rate) for n in again.nodes] == [
        (n.data_loading, n.device.input_rate) for n in cluster.nodes]
    training = TrainingSpec(global_batch=64, seq_len=512, dtype="fp16")
    rates = input_rates(cluster, training)
    # tokens count the training's sequence length per sample
    assert rates == InputRates(nodes={"a": 2000.0, "b": 200.0},
                               types={"A100-streamed": 1.5e6 / 512})


@pytest.mark.parametrize("field, value, needle", [
    ("data_loading", "0 samples/s", "must be a finite rate above zero for node 'a'"),
    ("data_loading", "-5 samples/s", "must be a finite rate above zero for node 'a'"),
    ("data_loading", "1e400 tokens/s", "must be a finite rate above zero for node 'a'"),
    ("data_loading", "100Gbps", "must be a rate in samples/s or tokens/s for node 'a'"),
    ("data_loading", "2000", "must be a rate in samples/s or tokens/s for node 'a'"),
    ("data_loading", "5 samples", "must be a rate in samples/s or tokens/s for node 'a'"),
])
def test_bad_rates_name_the_field_and_node(tmp_path, field, value, needle):
    text = TWO_NODES.replace("data_loading: 2k samples/s", f"{field}: {value}")
    with pytest.raises(PlannerError) as exc:
        load_cluster(write(tmp_path, text))
    assert "line 8, nodes[0].data_loading: " + needle in exc.value.message
    assert "samples/s" in exc.value.remedies[0]


def test_a_bad_device_input_rate_names_the_field_and_node(tmp_path):
    text = TWO_NODES.replace("input_rate: 1.5M tokens/s", "input_rate: 0 tokens/s")
    with pytest.raises(PlannerError) as exc:
        load_cluster(write(tmp_path, text))
    assert ("nodes[1].device.input_rate: must be a finite rate above zero for node 'b'"
            in exc.value.message)


def test_tokens_need_a_sequence_length(tmp_path):
    cluster = load_cluster(write(tmp_path, TWO_NODES))
    with pytest.raises(PlannerError) as exc:
        input_rates(cluster, TrainingSpec(global_batch=64, dtype="fp16"))
    assert "device 'A100-streamed''s input_rate is given in tokens/s" in exc.value.message


def test_the_cli_refuses_a_bad_rate_in_one_paragraph(tmp_path):
    path = write(tmp_path, TWO_NODES.replace("200 samples/s", "-1 samples/s"))
    result = CliRunner().invoke(app, ["solve", "opt-125m", "-c", path, "-B", "64"])
    assert result.exit_code == 1
    assert "nodes[1].data_loading: must be a finite rate above zero for node 'b'" in (
        result.output)
    assert "Traceback" not in result.output


# ---------------------------------------------------------------- the step model

def test_loading_is_the_nodes_sum_or_a_devices_own():
    rates = InputRates(nodes={"a": 100.0}, types={"T": 10.0})
    # two pipelines read on node a: its loaders load both
    both = loading(rates, [Feed("a", "U", 30.0), Feed("a", "U", 20.0), Feed("b", "U", 99.0)])
    assert both is not None and both.seconds == pytest.approx(0.5) and both.where == "node a"
    # a device of type T takes in 10 samples/s: its pipeline's 8 samples take 0.8 s
    device = loading(rates, [Feed("a", "T", 8.0), Feed("b", "U", 20.0)])
    assert device is not None and device.where == "device type T"
    assert device.seconds == pytest.approx(0.8)
    assert loading(None, [Feed("a", "T", 8.0)]) is None


def test_loading_is_a_floor_of_the_pipelines():
    fast = step_time([0.3, 0.2], sync=0.1, optimizer=0.05)
    assert fast.total == 0.3 + 0.05 + 0.1  # no loading: the step as before, exactly
    assert step_time([0.3, 0.2], 0.1, 0.05, loading=0.25).total == fast.total
    slow = step_time([0.3, 0.2], 0.1, 0.05, loading=0.5)
    assert slow.pipelines == 0.5 and slow.total == pytest.approx(0.65)
    # floors of the pipelines alone stay floors of a step fed more slowly
    assert floor(0.3, 0.1, 0.05) <= slow.total


# ---------------------------------------------------------------- solver and explain

def test_slow_loading_changes_the_plan(opt):
    graph, training = opt
    cluster = load_cluster("2x2xA100-40G")
    options = SolveOptions(gap=0.0)
    free = solve(graph, cluster, training, options)[0]
    # four pipelines, two read on each node
    assert placed(free) == [(16, "a100-40g-sxm-0")] * 2 + [(16, "a100-40g-sxm-1")] * 2
    slow = with_loading(cluster, "a100-40g-sxm-1", 200.0)  # 32 samples: 160 ms a step
    plan = solve(graph, slow, training, options)[0]
    assert plan_loading(plan) is None or plan_loading(plan).where != "node a100-40g-sxm-1"
    assert all(node == "a100-40g-sxm-0" for _, node in placed(plan))
    # the plan of the free cluster would wait for node 1's loaders
    waited = predict(dataclasses.replace(free, cluster=slow), graph.layers,
                     AnalyticalCostModel(slow))
    assert waited.step_time == pytest.approx(32 / 200 + waited.dp_comm + waited.optimizer)
    assert plan.prediction.step_time < waited.step_time
    assert plan.prediction.step_time > free.prediction.step_time
    # the first node slowed instead: placement fills the faster loaders' nodes first
    first = solve(graph, with_loading(cluster, "a100-40g-sxm-0", 200.0), training, options)[0]
    assert placed(first) == [(node_share, "a100-40g-sxm-1") for node_share, _ in placed(plan)]
    assert first.prediction.step_time == pytest.approx(plan.prediction.step_time)


def test_a_device_input_rate_bounds_each_pipeline(opt):
    graph, training = opt
    cluster = load_cluster("1x2xA100-40G")
    capped = dataclasses.replace(cluster, nodes=tuple(dataclasses.replace(n, device=(
        dataclasses.replace(n.device, input_rate=DataRate(per_second=100.0, unit="samples"))))
        for n in cluster.nodes))
    plan = solve(graph, capped, training, SolveOptions(gap=0.0))[0]
    most = max(p.batch_share for p in plan.pipelines)
    times = pipeline_times(plan, stage_timings(plan, graph.layers, AnalyticalCostModel(capped)))
    assert max(t.total for t in times) < most / 100  # it waits for its input
    prediction = plan.prediction
    assert prediction.step_time == pytest.approx(most / 100 + prediction.dp_comm
                                                 + prediction.optimizer)
    # the wait is in the bubble term, so the terms still add up to the step
    assert sum(prediction.terms().values()) == pytest.approx(prediction.step_time)


def test_a_cluster_without_rates_prices_as_before(opt):
    graph, training = opt
    cluster = load_cluster("2x2xA100-40G")
    assert input_rates(cluster, training) is None
    plan = solve(graph, cluster, training, SolveOptions(gap=0.0))[0]
    # loaders far faster than the pipelines change nothing, to the last bit
    fast = with_loading(with_loading(cluster, "a100-40g-sxm-0", 1e9), "a100-40g-sxm-1", 1e9)
    again = solve(graph, fast, training, SolveOptions(gap=0.0))[0]
    assert again.prediction == plan.prediction
    assert placed(again) == placed(plan)


def test_explain_names_the_loading_that_binds(opt):
    graph, training = opt
    one = with_loading(load_cluster("1x2xA100-40G"), "a100-40g-sxm-0", 200.0)
    plan = solve(graph, one, training, SolveOptions(gap=0.0))[0]
    told = explain(plan, graph.layers)
    assert told.binding == "data loading on node a100-40g-sxm-0 limits the step to 320 ms"
    assert told.headline.endswith("data-loading-bound on node a100-40g-sxm-0.")
    why = [r.text for r in told.reasons if r.kind == "loading"]
    assert len(why) == 1 and "64 samples per step at 200 samples/s (320 ms)" in why[0]
    assert not any("compute-bound" in r.text for r in told.reasons)
    # where the loaders keep up, explain says nothing of them
    quick = solve(graph, with_loading(one, "a100-40g-sxm-0", 1e6), training,
                  SolveOptions(gap=0.0))[0]
    quiet = explain(quick, graph.layers)
    assert "loading" not in quiet.binding and all(r.kind != "loading" for r in quiet.reasons)


# ---------------------------------------------------------------- the simulator and the data

def loading_bound(opt):
    """The solver's plan where one node's loaders (200 samples/s) read all 64 samples of
    a step: 320 ms of loading, longer than its pipelines (data-parallel ones, tp 1: a
    tp-2 plan ties with it at the loading's 320 ms)."""
    graph, training = opt
    cluster = with_loading(load_cluster("1x2xA100-40G"), "a100-40g-sxm-0", 200.0)
    plan = solve(graph, cluster, training, SolveOptions(gap=0.0, limits=Limits(tp=1)))[0]
    assert plan_loading(plan).seconds == pytest.approx(0.32)
    return graph, cluster, plan


def test_the_simulator_waits_for_the_input_as_predict_does(opt):
    graph, cluster, plan = loading_bound(opt)
    simulation = replay(plan, graph.layers, AnalyticalCostModel(cluster))
    assert max(simulation.pipeline_times) < 0.32 == simulation.pipelines
    assert simulation.step_time == pytest.approx(plan.prediction.step_time)
    # the sync and the optimizer step start once the input is loaded
    after = [e for e in simulation.events if e.kind in (SYNC, OPTIMIZER)]
    assert after and min(e.start for e in after) >= 0.32
    # loading shorter than the pipelines changes nothing
    stages = [[StageTiming(fwd=1.0, bwd=2.0, send=0.1)] * 2]
    plain = simulate(stages, [4], sync=0.5, optimizer=0.1)
    assert simulate(stages, [4], sync=0.5, optimizer=0.1, loading=1.0) == plain
    waited = simulate(stages, [4], sync=0.5, optimizer=0.1, loading=20.0)
    assert waited.step_time == pytest.approx(20.6) and waited.pipelines == 20.0
    with pytest.raises(ValueError, match="loading times must be >= 0"):
        simulate(stages, [4], loading=-1.0)


def test_the_timeline_draws_the_sync_after_the_input_is_loaded(opt):
    graph, cluster, plan = loading_bound(opt)
    timeline = build_timeline(plan, graph.layers, AnalyticalCostModel(cluster))
    assert timeline.step_time == pytest.approx(plan.prediction.step_time)
    after = [bar for bar in timeline.bars if bar.kind in (SYNC, OPTIMIZER)]
    assert after and min(bar.start for bar in after) >= 0.32


def test_a_data_profile_prices_the_wait_for_the_input(opt):
    graph, cluster, plan = loading_bound(opt)
    costs = AnalyticalCostModel(cluster)
    lengths = lognormal_lengths(2000, median=64, sigma=1.0, low=1, high=512,
                                rng=random.Random(5))
    profile = summarize([Sample(tokens=n) for n in lengths], "t")
    free = on_data(plan, graph.layers, AnalyticalCostModel(load_cluster("1x2xA100-40G")),
                   profile, draws=4)
    assert free.slowest < 0.32  # short samples: the pipelines alone are quicker still
    fed = on_data(plan, graph.layers, costs, profile, draws=4)
    # every drawn step waits for its 64 samples, as the plan's prediction does
    assert fed.expected == pytest.approx(plan.prediction.step_time)
    assert fed.slowest == pytest.approx(fed.expected) == pytest.approx(fed.mean_step)
    assert fed.idle > free.idle


def test_a_loading_bound_plan_is_not_told_to_grow_its_batch(opt):
    *_, plan = loading_bound(opt)
    prediction = plan.prediction
    # the pipelines' wait for the input is in the bubble: most of the step
    assert prediction.bubble > 0.5 * prediction.step_time
    assert small_batch(plan) is None  # it grows with the batch: no batch hides it
    # the same terms with a bubble of the pipelines' own: the warning, as before
    unfed = small_batch(dataclasses.replace(plan, cluster=load_cluster("1x2xA100-40G")))
    assert unfed is not None and "bubble" in unfed.fixed_terms
    # where the sync outweighs the loading, the warning names the sync alone
    step = prediction.step_time
    synced = dataclasses.replace(plan, prediction=dataclasses.replace(
        prediction, dp_comm=prediction.dp_comm + 3 * step, step_time=4 * step))
    found = small_batch(synced)
    assert found is not None and found.fixed_terms == ("dp_comm", "optimizer")
    fixed = synced.prediction.dp_comm + synced.prediction.optimizer
    assert found.fixed_share == pytest.approx(fixed / (4 * step))
