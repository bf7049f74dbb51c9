"""`planner tune`: run the best plans for a few steps, re-rank them by measured step time,
and write what the trials measured into a cluster file (`planner.tune`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cli import options as opt
from cli.tables import fit_words, output_console
from planner.errors import PlannerError
from planner.units import fmt_seconds

console = output_console()
err_console = Console(emoji=False, stderr=True)


def _plans(targets: list[str], *, cluster: str | None, global_batch: int | None,
           seq_len: int | None, dtype: str, top_k: int, time_limit: float,
           limits: dict, shape: dict) -> list:
    """The plans to try: the plan files given, or the `top_k` best plans of a solve."""
    from planner.planfile import read_plan

    files = [Path(t) for t in targets]
    if all(f.suffix == ".json" and f.is_file() for f in files):
        plans = [read_plan(f) for f in files]
        clusters = {p.cluster for p in plans}
        if len(clusters) > 1:
            raise PlannerError("bad-option", "The plan files are for different clusters; the "
                               "trials' measurements go back into one.",
                               ["tune the plans of one cluster at a time"])
        return plans
    if len(targets) != 1:
        raise PlannerError("bad-option", f"Give one model, or plan files (.json) that exist "
                           f"(got {', '.join(repr(t) for t in targets)}).")
    if cluster is None or global_batch is None:
        raise PlannerError("bad-option", f"To tune model {targets[0]!r} give --cluster and "
                           "--global-batch (-B): the trials run the best plans of its solve.",
                           ["or give plan files: planner tune plan.json other.json ..."])
    from cli.solve_cmd import _setup
    from planner.solver import Limits, SolveOptions, solve

    graph, spec, training = _setup(targets[0], cluster, global_batch, seq_len, dtype, shape)
    options = SolveOptions(limits=Limits(**limits), top_k=top_k, time_limit=time_limit,
                           with_baselines=False)
    with err_console.status("Solving...", spinner="dots"):
        return solve(graph, spec, training, options)


def tune(
    targets: Annotated[list[str], typer.Argument(
        help="A model (its best plans are solved for), or plan files to try.",
        metavar="MODEL_OR_PLANS...")],
    out: Annotated[Path, typer.Option(
        "--out", help="Folder for the trials (a launch folder and run per plan).")],
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Write the cluster with the trials' measurements here.")
    ] = None,
    cluster: Annotated[str | None, typer.Option(
        "--cluster", "-c", help="The cluster (with a model): a YAML file, example or "
        "inline spec of CPU nodes, e.g. 2x2xcpu.")] = None,
    global_batch: Annotated[int | None, typer.Option(
        "--global-batch", "-B", help="Samples per step (with a model).")] = None,
    seq_len: opt.SeqLen = None,
    dtype: Annotated[str, typer.Option("--dtype", help="Training dtype (with a model).")
                     ] = "fp32",
    top_k: Annotated[int, typer.Option("--top-k", help="Plans to try (with a model).")] = 3,
    steps: Annotated[int, typer.Option(
        "--steps", help="Training steps per trial; the first is warm-up.")] = 6,
    timeout: Annotated[float, typer.Option(
        "--timeout", help="Seconds a trial may run.")] = 600.0,
    time_limit: opt.TimeLimit = 30.0,
    tp: opt.Tp = None,
    pp: opt.Pp = None,
    micro_batch: opt.MicroBatch = None,
    layers: opt.Layers = None, hidden: opt.Hidden = None, heads: opt.Heads = None,
    force: opt.Force = False,
) -> None:
    """Try the best plans for a few steps and re-rank them by measured step time.

    Each plan runs with its own launch scripts (`planner launch --target local`: every
    rank a process on this machine's CPU) for --steps steps; the trials are ranked by
    the median step time their run summaries report. With -o, what they measured goes
    into a copy of the cluster (each device type's layer times at the degrees and
    micro-batch sizes tried), which the next `planner solve --cluster FILE` prices with.

    Examples:
      planner tune gpt-tiny -c 2x2xcpu -B 16 --top-k 3 --out trials/ -o measured.yaml
      planner tune plan.json other.json --out trials/
    """
    from cost_models.cluster import cluster_to_dict
    from cost_models.model import AnalyticalCostModel
    from planner.explain import retrace, structure
    from planner.files import check_writable, write_atomic
    from planner.launch import check_out
    from planner.tune import calibrate, check_cpu_plans, rank, run_trial

    if steps < 2:
        raise PlannerError("bad-option", f"--steps must be at least 2 (got {steps}): the "
                           "first step is warm-up, the others are timed.")
    if top_k < 1:
        raise PlannerError("bad-option", f"--top-k must be at least 1 (got {top_k}).")
    check_out(out, force=force)
    if output is not None:
        check_writable(output, force=force)
    limits = {k: v for k, v in (("tp", tp), ("pp", pp), ("micro_batch", micro_batch))
              if v is not None}
    plans = _plans(targets, cluster=cluster, global_batch=global_batch, seq_len=seq_len,
                   dtype=dtype, top_k=top_k, time_limit=time_limit, limits=limits,
                   shape=opt.overrides(layers=layers, hidden=hidden, heads=heads))
    check_cpu_plans(plans)
    trials = []
    for index, plan in enumerate(plans, 1):
        err_console.print(f"[{index}/{len(plans)}] trial of plan {index} ({escape(structure(plan))}"
                          f"), predicted {fmt_seconds(plan.prediction.step_time)} a step",
                          highlight=False, soft_wrap=True)
        trials.append(run_trial(plan, out / f"plan-{index}", index, steps=steps,
                                timeout=timeout, force=force))
    ranked = rank(trials)
    table = Table(title=f"Trials of {len(trials)} plan{'s' * (len(trials) != 1)}, "
                        f"{steps} steps each (median step after the warm-up)")
    for column in ("rank", "plan", "structure", "predicted", "measured", "error"):
        table.add_column(column, justify="left" if column == "structure" else "right")
    for place, trial in enumerate(ranked, 1):
        error = (f"{(trial.predicted - trial.measured) / trial.measured:+.0%}"
                 if trial.measured else "-")
        table.add_row(str(place), str(trial.index), structure(trial.plan),
                      fmt_seconds(trial.predicted),
                      fmt_seconds(trial.measured) if trial.measured else "failed", error)
    console.print(fit_words(table))
    for trial in trials:
        if trial.failure:
            err_console.print(f"[yellow]warning:[/] plan {trial.index}'s trial failed: "
                              f"{escape(trial.failure)}", highlight=False, soft_wrap=True)
    (out / "tune.json").write_text(json.dumps({"kind": "tune", "steps": steps, "trials": [
        {"plan": t.index, "folder": str(t.folder), "predicted_step_time": t.predicted,
         "measured_step_time": t.measured, "failure": t.failure} for t in ranked]},
        indent=1) + "\n")
    best = ranked[0]
    if best.measured is None:
        raise PlannerError("trial-failed", f"Every trial failed; see {out}/plan-*/trial.log.")
    console.print(f"Fastest measured: plan {best.index}, {fmt_seconds(best.measured)} a step "
                  f"({best.folder / 'plan.json'}).", markup=False, soft_wrap=True)
    if output is None:
        return
    import yaml

    layers_traced = retrace(best.plan).layers
    measured = calibrate(best.plan.cluster, trials, layers_traced,
                         AnalyticalCostModel(best.plan.cluster))
    write_atomic(output, f"# Made by `planner tune` from the trials in {out}\n"
                 + yaml.safe_dump(cluster_to_dict(measured), sort_keys=False), force=force)
    console.print(f"Wrote cluster {measured.name} with the trials' layer times to {output}; "
                  f"solve with it: planner solve {escape(best.plan.model.name)} --cluster "
                  f"{output}", markup=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("tune")(tune)
