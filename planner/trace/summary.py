"""Totals of a traced model and the check of its FLOPs against the 6 * N * T rule."""

from __future__ import annotations

from dataclasses import dataclass

from planner.types import LayerKind, ModelGraph, OpClass

_DENSE = (OpClass.MATMUL.value, OpClass.CONV.value)


@dataclass(frozen=True, kw_only=True)
class FlopCheck:
    """Training FLOPs per sample of the weight matmuls vs 6 * N * tokens.

    N counts the parameters that matmuls read (embedding tables used only for
    lookups are excluded, tied output projections included). Attention's
    sequence-quadratic FLOPs are not part of the rule and are reported apart.
    """

    tokens: int
    matmul_params: int
    rule_flops: float
    traced_flops: float
    attention_flops: float

    @property
    def ratio(self) -> float:
        return self.traced_flops / self.rule_flops if self.rule_flops else float("nan")


def flop_check(model: ModelGraph) -> FlopCheck | None:
    """The check, or None where the rule does not apply (no tokens, routed experts)."""
    if not model.seq_len or model.config.get("experts"):
        return None
    graph = model.graph
    params: set[str] = set()
    traced = attention = 0.0
    for _, data in graph.nodes(data=True):
        if data["op_class"] in _DENSE:
            params.update(data["params"])
    for layer in model.layers:
        for k in layer.kernels:
            if k.op_class.value in _DENSE:
                traced += k.flops + k.bwd_flops
            elif k.op_class is OpClass.ATTENTION:
                attention += k.flops + k.bwd_flops
    n = sum(graph.graph["parameters"][p] for p in params)
    if not n:
        return None
    return FlopCheck(tokens=model.seq_len, matmul_params=n, rule_flops=6.0 * n * model.seq_len,
                     traced_flops=traced, attention_flops=attention)


def count_blocks(model: ModelGraph) -> int:
    return sum(layer.kind is LayerKind.BLOCK for layer in model.layers)


def layer_runs(model: ModelGraph) -> list[tuple[int, int]]:
    """[start, end) ranges of consecutive layers with equal signatures and boundaries."""
    runs: list[tuple[int, int]] = []
    for layer in model.layers:
        first = model.layers[runs[-1][0]] if runs else None
        if first and (first.signature, first.output_bytes) == (layer.signature,
                                                                layer.output_bytes):
            runs[-1] = (runs[-1][0], layer.index + 1)
        else:
            runs.append((layer.index, layer.index + 1))
    return runs
