"""`planner models` and `planner trace`."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cli import options as opt
from cli.tables import fit_words, output_console
from planner.units import fmt_bytes, fmt_count, fmt_flops

if TYPE_CHECKING:
    from planner.types import ModelGraph

console = output_console()
err_console = Console(emoji=False, stderr=True)


def models(
    text: Annotated[str | None, typer.Argument(
        help="Only models whose name, family or description holds this (e.g. 70b, experts).",
        show_default=False)] = None,
    family: Annotated[str | None, typer.Option("--family", help="Only this family.")] = None,
    json_out: opt.JsonOut = False,
) -> None:
    """List the built-in model zoo with parameter counts.

    Examples: planner models llama; planner models --family llama
    """
    from planner.errors import PlannerError, unknown_name_error
    from planner.models import FLAVORS, load_model, model_spec
    from planner.models.zoo import matching

    families = sorted({f.family for f in FLAVORS.values()})
    if family and family.lower() not in families:
        raise unknown_name_error("unknown-family", "model family", family, families,
                                 "planner models")
    found = [f for f in matching(text or "") if not family or f.family == family.lower()]
    if not found:
        raise PlannerError("no-match", f"No zoo model matches {text!r}"
                           + (f" in family {family}." if family else "."),
                           ["`planner models` without a search lists all of them"])
    rows = []
    for flavor in found:
        loaded = load_model(model_spec(flavor.name))
        params = sum(p.numel() for p in loaded.module.parameters())
        rows.append({"name": flavor.name, "family": flavor.family,
                     "description": flavor.description, "params": params,
                     "seq_len": loaded.seq_len})
    if json_out:
        sys.stdout.write(json.dumps(rows, indent=1) + "\n")
        return
    table = Table(title="Model zoo (shapes can be overridden: --layers, --hidden, ...)")
    for column, justify in (("name", "left"), ("family", "left"), ("params", "right"),
                            ("seq len", "right"), ("description", "left")):
        table.add_column(column, justify=justify)
    for r in rows:
        table.add_row(r["name"], r["family"], fmt_count(r["params"]),
                      str(r["seq_len"] or "-"), r["description"])
    console.print(fit_words(table))


def trace(
    model: opt.ModelArg,
    batch: opt.Batch = 1,
    seq_len: opt.SeqLen = None,
    dtype: opt.Dtype = "bf16",
    json_out: opt.JsonOut = False,
    graph: Annotated[Path | None, typer.Option(
        "--graph", help="Also write the op graph: .json (node-link), .graphml or .dot.")] = None,
    all_layers: Annotated[bool, typer.Option(
        "--all-layers", help="One row per layer (default: identical runs folded).")] = False,
    force: opt.Force = False,
    layers: opt.Layers = None, hidden: opt.Hidden = None, heads: opt.Heads = None,
    kv_heads: opt.KvHeads = None, ffn: opt.Ffn = None, vocab: opt.Vocab = None,
    settings: opt.Set = None,
) -> None:
    """Trace a model on the meta device and show its layers and costs.

    Examples:
      planner trace llama3-70b --seq-len 4096
      planner trace gpt2-small --layers 4 --graph gpt2.graphml
      planner trace mypkg.models:build --set width=512 --json
    """
    from planner.files import check_writable
    from planner.models import load_model, model_spec
    from planner.trace import trace_loaded
    from planner.trace.export import summary_dict, write_graph

    spec = model_spec(model, opt.overrides(layers=layers, hidden=hidden, heads=heads,
                                           kv_heads=kv_heads, ffn=ffn, vocab=vocab,
                                           settings=settings))
    if graph is not None:  # before the trace, not after it
        check_writable(graph, force=force)
    start = time.perf_counter()
    with err_console.status(f"Building and tracing {escape(spec.describe())}...", spinner="dots"):
        traced = trace_loaded(load_model(spec, seq_len=seq_len), batch=batch, dtype=dtype)
    elapsed = time.perf_counter() - start
    if graph is not None:
        fmt = write_graph(traced, graph, force=True)
    if json_out:
        sys.stdout.write(json.dumps({**summary_dict(traced), "trace_seconds": elapsed},
                                    indent=1) + "\n")
        return
    _render(traced, elapsed, all_layers)
    if graph is not None:
        console.print(f"Wrote the op graph ({fmt}) to {graph}", markup=False)


def _render(traced: ModelGraph, elapsed: float, all_layers: bool) -> None:
    from planner.trace.summary import count_blocks, flop_check, layer_runs

    batch = traced.batch
    title = (f"{escape(traced.spec.describe())}: {fmt_count(traced.params)} parameters, "
             f"{count_blocks(traced)} blocks, seq {traced.seq_len or '-'}, {traced.dtype}")
    table = Table(title=title, caption="FLOPs, activations and boundaries are per sample.")
    for column in ("#", "layer", "kind", "×", "params", "fwd FLOP", "bwd FLOP",
                   "activations", "boundary"):
        table.add_column(column, justify="left" if column in ("layer", "kind") else "right",
                         overflow="fold", min_width=9 if column == "layer" else None)
    runs = ([(i, i + 1) for i in range(len(traced.layers))] if all_layers
            else layer_runs(traced))
    for start, end in runs:
        layer = traced.layers[start]
        last = traced.layers[end - 1].name
        stem, _, first_id = layer.name.rpartition(".")
        name = (layer.name if end - start == 1 else
                f"{stem}.{first_id}-{last.rpartition('.')[2]}"
                if stem and last.startswith(f"{stem}.") else f"{layer.name} … {last}")
        index = str(start) if end - start == 1 else f"{start}-{end - 1}"
        table.add_row(index, name, layer.kind.value, str(end - start), fmt_count(layer.params),
                      _compact(layer.fwd_flops), _compact(layer.bwd_flops),
                      fmt_bytes(layer.activation_bytes), fmt_bytes(layer.output_bytes))
    activations = sum(layer.activation_bytes for layer in traced.layers)
    table.add_section()
    table.add_row("", "total", "", str(len(traced.layers)), fmt_count(traced.params),
                  _compact(traced.fwd_flops), _compact(traced.bwd_flops),
                  fmt_bytes(activations), "")
    console.print(fit_words(table))
    step = (traced.fwd_flops + traced.bwd_flops) * batch
    console.print(f"Training step of batch {batch}: {fmt_flops(step)}; weights "
                  f"{fmt_bytes(traced.param_bytes)} in {traced.dtype}; traced with "
                  f"torch.{traced.tracer} in {elapsed:.1f} s.", soft_wrap=True)
    check = flop_check(traced)
    if check is not None:
        console.print(
            f"6·N·T check: weight-matmul training FLOPs {fmt_flops(check.traced_flops)}/sample "
            f"vs 6 × {fmt_count(check.matmul_params)} params × {check.tokens} tokens = "
            f"{fmt_flops(check.rule_flops)} (ratio {check.ratio:.3f}); attention adds "
            f"{fmt_flops(check.attention_flops)} ({check.attention_flops / check.rule_flops:.1%}).",
            soft_wrap=True)


def _compact(flops: float) -> str:
    return fmt_flops(flops).removesuffix("FLOP").replace(" ", "") or "0"


def register(app: typer.Typer) -> None:
    app.command("models")(models)
    app.command("trace")(trace)
