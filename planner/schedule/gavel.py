"""Gavel's published formats (Narayanan et al., OSDI 2020; github.com/stanford-futuredata/
gavel, MIT license): its measured throughput matrix and its job traces, read so the
scheduler can be evaluated on published measurements.

Matrix (JSON): {worker type: {"(job type, scale factor)": {"null": steps/s alone,
"(other job type, scale factor)": [this job's steps/s, the other's] when both share the
devices}}}; a worker type `<type>_unconsolidated` holds the figures of a job whose
devices are spread over servers. Traces, one job per tab-separated line, in two layouts:
seven fields (the Philly-derived `msr` traces: job type, command, steps flag, needs a
data folder, steps, arrival time, scale factor; as Gavel's `parse_trace` of that time
reads them) or ten (job type, command, working folder, steps flag, needs a data folder,
steps, scale factor, priority weight, SLO, arrival time); a scale factor of 0 marks a job
Gavel skips, and so do we.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.errors import PlannerError
from planner.schedule.jobs import Job

SPREAD_SUFFIX = "_unconsolidated"


@dataclass(frozen=True, kw_only=True)
class Matrix:
    """Measured steps/s. `alone[(worker type, job type, devices, spread)]`: the job by
    itself, spread or not over servers; `together[(worker type, job type, other job
    type, devices)]`: (this job's, the other's) steps/s when both share the devices."""

    alone: Mapping[tuple[str, str, int, bool], float]
    together: Mapping[tuple[str, str, str, int], tuple[float, float]]
    worker_types: tuple[str, ...]
    source: str

    def job_types(self) -> list[str]:
        return sorted({job for _, job, _, _ in self.alone})


def read_matrix(path: Path) -> Matrix:
    """The matrix in Gavel's JSON format at `path` (see the module docstring)."""
    if not path.is_file():
        raise PlannerError("bad-throughputs", f"Throughput matrix {str(path)!r} does not "
                           "exist.", ["check the path (a file in Gavel's format, e.g. "
                                      "simulation_throughputs.json)"])
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PlannerError("bad-throughputs", f"{str(path)!r} is not a throughput matrix: "
                           f"it is not JSON ({exc}).") from None
    return parse_matrix(data, str(path))


def parse_matrix(data: Any, source: str) -> Matrix:
    if not isinstance(data, dict) or not data:
        raise PlannerError("bad-throughputs", f"{source}: a throughput matrix maps worker "
                           "types to job types (Gavel's format).")
    alone: dict[tuple[str, str, int, bool], float] = {}
    together: dict[tuple[str, str, str, int], tuple[float, float]] = {}
    for worker, rows in data.items():
        spread = worker.endswith(SPREAD_SUFFIX)
        base = worker.removesuffix(SPREAD_SUFFIX)
        if not isinstance(rows, dict):
            raise PlannerError("bad-throughputs", f"{source}, worker type {worker!r}: "
                               "expected a mapping of job types.")
        for key, figures in rows.items():
            job, devices = _job_key(key, source, worker)
            where = f"{source}, {worker} / {key}"
            if not isinstance(figures, dict) or "null" not in figures:
                raise PlannerError("bad-throughputs", f"{where}: expected a mapping with "
                                   "\"null\" (the steps/s alone).")
            alone[(base, job, devices, spread)] = _rate(figures["null"], where)
            if spread:
                continue
            for other_key, pair in figures.items():
                if other_key == "null":
                    continue
                other, other_devices = _job_key(other_key, source, worker)
                if (not isinstance(pair, list) or len(pair) != 2
                        or other_devices != devices):
                    continue  # (pairs of different sizes are never co-located)
                rates = (_rate(pair[0], where), _rate(pair[1], where))
                if min(rates) > 0:  # (0: not measured)
                    together[(base, job, other, devices)] = rates
    workers = tuple(sorted({worker for worker, _, _, _ in alone}))
    return Matrix(alone=alone, together=together, worker_types=workers, source=source)


def _job_key(key: str, source: str, worker: str) -> tuple[str, int]:
    try:
        job, devices = ast.literal_eval(key)
    except (ValueError, SyntaxError, TypeError):
        job, devices = None, None
    if not isinstance(job, str) or not isinstance(devices, int) or devices < 1:
        raise PlannerError("bad-throughputs", f"{source}, worker type {worker!r}: key {key!r} "
                           "is not \"('job type', scale factor)\".")
    return job, devices


def _rate(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise PlannerError("bad-throughputs", f"{where}: {value!r} is not a throughput "
                           "(steps/s, 0 or more).")
    return float(value)


def read_trace(path: Path) -> tuple[Job, ...]:
    """The jobs of a Gavel trace (see the module docstring), named by their line."""
    if not path.is_file():
        raise PlannerError("bad-trace", f"Trace {str(path)!r} does not exist.",
                           ["check the path"])
    jobs = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        where = f"{path} line {number}"
        if len(fields) == 7:
            job_type, steps, arrival, devices = fields[0], fields[4], fields[5], fields[6]
            weight = "1"
        elif len(fields) == 10:
            job_type, steps, devices, weight, arrival = (fields[0], fields[5], fields[6],
                                                         fields[7], fields[9])
        else:
            raise PlannerError("bad-trace", f"{where}: {len(fields)} tab-separated fields; "
                               "Gavel's traces have 7 or 10.")
        try:
            scale, total, when, priority = int(devices), int(steps), float(arrival), float(weight)
        except ValueError:
            raise PlannerError("bad-trace", f"{where}: the scale factor, steps, arrival time "
                               "or priority is not a number.") from None
        if scale == 0:
            continue
        if scale < 0 or total < 1 or when < 0 or priority <= 0:
            raise PlannerError("bad-trace", f"{where}: a negative or zero scale factor, "
                               "steps, arrival time or priority.")
        jobs.append(Job(name=f"job-{number}", profile=job_type, steps=total, arrival=when,
                        weight=priority, min_devices=scale, max_devices=scale))
    return tuple(jobs)
