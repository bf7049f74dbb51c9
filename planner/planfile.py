"""Plan files: JSON with a schema version, validated on load (never pickle).

The file is the Plan dataclass as JSON (enums by value, tuples as lists); loading
validates every field's type with pydantic against the same dataclasses, then
`check_plan` checks values (ranges, the model, the layout) as the runtime needs them.

A plan written by hand (`read_plan(path, written=True)`, for the commands that price a
plan as written: `planner estimate --plan`, `explain`) may leave out what pricing gives
(the prediction, each stage's memory and modules, the solver's report) and what follows
from the rest (`complete_written`); the caller prices it (`planner.price`).
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

from planner.errors import PlannerError, closest
from planner.files import write_atomic
from planner.types import (
    SCHEMA_VERSION,
    CostBreakdown,
    MemoryBreakdown,
    Plan,
    SolverReport,
    SyncAlgorithm,
)


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


def read_plan(path: Path, *, written: bool = False) -> Plan:
    """A validated Plan; a clear error for a missing, corrupted or foreign file.
    `written`: the plan may be one written by hand, its left-out fields completed
    (`complete_written`); its figures are then placeholders until it is priced."""
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
    if written:
        data = complete_written(data, path)
    elif "prediction" not in data:
        raise PlannerError("bad-plan", f"{str(path)!r} has no prediction: it is a plan written "
                           "by hand, which is priced before it is launched, compared or "
                           "edited.", [f"price it first: `planner estimate --plan {path} -o "
                                       "priced.json`, then use priced.json"])
    try:
        plan = _adapter().validate_json(json.dumps(data))
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"])
        why = ("the plan has no such field (misspelt?)" if first["type"] ==
               "unexpected_keyword_argument" else first["msg"])
        remedies = [f"correct it in {str(path)!r} (README.md: Price a plan)"] if written else [
            "regenerate it with `planner solve`"]
        if not written and first["type"] == "missing" and first["loc"][-1] in PRICED:
            why += ": a plan written by hand leaves out what pricing gives"
            remedies = [f"price it first: `planner estimate --plan {path} -o priced.json`"]
        raise PlannerError("bad-plan", f"{str(path)!r} is not a valid plan: field "
                           f"{where.lstrip('.')}: {why} ({exc.error_count()} problem(s) in all).",
                           remedies) from exc
    return check_plan(plan, str(path), written=written)


# What pricing gives a plan (`planner.price`): a plan written by hand leaves them out.
PRICED = ("prediction", "solver", "memory", "modules")
WRITTEN_REPORT = SolverReport(status="fixed", objective=0.0, best_bound=0.0, gap=0.0,
                              wall_time=0.0, lower_bound=0.0, explored=0, pruned=0,
                              search_space="written by hand")
UNPRICED = CostBreakdown(step_time=0.0, compute=0.0, bubble=0.0, tp_comm=0.0, pp_comm=0.0,
                         dp_comm=0.0, optimizer=0.0, samples_per_s=0.0, tokens_per_s=None,
                         mfu=0.0)
NO_MEMORY = MemoryBreakdown(weights=0.0, gradients=0.0, optimizer=0.0, activations=0.0,
                            reserve=0.0)


def complete_written(data: dict, path: Path) -> dict:
    """A plan's JSON as written by hand, completed: `cluster` may name a cluster file
    (beside the plan file or as `--cluster` takes it), a built-in example or an inline
    spec; `prediction`, `solver`, and each stage's `memory` and `modules` may be left out
    (placeholders until the plan is priced); pipelines and stages are numbered in file
    order; a pipeline needs two of `batch_share`, `micro_batch` and `num_microbatches`
    (the third follows) and runs 1F1B (interleaved 1F1B with `interleave` 2 or more); a
    stage needs `devices.node` and `layers` ([start, end)) or `chunks`: `tp` is its
    devices' count, its devices 0 .. tp-1 (tp 1 where neither is given), `device_type`
    its node's, recompute none and ZeRO 0 unless given. Other fields of the wrong type are
    left as they are, for the validation after to name (a stage's devices are checked
    here: its node gives its device type)."""
    out = {"solver": to_jsonable(WRITTEN_REPORT), "prediction": to_jsonable(UNPRICED), **data}
    if isinstance(out.get("cluster"), str):
        out["cluster"] = to_jsonable(_written_cluster(out["cluster"], path))
    cluster = out.get("cluster")
    nodes = {n.get("name"): n for n in cluster.get("nodes", [])
             if isinstance(n, dict)} if isinstance(cluster, dict) else {}
    if isinstance(out.get("pipelines"), list):
        out["pipelines"] = [_written_pipeline(p, i, nodes, path) if isinstance(p, dict) else p
                            for i, p in enumerate(out["pipelines"])]
    return out


def _written_cluster(text: str, path: Path) -> Any:
    """The cluster a hand-written plan names: a file beside the plan first."""
    from cost_models.cluster import load_cluster

    beside = path.parent / text
    try:
        return load_cluster(str(beside) if beside.is_file() else text)
    except PlannerError as exc:
        raise PlannerError("bad-plan", f"{str(path)!r}: field cluster: {exc.message}",
                           exc.remedies) from None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


_SIZES = ("batch_share", "micro_batch", "num_microbatches")  # share = size x count


def _written_pipeline(pipe: dict, index: int, nodes: dict, path: Path) -> dict:
    at = f"{str(path)!r}: pipelines[{index}]"
    out = {"index": index, **pipe}
    interleave = out.get("interleave", 1)
    out.setdefault("schedule", "interleaved-1f1b" if _is_count(interleave) and interleave > 1
                   else "1f1b")
    sizes = {name: out[name] for name in _SIZES if name in out}
    if len(sizes) < 2:
        raise PlannerError("bad-plan", f"{at} gives {' and '.join(sizes) or 'none of them'}"
                           ", but a pipeline needs two of batch_share, micro_batch and "
                           "num_microbatches (the third follows: share = size x count).",
                           [f"add {next(n for n in _SIZES if n not in sizes)} to it"])
    if len(sizes) == 2 and all(map(_is_count, sizes.values())):
        if "batch_share" not in sizes:
            out["batch_share"] = sizes["micro_batch"] * sizes["num_microbatches"]
        else:
            known, = (n for n in sizes if n != "batch_share")
            third, = (n for n in _SIZES if n not in sizes)
            if sizes["batch_share"] % sizes[known]:
                raise PlannerError("bad-plan", f"{at}.batch_share {sizes['batch_share']} is "
                                   f"not a multiple of its {known} {sizes[known]}, so its "
                                   f"{third} is not whole.",
                                   [f"give a batch_share that {sizes[known]} divides"])
            out[third] = sizes["batch_share"] // sizes[known]
    if isinstance(out.get("stages"), list):
        out["stages"] = [_written_stage(s, index, j, nodes, path) if isinstance(s, dict) else s
                         for j, s in enumerate(out["stages"])]
    return out


def _pair(value: Any) -> bool:
    return (isinstance(value, list) and len(value) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in value))


def _written_stage(stage: dict, pipe: int, index: int, nodes: dict, path: Path) -> dict:
    at = f"pipelines[{pipe}].stages[{index}]"
    out = {"index": index, "recompute": "none", "zero": 0, "modules": [],
           "memory": to_jsonable(NO_MEMORY), **stage}
    chunks, layers = out.get("chunks"), out.get("layers")
    if "chunks" not in out and _pair(layers):
        out["chunks"] = [layers]
    if "layers" not in out and isinstance(chunks, list) and chunks and all(map(_pair, chunks)):
        out["layers"] = [min(a for a, _ in chunks), max(b for _, b in chunks)]
    if "layers" not in out and "chunks" not in out:
        raise PlannerError("bad-plan", f"{str(path)!r}: {at} gives neither layers nor chunks: "
                           "the stage holds no layers.",
                           [f"give {at}.layers as [start, end), e.g. [0, 4] for layers 0-3 "
                            "(`planner trace MODEL` lists the model's layers)"])
    devices = out.get("devices")
    if not isinstance(devices, dict) or "node" not in devices:
        raise PlannerError("bad-plan", f"{str(path)!r}: {at}.devices is "
                           f"{json.dumps(devices) if 'devices' in out else 'missing'}; a stage "
                           "runs on {\"node\": NAME}, a node of the plan's cluster, and "
                           "optionally its \"devices\": [indices] (0 .. tp-1 if not given).",
                           [f"give {at}.devices, e.g. {{\"node\": "
                            f"{json.dumps(next(iter(nodes), 'NODE'))}}}"])
    devices = {**devices}
    tp = out.get("tp")
    if "devices" not in devices:
        devices["devices"] = list(range(tp if _is_count(tp) else 1))
    if "tp" not in out and isinstance(devices["devices"], list):
        out["tp"] = len(devices["devices"])
    out["devices"] = devices
    node = devices["node"]
    if "device_type" not in out:
        if not isinstance(node, str) or node not in nodes:
            near = closest(str(node), [str(n) for n in nodes])
            hint = f" Did you mean {', '.join(repr(n) for n in near)}?" if near else ""
            raise PlannerError("bad-plan", f"{str(path)!r}: {at}.devices.node {node!r} is not "
                               f"a node of the plan's cluster.{hint}",
                               [f"use one of its nodes: {', '.join(map(str, nodes))}"])
        device = nodes[node].get("device")
        if isinstance(device, dict) and isinstance(device.get("name"), str):
            out["device_type"] = device["name"]
    return out


def check_plan(plan: Plan, source: str, *, written: bool = False) -> Plan:
    """The plan if it is one the runtime can run as written (counts in range, a model
    the zoo builds, every layer placed once, shares summing to the global batch, each
    device used once, devices and types that match its cluster, a known dtype); else an
    error naming the source and the first problem. `written`: a plan written by hand,
    which the error says to correct rather than to regenerate."""
    from planner.dtypes import canonical_dtype
    from planner.runtime.layout import rank_layout
    from planner.sync import check_sync

    try:
        _check_fields(plan)
        check_sync(plan)
        _check_numbers(plan)
        _check_model(plan)
        canonical_dtype(plan.training.dtype)
        rank_layout(plan)
    except PlannerError as exc:
        remedies = ([*(r for r in exc.remedies if not r.startswith("regenerate")),
                     f"correct it in {source} (README.md: Price a plan)"] if written
                    else exc.remedies)
        raise PlannerError("bad-plan", f"{source}: {exc.message}", remedies) from None
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
    other than 0-3 (or with a hierarchical gradient sync), an index out of order, a
    stage's layer span that is not its chunks', a cluster, node or device name or a host
    with a line break (cluster files refuse those too)."""
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
    if plan.constraints is not None:  # (what a re-plan gives the solver)
        given = plan.constraints
        counts += [(f"constraints.{name}", getattr(given, name)) for name in (
            "tp", "max_tp", "pp", "dp", "max_dp", "micro_batch", "max_stages", "interleave",
            "max_interleave") if getattr(given, name) is not None]
        if any(stage not in (0, 1, 2, 3) for stage in given.zero or ()):
            raise bad(f"constraints.zero must list ZeRO stages 0-3 (got {list(given.zero)}).")
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
            if s.zero and s.grad_sync is SyncAlgorithm.HIERARCHICAL:
                raise bad(f"{at}.grad_sync is hierarchical with zero {s.zero}: FSDP sums a "
                          "ZeRO stage's gradients with its own reductions, so the runtime "
                          "would not run it; make it \"ring\" or the stage's zero 0.")
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
