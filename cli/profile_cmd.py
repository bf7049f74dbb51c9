"""`planner profile`: measure this machine and write a device profile.

`profile` is a group so that sub-commands (e.g. merging profiles) can sit next to
it; without a sub-command it measures.
"""

from __future__ import annotations

import json
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cli import options as opt
from cli.tables import fit_words
from planner.errors import PlannerError
from planner.files import check_writable, write_atomic
from planner.units import fmt_bytes, fmt_flops, fmt_rate, fmt_seconds

console = Console(emoji=False)
err_console = Console(emoji=False, stderr=True)

profile_app = typer.Typer(no_args_is_help=False)


class Devices(str, Enum):
    cpu = "cpu"
    cuda = "cuda"
    all = "all"


@profile_app.callback(invoke_without_command=True)
def profile(
    ctx: typer.Context,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Write the profile (JSON) to this file.")] = None,
    quick: Annotated[bool, typer.Option(
        "--quick/--full", help="A short sweep (about 10 s on a 2-core CPU, 20 s when it is "
        "busy; more with --model) or the full one (minutes).")] = False,
    model: Annotated[str | None, typer.Option(
        "--model", help="Also time each layer of this model (a zoo flavor, "
        "package.module:factory or transformers config) in training steps.")] = None,
    seq_len: Annotated[int | None, typer.Option(
        "--seq-len", "-s", help="Sequence length for --model (default: the model's; "
        "--quick: at most 64).")] = None,
    dtype: Annotated[str, typer.Option(
        "--dtype", help="dtype of the layer timings: fp32, bf16, fp16, tf32.")] = "fp32",
    processes: Annotated[int, typer.Option(
        "--processes", help="Local processes for the communication benchmark.")] = 2,
    devices: Annotated[Devices, typer.Option(
        "--devices", help="Profile the CPU, the CUDA devices, or all of them.")] = Devices.all,
    no_comm: Annotated[bool, typer.Option(
        "--no-comm", help="Skip the communication benchmark.")] = False,
    json_out: opt.JsonOut = False,
    force: opt.Force = False,
) -> None:
    """Measure this machine and write a device profile.

    Measures matmul FLOP/s per dtype and memory bandwidth of the CPU and each CUDA
    device, each layer's forward and backward time of a model (--model), and
    collectives among local processes. Each measurement is announced on stderr as it
    starts, and a warning follows one whose repeated samples disagree (a busy machine).

    Examples:
      planner profile --quick
      planner profile -o node1.json --model gpt2-small --dtype bf16
    """
    if ctx.invoked_subcommand is not None:
        return
    import torch

    from cost_models.profile import noise_warnings, run_profile

    if output is not None:  # before the measurements, not after them
        check_writable(output, force=force)
    if devices is Devices.all and not torch.cuda.is_available():
        err_console.print("no CUDA device: profiling the CPU")
    start = time.perf_counter()
    doc = run_profile(quick=quick, model=model, seq_len=seq_len, dtype=dtype,
                      processes=processes, devices=devices.value, comm=not no_comm,
                      progress=_announce)
    elapsed = time.perf_counter() - start
    for line in noise_warnings(doc):
        err_console.print(f"[yellow]warning:[/] {escape(line)}", soft_wrap=True)
    if output is not None:
        try:
            output.write_text(json.dumps(doc, indent=1) + "\n")
        except OSError as exc:
            raise PlannerError("write-failed", f"Cannot write {output}: "
                               f"{exc.strerror or exc}.") from None
    if json_out:
        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
        return
    _render(doc, elapsed)
    if output is not None:
        console.print(f"Wrote the profile to {output}", soft_wrap=True, markup=False)


def _announce(stage: str, done: int, total: int) -> None:
    """A line on stderr as each measurement starts (a line, not a live bar: it shows
    in logs and pipes too, where a bar shows nothing)."""
    err_console.print(f"[{done + 1}/{total}] {stage}", markup=False, highlight=False,
                      soft_wrap=True)


def _render(doc: dict, elapsed: float) -> None:
    from cost_models.profile.noise import device_label

    dtypes = [d for d in ("fp32", "tf32", "bf16", "fp16")
              if any(d in dev["matmul"] for dev in doc["devices"])]
    load = doc["load_average"][0]
    table = Table(title=f"{doc['host']}: {doc['mode']} profile in {elapsed:.1f} s (load "
                        f"{load:.1f} at the start)",
                  caption="fp32...: best achieved matmul FLOP/s; copy: memory bandwidth "
                          "(bytes read + written)")
    for column in ("device", "name", "memory", *dtypes, "copy"):
        table.add_column(column, justify="left" if column in ("device", "name") else "right")
    for dev in doc["devices"]:
        threads = f", {dev['threads']} threads" if dev.get("threads") else ""
        table.add_row(device_label(dev), dev["name"] + threads, fmt_bytes(dev["memory_bytes"]),
                      *(fmt_flops(dev["matmul"][d]["best_flops"]) + "/s"
                        if d in dev["matmul"] else "-" for d in dtypes),
                      fmt_rate(dev["memory_bandwidth"]["best"]))
    console.print(fit_words(table))
    for dev in doc["devices"]:
        if dev["layers"] is not None:
            _render_layers(dev)
    if doc["communication"] is not None:
        _render_comm(doc["communication"])


def _render_layers(dev: dict) -> None:
    from cost_models.profile.noise import device_label

    layers = dev["layers"]
    batches = [s["micro_batch"] for s in layers["steps"]]
    table = Table(title=f"Layer times on {device_label(dev)}: {escape(layers['model'])}, seq "
                        f"{layers['seq_len'] or '-'}, {layers['dtype']} (the fastest step's)")
    table.add_column("layer")
    for b in batches:
        table.add_column(f"fwd ×{b}", justify="right")
        table.add_column(f"bwd ×{b}", justify="right")
    rows: dict[str, list[str]] = {}
    for t in layers["timings"]:
        rows.setdefault(t["layer"], []).extend([fmt_seconds(t["fwd"]), fmt_seconds(t["bwd"])])
    for name, cells in rows.items():
        table.add_row(name, *cells)
    console.print(fit_words(table))
    steps = ", ".join(f"{fmt_seconds(s['seconds'])} at micro-batch {s['micro_batch']}"
                      for s in layers["steps"])
    console.print(f"Whole training step (forward, loss, backward): {steps}.", soft_wrap=True)


def _render_comm(comm: dict) -> None:
    table = Table(title=f"Communication: {comm['world_size']} processes, {comm['backend']} on "
                        f"{comm['device']}",
                  caption="latency and bandwidth: fit of seconds = α + bytes / bandwidth; "
                          "busbw as in nccl-tests")
    for column in ("operation", "latency α", "bandwidth", "best busbw", "sizes"):
        table.add_column(column, justify="left" if column == "operation" else "right")
    for name, c in comm["collectives"].items():
        best = max(c["sweep"], key=lambda p: p["busbw"])
        sizes = f"{fmt_bytes(c['sweep'][0]['bytes'])} – {fmt_bytes(c['sweep'][-1]['bytes'])}"
        table.add_row(name, fmt_seconds(c["alpha"]), fmt_rate(c["beta_bandwidth"]),
                      f"{fmt_rate(best['busbw'])} at {fmt_bytes(best['bytes'])}", sizes)
    console.print(fit_words(table))


@profile_app.command("merge")
def merge(
    profiles: Annotated[list[Path], typer.Argument(help="Profile files, one per node.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The cluster YAML to write.")],
    network: Annotated[str, typer.Option(
        "--network", help="Link between nodes, e.g. 100Gbps/5us, or `measured` when the "
        "profiles come from workers of one machine.")] = "100Gbps/5us",
    names: Annotated[str | None, typer.Option(
        "--names", help="Comma-separated node names (default: the profiles' hosts).")] = None,
    name: Annotated[str, typer.Option("--name", help="The cluster's name.")] = "profiled",
    force: opt.Force = False,
) -> None:
    """Build a cluster spec from per-node profiles, measured values carried along.

    Example: planner profile merge node-a.json node-b.json --network 100Gbps -o lab.yaml
    """
    import yaml

    from cost_models.cluster import cluster_to_dict
    from cost_models.profile.merge import merge_profiles

    check_writable(output, force=force)
    cluster = merge_profiles(profiles, network=network, name=name,
                             names=[n.strip() for n in names.split(",")] if names else None)
    write_atomic(output, "# Made by `planner profile merge` from "
                 + ", ".join(str(p) for p in profiles) + "\n"
                 + yaml.safe_dump(cluster_to_dict(cluster), sort_keys=False), force=force)
    nodes, devices = len(cluster.nodes), cluster.num_devices
    console.print(f"Wrote cluster {cluster.name} ({nodes} node{'s' * (nodes != 1)}, "
                  f"{devices} device{'s' * (devices != 1)}) to {output}", markup=False)


class ImportFormat(str, Enum):
    metis = "metis"
    amp = "amp"
    csv = "csv"


@profile_app.command("import")
def import_profile(
    files: Annotated[list[Path], typer.Argument(
        help="The profile's files: Metis's JSON files (one per degree and micro-batch), "
        "AMP's .npy arrays (one per degree) or CSV tables.")],
    fmt: Annotated[ImportFormat, typer.Option(
        "--format", "-f", help="Who wrote the files: metis (Metis, Sailor), amp, csv.")],
    model: Annotated[str, typer.Option(
        "--model", "-m", help="The model profiled (a zoo flavor, package.module:factory or "
        "transformers config), its shape as profiled (--layers ...).")],
    cluster: Annotated[str, typer.Option(
        "--cluster", "-c", help="The cluster whose devices the profile measured (a YAML "
        "file, a built-in example or an inline spec).")],
    device: Annotated[str, typer.Option(
        "--device", "-d", help="The device type profiled (as the cluster names it, or its "
        "catalog name): its nodes get the measurements.")],
    output: Annotated[Path, typer.Option(
        "--output", "-o", help="The cluster YAML to write, measurements included.")],
    seq_len: opt.SeqLen = None,
    dtype: Annotated[str, typer.Option(
        "--dtype", help="dtype the profile trained in (what the plans will train in).")
    ] = "bf16",
    layers: opt.Layers = None,
    hidden: opt.Hidden = None,
    heads: opt.Heads = None,
    settings: opt.Set = None,
    force: opt.Force = False,
) -> None:
    """Bring per-layer times, memory and the optimizer step that another tool measured.

    The files' layers are mapped to the model's (as `planner trace` lists them), and
    the measurements go to every node of --device in a new cluster file, which the
    next `planner solve --cluster FILE` prices plans with: the layer times as measured
    (at each degree measured, tensor-parallel traffic included where the tool measured
    it so), measured memory for what fits, and the measured optimizer step.

    Examples:
      planner profile import DeviceType.A100_tp*_bs*.json -f metis -m gpt3-1.3b \\
          -c lab.yaml -d A100-40G -o lab-measured.yaml
      planner profile import known_cost/gpt2_G4_*.npy -f amp -m gpt2-medium \\
          -c 4x4xT4 -d T4 -o t4-measured.yaml
    """
    import yaml

    from cost_models.cluster import cluster_to_dict, load_cluster
    from cost_models.imports import attach, read_profile
    from planner.dtypes import canonical_dtype
    from planner.models import model_spec
    from planner.trace.cache import cached_trace

    check_writable(output, force=force)
    spec = load_cluster(cluster)
    traced = model_spec(model, opt.overrides(layers=layers, hidden=hidden, heads=heads,
                                             settings=settings))
    graph = cached_trace(traced, seq_len=seq_len, dtype=canonical_dtype(dtype))
    profile = read_profile(fmt.value, files, graph)
    measured = attach(spec, device, profile.measured)
    write_atomic(output, f"# Made by `planner profile import --format {fmt.value}` from "
                 + ", ".join(str(p) for p in files) + f" for {traced.describe()}\n"
                 + yaml.safe_dump(cluster_to_dict(measured), sort_keys=False), force=force)
    nodes = sum(n.device.measured is not None and n.device.measured is not m.device.measured
                for n, m in zip(measured.nodes, spec.nodes, strict=True))
    optimizer = " and the optimizer step" if profile.measured.optimizer else ""
    memory = (", with memory" if any(t.memory is not None
                                     for t in profile.measured.layer_times) else "")
    console.print(f"Wrote cluster {measured.name} to {output}: {profile.layers} layers of "
                  f"{traced.describe()} at {profile.points} degree and micro-batch "
                  f"pair{'s' * (profile.points != 1)}{memory}{optimizer}, on {nodes} "
                  f"node{'s' * (nodes != 1)} of {device}.", markup=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.add_typer(profile_app, name="profile")
