"""`planner devices`: the device catalog."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.table import Table

from cli import options as opt
from cli.tables import fit_words, output_console

if TYPE_CHECKING:
    from cost_models.catalog import Catalog
    from planner.types import DeviceSpec

console = output_console()


def devices(
    text: Annotated[str | None, typer.Argument(
        help="Only device types whose name or an alias holds this (e.g. a100, mi300).",
        show_default=False)] = None,
    vendor: Annotated[str | None, typer.Option(
        "--vendor", help="Only this vendor: nvidia, amd, generic.")] = None,
    sources: Annotated[bool, typer.Option(
        "--sources", help="Also show where each figure comes from, and the link types.")
    ] = False,
    json_out: opt.JsonOut = False,
) -> None:
    """List the device catalog: memory, bandwidth and dense peak FLOP/s per dtype.

    Examples:
      planner devices a100
      planner devices --vendor amd
      planner devices --sources
      planner devices --json
    """
    from cost_models.catalog import load_catalog
    from planner.errors import PlannerError, unknown_name_error

    catalog = load_catalog()
    specs = catalog.matching(text or "")
    if not specs:
        raise PlannerError("no-match", f"No device type matches {text!r}.",
                           ["`planner devices` without a search lists all of them"])
    if vendor:
        vendors = sorted({d.vendor for d in catalog.matching("")})
        if vendor.lower() not in vendors:
            raise unknown_name_error("unknown-vendor", "vendor", vendor, vendors,
                                     "planner devices")
        made = [d for d in specs if d.vendor == vendor.lower()]
        if not made:
            raise PlannerError("no-match", f"No device type matching {text!r} is made by "
                               f"{vendor.lower()}.", [f"`planner devices --vendor {vendor}` "
                                                      "lists that vendor's devices"])
        specs = made
    if json_out:
        rows = [_row(d, catalog) for d in specs]
        sys.stdout.write(json.dumps(rows, indent=1) + "\n")
        return
    _render(specs)
    if sources:
        _render_sources(specs, catalog)


def _row(d: DeviceSpec, catalog: Catalog) -> dict:
    link = d.intra_link
    return {"name": d.name, "vendor": d.vendor,
            "aliases": [a for a, name in catalog.aliases.items() if name == d.name],
            "memory": d.memory, "memory_bandwidth": d.memory_bandwidth,
            "peak_flops": dict(d.peak_flops),
            "intra_link": {"name": link.name, "bandwidth": link.bandwidth,
                           "latency": link.latency},
            "sources": dict(d.sources)}


def _render(specs: list[DeviceSpec]) -> None:
    from cost_models.catalog import DTYPES
    from planner.units import fmt_rate

    table = Table(title="Device catalog: dense peak TFLOP/s", box=box.SIMPLE_HEAD,
                  collapse_padding=True, pad_edge=False,
                  caption="-: no fast path, runs at the fp32 rate. Link bandwidth is per "
                          "device and direction. --sources: where each figure comes from.")
    for column in ("name", "vendor", "GiB", "mem GB/s", *DTYPES):
        table.add_column(column, no_wrap=True,
                         justify="left" if column in ("name", "vendor") else "right")
    table.add_column("intra-node link", overflow="fold")
    for d in specs:
        flops = [f"{d.peak_flops[t] / 1e12:.4g}" if t in d.peak_flops else "-"
                 for t in DTYPES]
        table.add_row(d.name, d.vendor, f"{d.memory / 2**30:.4g}",
                      f"{d.memory_bandwidth / 1e9:.4g}", *flops,
                      f"{d.intra_link.name}, {fmt_rate(d.intra_link.bandwidth)}")
    console.print(fit_words(table))


def _render_sources(specs: list[DeviceSpec], catalog: Catalog) -> None:
    from planner.units import fmt_rate, fmt_seconds

    table = Table(title="Sources of the device figures")
    for column in ("device", "figure", "source"):
        table.add_column(column, overflow="fold")
    for d in specs:
        for i, (field, text) in enumerate(d.sources.items()):
            table.add_row(d.name if i == 0 else "", field, text)
        table.add_section()
    console.print(fit_words(table))
    links = Table(title="Link types (bandwidth per device and direction)")
    for column in ("link", "name", "bandwidth", "latency", "source"):
        links.add_column(column, overflow="fold")
    used = [d.intra_link for d in specs]
    for key, spec in catalog.links.items():
        if spec in used:
            links.add_row(key, spec.name, fmt_rate(spec.bandwidth),
                          fmt_seconds(spec.latency), catalog.link_sources[key])
    console.print(fit_words(links))


def register(app: typer.Typer) -> None:
    app.command("devices")(devices)
