"""Plan summaries and differences: what `planner compare`, `planner what-if` and the
interactive session show side by side.

    rows = compare([plan_a, plan_b])       # one Row per figure, values per plan
    changes = diff(old_plan, new_plan)     # only the rows that differ

Each figure has a direction (lower or higher is better, or neither for
structure) so a renderer can colour an improvement green and a regression red.
Cost is device time: device-seconds per step and device-hours per million
samples; with prices (dollars per device-hour by device type) also dollars.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from planner.errors import PlannerError
from planner.sync import convergence_risk
from planner.types import Plan
from planner.units import fmt_bytes, fmt_rate, fmt_seconds

LOWER, HIGHER, NEUTRAL = "lower", "higher", "neutral"
SAME = 5e-4  # relative differences below this (0.05%) count as equal


def _span(values: Sequence[object]) -> str:
    """'2' when all equal, else the distinct values in order: '2, 3'."""
    seen: list[object] = []
    for v in values:
        if v not in seen:
            seen.append(v)
    return ", ".join(str(v) for v in seen)


def _count_types(plan: Plan) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in plan.pipelines:
        for s in p.stages:
            out[s.device_type] = out.get(s.device_type, 0) + s.tp
    return out


def memory_headroom(plan: Plan) -> tuple[float, float, str]:
    """(smallest free bytes on any used device, its fraction of capacity, where)."""
    best: tuple[float, float, str] | None = None
    for p in plan.pipelines:
        for s in p.stages:
            capacity = plan.cluster.node(s.devices.node).device.memory
            free = capacity - s.memory.total
            item = (free, free / capacity, f"pipeline {p.index} stage {s.index} "
                    f"({s.devices.node})")
            if best is None or item[0] < best[0]:
                best = item
    return best if best is not None else (0.0, 0.0, "-")


MAX_PRICE = 1e6  # dollars per device-hour (1e308 made the cost table infinite)


def parse_prices(items: Sequence[str] | None) -> dict[str, float]:
    """`TYPE=DOLLARS_PER_HOUR` items (device type names as `planner devices` lists)."""
    prices: dict[str, float] = {}
    given: dict[str, str] = {}
    for item in items or []:
        kind, sep, value = item.partition("=")
        priced = parse_price(kind, value) if sep else None
        if priced is None:
            shaped = sep and kind.strip() and _is_number(value)
            raise PlannerError("bad-option", f"--price {item!r}: " + (
                f"{value.strip()} is not a price (dollars per device-hour, 0 to "
                f"{MAX_PRICE:,.0f})."
                if shaped else "must look like TYPE=DOLLARS, dollars per device-hour, e.g. "
                "--price A100-80G-SXM=2.5."))
        if priced[0] in given:
            raise PlannerError("bad-option", f"--price names {priced[0]} twice ("
                               f"{given[priced[0]]!r}, then {item!r}).",
                               ["give each device type's price once"])
        given[priced[0]] = item
        prices[priced[0]] = priced[1]
    return prices


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_price(kind: str, value: str) -> tuple[str, float] | None:
    """A device type (catalog names canonicalised) and its finite, non-negative dollars
    per device-hour, or None if either is missing or not a price."""
    from cost_models import catalog

    try:
        price = float(value)
    except ValueError:
        return None
    if not kind.strip() or not 0 <= price <= MAX_PRICE:  # (NaN too)
        return None
    try:
        return catalog.device(kind.strip()).name, price
    except PlannerError:
        return kind.strip(), price


def dollars_per_hour(plan: Plan, prices: Mapping[str, float]) -> float | None:
    """What the used devices cost per hour; None when a used type has no price."""
    total = 0.0
    for kind, count in _count_types(plan).items():
        price = prices.get(kind, prices.get(kind.split("@")[0]))
        if price is None:
            return None
        total += price * count
    return total


@dataclass(frozen=True)
class Figure:
    key: str
    label: str
    better: str  # LOWER, HIGHER or NEUTRAL
    value: Callable[[Plan, Mapping[str, float]], object]
    fmt: Callable[[object], str] = str


def _pct(v: object) -> str:
    return "-" if v is None else f"{float(v):.1%}"  # type: ignore[arg-type]


def _secs(v: object) -> str:
    if v is None:
        return "-"
    value = float(v)  # type: ignore[arg-type]
    return fmt_seconds(0.0 if abs(value) < 1e-12 else value)


def _num(v: object) -> str:
    return "-" if v is None else f"{float(v):,.1f}"  # type: ignore[arg-type]


def _money(v: object) -> str:
    return "-" if v is None else f"${float(v):,.2f}"  # type: ignore[arg-type]


def _tokens(plan: Plan, _: Mapping[str, float]) -> float | None:
    return plan.prediction.tokens_per_s


def _device_hours(plan: Plan, _: Mapping[str, float]) -> float:
    step = plan.prediction.step_time
    return plan.num_devices * step / plan.training.global_batch * 1e6 / 3600


def _dollars(plan: Plan, prices: Mapping[str, float]) -> float | None:
    rate = dollars_per_hour(plan, prices) if prices else None
    if rate is None:
        return None
    return rate * plan.prediction.step_time / plan.training.global_batch * 1e6 / 3600


FIGURES: tuple[Figure, ...] = (
    Figure("model", "model", NEUTRAL, lambda p, _: p.model.describe()),
    Figure("cluster", "cluster", NEUTRAL, lambda p, _: p.cluster.name),
    Figure("cluster_devices", "devices in cluster", NEUTRAL,
           lambda p, _: p.cluster.num_devices),
    Figure("network", "network", NEUTRAL, lambda p, _: fmt_rate(p.cluster.network.bandwidth)),
    Figure("devices_used", "devices used", NEUTRAL, lambda p, _: p.num_devices),
    Figure("device_types", "used devices by type", NEUTRAL,
           lambda p, _: ", ".join(f"{n} {t}" for t, n in sorted(_count_types(p).items()))),
    Figure("global_batch", "global batch", NEUTRAL, lambda p, _: p.training.global_batch),
    Figure("seq_len", "sequence length", NEUTRAL, lambda p, _: p.training.seq_len or "-"),
    Figure("dtype", "dtype", NEUTRAL, lambda p, _: p.training.dtype),
    Figure("pipelines", "pipelines", NEUTRAL, lambda p, _: len(p.pipelines)),
    Figure("stages", "stages per pipeline", NEUTRAL,
           lambda p, _: _span([len(x.stages) for x in p.pipelines])),
    Figure("tp", "tensor parallel", NEUTRAL,
           lambda p, _: _span([s.tp for x in p.pipelines for s in x.stages])),
    Figure("micro_batch", "micro-batch", NEUTRAL,
           lambda p, _: _span([x.micro_batch for x in p.pipelines])),
    Figure("microbatches", "micro-batches per pipeline", NEUTRAL,
           lambda p, _: _span(sorted({x.num_microbatches for x in p.pipelines},
                                     reverse=True))),
    Figure("schedule", "schedule", NEUTRAL,
           lambda p, _: _span([x.schedule.value for x in p.pipelines])),
    Figure("recompute", "recompute", NEUTRAL,
           lambda p, _: _span([s.recompute.value for x in p.pipelines for s in x.stages])),
    Figure("zero", "ZeRO", NEUTRAL,
           lambda p, _: _span([s.zero for x in p.pipelines for s in x.stages])),
    Figure("step_time", "step time", LOWER, lambda p, _: p.prediction.step_time, _secs),
    Figure("samples_per_s", "samples/s", HIGHER, lambda p, _: p.prediction.samples_per_s, _num),
    Figure("tokens_per_s", "tokens/s", HIGHER, _tokens,
           lambda v: "-" if v is None else f"{float(v):,.0f}"),  # type: ignore[arg-type]
    Figure("mfu", "MFU", HIGHER, lambda p, _: p.prediction.mfu, _pct),
    Figure("compute", "compute", LOWER, lambda p, _: p.prediction.compute, _secs),
    Figure("bubble", "bubble", LOWER, lambda p, _: p.prediction.bubble, _secs),
    Figure("tp_comm", "tp comm", LOWER, lambda p, _: p.prediction.tp_comm, _secs),
    Figure("pp_comm", "pp comm", LOWER, lambda p, _: p.prediction.pp_comm, _secs),
    Figure("dp_comm", "dp comm", LOWER, lambda p, _: p.prediction.dp_comm, _secs),
    Figure("sync", "gradient sync", NEUTRAL, lambda p, _: p.training.sync.describe()),
    Figure("sync_saved", "sync saved / step", HIGHER, lambda p, _: p.prediction.sync_saved,
           _secs),
    Figure("convergence_risk", "convergence risk", NEUTRAL,
           lambda p, _: convergence_risk(p)),
    Figure("optimizer", "optimizer", LOWER, lambda p, _: p.prediction.optimizer, _secs),
    Figure("memory_headroom", "min memory headroom", HIGHER,
           lambda p, _: memory_headroom(p)[0],
           lambda v: fmt_bytes(float(v))),  # type: ignore[arg-type]
    Figure("memory_headroom_fraction", "min headroom share", HIGHER,
           lambda p, _: memory_headroom(p)[1], _pct),
    Figure("device_seconds", "device-seconds / step", LOWER,
           lambda p, _: p.num_devices * p.prediction.step_time,
           lambda v: f"{float(v):,.4g}"),  # type: ignore[arg-type]
    Figure("device_hours_per_m", "device-hours / 1M samples", LOWER, _device_hours,
           lambda v: f"{float(v):,.4g}"),  # type: ignore[arg-type]
    Figure("dollars_per_m", "$ / 1M samples", LOWER, _dollars, _money),
    Figure("solver", "solver", NEUTRAL, lambda p, _: p.solver.status),
)


@dataclass(frozen=True)
class Row:
    """One figure across plans: raw values, their text, and how each compares with
    the first plan (None for the first, or when the figure has no direction)."""

    key: str
    label: str
    better: str
    values: tuple[object, ...]
    texts: tuple[str, ...]
    changes: tuple[float | None, ...]  # relative change against the first plan
    verdicts: tuple[str, ...]  # "", "same", "better", "worse", "changed"

    @property
    def differs(self) -> bool:
        return any(v not in ("", "same") for v in self.verdicts)


def _verdict(figure: Figure, base: object, value: object) -> tuple[float | None, str]:
    if value == base:
        return 0.0 if isinstance(value, (int, float)) else None, "same"
    if figure.better == NEUTRAL or not isinstance(value, (int, float)) \
            or not isinstance(base, (int, float)):
        return None, "changed"
    # a base of float noise (a bubble of 1e-15 s) has no meaningful relative change
    change = (value - base) / abs(base) if abs(base) > 1e-9 * abs(value) else None
    if abs(value - base) <= max(SAME * max(abs(base), abs(value)), 1e-12):
        return 0.0, "same"
    improved = value < base if figure.better == LOWER else value > base
    return change, "better" if improved else "worse"


def compare(plans: Sequence[Plan], prices: Mapping[str, float] | None = None) -> list[Row]:
    """Every figure for every plan, judged against the first plan."""
    if not plans:
        raise PlannerError("bad-option", "Nothing to compare: give at least one plan.")
    prices = prices or {}
    rows = []
    for f in FIGURES:
        if f.key == "dollars_per_m" and not prices:
            continue
        if f.key == "tokens_per_s" and all(p.prediction.tokens_per_s is None for p in plans):
            continue
        values = tuple(f.value(p, prices) for p in plans)
        judged = [(None, "")] + [_verdict(f, values[0], v) for v in values[1:]]
        rows.append(Row(key=f.key, label=f.label, better=f.better, values=values,
                        texts=tuple(f.fmt(v) for v in values),
                        changes=tuple(c for c, _ in judged),
                        verdicts=tuple(v for _, v in judged)))
    return rows


def diff(old: Plan, new: Plan, prices: Mapping[str, float] | None = None,
         keys: Sequence[str] | None = None) -> list[Row]:
    """The rows where `new` differs from `old` (always step time, throughput and cost)."""
    always = {"step_time", "samples_per_s", "device_hours_per_m", "dollars_per_m"}
    rows = compare([old, new], prices)
    return [r for r in rows if (keys is None or r.key in keys)
            and (r.differs or r.key in always)]


def headline(old: Plan, new: Plan) -> str:
    """`step time 843 µs -> 612 µs (-27.4%), 75,906 -> 104,575 samples/s (+37.8%)`."""
    a, b = old.prediction, new.prediction
    dt = (b.step_time - a.step_time) / a.step_time
    ds = (b.samples_per_s - a.samples_per_s) / a.samples_per_s
    return (f"step time {fmt_seconds(a.step_time)} -> {fmt_seconds(b.step_time)} "
            f"({percent_change(dt)}), {a.samples_per_s:,.0f} -> {b.samples_per_s:,.0f} "
            f"samples/s ({percent_change(ds)})")


def percent_change(fraction: float) -> str:
    """`+6.9%`, `-52.7%`; a change too small to show `0.0%`, not `-0.0%` (float noise)."""
    text = f"{fraction:+.1%}"
    return text[1:] if text[1:] == "0.0%" else text


def speedup(ratio: float) -> str:
    """How a plan compares with one taking `ratio` times its step: `1.85x faster`,
    `1.20x slower`, or `as fast` where the factor rounds to 1.00."""
    factor = f"{max(ratio, 1 / ratio):.2f}"
    if factor == "1.00":
        return "as fast"
    return f"{factor}x {'faster' if ratio > 1 else 'slower'}"


def rows_json(rows: Sequence[Row]) -> list[dict]:
    return [{"key": r.key, "label": r.label, "better": r.better,
             "values": [v if isinstance(v, (int, float, str)) or v is None else str(v)
                        for v in r.values],
             "texts": list(r.texts), "changes": list(r.changes), "verdicts": list(r.verdicts)}
            for r in rows]


def same_structure(a: Plan, b: Plan) -> bool:
    """Whether two plans put the same stages on the same devices."""
    def shape(p: Plan) -> tuple:
        return tuple((x.micro_batch, x.num_microbatches, x.schedule, x.interleave,
                      tuple((s.layers, s.chunks, s.devices, s.tp, s.recompute, s.zero)
                            for s in x.stages)) for x in p.pipelines)
    return shape(a) == shape(b)
