"""The trace cache: traces read back equal, keyed by all they depend on, never an error;
and the commands that only plan import no torch once their trace is cached."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from planner.models import model_spec
from planner.models.zoo import FLAVORS
from planner.trace import cache
from planner.trace.cache import (
    cache_dir,
    cached_trace,
    entry_path,
    read_entry,
    trace_key,
    write_entry,
)
from planner.types import ModelGraph

ROOT = Path(__file__).resolve().parent.parent

# a few zoo models of every kind of layer: a GPT (tied head), a non-transformer with
# tuples in its configuration, an encoder-decoder (glue), BERT (post-norm, tied decoder)
# and a mixture of experts
MODELS = [
    ("gpt-tiny", {}, None),
    ("resnet50", {"blocks": [1, 2, 1, 1]}, None),
    ("t5-base", {"layers": 2, "hidden": 256, "heads": 4, "ffn": 512, "vocab": 1000}, 64),
    ("bert-base", {"layers": 2}, 128),
    ("mixtral-8x7b", {"layers": 2, "hidden": 256, "ffn": 512, "vocab": 1000, "heads": 4,
                      "kv_heads": 2}, 64),
]


def _entry(spec, seq_len=None, dtype="bf16") -> Path:
    return entry_path(spec, trace_key(spec, seq_len=seq_len, dtype=dtype, batch=1))


@pytest.mark.parametrize(("name", "overrides", "seq_len"), MODELS)
def test_a_cached_trace_reads_back_equal_to_the_trace(name, overrides, seq_len):
    spec = model_spec(name, overrides)
    traced = cached_trace(spec, seq_len=seq_len, dtype="bf16")
    assert traced.graph is not None  # traced, and kept
    assert _entry(spec, seq_len).is_file()
    read = cached_trace(spec, seq_len=seq_len, dtype="bf16")
    assert read.graph is None  # read from the cache: no op graph
    assert read == traced
    assert read.layers == traced.layers and read.config == traced.config
    assert {k: type(v) for k, v in read.config.items()} == {
        k: type(v) for k, v in traced.config.items()}
    assert read.spec is spec


def test_every_zoo_configuration_round_trips():
    """Configurations are kept as JSON: each flavor's reads back equal, tuples included."""
    spec = model_spec("gpt-tiny")
    key = trace_key(spec, seq_len=None, dtype="bf16", batch=1)
    for flavor in FLAVORS.values():
        model = ModelGraph(spec=spec, family=flavor.family, batch=1, seq_len=None,
                           dtype="bf16", tracer="fx", layers=(),
                           config=dataclasses.asdict(flavor.config))
        path = entry_path(spec, key)
        write_entry(path, key, model)
        assert read_entry(path, key, spec) == model, flavor.name


def test_a_solve_from_a_cached_trace_finds_the_same_plan():
    from cost_models.cluster import load_cluster
    from planner.solver import SolveOptions, solve
    from planner.types import TrainingSpec

    cluster = load_cluster("1x4xV100-32G,1x2xT4@10Gbps")
    spec = model_spec("gpt-tiny")
    plans = []
    for _ in range(2):
        graph = cached_trace(spec, seq_len=None, dtype="fp16")
        training = TrainingSpec(global_batch=32, seq_len=graph.seq_len, dtype="fp16")
        plan = solve(graph, cluster, training, SolveOptions())[0]
        plans.append(dataclasses.replace(plan, solver=dataclasses.replace(plan.solver,
                                                                          wall_time=0.0)))
    assert plans[0] == plans[1]


def test_the_key_holds_everything_a_trace_depends_on(monkeypatch):
    spec = model_spec("gpt-tiny")
    base = trace_key(spec, seq_len=None, dtype="bf16", batch=1)
    assert trace_key(model_spec("GPT-TINY"), seq_len=None, dtype="bfloat16", batch=1) == base
    others = [trace_key(model_spec("gpt-tiny", {"layers": 2}), seq_len=None, dtype="bf16",
                        batch=1),
              trace_key(model_spec("gpt2-small"), seq_len=None, dtype="bf16", batch=1),
              trace_key(spec, seq_len=32, dtype="bf16", batch=1),
              trace_key(spec, seq_len=None, dtype="fp32", batch=1),
              trace_key(spec, seq_len=None, dtype="bf16", batch=2)]
    for module, name, value in [(cache.metadata, "version", lambda package: "0.0-other"),
                                (cache, "__version__", "0.0-other"),
                                (cache, "_code_digest", lambda: "edited")]:
        with monkeypatch.context() as patch:  # torch, the planner, the tracing code
            patch.setattr(module, name, value)
            others.append(trace_key(spec, seq_len=None, dtype="bf16", batch=1))
    assert len({base, *others}) == len(others) + 1
    assert len({entry_path(spec, key) for key in [base, *others]}) == len(others) + 1


def test_factories_and_transformers_configs_are_not_cached(tmp_path):
    """They can change under the same name: traced every time, never kept."""
    assert trace_key(model_spec("mypkg.models:build"), seq_len=None, dtype="bf16",
                     batch=1) is None
    assert trace_key(model_spec("hf:LlamaConfig"), seq_len=None, dtype="bf16", batch=1) is None
    (tmp_path / "config.json").write_text("{}")
    assert trace_key(model_spec(str(tmp_path / "config.json")), seq_len=None, dtype="bf16",
                     batch=1) is None
    (tmp_path / "tinymodels.py").write_text(
        "import torch\n"
        "def build(width=8):\n"
        "    net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(3)])\n"
        "    return net, lambda batch, seq_len, device: (torch.zeros(batch, width,"
        " device=device),)\n")
    sys.path.insert(0, str(tmp_path))
    try:
        traced = cached_trace(model_spec("tinymodels:build"), seq_len=None, dtype="fp32")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("tinymodels", None)
    assert traced.graph is not None and traced.layers
    assert not (cache_dir() / "traces").exists()


@pytest.mark.parametrize("damage", [
    b"", b"{\"kind\": \"planner-trace\", \"form", b"[1, 2]", b"{\"kind\": \"plan\"}",
    b"not json \xff", "layers", "key", "format"])
def test_a_damaged_or_foreign_entry_is_traced_again_and_rewritten(damage):
    spec = model_spec("gpt-tiny")
    traced = cached_trace(spec, seq_len=None, dtype="bf16")
    path = _entry(spec)
    if damage in ("layers", "key", "format"):  # valid JSON, not this key's entry
        data = json.loads(path.read_text())
        if damage == "layers":
            data["model"]["layers"][1].pop("kernels")
        elif damage == "key":
            data["key"]["torch"] = "0.0-other"
        else:
            data["format"] += 1
        path.write_text(json.dumps(data))
    else:
        path.write_bytes(damage)
    again = cached_trace(spec, seq_len=None, dtype="bf16")
    assert again.graph is not None and again == traced  # traced again
    read = cached_trace(spec, seq_len=None, dtype="bf16")
    assert read.graph is None and read == traced  # and the entry rewritten


def test_the_cache_reads_what_it_holds_and_the_environment_bypasses_it(monkeypatch):
    spec = model_spec("gpt-tiny")
    traced = cached_trace(spec, seq_len=None, dtype="bf16")
    path = _entry(spec)
    data = json.loads(path.read_text())
    data["model"]["layers"][1]["name"] = "renamed"
    path.write_text(json.dumps(data))
    assert cached_trace(spec, seq_len=None, dtype="bf16").layers[1].name == "renamed"
    monkeypatch.setenv("PLANNER_NO_CACHE", "1")
    fresh = cached_trace(spec, seq_len=None, dtype="bf16")
    assert fresh.graph is not None and fresh == traced
    assert json.loads(path.read_text()) == data  # neither read nor written
    fp32 = cached_trace(spec, seq_len=None, dtype="fp32")
    assert fp32.graph is not None and not _entry(spec, dtype="fp32").exists()


def test_a_cache_folder_that_cannot_be_written_is_passed_over(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("a file where the cache folder would be")
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path / "file" / "cache"))
    spec = model_spec("gpt-tiny")
    first = cached_trace(spec, seq_len=None, dtype="bf16")
    second = cached_trace(spec, seq_len=None, dtype="bf16")
    assert first.graph is not None and second.graph is not None and first == second


def test_the_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "mine"
    assert _entry(model_spec("gpt-tiny")).parent == tmp_path / "mine" / "traces"
    monkeypatch.delenv("PLANNER_CACHE_DIR")
    assert cache_dir() == tmp_path / "xdg" / "planner"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == tmp_path / "home" / ".cache" / "planner"


def test_dtype_sizes_are_torch_s():
    import torch

    from planner.dtypes import DTYPES, dtype_bytes, torch_dtype

    assert torch_dtype("bf16") is torch.bfloat16 and torch_dtype("half") is torch.float16
    for name in DTYPES:
        assert dtype_bytes(name) == torch_dtype(name).itemsize


# a command run in a fresh interpreter, saying whether it imported torch
_RUN = """
import sys
from cli.main import app
sys.argv = ["planner", *sys.argv[1:]]
code = 0
try:
    app()
except SystemExit as exc:
    code = exc.code
print("torch imported" if "torch" in sys.modules else "no torch", code, file=sys.stderr)
"""


def _planner(tmp_path: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, "-c", _RUN, *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    last = done.stderr.strip().splitlines()[-1]
    assert last.endswith(" 0"), done.stderr
    return last.removesuffix(" 0")


def test_planning_commands_import_no_torch_once_the_trace_is_cached(tmp_path):
    solve = ("solve", "gpt-tiny", "-c", "1x4xV100-32G", "-B", "16", "--seq-len", "64",
             "--dtype", "fp16", "--time-limit", "20")
    assert _planner(tmp_path, *solve, "-o", "a.json") == "torch imported"  # traced
    assert _planner(tmp_path, *solve) == "no torch"
    assert _planner(tmp_path, "estimate", "gpt-tiny", "-c", "1x4xV100-32G", "-B", "16",
                    "--seq-len", "64", "--dtype", "fp16", "--pp", "2") == "no torch"
    assert _planner(tmp_path, *solve[:3], "1x2xA100-40G", *solve[4:], "-o",
                    "b.json") == "no torch"
    assert _planner(tmp_path, "explain", "a.json") == "no torch"
    assert _planner(tmp_path, "compare", "a.json", "b.json") == "no torch"
    assert _planner(tmp_path, "what-if", "a.json", "--add", "1x4xV100-32G") == "no torch"
    assert _planner(tmp_path, "devices") == "no torch"
