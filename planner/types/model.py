"""Model side of the data model: what tracing produces.

Units are SI everywhere: seconds, bytes, FLOP, FLOP/s, bytes/s. Human units are
parsed only at the file/CLI boundary (`planner.units`).

Model side (this module): `ModelSpec` names a model, `Kernel` and `Layer`
describe the traced costs, `ModelGraph` holds the op graph and its layers.
Per-sample quantities scale linearly with the micro-batch size; quantities
named `*_fixed` (weights read by a kernel) do not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import networkx as nx

SCHEMA_VERSION = 1


class OpClass(str, Enum):
    """What kind of work an op does; the cost model picks an efficiency by class."""

    MATMUL = "matmul"
    CONV = "conv"
    ATTENTION = "attention"
    NORM = "norm"
    ELEMENTWISE = "elementwise"
    EMBEDDING = "embedding"
    REDUCTION = "reduction"
    POOLING = "pooling"
    RESHAPE = "reshape"  # comm-free view/layout change: no FLOPs, usually no traffic
    OTHER = "other"


class LayerKind(str, Enum):
    EMBEDDING = "embedding"  # everything before the first repeated block
    BLOCK = "block"  # one repeated block (transformer layer, residual block)
    GLUE = "glue"  # work between two runs of blocks (e.g. encoder -> decoder)
    HEAD = "head"  # everything after the last block


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """How the user named a model; enough to rebuild it anywhere.

    source: "zoo" (a built-in flavor), "factory" (`package.module:callable`) or
            "hf" (a transformers config: a config.json path or a config class).
    overrides: shape overrides (zoo, hf) or keyword arguments (factory).
    """

    source: str
    name: str
    overrides: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def describe(self) -> str:
        extra = ", ".join(f"{k}={v}" for k, v in sorted(self.overrides.items()))
        return f"{self.name} ({extra})" if extra else self.name


@dataclass(frozen=True, kw_only=True)
class Kernel:
    """Identical ops of one layer, aggregated, for the roofline cost model.

    count:        how many such ops the layer runs per forward pass.
    flops:        forward FLOPs per sample, all `count` ops together.
    bwd_flops:    backward FLOPs per sample, all ops together.
    bytes:        activation bytes read and written per sample (forward).
    bytes_fixed:  bytes read once per micro-batch whatever its size (weights).
    gemm:         (m_per_sample, k, n) of one matmul-like op, so efficiency can
                  depend on problem size; None for other classes.
    whole:        run whole on every rank of a tensor-parallel group: the cheap ops
                  of the residual stream (norms, residual adds, dropout), whose inputs
                  and outputs every rank holds whole without sequence parallelism, and a
                  mixture-of-experts block's router and dispatch (only its experts are
                  split).
    core:         an attention core (a fused attention kernel: QK^T, softmax, dropout
                  and attention over V), what selective recompute runs again.
    """

    op_class: OpClass
    count: int
    flops: float
    bwd_flops: float
    bytes: float
    bytes_fixed: float
    gemm: tuple[int, int, int] | None = None
    whole: bool = False
    core: bool = False


@dataclass(frozen=True, kw_only=True)
class Layer:
    """One unit the pipeline splits on, with per-sample costs.

    params / param_bytes:  parameters this layer owns (tied weights count once,
                           in the first layer that uses them).
    fwd_flops / bwd_flops: per sample.
    activation_bytes:      bytes saved for backward per sample (no recompute),
                           each tensor counted once; attention saves what a
                           fused (flash) kernel saves.
    saved_by_class:        activation_bytes split by the op class that saved them.
    selective_bytes:       what selective recompute keeps instead: all but what the
                           attention core makes and saves (a fused core's output and
                           log-sum-exp).
    replicated_bytes:      the part of activation_bytes (and of selective_bytes: the
                           attention core is split) that tensor parallelism keeps
                           whole on every rank without sequence parallelism (the
                           residual stream: norms' inputs and outputs, the
                           column-parallel projections' inputs).
    input_bytes:           per-sample bytes of the tensors entering this layer
                           from earlier layers (kept under full recompute).
    output_bytes:          per-sample bytes of the tensors crossing the boundary
                           after this layer (sent to the next pipeline stage).
    tp_comm_bytes:         per-sample bytes a tensor-parallel (Megatron-style)
                           forward pass all-reduces; backward the same.
    tp_divisor:            tensor-parallel degrees must divide this (heads, widths).
    signature:             equal for identical repeated layers.
    tied:                  (owner layer, parameters) this layer reads but another
                           layer owns (an output head tied to the embedding): a stage
                           holding this layer without the owner holds a copy.
    tp_sharded:            whether tensor parallelism shards this layer (the runtime
                           shards transformer and MLP blocks and layers with a
                           `tensor_parallel_plan`; it replicates the rest on the group).
    vocab_layer:           a transformer's embedding or LM head, which vocabulary
                           parallelism splits over the vocabulary (its token table, the
                           vocabulary-wide matmul and the loss over it).
    sequence_layer:        sequence parallelism can split its residual stream over the
                           sequence: a transformer block, or a transformer's embedding
                           or head where vocabulary parallelism splits them.
    sequence_parallel:     the figures are as sequence parallelism runs the layer
                           (`cost_models.tensor_parallel.as_trained`): nothing whole,
                           its tensor-parallel traffic reduce-scatters and all-gathers.
    """

    index: int
    name: str
    kind: LayerKind
    modules: tuple[str, ...]
    params: int
    param_bytes: int
    buffer_bytes: int
    fwd_flops: float
    bwd_flops: float
    activation_bytes: float
    saved_by_class: Mapping[str, float] = field(hash=False)
    selective_bytes: float
    input_bytes: float
    output_bytes: float
    tp_comm_bytes: float
    tp_divisor: int
    kernels: tuple[Kernel, ...]
    signature: str
    tied: tuple[tuple[int, int], ...] = ()
    tp_sharded: bool = True
    replicated_bytes: float = 0.0
    vocab_layer: bool = False
    sequence_layer: bool = False
    sequence_parallel: bool = False

    def tp_share(self, tp: int) -> int:
        """The tensor-parallel degree this layer is split by: tp, or 1 if replicated."""
        return tp if self.tp_sharded else 1

    @property
    def flops(self) -> float:
        """Forward plus backward FLOPs per sample."""
        return self.fwd_flops + self.bwd_flops


@dataclass(frozen=True, kw_only=True)
class ModelGraph:
    """A traced model: the op graph and the ordered layers built from it.

    The graph's node attributes are for the traced batch (`batch` samples);
    the layers' figures are per sample. `graph` is None for a model read from the trace
    cache (`planner.trace.cache`), which keeps what planning reads, not the op graph.
    """

    spec: ModelSpec
    family: str
    batch: int
    seq_len: int | None
    dtype: str
    tracer: str  # "fx" or "export"
    layers: tuple[Layer, ...]
    graph: nx.DiGraph | None = field(default=None, compare=False, hash=False, repr=False)
    config: Mapping[str, Any] = field(default_factory=dict, hash=False)

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    @property
    def fwd_flops(self) -> float:
        """Forward FLOPs per sample."""
        return sum(layer.fwd_flops for layer in self.layers)

    @property
    def bwd_flops(self) -> float:
        return sum(layer.bwd_flops for layer in self.layers)

    def repeated_groups(self) -> dict[str, list[int]]:
        """Layer indices grouped by signature, for groups of two or more."""
        groups: dict[str, list[int]] = {}
        for layer in self.layers:
            groups.setdefault(layer.signature, []).append(layer.index)
        return {sig: idx for sig, idx in groups.items() if len(idx) > 1}


def layer_json(layer: Layer) -> dict[str, Any]:
    """`layer` as plain JSON values (enums by value); `layer_from_json` reads it back equal."""
    data = dataclasses.asdict(layer)
    data["kind"] = layer.kind.value
    for kernel in data["kernels"]:
        kernel["op_class"] = kernel["op_class"].value
    return data


def layer_from_json(data: Mapping[str, Any]) -> Layer:
    """The layer `layer_json` wrote (JSON's lists back to the tuples the fields hold); a
    KeyError, TypeError or ValueError for data it did not write."""
    kernels = tuple(Kernel(**{**kernel, "op_class": OpClass(kernel["op_class"]),
                              "gemm": None if kernel["gemm"] is None else tuple(kernel["gemm"])})
                    for kernel in data["kernels"])
    return Layer(**{**data, "kind": LayerKind(data["kind"]), "modules": tuple(data["modules"]),
                    "kernels": kernels, "tied": tuple(tuple(pair) for pair in data["tied"]),
                    "saved_by_class": dict(data["saved_by_class"])})


def params_per_rank(layers: Sequence[Layer], tp: int) -> float:
    """Parameters one rank of a tp-wide group holding `layers` keeps: the ones they own
    (sharded layers split, replicated ones whole), plus a copy of tied parameters whose
    owner is elsewhere, split as the layer reading it is (an LM head replicated keeps
    the token table whole, one split over the vocabulary its share)."""
    indices = {layer.index for layer in layers}
    copies = {owner: params / layer.tp_share(tp) for layer in layers
              for owner, params in layer.tied if owner not in indices}
    return sum(layer.params / layer.tp_share(tp) for layer in layers) + sum(copies.values())


def zero_kept(layers: Sequence[Layer], held: Collection[int], zero: int) -> float:
    """Parameters of tied weights that a stage holding the layers `held` (indices into
    the whole model's `layers`) keeps whole under ZeRO stage `zero`, as the runtime
    does: a weight whose owner and readers are not all on the stage has holders
    outside its replica set, so its gradient is summed unsharded beside ZeRO; and
    ZeRO-3 keeps every tied weight whole, since a gather around one reader's forward
    would leave it sharded for the other (replicated on a tp group: whole per rank)."""
    if zero < 1:
        return 0.0
    groups: dict[tuple[int, int], list[int]] = {}
    for layer in layers:
        for owner, params in layer.tied:
            groups.setdefault((owner, params), [owner]).append(layer.index)
    kept = 0.0
    for (_, params), ends in groups.items():
        inside = [i in held for i in ends]
        if any(inside) and (zero >= 3 or not all(inside)):
            kept += params
    return kept
