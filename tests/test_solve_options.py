"""Option combinations of `planner solve` and `planner estimate`: contradictions are named
by the options at fault before any search, and what is asked for is what comes back."""

import json
import re

import pytest
from typer.testing import CliRunner

from cli.main import app
from planner.solver import Limits, Space
from planner.solver.diagnose import constraints

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
    # the chunk counts tried come from --max-interleave only where --interleave fixes none
    (["--interleave", "3", "--max-interleave", "2"],
     "--interleave 3 contradicts --max-interleave 2"),
    (["--max-interleave", "4", "--schedule", "gpipe"],
     "--max-interleave 4 tries interleaved 1F1B, which contradicts --schedule gpipe"),
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
    given = dict(constraints(Limits(interleave=2), Space(), stages=8))
    assert "--interleave 2" in given and "drop --interleave 2" in given["--interleave 2"]
    assert not any(flag.startswith("--interleave") for flag, _ in constraints(
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
    # no configuration fits: say so (it led with how ZeRO shards across types)
    (["--ffn", "99999999999"], "The model is larger than the whole cluster's memory"),
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


def _baseline(args: list[str], name: str) -> dict:
    result = runner.invoke(app, ["solve", *args, "--json", "--time-limit", "10"])
    assert result.exit_code == 0, result.output
    return next(b for b in json.loads(result.stdout)["baselines"] if b["name"] == name)


@pytest.mark.parametrize("args, reason", [
    # the A100s alone are 4 devices, --dp 8 needs 8 pipelines: not a memory problem
    (["gpt-tiny", "-c", CLUSTER, "-B", "64", "--dp", "8"],
     "the constraints given (--dp 8) rule out a plan on the A100-40G-SXM devices alone"),
    (["gpt-tiny", "-c", CLUSTER, "--first-stage", "V100-16G"],
     "the constraints given (--first-stage V100-16G) rule out a plan on the A100-40G-SXM "
     "devices alone"),
    (["gpt-tiny", "-c", "consumer-rtx", "--last-stage", "RTX3090"],
     "the constraints given (--last-stage RTX3090) rule out a plan on the RTX4090 devices "
     "alone"),
    # the constraints make the one A100 overflow, where a leaner plan would fit it
    (["gpt2-small", "--hidden", "3072", "--layers", "16", "-c",
      "1x1xA100-40G,1x4xV100-32G@100Gbps", "-B", "32", "--recompute", "none",
      "--micro-batch", "16"],
     "under the constraints given (--micro-batch 16, --recompute none), no plan on the "
     "A100-40G-SXM devices alone fits in memory"),
    # memory alone rules the one A100 out (3.2B parameters): the memory reason stays
    (["gpt-tiny", "--hidden", "4096", "--layers", "16", "-c",
      "1x1xA100-40G,1x4xV100-32G@100Gbps", "-B", "8", "--micro-batch", "1"],
     "the model does not fit the A100-40G-SXM devices alone"),
])
def test_fastest_type_baseline_says_what_ruled_it_out(args, reason):
    assert _baseline(args, "fastest-type")["reason"] == reason


_RECIPE = re.compile(r"\(tp (\d+), pp (\d+), dp (\d+), micro-batch (\d+)(.*)\)$")


@pytest.mark.parametrize("args, wanted, data_parallel", [
    (["--tp", "2"], {"tp": 2}, "--tp 2"),
    (["--pp", "2"], {"pp": 2}, "--pp 2"),
    (["--dp", "2"], {"dp": 2}, "--dp 2"),
    (["--max-dp", "2"], {"most dp": 2}, "--max-dp 2"),
    (["--max-tp", "1", "--max-stages", "2"], {"tp": 1, "most pp": 2}, None),
    (["--micro-batch", "2"], {"mb": 2}, None),
    (["--recompute", "full"], {"savers": ", recompute full"}, None),
    (["--schedule", "gpipe"], {"savers": ", schedule gpipe"}, "--schedule gpipe"),
    (["--interleave", "2"], {"savers": ", interleave 2"}, "--interleave 2"),
    (["--zero", "3"], {"savers": ", ZeRO 3"}, "--zero 3"),  # (mixed replicas shard none)
])
def test_baselines_follow_the_constraints_given(args, wanted, data_parallel):
    """The uniform recipe takes the degrees, micro-batch size, schedule and memory
    savers the constraints allow (its description says which, as `planner estimate`
    takes them), and the data-parallel baseline is ruled out by a constraint that
    forbids a replica on every device, which its reason names."""
    result = runner.invoke(app, ["solve", "gpt-tiny", "-c", CLUSTER, "--json",
                                 "--time-limit", "10", *args])
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)
    plan_step = found["prediction"]["step_time"]
    named = {b["name"]: b for b in found["baselines"]}
    recipe = _RECIPE.search(named["uniform"]["description"])
    tp, pp, dp, mb = (int(x) for x in recipe.groups()[:4])
    got = {"tp": tp, "pp": pp, "dp": dp, "mb": mb, "savers": recipe[5]}
    for key, value in wanted.items():
        if key.startswith("most "):
            assert got[key[5:]] <= value, (key, got)
        else:
            assert got[key] == value, (key, got)
    dp_baseline = named["data-parallel"]
    if data_parallel is None:
        assert dp_baseline["prediction"] is not None
    else:
        assert dp_baseline["prediction"] is None
        assert dp_baseline["reason"] == (f"the constraints given ({data_parallel}) rule out a "
                                         "replica on every device")
    for b in named.values():  # (each a plan the constraints allow, in the search space)
        if b["prediction"] is not None:
            assert b["prediction"]["step_time"] >= plan_step * (1 - 1e-9)


@pytest.mark.parametrize("args, given", [
    # devices in file order put the A100s first: no recipe starts every pipeline on a V100
    (["-c", CLUSTER, "--first-stage", "V100-16G"], "--first-stage V100-16G"),
    # tp 2 x pp 4 in file order puts the pipeline on the A100 node and a V100 one
    (["-c", "1x4xA100-40G,2x4xV100-16G@100Gbps", "--no-mixed", "--tp", "2", "--pp", "4"],
     "--tp 2, --pp 4, --no-mixed"),
])
def test_uniform_baseline_says_when_the_constraints_rule_every_recipe_out(args, given):
    got = _baseline(["gpt-tiny", *args], "uniform")
    assert got["prediction"] is None
    assert got["reason"] == f"the constraints given ({given}) rule out every uniform recipe"


def test_data_parallel_baseline_says_the_batch_is_too_small():
    got = _baseline(["gpt-tiny", "-c", CLUSTER, "-B", "1"], "data-parallel")
    assert got["prediction"] is None
    assert got["reason"] == "a global batch of 1 cannot feed 8 replicas (one per device)"


@pytest.mark.parametrize("args, needle, fixes", [
    # --dp defaulted to 4 (8 devices, 2 per pipeline): say so, and which --dp works
    (["-B", "3", "--pp", "2"],
     "3 micro-batches (the global batch of 3 in micro-batches of 1) cannot feed 4 pipelines "
     "(--dp was not given, and defaults to as many as the devices allow: 8 devices, 2 per "
     "pipeline)", ["use one of --dp 3, 2, 1 (fewer pipelines than the devices allow)"]),
    # no --dp runs 3 micro-batches in whole rounds of 2 stages: the batch must change
    (["-B", "3", "--pp", "2", "--interleave", "2"],
     "cannot feed 4 pipelines (--dp was not given, and defaults to as many as the devices "
     "allow", ["use a global batch of 8 (or a larger multiple of 8) for 4 pipelines",
               "use a global batch of 4 (or a larger multiple of 2) with --dp 1"]),
    (["-B", "4", "--pp", "2", "--interleave", "2"],
     "a multiple of --pp 2, which 4 micro-batches over 4 pipelines (--dp was not given",
     ["use one of --dp 2, 1 (fewer pipelines than the devices allow)"]),
    (["-B", "12", "--micro-batch", "4", "--dp", "4"],
     "3 micro-batches (the global batch of 12 in micro-batches of 4) cannot feed --dp 4 "
     "pipelines.", ["use one of --dp 3, 2, 1", "use --micro-batch 3"]),
])
def test_estimate_says_which_dp_feeds_the_pipelines(args, needle, fixes):
    result = runner.invoke(app, ["estimate", "gpt2-small", "--cluster", CLUSTER, *args])
    assert result.exit_code == 1, result.output
    text = " ".join(result.stderr.split())
    assert needle in text and "Traceback" not in result.output, result.stderr
    assert "use a smaller --micro-batch or --dp" not in text
    for fix in fixes:
        assert fix in text, result.stderr


@pytest.mark.parametrize("command, args, needle", [
    ("solve", ["--tp", "4", "--tp-per-class"],
     "--tp-per-class lets each pipeline class take its own tensor-parallel degree, which "
     "contradicts --tp 4"),
    # the contradiction, not what --tp 8 alone cannot do on 4-device nodes
    ("solve", ["--tp", "8", "--max-tp", "4"], "--tp 8 contradicts --max-tp 4."),
    ("solve", ["--dp", "16", "--max-dp", "4"], "--dp 16 contradicts --max-dp 4."),
    ("estimate", ["--schedule", "gpipe", "--pp", "1"],
     "--schedule gpipe needs pipelines of several stages, which contradicts --pp 1."),
    ("estimate", ["--schedule", "gpipe"],
     "--schedule gpipe needs pipelines of several stages, which contradicts --pp 1 (the "
     "default)."),
    # NaN compares false with everything: it must not pass as "no time limit"
    ("solve", ["--time-limit", "nan"], "--time-limit must be a number of seconds, at least 0 "
     "(got nan)."),
    ("solve", ["--dtype", "xyz"], "Unknown dtype 'xyz'; use one of fp32, tf32, bf16, fp16, "
     "or auto."),
    ("estimate", ["--dtype", "xyz"], "or auto. 1) --dtype auto (the default) picks bf16"),
    ("solve", ["--tp", "3"], "and the nodes have 4 devices."),
])
def test_contradictions_are_named(command, args, needle):
    result = runner.invoke(app, [command, "gpt-tiny", "--cluster", CLUSTER, *args])
    assert result.exit_code == 1, result.output
    assert needle in " ".join(result.stderr.split()), result.stderr
    assert "Traceback" not in result.output


def test_estimate_runs_gpipe_on_several_stages():
    result = runner.invoke(app, ["estimate", "gpt-tiny", "--cluster", CLUSTER, "-B", "8",
                                 "--schedule", "gpipe", "--pp", "2", "--json"])
    assert result.exit_code == 0, result.output
    assert {p["schedule"] for p in json.loads(result.stdout)["pipelines"]} == {"gpipe"}
