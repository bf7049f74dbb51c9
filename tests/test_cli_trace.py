"""`planner models` and `planner trace` through typer's CliRunner, bad input included;
how `planner` ends on errors."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest
from typer.testing import CliRunner

from cli.main import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, list(args))


def test_version_and_help():
    assert run("--version").stdout.startswith("planner ")
    result = run("trace", "--help")
    assert result.exit_code == 0 and "--seq-len" in result.stdout


def test_models_lists_the_zoo_with_counts():
    result = run("models", "--json")
    assert result.exit_code == 0
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    assert rows["llama3-70b"]["params"] == 70_553_706_496
    assert {"gpt2-small", "gpt3-175b", "opt-350m", "bert-large", "t5-base", "vit-h",
            "resnet152", "mixtral-8x7b", "mlp", "llama3-405b"} <= set(rows)
    table = run("models", "--family", "llama")
    assert "llama3-8b" in table.stdout and "gpt2" not in table.stdout
    found = {r["name"] for r in json.loads(run("models", "70b", "--json").stdout)}
    assert found == {"llama2-70b", "llama3-70b"}
    none = run("models", "70b", "--family", "gpt")
    assert none.exit_code == 1 and "No zoo model matches '70b' in family gpt" in none.output


def test_trace_table():
    result = run("trace", "gpt-tiny")
    assert result.exit_code == 0, result.output
    assert "layers.0" in result.stdout and "6·N·T check" in result.stdout
    assert "4 blocks" in result.stdout


def test_trace_json():
    result = run("trace", "gpt-tiny", "--json", "--batch", "2", "--seq-len", "32")
    data = json.loads(result.stdout)
    assert data["schema_version"] == 1 and data["blocks"] == 4
    assert data["batch"] == 2 and data["seq_len"] == 32
    assert data["layers"][1]["output_bytes"] == 32 * 128 * 2
    assert data["flop_check"]["ratio"] == pytest.approx(1.0, abs=0.01)


def test_shape_options_and_set():
    result = run("trace", "llama2-7b", "--layers", "2", "--hidden", "256", "--heads", "4",
                 "--ffn", "512", "--vocab", "1000", "--set", "kv_heads=2", "--json")
    data = json.loads(result.stdout)
    assert data["blocks"] == 2 and data["config"]["kv_heads"] == 2


@pytest.mark.parametrize("blocks", ["[1, 1, 1, 1]", "(1,1,1,1)", "1, 1, 1, 1"])
def test_set_takes_a_list_as_yaml_or_python_writes_it(blocks):
    """The error for a bad list shows one in the form --set takes; a tuple as Python
    prints it (the form the zoo's defaults were shown in) works too."""
    result = run("trace", "resnet50", "--set", f"blocks={blocks}", "--set", "width=8",
                 "--set", "image_size=64", "--json")
    if blocks == "1, 1, 1, 1":
        assert result.exit_code != 0 and "like [3, 4, 6, 3]" in result.output
    else:
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["config"]["blocks"] == [1, 1, 1, 1]


def test_user_factory(tmp_path):
    result = run("trace", "tests.factories:mlp", "--set", "depth=5", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["blocks"] == 5
    result = run("trace", "tests.factories:needs_seq_len", "--seq-len", "8", "--json")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("suffix", [".json", ".graphml", ".dot"])
def test_graph_files(tmp_path, suffix):
    path = tmp_path / f"g{suffix}"
    assert run("trace", "gpt-tiny", "--graph", str(path)).exit_code == 0
    if suffix == ".json":
        data = json.loads(path.read_text())
        graph = nx.node_link_graph(data["graph"], edges="edges")
        assert data["schema_version"] == 1 and graph.number_of_nodes() > 50
        assert {d["layer"] for _, d in graph.nodes(data=True)} == set(range(6))
    elif suffix == ".graphml":
        graph = nx.read_graphml(path)
        assert graph.number_of_nodes() > 50
    elif shutil.which("dot"):
        done = subprocess.run(["dot", "-Tsvg", str(path)], capture_output=True, check=False)
        assert done.returncode == 0 and b"<svg" in done.stdout
    else:
        pytest.skip("graphviz is not installed")


def test_graph_file_is_not_overwritten(tmp_path):
    path = tmp_path / "g.json"
    path.write_text("mine")
    result = run("trace", "gpt-tiny", "--graph", str(path))
    assert result.exit_code == 1 and "already exists" in result.stderr
    assert path.read_text() == "mine"
    assert run("trace", "gpt-tiny", "--graph", str(path), "--force").exit_code == 0
    for target, needle in ((tmp_path / "no" / "g.json", "does not exist"),
                           (tmp_path, "is a folder")):
        result = run("trace", "gpt-tiny", "--graph", str(target), "--force")
        assert result.exit_code == 1 and needle in result.stderr, result.output


@pytest.mark.parametrize("args, needle", [
    (["llama-70b"], "Did you mean"),
    (["gpt2-small", "--seq-len", "-3"], "--seq-len must be positive"),
    (["gpt2-small", "--batch", "0"], "--batch must be positive"),
    (["gpt2-small", "--heads", "7"], "heads (7) must divide hidden (768)"),
    (["gpt2-small", "--layers", "0"], "layers must be positive"),
    (["gpt2-small", "--layers", "3", "--set", "layers=2"], "which another option sets too"),
    (["gpt2-small", "--set", "heads=abc"], "heads takes an integer"),
    (["gpt2-small", "--dtype", "int3"], "Unknown dtype"),
    (["gpt2-small", "--graph", "g.xyz"], "Cannot tell the graph format"),
    (["resnet50", "--seq-len", "64"], "no sequence length"),
    (["tests.factories:missing"], "has no attribute 'missing'"),
    (["nosuchpkg.models:build"], "Could not import module 'nosuchpkg.models'"),
    (["tests.factories:raises"], "raised ValueError: no such checkpoint shape"),
    (["tests.factories:not_a_module"], "returned dict, not a torch.nn.Module"),
    (["tests.factories:module_only"], "no example inputs"),
    (["tests.factories:branchy"], "Could not trace model"),
    (["tests.factories:needs_seq_len"], "has no default sequence length, and its example_batch("
     "batch=1, seq_len=None, device='meta') raised TypeError"),
    (["tests.factories:inputs_raise", "-s", "8"], "its inputs(batch=1, seq_len=8, "
     "device='meta') raised KeyError: 'no data here'"),
    (["gpt2-small", "--set", "oops"], "must look like KEY=VALUE"),
])
def test_bad_input_is_one_clear_message(args, needle, tmp_path, monkeypatch):
    result = run("trace", *args)
    assert result.exit_code == 1, result.output
    assert needle in result.stderr
    assert "Traceback" not in result.output


def test_untraceable_model_names_the_module():
    result = run("trace", "tests.factories:branchy")
    assert "in module" in result.stderr and "gate" not in result.stdout
    assert "def forward" not in result.output  # torch.export's partial graph: --debug only
    debug = run("--debug", "trace", "tests.factories:branchy")
    assert "def forward" in "".join(debug.exception.__cause__.__notes__)


def test_debug_shows_the_traceback():
    result = run("--debug", "trace", "nosuch-model")
    assert result.exit_code != 0
    assert result.exception is not None


@pytest.mark.parametrize("args, unbuffered", [
    (["devices", "--sources"], "1"),  # rich's console writes
    (["devices", "--json"], "1"),  # a plain write inside the command
    (["devices", "a100", "--json"], ""),  # buffered until main's last flush
    # typer prints these while it parses the arguments, before the command runs
    (["--version"], ""), (["--version"], "1"), (["--help"], ""), (["-h"], "1"),
])
def test_output_into_a_closed_pipe_ends_quietly(args, unbuffered):
    """`planner ... | head -1`: the reader left early, which is neither a bug (exit 3) nor
    bad input (exit 1). (devices: a quick command that does not import torch.)"""
    read, write = os.pipe()
    os.close(read)
    done = subprocess.run([sys.executable, "-m", "cli.main", *args], stdout=write,
                          stderr=subprocess.PIPE, text=True, check=False,
                          cwd=Path(__file__).parents[1],
                          env={**os.environ, "PYTHONUNBUFFERED": unbuffered})
    os.close(write)
    assert (done.returncode, done.stderr) == (141, "")
