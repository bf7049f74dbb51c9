"""YAML with line numbers, so errors can say "lab.yaml line 12, nodes[1].devices: ..."."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from planner.errors import PlannerError


class Located(dict):
    """A mapping that remembers the line of each key (1-based)."""

    lines: dict[str, int]
    line: int


class _Loader(yaml.SafeLoader):
    pass


def _mapping(loader: _Loader, node: yaml.MappingNode) -> Located:
    out = Located(loader.construct_mapping(node, deep=True))
    out.lines = {k.value: k.start_mark.line + 1 for k, _ in node.value
                 if isinstance(k, yaml.ScalarNode)}
    out.line = node.start_mark.line + 1
    return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)
    except RecursionError:
        raise PlannerError("bad-file", f"{source}: its YAML nests deeper than any cluster "
                           "file does.", ["check the file's brackets"]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or exc
        raise PlannerError("bad-file", f"{source}{where}: not valid YAML ({problem}).",
                           ["check indentation and quoting around that line"]) from exc


# what a cluster file holds, and where to see one, for errors about the file as a whole
CLUSTER_FILE = ("a cluster file is YAML: a mapping of schema_version, name, network and "
                "nodes (each node's device type and device count)")
SEE_FORMAT = ("see docs/clusters.md for the format, or copy a built-in example from "
              "examples/clusters/ (a100-v100-lab.yaml, say)")


def folder_given(path: Path) -> PlannerError:
    """The error for a folder passed as the cluster file (it read "does not exist")."""
    try:
        inside = sorted(p.name for p in path.iterdir() if p.suffix in (".yaml", ".yml"))
    except OSError:  # (a folder we may not list)
        inside = []
    return PlannerError("bad-file", f"{str(path)!r} is a folder, not a cluster file; "
                        f"{CLUSTER_FILE}.",
                        [f"pass one of its files: {', '.join(inside[:3])}"
                         + (", ..." if len(inside) > 3 else "") if inside
                         else "pass the path of the cluster's YAML file", SEE_FORMAT])


def read_yaml(path: Path) -> Any:
    if path.is_dir():
        raise folder_given(path)
    if not path.is_file():
        raise PlannerError("bad-file", f"File {str(path)!r} does not exist.", ["check the path"])
    try:
        text = path.read_text()
    except UnicodeDecodeError as exc:
        raise PlannerError("bad-file", f"{str(path)!r} is not a text file: byte "
                           f"{exc.start} is not UTF-8.",
                           ["pass the cluster YAML file (plain UTF-8 text)"]) from None
    return load_yaml(text, str(path))


class Fields:
    """Reads fields of one mapping, naming file, line and path in every error."""

    def __init__(self, data: Any, source: str, path: str = "") -> None:
        self.source, self.path = source, path
        self.data: dict = data if isinstance(data, dict) else {}
        self.used: set[str] = set()
        if not isinstance(data, dict):
            got = "it is empty" if data is None else f"got {type(data).__name__}"
            raise self.error(f"must be a mapping ({got})")

    def where(self, key: str | None = None) -> str:
        line = getattr(self.data, "lines", {}).get(key) if key else getattr(self.data, "line",
                                                                            None)
        at = f" line {line}" if line else ""
        field = ".".join(p for p in (self.path, key) if p) or "top level"
        return f"{self.source}{at}, {field}"

    def error(self, message: str, key: str | None = None, remedies: list[str] | None = None
              ) -> PlannerError:
        return PlannerError("bad-cluster", f"{self.where(key)}: {message}", remedies or [])

    def get(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        self.used.add(key)
        if key not in self.data:
            if required:
                raise self.error(f"is missing field {key!r}")
            return default
        return self.data[key]

    def sub(self, key: str, value: Any, index: int | None = None) -> Fields:
        path = ".".join(p for p in (self.path, key) if p)
        return Fields(value, self.source, path if index is None else f"{path}[{index}]")

    def positive_int(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default, required=default is None)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.error(f"must be a positive integer (got {value!r})", key)
        return value

    def parse(self, key: str, parser: Any, default: float | None = None) -> float:
        """A human-unit value parsed to SI; `default` (already SI) when absent."""
        value = self.get(key, required=default is None)
        if value is None:
            if default is None:
                raise self.error("needs a value", key)
            return default
        try:
            return parser(value)
        except PlannerError as exc:
            raise self.error(exc.message, key) from None

    def check_unknown(self, *expected: str) -> None:
        """An error for a field nothing read; `expected` adds fields still to be read,
        so a misspelt field is named before a required one is reported missing."""
        self.used.update(expected)
        unknown = [k for k in self.data if k not in self.used]
        if unknown:
            raise self.error(f"unknown field {unknown[0]!r}", unknown[0],
                             [f"valid fields here: {', '.join(sorted(self.used))}"])
