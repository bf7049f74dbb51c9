"""Traces kept on disk, so that planning a zoo model again skips building and tracing it.

Building a model and tracing it takes a second or more, and importing torch for it
another second, where a small search takes a tenth of that. `cached_trace` reads a
model traced before from the cache, and traces it (and keeps it) otherwise; reading
imports neither torch nor networkx.

An entry is JSON (never pickle): the key it was traced for, and the model's layers
and metadata, which planning reads; the op graph is not kept (`planner trace`, which
exports it, always traces). The key holds everything that changes a trace: the model
(zoo name and shape overrides), the sequence length asked for, the dtype, the batch
traced, the torch version (read without importing torch), the planner version and a
digest of the code that builds and traces models (`_CODE`), so an edited working tree
never reads a stale trace. Only zoo models are kept: a factory (`module:factory`) or a
transformers config (a config.json, a config class of the installed transformers) can
change under the same name, and is traced every time.

Where: $PLANNER_CACHE_DIR, else $XDG_CACHE_HOME/planner, else ~/.cache/planner, in its
`traces` folder. `PLANNER_NO_CACHE=1` neither reads nor writes it. Entries are written
whole or not at all (`planner.files.write_atomic`); an entry that cannot be read, or
was written for another key or format, is traced again and rewritten, and a folder
that cannot be written is passed over: the cache never makes a command fail.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

from planner import __version__
from planner.dtypes import canonical_dtype
from planner.errors import PlannerError
from planner.files import write_atomic
from planner.types import ModelGraph, ModelSpec
from planner.types.model import layer_from_json, layer_json

CACHE_FORMAT = 1  # the entry's layout: raise it when `_entry` or `_graph_from` change
KIND = "planner-trace"
# what builds and traces models (relative to the planner package): any edit is a new key
_CODE = ("trace", "models", "types/model.py", "dtypes.py")


def cache_dir() -> Path:
    """The folder the planner caches in (traces go to its `traces` folder)."""
    if os.environ.get("PLANNER_CACHE_DIR"):
        return Path(os.environ["PLANNER_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "planner"
    return Path.home() / ".cache" / "planner"


def cache_enabled() -> bool:
    """False where PLANNER_NO_CACHE is set to anything but 0 or nothing."""
    return os.environ.get("PLANNER_NO_CACHE", "").strip() in ("", "0")


def cached_trace(spec: ModelSpec, *, seq_len: int | None, dtype: str,
                 batch: int = 1) -> ModelGraph:
    """The model traced on meta (`planner.trace.trace_model`), read from the cache where it
    was traced before with the same key (then without its op graph, `graph` None)."""
    key = trace_key(spec, seq_len=seq_len, dtype=dtype, batch=batch)
    path = None if key is None or not cache_enabled() else entry_path(spec, key)
    if path is not None:
        graph = read_entry(path, key, spec)
        if graph is not None:
            return graph
    from planner.trace import trace_model

    graph = trace_model(spec, batch=batch, seq_len=seq_len, dtype=dtype)
    if path is not None:
        write_entry(path, key, graph)
    return graph


def trace_key(spec: ModelSpec, *, seq_len: int | None, dtype: str, batch: int) -> str | None:
    """The canonical JSON of everything the trace depends on; None for models not cached
    (factories and transformers configs, which may change under the same name)."""
    if spec.source != "zoo":
        return None
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    key = {"model": spec.name, "overrides": dict(spec.overrides), "seq_len": seq_len,
           "dtype": canonical_dtype(dtype), "batch": batch, "torch": torch_version,
           "planner": __version__, "code": _code_digest()}
    return json.dumps(key, sort_keys=True, default=repr)


@lru_cache(maxsize=1)
def _code_digest() -> str:
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for name in _CODE:
        files = sorted((package / name).glob("*.py")) if (package / name).is_dir() else [
            package / name]
        for file in files:
            digest.update(str(file.relative_to(package)).encode() + b"\0")
            digest.update(file.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def entry_path(spec: ModelSpec, key: str) -> Path:
    """The entry's file: the model's name (to find it by eye) and a digest of the key."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    name = re.sub(r"[^a-z0-9.-]", "_", spec.name.lower())
    return cache_dir() / "traces" / f"{name}-{digest}.json"


def read_entry(path: Path, key: str, spec: ModelSpec) -> ModelGraph | None:
    """The model the entry at `path` holds for `key`; None where there is none, or it is
    unreadable, damaged, or written for another key or format."""
    try:
        data = json.loads(path.read_text())
        if ((data.get("kind"), data.get("format")) != (KIND, CACHE_FORMAT)
                or json.dumps(data.get("key"), sort_keys=True) != key):
            return None
        return _graph_from(data["model"], spec)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None


def write_entry(path: Path, key: str, graph: ModelGraph) -> None:
    """Keep `graph` under `key`, whole or not at all; quietly nothing where the folder
    cannot be made or written (a read-only home, a full disk)."""
    text = json.dumps({"kind": KIND, "format": CACHE_FORMAT, "key": json.loads(key),
                       "model": _entry(graph)}, separators=(",", ":"))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text, force=True)
    except (OSError, PlannerError):
        return


def _entry(graph: ModelGraph) -> dict[str, Any]:
    return {"family": graph.family, "batch": graph.batch, "seq_len": graph.seq_len,
            "dtype": graph.dtype, "tracer": graph.tracer, "config": dict(graph.config),
            "layers": [layer_json(layer) for layer in graph.layers]}


def _graph_from(data: dict[str, Any], spec: ModelSpec) -> ModelGraph:
    """The model `_entry` wrote (its spec is the key's, `spec` itself); zoo configurations
    hold tuples where JSON has lists."""
    config = {name: tuple(value) if isinstance(value, list) else value
              for name, value in data["config"].items()}
    return ModelGraph(spec=spec, family=data["family"], batch=data["batch"],
                      seq_len=data["seq_len"], dtype=data["dtype"], tracer=data["tracer"],
                      layers=tuple(layer_from_json(layer) for layer in data["layers"]),
                      config=config)
