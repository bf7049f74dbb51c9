"""A re-plan keeps to the constraints the plan was solved with (planner/constraints.py,
`Plan.constraints`): `planner solve --tp 2` records them in the plan file, `planner
replan` and the supervisor's re-plan search within them (an --exclude of a lost node
dropped), `--ignore-constraints` searches free, `explain` lists them; a plan file from
before they were recorded loads and re-plans free, as it did."""

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from cli.main import app
from planner.constraints import flags, recorded, solve_options
from planner.planfile import read_plan, write_plan
from planner.replan import replan
from planner.solver import Limits, SolveOptions, Space
from planner.types import Recompute, Schedule
from planner.types.plan import SolveConstraints
from tests.runtime_helpers import SEQ, _traced, tiny_plan

SOLVE = ["solve", "gpt-tiny", "-B", "8", "--seq-len", str(SEQ), "--dtype", "fp32",
         "--time-limit", "20"]


def _run(*args: str):
    result = CliRunner().invoke(app, list(args))
    return result, " ".join(result.output.split())


def _tps(plan) -> list[list[int]]:
    return [[s.tp for s in p.stages] for p in plan.pipelines]


def _nodes(plan) -> set[str]:
    return {s.devices.node for p in plan.pipelines for s in p.stages}


@pytest.fixture(scope="module")
def solved_tp2(tmp_path_factory):
    """gpt-tiny solved on two nodes of two CPUs at --tp 2 (free, it runs tp 1)."""
    path = tmp_path_factory.mktemp("tp2") / "plan.json"
    result, _ = _run(*SOLVE, "-c", "2x2xcpu", "--tp", "2", "-o", str(path))
    assert result.exit_code == 0, result.output
    return path


def test_a_plan_solved_with_tp_2_replans_at_tp_2(solved_tp2, tmp_path):
    plan = read_plan(solved_tp2)
    assert plan.constraints == SolveConstraints(tp=2)
    out = tmp_path / "after.json"
    result, text = _run("replan", str(solved_tp2), "--lost", "cpu-1", "--time-limit", "10",
                        "-o", str(out))
    assert result.exit_code == 0, result.output
    assert ("constraints: kept --tp 2, as the plan was solved (--ignore-constraints drops "
            "them)") in text
    new = read_plan(out)
    assert _nodes(new) == {"cpu-0"} and _tps(new) == [[2]]
    assert new.constraints == SolveConstraints(tp=2)  # (a second loss keeps them too)
    shown, text = _run("explain", str(solved_tp2))
    assert shown.exit_code == 0 and "solved with: --tp 2" in text


def test_ignore_constraints_searches_free(solved_tp2):
    result, text = _run("replan", str(solved_tp2), "--lost", "cpu-1", "--time-limit", "10",
                        "--ignore-constraints", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["constraints"] == {"kept": None, "dropped_excludes": [], "ignored": True}
    new = data["plan"]
    assert [[s["tp"] for s in p["stages"]] for p in new["pipelines"]] == [[1], [1]]
    assert new["constraints"] == json.loads(json.dumps(dataclasses.asdict(
        SolveConstraints())))  # (searched free)
    shown, text = _run("replan", str(solved_tp2), "--lost", "cpu-1", "--ignore-constraints")
    assert shown.exit_code == 0
    assert ("constraints: ignored (--ignore-constraints): the plan was solved with --tp 2; "
            "searched free") in text


def test_a_plan_file_from_before_the_constraints_loads_and_replans_free(solved_tp2,
                                                                        tmp_path):
    data = json.loads(solved_tp2.read_text())
    del data["constraints"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    plan = read_plan(old)
    assert plan.constraints is None and _tps(plan) == [[2], [2]]
    result, text = _run("replan", str(old), "--lost", "cpu-1", "--json")
    assert result.exit_code == 0, result.output
    found = json.loads(result.output)
    assert found["constraints"] == {"kept": None, "dropped_excludes": [], "ignored": False}
    assert [[s["tp"] for s in p["stages"]] for p in found["plan"]["pipelines"]] == [[1], [1]]
    shown, text = _run("replan", str(old), "--lost", "cpu-1")
    assert shown.exit_code == 0 and "constraints: none recorded in the plan file" in text
    explained, text = _run("explain", str(old))
    assert explained.exit_code == 0 and "solved with" not in text


def test_an_excluded_node_stays_excluded_until_it_is_lost(tmp_path):
    path = tmp_path / "plan.json"
    result, _ = _run(*SOLVE, "-c", "3x2xcpu", "--tp", "2", "--exclude", "cpu-2", "-o",
                     str(path))
    assert result.exit_code == 0, result.output
    plan = read_plan(path)
    graph = _traced()
    kept = replan(plan, lost=["cpu-1"], graph=graph)
    assert _nodes(kept.new) == {"cpu-0"} and _tps(kept.new) == [[2]]  # (not cpu-2)
    assert kept.constraints == SolveConstraints(tp=2, exclude=("cpu-2",))
    assert kept.new.constraints == kept.constraints
    result, text = _run("replan", str(path), "--lost", "cpu-2")
    assert result.exit_code == 0, result.output
    assert ("constraints: kept --tp 2, as the plan was solved (--ignore-constraints drops "
            "them); --exclude cpu-2 dropped (the node is lost)") in text
    dropped = replan(plan, lost=["cpu-2"], graph=graph)
    assert dropped.dropped == ("cpu-2",) and dropped.new.constraints == SolveConstraints(tp=2)
    # what is left is excluded: the error says which constraints, and how to drop them
    result, text = _run("replan", str(path), "--lost", "cpu-0", "--lost", "cpu-1")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "The re-plan keeps to the constraints the plan was solved with: --tp 2 " \
        "--exclude cpu-2." in text
    assert "re-plan without them: --ignore-constraints" in text
    free, _ = _run("replan", str(path), "--lost", "cpu-0", "--lost", "cpu-1",
                   "--ignore-constraints", "--json")
    assert free.exit_code == 0, free.output


def test_a_fixed_count_of_pipelines_rules_out_a_rebalance_that_has_fewer():
    """A pipeline on each node, solved with --dp 2: losing a node leaves one pipeline to
    rebalance, which --dp 2 rules out; the search keeps two, on the node left."""
    plan = dataclasses.replace(tiny_plan("2x2xcpu", pp=2, dp=2),
                               constraints=SolveConstraints(dp=2))
    result = replan(plan, lost=["cpu-1"], graph=_traced())
    assert result.rebalanced.plan is None
    assert result.rebalanced.reason == ("the plan was solved with --dp 2 and 1 pipeline(s) "
                                        "survive")
    assert result.kept == "search" and len(result.new.pipelines) == 2
    assert _nodes(result.new) == {"cpu-0"}
    free = replan(plan, lost=["cpu-1"], graph=_traced(), keep_constraints=False)
    assert free.rebalanced.plan is not None and free.ignored


def test_the_record_and_the_solvers_options_are_each_others_inverse(tmp_path):
    options = SolveOptions(
        limits=Limits(tp=2, max_tp=4, pp=2, dp=3, max_dp=3, micro_batch=2, max_stages=4,
                      mixed=False, first_stage="A100-80G-SXM", last_stage="V100-32G",
                      interleave=2, interleaves=(1, 2, 3), schedule=Schedule.INTERLEAVED),
        space=Space(policies=(Recompute.FULL,), zeros=(1,)), exclude=("n-3",))
    given = recorded(options)
    assert solve_options(given) == options
    assert recorded(solve_options(given)) == given
    assert flags(given) == (
        "--tp 2 --max-tp 4 --pp 2 --dp 3 --max-dp 3 --micro-batch 2 --max-stages 4 "
        "--interleave 2 --max-interleave 3 --first-stage A100-80G-SXM --last-stage "
        "V100-32G --schedule interleaved --recompute full --zero 1 --exclude n-3 --no-mixed")
    assert recorded(SolveOptions()) == SolveConstraints() and flags(None) == ""
    assert solve_options(SolveConstraints(), top_k=3) == SolveOptions(top_k=3)  # (free)
    # a plan file keeps them as they were
    plan = dataclasses.replace(tiny_plan("1x2xcpu"), constraints=given)
    write_plan(plan, tmp_path / "plan.json")
    assert read_plan(tmp_path / "plan.json").constraints == given


def test_the_supervisor_replans_within_the_constraints(tmp_path):
    """The supervisor's re-plan after a node's loss keeps --tp 2 (free, gpt-tiny runs tp
    1 on the A100s left) and logs it."""
    from planner.launch import read_launch
    from planner.runtime.supervise import Round, Verdict, replan_round

    plan = dataclasses.replace(tiny_plan("3x2xA100-80G", tp=2, dp=3),
                               constraints=SolveConstraints(tp=2))
    write_plan(plan, tmp_path / "plan.json")
    out, run_dir = tmp_path / "launch", tmp_path / "run"
    result = CliRunner().invoke(app, ["launch", str(tmp_path / "plan.json"), "--out", str(out),
                                      "--target", "local", "--supervise"])
    assert result.exit_code == 0, result.output
    round_ = Round(0, out, read_plan(out / "plan.json"))
    lost = Verdict(("a100-80g-sxm-1",), "node(s) a100-80g-sxm-1 ended without a word")
    after, entry = replan_round(round_, lost, read_launch(out / "launch.json"), run_dir, out,
                                time_limit=10)
    assert _nodes(after.plan) <= {"a100-80g-sxm-0", "a100-80g-sxm-2"}
    assert {tp for pipe in _tps(after.plan) for tp in pipe} == {2}
    assert entry["constraints"] == "--tp 2"
    assert read_plan(after.folder / "plan.json").constraints == SolveConstraints(tp=2)
    free = replan(dataclasses.replace(plan, constraints=None), lost=["a100-80g-sxm-1"])
    assert {tp for pipe in _tps(free.new) for tp in pipe} == {1}  # (what the guard is for)


def test_a_plan_file_with_constraints_out_of_range_is_refused(solved_tp2, tmp_path):
    data = json.loads(solved_tp2.read_text())
    for field, value, said in (("max_stages", 0, "constraints.max_stages must be positive "
                                "(got 0)"),
                               ("zero", [4], "constraints.zero must list ZeRO stages 0-3 "
                                "(got [4])")):
        bad = tmp_path / f"{field}.json"
        bad.write_text(json.dumps({**data, "constraints": {**data["constraints"],
                                                           field: value}}))
        result, text = _run("replan", str(bad), "--lost", "cpu-1")
        assert result.exit_code == 1 and said in text and "Traceback" not in result.output


def test_spare_keeps_to_the_constraints():
    """--spare searches every count of pipelines within the constraints: at --tp 2 on two
    nodes of two CPUs, a pipeline per node (free, the plans run tp 1)."""
    from cost_models.cluster import load_cluster
    from planner.replan import spare_plan
    from planner.types import TrainingSpec

    graph, cluster = _traced(), load_cluster("2x2xcpu")
    training = TrainingSpec(global_batch=8, seq_len=SEQ, dtype="fp32")
    kept = spare_plan(graph, cluster, training, spare=0.5, time_limit=None,
                      constraints=SolveConstraints(tp=2))
    assert _tps(kept.plan) == [[2], [2]] and _tps(kept.best) == [[2], [2]]
    free = spare_plan(graph, cluster, training, spare=0.5, time_limit=None)
    assert {tp for pipe in _tps(free.plan) for tp in pipe} == {1}
