"""Rich rendering of plans: stages, predictions, memory, solver report, baselines."""

from __future__ import annotations

from collections import Counter

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from cli.tables import FitPanel, FitWords, counted, fit_words
from planner.compare import speedup
from planner.explain import MICRO_BATCHES, MICRO_BATCHES_KEY, micro_batches
from planner.sync import sync_note
from planner.types import PipelinePlan, Plan
from planner.units import fmt_bytes, fmt_seconds

NOISE = 1e-9  # a cost term this far below zero (relative to the step) is float noise
SPEEDUP_STYLES = {"faster": "green", "slower": "red"}


def pipeline_classes(plan: Plan) -> list[tuple[PipelinePlan, list[PipelinePlan]]]:
    """Pipelines grouped by identical structure: (representative, members)."""
    groups: dict[tuple, list[PipelinePlan]] = {}
    for p in plan.pipelines:
        stages = tuple((s.layers, s.chunks, s.device_type, s.tp, s.recompute, s.zero)
                       for s in p.stages)
        key = (stages, p.micro_batch, p.schedule, p.interleave)
        groups.setdefault(key, []).append(p)
    return [(members[0], members) for members in groups.values()]


def _layer_names(plan_layers: tuple[int, int], names: list[str] | None) -> str:
    a, b = plan_layers
    if names is None:
        return f"{a}-{b - 1}" if b - a > 1 else f"{a}"
    return names[a] if b - a == 1 else f"{names[a]} .. {names[b - 1]}"


def _used_of(used: float, capacity: float) -> str:
    """58.1/80 GiB (one unit where both take the same)."""
    a, b = fmt_bytes(used), fmt_bytes(capacity)
    if a.split()[1] == b.split()[1]:
        return f"{a.split()[0]}/{b}"
    return f"{a} / {b}"


def _micro_batches(rep: PipelinePlan, members: list[PipelinePlan]) -> str:
    """`32 x 1`, or where the pipelines alike run different counts `2 x 1 (227 pipes),
    1 x 1 (58 pipes)`; the schedule where it is not plain 1F1B."""
    counts = Counter(p.num_microbatches for p in members)
    return ", ".join(micro_batches(count, rep.micro_batch)
                     + (f" ({counted(pipes, 'pipe')})" if len(counts) > 1 else "")
                     for count, pipes in sorted(counts.items(), reverse=True)
                     ) + rep.schedule_note()


def stage_table(plan: Plan, layer_names: list[str] | None = None) -> FitWords:
    columns = ("pipes", "stage", "layers", "device", "tp", MICRO_BATCHES, "recompute",
               "ZeRO", "memory")
    rows: list[tuple[list, bool]] = []  # (cells, whether a new group of pipelines starts)
    for rep, members in pipeline_classes(plan):
        for s in rep.stages:
            capacity = plan.cluster.node(s.devices.node).device.memory
            over = s.memory.total > capacity
            memory = Text(_used_of(s.memory.total, capacity), style="bold red" if over else "")
            layers = " + ".join(_layer_names(c, layer_names) for c in s.chunks)
            rows.append(([str(len(members)) if s.index == 0 else "", str(s.index), layers,
                          s.device_type, str(s.tp),
                          _micro_batches(rep, members) if s.index == 0 else "",
                          s.recompute.value, str(s.zero), memory], s.index == 0))
    table = Table(title="Pipelines (identical pipelines grouped)", title_justify="left",
                  caption=MICRO_BATCHES_KEY, caption_justify="left")
    for column in columns:
        table.add_column(column, justify="right" if column in ("tp", "ZeRO") else "left",
                         overflow="fold")
    for index, (cells, first) in enumerate(rows):
        if first and index:
            table.add_section()
        table.add_row(*cells)
    return fit_words(table)


def prediction_panel(plan: Plan) -> FitPanel:
    p = plan.prediction
    lines = [f"step time [bold]{fmt_seconds(p.step_time)}[/]   "
             f"{p.samples_per_s:,.1f} samples/s"
             + (f"   {p.tokens_per_s:,.0f} tokens/s" if p.tokens_per_s else "")
             + f"   MFU {p.mfu:.1%}"]
    width = 40
    for name, value in p.terms().items():
        if -NOISE * p.step_time < value < 0:  # (a bubble of -1e-17 s read "-0.0%")
            value = 0.0
        share = value / p.step_time if p.step_time else 0.0
        bar = "█" * round(share * width)
        lines.append(f"{name:>10} {bar:<{width}} {fmt_seconds(value):>9} {share:6.1%}")
    note = sync_note(plan)
    if note is not None:
        lines.append(escape(note))
    title = (f"Prediction: {counted(len(plan.pipelines), 'pipeline')} on {plan.num_devices:,} "
             f"of {counted(plan.cluster.num_devices, 'device')}, global batch "
             f"{plan.training.global_batch}, {plan.training.dtype}")
    return FitPanel("\n".join(lines), title=title, title_align="left")


def solver_panel(plan: Plan, *, search_space: bool = True) -> FitPanel:
    """The search's report; `search_space`: with the paragraph that says what it covers
    (the same for every plan: shown once, not with every runner-up or what-if)."""
    r = plan.solver
    if r.status == "fixed":
        text = "configuration fixed by the user (planner estimate)"
    else:
        text = (f"status [bold]{r.status}[/] in {r.wall_time:.2f} s, {r.explored:,} nodes "
                f"explored, {r.pruned:,} pruned\n"
                f"objective {fmt_seconds(r.objective)}, best bound {fmt_seconds(r.best_bound)}"
                f", gap {r.gap:.2%}\n"
                f"no plan of any shape can beat {fmt_seconds(r.lower_bound)} "
                "(LP bound without communication or bubbles)"
                + (f"\n[dim]search space: {escape(r.search_space)}[/]" if search_space else ""))
    return FitPanel(text, title="Solver", title_align="left")


def baseline_table(plan: Plan) -> FitWords | None:
    if not plan.baselines:
        return None
    table = Table(title="Baselines (same cost model)", title_justify="left")
    for column in ("baseline", "step time", "this plan is", "how"):
        table.add_column(column, overflow="fold")
    for b in plan.baselines:
        if b.prediction is None:
            table.add_row(b.name, "-", "-", f"{b.description}: {b.reason}")
            continue
        verdict = speedup(b.prediction.step_time / plan.prediction.step_time)
        table.add_row(b.name, fmt_seconds(b.prediction.step_time),
                      Text(verdict, style=SPEEDUP_STYLES.get(verdict.rpartition(" ")[2], "")),
                      b.description)
    return fit_words(table)


def render(console: Console, plan: Plan, layer_names: list[str] | None = None, *,
           verbose: bool = False) -> None:
    """The plan, its prediction, the solver's report and the baselines; `verbose`: with
    the search space the solver covered (a paragraph the same for every plan)."""
    header = (f"[bold]{escape(plan.model.describe())}[/] on cluster "
              f"[bold]{escape(plan.cluster.name)}[/] "
              f"({counted(plan.cluster.num_devices, 'device')})")
    parts = [Text.from_markup(header), stage_table(plan, layer_names), prediction_panel(plan),
             solver_panel(plan, search_space=verbose)]
    baselines = baseline_table(plan)
    if baselines is not None:
        parts.append(baselines)
    console.print(Group(*parts))
