"""Forward and backward seconds of each traced layer, measured in real training steps.

The model is traced on the meta device (for its layers, their module paths and
signatures; batch 1, the profile's dtype) and built again on the device with real
weights. Each training step (forward, loss, backward) runs with hooks on every
layer's modules that mark when a module is entered and left, forward and backward.

Attribution: a pass is cut where a layer begins, so each layer's time runs from its
first module being entered to the next layer's first module being entered; work
outside every module (ops at the model's root) counts toward the layer it follows.
The first layer's forward starts with the step and the last layer's forward ends
after the loss, so the head includes the loss; backward runs the other way (the
head first, from the start of `backward()`, and the embedding last, until
`backward()` returns, weight-gradient accumulation included). The layer times of a
pass therefore add up to the pass. A layer whose modules are never entered (all of
its ops at the root) begins where the previous layer's modules were last left. A
module shared by several layers (T5's embedding) counts toward the next of them.
Gradients are not reset between steps: they accumulate, as they do across the
micro-batches of one optimizer step (and no step allocates them afresh).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cost_models.profile.timing import Clock, Samples, tf32
from planner.dtypes import canonical_dtype, torch_dtype
from planner.models import LoadedModel, load_model, model_spec
from planner.trace import trace_loaded
from planner.types import Layer

QUICK_SEQ_LEN = 64  # quick mode's sequence length when none is given (if shorter)
_REPEATS = {True: 3, False: 6}  # timed steps per micro-batch, after one warm-up step at it

Event = tuple[Any, bool, tuple[int, ...]]  # (clock mark, entering, layer indices)


def micro_batches(quick: bool) -> tuple[int, ...]:
    return (1, 2) if quick else (1, 2, 4, 8)


class _Recorder:
    """Hooks on each layer's modules that log (mark, entering, layers) per pass."""

    def __init__(self, module: nn.Module, layers: tuple[Layer, ...], clock: Clock) -> None:
        self.clock = clock
        self.count = len(layers)
        self.forward: list[Event] = []
        self.backward: list[Event] = []
        owners: dict[str, tuple[int, ...]] = {}
        for i, layer in enumerate(layers):
            for path in layer.modules:
                owners[path] = (*owners.get(path, ()), i)
        self.handles = []
        for path, indices in owners.items():
            sub = module.get_submodule(path)
            self.handles += [
                sub.register_forward_pre_hook(self._hook(self.forward, True, indices)),
                sub.register_forward_hook(self._hook(self.forward, False, indices)),
                sub.register_full_backward_pre_hook(self._hook(self.backward, True, indices)),
                sub.register_full_backward_hook(self._hook(self.backward, False, indices)),
            ]

    def _hook(self, events: list[Event], entering: bool, indices: tuple[int, ...]) -> Callable:
        def hook(*_: object) -> None:
            events.append((self.clock.mark(), entering, indices))
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def split_pass(events: list[Event], count: int, start: Any, end: Any, clock: Clock,
               backward: bool) -> list[float]:
    """Seconds of each of `count` layers (in layer order) in one pass from `start` to
    `end`, cut where each layer begins (see the module docstring)."""
    order = list(range(count))[::-1] if backward else list(range(count))
    position = {layer: p for p, layer in enumerate(order)}
    entered: list[Any] = [None] * count  # by position in the pass
    left: list[Any] = [None] * count
    cursor = -1
    for mark, entering, layers in events:
        places = sorted(position[i] for i in layers)
        if cursor not in places:
            later = [p for p in places if p > cursor]
            if not later:
                continue  # a module of an earlier layer, run again: part of this one
            cursor = later[0]
        if entering and entered[cursor] is None:
            entered[cursor] = mark
        if not entering:
            left[cursor] = mark
    starts = [start]
    for p in range(1, count):
        fallback = left[p - 1] if left[p - 1] is not None else starts[-1]
        starts.append(entered[p] if entered[p] is not None else fallback)
    ends = [*starts[1:], end]
    seconds = [clock.seconds(a, b) for a, b in zip(starts, ends, strict=True)]
    return [seconds[position[i]] for i in range(count)]


def _cast(tree: object, dtype: torch.dtype) -> object:
    return torch.utils._pytree.tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
        tree)


def _loss(loaded: LoadedModel, out: object, targets: object) -> torch.Tensor:
    """The model's training loss, or (a model without one) the mean of its outputs."""
    if loaded.loss is not None and targets is not None:
        return loaded.loss(out, targets)
    leaves = torch.utils._pytree.tree_leaves(out)
    return sum(t.float().mean() for t in leaves
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def _inputs(loaded: LoadedModel, batch: int, device: torch.device, dtype: str) -> tuple:
    args, kwargs, targets = loaded.example(batch, device)
    return _cast(args, torch_dtype(dtype)), _cast(kwargs, torch_dtype(dtype)), targets


def _step(loaded: LoadedModel, recorder: _Recorder,
          inputs: tuple) -> tuple[list[float], list[float], float]:
    """One training step: each layer's forward and backward seconds, and the step's."""
    args, kwargs, targets = inputs
    clock, count = recorder.clock, recorder.count
    recorder.forward.clear()
    recorder.backward.clear()
    start = clock.mark()
    loss = _loss(loaded, loaded.module(*args, **kwargs), targets)
    middle = clock.mark()
    with warnings.catch_warnings():  # the embedding's inputs (token ids) need no gradient
        warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
        loss.backward()
    end = clock.mark()
    return (split_pass(recorder.forward, count, start, middle, clock, backward=False),
            split_pass(recorder.backward, count, middle, end, clock, backward=True),
            clock.seconds(start, end))


def profile_layers(model: str, *, seq_len: int | None, dtype: str, device: torch.device,
                   quick: bool, tick: Callable[[str], None]) -> dict:
    """Forward and backward seconds of every traced layer of `model` at each micro-batch
    size, from the fastest of the timed steps, and that step's time: other work on a
    shared machine only ever adds time, and it comes in bursts that can cover several
    steps, so the fastest step is the one that measures the model. Each step entry
    keeps every timed step's seconds and their spread (`timing.Samples`), which says
    whether the machine was busy. Calls `tick` once before tracing and once before each
    micro-batch."""
    dtype = canonical_dtype(dtype)
    spec = model_spec(model)
    tick(f"{device}: tracing {spec.describe()}")
    meta = load_model(spec, seq_len=seq_len)
    if quick and seq_len is None and meta.seq_len and meta.seq_len > QUICK_SEQ_LEN:
        meta = load_model(spec, seq_len=QUICK_SEQ_LEN)
    layers = trace_loaded(meta, batch=1, dtype=dtype).layers
    loaded = load_model(spec, seq_len=meta.seq_len, device=device)
    loaded.module.to(torch_dtype(dtype)).train()
    recorder = _Recorder(loaded.module, layers, Clock(device))
    timings, steps = [], []
    try:
        with tf32(dtype == "tf32") if device.type == "cuda" else contextlib.nullcontext():
            for batch in micro_batches(quick):
                tick(f"{device}: layers of {spec.describe()}, micro-batch {batch}")
                inputs = _inputs(loaded, batch, device, dtype)
                _step(loaded, recorder, inputs)  # warm-up: allocations at this shape
                timed = [_step(loaded, recorder, inputs) for _ in range(_REPEATS[quick])]
                fwd, bwd, seconds = min(timed, key=lambda r: r[2])
                timings += [{"layer": layer.name, "signature": layer.signature,
                             "micro_batch": batch, "fwd": fwd[i], "bwd": bwd[i]}
                            for i, layer in enumerate(layers)]
                steps.append({"micro_batch": batch, "seconds": seconds,
                              **Samples(tuple(r[2] for r in timed)).record()})
    finally:
        recorder.remove()
    return {"model": spec.describe(), "seq_len": meta.seq_len, "dtype": dtype,
            "timings": timings, "steps": steps}
