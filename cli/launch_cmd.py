"""`planner launch`: scripts that run a plan with torchrun, SLURM or locally."""

from __future__ import annotations

import shlex
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from cli import options as opt

console = Console(emoji=False)
err_console = Console(emoji=False, stderr=True)


class Target(str, Enum):
    torchrun = "torchrun"
    slurm = "slurm"
    local = "local"


def _pairs(option: str, values: list[str] | None, key: str, example: str,
           each: str) -> dict[str, str]:
    """KEY=VALUE values of a repeatable option by key; a key named twice is refused, not
    overridden."""
    from planner.errors import PlannerError

    out: dict[str, str] = {}
    for value in values or []:
        name, sep, given = value.partition("=")
        if not sep or not name or not given:
            raise PlannerError("bad-option", f"{option} {value!r} must look like {key}=VALUE, "
                               f"e.g. {example}.")
        if name in out:
            raise PlannerError("bad-option", f"{option} names {key.lower()} {name!r} twice "
                               f"({out[name]!r}, then {given!r}); give each {each} once.",
                               [f"keep one of {option} {name}={out[name]} and {option} "
                                f"{name}={given}"])
        out[name] = given
    return out


def _cpus(values: list[str] | None) -> dict[str, str]:
    """--cpus NODE=CPUS values by node."""
    return _pairs("--cpus", values, "NODE", "worker-0=0 or worker-1=1-3", "node's CPU list")


def _check_runtime_args(args: list[str]) -> None:
    """--runtime-arg values as the runtime will parse them on every rank: refused here,
    once, rather than there."""
    import contextlib
    import io

    from planner.errors import PlannerError
    from planner.runtime.__main__ import options_from, parser
    from planner.runtime.train import check_options

    if not args:
        return
    if any(a == "--plan" or a.startswith("--plan=") for a in args):
        raise PlannerError("bad-option", "--runtime-arg --plan: the scripts pass the plan "
                           "they are written with (plan.json beside them).",
                           ["drop it; launch the plan you want instead"])
    messages = io.StringIO()
    try:
        with contextlib.redirect_stderr(messages):
            parsed = parser().parse_args(["--plan", "plan.json", *args])
    except SystemExit:
        problem = messages.getvalue().strip().splitlines()[-1:] or ["not understood"]
        raise PlannerError("bad-option", f"--runtime-arg {' '.join(args)}: the runtime "
                           f"would refuse it ({problem[0].removeprefix('usage: ')}).",
                           ["see python -m planner.runtime --help"]) from None
    try:
        check_options(options_from(parsed))
    except PlannerError as exc:
        raise PlannerError("bad-option", f"--runtime-arg {' '.join(args)}: the runtime would "
                           f"refuse it: {exc.message}", exc.remedies) from None


def launch(
    plan: Annotated[Path, typer.Argument(help="The plan file (planner solve -o plan.json).")],
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Folder for the scripts, the plan and a README.")] = None,
    target: Annotated[Target, typer.Option(
        "--target", "-t", help="torchrun (a script per node), slurm (an sbatch script) or "
        "local (every rank on this machine, CPU and gloo).")] = Target.torchrun,
    hosts: Annotated[Path | None, typer.Option(
        "--hosts", help="YAML/JSON mapping of plan node names to hosts: `node: host` or "
        "`node: {host, addr, cpus, ifname, env}`.")] = None,
    cpus: Annotated[list[str] | None, typer.Option(
        "--cpus", help="NODE=CPUS: pin a node's ranks to CPUs with taskset (local and "
        "torchrun targets; repeatable), e.g. --cpus worker-0=0.")] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print the files instead of writing them.")] = False,
    force: opt.Force = False,
    master_port: Annotated[int, typer.Option(
        "--master-port", help="Port of the static rendezvous on node rank 0.")] = 29500,
    max_restarts: Annotated[int, typer.Option(
        "--max-restarts", help="Restarts torchrun allows; restarted runs resume from the "
        "latest checkpoint.")] = 0,
    steps: Annotated[int, typer.Option("--steps", help="Training steps.")] = 10,
    checkpoint_every: Annotated[int, typer.Option(
        "--checkpoint-every", help="Checkpoint every K steps (0: only at the end).")] = 0,
    run_dir: Annotated[str | None, typer.Option(
        "--run-dir", help="Checkpoints, logs, summary (default: run/ in the --out folder).")
    ] = None,
    data: Annotated[str | None, typer.Option(
        "--data", help="A data hook package.module:function (default: synthetic data).")
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the weights and data.")] = 0,
    lr: Annotated[float, typer.Option("--lr", help="Learning rate.")] = 1e-3,
    python: Annotated[str | None, typer.Option(
        "--python", help="Python on the nodes (default: python3; local: this one).")] = None,
    sbatch: Annotated[list[str] | None, typer.Option(
        "--sbatch", help="An extra #SBATCH option, e.g. --sbatch=--partition=gpu "
        "(repeatable; --signal or --no-requeue replace the script's own).")] = None,
    constraint: Annotated[list[str] | None, typer.Option(
        "--constraint", help="DEVICE=FEATURES: the SLURM --constraint of the component of "
        "that device type, e.g. --constraint A100-80G-SXM=a100 (repeatable).")] = None,
    gres: Annotated[list[str] | None, typer.Option(
        "--gres", help="DEVICE=GRES: the SLURM --gres of that device type's component in "
        "place of --gpus-per-node, e.g. --gres V100-32G=gpu:v100:4 (repeatable).")] = None,
    rendezvous_timeout: Annotated[int, typer.Option(
        "--rendezvous-timeout", help="Seconds the nodes wait for each other before the ones "
        "missing are named.")] = 600,
    runtime_arg: Annotated[list[str] | None, typer.Option(
        "--runtime-arg", help="Another argument for python -m planner.runtime (repeatable).")
    ] = None,
    supervise: Annotated[bool, typer.Option(
        "--supervise", help="Also write supervise.sh: it runs the plan and, when a node is "
        "lost, re-plans on the nodes left, writes their scripts and resumes from the newest "
        "checkpoint.", rich_help_panel="Supervisor")] = False,
    max_replans: Annotated[int | None, typer.Option(
        "--max-replans", help="Re-plans the supervisor may make (default 3).",
        rich_help_panel="Supervisor")] = None,
    replan_time_limit: Annotated[float | None, typer.Option(
        "--replan-time-limit", help="Seconds each re-plan's search may take (default 10).",
        rich_help_panel="Supervisor")] = None,
) -> None:
    """Write launch scripts that train with PLAN on real torch.distributed.

    Examples:
      planner launch plan.json --out launch/ --hosts hosts.yaml
      planner launch plan.json --out job/ --target slurm --sbatch=--partition=gpu
      planner launch plan.json --out try/ --target local --steps 20 && bash try/run-local.sh
      planner launch plan.json --out sup/ --supervise --checkpoint-every 50 --hosts hosts.yaml
    """
    from planner.errors import PlannerError
    from planner.launch import (
        HostEntry,
        SuperviseOptions,
        check_model,
        check_out,
        hostless_nodes,
        parse_hosts,
        read_hosts,
        render_launch,
        write_launch,
    )
    from planner.planfile import read_plan
    from planner.runtime.layout import rank_layout
    from planner.runtime.train import checkpoint_warning
    from planner.solver.uniform import overflows

    if out is None and not dry_run:
        raise PlannerError("bad-option", "Pass --out DIR (the folder for the scripts) or "
                           "--dry-run.")
    if out is not None and not dry_run:  # before the model is traced, not after
        check_out(out, force=force)
    loaded = read_plan(plan)
    problems = overflows(loaded.pipelines, loaded.cluster)
    if problems:
        raise PlannerError("does-not-fit", f"{str(plan)!r} does not fit in device memory, so its "
                           "run would fail: " + "; ".join(problems[:3])
                           + ("; ..." if len(problems) > 3 else "."),
                           ["make a plan that fits with `planner solve` (it returns only "
                            "such plans)", "or change the recipe with `planner estimate`"])
    if steps < 1:
        raise PlannerError("bad-option", f"--steps must be positive (got {steps}).")
    if checkpoint_every < 0:
        raise PlannerError("bad-option", f"--checkpoint-every must be 0 or more (got "
                           f"{checkpoint_every}).")
    warning = checkpoint_warning(steps, checkpoint_every)
    if warning:
        err_console.print(f"[yellow]warning:[/] {escape(warning)}.", highlight=False,
                          soft_wrap=True)
    if not lr > 0 or lr == float("inf"):
        raise PlannerError("bad-option", f"--lr must be a positive number (got {lr}).")
    if not 0 <= seed < 2**63:
        raise PlannerError("bad-option", f"--seed must be between 0 and 2**63 - 1 (got "
                           f"{seed}).")
    module, colon, function = (data or "").partition(":")
    if data is not None and not (colon and module and function):
        raise PlannerError("bad-option", f"--data {data!r} must name a data hook as "
                           "package.module:function (importable on every node).")
    supervisor = {key: value for key, value in (("max_replans", max_replans),
                                                ("time_limit", replan_time_limit))
                  if value is not None}
    supervisor_only = [flag for flag, key in (("--max-replans", "max_replans"),
                                              ("--replan-time-limit", "time_limit"))
                       if key in supervisor]
    if supervisor_only and not supervise:
        raise PlannerError("bad-option", f"{' and '.join(supervisor_only)} set(s) up the "
                           "supervisor; give --supervise too.")
    slurm_only = [name for name, given in (("--sbatch", sbatch), ("--constraint", constraint),
                                           ("--gres", gres)) if given]
    if slurm_only and target is not Target.slurm:
        raise PlannerError("bad-option", f"{' and '.join(slurm_only)} go(es) into the SLURM job "
                           f"script; the {target.value} target has none.", ["use --target slurm"])
    constraints = _pairs("--constraint", constraint, "DEVICE", "A100-80G-SXM=a100",
                         "device type's constraint")
    gres_by_type = _pairs("--gres", gres, "DEVICE", "V100-32G=gpu:v100:4", "device type's gres")
    _check_runtime_args(list(runtime_arg or []))
    entries = read_hosts(hosts) if hosts is not None else {}
    for node, cpu_list in _cpus(cpus).items():
        base = entries.get(node) or HostEntry()
        entries[node] = HostEntry(host=base.host, addr=base.addr, cpus=cpu_list,
                                  ifname=base.ifname, env=base.env)
    if entries:
        entries = parse_hosts({name: {"host": e.host, "addr": e.addr, "cpus": e.cpus,
                                      "ifname": e.ifname, "env": dict(e.env)}
                               for name, e in entries.items()}, "--hosts/--cpus")
    # the plan against its model as every rank will check it, once here where the model
    # can be built (a user's package may live on the nodes only)
    from planner.models import load_model

    try:
        with err_console.status(f"Building {escape(loaded.model.describe())} on meta to "
                                "check the plan's stages...", spinner="dots"):
            model = load_model(loaded.model, seq_len=loaded.training.seq_len, device="meta")
    except PlannerError as exc:
        err_console.print(f"[yellow]note:[/] the plan's stages were not checked against its "
                          f"model, which cannot be built here: {escape(exc.message)} Every "
                          "rank checks them when it starts.", highlight=False)
    else:
        with err_console.status(f"Tracing {escape(loaded.model.describe())} to check the "
                                "plan against it...", spinner="dots"):
            check_model(loaded, model.module, str(plan))
    args = ["--steps", str(steps), "--seed", str(seed), "--lr", repr(lr)]
    if checkpoint_every:
        args += ["--checkpoint-every", str(checkpoint_every)]
    if data:
        args += ["--data", data]
    args += list(runtime_arg or [])
    files = render_launch(
        loaded, target=target.value, hosts=entries, master_port=master_port,
        max_restarts=max_restarts, runtime_args=args,
        python=python or (sys.executable if target is Target.local else "python3"),
        run_dir=run_dir, sbatch=list(sbatch or []), constraints=constraints,
        gres=gres_by_type, rendezvous_timeout=rendezvous_timeout,
        folder=str(out.resolve()) if out is not None else None,
        supervise=SuperviseOptions(**supervisor) if supervise else None)
    # (SLURM picks the hosts of nodes no one named)
    hostless = hostless_nodes(loaded, entries) if target is Target.torchrun else []
    if hostless:
        given = f"{escape(str(hosts))} does not map" if hosts is not None else "no --hosts maps"
        err_console.print(
            f"[yellow]warning:[/] {given} node(s) {escape(', '.join(hostless))}, and the "
            "plan's cluster gives them no host, so the scripts use these node names as host "
            "names: they work only where the names resolve to the nodes. Map every node to "
            "its host in a hosts file (`node: host`, --hosts FILE).",
            highlight=False, soft_wrap=True)
    # GPU types some of whose nodes SLURM picks with nothing to tell their type by
    unplaced = sorted({n.device_type for n in rank_layout(loaded).nodes
                       if not n.is_cpu and n.name in hostless_nodes(loaded, entries)}
                      - set(constraints) - set(gres_by_type)) if target is Target.slurm else []
    if unplaced:
        err_console.print(
            f"[yellow]warning:[/] no --constraint (or --gres) for {escape(', '.join(unplaced))}: "
            "SLURM may place those components on nodes of any GPU type. Give the node feature "
            f"your site marks them with, e.g. --constraint {escape(unplaced[0])}=FEATURE, or "
            "their hosts (--hosts).", highlight=False, soft_wrap=True)
    if dry_run:
        for name, text in files.items():
            if name == "plan.json":
                continue
            sys.stdout.write(f"==> {name} <==\n{text}\n")
        return
    assert out is not None
    write_launch(files, out, force=force)
    main_file = "supervise.sh" if supervise else {
        "local": "run-local.sh", "slurm": "launch.sbatch"}.get(target.value)
    console.print(f"Wrote {len(files)} files to {out}: " + ", ".join(files), soft_wrap=True,
                  markup=False)
    if main_file:  # sbatch from inside the folder: the job finds its scripts there
        run = ("bash" if target is Target.local or supervise else "sbatch") + " " + shlex.quote(
            str(out / main_file))
        console.print(f"Run: {run}  (see {out / 'README.md'})", soft_wrap=True, markup=False)
    else:
        console.print(f"Run each node's script on its host (see {out / 'README.md'}).",
                      soft_wrap=True, markup=False)
    if (max_restarts or supervise) and not checkpoint_every:
        console.print(f"[yellow]note:[/] {'--max-restarts' if max_restarts else '--supervise'} "
                      "without --checkpoint-every: a restart resumes from the last checkpoint, "
                      "and only the final step saves one.", soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("launch")(launch)
