"""`planner profile`: real quick-mode measurements of this machine's CPU, the layer
time attribution, the alpha-beta fit, profile validation and the CLI."""

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from cost_models.profile import load_profile, run_profile
from cost_models.profile.comm import fit_alpha_beta
from cost_models.profile.layers import split_pass
from cost_models.profile.timing import Clock
from planner.errors import PlannerError
from planner.models import model_spec
from planner.trace import trace_model

runner = CliRunner()


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """One quick profile of the CPU, with gpt-tiny's layers and 2 gloo processes."""
    doc = run_profile(quick=True, model="gpt-tiny", processes=2, devices="cpu")
    path = tmp_path_factory.mktemp("profile") / "cpu.json"
    path.write_text(json.dumps(doc))
    return doc, path


def test_quick_cpu_profile_is_valid_and_measured(profiled):
    doc, path = profiled
    assert load_profile(path) == doc
    assert doc["mode"] == "quick" and doc["software"]["torch"] == torch.__version__
    (cpu,) = doc["devices"]
    assert cpu["kind"] == "cpu" and cpu["memory_bytes"] > 2**30 and cpu["threads"] >= 1
    assert set(cpu["matmul"]) == {"fp32", "bf16", "fp16"}
    for result in cpu["matmul"].values():
        assert result["best_flops"] == max(p["flops"] for p in result["sweep"]) > 0
        for p in result["sweep"]:
            assert p["flops"] == pytest.approx(2 * p["m"] * p["n"] * p["k"] / p["seconds"])
    bandwidth = cpu["memory_bandwidth"]
    assert bandwidth["best"] > 1e8
    assert all(p["bandwidth"] == pytest.approx(p["bytes"] / p["seconds"])
               for p in bandwidth["sweep"])


def test_comm_sweeps_follow_nccl_tests_conventions(profiled):
    comm = profiled[0]["communication"]
    assert comm["backend"] == "gloo" and comm["world_size"] == 2 and comm["device"] == "cpu"
    n = comm["world_size"]
    factors = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "p2p": 1.0}
    for name, factor in factors.items():
        collective = comm["collectives"][name]
        sizes = [p["bytes"] for p in collective["sweep"]]
        assert sizes[0] == 1024 and sizes[-1] == 64 * 2**20 and sizes == sorted(sizes)
        for p in collective["sweep"]:
            assert p["algbw"] == pytest.approx(p["bytes"] / p["seconds"])
            assert p["busbw"] == pytest.approx(p["algbw"] * factor)
        assert collective["alpha"] >= 0 and collective["beta_bandwidth"] > 0


def test_every_traced_layer_is_timed_at_each_micro_batch(profiled):
    layers = profiled[0]["devices"][0]["layers"]
    assert layers["model"] == "gpt-tiny" and layers["dtype"] == "fp32"
    traced = trace_model(model_spec("gpt-tiny"), seq_len=layers["seq_len"], dtype="fp32")
    expected = [(layer.name, layer.signature) for layer in traced.layers]
    steps = {s["micro_batch"]: s["seconds"] for s in layers["steps"]}
    assert set(steps) == {1, 2}
    for batch, step in steps.items():
        rows = [t for t in layers["timings"] if t["micro_batch"] == batch]
        assert [(t["layer"], t["signature"]) for t in rows] == expected
        assert all(t["fwd"] > 0 and t["bwd"] > 0 for t in rows) and step > 0


def test_split_pass_cuts_where_each_layer_begins():
    # layers: 0 = embed; 1 = block; 2 = glue (norm, embed again); 3 = ops at the root only
    embed, block, glue = (0, 2), (1,), (2,)
    forward = [(1.0, True, embed), (2.0, False, embed), (3.0, True, block), (5.0, False, block),
               (6.0, True, glue), (7.0, False, glue), (7.5, True, embed), (8.0, False, embed)]
    clock = Clock(torch.device("cpu"))
    # the parts add up to the pass (0 to 10 s), so a step's layers add up to the step
    assert split_pass(forward, 4, 0.0, 10.0, clock, backward=False) == [3.0, 3.0, 2.0, 2.0]
    # backward: layer 3 first (from the start), then 2 (the embed's second call), 1, 0
    backward = [(11.0, True, embed), (11.5, False, embed), (12.0, True, glue),
                (13.0, True, block), (14.0, False, block), (16.0, True, embed)]
    assert split_pass(backward, 4, 10.0, 20.0, clock, backward=True) == [4.0, 3.0, 2.0, 1.0]


def test_alpha_beta_fit():
    points = [(b, 5e-5 + b / 2e9) for b in (1024, 65536, 2**20, 2**24)]
    alpha, bandwidth = fit_alpha_beta(points)
    assert alpha == pytest.approx(5e-5) and bandwidth == pytest.approx(2e9)
    alpha, bandwidth = fit_alpha_beta([(1000, 1e-6), (2000, 3e-6)])  # intercept < 0
    assert alpha == 0 and bandwidth > 0


def _edit(doc, change):
    doc = json.loads(json.dumps(doc))
    change(doc)
    return json.dumps(doc)


@pytest.mark.parametrize("change, words", [
    (lambda d: d.update(schema_version=2), ["'schema_version' is 2", "schema_version 1"]),
    (lambda d: d.update(kind="cluster"), ["'kind'", "'cluster'", "device-profile"]),
    (lambda d: d["devices"][0]["matmul"]["fp32"].update(best_flops=-1.0),
     ["'devices[0].matmul.fp32.best_flops'", "non-negative"]),
    (lambda d: d["communication"]["collectives"]["p2p"]["sweep"][0].update(seconds=-1e-6),
     ["'communication.collectives.p2p.sweep[0].seconds'"]),
    (lambda d: d["devices"][0].pop("memory_bandwidth"),
     ["'devices[0].memory_bandwidth'", "missing"]),
])
def test_load_profile_rejects_bad_documents(profiled, tmp_path, change, words):
    path = tmp_path / "bad.json"
    path.write_text(_edit(profiled[0], change))
    with pytest.raises(PlannerError) as info:
        load_profile(path)
    assert str(path) in info.value.message
    for word in words:
        assert word in info.value.message


def test_load_profile_rejects_non_json(tmp_path):
    path = tmp_path / "notes.json"
    path.write_text("devices: [cpu]\n")
    with pytest.raises(PlannerError, match="not JSON") as info:
        load_profile(path)
    assert str(path) in info.value.message


def test_cli_writes_a_profile_and_refuses_to_overwrite(tmp_path):
    out = tmp_path / "node[bold].json"  # printed as written, not as Rich markup
    result = runner.invoke(app, ["profile", "--quick", "--no-comm", "-o", str(out)])
    assert result.exit_code == 0, result.output
    doc = load_profile(out)
    assert doc["communication"] is None and doc["devices"][0]["layers"] is None
    assert "fp32" in result.stdout and f"Wrote the profile to {out}" in result.stdout
    if not torch.cuda.is_available():
        assert "no CUDA device: profiling the CPU" in result.stderr
    written = out.read_text()
    again = runner.invoke(app, ["profile", "--quick", "--no-comm", "-o", str(out)])
    assert again.exit_code == 1 and "already exists" in again.output
    assert out.read_text() == written
    forced = runner.invoke(app, ["profile", "--quick", "--no-comm", "--devices", "cpu",
                                 "--json", "--force", "-o", str(out)])
    assert forced.exit_code == 0, forced.output
    assert json.loads(forced.stdout) == load_profile(out) != json.loads(written)


def test_layer_times_name_the_model_as_written(capsys):
    """The model's name (a config.json path, a factory's settings) may hold [..] or
    :name:, which Rich would read as markup in the table's title."""
    from cli.profile_cmd import _render_layers

    _render_layers({"kind": "cpu", "layers": {
        "model": "m[/]:smile:", "seq_len": 8, "dtype": "fp32",
        "timings": [{"layer": "x", "fwd": 1e-3, "bwd": 2e-3}],
        "steps": [{"micro_batch": 1, "seconds": 1e-2}]}})
    assert "Layer times on cpu: m[/]:smile:, seq 8" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("args, words", [
    (["--processes", "1"], "--processes must be at least 2"),
    (["--processes", "1000"], "--processes must be at most 16 (got 1000)"),
    (["--dtype", "fp8"], "Unknown dtype 'fp8'"),
])
def test_cli_rejects_bad_options_before_measuring(args, words):
    result = runner.invoke(app, ["profile", "--quick", *args])
    assert result.exit_code == 1 and words in result.output


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc, a folder that takes no files")
def test_an_output_folder_that_takes_no_files_is_named_before_measuring(monkeypatch):
    """`-o /proc/x.json` passed the checks (the folder exists) and failed after the profile."""
    def measure(**_):
        raise AssertionError("measured before the output path was checked")
    monkeypatch.setattr("cost_models.profile.run_profile", measure)
    result = runner.invoke(app, ["profile", "--quick", "--no-comm", "-o", "/proc/x.json"])
    assert result.exit_code == 1, result.output
    assert "'/proc/x.json' cannot be written: folder '/proc' takes no new files" in result.output


def test_a_bad_model_fails_before_any_measurement():
    ticks = []
    with pytest.raises(PlannerError, match="Unknown model 'gpt-tinyy'"):
        run_profile(quick=True, model="gpt-tinyy", devices="cpu", comm=False,
                    progress=lambda *a: ticks.append(a))
    assert not ticks
