"""What-if edits of clusters and training (planner.whatif) and plan comparisons
(planner.compare): pure functions, no solving."""

from __future__ import annotations

from pathlib import Path

import pytest

from cost_models.cluster import load_cluster
from planner import whatif
from planner.compare import compare, diff, headline, parse_prices, rows_json, same_structure
from planner.errors import PlannerError
from planner.planfile import read_plan
from planner.types import TrainingSpec

PLANS = Path(__file__).parent / "data" / "plans"


@pytest.fixture(scope="module")
def lab():
    return load_cluster("a100-v100-lab")


def test_add_nodes_names_them_after_their_type(lab):
    grown = whatif.add_nodes(lab, "2x8xV100-32G")
    added = grown.nodes[len(lab.nodes):]
    assert [n.name for n in added] == ["v100-32g-0", "v100-32g-1"]
    assert grown.num_devices == lab.num_devices + 16
    again = whatif.add_nodes(grown, "1x8xV100-32G", nic="25Gbps")
    assert again.nodes[-1].name == "v100-32g-2"
    assert again.nodes[-1].nic is not None and again.nodes[-1].nic.bandwidth == 25e9 / 8
    assert lab.num_devices == 50  # the input is not changed


def test_add_nodes_rejects_networks_and_unknown_groups(lab):
    with pytest.raises(PlannerError, match="only nodes"):
        whatif.add_nodes(lab, "1x8xA100-80G@100Gbps")
    with pytest.raises(PlannerError, match="no group"):
        whatif.add_nodes(lab, "1x8xA100-80G", group="rack-9")
    with pytest.raises(PlannerError, match="Unknown device"):
        whatif.add_nodes(lab, "1x8xB9000")


def test_remove_nodes_by_name_and_by_count(lab):
    smaller = whatif.remove_nodes(lab, ["ws", "2xV100-32G"])
    names = [n.name for n in smaller.nodes]
    assert names == ["a100-0", "a100-1", "v100-0", "v100-1"]
    with pytest.raises(PlannerError, match=r"has no node 'v100-9'.*v100"):
        whatif.remove_nodes(lab, ["v100-9"])
    with pytest.raises(PlannerError, match="Cannot remove 5"):
        whatif.remove_nodes(lab, ["5xV100-32G"])
    with pytest.raises(PlannerError, match="removes no node"):
        whatif.remove_nodes(lab, ["0xV100-32G"])
    with pytest.raises(PlannerError, match="every node"):
        whatif.remove_nodes(load_cluster("1x8xA100-80G"), ["a100-80g-sxm-0"])


def test_resize_and_links(lab):
    assert whatif.resize_node(lab, "ws", 4).node("ws").devices == 4
    by_type = whatif.resize_node(lab, "V100-32G", 4)
    assert all(n.devices == 4 for n in by_type.nodes if n.device.name == "V100-32G")
    slow = whatif.set_link(lab, "network", "10Gbps/20us")
    assert slow.network.bandwidth == 10e9 / 8 and slow.network.latency == 20e-6
    nic = whatif.set_link(lab, "nic:ws", "1Gbps")
    assert nic.node("ws").nic.bandwidth == 1e9 / 8
    # an edited cluster is not shown under its old name; edits mark it once
    assert slow.name == f"{lab.name} (edited)"
    assert whatif.resize_node(slow, "ws", 4).name == slow.name
    intra = whatif.set_link(lab, "intra:A100-80G-SXM", "100GB/s")
    assert {n.intra_link.bandwidth for n in intra.nodes if n.name.startswith("a100")} == {1e11}
    with pytest.raises(PlannerError, match="Unknown link"):
        whatif.set_link(lab, "wifi", "1Gbps")
    with pytest.raises(PlannerError, match="bandwidth"):
        whatif.set_link(lab, "network", "fast")
    with pytest.raises(PlannerError, match="Cannot read '-1us' as a duration"):
        whatif.set_link(lab, "network", "25Gbps/-1us")  # the latency is at fault
    with pytest.raises(PlannerError, match="at least one device"):
        whatif.resize_node(lab, "ws", 0)


def test_edit_training_and_assignments():
    t = TrainingSpec(global_batch=64, seq_len=128, dtype="bf16")
    assert whatif.edit_training(t, global_batch=128, dtype="half") == TrainingSpec(
        global_batch=128, seq_len=128, dtype="fp16")
    for batch in (0, 10**10):  # solve's limit, named before the model is traced
        with pytest.raises(PlannerError, match="--global-batch must be between 1 and "
                                               "1,000,000,000 samples per step"):
            whatif.edit_training(t, global_batch=batch)
    assert whatif.parse_assignment("network=25Gbps", "--link", "network=25Gbps") == (
        "network", "25Gbps")
    with pytest.raises(PlannerError, match="KEY=VALUE"):
        whatif.parse_assignment("network", "--link", "network=25Gbps")
    with pytest.raises(PlannerError, match="whole number"):
        whatif.parse_int("eight", "devices")


def test_compare_rows_judge_against_the_first_plan():
    a, b = read_plan(PLANS / "base.json"), read_plan(PLANS / "tp2-slow-net.json")
    rows = {r.key: r for r in compare([a, b])}
    assert rows["step_time"].verdicts == ("", "worse")
    assert rows["samples_per_s"].verdicts == ("", "worse")
    assert rows["tp"].verdicts == ("", "changed") and rows["tp"].texts == ("1", "2")
    assert rows["model"].verdicts == ("", "same")
    assert rows["step_time"].changes[1] == pytest.approx(
        b.prediction.step_time / a.prediction.step_time - 1)
    assert "dollars_per_m" not in rows  # no prices given
    changed = {r.key for r in diff(a, b)}
    assert {"step_time", "tp", "network"} <= changed and "model" not in changed
    assert "step time" in headline(a, b)
    assert not same_structure(a, b) and same_structure(a, a)
    assert rows_json(compare([a, b]))[0]["key"] == "model"


def test_headroom_is_the_fewest_free_bytes_and_noise_has_no_percentage():
    from types import SimpleNamespace as NS

    from planner.compare import FIGURES, _verdict, memory_headroom
    from planner.units import fmt_seconds

    def stage(node: str, used: float) -> NS:
        return NS(index=0, devices=NS(node=node), memory=NS(total=used))

    capacity = {"big": 160.0, "small": 80.0}  # big: 80 free (50%); small: 78 free (97.5%)
    plan = NS(pipelines=[NS(index=0, stages=[stage("big", 80.0)]),
                         NS(index=1, stages=[stage("small", 2.0)])],
              cluster=NS(node=lambda name: NS(device=NS(memory=capacity[name]))))
    free, fraction, where = memory_headroom(plan)
    assert (free, fraction) == (78.0, 78.0 / 80.0) and "small" in where
    bubble = next(f for f in FIGURES if f.key == "bubble")
    assert _verdict(bubble, 1.8e-15, 0.132)[0] is None
    assert _verdict(bubble, 0.1, 0.132)[0] == pytest.approx(0.32)
    assert fmt_seconds(3.3e-15) == "0 µs" and fmt_seconds(2e-6) == "2 µs"


def test_prices_give_dollars():
    a = read_plan(PLANS / "base.json")
    prices = parse_prices(["A100-80G=2", "v100-32g=1"])
    assert prices == {"A100-80G-SXM": 2.0, "V100-32G": 1.0}
    rows = {r.key: r for r in compare([a, a], prices)}
    dollars = 4 * 2.0 * a.prediction.step_time / a.training.global_batch * 1e6 / 3600
    assert rows["dollars_per_m"].values[0] == pytest.approx(dollars)
    with pytest.raises(PlannerError, match="TYPE=DOLLARS"):
        parse_prices(["A100=cheap"])
    for bad, needle in (("A100=nan", "nan is not a price"), ("A100=inf", "inf is not a price"),
                        ("A100=-1", "-1 is not a price"), ("=2", "TYPE=DOLLARS")):
        with pytest.raises(PlannerError, match=needle):
            parse_prices([bad])
    with pytest.raises(PlannerError, match="--price names A100-80G-SXM twice"):
        parse_prices(["A100-80G=1", "A100-80G-SXM=2"])  # (the last one won silently)
    with pytest.raises(PlannerError, match="at least one"):
        compare([])
