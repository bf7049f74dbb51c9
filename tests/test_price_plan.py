"""Pricing plans as written (`planner.price`, `planner estimate --plan`, `planner price`,
`planner explain`): a plan written by hand prices to the figures the solver gives a plan of
the same structure, an edited plan to figures of its own, and a bad hand-written plan gets
an error naming the field at fault."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from cost_models.cluster import load_cluster
from cost_models.model import AnalyticalCostModel
from planner.errors import PlannerError
from planner.planfile import read_plan, write_plan
from planner.price import price_file, price_plan
from planner.solver import SolveOptions, solve
from planner.solver.build import assemble, stage_plan
from planner.solver.predict import predict, replay
from planner.solver.uniform import overflows
from planner.types import ModelSpec, PipelinePlan, Recompute, Schedule, TrainingSpec

PLANS = Path(__file__).parent / "data" / "plans"
THREE = "three-types.json"  # RTX 4090 -> A100 -> RTX 3090, layers 5 + 11 + 2
MODEL = ModelSpec(source="zoo", name="gpt3-6.7b", overrides={"layers": 16})
TRAINING = TrainingSpec(global_batch=16, seq_len=1024, dtype="bf16")
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def graph():
    from planner.trace import trace_model  # (not cached: the test's cache folder is not set yet)

    return trace_model(MODEL, batch=1, seq_len=1024, dtype="bf16")


@pytest.fixture()
def layers(graph):
    return graph.layers


@pytest.fixture()
def plans(tmp_path):
    for name in (THREE, "three-gpus.yaml"):
        shutil.copy(PLANS / name, tmp_path / name)
    return tmp_path


def _written(plans: Path, edit) -> Path:
    """three-types.json changed by `edit(data)`, as another file beside it."""
    data = json.loads((plans / THREE).read_text())
    edit(data)
    path = plans / "edited.json"
    path.write_text(json.dumps(data))
    return path


def test_a_hand_written_pipeline_over_three_types_prices_as_the_solver_builds_it(layers):
    """The file gives only the layout (layers, nodes, batch share, micro-batch); the
    solver's own builder, given the same structure, prices it to the same figures: each
    stage's memory and modules, and the step by cause. Stages run against the cluster
    file's order (RTX 4090 first), and the head's tied table is summed across nodes."""
    priced = price_file(PLANS / THREE).plan
    cluster = load_cluster(str(PLANS / "three-gpus.yaml"))
    costs = AnalyticalCostModel(cluster)
    stages = tuple(
        stage_plan(index=i, layers=layers, bounds=bounds, node=node, first=0,
                   device_type=cluster.node(node).device.name, tp=1,
                   recompute=Recompute.NONE, zero=0, replicas=1, micro_batch=1,
                   microbatches=16, stages=3, schedule=Schedule.ONE_F_ONE_B, interleave=1,
                   training=TRAINING, cluster=cluster, costs=costs)
        for i, (bounds, node) in enumerate([((0, 5), "rtx4090"), ((5, 16), "a100"),
                                            ((16, 18), "rtx3090")]))
    built = assemble(model=MODEL, training=TRAINING, cluster=cluster, layers=layers,
                     costs=costs, pipelines=[PipelinePlan(
                         index=0, stages=stages, batch_share=16, micro_batch=1,
                         num_microbatches=16, schedule=Schedule.ONE_F_ONE_B)])
    assert [s.device_type for s in priced.pipelines[0].stages] == [
        "RTX4090", "A100-40G-SXM", "RTX3090"]
    assert priced.pipelines == built.pipelines
    assert priced.prediction == built.prediction
    assert priced.prediction.dp_comm > 0  # (the tied table, held by stages 0 and 2)
    assert priced.solver.status == "fixed" and priced.solver.search_space == "written by hand"
    # the simulator replays it within 1% of the closed form
    simulated = replay(priced, layers, costs).step_time
    assert simulated == pytest.approx(priced.prediction.step_time, rel=0.01)


def _strip(plan_json: dict) -> dict:
    """A plan file as a user would write it: the figures and what follows from the rest
    left out."""
    data = copy.deepcopy(plan_json)
    for key in ("prediction", "solver", "baselines"):
        del data[key]
    for pipe in data["pipelines"]:
        for key, implied in (("index", None), ("num_microbatches", None),
                             ("schedule", "1f1b"), ("interleave", 1)):
            if implied is None or pipe[key] == implied:
                del pipe[key]
        for stage in pipe["stages"]:
            for key in ("index", "modules", "memory", "device_type", "tp"):
                del stage[key]
            for key, implied in (("recompute", "none"), ("zero", 0),
                                 ("chunks", [stage["layers"]])):
                if stage[key] == implied:
                    del stage[key]
    return data


def test_solver_plans_written_without_their_figures_price_back_to_them(tmp_path, graph):
    """The solver's best plans of issue 53's example (pipelines over several device
    types with uneven splits), their files stripped to what a user writes, price back to
    every figure the solver gave them; the complete files price to themselves, solver
    report included."""
    layers = graph.layers
    cluster = load_cluster(str(PLANS / "three-gpus.yaml"))
    found = solve(graph, cluster, TRAINING, SolveOptions(
        top_k=3, time_limit=30, with_baselines=False))
    assert any(len({s.device_type for s in p.stages}) > 1
               and len({s.layers[1] - s.layers[0] for s in p.stages}) > 1
               for plan in found for p in plan.pipelines)
    for number, plan in enumerate(found):
        path = tmp_path / f"plan-{number}.json"
        write_plan(plan, path)
        assert price_plan(read_plan(path), layers) == plan
        stripped = tmp_path / f"mine-{number}.json"
        stripped.write_text(json.dumps(_strip(json.loads(path.read_text()))))
        with pytest.raises(PlannerError, match="has no prediction: it is a plan written by "
                           "hand, which is priced before it is launched"):
            read_plan(stripped)  # (launch and compare read plans with their figures)
        mine = price_plan(read_plan(stripped, written=True), layers)
        assert mine.pipelines == plan.pipelines and mine.prediction == plan.prediction


def test_estimate_plan_prints_the_plan_priced_and_writes_it(plans):
    out = plans / "priced.json"
    result = run("estimate", "--plan", plans / THREE, "-o", out)
    assert result.exit_code == 0, result.output
    for text in ("RTX4090", "A100-40G-SXM", "RTX3090", "16 x 1", "step time",
                 "Simulated step (an event-driven replay of its schedules)",
                 f"Wrote the plan to {out}"):
        assert text in result.stdout, text
    written = read_plan(out)  # complete: launch, compare and what-if read it
    assert written == price_file(plans / THREE).plan
    again = run("price", plans / THREE, "-o", out)
    assert again.exit_code == 1 and "already exists" in again.stderr
    alias = run("price", plans / THREE, "--json")
    assert alias.exit_code == 0, alias.output
    assert json.loads(alias.stdout)["prediction"] == json.loads(out.read_text())["prediction"]


def test_estimate_plan_takes_no_recipe(plans):
    result = run("estimate", "gpt2-small", "--plan", plans / THREE, "--tp", "2", "-B", "8")
    assert result.exit_code == 1
    assert ("--plan prices the plan file as written (its model, cluster, training and "
            "layout); MODEL (gpt2-small), --global-batch, --tp cannot change it.") in " ".join(
                result.stderr.split())
    bare = run("estimate")
    assert bare.exit_code == 1 and "or --plan FILE" in bare.stderr


def _moved(plan, layers):
    """`plan` with one layer moved across a boundary of its first pipeline (the first such
    edit that still fits its devices' memory and changes the step time)."""
    pipe = plan.pipelines[0]
    for boundary, step in itertools.product(range(1, len(pipe.stages)), (1, -1)):
        stages = list(pipe.stages)
        before, after = stages[boundary - 1], stages[boundary]
        cut = after.layers[0] + step
        if not before.layers[0] < cut < after.layers[1]:
            continue
        stages[boundary - 1] = _holding(before, before.layers[0], cut, layers)
        stages[boundary] = _holding(after, cut, after.layers[1], layers)
        edited = dataclasses.replace(plan, pipelines=(
            dataclasses.replace(pipe, stages=tuple(stages)), *plan.pipelines[1:]))
        priced = price_plan(edited, layers)
        changed = priced.prediction.step_time != pytest.approx(plan.prediction.step_time,
                                                               rel=1e-3)
        if changed and not overflows(priced.pipelines, priced.cluster):
            return edited
    raise AssertionError("no layer of the plan can move and still fit")


def _holding(stage, start, end, layers):
    return dataclasses.replace(stage, layers=(start, end), chunks=((start, end),),
                               modules=tuple(m for layer in layers[start:end]
                                             for m in layer.modules))


def test_explain_and_estimate_price_an_edited_plan_not_its_stored_figures(plans, graph):
    """A solver's plan with a layer moved from one stage to its neighbour: explain and
    estimate --plan show the edited plan's own step time and memory, and the solver's
    report gives way to a fixed plan's (the search's bound and gap were its own plan's)."""
    layers = graph.layers
    cluster = load_cluster(str(PLANS / "three-gpus.yaml"))
    plan = solve(graph, cluster, TRAINING, SolveOptions(time_limit=30, with_baselines=False))[0]
    edited = _moved(plan, layers)
    path = plans / "edited.json"
    write_plan(edited, path)  # (the solver's figures, now stale)
    expected = predict(edited, layers, AnalyticalCostModel(cluster))

    result = run("explain", path, "--json")
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert shown["prediction"]["step_time"] == pytest.approx(expected.step_time, rel=1e-12)
    assert shown["solver"]["status"] == "fixed"
    assert "priced again" in shown["solver"]["search_space"]
    memory = {row["total"] for row in shown["memory"]}
    assert memory != {s.memory.total for p in plan.pipelines for s in p.stages}
    assert memory == {s.memory.total for p in price_plan(edited, layers).pipelines
                      for s in p.stages}

    estimated = run("estimate", "--plan", path, "--json")
    assert estimated.exit_code == 0, estimated.output
    assert json.loads(estimated.stdout)["prediction"]["step_time"] == pytest.approx(
        expected.step_time, rel=1e-12)


def _field(data: dict, path: str) -> tuple[dict, str]:
    """The mapping that holds the field at `path` (`a.b[0].c`), and its key."""
    keys = path.replace("[", ".").replace("]", "").split(".")
    for key in keys[:-1]:
        data = data[int(key) if key.isdigit() else key]
    return data, keys[-1]


def _set(path: str, value):
    """An edit of the plan's JSON that sets the field at `path`."""
    def edit(data):
        holder, key = _field(data, path)
        holder[key] = value
    return edit


def _drop(path: str):
    """An edit of the plan's JSON that leaves out the field at `path`."""
    def edit(data):
        holder, key = _field(data, path)
        del holder[key]
    return edit


def _both(*edits):
    def edit(data):
        for one in edits:
            one(data)
    return edit


@pytest.mark.parametrize(("edit", "message"), [
    (_set("pipelines[0].stages[0].devices.node", "rtx4080"),
     "pipelines[0].stages[0].devices.node 'rtx4080' is not a node of the plan's cluster. "
     "Did you mean 'rtx4090'"),
    (_drop("pipelines[0].micro_batch"),
     "pipelines[0] gives batch_share, but a pipeline needs two of batch_share, micro_batch "
     "and num_microbatches (the third follows: share = size x count)."),
    (_both(_drop("pipelines[0].micro_batch"), _set("pipelines[0].num_microbatches", 3)),
     "pipelines[0].batch_share 16 is not a multiple of its num_microbatches 3, so its "
     "micro_batch is not whole."),
    (_set("pipelines[0].stages[1].layers", [6, 16]),
     "Pipeline 0 does not cover the model's layers 0-17 once each: a chunk starts at layer 6 "
     "where layer 5 was expected."),
    (_set("pipelines[0].stages[0].recompte", "full"),
     "field pipelines[0].stages[0].recompte: the plan has no such field (misspelt?)"),
    (_set("pipelines[0].stages[0].device_type", "RTX3090"),
     "Pipeline 0 stage 0 says it runs on RTX3090, but node rtx4090 has RTX4090 devices."),
    (_set("pipelines[0].stages[0].tp", 2),
     "Pipeline 0 stage 0 uses device 1 of node rtx4090, which has devices 0-0."),
    (_set("cluster", "three-gpu.yaml"), "field cluster: "),
    (_drop("pipelines[0].stages[2].layers"),
     "pipelines[0].stages[2] gives neither layers nor chunks: the stage holds no layers."),
])
def test_bad_hand_written_plans_name_the_field(plans, edit, message):
    result = run("estimate", "--plan", _written(plans, edit))
    assert result.exit_code == 1, result.output
    assert message in " ".join(result.stderr.split()) and "Traceback" not in result.output
    # a plan written by hand is corrected, not regenerated with `planner solve`
    assert "regenerate" not in result.stderr


def test_a_hand_written_plan_that_stops_short_of_the_model_says_so(plans):
    """Every pipeline ends on the same layer, so the layout's own check passes; the model
    has more layers than the plan runs, which pricing checks against its trace."""
    path = _written(plans, _set("pipelines[0].stages[2].layers", [16, 17]))
    for command in (("estimate", "--plan", path), ("explain", path)):
        result = run(*command)
        assert result.exit_code == 1, result.output
        assert ("Pipeline 0 runs layers 0-16, but model gpt3-6.7b (layers=16) has 18 layers "
                "(0-17); every pipeline runs the whole model.") in " ".join(result.stderr.split())


def test_a_hand_written_plan_that_does_not_fit_is_shown_and_refused(plans):
    path = _written(plans, _both(_set("pipelines[0].stages[1].layers", [5, 17]),
                                 _set("pipelines[0].stages[2].layers", [17, 18])))
    result = run("estimate", "--plan", path)
    assert result.exit_code == 1
    assert "Pipelines (identical pipelines grouped)" in result.stdout
    assert "does not fit in memory" in " ".join(result.stderr.split())
