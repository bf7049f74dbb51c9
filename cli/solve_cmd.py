"""`planner solve` and `planner estimate`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape

from cli import options as opt
from cli.tables import output_console

if TYPE_CHECKING:
    from planner.schedule.ledger import Reservation
    from planner.solver import SolveOptions
    from planner.types import ClusterSpec, ModelGraph, Plan, SyncSpec, TrainingSpec

console = output_console()
err_console = Console(emoji=False, stderr=True)

DEFAULT_CLUSTER = "a100-v100-lab"
Cluster = Annotated[str, typer.Option(
    "--cluster", "-c", help="A cluster YAML file, a built-in example "
    "(a100-v100-lab, dgx-a100-pod, consumer-rtx, four-type-1024) or inline: "
    "2x8xA100-80G,4x8xV100-32G@100Gbps.")]
GlobalBatch = Annotated[int, typer.Option("--global-batch", "-B", help="Samples per step.")]
AutoDtype = Annotated[str, typer.Option(
    "--dtype", help="bf16, fp16, fp32, tf32, or auto: bf16 if every device has fast bf16, "
    "else fp16.")]
Output = Annotated[Path | None, typer.Option("--output", "-o", help="Write the plan file.")]
SequenceParallel = Annotated[bool, typer.Option(
    "--sequence-parallel", help="Megatron's sequence parallelism: each tensor-parallel group "
    "splits transformer blocks' norms, dropout and residual adds (and what they keep for "
    "backward) over the sequence, its all-reduces becoming reduce-scatters and all-gathers.")]
VocabParallel = Annotated[bool, typer.Option(
    "--vocab-parallel", help="Split a transformer's embedding and LM head, its loss "
    "included, over the vocabulary across each tensor-parallel group, as Megatron does, "
    "instead of running them whole on every rank.")]


Sync = Annotated[str, typer.Option(
    "--sync", help="How pipelines holding the same layers keep them equal: every-step "
    "(gradients summed every step), or, changing the optimization, local-sgd:H (local SGD, "
    "parameters averaged every H steps weighted by batch share), average:H (one weight per "
    "pipeline), diloco:H (DiLoCo: an outer Nesterov step every H steps), auto (solve only: "
    "with --max-interval, the solver picks H).", rich_help_panel="Gradient sync")]
OverlapSync = Annotated[bool, typer.Option(
    "--overlap-sync", help="Every-step gradient sums start bucket by bucket as backward makes "
    "the gradients (as DDP does), priced as what the last backward does not hide.",
    rich_help_panel="Gradient sync")]
MaxInterval = Annotated[int | None, typer.Option(
    "--max-interval", help="With --sync auto: the most steps between syncs.",
    rich_help_panel="Gradient sync", show_default=False)]


def _setup(model: str, cluster: str, global_batch: int, seq_len: int | None, dtype: str,
           shape: dict, *, sequence_parallel: bool = False, vocab_parallel: bool = False,
           sync: SyncSpec | None = None) -> tuple[ModelGraph, ClusterSpec, TrainingSpec]:
    """The model traced, its layers as the tensor-parallel options run them
    (`tensor_parallel.as_trained`), the cluster and the training."""
    import dataclasses

    from cost_models.cluster import load_cluster
    from cost_models.compute import rate_dtype
    from cost_models.tensor_parallel import as_trained
    from planner.models import model_spec
    from planner.session import resolve_dtype
    from planner.trace.cache import cached_trace
    from planner.types import TrainingSpec

    spec = load_cluster(cluster)
    dtype = resolve_dtype(dtype, spec)
    slow = sorted(k for k, d in spec.device_types().items() if rate_dtype(d, dtype) != dtype)
    if slow:
        err_console.print(f"[yellow]note:[/] {escape(', '.join(slow))} list no {dtype} throughput "
                          "(measured or in the catalog): their layers are priced at fp32 "
                          "speed (--dtype auto picks a dtype every device runs fast).",
                          soft_wrap=True)
    model_to_trace = model_spec(model, shape)
    with err_console.status(f"Building and tracing {escape(model_to_trace.describe())}...",
                            spinner="dots"):
        graph = cached_trace(model_to_trace, seq_len=seq_len, dtype=dtype)
    training = TrainingSpec(global_batch=global_batch, seq_len=graph.seq_len, dtype=dtype,
                            sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel,
                            **({} if sync is None else {"sync": sync}))
    return (dataclasses.replace(graph, layers=as_trained(graph.layers, training)), spec,
            training)


def _emit(plan: Plan, graph: ModelGraph, output: Path | None, force: bool,
          json_out: bool) -> None:
    from planner.planfile import plan_json, write_plan

    if output is not None:
        write_plan(plan, output, force=force)
    if json_out:
        sys.stdout.write(plan_json(plan))
        return
    from cli.render_plan import render

    render(console, plan, [layer.name for layer in graph.layers], verbose=True)
    if output is not None:
        console.print(f"Wrote the plan to {output}", markup=False)


def warn_small_batch(plan: Plan) -> None:
    """On stderr, where the global batch is too small for the devices the plan uses
    (`planner.small_batch`)."""
    from planner.small_batch import small_batch

    found = small_batch(plan)
    if found is not None:
        err_console.print(f"[yellow]warning:[/] {escape(found.message)}", soft_wrap=True)


def _policies(recompute: str | None) -> tuple:
    from planner.errors import PlannerError
    from planner.types import Recompute as Policy

    if recompute is None:
        return tuple(Policy)
    try:
        return (Policy(recompute),)
    except ValueError:
        raise PlannerError("bad-option", f"--recompute {recompute!r} is not one of none, "
                           "selective, full.") from None


def solve(
    model: opt.ModelArg,
    cluster: Cluster = DEFAULT_CLUSTER,
    global_batch: GlobalBatch = 512,
    seq_len: opt.SeqLen = None,
    dtype: AutoDtype = "auto",
    output: Output = None,
    json_out: opt.JsonOut = False,
    force: opt.Force = False,
    time_limit: opt.TimeLimit = 60.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Show the k best plans.")] = 1,
    gap: Annotated[float, typer.Option(
        "--gap", help="Stop when no plan can be more than this fraction faster.")] = 0.005,
    tp: opt.Tp = None,
    max_tp: opt.MaxTp = None,
    pp: opt.Pp = None,
    dp: opt.Dp = None,
    max_dp: opt.MaxDp = None,
    micro_batch: opt.MicroBatch = None,
    max_stages: Annotated[int, typer.Option(
        "--max-stages", help="Most stages per pipeline.", rich_help_panel="Constraints")] = 16,
    recompute: opt.Recompute = None,
    zero: opt.Zero = None,
    exclude: opt.Exclude = None,
    first_stage: opt.FirstStage = None,
    last_stage: opt.LastStage = None,
    mixed: opt.Mixed = True,
    tp_per_class: opt.TpPerClass = False,
    mixed_share_types: opt.MixedShareTypes = False,
    interleave: opt.Interleave = None,
    max_interleave: opt.MaxInterleave = None,
    schedule: opt.ScheduleChoice = None,
    sequence_parallel: SequenceParallel = False,
    vocab_parallel: VocabParallel = False,
    sync: Sync = "every-step",
    overlap_sync: OverlapSync = False,
    max_interval: MaxInterval = None,
    data_profile: Annotated[Path | None, typer.Option(
        "--data-profile", help="Rank the best plans again by their expected step on "
        "samples of this data profile's lengths (planner data-profile -o), packed.")] = None,
    layers: opt.Layers = None, hidden: opt.Hidden = None, heads: opt.Heads = None,
    kv_heads: opt.KvHeads = None, ffn: opt.Ffn = None, vocab: opt.Vocab = None,
    settings: opt.Set = None,
    reserve: Annotated[bool, typer.Option(
        "--reserve", help="Reserve the plan's devices in the ledger (under --job), so that "
        "other planners plan around them.", rich_help_panel="Reservations")] = False,
    job: Annotated[str | None, typer.Option(
        "--job", help="With --reserve: the job the devices are reserved for (default: the "
        "model's name).", rich_help_panel="Reservations", show_default=False)] = None,
    ledger: Annotated[Path | None, typer.Option(
        "--ledger", help="The reservations ledger (default: $PLANNER_LEDGER, else "
        "~/.local/share/planner/ledger.sqlite).", rich_help_panel="Reservations")] = None,
    until: Annotated[str | None, typer.Option(
        "--until", help="With --reserve: how long the reservation lasts (seconds, or 90min; "
        "default: until `planner jobs --cancel`).", rich_help_panel="Reservations",
        show_default=False)] = None,
) -> None:
    """Find the fastest plan for MODEL on a heterogeneous cluster.

    Devices other planners reserved (`planner jobs`) are left alone; --reserve
    reserves the plan's own.

    Examples:
      planner solve llama3-8b
      planner solve gpt3-1.3b --cluster 1x8xA100-40G,1x8xV100-16G@100Gbps -B 512 -o plan.json
      planner solve llama2-70b --cluster lab.yaml --tp 8 --time-limit 30
      planner solve llama3-8b --cluster lab.yaml --reserve --job pretrain --until 600min
    """
    import dataclasses

    from cli.progress import solve_progress
    from planner.errors import PlannerError
    from planner.files import check_writable
    from planner.reserve import free_cluster, on_real_devices, reserve_plan
    from planner.schedule.ledger import RETRIES, open_ledger
    from planner.solver import Limits, SolveOptions, Space, solve
    from planner.solver.limits import check_chunk_flags, parse_schedule
    from planner.sync import AutoSync, check_zero, parse_sync, solve_auto

    check_chunk_flags(interleave, max_interleave, schedule)
    if top_k < 1:
        raise PlannerError("bad-option", f"--top-k must be at least 1 (got {top_k}).")
    if zero is not None and zero not in (0, 1, 2, 3):
        raise PlannerError("bad-option", f"--zero must be 0, 1, 2 or 3 (got {zero}).")
    asked = parse_sync(sync, overlap=overlap_sync, max_interval=max_interval)
    check_zero(asked, zero)
    lasts = _reservation_length(reserve, job, until)
    if output is not None:  # before the work, not after it
        check_writable(output, force=force)
    shape = opt.overrides(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                          ffn=ffn, vocab=vocab, settings=settings)
    graph, spec, training = _setup(model, cluster, global_batch, seq_len, dtype, shape,
                                   sequence_parallel=sequence_parallel,
                                   vocab_parallel=vocab_parallel,
                                   sync=None if isinstance(asked, AutoSync) else asked)
    options = SolveOptions(
        limits=Limits(tp=tp, max_tp=max_tp, pp=pp, dp=dp, max_dp=max_dp, micro_batch=micro_batch,
                      max_stages=max_stages, mixed=mixed, tp_per_class=tp_per_class,
                      mixed_share_types=mixed_share_types,
                      first_stage=first_stage,
                      last_stage=last_stage, interleave=interleave,
                      **({} if max_interleave is None else {
                          "interleaves": tuple(range(1, max_interleave + 1))}),
                      schedule=parse_schedule(schedule) if schedule else None),
        space=Space(policies=_policies(recompute),
                    zeros=(zero,) if zero is not None else (0, 1, 2, 3)),
        exclude=tuple(exclude or ()), top_k=top_k, gap=gap, time_limit=time_limit)
    if data_profile is not None:  # (the best few, ranked again on the data: `data_cmd`)
        from cli.data_cmd import for_data
        from planner.data.choose import CANDIDATES
        from planner.data.profile import read_profile

        profile = read_profile(data_profile)  # (before the search, not after it)
        options = dataclasses.replace(options, top_k=max(top_k, CANDIDATES))
    book = open_ledger(ledger, create=reserve)
    reservation = None
    for attempt in range(RETRIES):  # (again where another planner reserved meanwhile)
        free = free_cluster(spec, book.held(spec.name) if book is not None else {})
        if free.reserved:
            err_console.print(f"[yellow]note:[/] {free.reserved} of the {spec.num_devices} "
                              f"devices of {escape(spec.name)} are reserved (`planner jobs`); "
                              "the plan leaves them alone.", soft_wrap=True)
        on_free = dataclasses.replace(options, exclude=free.still_excluded(options.exclude))
        with solve_progress(err_console, time_limit) as progress:
            plans = (solve_auto(graph, free.cluster, training, on_free, asked,
                                progress=progress)
                     if isinstance(asked, AutoSync)
                     else solve(graph, free.cluster, training, on_free, progress=progress))
        progress.finish(plans[0])
        plans = _with_constraints(plans, options)
        if data_profile is not None:
            plans = for_data(plans, graph, free.cluster, profile, str(data_profile))[:top_k]
        plans = [on_real_devices(plan, free, spec) for plan in plans]
        try:
            reservation = (reserve_plan(book, plans[0], job=job or model, lasts=lasts)
                           if reserve else None)
            break
        except PlannerError as exc:
            if exc.kind != "reserved" or attempt == RETRIES - 1:
                raise
    try:
        _show(plans, graph, output=output, force=force, json_out=json_out, top_k=top_k,
              reservation=reservation)
    except BaseException:  # (no plan written, no devices held: nothing half done)
        if reservation is not None:
            book.cancel(reservation.id)
        raise
    if reservation is not None and not json_out:
        console.print(f"Reserved for {escape(reservation.job)}: reservation "
                      f"{reservation.id} ({escape(str(book.path))})")


def _reservation_length(reserve: bool, job: str | None, until: str | None) -> float | None:
    """--until in seconds (None: no end); an error for --job or --until without
    --reserve."""
    from planner.errors import PlannerError
    from planner.units import parse_duration

    if not reserve and (job is not None or until is not None):
        raise PlannerError("bad-option", "--job and --until name and time the reservation "
                           "--reserve makes; without --reserve nothing is reserved.",
                           ["add --reserve", "or drop --job / --until"])
    if until is None:
        return None
    seconds = parse_duration(until, "--until")
    if seconds <= 0:
        raise PlannerError("bad-option", f"--until must be a positive duration (got {until}).",
                           ["give seconds or minutes: --until 3600 or --until 90min"])
    return seconds


def _show(plans: list[Plan], graph: ModelGraph, *, output: Path | None, force: bool,
          json_out: bool, top_k: int, reservation: Reservation | None) -> None:
    """The plans on stdout (--json: as JSON, the first with the reservation's id), the
    first written to `output`."""
    warn_small_batch(plans[0])
    if len(plans) < top_k:  # say so, not leave the reader to count
        found = ("exist under the constraints given" if plans[0].solver.status == "optimal"
                 else "were found before the search stopped")
        err_console.print(f"[yellow]note:[/] --top-k {top_k} asked for {top_k} plans, but only "
                          f"{len(plans)} {found}.", soft_wrap=True)
    if json_out and (top_k > 1 or reservation is not None):
        from planner.planfile import to_jsonable

        documents = [to_jsonable(p) for p in plans]
        if reservation is not None:
            documents[0]["reservation"] = reservation.id
        sys.stdout.write(json.dumps(documents if top_k > 1 else {"kind": "plan",
                                                                  **documents[0]},
                                    indent=1) + "\n")
        if output is not None:
            from planner.planfile import write_plan

            write_plan(plans[0], output, force=force)
        return
    _emit(plans[0], graph, output, force, json_out)
    for rank, other in enumerate(plans[1:], 2):
        console.rule(f"plan #{rank}")
        from cli.render_plan import render

        render(console, other, [layer.name for layer in graph.layers])


def _with_constraints(plans: list[Plan], options: SolveOptions) -> list[Plan]:
    """The plans recording the constraints they were solved with, which `planner replan`
    keeps to (`planner.constraints`)."""
    import dataclasses

    from planner.constraints import recorded

    constraints = recorded(options)
    return [dataclasses.replace(plan, constraints=constraints) for plan in plans]


PlanFile = Annotated[Path, typer.Argument(
    metavar="PLAN", help="A plan file: one `planner solve -o` wrote (edited or not), or one "
    "written by hand (README.md: Price a plan).")]


def estimate(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Argument(
        metavar="MODEL", show_default=False,
        help="A zoo flavor (see `planner models`), package.module:factory, hf:ConfigClass "
        "or a transformers config.json; not with --plan.")] = None,
    plan_file: Annotated[Path | None, typer.Option(
        "--plan", metavar="PLAN", show_default=False,
        help="Price this plan file as written instead (uneven layers and shares, stage "
        "devices, tp, recompute, ZeRO, schedule: a plan `solve` wrote, edited or not, or "
        "one written by hand); the options that describe a recipe are not taken with it.")
    ] = None,
    cluster: Cluster = DEFAULT_CLUSTER,
    global_batch: GlobalBatch = 512,
    seq_len: opt.SeqLen = None,
    dtype: AutoDtype = "auto",
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel degree.")] = 1,
    pp: Annotated[int | None, typer.Option(
        "--pp", help="Pipeline stages (default: 1).", show_default=False)] = None,
    dp: Annotated[int | None, typer.Option(
        "--dp", help="Pipelines (default: as many as the devices allow).")] = None,
    micro_batch: Annotated[int, typer.Option("--micro-batch")] = 1,
    recompute: Annotated[str, typer.Option(
        "--recompute", help="none, selective (Megatron's: the attention core) or full.")
    ] = "none",
    zero: Annotated[int, typer.Option("--zero", help="ZeRO stage 0-3.")] = 0,
    interleave: Annotated[int, typer.Option(
        "--interleave", help="Model chunks per device (interleaved 1F1B).")] = 1,
    schedule: Annotated[str | None, typer.Option(
        "--schedule", help="1f1b, gpipe or interleaved (with --interleave); default: 1f1b, "
        "interleaved with --interleave 2 or more.", show_default=False)] = None,
    sequence_parallel: SequenceParallel = False,
    vocab_parallel: VocabParallel = False,
    sync: Sync = "every-step",
    overlap_sync: OverlapSync = False,
    output: Output = None,
    json_out: opt.JsonOut = False,
    force: opt.Force = False,
    layers: opt.Layers = None, hidden: opt.Hidden = None, heads: opt.Heads = None,
    kv_heads: opt.KvHeads = None, ffn: opt.Ffn = None, vocab: opt.Vocab = None,
    settings: opt.Set = None,
) -> None:
    """Predict a configuration you fix (a Megatron-style TP x PP x DP recipe), or with
    --plan a plan file as written.

    Devices are taken node by node in cluster-file order, layers split as Megatron-LM
    splits them (the blocks evenly, the embedding with the first stage and the head
    with the last), the batch shared evenly (micro-batches left over go one each to the
    fastest pipelines, whatever their place in the file).

    Examples:
      planner estimate llama2-70b --cluster dgx-a100-pod --tp 8 --pp 4 --micro-batch 1
               --recompute full --interleave 2
      planner estimate --plan mine.json -o priced.json
    """
    from cost_models.model import AnalyticalCostModel
    from planner.errors import PlannerError
    from planner.files import check_writable
    from planner.solver.limits import parse_schedule
    from planner.solver.uniform import uniform_plan
    from planner.types import Schedule

    if plan_file is not None:
        _refuse_recipe(ctx, model)
        _price(plan_file, output=output, force=force, json_out=json_out)
        return
    if model is None:
        raise PlannerError("bad-option", "estimate needs a MODEL and a recipe for it (--tp, "
                           "--pp, ...), or --plan FILE to price a plan file as written.",
                           ["planner estimate llama3-8b --tp 2 --pp 2",
                            "planner estimate --plan plan.json"])
    if zero not in (0, 1, 2, 3):
        raise PlannerError("bad-option", f"--zero must be 0, 1, 2 or 3 (got {zero}).")
    if dp is not None and dp < 1:
        raise PlannerError("bad-option", f"--dp must be at least 1 (got {dp}).",
                           ["drop --dp to use as many pipelines as the devices allow"])
    chosen = parse_schedule(schedule) if schedule is not None else (
        Schedule.INTERLEAVED if interleave > 1 else Schedule.ONE_F_ONE_B)
    if chosen is Schedule.ONE_F_ONE_B and interleave > 1:
        raise PlannerError("bad-option", f"--interleave {interleave} runs interleaved 1F1B, "
                           "which contradicts --schedule 1f1b.",
                           ["drop --schedule 1f1b", "or drop --interleave"])
    if chosen is Schedule.INTERLEAVED and interleave < 2:
        raise PlannerError("bad-option", "--schedule interleaved needs model chunks per "
                           "device: give --interleave V (V of 2 or more).")
    if chosen is Schedule.GPIPE and (pp is None or pp == 1):
        raise PlannerError("bad-option", "--schedule gpipe needs pipelines of several stages, "
                           "which contradicts --pp 1" + (" (the default)" if pp is None else "")
                           + ".", ["give --pp 2 or more", "or drop --schedule gpipe"])
    pp = 1 if pp is None else pp
    asked = _fixed_sync(sync, overlap_sync, zero)
    if output is not None:
        check_writable(output, force=force)
    shape = opt.overrides(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                          ffn=ffn, vocab=vocab, settings=settings)
    graph, spec, training = _setup(model, cluster, global_batch, seq_len, dtype, shape,
                                   sequence_parallel=sequence_parallel,
                                   vocab_parallel=vocab_parallel, sync=asked)
    plan = uniform_plan(layers=graph.layers, model=graph.spec, cluster=spec,
                        training=training, costs=AnalyticalCostModel(spec), tp=tp, pp=pp,
                        dp=dp, micro_batch=micro_batch, recompute=_policies(recompute)[0],
                        zero=zero, schedule=chosen, interleave=interleave)
    _emit(plan, graph, output, force, json_out)
    _refuse_overflow(plan, graph, output)


def _fixed_sync(text: str, overlap: bool, zero: int) -> SyncSpec:
    """estimate's --sync and --overlap-sync (a recipe fixes its interval: no auto)."""
    from planner.errors import PlannerError
    from planner.sync import AUTO, check_zero, parse_sync

    if text.strip().lower() == AUTO:
        raise PlannerError("bad-option", "--sync auto lets `planner solve` pick the interval; "
                           "estimate prices the recipe given.",
                           ["give --sync local-sgd:H", "or plan with `planner solve --sync "
                            "auto --max-interval H`"])
    asked = parse_sync(text, overlap=overlap)
    check_zero(asked, zero)
    return asked


def _refuse_overflow(plan: Plan, graph: ModelGraph, output: Path | None) -> None:
    """An error, after the plan is shown (and written), where a stage does not fit its
    devices' memory."""
    from planner.errors import PlannerError
    from planner.solver.diagnose import larger_than_cluster
    from planner.solver.uniform import memory_remedies, overflows

    problems = overflows(plan.pipelines, plan.cluster)
    if problems:
        written = (f" The plan was written to {output} all the same, for `planner explain`; "
                   "`planner launch` refuses it." if output is not None else "")
        too_large = larger_than_cluster(graph.layers, plan.cluster, plan.training)
        if too_large is not None:  # (no configuration fits: say so, not how to shard)
            raise PlannerError("does-not-fit", too_large.message + written, too_large.remedies)
        raise PlannerError("does-not-fit", "This configuration does not fit in memory: "
                           + "; ".join(problems[:3]) + ("; ..." if len(problems) > 3 else ".")
                           + written, memory_remedies(plan.pipelines, plan.cluster))


# estimate's options that describe a recipe, which --plan does not take (the plan is one)
_RECIPE = ("cluster", "global_batch", "seq_len", "dtype", "tp", "pp", "dp", "micro_batch",
           "recompute", "zero", "interleave", "schedule", "sequence_parallel", "vocab_parallel",
           "sync", "overlap_sync",
           "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "settings")


def _refuse_recipe(ctx: typer.Context, model: str | None) -> None:
    """An error naming what was given beside --plan: the plan file holds the model, the
    cluster, the training and the layout, as written."""
    from planner.errors import PlannerError

    # (typer ships its own click: its ParameterSource is told by name)
    given = [param.opts[0] for param in ctx.command.params if param.name in _RECIPE
             and getattr(ctx.get_parameter_source(param.name), "name", "DEFAULT") != "DEFAULT"]
    if model is not None:
        given.insert(0, f"MODEL ({model})")
    if given:
        raise PlannerError("bad-option", f"--plan prices the plan file as written (its model, "
                           f"cluster, training and layout); {', '.join(given)} cannot change "
                           "it.", ["edit the plan file instead, or drop --plan to estimate "
                                   "a recipe"])


def _price(plan_file: Path, *, output: Path | None, force: bool, json_out: bool) -> None:
    """Price a plan file as written (`planner.price.price_file`): the plan as `solve`
    shows one, the step the simulator replays beside the closed form's, the plan
    written with its figures (`-o`)."""
    from planner.files import check_writable
    from planner.price import price_file
    from planner.solver.predict import replay

    if output is not None:
        check_writable(output, force=force)
    with err_console.status(f"Tracing the model of {escape(str(plan_file))}...",
                            spinner="dots"):
        priced = price_file(plan_file)
    plan = priced.plan
    _emit(plan, priced.graph, output, force, json_out)
    if not json_out:
        from planner.units import fmt_seconds

        simulated = replay(plan, priced.graph.layers, priced.costs).step_time
        closed = plan.prediction.step_time
        off = simulated / closed - 1
        against = (f"{abs(off):.1%} {'above' if off > 0 else 'below'}" if abs(off) >= 5e-4
                   else "as")  # (no "-0.0%")
        console.print(f"Simulated step (an event-driven replay of its schedules): "
                      f"{fmt_seconds(simulated)}, {against} the closed form's "
                      f"{fmt_seconds(closed)}.", markup=False, soft_wrap=True)
    warn_small_batch(plan)
    _refuse_overflow(plan, priced.graph, output)


def price(plan_file: PlanFile, output: Output = None, json_out: opt.JsonOut = False,
          force: opt.Force = False) -> None:
    """Price a plan file as written: `planner estimate --plan PLAN`.

    A plan `solve` wrote, edited or not, or one written by hand (a peer planner's,
    or a pipeline of your own; README.md: Price a plan): uneven layers and shares, stage
    devices, tp, recompute, ZeRO and schedule as written, priced with the cost model
    and replayed by the simulator.

    Example: planner price mine.json -o priced.json
    """
    _price(plan_file, output=output, force=force, json_out=json_out)


def register(app: typer.Typer) -> None:
    app.command("solve")(solve)
    app.command("estimate")(estimate)
    app.command("price")(price)
