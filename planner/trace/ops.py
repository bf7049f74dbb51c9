"""What one aten op costs: its class, FLOPs (forward and backward), bytes moved, GEMM shape.

FLOPs come from torch's own formulas (`torch.utils.flop_counter.flop_registry`),
the same ones FlopCounterMode uses; everything else from tensor shapes.
Backward FLOPs of a matmul-like op are one forward's worth per operand that
needs a gradient (input and weight), so 2x forward in training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import flop_registry

from planner.types import OpClass

aten = torch.ops.aten

def _ops(*names: str) -> frozenset:
    """The aten op packets of these names that this torch version has."""
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


_MATMUL = _ops("mm", "addmm", "bmm", "baddbmm")
_CONV = _ops("convolution", "_convolution", "convolution_overrideable", "_slow_conv2d_forward",
             "cudnn_convolution")
_ATTENTION = _ops("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
                  "_efficient_attention_forward")
_NORM = _ops("native_layer_norm", "native_batch_norm", "_native_batch_norm_legit",
             "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training",
             "native_group_norm", "_fused_rms_norm")
_EMBEDDING = _ops("embedding", "_embedding_bag")
_REDUCTION = _ops("sum", "mean", "amax", "amin", "max", "min", "var", "var_mean", "cumsum",
                  "nll_loss_forward", "nll_loss2d_forward", "topk", "sort", "argmax", "norm",
                  "linalg_vector_norm")
_POOLING = _ops("max_pool2d_with_indices", "avg_pool2d", "_adaptive_avg_pool2d",
                "adaptive_max_pool2d", "max_pool3d_with_indices", "avg_pool3d")
_METADATA = _ops("detach", "alias", "lift_fresh")


@dataclass(frozen=True)
class OpCost:
    op_class: OpClass
    flops: float
    bwd_flops: float
    bytes: float  # activation bytes read + written
    bytes_fixed: float  # parameter-derived bytes read
    gemm: tuple[int, int, int] | None  # (m, k, n) at the traced batch
    # run whole on every tensor-parallel rank whatever splits its layer: a mixture-of-
    # experts block's router and dispatch (tensor parallelism splits only its experts)
    whole: bool = False


def tensors(tree: object) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def classify(func: torch._ops.OpOverload) -> OpClass:
    packet = func.overloadpacket
    if packet in _MATMUL:
        return OpClass.MATMUL
    if packet in _CONV:
        return OpClass.CONV
    if packet in _ATTENTION:
        return OpClass.ATTENTION
    if packet in _NORM:
        return OpClass.NORM
    if packet in _EMBEDDING:
        return OpClass.EMBEDDING
    if packet in _REDUCTION or "softmax" in packet.__name__:
        return OpClass.REDUCTION
    if packet in _POOLING:
        return OpClass.POOLING
    if func.is_view or packet in _METADATA:
        return OpClass.RESHAPE
    if torch.Tag.pointwise in func.tags:
        return OpClass.ELEMENTWISE
    return OpClass.OTHER


def gemm_shape(func: torch._ops.OpOverload, args: tuple, out: object
               ) -> tuple[int, int, int] | None:
    """(m, k, n) of a matmul or (implicit-GEMM) convolution, batch folded into m."""
    packet = func.overloadpacket
    if packet in (aten.mm, aten.addmm):
        a, b = args[-2], args[-1]
        return (a.shape[0], a.shape[1], b.shape[1])
    if packet in (aten.bmm, aten.baddbmm):
        a, b = args[-2], args[-1]
        return (a.shape[0] * a.shape[1], a.shape[2], b.shape[2])
    if packet in _CONV and isinstance(out, torch.Tensor):
        weight = args[1]
        k = math.prod(weight.shape[1:])
        return (out.numel() // out.shape[1], k, weight.shape[0])
    return None


def op_flops(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: object) -> float:
    formula = flop_registry.get(func.overloadpacket)
    if formula is None:
        return 0.0
    return float(formula(*args, **kwargs, out_val=out))


def backward_flops(op_class: OpClass, func: torch._ops.OpOverload, args: tuple,
                   flops: float) -> float:
    """FLOPs of the gradient computation for this op, by the operands needing grads."""
    if op_class in (OpClass.MATMUL, OpClass.CONV):
        operands = args[-2:] if op_class is OpClass.MATMUL else args[:2]
        need = sum(1 for a in operands if isinstance(a, torch.Tensor) and a.requires_grad)
        return flops * need
    if op_class is OpClass.ATTENTION:
        return attention_backward_flops(flops)
    return 0.0


def attention_backward_flops(forward_flops: float) -> float:
    """A fused (flash) attention backward recomputes QK^T: five matmuls to forward's two."""
    return 2.5 * forward_flops
