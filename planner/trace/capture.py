"""Run a model once on meta tensors and record every op: its costs, the tensors it
creates, reads and saves for backward, and the parameters it touches.

The graph comes from torch.fx (symbolic tracing) when the model allows it, from
torch.export (non-strict) otherwise; either way an fx Interpreter replays it on
the meta device under a dispatch mode that sees each aten op, and autograd's
saved-tensor hooks report what backward would keep. No real memory is used.

Attention (`scaled_dot_product_attention`) is recorded as the fused kernel a GPU
runs: FLOPs of the math, but the bytes moved and saved of flash attention
(q, k, v, output and the log-sum-exp), not the seq x seq score matrix that the
meta device's reference decomposition materialises.
"""

from __future__ import annotations

import io
import itertools
import logging
import operator
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from planner.errors import PlannerError
from planner.trace.blocks import block_units
from planner.trace.fxtrace import fx_graph
from planner.trace.ops import (
    OpCost,
    attention_backward_flops,
    backward_flops,
    classify,
    gemm_shape,
    nbytes,
    op_flops,
    tensors,
)
from planner.trace.reuse import Reference, Run, copy_records, find_runs, value_meta
from planner.types import OpClass

_ATTENTION_TARGETS = ("scaled_dot_product_attention",)
_ADD_TARGETS = {operator.add, operator.iadd, torch.add, "add", "add_",
                torch.ops.aten.add.Tensor}


@dataclass
class NodeRecord:
    """One graph node after replay (mutable scratch, internal to tracing)."""

    name: str
    op: str  # fx node kind: placeholder, get_attr, call_function, call_module, ...
    target: str
    module: str  # innermost module path, "" for the root
    module_type: str
    inputs: list[str]
    costs: list[OpCost] = field(default_factory=list)
    saved: dict[int, int] = field(default_factory=dict)  # storage key -> bytes
    stats_saved: int = 0  # bytes fused kernels keep besides tensors (lse, rstd)
    in_keys: set[int] = field(default_factory=set)  # data storages read
    out_keys: dict[int, int] = field(default_factory=dict)  # data storages created -> bytes
    params: set[str] = field(default_factory=set)
    fixed: bool = False  # output depends on parameters/constants only
    is_add: bool = False
    out_bytes: int = 0  # bytes of all output tensors, views included
    shape: tuple[int, ...] | None = None
    dtype: str | None = None

    @property
    def op_class(self) -> OpClass:
        if any(t in self.target for t in _ATTENTION_TARGETS):
            return OpClass.ATTENTION
        if not self.costs:
            return OpClass.OTHER if self.op != "call_function" else OpClass.RESHAPE
        by_flops = max(self.costs, key=lambda c: c.flops)
        if by_flops.flops > 0:
            return by_flops.op_class
        classes = {c.op_class for c in self.costs} - {OpClass.RESHAPE}
        if not classes:
            return OpClass.RESHAPE
        return max(self.costs, key=lambda c: c.bytes).op_class


@dataclass
class Capture:
    records: list[NodeRecord]
    params: dict[str, tuple[int, int]]  # fqn -> (numel, bytes)
    buffers: dict[str, int]  # fqn -> bytes
    modules: dict[str, nn.Module]
    tracer: str
    batch: int


@contextmanager
def _module_stack(model: nn.Module) -> Iterator[list[str]]:
    """The names of the modules whose forward is running (for error messages)."""
    names = {id(m): n for n, m in model.named_modules()}
    stack: list[str] = []

    def pre(m: nn.Module, _args: Any) -> None:
        stack.append(names.get(id(m), type(m).__name__))

    def post(m: nn.Module, _args: Any, _out: Any) -> None:
        if stack:
            stack.pop()

    handles = [nn.modules.module.register_module_forward_pre_hook(pre),
               nn.modules.module.register_module_forward_hook(post)]
    try:
        yield stack
    finally:
        for h in handles:
            h.remove()


@contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """torch.export logs warnings about symbolic shapes that mean nothing to users."""
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _export_graph(module: nn.Module, args: tuple, kwargs: dict
                  ) -> tuple[nn.Module, torch.fx.Graph]:
    printed = io.StringIO()  # a failed export prints its partial graph to stderr
    with _module_stack(module) as stack, _quiet_torch_logs(), redirect_stderr(printed):
        try:
            program = torch.export.export(module, args, kwargs, strict=False)
        except Exception as exc:
            exc.add_note(f"planner: in module {stack[-1] if stack else '<root>'!r}")
            if printed.getvalue().strip():  # for --debug's traceback
                exc.add_note(f"torch.export printed:\n{printed.getvalue().strip()}")
            raise
    sys.stderr.write(printed.getvalue())  # what a successful export prints still shows
    gm = program.module()
    return gm, gm.graph


def _where(exc: BaseException) -> str:
    notes = [n for n in getattr(exc, "__notes__", []) if n.startswith("planner: in module")]
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    where = notes[-1].removeprefix("planner: ") if notes else "somewhere in the model"
    return f"{where}: {type(exc).__name__}: {first_line[:300]}"


@dataclass(frozen=True)
class Traced:
    """An fx graph and the module whose attributes its nodes refer to."""

    root: nn.Module
    graph: torch.fx.Graph
    tracer: str  # "fx" or "export"


def acquire_graph(module: nn.Module, args: tuple, kwargs: dict, label: str) -> Traced:
    """An fx graph of the model: symbolic tracing first, torch.export as the fallback."""
    try:
        units = set(block_units(dict(module.named_modules())))
        return Traced(*fx_graph(module, units), "fx")
    except Exception as fx_exc:
        try:
            return Traced(*_export_graph(module, args, kwargs), "export")
        except Exception as export_exc:
            raise PlannerError(
                "trace-failed",
                f"Could not trace model {label}. torch.fx failed {_where(fx_exc)}. "
                f"torch.export failed {_where(export_exc)}.",
                ["make that module's forward free of Python control flow on tensor values "
                 "(if/while on a tensor, .item(), data-dependent shapes)",
                 "mark the module as a leaf (class attribute `fx_leaf = True`) if it runs "
                 "on meta tensors",
                 "run again with --debug to see the full traceback"]) from export_exc


def _storage_key(t: torch.Tensor) -> int:
    return id(t._base if t._base is not None else t)


def _storage_bytes(t: torch.Tensor) -> int:
    return nbytes(t._base if t._base is not None else t)


def _module_of(node: torch.fx.Node) -> tuple[str, str]:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    key, value = list(stack.items())[-1]
    if isinstance(value, tuple):  # torch.export: key -> (path, type)
        path, typ = value
    else:  # torch.fx: path -> type
        path, typ = key, value
    name = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
    return path, name.rsplit(".", 1)[-1]


def _target_name(node: torch.fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    return getattr(t, "__name__", None) or str(t)


class _Replay(TorchDispatchMode):
    """Sees every aten op of the replay and charges it to the current node."""

    def __init__(self, fixed: dict[int, frozenset[str]], keep: list) -> None:
        super().__init__()
        self.fixed = fixed
        self.keep = keep
        self.current: NodeRecord | None = None
        self.inside = {"moe": 0, "experts": 0}  # calls under way (`_expert_hooks`)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = tensors((args, kwargs))
        fixed_inputs = [t for t in inputs if id(t) in self.fixed]
        outputs = tensors(out)
        if len(fixed_inputs) == len(inputs):  # parameter/constant-only: fold away
            sources = frozenset().union(*(self.fixed[id(t)] for t in fixed_inputs))
            for t in outputs:
                self.fixed[id(t)] = sources
                self.keep.append(t)
            return out
        record = self.current
        if record is None:
            return out
        for t in fixed_inputs:
            record.params |= self.fixed[id(t)]
        op_class = classify(func)
        flops = op_flops(func, args, kwargs, out)
        data_bytes = fixed_bytes = 0.0
        if op_class is not OpClass.RESHAPE:
            data_bytes = (sum(nbytes(t) for t in inputs if id(t) not in self.fixed)
                          + sum(nbytes(t) for t in outputs))
            fixed_bytes = sum(nbytes(t) for t in fixed_inputs)
        record.costs.append(OpCost(
            op_class, flops, backward_flops(op_class, func, args, flops), data_bytes,
            fixed_bytes, gemm_shape(func, args, out) if flops else None,
            whole=self.inside["moe"] > 0 and not self.inside["experts"]))
        return out


def _expert_hooks(root: nn.Module, mode: _Replay) -> list:
    """Hooks that tell `mode` when a mixture-of-experts block, and its experts, run:
    tensor parallelism splits the experts along their width, and every rank runs the
    router and the dispatch around them whole (`planner.runtime.parallel`)."""
    from planner.models.transformer import Experts, MoE

    def count(kind: str, step: int) -> Callable:
        def hook(*_: Any) -> None:
            mode.inside[kind] += step
        return hook

    handles = []
    for module in root.modules():
        kind = "moe" if isinstance(module, MoE) else "experts" if isinstance(
            module, Experts) else None
        if kind:
            handles += [module.register_forward_pre_hook(count(kind, 1)),
                        module.register_forward_hook(count(kind, -1))]
    return handles


@dataclass
class _State:
    fixed: dict[int, frozenset[str]] = field(default_factory=dict)
    keep: list = field(default_factory=list)
    saved_keys: set[int] = field(default_factory=set)
    known_keys: set[int] = field(default_factory=set)
    fresh: itertools.count = field(default_factory=lambda: itertools.count(-1, -1))


class _Interpreter(torch.fx.Interpreter):
    def __init__(self, traced: Traced, mode: _Replay, state: _State,
                 runs: dict[str, Run]) -> None:
        super().__init__(traced.root, graph=traced.graph)
        self.mode, self.state, self.runs = mode, state, runs
        self.records: list[NodeRecord] = []
        self.references: dict[tuple[str, str], Reference] = {}
        self.pending: dict[str, Any] = {}  # values of nodes of a copied run
        self.building: tuple[Run, tuple[str, str], Reference, int] | None = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        record = self.mode.current
        is_fixed = id(t) in self.state.fixed or (
            t._base is not None and id(t._base) in self.state.fixed)
        key = _storage_key(t)
        if record is not None and not is_fixed and key not in self.state.saved_keys:
            self.state.saved_keys.add(key)
            record.saved[key] = _storage_bytes(t)
            self.state.keep.append(t)
        return t

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.name in self.pending:
            return self.pending.pop(n.name)
        run = self.runs.get(n.name)
        if run is not None and self._start_run(run):
            return self.pending.pop(n.name)
        out = self._run_one(n)
        if self.building is not None:
            self._extend_reference(n, out)
        return out

    def _start_run(self, run: Run) -> bool:
        """Copy the run from an identical one if there is one (True), else record it."""
        values = [self.env[e] for e in run.externals]
        key = (run.fingerprint, repr(value_meta(values, self.state.fixed)))
        ref = self.references.get(key)
        if ref is None:
            external_keys = [[_storage_key(t) for t in tensors(v)] for v in values]
            self.building = (run, key, Reference(run.unit, [], external_keys), len(self.records))
            return False
        records, escaping = copy_records(ref, run, values, self.state.fresh, _storage_key,
                                         self.state.fixed, self.state.keep)
        for record in records:
            self.state.known_keys.update(record.out_keys)
            for k in list(record.saved):
                if k in self.state.saved_keys:
                    del record.saved[k]
                self.state.saved_keys.add(k)
        self.records.extend(records)
        self.pending.update({node.name: escaping.get(node.name) for node in run.nodes})
        return True

    def _extend_reference(self, n: torch.fx.Node, out: Any) -> None:
        run, key, ref, start = self.building
        if n.name in run.escaping:
            ref.outputs[n.name] = (value_meta(out, self.state.fixed),
                                   [_storage_key(t) for t in tensors(out)])
        if n is run.nodes[-1]:
            ref.records = self.records[start:]
            self.references[key] = ref
            self.building = None

    def _run_one(self, n: torch.fx.Node) -> Any:
        module, module_type = _module_of(n)
        if n.op == "call_module":
            module, module_type = str(n.target), type(self.fetch_attr(str(n.target))).__name__
        record = NodeRecord(name=n.name, op=n.op, target=_target_name(n), module=module,
                            module_type=module_type,
                            inputs=[a.name for a in n.all_input_nodes],
                            is_add=n.op in ("call_function", "call_method")
                            and n.target in _ADD_TARGETS)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        record.in_keys = {_storage_key(t) for t in tensors((args, kwargs))}
        self.mode.current = record
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            out = getattr(self, n.op)(n.target, args, kwargs)
        self.mode.current = None
        if record.op_class is OpClass.ATTENTION:
            self._as_fused_attention(record, args, kwargs, out)
        elif n.op == "call_module" and isinstance(self.fetch_attr(str(n.target)), nn.RMSNorm):
            self._as_fused_rms_norm(record, args[0], out)
        self._finish(record, out)
        self.records.append(record)
        return out

    def _as_fused_attention(self, record: NodeRecord, args: tuple, kwargs: dict,
                            out: Any) -> None:
        """Replace the reference decomposition's costs with a flash kernel's."""
        flops = sum(c.flops for c in record.costs)
        q, k, v = args[:3]
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        data = [t for t in (q, k, v, mask) if isinstance(t, torch.Tensor)
                and id(t) not in self.state.fixed]
        outputs = tensors(out)
        moved = sum(nbytes(t) for t in data) + sum(nbytes(t) for t in outputs)
        lse = q.numel() // q.shape[-1] * 4  # fp32 log-sum-exp per query row
        record.costs = [OpCost(OpClass.ATTENTION, flops, attention_backward_flops(flops),
                               moved, 0.0, None)]
        self._replace_saved(record, [*data[:3], *outputs])
        record.stats_saved = lse

    def _replace_saved(self, record: NodeRecord, keep: list[torch.Tensor]) -> None:
        for key in record.saved:
            self.state.saved_keys.discard(key)
        record.saved = {}
        for t in keep:
            key = _storage_key(t)
            if key not in self.state.saved_keys and id(t) not in self.state.fixed:
                self.state.saved_keys.add(key)
                record.saved[key] = _storage_bytes(t)

    def _as_fused_rms_norm(self, record: NodeRecord, x: torch.Tensor, out: torch.Tensor) -> None:
        """What CUDA's fused RMS norm keeps: its input and one fp32 rstd per row
        (the meta device decomposes it and would save fp32 copies)."""
        weight_bytes = sum(c.bytes_fixed for c in record.costs)
        record.costs = [OpCost(OpClass.NORM, 0.0, 0.0, nbytes(x) + nbytes(out), weight_bytes,
                               None)]
        self._replace_saved(record, [x])
        record.stats_saved = x.numel() // x.shape[-1] * 4

    def _finish(self, record: NodeRecord, out: Any) -> None:
        if "Norm" in record.module_type:
            record.costs = [c if c.op_class not in (OpClass.ELEMENTWISE, OpClass.REDUCTION)
                            else OpCost(OpClass.NORM, c.flops, c.bwd_flops, c.bytes,
                                        c.bytes_fixed, c.gemm) for c in record.costs]
        outputs = tensors(out)
        if outputs:
            record.shape, record.dtype = tuple(outputs[0].shape), str(outputs[0].dtype)
            record.out_bytes = sum(nbytes(t) for t in outputs)
        fixed = self.state.fixed
        record.fixed = bool(outputs) and all(
            id(t) in fixed or (t._base is not None and id(t._base) in fixed) for t in outputs)
        for t in outputs:
            key = _storage_key(t)
            if key in self.state.known_keys:
                continue
            self.state.known_keys.add(key)
            self.state.keep.append(t)
            if id(t) not in fixed and not (t._base is not None and id(t._base) in fixed):
                record.out_keys[key] = _storage_bytes(t)


def replay(model: nn.Module, traced: Traced, args: tuple,
           kwargs: dict, loss: Callable[[Any], torch.Tensor] | None, batch: int,
           reuse: bool = True) -> Capture:
    """Run the graph on meta inputs and record every node (plus the loss, if given).
    With `reuse`, identical blocks are replayed once and copied (see reuse.py)."""
    state = _State()
    root = traced.root
    params = {n: (p.numel(), nbytes(p)) for n, p in root.named_parameters()}
    buffers = {n: nbytes(b) for n, b in root.named_buffers()}
    for name, tensor in [*root.named_parameters(), *root.named_buffers()]:
        state.fixed[id(tensor)] = frozenset([name])
    mode = _Replay(state.fixed, state.keep)
    runs = (find_runs(traced.graph, dict(model.named_modules()), lambda n: _module_of(n)[0])
            if reuse else {})
    interp = _Interpreter(traced, mode, state, runs)
    flat_args = torch.utils._pytree.tree_leaves((args, kwargs))
    hooks = _expert_hooks(root, mode)
    try:
        with mode:
            out = interp.run(*flat_args)
            if loss is not None:
                record = NodeRecord(name="loss", op="call_function", target="loss", module="",
                                    module_type="", inputs=[interp.records[-1].name])
                record.in_keys = {_storage_key(t) for t in tensors(out)}
                mode.current = record
                with torch.autograd.graph.saved_tensors_hooks(interp._pack, lambda t: t):
                    value = loss(out)
                mode.current = None
                interp._finish(record, value)
                interp.records.append(record)
    except PlannerError:
        raise
    except Exception as exc:
        last = interp.records[-1] if interp.records else None
        where = f"after node {last.name!r} (module {last.module or '<root>'!r})" if last else ""
        raise PlannerError(
            "trace-failed",
            f"The {traced.tracer} graph of the model failed to run on meta tensors {where}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}",
            ["use smaller shape options (--hidden, --ffn, --seq-len): a tensor is larger "
             "than PyTorch can size" if "overflow" in str(exc) else
             "check that every op in that module has a meta implementation (custom C++ "
             "or NumPy code does not)", "run again with --debug to see the traceback"]) from exc
    finally:
        for hook in hooks:
            hook.remove()
    return Capture(records=interp.records, params=params, buffers=buffers,
                   modules=dict(model.named_modules()),
                   tracer=traced.tracer, batch=batch)
