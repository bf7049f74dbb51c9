"""Runs that survive faults, in one process: non-finite steps stop the run (or are
skipped) and are never checkpointed; checkpoints are verified on resume and a damaged or
foreign one is passed over by name; a stop request checkpoints and ends the run; a data
hook that is not deterministic is refused; the zoo GPT starts near ln(vocabulary).

The runs here are one rank in this process (a few seconds each); the multi-process
faults (restarts, lost nodes, the failure report, SLURM) are in test_faults_launch.py."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from planner.errors import PlannerError
from planner.planfile import write_plan
from planner.runtime.checkpoint import complete_steps, load_full_model, step_dir
from planner.runtime.reference import build_reference, train_reference
from planner.runtime.summary import read_losses
from tests.runtime_helpers import free_port, tiny_plan

slow = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def _env(port: int | None = None) -> dict[str, str]:
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port or free_port())}


def _mlp_plan():
    """mlp-small on one CPU (its inputs are features, which a hook can make NaN)."""
    from cost_models.cluster import load_cluster
    from cost_models.model import AnalyticalCostModel
    from planner.models import load_model, model_spec
    from planner.solver.uniform import uniform_plan
    from planner.trace import trace_loaded
    from planner.types import TrainingSpec

    graph = trace_loaded(load_model(model_spec("mlp-small", {}), seq_len=None), dtype="fp32")
    cluster = load_cluster("1x1xcpu")
    return uniform_plan(layers=graph.layers, model=graph.spec, cluster=cluster,
                        training=TrainingSpec(global_batch=8, seq_len=None, dtype="fp32"),
                        costs=AnalyticalCostModel(cluster), tp=1, pp=1, dp=1, micro_batch=4)


def _options(tmp_path, plan, **changes):
    from planner.runtime.train import RunOptions

    path = tmp_path / "plan.json"
    if not path.exists():
        write_plan(plan, path)
    return dataclasses.replace(RunOptions(plan=path, run_dir=tmp_path / "run", cpu=True,
                                          optimizer="adamw", timeout=60.0), **changes)


def _run(options):
    from planner.runtime.train import run

    return run(options, _env())


def _finite(path: Path, plan) -> bool:
    _, model = build_reference(plan, seed=0)
    load_full_model(path, model)
    return all(torch.isfinite(p).all() for p in model.parameters())


# ---------------------------------------------------------------- non-finite steps


@slow
def test_a_nan_loss_stops_the_run_with_exit_1_and_no_nan_checkpoint(tmp_path, monkeypatch,
                                                                    capsys):
    """--lr 100: the gradients overflow in step 2; the run used to go on to NaN losses,
    exit 0 and save NaN in every checkpoint."""
    from planner.runtime.__main__ import main

    plan = tiny_plan("1x1xcpu", micro_batch=2, batch=4)
    write_plan(plan, tmp_path / "plan.json")
    for key, value in _env().items():
        monkeypatch.setenv(key, value)
    code = main(["--plan", str(tmp_path / "plan.json"), "--run-dir", str(tmp_path / "run"),
                 "--cpu", "--steps", "6", "--lr", "100", "--checkpoint-every", "1"])
    err = capsys.readouterr().err
    assert code == 1
    assert "error: Step 2 of 6 gave NaN or infinite gradients on 1 rank(s): rank 0 (pipeline 0 "\
        "stage 0: " in err
    assert "the latest checkpoint (step 1) was written before it" in err
    assert "lower the learning rate (--lr 100)" in err and "Traceback" not in err
    run_dir = tmp_path / "run"
    assert complete_steps(run_dir) == [1] and not (run_dir / "summary.json").exists()
    assert _finite(step_dir(run_dir, 1), plan)
    rows = [json.loads(line) for line in (run_dir / "losses.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2 and rows[-1]["skipped"] == "non-finite: run stopped"


@slow
def test_skip_mode_skips_a_nan_step_and_stops_at_three_in_a_row(tmp_path):
    plan = _mlp_plan()
    summary = _run(_options(tmp_path, plan, steps=4, data="tests.fault_data:nan_at_step_2",
                            on_nonfinite="skip"))
    assert summary["skipped_steps"] == [2]
    losses = read_losses(tmp_path / "run")
    assert losses[2] is None and all(math.isfinite(losses[s]) for s in (1, 3, 4))
    assert _finite(step_dir(tmp_path / "run", 4), plan)
    (tmp_path / "again").mkdir()
    with pytest.raises(PlannerError, match=r"Step 4 of 6 gave a NaN loss and NaN or infinite "
                       r"gradients on 1 rank\(s\): rank 0 \(pipeline 0 stage 0: embed.weight, "
                       r"embed.bias, head.weight, ...\), 3 non-finite steps in a row "
                       r"\(--on-nonfinite skip skips up to 2\)") as stopped:
        _run(_options(tmp_path / "again", plan, steps=6, data="tests.fault_data:"
                      "nan_from_step_2", on_nonfinite="skip"))
    assert stopped.value.kind == "non-finite"
    assert "check the samples your data hook tests.fault_data:nan_from_step_2 gives for " \
        "step 4" in stopped.value.remedies


def test_on_nonfinite_is_checked_like_the_other_options(tmp_path):
    from planner.runtime.train import RunOptions, check_options

    with pytest.raises(PlannerError, match="--on-nonfinite must be stop or skip"):
        check_options(RunOptions(plan=tmp_path / "p.json", on_nonfinite="ignore"))


# ---------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished run of 6 steps with checkpoints at 2, 4 and 6, kept pristine: each test
    damages a copy."""
    base = tmp_path_factory.mktemp("trained")
    plan = tiny_plan("1x1xcpu", micro_batch=2, batch=4)
    _run(_options(base, plan, steps=6, checkpoint_every=2))
    return base, plan


def _copy(trained, tmp_path) -> Path:
    import shutil

    base, _ = trained
    shutil.copytree(base, tmp_path / "copy")
    return tmp_path / "copy"


def _resume(folder: Path, plan, steps: int = 8):
    return _run(_options(folder, plan, steps=steps, resume=True, checkpoint_every=2))


@slow
@pytest.mark.parametrize("damage, needle", [
    ("overwrite", "__0_0.distcp does not match its SHA-256 in the manifest"),
    ("truncate", "__0_0.distcp has {size} bytes where the manifest says"),
    ("metadata", ".metadata has 100 bytes where the manifest says"),
])
def test_a_damaged_checkpoint_is_passed_over_by_name(trained, tmp_path, capsys, damage,
                                                    needle):
    """4 KiB overwritten inside a shard resumed silently and trained on garbage; a truncated
    shard failed every attempt with DCP's CheckpointException, a truncated .metadata with
    an UnpicklingError. Now the run resumes from the newest intact checkpoint (step 4),
    naming the file at fault, and trains as the uninterrupted run did."""
    folder = _copy(trained, tmp_path)
    last = step_dir(folder / "run", 6)
    shard = last / "__0_0.distcp"
    if damage == "overwrite":
        with shard.open("r+b") as handle:
            handle.seek(1000)
            handle.write(b"\0" * 4096)
    elif damage == "truncate":
        os.truncate(shard, shard.stat().st_size // 2)
    else:
        os.truncate(last / ".metadata", 100)
    needle = needle.format(size=f"{shard.stat().st_size:,}")
    capsys.readouterr()
    summary = _resume(folder, trained[1])
    err = capsys.readouterr().err
    assert summary["first_step"] == 4
    assert f"warning: passed over checkpoint step-00000006: {needle}" in err
    assert f"resumed from step 4 ({step_dir(folder / 'run', 4)})" in err
    expected, _ = train_reference(trained[1], steps=8)
    losses = read_losses(folder / "run")
    assert [losses[s] for s in range(1, 9)] == pytest.approx(expected, rel=1e-5)
    # the damaged folder is kept aside, the new step 6 is whole
    assert (folder / "run" / "checkpoints" / "step-00000006.damaged-1").is_dir()
    assert complete_steps(folder / "run") == [2, 4, 6, 8]


@slow
def test_a_run_directory_of_another_model_is_refused_by_name(trained, tmp_path):
    """Resuming with another model was an opaque CheckpointException (the size mismatch
    only in the logs)."""
    folder = _copy(trained, tmp_path)
    wider = tiny_plan("1x1xcpu", micro_batch=2, batch=4, shape=(("layers", 2),))
    write_plan(wider, folder / "plan.json", force=True)
    with pytest.raises(PlannerError) as caught:
        _resume(folder, wider)
    assert caught.value.kind == "bad-checkpoint"
    message = caught.value.message
    assert "holds no checkpoint this run can resume from: step-00000006: it holds another " \
        "model: gpt-tiny (867,072 parameters), where this run trains gpt-tiny" in message
    assert "step-00000004: it holds another" in message
    assert "start afresh with another --run-dir" in " ".join(caught.value.remedies)


@slow
def test_another_optimizer_is_refused_and_the_plan_is_recorded(trained, tmp_path):
    folder = _copy(trained, tmp_path)
    with pytest.raises(PlannerError, match="it holds adamw optimizer state, where this run "
                       r"uses sgd \(--optimizer\)"):
        _run(_options(folder, trained[1], steps=8, resume=True, optimizer="sgd"))
    manifest = json.loads((step_dir(folder / "run", 6) / "manifest.json").read_text())
    summary = json.loads((folder / "run" / "summary.json").read_text())
    assert manifest["plan"] == summary["plan_fingerprint"]
    assert manifest["model"] == summary["model_fingerprint"]
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp"}


def test_a_checkpoint_is_published_whole_or_not_at_all(tmp_path):
    """DCP writes into a partial folder that no resume looks at; the step's folder appears
    with its manifest, by a rename."""
    from planner.runtime.checkpoint import _partial_dir

    partial = _partial_dir(tmp_path, 4)
    partial.mkdir(parents=True)
    (partial / ".metadata").write_bytes(b"x")
    assert complete_steps(tmp_path) == []


# ---------------------------------------------------------------- a stop request


@slow
def test_sigusr1_checkpoints_after_the_step_and_ends_the_run(tmp_path):
    """What SLURM's --signal sends before a time limit killed the rank (USR1's default)."""
    plan = tiny_plan("1x1xcpu", micro_batch=2, batch=4)
    write_plan(plan, tmp_path / "plan.json")
    run = subprocess.run(
        [sys.executable, "-m", "planner.runtime", "--plan", str(tmp_path / "plan.json"),
         "--run-dir", str(tmp_path / "run"), "--cpu", "--steps", "6",
         "--data", "tests.fault_data:stop_in_step_3"],
        env={**os.environ, **_env(), "PYTHONPATH": str(ROOT)}, cwd=ROOT, capture_output=True,
        text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "stopped after step 3 of 6 on request (SIGUSR1)" in run.stderr
    run_dir = tmp_path / "run"
    assert complete_steps(run_dir) == [3] and sorted(read_losses(run_dir)) == [1, 2, 3]
    stopped = json.loads((run_dir / "stopped.json").read_text())
    assert stopped["step"] == 3
    assert json.loads((run_dir / "summary.json").read_text())["stopped"] == stopped["reason"]


# ---------------------------------------------------------------- data and initialization


def test_a_data_hook_that_is_not_deterministic_is_refused():
    """Stages then trained on samples that did not match, silently."""
    from planner.runtime.data import Batches

    info, _ = build_reference(tiny_plan("1x1xcpu", micro_batch=2, batch=4), seed=0)
    batches = Batches(info.loaded, global_batch=4, seed=0, hook="tests.fault_data:unstable",
                      vocab=info.vocab, classes=info.classes)
    with pytest.raises(PlannerError, match=r"Data hook 'tests.fault_data:unstable' returned "
                       r"different samples when called twice with the same arguments \(step 0, "
                       r"samples 0-2\)") as caught:
        batches.get(0, 0, 2)
    assert caught.value.kind == "bad-data"
    steady = Batches(info.loaded, global_batch=4, seed=0, hook="tests.runtime_data:tokens",
                     vocab=info.vocab, classes=info.classes)
    first = steady.get(0, 0, 2)
    assert torch.equal(first[0][0], steady.get(0, 0, 2)[0][0])


def test_the_zoo_gpt_starts_at_about_ln_vocabulary():
    """Its tied token table kept PyTorch's N(0, 1): the first loss was about 85."""
    losses, _ = train_reference(tiny_plan("1x1xcpu", micro_batch=2, batch=4), steps=1)
    assert losses[0] == pytest.approx(math.log(512), rel=0.05)


def test_a_checkpoint_interval_past_the_last_step_is_warned_about(tmp_path):
    from typer.testing import CliRunner

    from cli.main import app

    write_plan(tiny_plan("1x1xcpu", micro_batch=2, batch=4), tmp_path / "plan.json")
    result = CliRunner().invoke(app, ["launch", str(tmp_path / "plan.json"), "--dry-run",
                                      "--target", "local", "--steps", "10",
                                      "--checkpoint-every", "100"])
    assert result.exit_code == 0, result.output
    assert ("warning: --checkpoint-every 100 with 10 step(s) to run (to step 10): no periodic "
            "checkpoint, only the final one") in " ".join(result.stderr.split())


def test_under_the_c10d_rendezvous_the_plan_numbers_the_ranks():
    """torchrun's c10d rendezvous numbers nodes as they join: its RANK and GROUP_RANK say
    nothing of the plan, PLANNER_NODE and LOCAL_RANK do (PLANNER_RANKS=plan)."""
    from planner.runtime.env import validate_environment
    from planner.runtime.layout import rank_layout

    plan = tiny_plan("2x2xcpu", pp=2, dp=2)
    layout = rank_layout(plan)
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
           "PLANNER_NODE": "cpu-1", "PLANNER_RANKS": "plan"}
    place = validate_environment(plan, layout, env)
    assert (place.slot.rank, place.slot.node, place.slot.pipeline, place.slot.stage) == (
        3, "cpu-1", 1, 1)
    with pytest.raises(PlannerError, match="PLANNER_NODE: expected the plan node this host "
                       "plays"):
        validate_environment(plan, layout, {k: v for k, v in env.items()
                                            if k != "PLANNER_NODE"})
