"""`planner replan PLAN --lost NODE... [--add SPEC]`: a new plan on what is left."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape

from cli import options as opt
from cli.solve_cmd import Output, warn_small_batch
from cli.tables import output_console

if TYPE_CHECKING:
    from planner.replan import Replan

console = output_console()
err_console = Console(emoji=False, stderr=True)


def replan(
    plan_file: Annotated[Path, typer.Argument(metavar="PLAN", help="The plan the run was "
                                              "launched with.")],
    lost: Annotated[list[str] | None, typer.Option(
        "--lost", metavar="NODE", help="A node that is gone (repeatable); `planner explain "
        "PLAN` lists the plan's nodes.")] = None,
    add: Annotated[list[str] | None, typer.Option(
        "--add", metavar="NODESxDEVICESxTYPE", help="Nodes that join, e.g. --add 1x8xA100-80G "
        "(repeatable).")] = None,
    global_batch: Annotated[int | None, typer.Option(
        "--global-batch", "-B", help="A new global batch (default: the plan's, kept so that "
        "the resumed run trains on the samples the interrupted one would have).")] = None,
    spare: Annotated[float | None, typer.Option(
        "--spare", metavar="F", help="Keep slack: the new plan must survive the loss of any "
        "one of its nodes by a rebalance of its batch shares alone, giving up at most F of "
        "the best plan's speed (0.2: up to 20% slower).")] = None,
    time_limit: Annotated[float, typer.Option(
        "--time-limit", help="Seconds for the search after the warm start (the old plan's "
        "surviving pipelines, rebalanced).")] = 10.0,
    ignore_constraints: Annotated[bool, typer.Option(
        "--ignore-constraints", help="Search free of the constraints the plan was solved "
        "with (--tp, --max-stages, --recompute, ...; kept by default, less an --exclude of "
        "a lost node).")] = False,
    output: Output = None,
    json_out: opt.JsonOut = False,
    force: opt.Force = False,
) -> None:
    """Re-plan after nodes are lost (or join): a new plan on what is left, shown as a diff.

    Warm start: the old plan's pipelines that no lost node touches, their stages as they
    were and the global batch shared among them again, are the plan to beat; the solver
    then searches what is left within --time-limit and its plan is kept where faster.
    The search keeps to the constraints the plan was solved with (`planner solve --tp 2
    ...`; --ignore-constraints drops them). The global batch is kept unless -B gives
    another. A run's checkpoint resumes under the new plan (`planner launch NEW --run-dir
    RUN --runtime-arg --resume`); the supervisor of `planner launch --supervise` does all
    this by itself.

    Examples:
      planner replan plan.json --lost v100-32g-1 -o after.json
      planner replan plan.json --lost a100-0 --add 1x8xA100-80G --time-limit 30
      planner replan plan.json --spare 0.2 -o resilient.json
    """
    from planner.compare import diff, headline, rows_json
    from planner.errors import PlannerError
    from planner.explain import retrace
    from planner.files import check_writable, write_atomic
    from planner.planfile import plan_json, read_plan, to_jsonable
    from planner.replan import replan as replan_plan

    if output is not None:
        check_writable(output, force=force)
    if not time_limit >= 0:
        raise PlannerError("bad-option", f"--time-limit must be 0 or more seconds (got "
                           f"{time_limit:g}).")
    plan = read_plan(plan_file)
    with err_console.status(f"Tracing {escape(plan.model.describe())}...", spinner="dots"):
        graph = retrace(plan, str(plan_file))
    with err_console.status(f"Re-planning {escape(plan.model.describe())}...", spinner="dots"):
        result = replan_plan(plan, lost=list(lost or []), add=list(add or []),
                             global_batch=global_batch, time_limit=time_limit, spare=spare,
                             graph=graph, keep_constraints=not ignore_constraints)
    new = result.new
    warn_small_batch(new)
    rows = diff(plan, new)
    if output is not None:
        write_atomic(output, plan_json(new), force=True)
    rebalanced = result.rebalanced.plan
    if json_out:
        sys.stdout.write(json.dumps({
            "kind": "replan", "from": str(plan_file), "lost": list(result.lost),
            "added": list(result.added), "kept": result.kept, "seconds": result.seconds,
            "global_batch": new.training.global_batch,
            "constraints": {"kept": to_jsonable(result.constraints),
                            "dropped_excludes": list(result.dropped),
                            "ignored": result.ignored},
            "rebalance": {"step_time": rebalanced.prediction.step_time if rebalanced else None,
                          "reason": result.rebalanced.reason},
            "search": {"step_time": result.searched.prediction.step_time
                       if result.searched else None,
                       "status": result.searched.solver.status if result.searched else None,
                       "error": result.search_error},
            "diff": rows_json(rows), "plan": {"kind": "plan", **to_jsonable(new)}},
            indent=1) + "\n")
        return
    from cli.render_explain import diff_table
    from cli.render_plan import render
    from planner.units import fmt_seconds

    what = [f"lost {', '.join(result.lost)}"] if result.lost else []
    what += [f"added {', '.join(result.added)}"] if result.added else []
    what += [f"slack to survive any one node's loss by a rebalance, up to {spare:.0%} "
             "slower than the best"] if spare is not None else []
    console.print(f"[bold]Re-plan:[/] {escape('; '.join(what))}", highlight=False)
    console.print("  warm start (the surviving pipelines, rebalanced): "
                  + (fmt_seconds(rebalanced.prediction.step_time) + " per step" if rebalanced
                     else f"none: {escape(result.rebalanced.reason)}"), highlight=False)
    searched = result.searched
    console.print("  search: " + (f"{fmt_seconds(searched.prediction.step_time)} per step, "
                                  f"{searched.solver.status}" if searched else
                                  f"no plan ({escape(result.search_error)})"), highlight=False)
    console.print(f"  kept the {'search' if result.kept == 'search' else 'rebalance'}'s plan; "
                  f"re-planned in {result.seconds:.2f} s", highlight=False)
    console.print(f"  constraints: {escape(constraints_line(result))}", highlight=False)
    if result.batch_changed:
        err_console.print(f"[yellow]note:[/] the global batch changes from "
                          f"{plan.training.global_batch} to {new.training.global_batch}: a run "
                          "resumed under this plan trains on other samples per step than the "
                          "interrupted run would have.", soft_wrap=True, highlight=False)
    console.print(headline(plan, new))
    console.print(diff_table(rows, title=f"{escape(str(plan_file))} -> the new plan"))
    render(console, new, [layer.name for layer in graph.layers])
    if output is not None:
        console.print(f"Wrote the plan to {output}", soft_wrap=True, highlight=False,
                      markup=False)


def constraints_line(result: Replan) -> str:
    """What the re-plan did with the constraints the plan was solved with."""
    from planner.constraints import flags

    if result.ignored:
        return (f"ignored (--ignore-constraints): the plan was solved with "
                f"{flags(result.old.constraints) or 'none'}; searched free")
    if result.constraints is None:
        return "none recorded in the plan file (a plan from before they were, or not " \
               "from `planner solve`): searched free"
    kept = flags(result.constraints)
    gone = "".join(f"; --exclude {name} dropped (the node is lost)" for name in result.dropped)
    return (f"kept {kept}, as the plan was solved (--ignore-constraints drops them)" if kept
            else "none (the plan was solved free)") + gone


def register(app: typer.Typer) -> None:
    app.command("replan")(replan)
