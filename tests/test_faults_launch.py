"""Runs that survive faults, across processes and nodes: every node restarts together
(a second fault during the restart included), a node started alone names the nodes that
never came, the failure report names the rank that died first, and the SLURM job takes
its hosts from SLURM, stops every task when one fails, and requeues itself after a stop
request (run with stand-in srun and scontrol)."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from planner.planfile import write_plan
from planner.runtime.reference import train_reference
from tests.runtime_helpers import free_port, tiny_plan

slow = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
HOOK_ENV = {"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _launch(tmp_path, plan, *args: str) -> Path:
    write_plan(plan, tmp_path / "plan.json")
    out = tmp_path / "launch"
    result = CliRunner().invoke(app, ["launch", str(tmp_path / "plan.json"), "--out", str(out),
                                      "--python", sys.executable, *args])
    assert result.exit_code == 0, result.output
    return out


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "losses.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _children(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == parent:
                found.append(int(entry.name))
    return found


def _environ(pid: int | str) -> dict[str, str]:
    try:
        raw = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if item)


def _launcher_of(node: str) -> int:
    """The pid of the process that starts `node`'s ranks (torchrun's agent): run-local.sh
    gives it PLANNER_NODE, torchrun gives its ranks LOCAL_RANK."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            env = _environ(entry.name)
            if env.get("PLANNER_NODE") == node and "LOCAL_RANK" not in env:
                return int(entry.name)
    raise AssertionError(f"no launcher for {node}")


def _local_rank(pid: int) -> str | None:
    return _environ(pid).get("LOCAL_RANK")


def _wait_for(condition, what: str, proc: subprocess.Popen, limit: float = 300.0):
    """Poll until `condition()` is true; the limit only bounds a hang."""
    deadline = time.monotonic() + limit
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}: {proc.stdout.read()}"
        assert time.monotonic() < deadline, f"no {what} in {limit} s"
        time.sleep(0.05)


def _end(proc: subprocess.Popen) -> None:
    """Kill what is left of a run started in a session of its own (run-local.sh, its
    launchers and their ranks), so a failed test leaves no process behind."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _logs(out: Path) -> str:
    return "".join(p.read_text()[-4000:] for p in sorted((out / "logs").glob("*.log")))


# ---------------------------------------------------------------- restarts


@slow
def test_a_second_fault_during_the_restart_is_survived_by_every_node(tmp_path, monkeypatch):
    """2 nodes of 2 ranks, --max-restarts 2: rank 3 is killed at step 3, then its
    replacement during its start-up. Each node's torchrun restarted on its own, keyed by
    its own restart count, and the nodes ended on different attempts, waiting for each
    other until the timeout. Now every node restarts together, and the losses are those
    of single-process training."""
    plan = tiny_plan("2x2xcpu", pp=2, dp=2)
    steps = 6
    out = _launch(tmp_path, plan, "--target", "local", "--steps", str(steps),
                  "--checkpoint-every", "2", "--max-restarts", "2", "--data",
                  "tests.fault_data:gated", "--master-port", str(free_port()))
    gate, run_dir = tmp_path / "gate", out / "run"
    proc = subprocess.Popen(["bash", str(out / "run-local.sh")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, **HOOK_ENV, "FAULT_GATE": str(gate)})
    try:
        _wait_for(lambda: _steps_logged(run_dir) >= 3, "step 3", proc)  # (then the gate)
        launcher = _launcher_of("cpu-1")
        first = int((run_dir / "pids" / "rank-3.pid").read_text())
        os.kill(first, signal.SIGKILL)
        found: list[int] = []

        def replacement() -> bool:
            found[:] = [pid for pid in _children(launcher)
                        if pid != first and _local_rank(pid) == "1"]
            return bool(found)

        _wait_for(replacement, "a replacement of rank 3", proc)
        os.kill(found[0], signal.SIGKILL)
        gate.touch()
        output, _ = proc.communicate(timeout=600)
    finally:
        gate.touch()
        _end(proc)
    assert proc.returncode == 0, output + _logs(out)
    rows = [json.loads(line) for line in (run_dir / "losses.jsonl").read_text().splitlines()]
    assert rows[-1]["attempt"] >= 2  # two failures survived, counted over the job
    monkeypatch.setenv("FAULT_GATE", str(gate))
    expected, _ = train_reference(plan, steps=steps, data="tests.fault_data:gated")
    got = {row["step"]: row["loss"] for row in rows}
    assert [got[i + 1] for i in range(steps)] == pytest.approx(expected, rel=1e-5)


# ---------------------------------------------------------------- a missing node


def _two_hosts(tmp_path) -> tuple[Path, Path]:
    """torchrun-target scripts for 2 CPU nodes of this machine (two names for it)."""
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("cpu-0: 127.0.0.1\ncpu-1: localhost\n")
    out = _launch(tmp_path, tiny_plan("2x2xcpu", pp=2, dp=2), "--hosts", str(hosts),
                  "--runtime-arg", "--cpu", "--master-port", str(free_port()))
    return out, out / "run"


@slow
def test_a_node_started_alone_names_the_nodes_that_never_came(tmp_path):
    """Node 0 alone waited over 700 s without a word (--timeout did not reach torchrun's
    rendezvous); node 1 alone the same. Now each fails within its rendezvous timeout and
    says which nodes are missing."""
    out, _ = _two_hosts(tmp_path)
    env = {**os.environ, "PLANNER_RDZV_TIMEOUT": "3", "CUDA_VISIBLE_DEVICES": ""}
    alone = subprocess.run(["bash", str(out / "node-0-cpu-0.sh")], capture_output=True,
                           text=True, env=env, timeout=300)
    assert alone.returncode == 1
    said = " ".join(alone.stderr.split())
    assert "error: Node cpu-0 waited 3 s at 127.0.0.1:" in said
    assert "for the plan's 2 nodes, and 1 never arrived: cpu-1." in said
    assert "start the script `planner launch` wrote for each of them" in said
    other = subprocess.run(["bash", str(out / "node-1-cpu-1.sh")], capture_output=True,
                           text=True, env=env, timeout=300)
    assert other.returncode == 1
    assert "error: Node cpu-1 could not reach node cpu-0 (node rank 0) at 127.0.0.1:" in (
        " ".join(other.stderr.split()))


# ---------------------------------------------------------------- the failure report


@slow
def test_the_report_names_the_killed_rank_not_the_ones_that_lost_it(tmp_path):
    """The report named a victim ("Connection closed by peer" on rank 1)."""
    plan = tiny_plan("2x2xcpu", pp=2, dp=2)
    out = _launch(tmp_path, plan, "--target", "local", "--steps", "8", "--data",
                  "tests.fault_data:gated", "--master-port", str(free_port()))
    gate, run_dir = tmp_path / "gate", out / "run"
    proc = subprocess.Popen(["bash", str(out / "run-local.sh")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **HOOK_ENV, "FAULT_GATE": str(gate)})
    try:
        _wait_for(lambda: _steps_logged(run_dir) >= 3, "step 3", proc)
        os.kill(int((run_dir / "pids" / "rank-3.pid").read_text()), signal.SIGKILL)
        gate.touch()  # the others go on, and find rank 3 gone
        _, err = proc.communicate(timeout=300)
    finally:
        gate.touch()
        _end(proc)
    assert proc.returncode == 1
    assert err.startswith("run-local.sh: a node failed")
    said = " ".join(err.split())
    assert ("rank 3 (node cpu-1, pipeline 1 stage 1) failed first: it was killed by signal 9 "
            "(SIGKILL)") in said, err + _logs(out)
    assert "Connection closed by peer" not in said


def test_the_report_puts_a_rank_that_failed_on_its_own_before_its_victims():
    from planner.runtime.failures import Failure, report

    def failure(rank, time, kind, message="x"):
        return Failure(rank=rank, node=f"n{rank // 2}", pipeline=rank // 2, stage=rank % 2,
                       time=time, kind=kind, message=message)

    victims = [failure(0, 1.0, "peer-lost", "RuntimeError: Connection closed by peer"),
               failure(1, 1.5, "peer-lost")]
    killed = failure(3, 9.0, "signal", "killed by signal 9 (SIGKILL), without a word")
    text = report([*victims, killed])
    assert text.startswith("rank 3 (node n1, pipeline 1 stage 1) failed first: it was killed "
                           "by signal 9 (SIGKILL)")
    assert "Then rank(s) 0, 1 lost their connection" in text
    raised = failure(2, 5.0, "error", "Step 3 of 8 gave a NaN loss.")
    assert report([*victims, raised]).splitlines()[:2] == [
        "rank 2 (node n1, pipeline 1 stage 0) failed first:", "error: Step 3 of 8 gave a "
        "NaN loss."]
    assert "no node recorded a rank that failed on its own" in report(victims)
    assert report([]) is None


# ---------------------------------------------------------------- SLURM

SRUN = r'''#!/usr/bin/env python3
"""Stand-in srun: one task per node of each component (parts between ':'); with
--kill-on-bad-exit=1 the first task that fails ends the others."""
import os, subprocess, sys, time
with open(os.environ["STUB_LOG"], "a") as log:
    log.write("srun " + " ".join(sys.argv[1:]) + "\n")
parts, part = [], []
for arg in sys.argv[1:]:
    if arg == ":":
        parts.append(part)
        part = []
    else:
        part.append(arg)
parts.append(part)
tasks, kill = [], False
for group, part in enumerate(parts):
    options = {}
    while part[0].startswith("--"):
        key, _, value = part.pop(0).partition("=")
        options[key] = value
    kill |= options.get("--kill-on-bad-exit") == "1"
    hosts = os.environ[f"SLURM_JOB_NODELIST_HET_GROUP_{group}"].split(",")
    for host in hosts[:int(options["--nodes"])]:
        env = dict(os.environ, SLURM_PROCID=str(len(tasks)), SLURMD_NODENAME=host,
                   SLURM_CPUS_PER_TASK=options["--cpus-per-task"])
        tasks.append(subprocess.Popen(part, env=env))
status = 0
while any(t.poll() is None for t in tasks):
    failed = [t for t in tasks if t.poll() not in (None, 0)]
    if failed and kill:
        for t in tasks:
            if t.poll() is None:
                t.terminate()
    time.sleep(0.05)
sys.exit(max((t.returncode != 0 for t in tasks), default=0))
'''

SCONTROL = r'''#!/usr/bin/env bash
set -euo pipefail
case "$1" in
  show)
    if [ "$2" = hostnames ]; then tr ',' '\n' <<< "$3"; else echo "   Command=$STUB_COMMAND"; fi ;;
  requeue) echo "requeue $2" >> "$STUB_LOG" ;;
esac
'''

FAKE_PYTHON = r'''#!/usr/bin/env bash
# the node launcher's stand-in: records what it was given, then fails, stops or waits
node= head= addr= run=
while [ $# -gt 0 ]; do
  case "$1" in
    --node) node=$2; shift ;; --head) head=$2; shift ;; --local-addr) addr=$2; shift ;;
    --run-dir) run=$2; shift ;;
  esac
  shift
done
echo "task $node head=$head addr=$addr cpus=$SLURM_CPUS_PER_TASK" >> "$STUB_LOG"
if [ "$node" = "${FAIL_NODE:-}" ]; then exit 3; fi
if [ -n "${STOP:-}" ]; then
  if [ "$node" = a100-0 ]; then mkdir -p "$run" && echo '{"step": 3}' > "$run/stopped.json"; fi
  exit 0
fi
# (the trap first, and the sleep off the test's pipes: a TERM that came before the trap
# left a sleep holding them, and the test waited for it)
trap 'kill "${pid:-}" 2>/dev/null; echo "terminated $node" >> "$STUB_LOG"; exit 143' TERM
sleep 300 </dev/null >/dev/null 2>&1 &
pid=$!
wait
'''


@pytest.fixture
def slurm_job(tmp_path):
    """launch.sbatch for 3 nodes (A100, V100, A100 in the plan's order: two components),
    stand-in srun and scontrol, and the environment SLURM would give the job."""
    cluster = tmp_path / "three.yaml"
    cluster.write_text(
        "schema_version: 1\nname: three-nodes\nnetwork: {bandwidth: 100Gbps}\nnodes:\n"
        "  - {name: a100-0, device: A100-80G, devices: 2}\n"
        "  - {name: v100-0, device: V100-32G, devices: 4}\n"
        "  - {name: a100-1, device: A100-80G, devices: 2}\n")
    out = _launch(tmp_path, tiny_plan(str(cluster), tp=2, pp=4), "--target", "slurm",
                  "--constraint", "A100-80G-SXM=a100", "--constraint", "V100-32G=v100")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("python", FAKE_PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    spool = tmp_path / "spool"  # sbatch runs a copy of the script, away from its folder
    spool.mkdir()
    shutil.copy(out / "launch.sbatch", spool / "slurm_script")
    log = tmp_path / "stub.log"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PLANNER_PYTHON": str(bin_dir / "python"), "STUB_LOG": str(log),
           "STUB_COMMAND": str(out / "launch.sbatch"), "SLURM_JOB_ID": "42",
           "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_NODELIST_HET_GROUP_0": "gpu-a7,gpu-a9",
           "SLURM_JOB_NODELIST_HET_GROUP_1": "gpu-v3",
           "SLURM_JOB_CPUS_PER_NODE_HET_GROUP_0": "64(x2)",
           "SLURM_JOB_CPUS_PER_NODE_HET_GROUP_1": "48"}
    return spool / "slurm_script", env, log, out


def test_the_slurm_job_takes_its_hosts_from_slurm_and_a_failing_task_stops_the_rest(slurm_job):
    """The nodelist and master address were fixed when the script was written (made-up
    names without --hosts), srun got no --cpus-per-task, a failed node left the others
    waiting, and the launch folder was the submit directory."""
    script, env, log, out = slurm_job
    text = (out / "launch.sbatch").read_text()
    assert "--nodelist" not in text and "#SBATCH --constraint=a100" in text
    assert "#SBATCH --signal=USR1@300" in text and "#SBATCH --requeue" in text
    run = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120,
                         env={**env, "FAIL_NODE": "v100-0"}, cwd=script.parent)
    assert run.returncode != 0
    lines = log.read_text().splitlines()
    assert sorted(line for line in lines if line.startswith("task ")) == [
        # plan nodes a100-0 and a100-1 on the first component's hosts, v100-0 on the
        # second's; every node meets at the first A100 host, each says its own address
        "task a100-0 head=gpu-a7 addr=gpu-a7 cpus=64",
        "task a100-1 head=gpu-a7 addr=gpu-a9 cpus=64",
        "task v100-0 head=gpu-a7 addr=gpu-v3 cpus=48"]
    assert "--kill-on-bad-exit=1" in lines[0] and lines[0].count(" : ") == 1
    assert sorted(line for line in lines if line.startswith("terminated ")) == [
        "terminated a100-0", "terminated a100-1"]
    assert not any(line.startswith("requeue") for line in lines)


def test_a_stopped_slurm_run_requeues_its_job(slurm_job):
    """Before a time limit SLURM's --signal has the ranks checkpoint and end; the job then
    requeues itself, to resume from that checkpoint."""
    script, env, log, out = slurm_job
    run = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120,
                         env={**env, "STOP": "1"}, cwd=script.parent)
    assert run.returncode == 0, run.stderr
    assert "requeueing the job to resume" in run.stderr
    assert "requeue 42" in log.read_text().splitlines()
    assert "--resume" in (out / "node-0-a100-0.sh").read_text()


# ---------------------------------------------------------------- another plan


@slow
def test_a_checkpoint_written_under_one_plan_resumes_under_another(tmp_path):
    """What re-planning on the survivors needs: 2 stages on 2 ranks train 3 steps; 2
    replicas with unequal shares resume them to 5; 2 tensor-parallel ranks to 7. The model
    and AdamW states are resharded on load, and the losses are those of single-process
    training (the data of a step does not depend on the plan)."""
    from planner.runtime.checkpoint import complete_steps
    from planner.runtime.summary import read_losses
    from tests.runtime_helpers import run_ranks

    run_dir = tmp_path / "run"
    plans = [tiny_plan("1x2xcpu", pp=2), tiny_plan("1x2xcpu", dp=2, shares=[3, 1]),
             tiny_plan("1x2xcpu", tp=2)]
    for i, (plan, steps) in enumerate(zip(plans, (3, 5, 7), strict=True)):
        path = tmp_path / f"plan-{i}.json"
        write_plan(plan, path)
        run_ranks(path, run_dir=run_dir, steps=steps, resume=i > 0)
    assert complete_steps(run_dir) == [3, 5, 7]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["first_step"] == 5
    expected, _ = train_reference(plans[0], steps=7)
    losses = read_losses(run_dir)
    assert [losses[s] for s in range(1, 8)] == pytest.approx(expected, rel=1e-5)
