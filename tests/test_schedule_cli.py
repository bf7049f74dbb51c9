"""`planner schedule` and `planner jobs` through typer's CliRunner: schedules of measured
and planner-priced jobs, files, reservations, bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from planner.planfile import read_plan
from planner.schedule.ledger import Ledger

SAMPLE = Path(__file__).parent / "data" / "gavel-sample"
CLUSTER = "1x2xA100-80G,1x2xV100-32G"
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(autouse=True)
def _ledger(tmp_path, monkeypatch):
    """Each test its own reservations ledger, never the user's."""
    monkeypatch.setenv("PLANNER_LEDGER", str(tmp_path / "ledger.sqlite"))
    return tmp_path / "ledger.sqlite"


@pytest.fixture()
def measured(tmp_path):
    shutil.copy(SAMPLE / "throughputs.json", tmp_path / "gavel.json")
    path = tmp_path / "jobs.yaml"
    path.write_text("""
throughputs: gavel.json
jobs:
  - {name: resnet, profile: "ResNet-50 (batch size 64)", steps: 20000, min_devices: 2}
  - {name: xfmr, profile: "Transformer (batch size 64)", steps: 30000}
  - {name: lm, profile: "LM (batch size 20)", steps: 50000, arrival: 20min}
  - {name: a3c, profile: A3C, steps: 20000, weight: 2, deadline: 300min}
""")
    return path


@pytest.fixture()
def priced(tmp_path):
    path = tmp_path / "jobs.yaml"
    path.write_text("""
jobs:
  - {name: big, model: gpt-tiny, global_batch: 32, steps: 30000, min_devices: 2}
  - {name: small, model: gpt-tiny, global_batch: 16, steps: 20000, arrival: 10min}
""")
    return path


def test_measured_jobs_json(measured):
    result = run("schedule", measured, "--gpus", "v100=2,p100=2,k80=4", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["kind"] == "schedule" and data["policy"] == "max-min-fairness"
    assert data["devices"] == {"k80": 4, "p100": 2, "v100": 2}
    jobs = {j["name"]: j for j in data["jobs"]}
    assert all(j["finish"] is not None for j in jobs.values())
    assert jobs["lm"]["now"] is None and jobs["lm"]["start"] >= 1200  # arrives in 20 min
    now = [jobs[name]["now"] for name in ("resnet", "xfmr", "a3c")]
    assert all(n is not None for n in now)  # three jobs, eight devices: all run now
    assert sum(len(d) for n in now for d in n["devices"].values()) <= 8
    assert jobs["a3c"]["deadline_met"] is True
    assert data["rounds"][0]["start"] == 0 and data["metrics"]["finished"] == 4
    assert data["reservations"] == []


def test_a_gavel_trace_is_a_jobs_file_too():
    result = run("schedule", SAMPLE / "physical.trace", "--throughputs",
                 SAMPLE / "throughputs.json", "--gpus", "v100=4,p100=4,k80=4", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [j["min_devices"] for j in data["jobs"]] == [1, 4, 4, 2]
    assert data["metrics"]["finished"] == 4


def test_compare_lists_every_policy(measured):
    result = run("schedule", measured, "--gpus", "v100=2,p100=2,k80=4", "--compare")
    assert result.exit_code == 0, result.output
    for name in ("max-throughput", "max-min-fairness", "min-jct", "min-makespan",
                 "finish-time-fairness", "gavel (baseline)", "fifo (baseline)"):
        assert name in result.stdout, name
    data = json.loads(run("schedule", measured, "--gpus", "v100=2,p100=2,k80=4", "--compare",
                          "--json").stdout)
    assert set(data["policies"]) >= {"min-jct", "gavel", "fifo"}


def test_priced_jobs_get_plans_launch_folders_and_reservations(priced, tmp_path, _ledger):
    out = tmp_path / "out"
    result = run("schedule", priced, "-c", CLUSTER, "--policy", "min-jct", "--out", out,
                 "--reserve", "--time-limit", "2")
    assert result.exit_code == 0, result.output
    assert "big" in result.stdout and "Reserved for big" in result.stdout
    document = json.loads((out / "schedule.json").read_text())
    now = {j["name"]: j["now"] for j in document["jobs"]}
    assert now["small"] is None and now["big"] is not None  # small arrives later
    plan = read_plan(out / "jobs" / "big" / "plan.json")
    assert {n.name for n in plan.cluster.nodes} <= set(now["big"]["devices"])
    scripts = sorted((out / "jobs" / "big").glob("*.sh"))
    assert scripts and subprocess.run(["shellcheck", *map(str, scripts)]).returncode == 0
    assert (out / "timeline.svg").read_text().startswith("<?xml")
    assert "<svg" in (out / "timeline.html").read_text()
    held = Ledger(_ledger).held(CLUSTER)
    assert {n: sorted(d) for n, d in held.items()} == now["big"]["devices"]
    # a second planner plans around the reserved devices
    again = json.loads(run("schedule", priced, "-c", CLUSTER, "--json", "--time-limit",
                           "2").stdout)
    second = next(j for j in again["jobs"] if j["name"] == "big")["now"]
    taken = {(n, d) for n, ds in now["big"]["devices"].items() for d in ds}
    assert not taken & {(n, d) for n, ds in second["devices"].items() for d in ds}
    listing = json.loads(run("jobs", "--json").stdout)
    assert [r["job"] for r in listing["reservations"]] == ["big"]
    rid = listing["reservations"][0]["id"]
    assert run("jobs", "--cancel", rid).exit_code == 0
    assert json.loads(run("jobs", "--json").stdout)["reservations"] == []
    assert "cancelled" in run("jobs", "--all").stdout
    again = run("schedule", priced, "-c", CLUSTER, "--out", out, "--time-limit", "2")
    assert again.exit_code == 1 and "already exists" in again.stderr


def test_launch_scripts_point_at_the_devices_the_job_got(priced, tmp_path, _ledger):
    """Devices 0-1 of the A100 node reserved by someone else: a job placed there gets
    devices 2-3, which its scripts make visible (its plan numbers them 0-1)."""
    cluster = "1x4xA100-80G"
    Ledger(_ledger).reserve(cluster, [("other", {"a100-80g-sxm-0": [0, 1]})], owner="x")
    out = tmp_path / "out"
    result = run("schedule", priced, "-c", cluster, "--out", out, "--time-limit", "2")
    assert result.exit_code == 0, result.output
    [script] = (out / "jobs" / "big").glob("node-*.sh")
    assert "export CUDA_VISIBLE_DEVICES=2,3" in script.read_text()


@pytest.mark.parametrize(("args", "words"), [
    (["--gpus", "v100=2", "--policy", "fairest"], ["Unknown policy 'fairest'"]),
    (["--gpus", "v100=two"], ["'v100=two' is not TYPE=COUNT"]),
    (["--gpus", "v100=2", "-c", CLUSTER], ["Give the cluster once"]),
    ([], ["Give the cluster: --cluster"]),
    (["--gpus", "x100=2"], ["No device type of the cluster (x100)"]),
    (["--gpus", "v100=2", "--round", "0"], ["--round must be a positive"]),
    (["--gpus", "v100=2", "--compare", "--reserve"], ["--compare simulates every policy"]),
])
def test_bad_options(measured, args, words):
    result = run("schedule", measured, *args)
    assert result.exit_code == 1, result.output
    for word in words:
        assert word in result.stderr, (word, result.stderr)


def test_bad_jobs(tmp_path, priced):
    result = run("schedule", priced, "--gpus", "v100=2")
    assert result.exit_code == 1 and "Job big is priced by the planner" in result.stderr
    jobs = tmp_path / "j.yaml"
    jobs.write_text("jobs:\n  - {name: r, profile: ResNet, steps: 10}\n")
    result = run("schedule", jobs, "--gpus", "v100=2")
    assert result.exit_code == 1 and "Job r gives a profile" in result.stderr
    result = run("schedule", jobs, "--gpus", "v100=2", "--throughputs",
                 SAMPLE / "throughputs.json")
    assert result.exit_code == 1 and "profile 'ResNet' is not a job type" in result.stderr
    jobs.write_text("jobs:\n  - {name: r, profile: A3C, steps: 10, min_devices: 8}\n")
    result = run("schedule", jobs, "--gpus", "v100=2", "--throughputs",
                 SAMPLE / "throughputs.json")
    assert result.exit_code == 1 and "Job r can run nowhere" in result.stderr
    result = run("schedule", tmp_path / "missing.yaml", "--gpus", "v100=2")
    assert result.exit_code == 1 and "does not exist" in result.stderr
    assert run("jobs", "--cancel", "7").exit_code == 1
