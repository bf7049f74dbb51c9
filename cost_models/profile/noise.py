"""Warnings about a profile's figures that a busy machine may have spoiled.

Two signs are read from the profile itself. The samples of one measurement disagree:
the middle half of them spans more than SPREAD_LIMIT (`timing.Samples.spread`; the
point that gives the figure is judged: the best shape of a matmul sweep, the best
size of the copy sweep, the widest-spread micro-batch of the layer steps). On this
project's 2-core VM, quick sweeps at a load of 1.5-2 spread 1.01-1.25 at those points;
at a load of 3 (other work on both cores) from 1.0 to 18, while the fp32 figure went
from 227 to 32 GFLOP/s between two runs a few seconds apart. And the machine was
busy when the profile started (its 1-minute load average at least the CPU's cores):
other work that lasts the whole profile slows every sample alike, so they agree
(that 32 GFLOP/s run spread 1.06) and only the load gives it away.
"""

from __future__ import annotations

from collections.abc import Callable

from cost_models.profile.timing import Samples
from planner.units import fmt_bytes, fmt_flops, fmt_rate, fmt_seconds

SPREAD_LIMIT = 1.5  # the upper quartile of the samples over the lower, at most


def device_label(device: dict) -> str:
    """"cpu" or "cuda:N": how the profile's devices are named to the user."""
    return "cpu" if device["kind"] == "cpu" else f"cuda:{device['index']}"


def noise_warnings(doc: dict) -> list[str]:
    """One line per measurement of `doc` whose samples disagree, and one if the machine
    was busy at the start (see the module docstring). Points without samples (files
    written before samples were kept) are taken as they are."""
    lines = []
    for device in doc["devices"]:
        label = device_label(device)
        for dtype, result in device["matmul"].items():
            best = max(result["sweep"], key=lambda p: p["flops"], default=None)
            if best is not None:
                flops = 2 * best["m"] * best["n"] * best["k"]
                lines += _disagreement(
                    f"{label} {dtype} matmul at {best['m']}×{best['n']}×{best['k']}", best,
                    lambda seconds, flops=flops: flops / seconds,
                    lambda rate: fmt_flops(rate) + "/s", "median")
        best = max(device["memory_bandwidth"]["sweep"], key=lambda p: p["bandwidth"],
                   default=None)
        if best is not None:
            copies = fmt_bytes(best["bytes"] / 2)
            lines += _disagreement(f"{label} memory bandwidth, {copies} copies", best,
                                   lambda seconds, moved=best["bytes"]: moved / seconds,
                                   fmt_rate, "median")
        steps = (device["layers"] or {}).get("steps", [])
        widest = max(steps, key=lambda p: p.get("spread", 1.0), default=None)
        if widest is not None:
            lines += _disagreement(f"{label} training step of {device['layers']['model']} at "
                                   f"micro-batch {widest['micro_batch']}", widest,
                                   lambda seconds: seconds, fmt_seconds, "fastest")
    cores = next((d.get("cores") for d in doc["devices"] if d["kind"] == "cpu"), None)
    load = doc["load_average"][0] if doc["load_average"] else 0.0
    if cores and load >= cores:
        lines.append(f"the machine was busy when the profile started (load average "
                     f"{load:.1f} on {cores} cores): its figures may be low and differ from "
                     "run to run; profile again when it is idle.")
    return lines


def _disagreement(what: str, point: dict, figure: Callable[[float], float],
                  show: Callable[[float], str], kept: str) -> list[str]:
    """A warning if `point`'s samples spread past the limit: the middle half of them
    as figures (`figure` of seconds, written by `show`); `kept` names the sample that
    the profile keeps."""
    if point.get("spread", 1.0) <= SPREAD_LIMIT or not point.get("samples"):
        return []
    low, high = sorted(figure(s) for s in Samples(tuple(point["samples"])).middle_half)
    return [f"{what}: the middle half of {len(point['samples'])} samples spans "
            f"{point['spread']:.1f}x ({show(low)} .. {show(high)}); the machine may be "
            f"busy. The profile keeps their {kept}."]
