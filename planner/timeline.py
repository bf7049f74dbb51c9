"""The timeline of one training step of a plan: data, terminal chart and SVG.

    timeline = build_timeline(plan, layers, costs)   # simulate.simulate per pipeline
    rows = text_rows(timeline, width=100)           # (label, [(text, kind), ...]) per lane
    svg = to_svg(timeline)                          # a self-contained <svg> document

A lane is one stage's devices (its tensor-parallel group acts as one), or the
link after a stage when sending over it takes time. Pipelines whose stages
have identical timings and micro-batch counts run identical timelines; they
share lanes (the lane lists every device it stands for) unless `group=False`.
Bars are compute (fwd, bwd), transfers (send, send-grad, on link lanes) and,
after the last backward, the gradient sync and optimizer step on every device.

Every chart names kinds of bar with `kind_name` and lists them with `legend`, so
the SVG, the HTML report and the terminal chart say the same. In SVG, bars too
narrow to tell apart (dozens of micro-batches) are merged into striped blocks
(`merge_narrow`), so a long step stays readable: warm-up, steady state, drain and
bubbles show; each block's tooltip counts the bars it holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

from cost_models.model import CostModel
from planner.simulate import BWD, FWD, OPTIMIZER, SEND, SEND_GRAD, SYNC, simulate
from planner.solver.predict import (
    loading_time,
    plan_contention,
    stage_timings,
    sync_and_optimizer,
    tail_sync,
)
from planner.solver.step import EVERY_STEP, NO_CONTENTION, Contention, overlappable, step_time
from planner.solver.timing import StageTiming
from planner.types import Layer, Plan, Recompute, Schedule, SyncSpec
from planner.units import fmt_seconds

KINDS = (FWD, BWD, SEND, SEND_GRAD, SYNC, OPTIMIZER)
COLORS = {FWD: "#4c78a8", BWD: "#54a24b", SEND: "#9ecae9", SEND_GRAD: "#88d27a",
          SYNC: "#eeca3b", OPTIMIZER: "#b279a2"}
NAMES = {FWD: "forward", BWD: "backward", SEND: "activation send",
         SEND_GRAD: "gradient send", SYNC: "gradient sync", OPTIMIZER: "optimizer step"}
FILL = {FWD: "▓", BWD: "█", SEND: ">", SEND_GRAD: "<", SYNC: "≈", OPTIMIZER: "o"}
IDLE = "·"

MAX_WIDTH = 2000  # columns of a terminal timeline (a million printed megabytes)
# SVG: bars narrower than this (pixels) carry no label, and a run of them reads as a
# strip of colour (64 micro-batches on a 750-pixel chart: 4 and 7 pixels), so
# touching ones are merged into one block
MIN_BAR_PX = 12.0
# idle time narrower than this does not show between bars: narrow bars merge across it
MIN_GAP_PX = 2.0


@dataclass(frozen=True)
class Lane:
    kind: str  # "device" or "link"
    pipelines: tuple[int, ...]
    stage: int  # the stage, or for a link the stage it leaves
    label: str
    device_type: str
    devices: tuple[str, ...]  # "node:index" of every device the lane stands for
    recompute: bool = False  # its stage recomputes activations in its backward


@dataclass(frozen=True)
class Bar:
    lane: int
    kind: str
    microbatch: int | None
    chunk: int | None
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    title: str
    step_time: float  # simulated
    predicted: float  # the plan's closed-form prediction
    lanes: tuple[Lane, ...]
    bars: tuple[Bar, ...]


def ranges(values: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out: list[str] = []
    items = sorted(set(values))
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        out.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(out)


@dataclass(frozen=True)
class Run:
    """Pipelines with identical timelines: what `lay_out` draws as one set of lanes."""

    pipelines: tuple[int, ...]
    stages: tuple[StageTiming, ...]
    microbatches: int
    device_types: tuple[str, ...]  # per stage, with " xN" for tensor parallelism
    devices: tuple[tuple[str, ...], ...]  # per stage: "node:index" of every device
    schedule: Schedule = Schedule.ONE_F_ONE_B
    interleave: int = 1
    recomputes: tuple[bool, ...] = ()  # per stage (none if empty)


def lay_out(runs: Sequence[Run], *, sync: float = 0.0, optimizer: float = 0.0,
            title: str = "", predicted: float = 0.0, policy: SyncSpec = EVERY_STEP,
            tail: float = 0.0, loading: float = 0.0,
            contention: Contention = NO_CONTENTION) -> Timeline:
    """Simulate each run (`planner.simulate`) and put its events on lanes; the gradient
    sync (paid as `policy` says, `step.py`: `tail`, its last bucket's all-reduce where it
    overlaps backward, slowed as `contention` says) and optimizer step follow the last
    backward of all runs, on every
    device, and the step's input, `loading` seconds of it, loaded (`step.fed`)."""
    lanes: list[Lane] = []
    bars: list[Bar] = []
    end = 0.0
    device_lanes: list[int] = []
    for run in runs:
        members = run.pipelines
        interleave = run.interleave if run.schedule is Schedule.INTERLEAVED else 1
        sim = simulate([run.stages], [run.microbatches], schedule=run.schedule,
                       interleave=interleave)
        end = max(end, sim.pipeline_times[0])
        tag = f"p{members[0]}" if len(members) == 1 else \
            f"p{ranges(members)} (x{len(members)})"
        device_lane: dict[int, int] = {}
        link_lane: dict[int, int] = {}
        links_used = {e.stage for e in sim.events if e.kind in (SEND, SEND_GRAD)
                      and e.end > e.start}
        for s, kind in enumerate(run.device_types):
            device_lane[s] = len(lanes)
            lanes.append(Lane(kind="device", pipelines=members, stage=s,
                              label=f"{tag} s{s} {kind}", device_type=kind.split(" x")[0],
                              devices=run.devices[s],
                              recompute=bool(run.recomputes) and run.recomputes[s]))
            if s in links_used:
                link_lane[s] = len(lanes)
                lanes.append(Lane(kind="link", pipelines=members, stage=s,
                                  label=f"{tag} link s{s}->s{(s + 1) % len(run.stages)}",
                                  device_type="", devices=()))
        for e in sim.events:
            lane = link_lane.get(e.stage) if e.kind in (SEND, SEND_GRAD) else \
                device_lane.get(e.stage)
            if lane is not None and e.kind in (FWD, BWD, SEND, SEND_GRAD):
                bars.append(Bar(lane, e.kind, e.microbatch, e.chunk, e.start, e.end))
        device_lanes += device_lane.values()
    step = step_time([end], sync, optimizer, policy=policy, loading=loading, tail=tail,
                     hidden=overlappable(t.bwd for run in runs for t in run.stages),
                     contention=contention)
    bars += [Bar(lane, phase.kind, None, None, phase.start, phase.end)
             for lane in device_lanes for phase in step.phases() if phase.seconds > 0]
    bars.sort(key=lambda b: (b.lane, b.start, b.end))
    return Timeline(title=title, step_time=step.total, predicted=predicted,
                    lanes=tuple(lanes), bars=tuple(bars))


def build_timeline(plan: Plan, layers: Sequence[Layer], costs: CostModel, *,
                   group: bool = True) -> Timeline:
    """Simulate one step of `plan` and lay its events out on lanes."""
    timings = stage_timings(plan, layers, costs)
    sync, optimizer = sync_and_optimizer(plan, layers, costs)
    groups: dict[tuple, list[int]] = {}
    for p, pipeline in enumerate(plan.pipelines):
        key = (tuple(timings[p]), pipeline.num_microbatches, pipeline.schedule,
               pipeline.interleave,
               tuple((s.device_type, s.tp, s.recompute) for s in pipeline.stages))
        groups.setdefault(key if group else (p,), []).append(p)
    runs = []
    for members in groups.values():
        rep = plan.pipelines[members[0]]
        runs.append(Run(
            pipelines=tuple(members), stages=tuple(timings[members[0]]),
            microbatches=rep.num_microbatches, schedule=rep.schedule,
            interleave=rep.interleave,
            device_types=tuple(s.device_type + (f" x{s.tp}" if s.tp > 1 else "")
                               for s in rep.stages),
            recomputes=tuple(s.recompute is not Recompute.NONE for s in rep.stages),
            devices=tuple(tuple(f"{plan.pipelines[m].stages[s].devices.node}:{d}"
                                for m in members
                                for d in plan.pipelines[m].stages[s].devices.devices)
                          for s in range(len(rep.stages)))))
    title = (f"{plan.model.describe()} on {plan.cluster.name}: one training step "
             f"(global batch {plan.training.global_batch})")
    return lay_out(runs, sync=sync, optimizer=optimizer, title=title,
                   predicted=plan.prediction.step_time, policy=plan.training.sync,
                   tail=tail_sync(plan, layers, costs), loading=loading_time(plan, costs),
                   contention=plan_contention(plan, costs))


def timeline_dict(timeline: Timeline) -> dict:
    return {"title": timeline.title, "step_time": timeline.step_time,
            "predicted_step_time": timeline.predicted,
            "lanes": [{"kind": lane.kind, "pipelines": list(lane.pipelines),
                       "stage": lane.stage, "label": lane.label,
                       "device_type": lane.device_type, "devices": list(lane.devices),
                       "recompute": lane.recompute}
                      for lane in timeline.lanes],
            "bars": [{"lane": b.lane, "kind": b.kind, "microbatch": b.microbatch,
                      "chunk": b.chunk, "start": b.start, "end": b.end}
                     for b in timeline.bars]}


def _label(bar: Bar) -> str:
    if bar.kind == FWD:
        return f"F{bar.microbatch}"
    if bar.kind == BWD:
        return f"B{bar.microbatch}"
    return {SYNC: "sync", OPTIMIZER: "opt"}.get(bar.kind, "")


def text_rows(timeline: Timeline, width: int = 100) -> list[tuple[str, list[tuple[str, str]]]]:
    """Each lane as `width` character cells, run-length grouped: (label, [(text, kind)]),
    kind "" for idle. Forward/backward bars wide enough carry their micro-batch."""
    width = max(10, width)
    total = timeline.step_time or 1.0
    by_lane: dict[int, list[Bar]] = {}
    for b in timeline.bars:
        by_lane.setdefault(b.lane, []).append(b)
    out = []
    for index, lane in enumerate(timeline.lanes):
        chars = [IDLE if lane.kind == "device" else " "] * width
        kinds = [""] * width
        owner = [-1] * width
        # sync and optimizer first: where a cell holds both, compute shows
        ordered = sorted(by_lane.get(index, []), key=lambda b: b.kind not in (SYNC, OPTIMIZER))
        spans = []
        for k, b in enumerate(ordered):
            c0 = min(width - 1, int(b.start / total * width))
            c1 = max(c0 + 1, min(width, round(b.end / total * width)))
            spans.append((c0, c1))
            for c in range(c0, c1):
                if lane.kind == "link" and kinds[c] and kinds[c] != b.kind:
                    chars[c] = "x"
                else:
                    chars[c] = FILL[b.kind]
                kinds[c] = b.kind
                owner[c] = k
        for k, (b, (c0, c1)) in enumerate(zip(ordered, spans, strict=True)):
            text = _label(b)
            run = 0
            while c0 + run < c1 and owner[c0 + run] == k:
                run += 1
            if text and run >= len(text) + 1:
                chars[c0:c0 + len(text)] = list(text)
        segments: list[tuple[str, str]] = []
        for ch, kind in zip(chars, kinds, strict=True):
            if segments and segments[-1][1] == kind:
                segments[-1] = (segments[-1][0] + ch, kind)
            else:
                segments.append((ch, kind))
        out.append((lane.label, segments))
    return out


def nice_ticks(total: float, count: int = 8) -> list[float]:
    """Round tick positions from 0 to about `total`."""
    if total <= 0:
        return [0.0]
    raw = total / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    ticks = []
    k = 0
    while k * step <= total * (1 + 1e-9):
        ticks.append(k * step)
        k += 1
    return ticks


def kind_name(kind: str, recompute: bool = False) -> str:
    """The one name of a kind of bar that every chart and tooltip gives; a backward
    says it includes recompute only where its stage recomputes."""
    return NAMES[kind] + (" (with recompute)" if recompute and kind == BWD else "")


def legend(timeline: Timeline) -> list[tuple[str, str]]:
    """(kind, name) of every kind of bar the timeline holds, in `KINDS` order: what
    each chart's legend lists."""
    present = {b.kind for b in timeline.bars}
    devices = [lane for lane in timeline.lanes if lane.kind == "device"]
    recomputing = [lane for lane in devices if lane.recompute]
    names = {BWD: (kind_name(BWD, True) if recomputing and len(recomputing) == len(devices)
                   else "backward (with recompute where a stage recomputes)" if recomputing
                   else kind_name(BWD))}
    return [(kind, names.get(kind, kind_name(kind))) for kind in KINDS if kind in present]


@dataclass(frozen=True)
class Block:
    """What the SVG draws as one bar: a bar of one lane wide enough to draw alone, or
    consecutive bars too narrow to tell apart, merged."""

    lane: int
    bars: tuple[Bar, ...]

    @property
    def start(self) -> float:
        return min(b.start for b in self.bars)

    @property
    def end(self) -> float:
        return max(b.end for b in self.bars)

    @property
    def kinds(self) -> tuple[str, ...]:
        present = {b.kind for b in self.bars}
        return tuple(kind for kind in KINDS if kind in present)

    @property
    def busy(self) -> float:
        """Seconds of the block some bar covers (link lanes' sends may overlap)."""
        covered, reached = 0.0, self.start
        for b in sorted(self.bars, key=lambda b: b.start):
            covered += max(0.0, b.end - max(b.start, reached))
            reached = max(reached, b.end)
        return covered


def merge_narrow(bars: Sequence[Bar], *, min_width: float, min_gap: float) -> list[Block]:
    """One lane's bars (sorted by start) as blocks to draw: a bar at least `min_width`
    seconds long stays alone; consecutive shorter ones merge while the idle time between
    them is under `min_gap` seconds (it would not show)."""
    groups: list[list[Bar]] = []
    reached = 0.0  # where the last group's bars end
    for bar in bars:
        last = groups[-1] if groups else []
        if (bar.end - bar.start < min_width and last
                and last[-1].end - last[-1].start < min_width
                and bar.start - reached < min_gap):
            last.append(bar)
            reached = max(reached, bar.end)
        else:
            groups.append([bar])
            reached = bar.end
    return [Block(lane=group[0].lane, bars=tuple(group)) for group in groups]


def _tooltip(block: Block, lane: Lane) -> str:
    span = f"{fmt_seconds(block.start)} to {fmt_seconds(block.end)}"
    if len(block.bars) == 1:
        (b,) = block.bars
        what = kind_name(b.kind, lane.recompute) + (
            f", micro-batch {b.microbatch}" if b.microbatch is not None else "") + (
            f", chunk {b.chunk}" if b.chunk else "")
        return f"{what}: {span}"
    counts = [(kind, sum(b.kind == kind for b in block.bars)) for kind in block.kinds]
    microbatches = [b.microbatch for b in block.bars if b.microbatch is not None]
    return (f"{len(block.bars)} bars too short to draw one by one: "
            + ", ".join(f"{n} {kind_name(kind, lane.recompute)}" for kind, n in counts)
            + (f", micro-batches {ranges(microbatches)}" if microbatches else "")
            + f"; {span}, busy {block.busy / (block.end - block.start):.0%}")


@dataclass(frozen=True)
class _Swatch:
    """A legend entry: its colours (stripes, top to bottom) and its text."""

    colors: tuple[str, ...]
    text: str


def _legend_rows(swatches: Sequence[_Swatch], left: float, right: float,
                 ) -> list[list[tuple[float, _Swatch]]]:
    """Legend entries placed left to right, wrapping before `right` (11 px text is
    about 6.2 px a character)."""
    rows: list[list[tuple[float, _Swatch]]] = [[]]
    x = left
    for swatch in swatches:
        step = 14 + 6.2 * len(swatch.text) + 14
        if rows[-1] and x + step > right:
            rows.append([])
            x = left
        rows[-1].append((x, swatch))
        x += step
    return rows


def _stripes(x: float, y: float, width: float, height: float,
             colors: Sequence[str]) -> str:
    each = height / len(colors)
    return "".join(f'<rect x="{x:.2f}" y="{y + k * each:.2f}" width="{width:.2f}" '
                   f'height="{each:.2f}" fill="{color}"/>' for k, color in enumerate(colors))


def to_svg(timeline: Timeline, *, width: int = 1100, standalone: bool = True) -> str:
    """The timeline as SVG text: no scripts, fonts or links, tooltips as <title>. Bars
    too narrow to draw one by one are merged (`merge_narrow`), striped by kind."""
    label_w, chart_w = 330, max(200, width - 330 - 20)
    total = timeline.step_time or 1.0
    per_px = total / chart_w
    by_lane: dict[int, list[Bar]] = {}
    for b in timeline.bars:
        by_lane.setdefault(b.lane, []).append(b)
    blocks = [block for lane in sorted(by_lane) for block in merge_narrow(
        by_lane[lane], min_width=MIN_BAR_PX * per_px, min_gap=MIN_GAP_PX * per_px)]
    swatches = [_Swatch((COLORS[kind],), name) for kind, name in legend(timeline)]
    if any(len(block.bars) > 1 for block in blocks):
        swatches.append(_Swatch(tuple(COLORS[kind] for kind in (FWD, BWD)),
                                "striped: bars too short to draw one by one, merged "
                                "(their kinds; hover for counts)"))
    legend_rows = _legend_rows(swatches, label_w, width - 10)
    lane_h, link_h, gap = 22, 10, 4
    top = 38 + 16 * len(legend_rows) + 4
    heights = [lane_h if lane.kind == "device" else link_h for lane in timeline.lanes]
    ys = []
    y = top
    for h in heights:
        ys.append(y)
        y += h + gap
    height = y + 36

    def x(t: float) -> float:
        return label_w + t / total * chart_w

    parts = []
    xmlns = ' xmlns="http://www.w3.org/2000/svg"' if standalone else ""
    parts.append(f'<svg{xmlns} width="{width}" height="{height}" viewBox="0 0 {width} '
                 f'{height}" font-family="sans-serif" font-size="11" role="img">')
    parts.append(f"<title>{escape(timeline.title)}</title>")
    parts.append('<rect x="0" y="0" width="100%" height="100%" fill="#ffffff"/>')
    parts.append(f'<text x="8" y="16" font-size="13" font-weight="bold">'
                 f"{escape(timeline.title)}</text>")
    parts.append(f'<text x="8" y="32">simulated step {escape(fmt_seconds(timeline.step_time))}'
                 f" (closed-form prediction {escape(fmt_seconds(timeline.predicted))})</text>")
    for row, entries in enumerate(legend_rows):
        for lx, swatch in entries:
            ly = 38 + 16 * row
            parts.append(f'<g class="legend">{_stripes(lx, ly, 10, 10, swatch.colors)}'
                         f'<text x="{lx + 14:.1f}" y="{ly + 9}">{escape(swatch.text)}</text></g>')
    for tick in nice_ticks(total):
        tx = x(tick)
        parts.append(f'<line x1="{tx:.1f}" y1="{top - 4}" x2="{tx:.1f}" y2="{y}" '
                     'stroke="#dddddd"/>')
        parts.append(f'<text x="{tx:.1f}" y="{y + 14}" text-anchor="middle">'
                     f"{escape(fmt_seconds(tick)) if tick else '0'}</text>")
    for i, lane in enumerate(timeline.lanes):
        h = heights[i]
        devices = ", ".join(lane.devices) if lane.devices else "link between stages"
        parts.append(f'<g class="lane" data-kind="{lane.kind}" data-stage="{lane.stage}" '
                     f"data-devices={quoteattr(' '.join(lane.devices))}>")
        parts.append(f"<title>{escape(lane.label)}: {escape(devices)}"
                     f"{'; recomputes activations' if lane.recompute else ''}</title>")
        parts.append(f'<rect x="{label_w}" y="{ys[i]}" width="{chart_w}" height="{h}" '
                     f'fill="{"#f4f4f4" if lane.kind == "device" else "#fbfbfb"}"/>')
        parts.append(f'<text x="{label_w - 6}" y="{ys[i] + h / 2 + 4:.1f}" '
                     f'text-anchor="end" font-size="{11 if lane.kind == "device" else 9}">'
                     f"{escape(lane.label)}</text>")
        parts.append("</g>")
    for block in blocks:
        i = block.lane
        h = heights[i]
        x0, x1 = x(block.start), x(block.end)
        tip = escape(_tooltip(block, timeline.lanes[i]))
        kinds = " ".join(block.kinds)
        if len(block.bars) > 1:
            parts.append(f'<g class="bar" data-kind="{kinds}" data-count="{len(block.bars)}">'
                         f"<title>{tip}</title>"
                         + _stripes(x0, ys[i] + 1, max(0.5, x1 - x0), h - 2,
                                    [COLORS[kind] for kind in block.kinds]) + "</g>")
            continue
        (b,) = block.bars
        parts.append(f'<rect class="bar" x="{x0:.2f}" y="{ys[i] + 1}" '
                     f'width="{max(0.5, x1 - x0):.2f}" height="{h - 2}" fill="{COLORS[b.kind]}" '
                     f'stroke="#ffffff" stroke-width="0.5" data-kind="{b.kind}" data-count="1">'
                     f"<title>{tip}</title></rect>")
        label = _label(b)
        if label and (x1 - x0) > 7 * len(label) + 4 and h >= lane_h:
            parts.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{ys[i] + h / 2 + 4:.1f}" '
                         f'text-anchor="middle" fill="#ffffff" pointer-events="none">'
                         f"{escape(label)}</text>")
    parts.append("</svg>")
    text = "\n".join(parts) + "\n"
    return ('<?xml version="1.0" encoding="UTF-8"?>\n' + text) if standalone else text
