"""`planner profile import`: per-layer profiles of other tools (Metis/Sailor JSON, AMP's
arrays, a plain CSV) mapped to the model's layers, written into a cluster file, and the
measured times, memory and optimizer step the figures a solve then uses."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from cli.main import app
from cost_models.cluster import cluster_to_dict, load_cluster, parse_cluster
from cost_models.imports import attach, entries_of, read_profile
from cost_models.memory import activation_bytes
from cost_models.model import AnalyticalCostModel
from planner.errors import PlannerError
from planner.models import model_spec
from planner.trace.cache import cached_trace
from planner.types import Recompute

DATA = Path(__file__).parent / "data" / "profiles"
METIS = sorted((DATA / "metis").glob("*.json"))
AMP = sorted((DATA / "amp").glob("*.npy"))
MIB = 2.0**20
runner = CliRunner()


@pytest.fixture(scope="module")
def tiny():
    return cached_trace(model_spec("gpt-tiny"), seq_len=None, dtype="fp32")


def _import(tmp_path: Path, files: list[Path], fmt: str, cluster: str, device: str,
            *extra: str) -> Path:
    out = tmp_path / f"{fmt}.yaml"
    result = runner.invoke(app, ["profile", "import", *map(str, files), "--format", fmt,
                                 "--model", "gpt-tiny", "--dtype", "fp32", "--cluster", cluster,
                                 "--device", device, "-o", str(out), *extra])
    assert result.exit_code == 0, result.output
    return out


def _solve(cluster: Path, *options: str) -> dict:
    result = runner.invoke(app, ["solve", "gpt-tiny", "--cluster", str(cluster), "--dtype",
                                 "fp32", "--json", *options])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _metis(tp: int, batch: int) -> dict:
    return json.loads((DATA / "metis" / f"DeviceType.A100_tp{tp}_bs{batch}.json").read_text())


def test_a_metis_profile_drives_a_solve_with_its_times_and_optimizer_step(tmp_path):
    cluster = _import(tmp_path, METIS, "metis", "2x2xA100-80G@100Gbps", "A100-80G")
    plan = _solve(cluster, "-B", "8", "--tp", "1", "--pp", "1", "--micro-batch", "2",
                  "--zero", "0")
    measured = _metis(1, 2)["execution_time"]
    # one micro-batch of 2 per pipeline: the layers' times as measured at tp 1, size 2
    assert plan["prediction"]["compute"] == pytest.approx(
        sum(measured["layer_compute_total_ms"]) / 1e3)
    # the optimizer step as measured on the whole model (the file at the smallest degree)
    assert plan["prediction"]["optimizer"] == pytest.approx(_metis(1, 1)["execution_time"]
                                                            ["optimizer_time_ms"] / 1e3)
    assert plan["pipelines"][0]["stages"][0]["device_type"] == "A100-80G-SXM@measured"


def test_metis_times_at_tp_2_hold_their_collectives(tmp_path):
    cluster = _import(tmp_path, METIS, "metis", "2x2xA100-80G@100Gbps", "A100-80G")
    plan = _solve(cluster, "-B", "4", "--tp", "2", "--pp", "1", "--micro-batch", "2",
                  "--zero", "0")
    assert plan["prediction"]["compute"] == pytest.approx(
        sum(_metis(2, 2)["execution_time"]["layer_compute_total_ms"]) / 1e3)
    assert plan["prediction"]["tp_comm"] == 0.0  # (measured in the layers' times)


def test_measured_memory_scales_the_activations_a_solve_counts(tmp_path, tiny):
    cluster = load_cluster(str(_import(tmp_path, METIS, "metis", "2x2xA100-80G@100Gbps",
                                       "A100-80G")))
    costs = AnalyticalCostModel(cluster)
    block = tiny.layers[1]
    fitted = []
    for tp in (1, 2):  # per sample: the slope of memory over the micro-batch size
        slope = (_metis(tp, 2)["execution_memory"]["layer_memory_total_mb"][1]
                 - _metis(tp, 1)["execution_memory"]["layer_memory_total_mb"][1]) * MIB
        fitted.append((slope, activation_bytes(block, recompute=Recompute.NONE, tp=tp)))
    scale = sum(a * t for a, t in fitted) / sum(t * t for _, t in fitted)
    for policy in Recompute:
        assert costs.activation_bytes(block, recompute=policy, tp=2) == pytest.approx(
            scale * activation_bytes(block, recompute=policy, tp=2))
    device = cluster.nodes[0].device
    from planner.types import TrainingSpec
    training = TrainingSpec(global_batch=8, dtype="fp32")
    assert costs.memory([block], device, training, micro_batch=2).activations \
        == pytest.approx(2 * scale * activation_bytes(block, recompute=Recompute.NONE, tp=1))
    plan = _solve(Path(tmp_path / "metis.yaml"), "-B", "8", "--tp", "1", "--pp", "1",
                  "--micro-batch", "2", "--zero", "0", "--recompute", "none")
    kept = sum(costs.activation_bytes(layer, recompute=Recompute.NONE, tp=1)
               for layer in tiny.layers)
    assert plan["pipelines"][0]["stages"][0]["memory"]["activations"] == pytest.approx(2 * kept)


def test_an_amp_profile_drives_a_solve(tmp_path, tiny):
    cluster = _import(tmp_path, AMP, "amp", "2x2xT4", "T4")
    plan = _solve(cluster, "-B", "4", "--tp", "1", "--pp", "1", "--micro-batch", "1",
                  "--zero", "0")
    forward = np.load(DATA / "amp" / "gpt-tiny_T4_1.npy")
    # AMP's 10 entries: embedding + a transpose, 4 blocks, a transpose + norm + head + loss
    per_layer = [forward[:2].sum(), *forward[2:6], forward[6:].sum()]
    expected = sum(f * (1 + (layer.bwd_flops / layer.fwd_flops if layer.fwd_flops else 2))
                   for f, layer in zip(per_layer, tiny.layers, strict=True))
    assert plan["prediction"]["compute"] == pytest.approx(expected)
    two = _solve(cluster, "-B", "2", "--tp", "2", "--pp", "1", "--micro-batch", "1",
                 "--zero", "0")
    assert two["prediction"]["tp_comm"] == 0.0


def test_a_csv_profile_by_layer_name_and_index_and_its_memory_decides_what_fits(tmp_path):
    rows = ["layer,micro_batch,tp,fwd_ms,bwd_ms,memory_mb"]
    for batch in (1, 2):
        rows += [f"0,{batch},1,0.1,0.2,{1 + batch}", f"head,{batch},1,1.0,2.0,{1 + batch}"]
        rows += [f"layers.{b},{batch},1,2.0,4.0,{4 + 100 * batch}" for b in range(4)]
    table = tmp_path / "tiny.csv"
    table.write_text("\n".join(rows) + "\n")
    small = tmp_path / "small.yaml"
    small.write_text("schema_version: 1\nname: small\nnodes:\n  - name: box\n    devices: 1\n"
                     "    device: {name: Small, memory: 1.5GiB, memory_bandwidth: 100GB/s,\n"
                     "             peak_flops: {fp32: 10TFLOPS}}\n")
    options = ("-B", "2", "--tp", "1", "--pp", "1", "--micro-batch", "2", "--recompute", "none")
    traced = _solve(small, *options)  # the trace's bytes fit
    measured = _import(tmp_path, [table], "csv", str(small), "Small")
    # 4 blocks keep 100 MiB a sample as measured: 800 MiB at micro-batch 2, past the
    # 0.5 GiB the device has beside the framework's 1 GiB
    result = runner.invoke(app, ["solve", "gpt-tiny", "--cluster", str(measured), "--dtype",
                                 "fp32", *options])
    assert result.exit_code == 1
    assert "memory" in result.output
    # measured times (as written, at both sizes) and a plan that fits the measured memory
    plan = _solve(measured, "-B", "2", "--tp", "1", "--pp", "1", "--micro-batch", "1")
    assert plan["prediction"]["compute"] == pytest.approx(2 * (0.3 + 4 * 6.0 + 3.0) / 1e3)
    memory = plan["pipelines"][0]["stages"][0]["memory"]
    assert memory["activations"] > 50 * traced["pipelines"][0]["stages"][0]["memory"][
        "activations"]
    assert sum(memory.values()) <= 1.5 * 2**30


def test_the_cluster_file_keeps_what_was_imported(tmp_path, tiny):
    profile = read_profile("metis", METIS, tiny)
    cluster = attach(load_cluster("2x2xA100-80G@100Gbps"), "A100-80G-SXM", profile.measured)
    again = parse_cluster(yaml.safe_load(yaml.safe_dump(cluster_to_dict(cluster))), "again")
    assert [n.device.name for n in again.nodes] == [n.device.name for n in cluster.nodes]
    for read, written in zip(again.nodes[0].device.measured.layer_times,
                             cluster.nodes[0].device.measured.layer_times, strict=True):
        assert (read.layer, read.tp, read.micro_batch, read.with_tp_comm) == (
            written.layer, written.tp, written.micro_batch, written.with_tp_comm)
        assert (read.fwd, read.bwd, read.memory) == pytest.approx(
            (written.fwd, written.bwd, written.memory), rel=1e-9)
    assert len(again.device_types()) == 1  # both nodes one measured type
    timing = next(t for t in again.nodes[0].device.measured.layer_times
                  if t.tp == 2 and t.layer == tiny.layers[1].signature and t.micro_batch == 1)
    assert timing.with_tp_comm and timing.memory == pytest.approx(
        _metis(2, 1)["execution_memory"]["layer_memory_total_mb"][1] * MIB)
    assert again.nodes[0].device.measured.optimizer.params == pytest.approx(tiny.params)


def test_profiles_that_do_not_map_to_the_model_are_refused_by_name(tmp_path, tiny):
    three = cached_trace(model_spec("gpt-tiny", {"layers": 3}), seq_len=None, dtype="fp32")
    with pytest.raises(PlannerError, match=r"has 6 layer entries.*5 layers \(embedding, 3 "):
        read_profile("metis", METIS[:1], three)
    with pytest.raises(PlannerError, match=r"has 10 layer entries"):
        read_profile("amp", AMP[:1], three)
    renamed = tmp_path / "profile.json"
    renamed.write_text(METIS[0].read_text())
    with pytest.raises(PlannerError, match="tp2, bs4"):
        read_profile("metis", [renamed], tiny)
    with pytest.raises(PlannerError, match="no node of device type 'H100'"):
        attach(load_cluster("2x2xT4"), "H100", read_profile("amp", AMP, tiny).measured)
    bad = tmp_path / "DeviceType.A100_tp1_bs1.json"
    doc = _metis(1, 1)
    doc["execution_time"]["layer_compute_total_ms"][2] = -1
    bad.write_text(json.dumps(doc))
    with pytest.raises(PlannerError, match=r"layer_compute_total_ms\[2\] must be a finite"):
        read_profile("metis", [bad], tiny)
    table = tmp_path / "t.csv"
    table.write_text("layer,micro_batch,fwd_ms,bwd_ms\nlayer.9,1,1,2\n")
    with pytest.raises(PlannerError, match=r"t.csv line 2: layer 'layer.9' is not one"):
        read_profile("csv", [table], tiny)


def test_entries_map_one_to_one_or_around_the_blocks(tiny):
    assert entries_of(6, tiny.layers, around=(2, 4), source="x", hint="") == [
        [i] for i in range(6)]
    assert entries_of(10, tiny.layers, around=(2, 4), source="x", hint="") == [
        [0, 1], [2], [3], [4], [5], [6, 7, 8, 9]]
    with pytest.raises(PlannerError, match="x has 8 layer entries"):
        entries_of(8, tiny.layers, around=None, source="x", hint="")


def test_import_never_overwrites_without_force(tmp_path):
    out = tmp_path / "lab.yaml"
    out.write_text("mine\n")
    result = runner.invoke(app, ["profile", "import", *map(str, AMP), "-f", "amp", "-m",
                                 "gpt-tiny", "--dtype", "fp32", "-c", "2x2xT4", "-d", "T4",
                                 "-o", str(out)])
    assert result.exit_code == 1 and "already exists" in result.output
    assert out.read_text() == "mine\n"
