"""The device-profile document (schema_version 1) and its validation.

Every field below must be present but the optional ones (more are allowed, e.g. a
CPU's `cores`); numbers must be finite and not negative. Units are SI: seconds, bytes,
FLOP/s, bytes/s. Optional fields came after files were first written, which still
load: a timed point's `samples` (the seconds of each sample) and their `spread` (see
`timing.Samples`), and the communication's `contention` (`contention`; absent: none).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.errors import PlannerError

SCHEMA_VERSION = 1
KIND = "device-profile"


@dataclass(frozen=True)
class _Each:
    """An object whose every value (any key) is `of`."""

    of: object


@dataclass(frozen=True)
class _Maybe:
    """null, or `of`."""

    of: object


@dataclass(frozen=True)
class _Optional:
    """A field that may be absent; when present, `of`."""

    of: object


NUMBER = float  # any finite, non-negative int or float

_SAMPLED = {"samples": _Optional([NUMBER]), "spread": _Optional(NUMBER)}
_MATMUL = {"best_flops": NUMBER, "sweep": [
    {"m": NUMBER, "n": NUMBER, "k": NUMBER, "seconds": NUMBER, "flops": NUMBER, **_SAMPLED}]}
_BANDWIDTH = {"best": NUMBER, "sweep": [{"bytes": NUMBER, "seconds": NUMBER,
                                         "bandwidth": NUMBER, **_SAMPLED}]}
_LAYERS = {"model": str, "seq_len": _Maybe(NUMBER), "dtype": str,
           "timings": [{"layer": str, "signature": str, "micro_batch": NUMBER, "fwd": NUMBER,
                        "bwd": NUMBER}],
           "steps": [{"micro_batch": NUMBER, "seconds": NUMBER, **_SAMPLED}]}
_DEVICE = {"index": NUMBER, "kind": str, "name": str, "memory_bytes": NUMBER,
           "matmul": _Each(_MATMUL), "memory_bandwidth": _BANDWIDTH, "layers": _Maybe(_LAYERS)}
_COLLECTIVE = {"alpha": NUMBER, "beta_bandwidth": NUMBER, "sweep": [
    {"bytes": NUMBER, "seconds": NUMBER, "algbw": NUMBER, "busbw": NUMBER}]}
_CONTENTION = {key: NUMBER for key in (
    "bytes", "matmul_side", "compute_alone", "compute_overlapped", "collective_alone",
    "collective_overlapped", "compute_slowdown", "collective_slowdown")}
_COMMUNICATION = {"backend": str, "world_size": NUMBER, "device": str,
                  "collectives": {"all_reduce": _COLLECTIVE, "all_gather": _COLLECTIVE,
                                  "p2p": _COLLECTIVE},
                  "contention": _Optional(_CONTENTION)}
_DOCUMENT = {"schema_version": NUMBER, "kind": str, "host": str, "timestamp": str,
             "software": {"python": str, "torch": str, "cuda": _Maybe(str), "planner": str,
                          "platform": str},
             "mode": str, "load_average": [NUMBER], "devices": [_DEVICE],
             "communication": _Maybe(_COMMUNICATION)}


def validate(doc: object, source: str) -> dict:
    """`doc` if it is a valid device profile; otherwise a PlannerError naming `source`
    and the field at fault."""
    if not isinstance(doc, dict):
        raise _bad(source, None, "is not a JSON object")
    if doc.get("kind") != KIND:
        raise _bad(source, "kind", f"is {doc.get('kind')!r}, not {KIND!r}: this is not a "
                   "device profile")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise PlannerError(
            "bad-profile", f"{source}: field 'schema_version' is "
            f"{doc.get('schema_version')!r}; this planner reads schema_version "
            f"{SCHEMA_VERSION} only.",
            ["profile the machine again with this planner: planner profile -o FILE",
             "or use the planner version that wrote the file"])
    _check(doc, _DOCUMENT, "", source)
    return doc


def _check(value: object, schema: object, path: str, source: str) -> None:
    if isinstance(schema, _Maybe):
        if value is not None:
            _check(value, schema.of, path, source)
    elif isinstance(schema, dict | _Each):
        if not isinstance(value, dict):
            raise _bad(source, path, "must be an object")
        fields = schema.items() if isinstance(schema, dict) else (
            (key, schema.of) for key in value)
        for key, sub in fields:
            where = f"{path}.{key}" if path else key
            if key not in value:
                if isinstance(sub, _Optional):
                    continue
                raise _bad(source, where, "is missing")
            _check(value[key], sub.of if isinstance(sub, _Optional) else sub, where, source)
    elif isinstance(schema, list):
        if not isinstance(value, list):
            raise _bad(source, path, "must be a list")
        for i, item in enumerate(value):
            _check(item, schema[0], f"{path}[{i}]", source)
    elif schema is str:
        if not isinstance(value, str):
            raise _bad(source, path, f"must be a string (got {value!r})")
    elif isinstance(value, bool) or not isinstance(value, int | float):  # schema is NUMBER
        raise _bad(source, path, f"must be a number (got {value!r})")
    elif not math.isfinite(value) or value < 0:
        raise _bad(source, path, f"is {value}; it must be a finite, non-negative number")


def _bad(source: str, path: str | None, problem: str) -> PlannerError:
    where = f"field {path!r} " if path else ""
    return PlannerError("bad-profile", f"{source}: {where}{problem}.",
                        ["profile the machine again: planner profile -o FILE"])
