"""A micro-batch priced by its tokens: linear terms per token, attention's per sample.

Layers are traced at the plan's sequence length S, their figures per sample. A sample
of L tokens costs the layer's linear work (matmuls, norms, the MLP, everything but the
attention core) in proportion to L, and the attention core (`Kernel.core`: QK^T,
softmax and attention over V) in proportion to L squared. A micro-batch of r samples
padded to its longest, L tokens each, therefore takes

    time(r, L) = time(mb, S) * r / mb * ((1 - q) L / S + q (L / S)^2)

of the time a planned micro-batch (mb samples of S tokens) takes, where q is the share
of that time in attention cores (`quadratic_share`, from the roofline of the layers'
kernels at the traced length: measured layer times have no kernels to split). Fixed
per-micro-batch costs (kernel launches, reading the weights) are left out: they are
small beside the token terms at the micro-batch sizes plans use. Communication of a
micro-batch's activations (pipeline sends, tensor-parallel collectives) moves r L
tokens' worth: `linear_factor`.

A micro-batch may hold at most `token_budget` tokens, its rows times its length: what
the plan's memory was priced for (mb samples of S tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cost_models.compute import DEFAULT_EFFICIENCY, Efficiency, recompute_time, roofline_time
from planner.types import DeviceSpec, Layer
from planner.types.training import Recompute


@dataclass(frozen=True, kw_only=True)
class TokenShape:
    """A micro-batch as it runs: `rows` samples, each padded to `length` tokens."""

    rows: int
    length: int

    @property
    def tokens(self) -> int:
        return self.rows * self.length


def token_factor(shape: TokenShape, *, micro_batch: int, seq_len: int, quadratic: float
                 ) -> float:
    """Compute time of a micro-batch of `shape` over a planned one's (`micro_batch` rows of
    `seq_len` tokens), `quadratic` the share of that time in attention cores."""
    ratio = shape.length / seq_len
    return shape.rows / micro_batch * ((1 - quadratic) * ratio + quadratic * ratio * ratio)


def linear_factor(shape: TokenShape, *, micro_batch: int, seq_len: int) -> float:
    """Bytes of a micro-batch of `shape`'s activations over a planned one's."""
    return shape.tokens / (micro_batch * seq_len)


def token_budget(*, micro_batch: int, seq_len: int) -> int:
    """The most tokens a micro-batch may hold: what the plan's memory was priced for."""
    return micro_batch * seq_len


def quadratic_share(layers: Sequence[Layer], device: DeviceSpec, *, tp: int, dtype: str,
                    eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """The share of the layers' forward time (one sample at the traced length, on a rank
    of a `tp`-wide group) in attention cores; 0 for layers without any."""
    total = core = 0.0
    for layer in layers:
        total += roofline_time(layer, device, tp=tp, micro_batch=1, dtype=dtype, eff=eff).fwd
        core += recompute_time(layer, device, tp=tp, micro_batch=1, dtype=dtype,
                               policy=Recompute.SELECTIVE, eff=eff)
    return core / total if total else 0.0
