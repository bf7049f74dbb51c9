"""`planner compare A B ...` and `planner what-if PLAN [edits]`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from cli import options as opt
from cli.solve_cmd import Output, warn_small_batch
from cli.tables import output_console

console = output_console()
err_console = Console(emoji=False, stderr=True)

Price = Annotated[list[str] | None, typer.Option(
    "--price", metavar="TYPE=DOLLARS", help="Dollars per device-hour of a device type, to "
    "show cost in dollars (repeatable), e.g. --price A100-80G-SXM=2.5.")]


def _names(paths: list[Path]) -> list[str]:
    stems = [p.stem for p in paths]
    return [str(p) if stems.count(p.stem) > 1 else p.stem for p in paths]


_STRATEGY_OPTIONS = ("cluster", "global_batch", "seq_len", "interval", "time_limit", "svg",
                     "force")  # what only --strategies takes


def compare(
    ctx: typer.Context,
    plans: Annotated[list[Path] | None, typer.Argument(
        metavar="PLAN...", help="Two or more plan files; the first is the reference.",
        show_default=False)] = None,
    json_out: opt.JsonOut = False,
    price: Price = None,
    only_differences: Annotated[bool, typer.Option(
        "--only-differences", "-d", help="Show only the rows where the plans differ.")] = False,
    strategies: Annotated[str | None, typer.Option(
        "--strategies", metavar="MODEL", show_default=False, rich_help_panel="Strategies",
        help="Instead of plan files: DDP, FSDP ZeRO-2/3, local SGD, DiLoCo and the solver's "
        "hybrid plan for MODEL on --cluster, side by side, with their scaling curve.")] = None,
    cluster: Annotated[str, typer.Option(
        "--cluster", "-c", rich_help_panel="Strategies",
        help="With --strategies: a cluster YAML file, a built-in example or inline.")
    ] = "a100-v100-lab",
    global_batch: Annotated[int, typer.Option(
        "--global-batch", "-B", rich_help_panel="Strategies",
        help="With --strategies: samples per step.")] = 512,
    seq_len: Annotated[int | None, typer.Option(
        "--seq-len", "-s", rich_help_panel="Strategies", show_default=False,
        help="With --strategies: sequence length (default: the model's).")] = None,
    interval: Annotated[int, typer.Option(
        "--interval", metavar="H", rich_help_panel="Strategies",
        help="With --strategies: steps between syncs of local SGD and DiLoCo.")] = 8,
    time_limit: Annotated[float, typer.Option(
        "--time-limit", rich_help_panel="Strategies",
        help="With --strategies: seconds for the hybrid plan's search.")] = 60.0,
    svg: Annotated[Path | None, typer.Option(
        "--svg", rich_help_panel="Strategies",
        help="With --strategies: write the scaling curve as a self-contained SVG.")] = None,
    force: Annotated[bool, typer.Option(
        "--force", rich_help_panel="Strategies",
        help="With --strategies: overwrite the --svg file.")] = False,
) -> None:
    """Compare plans side by side, the differences from the first highlighted; or with
    --strategies, the usual ways to train a model beside the solver's plan.

    Rows: structure (devices, pipelines, stages, tp, micro-batches, recompute, ZeRO),
    predicted step time and throughput, the step time by cause (communication
    included), memory headroom and cost (device-hours; dollars with --price).
    Green is better than the first plan, red worse, yellow a changed structure.

    --strategies MODEL: DDP, FSDP ZeRO-2 and ZeRO-3, local SGD and DiLoCo every H steps
    and the solver's best hybrid plan, each priced by the solver's step model at 1, 2,
    4, ... replicas and on every device: throughput, peak memory per device,
    communication per step, convergence risk, the scaling curve (--svg draws it).

    Examples:
      planner compare plan.json what-if.json
      planner compare a.json b.json c.json --price A100-80G-SXM=2.5 --price V100-32G=0.9
      planner compare a.json b.json --json | jq '.rows[] | select(.key=="step_time")'
      planner compare --strategies gpt2-small -c a100-v100-lab -B 64 --svg scaling.svg
    """
    from planner.compare import compare as compare_plans
    from planner.compare import parse_prices, rows_json
    from planner.errors import PlannerError
    from planner.planfile import read_plan

    if strategies is not None:
        from cli.strategies_cmd import show_strategies

        if plans or price or only_differences:
            raise PlannerError("bad-option", "--strategies prices a model's strategies; it "
                               "takes no plan files, --price or --only-differences.",
                               ["planner compare --strategies MODEL -c CLUSTER",
                                "or planner compare PLAN PLAN ..."])
        show_strategies(strategies, cluster=cluster, global_batch=global_batch,
                        seq_len=seq_len, interval=interval, time_limit=time_limit, svg=svg,
                        force=force, json_out=json_out)
        return
    # (typer ships its own click: its ParameterSource is told by name)
    given = [param.opts[0] for param in ctx.command.params if param.name in _STRATEGY_OPTIONS
             and getattr(ctx.get_parameter_source(param.name), "name", "DEFAULT") != "DEFAULT"]
    if given:
        raise PlannerError("bad-option", f"{', '.join(given)}: only with --strategies MODEL "
                           "(plan files hold their own cluster, batch and layout).",
                           ["planner compare --strategies MODEL -c CLUSTER ...",
                            "or drop " + ", ".join(given)])
    plans = plans or []
    if len(plans) < 2:
        raise PlannerError("bad-option", f"Give at least two plan files to compare (got "
                           f"{len(plans)}).", ["planner explain PLAN shows a single plan"])
    prices = parse_prices(price)
    loaded = [read_plan(p) for p in plans]
    used = sorted({s.device_type for p in loaded for pipe in p.pipelines for s in pipe.stages})
    if prices and (unknown := sorted(set(prices) - set(used))):
        raise PlannerError("bad-option", f"--price names {', '.join(unknown)}, which none of "
                           "the plans uses.", [f"price the types the plans use: "
                                               f"{', '.join(used)}"])
    if prices and (missing := [k for k in used if k not in prices]):
        err_console.print(f"[yellow]note:[/] no --price for {escape(', '.join(missing))}: "
                          "plans that use them show no dollar cost.", soft_wrap=True)
    rows = compare_plans(loaded, prices)
    if only_differences:
        rows = [r for r in rows if r.differs or r.key in ("step_time", "samples_per_s")]
    if json_out:
        sys.stdout.write(json.dumps({"kind": "comparison", "plans": [str(p) for p in plans],
                                     "rows": rows_json(rows)}, indent=1) + "\n")
        return
    from cli.render_explain import compare_table

    models = {p.model.describe() for p in loaded}
    title = (f"{len(plans)} plans against {escape(str(plans[0]))} (green better, red worse, "
             "yellow changed)")
    console.print(compare_table(rows, _names(plans), title=title))
    if len(models) > 1:
        console.print(f"[yellow]Note:[/] the plans are for different models "
                      f"({escape(', '.join(sorted(models)))}); step times are not "
                      "comparable work.")


def what_if(
    plan_file: Annotated[Path, typer.Argument(metavar="PLAN", help="The plan to start from.")],
    add: Annotated[list[str] | None, typer.Option(
        "--add", metavar="NODESxDEVICESxTYPE", help="Add nodes, e.g. --add 4x8xV100-32G "
        "(repeatable).", rich_help_panel="Cluster edits")] = None,
    remove: Annotated[list[str] | None, typer.Option(
        "--remove", metavar="NODE|NxTYPE", help="Remove a node, or the last N nodes of a type "
        "(repeatable).", rich_help_panel="Cluster edits")] = None,
    resize: Annotated[list[str] | None, typer.Option(
        "--resize", metavar="NODE=N", help="Devices per node of a node or device type "
        "(repeatable).", rich_help_panel="Cluster edits")] = None,
    link: Annotated[list[str] | None, typer.Option(
        "--link", metavar="TARGET=BANDWIDTH", help="Change a link: network, nic:NODE, "
        "intra:NODE or intra:TYPE, group:NAME; e.g. --link network=25Gbps (repeatable).",
        rich_help_panel="Cluster edits")] = None,
    nic: Annotated[str | None, typer.Option(
        "--nic", help="A network card for the --add nodes, e.g. 25Gbps.",
        rich_help_panel="Cluster edits")] = None,
    group: Annotated[str | None, typer.Option(
        "--group", help="The group (rack, zone) of the --add nodes.",
        rich_help_panel="Cluster edits")] = None,
    global_batch: Annotated[int | None, typer.Option(
        "--global-batch", "-B", help="Samples per step (default: the plan's).")] = None,
    seq_len: opt.SeqLen = None,
    dtype: Annotated[str | None, typer.Option(
        "--dtype", help="bf16, fp16, fp32, tf32, or auto (default: the plan's dtype).")] = None,
    tp: opt.Tp = None,
    max_tp: opt.MaxTp = None,
    pp: opt.Pp = None,
    dp: opt.Dp = None,
    max_dp: opt.MaxDp = None,
    micro_batch: opt.MicroBatch = None,
    max_stages: Annotated[int | None, typer.Option(
        "--max-stages", help="Most stages per pipeline.", rich_help_panel="Constraints")] = None,
    recompute: opt.Recompute = None,
    zero: opt.Zero = None,
    exclude: opt.Exclude = None,
    first_stage: opt.FirstStage = None,
    last_stage: opt.LastStage = None,
    interleave: opt.Interleave = None,
    max_interleave: opt.MaxInterleave = None,
    schedule: opt.ScheduleChoice = None,
    mixed: opt.Mixed = True,
    tp_per_class: opt.TpPerClass = False,
    mixed_share_types: opt.MixedShareTypes = False,
    time_limit: opt.TimeLimit = 60.0,
    output: Output = None,
    cluster_out: Annotated[Path | None, typer.Option(
        "--cluster-out", help="Also write the edited cluster as YAML.")] = None,
    price: Price = None,
    json_out: opt.JsonOut = False,
    force: opt.Force = False,
) -> None:
    """Change the cluster or training setup of a plan, solve again, show what changed.

    Edits apply in this order: --add, --remove, --resize, --link, then the training
    options. The model is the plan's; constraints apply to the new solve only.
    This is what the interactive session's what-if commands do.

    Examples:
      planner what-if plan.json --add 4x8xV100-32G
      planner what-if plan.json --link network=25Gbps --remove ws -o slow-net.json
      planner what-if plan.json -B 1024 --seq-len 4096 --tp 4 --json
    """
    import dataclasses

    import yaml

    from cli.progress import solve_progress
    from cost_models.cluster import cluster_to_dict
    from planner import whatif
    from planner.compare import diff, headline, parse_prices, rows_json
    from planner.errors import PlannerError
    from planner.files import check_writable, write_atomic
    from planner.planfile import plan_json, read_plan, to_jsonable
    from planner.session import (
        Constraints,
        Tracer,
        parse_constraint,
        resolve_dtype,
        solve_plans,
    )

    for path in (output, cluster_out):
        if path is not None:
            check_writable(path, force=force)
    prices = parse_prices(price)
    plan = read_plan(plan_file)
    cluster = plan.cluster
    edits: list[str] = []
    for spec in add or []:
        cluster = whatif.add_nodes(cluster, spec, nic=nic, group=group)
        edits.append(f"add {spec}")
    if remove:
        cluster = whatif.remove_nodes(cluster, remove)
        edits.append(f"remove {' '.join(remove)}")
    for item in resize or []:
        name, value = whatif.parse_assignment(item, "--resize", "v100-32g-0=4")
        cluster = whatif.resize_node(cluster, name, whatif.parse_int(value, "--resize"))
        edits.append(f"resize {name} {value}")
    for item in link or []:
        target, value = whatif.parse_assignment(item, "--link", "network=25Gbps")
        cluster = whatif.set_link(cluster, target, value)
        edits.append(f"link {target} {value}")
    if (nic or group) and not add:
        raise PlannerError("bad-option", "--nic and --group describe --add nodes; give --add "
                           "too.")
    constraints = Constraints(exclude=tuple(exclude or ()), mixed=mixed,
                              tp_per_class=tp_per_class, mixed_share_types=mixed_share_types)
    for key, value in (("tp", tp), ("max-tp", max_tp), ("pp", pp), ("dp", dp),
                       ("max-dp", max_dp),
                       ("micro-batch", micro_batch), ("max-stages", max_stages),
                       ("recompute", recompute), ("zero", zero),
                       ("first-stage", first_stage), ("last-stage", last_stage),
                       ("interleave", interleave), ("max-interleave", max_interleave),
                       ("schedule", schedule)):
        if value is not None:
            constraints = parse_constraint(constraints, key, str(value))
    names = {n.name for n in cluster.nodes}
    for name in constraints.exclude:
        if name not in names:
            raise whatif._unknown_node(cluster, name)
    new_dtype = resolve_dtype(dtype, cluster) if dtype else plan.training.dtype
    training = whatif.edit_training(plan.training, global_batch=global_batch, seq_len=seq_len,
                                    dtype=new_dtype)
    if global_batch is not None:
        edits.append(f"global batch {global_batch}")
    if seq_len is not None:
        edits.append(f"sequence length {seq_len}")
    if new_dtype != plan.training.dtype:
        edits.append(f"dtype {new_dtype}")
    tracing = f"Tracing {escape(plan.model.describe())}..."
    with err_console.status(tracing, spinner="dots"):
        graph = Tracer()(plan.model, seq_len or plan.training.seq_len, training.dtype)
    training = dataclasses.replace(training, seq_len=graph.seq_len)
    with solve_progress(err_console, time_limit) as progress:
        plans = solve_plans(graph, cluster, training, constraints, time_limit=time_limit,
                            top_k=1, progress=progress.update)
    new = plans[0]
    progress.finish(new)
    warn_small_batch(new)
    rows = diff(plan, new, prices)
    if output is not None:
        write_atomic(output, plan_json(new), force=True)
    if cluster_out is not None:
        write_atomic(cluster_out, yaml.safe_dump(cluster_to_dict(cluster), sort_keys=False),
                     force=True)
    if json_out:
        sys.stdout.write(json.dumps({"kind": "what-if", "from": str(plan_file),
                                     "edits": edits, "diff": rows_json(rows),
                                     "plan": {"kind": "plan", **to_jsonable(new)}},
                                    indent=1) + "\n")
        return
    from cli.render_explain import diff_table
    from cli.render_plan import render

    done = escape("; ".join(edits)) or "nothing changed, solved again"
    console.print(f"[bold]What if:[/] {done}")
    console.print(headline(plan, new))
    console.print(diff_table(rows, title=f"{escape(str(plan_file))} -> the new plan"))
    render(console, new, [layer.name for layer in graph.layers])
    for path, what in ((output, "plan"), (cluster_out, "cluster")):
        if path is not None:
            console.print(f"Wrote the {what} to {path}", soft_wrap=True, highlight=False,
                          markup=False)


def register(app: typer.Typer) -> None:
    app.command("compare")(compare)
    app.command("what-if")(what_if)
