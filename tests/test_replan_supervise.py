"""The supervisor (`planner launch --supervise`, planner/runtime/supervise.py): which nodes a
failed run lost, and a run that loses a node mid-run re-planned onto the survivor and
resumed, its losses those of single-process training resumed from the same checkpoint."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from planner.planfile import write_plan
from planner.runtime.failures import Failure
from planner.runtime.node import NodeRecord
from planner.runtime.supervise import judge
from tests.runtime_helpers import free_port, tiny_plan
from tests.test_faults_launch import HOOK_ENV, _end, _environ, _logs, _steps_logged, _wait_for

slow = pytest.mark.slow


def _record(node: str, status: str, message: str = "") -> NodeRecord:
    return NodeRecord(node=node, node_rank=int(node[-1]), host=f"host-{node}", pid=1,
                      started=0.0, status=status, code=None if status == "running" else 1,
                      message=message)


def _failure(rank: int, kind: str, time: float, message: str = "x") -> Failure:
    return Failure(rank=rank, node=f"cpu-{rank // 2}", pipeline=rank % 2, stage=rank // 2,
                   time=time, kind=kind, message=message)


def test_a_node_whose_launcher_ended_without_a_word_is_lost():
    records = {"cpu-0": _record("cpu-0", "failed"), "cpu-1": _record("cpu-1", "running")}
    verdict = judge(["cpu-0", "cpu-1"], records, [_failure(0, "peer-lost", 5.0)])
    assert verdict.lost == ("cpu-1",)
    assert "ended without a word" in verdict.why
    # a node that never started (no record) is as lost
    assert judge(["cpu-0", "cpu-1"], {"cpu-0": records["cpu-0"]}, []).lost == ("cpu-1",)


def test_the_node_of_a_rank_killed_first_is_lost_and_its_victims_are_not():
    records = {n: _record(n, "failed") for n in ("cpu-0", "cpu-1")}
    found = [_failure(0, "peer-lost", 1.0), _failure(1, "peer-lost", 1.5),
             _failure(3, "signal", 9.0, "killed by signal 9 (SIGKILL), without a word")]
    verdict = judge(["cpu-0", "cpu-1"], records, found)
    assert verdict.lost == ("cpu-1",)
    assert verdict.why.startswith("rank 3 (node cpu-1, pipeline 1 stage 1) failed: killed")
    # another rank's error before it (torchrun noticed the death a second late)
    earlier = [_failure(0, "exception", 8.5, "RuntimeError: [gloo] unexpected end"), *found]
    assert judge(["cpu-0", "cpu-1"], records, earlier).lost == ("cpu-1",)
    gpu = [_failure(1, "exception", 2.0, "RuntimeError: CUDA error: GPU is lost")]
    assert judge(["cpu-0", "cpu-1"], records, gpu).lost == ("cpu-0",)


def test_a_rank_that_failed_on_its_own_or_a_launch_that_failed_loses_no_node():
    """A NaN, a bad checkpoint or a bug would fail alike under any plan; a launch where
    no node started is not a node's loss either."""
    records = {n: _record(n, "failed") for n in ("cpu-0", "cpu-1")}
    nan = [_failure(2, "error", 3.0, "Step 3 of 8 gave a NaN loss."),
           _failure(0, "peer-lost", 1.0)]
    verdict = judge(["cpu-0", "cpu-1"], records, nan)
    assert verdict.lost == () and "NaN loss" in verdict.why
    assert judge(["cpu-0", "cpu-1"], records,
                 [_failure(1, "exception", 2.0, "ValueError: bad shape")]).lost == ()
    assert judge(["cpu-0", "cpu-1"], {}, []).lost == ()
    errors = {n: _record(n, "error", "port 29500 is in use") for n in ("cpu-0", "cpu-1")}
    assert "port 29500 is in use" in judge(["cpu-0", "cpu-1"], errors, []).why


@slow
def test_a_node_launcher_records_how_it_ended(tmp_path):
    """What the supervisor tells a lost node by: a launcher records its node "running"
    when it starts and how it ended when it ends, a SIGTERM before torchrun runs
    included; one killed outright leaves "running"."""
    from planner.runtime.node import read_records

    write_plan(tiny_plan("2x1xcpu", pp=2), tmp_path / "plan.json")
    run_dir = tmp_path / "run"

    def launcher(node: str, timeout: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "planner.runtime.node", "--plan",
             str(tmp_path / "plan.json"), "--node", node, "--head", "127.0.0.1", "--port",
             str(free_port()), "--run-dir", str(run_dir), "--rendezvous-timeout", timeout],
            stderr=subprocess.PIPE, text=True, env={**os.environ, **HOOK_ENV})

    alone = launcher("cpu-1", "1")  # node rank 0 never comes
    _, err = alone.communicate(timeout=300)
    assert alone.returncode == 1 and "could not reach node cpu-0" in err
    record = read_records(run_dir)["cpu-1"]
    assert (record.status, record.code, record.node_rank) == ("error", 1, 1)
    assert record.message.startswith("Node cpu-1 could not reach node cpu-0 (node rank 0)")
    assert record.host and record.ended >= record.started
    head = launcher("cpu-0", "600")  # waits for cpu-1
    _wait_for(lambda: "cpu-0" in read_records(run_dir), "cpu-0's record", head)
    assert read_records(run_dir)["cpu-0"].status == "running"
    head.send_signal(signal.SIGTERM)
    head.communicate(timeout=300)
    assert head.returncode == 143
    assert (read_records(run_dir)["cpu-0"].status, read_records(run_dir)["cpu-0"].code) == (
        "stopped", 143)


def test_launch_supervise_writes_the_supervisor_and_what_it_needs(tmp_path):
    write_plan(tiny_plan("2x2xcpu", pp=2, dp=2), tmp_path / "plan.json")
    out = tmp_path / "launch"
    result = CliRunner().invoke(app, ["launch", str(tmp_path / "plan.json"), "--out", str(out),
                                      "--target", "local", "--supervise", "--max-replans",
                                      "2", "--checkpoint-every", "2"])
    assert result.exit_code == 0, result.output
    assert "Run: bash " in result.output and "supervise.sh" in result.output
    text = (out / "supervise.sh").read_text()
    assert "-m planner.runtime.supervise --folder \"$HERE\" --max-replans 2" in text
    shellcheck = subprocess.run(["shellcheck", str(out / "supervise.sh")], capture_output=True,
                                text=True)
    assert shellcheck.returncode == 0, shellcheck.stdout
    record = json.loads((out / "launch.json").read_text())
    assert record["target"] == "local" and "--resume" in record["runtime_args"]
    assert record["supervise"] == {"max_replans": 2, "time_limit": 10.0}
    assert "Supervised: `bash supervise.sh`" in (out / "README.md").read_text()
    refused = CliRunner().invoke(app, ["launch", str(tmp_path / "plan.json"), "--out",
                                       str(tmp_path / "other"), "--max-replans", "2"])
    assert refused.exit_code == 1
    assert "--max-replans set(s) up the supervisor; give --supervise too" in refused.output


def _ranks_of(node: str, root: int) -> list[int]:
    """The pids of `node`'s ranks (torchrun gives them LOCAL_RANK, the launcher
    PLANNER_NODE) among the descendants of process `root` (never another run's, which
    other tests on this machine may have going)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == root:
                return True
        return False

    return [pid for pid in parents if descends(pid)
            and (env := _environ(pid)).get("PLANNER_NODE") == node and "LOCAL_RANK" in env]


@slow
def test_the_supervisor_replans_onto_the_survivor_when_a_node_is_lost(tmp_path, monkeypatch):
    """4 ranks on 2 nodes (2 stages x 2 pipelines), checkpoints every 2 steps; node cpu-1's
    ranks are killed at step 3. --max-restarts restarts the same plan, which cannot start
    without the node: training stopped until someone re-planned by hand. The supervisor
    re-plans onto cpu-0 and resumes from step 2, losing 1 step (at most the checkpoint
    interval), and the losses after resuming are those of single-process training resumed
    from the same checkpoint."""
    from planner.planfile import read_plan
    from planner.runtime.checkpoint import step_dir
    from planner.runtime.reference import train_reference
    from planner.runtime.summary import read_losses

    plan = tiny_plan("2x2xcpu", pp=2, dp=2)
    write_plan(plan, tmp_path / "plan.json")
    out, steps = tmp_path / "launch", 6
    result = CliRunner().invoke(app, [
        "launch", str(tmp_path / "plan.json"), "--out", str(out), "--target", "local",
        "--python", sys.executable, "--supervise", "--steps", str(steps),
        "--checkpoint-every", "2", "--data", "tests.fault_data:gated",
        "--master-port", str(free_port())])
    assert result.exit_code == 0, result.output
    gate, run_dir = tmp_path / "gate", out / "run"
    proc = subprocess.Popen(["bash", str(out / "supervise.sh")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, **HOOK_ENV, "FAULT_GATE": str(gate)})
    try:
        _wait_for(lambda: _steps_logged(run_dir) >= 3, "step 3", proc)  # (then the gate)
        for pid in _ranks_of("cpu-1", proc.pid):
            os.kill(pid, signal.SIGKILL)
        gate.touch()
        output, _ = proc.communicate(timeout=600)
    finally:
        gate.touch()
        _end(proc)
    assert proc.returncode == 0, output + _logs(out) + _logs(out / "replan-1")
    entries = [json.loads(line) for line in
               (run_dir / "supervisor.jsonl").read_text().splitlines()]
    assert len(entries) == 1
    entry = entries[0]
    assert entry["lost"] == ["cpu-1"]
    assert entry["why"].startswith(("rank 2 (node cpu-1", "rank 3 (node cpu-1")), entry["why"]
    assert entry["resume_step"] == 2 and entry["last_step"] == 3
    assert entry["steps_lost"] == 1 <= 2  # at most the checkpoint interval
    new = read_plan(out / "replan-1" / "plan.json")
    assert {s.devices.node for p in new.pipelines for s in p.stages} == {"cpu-0"}
    assert new.training.global_batch == plan.training.global_batch
    assert f"resuming from step 2 (1 step(s) lost) with {out / 'replan-1'}" in " ".join(
        output.split())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["first_step"] == 2 and summary["world_size"] == 2
    monkeypatch.setenv("FAULT_GATE", str(gate))
    expected, _ = train_reference(plan, steps=steps, data="tests.fault_data:gated",
                                  start=step_dir(run_dir, 2))
    losses = read_losses(run_dir)
    assert [losses[s] for s in range(3, steps + 1)] == pytest.approx(expected, rel=1e-5)
    before, _ = train_reference(plan, steps=2, data="tests.fault_data:gated")
    assert [losses[1], losses[2]] == pytest.approx(before, rel=1e-5)


STUB = r'''#!/usr/bin/env python3
"""Stand-in ssh and sbatch: log the command line, and play the nodes of the folder it
starts: in round 0 node $LOST_NODE ends without a word (its record says "running") and
the others fail; in a re-planned folder (replan-N) every node ends well."""
import json, os, sys, time
from pathlib import Path
sys.path.insert(0, os.environ["STUB_ROOT"])
from planner.planfile import read_plan
from planner.runtime.layout import rank_layout
from planner.runtime.node import NodeRecord, write_record

with open(os.environ["STUB_LOG"], "a") as log:
    log.write(Path(sys.argv[0]).name + " " + " ".join(sys.argv[1:]) + "\n")
if Path(sys.argv[0]).name == "ssh":
    host, command = sys.argv[-2:]
    folder = Path(command.split("'")[1] if "'" in command else command.split()[1])
    script = command.rpartition(" ")[2].strip("'")
    nodes = [n for n in rank_layout(read_plan(folder / "plan.json")).nodes
             if f"node-{n.node_rank}-{n.name}.sh" == script]
else:
    folder = Path(sys.argv[-1]).parent
    nodes = list(rank_layout(read_plan(folder / "plan.json")).nodes)
replanned = folder.name.startswith("replan-")
run_dir = Path(os.environ["PLANNER_RUN_DIR"])
code = 0
for node in nodes:
    lost = not replanned and node.name == os.environ["LOST_NODE"]
    status = "done" if replanned else "running" if lost else "failed"
    write_record(run_dir, NodeRecord(node=node.name, node_rank=node.node_rank,
                                     host=f"host-{node.name}", pid=os.getpid(),
                                     started=time.time(), status=status,
                                     code=None if lost else 0 if replanned else 1))
    code = code or (255 if lost else 0 if replanned else 1)
sys.exit(code)
'''


@pytest.mark.parametrize("target", ["torchrun", "slurm"])
def test_the_supervisor_restarts_on_the_nodes_left_over_ssh_and_resubmits_to_slurm(
        tmp_path, target):
    """torchrun: every node's script over ssh at once, in its folder; after a node is lost,
    the new plan's scripts on the hosts left. SLURM: sbatch --wait, and after a loss the
    new plan's job, excluding the lost node's host (stand-in ssh and sbatch play the
    nodes)."""
    from planner.launch import node_script
    from planner.planfile import read_plan
    from planner.runtime.layout import rank_layout

    plan = tiny_plan("3x2xA100-80G", pp=2, dp=3)
    write_plan(plan, tmp_path / "plan.json")
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("".join(f"a100-80g-sxm-{i}: gpu-{i}\n" for i in range(3)))
    out = tmp_path / "launch"
    result = CliRunner().invoke(app, [
        "launch", str(tmp_path / "plan.json"), "--out", str(out), "--target", target,
        "--supervise", "--checkpoint-every", "2",
        *(["--hosts", str(hosts)] if target == "torchrun" else [])])
    assert result.exit_code == 0, result.output
    bin_dir, log, run_dir = tmp_path / "bin", tmp_path / "stub.log", tmp_path / "run"
    bin_dir.mkdir()
    for name in ("ssh", "sbatch"):
        (bin_dir / name).write_text(STUB.replace("python3", sys.executable, 1))
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PLANNER_SSH": str(bin_dir / "ssh"),
           "PLANNER_SBATCH": str(bin_dir / "sbatch"), "STUB_LOG": str(log),
           "STUB_ROOT": str(Path(__file__).resolve().parents[1]),
           "LOST_NODE": "a100-80g-sxm-1", "PLANNER_RUN_DIR": str(run_dir),
           "PLANNER_PYTHON": sys.executable}
    run = subprocess.run(["bash", str(out / "supervise.sh")], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    said = " ".join(run.stderr.split())
    assert "lost a100-80g-sxm-1: node(s) a100-80g-sxm-1 ended without a word" in said
    calls = log.read_text().splitlines()
    new = out / "replan-1"
    if target == "torchrun":
        assert sorted(calls[:3]) == [
            f"ssh -o BatchMode=yes -o ServerAliveInterval=15 -o ServerAliveCountMax=4 -- "
            f"gpu-{i} cd {out} && bash node-{i}-a100-80g-sxm-{i}.sh" for i in range(3)]
        left = rank_layout(read_plan(new / "plan.json")).nodes  # (those the new plan uses)
        assert sorted(call.split(" -- ")[1] for call in calls[3:]) == sorted(
            f"gpu-{n.name[-1]} cd {new} && bash {node_script(n)}" for n in left)
        assert "gpu-1" not in " ".join(calls[3:])
        assert sorted(json.loads((new / "launch.json").read_text())["hosts"]) == [
            n.name for n in left]
    else:
        assert calls == [f"sbatch --wait {out / 'launch.sbatch'}",
                         f"sbatch --wait --exclude=host-a100-80g-sxm-1 "
                         f"{new / 'launch.sbatch'}"]
    assert "a100-80g-sxm-1" not in (new / "plan.json").read_text().split('"nodes"')[0]
    moved = run_dir / "supervisor" / "round-0" / "nodes"
    assert sorted(p.name for p in moved.iterdir()) == [
        "a100-80g-sxm-0.json", "a100-80g-sxm-1.json", "a100-80g-sxm-2.json"]


@slow
def test_a_checkpoint_resumes_under_a_plan_of_other_device_types_and_shares(tmp_path):
    """What a re-plan onto other nodes needs beside other tp, pp and dp
    (test_faults_launch): 2 stages on two CPU ranks train 3 steps; pipelines on an A100
    and a V100 (run on the CPU), with unequal shares, resume them to 6. The AdamW state
    (its step count and moments) reshards on load and each step's samples are those of
    the uninterrupted run: the losses after resuming are those of single-process
    training resumed from the same checkpoint, and of training never interrupted."""
    from planner.runtime.checkpoint import step_dir
    from planner.runtime.reference import train_reference
    from planner.runtime.summary import read_losses
    from tests.runtime_helpers import run_ranks

    run_dir = tmp_path / "run"
    first = tiny_plan("1x2xcpu", pp=2)
    second = tiny_plan("1x1xA100-80G,1x1xV100-32G@100Gbps", dp=2, micro_batch=1,
                       shares=[5, 3])
    assert {s.device_type for p in second.pipelines for s in p.stages} == {
        "A100-80G-SXM", "V100-32G"}
    for i, (plan, steps) in enumerate(((first, 3), (second, 6))):
        write_plan(plan, tmp_path / f"plan-{i}.json")
        run_ranks(tmp_path / f"plan-{i}.json", run_dir=run_dir, steps=steps, resume=i > 0,
                  cpu=True)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["first_step"] == 3
    losses = read_losses(run_dir)
    resumed, _ = train_reference(first, steps=6, start=step_dir(run_dir, 3))
    assert [losses[s] for s in range(4, 7)] == pytest.approx(resumed, rel=1e-5)
    whole, _ = train_reference(first, steps=6)
    assert [losses[s] for s in range(1, 7)] == pytest.approx(whole, rel=1e-5)
