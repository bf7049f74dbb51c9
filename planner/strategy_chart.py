"""The strategy report's scaling curve as a self-contained SVG (no scripts, fonts or
links; tooltips as <title>), as `planner.timeline.to_svg` draws a step: throughput
against replicas, a line per strategy, replicas on a log2 axis (the curve's points are
1, 2, 4, ... and every device: `strategies.replica_counts`).

    write_atomic(path, scaling_svg(report))

Points where a strategy does not fit in memory, or cannot be laid out, are left out,
so each line shows only layouts that run.
"""

from __future__ import annotations

import math
from html import escape

from planner.strategies import StrategyReport
from planner.timeline import nice_ticks

# one colour per row, in report order (the palette of `timeline.COLORS` and `report.py`)
LINE_COLORS = ("#4c78a8", "#f58518", "#e45756", "#72b7b2", "#54a24b", "#b279a2",
               "#eeca3b", "#9d755d")
WIDTH, HEIGHT = 760, 440
LEFT, RIGHT, TOP, BOTTOM = 80, 200, 50, 50  # margins around the plot (legend on the right)


def scaling_svg(report: StrategyReport, *, standalone: bool = True) -> str:
    """Samples per second against replicas, a line per strategy of `report`."""
    drawn = [[(p.replicas, p.plan.prediction.samples_per_s) for p in row.curve
              if p.fits and p.plan is not None] for row in report.rows]
    most_replicas = max((r for line in drawn for r, _ in line), default=1)
    top_rate = max((rate for line in drawn for _, rate in line), default=1.0)
    ticks = nice_ticks(top_rate * 1.05, 6)
    y_max = ticks[-1] if ticks[-1] > 0 else 1.0
    span = max(1.0, math.log2(most_replicas))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(replicas: float) -> float:
        return LEFT + math.log2(replicas) / span * plot_w

    def y(rate: float) -> float:
        return TOP + plot_h - rate / y_max * plot_h

    title = (f"Throughput by replicas: {report.model} on {report.cluster}, global batch "
             f"{report.global_batch}")
    xmlns = ' xmlns="http://www.w3.org/2000/svg"' if standalone else ""
    parts = [f'<svg{xmlns} width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" '
             'font-family="sans-serif" font-size="11" role="img">',
             f"<title>{escape(title)}</title>",
             '<rect x="0" y="0" width="100%" height="100%" fill="#ffffff"/>',
             f'<text x="8" y="18" font-size="13" font-weight="bold">{escape(title)}</text>',
             '<text x="8" y="34">predicted samples/s of each strategy at 1..N replicas; '
             "layouts that do not fit in memory are left out</text>"]
    for tick in ticks:
        parts.append(f'<line x1="{LEFT}" y1="{y(tick):.1f}" x2="{LEFT + plot_w}" '
                     f'y2="{y(tick):.1f}" stroke="#dddddd"/>')
        parts.append(f'<text x="{LEFT - 6}" y="{y(tick) + 4:.1f}" text-anchor="end">'
                     f"{tick:,.0f}</text>")
    replicas = sorted({p.replicas for row in report.rows for p in row.curve if p.replicas})
    for count in replicas:
        parts.append(f'<line x1="{x(count):.1f}" y1="{TOP}" x2="{x(count):.1f}" '
                     f'y2="{TOP + plot_h}" stroke="#eeeeee"/>')
        parts.append(f'<text x="{x(count):.1f}" y="{TOP + plot_h + 16}" '
                     f'text-anchor="middle">{count}</text>')
    parts.append(f'<text x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 10}" text-anchor="middle">'
                 "replicas (the hybrid: pipelines); log scale</text>")
    parts.append(f'<text x="16" y="{TOP + plot_h / 2:.1f}" text-anchor="middle" '
                 f'transform="rotate(-90 16 {TOP + plot_h / 2:.1f})">samples/s</text>')
    for index, (row, line) in enumerate(zip(report.rows, drawn, strict=True)):
        color = LINE_COLORS[index % len(LINE_COLORS)]
        name = escape(row.name)
        parts.append(f'<g class="strategy" data-name="{name}">')
        if len(line) > 1:
            points = " ".join(f"{x(r):.1f},{y(rate):.1f}" for r, rate in line)
            parts.append(f'<polyline points="{points}" fill="none" stroke="{color}" '
                         'stroke-width="2"/>')
        for count, rate in line:
            parts.append(f'<circle cx="{x(count):.1f}" cy="{y(rate):.1f}" r="3.5" '
                         f'fill="{color}"><title>{name}, {count} replica(s): '
                         f"{rate:,.0f} samples/s</title></circle>")
        legend_y = TOP + 16 * index
        parts.append(f'<rect x="{WIDTH - RIGHT + 16}" y="{legend_y}" width="10" height="10" '
                     f'fill="{color}"/><text x="{WIDTH - RIGHT + 30}" y="{legend_y + 9}">'
                     f"{name}{'' if line else ' (no layout fits)'}</text></g>")
    parts.append("</svg>")
    text = "\n".join(parts) + "\n"
    return ('<?xml version="1.0" encoding="UTF-8"?>\n' + text) if standalone else text
