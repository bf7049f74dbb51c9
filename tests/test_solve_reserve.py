"""`planner solve` with the reservations ledger: it plans on the devices no reservation
holds, names them as the node numbers them, and `--reserve` books the plan's own."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cli.main import app
from planner.planfile import read_plan
from planner.runtime.layout import rank_layout
from planner.schedule.ledger import RETRIES, Ledger

CLUSTER = "1x4xV100-32G,1x4xA100-80G@100Gbps"
A100 = "a100-80g-sxm-0"
V100 = "v100-32g-0"
SOLVE = ("solve", "gpt2-medium", "-c", CLUSTER, "-B", "64", "--time-limit", "5",
         "--max-stages", "2")
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(autouse=True)
def ledger_path(tmp_path, monkeypatch):
    """Each test its own reservations ledger, never the user's."""
    path = tmp_path / "ledger.sqlite"
    monkeypatch.setenv("PLANNER_LEDGER", str(path))
    return path


def _used(document: dict) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for pipeline in document["pipelines"]:
        for stage in pipeline["stages"]:
            out.setdefault(stage["devices"]["node"], set()).update(stage["devices"]["devices"])
    return out


def test_a_node_with_devices_reserved_is_solved_on_its_free_ones_named_as_the_node_names_them(
        tmp_path, ledger_path):
    """Devices 0 and 2 of the A100 node held by another job: the plan (whose best on the
    free cluster keeps to A100s) runs on devices 1 and 3 of it, never 0 or 2, its
    cluster is the whole cluster, and the plan file passes the runtime's checks."""
    Ledger(ledger_path).reserve(CLUSTER, [("other", {A100: [0, 2]})], owner="someone")
    result = run(*SOLVE, "-o", tmp_path / "plan.json")
    assert result.exit_code == 0, result.output
    assert "2 of the 8 devices" in result.stderr and "planner jobs" in result.stderr
    used = _used(json.loads((tmp_path / "plan.json").read_text()))
    assert used.get(A100) == {1, 3}, used
    plan = read_plan(tmp_path / "plan.json")
    assert {node.name: node.devices for node in plan.cluster.nodes} == {V100: 4, A100: 4}
    rank_layout(plan)  # (devices in range, none twice)


def test_reserve_books_the_plans_devices_and_jobs_lists_them(ledger_path):
    result = run(*SOLVE, "--reserve", "--job", "pretrain", "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["kind"] == "plan"
    [listed] = json.loads(run("jobs", "--json").stdout)["reservations"]
    assert document["reservation"] == listed["id"]
    assert listed["job"] == "pretrain" and listed["cluster"] == CLUSTER
    assert {n: set(d) for n, d in listed["devices"].items()} == _used(document)


def test_a_second_reserving_solve_plans_on_what_is_left(ledger_path):
    first = run(*SOLVE, "--reserve", "--json")
    second = run(*SOLVE, "--reserve", "--json")
    assert first.exit_code == 0 and second.exit_code == 0, second.output
    taken, then = _used(json.loads(first.stdout)), _used(json.loads(second.stdout))
    assert then and all(not taken.get(node, set()) & devices for node, devices in then.items())
    jobs = json.loads(run("jobs", "--json").stdout)["reservations"]
    assert [r["job"] for r in jobs] == ["gpt2-medium", "gpt2-medium"]
    held = [(n, d) for r in jobs for n, ds in r["devices"].items() for d in ds]
    assert len(held) == len(set(held))


def _race(monkeypatch, times: int) -> list:
    """Ledger.reserve with another planner reserving one of the devices asked for just
    before (the first of the first node), the first `times` calls: the request is then
    refused as reserved."""
    real = Ledger.reserve
    raced: list = []

    def racing(self, cluster, requests, **kwargs):
        if len(raced) < times:
            raced.append(requests)
            node, devices = next(iter(requests[0][1].items()))
            real(self, cluster, [(f"rival-{len(raced)}", {node: [devices[0]]})],
                 owner="another planner")
        return real(self, cluster, requests, **kwargs)

    monkeypatch.setattr(Ledger, "reserve", racing)
    return raced


def test_devices_reserved_between_the_read_and_the_write_are_solved_around(
        monkeypatch, ledger_path):
    raced = _race(monkeypatch, 1)
    result = run(*SOLVE, "--reserve", "--json")
    assert result.exit_code == 0, result.output
    assert len(raced) == 1
    [rival, mine] = Ledger(ledger_path).reservations()
    assert rival.job == "rival-1" and mine.job == "gpt2-medium"
    assert json.loads(result.stdout)["reservation"] == mine.id
    lost = {(n, d) for n, ds in rival.devices for d in ds}
    got = {(n, d) for n, ds in mine.devices for d in ds}
    assert got and not lost & got


def test_solve_gives_up_after_the_retries_schedule_uses(monkeypatch, ledger_path):
    raced = _race(monkeypatch, RETRIES)
    result = run(*SOLVE, "--reserve")
    assert result.exit_code == 1
    assert "already reserved" in result.stderr
    assert len(raced) == RETRIES
    assert all(r.job.startswith("rival") for r in Ledger(ledger_path).reservations())


def test_every_device_reserved_is_an_error_naming_the_cluster(ledger_path):
    Ledger(ledger_path).reserve(CLUSTER, [("other", {A100: range(4), V100: range(4)})],
                                owner="someone")
    result = run(*SOLVE)
    assert result.exit_code == 1
    assert CLUSTER in result.stderr and "planner jobs" in result.stderr
    assert "Traceback" not in result.output


def test_no_ledger_file_means_nothing_changes_and_none_is_created(ledger_path):
    result = run(*SOLVE, "--json")
    assert result.exit_code == 0, result.output
    assert not ledger_path.exists()
    assert "reservation" not in json.loads(result.stdout)


@pytest.mark.parametrize("flag", [("--job", "x"), ("--until", "60")])
def test_job_and_until_need_reserve(flag, ledger_path):
    result = run(*SOLVE, *flag)
    assert result.exit_code == 1 and "--reserve" in result.stderr
    assert not ledger_path.exists()


def test_until_sets_the_reservations_end(ledger_path):
    result = run(*SOLVE, "--reserve", "--until", "90min")
    assert result.exit_code == 0, result.output
    [reservation] = Ledger(ledger_path).reservations()
    assert reservation.until is not None  # (from the reservation on: not the solve's start)
    assert reservation.until - reservation.created == pytest.approx(90 * 60, abs=30)



def test_excluding_a_node_that_is_wholly_reserved_is_no_error(ledger_path):
    """(The node is out of the solver's cluster already, not a name it does not know.)"""
    Ledger(ledger_path).reserve(CLUSTER, [("other", {A100: range(4)})], owner="someone")
    result = run(*SOLVE, "--exclude", A100, "--json")
    assert result.exit_code == 0, result.output
    assert set(_used(json.loads(result.stdout))) == {V100}
    assert run(*SOLVE, "--exclude", "no-such-node").exit_code == 1
