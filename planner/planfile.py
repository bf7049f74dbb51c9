"""Plan files: JSON with a schema version, validated on load (never pickle).

The file is the Plan dataclass as JSON (enums by value, tuples as lists); loading
validates every field with pydantic against the same dataclasses.
"""

from __future__ import annotations

import dataclasses
import json
from enum import Enum
from functools import lru_cache
from pathlib import Path
from typing import Any

import pydantic

from planner.errors import PlannerError
from planner.files import write_atomic
from planner.types import SCHEMA_VERSION, Plan


def to_jsonable(value: Any) -> Any:
    """Dataclasses, enums, tuples and mappings as plain JSON values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict) or hasattr(value, "items"):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return None
    return value


def plan_json(plan: Plan) -> str:
    return json.dumps({"kind": "plan", **to_jsonable(plan)}, indent=1) + "\n"


def write_plan(plan: Plan, path: Path, *, force: bool = False) -> None:
    write_atomic(path, plan_json(plan), force=force)


@lru_cache(maxsize=1)
def _adapter() -> pydantic.TypeAdapter:
    return pydantic.TypeAdapter(Plan)


def read_plan(path: Path) -> Plan:
    """A validated Plan; a clear error for a missing, corrupted or foreign file."""
    if not path.is_file():
        raise PlannerError("bad-plan", f"Plan file {str(path)!r} does not exist.",
                           ["check the path", "make one with `planner solve ... -o plan.json`"])
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PlannerError("bad-plan", f"{str(path)!r} is not a plan file: it is not JSON "
                           f"({exc}).", ["regenerate it with `planner solve`"]) from exc
    if not isinstance(data, dict) or data.get("kind") != "plan":
        raise PlannerError("bad-plan", f"{str(path)!r} is not a plan file (no \"kind\": "
                           "\"plan\"); it may be a profile, trace or cluster file.",
                           ["pass the file `planner solve -o` wrote"])
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise PlannerError("bad-plan", f"{str(path)!r} has schema_version {version!r}; this "
                           f"planner reads version {SCHEMA_VERSION}.",
                           ["regenerate the plan with this planner's `planner solve`"])
    data.pop("kind")
    try:
        plan = _adapter().validate_python(data)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise PlannerError("bad-plan", f"{str(path)!r} is not a valid plan: field {where}: "
                           f"{first['msg']} ({exc.error_count()} problem(s) in all).",
                           ["regenerate it with `planner solve`"]) from exc
    return check_plan(plan, str(path))


def check_plan(plan: Plan, source: str) -> Plan:
    """The plan if it is one the runtime can run as written (every layer placed once,
    shares summing to the global batch, each device used once, devices and types that
    match its cluster, a known dtype); else an error naming the first problem."""
    from planner.dtypes import canonical_dtype
    from planner.runtime.layout import rank_layout

    try:
        canonical_dtype(plan.training.dtype)
        rank_layout(plan)
    except PlannerError as exc:
        raise PlannerError("bad-plan", f"{source}: {exc.message}", exc.remedies) from None
    return plan
