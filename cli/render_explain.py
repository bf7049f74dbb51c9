"""Rich rendering of analyses (`planner explain`), comparisons (`planner compare`,
`planner what-if`) and interactive-session replies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from cli.tables import FitPanel, FitWords, counted, fit_words
from planner.compare import percent_change
from planner.units import fmt_bytes, fmt_rate, fmt_seconds

if TYPE_CHECKING:
    from planner.compare import Row
    from planner.explain import Analysis
    from planner.session import Reply
    from planner.timeline import Timeline

KIND_STYLES = {"fwd": "white on blue", "bwd": "black on green", "send": "cyan",
               "send-grad": "green", "sync": "black on yellow", "optimizer": "white on magenta",
               "": "dim"}
MEMORY_STYLES = {"weights": "blue", "gradients": "dark_orange", "optimizer": "red",
                 "activations": "cyan", "reserve": "grey50"}
MEMORY_FILL = {"weights": "█", "gradients": "▓", "optimizer": "▒", "activations": "░",
               "reserve": ":"}
VERDICT_STYLES = {"better": "bold green", "worse": "bold red", "changed": "bold yellow",
                  "same": "", "": ""}


# ---------------------------------------------------------------- comparisons

def _cell(row: Row, i: int) -> Text:
    text = row.texts[i]
    verdict = row.verdicts[i]
    change = row.changes[i]
    if verdict in ("better", "worse") and change is not None:
        text += f" ({percent_change(change)})"
    return Text(text, style=VERDICT_STYLES.get(verdict, ""))


def compare_table(rows: Sequence[Row], names: Sequence[str], *, title: str,
                  only_differences: bool = False) -> FitWords:
    table = Table(title=title, title_justify="left")
    table.add_column("", style="bold")
    for name in names:
        table.add_column(name, overflow="fold")
    for row in rows:
        if only_differences and not row.differs and row.key not in ("step_time",
                                                                     "samples_per_s"):
            continue
        table.add_row(row.label, *(_cell(row, i) for i in range(len(names))))
    return fit_words(table)


def diff_table(rows: Sequence[Row], *, title: str = "What changed") -> FitWords:
    table = Table(title=title, title_justify="left")
    for column in ("", "before", "after", "change"):
        table.add_column(column, overflow="fold", style="bold" if not column else None)
    for row in rows:
        verdict = row.verdicts[1]
        change = row.changes[1]
        note = (percent_change(change) if change is not None and verdict in ("better", "worse")
                else "" if verdict == "same" else verdict)
        table.add_row(row.label, Text(row.texts[0]), Text(row.texts[1],
                                                    style=VERDICT_STYLES.get(verdict, "")),
                      Text(note, style=VERDICT_STYLES.get(verdict, "")))
    return fit_words(table)


# ---------------------------------------------------------------- analyses

def explanation_panel(analysis: Analysis) -> Group:
    e = analysis.explanation
    lines = Text()
    for r in e.reasons:
        lines.append(f"• {r.kind}: ", style="bold")
        lines.append(r.text + "\n")
    binding = Text.assemble(("Binding constraint: ", "bold"), e.binding)
    parts: list[Any] = [FitPanel(Group(Text(e.headline, style="bold"), binding, Text(""),
                                       lines), title="Why this plan", title_align="left")]
    if e.alternatives:
        table = Table(title="Runner-ups and baselines: why they lose", title_justify="left")
        for column in ("alternative", "step time", "slower by", "why", "what"):
            table.add_column(column, overflow="fold")
        for a in e.alternatives:
            table.add_row(a.name, fmt_seconds(a.step_time) if a.step_time else "-",
                          Text(percent_change(a.slower_by) if a.slower_by is not None else "-",
                               style="red" if (a.slower_by or 0) > 0 else ""),
                          a.why, a.description)
        parts.append(fit_words(table))
    return Group(*parts)


def stage_timing_table(analysis: Analysis) -> FitWords:
    from planner.explain import (
        MICRO_BATCHES,
        MICRO_BATCHES_KEY,
        describe_pipelines,
        micro_batches,
    )

    table = Table(title="Stages (seconds per micro-batch; load: busy time against the "
                  "pipeline's busiest stage)", title_justify="left",
                  caption=MICRO_BATCHES_KEY, caption_justify="left")
    extra = [(name, key) for name, key in (("recompute", "recompute_time"),
                                           ("tp comm", "tp_time"))
             if any(getattr(r, key) for r in analysis.stages)]
    columns = ["pipes", "stage", "layers", "device", MICRO_BATCHES, "savers",
               "fwd / bwd", *(name for name, _ in extra), "send", "load"]
    for column in columns:
        table.add_column(column, overflow="fold",
                         justify="left" if column in ("pipes", "layers", "device",
                                                      "savers") else "right")
    last = None
    for r in analysis.stages:
        if last is not None and r.pipelines != last:
            table.add_section()
        last = r.pipelines
        savers = ", ".join(x for x in (r.recompute if r.recompute != "none" else "",
                                       f"ZeRO-{r.zero}" if r.zero else "") if x) or "-"
        table.add_row(describe_pipelines(r.pipelines) if r.stage == 0 else "", str(r.stage),
                      r.layers, r.device_type + (f" x{r.tp}" if r.tp > 1 else ""),
                      micro_batches(r.microbatches, r.micro_batch) + r.schedule
                      if r.stage == 0 else "", savers,
                      f"{fmt_seconds(r.fwd)} / {fmt_seconds(r.bwd)}",
                      *(fmt_seconds(getattr(r, key)) for _, key in extra),
                      fmt_seconds(r.send),
                      Text(f"{r.busy_share:.0%}", style="bold" if r.busy_share >= 0.999 else ""))
    return fit_words(table)


def device_map_table(analysis: Analysis, *, max_nodes: int = 64) -> FitWords:
    table = Table(title="Device map (pN sM: pipeline N, stage M)", title_justify="left")
    table.add_column("node")
    table.add_column("device")
    table.add_column("devices", overflow="fold")
    by_node: dict[str, list] = {}
    for d in analysis.devices:
        by_node.setdefault(d.node, []).append(d)
    for k, (node, devs) in enumerate(by_node.items()):
        if k == max_nodes:
            table.add_row("...", f"{len(by_node) - max_nodes} more nodes", "")
            break
        cells = Text()
        for i, d in enumerate(devs):
            if i:
                cells.append("  ")
            cells.append(f"[{d.device}] ", style="dim")
            cells.append(d.role, style="dim" if d.role == "idle" else "")
        table.add_row(node, devs[0].device_type, cells)
    return fit_words(table)


def memory_table(analysis: Analysis, *, width: int = 40) -> FitWords:
    from planner.explain import describe_pipelines

    legend = "  ".join(f"{MEMORY_FILL[k]} {k}" for k in MEMORY_FILL)
    table = Table(title="Memory per device against capacity", title_justify="left",
                  caption=legend, caption_justify="left")
    for column in ("pipelines", "stage", "node", "device", "memory", "used"):
        table.add_column(column, overflow="fold", no_wrap=column == "memory")
    for m in analysis.memory:
        bar = Text()
        cells = 0
        for term, value in m.terms.items():
            n = round(value / m.capacity * width) if m.capacity else 0
            n = min(n, width + 2 - cells)
            bar.append(MEMORY_FILL[term] * n, style=MEMORY_STYLES[term])
            cells += n
        bar.append("·" * max(0, width - cells), style="dim")
        bar.append("|")
        over = m.fraction > 1
        table.add_row(describe_pipelines(m.pipelines), str(m.stage), m.node,
                      m.device_type,
                      bar, Text(f"{fmt_bytes(m.total)} / {fmt_bytes(m.capacity)} "
                                f"({m.fraction:.0%})", style="bold red" if over else ""))
    return fit_words(table)


def traffic_table(analysis: Analysis) -> FitWords:
    table = Table(title="Communication per step", title_justify="left")
    for column in ("traffic", "between", "link", "bandwidth", "bytes", "time"):
        table.add_column(column, overflow="fold",
                         justify="right" if column in ("bandwidth", "bytes", "time") else "left")
    for t in analysis.traffic:
        table.add_row(t.kind, t.where, t.link, fmt_rate(t.bandwidth), fmt_bytes(t.bytes_per_step),
                      fmt_seconds(t.seconds))
    if not analysis.traffic:
        table.add_row("none", "", "", "", "", "")
    return fit_words(table)


def gantt(timeline: Timeline, width: int) -> Group:
    """The step as a terminal Gantt chart: one line per lane."""
    from planner.timeline import FILL, IDLE, legend, nice_ticks, text_rows

    label_w = min(44, max(len(lane.label) for lane in timeline.lanes))
    chart_w = max(20, width - label_w - 3)
    lines: list[Text] = [Text(f"Timeline of one step: simulated "
                              f"{fmt_seconds(timeline.step_time)} (closed-form prediction "
                              f"{fmt_seconds(timeline.predicted)})", style="bold")]
    axis = [" "] * (chart_w + 12)
    for tick in nice_ticks(timeline.step_time, max(2, chart_w // 12)):
        pos = round(tick / (timeline.step_time or 1) * chart_w)
        label = fmt_seconds(tick) if tick else "0"
        if pos + len(label) <= len(axis) and all(c == " " for c in axis[pos:pos + len(label)]):
            axis[pos:pos + len(label)] = list(label)
    lines.append(Text(" " * (label_w + 3) + "".join(axis).rstrip(), style="dim"))
    for label, segments in text_rows(timeline, chart_w):
        line = Text(f"{label[:label_w]:<{label_w}} │ ", style="bold" if "link" not in label
                    else "dim")
        for text, kind in segments:
            line.append(text, style=KIND_STYLES.get(kind, ""))
        lines.append(line)
    key = Text("  ")
    for kind, name in (*legend(timeline), ("", "idle")):
        if len(key) + len(name) + 5 > width:
            lines.append(key)
            key = Text("  ")
        key.append(FILL.get(kind, IDLE), style=KIND_STYLES[kind])
        key.append(f" {name}   ")
    hint = "Fn, Bn: micro-batch n"
    if len(key) + len(hint) > width:
        lines.append(key)
        key = Text("  ")
    lines.append(key.append(hint))
    return Group(*lines)


def render_analysis(console: Console, analysis: Analysis, *, width: int | None = None) -> None:
    """Everything `planner explain` shows; the baselines once, in the explanation's table
    of why the alternatives lose."""
    from cli.render_plan import prediction_panel, solver_panel

    plan = analysis.plan
    console.print(Text.from_markup(
        f"[bold]{escape(plan.model.describe())}[/] on cluster [bold]"
        f"{escape(plan.cluster.name)}[/] ({plan.num_devices:,} of "
        f"{counted(plan.cluster.num_devices, 'device')} used)"))
    console.print(stage_timing_table(analysis))
    console.print(device_map_table(analysis))
    console.print(memory_table(analysis, width=max(12, min(40, console.width - 62))))
    console.print(traffic_table(analysis))
    console.print(gantt(analysis.timeline, width or console.width), soft_wrap=True)
    console.print(prediction_panel(plan))
    console.print(explanation_panel(analysis))
    console.print(solver_panel(plan))


# ---------------------------------------------------------------- session replies

def help_table(commands: Sequence[Any]) -> FitWords:
    table = Table(title="Session commands (each has a non-interactive equivalent)",
                  title_justify="left", show_lines=False)
    for column in ("command", "what it does", "without the session"):
        table.add_column(column, overflow="fold")
    group = None
    for c in commands:
        if group is not None and c.group != group:
            table.add_section()
        group = c.group
        table.add_row(Text(c.usage, style="bold"), c.summary, Text(c.equivalent, style="dim"))
    return fit_words(table)


def render_reply(console: Console, reply: Reply) -> None:
    from planner.session import Tabular

    for kind, value in reply.items:
        if kind == "text":
            console.print(escape(value))
        elif kind == "note":
            console.print(Text(value, style="dim"))
        elif kind == "warning":
            console.print(Text(value, style="bold yellow"))
        elif kind == "table" and isinstance(value, Tabular):
            table = Table(title=escape(value.title), title_justify="left")
            for column in value.columns:
                table.add_column(column, overflow="fold")
            for row in value.rows:
                table.add_row(*row)
            console.print(fit_words(table))
        elif kind == "plan":
            from cli.render_plan import render

            plan, names = value
            render(console, plan, names)
        elif kind == "plan-summary":  # after a change: its stages only, the change in view
            from cli.render_plan import stage_table

            plan, names = value
            console.print(stage_table(plan, names))
        elif kind == "diff":
            _old, _new, rows = value
            console.print(diff_table(rows))
        elif kind == "explanation":
            console.print(explanation_panel(value))
        elif kind == "memory":
            console.print(memory_table(value, width=max(12, min(40, console.width - 62))))
        elif kind == "traffic":
            console.print(traffic_table(value))
            console.print(device_map_table(value))
        elif kind == "timeline":
            timeline, width = value
            console.print(gantt(timeline, width or console.width), soft_wrap=True)
        elif kind == "help":
            console.print(help_table(value))
        elif kind == "cli":
            for line in value:
                console.print(Text(line, style="cyan"), soft_wrap=True)
    if reply.error is not None:
        console.print(f"[bold red]error:[/] {escape(reply.error.message)}")
        for i, remedy in enumerate(reply.error.remedies, 1):
            console.print(f"  {i}) {escape(remedy)}")
