"""Plan files: JSON with a schema version, validated on load (never pickle).

The file is the Plan dataclass as JSON (enums by value, tuples as lists); loading
validates every field's type with pydantic against the same dataclasses, then
`check_plan` checks values (ranges, the model, the layout) as the runtime needs them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
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
    """Plan's validator, strict: a field the plan does not have (a misspelt one would be
    silently dropped) is an error, as is a value of another JSON type (\"64\" or true
    for a count)."""
    for cls in _dataclasses(Plan):
        cls.__pydantic_config__ = pydantic.ConfigDict(extra="forbid", strict=True)
    return pydantic.TypeAdapter(Plan)


def _dataclasses(cls: type, seen: set | None = None) -> set:
    """The dataclasses a dataclass's fields hold, itself included, at any depth."""
    seen = set() if seen is None else seen
    if dataclasses.is_dataclass(cls) and cls not in seen:
        seen.add(cls)
        for hint in typing.get_type_hints(cls).values():
            for inner in [hint, *_nested(hint)]:
                _dataclasses(inner, seen)
    return seen


def _nested(hint: Any) -> list:
    """The types inside a hint (tuple[X, ...], X | None, dict[str, X]), at any depth."""
    out = []
    for arg in typing.get_args(hint):
        out += [arg, *_nested(arg)]
    return out


def read_plan(path: Path) -> Plan:
    """A validated Plan; a clear error for a missing, corrupted or foreign file."""
    if path.is_dir():
        raise PlannerError("bad-plan", f"{str(path)!r} is a folder, not a plan file.",
                           ["give the plan file in it, e.g. "
                            f"{str(path / 'plan.json')!r}"])
    if not path.is_file():
        raise PlannerError("bad-plan", f"Plan file {str(path)!r} does not exist.",
                           ["check the path", "make one with `planner solve ... -o plan.json`"])
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PlannerError("bad-plan", f"{str(path)!r} is not a plan file: it is not JSON "
                           f"({exc}).", ["regenerate it with `planner solve`"]) from exc
    except RecursionError:
        raise PlannerError("bad-plan", f"{str(path)!r} is not a plan file: its JSON nests "
                           "deeper than any plan does.",
                           ["regenerate it with `planner solve`"]) from None
    if not isinstance(data, dict) or data.get("kind") != "plan":
        raise PlannerError("bad-plan", f"{str(path)!r} is not a plan file (no \"kind\": "
                           "\"plan\"); it may be a profile, trace or cluster file.",
                           ["pass the file `planner solve -o` wrote"])
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        given = (f"{version!r}, a {type(version).__name__}" if not isinstance(version, int)
                 or isinstance(version, bool) else repr(version))
        raise PlannerError("bad-plan", f"{str(path)!r} has schema_version {given}; this "
                           f"planner reads version {SCHEMA_VERSION} (a number).",
                           ["regenerate the plan with this planner's `planner solve`"])
    data.pop("kind")
    try:
        plan = _adapter().validate_json(json.dumps(data))
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"])
        why = ("the plan has no such field (misspelt?)" if first["type"] ==
               "unexpected_keyword_argument" else first["msg"])
        raise PlannerError("bad-plan", f"{str(path)!r} is not a valid plan: field "
                           f"{where.lstrip('.')}: {why} ({exc.error_count()} problem(s) in all).",
                           ["regenerate it with `planner solve`"]) from exc
    return check_plan(plan, str(path))


def check_plan(plan: Plan, source: str) -> Plan:
    """The plan if it is one the runtime can run as written (counts in range, a model
    the zoo builds, every layer placed once, shares summing to the global batch, each
    device used once, devices and types that match its cluster, a known dtype); else an
    error naming the source and the first problem."""
    from planner.dtypes import canonical_dtype
    from planner.runtime.layout import rank_layout

    try:
        _check_fields(plan)
        _check_numbers(plan)
        _check_model(plan)
        canonical_dtype(plan.training.dtype)
        rank_layout(plan)
    except PlannerError as exc:
        raise PlannerError("bad-plan", f"{source}: {exc.message}", exc.remedies) from None
    return plan


_REGENERATE = "regenerate the plan with `planner solve`"
OPTIMIZERS = ("adam", "adamw", "sgd")  # (the runtime runs AdamW for the first two)
STATUSES = ("optimal", "feasible", "interrupted", "fixed")  # (`SolverReport.status`)
_POSITIVE = ("bandwidth", "memory", "memory_bandwidth")  # cluster fields above zero


def _numbers(value: Any, path: str):
    """(path, number) for every float inside a plan's dataclasses, mappings and tuples."""
    if isinstance(value, float):
        yield path, value
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from _numbers(getattr(value, f.name), f"{path}.{f.name}".lstrip("."))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, f"{path}.{key}")
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _numbers(item, f"{path}[{i}]")


def _check_numbers(plan: Plan) -> None:
    """An error naming the first number out of range: NaN anywhere; in the cluster, the
    predictions, the stages' memory and the optimizer's bytes, a negative or infinite
    value; in the cluster, a bandwidth, memory size or compute rate that is not positive
    (explain, compare and launch divide by them), and gradients of no bytes."""
    for path, value in _numbers(plan, ""):
        if math.isnan(value):
            raise PlannerError("bad-plan", f"{path} is not a number (NaN).", [_REGENERATE])
        priced = (path.startswith(("cluster.", "prediction.", "baselines",
                                   "training.optimizer."))
                  or ".memory." in path)
        if priced and (math.isinf(value) or value < -1e-9):
            raise PlannerError("bad-plan", f"{path} must be a finite number of at least 0 "
                               f"(got {value}).", [_REGENERATE])
        last = path.rsplit(".", 1)[-1]
        if path == "training.optimizer.grad_bytes" and value <= 0:
            raise PlannerError("bad-plan", f"{path} must be positive (got {value}): the bytes "
                               "of each parameter's gradient.", [_REGENERATE])
        if path.startswith("cluster.") and value <= 0 and (
                last in _POSITIVE or ".peak_flops." in path):
            raise PlannerError("bad-plan", f"{path} must be positive (got {value}).",
                               [_REGENERATE])


def _check_fields(plan: Plan) -> None:
    """An error naming the first field out of range: a count below 1, a ZeRO stage
    other than 0-3, an index out of order, a stage's layer span that is not its chunks',
    a cluster, node or device name or a host with a line break (cluster files refuse
    those too)."""
    def bad(message: str) -> PlannerError:
        return PlannerError("bad-plan", message, [_REGENERATE])

    if not plan.pipelines:
        raise bad("pipelines is empty: the plan has no pipelines to run.")
    counts = [("training.global_batch", plan.training.global_batch)]
    if plan.training.seq_len is not None:
        counts.append(("training.seq_len", plan.training.seq_len))
    for i, p in enumerate(plan.pipelines):
        counts += [(f"pipelines[{i}].{name}", getattr(p, name))
                   for name in ("batch_share", "micro_batch", "num_microbatches", "interleave")]
        counts += [(f"pipelines[{i}].stages[{j}].tp", s.tp) for j, s in enumerate(p.stages)]
    for field, value in counts:
        if value < 1:
            raise bad(f"{field} must be positive (got {value}).")
    if plan.solver.status not in STATUSES:
        raise bad(f"solver.status {plan.solver.status!r} is not one of {', '.join(STATUSES)}.")
    if plan.training.optimizer.name not in OPTIMIZERS:
        raise bad(f"training.optimizer.name {plan.training.optimizer.name!r} is not one of "
                  f"{', '.join(OPTIMIZERS)} (the optimizers the runtime runs).")
    if not plan.cluster.nodes:
        raise bad("cluster.nodes is empty: the plan's cluster has no nodes to run on.")
    names = [("cluster.name", plan.cluster.name)]
    groups = {g.name for g in plan.cluster.groups}
    first: dict[str, int] = {}
    for i, n in enumerate(plan.cluster.nodes):
        if n.devices < 1:
            raise bad(f"cluster.nodes[{i}].devices is {n.devices}: node {n.name} has no "
                      "devices (a node needs at least one).")
        if first.setdefault(n.name, i) != i:
            raise bad(f"cluster.nodes[{i}].name {n.name!r} is also cluster.nodes"
                      f"[{first[n.name]}].name; every node needs a name of its own.")
        unknown = [g for g in n.groups if g not in groups]
        if unknown:
            raise bad(f"cluster.nodes[{i}].groups names {unknown[0]!r}, which is none of "
                      "cluster.groups (a node's groups set the links it shares).")
        if "fp32" not in n.device.peak_flops:
            raise bad(f"cluster.nodes[{i}].device.peak_flops has no fp32 rate (got "
                      f"{sorted(n.device.peak_flops)}): every device needs one.")
        names += [(f"cluster.nodes[{i}].name", n.name), (f"cluster.nodes[{i}].host", n.host),
                  (f"cluster.nodes[{i}].device.name", n.device.name)]
    for field, text in names:
        if text is not None and not text.isprintable():  # they go into launch scripts
            raise PlannerError("bad-plan", f"{field} {text!r} has a line break or another "
                               "control character; names and hosts must be one line of "
                               "printable text.", ["write it on one line", _REGENERATE])
    for i, p in enumerate(plan.pipelines):
        if p.index != i:
            raise bad(f"pipelines[{i}].index is {p.index}; pipelines are numbered 0, 1, ... "
                      "in file order.")
        if not p.stages:
            raise bad(f"pipelines[{i}].stages is empty: pipeline {i} has no stages.")
        for j, s in enumerate(p.stages):
            at = f"pipelines[{i}].stages[{j}]"
            if s.index != j:
                raise bad(f"{at}.index is {s.index}; stages are numbered 0, 1, ... in file "
                          "order.")
            if s.zero not in (0, 1, 2, 3):
                raise bad(f"{at}.zero must be 0, 1, 2 or 3 (got {s.zero}).")
            if not s.chunks:
                raise bad(f"{at}.chunks is empty: the stage holds no layers.")
            span = (min(a for a, _ in s.chunks), max(b for _, b in s.chunks))
            if tuple(s.layers) != span:
                raise bad(f"{at}.layers is {list(s.layers)}, but its chunks span layers "
                          f"{list(span)}.")


def _check_model(plan: Plan) -> None:
    """An error naming the model field at fault when a zoo model, its overrides or the
    sequence length is not one the zoo builds (factory and transformers models are
    checked where they are built)."""
    from planner.models.zoo import configure

    if plan.model.source not in ("zoo", "factory", "hf"):
        raise PlannerError("bad-plan", f"model.source must be zoo, factory or hf (got "
                           f"{plan.model.source!r}).", [_REGENERATE])
    if plan.model.source != "zoo":
        return
    try:
        configure(plan.model.name, plan.model.overrides, plan.training.seq_len)
    except PlannerError as exc:
        field = {"unknown-model": "model.name", "bad-override": "model.overrides",
                 "bad-option": "training.seq_len"}.get(exc.kind, "model.overrides or "
                                                       "training.seq_len")
        remedies = exc.remedies if exc.kind == "unknown-model" else ()
        raise PlannerError("bad-plan", f"{field}: {exc.message}",
                           [*remedies, _REGENERATE]) from None
