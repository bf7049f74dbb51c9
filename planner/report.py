"""A self-contained HTML page for one plan's analysis: no scripts, fonts, images or
links to fetch, so it opens offline in any browser.

    html = report_html(analyze(plan, layers))

Charts are inline SVG (tooltips as <title>) that write their figures on them: the
timeline (`planner.timeline.to_svg`), memory per device (each bar labelled with
used / capacity and its terms where they fit) and step time by cause (a bar per
cause beside its seconds and share).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from planner.compare import speedup
from planner.explain import TERM_WORDS, Analysis, MemoryRow, describe_pipelines
from planner.timeline import to_svg
from planner.units import fmt_bytes, fmt_rate, fmt_seconds

MEMORY_COLORS = {"weights": "#4c78a8", "gradients": "#f58518", "optimizer": "#e45756",
                 "activations": "#72b7b2", "reserve": "#bab0ac"}
CAUSE_COLOR = "#4c78a8"
BAR_PX = 400  # a full bar: a device's memory, or the whole step
BAR_HEIGHT = 16
CHAR_PX = 6.0  # about the width of a character of the bars' 10 px text

_CSS = """
body { font-family: sans-serif; margin: 24px; color: #222; max-width: 1200px; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 12px; margin: 8px 0; }
th, td { border: 1px solid #ddd; padding: 3px 6px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.num { text-align: right; }
.legend span { display: inline-block; width: 10px; height: 10px; margin: 0 4px 0 12px; }
.idle { color: #999; } .dev { font-family: monospace; font-size: 11px; }
.timeline { overflow-x: auto; }
"""


def _table(header: list[str], rows: list[list[str]], numeric: set[int] | None = None) -> str:
    numeric = numeric or set()
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(
        f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>"
        for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


@dataclass(frozen=True)
class Segment:
    """A part of a horizontal bar: what it is, how much, its colour and its figure."""

    name: str
    value: float
    color: str
    figure: str


def bar_svg(segments: Sequence[Segment], full: float, caption: str = "", *,
            limit: float | None = None) -> str:
    """A horizontal bar as inline SVG: `segments` end to end on a `full`-long track of
    BAR_PX pixels, each with its figure written on it where it fits, `caption` after
    the bar; `limit` (on the same scale) marks a capacity the bar goes past."""
    scale = BAR_PX / full if full > 0 else 0.0
    parts = [f'<rect x="0" y="0" width="{BAR_PX}" height="{BAR_HEIGHT}" fill="#f4f4f4" '
             'stroke="#cccccc"/>']
    x = 0.0
    for segment in segments:
        width = segment.value * scale
        if width <= 0:
            continue
        parts.append(f'<rect x="{x:.2f}" y="0" width="{width:.2f}" height="{BAR_HEIGHT}" '
                     f'fill="{segment.color}"><title>{escape(segment.name)}: '
                     f"{escape(segment.figure)}</title></rect>")
        if segment.figure and CHAR_PX * len(segment.figure) + 4 <= width:
            parts.append(f'<text x="{x + width / 2:.2f}" y="{BAR_HEIGHT - 4}" '
                         f'text-anchor="middle" fill="{_ink(segment.color)}">'
                         f"{escape(segment.figure)}</text>")
        x += width
    if limit is not None:
        parts.append(f'<line x1="{limit * scale:.2f}" y1="-2" x2="{limit * scale:.2f}" '
                     f'y2="{BAR_HEIGHT + 2}" stroke="#cc0000" stroke-width="2"/>')
    if caption:
        over = ' fill="#cc0000" font-weight="bold"' if limit is not None else ""
        parts.append(f'<text class="caption" x="{BAR_PX + 6}" y="{BAR_HEIGHT - 4}"{over}>'
                     f"{escape(caption)}</text>")
    width = BAR_PX + (12 + CHAR_PX * len(caption) if caption else 2)
    return (f'<svg class="bar" width="{width:.0f}" height="{BAR_HEIGHT}" '
            f'viewBox="0 0 {width:.0f} {BAR_HEIGHT}" font-family="sans-serif" font-size="10">'
            + "".join(parts) + "</svg>")


def _ink(background: str) -> str:
    """Black or white text, whichever reads on `background` ("#rrggbb")."""
    red, green, blue = (int(background[i:i + 2], 16) for i in (1, 3, 5))
    return "#000000" if 0.299 * red + 0.587 * green + 0.114 * blue > 150 else "#ffffff"


def memory_bar(row: MemoryRow) -> str:
    """A device's memory by term against its capacity, labelled used / capacity."""
    segments = [Segment(term, value, MEMORY_COLORS[term], fmt_bytes(value))
                for term, value in row.terms.items()]
    caption = f"{fmt_bytes(row.total)} / {fmt_bytes(row.capacity)} ({row.fraction:.0%})"
    return bar_svg(segments, max(row.total, row.capacity), caption,
                   limit=row.capacity if row.fraction > 1 else None)


def report_html(analysis: Analysis) -> str:
    plan = analysis.plan
    pred = plan.prediction
    e = analysis.explanation
    title = f"Plan for {plan.model.describe()} on {plan.cluster.name}"
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{escape(title)}</title>", f"<style>{_CSS}</style></head><body>",
             f"<h1>{escape(title)}</h1>",
             f"<p><b>{escape(fmt_seconds(pred.step_time))}</b> per step, "
             f"{pred.samples_per_s:,.1f} samples/s"
             + (f", {pred.tokens_per_s:,.0f} tokens/s" if pred.tokens_per_s else "")
             + f", MFU {pred.mfu:.1%}; global batch {plan.training.global_batch}, "
             f"{escape(plan.training.dtype)}, {plan.num_devices} of "
             f"{plan.cluster.num_devices} devices.</p>"]
    parts.append("<h2>Why this plan</h2>")
    parts.append(f"<p>{escape(e.headline)}<br><b>Binding constraint:</b> "
                 f"{escape(e.binding)}</p><ul>"
                 + "".join(f"<li><b>{escape(r.kind)}</b>: {escape(r.text)}</li>"
                           for r in e.reasons) + "</ul>")
    if e.alternatives:
        parts.append(_table(["alternative", "step time", "slower by", "why it loses", "what"],
                            [[escape(a.name),
                              escape(fmt_seconds(a.step_time)) if a.step_time else "-",
                              f"{a.slower_by:+.1%}" if a.slower_by is not None else "-",
                              escape(a.why), escape(a.description)]
                             for a in e.alternatives], {1, 2}))
    parts.append("<h2>Timeline of one step</h2>")
    parts.append(f'<div class="timeline">{to_svg(analysis.timeline, standalone=False)}</div>')
    parts.append("<h2>Stages</h2>")
    parts.append(_table(
        ["pipelines", "stage", "layers", "device", "nodes", "tp", "micro-batches", "recompute",
         "ZeRO", "fwd", "bwd", "of which recompute", "tp comm", "send"],
        [[escape(describe_pipelines(r.pipelines)), str(r.stage), escape(r.layers),
          escape(r.device_type), escape(", ".join(r.nodes)), str(r.tp),
          f"{r.microbatches} x {r.micro_batch}{r.schedule}", escape(r.recompute), str(r.zero),
          fmt_seconds(r.fwd), fmt_seconds(r.bwd), fmt_seconds(r.recompute_time),
          fmt_seconds(r.tp_time), fmt_seconds(r.send)] for r in analysis.stages],
        {1, 5, 9, 10, 11, 12, 13}))
    parts.append("<h2>Device map</h2>")
    by_node: dict[str, list] = {}
    for d in analysis.devices:
        by_node.setdefault(d.node, []).append(d)
    rows = []
    for node, devs in by_node.items():
        cells = " ".join(
            f'<span class="dev{" idle" if d.role == "idle" else ""}">[{d.device}] '
            f"{escape(d.role)}</span>" for d in devs)
        rows.append([escape(node), escape(devs[0].device_type), cells])
    parts.append(_table(["node", "device", "devices: role"], rows))
    parts.append("<h2>Memory per device</h2>")
    legend = "".join(f'<span style="background:{c}"></span>{escape(k)}'
                     for k, c in MEMORY_COLORS.items())
    parts.append(f'<div class="legend">{legend}</div>')
    parts.append(_table(["pipelines", "stage", "node", "device", "used / capacity, by term"],
                        [[escape(describe_pipelines(m.pipelines)), str(m.stage), escape(m.node),
                          escape(m.device_type), memory_bar(m)] for m in analysis.memory]))
    parts.append("<h2>Communication per step</h2>")
    parts.append(_table(["traffic", "between", "link", "bandwidth", "bytes", "time"],
                        [[escape(t.kind), escape(t.where), escape(t.link),
                          escape(fmt_rate(t.bandwidth)), escape(fmt_bytes(t.bytes_per_step)),
                          escape(fmt_seconds(t.seconds))] for t in analysis.traffic],
                        {3, 4, 5}) if analysis.traffic else "<p>No communication.</p>")
    parts.append("<h2>Step time by cause</h2>")
    causes = [(TERM_WORDS[k], v, f"{v / pred.step_time:.1%}" if pred.step_time else "-")
              for k, v in pred.terms().items()]
    parts.append(_table(["cause", "seconds", "share", "of the step"], [
        [escape(cause), escape(fmt_seconds(v)), share, bar_svg(
            [Segment(cause, v, CAUSE_COLOR, f"{fmt_seconds(v)} ({share})")], pred.step_time)]
        for cause, v, share in causes], {1, 2}))
    r = plan.solver
    parts.append("<h2>Solver</h2>")
    if r.status == "fixed":
        parts.append("<p>Configuration fixed by the user (planner estimate).</p>")
    else:
        parts.append(f"<p>status <b>{escape(r.status)}</b> in {r.wall_time:.2f} s, "
                     f"{r.explored:,} nodes explored, {r.pruned:,} pruned; objective "
                     f"{escape(fmt_seconds(r.objective))}, best bound "
                     f"{escape(fmt_seconds(r.best_bound))}, gap {r.gap:.2%}; no plan of any "
                     f"shape beats {escape(fmt_seconds(r.lower_bound))}.<br>"
                     f"<small>search space: {escape(r.search_space)}</small></p>")
    if plan.baselines:
        parts.append(_table(["baseline", "step time", "this plan is", "how"], [
            [escape(b.name), escape(fmt_seconds(b.prediction.step_time)) if b.prediction
             else "-", speedup(b.prediction.step_time / pred.step_time) if b.prediction
             else "-",
             escape(b.description + (f": {b.reason}" if b.prediction is None else ""))]
            for b in plan.baselines], {1}))
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
