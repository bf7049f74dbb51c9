"""Micro-batch shares: how many micro-batches each pipeline runs so that the slowest
finishes first (HAP's uneven shares), for pipelines of several classes, each class's
pipelines identical and taking T(m) = (m - 1) b + c for m micro-batches.

`shares` lets a pipeline run any count; `grouped_shares` counts in whole groups of g
micro-batches per class (interleaved 1F1B runs a multiple of its stages: Megatron's
rule, and one torch's interleaved schedule accepts).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence


def shares(lines: Sequence[tuple[int, float, float]], total: int) -> list[int] | None:
    """Micro-batches per pipeline minimising the slowest pipeline's time.

    lines: (pipeline count, bottleneck b, fill c) per class, a pipeline taking
    T(m) = (m - 1) b + c for m micro-batches. Returns every pipeline's count in
    order (each at least one), or None if there are fewer micro-batches than
    pipelines. The optimum t* is the smallest time by which the pipelines can
    finish `total` micro-batches (a pipeline finishes 1 + floor((t - c) / b) by
    t); identical pipelines share a class's micro-batches as evenly as possible."""
    pipelines = sum(count for count, _, _ in lines)
    if total < pipelines:
        return None

    def capacity(t: float, b: float, c: float) -> int:
        return 0 if t < c else min(total, 1 + int((t - c) / b + 1e-9))

    def done(t: float) -> int:
        return sum(n * capacity(t, b, c) for n, b, c in lines)

    high = max(c for _, _, c in lines)  # every pipeline runs at least one micro-batch
    if done(high) < total:
        # t* lies within the longest period above where the pipelines, run fluidly, would
        # finish; it is one of the times a pipeline completes a micro-batch
        fluid = (total - sum(n * (1 - c / b) for n, b, c in lines)) / sum(
            n / b for n, b, _ in lines)
        low = max(high, fluid)
        reach = low + max(b for _, b, _ in lines)
        times = sorted({c + k * b for _, b, c in lines
                        for k in range(max(0, math.floor((low - c) / b)),
                                       math.floor((reach - c) / b) + 2)})
        times = [t for t in times if t >= low] or [reach]
        first, last = 0, len(times) - 1
        while first < last:
            mid = (first + last) // 2
            first, last = (first, mid) if done(times[mid]) >= total else (mid + 1, last)
        high = times[first]
    tops = [max(1, capacity(high, b, c)) for _, b, c in lines]
    firsts = [0] * len(lines)  # class j: its first firsts[j] pipelines run tops[j] - 1
    excess = sum(n * top for (n, _, _), top in zip(lines, tops, strict=True)) - total

    def key(j: int) -> tuple[float, int]:  # the slowest pipeline first, then the class order
        return -((tops[j] - 1) * lines[j][1] + lines[j][2]), j

    heap = [key(j) for j in range(len(lines)) if tops[j] > 1]
    heapq.heapify(heap)
    while excess > 0:  # take micro-batches back from the slowest pipelines, a level at a time
        _, j = heapq.heappop(heap)
        n, b, c = lines[j]
        if excess < n:
            firsts[j] = excess
            break
        levels = 1
        if heap:  # every level still slower than the next class's slowest pipeline
            slower = math.floor((tops[j] - 1) - (-heap[0][0] - c) / b) if b > 0 else 1
            levels = max(1, min(slower, tops[j] - 1, excess // n))
        tops[j] -= levels
        excess -= levels * n
        if tops[j] > 1:
            heapq.heappush(heap, key(j))
    return [top - (i < first) for (n, _, _), top, first in zip(lines, tops, firsts, strict=True)
            for i in range(n)]


def grouped_shares(lines: Sequence[tuple[int, float, float]], groups: Sequence[int],
                   total: int) -> list[int] | None:
    """`shares` where class j's pipelines run whole groups of groups[j] micro-batches
    (None if no such counts sum to `total`). A group of g takes g b, the first one
    c + (g - 1) b. One group size for all: `shares` in groups. Several: the optimum is
    the first time t, of those at which some pipeline finishes a group, by which
    counts of groups K_j (n_j to n_j times the groups a pipeline of class j finishes by
    t) exist with sum_j g_j K_j = total (a subset-sum over the classes' ranges, as bit
    sets); each class's groups are shared as evenly as possible."""
    if all(g == 1 for g in groups):
        return shares(lines, total)
    units = [(n, g * b, c + (g - 1) * b) for (n, b, c), g in zip(lines, groups, strict=True)]
    if len(set(groups)) == 1:
        g = groups[0]
        counts = shares(units, total // g) if total % g == 0 else None
        return None if counts is None else [k * g for k in counts]
    mask = (1 << (total + 1)) - 1

    def most(j: int, t: float) -> int:
        """The groups class j's pipelines finish by t."""
        n, b, c = units[j]
        return n * (0 if t < c else 1 + int((t - c) / b + 1e-9))

    def reachable(t: float) -> list[int]:
        """Per class prefix, the sums of micro-batches its classes can run by t (bits)."""
        sets = [1]
        for j, ((n, _, _), g) in enumerate(zip(units, groups, strict=True)):
            acc, span, top = (sets[-1] << (g * n)) & mask, 1, most(j, t)
            while span < top - n + 1:  # every K in [n, top]: shifts doubled
                step = min(span, top - n + 1 - span)
                acc |= (acc << (g * step)) & mask
                span += step
            sets.append(acc if top >= n else 0)
        return sets

    times = sorted({c + k * b for (n, b, c), g in zip(units, groups, strict=True)
                    for k in range(total // (g * n) + 2)})
    first, last = 0, len(times) - 1
    if not reachable(times[last])[-1] >> total & 1:
        return None
    while first < last:
        mid = (first + last) // 2
        first, last = (first, mid) if reachable(times[mid])[-1] >> total & 1 else (mid + 1, last)
    sets, left, per_class = reachable(times[first]), total, []
    for j in range(len(units) - 1, -1, -1):  # the largest count of the last class first
        n, g, k = units[j][0], groups[j], most(j, times[first])
        while k >= n and not (left - g * k >= 0 and sets[j] >> (left - g * k) & 1):
            k -= 1
        per_class.append(k)
        left -= g * k
    per_class.reverse()
    return [g * (k // n + (i >= n - k % n)) for (n, _, _), g, k in zip(
        units, groups, per_class, strict=True) for i in range(n)]
