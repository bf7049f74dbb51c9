"""Build this rank's part of the model: on the meta device first, then only the
stage's modules materialized with values every rank (and a single-process run)
agrees on.

The runtime runs models whose layers form a chain: each layer is one module
(the plan's `modules`), the first takes the model's inputs, each next one takes
the previous one's output, and the model returns the last one's output, with no
work in between. One forward on the meta device checks this, and records which
parameters each layer reads, so a layer that reads a parameter owned elsewhere
(a head tied to the token embedding) gets that module too; the gradient of such
a shared parameter is summed over every stage holding it.

Initialization is deterministic per module: each module that owns parameters is
initialized on the CPU with its own `reset_parameters()` under a seed derived
from (seed, module path), so any subset of modules gets the same values as the
whole model built the same way (`materialize`, used by the single-process
reference too). Parameters of modules without `reset_parameters()` get zeros
(names ending in "bias"), ones (other 1-D weights) or N(0, 0.02).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from planner.errors import PlannerError, closest
from planner.models import LoadedModel, load_model
from planner.types import Plan, Recompute, StagePlan, TrainingSpec


@dataclass(frozen=True)
class TensorParallelOptions:
    """What a tensor-parallel group splits beyond Megatron's block split, from the plan's
    training (`TrainingSpec`): `sequence`, the residual stream of transformer blocks over
    the sequence (sequence parallelism); `vocab`, a transformer's token table, LM head
    and loss over the vocabulary. `build_stage` sets them on each layer module of a
    stage wider than one device (attribute `TP_OPTIONS`), where
    `parallel.apply_tensor_parallel` reads them."""

    sequence: bool = False
    vocab: bool = False


TP_OPTIONS = "planner_tensor_parallel"  # the layer modules' attribute holding their options


@dataclass(frozen=True)
class ModelInfo:
    """The model on meta, its layers' modules and what each layer reads."""

    loaded: LoadedModel
    layer_modules: tuple[str, ...]  # one module path per layer
    uses: tuple[frozenset[str], ...]  # parameter names each layer reads
    owner: dict[str, str]  # parameter name -> path of the module that owns it
    vocab: dict[int, int]  # model input (by position) -> rows of the table it indexes
    classes: int | None  # classes the loss takes integer targets from (`loss_classes`)
    training: TrainingSpec | None = None  # the plan's (its tensor-parallel options)

    @property
    def module(self) -> nn.Module:
        return self.loaded.module


def layer_modules(plan: Plan) -> tuple[str, ...]:
    """The module path of each layer, from the plan's stages."""
    by_layer: dict[int, str] = {}
    for p in plan.pipelines:
        for s in p.stages:
            count = sum(b - a for a, b in s.chunks)
            if len(s.modules) != count:
                raise PlannerError(
                    "unsupported-model", f"Pipeline {p.index} stage {s.index} holds {count} "
                    f"layers built from {len(s.modules)} modules ({', '.join(s.modules)}); the "
                    "runtime runs models whose every layer is exactly one module, called in "
                    "a chain (embedding, blocks, head).",
                    ["use a model whose forward calls its layers one after the other",
                     "T5-style encoder-decoder models cannot run yet"])
            names = iter(s.modules)
            for a, b in s.chunks:
                for layer in range(a, b):
                    path = next(names)
                    if by_layer.setdefault(layer, path) != path:
                        raise PlannerError(
                            "bad-plan", f"Layer {layer} is module {by_layer[layer]!r} in one "
                            f"pipeline and {path!r} in pipeline {p.index}.",
                            ["regenerate the plan with `planner solve`"])
    return tuple(by_layer[i] for i in range(len(by_layer)))


def check_modules(plan: Plan, model: nn.Module, source: str = "") -> None:
    """An error naming the pipeline, stage and module where a stage's `modules` name one
    that `model` does not have (a hand-edited plan, or one for another model), naming
    `source` (the plan file) if given."""
    for p in plan.pipelines:
        for s in p.stages:
            for path in s.modules:
                try:
                    model.get_submodule(path)
                except AttributeError:
                    near = closest(path, [name for name, _ in model.named_modules() if name])
                    hint = f" Did you mean {', '.join(repr(n) for n in near)}?" if near else ""
                    raise PlannerError(
                        "bad-plan", (f"{source}: " if source else "")
                        + f"Pipeline {p.index} stage {s.index} names module {path!r}, which "
                        f"model {plan.model.describe()} does not have.{hint}",
                        ["regenerate the plan for this model with `planner solve`"]) from None


class _ParamReads(TorchFunctionMode):
    """Records the parameters torch functions receive while a layer runs, and the rows of
    the embedding tables the model's `inputs` index unchanged."""

    def __init__(self, names: dict[int, str], uses: list[set[str]]) -> None:
        super().__init__()
        self.names, self.uses = names, uses
        self.current: int | None = None
        self.inputs: tuple = ()
        self.vocab: dict[int, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is nn.functional.embedding and args:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            for i, given in enumerate(self.inputs):
                if args[0] is given and isinstance(weight, torch.Tensor):
                    self.vocab[i] = min(self.vocab.get(i, weight.shape[0]), weight.shape[0])
        if self.current is not None:
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, nn.Parameter) and id(leaf) in self.names:
                    self.uses[self.current].add(self.names[id(leaf)])
        return func(*args, **kwargs)


def check_options(plan: Plan) -> None:
    """A PlannerError for a plan whose tensor-parallel options the runtime cannot run:
    sequence and vocabulary parallelism split the tensors a pipeline's stages pass on
    (a sequence slice per tp rank, logits over a vocabulary slice), so every stage of
    such a pipeline needs the same degree (a wider stage's followers mirror whole
    tensors: `follow.py`)."""
    given = [name for name, on in (("sequence_parallel", plan.training.sequence_parallel),
                                    ("vocab_parallel", plan.training.vocab_parallel)) if on]
    for p in plan.pipelines if given else ():
        tps = sorted({s.tp for s in p.stages})
        if len(tps) > 1:
            raise PlannerError(
                "unsupported-plan", f"Pipeline {p.index} runs stages of tensor-parallel "
                f"degrees {tps} with training.{given[0]}; the runtime runs sequence and "
                "vocabulary parallelism on pipelines of one degree.",
                ["solve with a fixed --tp (or without --tp-per-class)",
                 f"or without --{given[0].replace('_', '-')}"])


def inspect_model(plan: Plan) -> ModelInfo:
    """Build the plan's model on meta and check that its layers form a chain (and that
    the runtime runs the plan's tensor-parallel options: `check_options`)."""
    check_options(plan)
    loaded = load_model(plan.model, seq_len=plan.training.seq_len, device="meta")
    if loaded.loss is None:
        raise PlannerError("unsupported-model", f"Model {plan.model.describe()} has no "
                           "training loss; the runtime trains with the model's loss.",
                           ["give the module a loss(output, targets) method"])
    model = loaded.module
    check_modules(plan, model)
    paths = layer_modules(plan)
    names: dict[int, str] = {}
    owner: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
        owner.setdefault(names[id(param)], name.rpartition(".")[0])
    uses: list[set[str]] = [set() for _ in paths]
    calls: list[tuple[int, tuple, object]] = []
    mode = _ParamReads(names, uses)
    handles = []
    for index, path in enumerate(paths):
        sub = model.get_submodule(path)

        def pre(_m: nn.Module, args: tuple, index: int = index) -> None:
            mode.current = index
            calls.append((index, args, None))

        def post(_m: nn.Module, _args: tuple, out: object, index: int = index) -> None:
            mode.current = None
            calls.append((index, (), out))

        handles += [sub.register_forward_pre_hook(pre), sub.register_forward_hook(post)]
    args, kwargs, targets = loaded.example(1, "meta")
    mode.inputs = tuple(args)
    try:
        with torch.no_grad(), mode:
            output = model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    _check_chain(plan, paths, calls, args, kwargs, output)
    if plan.training.vocab_parallel:  # (logits split over the vocabulary: `parallel.py`)
        from planner.runtime.parallel import ShardedLogitsLoss

        loaded = dataclasses.replace(loaded, loss=ShardedLogitsLoss(loaded.loss))
    return ModelInfo(loaded=loaded, layer_modules=paths,
                     uses=tuple(frozenset(u) for u in uses), owner=owner,
                     vocab=dict(mode.vocab), classes=loss_classes(loaded, output, targets),
                     training=plan.training)


def loss_classes(loaded: LoadedModel, output: object, targets: object) -> int | None:
    """The number of classes the model's loss takes integer targets from: the last
    dimension of the model's output (`output`, for the example's `targets`), since every
    loss of the zoo and transformers models is a cross-entropy over it. None where the
    targets are not integers (nothing to count) or the loss is a user factory's own (its
    targets may index something else, so no range can be assumed)."""
    if loaded.spec.source == "factory" or not isinstance(output, torch.Tensor):
        return None
    if not isinstance(targets, torch.Tensor) or targets.dtype.is_floating_point:
        return None
    return output.shape[-1] if output.dim() else None


def _check_chain(plan: Plan, paths: Sequence[str], calls: list, args: tuple, kwargs: dict,
                 output: object) -> None:
    def fail(detail: str) -> PlannerError:
        return PlannerError(
            "unsupported-model", f"Model {plan.model.describe()}: {detail}. The runtime runs "
            "models whose layers form a chain (the first layer takes the model's inputs, each "
            "next layer the previous one's output, and the model returns the last one's), "
            "like the zoo's GPT, OPT, Llama, BERT, Mixtral, ViT, ResNet and MLP.",
            ["write the model's forward as a loop over its layers",
             "T5-style encoder-decoder models cannot run yet"])

    entries = [(i, a) for i, a, out in calls if out is None]
    exits = [(i, out) for i, a, out in calls if out is not None]
    order = [i for i, _ in entries]
    if order != list(range(len(paths))):
        raise fail(f"its layers run in the order {order[:8]}, not once each in layer order")
    if kwargs:
        raise fail("its forward takes keyword inputs")
    if len(entries[0][1]) != len(args) or any(a is not b for a, b in zip(entries[0][1], args,
                                                                          strict=True)):
        raise fail(f"layer 0 ({paths[0]}) does not take the model's inputs unchanged")
    for (i, got), (_, previous) in zip(entries[1:], exits[:-1], strict=True):
        if len(got) != 1 or got[0] is not previous:
            raise fail(f"layer {i} ({paths[i]}) does not take layer {i - 1}'s output "
                       "unchanged")
    if output is not exits[-1][1]:
        raise fail(f"the model does not return its last layer's ({paths[-1]}) output")
    if not isinstance(output, torch.Tensor) or any(
            not isinstance(out, torch.Tensor) for _, out in exits):
        raise fail("a layer returns something other than one tensor")


def stage_paths(info: ModelInfo, chunks: Iterable[tuple[int, int]]) -> tuple[tuple[str, ...],
                                                                           tuple[str, ...]]:
    """(the layer modules of these chunks in order, modules of parameters they read but
    do not own)."""
    units = tuple(info.layer_modules[i] for a, b in chunks for i in range(a, b))
    layers = [i for a, b in chunks for i in range(a, b)]
    extras = sorted({info.owner[name] for i in layers for name in info.uses[i]
                     if not _under(info.owner[name], units)})
    return units, tuple(extras)


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r + ".") or r == "" for r in roots)


def prune(model: nn.Module, paths: Iterable[str]) -> nn.Module:
    """A module tree holding only `paths` (and their submodules) of `model`, under the
    same names, so parameter names match the whole model's."""
    root = nn.Module()
    kept: list[str] = []
    for path in sorted(set(paths), key=lambda p: (p.count("."), p)):
        if _under(path, kept):
            continue
        kept.append(path)
        parent = root
        *parents, leaf = path.split(".")
        for part in parents:
            if part not in parent._modules:
                parent.add_module(part, nn.Module())
            parent = parent._modules[part]
        parent.add_module(leaf, model.get_submodule(path))
    return root


def _seed(seed: int, path: str) -> int:
    return zlib.crc32(f"{seed}:{path}".encode())


def materialize(root: nn.Module, seed: int) -> nn.Module:
    """Allocate `root` (on meta) on the CPU and initialize each module deterministically
    from (seed, its path); see the module docstring."""
    root.to_empty(device="cpu")
    for path, module in root.named_modules():
        params = dict(module.named_parameters(recurse=False))
        buffers = dict(module.named_buffers(recurse=False))
        if not params and not buffers:
            continue
        reset = getattr(module, "reset_parameters", None)
        if buffers and not callable(reset):
            raise PlannerError(
                "unsupported-model", f"Module {path or '(root)'} ({type(module).__name__}) has "
                f"buffers ({', '.join(buffers)}) that cannot be rebuilt after building on the "
                "meta device.", ["give the module a reset_parameters() method that sets them"])
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(_seed(seed, path))
            if callable(reset):
                reset()
                continue
            for name, param in params.items():
                if name.endswith("bias"):
                    param.zero_()
                elif param.dim() == 1:
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, 0.02)
    return root


# --- recompute --------------------------------------------------------------------------

class _RecomputeAttention(TorchFunctionMode):
    """Runs every fused attention call (`scaled_dot_product_attention`: QK^T, softmax,
    dropout and attention over V in one kernel) under torch.utils.checkpoint: its inputs
    (Q, K, V) are kept, its output and statistics made again in backward. The attention
    core, as the trace records it (`Kernel.core`)."""

    def __torch_function__(self, func: object, types: object, args: tuple = (),
                           kwargs: dict | None = None) -> object:
        from torch.utils.checkpoint import checkpoint

        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention and torch.is_grad_enabled():
            return checkpoint(func, *args, use_reentrant=False, **kwargs)
        return func(*args, **kwargs)


def apply_recompute(unit: nn.Module, policy: Recompute) -> None:
    """Recompute the unit's activations in backward: all of them (full: only the unit's
    input is kept, torch.utils.checkpoint) or the attention core's (selective,
    Megatron's: each fused attention call runs again, everything else is kept)."""
    if policy is Recompute.NONE:
        return
    from torch.utils.checkpoint import checkpoint

    forward = unit.forward

    def recomputed(*args: object, **kwargs: object) -> object:
        if policy is Recompute.SELECTIVE:
            with _RecomputeAttention():
                return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    unit.forward = recomputed


class ChunkModule(nn.Module):
    """One pipeline stage chunk: its layer modules called one after the other (what
    torch.distributed.pipelining runs); `autocast` is the training dtype for bf16/fp16."""

    def __init__(self, units: Sequence[tuple[str, nn.Module]],
                 autocast: tuple[str, torch.dtype] | None = None) -> None:
        super().__init__()
        self.paths = [path for path, _ in units]
        for i, (_, module) in enumerate(units):
            self.add_module(f"unit{i}", module)
        self.autocast = autocast

    def units(self) -> list[nn.Module]:
        return [self._modules[f"unit{i}"] for i in range(len(self.paths))]

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if self.autocast is None:
            return self._run(args)
        device_type, dtype = self.autocast
        with torch.autocast(device_type, dtype=dtype):
            return self._run(args)

    def _run(self, args: tuple) -> torch.Tensor:
        x = args
        out = None
        for unit in self.units():
            out = unit(*x)
            x = (out,)
        return out


@dataclass
class BuiltStage:
    """What one rank holds: `root` (every module it holds, named as in the whole model)
    and one ChunkModule per chunk of its stage."""

    root: nn.Module
    chunks: list[ChunkModule]
    units: list[list[tuple[str, nn.Module]]]  # per chunk: (path, module)
    extras: tuple[str, ...]


def build_stage(info: ModelInfo, stage: StagePlan, *, seed: int,
                autocast: tuple[str, torch.dtype] | None = None) -> BuiltStage:
    """Materialize (on the CPU) only the modules of `stage`, and its chunk modules."""
    all_units: list[str] = []
    chunk_units = []
    for chunk in stage.chunks:
        units, _ = stage_paths(info, [chunk])
        chunk_units.append(units)
        all_units += units
    _, extras = stage_paths(info, stage.chunks)
    root = prune(info.module, [*all_units, *extras])
    materialize(root, seed)
    units = [[(p, root.get_submodule(p)) for p in paths] for paths in chunk_units]
    if stage.tp > 1 and info.training is not None:
        options = TensorParallelOptions(sequence=info.training.sequence_parallel,
                                        vocab=info.training.vocab_parallel)
        for chunk in units:
            for _, unit in chunk:
                setattr(unit, TP_OPTIONS, options)
    chunks = [ChunkModule(u, autocast) for u in units]
    return BuiltStage(root=root, chunks=chunks, units=units, extras=extras)


def stage_param_names(info: ModelInfo, stage: StagePlan) -> frozenset[str]:
    """Names of the parameters a stage holds (its modules' and the shared ones it reads),
    computed on meta without materializing anything."""
    units, extras = stage_paths(info, stage.chunks)
    names = set()
    for path in (*units, *extras):
        names.update(f"{path}.{n}" if path else n
                     for n, _ in info.module.get_submodule(path).named_parameters())
    return frozenset(names)
