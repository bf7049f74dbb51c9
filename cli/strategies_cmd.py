"""`planner compare --strategies MODEL -c CLUSTER`: DDP, FSDP, local SGD, DiLoCo and the
solver's hybrid plan side by side (`planner.strategies`), with their scaling curve as a
table and, with --svg, as a chart (`planner.strategy_chart`)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cli.tables import fit_words, output_console

if TYPE_CHECKING:
    from planner.strategies import StrategyReport
    from planner.types import Layer, Plan

console = output_console()
err_console = Console(emoji=False, stderr=True)


def show_strategies(model: str, *, cluster: str, global_batch: int, seq_len: int | None,
                    interval: int, time_limit: float | None, svg: Path | None, force: bool,
                    json_out: bool) -> None:
    """Trace MODEL, price every strategy on CLUSTER, solve for the hybrid plan, print
    (or write as JSON) the report; --svg writes the scaling curve."""
    from cli.progress import solve_progress
    from cli.solve_cmd import _setup
    from planner.errors import Infeasible
    from planner.files import check_writable, write_atomic
    from planner.solver import SolveOptions, solve
    from planner.strategies import check_interval, hybrid_training, strategy_report
    from planner.strategy_chart import scaling_svg

    check_interval(interval)
    if svg is not None:  # before the work, not after it
        check_writable(svg, force=force)
    graph, spec, training = _setup(model, cluster, global_batch, seq_len, "auto", {})

    hybrid: Plan | Infeasible
    try:
        with solve_progress(err_console, time_limit) as progress:
            plans = solve(graph, spec, hybrid_training(training),
                          SolveOptions(time_limit=time_limit), progress=progress)
        progress.finish(plans[0])
        hybrid = plans[0]
    except Infeasible as exc:  # (the hybrid's row says why)
        hybrid = exc
    with err_console.status("Pricing DDP, FSDP, local SGD and DiLoCo at 1..N replicas...",
                            spinner="dots"):
        report = strategy_report(graph, spec, training, hybrid=hybrid, interval=interval)
    if svg is not None:
        write_atomic(svg, scaling_svg(report), force=True)
    if json_out:
        sys.stdout.write(json.dumps(report_json(report, graph.layers), indent=1) + "\n")
        return
    render(report, graph.layers)
    if svg is not None:
        console.print(f"Wrote the scaling curve to {svg}", soft_wrap=True, highlight=False,
                      markup=False)


def layout(plan: Plan) -> str:
    """A plan's replicas, micro-batch size and memory savers, in a few words."""
    stages = [s for p in plan.pipelines for s in p.stages]
    recompute = sorted({s.recompute.value for s in stages})
    zeros = sorted({s.zero for s in stages})
    return (f"{len(plan.pipelines)} replica(s) on {sum(s.tp for s in stages)} device(s), "
            "micro-batch "
            f"{', '.join(str(m) for m in sorted({p.micro_batch for p in plan.pipelines}))}, "
            f"recompute {', '.join(recompute)}, ZeRO {', '.join(map(str, zeros))}")


def render(report: StrategyReport, layers: Sequence[Layer]) -> None:
    """The strategies' table and their scaling curve as a table."""
    from planner.strategies import figures
    from planner.units import fmt_bytes, fmt_seconds

    table = Table(title=f"Strategies for {escape(report.model)} on {escape(report.cluster)}, "
                  f"global batch {report.global_batch}, each at its fastest replica count "
                  "(priced by the solver's step model)", title_justify="left")
    for column in ("strategy", "layout", "step", "samples/s", "peak memory per device",
                   "communication per step", "convergence risk"):
        table.add_column(column, overflow="fold", style="bold" if column == "strategy"
                         else None)
    for row in report.rows:
        plan = row.best.plan
        if plan is None:
            table.add_row(row.name, f"no plan: {row.best.reason}", "-", "-", "-", "-", "-")
            continue
        found = figures(plan, layers)
        memory = (f"{fmt_bytes(found.peak_memory)} of {fmt_bytes(found.capacity)} "
                  f"({found.peak_device})")
        comm = f"{fmt_bytes(found.comm_bytes)}, {fmt_seconds(found.comm_seconds)}"
        if found.whole_sync:
            comm += (f" (sync {fmt_seconds(plan.prediction.dp_comm)} of "
                     f"{fmt_seconds(found.whole_sync)})")
        if not row.best.fits:
            table.add_row(row.name, f"does not fit in memory at any replica count: "
                          f"{row.best.reason}", "-", "-", memory, "-", "-")
            continue
        table.add_row(row.name, layout(plan), fmt_seconds(found.step_time),
                      f"{found.samples_per_s:,.0f}", memory, comm, found.risk)
    console.print(fit_words(table))
    for row in report.rows:
        console.print(f"  {row.name}: {row.description}", soft_wrap=True, highlight=False,
                      markup=False)
    console.print("  Communication: bytes and seconds per step on the busiest device of each "
                  "kind of traffic (ZeRO-3's gathers included); of the gradient sync, what a "
                  "step pays of one whole sync.", soft_wrap=True, highlight=False, markup=False)
    counts = sorted({p.replicas for row in report.rows for p in row.curve if p.replicas})
    curve = Table(title="Scaling: samples/s at each replica count (oom: does not fit in "
                  "memory; -: cannot run so, --json says why)", title_justify="left")
    curve.add_column("strategy", style="bold")
    for count in counts:
        curve.add_column(str(count), justify="right")
    for row in report.rows:
        cells = {p.replicas: (f"{p.plan.prediction.samples_per_s:,.0f}" if p.fits and p.plan
                              else "oom" if p.plan else "-") for p in row.curve}
        curve.add_row(row.name, *(cells.get(count, "") for count in counts))
    console.print(fit_words(curve))


def report_json(report: StrategyReport, layers: Sequence[Layer]) -> dict:
    """The report as `--json` prints it (schema_version 1)."""
    from planner.strategies import figures

    rows = []
    for row in report.rows:
        plan = row.best.plan
        found = figures(plan, layers) if plan is not None else None
        rows.append({
            "name": row.name, "description": row.description, "replicas": row.best.replicas,
            "fits": row.best.fits, "reason": row.best.reason,
            "layout": layout(plan) if plan is not None else None,
            "sync": plan.training.sync.describe() if plan is not None else None,
            "figures": None if found is None else vars(found),
            "curve": [{"replicas": p.replicas, "fits": p.fits, "reason": p.reason,
                       "samples_per_s": p.plan.prediction.samples_per_s if p.plan else None}
                      for p in row.curve]})
    return {"kind": "strategies", "schema_version": 1, "model": report.model,
            "cluster": report.cluster, "global_batch": report.global_batch,
            "interval": report.interval, "rows": rows}
