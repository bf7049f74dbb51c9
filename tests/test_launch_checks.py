"""`planner launch` refuses what would fail later, before writing anything: host names
that are no host names (one starting with '-' became an ssh option in the README), an
--out folder that cannot be written, a plan whose model changed or that the runtime
cannot run; and warns where nodes have no host but their plan names."""

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from planner.errors import PlannerError
from planner.launch import parse_hosts, render_launch, write_launch
from planner.planfile import plan_json, write_plan
from tests.runtime_helpers import tiny_plan

runner = CliRunner()


@pytest.fixture(scope="module")
def hetero_plan():
    return tiny_plan("1x2xA100-80G,1x4xV100-32G", tp=2, pp=3)


@pytest.fixture
def plan_file(tmp_path, hetero_plan):
    path = tmp_path / "plan.json"
    write_plan(hetero_plan, path)
    return path


def _said(result) -> str:
    return " ".join(result.stderr.split())


def _launch(*args: str):
    return runner.invoke(app, ["launch", *map(str, args)])


# ---------------------------------------------------------------- host names


@pytest.mark.parametrize("host", [
    "-oProxyCommand=touch pwned", "gpu-a1$(touch pwned)", "gpu a1", "gpu-", "a..b",
    "-l@gpu-a1", "alice@-oProxyCommand=x", "alice@", "@gpu-a1", "fe80::1%$(x)"])
def test_a_host_that_is_no_host_name_is_refused(tmp_path, plan_file, host):
    """`-oProxyCommand=...` was written into the README's `ssh HOST bash ...` line, where
    pasting it ran a local command; the error names the file, the node and the value."""
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(json.dumps({"a100-80g-sxm-0": host, "v100-32g-0": "gpu-v1"}))
    out = tmp_path / "out"
    result = _launch(plan_file, "--out", out, "--hosts", hosts)
    assert result.exit_code == 1 and not out.exists(), result.output
    assert (f"{hosts}: node 'a100-80g-sxm-0': host {host!r} is not a host name "
            in _said(result)), result.stderr
    assert "or an IP address, optionally after user@" in _said(result)
    assert "Traceback" not in result.output


def test_an_addr_that_is_no_address_is_refused(tmp_path):
    with pytest.raises(PlannerError, match=r"hosts.yaml: node 'n': addr '-x' is not a host "
                       r"name .* or an IP address\."):
        parse_hosts({"n": {"host": "gpu-a1", "addr": "-x"}}, "hosts.yaml")
    with pytest.raises(PlannerError, match=r"addr 'alice@10\.0\.0\.1' is not"):  # no login there
        parse_hosts({"n": {"host": "gpu-a1", "addr": "alice@10.0.0.1"}}, "hosts.yaml")


@pytest.mark.parametrize("host", [
    "gpu-a1", "GPU-A1", "alice@gpu-a1", "node_1.cluster.local.", "10.0.0.1", "fe80::1",
    "root@fe80::1%eth0", "a.b-c.d1", "4x8"])
def test_host_names_and_ip_addresses_are_hosts(host):
    from planner.launch import is_host

    assert is_host(host, user=True)
    assert parse_hosts({"n": host}, "hosts.yaml")["n"].host == host


def test_a_plan_host_that_is_no_host_name_is_refused_unless_mapped(tmp_path, hetero_plan):
    """A cluster file's host reaches the scripts as a hosts file's does; the local target
    uses no host."""
    data = json.loads(plan_json(hetero_plan))
    data["cluster"]["nodes"][1]["host"] = "-oProxyCommand=touch pwned"
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(data))
    for target in ("torchrun", "slurm"):
        result = _launch(plan, "--out", tmp_path / "out", "--target", target)
        assert result.exit_code == 1 and not (tmp_path / "out").exists()
        assert ("Node 'v100-32g-0' has no host in --hosts, and its cluster file gives it host "
                "'-oProxyCommand=touch pwned', which is not a host name") in _said(result)
        assert "map the node to its host in a hosts file" in _said(result)
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("v100-32g-0: gpu-v1\na100-80g-sxm-0: gpu-a1\n")
    assert _launch(plan, "--dry-run", "--hosts", hosts).exit_code == 0
    assert _launch(plan, "--dry-run", "--target", "local").exit_code == 0


# ---------------------------------------------------------------- the --out folder


def _unwritable(tmp_path: Path, where: str) -> Path:
    if where == "under a file":  # refused to root too, unlike a folder without write access
        (tmp_path / "a-file").write_text("x")
        return tmp_path / "a-file" / "launch" / "deeper"
    if not Path("/proc/self").is_dir():
        pytest.skip("no /proc here")
    return Path("/proc/planner-launch-test")


@pytest.mark.parametrize("where", ["under a file", "under /proc"])
def test_an_out_folder_that_cannot_be_written_is_the_error_solve_gives(tmp_path, plan_file,
                                                                      hetero_plan, where):
    """It was an internal error (exit 3, a PermissionError or NotADirectoryError)."""
    out = _unwritable(tmp_path, where)
    result = _launch(plan_file, "--out", out)
    assert result.exit_code == 1, result.output
    assert "internal error" not in result.output and "Traceback" not in result.output
    first_new = out.parent if where == "under a file" else out  # the folder made first
    solve = runner.invoke(app, ["solve", "gpt-tiny", "-c", "1x2xA100-80G", "-B", "8",
                                "--time-limit", "1", "-o", str(first_new)])
    assert solve.exit_code == 1
    error = re.search(r"error: .*?\.(?= 1\))", _said(solve)).group(0)  # its one paragraph
    assert "cannot be written" in error and error in _said(result)
    # the library raises it too (the interactive session's `save launch` catches it)
    with pytest.raises(PlannerError, match="cannot be written"):
        write_launch(render_launch(hetero_plan, target="local"), out)


# ---------------------------------------------------------------- the plan and its model


def test_launch_refuses_a_plan_whose_model_changed_as_explain_does(tmp_path, plan_file):
    """gpt-tiny edited to 6 blocks: every stage's modules still exist, so launch wrote the
    scripts; each rank then failed with a misleading "layers form no chain"."""
    data = json.loads(plan_file.read_text())
    data["model"]["overrides"] = {"layers": 6}
    plan_file.write_text(json.dumps(data))
    out = tmp_path / "out"
    result = _launch(plan_file, "--out", out)
    assert result.exit_code == 1 and not out.exists(), result.output
    explain = runner.invoke(app, ["explain", str(plan_file)])
    assert explain.exit_code == 1 and "changed since the plan was made" in explain.stderr
    assert _said(result) == _said(explain)  # the same rule, in the same words


def test_launch_refuses_a_model_the_runtime_cannot_run(tmp_path):
    """A T5-style encoder-decoder's stages hold layers of several modules (its embedding
    twice): every rank refused it when it started; launch now says so, in its words."""
    from cost_models.cluster import load_cluster
    from cost_models.model import AnalyticalCostModel
    from planner.models import load_model, model_spec
    from planner.runtime.stage import inspect_model
    from planner.solver.uniform import uniform_plan
    from planner.trace import trace_loaded
    from planner.types import TrainingSpec

    spec = model_spec("t5-base", {"layers": 2, "hidden": 64, "heads": 2, "ffn": 128})
    graph = trace_loaded(load_model(spec, seq_len=32), dtype="fp32")
    cluster = load_cluster("1x2xA100-80G")
    t5 = uniform_plan(layers=graph.layers, model=graph.spec, cluster=cluster,
                      training=TrainingSpec(global_batch=8, seq_len=32, dtype="fp32"),
                      costs=AnalyticalCostModel(cluster), tp=1, pp=2, dp=1, micro_batch=2)
    plan = tmp_path / "t5.json"
    write_plan(t5, plan)
    with pytest.raises(PlannerError) as runtime:
        inspect_model(t5)
    out = tmp_path / "out"
    result = _launch(plan, "--out", out, "--target", "local")
    assert result.exit_code == 1 and not out.exists(), result.output
    assert f"{plan}: The runtime cannot run this plan: " in _said(result)
    assert " ".join(runtime.value.message.split()) in _said(result)
    assert "T5-style encoder-decoder models cannot run yet" in _said(result)


# ---------------------------------------------------------------- nodes without a host


def test_nodes_without_a_host_are_warned_about(tmp_path, plan_file):
    """Their scripts use the plan's made-up node names as host names: a partial hosts
    file went through silently. SLURM picks such nodes itself, by type only where
    --constraint or --gres tell it."""
    partial = tmp_path / "partial.yaml"
    partial.write_text("a100-80g-sxm-0: gpu-a1\nv100-32g-0: {cpus: 0-3}\n")
    result = _launch(plan_file, "--dry-run", "--hosts", partial)
    assert result.exit_code == 0, result.output
    assert (f"warning: {partial} does not map node(s) v100-32g-0, and the plan's cluster gives "
            "them no host") in _said(result)
    assert "Map every node to its host in a hosts file" in _said(result)
    slurm = _launch(plan_file, "--dry-run", "--target", "slurm")
    assert slurm.exit_code == 0, slurm.output
    assert ("warning: no --constraint (or --gres) for A100-80G-SXM, V100-32G: SLURM may place "
            "those components on nodes of any GPU type") in _said(slurm)
    assert "does not map" not in _said(slurm) and "no --hosts maps" not in _said(slurm)
    placed = _launch(plan_file, "--dry-run", "--target", "slurm", "--constraint",
                     "A100-80G-SXM=a100", "--gres", "V100-32G=gpu:v100:4")
    assert placed.exit_code == 0 and "warning" not in placed.stderr, placed.output
    full = tmp_path / "full.yaml"
    full.write_text("a100-80g-sxm-0: gpu-a1\nv100-32g-0: {host: gpu-v1, cpus: 0-3}\n")
    for args in (["--hosts", full], ["--target", "local"]):
        quiet = _launch(plan_file, "--dry-run", *args)
        assert quiet.exit_code == 0 and "warning" not in quiet.stderr, quiet.output


def test_a_node_the_cluster_file_gives_a_host_keeps_it_with_cpus(tmp_path, hetero_plan):
    """--cpus for a node (or a hosts entry without a host) no longer replaces its cluster
    file's host with its name, and such a node is not warned about."""
    data = json.loads(plan_json(hetero_plan))
    data["cluster"]["nodes"][1]["host"] = "gpu-v1"
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(data))
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("a100-80g-sxm-0: gpu-a1\n")
    result = _launch(plan, "--dry-run", "--hosts", hosts, "--cpus", "v100-32g-0=0-3")
    assert result.exit_code == 0 and "warning" not in result.stderr, result.output
    assert "| 1 | v100-32g-0 | gpu-v1 | gpu-v1 |" in result.stdout  # (README: host, address)
