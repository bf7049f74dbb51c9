"""Gradient sync (issue 48): sums that overlap backward, and sync modes for slow links
(local SGD, model averaging, DiLoCo), in the runtime and in the step model."""

import dataclasses
import json
import random

import pytest
from typer.testing import CliRunner

from cli.main import app
from planner.errors import PlannerError
from planner.planfile import plan_json, read_plan, write_plan
from planner.runtime.summary import read_losses
from planner.solver.step import floor, pipelines_within, step_time, synced, unsynced
from planner.sync import AutoSync, parse_sync, solve_auto
from planner.types import SyncSpec, TrainingSpec
from tests.runtime_helpers import on_devices, run_ranks, tiny_plan
from tests.solver_tables import random_instance
from tests.test_runtime import _check_against_reference, _run
from tests.test_solver_search import (
    assert_equals_brute_force,
    check_both_parts_subtree_bounds,
)

slow = pytest.mark.slow


def _with_sync(plan, **sync):
    return dataclasses.replace(plan, training=dataclasses.replace(
        plan.training, sync=SyncSpec(**sync)))


@slow
def test_sums_that_overlap_backward_train_as_one_process(tmp_path):
    """Two pipelines of two stages, shares 6 and 2, the tied table on both ends: with
    buckets of a few KiB (the plan's, which the runtime keeps) every stage starts several
    all-reduces within its last backward, and the run matches single-process training."""
    plan = _with_sync(tiny_plan("1x4xcpu", pp=2, dp=2, shares=[3, 1]), overlap=True,
                      bucket_mb=0.01)
    summary = _check_against_reference(plan, _run(tmp_path, plan))
    sync = summary["gradient_sync"]
    assert sync["overlap"] and sync["mode"] == "every-step"
    assert sync["exposed"] > 0 and sync["in_flight"] > 0
    ranks = summary["ranks"]
    assert all(r["sync_sums"] > 1 for r in ranks)
    # every bucket is complete, so started, before the schedule's step returns
    assert all(r["sync_started_in_backward"] == r["sync_sums"] for r in ranks)


@slow
@pytest.mark.parametrize("case", ["tensor-parallel", "interleaved", "zero", "followers"])
def test_overlapped_sums_on_every_kind_of_stage(tmp_path, case):
    """Tensor-parallel replicas (shards summed in backward, the parameters each tp rank
    holds whole summed in slices after it), an interleaved pipeline (each chunk's
    parameters complete at its own last backward; the tied table read on both stages),
    ZeRO-2 (FSDP's own reduce-scatters, the tied table beside them) and a wide stage's
    followers (its replicas sum their shards in their mirrored backward)."""
    if case == "tensor-parallel":
        plan = tiny_plan("1x4xcpu", tp=2, dp=2, shares=[3, 1])
    elif case == "interleaved":
        plan = tiny_plan("1x2xcpu", pp=2, interleave=2, micro_batch=2, batch=8)
    elif case == "zero":
        plan = tiny_plan("1x4xcpu", pp=2, dp=2, zero=2)
    else:
        plan = tiny_plan("1x6xcpu", pp=2, dp=2, shares=[3, 1])
        plan = on_devices(on_devices(plan, 0, [(0, 1), (2,)]), 1, [(3, 4), (5,)])
    plan = _with_sync(plan, overlap=True)
    summary = _check_against_reference(plan, _run(tmp_path, plan, bucket_mb=0.01))
    assert any(r["sync_started_in_backward"] for r in summary["ranks"])


def _losses(run_dir):
    got = read_losses(run_dir)
    return [got[step] for step in sorted(got)]


def _train(folder, plan, *, steps, **options):
    """Train `plan` (SGD unless told) into folder/run; its per-step losses."""
    folder.mkdir(exist_ok=True)
    write_plan(plan, folder / "plan.json", force=True)
    options.setdefault("optimizer", "sgd")
    run_ranks(folder / "plan.json", run_dir=folder / "run", steps=steps, **options)
    return _losses(folder / "run")


@slow
def test_local_sgd_with_one_step_between_syncs_is_every_step_sync(tmp_path):
    """Two pipelines of two stages, shares 6 and 2, the tied table on both ends of
    each: each pipeline steps on its own mean gradient (the tie summed within it) and
    the parameters are averaged weighted by the shares after every step, which for
    SGD is the every-step update: the run matches single-process training."""
    plan = _with_sync(tiny_plan("1x4xcpu", pp=2, dp=2, shares=[3, 1]), mode="local-sgd",
                      interval=1)
    summary = _check_against_reference(plan, _run(tmp_path, plan))
    assert summary["gradient_sync"]["mode"] == "local-sgd"


def _mlp_plan(*, dp, batch, micro_batch):
    """A uniform plan of `dp` one-stage pipelines for mlp-small (fp32) on CPU devices."""
    from cost_models.cluster import load_cluster
    from cost_models.model import AnalyticalCostModel
    from planner.models import load_model, model_spec
    from planner.solver.uniform import uniform_plan
    from planner.trace import trace_loaded
    from planner.types import TrainingSpec

    cluster = load_cluster(f"1x{dp}xcpu")
    graph = trace_loaded(load_model(model_spec("mlp-small"), device="meta"), dtype="fp32")
    return uniform_plan(layers=graph.layers, model=graph.spec, cluster=cluster,
                        training=TrainingSpec(global_batch=batch, dtype="fp32"),
                        costs=AnalyticalCostModel(cluster), tp=1, pp=1, dp=dp,
                        micro_batch=micro_batch)


@slow
def test_local_sgd_every_four_steps_learns_as_every_step_sync(tmp_path):
    """On a task mlp-small learns in a few dozen steps (tests.runtime_data.teacher), local
    SGD averaging every 4 steps ends within 5% of every-step sync's loss after the same
    samples (the mean of the last 8 steps'; benchmarks/sync.py draws both curves)."""
    plan = _mlp_plan(dp=2, batch=16, micro_batch=4)
    options = {"data": "tests.runtime_data:teacher", "steps": 48, "lr": 0.3,
               "final_checkpoint": False}
    every = _train(tmp_path / "every", plan, **options)
    local = _train(tmp_path / "local", _with_sync(plan, mode="local-sgd", interval=4),
                   **options)
    tail = slice(-8, None)
    assert sum(every[tail]) < 0.8 * 8 * every[0]  # (it learns)
    assert sum(local[tail]) == pytest.approx(sum(every[tail]), rel=0.05)
    assert local != every  # (the pipelines drift apart between syncs)


@slow
def test_averaging_weighs_each_pipeline_once_where_local_sgd_weighs_its_samples(tmp_path):
    """Shares 6 and 2: averaging every step with one weight per pipeline (torch's
    PeriodicModelAverager) is not every-step sync, local SGD's share-weighted average
    is; with equal shares the two are one."""
    uneven = tiny_plan("1x2xcpu", dp=2, shares=[3, 1])
    local = _train(tmp_path / "local", _with_sync(uneven, mode="local-sgd", interval=1),
                   steps=3)
    averaged = _train(tmp_path / "average", _with_sync(uneven, mode="average", interval=1),
                      steps=3)
    assert averaged[:1] == pytest.approx(local[:1]) and averaged[-1] != pytest.approx(
        local[-1], rel=1e-6)
    even = tiny_plan("1x2xcpu", dp=2)
    assert _train(tmp_path / "even-average", _with_sync(even, mode="average", interval=1),
                  steps=3) == pytest.approx(
        _train(tmp_path / "even-local", _with_sync(even, mode="local-sgd", interval=1),
               steps=3), rel=1e-6)


@slow
def test_diloco_resumes_with_its_outer_optimizer(tmp_path):
    """DiLoCo every 2 steps (inner SGD), checkpointed after step 2 and resumed to step
    6, trains as one run of 6 steps: the outer parameters and momentum come back from
    the checkpoint. With outer learning rate 1 and no momentum it is local SGD."""
    plan = _with_sync(tiny_plan("1x4xcpu", pp=2, dp=2, shares=[3, 1]), mode="diloco",
                      interval=2)
    whole = _train(tmp_path / "whole", plan, steps=6, lr=0.1)
    _train(tmp_path / "parts", plan, steps=2, lr=0.1)
    parts = _train(tmp_path / "parts", plan, steps=6, lr=0.1, resume=True)
    assert parts == pytest.approx(whole, rel=1e-6)
    assert len(set(whole)) == 6
    outer_one = _train(tmp_path / "outer-one", plan, steps=4, outer_lr=1.0,
                       outer_momentum=0.0)
    local = _train(tmp_path / "local", _with_sync(plan, mode="local-sgd", interval=2),
                   steps=4)
    assert outer_one == pytest.approx(local, rel=1e-5)


# --- the step model ---------------------------------------------------------------------

POLICIES = [SyncSpec(), SyncSpec(overlap=True), SyncSpec(mode="local-sgd", interval=4),
            SyncSpec(mode="diloco", interval=16), SyncSpec(overlap=True, bucket_mb=2**-10)]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.describe())
@pytest.mark.parametrize("seed", range(10))
def test_a_floor_of_term_floors_is_below_every_step_the_policy_pays(seed, policy):
    """Whatever the sync policy, a floor from floors of the terms is below the step of
    any larger terms, whatever backward the sync hides (at most the pipelines' time),
    and a floor found without the sync gives it by `synced`."""
    rng = random.Random(seed)
    for _ in range(50):
        floors = [rng.uniform(0, 10) for _ in range(3)]
        terms = [x + rng.choice([0.0, rng.uniform(0, 5)]) for x in floors]
        hidden = rng.choice([0.0, terms[0], rng.uniform(0, terms[0])])
        step = step_time([terms[0], rng.uniform(0, terms[0])], terms[1], terms[2], hidden,
                         policy)
        assert floor(*floors, policy) <= step.total * (1 + 1e-12)
        assert floor(*floors, policy) == pytest.approx(
            synced(unsynced(floors[0], floors[2]), floors[1], policy))
        # a step below `bar` needs pipelines below `pipelines_within`
        bar = step.total
        assert floor(pipelines_within(bar, terms[1], terms[2], policy), terms[1], terms[2],
                     policy) <= bar * (1 + 1e-12)
        assert terms[0] <= pipelines_within(bar, terms[1], terms[2], policy) * (1 + 1e-12)


def test_a_step_pays_what_backward_does_not_hide_or_a_share_of_the_sync():
    overlap, local = SyncSpec(overlap=True), SyncSpec(mode="local-sgd", interval=4)
    assert step_time([3.0], 2.0, 0.5).total == 5.5
    assert step_time([3.0], 2.0, 0.5, 0.75, overlap).total == 4.75  # 1.25 of 2 exposed
    assert step_time([3.0], 2.0, 0.5, 2.5, overlap).total == 3.5  # all of it hidden
    assert step_time([3.0], 2.0, 0.5, 0.75, local).total == 4.0  # 2 / 4, nothing hidden
    sync, optimizer = step_time([3.0], 2.0, 0.5, 0.75, overlap).phases()
    assert (sync.start, sync.end, optimizer.start) == (2.25, 4.25, 4.25)


def test_an_overlapped_sync_pays_its_last_bucket_whatever_backward_hides():
    """The last bucket (the first layers' gradients) is made only as backward ends, so
    its all-reduce (`tail`) is exposed however much backward there is to hide behind."""
    overlap = SyncSpec(overlap=True)
    assert step_time([3.0], 2.0, 0.5, 2.5, overlap, tail=0.25).total == 3.75
    assert step_time([3.0], 2.0, 0.5, 0.75, overlap, tail=0.25).total == 4.75  # 1.25 > 0.25
    assert step_time([3.0], 2.0, 0.5, 2.5, SyncSpec(), tail=0.25).total == 5.5  # whole sync
    sync, optimizer = step_time([3.0], 2.0, 0.5, 2.5, overlap, tail=0.25).phases()
    assert (sync.start, sync.end, optimizer.start) == (1.25, 3.25, 3.25)


@pytest.mark.parametrize("cluster", ["1x2xcpu", "2x1xcpu"])
def test_a_plan_whose_backward_hides_its_sync_pays_one_buckets_all_reduce(cluster):
    """tiny's backward outlasts its sync: cut into 1 KiB buckets, the step pays the last
    one's all-reduce on the sync's group, priced as the sync is; in the default 25 MiB
    bucket, which holds all of tiny's gradients, nothing is hidden."""
    from cost_models.comm import Collective, CommGroup
    from cost_models.model import AnalyticalCostModel

    plan = tiny_plan(cluster, dp=2)
    group = CommGroup.of([p.stages[0].devices.node for p in plan.pipelines])
    one_bucket = AnalyticalCostModel(plan.cluster).collective_time(
        Collective.ALL_REDUCE, 1024, group)
    small = _priced(plan, SyncSpec(overlap=True, bucket_mb=2**-10)).prediction
    assert small.compute > small.whole_sync > 4 * one_bucket
    assert small.dp_comm == pytest.approx(one_bucket, rel=1e-12)
    whole = _priced(plan, SyncSpec(overlap=True)).prediction
    assert whole.dp_comm == pytest.approx(whole.whole_sync, rel=1e-12)


@pytest.mark.parametrize("policy", POLICIES[1:], ids=lambda p: p.describe())
@pytest.mark.parametrize("seed", range(12))
def test_search_equals_brute_force_under_every_sync_policy(seed, policy):
    """The search prices and bounds a structure through `step.py` under the solve's
    sync policy (`CostTable.sync`) as brute force does."""
    table, batch, limits = random_instance(random.Random(seed))
    table = dataclasses.replace(table, sync=policy, cache={})
    assert_equals_brute_force(table, batch, limits)


@slow
@pytest.mark.parametrize("policy", POLICIES[1:], ids=lambda p: p.describe())
@pytest.mark.parametrize("seed", [1393, 12, 33, 5, 8299, 3, 17, 29])
def test_every_node_bound_is_below_every_structure_under_every_sync_policy(seed, policy):
    """The branch and bound's node bounds hold under the solve's sync policy as they do
    under the default (`test_solver_search`'s test of the same name)."""
    table, batch, limits = random_instance(random.Random(seed))
    table = dataclasses.replace(table, sync=policy, cache={})
    check_both_parts_subtree_bounds(table, batch, limits, seed)


# --- options, plan files, pricing -------------------------------------------------------

runner = CliRunner()
SLOW_NETWORK = "8x1xA100-80G@10Gbps"  # one GPU per node on 10 Gb/s Ethernet


@pytest.mark.parametrize(("text", "overlap", "most", "expected"), [
    ("every-step", False, None, SyncSpec()),
    ("every-step", True, None, SyncSpec(overlap=True)),
    ("local-sgd:4", False, None, SyncSpec(mode="local-sgd", interval=4)),
    ("DiLoCo:16", False, None, SyncSpec(mode="diloco", interval=16)),
    ("auto", False, 8, AutoSync(8)),
])
def test_sync_options_parse(text, overlap, most, expected):
    assert parse_sync(text, overlap=overlap, max_interval=most) == expected


@pytest.mark.parametrize(("text", "overlap", "most", "needle"), [
    ("every-step:4", False, None, "an interval goes with local-sgd, average or diloco"),
    ("local-sgd", False, None, "needs the steps between syncs: local-sgd:H"),
    ("local-sgd:0", False, None, "--sync local-sgd:H must be between 1 and 1024"),
    ("gossip:4", False, None, "is not one of every-step, local-sgd:H"),
    ("auto", False, None, "--sync auto needs --max-interval H"),
    ("local-sgd:4", False, 8, "--max-interval goes with --sync auto"),
    ("average:2", True, None, "nothing to overlap"),
])
def test_sync_options_name_what_is_wrong(text, overlap, most, needle):
    with pytest.raises(PlannerError) as caught:
        parse_sync(text, overlap=overlap, max_interval=most)
    assert needle in caught.value.message


@pytest.mark.parametrize(("args", "needle"), [
    (["solve", "--sync", "local-sgd:4", "--zero", "2"],
     "--zero 2 with --sync local-sgd:4: between syncs each pipeline steps its own optimizer"),
    (["estimate", "--sync", "auto"], "--sync auto lets `planner solve` pick the interval"),
    (["solve", "--sync", "auto"], "--sync auto needs --max-interval H"),
])
def test_the_cli_refuses_sync_options_that_contradict(args, needle):
    result = runner.invoke(app, [args[0], "gpt-tiny", "--cluster", "1x2xA100-40G", *args[1:]])
    assert result.exit_code == 1, result.output
    assert needle in result.stderr


@pytest.mark.parametrize(("sync", "zero", "needle"), [
    ({"mode": "local-sgd", "interval": 2, "overlap": True}, 0,
     "training.sync.overlap is true with mode local-sgd"),
    ({"mode": "every-step", "interval": 3}, 0, "training.sync.interval is 3 with mode every-step"),
    ({"mode": "gossip", "interval": 3}, 0, "training.sync.mode 'gossip' is not one of"),
    ({"mode": "diloco", "interval": 8}, 1, "pipelines[0].stages[0].zero is 1 with "
     "training.sync.mode diloco"),
    ({"overlap": True, "bucket_mb": 0}, 0, "training.sync.bucket_mb must be a positive"),
])
def test_a_plan_file_with_a_sync_the_runtime_cannot_run_is_refused(tmp_path, sync, zero,
                                                                  needle):
    plan = tiny_plan("1x2xcpu", dp=2)
    data = json.loads(plan_json(plan))
    data["training"]["sync"] = sync
    data["pipelines"][0]["stages"][0]["zero"] = zero
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlannerError) as caught:
        read_plan(path)
    assert needle in caught.value.message


def test_plans_written_before_sync_modes_read_as_every_step(tmp_path):
    data = json.loads(plan_json(tiny_plan("1x2xcpu", dp=2)))
    del data["training"]["sync"], data["prediction"]["whole_sync"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    plan = read_plan(path)
    assert plan.training.sync == SyncSpec() and plan.prediction.whole_sync is None
    assert plan.prediction.sync_saved == 0.0


def _gpt2(cluster, batch, sync):
    from cost_models.cluster import load_cluster
    from planner.models import model_spec
    from planner.solver import SolveOptions, solve
    from planner.trace.cache import cached_trace

    graph = cached_trace(model_spec("gpt2-small", {}), seq_len=1024, dtype="bf16")
    training = TrainingSpec(global_batch=batch, seq_len=1024, dtype="bf16")
    options = SolveOptions(time_limit=20, with_baselines=False)
    if isinstance(sync, AutoSync):
        return solve_auto(graph, load_cluster(cluster), training, options, sync)[0]
    return solve(graph, load_cluster(cluster), dataclasses.replace(training, sync=sync),
                 options)[0]


def test_on_a_slow_network_the_solver_overlaps_sync_and_auto_syncs_less_often():
    """One GPU per node on 10 Gb/s: the gradient sync dominates. Overlapped, the step
    pays what the last backward leaves; with --sync auto the solver picks H > 1 and the
    step pays the whole sync / H (1/H of every-step's, the same plan's)."""
    plain = _gpt2(SLOW_NETWORK, 64, SyncSpec())
    overlapped = _gpt2(SLOW_NETWORK, 64, SyncSpec(overlap=True))
    assert overlapped.prediction.step_time < plain.prediction.step_time
    assert 0 < overlapped.prediction.dp_comm < overlapped.prediction.whole_sync
    auto = _gpt2(SLOW_NETWORK, 64, AutoSync(32))
    sync = auto.training.sync
    assert sync.mode == "local-sgd" and sync.interval > 1
    assert auto.prediction.dp_comm == pytest.approx(auto.prediction.whole_sync / sync.interval)
    assert auto.prediction.step_time < overlapped.prediction.step_time
    assert all(s.zero == 0 for p in auto.pipelines for s in p.stages)
    # the same plan at other intervals: its sync per step falls as 1/H
    for interval in (1, 2, 8):
        again = _priced(auto, SyncSpec(mode="local-sgd", interval=interval))
        assert again.prediction.dp_comm == pytest.approx(
            auto.prediction.whole_sync / interval)


def _priced(plan, sync):
    from cost_models.model import AnalyticalCostModel
    from planner.explain import retrace
    from planner.solver.predict import predict

    plan = dataclasses.replace(plan, training=dataclasses.replace(plan.training, sync=sync))
    return dataclasses.replace(plan, prediction=predict(plan, retrace(plan).layers,
                                                        AnalyticalCostModel(plan.cluster)))


@pytest.mark.parametrize("sync", POLICIES, ids=lambda p: f"{p.describe()}, {p.bucket_mb} MiB")
def test_the_simulator_and_the_closed_form_pay_the_same_sync(sync):
    from cost_models.model import AnalyticalCostModel
    from planner.explain import retrace
    from planner.solver.predict import replay

    plan = _priced(tiny_plan("1x4xcpu", pp=2, dp=2, shares=[3, 1]), sync)
    layers = retrace(plan).layers
    simulated = replay(plan, layers, AnalyticalCostModel(plan.cluster))
    assert simulated.step_time == pytest.approx(plan.prediction.step_time, rel=0.02)
    assert plan.prediction.whole_sync > 0


def test_an_accumulation_after_its_bucket_started_stops_the_step(tmp_path):
    """Backward that accumulates a gradient more often than the step was told (here:
    twice, where one is expected) would leave its started sum stale: an error names it."""
    import torch
    import torch.distributed as dist

    from planner.runtime.overlap import Overlapped
    from planner.runtime.parallel import _Bucket

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        weight = torch.nn.Parameter(torch.ones(3))
        sums = type("Sums", (), {"buckets": [_Bucket([weight], dist.group.WORLD)]})()
        overlapped = Overlapped(sums, sums.buckets, {id(weight): "w"}, {"w": 1})
        overlapped.start_step()
        (weight * 2).sum().backward()  # its sum starts here
        assert overlapped.next == 1
        (weight * 3).sum().backward()
        with pytest.raises(PlannerError, match="accumulated the gradient of w after its sum"):
            overlapped(0.0)
    finally:
        dist.destroy_process_group()


def test_diloco_keeps_its_outer_state_in_memory():
    """DiLoCo's outer parameters and momentum (fp32) are priced in every stage's memory
    (`price.price_plan`, as the search's table counts them: `CostTable.state_bytes`)."""
    from cost_models.memory import optimizer_state_bytes, sync_state_bytes
    from planner.explain import retrace
    from planner.price import price_plan

    def memory(sync):
        plan = _with_sync(tiny_plan("1x2xcpu", dp=2), **sync)
        return plan, price_plan(plan, retrace(plan).layers).pipelines[0].stages[0].memory

    plain, before = memory({"mode": "local-sgd", "interval": 4})
    diloco, after = memory({"mode": "diloco", "interval": 4})
    assert sync_state_bytes(diloco.training) == 8.0 and sync_state_bytes(plain.training) == 0
    per_param = before.optimizer / optimizer_state_bytes(plain.training)
    assert after.optimizer == pytest.approx(before.optimizer + 8 * per_param)
    assert after.weights == before.weights and after.gradients == before.gradients


def test_a_measured_contention_slows_an_overlapped_plan_as_the_step_model_says():
    """On devices whose profile measured contention (`MeasuredDevice.compute_slowdown`,
    `sync_slowdown`), an overlapped sync slows the computing it runs beside: the
    prediction computes longer by `step.slowed` and pays `step.exposed` after it; the
    simulator and the timeline price the step alike. A sync after backward slows
    nothing."""
    from cost_models.model import AnalyticalCostModel
    from planner.explain import retrace
    from planner.solver.predict import replay, stage_timings, tail_sync
    from planner.solver.step import Contention, overlappable
    from planner.timeline import build_timeline
    from planner.types import MeasuredDevice

    def measuring(measured):
        plan = tiny_plan("2x1xcpu", dp=2)
        nodes = tuple(dataclasses.replace(node, device=dataclasses.replace(
            node.device, measured=measured)) for node in plan.cluster.nodes)
        return dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, nodes=nodes))

    plan = measuring(MeasuredDevice())
    contended = measuring(MeasuredDevice(compute_slowdown=0.5, sync_slowdown=0.25))
    overlap = SyncSpec(overlap=True, bucket_mb=2**-10)
    alone, beside = _priced(plan, overlap), _priced(contended, overlap)
    layers = retrace(plan).layers
    costs = AnalyticalCostModel(contended.cluster)
    hidden = overlappable(t.bwd for stages in stage_timings(beside, layers, costs)
                          for t in stages)
    step = step_time([0.0], alone.prediction.whole_sync, 0.0, hidden, overlap,
                     tail=tail_sync(beside, layers, costs),
                     contention=Contention(compute=0.5, sync=0.25))
    assert step.slowed > 0
    assert beside.prediction.compute == pytest.approx(alone.prediction.compute + step.slowed)
    assert beside.prediction.dp_comm == pytest.approx(step.exposed)
    assert beside.prediction.step_time == pytest.approx(
        alone.prediction.step_time - alone.prediction.dp_comm + step.slowed + step.exposed)
    assert replay(beside, layers, costs).step_time == pytest.approx(
        beside.prediction.step_time, rel=0.02)
    assert build_timeline(beside, layers, costs).step_time == pytest.approx(
        beside.prediction.step_time, rel=0.02)
    after = _priced(contended, SyncSpec())
    assert after.prediction == _priced(plan, SyncSpec()).prediction
