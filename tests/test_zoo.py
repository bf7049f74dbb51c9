"""Zoo flavors build with their published shapes and reject nonsense shapes."""

import pytest
import torch

from planner.errors import PlannerError
from planner.models import load_model, model_spec
from planner.models.zoo import FLAVORS

# Published parameter counts (model cards / reference implementations).
PUBLISHED = {
    "gpt2-small": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "opt-125m": 125_239_296, "opt-350m": 331_196_416, "opt-1.3b": 1_315_758_080,
    "opt-6.7b": 6_658_473_984,
    "llama2-7b": 6_738_415_616, "llama2-13b": 13_015_864_320, "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496, "llama3-405b": 405_853_388_800,
    "bert-base": 109_514_298, "bert-large": 335_174_458,  # BertForMaskedLM
    "t5-base": 222_903_552, "t5-large": 737_668_096,
    "vit-l": 304_326_632, "vit-h": 632_045_800,  # timm, 1000-class head
    "resnet50": 25_557_032, "resnet152": 60_192_808,  # torchvision
    "mixtral-8x7b": 46_702_792_704,
    "gpt3-175b": 175_000_000_000,  # the paper's rounded figure
}


def count(name: str, **overrides) -> int:
    loaded = load_model(model_spec(name, overrides))
    return sum(p.numel() for p in loaded.module.parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_published(name):
    assert count(name) == pytest.approx(PUBLISHED[name], rel=0.01)


@pytest.mark.parametrize("name", ["gpt3-1.3b", "gpt3-2.7b", "gpt3-6.7b", "gpt3-13b"])
def test_gpt3_counts_follow_megatron_formula(name):
    # The paper's names round (1.3B is 1.316B); Narayanan et al. 2021 give the count:
    # P = 12 l h^2 (1 + 13 / (12 h) + (V + s) / (12 l h)).
    cfg = FLAVORS[name].config
    n, h, v, s = cfg.layers, cfg.hidden, cfg.vocab_size, cfg.seq_len
    formula = 12 * n * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * n * h))
    assert count(name) == pytest.approx(formula, rel=1e-3)


def test_every_flavor_builds_on_meta():
    for name in FLAVORS:
        module = load_model(model_spec(name)).module
        assert all(p.device.type == "meta" for p in module.parameters())


def test_overrides_change_the_shape():
    small = load_model(model_spec("llama3-8b", {"layers": 2, "hidden": 256, "heads": 4,
                                                "kv_heads": 2, "ffn": 512, "vocab": 1000}))
    assert len(small.module.layers) == 2
    assert small.module.layers[0].attn.k.out_features == 2 * 64
    assert small.config["vocab_size"] == 1000


@pytest.mark.parametrize("overrides, needle", [
    ({"layers": 0}, "layers must be positive"),
    ({"heads": 7}, "heads (7) must divide hidden (768)"),
    ({"hidden": -5}, "hidden must be positive"),
    ({"kv_heads": 5}, "kv_heads (5)"),
    ({"heads": "abc"}, "heads takes an integer (like 12), not 'abc'"),  # --set heads=abc
    ({"layers": True}, "layers takes an integer"),  # YAML reads --set layers=yes as True
    ({"kv_heads": "x"}, "kv_heads takes an integer, not 'x'"),  # an optional count
    ({"capacity_factor": "big"}, "capacity_factor takes a number"),
    ({"capacity_factor": -1}, "capacity_factor must be a positive, finite number (got -1"),
    ({"capacity_factor": 0}, "capacity_factor must be a positive, finite number (got 0"),
    ({"capacity_factor": float("nan")}, "capacity_factor must be a positive, finite number"),
    # 100,000 blocks traced for many minutes without a word; 0 positions were taken as none
    ({"layers": 100_000}, "layers must be at most 4,096 (got 100,000)"),
    ({"max_positions": 0}, "max_positions must be positive (got 0)"),
    ({"max_positions": -5}, "max_positions must be positive (got -5)"),
    # a weight past PyTorch's sizes was an internal error
    ({"hidden": 4_000_000_000, "heads": 4}, "cannot be built: Storage size calculation "
     "overflowed"),
])
def test_nonsense_shapes_are_named(overrides, needle):
    with pytest.raises(PlannerError) as err:
        load_model(model_spec("gpt2-small", overrides))
    assert needle in err.value.message


def test_sequence_longer_than_learned_positions():
    with pytest.raises(PlannerError, match="exceeds the 1024 learned positions") as err:
        load_model(model_spec("gpt2-small"), seq_len=2048)
    assert list(err.value.remedies) == ["use a shorter --seq-len"]  # no overrides were given
    assert load_model(model_spec("gpt2-small", {"max_positions": 2048}), seq_len=2048)


def test_unknown_model_suggests_close_names():
    with pytest.raises(PlannerError) as err:
        load_model(model_spec("lama3-70b"))
    assert "llama3-70b" in err.value.message
    assert err.value.kind == "unknown-model"


def test_unknown_override_lists_the_accepted_ones():
    with pytest.raises(PlannerError, match="has no shape option 'patch'"):
        load_model(model_spec("gpt2-small", {"patch": 4}))


def test_seq_len_rejected_for_models_without_sequences():
    with pytest.raises(PlannerError, match="no sequence length"):
        load_model(model_spec("resnet50"), seq_len=128)
    with pytest.raises(PlannerError, match="no sequence length"):
        load_model(model_spec("vit-l"), seq_len=128)


def test_a_vit_plan_reloads_its_model_with_the_token_count_it_records():
    """Plans store the traced token count (patches + 1); reading them back passes it
    to load_model, which takes it where it is the model's own count."""
    small = model_spec("vit-l", {"layers": 1, "hidden": 32, "heads": 2, "ffn": 64,
                                 "image_size": 32})
    tokens = load_model(small, device="meta").seq_len
    assert load_model(small, seq_len=tokens, device="meta").seq_len == tokens == 5


def test_a_plan_file_rebuilds_a_model_with_a_list_override(tmp_path):
    """JSON keeps a tuple override (ResNet's blocks) as a list: the plan read back must
    still build its model, or the runtime cannot run the plan."""
    from cost_models.cluster import load_cluster
    from planner.planfile import read_plan, write_plan
    from planner.solver import SolveOptions, solve
    from planner.trace import trace_model
    from planner.types import TrainingSpec

    spec = model_spec("resnet50", {"blocks": (1, 1, 1, 1), "width": 8, "image_size": 64})
    plan = solve(trace_model(spec, dtype="fp16"), load_cluster("1x2xA100-40G"),
                 TrainingSpec(global_batch=4, seq_len=None, dtype="fp16"),
                 SolveOptions(with_baselines=False))[0]
    write_plan(plan, tmp_path / "plan.json")
    again = read_plan(tmp_path / "plan.json")
    assert list(again.model.overrides["blocks"]) == [1, 1, 1, 1]
    loaded = load_model(again.model, device="meta")
    assert sum(p.numel() for p in loaded.module.parameters()) == sum(
        p.numel() for p in load_model(spec, device="meta").module.parameters())


@pytest.mark.parametrize("name", ["gpt-tiny", "t5-base", "vit-l", "resnet50", "mlp-small",
                                  "mixtral-8x7b", "bert-base"])
def test_zoo_models_train_for_real(name):
    """The zoo modules are real: a small version runs forward and backward on CPU."""
    small = {"gpt-tiny": {}, "t5-base": {"layers": 1, "hidden": 32, "heads": 2, "ffn": 64,
                                         "vocab": 50, "head_dim": 16},
             "vit-l": {"layers": 1, "hidden": 32, "heads": 2, "ffn": 64, "image_size": 32},
             "resnet50": {"blocks": (1, 1, 1, 1), "width": 8, "image_size": 32},
             "mlp-small": {}, "bert-base": {"layers": 1, "hidden": 32, "heads": 2, "ffn": 64},
             "mixtral-8x7b": {"layers": 1, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 64,
                              "vocab": 50}}[name]
    torch.manual_seed(0)
    loaded = load_model(model_spec(name, small), seq_len=16 if name not in (
        "vit-l", "resnet50", "mlp-small") else None, device="cpu")
    args, _, targets = loaded.example(2, "cpu")
    loss = loaded.loss(loaded.module(*args), targets)
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in loaded.module.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
