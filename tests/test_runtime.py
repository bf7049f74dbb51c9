"""The runtime trains exactly like one process: distributed runs of small plans (gloo,
one process per rank) against single-process training on the same global batch.

Parameters are compared after SGD steps (Adam divides by the gradient's running
magnitude, which turns float noise in gradients that are zero in exact arithmetic,
like an attention key bias's, into full-size updates)."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from planner.planfile import write_plan
from planner.runtime.checkpoint import complete_steps, load_full_model
from planner.runtime.reference import build_reference, train_reference
from planner.runtime.summary import read_losses
from planner.types import Recompute, Schedule, SyncAlgorithm
from tests.runtime_helpers import on_devices, resplit, run_ranks, solver_plan, tiny_plan

# Each test starts a few processes (2-20 s, more on a busy machine): all but the first run
# in `pytest -m slow` (CI's second step); the first, a pipeline by replicas with unequal
# shares against single-process training, runs in the default `pytest` too.
slow = pytest.mark.slow

STEPS = 3


def _check_against_reference(plan, run_dir, *, optimizer="sgd", lr=1e-3, data=None,
                             steps=STEPS):
    losses, model = train_reference(plan, steps=steps, lr=lr, optimizer=optimizer, data=data)
    got = read_losses(run_dir)
    assert [got[i + 1] for i in range(steps)] == pytest.approx(losses, rel=1e-5)
    _, trained = build_reference(plan, seed=0)
    load_full_model(run_dir / "checkpoints" / f"step-{steps:08d}", trained)
    expected, found = model.state_dict(), trained.state_dict()
    assert expected.keys() == found.keys()
    for name, value in expected.items():
        torch.testing.assert_close(found[name], value, rtol=1e-4, atol=1e-5, msg=name)
    return json.loads((run_dir / "summary.json").read_text())


def _run(tmp_path, plan, **options):
    path = tmp_path / "plan.json"
    write_plan(plan, path)
    run_dir = tmp_path / "run"
    options.setdefault("optimizer", "sgd")
    run_ranks(path, run_dir=run_dir, steps=options.pop("steps", STEPS), **options)
    return run_dir


def test_two_stages_by_two_replicas_with_unequal_shares(tmp_path):
    # pipeline 0 takes 6 of the 8 samples, pipeline 1 takes 2; the tied token table
    # sits in stage 0 (embedding) and stage 1 (head) of both pipelines
    plan = tiny_plan("1x4xcpu", pp=2, dp=2, shares=[3, 1])
    assert [p.batch_share for p in plan.pipelines] == [6, 2]
    summary = _check_against_reference(plan, _run(tmp_path, plan))
    assert summary["world_size"] == 4 and summary["steps_run"] == STEPS
    ranks = summary["ranks"]
    assert [(r["pipeline"], r["stage"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["peak_memory_bytes"] > 0 and r["step_time_mean"] > 0 for r in ranks)
    assert summary["step_time"]["count"] == STEPS - 1 and summary["samples_per_s"] > 0


@slow
def test_tensor_parallel_stages(tmp_path):
    plan = tiny_plan("1x4xcpu", tp=2, pp=2)
    summary = _check_against_reference(plan, _run(tmp_path, plan))
    per_rank = {r["rank"]: r["params"] for r in summary["ranks"]}
    full = sum(p.numel() for p in build_reference(plan, 0)[1].parameters())
    # blocks are sharded over the two tp ranks, embedding and head replicated
    assert per_rank[0] == per_rank[1] and per_rank[0] + per_rank[2] < full


@slow
def test_tensor_parallel_experts_with_zero(tmp_path):
    """Mixture-of-experts blocks split every expert over the tp ranks (the router runs
    whole on each), with ZeRO-3 sharding them further over two replicas. Capacity for
    every token (factor experts / top-k), so micro-batches route as the whole batch."""
    plan = tiny_plan("1x4xcpu", tp=2, dp=2, zero=3,
                     shape=(("experts", 4), ("top_k", 2), ("capacity_factor", 2.0)))
    summary = _check_against_reference(plan, _run(tmp_path, plan))
    notes = summary["notes"]
    assert not any("Block" in note or "ran as ZeRO-2" in note for note in notes)
    assert all("embed.tokens.weight" in note for note in notes if "ZeRO" in note)


@slow
def test_zero3_tensor_parallel_and_full_recompute(tmp_path):
    plan = tiny_plan("1x4xcpu", tp=2, dp=2, zero=3, recompute=Recompute.FULL, shares=[3, 1])
    summary = _check_against_reference(plan, _run(tmp_path, plan))
    assert any("ZeRO-3 ran as ZeRO-2" in note for note in summary["notes"])


@slow
def test_zero3_equal_shares_selective_recompute_and_a_tied_weight(tmp_path):
    # FSDP shards stage 0 over its replica; the token table is also the head's, in
    # stage 1, so it stays out of FSDP and is summed over all four holders
    plan = tiny_plan("1x4xcpu", pp=2, dp=2, zero=3, recompute=Recompute.SELECTIVE)
    summary = _check_against_reference(plan, _run(tmp_path, plan))
    assert not any("ZeRO" in note for note in summary["notes"])


@slow
def test_zero3_on_a_stage_that_holds_the_head_and_its_tied_table(tmp_path):
    """One stage holds the token table and the head that reads it: FSDP would gather
    the table around the embedding's forward and reshard it before the head's, so the
    table stays out of FSDP while the blocks are sharded."""
    plan = tiny_plan("1x2xcpu", pp=1, dp=2, zero=3)
    summary = _check_against_reference(plan, _run(tmp_path, plan))
    kept = [note for note in summary["notes"] if "ZeRO" in note]
    assert len(kept) == 2 and all("keeps embed.tokens.weight unsharded" in n for n in kept)


@slow
def test_pipelines_split_differently_gpipe(tmp_path):
    plan = tiny_plan("1x4xcpu", pp=2, dp=2, shares=[1, 3], schedule=Schedule.GPIPE)
    plan = resplit(plan, 1, [(0, 2), (2, 6)])
    assert plan.pipelines[0].stages[0].layers == (0, 3)
    _check_against_reference(plan, _run(tmp_path, plan))


@slow
def test_a_gpipe_solver_plan_with_zero(tmp_path):
    """The search's GPipe plans (one class, every pipeline holding all its micro-batches)
    run as planned, here with ZeRO sharding each stage over two pipelines."""
    plan = solver_plan("1x4xcpu", batch=8, schedule=Schedule.GPIPE, pp=2, dp=2,
                       micro_batch=1)
    assert {p.schedule for p in plan.pipelines} == {Schedule.GPIPE}
    assert [p.num_microbatches for p in plan.pipelines] == [4, 4]
    assert all(s.zero >= 1 for p in plan.pipelines for s in p.stages)
    _check_against_reference(plan, _run(tmp_path, plan))


@slow
def test_interleaved_schedule_with_a_data_hook(tmp_path):
    plan = tiny_plan("1x2xcpu", pp=2, interleave=2, micro_batch=2, batch=8)
    assert plan.pipelines[0].schedule is Schedule.INTERLEAVED
    assert len(plan.pipelines[0].stages[0].chunks) == 2
    hook = "tests.runtime_data:tokens"
    _check_against_reference(plan, _run(tmp_path, plan, data=hook), data=hook)


@slow
def test_an_interleaved_solver_plan_with_uneven_chunks(tmp_path):
    """The solver cuts every round alike, here unevenly (one block and two layers per
    round), and the tied token table spans both stages."""
    plan = solver_plan("1x2xcpu", batch=8, interleave=2, pp=2, micro_batch=2)
    pipe = plan.pipelines[0]
    assert pipe.schedule is Schedule.INTERLEAVED and pipe.num_microbatches == 4
    sizes = {b - a for s in pipe.stages for a, b in s.chunks}
    assert sizes == {1, 2}
    _check_against_reference(plan, _run(tmp_path, plan))


@slow
def test_an_interleaved_solver_plan_on_zero3(tmp_path):
    """Each chunk of an interleaved stage is its own FSDP unit: it gathers its weights
    around its forward and backward and reduce-scatters its gradients."""
    plan = solver_plan("1x4xcpu", batch=8, interleave=2, pp=2, dp=2, micro_batch=1,
                       zeros=(3,))
    assert {p.schedule for p in plan.pipelines} == {Schedule.INTERLEAVED}
    assert {s.zero for p in plan.pipelines for s in p.stages} == {3}
    summary = _check_against_reference(plan, _run(tmp_path, plan))
    assert not any("ZeRO-3 ran as ZeRO-2" in note for note in summary["notes"])


@slow
def test_pipelines_of_different_tensor_parallel_degrees(tmp_path):
    """Pipeline 0 runs the whole model on two tensor-parallel ranks, pipeline 1 on two
    stages of one device each: the blocks' gradients are summed between a sharded and an
    unsharded copy, the token table between a replicated copy and a stage that holds it
    beside the head, and the checkpoint holds one copy of each parameter."""
    plan = tiny_plan("1x4xcpu", pp=2, dp=2, shares=[3, 1])
    first = plan.pipelines[0]
    whole = dataclasses.replace(
        first.stages[0], layers=(0, first.stages[-1].layers[1]),
        chunks=((0, first.stages[-1].layers[1]),),
        modules=tuple(m for s in first.stages for m in s.modules), tp=2,
        devices=dataclasses.replace(first.stages[0].devices, devices=(0, 1)))
    plan = dataclasses.replace(plan, pipelines=(
        dataclasses.replace(first, stages=(whole,)), plan.pipelines[1]))
    assert [[s.tp for s in p.stages] for p in plan.pipelines] == [[2], [1, 1]]
    run_dir = _run(tmp_path, plan, steps=STEPS - 1)  # then resume from its checkpoint
    run_ranks(tmp_path / "plan.json", run_dir=run_dir, steps=STEPS, resume=True,
              optimizer="sgd")
    summary = _check_against_reference(plan, run_dir)
    assert summary["world_size"] == 4
    # Adam's states are written once per parameter too
    (tmp_path / "adam").mkdir()
    _run(tmp_path / "adam", plan, optimizer="adamw", steps=1)
    assert complete_steps(tmp_path / "adam" / "run") == [1]


@pytest.mark.parametrize(("devices", "schedule", "recompute"), [
    (((0, 1), (2,)), Schedule.ONE_F_ONE_B, Recompute.NONE),
    (((0,), (1, 2)), Schedule.ONE_F_ONE_B, Recompute.NONE),
    (((0,), (1, 2)), Schedule.GPIPE, Recompute.FULL),
])
@slow
def test_a_pipeline_whose_stages_differ_in_tensor_parallel_degree(tmp_path, devices,
                                                                   schedule, recompute):
    """One chain pairs the stages' first ranks; the wider stage's second rank follows
    its first (inputs and output gradients broadcast to it), through 1F1B's steady
    state (four micro-batches, two stages) or GPipe, where both recompute each block's
    forward, collectives included, in the backward. The token table is summed between
    a stage of tp 2 and one of tp 1 (embedding and tied head)."""
    plan = on_devices(tiny_plan("1x3xcpu", pp=2, schedule=schedule, recompute=recompute), 0,
                      devices)
    assert [s.tp for s in plan.pipelines[0].stages] == [len(d) for d in devices]
    assert plan.pipelines[0].num_microbatches == 4
    summary = _check_against_reference(plan, _run(tmp_path, plan))
    per_rank = {r["rank"]: r["params"] for r in summary["ranks"]}
    wide = 0 if len(devices[0]) == 2 else 1
    assert per_rank[wide] == per_rank[wide + 1]  # the follower holds its shards


@slow
def test_two_chains_and_two_followers(tmp_path):
    """Stages of tp 2 then tp 4: two chains pair the stages' ranks of index 0 and 1;
    the last stage's ranks of index 2 and 3 follow its first, and its rank of index 1
    runs chain 1's schedule, neither leading nor following."""
    plan = on_devices(tiny_plan("1x6xcpu", pp=2), 0, [(0, 1), (2, 3, 4, 5)])
    _check_against_reference(plan, _run(tmp_path, plan))


@slow
def test_replicas_of_a_wide_stage_sum_their_followers_gradients(tmp_path):
    """Two pipelines of stages tp 2 then tp 1, unequal shares: the followers (tp index
    1 of each first stage) sum their shards and a slice of the replicated parameters
    with each other; ZeRO asked for runs unsharded on the wide stages, and says so."""
    plan = tiny_plan("1x6xcpu", pp=2, dp=2, shares=[3, 1])
    plan = on_devices(on_devices(plan, 0, [(0, 1), (2,)]), 1, [(3, 4), (5,)])
    plan = dataclasses.replace(plan, pipelines=tuple(
        dataclasses.replace(p, stages=tuple(dataclasses.replace(s, zero=1) for s in p.stages))
        for p in plan.pipelines))
    summary = _check_against_reference(plan, _run(tmp_path, plan))
    notes = [n for n in summary["notes"] if "ZeRO" in n]
    assert len(notes) == 2 and all("wider than its pipeline's narrowest" in n for n in notes)


@slow
def test_a_killed_rank_resumes_from_the_checkpoint(tmp_path):
    """The generated local launch (torchrun) with restarts: SIGKILL a rank mid-run; the
    restarted ranks resume from the latest checkpoint and the loss curve is the one of
    an uninterrupted run (single-process training)."""
    plan = tiny_plan("1x2xcpu", pp=2, shares=None)
    write_plan(plan, tmp_path / "plan.json")
    out = tmp_path / "launch"
    steps, every = 8, 2
    from typer.testing import CliRunner

    from cli.main import app

    result = CliRunner().invoke(app, [
        "launch", str(tmp_path / "plan.json"), "--out", str(out), "--target", "local",
        "--steps", str(steps), "--checkpoint-every", str(every), "--max-restarts", "1",
        "--python", sys.executable, "--master-port", "29613"])
    assert result.exit_code == 0, result.output
    run_dir = out / "run"
    proc = subprocess.Popen(["bash", str(out / "run-local.sh")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and len(read_losses(run_dir)) < 3:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        killed_after = max(read_losses(run_dir))
        os.kill(int((run_dir / "pids" / "rank-1.pid").read_text()), signal.SIGKILL)
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output + "".join(
        p.read_text()[-3000:] for p in (out / "logs").glob("*.log"))
    rows = [json.loads(line) for line in (run_dir / "losses.jsonl").read_text().splitlines()]
    resumed = [r for r in rows if r["attempt"] == 1]
    assert resumed, "no restart happened"
    first_resumed = resumed[0]["step"]
    # at most `every` steps (plus the one in flight) are lost
    assert killed_after - every <= first_resumed - 1 <= killed_after
    assert first_resumed - 1 in complete_steps(run_dir) or first_resumed == 1
    expected, _ = train_reference(plan, steps=steps, optimizer="adamw")
    got = read_losses(run_dir)
    assert [got[i + 1] for i in range(steps)] == pytest.approx(expected, rel=1e-5)


@slow
def test_replica_sets_of_two_device_types_create_their_groups_alike(tmp_path):
    """Three one-stage pipelines, one on a slow type and two on a fast one: every rank
    creates every group exactly once, member or not (the runtime used to hang in
    new_group when a non-member created a group twice)."""
    cluster = tmp_path / "two.yaml"
    cluster.write_text(
        "schema_version: 1\nname: two-cpu-types\nnetwork: {bandwidth: 10Gbps}\nnodes:\n"
        "  - {name: slow, device: {base: cpu, name: cpu@slow}, devices: 1}\n"
        "  - {name: fast, device: {base: cpu, name: cpu@fast}, devices: 2}\n")
    plan = tiny_plan(str(cluster), pp=1, dp=3, zero=2, micro_batch=1, batch=6)
    assert [s.device_type for p in plan.pipelines for s in p.stages] == [
        "cpu@slow", "cpu@fast", "cpu@fast"]
    # the planner gives these stages no ZeRO (two replica sets hold the layers); a plan
    # that asks for it anyway runs unsharded, and the summary says so
    assert all(s.zero == 0 for p in plan.pipelines for s in p.stages)
    # (a ZeRO stage's gradients are FSDP's to sum: a ring, as the plan file requires)
    plan = dataclasses.replace(plan, pipelines=tuple(
        dataclasses.replace(p, stages=tuple(
            dataclasses.replace(s, zero=2, grad_sync=SyncAlgorithm.RING) for s in p.stages))
        for p in plan.pipelines))
    summary = _check_against_reference(plan, _run(tmp_path, plan, timeout=60.0))
    assert any("ZeRO-2 shards nothing" in note for note in summary["notes"])


@slow
def test_a_failed_local_run_prints_the_runtimes_error(tmp_path):
    """run-local.sh: when the ranks fail, the terminal gets the runtime's first error
    paragraph, not only 'a node failed' and a pointer to the logs."""
    from typer.testing import CliRunner

    from cli.main import app

    plan = tiny_plan("1x2xcpu", pp=2, shares=None)
    write_plan(plan, tmp_path / "plan.json")
    out = tmp_path / "launch"
    result = CliRunner().invoke(app, [
        "launch", str(tmp_path / "plan.json"), "--out", str(out), "--target", "local",
        "--steps", "1", "--data", "no_such_module:rows", "--python", sys.executable])
    assert result.exit_code == 0, result.output
    run = subprocess.run(["bash", str(out / "run-local.sh")], capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 1
    # the ranks of a node write one log at once, so two of their lines can interleave
    assert "error: Could not import module 'no_such_module'" in run.stderr
    assert run.stderr.startswith("run-local.sh: a node failed")


@slow
def test_a_failed_local_run_prints_the_exception_of_a_traceback(tmp_path):
    """A rank that dies in a traceback logs no error paragraph: the terminal gets the
    exception's line, not torchrun's separator. Here a data hook raises a BaseException,
    which the runtime does not turn into an error paragraph as it does an Exception."""
    import os

    from typer.testing import CliRunner

    from cli.main import app

    (tmp_path / "badhook.py").write_text(
        "class HookError(BaseException):\n    pass\n\n\n"
        "def rows(step, start, stop, *, seq_len, seed):\n"
        "    raise HookError('the data store went away')\n")
    write_plan(tiny_plan("1x2xcpu", pp=2, shares=None), tmp_path / "plan.json")
    out = tmp_path / "launch"
    result = CliRunner().invoke(app, [
        "launch", str(tmp_path / "plan.json"), "--out", str(out), "--target", "local",
        "--steps", "1", "--data", "badhook:rows", "--python", sys.executable])
    assert result.exit_code == 0, result.output
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run(["bash", str(out / "run-local.sh")], capture_output=True, text=True,
                         timeout=240, env=env)
    assert run.returncode == 1
    # (both ranks call the hook, so either may fail first)
    assert "failed first: HookError: the data store went away" in run.stderr, run.stderr


@slow
def test_a_local_run_on_a_taken_port_says_so(tmp_path):
    """torchrun fails before the runtime starts when another run holds the port: the
    terminal gets that cause and the setting that moves the port."""
    import socket

    from typer.testing import CliRunner

    from cli.main import app

    write_plan(tiny_plan("1x2xcpu", pp=2), tmp_path / "plan.json")
    out = tmp_path / "launch"
    result = CliRunner().invoke(app, ["launch", str(tmp_path / "plan.json"), "--out", str(out),
                                      "--target", "local", "--python", sys.executable])
    assert result.exit_code == 0, result.output
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run(["bash", str(out / "run-local.sh")], capture_output=True,
                             text=True, timeout=240,
                             env={**os.environ, "PLANNER_MASTER_PORT": str(port)})
    assert run.returncode == 1
    assert f"port {port} is in use" in run.stderr and "PLANNER_MASTER_PORT" in run.stderr


@slow
@pytest.mark.parametrize("flavor", ["llama3-8b", "mixtral-8x7b"])
def test_the_trace_prices_what_tensor_parallelism_moves_and_keeps(tmp_path, flavor):
    """A block sharded as the runtime shards it all-reduces, in a forward and a backward,
    what the trace's tp_comm_bytes says (per sample, each way): a dense block's two
    row-parallel outputs, a mixture-of-experts block's attention output and its
    experts' dispatched rows. Of the activations it saves, tp 2 halves the part the
    memory model splits: the residual stream's (norms' inputs and outputs, which the
    column-parallel projections save) stay whole on every rank."""
    from cost_models.memory import activation_bytes
    from planner.models import model_spec
    from planner.trace import trace_model
    from planner.types import Recompute
    from tests.runtime_helpers import tp_block_bytes

    shape = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 64, "vocab": 64,
             "experts": 4}
    if flavor != "mixtral-8x7b":
        shape.pop("experts")
    seq, batch = 16, 3
    block = trace_model(model_spec(flavor, shape), batch=batch, seq_len=seq,
                        dtype="fp32").layers[1]
    measured = tp_block_bytes(flavor, shape, seq=seq, batch=batch, out=tmp_path / "bytes")
    assert measured["all-reduced"] == pytest.approx(2 * block.tp_comm_bytes * batch)
    split = 2 * (measured["saved whole"] - measured["saved"])  # what tp 2 halves
    predicted = 2 * (activation_bytes(block, recompute=Recompute.NONE, tp=1)
                     - activation_bytes(block, recompute=Recompute.NONE, tp=2))
    assert split == pytest.approx(predicted * batch)


@slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipelines_over_three_device_types_under_the_local_launch(tmp_path, schedule):
    """A plan written by hand (tests/data/plans/three-cpu-types.json), priced as written:
    one pipeline over three device types in an order of its own (node c, then a, then
    b: not the ranks' order) with uneven layers, beside one over two of them with
    micro-batches of another size and a smaller share. `planner launch --target local`
    and its run-local.sh train it as single-process training does."""
    from pathlib import Path

    from typer.testing import CliRunner

    from cli.main import app
    from planner.price import price_file
    from tests.runtime_helpers import free_port

    plans = Path(__file__).parent / "data" / "plans"
    data = json.loads((plans / "three-cpu-types.json").read_text())
    data["cluster"] = str(plans / data["cluster"])
    for pipe in data["pipelines"]:
        pipe["schedule"] = schedule
    (tmp_path / "mine.json").write_text(json.dumps(data))
    plan = price_file(tmp_path / "mine.json").plan
    assert [[s.device_type for s in p.stages] for p in plan.pipelines] == [
        ["cpu@c", "cpu@a", "cpu@b"], ["cpu@b", "cpu@a"]]
    assert [(p.micro_batch, p.num_microbatches) for p in plan.pipelines] == [(2, 3), (1, 2)]
    write_plan(plan, tmp_path / "plan.json")
    out = tmp_path / "launch"
    result = CliRunner().invoke(app, [
        "launch", str(tmp_path / "plan.json"), "--out", str(out), "--target", "local",
        "--steps", str(STEPS), "--python", sys.executable, "--master-port", str(free_port()),
        "--runtime-arg=--optimizer", "--runtime-arg=sgd"])
    assert result.exit_code == 0, result.output
    run = subprocess.run(["bash", str(out / "run-local.sh")], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr + "".join(
        p.read_text()[-3000:] for p in (out / "logs").glob("*.log"))
    summary = _check_against_reference(plan, out / "run")
    assert summary["world_size"] == 5
