"""The interactive planning session as a pure-ish state machine: command lines in,
a new state and a reply out. The terminal (`cli/interactive.py`) is a thin prompt
loop over it; transcripts replay through the same `Session.run`.

    session = Session(time_limit=10)
    session.run("model gpt-tiny")
    session.run("cluster 2x4xA100-80G,1x4xV100-32G@100Gbps")
    session.run("set global-batch 64")
    reply = session.run("solve")            # reply.items: ("plan", ...), ...
    reply = session.run("add 1x4xV100-32G")  # re-solved; ("diff", ...) against the last plan
    session.run("save plan plan.json")

Every command is one line (shell-like quoting, `#` starts a comment). A command
either succeeds, changing the state (kept for `undo`) and appending the line to
the transcript, or fails with a `PlannerError` and changes nothing. `COMMANDS`
lists them with their non-interactive equivalents. Errors name the session's
commands where the library's name the CLI's options (`set seq-len N`, not
`--seq-len`). A `solve` that failed is tried again after each change, as a solved
session re-solves, until it succeeds (the transcript then records that `solve`).

The state is a frozen value; tracing results are cached per (model, sequence
length, dtype), analyses per plan. Library code only: no printing, no prompts.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.errors import PlannerError, closest
from planner.files import write_atomic
from planner.types import ClusterSpec, ModelGraph, ModelSpec, Plan, TrainingSpec

if TYPE_CHECKING:
    from planner.models import LoadedModel

DEFAULT_TIME_LIMIT = 10.0
TOP_K = 3


# ---------------------------------------------------------------- commands and their help

@dataclass(frozen=True)
class Command:
    name: str
    usage: str
    summary: str
    equivalent: str  # the non-interactive way to do the same
    group: str


COMMANDS: tuple[Command, ...] = (
    Command("models", "models [TEXT]", "list the model zoo, or search it for TEXT",
            "planner models [TEXT] [--family F]", "setup"),
    Command("devices", "devices [TEXT]", "list device types, or search them for TEXT",
            "planner devices [TEXT]", "setup"),
    Command("examples", "examples", "list the built-in example clusters",
            "planner solve --help (the --cluster option)", "setup"),
    Command("model", "model NAME [--layers N --hidden N --heads N --kv-heads N --ffn N "
            "--vocab N --set KEY=VALUE]", "choose the model: a zoo name, package.module:factory "
            "or a transformers config", "planner solve NAME [shape options]", "setup"),
    Command("cluster", "cluster FILE|EXAMPLE|INLINE", "load a cluster: a YAML file, an example "
            "name, or inline like 2x8xA100-80G,4x8xV100-32G@100Gbps", "planner solve --cluster "
            "SPEC", "setup"),
    Command("set", "set global-batch N | seq-len N|default | dtype bf16|fp16|fp32|tf32|auto | "
            "time-limit SECONDS | auto-solve on|off", "change the training setup (a what-if "
            "once there is a plan) or session settings",
            "planner solve -B N --seq-len N --dtype D --time-limit S; planner what-if PLAN -B N",
            "setup"),
    Command("solve", "solve", "find the best plan for the current setup",
            "planner solve MODEL --cluster SPEC [options] -o plan.json", "setup"),
    Command("add", "add NODESxDEVICESxTYPE [--nic BANDWIDTH] [--group NAME]",
            "what-if: add nodes, e.g. add 4x8xV100-32G", "planner what-if PLAN --add SPEC",
            "what-if"),
    Command("remove", "remove NODE|COUNTxTYPE ...", "what-if: remove nodes by name, or the "
            "last COUNT nodes of a device type", "planner what-if PLAN --remove NODE", "what-if"),
    Command("resize", "resize NODE|TYPE DEVICES", "what-if: change the devices per node",
            "planner what-if PLAN --resize NODE=N", "what-if"),
    Command("link", "link network|nic:NODE|intra:NODE|intra:TYPE|group:NAME BANDWIDTH[/LATENCY]",
            "what-if: change a link, e.g. link network 25Gbps",
            "planner what-if PLAN --link TARGET=BANDWIDTH", "what-if"),
    Command("constrain", "constrain KEY=VALUE ...", "fix or bound the search: tp, max-tp, pp, "
            "dp, max-dp, micro-batch, max-stages, recompute (none|selective|full), zero (0-3), "
            "schedule (1f1b|gpipe|interleaved), "
            "first-stage / last-stage (a device type), mixed (yes|no), tp-per-class (yes|no)",
            "planner solve --tp N --pp N ... (same names)", "constrain"),
    Command("exclude", "exclude NODE ...", "do not use these nodes",
            "planner solve --exclude NODE", "constrain"),
    Command("pin", "pin NODE ...", "use only these nodes (pin again to add more)",
            "planner solve --exclude OTHER-NODE ...", "constrain"),
    Command("unconstrain", "unconstrain [KEY|NODE ...|all]", "drop constraints, exclusions or "
            "pins (all of them without arguments)", "leave the option out", "constrain"),
    Command("price", "price TYPE DOLLARS_PER_HOUR", "price a device type, to show costs in "
            "dollars", "planner compare/what-if --price TYPE=DOLLARS", "constrain"),
    Command("show", "show [plan|cluster|constraints|runners-up]", "show the plan, the cluster, "
            "the constraints or the runner-up plans", "planner explain plan.json", "inspect"),
    Command("explain", "explain", "why this plan: the binding constraint, the bottleneck "
            "stage, and why the runner-ups and baselines lose", "planner explain plan.json",
            "inspect"),
    Command("timeline", "timeline [WIDTH]", "the pipeline timeline of one step",
            "planner explain plan.json (--svg/--html FILE)", "inspect"),
    Command("memory", "memory", "memory per device by term against capacity",
            "planner explain plan.json", "inspect"),
    Command("traffic", "traffic", "communication per step on each link",
            "planner explain plan.json", "inspect"),
    Command("diff", "diff", "the current plan against the previous one",
            "planner compare old.json new.json", "inspect"),
    Command("cli", "cli", "the shell commands that reproduce this session's plan",
            "-", "inspect"),
    Command("save", "save plan|cluster|report|launch|transcript PATH [--force] "
            "[--target torchrun|slurm|local] [--hosts FILE]",
            "save the plan (JSON), the cluster (YAML), a report (.html or .svg timeline), "
            "launch scripts (a folder), or the session transcript",
            "planner solve -o; planner what-if --cluster-out; planner explain --html/--svg; "
            "planner launch PLAN --out DIR --target T --hosts FILE; planner interactive "
            "--record", "save"),
    Command("undo", "undo", "go back one change", "-", "session"),
    Command("history", "history", "the commands so far (the transcript)", "-", "session"),
    Command("help", "help [COMMAND]", "this list, or one command's help", "planner --help",
            "session"),
    Command("quit", "quit", "leave (also exit, Ctrl-D; Ctrl-C leaves too, saved files stay)",
            "-", "session"),
)
_BY_NAME = {c.name: c for c in COMMANDS}
_ALIASES = {"exit": "quit", "q": "quit", "?": "help"}
_UNRECORDED = {"help", "history", "quit", "cli"}
CONSTRAINT_KEYS = ("tp", "max-tp", "pp", "dp", "max-dp", "micro-batch", "max-stages", "recompute",
                   "zero", "first-stage", "last-stage", "interleave", "max-interleave",
                   "schedule", "mixed", "tp-per-class")
_SWITCHES = {"mixed": True, "tp-per-class": False}  # yes/no constraints and their defaults


# ---------------------------------------------------------------- state

@dataclass(frozen=True)
class Constraints:
    """What the user fixes or bounds; exclude and pinned are node names."""

    tp: int | None = None
    max_tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    max_dp: int | None = None
    micro_batch: int | None = None
    max_stages: int | None = None
    recompute: str | None = None
    zero: int | None = None
    first_stage: str | None = None  # device type
    last_stage: str | None = None
    interleave: int | None = None  # model chunks per device
    max_interleave: int | None = None
    schedule: str | None = None  # 1f1b, gpipe or interleaved
    mixed: bool = True
    tp_per_class: bool = False
    mixed_share_types: bool = False  # two mixed classes may share device types
    exclude: tuple[str, ...] = ()
    pinned: tuple[str, ...] = ()

    def excluded(self, cluster: ClusterSpec) -> tuple[str, ...]:
        names = [n.name for n in cluster.nodes]
        out = [n for n in self.exclude if n in names]
        if self.pinned:
            out += [n for n in names if n not in self.pinned and n not in out]
        return tuple(out)

    def describe(self) -> list[str]:
        out = [f"{key}={getattr(self, key.replace('-', '_'))}" for key in CONSTRAINT_KEYS
               if key not in _SWITCHES and getattr(self, key.replace("-", "_")) is not None]
        out += [f"{key}={'yes' if value else 'no'}" for key, default in _SWITCHES.items()
                if (value := getattr(self, key.replace("-", "_"))) != default]
        if self.exclude:
            out.append("exclude " + ", ".join(self.exclude))
        if self.pinned:
            out.append("only nodes " + ", ".join(self.pinned))
        return out

    def flags(self, cluster: ClusterSpec | None) -> list[str]:
        """The `planner solve` options that impose these constraints."""
        out: list[str] = []
        for key in CONSTRAINT_KEYS:
            value = getattr(self, key.replace("-", "_"))
            if key in _SWITCHES:
                if value != _SWITCHES[key]:
                    out.append(f"--{key}" if value else f"--no-{key}")
            elif value is not None:
                out += [f"--{key}", str(value)]
        for name in (self.excluded(cluster) if cluster is not None else self.exclude):
            out += ["--exclude", name]
        return out

    def options(self, cluster: ClusterSpec, *, time_limit: float | None, top_k: int) -> Any:
        from planner.solver import Limits, SolveOptions, Space
        from planner.solver.limits import check_chunk_flags, parse_schedule
        from planner.types import Recompute

        check_chunk_flags(self.interleave, self.max_interleave, self.schedule)
        limits = Limits(tp=self.tp, max_tp=self.max_tp, pp=self.pp, dp=self.dp,
                        max_dp=self.max_dp,
                        micro_batch=self.micro_batch, mixed=self.mixed,
                        tp_per_class=self.tp_per_class,
                        mixed_share_types=self.mixed_share_types,
                        first_stage=self.first_stage, last_stage=self.last_stage,
                        interleave=self.interleave,
                        schedule=parse_schedule(self.schedule) if self.schedule else None,
                        **({"max_stages": self.max_stages} if self.max_stages else {}),
                        **({"interleaves": tuple(range(1, self.max_interleave + 1))}
                           if self.max_interleave else {}))
        space = Space(policies=(Recompute(self.recompute),) if self.recompute else tuple(Recompute),
                      zeros=(self.zero,) if self.zero is not None else (0, 1, 2, 3))
        return SolveOptions(limits=limits, space=space, exclude=self.excluded(cluster),
                            top_k=top_k, time_limit=time_limit)


def parse_constraint(constraints: Constraints, key: str, value: str) -> Constraints:
    """One KEY=VALUE constraint applied; a clear error for a bad key or value."""
    from planner.whatif import parse_int

    key = key.strip().lower().replace("_", "-")
    if key not in CONSTRAINT_KEYS:
        near = closest(key, list(CONSTRAINT_KEYS))
        raise PlannerError("bad-command", f"Unknown constraint {key!r}"
                           + (f"; did you mean {near[0]!r}?" if near else ".")
                           , [f"use one of {', '.join(CONSTRAINT_KEYS)}"])
    attr = key.replace("-", "_")
    if key in _SWITCHES:
        flag = value.strip().lower()
        if flag not in ("yes", "no", "on", "off", "true", "false"):
            raise PlannerError("bad-value", f"{key} must be yes or no (got {value!r}).")
        return dataclasses.replace(constraints, **{attr: flag in ("yes", "on", "true")})
    if key == "recompute":
        if value not in ("none", "selective", "full"):
            raise PlannerError("bad-value", f"recompute must be none, selective or full (got "
                               f"{value!r}).")
        return dataclasses.replace(constraints, recompute=value)
    if key in ("first-stage", "last-stage"):
        return dataclasses.replace(constraints, **{attr: value.strip()})
    if key == "schedule":
        from planner.solver.limits import parse_schedule, schedule_name

        return dataclasses.replace(constraints, schedule=schedule_name(
            parse_schedule(value, "schedule")))
    number = parse_int(value, key)
    if key == "zero" and number not in (0, 1, 2, 3):
        raise PlannerError("bad-value", f"zero must be 0, 1, 2 or 3 (got {number}).")
    if key != "zero" and number < 1:
        raise PlannerError("bad-value", f"{key} must be at least 1 (got {number}).")
    return dataclasses.replace(constraints, **{attr: number})


@dataclass(frozen=True)
class State:
    model: ModelSpec | None = None
    cluster: ClusterSpec | None = None
    cluster_source: str | None = None  # the spec the cluster was loaded from
    cluster_edits: tuple[str, ...] = ()  # `planner what-if` options for the edits since
    global_batch: int = 512
    seq_len: int | None = None
    dtype: str = "auto"
    constraints: Constraints = field(default_factory=Constraints)
    time_limit: float | None = DEFAULT_TIME_LIMIT
    auto_solve: bool = True
    prices: tuple[tuple[str, float], ...] = ()
    plan: Plan | None = None
    runners_up: tuple[Plan, ...] = ()
    previous: Plan | None = None  # the plan before the current one
    tried: bool = False  # a solve was attempted (edits re-solve from then on)
    note: str = ""  # why there is no plan

    @property
    def price_map(self) -> dict[str, float]:
        return dict(self.prices)


@dataclass(frozen=True)
class Tabular:
    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclass
class Reply:
    """What a command produced. items are (kind, value) for the renderer:
    text, note, warning: str; table: Tabular; plan: (Plan, layer names), shown whole;
    plan-summary: the same, shown compactly (after a change, below what changed);
    diff: (old Plan, new Plan, rows); explanation, memory, traffic: Analysis;
    timeline: (Timeline, width); help: list of Command; cli: list of str.
    then: lines the transcript records after this command's (a `solve` it ran)."""

    command: str
    ok: bool = True
    items: list[tuple[str, Any]] = field(default_factory=list)
    error: PlannerError | None = None
    quit: bool = False
    data: dict = field(default_factory=dict)
    then: list[str] = field(default_factory=list)

    def add(self, kind: str, value: Any) -> Reply:
        self.items.append((kind, value))
        return self


# ---------------------------------------------------------------- helpers

def split_line(line: str) -> list[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError as exc:
        raise PlannerError("bad-command", f"Cannot read the command {line!r}: {exc}.") from None


def parse_options(tokens: Sequence[str], *, values: Sequence[str] = (),
                  multi: Sequence[str] = (), flags: Sequence[str] = ()
                  ) -> tuple[list[str], dict[str, Any]]:
    """Positional words and `--name value` / `--name=value` options."""
    positional: list[str] = []
    found: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token.startswith("--") and len(token) > 2:
            name, eq, inline = token[2:].partition("=")
            if name in flags:
                found[name] = True
            elif name in values or name in multi:
                if eq:
                    value = inline
                elif i + 1 < len(tokens):
                    i += 1
                    value = tokens[i]
                else:
                    raise PlannerError("bad-command", f"--{name} needs a value.")
                if name in multi:
                    found.setdefault(name, []).append(value)
                else:
                    found[name] = value
            else:
                known = [*values, *multi, *flags]
                near = closest(name, known)
                raise PlannerError("bad-command", f"Unknown option --{name}"
                                   + (f"; did you mean --{near[0]}?" if near else ".")
                                   , [f"options here: {', '.join('--' + k for k in known)}"
                                      if known else "this command takes no options"])
        else:
            positional.append(token)
        i += 1
    return positional, found


# The CLI's options as the session spells them: library errors name the options of
# `planner solve` (`--seq-len`, `--tp 4`), which a session sets with its own commands.
_NUMBER_VALUE = r"\d+(?:\.\d+)?"
_SET_OPTIONS = {"global-batch": _NUMBER_VALUE, "seq-len": _NUMBER_VALUE,
                "time-limit": _NUMBER_VALUE, "dtype": r"bf16|fp16|fp32|tf32|auto"}  # its values
_PLACEHOLDERS = {"time-limit": "SECONDS", "dtype": "DTYPE"}  # (else N)
_WORD_VALUES = {"schedule": r"1f1b|gpipe|interleaved", "recompute": r"none|selective|full",
                "first-stage": r"[A-Z][\w.@-]*", "last-stage": r"[A-Z][\w.@-]*"}
_OPTION = re.compile(
    r"(?<![\w-])--(?P<no>no-)?(?P<name>"
    + "|".join(sorted([*_SET_OPTIONS, *CONSTRAINT_KEYS, "exclude"], key=len, reverse=True))
    + r")(?![\w-])(?:[ =](?P<value>"
    + "|".join(sorted({*_SET_OPTIONS.values(), *_WORD_VALUES.values()}))
    + r")(?![\w-]))?")
_CLI_COMMAND = re.compile(r"`planner (?P<name>\w+)`")


def _session_option(match: re.Match) -> str:
    """One CLI option (and its value, if written) as the session command that sets it."""
    name, value = match["name"], match["value"]
    if name in _SET_OPTIONS:
        return f"`set {name} {value or _PLACEHOLDERS.get(name, 'N')}`"
    if name in _SWITCHES:
        return f"`constrain {name}={'no' if match['no'] else 'yes'}`"
    if name == "exclude":
        return f"`exclude {value or 'NODE'}`"
    return f"`constrain {name}={value or ('VALUE' if name in _WORD_VALUES else 'N')}`"


def in_session_terms(error: PlannerError) -> PlannerError:
    """`error` (of any PlannerError class) naming the session's commands where it names
    the CLI's: `set seq-len N` for --seq-len, `constrain tp=4` for --tp 4, `models` for
    `planner models`. Shape options (--layers, ...) read the same in both."""
    def words(text: str) -> str:
        text = _OPTION.sub(_session_option, text)
        return _CLI_COMMAND.sub(lambda m: f"`{m['name']}`" if m["name"] in _BY_NAME
                                else m[0], text)

    translated = type(error).__new__(type(error))  # (its class's fields, as they are)
    translated.__dict__.update(error.__dict__)
    translated.message = words(error.message)
    translated.remedies = tuple(words(remedy) for remedy in error.remedies)
    translated.args = (translated.render(),)
    return translated


def resolve_dtype(dtype: str, cluster: ClusterSpec) -> str:
    """`auto`: bf16 if every device has fast bf16, else fp16, else fp32 (as `planner solve`)."""
    from planner.dtypes import DTYPES, canonical_dtype

    if dtype.strip().lower() != "auto":
        try:
            return canonical_dtype(dtype)
        except PlannerError:
            raise PlannerError("bad-value", f"Unknown dtype {dtype!r}; use one of "
                               f"{', '.join(DTYPES)}, or auto.",
                               ["--dtype auto (the default) picks bf16 where every device "
                                "runs it fast, else fp16"]) from None
    kinds = cluster.device_types().values()
    return ("bf16" if all("bf16" in d.peak_flops for d in kinds) else
            "fp16" if all("fp16" in d.peak_flops for d in kinds) else "fp32")


def needs_length(loaded: LoadedModel) -> bool:
    """Whether a built model has no default sequence length and cannot make its inputs
    without one (a factory's that uses it; a zoo model always has one or, like ResNet,
    needs none). A factory whose inputs fail for another reason counts too: tracing it
    will name that reason once a length is given."""
    if loaded.seq_len is not None:
        return False
    try:
        loaded.example(1, "meta")
    except PlannerError:
        return True
    return False


class Tracer:
    """Traces models at batch 1, kept by (model, sequence length, dtype) here and on disk
    (`planner.trace.cache`)."""

    def __init__(self) -> None:
        self._cache: dict[tuple, ModelGraph] = {}

    def __call__(self, spec: ModelSpec, seq_len: int | None, dtype: str) -> ModelGraph:
        from planner.trace.cache import cached_trace

        key = (spec.source, spec.name, tuple(sorted((k, repr(v))
                                                    for k, v in spec.overrides.items())),
               seq_len, dtype)
        if key not in self._cache:
            graph = cached_trace(spec, seq_len=seq_len, dtype=dtype)
            self._cache[key] = graph
            self._cache[(*key[:3], graph.seq_len, dtype)] = graph  # as plans name it
        return self._cache[key]


def solve_plans(graph: ModelGraph, cluster: ClusterSpec, training: TrainingSpec,
                constraints: Constraints, *, time_limit: float | None, top_k: int = TOP_K,
                progress: Callable[[str], None] | None = None) -> list[Plan]:
    """The best `top_k` plans under `constraints` (what `planner solve` runs)."""
    from planner.solver import Progress, solve

    options = constraints.options(cluster, time_limit=time_limit, top_k=top_k)

    def tick(now: Progress) -> None:
        if progress is not None and now.explored % 200 == 0:
            progress(now.describe())

    return solve(graph, cluster, training, options, progress=tick)


# ---------------------------------------------------------------- the session

class Session:
    """Commands in, replies out. `progress(message)` hears about long work."""

    def __init__(self, *, time_limit: float | None = DEFAULT_TIME_LIMIT, force: bool = False,
                 progress: Callable[[str], None] | None = None,
                 on_record: Callable[[str], None] | None = None,
                 tracer: Tracer | None = None, top_k: int = TOP_K) -> None:
        self.state = State(time_limit=time_limit)
        self.history: list[State] = []
        self.transcript: list[str] = []
        self.saved: list[str] = []
        self.force = force
        self.progress = progress or (lambda message: None)
        self.on_record = on_record
        self.trace = tracer or Tracer()
        self.top_k = top_k
        self.failed_solve = False  # the last `solve` failed: changes try it again
        self._analysis: tuple[Plan, Any] | None = None

    # -- running commands

    def run(self, line: str) -> Reply:
        """Run one command line; never raises a PlannerError (it is in the reply)."""
        line = line.strip()
        reply = Reply(command=line)
        try:
            tokens = split_line(line)
            if not tokens:
                return reply
            if tokens[0].lower() in ("what-if", "whatif") and len(tokens) > 1:
                tokens = tokens[1:]  # "what-if add 4x8xV100-32G" reads as "add ..."
            name = _ALIASES.get(tokens[0].lower(), tokens[0].lower())
            handler = getattr(self, f"_cmd_{name.replace('-', '_')}", None)
            if name not in _BY_NAME or handler is None:
                near = closest(name, list(_BY_NAME))
                raise PlannerError("bad-command", f"Unknown command {tokens[0]!r}"
                                   + (f"; did you mean {near[0]!r}?" if near else ".")
                                   , ["type `help` for the list of commands"])
            new_state = handler(tokens[1:], reply)
        except PlannerError as exc:
            reply.ok = False
            reply.error = exc = in_session_terms(exc)
            reply.data = {"command": line, "ok": False, "error": exc.message,
                          "kind": exc.kind, "remedies": list(exc.remedies)}
            return reply
        if new_state is not None and new_state is not self.state:
            self.history.append(self.state)
            self.state = new_state
        if name not in _UNRECORDED and not (name == "save" and tokens[1:2] == ["transcript"]):
            for recorded in (line, *reply.then):
                self.transcript.append(recorded)
                if self.on_record is not None:
                    self.on_record(recorded)
        reply.data = {"command": line, "ok": True, **reply.data}
        return reply

    def run_script(self, lines: Sequence[str], *, keep_going: bool = False) -> list[Reply]:
        replies = []
        for line in lines:
            if not line.strip() or line.strip().startswith("#"):
                continue
            reply = self.run(line)
            replies.append(reply)
            if reply.quit or (not reply.ok and not keep_going):
                break
        return replies

    # -- needs

    def _need_model(self) -> ModelSpec:
        if self.state.model is None:
            raise PlannerError("no-model", "No model yet.", ["choose one: model gpt-tiny "
                                                             "(models lists the zoo)"])
        return self.state.model

    def _need_cluster(self) -> ClusterSpec:
        if self.state.cluster is None:
            raise PlannerError("no-cluster", "No cluster yet.",
                               ["load one: cluster a100-v100-lab (examples lists them), or "
                                "cluster 2x8xA100-80G,4x8xV100-32G@100Gbps"])
        return self.state.cluster

    def _need_plan(self) -> Plan:
        if self.state.plan is None:
            why = f" ({self.state.note})" if self.state.note else ""
            raise PlannerError("no-plan", f"No plan yet{why}.",
                               ["run `solve`" if not self.state.tried else
                                "change the setup, or `undo` the last change"])
        return self.state.plan

    def needs_seq_len(self) -> bool:
        """Whether the model cannot be traced before `set seq-len N`: it has no default
        sequence length (see `needs_length`) and the session sets none."""
        from planner.models import load_model

        if self.state.model is None or self.state.seq_len is not None:
            return False
        return needs_length(load_model(self.state.model))

    def graph(self, state: State | None = None) -> ModelGraph:
        state = state or self.state
        assert state.model is not None and state.cluster is not None
        dtype = resolve_dtype(state.dtype, state.cluster)
        self.progress(f"Tracing {state.model.describe()}...")
        return self.trace(state.model, state.seq_len, dtype)

    def analysis(self) -> Any:
        from cost_models.model import AnalyticalCostModel
        from planner.explain import analyze

        plan = self._need_plan()
        if self._analysis is None or self._analysis[0] is not plan:
            graph = self.trace(plan.model, plan.training.seq_len, plan.training.dtype)
            self.progress("Simulating the step...")
            self._analysis = (plan, analyze(
                plan, graph.layers, AnalyticalCostModel(plan.cluster),
                runners_up=self.state.runners_up,
                constraints=self.state.constraints.describe()))
        return self._analysis[1]

    # -- solving

    def _solve(self, state: State, reply: Reply, *, strict: bool) -> State:
        """`state` with a fresh plan (or, when not strict and no plan exists, with the
        reason in `note`), the change against the previous plan in the reply."""
        from planner.compare import diff, headline, rows_json

        model = state.model
        cluster = state.cluster
        if model is None or cluster is None:
            raise PlannerError("incomplete", "Choose a model and a cluster first.",
                               ["model NAME", "cluster SPEC"])
        try:
            graph = self.graph(state)
            training = TrainingSpec(global_batch=state.global_batch, seq_len=graph.seq_len,
                                    dtype=resolve_dtype(state.dtype, cluster))
            self.progress("Searching plans...")
            plans = solve_plans(graph, cluster, training, state.constraints,
                                time_limit=state.time_limit, top_k=self.top_k,
                                progress=self.progress)
        except PlannerError as exc:
            if strict:
                raise
            exc = in_session_terms(exc)
            reply.add("warning", f"No plan for this setup: {exc.message}")
            for remedy in exc.remedies:
                reply.add("note", f"try: {remedy}")
            reply.add("note", "The change is kept; `undo` goes back.")
            reply.data["solved"] = False
            reply.data["error"] = exc.message
            return dataclasses.replace(state, plan=None, runners_up=(), tried=True,
                                       previous=state.plan or state.previous, note=exc.message)
        plan = plans[0]
        before = state.plan or state.previous
        new = dataclasses.replace(state, plan=plan, runners_up=tuple(plans[1:]),
                                  previous=before, tried=True, note="")
        reply.data["solved"] = True
        reply.data["plan"] = _plan_data(plan)
        names = [layer.name for layer in graph.layers]
        if before is None:
            reply.add("plan", (plan, names))
            return new
        # a change leads with what it changed; the plan follows compactly, so that the
        # change stays in view (`show plan` and `explain` give the rest)
        rows = diff(before, plan, state.price_map)
        reply.add("text", "Against the previous plan: " + headline(before, plan))
        reply.add("diff", (before, plan, rows))
        reply.data["diff"] = rows_json(rows)
        reply.add("plan-summary", (plan, names))
        reply.add("note", "`show plan`: the whole plan; `explain`: why it looks so.")
        return new

    def _changed(self, state: State, reply: Reply, what: str) -> State:
        """After an edit: say what changed and re-solve if the session has solved before,
        or try again a `solve` that failed. Where that succeeds, the edit and the `solve`
        count as two commands, as the transcript records them (the failed `solve` is not
        in it): `undo` goes back to the edit without the plan, as in a replay."""
        reply.add("text", what)
        complete = state.model is not None and state.cluster is not None
        if state.tried and state.auto_solve and complete:
            return self._solve(state, reply, strict=False)
        if self.failed_solve and state.auto_solve and complete:
            try:
                solved = self._solve(state, reply, strict=True)
            except PlannerError as exc:
                exc = in_session_terms(exc)
                reply.add("warning", f"Still no plan: {exc.message}")
                for remedy in exc.remedies:
                    reply.add("note", f"try: {remedy}")
                reply.data["solved"] = False
                reply.data["error"] = exc.message
                return state
            self.failed_solve = False
            self.history.append(self.state)  # the edit, then (by `run`) the solve
            self.state = state
            reply.then.append("solve")
            return solved
        if state.tried and not state.auto_solve:
            reply.add("note", "auto-solve is off: `solve` to see the effect.")
            state = dataclasses.replace(state, plan=None, previous=state.plan or state.previous,
                                        runners_up=(), note="the setup changed since the "
                                        "last solve")
        return state

    # -- setup commands

    def _cmd_help(self, args: list[str], reply: Reply) -> None:
        if args:
            name = _ALIASES.get(args[0].lower(), args[0].lower())
            if name not in _BY_NAME:
                near = closest(name, list(_BY_NAME))
                raise PlannerError("bad-command", f"No command {args[0]!r}"
                                   + (f"; did you mean {near[0]!r}?" if near else "."))
            reply.add("help", [_BY_NAME[name]])
        else:
            reply.add("help", list(COMMANDS))
        return None

    def _cmd_quit(self, args: list[str], reply: Reply) -> None:
        reply.quit = True
        return None

    def _cmd_models(self, args: list[str], reply: Reply) -> None:
        from planner.models.zoo import matching

        text = " ".join(args).lower()
        rows = tuple((f.name, f.family, f.description) for f in matching(text))
        if not rows:
            raise PlannerError("no-match", f"No zoo model matches {text!r}.",
                               ["`models` without a search lists all of them"])
        reply.add("table", Tabular("Model zoo" + (f" matching {text!r}" if text else ""),
                                   ("name", "family", "description"), rows))
        reply.data["models"] = [r[0] for r in rows]
        return None

    def _cmd_devices(self, args: list[str], reply: Reply) -> None:
        from cost_models.catalog import load_catalog

        text = " ".join(args).lower()
        catalog = load_catalog()
        rows = []
        for d in catalog.matching(text):
            aliases = [a for a, n in catalog.aliases.items() if n == d.name]
            flops = d.peak_flops.get("bf16") or d.peak_flops.get("fp16") \
                or d.peak_flops.get("fp32", 0.0)
            rows.append((d.name, d.vendor, f"{d.memory / 2**30:.4g} GiB",
                         f"{flops / 1e12:.4g}", ", ".join(aliases[:3])))
        if not rows:
            raise PlannerError("no-match", f"No device type matches {text!r}.",
                               ["`devices` without a search lists all of them"])
        reply.add("table", Tabular("Device types" + (f" matching {text!r}" if text else ""),
                                   ("name", "vendor", "memory", "16-bit TFLOP/s", "aliases"),
                                   tuple(rows)))
        reply.data["devices"] = [r[0] for r in rows]
        return None

    def _cmd_examples(self, args: list[str], reply: Reply) -> None:
        from cost_models.cluster import example_names, load_cluster
        from planner.whatif import describe_cluster

        rows = tuple((name, describe_cluster(load_cluster(name))) for name in example_names())
        reply.add("table", Tabular("Example clusters", ("name", "nodes"), rows))
        reply.data["examples"] = [r[0] for r in rows]
        return None

    def _cmd_model(self, args: list[str], reply: Reply) -> State:
        import yaml

        from planner.models import load_model, model_spec
        from planner.units import fmt_count
        from planner.whatif import parse_int

        positional, opts = parse_options(
            args, values=("layers", "hidden", "heads", "kv-heads", "ffn", "vocab"),
            multi=("set",))
        if len(positional) != 1:
            raise PlannerError("bad-command", "Give one model name: model NAME [options].",
                               ["e.g. model gpt-tiny, model opt-125m --layers 2"])
        overrides: dict[str, Any] = {}
        for key in ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab"):
            if key in opts:
                overrides[key.replace("-", "_")] = parse_int(opts[key], f"--{key}")
        for item in opts.get("set", []):
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise PlannerError("bad-option", f"--set {item!r} must look like KEY=VALUE.")
            parsed = yaml.safe_load(value) if value.strip() else ""
            overrides[key.strip().replace("-", "_")] = (tuple(parsed) if isinstance(parsed, list)
                                                        else parsed)
        spec = model_spec(positional[0], overrides)
        self.progress(f"Building {spec.describe()}...")
        loaded = load_model(spec, seq_len=self.state.seq_len)
        params = sum(p.numel() for p in loaded.module.parameters())
        state = dataclasses.replace(self.state, model=spec)
        reply.data["model"] = {"name": spec.name, "overrides": dict(spec.overrides),
                               "params": params}
        length = (f"sequence length {loaded.seq_len or '-'}" if not needs_length(loaded) else
                  "no default sequence length (give one: `set seq-len N`)")
        return self._changed(state, reply, f"Model {spec.describe()}: {fmt_count(params)} "
                             f"parameters, {length}.")

    def _cmd_cluster(self, args: list[str], reply: Reply) -> State:
        from cost_models.cluster import load_cluster
        from planner.whatif import describe_cluster

        if len(args) != 1:
            raise PlannerError("bad-command", "Give one cluster: a YAML file, an example name or "
                               "an inline spec (no spaces), e.g. cluster "
                               "2x8xA100-80G,4x8xV100-32G@100Gbps.")
        cluster = load_cluster(args[0])
        state = dataclasses.replace(self.state, cluster=cluster, cluster_source=args[0],
                                    cluster_edits=(),
                                    constraints=dataclasses.replace(self.state.constraints,
                                                                    exclude=(), pinned=()))
        reply.data["cluster"] = {"name": cluster.name, "devices": cluster.num_devices,
                                 "nodes": [n.name for n in cluster.nodes]}
        return self._changed(state, reply, f"Cluster {cluster.name}: "
                             f"{describe_cluster(cluster)}; nodes "
                             f"{', '.join(n.name for n in cluster.nodes)}.")

    def _cmd_set(self, args: list[str], reply: Reply) -> State:
        from planner.dtypes import canonical_dtype
        from planner.whatif import parse_int

        if len(args) != 2:
            raise PlannerError("bad-command", "Use set NAME VALUE, e.g. set global-batch 1024.",
                               ["names: global-batch, seq-len, dtype, time-limit, auto-solve"])
        key, value = args[0].lower().replace("_", "-"), args[1]
        state = self.state
        if key in ("global-batch", "batch", "b"):
            from planner.solver.limits import MAX_GLOBAL_BATCH

            number = parse_int(value, "global-batch")
            if not 1 <= number <= MAX_GLOBAL_BATCH:
                raise PlannerError("bad-value", f"global-batch must be between 1 and "
                                   f"{MAX_GLOBAL_BATCH:,} (got {number:,}).")
            state = dataclasses.replace(state, global_batch=number)
        elif key == "seq-len":
            seq = None if value == "default" else parse_int(value, "seq-len")
            if seq is not None and seq < 1:
                raise PlannerError("bad-value", f"seq-len must be positive (got {seq}).")
            if seq is not None and state.model is not None:  # the model's checks, as solve's
                from planner.models import load_model

                self.progress(f"Building {state.model.describe()}...")
                load_model(state.model, seq_len=seq)
            state = dataclasses.replace(state, seq_len=seq)
        elif key == "dtype":
            dtype = "auto" if value == "auto" else canonical_dtype(value)
            state = dataclasses.replace(state, dtype=dtype)
        elif key == "time-limit":
            try:
                seconds = None if value in ("none", "off") else float(value)
            except ValueError:
                raise PlannerError("bad-value", f"time-limit must be seconds or none (got "
                                   f"{value!r}).") from None
            if seconds is not None and not 0 < seconds < float("inf"):  # (NaN too)
                raise PlannerError("bad-value", f"time-limit must be a positive number of "
                                   f"seconds, or none (got {value!r}).")
            reply.add("text", f"Solves stop after {seconds} s." if seconds else
                      "Solves run to optimality (no time limit).")
            return dataclasses.replace(state, time_limit=seconds)
        elif key == "auto-solve":
            if value.lower() not in ("on", "off"):
                raise PlannerError("bad-value", "auto-solve is on or off.")
            reply.add("text", f"auto-solve {value.lower()}.")
            return dataclasses.replace(state, auto_solve=value.lower() == "on")
        else:
            near = closest(key, ["global-batch", "seq-len", "dtype", "time-limit",
                                 "auto-solve"])
            raise PlannerError("bad-command", f"Cannot set {key!r}"
                               + (f"; did you mean {near[0]!r}?" if near else "."))
        return self._changed(state, reply, f"{key} = {value}.")

    def _cmd_solve(self, args: list[str], reply: Reply) -> State:
        if args:
            raise PlannerError("bad-command", "solve takes no arguments; set options with "
                               "`set` and `constrain`.")
        self._need_model()
        self._need_cluster()
        try:
            solved = self._solve(self.state, reply, strict=True)
        except PlannerError:
            self.failed_solve = True
            raise
        self.failed_solve = False
        return solved

    # -- what-if commands

    def _edit_cluster(self, reply: Reply, cluster: ClusterSpec, flags: tuple[str, ...],
                      what: str) -> State:
        from planner.whatif import describe_cluster

        state = dataclasses.replace(self.state, cluster=cluster,
                                    cluster_edits=self.state.cluster_edits + flags)
        reply.data["cluster"] = {"name": cluster.name, "devices": cluster.num_devices,
                                 "nodes": [n.name for n in cluster.nodes]}
        return self._changed(state, reply, f"{what} Cluster now: {describe_cluster(cluster)}.")

    def _cmd_add(self, args: list[str], reply: Reply) -> State:
        from planner.whatif import add_nodes

        positional, opts = parse_options(args, values=("nic", "group"))
        if len(positional) != 1:
            raise PlannerError("bad-command", "Use add NODESxDEVICESxTYPE, e.g. add 4x8xV100-32G.")
        before = {n.name for n in self._need_cluster().nodes}
        cluster = add_nodes(self._need_cluster(), positional[0], nic=opts.get("nic"),
                            group=opts.get("group"))
        added = [n.name for n in cluster.nodes if n.name not in before]
        extra = [x for k in ("nic", "group") if k in opts for x in (f"--{k}", opts[k])]
        flags = ("--add", positional[0], *extra)
        return self._edit_cluster(reply, cluster, flags, f"Added {', '.join(added)}.")

    def _cmd_remove(self, args: list[str], reply: Reply) -> State:
        from planner.whatif import remove_nodes

        before = self._need_cluster()
        cluster = remove_nodes(before, args)
        gone = [n.name for n in before.nodes if n not in cluster.nodes]
        flags = tuple(x for name in gone for x in ("--remove", name))
        return self._edit_cluster(reply, cluster, flags, f"Removed {', '.join(gone)}.")

    def _cmd_resize(self, args: list[str], reply: Reply) -> State:
        from planner.whatif import parse_int, resize_node

        if len(args) != 2:
            raise PlannerError("bad-command", "Use resize NODE DEVICES, e.g. resize ws 4.")
        devices = parse_int(args[1], "devices")
        cluster = resize_node(self._need_cluster(), args[0], devices)
        return self._edit_cluster(reply, cluster, ("--resize", f"{args[0]}={devices}"),
                                  f"{args[0]} now has {devices} device(s) per node.")

    def _cmd_link(self, args: list[str], reply: Reply) -> State:
        from planner.whatif import LINK_TARGETS, set_link

        if len(args) != 2:
            raise PlannerError("bad-command", "Use link TARGET BANDWIDTH[/LATENCY], e.g. link "
                               f"network 25Gbps; TARGET is one of {LINK_TARGETS}.")
        cluster = set_link(self._need_cluster(), args[0], args[1])
        return self._edit_cluster(reply, cluster, ("--link", f"{args[0]}={args[1]}"),
                                  f"Link {args[0]} set to {args[1]}.")

    # -- constraints

    def _constrained(self, constraints: Constraints, reply: Reply) -> State:
        state = dataclasses.replace(self.state, constraints=constraints)
        text = "; ".join(constraints.describe()) or "none"
        return self._changed(state, reply, f"Constraints: {text}.")

    def _cmd_constrain(self, args: list[str], reply: Reply) -> State:
        if not args:
            raise PlannerError("bad-command", "Use constrain KEY=VALUE ..., e.g. constrain tp=2 "
                               "recompute=full.", [f"keys: {', '.join(CONSTRAINT_KEYS)}"])
        constraints = self.state.constraints
        for item in args:
            key, sep, value = item.partition("=")
            if not sep:
                raise PlannerError("bad-command", f"{item!r} must look like KEY=VALUE, e.g. "
                                   "tp=2.", [f"keys: {', '.join(CONSTRAINT_KEYS)}"])
            constraints = parse_constraint(constraints, key, value)
        return self._constrained(constraints, reply)

    def _check_nodes(self, names: Sequence[str]) -> None:
        from planner.whatif import _unknown_node

        cluster = self._need_cluster()
        if not names:
            raise PlannerError("bad-command", "Name at least one node.",
                               [f"nodes: {', '.join(n.name for n in cluster.nodes)}"])
        for name in names:
            if name not in {n.name for n in cluster.nodes}:
                raise _unknown_node(cluster, name)

    def _cmd_exclude(self, args: list[str], reply: Reply) -> State:
        self._check_nodes(args)
        c = self.state.constraints
        exclude = c.exclude + tuple(a for a in args if a not in c.exclude)
        return self._constrained(dataclasses.replace(c, exclude=exclude), reply)

    def _cmd_pin(self, args: list[str], reply: Reply) -> State:
        self._check_nodes(args)
        c = self.state.constraints
        pinned = c.pinned + tuple(a for a in args if a not in c.pinned)
        return self._constrained(dataclasses.replace(c, pinned=pinned), reply)

    def _cmd_unconstrain(self, args: list[str], reply: Reply) -> State:
        c = self.state.constraints
        if not args or args == ["all"]:
            return self._constrained(Constraints(), reply)
        for arg in args:
            key = arg.lower().replace("_", "-")
            if key in CONSTRAINT_KEYS:
                default = Constraints()
                c = dataclasses.replace(c, **{key.replace("-", "_"): getattr(
                    default, key.replace("-", "_"))})
            elif key in ("exclude", "pin", "pins", "pinned"):
                c = dataclasses.replace(c, **({"exclude": ()} if key == "exclude"
                                              else {"pinned": ()}))
            elif arg in c.exclude or arg in c.pinned:
                c = dataclasses.replace(c, exclude=tuple(x for x in c.exclude if x != arg),
                                        pinned=tuple(x for x in c.pinned if x != arg))
            else:
                raise PlannerError("bad-command", f"{arg!r} is not a constraint, an excluded "
                                   "node or a pinned node.",
                                   [f"constraints now: {'; '.join(c.describe()) or 'none'}"])
        return self._constrained(c, reply)

    def _cmd_price(self, args: list[str], reply: Reply) -> State:
        from planner.compare import MAX_PRICE, parse_price

        usage = "price TYPE DOLLARS_PER_HOUR, e.g. price A100-80G-SXM 2.5"
        priced = parse_price(*args) if len(args) == 2 else None
        if priced is None:
            raise PlannerError("bad-command", f"Use {usage} (a price is 0 to {MAX_PRICE:,.0f} "
                               "dollars per device-hour).")
        types = sorted({node.device.name for node in self._need_cluster().nodes})
        kind = priced[0]
        if kind not in types and kind.split("@")[0] not in {t.split("@")[0] for t in types}:
            raise PlannerError("bad-command", f"The cluster has no {kind} devices, so the "
                               "price would never be used.",
                               [f"price one of its types: {', '.join(types)}"])
        prices = {**self.state.price_map, kind: priced[1]}
        reply.add("text", "Prices per device-hour: " + ", ".join(
            f"{k} ${v:g}" for k, v in prices.items()) + ".")
        return dataclasses.replace(self.state, prices=tuple(sorted(prices.items())))

    # -- inspecting

    def _cmd_show(self, args: list[str], reply: Reply) -> None:
        what = args[0].lower() if args else "plan"
        state = self.state
        if what == "plan":
            plan = self._need_plan()
            graph = self.trace(plan.model, plan.training.seq_len, plan.training.dtype)
            reply.add("plan", (plan, [layer.name for layer in graph.layers]))
            reply.data["plan"] = _plan_data(plan)
        elif what == "cluster":
            cluster = self._need_cluster()
            from planner.units import fmt_rate

            rows = tuple((n.name, n.device.name, str(n.devices),
                          f"{n.intra_link.name} ({fmt_rate(n.intra_link.bandwidth)})",
                          f"{fmt_rate(n.nic.bandwidth)}" if n.nic else "-",
                          " > ".join(n.groups) or "-") for n in cluster.nodes)
            reply.add("table", Tabular(
                f"Cluster {cluster.name}: network {cluster.network.name} "
                f"({fmt_rate(cluster.network.bandwidth)})",
                ("node", "device", "devices", "intra-node link", "NIC", "groups"), rows))
            reply.data["cluster"] = {"name": cluster.name, "nodes": [r[0] for r in rows]}
        elif what == "constraints":
            items = state.constraints.describe()
            reply.add("text", "Constraints: " + ("; ".join(items) if items else "none")
                      + f". Time limit: {state.time_limit or 'none'} s; auto-solve "
                      f"{'on' if state.auto_solve else 'off'}.")
            reply.data["constraints"] = items
        elif what in ("runners-up", "runner-ups", "runners"):
            from planner.explain import structure
            from planner.units import fmt_seconds

            plan = self._need_plan()
            rows = tuple((f"#{i}", structure(p), fmt_seconds(p.prediction.step_time),
                          f"{p.prediction.step_time / plan.prediction.step_time - 1:+.1%}")
                         for i, p in enumerate((plan, *state.runners_up), 1))
            reply.add("table", Tabular("The best plans found", ("rank", "structure",
                                                                "step time", "vs best"), rows))
        else:
            raise PlannerError("bad-command", f"Cannot show {what!r}.",
                               ["show plan, show cluster, show constraints, show runners-up"])
        return None

    def _cmd_explain(self, args: list[str], reply: Reply) -> None:
        from planner.explain import analysis_dict

        analysis = self.analysis()
        reply.add("explanation", analysis)
        data = analysis_dict(analysis)
        reply.data["explanation"] = data["explanation"]
        return None

    def _cmd_timeline(self, args: list[str], reply: Reply) -> None:
        from planner.timeline import MAX_WIDTH
        from planner.whatif import parse_int

        width = parse_int(args[0], "width") if args else 0
        if args and not 40 <= width <= MAX_WIDTH:
            raise PlannerError("bad-value", f"timeline width must be between 40 and "
                               f"{MAX_WIDTH:,} columns (got {width:,}).")
        reply.add("timeline", (self.analysis().timeline, width))
        return None

    def _cmd_memory(self, args: list[str], reply: Reply) -> None:
        reply.add("memory", self.analysis())
        return None

    def _cmd_traffic(self, args: list[str], reply: Reply) -> None:
        reply.add("traffic", self.analysis())
        return None

    def _cmd_diff(self, args: list[str], reply: Reply) -> None:
        from planner.compare import diff, headline, rows_json

        plan = self._need_plan()
        before = self.state.previous
        if before is None:
            raise PlannerError("no-plan", "There is no previous plan to compare with yet.",
                               ["make a change (a what-if) first"])
        rows = diff(before, plan, self.state.price_map)
        reply.add("text", headline(before, plan))
        reply.add("diff", (before, plan, rows))
        reply.data["diff"] = rows_json(rows)
        return None

    def _cmd_history(self, args: list[str], reply: Reply) -> None:
        reply.add("cli", list(self.transcript) or ["(nothing yet)"])
        return None

    def _cmd_cli(self, args: list[str], reply: Reply) -> None:
        reply.add("cli", self.equivalent())
        return None

    def _cmd_undo(self, args: list[str], reply: Reply) -> State:
        if not self.history:
            raise PlannerError("nothing-to-undo", "Nothing to undo.")
        previous = self.history.pop()
        reply.add("text", "Undone: back to the state before the last change.")
        if previous.plan is not None:
            from planner.explain import structure
            from planner.units import fmt_seconds

            reply.add("note", f"Plan: {structure(previous.plan)}, "
                      f"{fmt_seconds(previous.plan.prediction.step_time)} per step.")
        self.state = previous
        return previous

    # -- saving

    def _cmd_save(self, args: list[str], reply: Reply) -> None:
        positional, opts = parse_options(args, values=("target", "hosts"), flags=("force",))
        if len(positional) != 2:
            raise PlannerError("bad-command", "Use save plan|cluster|report|launch|transcript "
                               "PATH [--force].")
        what, path = positional[0].lower(), Path(positional[1])
        force = self.force or bool(opts.get("force"))
        try:
            self._save(what, path, opts, force, reply)
        except OSError as exc:  # (checked before writing: a disk that fills, a folder that goes)
            raise PlannerError("bad-path", f"Could not save the {what} to {str(path)!r}: "
                               f"{exc.strerror or exc}.", ["choose another path"]) from None
        self.saved.append(str(path))
        reply.add("text", f"Saved the {what} to {path}.")
        reply.data["saved"] = str(path)
        return None

    def _save(self, what: str, path: Path, opts: dict[str, Any], force: bool,
              reply: Reply) -> None:
        if what == "plan":
            from planner.planfile import plan_json

            write_atomic(path, plan_json(self._need_plan()), force=force)
        elif what == "cluster":
            import yaml

            from cost_models.cluster import cluster_to_dict

            text = yaml.safe_dump(cluster_to_dict(self._need_cluster()), sort_keys=False)
            write_atomic(path, text, force=force)
        elif what == "report":
            suffix = path.suffix.lower()
            if suffix == ".svg":
                from planner.timeline import to_svg

                write_atomic(path, to_svg(self.analysis().timeline), force=force)
            elif suffix in (".html", ".htm"):
                from planner.report import report_html

                write_atomic(path, report_html(self.analysis()), force=force)
            else:
                raise PlannerError("bad-path", f"{str(path)!r}: a report is .html (the whole "
                                   "analysis) or .svg (the timeline).")
        elif what == "transcript":
            write_atomic(path, transcript_text(self.transcript), force=force)
        elif what == "launch":
            self._save_launch(path, opts.get("target"), opts.get("hosts"), force, reply)
        else:
            raise PlannerError("bad-command", f"Cannot save {what!r}.",
                               ["save plan, save cluster, save report, save launch, "
                                "save transcript"])

    def _save_launch(self, folder: Path, target: str | None, hosts: str | None, force: bool,
                     reply: Reply) -> None:
        plan = self._need_plan()
        try:
            from planner import launch  # type: ignore[attr-defined]
        except ImportError:
            raise PlannerError(
                "not-available", "Launch scripts come from `planner launch`, which this "
                "installation does not have yet.",
                ["save the plan (save plan plan.json) and run `planner launch plan.json` "
                 "once it is available"]) from None
        options: dict[str, Any] = {"target": target or "torchrun"}
        if hosts is not None:
            options["hosts"] = launch.read_hosts(Path(hosts))
        files = launch.render_launch(plan, **options)
        if folder.exists() and not folder.is_dir():
            raise PlannerError("bad-path", f"{str(folder)!r} is a file; launch scripts go in a "
                               "folder.")
        targets = [folder / name for name in files]
        clash = [str(p) for p in targets if p.exists()]
        if clash and not force:
            raise PlannerError("file-exists", f"{clash[0]!r} already exists; nothing was "
                               "written.", ["add --force to overwrite", "choose another folder"])
        launch.check_out(folder, force=True)  # as `planner launch --out` (and `save plan`)
        for name, text in files.items():
            path = folder / name
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, text, force=True)
            if name.endswith((".sh", ".sbatch")):
                path.chmod(0o755)
        reply.add("note", f"{len(files)} file(s) for {options['target']}: "
                  + ", ".join(sorted(map(str, files))))

    # -- equivalents

    def equivalent(self) -> list[str]:
        """Shell commands that reproduce the current plan without the session."""
        state = self.state
        if state.model is None or state.cluster is None:
            return ["# choose a model and a cluster first"]
        model = state.model
        words = ["planner", "solve", model.name]
        for key, value in sorted(model.overrides.items()):
            if key in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab"):
                words += [f"--{key.replace('_', '-')}", str(value)]
            else:
                words += ["--set", f"{key}={value}"]
        base = state.cluster_source or "cluster.yaml"
        training = ["--global-batch", str(state.global_batch)]
        if state.seq_len:
            training += ["--seq-len", str(state.seq_len)]
        training += ["--dtype", state.dtype]
        limit = ["--time-limit", f"{state.time_limit:g}"] if state.time_limit else []
        lines = []
        if not state.cluster_edits:
            lines.append(shlex.join([*words, "--cluster", base, *training,
                                     *state.constraints.flags(state.cluster), *limit,
                                     "-o", "plan.json"]))
        else:
            before = [*words, "--cluster", base, *training, *limit, "-o", "base.json"]
            lines.append(shlex.join(before))
            lines.append(shlex.join(["planner", "what-if", "base.json", *state.cluster_edits,
                                     "--dtype", state.dtype,
                                     *state.constraints.flags(state.cluster), *limit,
                                     "-o", "plan.json", "--cluster-out", "cluster.yaml"]))
            lines.append("# or: save cluster cluster.yaml here, then "
                         + shlex.join([*words, "--cluster", "cluster.yaml", *training,
                                       *state.constraints.flags(state.cluster), *limit,
                                       "-o", "plan.json"]))
        lines.append("planner explain plan.json --html plan.html")
        lines.append("planner launch plan.json --out launch/   # launch scripts")
        return lines


def transcript_text(lines: Sequence[str]) -> str:
    header = ("# planner session transcript: replay with "
              "`planner interactive --replay FILE` (add --force to overwrite saved files)\n")
    return header + "".join(f"{line}\n" for line in lines)


def read_transcript(path: Path) -> list[str]:
    if str(path) != "-" and not path.is_file():
        raise PlannerError("bad-path", f"Transcript {str(path)!r} does not exist.")
    import sys

    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text()
    except UnicodeDecodeError:
        raise PlannerError("bad-transcript", f"{str(path)!r} is not a text file of session "
                           "commands.") from None
    return [line for line in text.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def _plan_data(plan: Plan) -> dict:
    from planner.explain import structure

    p = plan.prediction
    return {"structure": structure(plan), "step_time": float(p.step_time),
            "samples_per_s": float(p.samples_per_s),
            "tokens_per_s": float(p.tokens_per_s) if p.tokens_per_s else None,
            "mfu": float(p.mfu), "devices_used": plan.num_devices,
            "pipelines": len(plan.pipelines), "dtype": plan.training.dtype,
            "global_batch": plan.training.global_batch, "solver": plan.solver.status}
