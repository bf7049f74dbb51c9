"""`planner schedule` (many jobs on one shared cluster) and `planner jobs` (the
reservations the ledger holds)."""

from __future__ import annotations

import contextlib
import getpass
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cli import options as opt
from cli.tables import output_console

if TYPE_CHECKING:
    from collections.abc import Sequence

    from planner.schedule.jobs import Job
    from planner.schedule.pool import Pool
    from planner.schedule.setup import Setup
    from planner.schedule.simulate import Settings, Simulation
    from planner.types import Plan

console = output_console()
err_console = Console(emoji=False, stderr=True)

JobsArg = Annotated[Path, typer.Argument(
    metavar="JOBS", help="The jobs file (YAML), or a job trace in Gavel's format (.trace).")]
Ledger = Annotated[Path | None, typer.Option(
    "--ledger", help="The reservations ledger (default: $PLANNER_LEDGER, else "
    "~/.local/share/planner/ledger.sqlite).")]


def schedule(
    jobs_file: JobsArg,
    cluster: Annotated[str | None, typer.Option(
        "--cluster", "-c", help="A cluster YAML file, a built-in example or inline "
        "(2x8xA100-80G,4x8xV100-32G@100Gbps).")] = None,
    gpus: Annotated[str | None, typer.Option(
        "--gpus", help="Instead of --cluster, devices per type for jobs given by profile, "
        "named as the throughput matrix names them: v100=36,p100=36,k80=36.")] = None,
    per_node: Annotated[int, typer.Option(
        "--per-node", help="Devices per machine with --gpus.")] = 4,
    policy: Annotated[str, typer.Option(
        "--policy", "-p", help="max-min-fairness, min-jct, max-throughput, min-makespan, "
        "finish-time-fairness, or the baselines gavel and fifo.")] = "max-min-fairness",
    compare: Annotated[bool, typer.Option(
        "--compare", help="Simulate every policy on the jobs and compare them.")] = False,
    interactive: Annotated[bool, typer.Option(
        "--interactive", "-i", help="Then take commands (from stdin): add and remove jobs, "
        "change the policy, show the schedule, compare, what-if; `help` lists them.")]
    = False,
    throughputs: Annotated[Path | None, typer.Option(
        "--throughputs", help="A measured throughput matrix in Gavel's format, for jobs "
        "given by profile (default: the jobs file's `throughputs`).")] = None,
    round_length: Annotated[float, typer.Option(
        "--round", help="Seconds per scheduling round.")] = 360.0,
    checkpoint: Annotated[float, typer.Option(
        "--checkpoint", help="Seconds a job takes to save its state before it stops or "
        "moves.")] = 30.0,
    restore: Annotated[float, typer.Option(
        "--restore", help="Seconds a job takes to start or resume.")] = 30.0,
    time_limit: Annotated[float, typer.Option(
        "--time-limit", help="Seconds for each plan the planner prices (model jobs).")] = 5.0,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Write schedule.json, timeline.svg, timeline.html and a launch "
        "folder per job that starts now (jobs/NAME/) into this folder.")] = None,
    target: Annotated[str, typer.Option(
        "--target", help="Launch scripts for torchrun or slurm (see `planner launch`).")]
    = "torchrun",
    reserve: Annotated[bool, typer.Option(
        "--reserve", help="Reserve the devices of the jobs that start now in the ledger, "
        "so that other planners plan around them.")] = False,
    ledger: Ledger = None,
    json_out: opt.JsonOut = False,
    force: opt.Force = False,
) -> None:
    """Schedule many training jobs on one shared heterogeneous cluster.

    Each round (6 minutes by default) a policy shares the devices among the jobs
    that have arrived, knowing how fast each job runs on each allocation: from the
    planner's own plans (jobs given by `model`) or a measured matrix in Gavel's
    format (jobs given by `profile`). A job may span two device types, and two jobs
    may share devices where that wins. The schedule is simulated to the end (with
    checkpoint and restore costs for every move), which gives each job's start and
    finish; what runs now can get its plan and launch scripts (--out) and its
    devices reserved (--reserve). Devices other planners reserved are left alone.

    The jobs file:

      throughputs: gavel.json      # optional, for profile jobs
      jobs:
        - {name: bert, model: bert-large, global_batch: 256, seq_len: 512,
           steps: 5000, min_devices: 4, max_devices: 8}
        - {name: resnet, profile: "ResNet-50 (batch size 64)", steps: 100000,
           arrival: 30min, weight: 2}

    Examples:
      planner schedule jobs.yaml -c lab.yaml
      planner schedule jobs.yaml -c lab.yaml --policy min-jct --out sched/ --reserve
      planner schedule gavel.trace --throughputs gavel.json --gpus v100=36,p100=36,k80=36 \\
          --compare
      planner schedule jobs.yaml -c lab.yaml -i     # then: show, what-if policy min-jct
    """
    from planner.errors import PlannerError
    from planner.schedule.ledger import RETRIES, open_ledger
    from planner.schedule.policies import POLICIES
    from planner.schedule.policies import policy as find_policy
    from planner.schedule.simulate import Settings

    for flag, value in (("--round", round_length), ("--time-limit", time_limit)):
        if not value > 0:
            raise PlannerError("bad-option", f"{flag} must be a positive number of seconds "
                               f"(got {value:g}).")
    for flag, value in (("--checkpoint", checkpoint), ("--restore", restore)):
        if not value >= 0:
            raise PlannerError("bad-option", f"{flag} must be 0 or more seconds (got "
                               f"{value:g}).")
    if target not in ("torchrun", "slurm"):
        raise PlannerError("bad-option", f"--target {target!r}: scheduled jobs launch with "
                           "torchrun or slurm.")
    chosen = find_policy(policy)
    if compare and (out is not None or reserve):
        raise PlannerError("bad-option", "--compare simulates every policy; it writes and "
                           "reserves nothing.", ["drop --out / --reserve, or --compare"])
    if interactive and (compare or out is not None or reserve or json_out):
        raise PlannerError("bad-option", "--interactive takes commands and prints their "
                           "replies; it writes, reserves and compares nothing at the start.",
                           ["drop --compare / --out / --reserve / --json, or "
                            "--interactive"])
    if out is not None:
        _check_out(out, force)
    setup = _setup(jobs_file, cluster, gpus, per_node, throughputs, time_limit)
    settings = Settings(round_length=round_length, checkpoint=checkpoint, restore=restore)
    book = open_ledger(ledger, create=reserve)
    if compare:
        _compare(setup, settings, book, [POLICIES[name] for name in POLICIES], json_out)
        return
    if interactive:
        _interact(setup, chosen.name, settings)
        return
    reserved: list = []
    for attempt in range(RETRIES):
        simulation = _simulate(setup, chosen, settings, book)
        plans = _plans(setup, simulation)
        files = _files(setup, simulation, settings, plans, target) if out is not None else {}
        try:
            reserved = _reserve(setup, simulation, book) if reserve else []
            break
        except PlannerError as exc:  # another planner took devices meanwhile
            if exc.kind != "reserved" or attempt == RETRIES - 1:
                raise
    try:
        written = _write(out, files) if out is not None else []
    except BaseException:  # (no files, no reservation: nothing half done)
        for reservation in reserved:
            book.cancel(reservation.id)
        raise
    if json_out:
        from planner.schedule.setup import schedule_document

        document = schedule_document(simulation, setup, settings, plans)
        document["reservations"] = [r.id for r in reserved]
        sys.stdout.write(json.dumps(document, indent=1) + "\n")
        return
    _render(setup.jobs_file.jobs, setup.pool, simulation, plans)
    for reservation in reserved:
        console.print(f"Reserved for {escape(reservation.job)}: reservation "
                      f"{reservation.id} ({escape(str(book.path))})")
    if written:
        console.print(f"Wrote {len(written)} files into {escape(str(out))}")


def _check_out(out: Path, force: bool) -> None:
    from planner.errors import PlannerError

    if out.exists() and not out.is_dir():
        raise PlannerError("bad-path", f"{str(out)!r} is a file, not a folder.",
                           ["choose another --out folder"])
    if out.exists() and any(out.iterdir()) and not force:
        raise PlannerError("file-exists", f"{str(out)!r} already exists and is not empty; it "
                           "was left as it is.", ["pass --force to overwrite the files in it",
                                                  "choose another --out folder"])


def _setup(jobs_file: Path, cluster: str | None, gpus: str | None, per_node: int,
           throughputs: Path | None, time_limit: float) -> Setup:
    from cost_models.cluster import load_cluster
    from planner.schedule.gavel import read_trace
    from planner.schedule.jobs import JobsFile, read_jobs
    from planner.schedule.setup import load_setup, parse_gpus

    jobs = (JobsFile(jobs=read_trace(jobs_file), resources={}) if jobs_file.suffix == ".trace"
            else read_jobs(jobs_file))
    spec = load_cluster(cluster) if cluster is not None else None
    pool = parse_gpus(gpus, per_node) if gpus is not None else None
    return load_setup(jobs, cluster=spec, gpus=pool, matrix_path=throughputs,
                      time_limit=time_limit)


def _simulate(setup: Setup, policy, settings: Settings, book) -> Simulation:
    from planner.schedule.ledger import free_devices
    from planner.schedule.simulate import simulate

    held = book.held(setup.pool.name) if book is not None else {}
    free = free_devices(setup.pool.machines, held) if held else None
    with (err_console.status(f"Simulating the schedule ({escape(policy.name)})...",
                             spinner="dots") if err_console.is_terminal
          else contextlib.nullcontext()):
        return simulate(setup.jobs_file.jobs, setup.pool, setup.throughputs, policy, settings,
                        free=free)


def _plans(setup: Setup, simulation: Simulation) -> dict[str, Plan | None]:
    """The plan of each model job that starts now, on the very devices it gets."""
    from planner.schedule.setup import starting_now

    predicted = setup.throughputs.predicted
    plans: dict[str, Plan | None] = {}
    if predicted is None:
        return plans
    jobs = {job.name: job for job in setup.jobs_file.jobs}
    for placement in starting_now(simulation):
        for name in placement.option.jobs:
            if jobs[name].model is not None:
                plans[name] = predicted.plan(jobs[name], {
                    machine: len(indices) for machine, indices in placement.devices})
    return plans


def _reserve(setup: Setup, simulation: Simulation, book) -> list:
    from planner.schedule.setup import starting_now

    requests = [(" + ".join(p.option.jobs), {m: list(d) for m, d in p.devices})
                for p in starting_now(simulation)]
    if not requests:
        return []
    return book.reserve(setup.pool.name, requests, owner=f"{getpass.getuser()} (planner "
                        "schedule)")


def _files(setup: Setup, simulation: Simulation, settings: Settings, plans: dict,
           target: str) -> dict[str, str]:
    """{path in --out: text}: the schedule, its timeline, and a launch folder for each
    job that starts now with a plan (jobs/NAME/), its scripts pointed at its devices."""
    from planner.launch import render_launch
    from planner.schedule.render import schedule_html, timeline_svg
    from planner.schedule.setup import launch_hosts, schedule_document, starting_now

    jobs = setup.jobs_file.jobs
    files = {"schedule.json": json.dumps(schedule_document(simulation, setup, settings, plans),
                                         indent=1) + "\n",
             "timeline.svg": timeline_svg(simulation, setup.pool, jobs),
             "timeline.html": schedule_html(simulation, setup.pool, jobs)}
    for placement in starting_now(simulation):
        for name in placement.option.jobs:
            plan = plans.get(name)
            if plan is not None:
                hosts = launch_hosts(plan, placement) if target == "torchrun" else None
                launch = render_launch(plan, target=target, hosts=hosts)
                files.update({f"jobs/{name}/{file}": text for file, text in launch.items()})
    return files


def _write(out: Path, files: dict[str, str]) -> list[Path]:
    """Write the files (--out was checked: empty, or --force given)."""
    from planner.files import write_atomic

    written = []
    for name, text in files.items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text, force=True)
        if name.endswith((".sh", ".sbatch")):
            path.chmod(0o755)
        written.append(path)
    return written


def _render(jobs: Sequence[Job], pool: Pool, simulation: Simulation, plans: dict) -> None:
    from planner.schedule.render import clock, describe_devices
    from planner.schedule.setup import starting_now, summary_line

    now = {job: p for p in starting_now(simulation) for job in p.option.jobs}
    outcome = {o.name: o for o in simulation.outcomes}
    table = Table(title=f"Schedule on {escape(pool.name)}: policy "
                  f"{escape(simulation.policy)}", title_justify="left")
    for column in ("job", "trains", "arrives", "now", "plan step", "starts", "finishes",
                   "completion", "restarts", "deadline"):
        table.add_column(column, no_wrap=column in ("job", "arrives", "starts", "finishes"))
    for job in sorted(jobs, key=lambda j: (j.arrival, j.name)):
        o = outcome[job.name]
        placement = now.get(job.name)
        plan = plans.get(job.name)
        table.add_row(
            escape(job.name), escape(job.workload), clock(job.arrival),
            escape(describe_devices(placement.devices)) if placement else
            ("waiting" if job.arrival <= 0 else "-"),
            f"{plan.prediction.step_time:.3g} s" if plan is not None else "-",
            "-" if o.start is None else clock(o.start),
            "-" if o.finish is None else clock(o.finish),
            "-" if o.jct is None else clock(o.jct), str(o.restarts),
            "-" if o.deadline_met is None else ("met" if o.deadline_met else "missed"))
    console.print(table)
    console.print(escape(summary_line(simulation)))


def _compare(setup: Setup, settings: Settings, book, policies: list, json_out: bool) -> None:
    from planner.schedule.setup import metrics_dict

    results = [_simulate(setup, p, settings, book) for p in policies]
    if json_out:
        sys.stdout.write(json.dumps({"kind": "schedule-comparison", "schema_version": 1,
                                     "policies": {s.policy: metrics_dict(s) for s in results}},
                                    indent=1) + "\n")
        return
    _comparison_table(setup.pool, results)


def _comparison_table(pool: Pool, results: Sequence[Simulation]) -> None:
    from planner.schedule.policies import POLICIES
    from planner.schedule.render import clock

    table = Table(title=f"Policies on {escape(pool.name)}", title_justify="left")
    for column in ("policy", "average completion", "makespan", "utilization", "Jain",
                   "finished", "deadlines met", "what it does"):
        table.add_column(column)
    for s in results:
        m, p = s.metrics, POLICIES[s.policy]
        table.add_row(escape(p.name) + (" (baseline)" if p.baseline else ""),
                      "-" if m.average_jct != m.average_jct else clock(m.average_jct),
                      clock(m.makespan), f"{m.utilization:.0%}", f"{m.jain:.3f}",
                      f"{m.finished}/{m.finished + m.unfinished}",
                      f"{m.deadlines_met}/{m.deadlines}" if m.deadlines else "-",
                      escape(p.summary))
    console.print(table)


def _interact(setup: Setup, policy_name: str, settings: Settings) -> None:
    """Commands from stdin (a prompt at a terminal), each reply printed; a bad command
    says why and changes nothing; `quit` or end of input ends."""
    from planner.errors import PlannerError
    from planner.schedule.session import Session, State

    session = Session(setup, State(jobs=setup.jobs_file.jobs, policy=policy_name,
                                   settings=settings))
    prompt = sys.stdin.isatty()
    while True:
        try:
            line = input("schedule> ") if prompt else sys.stdin.readline()
        except EOFError:
            break
        if not prompt and not line:
            break
        if line.strip() in ("quit", "exit"):
            break
        if not line.strip():
            continue
        try:
            _reply(session.run(line), setup)
        except PlannerError as exc:
            err_console.print(f"[bold red]error:[/] {escape(exc.message)}")
            for i, remedy in enumerate(exc.remedies, 1):
                err_console.print(f"  {i}) {escape(remedy)}")


def _reply(reply, setup: Setup) -> None:
    from planner.schedule.render import clock

    if reply.kind == "jobs":
        table = Table(title=f"{len(reply.state.jobs)} jobs, policy {reply.state.policy}",
                      title_justify="left")
        for column in ("job", "trains", "steps", "arrives", "devices", "weight"):
            table.add_column(column)
        for job in reply.state.jobs:
            devices = (str(job.min_devices) if job.min_devices == job.max_devices
                       else f"{job.min_devices}-{job.max_devices}")
            table.add_row(escape(job.name), escape(job.workload), str(job.steps),
                          clock(job.arrival), devices, f"{job.weight:g}")
        console.print(table)
    elif reply.kind == "schedule":
        _render(reply.state.jobs, setup.pool, reply.simulations[0], {})
    elif reply.kind == "comparison":
        _comparison_table(setup.pool, reply.simulations)
    elif reply.kind == "what-if":
        _what_if(reply.message, *reply.simulations)
    else:
        console.print(escape(reply.message))


def _what_if(change: str, before: Simulation, after: Simulation) -> None:
    """The metrics before and after a change, and the jobs whose finish moved."""
    from planner.schedule.render import clock

    table = Table(title=f"What if: {escape(change)}", title_justify="left")
    for column in ("", "now", "what if", "change"):
        table.add_column(column)
    for label, field, show in (("average completion", "average_jct", clock),
                               ("makespan", "makespan", clock),
                               ("utilization", "utilization", lambda v: f"{v:.0%}"),
                               ("Jain's index", "jain", lambda v: f"{v:.3f}")):
        old, new = getattr(before.metrics, field), getattr(after.metrics, field)
        change_text = f"{(new - old) / old:+.1%}" if old and old == old and new == new else "-"
        table.add_row(label, show(old) if old == old else "-",
                      show(new) if new == new else "-", change_text)
    console.print(table)
    finish = {o.name: o.finish for o in before.outcomes}
    moved = [(o.name, finish[o.name], o.finish) for o in after.outcomes
             if o.name in finish and o.finish != finish[o.name]]
    for name, old, new in moved:
        console.print(f"  {escape(name)}: finishes "
                      f"{'-' if old is None else clock(old)} -> "
                      f"{'-' if new is None else clock(new)}")


def jobs(
    cancel: Annotated[list[int] | None, typer.Option(
        "--cancel", help="End this reservation now (repeatable).")] = None,
    show_all: Annotated[bool, typer.Option(
        "--all", help="List ended and cancelled reservations too.")] = False,
    cluster: Annotated[str | None, typer.Option(
        "--cluster", "-c", help="Only this cluster's reservations (by its name).")] = None,
    ledger: Ledger = None,
    json_out: opt.JsonOut = False,
) -> None:
    """List or cancel device reservations (what `planner schedule --reserve` and
    `planner solve --reserve` made).

    Examples:
      planner jobs
      planner jobs --cancel 12 --cancel 13
      planner jobs --all --json
    """
    from datetime import datetime

    from planner.schedule.ledger import Ledger as Reservations
    from planner.schedule.render import describe_devices

    book = Reservations(ledger)
    for reservation in cancel or []:
        ended = book.cancel(reservation)
        if not json_out:
            console.print(f"Cancelled reservation {ended.id} ({escape(ended.job)}).")
    listed = book.reservations(cluster, ended=show_all)
    if json_out:
        sys.stdout.write(json.dumps({"kind": "reservations", "schema_version": 1,
                                     "ledger": str(book.path), "reservations": [
            {"id": r.id, "cluster": r.cluster, "job": r.job, "owner": r.owner,
             "created": r.created, "until": r.until, "cancelled": r.cancelled,
             "devices": {n: list(d) for n, d in r.devices}} for r in listed]},
            indent=1) + "\n")
        return
    if cancel and not listed:
        return
    table = Table(title=f"Reservations in {escape(str(book.path))}", title_justify="left")
    for column in ("id", "cluster", "job", "devices", "owner", "since", "state"):
        table.add_column(column)
    for r in listed:
        state = ("cancelled" if r.cancelled is not None else
                 "ended" if r.until is not None and not r.active(datetime.now().timestamp())
                 else "active")
        table.add_row(str(r.id), escape(r.cluster), escape(r.job),
                      escape(describe_devices(r.devices)) or "-", escape(r.owner),
                      datetime.fromtimestamp(r.created).strftime("%Y-%m-%d %H:%M"), state)
    console.print(table if listed else "No reservations.")


def register(app: typer.Typer) -> None:
    app.command("schedule")(schedule)
    app.command("jobs")(jobs)
