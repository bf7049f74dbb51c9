"""`planner launch`: the rendered scripts (bash -n, ShellCheck, quoting), per-node
settings from the plan, the hosts file, and the CLI."""

import dataclasses
import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from planner.errors import PlannerError
from planner.launch import parse_hosts, render_launch, write_launch
from planner.planfile import plan_json, write_plan
from planner.types import DeviceGroup
from tests.runtime_helpers import tiny_plan

runner = CliRunner()
EVIL = "gpu-a1$(touch pwned);`touch pwned2` 'x' \"y\" # reboot"


@pytest.fixture(scope="module")
def hetero_plan():
    """Two nodes with different device counts used: 2 ranks on the first, 4 on the
    second (tp 2 stages), so --nproc-per-node differs per node."""
    return tiny_plan("1x2xA100-80G,1x4xV100-32G", tp=2, pp=3)


def _scripts(files):
    return {name: text for name, text in files.items() if name.endswith((".sh", ".sbatch"))}


def _check_shell(tmp_path, files):
    out = tmp_path / "out"
    write_launch(files, out, force=True)
    for name in _scripts(files):
        subprocess.run(["bash", "-n", str(out / name)], check=True)
        if shutil.which("shellcheck"):
            result = subprocess.run(["shellcheck", str(out / name)], capture_output=True,
                                    text=True)
            assert result.returncode == 0, result.stdout
    return out


@pytest.mark.parametrize("target", ["torchrun", "slurm", "local"])
def test_scripts_pass_bash_n_and_shellcheck(tmp_path, hetero_plan, target):
    hosts = parse_hosts({"a100-80g-sxm-0": {"host": "gpu-a1", "addr": "10.0.0.1",
                                            "ifname": "ib0", "cpus": "0-3",
                                            "env": {"NCCL_IB_HCA": "mlx5_0"}},
                         "v100-32g-0": "gpu-v1"}, "test")
    files = render_launch(hetero_plan, target=target, hosts=hosts, max_restarts=2,
                          runtime_args=["--steps", "5", "--data", "my data.mod:load"],
                          sbatch=["--partition=gpu"])
    _check_shell(tmp_path, files)
    assert "plan.json" in files and "README.md" in files
    for text in _scripts(files).values():
        assert "set -euo pipefail" in text
    if target == "local":
        assert set(files) == {"plan.json", "README.md", "run-local.sh"}
        text = files["run-local.sh"]
        assert "taskset -c 0-3" in text and "--cpu" in text and "127.0.0.1" in text
        assert text.count("-m planner.runtime.node") == 2
        assert "node rank 0, 2 rank(s)" in text and "node rank 1, 4 rank(s)" in text
        readme = files["README.md"]
        assert "| this machine | 127.0.0.1 |" in readme and "`node-0-" not in readme
        assert "| 0-1 |" in readme and "(`run/` in this folder" in readme
    else:  # a node with cpus runs torchrun under taskset, the others do not
        pinned, free = files["node-0-a100-80g-sxm-0.sh"], files["node-1-v100-32g-0.sh"]
        assert "exec taskset -c 0-3 \"$PYTHON\" -m planner.runtime.node" in pinned
        assert "OMP_NUM_THREADS=2" in pinned and "taskset" not in free


def test_each_node_gets_its_rank_its_process_count_and_its_devices(tmp_path, hetero_plan):
    from planner.runtime.layout import rank_layout
    from planner.runtime.node import NodeOptions, torchrun_args

    files = render_launch(hetero_plan, target="torchrun", max_restarts=1,
                          hosts=parse_hosts({"a100-80g-sxm-0": "gpu-a1"}, "t"))
    first, second = files["node-0-a100-80g-sxm-0.sh"], files["node-1-v100-32g-0.sh"]
    assert "--node a100-80g-sxm-0" in first and "--node v100-32g-0" in second
    for text in (first, second):
        assert "HEAD=gpu-a1\n" in text and '--head "$HEAD"' in text
        assert "--max-restarts 1" in text and "--resume" in text
    # the launcher runs torchrun with the plan's process count per node and the c10d
    # rendezvous, which node rank 0 hosts
    layout = rank_layout(hetero_plan)
    options = NodeOptions(plan=tmp_path / "plan.json", node="", head="gpu-a1", port=29500,
                          run_dir=tmp_path / "run", max_restarts=1)
    head, other = (torchrun_args(layout, node, options) for node in layout.nodes)
    assert "--nnodes=2" in head and "--nproc-per-node=2" in head
    assert "--nproc-per-node=4" in other and "--max-restarts=1" in other
    for args in (head, other):
        assert "--rdzv-backend=c10d" in args and "--rdzv-endpoint=gpu-a1:29500" in args
    assert "--rdzv-conf=is_host=true,join_timeout=600" in head
    assert "--rdzv-conf=is_host=false,join_timeout=600" in other
    assert "export CUDA_VISIBLE_DEVICES=0,1\n" in first
    assert "export CUDA_VISIBLE_DEVICES=0,1,2,3\n" in second
    assert "export PLANNER_NODE=v100-32g-0" in second
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in second and "OMP_NUM_THREADS" in second
    readme = files["README.md"]
    assert "| 1 | v100-32g-0 | v100-32g-0 |" in readme and "node-1-v100-32g-0.sh" in readme


def test_slurm_asks_for_one_component_per_device_type(hetero_plan):
    files = render_launch(hetero_plan, target="slurm", sbatch=["--time=01:00:00"],
                          constraints={"V100-32G": "v100"})
    sbatch = files["launch.sbatch"]
    assert sbatch.count("#SBATCH hetjob") == 1
    assert "#SBATCH --gpus-per-node=2" in sbatch and "#SBATCH --gpus-per-node=4" in sbatch
    assert "#SBATCH --constraint=v100" in sbatch and "--nodelist" not in sbatch
    assert sbatch.count("#SBATCH --time=01:00:00") == 2
    # one step, a task per node, each component's CPUs passed on
    assert sbatch.count("\nsrun ") == 1 and sbatch.count('bash "$HERE"/slurm-task.sh') == 2
    assert '--cpus-per-task="$cpus1"' in sbatch and "--kill-on-bad-exit=1" in sbatch
    assert "SCRIPTS=(node-0-a100-80g-sxm-0.sh node-1-v100-32g-0.sh)" in files["slurm-task.sh"]
    with pytest.raises(PlannerError, match="not a name SLURM can place"):
        render_launch(hetero_plan, target="slurm",
                      hosts=parse_hosts({"v100-32g-0": "alice@gpu-v1"}, "t"))


def test_values_with_shell_metacharacters_are_quoted_not_executed(tmp_path, hetero_plan):
    """Host names are checked (test_launch_checks.py); env values and runtime arguments
    may hold anything printable, and reach the program as written."""
    hosts = parse_hosts({"a100-80g-sxm-0": {"host": "alice@gpu-a1", "env": {"EVIL": EVIL}},
                         "v100-32g-0": {"host": "gpu-v1", "env": {"EVIL": EVIL}}},
                        "test")
    files = render_launch(hetero_plan, target="torchrun", hosts=hosts,
                          runtime_args=["--data", "$(touch pwned3)"])
    out = _check_shell(tmp_path, files)
    # the README's ssh lines end ssh's options before the host: copied into a shell, they
    # run each node's script on its host, in the launch folder there, all at once
    readme = render_launch(hetero_plan, target="torchrun", hosts=hosts,
                           folder="/srv/my launch")["README.md"]
    ssh = [shlex.split(line) for line in readme.splitlines() if line.startswith("    ssh ")]
    assert [line[:3] for line in ssh] == [["ssh", "--", "alice@gpu-a1"],
                                          ["ssh", "--", "gpu-v1"]]
    assert [shlex.split(line[3]) for line in ssh] == [
        ["cd", "/srv/my launch", "&&", "bash", "node-0-a100-80g-sxm-0.sh"],
        ["cd", "/srv/my launch", "&&", "bash", "node-1-v100-32g-0.sh"]]
    assert all(line[-1] == "&" for line in ssh) and "    wait" in readme.splitlines()
    # run the script with a stand-in python that records its arguments and environment
    fake = tmp_path / "fake-python"
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$EVIL" "$@" > "$ARGS_FILE"\n')
    fake.chmod(0o755)
    work = tmp_path / "cwd"
    work.mkdir()
    env = dict(os.environ, PLANNER_PYTHON=str(fake), ARGS_FILE=str(tmp_path / "args"))
    subprocess.run(["bash", str(out / "node-1-v100-32g-0.sh"), "--steps", "2"], cwd=work,
                   env=env, check=True)
    args = (tmp_path / "args").read_text().split("\n")
    assert not list(work.iterdir()) and not list(out.glob("pwned*"))
    assert args[0] == EVIL
    # the head is node rank 0's host; a user@ names the login, not the address
    assert args[args.index("--head") + 1] == "gpu-a1"
    assert args[args.index("--data") + 1] == "$(touch pwned3)"
    assert args[-3:-1] == ["--steps", "2"] and args[args.index("--plan") + 1] == str(
        out / "plan.json")


def test_hosts_file_errors_name_the_node(tmp_path, hetero_plan):
    with pytest.raises(PlannerError, match=r"node 'v100-32g-1'.*Did you mean 'v100-32g-0'"):
        render_launch(hetero_plan, target="torchrun",
                      hosts=parse_hosts({"v100-32g-1": "h"}, "hosts.yaml"))
    with pytest.raises(PlannerError, match="cpus 'all' is not a CPU list"):
        parse_hosts({"v100-32g-0": {"host": "h", "cpus": "all"}}, "hosts.yaml")
    with pytest.raises(PlannerError, match="'bad-name' is not an environment variable"):
        parse_hosts({"v100-32g-0": {"host": "h", "env": {"bad-name": "1"}}}, "hosts.yaml")
    for value in ({"host": ""}, {"addr": " "}, {"ifname": ""}):
        field = next(iter(value))
        with pytest.raises(PlannerError, match=f"node 'v100-32g-0': {field} is empty"):
            parse_hosts({"v100-32g-0": value}, "hosts.yaml")
    for value, field in (({"addr": "a\nb"}, "addr"), ({"ifname": "eth0\t"}, "ifname"),
                         ({"env": {"X": "a\nb"}}, "env X")):
        with pytest.raises(PlannerError, match=f"node 'v100-32g-0': {field} .* line break"):
            parse_hosts({"v100-32g-0": {"host": "h", **value}}, "hosts.yaml")


@pytest.mark.parametrize("target", ["torchrun", "slurm"])
def test_two_nodes_on_one_host_are_refused(hetero_plan, target):
    """Both node scripts would start torchrun on that host with the same GPUs."""
    hosts = parse_hosts({"a100-80g-sxm-0": "h", "v100-32g-0": "h"}, "hosts.yaml")
    with pytest.raises(PlannerError, match="Nodes 'a100-80g-sxm-0' and 'v100-32g-0' both "
                       "run on host 'h'"):
        render_launch(hetero_plan, target=target, hosts=hosts)
    # a host named after the other node (the default for nodes not listed) counts too
    with pytest.raises(PlannerError, match="both run on host 'v100-32g-0'"):
        render_launch(hetero_plan, target=target,
                      hosts=parse_hosts({"a100-80g-sxm-0": "v100-32g-0"}, "hosts.yaml"))
    assert "run-local.sh" in render_launch(hetero_plan, target="local", hosts=hosts)
    # names DNS takes as one host, and one address under two names
    for same in ({"a100-80g-sxm-0": "hostA", "v100-32g-0": "HOSTA."},
                 {"a100-80g-sxm-0": {"host": "a", "addr": "10.0.0.1"},
                  "v100-32g-0": {"host": "b", "addr": "10.0.0.1"}}):
        with pytest.raises(PlannerError, match="both run on host"):
            render_launch(hetero_plan, target=target, hosts=parse_hosts(same, "hosts.yaml"))


@pytest.mark.parametrize("target", ["torchrun", "slurm", "local"])
def test_a_hosts_value_with_a_line_break_is_refused(tmp_path, hetero_plan, target):
    """It would break the README (and the scripts' comments) for every target alike."""
    plan = tmp_path / "plan.json"
    write_plan(hetero_plan, plan)
    (tmp_path / "hosts.yaml").write_text('a100-80g-sxm-0: {host: "h1\\nrm -rf ~"}\n')
    result = runner.invoke(app, ["launch", str(plan), "--out", str(tmp_path / "out"),
                                 "--hosts", str(tmp_path / "hosts.yaml"), "--target", target])
    assert result.exit_code == 1 and not (tmp_path / "out").exists()
    assert "hosts.yaml: node 'a100-80g-sxm-0': host 'h1\\nrm -rf ~' has a line break" in (
        " ".join(result.stderr.split()))


def test_cpus_naming_a_node_twice_is_refused(tmp_path, hetero_plan):
    """The last value used to win silently; an unknown node was refused already."""
    plan = tmp_path / "plan.json"
    write_plan(hetero_plan, plan)
    result = runner.invoke(app, ["launch", str(plan), "--dry-run", "--cpus", "v100-32g-0=0",
                                 "--cpus", "v100-32g-0=1-3"])
    assert result.exit_code == 1 and "taskset" not in result.stdout
    assert ("--cpus names node 'v100-32g-0' twice ('0', then '1-3'); give each node's CPU "
            "list once.") in " ".join(result.stderr.split())
    assert "keep one of --cpus v100-32g-0=0 and --cpus v100-32g-0=1-3" in result.stderr
    unknown = runner.invoke(app, ["launch", str(plan), "--dry-run", "--cpus", "v100-32g-1=0"])
    assert unknown.exit_code == 1 and "node 'v100-32g-1', which the plan's cluster does not " \
        "have" in " ".join(unknown.stderr.split())


@pytest.mark.parametrize("run_dir", ["", "  ", "run\nrm"])
def test_a_run_dir_that_names_no_folder_is_refused(tmp_path, hetero_plan, run_dir):
    """An empty --run-dir used to write launch scripts that ran in the current folder."""
    plan = tmp_path / "plan.json"
    write_plan(hetero_plan, plan)
    result = runner.invoke(app, ["launch", str(plan), "--out", str(tmp_path / "out"),
                                 "--run-dir", run_dir])
    assert result.exit_code == 1 and not (tmp_path / "out").exists()
    expected = f"--run-dir {run_dir!r} is not a folder name"
    assert " ".join(expected.split()) in " ".join(result.stderr.split())


@pytest.mark.parametrize("field", ["nodes[1].host", "nodes[1].name", "nodes[1].device.name",
                                   "name"])
def test_a_plan_name_or_host_with_a_line_break_is_refused(tmp_path, hetero_plan, field):
    """Hand-edited into the plan file, it would reach the scripts and the README as
    a hosts file's would (cluster files refuse it too)."""
    evil = "v1\nrm -rf ~"
    data = json.loads(plan_json(hetero_plan))
    if field == "nodes[1].host":
        data["cluster"]["nodes"][1]["host"] = evil
    elif field == "name":
        data["cluster"]["name"] = evil
    else:  # renamed wherever the plan names it, so only the line break is wrong
        old = "v100-32g-0" if field == "nodes[1].name" else data["cluster"]["nodes"][1][
            "device"]["name"]
        data = json.loads(json.dumps(data).replace(json.dumps(old), json.dumps(evil)))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(data))
    result = runner.invoke(app, ["launch", str(plan), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1 and not (tmp_path / "out").exists()
    assert (f"{plan}: cluster.{field} 'v1\\nrm -rf ~' has a line break or another "
            "control character") in " ".join(result.stderr.split())


def test_cli_writes_refuses_to_overwrite_and_dry_runs(tmp_path, hetero_plan):
    plan = tmp_path / "plan.json"
    write_plan(hetero_plan, plan)
    (tmp_path / "hosts.yaml").write_text("a100-80g-sxm-0: gpu-a1\nv100-32g-0:\n  host: gpu-v1\n")
    out = tmp_path / "launch"
    args = ["launch", str(plan), "--out", str(out), "--hosts", str(tmp_path / "hosts.yaml"),
            "--steps", "7", "--checkpoint-every", "2"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md", "node-0-a100-80g-sxm-0.sh", "node-1-v100-32g-0.sh", "plan.json"]
    assert os.access(out / "node-0-a100-80g-sxm-0.sh", os.X_OK)
    assert "--checkpoint-every 2" in (out / "node-1-v100-32g-0.sh").read_text()
    again = runner.invoke(app, args)
    assert again.exit_code == 1 and "already exists" in again.output
    assert runner.invoke(app, [*args, "--force"]).exit_code == 0
    dry = runner.invoke(app, ["launch", str(plan), "--dry-run", "--target", "slurm"])
    assert dry.exit_code == 0 and "==> launch.sbatch <==" in dry.output
    missing = runner.invoke(app, ["launch", str(plan)])
    assert missing.exit_code == 1 and "--out" in missing.output


def test_the_plan_copy_is_the_plan(tmp_path, hetero_plan):
    from planner.planfile import read_plan

    out = _check_shell(tmp_path, render_launch(hetero_plan, target="torchrun"))
    assert read_plan(Path(out / "plan.json")) == hetero_plan


def _edited(plan, **stage0):
    """The plan with its first pipeline's first stage changed."""
    first = plan.pipelines[0]
    stage = dataclasses.replace(first.stages[0], **stage0)
    pipeline = dataclasses.replace(first, stages=(stage, *first.stages[1:]))
    return dataclasses.replace(plan, pipelines=(pipeline, *plan.pipelines[1:]))


def test_launch_refuses_plans_that_cannot_run(tmp_path, hetero_plan):
    """A plan predicted to overflow memory, and bad runtime options, stop before any file is
    written; sbatch options the script sets itself, or with spaces, are refused."""
    small = dataclasses.replace(hetero_plan.pipelines[0].stages[0].memory, optimizer=2.0**40)
    plan = tmp_path / "plan.json"
    write_plan(_edited(hetero_plan, memory=small), plan)
    out = tmp_path / "out"
    result = runner.invoke(app, ["launch", str(plan), "--out", str(out)])
    assert result.exit_code == 1 and "does not fit in device memory" in result.stderr
    assert not out.exists()
    write_plan(hetero_plan, plan, force=True)
    for bad, needle in ((["--steps", "-3"], "--steps must be positive"),
                        (["--lr", "nan"], "--lr must be a positive number"),
                        (["--data", "nomodule"], "must name a data hook as package.module"),
                        (["--sbatch=--partition=x"], "the torchrun target has none"),
                        (["--runtime-arg=--bogus"], "unrecognized arguments: --bogus"),
                        # values the runtime refuses, refused here once (not on every rank)
                        (["--runtime-arg=--timeout=inf"], "--timeout must be positive"),
                        (["--runtime-arg=--steps=0"], "--steps must be at least 1"),
                        (["--runtime-arg=--plan=x.json"], "the scripts pass the plan"),
                        (["--seed", str(10**20)], "--seed must be between 0 and 2**63 - 1")):
        result = runner.invoke(app, ["launch", str(plan), "--out", str(out), *bad])
        assert result.exit_code == 1 and needle in " ".join(result.stderr.split()), (
            result.output)
    for sbatch, needle in (("--partition=gpu queue", "without spaces"),
                           ("--nodes=4", "sets --nodes itself")):
        with pytest.raises(PlannerError, match=needle):
            render_launch(hetero_plan, target="slurm", sbatch=[sbatch])


def test_launch_refuses_a_plan_whose_stage_names_a_module_the_model_lacks(tmp_path,
                                                                          hetero_plan):
    """A hand-edited stage module failed on every rank (or blamed the model's support);
    launch builds the model on meta and names the pipeline, stage and module instead."""
    plan = tmp_path / "plan.json"
    write_plan(_edited(hetero_plan, modules=("embed", "layers.9")), plan)
    out = tmp_path / "out"
    result = runner.invoke(app, ["launch", str(plan), "--out", str(out), "--target", "local"])
    assert result.exit_code == 1 and not out.exists()
    assert (f"{plan}: Pipeline 0 stage 0 names module 'layers.9', which model gpt-tiny does "
            "not have.") in " ".join(result.stderr.split())
    assert "Traceback" not in result.output


def test_launch_of_a_plan_whose_model_cannot_be_built_here_notes_it_and_writes(tmp_path,
                                                                              hetero_plan):
    """A user's package may live on the nodes only: launch then says it did not check
    the stages' modules (each rank does) and writes the scripts."""
    from planner.types.model import ModelSpec

    plan = tmp_path / "plan.json"
    write_plan(dataclasses.replace(hetero_plan, model=ModelSpec(
        source="factory", name="no_such_package_here.models:build")), plan)
    out = tmp_path / "out"
    result = runner.invoke(app, ["launch", str(plan), "--out", str(out), "--target", "local"])
    assert result.exit_code == 0, result.output
    assert "the plan's stages were not checked against its model" in " ".join(
        result.stderr.split())
    assert (out / "run-local.sh").exists()


@pytest.mark.parametrize("change, needle", [
    (dict(device_type="H100-SXM"), "says it runs on H100-SXM, but node"),
    (dict(devices=DeviceGroup(node="a100-80g-sxm-0", devices=(0, 7))), "uses device 7"),
])
def test_every_command_reads_only_plans_the_runtime_can_run(tmp_path, hetero_plan, change,
                                                            needle):
    from planner.planfile import read_plan

    plan = tmp_path / "plan.json"
    write_plan(_edited(hetero_plan, **change), plan)
    with pytest.raises(PlannerError, match=needle):
        read_plan(plan)
    result = runner.invoke(app, ["compare", str(plan), str(plan)])
    assert result.exit_code == 1 and needle in result.stderr
