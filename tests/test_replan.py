"""Re-planning after a node is lost (planner/replan.py, `planner replan`): the old plan's
surviving pipelines rebalanced, a short search on what is left, the better of the two
kept and shown as a diff; plans with slack (--spare) that survive any one node's loss by
a rebalance alone."""

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from cli.main import app
from planner.errors import PlannerError
from planner.planfile import read_plan, write_plan
from planner.price import price_plan
from planner.replan import losses, rebalance, replan, resilient, spare_plan
from planner.types import TrainingSpec
from planner.whatif import remove_nodes
from tests.runtime_helpers import SEQ, _traced, tiny_plan


@pytest.fixture(scope="module")
def layers():
    return _traced().layers


def _nodes(plan) -> list[list[str]]:
    return [[s.devices.node for s in p.stages] for p in plan.pipelines]


def test_a_lost_node_leaves_the_other_pipelines_with_the_whole_batch(layers):
    """2 pipelines of 2 stages, one per node: losing cpu-1 leaves pipeline 0 as it was,
    running all 8 samples (4 micro-batches of 2), priced as written on the cluster left."""
    plan = tiny_plan("2x2xcpu", pp=2, dp=2)
    left = remove_nodes(plan.cluster, ["cpu-1"])
    found = rebalance(plan, left, layers)
    assert found.reason == ""
    new = found.plan
    assert _nodes(new) == [["cpu-0", "cpu-0"]]
    (pipeline,) = new.pipelines
    assert (pipeline.index, pipeline.batch_share, pipeline.num_microbatches) == (0, 8, 4)
    assert pipeline.stages == tuple(dataclasses.replace(s, memory=t.memory) for s, t in zip(
        plan.pipelines[0].stages, pipeline.stages, strict=True))
    assert new.cluster.name == "2x2xcpu (edited)" and new.training == plan.training
    assert new.prediction == price_plan(new, layers).prediction
    assert new.prediction.step_time > plan.prediction.step_time  # half the devices
    assert new.solver.status == "fixed" and "cpu-1 lost" in new.solver.search_space


def test_the_rebalanced_shares_are_the_best_split_of_the_batch(layers):
    """Three pipelines left of four (two A100s, a V100): no other split of the 16
    micro-batches among them gives a shorter step."""
    plan = tiny_plan("1x2xA100-80G,2x1xV100-32G@100Gbps", dp=4, micro_batch=1, batch=16)
    left = remove_nodes(plan.cluster, ["v100-32g-0"])
    found = rebalance(plan, left, layers).plan
    assert _nodes(found) == [["a100-80g-sxm-0"], ["a100-80g-sxm-0"], ["v100-32g-1"]]
    assert sum(p.num_microbatches for p in found.pipelines) == 16
    assert sum(p.batch_share for p in found.pipelines) == 16

    def split(counts):
        return price_plan(dataclasses.replace(found, pipelines=tuple(
            dataclasses.replace(p, batch_share=c, num_microbatches=c)
            for p, c in zip(found.pipelines, counts, strict=True))), layers)

    steps = [split((a, b, 16 - a - b)).prediction.step_time
             for a in range(1, 15) for b in range(1, 16 - a)]
    assert found.prediction.step_time == pytest.approx(min(steps), rel=1e-12)


def test_a_rebalance_says_why_it_cannot_run(layers):
    across = tiny_plan("2x1xcpu", pp=2)  # one pipeline over both nodes
    found = rebalance(across, remove_nodes(across.cluster, ["cpu-1"]), layers)
    assert found.plan is None
    assert found.reason == "every pipeline of the plan runs on cpu-1"
    plan = tiny_plan("2x2xcpu", dp=4, micro_batch=2)
    odd = rebalance(plan, remove_nodes(plan.cluster, ["cpu-1"]), layers, global_batch=7)
    assert odd.reason == "the global batch of 7 is no whole number of its micro-batches of 2"
    few = rebalance(plan, remove_nodes(plan.cluster, ["cpu-1"]), layers, global_batch=2)
    assert few.reason == "its 2 surviving pipeline(s) cannot share the 1 micro-batches of " \
        "the global batch"


def test_replan_keeps_the_faster_of_the_rebalance_and_the_search(layers):
    plan = tiny_plan("2x2xcpu", pp=2, dp=2)
    graph = _traced()
    result = replan(plan, lost=["cpu-1"], graph=graph)
    assert result.lost == ("cpu-1",) and result.added == ()
    assert result.rebalanced.plan is not None and result.searched is not None
    faster = min(result.rebalanced.plan, result.searched, key=lambda p: p.prediction.step_time)
    assert result.new is faster
    assert result.kept == ("search" if faster is result.searched else "rebalance")
    assert {n for pipe in _nodes(result.new) for n in pipe} == {"cpu-0"}
    assert result.new.training.global_batch == 8 and not result.batch_changed
    assert result.seconds > 0
    # a pipeline over both nodes leaves no rebalance: the search's plan it is
    across = replan(tiny_plan("2x1xcpu", pp=2), lost=["cpu-0"], graph=graph)
    assert across.kept == "search" and across.rebalanced.plan is None
    assert _nodes(across.new) == [["cpu-1"]]
    # nodes that join are planned on; a new global batch is the user's to give
    grown = replan(plan, lost=["cpu-1"], add=["1x2xcpu"], global_batch=16, graph=graph)
    assert grown.added == ("cpu-2",) and grown.batch_changed
    assert "cpu-2" in {n for pipe in _nodes(grown.new) for n in pipe}
    assert grown.new.training.global_batch == 16


def test_replan_refuses_what_it_cannot_do():
    plan = tiny_plan("2x2xcpu", pp=2, dp=2)
    graph = _traced()
    with pytest.raises(PlannerError, match=r"has no node 'cpu-7'\. Did you mean"):
        replan(plan, lost=["cpu-7"], graph=graph)
    with pytest.raises(PlannerError, match="--lost names cpu-1 more than once"):
        replan(plan, lost=["cpu-1", "cpu-1"], graph=graph)
    with pytest.raises(PlannerError, match="Nothing to re-plan"):
        replan(plan, lost=[], graph=graph)
    with pytest.raises(PlannerError, match="every node"):
        replan(plan, lost=["cpu-0", "cpu-1"], graph=graph)


def test_a_plan_survives_a_node_by_rebalance_only_where_pipelines_avoid_it(layers):
    per_node = tiny_plan("2x2xcpu", pp=2, dp=2)
    found = losses(per_node, layers)
    assert [loss.node for loss in found] == ["cpu-0", "cpu-1"] and resilient(found)
    one = losses(tiny_plan("2x1xcpu", pp=2), layers)
    assert not resilient(one)
    assert [loss.rebalanced.reason for loss in one] == [
        "every pipeline of the plan runs on cpu-0", "every pipeline of the plan runs on cpu-1"]


def test_spare_trades_speed_for_a_plan_that_survives_any_loss(layers):
    """Two A100s on one node and a V100 on another: the fastest plan uses the A100 node
    alone, and losing it leaves nothing. --spare 0.9 allows a plan up to 90% slower that
    keeps a pipeline on each node; --spare 0.1 finds none and says how much slack the
    fastest resilient plan needs."""
    from cost_models.cluster import load_cluster

    graph = _traced()
    cluster = load_cluster("1x2xA100-80G,1x1xV100-32G@10Gbps")
    training = TrainingSpec(global_batch=8, seq_len=SEQ, dtype="fp32")
    found = spare_plan(graph, cluster, training, spare=0.9, time_limit=None)
    assert {n for pipe in _nodes(found.best) for n in pipe} == {"a100-80g-sxm-0"}
    assert not resilient(losses(found.best, layers))
    assert resilient(found.losses) and 0 < found.slack <= 0.9
    assert {n for pipe in _nodes(found.plan) for n in pipe} == {"a100-80g-sxm-0", "v100-32g-0"}
    assert found.worst.node == "a100-80g-sxm-0"  # the V100 alone is the slower survivor
    with pytest.raises(PlannerError, match=r"No plan within --spare 0\.1 .* the fastest "
                       r"resilient plan found is \d+\.\d% slower than the best") as caught:
        spare_plan(graph, cluster, training, spare=0.1, time_limit=None)
    assert caught.value.kind == "no-spare"
    with pytest.raises(PlannerError, match=r"--spare is a fraction .* \(got 1\.5\)"):
        spare_plan(graph, cluster, training, spare=1.5)


def test_the_replan_command_shows_the_new_plan_as_a_diff(tmp_path):
    write_plan(tiny_plan("2x2xcpu", pp=2, dp=2), tmp_path / "plan.json")
    runner = CliRunner()
    out = tmp_path / "after.json"
    result = runner.invoke(app, ["replan", str(tmp_path / "plan.json"), "--lost", "cpu-1",
                                 "-o", str(out), "--time-limit", "5"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert text.startswith("Re-plan: lost cpu-1 warm start (the surviving pipelines, "
                           "rebalanced): ")
    assert "search: " in text and "re-planned in" in text
    assert "devices used 4 2 changed" in text and "embedding" in text
    assert read_plan(out).cluster.name == "2x2xcpu (edited)"
    again = runner.invoke(app, ["replan", str(tmp_path / "plan.json"), "--lost", "cpu-1",
                                "-o", str(out)])
    assert again.exit_code == 1 and "already exists" in again.output
    data = json.loads(runner.invoke(app, ["replan", str(tmp_path / "plan.json"), "--lost",
                                          "cpu-0", "--json"]).output)
    assert data["kind"] == "replan" and data["lost"] == ["cpu-0"]
    assert data["kept"] in ("rebalance", "search") and data["global_batch"] == 8
    assert data["rebalance"]["step_time"] > 0 and data["plan"]["kind"] == "plan"
    assert any(row["key"] == "step_time" for row in data["diff"])
    bad = runner.invoke(app, ["replan", str(tmp_path / "plan.json"), "--lost", "gpu-3"])
    assert bad.exit_code == 1
    assert "error: Cluster 2x2xcpu has no node 'gpu-3'" in bad.output
    assert "Traceback" not in bad.output
