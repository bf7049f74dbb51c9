"""Per-layer profiles measured by other tools, as this planner's measurements.

    imported = read_profile("metis", paths, graph)    # ImportedProfile
    cluster = attach(cluster, "A100-80G-SXM", imported.measured)

Formats (`metis.py`, `amp.py`, `plain_csv.py`):
  metis  Metis's and Sailor's per-layer profile: one JSON file per device type,
         tensor-parallel degree and micro-batch size (`DeviceType.A100_tp2_bs4.json`),
         each with every layer's forward-plus-backward milliseconds, its memory in
         MiB and the optimizer step's milliseconds;
  amp    AMP's profile arrays: one array of per-layer forward seconds at micro-batch 1
         per model-parallel degree (`gpt2_G4_2.npy`), in its DeepSpeed pipeline's
         layer order;
  csv    a plain table: layer (index or name as `planner trace` lists them),
         micro_batch, tp, fwd_ms and bwd_ms (or fwd_bwd_ms), optionally memory_mb
         and tp_comm.

Mapping to this project's layers (`entries_of`): a profile of as many layers as the
traced model maps one to one; one laid out as the tool lays out a GPT (AMP's: two
entries before the blocks, the embedding and a transpose; four after, a transpose, the
final norm, the head and the loss) maps the leading entries to the embedding, then a
block each, the trailing ones to the head. Any other count is an error naming both.
A forward-plus-backward time splits as the layer's traced FLOPs do (forward FLOPs over
all; a third forward where a layer has none, the embedding), and a forward time alone
gets the backward those FLOPs give it (twice the forward where none). Identical layers
(one signature) measured several times are averaged. Times measured at tp > 1 by tools
built on Megatron-LM hold the layer's tensor-parallel collectives
(`LayerTiming.with_tp_comm`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cost_models import catalog
from planner.errors import PlannerError, closest
from planner.types import (
    ClusterSpec,
    Layer,
    LayerKind,
    LayerTiming,
    MeasuredDevice,
    ModelGraph,
    NodeSpec,
    OptimizerTiming,
)

FORMATS = ("metis", "amp", "csv")
SHARED_NAME = "measured"  # the device type's name after '@' where measurements are new
MIB = 2.0**20


@dataclass(frozen=True, kw_only=True)
class LayerMeasurement:
    """What a profile measured of one of the model's layers at one degree and size."""

    layer: int  # index into the model's layers
    tp: int
    micro_batch: int
    fwd: float  # seconds
    bwd: float
    memory: float | None = None  # bytes
    with_tp_comm: bool = False


@dataclass(frozen=True, kw_only=True)
class ImportedProfile:
    """A profile read from another tool's files, as this planner's measurements."""

    measured: MeasuredDevice
    layers: int  # entries mapped, per degree and size
    points: int  # (degree, micro-batch) pairs measured


def number(value: object, where: str) -> float:
    """`value` as a finite, non-negative number, else an error naming `where`."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value >= 0):
        raise PlannerError("bad-profile", f"{where} must be a finite, non-negative number "
                           f"(got {value!r}).", ["check the file; it may be damaged"])
    return float(value)


def numbers(value: object, where: str) -> list[float]:
    if not isinstance(value, list) or not value:
        raise PlannerError("bad-profile", f"{where} must be a non-empty list of numbers "
                           f"(got {type(value).__name__}).", ["check the file's format"])
    return [number(v, f"{where}[{i}]") for i, v in enumerate(value)]


def _layout(layers: Sequence[Layer]) -> str:
    blocks = sum(layer.kind is LayerKind.BLOCK for layer in layers)
    return (f"{len(layers)} layers ({', '.join(layer.name for layer in layers[:1])}, "
            f"{blocks} blocks, {layers[-1].name})")


def entries_of(count: int, layers: Sequence[Layer], *, around: tuple[int, int] | None,
               source: str, hint: str) -> list[list[int]]:
    """For each of the model's layers, the indices of the profile's `count` entries it
    takes (the module docstring's mapping): one to one, or where the tool puts
    `around` = (leading, trailing) entries around the blocks, those to the embedding and
    the head; an error naming both counts otherwise. `hint` says how the tool lays its
    layers out."""
    if count == len(layers):
        return [[i] for i in range(count)]
    kinds = [layer.kind for layer in layers]
    blocks = kinds.count(LayerKind.BLOCK)
    simple = (len(kinds) == blocks + 2 and kinds[0] is LayerKind.EMBEDDING
              and kinds[-1] is LayerKind.HEAD)
    if simple and around is not None and count == around[0] + blocks + around[1]:
        leading = around[0]
        return [list(range(leading)), *([leading + b] for b in range(blocks)),
                list(range(leading + blocks, count))]
    raise PlannerError(
        "bad-profile", f"{source} has {count} layer entries, which do not map to the "
        f"model's {_layout(layers)}: {hint}",
        ["profile the same model (its --layers and other shape options as here)",
         "or check --model, --seq-len and --dtype: the import traces the model with them"])


def split_total(total: float, layer: Layer) -> tuple[float, float]:
    """A forward-plus-backward time as (forward, backward), split as the layer's FLOPs."""
    share = layer.fwd_flops / layer.flops if layer.flops else 1 / 3
    return total * share, total * (1 - share)


def backward_of(forward: float, layer: Layer) -> float:
    """The backward time a measured forward time implies, by the layer's FLOPs."""
    return forward * (layer.bwd_flops / layer.fwd_flops if layer.fwd_flops else 2.0)


def timings(measurements: Sequence[LayerMeasurement], graph: ModelGraph
            ) -> tuple[LayerTiming, ...]:
    """One `LayerTiming` per signature, degree and size: identical layers' measurements
    averaged."""
    groups: dict[tuple[str, int, int], list[LayerMeasurement]] = {}
    for m in measurements:
        key = (graph.layers[m.layer].signature, m.tp, m.micro_batch)
        groups.setdefault(key, []).append(m)
    out = []
    for (signature, tp, mb), group in groups.items():
        memories = [m.memory for m in group if m.memory is not None]
        out.append(LayerTiming(
            model=graph.spec.describe(), layer=signature, seq_len=graph.seq_len,
            dtype=graph.dtype, micro_batch=mb, tp=tp,
            fwd=sum(m.fwd for m in group) / len(group),
            bwd=sum(m.bwd for m in group) / len(group),
            with_tp_comm=any(m.with_tp_comm for m in group),
            memory=sum(memories) / len(memories) if memories else None))
    return tuple(sorted(out, key=lambda t: (t.layer, t.tp, t.micro_batch)))


def imported(measurements: Sequence[LayerMeasurement], graph: ModelGraph,
             optimizer: OptimizerTiming | None, source: str) -> ImportedProfile:
    points = {(m.tp, m.micro_batch) for m in measurements}
    return ImportedProfile(
        measured=MeasuredDevice(layer_times=timings(measurements, graph), optimizer=optimizer,
                                source=source),
        layers=len(measurements) // max(1, len(points)), points=len(points))


def read_profile(kind: str, paths: Sequence[Path], graph: ModelGraph) -> ImportedProfile:
    """The profile in `paths`, of format `kind` (FORMATS), mapped to `graph`'s layers."""
    from cost_models.imports import amp, metis, plain_csv

    readers = {"metis": metis.read, "amp": amp.read, "csv": plain_csv.read}
    if kind not in readers:
        raise PlannerError("bad-option", f"--format {kind!r} is not one of "
                           f"{', '.join(FORMATS)}.")
    if not paths:
        raise PlannerError("bad-option", "Give the profile's files to import.")
    for path in paths:
        if not path.is_file():
            raise PlannerError("bad-file", f"{str(path)!r} is not a file.",
                               ["check the path (a Metis profile is one JSON file per "
                                "degree and micro-batch size: pass them all)"])
    return readers[kind](paths, graph)


def _matches(node: NodeSpec, device: str) -> bool:
    """Whether `node`'s device type is `device`: its name, its name before '@', or the
    catalog's name for `device` (an alias: A100-80G)."""
    name = node.device.name.lower()
    try:
        known = catalog.device(device).name.lower()
    except PlannerError:
        known = None
    return device.lower() in (name, name.partition("@")[0]) or known == name.partition("@")[0]


def merged(old: MeasuredDevice | None, new: MeasuredDevice) -> MeasuredDevice:
    """`old` with `new`'s layer timings in place of those of the same layer, dtype,
    degree and size, its optimizer step if it has one, and both sources."""
    if old is None:
        return new
    replaced = {(t.layer, t.dtype, t.tp, t.micro_batch) for t in new.layer_times}
    kept = tuple(t for t in old.layer_times
                 if (t.layer, t.dtype, t.tp, t.micro_batch) not in replaced)
    source = "; ".join(s for s in (old.source, new.source) if s)
    return dataclasses.replace(old, layer_times=kept + new.layer_times,
                               optimizer=new.optimizer or old.optimizer, source=source)


def attach(cluster: ClusterSpec, device: str, measured: MeasuredDevice) -> ClusterSpec:
    """`cluster` with `measured` added to every node of device type `device` (its name as
    `planner explain` or the cluster file gives it, or its catalog name). Nodes without
    measurements so far become one device type, `NAME@measured`; a node measured before
    keeps its own type, its measurements merged (`merged`)."""
    nodes = ([n for n in cluster.nodes if n.device.name.lower() == device.lower()]
             or [n for n in cluster.nodes if _matches(n, device)])
    if not nodes:
        names = sorted({n.device.name for n in cluster.nodes})
        near = closest(device, names)
        raise PlannerError("bad-option", f"Cluster {cluster.name} has no node of device type "
                           f"{device!r}; its types are {', '.join(names)}.",
                           [f"pass --device {near[0]}" if near else
                            f"pass one of --device {', '.join(names)}"])
    out = []
    for node in cluster.nodes:
        if node in nodes:
            old = node.device.measured
            base, _, own = node.device.name.partition("@")
            name = f"{base}@{own}" if old is not None else f"{base}@{SHARED_NAME}"
            node = dataclasses.replace(node, device=dataclasses.replace(
                node.device, name=name, measured=merged(old, measured)))
        out.append(node)
    return dataclasses.replace(cluster, nodes=tuple(out))
