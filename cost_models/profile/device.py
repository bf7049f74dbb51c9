"""What a device is and how fast it multiplies matrices and copies memory.

Matmul: `A @ B` with A m×k and B k×n is 2·m·n·k FLOPs. Shapes (square and
rectangular) run from the smallest to the largest; the sweep stops after the first
shape whose single call exceeds the mode's limit, so a dtype without a fast path
(bf16 and fp16 on many CPUs run 100× slower than fp32) costs little. Each shape's
time is the median of its samples (`timing.Samples`; each point keeps its samples and
their spread); the device's figure is the best over the sweep. "fp32" on CUDA forbids
TF32; "tf32" allows it.

Memory bandwidth: `dst.copy_(src)` of tensors larger than any cache; `bytes` counts
what is read plus what is written (twice the tensor), and the figure is the best
over the sweep, each size's time again the median of its samples.
"""

from __future__ import annotations

import contextlib
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from cost_models.profile.timing import Clock, Sampler, sample_seconds, tf32
from planner.dtypes import torch_dtype

MiB = 2**20


@dataclass(frozen=True)
class _Sweep:
    shapes: tuple[tuple[int, int, int], ...]  # (m, n, k)
    copy_sizes: tuple[int, ...]  # bytes of one tensor
    repeats: int
    budget: float  # seconds per shape at most (after the first call)
    max_call: float  # stop the matmul sweep after a call longer than this


_SWEEPS = {
    ("cpu", True): _Sweep(((256, 256, 256), (1024, 512, 256), (512, 512, 512),
                           (1024, 1024, 1024)),
                          (64 * MiB, 256 * MiB), repeats=5, budget=0.25, max_call=0.1),
    ("cpu", False): _Sweep(((256, 256, 256), (1024, 512, 256), (512, 512, 512),
                            (1024, 1024, 1024), (4096, 1024, 1024), (2048, 2048, 2048),
                            (1024, 4096, 4096), (4096, 4096, 4096)),
                           (64 * MiB, 256 * MiB, 1024 * MiB), repeats=10, budget=2.0,
                           max_call=1.0),
    ("cuda", True): _Sweep(((1024, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 1024),
                            (8192, 8192, 8192)),
                           (256 * MiB, 1024 * MiB), repeats=10, budget=0.5, max_call=0.1),
    ("cuda", False): _Sweep(((1024, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 1024),
                             (16384, 4096, 4096), (8192, 8192, 8192), (16384, 16384, 4096),
                             (16384, 16384, 16384)),
                            (256 * MiB, 1024 * MiB, 4096 * MiB), repeats=30, budget=2.0,
                            max_call=1.0),
}


def matmul_dtypes(device: torch.device) -> tuple[str, ...]:
    return ("fp32", "tf32", "bf16", "fp16") if device.type == "cuda" else ("fp32", "bf16", "fp16")


def describe(device: torch.device) -> dict:
    """Index, kind, name, memory and (CPU) threads of a device."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"index": device.index, "kind": "cuda", "name": props.name,
                "memory_bytes": props.total_memory, "threads": None,
                "multiprocessors": props.multi_processor_count,
                "compute_capability": f"{props.major}.{props.minor}"}
    return {"index": 0, "kind": "cpu", "name": _cpu_name(),
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "threads": torch.get_num_threads(), "cores": os.cpu_count()}


def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    return platform.processor() or platform.machine()


def measure_matmul(device: torch.device, dtype: str, quick: bool,
                   sample: Sampler = sample_seconds) -> dict:
    """Best achieved FLOP/s of `dtype` matmuls over the mode's shapes, each timed by
    `sample` (tests give a fake)."""
    sweep = _SWEEPS[device.type, quick]
    clock = Clock(device)
    points = []
    precision = tf32(dtype == "tf32") if device.type == "cuda" else contextlib.nullcontext()
    with precision:
        for m, n, k in sorted(sweep.shapes, key=lambda s: s[0] * s[1] * s[2]):
            a = torch.randn(m, k, device=device).to(torch_dtype(dtype))
            b = torch.randn(k, n, device=device).to(torch_dtype(dtype))
            samples = sample(lambda a=a, b=b: a @ b, clock, repeats=sweep.repeats,
                             budget=sweep.budget)
            seconds = samples.median
            points.append({"m": m, "n": n, "k": k, "seconds": seconds,
                           "flops": 2 * m * n * k / seconds, **samples.record()})
            del a, b
            if seconds > sweep.max_call:
                break
    return {"best_flops": max(p["flops"] for p in points), "sweep": points}


def measure_bandwidth(device: torch.device, memory_bytes: int, quick: bool,
                      sample: Sampler = sample_seconds) -> dict:
    """Best copy bandwidth (read + write bytes per second) over the mode's sizes, each
    timed by `sample`; sizes whose two tensors would take more than a quarter of the
    memory are skipped."""
    sweep = _SWEEPS[device.type, quick]
    clock = Clock(device)
    sizes = [s for s in sweep.copy_sizes if 2 * s <= memory_bytes / 4] or [min(sweep.copy_sizes)]
    points = []
    for size in sizes:
        src = torch.ones(size // 4, device=device)
        dst = torch.empty_like(src)
        samples = sample(lambda src=src, dst=dst: dst.copy_(src), clock,
                         repeats=sweep.repeats, budget=sweep.budget)
        seconds = samples.median
        points.append({"bytes": 2 * size, "seconds": seconds, "bandwidth": 2 * size / seconds,
                       **samples.record()})
        del src, dst
    return {"best": max(p["bandwidth"] for p in points), "sweep": points}
