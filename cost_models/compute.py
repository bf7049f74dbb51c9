"""Compute time of a traced layer on a device: a roofline per kernel, calibrated by
measurements when a profile exists.

For each kernel of the layer, at micro-batch size `mb` and tensor-parallel
degree `tp`:

    time = max(flops / (peak(dtype) * efficiency(class, GEMM shape)),
               bytes / (memory_bandwidth * memory_efficiency)) + count * launch

A GEMM of m x k by k x n keeps this share of the peak (`gemm_efficiency`):

    E * m n / (waves * units * tm tn) * k / (k + 32),   waves = ceil(tiles / units),
                                                         tiles = ceil(m / tm) ceil(n / tn)

E is the device's large-GEMM efficiency (catalog `gemm_efficiency`: the measured
maximum achievable matmul FLOP/s over the peak; else `Efficiency.matmul`). The output
is computed in tm x tn tiles, one tile per compute unit (SM) at a time: a partial tile
computes padding (tile quantization) and a last wave with fewer tiles than units leaves
units idle (wave quantization; NVIDIA, Matrix Multiplication Background User's Guide,
2023, sections 2.3 and 3). Of cuBLAS's typical tiles, 256 x 128 and 128 x 128, the one
that wastes less is taken. A device without a unit count pays tile quantization alone
(128 x 128). A reduction shorter than a few steps of the kernel's pipeline (k0 = 32)
cannot hide its loads.

FLOPs and activation bytes scale with `mb`; weights (`bytes_fixed`) do not.
Tensor parallelism divides a kernel's work by `tp` (Megatron shards matmuls,
attention heads and what runs on them) but for the kernels every rank runs whole
(`Kernel.whole`: the residual stream's norms, adds and dropout, which sequence
parallelism splits too). Backward uses the kernel's backward FLOPs and about twice
the forward's bytes.

Recompute costs backward the forward of what it drops: the attention core
(`Kernel.core`) for selective, the whole layer for full, whose tensor-parallel
collectives run again too (`recompute_repeats_tp`; the solver prices them).

Measurements override the catalog in two steps: a profile's achieved matmul
FLOP/s and memory bandwidth replace peak x efficiency; and measured times of
this very layer (same signature and dtype) at one or more micro-batch sizes
replace the roofline, fitted as time = a + b * mb: those measured at the
tensor-parallel degree priced as they are, else those at tp 1 scaled by the
roofline's tp ratio. A dtype the profile did not measure (or, without a profile,
the catalog does not list) runs at the fp32 rate (`rate_dtype`). Times measured at a
degree with the layer's tensor-parallel collectives in them (`LayerTiming.with_tp_comm`:
what profiles of Megatron-LM runs hold) hold that degree's traffic too
(`includes_tp_comm`), which the cost model then does not price again. A measured
optimizer step (`MeasuredDevice.optimizer`) prices the step per parameter instead of
the bandwidth bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.types import DeviceSpec, Kernel, Layer, LayerTiming, OpClass, OptimizerSpec
from planner.types.training import Recompute

_SHARDED = {OpClass.MATMUL, OpClass.ATTENTION, OpClass.CONV, OpClass.EMBEDDING,
            OpClass.ELEMENTWISE, OpClass.REDUCTION, OpClass.POOLING, OpClass.OTHER,
            OpClass.NORM}


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    """Fractions of the datasheet peak that well-tuned kernels reach.

    Defaults: large bf16/fp16 GEMMs reach 70-80% of peak with cuBLAS on
    A100/H100 (`matmul`, for devices the catalog gives no measured
    `gemm_efficiency`); FlashAttention-2 reaches 50-70% forward and 40-50% backward
    (Dao 2023); memory-bound kernels 80% of peak bandwidth; eager PyTorch pays
    a few microseconds per kernel launch.
    """

    matmul: float = 0.75
    conv: float = 0.6
    attention_fwd: float = 0.55
    attention_bwd: float = 0.45
    memory: float = 0.8
    launch: float = 5e-6
    backward_bytes: float = 2.0
    tile: int = 128  # GEMM tile edge where the device's unit count is unknown
    tiles: tuple[tuple[int, int], ...] = ((256, 128), (128, 128))  # cuBLAS's large tiles


DEFAULT_EFFICIENCY = Efficiency()


@dataclass(frozen=True)
class LayerTime:
    fwd: float
    bwd: float
    source: str  # "roofline" or "measured"

    @property
    def total(self) -> float:
        return self.fwd + self.bwd


def gemm_utilization(m: float, k: int, n: int, *, units: int | None,
                     eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """Share of the matrix units a GEMM of m x k by k x n keeps busy (the module's
    formula without E): the useful part of the tiles issued in whole waves over `units`
    compute units, the best of `eff.tiles` (one `eff.tile` square without a unit
    count), times k / (k + 32)."""
    if m <= 0 or n <= 0:
        return 1.0
    shapes = eff.tiles if units else ((eff.tile, eff.tile),)
    best = 0.0
    for rows, cols in shapes:
        tiles = math.ceil(m / rows) * math.ceil(n / cols)
        issued = math.ceil(tiles / units) * units if units else tiles
        best = max(best, m * n / (issued * rows * cols))
    return best * k / (k + 32)


def rate_dtype(device: DeviceSpec, dtype: str) -> str:
    """The dtype whose matmul rate prices `dtype` on `device`: `dtype` if the profile
    measured it; else fp32 if the profile measured that; else `dtype` if the catalog
    lists it; else fp32 (a dtype without a fast path runs at the fp32 rate)."""
    measured = device.measured.matmul_flops if device.measured else {}
    known = measured if dtype in measured or "fp32" in measured else device.peak_flops
    return dtype if dtype in known else "fp32"


def _rates(device: DeviceSpec, dtype: str, eff: Efficiency) -> tuple[float, float, float]:
    """(matmul FLOP/s at full utilization, the peak it stands for, memory bytes/s)."""
    measured = device.measured
    rated = rate_dtype(device, dtype)
    large = device.gemm_efficiency or eff.matmul
    matmul = device.flops(rated) * large
    if measured and rated in measured.matmul_flops:
        matmul = measured.matmul_flops[rated]
    bandwidth = device.memory_bandwidth * eff.memory
    if measured and measured.memory_bandwidth:
        bandwidth = measured.memory_bandwidth
    return matmul, matmul / large, bandwidth


def _kernel_time(k: Kernel, *, mb: int, tp: int, backward: bool, device: DeviceSpec,
                 dtype: str, eff: Efficiency) -> float:
    matmul_rate, peak_equiv, bandwidth = _rates(device, dtype, eff)
    share = tp if k.op_class in _SHARDED and not k.whole else 1
    flops = (k.bwd_flops if backward else k.flops) * mb / share
    moved = (k.bytes * mb + k.bytes_fixed) / share
    if backward:
        moved *= eff.backward_bytes
    rate = matmul_rate
    if k.op_class is OpClass.ATTENTION:
        rate = peak_equiv * (eff.attention_bwd if backward else eff.attention_fwd)
    elif k.op_class is OpClass.CONV:
        rate = peak_equiv * eff.conv
    if k.gemm is not None:
        m, kk, n = k.gemm
        rate *= gemm_utilization(m * mb, kk, max(1, n // share), units=device.compute_units,
                                 eff=eff)
    compute = flops / rate if flops else 0.0
    return max(compute, moved / bandwidth) + k.count * eff.launch


def roofline_time(layer: Layer, device: DeviceSpec, *, tp: int, micro_batch: int, dtype: str,
                  eff: Efficiency = DEFAULT_EFFICIENCY) -> LayerTime:
    tp = layer.tp_share(tp)  # a replicated layer runs whole on every rank
    def total(backward: bool) -> float:
        return sum(_kernel_time(k, mb=micro_batch, tp=tp, backward=backward, device=device,
                                dtype=dtype, eff=eff) for k in layer.kernels)
    return LayerTime(total(False), total(True), "roofline")


def _fit(points: list[LayerTiming], mb: int, attr: str) -> float:
    """time(mb) = a + b * mb by least squares; proportional through one point."""
    if len(points) == 1:
        p = points[0]
        return getattr(p, attr) * mb / p.micro_batch
    xs = [p.micro_batch for p in points]
    ys = [getattr(p, attr) for p in points]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
    return max(0.0, mean_y + slope * (mb - mean_x))


def layer_time(layer: Layer, device: DeviceSpec, *, tp: int, micro_batch: int, dtype: str,
               eff: Efficiency = DEFAULT_EFFICIENCY) -> LayerTime:
    """Forward and backward seconds of `layer` for one micro-batch on one device of a
    `tp`-wide tensor-parallel group."""
    measured = device.measured
    alike = [t for t in (measured.layer_times if measured else ())
             if t.layer == layer.signature and t.dtype == dtype]
    at_tp = [t for t in alike if t.tp == tp]
    if at_tp:  # measured at this very degree: as measured
        return LayerTime(_fit(at_tp, micro_batch, "fwd"), _fit(at_tp, micro_batch, "bwd"),
                         "measured")
    points = [t for t in alike if t.tp == 1]
    if not points:
        return roofline_time(layer, device, tp=tp, micro_batch=micro_batch, dtype=dtype, eff=eff)
    fwd, bwd = _fit(points, micro_batch, "fwd"), _fit(points, micro_batch, "bwd")
    if tp > 1:
        one = roofline_time(layer, device, tp=1, micro_batch=micro_batch, dtype=dtype, eff=eff)
        many = roofline_time(layer, device, tp=tp, micro_batch=micro_batch, dtype=dtype, eff=eff)
        fwd *= many.fwd / one.fwd if one.fwd else 1.0
        bwd *= many.bwd / one.bwd if one.bwd else 1.0
    return LayerTime(fwd, bwd, "measured")


def includes_tp_comm(layer: Layer, device: DeviceSpec, tp: int) -> bool:
    """Whether `layer_time` gives `layer` at degree `tp` from times measured at that degree
    with the layer's tensor-parallel collectives in them (their dtype is in the layer's
    signature, which the timings match)."""
    measured = device.measured
    return tp > 1 and measured is not None and any(
        t.with_tp_comm for t in measured.layer_times
        if t.layer == layer.signature and t.tp == tp)


def recompute_time(layer: Layer, device: DeviceSpec, *, tp: int, micro_batch: int,
                   dtype: str, policy: Recompute, eff: Efficiency = DEFAULT_EFFICIENCY
                   ) -> float:
    """Extra backward seconds that recomputation costs in compute: the whole forward
    (full), or the forward of the attention core (selective); the collectives a full
    recompute runs again are the solver's to price (`recompute_repeats_tp`)."""
    if policy is Recompute.NONE:
        return 0.0
    if policy is Recompute.FULL:
        return layer_time(layer, device, tp=tp, micro_batch=micro_batch, dtype=dtype,
                          eff=eff).fwd
    return sum(_kernel_time(k, mb=micro_batch, tp=layer.tp_share(tp), backward=False,
                            device=device, dtype=dtype, eff=eff)
               for k in layer.kernels if k.core)


def recompute_repeats_tp(policy: Recompute) -> bool:
    """Whether recomputing under `policy` runs the layer's tensor-parallel collectives
    again: full recompute runs the whole forward, its all-reduces (or reduce-scatters
    and all-gathers) included; the attention core has none."""
    return policy is Recompute.FULL


def optimizer_time(params: float, device: DeviceSpec, *, dtype_bytes: int,
                   optimizer: OptimizerSpec, state_bytes: float,
                   eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """Seconds of a memory-bound optimizer step over `params` local parameters: read
    gradients, read and write weights and optimizer states; or, where the device's
    optimizer step was measured, its seconds per parameter times `params`."""
    measured = device.measured.optimizer if device.measured else None
    if measured is not None:
        return params * measured.seconds / measured.params
    grad = optimizer.grad_bytes or dtype_bytes
    moved = params * (grad + 2 * dtype_bytes + 2 * state_bytes)
    _, _, bandwidth = _rates(device, "fp32", eff)
    return moved / bandwidth
