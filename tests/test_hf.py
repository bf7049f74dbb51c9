"""transformers configs are built on meta and traced with torch.export (non-strict)."""

import json

import pytest

pytest.importorskip("transformers")

from planner.errors import PlannerError
from planner.models import model_spec
from planner.trace import trace_model
from planner.trace.summary import count_blocks, flop_check

SMALL = {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "ffn": 256, "vocab": 500}


def test_config_class_with_overrides():
    g = trace_model(model_spec("hf:LlamaConfig", SMALL), seq_len=64)
    assert g.tracer == "export"
    assert count_blocks(g) == 2
    assert [layer.name for layer in g.layers[1:3]] == ["model.layers.0", "model.layers.1"]
    assert g.layers[1].signature == g.layers[2].signature
    # the runtime has no tensor-parallel plan for transformers' blocks: replicated
    assert not any(layer.tp_sharded for layer in g.layers) and g.layers[1].tp_divisor == 0
    assert flop_check(g).ratio == pytest.approx(1.0, abs=0.01)


def test_config_json_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_layer": 3, "n_embd": 64,
                                "n_head": 2, "vocab_size": 300}))
    g = trace_model(model_spec(str(path)), seq_len=32)
    assert count_blocks(g) == 3
    assert g.params == sum(layer.params for layer in g.layers)


def test_unknown_config_class():
    with pytest.raises(PlannerError, match="no config class 'NopeConfig'"):
        trace_model(model_spec("hf:NopeConfig"))


def test_missing_config_file(tmp_path):
    with pytest.raises(PlannerError, match="does not exist"):
        trace_model(model_spec(str(tmp_path / "missing.json")))


def test_a_misspelt_config_option_is_an_error_not_ignored():
    # transformers keeps unknown keyword arguments as attributes: a typo changed nothing
    with pytest.raises(PlannerError, match="did you mean 'num_hidden_layers'"):
        trace_model(model_spec("hf:LlamaConfig", {**SMALL, "num_hiden_layers": 1}), seq_len=64)


def test_a_config_with_no_layers_is_refused(tmp_path):
    """GPT-2's n_layer maps to num_hidden_layers: -3 blocks built a model of none."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_layer": -3, "n_embd": 64,
                                "n_head": 2}))
    with pytest.raises(PlannerError, match="has num_hidden_layers -3; it must be at least 1"):
        trace_model(model_spec(str(path)))


def test_a_config_transformers_cannot_build_is_named(tmp_path):
    """The config reads fine, but the model's constructor refuses it (an internal error
    before)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 130,
                                "n_head": 4}))
    with pytest.raises(PlannerError, match=r"transformers could not build GPT2Config of .*"
                       r"embed_dim. must be divisible by num_heads"):
        trace_model(model_spec(str(path)))


def test_an_unknown_model_type_is_named_in_a_short_message(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "nosuch"}))
    with pytest.raises(PlannerError, match="nosuch") as caught:
        trace_model(model_spec(str(path)))
    assert len(caught.value.message) < 600  # (transformers lists every model type it knows)
