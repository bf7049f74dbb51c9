"""Class-balanced partitions of a data set over heterogeneous data-parallel workers
(`planner partition`): one index file per pipeline, its size proportional to the
pipeline's capacity, each class's share in it within a tolerance of the class's share
of the whole (RCD-SGD's condition for fast workers not to skew the gradient).

Capacity: the samples each pipeline takes per step (the plan's batch shares, which the
solver makes proportional to the pipelines' speeds, or `--shares`). Shard sizes are the
data set's count split in those proportions by largest remainders, so each is within
one sample of its exact share. The samples, grouped by class (shuffled within each,
seeded), are then dealt out one by one, each to the shard furthest behind its share of
what has been dealt so far (among those not yet full): every class, a run of that
order, lands in the shards in proportion to their sizes, within a sample or two.

The partition checks itself: each shard's class proportions against the data set's,
within `tolerance`, and Pearson's chi-squared test of independence between shard and
class over the shard-by-class table (its p-value: near 1 where the classes spread as
evenly as sampling could make them).

Files (written together, `write_partition`): `partition.json` (kind "partition",
schema_version 1: the shares, sizes, class counts per shard, the test) and
`pipeline-<p>.txt` for each pipeline, its sample indices (0-based lines of the samples
file) one a line, shuffled. A data hook reads them with `read_partition(path).indices(step,
start, stop)`: the data set indices of samples [start, stop) of a step's global batch,
pipeline p's slice of the batch from its own shard (its share per step, consecutive,
wrapping round at the end of the shard).
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from planner.errors import PlannerError

SCHEMA_VERSION = 1
KIND = "partition"
MANIFEST = "partition.json"
NO_LABEL = ""  # the class of samples without a label (all or none have one)


@dataclass(frozen=True, kw_only=True)
class Shard:
    """One pipeline's part of the data set."""

    pipeline: int
    share: int  # samples the pipeline takes per step
    file: str  # its index file, beside the manifest
    samples: tuple[int, ...]  # data set indices, in the order it reads them
    classes: dict[str, int]  # samples per class

    @property
    def size(self) -> int:
        return len(self.samples)


@dataclass(frozen=True, kw_only=True)
class Partition:
    source: str
    count: int
    seed: int
    tolerance: float
    classes: dict[str, int]  # samples per class, the whole data set
    shards: tuple[Shard, ...]
    deviation: float  # the largest |class share in a shard - class share overall|
    chi_squared: float  # Pearson's statistic of the shard-by-class table
    degrees: int  # its degrees of freedom: (shards - 1) (classes - 1)
    p_value: float

    def indices(self, step: int, start: int, stop: int) -> list[int]:
        """Data set indices of samples [start, stop) of step `step`'s global batch: each
        pipeline's slice (plan order, as the runtime takes them) from its own shard."""
        batch = sum(shard.share for shard in self.shards)
        if not 0 <= start <= stop <= batch:
            raise PlannerError("bad-data", f"Samples {start}-{stop} are outside the global "
                               f"batch of {batch} the partition was made for.",
                               ["make the partition with the plan the run trains with"])
        out = []
        offset = 0
        for shard in self.shards:
            for position in range(max(start, offset), min(stop, offset + shard.share)):
                at = step * shard.share + position - offset
                out.append(shard.samples[at % shard.size])
            offset += shard.share
        return out


def largest_remainders(count: int, shares: Sequence[int]) -> list[int]:
    """`count` split in proportion to `shares` (Hamilton's method: the floors, then one
    more to the largest remainders; ties to the lower index)."""
    total = sum(shares)
    exact = [count * s / total for s in shares]
    sizes = [math.floor(x) for x in exact]
    for p in sorted(range(len(shares)), key=lambda p: (-(exact[p] - sizes[p]), p))[
            :count - sum(sizes)]:
        sizes[p] += 1
    return sizes


def make_partition(labels: Sequence[str | None], shares: Sequence[int], *, tolerance: float,
                   seed: int, source: str) -> Partition:
    """The partition of samples with these labels over pipelines of these shares (see the
    module docstring); an error naming the shard and class where a proportion misses the
    tolerance."""
    if not shares or min(shares) < 1:
        raise PlannerError("bad-option", f"Every pipeline needs a share of at least one "
                           f"sample per step (got {list(shares)}).")
    if not 0 < tolerance < 1:
        raise PlannerError("bad-option", f"--tolerance must be between 0 and 1 (got "
                           f"{tolerance}): the most a class's share in a shard may differ "
                           "from its share of the whole data set.")
    labelled = sum(label is not None for label in labels)
    if labelled not in (0, len(labels)):
        missing = next(i for i, label in enumerate(labels) if label is None)
        raise PlannerError("bad-data", f"{source}: sample {missing} has no label while "
                           f"{labelled:,} others have one; give every sample a label, or "
                           "none.")
    names = [NO_LABEL if label is None else label for label in labels]
    sizes = largest_remainders(len(names), shares)
    if min(sizes) < 1:
        raise PlannerError("bad-data", f"{source}: {len(names):,} samples leave pipeline "
                           f"{sizes.index(min(sizes))} none at shares {list(shares)}.",
                           ["give more samples than pipelines"])
    rng = random.Random(seed)
    keys = {i: rng.random() for i in range(len(names))}
    order = sorted(range(len(names)), key=lambda i: (names[i], keys[i]))
    dealt: list[list[int]] = [[] for _ in shares]
    for t, sample in enumerate(order, 1):
        open_ = [p for p in range(len(shares)) if len(dealt[p]) < sizes[p]]
        best = max(open_, key=lambda p: (t * sizes[p] / len(names) - len(dealt[p]), -p))
        dealt[best].append(sample)
    shards = []
    for p, (share, samples) in enumerate(zip(shares, dealt, strict=True)):
        mine = sorted(samples)
        random.Random(seed * 1_000_003 + p).shuffle(mine)
        shards.append(Shard(pipeline=p, share=share, file=f"pipeline-{p}.txt",
                            samples=tuple(mine),
                            classes=dict(sorted(Counter(names[i] for i in mine).items()))))
    classes = dict(sorted(Counter(names).items()))
    statistic, degrees = chi_squared([[s.classes.get(c, 0) for c in classes] for s in shards])
    deviation, worst = _deviation(shards, classes, len(names))
    partition = Partition(source=source, count=len(names), seed=seed, tolerance=tolerance,
                          classes=classes, shards=tuple(shards), deviation=deviation,
                          chi_squared=statistic, degrees=degrees,
                          p_value=chi_squared_survival(statistic, degrees))
    if deviation > tolerance:
        shard, label = worst
        inside = partition.shards[shard].classes.get(label, 0) / sizes[shard]
        raise PlannerError("bad-data", f"Pipeline {shard}'s shard holds class {label!r} at "
                           f"{inside:.2%} of its {sizes[shard]:,} samples, against "
                           f"{classes[label] / len(names):.2%} of the data set: "
                           f"{deviation:.2%} apart, beyond the tolerance {tolerance:.2%} (a "
                           "shard this small cannot hold each class closer).",
                           ["raise --tolerance", "give more samples", "use fewer pipelines"])
    return partition


def _deviation(shards: Sequence[Shard], classes: dict[str, int], count: int
               ) -> tuple[float, tuple[int, str]]:
    """The largest gap between a class's share in a shard and in the data set, and where."""
    worst, where = 0.0, (0, next(iter(classes)))
    for shard in shards:
        for label, overall in classes.items():
            gap = abs(shard.classes.get(label, 0) / shard.size - overall / count)
            if gap > worst:
                worst, where = gap, (shard.pipeline, label)
    return worst, where


def chi_squared(table: Sequence[Sequence[int]]) -> tuple[float, int]:
    """Pearson's chi-squared statistic of a contingency table (rows: shards, columns:
    classes) against independence, and its degrees of freedom."""
    rows = [sum(row) for row in table]
    columns = [sum(column) for column in zip(*table, strict=True)]
    total = sum(rows)
    statistic = 0.0
    for row, row_total in zip(table, rows, strict=True):
        for observed, column_total in zip(row, columns, strict=True):
            expected = row_total * column_total / total
            if expected:
                statistic += (observed - expected) ** 2 / expected
    return statistic, (len(rows) - 1) * (len(columns) - 1)


def chi_squared_survival(statistic: float, degrees: int) -> float:
    """P(X >= statistic) for X chi-squared with `degrees` degrees of freedom: the
    regularized upper incomplete gamma function Q(degrees / 2, statistic / 2), by its
    series below a + 1 and its continued fraction above (Numerical Recipes, 6.2)."""
    if degrees < 1 or statistic <= 0:
        return 1.0
    a, x = degrees / 2, statistic / 2
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1 / a
        for n in range(1, 1000):
            term *= x / (a + n)
            total += term
            if term < total * 1e-15:
                break
        return max(0.0, 1 - total * math.exp(log_front))
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for n in range(1, 1000):
        an = -n * (n - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        step = d * c
        h *= step
        if abs(step - 1) < 1e-15:
            break
    return min(1.0, math.exp(log_front) * h)


# ---- files --------------------------------------------------------------------------------

def partition_json(partition: Partition) -> str:
    data = asdict(partition)
    for shard in data["shards"]:
        del shard["samples"]  # (in the shard's own file)
        shard["size"] = len(next(s for s in partition.shards
                                 if s.pipeline == shard["pipeline"]).samples)
    return json.dumps({"kind": KIND, "schema_version": SCHEMA_VERSION, **data}, indent=1) + "\n"


def partition_files(partition: Partition) -> dict[str, str]:
    """Every file of the partition by name: the manifest and one index file per shard."""
    files = {MANIFEST: partition_json(partition)}
    for shard in partition.shards:
        files[shard.file] = "".join(f"{i}\n" for i in shard.samples)
    return files


def read_partition(path: Path) -> Partition:
    """A partition as `partition_files` wrote it (`path`: its folder or manifest); errors
    name the file at fault."""
    manifest = path / MANIFEST if path.is_dir() else path
    try:
        data = json.loads(manifest.read_text())
    except OSError as exc:
        raise PlannerError("bad-path", f"Cannot read partition {str(manifest)!r}: "
                           f"{exc.strerror or exc}.", ["make it with `planner partition`"]
                           ) from None
    except json.JSONDecodeError as exc:
        raise PlannerError("bad-data", f"{manifest}: not JSON ({exc.msg}).") from None
    if not isinstance(data, dict) or data.get("kind") != KIND or data.get(
            "schema_version") != SCHEMA_VERSION:
        raise PlannerError("bad-data", f"{manifest} is not a partition (schema_version "
                           f"{SCHEMA_VERSION}) that `planner partition` writes.")
    shards = []
    for entry in data["shards"]:
        index_file = manifest.parent / entry["file"]
        try:
            samples = tuple(int(line) for line in index_file.read_text().split())
        except (OSError, ValueError) as exc:
            raise PlannerError("bad-data", f"Index file {str(index_file)!r} of the partition "
                               f"cannot be read as one sample index a line ({exc}).") from None
        if len(samples) != entry["size"]:
            raise PlannerError("bad-data", f"Index file {str(index_file)!r} holds "
                               f"{len(samples)} samples; the partition says {entry['size']}.",
                               ["make the partition again"])
        shards.append(Shard(pipeline=entry["pipeline"], share=entry["share"],
                            file=entry["file"], samples=samples, classes=entry["classes"]))
    body = {k: v for k, v in data.items() if k not in ("kind", "schema_version", "shards")}
    return Partition(**body, shards=tuple(shards))
