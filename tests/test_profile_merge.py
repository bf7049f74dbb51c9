"""`planner profile merge`: per-node profiles become a cluster spec, measurements kept."""

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from cli.main import app
from cost_models.cluster import load_cluster
from cost_models.model import AnalyticalCostModel
from cost_models.profile.merge import merge_profiles
from planner.errors import PlannerError
from planner.models import model_spec
from planner.trace import trace_model


def profile(host: str, *, speed: float, timings=None) -> dict:
    sweep = [{"bytes": b, "seconds": 1e-4 + b / 1e9, "algbw": b / (1e-4 + b / 1e9),
              "busbw": b / (1e-4 + b / 1e9)} for b in (1024, 1 << 20)]
    fit = {"alpha": 1e-4, "beta_bandwidth": 1e9, "sweep": sweep}
    return {
        "schema_version": 1, "kind": "device-profile", "host": host,
        "timestamp": "2026-11-29T00:00:00+00:00",
        "software": {"python": "3.11", "torch": "2.13", "cuda": None, "planner": "0.1.0",
                     "platform": "linux"},
        "mode": "quick", "load_average": [0.1, 0.1, 0.1],
        "devices": [{
            "index": 0, "kind": "cpu", "name": "test cpu", "memory_bytes": 8 * 2**30,
            "matmul": {"fp32": {"best_flops": speed * 1e11, "sweep": []}},
            "memory_bandwidth": {"best": speed * 1e10, "sweep": []},
            "layers": None if timings is None else {
                "model": "gpt-tiny", "seq_len": 64, "dtype": "fp32", "timings": timings,
                "steps": []}}],
        "communication": {"backend": "gloo", "world_size": 2, "device": "cpu",
                          "collectives": {"all_reduce": fit, "all_gather": fit, "p2p": fit}}}


@pytest.fixture(scope="module")
def tiny():
    return trace_model(model_spec("gpt-tiny"), dtype="fp32")


def test_merge_keeps_measurements(tmp_path, tiny):
    timings = [{"layer": layer.name, "signature": layer.signature, "micro_batch": mb,
                "fwd": 0.001 * mb, "bwd": 0.002 * mb} for layer in tiny.layers for mb in (1, 2)]
    paths = []
    for i, speed in enumerate((1.0, 0.5)):
        path = tmp_path / f"w{i}.json"
        path.write_text(json.dumps(profile("box", speed=speed, timings=timings)))
        paths.append(path)
    cluster = merge_profiles(paths, network="measured", names=["fast", "slow"])
    fast, slow = cluster.nodes
    assert (fast.name, slow.name) == ("fast", "slow") and fast.host is None  # same machine
    assert fast.device.name == "cpu@fast" and fast.device.measured.matmul_flops["fp32"] == 1e11
    assert slow.device.measured.memory_bandwidth == 0.5e10
    # the all-reduce link reproduces the fit for 2 ranks: t = S/B + 2 * latency
    assert fast.intra_link.bandwidth == pytest.approx(1e9)
    assert fast.intra_link.latency == pytest.approx(0.5e-4)
    costs = AnalyticalCostModel(cluster)
    t = costs.layer_time(tiny.layers[1], fast.device, tp=1, micro_batch=2, dtype="fp32")
    assert (t.fwd, t.bwd, t.source) == (pytest.approx(0.002), pytest.approx(0.004), "measured")


def test_merge_cli_writes_a_loadable_cluster(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a short path: the "Wrote" line fits on one line
    paths = []
    for host in ("node-a", "node-b"):
        path = tmp_path / f"{host}.json"
        path.write_text(json.dumps(profile(host, speed=1.0)))
        paths.append(str(path))
    out = Path("lab[bold].yaml")  # names print as written, not as Rich markup
    runner = CliRunner()
    result = runner.invoke(app, ["profile", "merge", *paths, "--network", "25Gbps/10us",
                                 "--name", "lab[/]:smile:", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert ("Wrote cluster lab[/]:smile: (2 nodes, 2 devices) to lab[bold].yaml"
            in result.stdout)
    cluster = load_cluster(str(out))
    assert [n.host for n in cluster.nodes] == ["node-a", "node-b"]
    assert cluster.network.bandwidth == 25e9 / 8
    assert yaml.safe_load(out.read_text())["nodes"][0]["measured"]["matmul_flops"]
    again = runner.invoke(app, ["profile", "merge", *paths, "-o", str(out)])
    assert again.exit_code == 1 and "already exists" in again.stderr


def test_merge_errors(tmp_path):
    path = tmp_path / "p.json"
    doc = profile("h", speed=1.0)
    doc["schema_version"] = 7
    path.write_text(json.dumps(doc))
    with pytest.raises(PlannerError, match="schema_version"):
        merge_profiles([path])
    path.write_text(json.dumps(profile("h", speed=1.0)))
    with pytest.raises(PlannerError, match="1 names"):
        merge_profiles([path, path], names=["only-one"])
    with pytest.raises(PlannerError, match="must be non-empty"):
        merge_profiles([path, path], names=["a", ""])
    mixed = profile("h", speed=1.0)
    mixed["devices"] = [dict(mixed["devices"][0], index=0),
                        dict(mixed["devices"][0], index=1, name="Tesla V100-SXM2-32GB")]
    path.write_text(json.dumps(mixed))
    with pytest.raises(PlannerError, match="different devices on one host"):
        merge_profiles([path])
    silent = dict(profile("h", speed=1.0), communication=None)  # made with --no-comm
    path.write_text(json.dumps(silent))
    with pytest.raises(PlannerError, match="no profile measured communication"):
        merge_profiles([path], network="measured")


def test_merge_carries_the_measured_contention_through_the_cluster_file(tmp_path):
    """A profile's `communication.contention` (how computing and an all-reduce in flight
    slow each other) becomes its device's `compute_slowdown` and `sync_slowdown`, which
    the cluster file keeps; a profile without it (written before it was measured), or
    whose communication ran on devices of another kind, gives none."""
    doc = profile("box", speed=1.0)
    doc["communication"]["contention"] = {
        "bytes": 4 << 20, "matmul_side": 256, "compute_alone": 1e-3, "compute_overlapped": 1.2e-3,
        "collective_alone": 0.2, "collective_overlapped": 0.25, "compute_slowdown": 0.2,
        "collective_slowdown": 0.25}
    old = profile("old", speed=1.0)
    elsewhere = json.loads(json.dumps(doc))
    elsewhere["communication"]["device"] = "cuda"
    paths = []
    for name, each in (("new", doc), ("old", old), ("elsewhere", elsewhere)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(each))
    runner = CliRunner()
    out = tmp_path / "lab.yaml"
    result = runner.invoke(app, ["profile", "merge", *map(str, paths), "--network", "10Gbps",
                                 "-o", str(out)])
    assert result.exit_code == 0, result.output
    measured = [node.device.measured for node in load_cluster(str(out)).nodes]
    assert [(m.compute_slowdown, m.sync_slowdown) for m in measured] == [
        (0.2, 0.25), (0.0, 0.0), (0.0, 0.0)]
    written = yaml.safe_load(out.read_text())["nodes"]
    assert written[0]["measured"]["overlap_slowdown"] == {"compute": 0.2, "sync": 0.25}
    assert "overlap_slowdown" not in written[1]["measured"]


@pytest.mark.parametrize("value, words", [
    (-0.5, ["overlap_slowdown.compute", "0 or more", "-0.5"]),
    ("fast", ["overlap_slowdown.compute", "'fast'"]),
])
def test_a_bad_contention_in_a_cluster_file_is_named(tmp_path, value, words):
    path = tmp_path / "lab.yaml"
    path.write_text(yaml.safe_dump({"schema_version": 1, "name": "lab", "nodes": [
        {"name": "a", "device": "cpu", "devices": 1,
         "measured": {"overlap_slowdown": {"compute": value}}}]}))
    with pytest.raises(PlannerError) as error:
        load_cluster(str(path))
    assert all(word in error.value.message for word in words), error.value.message
