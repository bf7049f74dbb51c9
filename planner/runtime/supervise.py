"""`python -m planner.runtime.supervise --folder DIR`: run a launch folder's plan and, when
a node is lost, re-plan on the nodes left, write their scripts and resume.

    bash DIR/supervise.sh          # what `planner launch --supervise` writes

Each round:
  1. The plan's nodes start as the target starts them: `local`, run-local.sh; `torchrun`,
     every node's script on its host over ssh (PLANNER_SSH, default `ssh`), all at once;
     `slurm`, `sbatch --wait launch.sbatch` (PLANNER_SBATCH, default `sbatch`), with
     `--exclude` of the hosts lost before. The supervisor waits for them to end.
  2. Success ends it. Otherwise `judge` says which nodes are lost, from the records the
     nodes' launchers keep (`node.py`: RUN_DIR/nodes/) and the ranks' failures
     (`failures.py`): nodes whose launcher ended without a word (killed, or the host went
     down) while others recorded their end; else, where every launcher recorded its end,
     the node of the first rank that died without a word (killed by a signal, the
     out-of-memory killer included, or exited before saying why) or of a GPU fault,
     whatever other ranks' errors came before it (torchrun notices a death up to a
     second late). A rank that failed with an error of its own (a NaN, a bad checkpoint,
     an exception in the code) and no such death is no node's fault: the supervisor
     stops with the report, as a new plan would fail alike. torchrun's --max-restarts
     restarts the same plan first, for faults that pass; the supervisor takes over when
     those are spent.
  3. `planner.replan` plans without the lost nodes (the surviving pipelines rebalanced,
     or a search within --time-limit, keeping to the constraints the plan was solved
     with: --tp, --max-stages, ...), the new plan's files go to DIR/replan-<n>/ (the
     launch options launch.json records, the same run directory), and the next round
     resumes from the newest intact checkpoint, the global batch kept, so the samples of
     each step are those an uninterrupted run would have used. At most --max-replans.

RUN_DIR/supervisor.jsonl keeps a line per re-plan: the nodes lost and why, the re-plan's
seconds, which plan it kept and the solve's constraints it kept to, the step times
before and after, the last step logged, the checkpoint resumed from and the steps lost.
Each round's node records and failures are moved to RUN_DIR/supervisor/round-<n>/ before
the next one starts (those of a run before, to supervisor/earlier/).

The launch folder and the run directory must be on a file system every node shares (the
new plan's scripts are written there).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.errors import PlannerError
from planner.runtime import failures
from planner.runtime.node import NodeRecord, read_records, records_dir
from planner.types import Plan

# how a rank fails when its node, not the code, is at fault: it dies without a word
NODE_FAULTS = ("signal", "exit")
# what a rank's exception says when its GPU failed
GPU_FAULTS = ("uncorrectable ecc", "fallen off the bus", "gpu is lost")
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "ServerAliveInterval=15",
               "-o", "ServerAliveCountMax=4")
_POLL = 0.5  # seconds between looks at the nodes' processes
GRACE = 60  # seconds past the rendezvous timeout the other nodes get once one failed


@dataclass(frozen=True)
class Verdict:
    """The nodes a failed round lost (none: the failure was no node's), and why."""

    lost: tuple[str, ...]
    why: str


def judge(nodes: Sequence[str], records: Mapping[str, NodeRecord],
          found: Sequence[failures.Failure]) -> Verdict:
    """Which of the plan's `nodes` a failed run lost (see the module docstring), from
    their launchers' `records` and the ranks' failures `found`."""
    silent = [name for name in nodes if name not in records
              or records[name].status == "running"]
    if silent and len(silent) < len(nodes):
        return Verdict(tuple(silent), f"node(s) {', '.join(silent)} ended without a word: "
                       "the launcher was killed or its host went down")
    if silent:
        return Verdict((), "no node recorded how it ended: the launch itself failed (see "
                       "its output above)")
    # a rank that died without a word is its node's fault even where another rank's
    # error came first: torchrun notices a death up to a second late, and the others'
    # errors may be what the death caused
    dead = [f for f in found if f.kind in NODE_FAULTS or (f.kind == "exception" and any(
        marker in f.message.lower() for marker in GPU_FAULTS))]
    first = failures.first_failure(dead or found)
    if first is None:
        errors = [f"node {r.node}: {r.message}" for r in records.values() if r.message]
        return Verdict((), "no rank recorded a failure" + (f" ({'; '.join(errors)})"
                                                          if errors else ""))
    if dead:
        return Verdict((first.node,), f"{first.where} failed: {first.message}")
    return Verdict((), failures.report(found) or f"{first.where} failed first")


@dataclass(frozen=True)
class Round:
    """One round's plan and its launch folder."""

    number: int
    folder: Path
    plan: Plan


@dataclass
class Children:
    """The processes a round started, to wait on and to stop on a signal."""

    procs: list[subprocess.Popen] = field(default_factory=list)
    stopped: int = 0  # the signal that stopped the supervisor (0: none)

    def stop_all(self) -> None:
        """SIGTERM to every process group the round started (run-local.sh, the nodes'
        launchers, ssh or sbatch), which stop their ranks."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGTERM)

    def handle(self, signum: int, frame: Any) -> None:
        self.stopped = signum
        self.stop_all()


def say(message: str) -> None:
    print(f"planner supervise: {message}", file=sys.stderr, flush=True)


def run_dir_of(folder: Path, options: Mapping[str, Any]) -> Path:
    """Where the nodes write (PLANNER_RUN_DIR, else launch.json's run_dir, else run/ in
    the folder)."""
    given = os.environ.get("PLANNER_RUN_DIR") or options["run_dir"]
    return Path(given).resolve() if given else (folder / "run").resolve()


def _command(variable: str, default: str) -> list[str]:
    return shlex.split(os.environ.get(variable) or default)


def start(round_: Round, options: Mapping[str, Any], excluded: Sequence[str],
          children: Children) -> None:
    """Start the round's nodes the target's way (see the module docstring)."""
    from planner.launch import host_of, node_script
    from planner.runtime.layout import rank_layout

    target, folder = options["target"], round_.folder
    if target == "local":
        commands = [["bash", str(folder / "run-local.sh")]]
    elif target == "slurm":
        commands = [[*_command("PLANNER_SBATCH", "sbatch"), "--wait",
                     *([f"--exclude={','.join(excluded)}"] if excluded else []),
                     str(folder / "launch.sbatch")]]
    else:
        commands = [[*_command("PLANNER_SSH", "ssh"), *SSH_OPTIONS, "--",
                     str(host_of(node, options["hosts"]).host),
                     f"cd {shlex.quote(str(folder))} && bash {shlex.quote(node_script(node))}"]
                    for node in rank_layout(round_.plan).nodes]
    for command in commands:
        children.procs.append(subprocess.Popen(command, start_new_session=True))


def wait(children: Children, grace: float) -> int:
    """Wait for the round's processes; once one failed, the others get `grace` seconds
    to end by themselves (their ranks lose the failed ones), then are stopped. The
    first non-zero exit code, else 0."""
    failed_at = None
    while any(proc.poll() is None for proc in children.procs):
        codes = [proc.returncode for proc in children.procs if proc.returncode is not None]
        if failed_at is None and any(codes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace:
            children.stop_all()
            failed_at = float("inf")  # (stopped once)
        time.sleep(_POLL)
    return next((proc.returncode for proc in children.procs if proc.returncode), 0)


def archive(run_dir: Path, label: str) -> None:
    """Move the node records and failures aside into RUN_DIR/supervisor/<label>/ (the
    first free name), so that the next round's verdict reads only its own."""
    kept, n = run_dir / "supervisor" / label, 1
    while kept.exists():
        kept, n = run_dir / "supervisor" / f"{label}-{n}", n + 1
    for folder in (records_dir(run_dir), failures.failures_dir(run_dir)):
        if folder.is_dir():
            kept.mkdir(parents=True, exist_ok=True)
            shutil.move(str(folder), str(kept / folder.name))


def _next_folder(root: Path) -> Path:
    n = 1
    while (root / f"replan-{n}").exists():
        n += 1
    return root / f"replan-{n}"


def _progress(run_dir: Path) -> tuple[int, int]:
    """(the last step logged, the newest checkpoint's step)."""
    from planner.runtime.checkpoint import complete_steps
    from planner.runtime.summary import read_losses

    logged = read_losses(run_dir) if (run_dir / "losses.jsonl").is_file() else {}
    steps = complete_steps(run_dir)
    return max(logged, default=0), steps[-1] if steps else 0


def _new_options(options: Mapping[str, Any], plan: Any, folder: Path, run_dir: Path
                 ) -> dict[str, Any]:
    """`render_launch`'s options for `plan`: the hosts and device types it still uses,
    the run directory of the rounds before."""
    from planner.runtime.layout import rank_layout

    layout = rank_layout(plan)
    names = {n.name for n in layout.nodes}
    types = {n.device_type for n in layout.nodes}
    return {**options, "hosts": {k: v for k, v in options["hosts"].items() if k in names},
            "constraints": {k: v for k, v in options["constraints"].items() if k in types},
            "gres": {k: v for k, v in options["gres"].items() if k in types},
            "run_dir": str(run_dir), "folder": str(folder)}


def replan_round(round_: Round, verdict: Verdict, options: Mapping[str, Any],
                 run_dir: Path, root: Path, time_limit: float) -> tuple[Round, dict]:
    """The next round: the plan without the lost nodes and its files, and the log line."""
    from planner.constraints import flags
    from planner.launch import render_launch, write_launch
    from planner.replan import replan

    last, resumed = _progress(run_dir)
    result = replan(round_.plan, lost=verdict.lost, time_limit=time_limit)
    folder = _next_folder(root)
    write_launch(render_launch(result.new, **_new_options(options, result.new, folder,
                                                          run_dir)), folder)
    entry = {"round": round_.number + 1, "time": time.time(), "lost": list(verdict.lost),
             "why": verdict.why, "replan_seconds": result.seconds, "kept": result.kept,
             "constraints": flags(result.constraints),
             "step_time_before": round_.plan.prediction.step_time,
             "step_time_after": result.new.prediction.step_time,
             "rebalance_step_time": result.rebalanced.plan.prediction.step_time
             if result.rebalanced.plan else None,
             "folder": str(folder), "last_step": last, "resume_step": resumed,
             "steps_lost": max(0, last - resumed)}
    return Round(round_.number + 1, folder, result.new), entry


def supervise(folder: Path, *, max_replans: int, time_limit: float) -> int:
    """Run the folder's plan to the end, re-planning when nodes are lost (see the module
    docstring); the exit code."""
    from planner.launch import read_launch
    from planner.planfile import read_plan
    from planner.runtime.layout import rank_layout

    folder = folder.resolve()
    options = read_launch(folder / "launch.json")
    run_dir = run_dir_of(folder, options)
    round_ = Round(0, folder, read_plan(folder / "plan.json"))
    excluded: list[str] = []
    children = Children()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, children.handle)
    archive(run_dir, "earlier")  # (an earlier run's, in the same run directory)
    while not children.stopped:
        say(f"round {round_.number}: {len(rank_layout(round_.plan).nodes)} node(s), "
            f"{round_.folder}")
        children.procs.clear()
        start(round_, options, excluded, children)
        code = wait(children, options["rendezvous_timeout"] + GRACE)
        if children.stopped:
            break
        if code == 0:
            say(f"done; run directory {run_dir}")
            return 0
        records = read_records(run_dir)
        names = [n.name for n in rank_layout(round_.plan).nodes]
        verdict = judge(names, records, failures.read_all(run_dir))
        if not verdict.lost:
            say(f"the run failed, and not for a lost node, so it is not re-planned: "
                f"{verdict.why}")
            return code
        if round_.number >= max_replans:
            say(f"lost {', '.join(verdict.lost)} ({verdict.why}), after {max_replans} "
                "re-plan(s) already (--max-replans): stopping")
            return code
        excluded += [records[name].host for name in verdict.lost if name in records]
        try:
            round_, entry = replan_round(round_, verdict, options, run_dir, folder,
                                         time_limit)
        except PlannerError as exc:
            say(f"lost {', '.join(verdict.lost)} ({verdict.why}), and no plan runs on what "
                f"is left: {exc.message}")
            return code
        with (run_dir / "supervisor.jsonl").open("a") as log:
            log.write(json.dumps(entry) + "\n")
        archive(run_dir, f"round-{round_.number - 1}")
        say(f"lost {', '.join(verdict.lost)}: {verdict.why}. Re-planned in "
            f"{entry['replan_seconds']:.2f} s ({entry['kept']}"
            + (f", keeping {entry['constraints']}" if entry["constraints"] else "") + "): step "
            f"{entry['step_time_before']:.4g} s -> {entry['step_time_after']:.4g} s on "
            f"{len(rank_layout(round_.plan).nodes)} node(s); resuming from step "
            f"{entry['resume_step']} ({entry['steps_lost']} step(s) lost) with "
            f"{round_.folder}")
    say(f"stopped by signal {signal.Signals(children.stopped).name}")
    return 128 + children.stopped


def main(argv: list[str] | None = None) -> int:
    from planner.launch import SuperviseOptions

    p = argparse.ArgumentParser(
        prog="python -m planner.runtime.supervise",
        description="Run a launch folder's plan; when a node is lost, re-plan on the nodes "
        "left, write their scripts and resume (see planner launch --supervise).")
    p.add_argument("--folder", type=Path, required=True, help="The launch folder.")
    defaults = SuperviseOptions()
    p.add_argument("--max-replans", type=int, default=defaults.max_replans)
    p.add_argument("--time-limit", type=float, default=defaults.time_limit,
                   help="Seconds each re-plan's search may take.")
    args = p.parse_args(argv)
    try:
        return supervise(args.folder, max_replans=args.max_replans,
                         time_limit=args.time_limit)
    except PlannerError as exc:
        print(exc.report(), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
