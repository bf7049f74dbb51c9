"""The built-in model zoo: flavor name -> family + published configuration.

Shapes follow the papers and model cards (GPT-2, GPT-3 table 2.1, OPT, Llama 2,
Llama 3/3.1, BERT, T5, ViT, ResNet, Mixtral). `build_zoo_model` applies shape
overrides and validates them before any module is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from planner.errors import PlannerError, unknown_name_error
from planner.models.configs import (
    MLPConfig,
    ResNetConfig,
    T5Config,
    TransformerConfig,
    ViTConfig,
)

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class Flavor:
    name: str
    family: str
    description: str
    config: Any


def _gpt2(hidden: int, layers: int, heads: int) -> TransformerConfig:
    return TransformerConfig(vocab_size=50257, hidden=hidden, layers=layers, heads=heads,
                             seq_len=1024)


def _gpt3(hidden: int, layers: int, heads: int) -> TransformerConfig:
    return TransformerConfig(vocab_size=50257, hidden=hidden, layers=layers, heads=heads,
                             seq_len=2048)


def _opt(hidden: int, layers: int, heads: int, **kw: Any) -> TransformerConfig:
    return TransformerConfig(vocab_size=50272, hidden=hidden, layers=layers, heads=heads,
                             seq_len=2048, position_offset=2, activation="relu", **kw)


def _llama(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int,
           seq_len: int, theta: float) -> TransformerConfig:
    return TransformerConfig(vocab_size=vocab, hidden=hidden, layers=layers, heads=heads,
                             kv_heads=kv_heads, ffn=ffn, seq_len=seq_len, positions="rope",
                             rope_theta=theta, norm="rmsnorm", activation="swiglu",
                             tie_embeddings=False, bias=False)


def _bert(hidden: int, layers: int, heads: int) -> TransformerConfig:
    return TransformerConfig(vocab_size=30522, hidden=hidden, layers=layers, heads=heads,
                             seq_len=512, type_vocab=2, embed_norm=True, pre_norm=False,
                             causal=False, mlm_head=True, norm_eps=1e-12)


_FLAVORS = [
    Flavor("gpt2-small", "gpt", "GPT-2 124M", _gpt2(768, 12, 12)),
    Flavor("gpt2-medium", "gpt", "GPT-2 355M", _gpt2(1024, 24, 16)),
    Flavor("gpt2-large", "gpt", "GPT-2 774M", _gpt2(1280, 36, 20)),
    Flavor("gpt2-xl", "gpt", "GPT-2 1.5B", _gpt2(1600, 48, 25)),
    Flavor("gpt3-1.3b", "gpt", "GPT-3 XL 1.3B", _gpt3(2048, 24, 16)),
    Flavor("gpt3-2.7b", "gpt", "GPT-3 2.7B", _gpt3(2560, 32, 32)),
    Flavor("gpt3-6.7b", "gpt", "GPT-3 6.7B", _gpt3(4096, 32, 32)),
    Flavor("gpt3-13b", "gpt", "GPT-3 13B", _gpt3(5120, 40, 40)),
    Flavor("gpt3-175b", "gpt", "GPT-3 175B", _gpt3(12288, 96, 96)),
    Flavor("opt-125m", "opt", "OPT 125M", _opt(768, 12, 12)),
    Flavor("opt-350m", "opt", "OPT 350M (post-norm, 512-wide embeddings)",
           _opt(1024, 24, 16, embed_dim=512, pre_norm=False)),
    Flavor("opt-1.3b", "opt", "OPT 1.3B", _opt(2048, 24, 32)),
    Flavor("opt-6.7b", "opt", "OPT 6.7B", _opt(4096, 32, 32)),
    Flavor("llama2-7b", "llama", "Llama 2 7B", _llama(4096, 32, 32, 32, 11008, 32000, 4096,
                                                      1e4)),
    Flavor("llama2-13b", "llama", "Llama 2 13B", _llama(5120, 40, 40, 40, 13824, 32000, 4096,
                                                        1e4)),
    Flavor("llama2-70b", "llama", "Llama 2 70B (GQA)", _llama(8192, 80, 64, 8, 28672, 32000,
                                                              4096, 1e4)),
    Flavor("llama3-8b", "llama", "Llama 3 8B (GQA)", _llama(4096, 32, 32, 8, 14336, 128256,
                                                            8192, 5e5)),
    Flavor("llama3-70b", "llama", "Llama 3 70B (GQA)", _llama(8192, 80, 64, 8, 28672, 128256,
                                                              8192, 5e5)),
    Flavor("llama3-405b", "llama", "Llama 3.1 405B (GQA)",
           _llama(16384, 126, 128, 8, 53248, 128256, 8192, 5e5)),
    Flavor("bert-base", "bert", "BERT-base 110M (masked LM)", _bert(768, 12, 12)),
    Flavor("bert-large", "bert", "BERT-large 340M (masked LM)", _bert(1024, 24, 16)),
    Flavor("t5-base", "t5", "T5-style encoder-decoder, 220M", T5Config()),
    Flavor("t5-large", "t5", "T5-style encoder-decoder, 770M",
           T5Config(hidden=1024, layers=24, heads=16, ffn=4096)),
    Flavor("vit-l", "vit", "ViT-L/16, 224px", ViTConfig()),
    Flavor("vit-h", "vit", "ViT-H/14, 224px",
           ViTConfig(patch=14, hidden=1280, layers=32, heads=16, ffn=5120)),
    Flavor("resnet50", "resnet", "ResNet-50", ResNetConfig()),
    Flavor("resnet152", "resnet", "ResNet-152", ResNetConfig(blocks=(3, 8, 36, 3))),
    Flavor("mixtral-8x7b", "mixtral", "Mixtral 8x7B (top-2 of 8 experts)",
           dataclasses.replace(_llama(4096, 32, 32, 8, 14336, 32000, 4096, 1e6), experts=8,
                               top_k=2)),
    Flavor("mlp", "mlp", "Plain MLP, 8 x 4096", MLPConfig()),
    Flavor("mlp-small", "mlp", "Plain MLP, 4 x 256 (for quick runs)",
           MLPConfig(inputs=128, hidden=256, layers=4, classes=10)),
    Flavor("gpt-tiny", "gpt", "A 4-layer, 128-wide GPT (for tests and local runs)",
           TransformerConfig(vocab_size=512, hidden=128, layers=4, heads=4, seq_len=64)),
]
FLAVORS: Mapping[str, Flavor] = {f.name: f for f in _FLAVORS}


def _model_class(config: Any) -> Callable[[Any], nn.Module]:
    """The module that builds `config`'s family, imported only here: the flavors and their
    checks above need no torch."""
    from planner.models.mlp import MLPModel
    from planner.models.t5 import T5
    from planner.models.transformer import Transformer
    from planner.models.vision import ResNet, ViT

    return {TransformerConfig: Transformer, T5Config: T5, ViTConfig: ViT, ResNetConfig: ResNet,
            MLPConfig: MLPModel}[type(config)]

# User-facing override names -> config field, per config class.
OVERRIDES: Mapping[type, Mapping[str, str]] = {
    TransformerConfig: {"layers": "layers", "hidden": "hidden", "heads": "heads",
                        "kv_heads": "kv_heads", "ffn": "ffn", "vocab": "vocab_size",
                        "experts": "experts", "top_k": "top_k",
                        "capacity_factor": "capacity_factor", "max_positions": "max_positions"},
    T5Config: {"layers": "layers", "decoder_layers": "decoder_layers", "hidden": "hidden",
               "heads": "heads", "ffn": "ffn", "vocab": "vocab_size", "head_dim": "head_dim"},
    ViTConfig: {"layers": "layers", "hidden": "hidden", "heads": "heads", "ffn": "ffn",
                "image_size": "image_size", "patch": "patch", "classes": "classes"},
    ResNetConfig: {"blocks": "blocks", "width": "width", "classes": "classes",
                   "image_size": "image_size"},
    MLPConfig: {"layers": "layers", "hidden": "hidden", "inputs": "inputs",
                "classes": "classes"},
}


def matching(text: str) -> list[Flavor]:
    """The zoo flavors whose name, family or description holds `text` (any case); all
    for ""."""
    wanted = text.strip().lower()
    return [f for f in FLAVORS.values() if wanted in f.name or wanted in f.family
            or wanted in f.description.lower()]


def flavor(name: str) -> Flavor:
    try:
        return FLAVORS[name.lower()]
    except KeyError:
        raise unknown_name_error("unknown-model", "model", name, list(FLAVORS),
                                 "planner models") from None


_SHAPE_FLAGS = {"layers", "hidden", "heads", "kv_heads", "ffn", "vocab"}  # CLI options
# the most blocks a model may have (the largest zoo model has 126): tracing takes about
# 5 ms a block and the search's tables grow with the square of the layers, so 100,000
# ran for many minutes without a word
MAX_BLOCKS = 4096


def configure(name: str, overrides: Mapping[str, Any],
              seq_len: int | None = None) -> tuple[Flavor, Any]:
    """The flavor and its configuration with overrides (and a sequence length for
    the families that take one) applied and validated."""
    base = flavor(name)
    allowed = OVERRIDES[type(base.config)]
    changes = {}
    for key, value in overrides.items():
        if key not in allowed:
            raise PlannerError(
                "bad-override",
                f"Model {base.name} ({base.family}) has no shape option {key!r}; it accepts "
                f"{', '.join(sorted(allowed))}.",
                [f"drop --{key.replace('_', '-')}" if key in _SHAPE_FLAGS else
                 f"drop --set {key}=..."])
        changes[allowed[key]] = _typed(base, key, getattr(base.config, allowed[key]), value)
    fixed = not hasattr(base.config, "max_positions") and not isinstance(base.config, T5Config)
    own = getattr(dataclasses.replace(base.config, **changes), "seq_len", None)
    if fixed and seq_len is not None and seq_len == own:
        seq_len = None  # the model's own token count, as plans record it (ViT's patches)
    if seq_len is not None:
        if fixed:
            raise PlannerError(
                "bad-option", f"Model {base.name} ({base.family}) has no sequence length to "
                f"set; its input size comes from its shape options "
                f"({', '.join(sorted(allowed))}).", ["drop --seq-len"])
        changes["seq_len"] = seq_len
        if getattr(base.config, "positions", None) == "learned":
            changes.setdefault("max_positions", base.config.max_positions or base.config.seq_len)
    config = dataclasses.replace(base.config, **changes)
    problems = config.validate() + [
        f"{name} must be at most {MAX_BLOCKS:,} (got {value:,})"
        for name in ("layers", "decoder_layers")
        if isinstance(value := getattr(config, name, None), int) and value > MAX_BLOCKS]
    if problems:
        given = f" with overrides {dict(overrides)}" if overrides else ""
        fixes = (["change the overriding options so the shape is consistent"] if overrides
                 else [])
        if seq_len is not None:
            fixes.append("use a shorter --seq-len" if "max_positions" in "".join(problems)
                         else "check --seq-len")
        raise PlannerError("bad-shape", f"Model {base.name}{given} is not a valid shape: "
                           f"{'; '.join(problems)}.", fixes)
    return base, config


def _typed(base: Flavor, key: str, default: Any, value: Any) -> Any:
    """An override's value if it has its field's type (an int for an int field, a number
    for a float one, ...); else an error naming the option."""
    kind = int if default is None else type(default)  # the optional fields are counts
    if kind is tuple and isinstance(value, list):  # (as JSON plan files keep it)
        value = tuple(value)

    def integer(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    ok = {int: integer(value), float: integer(value) or isinstance(value, float),
          tuple: isinstance(value, tuple) and all(integer(x) for x in value)
          }.get(kind, isinstance(value, kind))
    if not ok:
        what = {int: "an integer", float: "a number", tuple: "a list of integers"}.get(
            kind, f"a {kind.__name__}")
        raise PlannerError("bad-override", f"Model {base.name}: {key} takes {what}"
                           + (f" (like {list(default) if kind is tuple else default!r})"
                              if default is not None else "")
                           + f", not {value!r}.",
                           [f"e.g. --set {key}={list(default) if kind is tuple else default}"
                            if key not in _SHAPE_FLAGS else f"e.g. --{key.replace('_', '-')} "
                            f"{default if default is not None else 8}"])
    return float(value) if kind is float else value


def build_zoo_model(name: str, overrides: Mapping[str, Any], seq_len: int | None = None
                    ) -> tuple[Flavor, Any, nn.Module]:
    """Build a zoo model on the current default device (use `torch.device("meta")`)."""
    base, config = configure(name, overrides, seq_len)
    return base, config, _model_class(config)(config)
