"""The device catalog: datasheet figures for known devices and link types, with sources.

The data lives in `data/devices.yaml` (package data; its header states the
conventions). Loading validates every entry and converts human units to SI; a
malformed entry raises a `PlannerError` naming the file, the entry and the field.
Lookups are case-insensitive, by canonical name or alias (including the name
`torch.cuda.get_device_name()` returns).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from planner.errors import PlannerError, unknown_name_error
from planner.types import DeviceSpec, LinkSpec
from planner.types.cluster import BusRate
from planner.units import parse_bandwidth, parse_bytes, parse_duration, parse_flops

SCHEMA_VERSION = 1
DTYPES = ("fp32", "tf32", "bf16", "fp16")
SOURCED_FIELDS = ("peak_flops", "memory_bandwidth", "memory", "intra_link")
GEMM_FIELDS = ("compute_units", "gemm_efficiency")  # optional, each with its source
_PACKAGED = "cost_models/data/devices.yaml"


@dataclass(frozen=True, kw_only=True)
class Catalog:
    """devices and links by canonical name, in file order; aliases maps each alias (as
    written) to its device's canonical name; link_sources gives each link's source."""

    devices: Mapping[str, DeviceSpec]
    links: Mapping[str, LinkSpec]
    aliases: Mapping[str, str]
    link_sources: Mapping[str, str]

    def device(self, name: str) -> DeviceSpec:
        wanted = name.strip().lower()
        names = {**{n.lower(): n for n in self.devices},
                 **{a.lower(): n for a, n in self.aliases.items()}}
        if wanted not in names:
            raise unknown_name_error("unknown-device", "device", name, list(self.devices),
                                     "planner devices")
        return self.devices[names[wanted]]

    def matching(self, text: str) -> list[DeviceSpec]:
        """The device types whose name or an alias holds `text` (any case); all for ""."""
        wanted = text.strip().lower()
        return [d for d in self.devices.values() if wanted in d.name.lower() or any(
            wanted in a.lower() for a, n in self.aliases.items() if n == d.name)]

    def link(self, name: str) -> LinkSpec:
        """A link type by key ("nvlink3") or display name ("NVLink 3")."""
        wanted = name.strip().lower()
        for key, spec in self.links.items():
            if wanted in (key.lower(), spec.name.lower()):
                return spec
        raise unknown_name_error("unknown-link", "link type", name, list(self.links),
                                 "planner devices --sources")


def load_catalog(path: str | Path | None = None) -> Catalog:
    """The packaged catalog (read once), or the catalog file at `path`."""
    if path is None:
        return _packaged()
    return parse_catalog(Path(path).read_text(), str(path))


@functools.cache
def _packaged() -> Catalog:
    text = resources.files("cost_models").joinpath("data/devices.yaml").read_text()
    return parse_catalog(text, _PACKAGED)


def device(name: str) -> DeviceSpec:
    return load_catalog().device(name)


def link(name: str) -> LinkSpec:
    return load_catalog().link(name)


def device_names() -> list[str]:
    return list(load_catalog().devices)


def parse_catalog(text: str, source: str) -> Catalog:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise PlannerError("bad-catalog", f"{source}{line}: not valid YAML "
                           f"({getattr(exc, 'problem', None) or exc}).") from exc
    top = _fields(data, source, required=("schema_version", "links", "devices"))
    if top["schema_version"] != SCHEMA_VERSION:
        raise _bad(f"{source}, schema_version", f"must be {SCHEMA_VERSION} "
                   f"(got {top['schema_version']!r})")
    links: dict[str, LinkSpec] = {}
    link_sources: dict[str, str] = {}
    for key, raw in _mapping(top["links"], f"{source}, links").items():
        links[str(key)], link_sources[str(key)] = _link(raw, f"{source}, links.{key}")
    devices: dict[str, DeviceSpec] = {}
    aliases: dict[str, str] = {}
    taken: dict[str, str] = {}  # every lookup key, lower-cased -> canonical name
    for name, raw in _mapping(top["devices"], f"{source}, devices").items():
        where = f"{source}, devices.{name}"
        devices[str(name)], names = _device(str(name), raw, links, where)
        for i, alias in enumerate([str(name), *names]):
            if alias.lower() in taken:
                raise _bad(f"{where}.{'aliases' if i else 'name'}",
                           f"{alias!r} already names {taken[alias.lower()]}")
            taken[alias.lower()] = str(name)
            if i:
                aliases[alias] = str(name)
    return Catalog(devices=MappingProxyType(devices), links=MappingProxyType(links),
                   aliases=MappingProxyType(aliases),
                   link_sources=MappingProxyType(link_sources))


def _link(raw: Any, where: str) -> tuple[LinkSpec, str]:
    data = _fields(raw, where, required=("name", "bandwidth", "latency", "source"),
                   optional=("bus_rates",))
    spec = LinkSpec(name=_text(data["name"], f"{where}.name"),
                    bandwidth=_parse(parse_bandwidth, data["bandwidth"], f"{where}.bandwidth"),
                    latency=_parse(parse_duration, data["latency"], f"{where}.latency"),
                    bus_rates=_bus_rates(data.get("bus_rates", {}), f"{where}.bus_rates"))
    return spec, _text(data["source"], f"{where}.source")


def _bus_rates(raw: Any, where: str) -> tuple[BusRate, ...]:
    """A link's measured bus bandwidth by message size ({bytes: rate}), smallest first."""
    rates = sorted((_parse(parse_bytes, size, f"{where}.{size}"),
                    _parse(parse_bandwidth, rate, f"{where}.{size}"))
                   for size, rate in _mapping(raw, where).items())
    sizes = [size for size, _ in rates]
    for i, size in enumerate(sizes):
        if size <= 0 or size in sizes[i + 1:]:
            raise _bad(f"{where}.{size:.0f}", "give each size once, as a positive number of "
                       "bytes")
    return tuple(BusRate(size=size, bus_bandwidth=rate) for size, rate in rates)


def _device(name: str, raw: Any, links: Mapping[str, LinkSpec], where: str
            ) -> tuple[DeviceSpec, list[str]]:
    data = _fields(raw, where, required=("vendor", *SOURCED_FIELDS, "sources"),
                   optional=("aliases", *GEMM_FIELDS))
    peak = {}
    for dtype, value in _mapping(data["peak_flops"], f"{where}.peak_flops").items():
        if dtype not in DTYPES:
            raise _bad(f"{where}.peak_flops.{dtype}", f"unknown dtype; use {', '.join(DTYPES)}")
        peak[dtype] = _parse(parse_flops, value, f"{where}.peak_flops.{dtype}")
    if "fp32" not in peak:
        raise _bad(f"{where}.peak_flops", "needs fp32 (dtypes without a fast path run at it)")
    link_name = _text(data["intra_link"], f"{where}.intra_link")
    if link_name not in links:
        raise _bad(f"{where}.intra_link", f"unknown link type {link_name!r}; define it under "
                   f"links (known: {', '.join(links)})")
    memory = _parse(parse_bytes, data["memory"], f"{where}.memory")
    if memory <= 0:
        raise _bad(f"{where}.memory", f"must be positive (got {data['memory']!r})")
    given = tuple(key for key in GEMM_FIELDS if key in data)
    sources = _fields(data["sources"], f"{where}.sources", required=(*SOURCED_FIELDS, *given))
    aliases = data.get("aliases", [])
    if not isinstance(aliases, list):
        raise _bad(f"{where}.aliases", f"must be a list of names (got {aliases!r})")
    units = data.get("compute_units")
    if units is not None and (not isinstance(units, int) or isinstance(units, bool)
                              or units < 1):
        raise _bad(f"{where}.compute_units", f"must be a positive whole number (got {units!r})")
    gemm = data.get("gemm_efficiency")
    if gemm is not None and (not isinstance(gemm, int | float) or isinstance(gemm, bool)
                             or not 0 < gemm <= 1):
        raise _bad(f"{where}.gemm_efficiency", f"must be a share of the peak in (0, 1] "
                   f"(got {gemm!r})")
    spec = DeviceSpec(
        name=name, vendor=_text(data["vendor"], f"{where}.vendor"), memory=memory,
        memory_bandwidth=_parse(parse_bandwidth, data["memory_bandwidth"],
                                f"{where}.memory_bandwidth"),
        peak_flops=peak, intra_link=links[link_name],
        sources={k: _text(v, f"{where}.sources.{k}") for k, v in sources.items()},
        compute_units=units, gemm_efficiency=None if gemm is None else float(gemm))
    return spec, [_text(a, f"{where}.aliases") for a in aliases]


def _bad(where: str, message: str) -> PlannerError:
    return PlannerError("bad-catalog", f"{where}: {message}.",
                        ["fix that entry of the device catalog"])


def _mapping(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise _bad(where, f"must be a mapping (got {type(value).__name__})")
    return value


def _fields(value: Any, where: str, *, required: tuple[str, ...],
            optional: tuple[str, ...] = ()) -> dict:
    data = _mapping(value, where)
    for key in data:
        if key not in required and key not in optional:
            raise _bad(f"{where}.{key}", f"unknown field; valid fields: "
                       f"{', '.join((*required, *optional))}")
    missing = [key for key in required if key not in data]
    if missing:
        raise _bad(where, f"is missing field {missing[0]!r}")
    return data


def _parse(parser: Callable[[Any], float], value: Any, where: str) -> float:
    try:
        return parser(value)
    except PlannerError as exc:
        raise _bad(where, exc.message.rstrip(".")) from None


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _bad(where, f"must be a non-empty string (got {value!r})")
    return value
