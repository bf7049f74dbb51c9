"""Models the user brings: a `package.module:factory` callable or a transformers config.

A factory is called with the shape overrides as keyword arguments, on the meta
device, and returns either a module or `(module, inputs)`, where
`inputs(batch, seq_len, device)` returns the forward's positional inputs (a
tuple of tensors). A module may instead define `example_batch(batch, seq_len,
device) -> (inputs, targets)` and `loss(output, targets)`, like the zoo models.
Tensors are created on `device`; a return of another shape is a bad-model error.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from planner.errors import PlannerError, closest

Example = Callable[[int, int | None, Any], tuple[tuple, dict, Any]]


def _import_target(target: str) -> Callable[..., Any]:
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise PlannerError("bad-model", f"Model factory {target!r} must look like "
                           "'package.module:function'.", ["check the spelling"])
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise PlannerError(
            "bad-model", f"Could not import module {module_name!r} for model factory "
            f"{target!r}: {type(exc).__name__}: {exc}",
            ["run from the directory that contains the package, or install it",
             "run again with --debug for the traceback"]) from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PlannerError("bad-model", f"Module {module_name!r} has no attribute "
                               f"{attr!r} (model factory {target!r}).", ["check the spelling"])
        obj = getattr(obj, part)
    if not callable(obj):
        raise PlannerError("bad-model", f"{target!r} is not callable; it must be a function "
                           "or class that returns an nn.Module.")
    return obj


def load_factory(target: str, overrides: Mapping[str, Any], device: Any = "meta"
                 ) -> tuple[nn.Module, Example, Callable | None]:
    factory = _import_target(target)
    try:
        with torch.device(device):
            made = factory(**overrides)
    except Exception as exc:
        raise PlannerError(
            "bad-model", f"Model factory {target!r} raised {type(exc).__name__}: {exc}",
            ["check the factory's keyword arguments (shape options are passed as keywords)",
             "run again with --debug for the traceback"]) from exc
    inputs = None
    if isinstance(made, tuple) and len(made) == 2 and callable(made[1]):
        made, inputs = made
    if not isinstance(made, nn.Module):
        raise PlannerError("bad-model", f"Model factory {target!r} returned "
                           f"{type(made).__name__}, not a torch.nn.Module (or a "
                           "(module, inputs) pair).", ["return the model from the factory"])
    module = made.to(device) if torch.device(device).type == "meta" else made
    loss = getattr(module, "loss", None) if callable(getattr(module, "loss", None)) else None
    if inputs is not None:
        def example(batch: int, seq_len: int | None, device: Any) -> tuple[tuple, dict, Any]:
            made = _call_user(target, "inputs", inputs, batch, seq_len, device)
            return _example(target, "inputs", made, batch, seq_len, device)
        return module, example, None
    if callable(getattr(module, "example_batch", None)):
        def example(batch: int, seq_len: int | None, device: Any) -> tuple[tuple, dict, Any]:
            made = _call_user(target, "example_batch", module.example_batch, batch, seq_len,
                              device)
            return _example(target, "example_batch", made, batch, seq_len, device)
        return module, example, loss
    raise PlannerError(
        "bad-model", f"Model factory {target!r} returned a module but no example inputs, so "
        "it cannot be traced.",
        ["return (module, inputs) where inputs(batch, seq_len, device) returns the "
         "forward's input tensors", "or give the module an example_batch(batch, seq_len, "
         "device) method returning (inputs, targets)"])


def _call_user(target: str, what: str, make: Callable, batch: int, seq_len: int | None,
               device: Any) -> Any:
    """Call the user's input builder: what it raises is an error of the user's model."""
    try:
        return make(batch, seq_len, device)
    except Exception as exc:
        call = (f"its {what}(batch={batch}, seq_len={seq_len}, device='{device}') raised "
                f"{type(exc).__name__}: {exc}")
        if seq_len is None:  # the likely cause: a model of the user's has no default length
            message = f"Model {target!r} has no default sequence length, and {call}"
            fix = "pass the sequence length with --seq-len"
        else:
            message, fix = f"Model {target!r}: {call}", f"fix the error in the model's {what}()"
        raise PlannerError("bad-model", message,
                           [fix, "run again with --debug for the traceback"]) from exc


_RETURNS = {
    "inputs": "the forward's inputs: a tensor, a tuple of tensors, or a dict of tensors "
              "passed by keyword",
    "example_batch": "(inputs, targets): inputs a tensor or a tuple of tensors (the "
                     "forward's positional inputs), targets what the model's loss takes",
}


def _describe(value: Any) -> str:
    """A value a user's function returned, in a few words for an error message."""
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a {value.device.type} tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list, dict)):
        return f"a {type(value).__name__} of {len(value)} item(s)"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _example(target: str, what: str, made: Any, batch: int, seq_len: int | None,
             device: Any) -> tuple[tuple, dict, Any]:
    """The user's example as (args, kwargs, targets); a bad-model error naming the model
    and what `what` must return when it returned something else, or inputs on another
    device than the one it was given (the tracer runs on meta)."""
    def bad(problem: str) -> PlannerError:
        return PlannerError(
            "bad-model", f"Model {target!r}: its {what}(batch={batch}, seq_len={seq_len}, "
            f"device='{device}') {problem}; it must return {_RETURNS[what]}.",
            [f"fix the model's {what}()", "e.g. return ((x,), y) with x and y created on "
             "the device it is given" if what == "example_batch" else
             "e.g. return (x,) with x created on the device it is given"])

    targets = None
    if what == "example_batch":
        if not isinstance(made, (tuple, list)) or len(made) != 2:
            raise bad(f"returned {_describe(made)}")
        made, targets = made
    if isinstance(made, torch.Tensor):
        made = (made,)
    if isinstance(made, dict) and what == "inputs":
        args, kwargs = (), dict(made)
    elif isinstance(made, (tuple, list)):
        args, kwargs = tuple(made), {}
    else:
        raise bad(f"returned {_describe(made)} as its inputs")
    values = [*args, *kwargs.values()]
    if not values:
        raise bad("returned no inputs")
    for value in values:
        if not isinstance(value, torch.Tensor):
            raise bad(f"returned {_describe(value)} among its inputs")
    expected = torch.device(device).type
    for tensor in values:  # (targets only meet the loss, which says where they belong)
        if tensor.device.type != expected:
            raise bad(f"returned {_describe(tensor)}, not on {expected}")
    return args, kwargs, targets


_HF_NAMES = {"layers": "num_hidden_layers", "hidden": "hidden_size",
             "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
             "ffn": "intermediate_size", "vocab": "vocab_size"}


def hf_config(name: str, overrides: Mapping[str, Any]) -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise PlannerError("missing-dependency", f"Model {name!r} needs the transformers "
                           "package, which is not installed.",
                           ["pip install 'hetero-planner[hf]'"]) from exc
    settings = {_HF_NAMES.get(k, k): v for k, v in overrides.items()}
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json":
        if not path.is_file():
            raise PlannerError("bad-model", f"Config file {str(path)!r} does not exist.",
                               ["check the path"])
        try:
            data = json.loads(path.read_text())
            config = transformers.AutoConfig.for_model(**{**data, **settings})
        except Exception as exc:
            said = str(exc)  # (an unknown model_type lists every known one: kilobytes)
            said = said if len(said) <= 300 else said[:300].rsplit(" ", 1)[0] + " ..."
            raise PlannerError("bad-model", f"Could not read transformers config "
                               f"{str(path)!r}: {type(exc).__name__}: {said}",
                               ["check that it is a transformers config.json with a "
                                "model_type"]) from exc
    else:
        cls_name = name.removeprefix("hf:")
        cls = getattr(transformers, cls_name, None)
        if cls is None or not isinstance(cls, type) or not cls_name.endswith("Config"):
            raise PlannerError("bad-model", f"transformers has no config class {cls_name!r}.",
                               ["name a config class such as hf:LlamaConfig, or pass a "
                                "config.json path"])
        try:
            config = cls(**settings)
        except Exception as exc:
            raise PlannerError("bad-shape", f"transformers {cls_name} rejected the options "
                               f"{settings}: {type(exc).__name__}: {exc}",
                               ["change the shape options"]) from exc
    for field in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                  "intermediate_size", "vocab_size"):  # (n_layer, n_embd ... map to these)
        value = getattr(config, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise PlannerError("bad-shape", f"transformers {type(config).__name__} of {name!r} "
                               f"has {field} {value}; it must be at least 1.",
                               ["fix the config, or pass a shape option such as --layers"])
    default = type(config)()  # transformers keeps unknown keys silently: a typo does nothing
    unknown = [k for k in settings if not hasattr(default, k)]
    if unknown:
        known = sorted(default.to_dict())
        near = closest(unknown[0], known)
        raise PlannerError("bad-override", f"transformers {type(config).__name__} has no option "
                           f"{unknown[0]!r}" + (f"; did you mean {near[0]!r}?" if near else "."),
                           [f"check the name against {type(config).__name__}'s fields"])
    return config


def load_hf(name: str, overrides: Mapping[str, Any]
            ) -> tuple[nn.Module, Example, Callable | None, Any]:
    import transformers

    config = hf_config(name, overrides)
    auto = [transformers.AutoModelForCausalLM, transformers.AutoModelForSeq2SeqLM,
            transformers.AutoModelForMaskedLM, transformers.AutoModelForImageClassification,
            transformers.AutoModel]
    model = None
    for cls in auto:
        if type(config) in cls._model_mapping:
            try:
                with torch.device("meta"):
                    model = cls.from_config(config)
            except (ValueError, RuntimeError) as exc:  # (inconsistent or too large shapes)
                raise PlannerError("bad-shape", f"transformers could not build "
                                   f"{type(config).__name__} of {name!r}: "
                                   f"{type(exc).__name__}: {str(exc)[:300]}",
                                   ["fix the config's shape, or pass shape options such as "
                                    "--hidden and --heads"]) from exc
            break
    if model is None:
        raise PlannerError("bad-model", f"transformers has no model for config "
                           f"{type(config).__name__}.")
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    import inspect

    takes_cache = "use_cache" in inspect.signature(model.forward).parameters
    vocab = getattr(config, "vocab_size", None)
    vision = getattr(config, "image_size", None) and not vocab
    seq2seq = getattr(config, "is_encoder_decoder", False)

    def example(batch: int, seq_len: int | None, device: Any) -> tuple[tuple, dict, Any]:
        if vision:
            size, channels = config.image_size, getattr(config, "num_channels", 3)
            return (torch.zeros(batch, channels, size, size, device=device),), {}, None
        ids = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
        kwargs = {"decoder_input_ids": ids} if seq2seq else {}
        if takes_cache:
            kwargs["use_cache"] = False
        return (ids,), kwargs, ids

    def loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
        logits = output[0] if isinstance(output, (tuple, list)) else output.logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    return model, example, (None if vision else loss), config
