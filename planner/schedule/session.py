"""`planner schedule --interactive`: add and remove jobs, change the policy or the round,
see the schedule, compare policies, and ask what-if (`HELP` lists the commands). The
session has no terminal: `Session.run(line)` takes one command and gives a reply, or
raises PlannerError and changes nothing.
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass
from typing import Any

import yaml

from planner.errors import PlannerError, closest
from planner.schedule.jobs import Job, JobsFile, parse_jobs
from planner.schedule.policies import POLICIES, policy
from planner.schedule.setup import Setup
from planner.schedule.simulate import Settings, Simulation, simulate

HELP = """\
jobs                   the jobs
add KEY=VALUE ...      a job, with the fields of a jobs file entry, e.g.
                       add name=bert model=bert-large global_batch=256 steps=5000
remove NAME            drop a job
policy NAME            the policy (max-min-fairness, min-jct, max-throughput, ...)
round SECONDS          the round length
show                   the schedule: each job's start and finish, and the metrics
compare                every policy on the jobs
what-if CHANGE         the schedule after a change (add, remove, policy, round) beside
                       the current one; nothing is kept
undo                   back to before the last change
help                   this list"""
EDITS = ("add", "remove", "policy", "round")


@dataclass(frozen=True, kw_only=True)
class State:
    jobs: tuple[Job, ...]
    policy: str
    settings: Settings


@dataclass(frozen=True, kw_only=True)
class Reply:
    """What a command gives back: `kind` ("message", "jobs", "schedule", "comparison",
    "what-if"), a line for people, and what to show."""

    kind: str
    message: str
    state: State
    simulations: tuple[Simulation, ...] = ()


class Session:
    """The state, a command at a time; `undo` goes back one change."""

    def __init__(self, setup: Setup, state: State) -> None:
        self.setup = setup
        self.state = state
        self.history: list[State] = []

    def run(self, line: str) -> Reply:
        words = _split(line)
        if not words:
            raise PlannerError("bad-command", "Empty command.", ["type help"])
        command, args = words[0].lower(), words[1:]
        if command == "help":
            return Reply(kind="message", message=HELP, state=self.state)
        if command == "jobs":
            return Reply(kind="jobs", message=f"{len(self.state.jobs)} jobs", state=self.state)
        if command == "show":
            return Reply(kind="schedule", message=f"policy {self.state.policy}",
                         state=self.state, simulations=(self._simulate(self.state),))
        if command == "compare":
            sims = tuple(self._simulate(dataclasses.replace(self.state, policy=name))
                         for name in POLICIES)
            return Reply(kind="comparison", message="every policy", state=self.state,
                         simulations=sims)
        if command == "undo":
            if not self.history:
                raise PlannerError("bad-command", "Nothing to undo.")
            self.state = self.history.pop()
            return Reply(kind="message", message="undone", state=self.state)
        if command == "what-if":
            if not args or args[0].lower() not in EDITS:
                raise PlannerError("bad-command", "what-if takes a change: "
                                   + ", ".join(EDITS) + ".",
                                   ["e.g. what-if policy min-jct"])
            changed, _ = self._edit(args[0].lower(), args[1:])
            return Reply(kind="what-if", message=shlex.join(args), state=changed,
                         simulations=(self._simulate(self.state), self._simulate(changed)))
        if command in EDITS:
            changed, done = self._edit(command, args)
            self.history.append(self.state)
            self.state = changed
            return Reply(kind="message", message=done, state=changed)
        near = closest(command, [*EDITS, "jobs", "show", "compare", "what-if", "undo", "help"])
        raise PlannerError("bad-command", f"Unknown command {command!r}"
                           + (f"; did you mean {near[0]}?" if near else "."), ["type help"])

    def _simulate(self, state: State) -> Simulation:
        if not state.jobs:
            raise PlannerError("bad-command", "There are no jobs to schedule.",
                               ["add one: add name=... profile=... steps=..."])
        return simulate(state.jobs, self.setup.pool, self.setup.throughputs,
                        policy(state.policy), state.settings)

    def _edit(self, command: str, args: list[str]) -> tuple[State, str]:
        """The state after an edit, checked (a job the throughputs cannot price is an
        error now, not at the next `show`), and what was done."""
        state = self.state
        if command == "policy":
            name = _one(args, "policy NAME")
            policy(name)
            return dataclasses.replace(state, policy=name), f"policy {name}"
        if command == "round":
            seconds = _number(_one(args, "round SECONDS"), "round")
            if seconds <= 0:
                raise PlannerError("bad-value", f"round must be a positive number of "
                                   f"seconds (got {seconds:g}).")
            settings = dataclasses.replace(state.settings, round_length=seconds)
            return dataclasses.replace(state, settings=settings), f"rounds of {seconds:g} s"
        if command == "remove":
            name = _one(args, "remove NAME")
            names = [j.name for j in state.jobs]
            if name not in names:
                near = closest(name, names)
                raise PlannerError("bad-value", f"There is no job {name!r}"
                                   + (f"; did you mean {near[0]}?" if near else "."),
                                   ["type jobs to list them"])
            return (dataclasses.replace(state, jobs=tuple(j for j in state.jobs
                                                          if j.name != name)),
                    f"removed {name}")
        job = _job(args, state.jobs)
        if job.model is not None:
            from planner.models import model_spec

            model_spec(job.model)  # (an unknown model is refused now, not at `show`)
        self.setup.throughputs.shapes(job, self.setup.pool.capacity(), span=False)
        return dataclasses.replace(state, jobs=(*state.jobs, job)), f"added {job.name}"


def _split(line: str) -> list[str]:
    try:
        return shlex.split(line)
    except ValueError as exc:
        raise PlannerError("bad-command", f"Cannot read the command: {exc}.",
                           ["quote values with spaces, e.g. profile=\"A3C\""]) from None


def _one(args: list[str], usage: str) -> str:
    if len(args) != 1:
        raise PlannerError("bad-command", f"Usage: {usage}.")
    return args[0]


def _number(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise PlannerError("bad-value", f"{what} must be a number (got {text!r}).") from None


def _job(args: list[str], jobs: tuple[Job, ...]) -> Job:
    """A job from key=value words, validated as a jobs file entry beside the others."""
    fields: dict[str, Any] = {}
    for word in args:
        key, sep, value = word.partition("=")
        if not sep or not key:
            raise PlannerError("bad-command", f"{word!r} is not key=value.",
                               ["e.g. add name=r profile=A3C steps=1000"])
        fields[key] = yaml.safe_load(value) if value else value
    entries = [_entry(job) for job in jobs] + [fields]
    parsed: JobsFile = parse_jobs({"jobs": entries}, "add")
    return parsed.jobs[-1]


def _entry(job: Job) -> dict[str, Any]:
    """A job as a jobs file entry (its fields that are set)."""
    return {k: v for k, v in dataclasses.asdict(job).items() if v is not None}
