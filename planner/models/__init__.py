"""Models by name: the built-in zoo, user factories and transformers configs.

`model_spec("llama3-8b")`, `model_spec("mypkg.models:build")`,
`model_spec("hf:LlamaConfig")` or `model_spec("path/to/config.json")` name a
model; `load_model` builds it (on the meta device by default) together with
example inputs and its training loss. Naming a model and the zoo's flavors need no
torch: it is imported where a model is built (a solve whose trace is cached builds none).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.errors import PlannerError
from planner.models.zoo import FLAVORS
from planner.types import ModelSpec

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["FLAVORS", "LoadedModel", "load_model", "model_spec"]


def model_spec(name: str, overrides: Mapping[str, Any] | None = None) -> ModelSpec:
    """Classify a model name: zoo flavor, `module:factory`, or transformers config."""
    overrides = dict(overrides or {})
    if name.startswith("hf:") or name.endswith(".json") or (Path(name) / "config.json").is_file():
        return ModelSpec(source="hf", name=name, overrides=overrides)
    if ":" in name:
        return ModelSpec(source="factory", name=name, overrides=overrides)
    return ModelSpec(source="zoo", name=name.lower(), overrides=overrides)


@dataclass(frozen=True)
class LoadedModel:
    """A built model with what tracing and training need.

    example(batch, device) -> (args, kwargs, targets) builds inputs for one batch;
    loss(output, targets) is the training loss, or None (forward only).
    """

    spec: ModelSpec
    family: str
    module: nn.Module
    config: Mapping[str, Any]
    seq_len: int | None
    example: Callable[[int, Any], tuple[tuple, dict, Any]]
    loss: Callable[[Any, Any], torch.Tensor] | None


def _config_dict(config: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    if hasattr(config, "to_dict"):
        return {k: v for k, v in config.to_dict().items()
                if isinstance(v, (int, float, str, bool)) or v is None}
    return {}


@contextlib.contextmanager
def _skip_meta_init() -> Iterator[None]:
    """Make torch.nn.init's in-place initializers return meta tensors untouched:
    they hold no values, and initializing them costs seconds for big models."""
    import torch

    init = torch.nn.init
    originals = {n: getattr(init, n) for n in dir(init)
                 if n.endswith("_") and not n.startswith("_") and callable(getattr(init, n))}

    def skipping(fn: Callable) -> Callable:
        def wrapper(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
            return fn(tensor, *args, **kwargs)
        return wrapper

    for name, fn in originals.items():
        setattr(init, name, skipping(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(init, name, fn)


def load_model(spec: ModelSpec, *, seq_len: int | None = None,
               device: str | torch.device = "meta") -> LoadedModel:
    """Build the model named by `spec` on `device` (meta: no memory is allocated)."""
    import torch

    from planner.models.user import load_factory, load_hf
    from planner.models.zoo import build_zoo_model

    if seq_len is not None and seq_len <= 0:
        raise PlannerError("bad-value", f"--seq-len must be positive (got {seq_len}).")
    meta = torch.device(device).type == "meta"
    with torch.device(device), (_skip_meta_init() if meta else contextlib.nullcontext()):
        if spec.source == "zoo":
            try:
                flavor, config, module = build_zoo_model(spec.name, spec.overrides, seq_len)
            except RuntimeError as exc:  # (a tensor past PyTorch's sizes)
                raise PlannerError("bad-shape", f"Model {spec.describe()} cannot be built: "
                                   f"{str(exc).splitlines()[0][:300]}",
                                   ["use smaller shape options (--hidden, --ffn, --vocab, "
                                    "--seq-len)"]) from exc
            seq = getattr(config, "seq_len", None)
            if flavor.family in ("resnet", "mlp"):
                seq = None

            def example(batch: int, dev: Any) -> tuple[tuple, dict, Any]:
                args, targets = module.example_batch(batch, seq, dev)
                return args, {}, targets

            return LoadedModel(spec=spec, family=flavor.family, module=module,
                               config=_config_dict(config), seq_len=seq, example=example,
                               loss=module.loss)
        if spec.source == "factory":
            module, make, loss = load_factory(spec.name, spec.overrides, device)
            return LoadedModel(spec=spec, family="custom", module=module, config={},
                               seq_len=seq_len, example=lambda b, d: make(b, seq_len, d),
                               loss=loss)
        if spec.source == "hf":
            module, make, loss, config = load_hf(spec.name, spec.overrides)
            seq = seq_len or min(getattr(config, "max_position_embeddings", 0) or 512, 2048)
            if getattr(config, "image_size", None) and not getattr(config, "vocab_size", None):
                seq = None
            return LoadedModel(spec=spec, family=getattr(config, "model_type", "hf"),
                               module=module, config=_config_dict(config), seq_len=seq,
                               example=lambda b, d: make(b, seq, d), loss=loss)
    raise PlannerError("bad-model", f"Unknown model source {spec.source!r}.")
