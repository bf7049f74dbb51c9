"""Data profiles: the distribution of per-sample token counts (`planner data-profile`).

Real batches are not uniform: sequence lengths are heavy-tailed and multimodal samples
carry different numbers of image tokens. A plan priced for the mean sample leaves
pipelines waiting on the heaviest micro-batch, so the packer (`packing.py`) and the
benchmark price steps drawn from the distribution instead.

Samples come from a JSONL file, one sample a line: a number (its tokens), or an object
with `tokens` (or `length`, or `input_ids`: a list whose length counts), optionally
`image_tokens` (a multimodal sample's image tokens, which the language model sees as
part of its sequence) and `label` (its class, for `planner partition`). Or from a data
hook (`--data package.module:function`, as the runtime calls it): each sample's length
is the number of its targets the loss counts (not the ignored index).

The profile (JSON, `kind` "data-profile", schema_version 1) keeps the count, mean,
standard deviation, extremes, the mean of the squared length (attention's quadratic
term prices it), a quantile table dense in the tail (from it `draw_lengths` draws
samples of the same distribution), a histogram on geometric bins, image tokens and
labels where the samples have them.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from planner.errors import PlannerError

SCHEMA_VERSION = 1
KIND = "data-profile"
# quantile levels: every percent, then the tail more finely (a heavy tail's top percent
# holds the samples that set a step's longest micro-batch)
LEVELS = tuple([i / 100 for i in range(100)] + [0.995, 0.999, 0.9999, 1.0])
HISTOGRAM_BINS = 20


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One sample as the profile counts it: text tokens, image tokens and its class."""

    tokens: int
    image_tokens: int = 0
    label: str | None = None

    @property
    def length(self) -> int:
        """The sequence the model sees: text and image tokens together."""
        return self.tokens + self.image_tokens


@dataclass(frozen=True, kw_only=True)
class Histogram:
    """Samples per bin: bin i holds lengths in [edges[i], edges[i + 1]) (the last bin
    its upper edge too); edges grow geometrically, as heavy tails need."""

    edges: tuple[int, ...]
    counts: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class DataProfile:
    """The distribution of sample lengths (tokens the model sees per sample)."""

    source: str
    count: int
    total_tokens: int
    mean: float
    std: float
    min: int
    max: int
    mean_square: float  # mean of length squared: attention's quadratic term per sample
    levels: tuple[float, ...]  # quantile levels, 0 to 1
    quantiles: tuple[float, ...]  # the lengths at those levels
    histogram: Histogram
    top_share: float  # share of all tokens in the longest 1% of samples
    image_samples: int = 0  # samples with image tokens
    image_tokens: int = 0  # all samples' image tokens
    labels: dict[str, int] = field(default_factory=dict)  # samples per class

    def quantile(self, level: float) -> float:
        """The length at `level` (0 to 1), interpolated in the quantile table."""
        return _interpolate(self.levels, self.quantiles, level)


def _interpolate(levels: Sequence[float], values: Sequence[float], level: float) -> float:
    level = min(max(level, 0.0), 1.0)
    for i in range(1, len(levels)):
        if level <= levels[i]:
            low, high = levels[i - 1], levels[i]
            weight = (level - low) / (high - low) if high > low else 1.0
            return values[i - 1] + weight * (values[i] - values[i - 1])
    return values[-1]


def summarize(samples: Sequence[Sample], source: str) -> DataProfile:
    """The profile of `samples` (at least one, each at least one token long)."""
    if not samples:
        raise PlannerError("bad-data", f"{source}: no samples to profile.",
                           ["give a file with one sample a line, or a data hook that "
                            "returns samples"])
    lengths = sorted(s.length for s in samples)
    if lengths[0] < 1:
        raise PlannerError("bad-data", f"{source}: a sample has no tokens; every sample "
                           "needs at least one the loss counts.",
                           ["leave empty samples out of the data"])
    count = len(lengths)
    total = sum(lengths)
    mean = total / count
    variance = sum((n - mean) ** 2 for n in lengths) / count
    top = lengths[count - max(1, math.ceil(count / 100)):]
    labels = Counter(s.label for s in samples if s.label is not None)
    return DataProfile(
        source=source, count=count, total_tokens=total, mean=mean, std=math.sqrt(variance),
        min=lengths[0], max=lengths[-1], mean_square=sum(n * n for n in lengths) / count,
        levels=LEVELS, quantiles=tuple(_quantile(lengths, q) for q in LEVELS),
        histogram=histogram(lengths), top_share=sum(top) / total,
        image_samples=sum(1 for s in samples if s.image_tokens),
        image_tokens=sum(s.image_tokens for s in samples),
        labels=dict(sorted(labels.items())))


def _quantile(ordered: Sequence[int], level: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    position = level * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (position - low) * (ordered[high] - ordered[low])


def histogram(ordered: Sequence[int], bins: int = HISTOGRAM_BINS) -> Histogram:
    """Counts of the sorted lengths on up to `bins` geometric bins from the least to
    the greatest (fewer where whole-token edges coincide)."""
    low, high = ordered[0], ordered[-1]
    ratio = (high / low) ** (1 / bins) if high > low else 1.0
    edges = sorted({*(round(low * ratio**i) for i in range(bins)), high + 1})
    counts = [0] * (len(edges) - 1)
    at = 0
    for length in ordered:
        while length >= edges[at + 1]:
            at += 1
        counts[at] += 1
    return Histogram(edges=tuple(edges), counts=tuple(counts))


def draw_lengths(profile: DataProfile, count: int, rng: random.Random) -> list[int]:
    """`count` lengths drawn from the profile's distribution (inverse transform sampling
    of its quantile table), each between its least and greatest."""
    return [min(profile.max, max(profile.min, round(profile.quantile(rng.random()))))
            for _ in range(count)]


def lognormal_lengths(count: int, *, median: float, sigma: float, low: int, high: int,
                      rng: random.Random) -> list[int]:
    """`count` lengths of a lognormal distribution (heavy-tailed, as token counts of
    documents are), rounded and clipped to [low, high]."""
    return [min(high, max(low, round(rng.lognormvariate(math.log(median), sigma))))
            for _ in range(count)]


# ---- reading samples ------------------------------------------------------------------

def read_samples(path: Path) -> list[Sample]:
    """The samples of a JSONL file (see the module docstring); errors name the line."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise PlannerError("bad-path", f"Cannot read {str(path)!r}: "
                           f"{exc.strerror or exc}.", ["check the path"]) from None
    samples = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            samples.append(_sample(line, f"{path}:{number}"))
    return samples


def _sample(line: str, where: str) -> Sample:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PlannerError("bad-data", f"{where}: not JSON ({exc.msg}).",
                           ["write one sample a line: a number of tokens, or an object "
                            'such as {"tokens": 812, "image_tokens": 576, "label": "cat"}']
                           ) from None
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"tokens", "length", "input_ids", "image_tokens",
                                       "label"})
        if unknown:
            raise PlannerError("bad-data", f"{where}: unknown field(s) {', '.join(unknown)}; "
                               "a sample has tokens (or length, or input_ids), image_tokens "
                               "and label.")
        given = [k for k in ("tokens", "length", "input_ids") if k in value]
        if len(given) != 1:
            raise PlannerError("bad-data", f"{where}: give the sample's tokens in one of the "
                               "fields tokens, length or input_ids (got "
                               f"{', '.join(given) or 'none'}).")
        tokens = value[given[0]]
        if given[0] == "input_ids":
            if not isinstance(tokens, list):
                raise PlannerError("bad-data", f"{where}: input_ids must be a list of token "
                                   f"ids (got {type(tokens).__name__}).")
            tokens = len(tokens)
        images = value.get("image_tokens", 0)
        label = value.get("label")
        if isinstance(label, bool) or not isinstance(label, (str, int, type(None))):
            raise PlannerError("bad-data", f"{where}: label must be a string or an integer "
                               f"(got {json.dumps(label)}).")
        return Sample(tokens=_count(tokens, given[0], where),
                      image_tokens=_count(images, "image_tokens", where),
                      label=None if label is None else str(label))
    return Sample(tokens=_count(value, "the sample", where))


def _count(value: Any, what: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PlannerError("bad-data", f"{where}: {what} must be a whole number of tokens, "
                           f"0 or more (got {json.dumps(value)}).")
    return value


def hook_samples(target: str, *, steps: int, global_batch: int, seq_len: int | None,
                 seed: int) -> list[Sample]:
    """The samples a data hook gives for steps 0 .. steps-1, each `global_batch` samples
    (called as the runtime calls it); a sample's tokens are its targets the loss counts.
    A hook may return each sample's tensors in a list (variable lengths) or stacked."""
    import torch

    from planner.runtime.data import IGNORED_TARGET, load_hook

    if steps < 1 or global_batch < 1:
        raise PlannerError("bad-option", f"--steps and --global-batch must be at least 1 "
                           f"(got {steps} and {global_batch}).")
    hook = load_hook(target)
    samples = []
    for step in range(steps):
        try:
            made = hook(step, 0, global_batch, seq_len=seq_len, seed=seed)
        except Exception as exc:
            raise PlannerError("bad-data", f"Data hook {target!r} raised "
                               f"{type(exc).__name__}: {exc} (step {step}, samples "
                               f"0-{global_batch}).",
                               ["run the hook by hand with those arguments"]) from exc
        if not isinstance(made, tuple) or len(made) != 2:
            raise PlannerError("bad-data", f"Data hook {target!r} must return (inputs, "
                               f"targets); it returned {type(made).__name__}.")
        targets = made[1]
        rows = list(targets) if isinstance(targets, (list, tuple)) else None
        if rows is None and isinstance(targets, torch.Tensor) and targets.dim() >= 1:
            rows = list(targets)
        if rows is None or len(rows) != global_batch:
            raise PlannerError("bad-data", f"Data hook {target!r} returned targets that are "
                               f"not {global_batch} samples (step {step}): give a tensor with "
                               "a row per sample, or a list of one tensor per sample.")
        for row in rows:
            counted = row[row != IGNORED_TARGET] if isinstance(row, torch.Tensor) else None
            if counted is None:
                raise PlannerError("bad-data", f"Data hook {target!r} returned a target of "
                                   f"type {type(row).__name__} (step {step}); give tensors.")
            samples.append(Sample(tokens=int(counted.numel())))
    return samples


# ---- profile files ----------------------------------------------------------------------

def profile_json(profile: DataProfile) -> str:
    return json.dumps({"kind": KIND, "schema_version": SCHEMA_VERSION, **asdict(profile)},
                      indent=1) + "\n"


def read_profile(path: Path) -> DataProfile:
    """A data profile file as `profile_json` writes it; errors name the file and field."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise PlannerError("bad-path", f"Cannot read data profile {str(path)!r}: "
                           f"{exc.strerror or exc}.", ["check the path"]) from None
    except json.JSONDecodeError as exc:
        raise PlannerError("bad-data", f"{path}: not JSON ({exc.msg}, line {exc.lineno}).",
                           ["write it with `planner data-profile ... -o FILE`"]) from None
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise PlannerError("bad-data", f"{path} is not a data profile (kind "
                           f"{data.get('kind') if isinstance(data, dict) else None!r}).",
                           ["write one with `planner data-profile SAMPLES.jsonl -o FILE`"])
    if data.get("schema_version") != SCHEMA_VERSION:
        raise PlannerError("bad-data", f"{path}: data profile schema_version "
                           f"{data.get('schema_version')!r}; this planner reads "
                           f"{SCHEMA_VERSION}.", ["profile the data again"])
    body = {k: v for k, v in data.items() if k not in ("kind", "schema_version")}
    try:
        body["histogram"] = Histogram(edges=tuple(body["histogram"]["edges"]),
                                      counts=tuple(body["histogram"]["counts"]))
        body["levels"], body["quantiles"] = tuple(body["levels"]), tuple(body["quantiles"])
        profile = DataProfile(**body)
    except (KeyError, TypeError) as exc:
        raise PlannerError("bad-data", f"{path}: data profile field {exc} is missing or "
                           "unknown.", ["profile the data again"]) from None
    ordered = list(profile.quantiles)
    if (len(profile.levels) != len(ordered) or len(ordered) < 2 or ordered != sorted(ordered)
            or profile.levels[0] != 0 or profile.levels[-1] != 1 or profile.min < 1):
        raise PlannerError("bad-data", f"{path}: the quantile table (levels, quantiles) "
                           "must rise from level 0 to 1 over lengths of at least 1 token.",
                           ["profile the data again"])
    return profile
