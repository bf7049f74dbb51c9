"""The strategy report (issue 48, item 4): `planner compare --strategies MODEL -c CLUSTER`
prices DDP, FSDP ZeRO-2/3, local SGD, DiLoCo and the solver's hybrid plan by the
solver's own rules, at 1..N replicas, and says where one does not fit."""

import dataclasses
import json
import re

import pytest
from typer.testing import CliRunner

from cli.main import app
from cli.solve_cmd import _setup
from cost_models.model import AnalyticalCostModel
from planner.price import price_plan
from planner.solver import SolveOptions, solve
from planner.solver.baselines import by_speed
from planner.solver.uniform import uniform_plan
from planner.strategies import (
    OVERLAPPED,
    data_parallel_strategies,
    figures,
    hybrid_training,
    replica_counts,
    strategy_report,
)
from planner.types import SyncSpec

MIXED = "1x4xA100-80G,1x4xV100-32G@10Gbps"  # two speeds, 10 Gb/s between the nodes
SMALL_MEMORY = "2x4xT4@10Gbps"  # 15 GiB cards: gpt2-large with DiLoCo's state overflows
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def mixed():
    """gpt2-small on MIXED at batch 128, its report and the hybrid plan (a complete search:
    no time limit, so the plan is the optimum whatever the machine's load)."""
    graph, cluster, training = _setup("gpt2-small", MIXED, 128, 256, "auto", {})
    hybrid = solve(graph, cluster, hybrid_training(training), SolveOptions(time_limit=None))[0]
    assert hybrid.solver.status == "optimal"
    report = strategy_report(graph, cluster, training, hybrid=hybrid, interval=4)
    return graph, cluster, training, hybrid, report


def _rows(report):
    return {row.name: row for row in report.rows}


def test_replica_counts_are_powers_of_two_and_every_device():
    assert replica_counts(1) == [1]
    assert replica_counts(3) == [1, 2, 3]
    assert replica_counts(8) == [1, 2, 4, 8]
    assert replica_counts(50) == [1, 2, 4, 8, 16, 32, 50]


def test_every_point_is_a_plan_priced_as_plan_files_are(mixed):
    """Each point of each curve prices, as a plan file, to the step it shows
    (`price.price_plan`), and a DDP or FSDP point is the recipe `planner estimate --tp 1
    --pp 1 --dp N` gives on the fastest devices: no figure of the report's own."""
    graph, cluster, training, _, report = mixed
    rows = _rows(report)
    assert [row.name for row in report.rows] == [
        "DDP", "FSDP ZeRO-2", "FSDP ZeRO-3", "local SGD:4", "DiLoCo:4", "hybrid (solver)"]
    costs = AnalyticalCostModel(by_speed(cluster, training.dtype))
    for row in report.rows:
        assert row.curve and all(p.fits for p in row.curve if p.plan is not None), row.name
        assert all(p.plan is not None for p in row.curve if p.replicas <= 4), row.name
        for point in (p for p in row.curve if p.plan is not None):
            again = price_plan(point.plan, graph.layers)
            assert again.prediction.step_time == pytest.approx(
                point.plan.prediction.step_time, rel=1e-9), (row.name, point.replicas)
    for name, zero in (("DDP", 0), ("FSDP ZeRO-2", 2), ("FSDP ZeRO-3", 3)):
        for point in (p for p in rows[name].curve if p.plan is not None):
            plan = point.plan
            stage = plan.pipelines[0].stages[0]
            recipe = uniform_plan(
                layers=graph.layers, model=graph.spec, training=dataclasses.replace(
                    training, sync=OVERLAPPED), cluster=by_speed(cluster, training.dtype),
                costs=costs, tp=1, pp=1, dp=point.replicas,
                micro_batch=plan.pipelines[0].micro_batch, recompute=stage.recompute,
                zero=zero)
            assert recipe.prediction.step_time == pytest.approx(plan.prediction.step_time)
            assert len(plan.pipelines) == point.replicas
            assert plan.training.sync == OVERLAPPED


def test_each_row_is_its_fastest_point_and_the_hybrid_is_the_solvers_plan(mixed):
    _, _, _, hybrid, report = mixed
    for row in report.rows:
        fastest = min((p for p in row.curve if p.plan is not None),
                      key=lambda p: p.plan.prediction.step_time)
        assert row.best.plan.prediction.step_time == fastest.plan.prediction.step_time
    rows = _rows(report)
    assert rows["hybrid (solver)"].best.plan is hybrid
    assert [p.replicas for p in rows["hybrid (solver)"].curve] == replica_counts(
        len(hybrid.pipelines))
    # a complete search covers every every-step data-parallel layout: none is faster
    for name in ("DDP", "FSDP ZeRO-2", "FSDP ZeRO-3"):
        assert (hybrid.prediction.step_time
                <= rows[name].best.plan.prediction.step_time * (1 + 1e-9)), name


def test_local_sgd_shares_by_speed_and_pays_a_share_of_the_sync(mixed):
    """Local SGD and DiLoCo give the faster A100s larger shares than DDP's even ones,
    sync every 4 steps (a step pays a quarter of the sync and sends a quarter of its
    bytes), and say how far the replicas drift."""
    graph, _, _, _, report = mixed
    rows = _rows(report)
    ddp = next(p.plan for p in rows["DDP"].curve if p.replicas == 8)
    assert len({p.batch_share for p in ddp.pipelines}) == 1
    for name, mode in (("local SGD:4", "local-sgd"), ("DiLoCo:4", "diloco")):
        plan = next(p.plan for p in rows[name].curve if p.replicas == 8)
        assert plan.training.sync == SyncSpec(mode=mode, interval=4)
        shares = {s.device_type: p.batch_share for p in plan.pipelines for s in p.stages}
        assert shares["A100-80G-SXM"] > shares["V100-32G"]
        assert sum(p.batch_share for p in plan.pipelines) == 128
        found = figures(plan, graph.layers)
        assert plan.prediction.dp_comm == pytest.approx(found.whole_sync / 4)
        assert found.risk == f"{max(p.batch_share for p in plan.pipelines) * 4:,} samples " \
                             "alone, 3 step(s) stale"
        every_step = price_plan(dataclasses.replace(plan, training=dataclasses.replace(
            plan.training, sync=SyncSpec())), graph.layers)
        assert found.comm_bytes == pytest.approx(figures(every_step, graph.layers).comm_bytes / 4)
    assert figures(rows["DDP"].best.plan, graph.layers).risk == "none (every step)"


def test_zero_shards_what_ddp_keeps_whole(mixed):
    """On the 4 A100s, ZeRO-2 keeps less model state per device than DDP, ZeRO-3 fewer
    weights than ZeRO-2 (a tied embedding stays whole under ZeRO-3, so not less state
    for gpt2-small), DiLoCo more than local SGD (its outer optimizer's); the report's peak is the
    largest stage's. On all 8 devices, A100s beside V100s, the runtime shards nothing
    (ZeRO groups hold one device type): FSDP has no such point, and says why."""
    graph, _, _, _, report = mixed
    rows = _rows(report)

    def memory(name):
        plan = next(p.plan for p in rows[name].curve if p.replicas == 4)  # the A100s
        largest = max((s.memory for p in plan.pipelines for s in p.stages),
                      key=lambda m: m.total)
        assert figures(plan, graph.layers).peak_memory == largest.total
        return largest

    def state(name):
        return memory(name).weights + memory(name).gradients + memory(name).optimizer

    assert state("FSDP ZeRO-2") < state("DDP")
    assert memory("FSDP ZeRO-3").weights < memory("FSDP ZeRO-2").weights
    assert state("DiLoCo:4") > state("local SGD:4")
    for name in ("FSDP ZeRO-2", "FSDP ZeRO-3"):
        mixed_types = rows[name].curve[-1]
        assert mixed_types.replicas == 8 and mixed_types.plan is None
        assert "mix A100-80G-SXM and V100-32G" in mixed_types.reason


def test_a_strategy_that_does_not_fit_says_which_device_overflows(tmp_path):
    """gpt2-large on 15 GiB T4s: DDP fits, DiLoCo's outer state does not, at any count:
    its row says so and names the device and the bytes; the curve shows oom."""
    svg = tmp_path / "scaling.svg"
    result = run("compare", "--strategies", "gpt2-large", "-c", SMALL_MEMORY, "-B", 32,
                 "-s", 256, "--time-limit", 60, "--svg", svg)
    assert result.exit_code == 0, result.output
    line = next(x for x in result.stdout.splitlines() if x.startswith("DiLoCo:8"))
    assert "does not fit in memory at any replica count" in line
    assert re.search(r"DiLoCo:8 +oom +oom +oom +oom", result.stdout)
    data = json.loads(run("compare", "--strategies", "gpt2-large", "-c", SMALL_MEMORY,
                          "-B", 32, "-s", 256, "--time-limit", 60, "--json").stdout)
    assert data["kind"] == "strategies" and data["interval"] == 8
    rows = {row["name"]: row for row in data["rows"]}
    diloco = rows["DiLoCo:8"]
    assert not diloco["fits"] and not any(p["fits"] for p in diloco["curve"])
    assert re.search(r"on \S+ \(T4\) needs [\d.]+ GiB of 15.0 GiB", diloco["reason"])
    assert diloco["figures"]["peak_memory"] > diloco["figures"]["capacity"]
    assert rows["DDP"]["fits"] and rows["DDP"]["figures"]["peak_memory"] <= (
        rows["DDP"]["figures"]["capacity"])
    # the chart: a line per strategy with a curve, a point per layout that fits
    text = svg.read_text()
    assert text.startswith("<?xml")
    fitting = sum(p["fits"] for row in data["rows"] for p in row["curve"])
    assert text.count("<circle") == fitting
    assert "DiLoCo:8 (no layout fits)" in text


def test_strategies_refuse_what_they_cannot_take(tmp_path):
    svg = tmp_path / "curve.svg"
    svg.write_text("mine")
    cases = [
        (["--strategies", "gpt2-small", "plan.json"], "takes no plan files"),
        (["--strategies", "gpt2-small", "--interval", "0"], "--interval must be between 1"),
        (["--strategies", "gpt2-small", "--svg", svg], "already exists"),
        ([], "at least two plan files"),
        (["a.json", "b.json", "-c", "consumer-rtx", "--svg", "x.svg"],
         "--cluster, --svg: only with --strategies MODEL"),
    ]
    for args, needle in cases:
        result = run("compare", *args)
        assert result.exit_code == 1, (args, result.output)
        assert needle in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.output
    assert svg.read_text() == "mine"  # nothing the user wrote is overwritten unasked


def test_strategies_names_follow_the_interval():
    names = [s.name for s in data_parallel_strategies(16)]
    assert names == ["DDP", "FSDP ZeRO-2", "FSDP ZeRO-3", "local SGD:16", "DiLoCo:16"]
