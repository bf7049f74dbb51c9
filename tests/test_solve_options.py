"""Option combinations of `planner solve` and `planner estimate`: contradictions are named
by the options at fault before any search, and what is asked for is what comes back."""

import json

import pytest
from typer.testing import CliRunner

from cli.main import app
from planner.solver import Limits, Space
from planner.solver.diagnose import _constraints

CLUSTER = "1x4xA100-40G,1x4xV100-16G@100Gbps"  # gpt-tiny: 6 layers
runner = CliRunner()


@pytest.mark.parametrize("args, needle", [
    # interleaved 1F1B runs a whole multiple of its stages in micro-batches per pipeline
    (["-B", "3", "--interleave", "2", "--pp", "2"],
     "--interleave 2 with --pp 2: interleaved 1F1B runs a whole multiple of its 2 stages "
     "in micro-batches on every pipeline, which the global batch of 3 cannot be"),
    (["-B", "12", "--interleave", "2", "--pp", "2", "--micro-batch", "4"],
     "the 3 micro-batches of --micro-batch 4 in a global batch of 12 cannot be"),
    (["-B", "1", "--interleave", "2"],
     "runs a whole multiple of its stages, two or more, in micro-batches on every pipeline, "
     "which the global batch of 1 cannot be"),
    (["-B", "1", "--schedule", "interleaved", "--max-interleave", "2"],
     "--schedule interleaved: interleaved 1F1B runs a whole multiple of its stages"),
    (["-B", "4", "--dp", "4", "--interleave", "2"], "on each of the --dp 4 pipelines"),
    # --max-stages 1 allows one stage only, as --pp 1 does
    (["--max-stages", "1", "--schedule", "gpipe"],
     "--schedule gpipe needs pipelines of several stages, which contradicts --max-stages 1"),
    (["--max-stages", "1", "--interleave", "2"],
     "--interleave 2 needs pipelines of several stages, which contradicts --max-stages 1"),
    (["--max-stages", "1", "--first-stage", "V100-16G", "--last-stage", "A100-40G"],
     "put two device types in every pipeline, which --max-stages 1 rules out"),
])
def test_solve_names_the_contradiction(args, needle):
    result = runner.invoke(app, ["solve", "gpt-tiny", "--cluster", CLUSTER, *args])
    assert result.exit_code == 1, result.output
    assert needle in result.stderr and "No plan" not in result.stderr, result.stderr


def test_interleaved_pipelines_that_share_the_batch_in_whole_rounds_are_solved():
    result = runner.invoke(app, ["solve", "gpt-tiny", "--cluster", CLUSTER, "-B", "6",
                                 "--interleave", "2", "--pp", "3", "--json",
                                 "--time-limit", "10"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    for pipeline in plan["pipelines"]:
        assert pipeline["interleave"] == 2 and len(pipeline["stages"]) == 3
        assert pipeline["num_microbatches"] % 3 == 0


def test_diagnosis_names_a_fixed_chunk_count():
    given = dict(_constraints(Limits(interleave=2), Space(), stages=8))
    assert "--interleave 2" in given and "drop --interleave 2" in given["--interleave 2"]
    assert not any(flag.startswith("--interleave") for flag, _ in _constraints(
        Limits(interleave=1), Space(), stages=8))


def test_top_k_says_when_fewer_plans_exist():
    result = runner.invoke(app, ["solve", "gpt-tiny", "--cluster", "1x4xA100-40G", "-B", "1",
                                 "--tp", "2", "--pp", "2", "--dp", "1", "--top-k", "9",
                                 "--json", "--time-limit", "10"])
    assert result.exit_code == 0, result.output
    plans = json.loads(result.stdout)
    assert 1 <= len(plans) < 9
    assert (f"--top-k 9 asked for 9 plans, but only {len(plans)} exist under the "
            "constraints given") in result.stderr


@pytest.mark.parametrize("args, needle", [
    (["--dp", "0"], "--dp must be at least 1 (got 0)"),
    (["--pp", "2", "--interleave", "2", "--schedule", "1f1b"],
     "--interleave 2 runs interleaved 1F1B, which contradicts --schedule 1f1b"),
])
def test_estimate_refuses(args, needle):
    result = runner.invoke(app, ["estimate", "gpt-tiny", "--cluster", CLUSTER, *args])
    assert result.exit_code == 1, result.output
    assert needle in result.stderr, result.stderr


@pytest.mark.parametrize("schedule", [[], ["--schedule", "interleaved"]])
def test_estimate_interleaves_with_a_chunk_count(schedule):
    result = runner.invoke(app, ["estimate", "gpt-tiny", "--cluster", CLUSTER, "-B", "16",
                                 "--pp", "2", "--interleave", "2", "--json", *schedule])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert {(p["schedule"], p["interleave"]) for p in plan["pipelines"]} == {
        ("interleaved-1f1b", 2)}
