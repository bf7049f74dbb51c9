"""Wall time and peak memory of `planner trace` on the largest models.

    python benchmarks/trace.py            # writes the "trace" section of RESULTS.md

Each model is traced by the real CLI in a fresh process (torch's import
included, as a user sees it), three times; the table shows the median wall
time and the largest peak RSS. Targets: under 10 s and under 1 GiB each.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import write_section

CASES = [("llama3-70b", 4096), ("gpt3-175b", 2048), ("llama3-405b", 4096)]
REPEATS = 3
PLANNER = [sys.executable, "-m", "cli.main"]


def run_once(model: str, seq_len: int) -> tuple[float, float, dict]:
    """Wall seconds, peak RSS (GiB) and the JSON output of one traced process."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen([*PLANNER, "trace", model, "--seq-len", str(seq_len), "--json"],
                                stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode:
            raise SystemExit(f"planner trace {model} failed:\n{err.read()}")
        return wall, usage.ru_maxrss / 2**20, json.loads(out.read())


def main() -> None:
    rows = []
    for model, seq_len in CASES:
        walls, rsses = [], []
        for _ in range(REPEATS):
            wall, rss, data = run_once(model, seq_len)
            walls.append(wall)
            rsses.append(rss)
        rss = max(rsses)
        wall = statistics.median(walls)
        ok = wall < 10 and rss < 1.0
        rows.append(f"| {model} | {seq_len} | {data['params'] / 1e9:.1f}B | {data['blocks']} | "
                    f"{data['tracer']} | {wall:.1f} s | {data['trace_seconds']:.1f} s | "
                    f"{rss:.2f} GiB | {'yes' if ok else 'NO'} |")
        print(rows[-1], flush=True)
    body = ("| model | seq | params | blocks | tracer | wall (median of 3) | of which tracing "
            "| peak RSS | under 10 s and 1 GiB |\n|---|---|---|---|---|---|---|---|---|\n"
            + "\n".join(rows) +
            "\n\nWall time is the whole `planner trace MODEL --seq-len S --json` process, "
            "torch's import included; \"of which tracing\" is the time inside the trace "
            "(build on meta, fx trace, replay, layers).")
    write_section("trace", "python benchmarks/trace.py", body)


if __name__ == "__main__":
    main()
