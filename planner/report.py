"""A self-contained HTML page for one plan's analysis: no scripts, fonts, images or
links to fetch, so it opens offline in any browser.

    html = report_html(analyze(plan, layers))
"""

from __future__ import annotations

from html import escape

from planner.explain import Analysis, describe_pipelines
from planner.timeline import COLORS, to_svg
from planner.units import fmt_bytes, fmt_rate, fmt_seconds

MEMORY_COLORS = {"weights": "#4c78a8", "gradients": "#f58518", "optimizer": "#e45756",
                 "activations": "#72b7b2", "reserve": "#bab0ac"}

_CSS = """
body { font-family: sans-serif; margin: 24px; color: #222; max-width: 1200px; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 12px; margin: 8px 0; }
th, td { border: 1px solid #ddd; padding: 3px 6px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.num { text-align: right; }
.bar { display: flex; width: 420px; height: 14px; background: #f4f4f4; border: 1px solid #ccc; }
.bar span { display: block; height: 100%; }
.over { color: #c00; font-weight: bold; }
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
    rows = []
    for m in analysis.memory:
        spans = "".join(
            f'<span style="width:{min(100.0, v / m.capacity * 100):.2f}%;'
            f'background:{MEMORY_COLORS[k]}" title="{escape(k)} {escape(fmt_bytes(v))}"></span>'
            for k, v in m.terms.items() if v > 0)
        total = escape(f"{fmt_bytes(m.total)} / {fmt_bytes(m.capacity)} ({m.fraction:.0%})")
        rows.append([escape(describe_pipelines(m.pipelines)), str(m.stage), escape(m.node),
                     escape(m.device_type), f'<div class="bar">{spans}</div>',
                     f'<span class="over">{total}</span>' if m.fraction > 1 else total])
    parts.append(_table(["pipelines", "stage", "node", "device", "by term", "total"], rows))
    parts.append("<h2>Communication per step</h2>")
    parts.append(_table(["traffic", "between", "link", "bandwidth", "bytes", "time"],
                        [[escape(t.kind), escape(t.where), escape(t.link),
                          escape(fmt_rate(t.bandwidth)), escape(fmt_bytes(t.bytes_per_step)),
                          escape(fmt_seconds(t.seconds))] for t in analysis.traffic],
                        {3, 4, 5}) if analysis.traffic else "<p>No communication.</p>")
    parts.append("<h2>Step time by cause</h2>")
    parts.append(_table(["term", "seconds", "share"],
                        [[escape(k), escape(fmt_seconds(v)),
                          f"{v / pred.step_time:.1%}" if pred.step_time else "-"]
                         for k, v in pred.terms().items()], {1, 2}))
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
             else "-", _speedup(b.prediction.step_time / pred.step_time) if b.prediction
             else "-",
             escape(b.description + (f": {b.reason}" if b.prediction is None else ""))]
            for b in plan.baselines], {1}))
    parts.append('<p class="legend">Timeline colours: '
                 + "".join(f'<span style="background:{c}"></span>{escape(k)}'
                           for k, c in COLORS.items()) + "</p>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _speedup(ratio: float) -> str:
    """How this plan compares with a baseline taking `ratio` times its step."""
    return f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"
