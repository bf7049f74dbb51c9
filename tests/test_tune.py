"""`planner tune`: trial runs of the best plans re-ranked by what they measured, and the
measurements written back into the cluster for the next solve."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from cli.main import app
from cost_models.cluster import load_cluster
from cost_models.model import AnalyticalCostModel
from planner.errors import PlannerError
from planner.solver.predict import predict
from planner.tune import RankFigures, Trial, calibrate, check_cpu_plans, compute_scale, rank
from tests.runtime_helpers import _traced, tiny_plan

runner = CliRunner()


def _trial(plan, index: int, measured: float | None, busy: float = 0.0, step: float = 0.0):
    ranks = tuple(RankFigures(node=s.devices.node, busy=busy, step=step, params=1000.0 * (i + 1))
                  for p in plan.pipelines for i, s in enumerate(p.stages))
    return Trial(index=index, plan=plan, folder=Path(f"plan-{index}"), measured=measured,
                 ranks=ranks if measured is not None else (), failure=None if measured else "x")


def test_trials_rank_by_measured_step_failed_ones_last():
    plan = tiny_plan("1x2xcpu", pp=2)
    trials = [_trial(plan, 1, 0.30), _trial(plan, 2, None), _trial(plan, 3, 0.10),
              _trial(plan, 4, 0.20)]
    assert [t.index for t in rank(trials)] == [3, 4, 1, 2]


def test_the_written_cluster_prices_the_trial_at_what_its_ranks_measured():
    plan = tiny_plan("1x2xcpu", pp=2, micro_batch=2, batch=8)
    layers = _traced().layers
    before = plan.prediction
    made = before.compute + before.bubble
    busy = 7 * made + before.tp_comm + before.pp_comm  # the schedule ran 7x the prediction
    trial = _trial(plan, 1, 0.5, busy=busy, step=busy + before.dp_comm + 0.004)
    assert compute_scale(trial) == pytest.approx(7.0)
    measured = calibrate(plan.cluster, [trial], layers, AnalyticalCostModel(plan.cluster))
    assert {n.device.name for n in measured.nodes} == {"cpu@measured"}
    again = predict(dataclasses.replace(plan, cluster=measured), layers,
                    AnalyticalCostModel(measured))
    assert again.compute + again.bubble == pytest.approx(7 * made)
    # each rank spent 4 ms after its schedule, beyond the gradient sync: its optimizer
    # step, over the parameters it holds (1,000 and 2,000 here)
    step = measured.nodes[0].device.measured.optimizer
    assert (step.params, step.seconds) == pytest.approx((3000.0, 0.008))
    assert measured.nodes[0].device.measured.layer_times[0].micro_batch == 2


def test_failed_trials_write_nothing_back():
    plan = tiny_plan("1x2xcpu", pp=2)
    layers = _traced().layers
    assert calibrate(plan.cluster, [_trial(plan, 1, None)], layers,
                     AnalyticalCostModel(plan.cluster)) == plan.cluster


def test_plans_for_gpus_are_not_tried_on_this_cpu():
    with pytest.raises(PlannerError, match="CPU devices only; this plan runs on A100-80G-SXM"):
        check_cpu_plans([tiny_plan("1x2xA100-80G", pp=2)])


def test_tune_needs_a_cluster_and_batch_for_a_model_and_keeps_existing_files(tmp_path):
    result = runner.invoke(app, ["tune", "gpt-tiny", "--out", str(tmp_path / "t")])
    assert result.exit_code == 1 and "give --cluster and --global-batch" in result.output
    mine = tmp_path / "mine.yaml"
    mine.write_text("mine\n")
    result = runner.invoke(app, ["tune", "gpt-tiny", "-c", "1x2xcpu", "-B", "8", "--out",
                                 str(tmp_path / "t"), "-o", str(mine)])
    assert result.exit_code == 1 and "already exists" in result.output
    assert mine.read_text() == "mine\n"


@pytest.mark.slow
def test_tune_reranks_cpu_trials_and_the_next_solve_prices_with_them(tmp_path):
    """Real trials: the local launches of gpt-tiny's 2 best plans on two CPU ranks."""
    out, written = tmp_path / "trials", tmp_path / "measured.yaml"
    result = runner.invoke(app, ["tune", "gpt-tiny", "-c", "1x2xcpu", "-B", "8", "--seq-len",
                                 "32", "--top-k", "2", "--steps", "3", "--out", str(out),
                                 "-o", str(written)])
    assert result.exit_code == 0, result.output + "".join(
        p.read_text()[-2000:] for p in out.glob("plan-*/trial.log"))
    report = json.loads((out / "tune.json").read_text())
    medians = {t["plan"]: json.loads((out / f"plan-{t['plan']}" / "run" / "summary.json")
                                     .read_text())["step_time"]["median"]
               for t in report["trials"]}
    assert len(medians) == 2
    # the re-ranked order is the measured order, its best the measured best
    assert [t["plan"] for t in report["trials"]] == sorted(medians, key=medians.get)
    best = min(medians, key=medians.get)
    assert f"Fastest measured: plan {best}" in result.stdout
    cluster = load_cluster(str(written))
    device = cluster.nodes[0].device
    assert device.name == "cpu@measured" and device.measured.layer_times
    assert device.measured.optimizer is not None
    layers = _traced().layers
    costs = AnalyticalCostModel(cluster)
    timing = device.measured.layer_times[0]
    layer = next(x for x in layers if x.signature == timing.layer)
    assert costs.layer_time(layer, device, tp=timing.tp, micro_batch=timing.micro_batch,
                            dtype="fp32").source == "measured"
    solved = runner.invoke(app, ["solve", "gpt-tiny", "-c", str(written), "-B", "8",
                                 "--seq-len", "32", "--dtype", "fp32", "--json"])
    assert solved.exit_code == 0, solved.output
    assert json.loads(solved.stdout)["pipelines"][0]["stages"][0]["device_type"] \
        == "cpu@measured"
    assert yaml.safe_load(written.read_text())["nodes"][0]["measured"]["name"] == "measured"
