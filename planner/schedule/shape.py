"""What a job runs on: a shape (devices per type) and a layout (how many of them on each
machine). Throughputs depend on both: a job of 8 devices on one server runs faster than
on two (its collectives cross the network), so rates are looked up by layout, and
policies, which plan in shapes, price each shape at its most compact layout."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

from planner.schedule.pool import Pool


@dataclass(frozen=True, order=True)
class Shape:
    """Devices per type, `((type, count), ...)` in type order, every count positive."""

    counts: tuple[tuple[str, int], ...]

    @staticmethod
    def of(counts: Mapping[str, int]) -> Shape:
        return Shape(tuple(sorted((kind, n) for kind, n in counts.items() if n > 0)))

    @property
    def devices(self) -> int:
        return sum(n for _, n in self.counts)

    @property
    def types(self) -> tuple[str, ...]:
        return tuple(kind for kind, _ in self.counts)

    def count(self, kind: str) -> int:
        return dict(self.counts).get(kind, 0)

    @cached_property
    def label(self) -> str:
        """'4xv100', '2xv100+2xp100'."""
        return "+".join(f"{n}x{kind}" for kind, n in self.counts)


@dataclass(frozen=True, order=True)
class Layout:
    """Devices on each machine a job uses: `((type, devices), ...)`, largest first per
    type. Two layouts with the same chunks run alike (machines of a type are alike)."""

    chunks: tuple[tuple[str, int], ...]

    @staticmethod
    def of(chunks: Iterable[tuple[str, int]]) -> Layout:
        return Layout(tuple(sorted(chunks, key=lambda c: (c[0], -c[1]))))

    @property
    def shape(self) -> Shape:
        totals: dict[str, int] = {}
        for kind, n in self.chunks:
            totals[kind] = totals.get(kind, 0) + n
        return Shape.of(totals)

    @property
    def spread(self) -> bool:
        """Whether the job's devices span more than one machine."""
        return len(self.chunks) > 1


def compact_layout(shape: Shape, pool: Pool) -> Layout:
    """The layout of `shape` on the fewest machines of `pool` (largest machines first),
    the one policies price a shape at."""
    chunks = []
    for kind, count in shape.counts:
        sizes = sorted((m.devices for m in pool.machines if m.device_type == kind),
                       reverse=True)
        left = count
        fits = [s for s in sizes if s >= left]
        if fits:  # one machine holds it all
            chunks.append((kind, left))
            continue
        for size in sizes:
            if left == 0:
                break
            take = min(size, left)
            chunks.append((kind, take))
            left -= take
    return Layout.of(chunks)
