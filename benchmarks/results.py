"""Write one benchmark's section of benchmarks/RESULTS.md, leaving the others alone."""

from __future__ import annotations

import platform
import re
import subprocess
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")
HEADER = "# Benchmark results\n\nEach section is rewritten by the script named in it.\n"


def machine() -> str:
    cpus = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    return f"{platform.machine()}, {cpus} cores, Python {platform.python_version()}"


def write_section(name: str, command: str, body: str) -> None:
    """Replace (or add) the section `name` with `body` and how it was produced."""
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = (f"<!-- {name}:start -->\n## {name}\n\nCommand: `{command}`  \n"
               f"Run: {stamp} on {machine()}\n\n{body.strip()}\n<!-- {name}:end -->\n")
    text = RESULTS.read_text() if RESULTS.exists() else HEADER
    pattern = re.compile(rf"<!-- {re.escape(name)}:start -->.*?<!-- {re.escape(name)}:end -->\n",
                         re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else (
        text.rstrip("\n") + "\n\n" + section)
    RESULTS.write_text(text)


def table(columns: list[str], rows: list[str]) -> str:
    """A markdown table of `rows` (each already "| a | b |") under these columns."""
    return ("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
            + "\n".join(rows) + "\n")
