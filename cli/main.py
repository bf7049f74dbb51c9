"""The `planner` command: a thin typer + rich layer over the library.

Errors: a `PlannerError` becomes a short red message on stderr and exit code 1;
an unexpected exception exits with 3 and a one-line note. `--debug` shows the
traceback instead. Usage errors (typer/click) exit with 2. Output into a closed pipe
(`planner ... | head -1`) ends quietly with 141, as cat and git do.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from planner import __version__
from planner.errors import PlannerError

err_console = Console(emoji=False, stderr=True, soft_wrap=True)
# 128 + SIGPIPE: how cat and git end when the reader of their output is gone (git exits
# with 141 itself on EPIPE), so a `set -o pipefail` script sees cut-off output as it would
# theirs; and it is neither bad input (1) nor a bug (3).
PIPE_CLOSED = 141


def _on_broken_pipe(console: Console) -> None:
    """rich ends the program with exit code 1 itself when its output is closed: hand the
    error to `_Group.invoke` instead, which ends every closed pipe the same way."""
    raise BrokenPipeError(errno.EPIPE, "Broken pipe")


Console.on_broken_pipe = _on_broken_pipe  # type: ignore[method-assign]


class _Group(TyperGroup):
    """Maps library errors to messages and exit codes in one place."""

    def make_context(self, *args: Any, **kwargs: Any) -> typer.Context:
        """`planner --help` and `--version` print while the arguments are parsed, before
        `invoke`: a closed pipe there ends as quietly (typer would exit with 1)."""
        try:
            return super().make_context(*args, **kwargs)
        except BrokenPipeError:
            raise typer.Exit(PIPE_CLOSED) from None

    def invoke(self, ctx: typer.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except BrokenPipeError:  # the reader of our output went away: nothing to say
            raise typer.Exit(PIPE_CLOSED) from None
        except Exception as exc:
            if _usage_error(exc) or ctx.params.get("debug"):
                raise  # typer prints usage errors itself (exit code 2)
            if isinstance(exc, PlannerError):
                err_console.print(f"[bold red]error:[/] {escape(exc.message)}")
                for i, remedy in enumerate(exc.remedies, 1):
                    err_console.print(f"  {i}) {escape(remedy)}")
                raise typer.Exit(1) from None
            err_console.print(f"[bold red]internal error:[/] {type(exc).__name__}: "
                              f"{escape(str(exc).splitlines()[0] if str(exc) else '')}\n"
                              "This is a bug in planner; run again with --debug for the "
                              "traceback and report it.")
            raise typer.Exit(3) from None


def _usage_error(exc: Exception) -> bool:
    """A bad option, value or missing argument, as typer's click raises it (typer ships
    its own click, so the class is recognised by what it can do)."""
    return callable(getattr(exc, "show", None)) and isinstance(getattr(exc, "exit_code", None),
                                                               int)


app = typer.Typer(
    name="planner", cls=_Group, no_args_is_help=False, add_completion=True,
    pretty_exceptions_enable=False, rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Plan and launch distributed PyTorch training on heterogeneous GPU clusters.")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"planner {__version__}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def root(
    ctx: typer.Context,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks of errors.")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Plan and launch distributed PyTorch training on heterogeneous GPU clusters.

    Run `planner` alone at a terminal for a guided interactive session.
    """
    if ctx.invoked_subcommand is None:
        if sys.stdin.isatty():
            from cli.interactive import start

            start()
        else:
            typer.echo(ctx.get_help())


def _register() -> None:
    from cli import (
        compare_cmd,
        data_cmd,
        devices_cmd,
        explain_cmd,
        interactive,
        launch_cmd,
        profile_cmd,
        replan_cmd,
        schedule_cmd,
        solve_cmd,
        trace_cmd,
        tune_cmd,
    )

    for module in (trace_cmd, solve_cmd, devices_cmd, profile_cmd, explain_cmd, compare_cmd,
                   interactive, launch_cmd, replan_cmd, schedule_cmd, tune_cmd,
                   data_cmd):
        module.register(app)


_register()


def main() -> None:
    """Console entry point. Exits without interpreter teardown, which takes seconds
    after a big trace (millions of small objects) and does no useful work here."""
    try:
        app()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BrokenPipeError:  # the reader went away before the last buffered output
            code = code or PIPE_CLOSED
    os._exit(code)


if __name__ == "__main__":
    main()
