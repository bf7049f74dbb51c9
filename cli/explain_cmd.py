"""`planner explain PLAN`: why a plan looks the way it does, and its timeline."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from cli import options as opt
from cli.tables import output_console

console = output_console()
err_console = Console(emoji=False, stderr=True)

PlanArg = Annotated[Path, typer.Argument(
    metavar="PLAN", help="A plan file written by `planner solve -o` (or estimate, what-if), "
    "edited or not, or one written by hand (README.md: Price a plan).")]


def explain(
    plan_file: PlanArg,
    html: Annotated[Path | None, typer.Option(
        "--html", help="Write a self-contained HTML report (timeline, tables, explanation); "
        "it opens offline.")] = None,
    svg: Annotated[Path | None, typer.Option(
        "--svg", help="Write the timeline of one step as a self-contained SVG.")] = None,
    json_out: opt.JsonOut = False,
    force: opt.Force = False,
    width: Annotated[int | None, typer.Option(
        "--width", help="Columns for the terminal timeline (default: the terminal's).")] = None,
    all_pipelines: Annotated[bool, typer.Option(
        "--all-pipelines", help="One timeline lane per pipeline (default: identical "
        "pipelines share lanes).")] = False,
    runners_up: Annotated[int, typer.Option(
        "--runners-up", help="Solve again for the N next-best plans and say why they lose "
        "(the plan file keeps only the best).")] = 0,
    time_limit: Annotated[float, typer.Option(
        "--time-limit", help="Seconds for the --runners-up solve.")] = 30.0,
) -> None:
    """Explain a plan: stages, device map, memory, communication, timeline, and why.

    Shows the stage table with per-micro-batch timings, which node and device runs
    what, memory per device as bars against capacity (by term), communication per
    link, the pipeline timeline of one step (a simulated replay) as a Gantt chart,
    the binding constraint and bottleneck stage, why the baselines (and with
    --runners-up the next-best plans) lose, and the solver report. The plan is priced
    as written, so a plan edited after its solve, or one written by hand, is explained
    with figures of its own.

    Examples:
      planner explain plan.json
      planner explain plan.json --html plan.html --svg step.svg
      planner explain plan.json --runners-up 3 --json | jq .explanation.alternatives
    """
    from planner.errors import PlannerError
    from planner.explain import analysis_dict, analyze
    from planner.files import check_writable
    from planner.price import price_file
    from planner.timeline import MAX_WIDTH

    if runners_up < 0:
        raise PlannerError("bad-option", f"--runners-up must be 0 or more (got {runners_up}).")
    if width is not None and not 40 <= width <= MAX_WIDTH:
        raise PlannerError("bad-option", f"--width must be between 40 and {MAX_WIDTH:,} "
                           f"columns (got {width:,}).")
    if html is not None and svg is not None and html.resolve() == svg.resolve():
        raise PlannerError("bad-option", f"--html and --svg both name {str(html)!r}; give "
                           "them different files.")
    for path in (html, svg):  # before the trace and the replay, not after them
        if path is not None:
            check_writable(path, force=force)
    with err_console.status(f"Tracing the model of {escape(str(plan_file))}...",
                            spinner="dots") as status:
        # priced as written: an edited plan's figures are its own, not the file's
        priced = price_file(plan_file)
        plan, graph = priced.plan, priced.graph
        if runners_up and plan.solver.status == "fixed":
            raise PlannerError(
                "bad-option", "--runners-up says why the next-best plans of a search lose to "
                f"the best; {str(plan_file)!r} is not a search result: a configuration fixed "
                "with `planner estimate` or by hand, or a plan edited since its search.",
                ["solve the same model and cluster with `planner solve ... -o best.json`, "
                 f"then `planner compare {plan_file} best.json`"])
        others = []
        if runners_up:
            from planner.compare import same_structure
            from planner.solver import SolveOptions, solve

            status.update("Solving for the runner-up plans...")
            found = solve(graph, plan.cluster, plan.training,
                          SolveOptions(top_k=runners_up + 1, time_limit=time_limit,
                                       with_baselines=False),
                          progress=lambda now: status.update(
                              f"Solving for the runner-up plans: {now.explored:,} explored")
                          if now.explored % 200 == 0 else None)
            others = [p for p in found if not same_structure(p, plan)][:runners_up]
        status.update("Simulating the step...")
        analysis = analyze(plan, graph.layers, priced.costs, runners_up=others,
                           group=not all_pipelines)
    if html is not None:
        from planner.files import write_atomic
        from planner.report import report_html

        write_atomic(html, report_html(analysis), force=True)
    if svg is not None:
        from planner.files import write_atomic
        from planner.timeline import to_svg

        write_atomic(svg, to_svg(analysis.timeline), force=True)
    if json_out:
        sys.stdout.write(json.dumps(analysis_dict(analysis), indent=1) + "\n")
        return
    from cli.render_explain import render_analysis

    render_analysis(console, analysis, width=width)
    from planner.constraints import solved_with

    if plan.constraints is not None and solved_with(plan):  # (what a re-plan keeps to)
        console.print(f"solved with: {solved_with(plan)}", markup=False, highlight=False)
    for path, what in ((html, "HTML report"), (svg, "SVG timeline")):
        if path is not None:
            console.print(f"Wrote the {what} to {path}", soft_wrap=True, highlight=False,
                          markup=False)


def register(app: typer.Typer) -> None:
    app.command("explain")(explain)
