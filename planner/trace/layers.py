"""Coarsen recorded ops into the ordered layers a pipeline splits on.

Blocks are found from the module tree: the children of the outermost
ModuleList/Sequential/ModuleDict whose majority class repeats (transformer
layers, residual blocks; ResNet's four stages contribute all their blocks).
Ops outside every block form the embedding layer (before the first block),
the head (after the last) and glue layers (real work between two runs of
blocks, e.g. an encoder's final norm and the decoder's embedding).

Boundaries: the bytes crossing the cut after layer i are the data tensors made
at or before layer i and read after it. Model inputs (token ids, images,
targets) are available to every stage and never cross; neither do tensors
computed from parameters and constants alone (rotary tables, masks).
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from dataclasses import dataclass, field

from torch import nn

from planner.errors import PlannerError
from planner.trace.blocks import block_units, unit_of
from planner.trace.capture import Capture, NodeRecord
from planner.types import Kernel, Layer, LayerKind, OpClass

_HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads",
               "n_head", "n_heads", "n_kv_heads")
_HEAVY = (OpClass.MATMUL, OpClass.CONV, OpClass.ATTENTION)


@dataclass
class _Group:
    kind: LayerKind
    unit: str | None
    records: list[NodeRecord] = field(default_factory=list)

    def substantial(self) -> bool:
        return any(r.params or any(c.flops for c in r.costs) for r in self.records)


def group_records(capture: Capture) -> list[_Group]:
    """Records split into ordered layer groups."""
    units = block_units(capture.modules)
    unit_set = set(units)
    groups: list[_Group] = []
    pending: list[NodeRecord] = []
    seen_units: set[str] = set()
    for record in capture.records:
        unit = unit_of(record.module, unit_set)
        if record.op in ("placeholder", "output", "get_attr") or unit is None:
            pending.append(record)
            continue
        if groups and groups[-1].unit == unit:
            groups[-1].records.extend(pending)
            pending = []
            groups[-1].records.append(record)
            continue
        if unit in seen_units:
            raise PlannerError(
                "trace-failed",
                f"Block {unit!r} runs more than once, interleaved with other blocks (shared "
                f"weights?); a pipeline needs each block to run once, in order.",
                ["give each repeated use its own module", "trace a model without weight "
                 "sharing across layers"])
        seen_units.add(unit)
        if not groups:
            groups.append(_Group(LayerKind.EMBEDDING, None, pending))
        else:
            glue = _Group(LayerKind.GLUE, None, pending)
            if glue.substantial():
                groups.append(glue)
            else:
                groups[-1].records.extend(pending)
        pending = []
        groups.append(_Group(LayerKind.BLOCK, unit, [record]))
    groups.append(_Group(LayerKind.HEAD, None, pending))
    if len(groups) > 1 and not groups[-1].substantial():
        groups[-2].records.extend(groups.pop().records)
    if len(groups) > 1 and not groups[0].substantial():
        first = groups.pop(0)
        groups[0].records[:0] = first.records
    return groups


def _boundaries(groups: list[_Group]) -> tuple[list[float], float]:
    """Bytes crossing the cut after each layer; bytes of model inputs read by layer 0."""
    producer: dict[int, tuple[int, int]] = {}  # key -> (layer, bytes)
    inputs: set[int] = set()
    last_use: dict[int, int] = {}
    for i, group in enumerate(groups):
        for r in group.records:
            for key in r.in_keys:
                last_use[key] = max(last_use.get(key, i), i)
            if r.op == "placeholder":
                inputs.update(r.out_keys)
            for key, size in r.out_keys.items():
                producer.setdefault(key, (i, size))
    crossing = [0.0] * len(groups)
    for key, (made, size) in producer.items():
        if key in inputs:
            continue
        for cut in range(made, last_use.get(key, made)):
            crossing[cut] += size
    first_inputs = sum(producer[k][1] for k in inputs
                       if any(k in r.in_keys for r in groups[0].records))
    return crossing, first_inputs


def _kernels(records: list[NodeRecord], batch: int, whole: set[str], core: set[str]
             ) -> tuple[Kernel, ...]:
    """The records' costs aggregated by class and matmul shape, those every tensor-
    parallel rank computes whole apart (the cheap records in `whole`, `_stream`, and a
    mixture-of-experts block's router and dispatch, `OpCost.whole`), and those of
    attention cores (`_attention_core`) apart."""
    acc: dict[tuple, list[float]] = {}
    for r in records:
        for c in r.costs:
            gemm = (c.gemm[0] / batch, c.gemm[1], c.gemm[2]) if c.gemm else None
            replicated = c.whole or (r.name in whole and c.op_class not in _HEAVY)
            key = (c.op_class, gemm, replicated, r.name in core)
            entry = acc.setdefault(key, [0, 0.0, 0.0, 0.0, 0.0])
            entry[0] += 1
            entry[1] += c.flops / batch
            entry[2] += c.bwd_flops / batch
            entry[3] += c.bytes / batch
            entry[4] += c.bytes_fixed
    return tuple(
        Kernel(op_class=cls, count=int(v[0]), flops=v[1], bwd_flops=v[2], bytes=v[3],
               bytes_fixed=v[4], gemm=gemm, whole=replicated, core=in_core)
        for (cls, gemm, replicated, in_core), v in acc.items()
        if cls is not OpClass.RESHAPE or v[3])


def _attention_core(group: _Group) -> set[str]:
    """The group's records of fused attention kernels (scaled dot-product attention:
    QK^T, softmax, dropout and attention over V in one), the attention core Megatron's
    selective recompute runs again, as the runtime does (`runtime.stage.apply_recompute`).
    An unfused core (separate matmuls and softmax) is not one: the runtime keeps it."""
    return {r.name for r in group.records if r.op_class is OpClass.ATTENTION}


def _core_saved(group: _Group, core: set[str], producers: dict[int, NodeRecord]) -> float:
    """Bytes the attention cores of the group save for backward that selective recompute
    frees: what they save of tensors they make (their output) and their statistics
    (log-sum-exp); their inputs (Q, K, V) stay, kept for the recomputation."""
    freed = 0.0
    for r in group.records:
        if r.name in core:
            freed += r.stats_saved + sum(size for key, size in r.saved.items()
                                         if key in producers and producers[key].name in core)
    return freed


def _opaque(group: _Group, modules: dict[str, nn.Module]) -> set[str]:
    """The group's records of modules marked `fx_leaf`: one record for a whole module,
    whose ops say themselves which run whole (`OpCost.whole`: a mixture-of-experts
    block's router and dispatch), not the stream they join."""
    return {r.name for r in group.records
            if getattr(modules.get(r.module), "fx_leaf", False)}


def _stream(group: _Group, fixed_or_input: set[str]
            ) -> tuple[set[str], list[tuple[NodeRecord, list[NodeRecord]]]]:
    """Under Megatron-style tensor parallelism: the records whose outputs every rank of
    the group holds whole (the residual stream: the layer's inputs and the cheap ops on
    them, norms included, and the row-parallel outputs that join it, all-reduced), and
    each residual add with the branches it joins."""
    by_name = {r.name: r for r in group.records}
    residual: dict[str, bool] = {}
    adds = []
    for r in group.records:  # (tensors only: a view's sizes read from the stream are not)
        data_inputs = [i for i in r.inputs if i not in fixed_or_input
                       and (i not in by_name or by_name[i].out_bytes > 0)]
        from_residual = [i not in by_name or residual.get(i, False) for i in data_inputs]
        residual[r.name] = r.op_class not in _HEAVY and any(from_residual)
        if r.is_add and any(from_residual) and not all(from_residual):
            adds.append((r, [by_name[i] for i, res in zip(data_inputs, from_residual,
                                                          strict=True) if not res]))
    whole = {name for name, res in residual.items() if res}
    return whole | {b.name for _, branches in adds for b in branches}, adds


def _tp_comm_bytes(adds: list[tuple[NodeRecord, list[NodeRecord]]],
                   modules: dict[str, nn.Module]) -> float:
    """Bytes a Megatron-style tensor-parallel forward all-reduces: one output per
    residual add fed by a matmul branch (row-parallel projection; `adds` of `_stream`).
    A branch from a mixture-of-experts block all-reduces its experts' rows instead
    (`_experts`). (A vocabulary-parallel embedding's and head's traffic follows from
    their boundaries: `cost_models.tensor_parallel`.)"""
    return sum(sum(_experts(b, modules)[0] for b in branches) or add.out_bytes
               for add, branches in adds)


def _replicated_saved(group: _Group, whole: set[str], producers: dict[int, NodeRecord],
                      modules: dict[str, nn.Module]) -> float:
    """Bytes of what the layer saves for its backward that tensor parallelism keeps
    whole on every rank: tensors of the residual stream (`whole` of `_stream`; the
    layer's inputs among them, which the norms and the column-parallel projections
    after them save) and the norms' statistics. Tensors made inside an opaque module
    (a leaf) count as split, but for a mixture-of-experts block's: only its experts'
    are."""
    inside = {r.name for r in group.records}
    saved = 0.0
    for r in group.records:
        internal = 0.0
        for key, size in r.saved.items():
            made = producers.get(key)
            if made is None:
                internal += size
            elif made.name not in inside or made.name in whole:
                saved += size
        split = _experts(r, modules)[1]
        if split:  # a mixture-of-experts block: all but its experts' own stay whole
            saved += max(0.0, internal - split)
        if r.op_class is OpClass.NORM:
            saved += r.stats_saved
    return saved


def _experts(record: NodeRecord, modules: dict[str, nn.Module]) -> tuple[float, float]:
    """For the output `record` of a mixture-of-experts block, bytes of the rows its
    experts run on (every expert's capacity for the tokens) and of what its experts
    save that tensor parallelism splits (the gate and up projections' outputs, the
    activation's and the product fed to the down projection: a row each by the
    experts' width); (0, 0) for any other record."""
    from planner.models.transformer import MoE

    moe = modules.get(record.module)
    if not isinstance(moe, MoE) or not record.shape:
        return 0.0, 0.0
    tokens = math.prod(record.shape[:-1])
    per_value = record.out_bytes / (tokens * record.shape[-1])
    rows = moe.num_experts * moe.capacity(tokens)
    return (rows * record.shape[-1] * per_value,
            4 * rows * moe.experts.w_up.shape[-1] * per_value)


def _tp_sharded(unit: nn.Module | None) -> bool:
    """Whether the runtime shards this layer's unit over a tensor-parallel group
    (`planner.runtime.parallel.apply_tensor_parallel`): zoo transformer blocks (their
    experts too), MLP blocks and modules with a `tensor_parallel_plan`; everything
    else is replicated."""
    from planner.models.mlp import MLPBlock
    from planner.models.transformer import Block

    return (callable(getattr(unit, "tensor_parallel_plan", None))
            or isinstance(unit, MLPBlock | Block))


def _gathered(unit: nn.Module | None) -> bool:
    """Whether the runtime gathers the output of this layer's column-parallel matmul
    (an MLP block's), so every tensor-parallel rank runs the ops after it, and holds
    what they save, whole."""
    from planner.models.mlp import MLPBlock

    return isinstance(unit, MLPBlock)


def _vocab_layer(group: _Group, modules: dict[str, nn.Module]) -> bool:
    """Whether the group is a zoo transformer's embedding or LM head (its loss
    included), which vocabulary parallelism splits over the vocabulary."""
    from planner.models.transformer import Embedding, Head

    return group.kind in (LayerKind.EMBEDDING, LayerKind.HEAD) and any(
        isinstance(modules.get(root), Embedding | Head)
        for root in _module_roots(group.records, modules))


def _sequence_layer(unit: nn.Module | None, vocab: bool) -> bool:
    """Whether sequence parallelism can split the layer's residual stream: a zoo
    transformer block, or a transformer's embedding or head (where vocabulary
    parallelism splits them)."""
    from planner.models.transformer import Block

    return vocab or isinstance(unit, Block)


def _tp_divisor(group: _Group, capture: Capture, vocab_sizes: set[int]) -> int:
    from planner.models.transformer import MoE

    divisor = 0
    modules = {r.module for r in group.records}
    for path in modules:
        module = capture.modules.get(path)
        for owner in (module, getattr(module, "config", None)):
            for attr in _HEAD_ATTRS:
                value = getattr(owner, attr, None)
                if isinstance(value, int) and value > 0:
                    divisor = math.gcd(divisor, value)
    for r in group.records:
        module = capture.modules.get(r.module)
        if isinstance(module, MoE):  # its experts split along their width, its router not
            divisor = math.gcd(divisor, module.experts.w_up.shape[-1])
            continue
        for c in r.costs:
            if c.gemm and c.bytes_fixed and c.gemm[2] not in vocab_sizes:
                divisor = math.gcd(divisor, c.gemm[2])
    return divisor


def _signature(group: _Group, kind: LayerKind, capture: Capture) -> str:
    unit = group.unit or ""

    def relative(path: str) -> str:
        return "" if path == unit else path.removeprefix(f"{unit}.") if unit else path

    parts: list[object] = [kind.value, type(capture.modules.get(unit)).__name__]
    for r in group.records:
        parts.append((r.op, relative(r.target), relative(r.module), r.op_class.value, r.shape,
                      r.dtype))
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:12]


def _module_roots(records: list[NodeRecord], modules: dict[str, nn.Module]) -> tuple[str, ...]:
    paths: list[str] = []
    for r in records:
        if r.module and r.module in modules and r.module not in paths:
            paths.append(r.module)
    roots = [p for p in paths if not any(p.startswith(f"{q}.") for q in paths)]
    return tuple(roots)


def build_layers(capture: Capture) -> tuple[tuple[Layer, ...], dict[str, int]]:
    """The ordered layers and, for each record name, the index of its layer."""
    groups = group_records(capture)
    batch = capture.batch
    crossing, first_inputs = _boundaries(groups)
    owner: dict[str, int] = {}
    for i, group in enumerate(groups):
        for r in group.records:
            for name in r.params:
                owner.setdefault(name, i)
    units = {g.unit: i for i, g in enumerate(groups) if g.unit}
    for name in [*capture.params, *capture.buffers]:
        if name not in owner:
            unit = unit_of(name.rpartition(".")[0], set(units))
            owner[name] = units[unit] if unit else len(groups) - 1
    fixed_or_input = {r.name for r in capture.records if r.fixed or r.op == "placeholder"}
    producers: dict[int, NodeRecord] = {}
    for r in capture.records:
        for key in r.out_keys:
            producers.setdefault(key, r)
    vocab = {m.num_embeddings for m in capture.modules.values() if isinstance(m, nn.Embedding)}
    glue_count = sum(g.kind is LayerKind.GLUE for g in groups)
    layers, node_layer, glue_seen = [], {}, 0
    for i, group in enumerate(groups):
        kind = group.kind
        if kind is LayerKind.GLUE:
            glue_seen += 1
        name = group.unit or (f"glue{glue_seen}" if kind is LayerKind.GLUE and glue_count > 1
                              else kind.value)
        saved_by_class: dict[str, float] = defaultdict(float)
        for r in group.records:
            node_layer[r.name] = i
            for size in [*r.saved.values(), r.stats_saved]:
                saved_by_class[r.op_class.value] += size / batch
        owned = [n for n, o in owner.items() if o == i]
        borrowed: dict[int, int] = defaultdict(int)  # tied: owner layer -> parameters
        for n in sorted({n for r in group.records for n in r.params}):
            if owner[n] != i and n in capture.params:
                borrowed[owner[n]] += capture.params[n][0]
        whole, adds = _stream(group, fixed_or_input)
        if _gathered(capture.modules.get(group.unit)):
            whole = {r.name for r in group.records}
        core = _attention_core(group)
        kernels = _kernels(group.records, batch, whole - _opaque(group, capture.modules),
                           core)
        input_bytes = (crossing[i - 1] if i else first_inputs) / batch
        saved = sum(saved_by_class.values())
        selective = max(0.0, saved - _core_saved(group, core, producers) / batch)
        sharded = _tp_sharded(capture.modules.get(group.unit))
        tp_bytes = _tp_comm_bytes(adds, capture.modules) / batch if sharded else 0.0
        replicated = _replicated_saved(group, whole, producers, capture.modules)
        vocab_split = _vocab_layer(group, capture.modules)
        if sharded and not tp_bytes:  # column-parallel with a gathered output (MLP blocks)
            tp_bytes = crossing[i] / batch if i < len(groups) - 1 else 0.0
        layers.append(Layer(
            index=i, name=name, kind=kind,
            modules=(group.unit,) if group.unit else _module_roots(group.records, capture.modules),
            params=sum(capture.params[n][0] for n in owned if n in capture.params),
            param_bytes=sum(capture.params[n][1] for n in owned if n in capture.params),
            buffer_bytes=sum(capture.buffers[n] for n in owned if n in capture.buffers),
            fwd_flops=sum(k.flops for k in kernels),
            bwd_flops=sum(k.bwd_flops for k in kernels),
            activation_bytes=saved,
            saved_by_class=dict(saved_by_class),
            selective_bytes=selective,
            replicated_bytes=min(selective, replicated / batch),
            input_bytes=input_bytes,
            output_bytes=crossing[i] / batch if i < len(groups) - 1 else 0.0,
            tp_comm_bytes=tp_bytes,
            tp_divisor=_tp_divisor(group, capture, vocab) if sharded else 0,
            kernels=kernels,
            signature=_signature(group, kind, capture),
            tied=tuple(sorted(borrowed.items())),
            tp_sharded=sharded,
            vocab_layer=vocab_split,
            sequence_layer=_sequence_layer(capture.modules.get(group.unit), vocab_split),
        ))
    return tuple(layers), node_layer
