"""`planner interactive` (and `planner` alone at a terminal): a guided planning session.

The session logic is `planner.session.Session` (commands in, replies out); this
module only asks questions, reads command lines and renders replies. Every
question's answer becomes a session command, so the transcript (`--record`,
`save transcript`) replays the whole session with `--replay`.

Ctrl-C during long work (tracing, solving) interrupts it and changes nothing;
Ctrl-C or Ctrl-D at a prompt leaves. Saved files are written whole or not at
all, so leaving never loses or corrupts them.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.prompt import Confirm, IntPrompt, Prompt

from cli import options as opt

console = Console(emoji=False, highlight=False)
err_console = Console(emoji=False, stderr=True, highlight=False)

HINT = ("Try: add 1x8xV100-32G | link network 25Gbps | set global-batch 1024 | constrain tp=2 "
        "| explain | timeline | memory | save plan plan.json | help | quit")


class _Leave(Exception):
    """The user left (Ctrl-C or Ctrl-D at a prompt, or `quit`)."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code
        self.why = why


class Terminal:
    """The prompt loop around a Session."""

    def __init__(self, session: object, console: Console, *, echo: bool = False) -> None:
        from planner.session import Session

        assert isinstance(session, Session)
        self.session = session
        self.console = console
        self.echo = echo

    # -- running one command

    def do(self, line: str) -> object:
        from cli.render_explain import render_reply

        if self.echo:
            self.console.print(f"[bold]planner>[/] {escape(line)}", highlight=False)
        if self.console.is_terminal:
            with self.console.status("Working...", spinner="dots") as status:
                self.session.progress = lambda message: status.update(escape(message))
                try:
                    reply = self.session.run(line)
                finally:
                    self.session.progress = lambda message: None
        else:
            reply = self.session.run(line)
        render_reply(self.console, reply)
        return reply

    def ask(self, question: str, *, default: str | None = None,
            choices: list[str] | None = None) -> str:
        try:
            if default is None:
                answer = Prompt.ask(question, console=self.console, choices=choices)
            else:
                answer = Prompt.ask(question, console=self.console, default=default,
                                    choices=choices)
        except EOFError:
            raise _Leave(0, "end of input") from None
        except KeyboardInterrupt:
            raise _Leave(130, "Ctrl-C") from None
        return answer.strip()

    def ask_int(self, question: str, default: int) -> int:
        try:
            return IntPrompt.ask(question, console=self.console, default=default)
        except EOFError:
            raise _Leave(0, "end of input") from None
        except KeyboardInterrupt:
            raise _Leave(130, "Ctrl-C") from None

    def confirm(self, question: str) -> bool:
        try:
            return Confirm.ask(question, console=self.console, default=False)
        except EOFError:
            raise _Leave(0, "end of input") from None
        except KeyboardInterrupt:
            raise _Leave(130, "Ctrl-C") from None

    # -- the guided start

    def guide(self) -> None:
        state = self.session.state
        self.console.rule("[bold]planner[/]: plan training on your cluster")
        self.console.print("Answer three questions (Enter takes the default shown); "
                           "then change anything with commands. Ctrl-C leaves.")
        if state.model is None:
            self._ask_model()
        if self.session.state.cluster is None:
            self._ask_cluster()
        self._ask_training()
        self._interruptible("solve")
        self.console.print(HINT, style="dim")

    def _ask_model(self) -> None:
        self.console.print("[bold]1. The model.[/] A zoo name (gpt-tiny, llama3-8b, ...), "
                           "'list' for the zoo, 'search TEXT', or package.module:factory.")
        while True:  # the name is checked (the model built) here: a typo re-asks only it
            name = self.ask("Model", default="gpt-tiny")
            words = name.split()
            if name.lower() in ("list", "?", "ls") or words[:1] == ["models"]:  # (as hints say)
                self.do(shlex.join(["models", *words[1:]]))
                continue
            if name.lower().startswith("search "):
                self.do("models " + name[7:])
                continue
            if self._interruptible(shlex.join(["model", name])):
                break
        while True:
            extra = self.ask("Shape overrides, e.g. --layers 2 (Enter for none)", default="")
            try:
                words = shlex.split(extra)
            except ValueError:
                self.console.print("[red]Cannot read those options; try again.[/]")
                continue
            if not words or self._interruptible(shlex.join(["model", name, *words])):
                return

    def _ask_cluster(self) -> None:
        from cost_models.cluster import example_names

        self.console.print("[bold]2. The cluster.[/] \\[e] an example, \\[f] a YAML file, "
                           "\\[b] build it by answering questions, \\[i] an inline spec.")
        while True:
            how = self.ask("Cluster", choices=["e", "f", "b", "i"], default="e")
            if how == "e":
                self.do("examples")
                names = example_names()
                spec = self.ask("Example", choices=names, default=names[0])
            elif how == "f":
                spec = self.ask("Cluster YAML file")
            elif how == "i":
                spec = self.ask("Inline spec (NODESxDEVICESxTYPE,...@BANDWIDTH)",
                                default="2x8xA100-80G,4x8xV100-32G@100Gbps")
            else:
                spec = self._build_cluster()
            if self._interruptible(shlex.join(["cluster", spec])):
                return

    def _build_cluster(self) -> str:
        from cost_models import catalog
        from cost_models.cluster import parse_inline_network
        from planner.errors import PlannerError

        items = []
        while True:
            kind = self.ask("Device type ('list' or 'search TEXT' to look)", default="A100-80G")
            if kind.lower() in ("list", "?", "ls"):
                self.do("devices")
                continue
            if kind.lower().startswith("search "):
                self.do("devices " + kind[7:])
                continue
            try:
                name = catalog.device(kind).name
            except PlannerError as exc:
                self.console.print(f"[red]{escape(exc.message)}[/]")
                continue
            nodes = self.ask_int(f"How many {name} nodes", 1)
            per = self.ask_int(f"{name} devices per node", 8)
            if nodes < 1 or per < 1:
                self.console.print("[red]Nodes and devices per node must be at least 1.[/]")
                continue
            items.append(f"{nodes}x{per}x{name}")
            if not self.confirm("Add another kind of node?"):
                break
        while True:  # checked here: a typo re-asks the network, not every question before
            network = self.ask("Network between nodes (bandwidth per node)", default="100Gbps")
            try:
                parse_inline_network(network)
            except PlannerError as exc:
                self.console.print(f"[red]{escape(exc.message)}[/]")
                continue
            return ",".join(items) + f"@{network}"

    def _ask_training(self) -> None:
        state = self.session.state
        self.console.print("[bold]3. Training.[/]")
        while True:
            batch = self.ask_int("Global batch (samples per step)", state.global_batch)
            if self._interruptible(f"set global-batch {batch}"):
                break
        needed = self.session.needs_seq_len()  # (a factory's model may have no default)
        while True:
            seq = (self.ask("Sequence length (the model has no default)") if needed else
                   self.ask("Sequence length (Enter: the model's)", default=""))
            if not seq and needed:
                self.console.print("[red]This model has no default sequence length: give "
                                   "one, e.g. 2048.[/]")
                continue
            if not seq or self._interruptible(f"set seq-len {shlex.quote(seq)}"):
                break
        dtype = self.ask("Training dtype (auto: bf16 if every device has it, else fp16)",
                         choices=["auto", "bf16", "fp16", "fp32", "tf32"], default=state.dtype)
        if dtype != state.dtype:
            self._interruptible(f"set dtype {dtype}")

    # -- the loop

    def _interruptible(self, line: str) -> bool:
        """Run a command at the terminal: Ctrl-C stops it (a plan search stops with the
        best plan so far, as `planner solve` does; anything else leaves the state
        unchanged), and a bug in it is reported without ending the session."""
        try:
            reply = self.do(line)
        except KeyboardInterrupt:
            self.console.print("\n[yellow]Interrupted; nothing changed.[/]")
            return False
        except Exception as exc:  # a bug: say so, keep the session and its saved work
            first = str(exc).splitlines()[0] if str(exc) else ""
            self.console.print(f"[bold red]internal error:[/] {type(exc).__name__}: "
                               f"{escape(first)}\nThis is a bug in planner; nothing changed. "
                               "Please report it (with the transcript: `history`).")
            return False
        if getattr(reply, "quit", False):
            raise _Leave(0, "quit")
        return bool(getattr(reply, "ok", False))

    def loop(self) -> None:
        while True:
            try:
                line = self.console.input("[bold cyan]planner>[/] ")
            except EOFError:
                raise _Leave(0, "end of input") from None
            except KeyboardInterrupt:
                raise _Leave(130, "Ctrl-C") from None
            if line.strip():
                self._interruptible(line)


def _completion(session: object) -> None:
    """Tab completion of command names, node names and zoo names (where readline is)."""
    try:
        import readline
    except ImportError:  # pragma: no cover - Windows without pyreadline
        return
    from planner.models import FLAVORS
    from planner.session import COMMANDS, Session

    assert isinstance(session, Session)
    words = [c.name for c in COMMANDS]

    def complete(text: str, index: int) -> str | None:
        line = readline.get_line_buffer()
        first = not line.strip() or (len(line.split()) == 1 and not line.endswith(" "))
        pool = list(words) if first else []
        if not first:
            cluster = session.state.cluster
            pool += [n.name for n in cluster.nodes] if cluster else []
            pool += [*FLAVORS, "plan", "cluster", "report", "launch", "transcript",
                     "constraints", "runners-up", "network", "global-batch", "seq-len",
                     "dtype", "time-limit", "auto-solve"]
        hits = [w for w in pool if w.startswith(text)]
        return hits[index] if index < len(hits) else None

    readline.set_completer(complete)
    readline.set_completer_delims(" \t")
    readline.parse_and_bind("tab: complete")


def complete_models(incomplete: str) -> list[str]:
    """Shell completion of zoo model names."""
    from planner.models import FLAVORS

    return [name for name in FLAVORS if name.startswith(incomplete)]


def complete_clusters(incomplete: str) -> list[str]:
    """Shell completion of example cluster names (files complete as usual)."""
    from cost_models.cluster import example_names

    return [name for name in example_names() if name.startswith(incomplete)]


def _recorder(path: Path | None, force: bool) -> tuple[Callable[[str], None] | None,
                                                         IO[str] | None]:
    if path is None:
        return None, None
    from planner.files import check_writable
    from planner.session import transcript_text

    check_writable(path, force=force)
    out = path.open("w")
    out.write(transcript_text([]))
    out.flush()

    def record(line: str) -> None:
        out.write(line + "\n")
        out.flush()
        os.fsync(out.fileno())

    return record, out


def interactive(
    replay: Annotated[Path | None, typer.Option(
        "--replay", help="Run the commands in FILE (a transcript; - for stdin) instead of "
        "asking. Stops at the first failing command (exit 1) unless --keep-going.",
        dir_okay=False, allow_dash=True)] = None,
    record: Annotated[Path | None, typer.Option(
        "--record", help="Write every command to FILE as it runs (a transcript to replay).",
        dir_okay=False)] = None,
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="Start with this model (skips the question).",
        autocompletion=complete_models)] = None,
    cluster: Annotated[str | None, typer.Option(
        "--cluster", "-c", help="Start with this cluster (skips the question).",
        autocompletion=complete_clusters)] = None,
    global_batch: Annotated[int | None, typer.Option(
        "--global-batch", "-B", help="Start with this global batch.")] = None,
    seq_len: opt.SeqLen = None,
    dtype: Annotated[str | None, typer.Option(
        "--dtype", help="bf16, fp16, fp32, tf32 or auto.")] = None,
    time_limit: Annotated[float, typer.Option(
        "--time-limit", help="Seconds each solve may take (the session's `set time-limit`).")
    ] = 10.0,
    json_out: Annotated[bool, typer.Option(
        "--json", help="With --replay or piped commands: print one JSON list of the command "
        "results to stdout, nothing else.")] = False,
    keep_going: Annotated[bool, typer.Option(
        "--keep-going", help="With --replay: run every command even after a failure.")
    ] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="Let `save` commands (and --record) overwrite existing files.")
    ] = False,
    guided: Annotated[bool, typer.Option(
        "--guided/--no-guided", help="Ask for the model, cluster and training setup first "
        "(default: at a terminal, when they are not given).")] = True,
) -> None:
    """Plan interactively: pick a model and cluster, see the plan, then ask what-if.

    After the guided start, type commands (`help` lists them): what-if edits (add,
    remove, resize, link, set), constraints (constrain, exclude, pin), explain,
    timeline, memory, traffic, diff, and save (plan, cluster, report, launch,
    transcript). Each re-solve shows the change in step time, throughput and cost.
    Every command has a non-interactive equivalent (`help` shows it; `cli` prints
    the shell commands for the current plan).

    Examples:
      planner                                        # at a terminal: the same as this
      planner interactive -m gpt-tiny -c a100-v100-lab --record session.txt
      planner interactive --replay session.txt --force
      echo -e "model gpt-tiny\\ncluster 1x8xA100-80G\\nsolve" | planner interactive --json
    """
    from planner.errors import PlannerError
    from planner.session import Session, read_transcript

    scripted = replay is not None or not sys.stdin.isatty()
    if json_out and not scripted:
        raise PlannerError("bad-option", "--json needs --replay FILE or commands on stdin; at "
                           "a terminal the session is for people.")
    if keep_going and not scripted:
        raise PlannerError("bad-option", "--keep-going applies to --replay FILE (or commands "
                           "on stdin); at a terminal a failed command never ends the session.")
    if not time_limit > 0:  # (NaN too)
        raise PlannerError("bad-option", f"--time-limit must be positive (got {time_limit}).")
    lines = read_transcript(replay if replay is not None else Path("-")) if scripted else []
    on_record, record_file = _recorder(record, force)
    out = Console(emoji=False, stderr=True, highlight=False) if json_out else console
    session = Session(time_limit=time_limit, force=force, on_record=on_record)
    prelude = []
    if model:
        prelude.append(shlex.join(["model", model]))
    if cluster:
        prelude.append(shlex.join(["cluster", cluster]))
    if global_batch is not None:
        prelude.append(f"set global-batch {global_batch}")
    if seq_len is not None:
        prelude.append(f"set seq-len {seq_len}")
    if dtype is not None:
        prelude.append(shlex.join(["set", "dtype", dtype]))
    terminal = Terminal(session, out, echo=scripted and not json_out)
    try:
        if scripted:
            _scripted(terminal, prelude + lines, json_out=json_out, keep_going=keep_going)
            return
        _completion(session)
        code, why = 0, "quit"
        try:
            for line in prelude:
                if not terminal._interruptible(line):
                    raise PlannerError("bad-option", f"Could not start with `{line}`; see above.")
            if guided:
                terminal.guide()
            else:
                terminal.console.print(HINT, style="dim")
            terminal.loop()
        except _Leave as leave:
            code, why = leave.code, leave.why
        _goodbye(session, why, record)
        if code:
            raise typer.Exit(code)
    finally:
        if record_file is not None:
            record_file.close()


def _scripted(terminal: Terminal, lines: list[str], *, json_out: bool,
              keep_going: bool) -> None:
    session = terminal.session
    results = []
    failed = False
    for line in lines:
        reply: Any = session.run(line) if json_out else terminal.do(line)
        results.append(reply.data)
        if reply.quit:
            break
        if not reply.ok:
            failed = True
            if not keep_going:
                break
    if json_out:
        sys.stdout.write(json.dumps(results, indent=1, default=str) + "\n")
    elif failed:
        err_console.print("[bold red]error:[/] the transcript stopped at a failing command "
                          "(above)." if not keep_going else
                          "[bold red]error:[/] some commands failed (above).")
    if failed:
        raise typer.Exit(1)


def _goodbye(session: object, why: str, record: Path | None) -> None:
    from planner.session import Session

    assert isinstance(session, Session)
    saved = sorted(set(session.saved))
    console.print()
    console.print(f"Left the session ({why})."
                  + (f" Saved: {', '.join(saved)}." if saved else " Nothing was saved.")
                  + (f" Transcript: {record}." if record else ""), highlight=False,
                  markup=False)  # (file names as written)


def start() -> None:
    """`planner` with no command at a terminal."""
    interactive()


def register(app: typer.Typer) -> None:
    app.command("interactive")(interactive)
