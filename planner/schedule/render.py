"""The schedule for people: its timeline as SVG (a lane per machine, a row per device,
a bar per stretch of time a job holds a device) and a self-contained HTML page with the
timeline, the jobs and the metrics. No scripts, fonts or links, tooltips as <title>, in
the style of `planner explain`'s files."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from xml.sax.saxutils import quoteattr

from planner.schedule.jobs import Job
from planner.schedule.pool import Pool
from planner.schedule.simulate import Simulation

PALETTE = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2",
           "#ff9da6", "#9d755d", "#bab0ac", "#2f4b7c", "#a05195")
LABEL_PX, ROW_PX, GAP_PX = 170, 10, 6


def clock(seconds: float) -> str:
    """A duration as people read schedules: '45 s', '12 min', '3.5 h', '2.1 d'."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


@dataclass(frozen=True)
class Bar:
    """`jobs` holding device `index` of `machine` from `start` to `end`."""

    machine: str
    index: int
    jobs: tuple[str, ...]
    start: float
    end: float


def bars(simulation: Simulation) -> list[Bar]:
    """Each device's holders over time, consecutive rounds of one holder merged; a bar
    ends where its jobs all finished, if that is within the round."""
    finish = {o.name: o.finish for o in simulation.outcomes}
    open_bars: dict[tuple[str, int], Bar] = {}
    out = []
    for r in simulation.rounds:
        seen = set()
        for placement in r.placements:
            jobs = placement.option.jobs
            ends = [finish[j] for j in jobs]
            end = r.start + r.length
            if all(e is not None and e < end for e in ends):
                end = max(e for e in ends if e is not None)
            for machine, indices in placement.devices:
                for index in indices:
                    key = (machine, index)
                    seen.add(key)
                    last = open_bars.get(key)
                    if last is not None and last.jobs == jobs and last.end >= r.start - 1e-9:
                        open_bars[key] = Bar(machine, index, jobs, last.start, end)
                    else:
                        if last is not None:
                            out.append(last)
                        open_bars[key] = Bar(machine, index, jobs, r.start, end)
        for key in [k for k in open_bars if k not in seen]:
            out.append(open_bars.pop(key))
    return out + list(open_bars.values())


def colors(jobs: Sequence[Job]) -> dict[str, str]:
    order = sorted(jobs, key=lambda j: (j.arrival, j.name))
    return {job.name: PALETTE[i % len(PALETTE)] for i, job in enumerate(order)}


def timeline_svg(simulation: Simulation, pool: Pool, jobs: Sequence[Job], *,
                 width: int = 1100, standalone: bool = True) -> str:
    from planner.timeline import nice_ticks  # (it imports the solver: only when drawing)

    color = colors(jobs)
    start = min((j.arrival for j in jobs), default=0.0)
    end = max([start + 1.0] + [r.start + r.length for r in simulation.rounds])
    span = end - start
    chart = max(200, width - LABEL_PX - 20)
    top = 46

    def x(t: float) -> float:
        return LABEL_PX + (t - start) / span * chart

    lanes, y = [], top
    for machine in pool.machines:
        lanes.append((machine, y))
        y += machine.devices * ROW_PX + GAP_PX
    height = y + 30
    m = simulation.metrics
    title = f"Schedule: policy {simulation.policy} on {pool.name}"
    xmlns = ' xmlns="http://www.w3.org/2000/svg"' if standalone else ""
    parts = [f'<svg{xmlns} width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
             'font-family="sans-serif" font-size="11" role="img">',
             f"<title>{escape(title)}</title>",
             '<rect x="0" y="0" width="100%" height="100%" fill="#ffffff"/>',
             f'<text x="8" y="16" font-size="13" font-weight="bold">{escape(title)}</text>',
             f'<text x="8" y="32">average job completion time {escape(_or_dash(m.average_jct))}'
             f", makespan {escape(clock(m.makespan))}, utilization {m.utilization:.0%}, "
             f"Jain's index {m.jain:.3f}</text>"]
    unit, per = next((u, s) for u, s in (("d", 86400.0), ("h", 3600.0), ("min", 60.0),
                                         ("s", 1.0)) if span >= 2 * s or s == 1.0)
    for tick in nice_ticks(span / per):
        tx = LABEL_PX + tick * per / span * chart
        parts.append(f'<line x1="{tx:.1f}" y1="{top - 4}" x2="{tx:.1f}" y2="{y}" '
                     'stroke="#dddddd"/>')
        parts.append(f'<text x="{tx:.1f}" y="{y + 14}" text-anchor="middle">'
                     f"{f'{tick:g} {unit}' if tick else '0'}</text>")
    for machine, lane_y in lanes:
        lane_h = machine.devices * ROW_PX
        parts.append(f'<g class="lane" data-machine={quoteattr(machine.name)}>'
                     f"<title>{escape(machine.name)}: {machine.devices} "
                     f"{escape(machine.device_type)}</title>"
                     f'<rect x="{LABEL_PX}" y="{lane_y}" width="{chart}" height="{lane_h}" '
                     'fill="#f4f4f4"/>'
                     f'<text x="{LABEL_PX - 6}" y="{lane_y + lane_h / 2 + 4:.1f}" '
                     f'text-anchor="end">{escape(machine.name)} ({machine.devices}x '
                     f"{escape(machine.device_type)})</text></g>")
    row_of = {(machine.name, i): lane_y + i * ROW_PX for machine, lane_y in lanes
              for i in range(machine.devices)}
    for bar in bars(simulation):
        left, right = x(bar.start), x(bar.end)
        fill = color[bar.jobs[0]]
        stroke = ' stroke="#222222" stroke-dasharray="2,1"' if len(bar.jobs) > 1 else ""
        label = " + ".join(bar.jobs)
        top_y = row_of[(bar.machine, bar.index)] + 1
        parts.append(f'<rect class="bar" data-jobs={quoteattr(label)} x="{left:.1f}" '
                     f'y="{top_y}" width="{max(right - left, 0.5):.1f}" height="{ROW_PX - 2}" '
                     f'fill="{fill}"{stroke}><title>{escape(label)} on {escape(bar.machine)} '
                     f"device {bar.index}: {escape(clock(bar.start - start))} to "
                     f"{escape(clock(bar.end - start))}</title></rect>")
    parts.append("</svg>")
    text = "\n".join(parts) + "\n"
    return ('<?xml version="1.0" encoding="UTF-8"?>\n' + text) if standalone else text


def _or_dash(seconds: float) -> str:
    return "-" if seconds != seconds else clock(seconds)  # (nan: nothing finished)


_CSS = """
body { font-family: sans-serif; margin: 24px; color: #222; max-width: 1200px; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 12px; margin: 8px 0; }
th, td { border: 1px solid #ddd; padding: 3px 6px; text-align: left; }
th { background: #f4f4f4; } .timeline { overflow-x: auto; }
.swatch { display: inline-block; width: 10px; height: 10px; margin-right: 4px; }
"""


def schedule_html(simulation: Simulation, pool: Pool, jobs: Sequence[Job]) -> str:
    """The page: metrics, the timeline, and a row per job (its first allocation, start,
    finish, completion time, deadline)."""
    color = colors(jobs)
    outcome = {o.name: o for o in simulation.outcomes}
    first: dict[str, str] = {}
    for r in simulation.rounds:
        for placement in r.placements:
            for job in placement.option.jobs:
                first.setdefault(job, describe_devices(placement.devices))
    rows = []
    for job in sorted(jobs, key=lambda j: (j.arrival, j.name)):
        o = outcome[job.name]
        cells = [f'<span class="swatch" style="background:{color[job.name]}"></span>'
                 f"{escape(job.name)}", escape(job.workload), clock(job.arrival),
                 escape(first.get(job.name, "never ran")),
                 "-" if o.start is None else clock(o.start),
                 "-" if o.finish is None else clock(o.finish),
                 "-" if o.jct is None else clock(o.jct), str(o.restarts),
                 "-" if o.deadline_met is None else ("met" if o.deadline_met else "missed")]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("job", "trains", "arrives", "first allocation",
                                             "starts", "finishes", "completion time",
                                             "restarts", "deadline"))
    m = simulation.metrics
    metrics = (f"<p>Average job completion time {escape(_or_dash(m.average_jct))}; makespan "
               f"{escape(clock(m.makespan))}; utilization {m.utilization:.0%}; Jain's "
               f"fairness index {m.jain:.3f}; {m.finished} of {m.finished + m.unfinished} "
               "jobs finished.</p>")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>Schedule: "
            f"{escape(simulation.policy)}</title><style>{_CSS}</style></head><body>"
            f"<h1>Schedule: policy {escape(simulation.policy)} on {escape(pool.name)}</h1>"
            f"{metrics}<h2>Timeline</h2><div class=\"timeline\">"
            f"{timeline_svg(simulation, pool, jobs, standalone=False)}</div>"
            f"<h2>Jobs</h2><table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}"
            "</tbody></table></body></html>\n")


def describe_devices(devices: Sequence[tuple[str, Sequence[int]]]) -> str:
    """'v100-0 [0-3], v100-1 [0,1]'."""
    from planner.timeline import ranges

    return ", ".join(f"{machine} [{ranges(list(indices))}]" for machine, indices in devices)
