"""The jobs file `planner schedule` reads: the training jobs that share one cluster.

    schema_version: 1
    throughputs: gavel.json        # optional: a measured matrix (Gavel's format), for
                                   #   jobs given by `profile`; relative to this file
    resources:                     # optional: host CPU cores and memory per node; a node's
      default: {cpus: 64, memory: 512GiB}   # name, then its device type, then `default`
      V100-32G: {cpus: 48}         #   (without any, CPU and memory are not limited)
    jobs:
      - name: llama-ft
        model: llama3-8b           # priced by the planner on every allocation it may get
        global_batch: 256
        seq_len: 4096
        steps: 2000                # or samples: 512000 (a whole number of global batches)
        weight: 2                  # a share twice as large in fairness policies
        arrival: 30min             # seconds (or "90s", "30min") from now; default 0
        deadline: 600min           # optional: finish by then (same clock as arrival)
        min_devices: 8             # never runs on fewer
        max_devices: 16            # default: min_devices
        cpus: 16                   # host cores the job needs in all, spread over its nodes
        memory: 256GiB             # host memory in all
      - name: resnet
        profile: "ResNet-50 (batch size 64)"   # a row of the throughput matrix
        steps: 100000
        min_devices: 4

Every error names the file, the line, the job and the field at fault.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic

from planner.errors import PlannerError, closest

SCHEMA_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class Job:
    """One training job. `profile` names its row of a measured throughput matrix; else
    `model` (with `global_batch`, `seq_len`) is priced by the planner. Times are seconds
    on the schedule's clock (0: now), sizes bytes."""

    name: str
    steps: int
    profile: str | None = None
    model: str | None = None
    global_batch: int | None = None
    seq_len: int | None = None
    weight: float = 1.0
    arrival: float = 0.0
    deadline: float | None = None
    min_devices: int = 1
    max_devices: int = 1
    cpus: float = 0.0
    memory: float = 0.0

    @property
    def workload(self) -> str:
        """What the job trains, as people read it."""
        if self.profile is not None:
            return self.profile
        return f"{self.model}, batch {self.global_batch}" + (
            f", sequence {self.seq_len}" if self.seq_len else "")


@dataclass(frozen=True, kw_only=True)
class HostResources:
    """Host CPU cores and memory of one node (infinite: not limited)."""

    cpus: float = math.inf
    memory: float = math.inf


@dataclass(frozen=True, kw_only=True)
class JobsFile:
    jobs: tuple[Job, ...]
    resources: Mapping[str, HostResources]  # by node name, device type or "default"
    throughputs: Path | None = None  # a Gavel-format matrix, resolved against the file


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", strict=True)


class _JobEntry(_Strict):
    name: str
    profile: str | None = None
    model: str | None = None
    global_batch: pydantic.PositiveInt | None = None
    seq_len: pydantic.PositiveInt | None = None
    steps: pydantic.PositiveInt | None = None
    samples: pydantic.PositiveInt | None = None
    weight: pydantic.PositiveFloat = 1.0
    arrival: float | str = 0.0
    deadline: float | str | None = None
    min_devices: pydantic.PositiveInt = 1
    max_devices: pydantic.PositiveInt | None = None
    cpus: pydantic.NonNegativeFloat = 0.0
    memory: float | str = 0.0


class _ResourcesEntry(_Strict):
    cpus: pydantic.PositiveFloat | None = None
    memory: float | str | None = None


class _File(_Strict):
    schema_version: int = SCHEMA_VERSION
    throughputs: str | None = None
    resources: dict[str, Any] = {}
    jobs: list[Any]


def read_jobs(path: Path) -> JobsFile:
    """The jobs file at `path`, validated (see the module docstring)."""
    from cost_models.yamlfile import read_yaml

    return parse_jobs(read_yaml(path), str(path), base=path.parent)


def parse_jobs(data: Any, source: str, *, base: Path = Path(".")) -> JobsFile:
    """A validated JobsFile from parsed YAML (`base`: where relative paths start)."""
    if not isinstance(data, dict):
        raise PlannerError("bad-jobs", f"{source}: a jobs file is a mapping with a `jobs` list "
                           f"(got {type(data).__name__}).", ["see `planner schedule --help`"])
    top = _validated(_File, data, source, "")
    if top.schema_version != SCHEMA_VERSION:
        raise PlannerError("bad-jobs", f"{_where(source, data, 'schema_version')}: "
                           f"schema_version {top.schema_version} is not supported (this "
                           f"planner reads version {SCHEMA_VERSION}).")
    if not top.jobs:
        raise PlannerError("bad-jobs", f"{_where(source, data, 'jobs')}: the jobs list is "
                           "empty.", ["add at least one job"])
    items = data["jobs"]  # (as loaded: they know their lines)
    jobs = tuple(_job(item, i, source) for i, item in enumerate(items))
    seen: dict[str, int] = {}
    for i, job in enumerate(jobs):
        if job.name in seen:
            raise PlannerError("bad-jobs", f"{_where(source, items[i], 'name', f'jobs[{i}]')}"
                               f": job name {job.name!r} is also the name of jobs[{seen[job.name]}]"
                               ".", ["give every job its own name"])
        seen[job.name] = i
    resources = {str(key): _resources(value, str(key), source)
                 for key, value in data.get("resources", {}).items()}
    matrix = base / top.throughputs if top.throughputs else None
    return JobsFile(jobs=jobs, resources=resources, throughputs=matrix)


def _job(item: Any, index: int, source: str) -> Job:
    path = f"jobs[{index}]"
    if not isinstance(item, dict):
        raise PlannerError("bad-jobs", f"{source}, {path}: a job is a mapping of fields "
                           f"(got {item!r}).", ["see the example in `planner schedule --help`"])
    label = f"{path} ({item['name']})" if isinstance(item.get("name"), str) else path
    entry = _validated(_JobEntry, item, source, label)

    def fail(field: str, message: str, remedies: tuple[str, ...] = ()) -> PlannerError:
        return PlannerError("bad-jobs", f"{_where(source, item, field, label)}: {message}",
                            remedies)

    if (entry.profile is None) == (entry.model is None):
        raise fail("profile" if entry.profile else "name", (
            "the job gives both `profile` (a row of the throughput matrix) and `model` "
            "(priced by the planner); give one." if entry.profile else
            "the job gives neither `profile` (a row of the throughput matrix) nor `model` "
            "(priced by the planner); give one."))
    if entry.model is not None and entry.global_batch is None:
        raise fail("model", "a job given by `model` needs `global_batch` (samples per step).")
    if (entry.steps is None) == (entry.samples is None):
        raise fail("steps" if entry.steps else "name", "the job gives " + (
            "both `steps` and `samples` to train" if entry.steps else
            "neither `steps` nor `samples` to train") + "; give one.")
    steps = entry.steps
    if entry.samples is not None:
        if entry.global_batch is None:
            raise fail("samples", "`samples` needs `global_batch` to count steps.",
                       ("give `steps` instead",))
        steps = math.ceil(entry.samples / entry.global_batch)
    low = entry.min_devices
    high = entry.max_devices if entry.max_devices is not None else low
    if high < low:
        raise fail("max_devices", f"max_devices {high} is below min_devices {low}.")
    arrival = _unit(fail, "arrival", entry.arrival, "duration")
    deadline = (None if entry.deadline is None
                else _unit(fail, "deadline", entry.deadline, "duration"))
    if deadline is not None and deadline <= arrival:
        raise fail("deadline", f"the deadline ({deadline:g} s) is not after the arrival "
                   f"({arrival:g} s); both count from now.")
    return Job(name=entry.name, steps=int(steps or 0), profile=entry.profile,
               model=entry.model, global_batch=entry.global_batch, seq_len=entry.seq_len,
               weight=float(entry.weight), arrival=arrival, deadline=deadline,
               min_devices=low, max_devices=high, cpus=float(entry.cpus),
               memory=_unit(fail, "memory", entry.memory, "bytes"))


def _resources(item: Any, key: str, source: str) -> HostResources:
    label = f"resources.{key}"
    if not isinstance(item, dict):
        raise PlannerError("bad-jobs", f"{source}, {label}: host resources are a mapping "
                           f"like {{cpus: 64, memory: 512GiB}} (got {item!r}).")
    entry = _validated(_ResourcesEntry, item, source, label)

    def fail(field: str, message: str) -> PlannerError:
        return PlannerError("bad-jobs", f"{_where(source, item, field, label)}: {message}")

    memory = math.inf if entry.memory is None else _unit(fail, "memory", entry.memory,
                                                           "bytes")
    if memory <= 0:
        raise fail("memory", f"must be more than 0 (got {entry.memory!r}).")
    return HostResources(cpus=entry.cpus if entry.cpus is not None else math.inf,
                         memory=memory)


def _unit(fail: Any, field: str, value: float | int | str, kind: str) -> float:
    """A duration (seconds) or size (bytes) in human units, never negative."""
    from planner.units import parse_bytes, parse_duration

    what, examples = (("a duration", "seconds (3600) or a number with s or min ('90s', "
                       "'30min')") if kind == "duration" else
                      ("a size", "bytes (1e9) or '64GiB', '512GB'"))
    try:
        parsed = parse_duration(value) if kind == "duration" else parse_bytes(value)
    except PlannerError:
        raise fail(field, f"{value!r} is not {what}: write {examples}.") from None
    if parsed < 0:
        raise fail(field, f"must not be negative (got {value!r}).")
    return parsed


def _validated(model: type[_Strict], item: dict, source: str, label: str) -> Any:
    """`item` checked against `model`; the first problem as a PlannerError."""
    try:
        return model.model_validate(item)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        key = str(first["loc"][0]) if first["loc"] else None
        why = ("is not a field here (misspelt?)" if first["type"] == "extra_forbidden"
               else "is missing" if first["type"] == "missing"
               else first["msg"].replace("Input should be", "should be")
               + f" (got {first.get('input')!r})")
        where = _where(source, item, key, label)
        raise PlannerError("bad-jobs", f"{where}: {why}.",
                           _remedies(first, key, list(model.model_fields))) from None


def _remedies(error: Any, key: str | None, fields: list[str]) -> list[str]:
    """What to change for one pydantic error (`_validated`): a misspelt field gets the
    names closest to it and the list of fields; a missing one its line to add; a bad
    value what the field takes (see `planner schedule --help`)."""
    listing = f"the fields here are: {', '.join(fields)}"
    if key is None:
        return [listing]
    if error["type"] == "extra_forbidden":
        near = closest(key, fields)
        return ([f"did you mean {' or '.join(near)}?"] if near else []) + [listing]
    if error["type"] == "missing":
        return [f"add `{key}: ...` to it ({listing})"]
    takes = error["msg"].replace("Input should be ", "")
    if takes.startswith(("greater", "less")):
        takes = f"a number {takes}"
    return [f"write {key} as {takes} (`planner schedule --help` shows a jobs file)"]


def _where(source: str, item: Any, key: str | None, label: str = "") -> str:
    """'jobs.yaml line 12, jobs[2] (bert).steps' from the YAML loader's line numbers."""
    line = getattr(item, "lines", {}).get(key) if key else None
    line = line or getattr(item, "line", None)
    at = f" line {line}" if line else ""
    field = ".".join(p for p in (label, key) if p)
    return f"{source}{at}, {field}" if field else f"{source}{at}"
