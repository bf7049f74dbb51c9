"""Find the fastest plan for a model on a (heterogeneous) cluster.

    plans = solve(model_graph, cluster, TrainingSpec(global_batch=512, seq_len=2048))
    plans[0].prediction.step_time, plans[0].solver.gap

The search (`search.py`) runs on a cost table (`table.py`) built from the cost
model; `partition.py` splits layers exactly, `evaluate.py` prices structures,
`bounds.py` gives a lower bound on any plan, `build.py` turns the result into a
Plan whose predictions `predict.py` computes, and `baselines.py` prices what the
same job costs without heterogeneity-aware planning.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cost_models.model import AnalyticalCostModel, CostModel
from planner.collector import paused
from planner.errors import PlannerError, closest
from planner.solver.baselines import baseline_plans, fastest_type, never_slower
from planner.solver.bounds import lower_bound
from planner.solver.build import from_evaluation
from planner.solver.diagnose import diagnose
from planner.solver.evaluate import Space
from planner.solver.interleave import choices
from planner.solver.limits import Limits, check_global_batch, schedule_name
from planner.solver.search import Progress, SearchResult, search
from planner.solver.table import CostTable, build_table, check_tp_divides
from planner.types import ClusterSpec, ModelGraph, Plan, Schedule, SolverReport, TrainingSpec

__all__ = ["Limits", "Progress", "SolveOptions", "Space", "solve"]


@dataclass(frozen=True)
class SolveOptions:
    limits: Limits = field(default_factory=Limits)
    space: Space = field(default_factory=Space)
    exclude: tuple[str, ...] = ()  # node names not to use
    top_k: int = 1
    gap: float = 0.005  # stop when no structure can be this much faster
    time_limit: float | None = None
    tps: tuple[int, ...] = (1, 2, 4, 8, 16)
    micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    with_baselines: bool = True


def _check(model: ModelGraph, cluster: ClusterSpec, training: TrainingSpec,
           options: SolveOptions) -> ClusterSpec:
    check_global_batch(training.global_batch)
    limits = options.limits
    for flag, value in (("--tp", limits.tp), ("--max-tp", limits.max_tp), ("--pp", limits.pp),
                        ("--dp", limits.dp), ("--max-dp", limits.max_dp),
                        ("--micro-batch", limits.micro_batch),
                        ("--max-stages", limits.max_stages), ("--interleave", limits.interleave),
                        ("--max-interleave", max(limits.interleaves, default=0))):
        if value is not None and value < 1:
            raise PlannerError("bad-option", f"{flag} must be at least 1 (got {value}).")
    # contradictions between options first: they say more than what either one rules out
    for fixed, most, name in ((limits.tp, limits.max_tp, "tp"), (limits.dp, limits.max_dp, "dp")):
        if fixed is not None and most is not None and fixed > most:
            raise PlannerError("bad-option", f"--{name} {fixed} contradicts --max-{name} "
                               f"{most}.", ["drop one of them"])
    if limits.tp is not None and limits.tp_per_class:
        raise PlannerError("bad-option", f"--tp-per-class lets each pipeline class take its "
                           f"own tensor-parallel degree, which contradicts --tp {limits.tp} "
                           "(one degree for every stage).",
                           ["drop --tp-per-class",
                            f"or bound the degrees with --max-tp {limits.tp} instead of --tp"])
    _check_schedule(limits)
    _check_interleave(limits, len(model.layers))
    # --max-stages bounds a free --pp; only one the user changed contradicts a fixed one
    if (limits.pp is not None and limits.max_stages < limits.pp
            and limits.max_stages != Limits().max_stages):
        raise PlannerError("bad-option", f"--pp {limits.pp} contradicts --max-stages "
                           f"{limits.max_stages}.", ["drop one of them, or raise --max-stages"])
    if options.time_limit is not None and not options.time_limit >= 0:  # (NaN too)
        raise PlannerError("bad-option", f"--time-limit must be a number of seconds, at "
                           f"least 0 (got {options.time_limit:g}).")
    if not 0 <= options.gap < 1:
        raise PlannerError("bad-option", f"--gap is a fraction in [0, 1) (got {options.gap:g}).")
    unknown = [n for n in options.exclude if n not in {x.name for x in cluster.nodes}]
    if unknown:
        raise PlannerError("bad-option", f"--exclude names node {unknown[0]!r}, which cluster "
                           f"{cluster.name} does not have.",
                           [f"use one of {', '.join(n.name for n in cluster.nodes)}"])
    used = dataclasses.replace(cluster, nodes=tuple(n for n in cluster.nodes
                                                    if n.name not in options.exclude))
    if not used.nodes:
        raise PlannerError("no-devices", "Every node is excluded: the cluster has no usable "
                           "device.", ["drop some --exclude options"])
    tp = limits.tp
    usable = [t for t in options.tps if any(n.devices % t == 0 for n in used.nodes)]
    if tp is not None and tp not in usable:
        raise PlannerError(
            "bad-option", f"--tp {tp} cannot be used: tensor parallelism stays inside a node "
            f"and splits it evenly, and the nodes have "
            f"{' or '.join(map(str, sorted({n.devices for n in used.nodes})))} devices.",
            [f"use one of --tp {', '.join(map(str, usable))}"])
    if tp is not None:
        check_tp_divides(model.layers, tp, usable)
    devices = sum(n.devices for n in used.nodes)
    least = (limits.pp or 1) * (tp or 1)  # devices a pipeline takes at least
    if (limits.dp or 1) * least > devices:
        what = (f"--dp {limits.dp} pipelines" if limits.dp else "A pipeline") + (
            f" of --pp {limits.pp} stages" if limits.pp else "") + (
            f" with --tp {tp}" if tp else "")
        raise PlannerError(
            "bad-option", f"{what} need{'' if limits.dp else 's'} {(limits.dp or 1) * least} "
            "devices, but the usable "
            f"nodes of cluster {cluster.name} have {devices}.",
            ["lower " + " or ".join(f for f, v in (("--dp", limits.dp), ("--pp", limits.pp),
                                                   ("--tp", tp)) if v), "add devices"])
    if limits.pp is not None and limits.pp > len(model.layers):
        raise PlannerError("bad-option", f"--pp {limits.pp} is more stages than the model has "
                           f"layers ({len(model.layers)}).", [f"use --pp {len(model.layers)} "
                                                              "or less"])
    mb = limits.micro_batch
    if mb is not None and training.global_batch % mb:
        raise PlannerError("bad-option", f"--micro-batch {mb} does not divide the global batch "
                           f"{training.global_batch}.", ["pick a divisor of the global batch"])
    if limits.dp is not None and limits.dp > training.global_batch:
        raise PlannerError("bad-option", f"--dp {limits.dp} pipelines cannot share a global "
                           f"batch of {training.global_batch}.", ["lower --dp"])
    _check_interleave_batch(limits, len(model.layers), training.global_batch)
    return used


def _check_schedule(limits: Limits) -> None:
    """A fixed schedule must agree with the chunk counts and the stages allowed."""
    schedule, v = limits.schedule, limits.interleave
    if schedule is None:
        return
    name = f"--schedule {schedule_name(schedule)}"
    if schedule is Schedule.INTERLEAVED and (v or max(limits.interleaves, default=1)) < 2:
        raise PlannerError("bad-option", f"{name} needs model chunks per device: give "
                           "--interleave V or --max-interleave V (V of 2 or more).")
    if schedule is not Schedule.INTERLEAVED and v is not None and v > 1:
        raise PlannerError("bad-option", f"--interleave {v} runs interleaved 1F1B, which "
                           f"contradicts {name}.", ["drop one of them"])
    one = _one_stage(limits)
    if schedule is not Schedule.ONE_F_ONE_B and one:
        raise PlannerError("bad-option", f"{name} needs pipelines of several stages, which "
                           f"contradicts {one}.", ["drop one of them"])


def _one_stage(limits: Limits) -> str | None:
    """The option that allows pipelines of one stage only, as given (None: several
    stages are allowed)."""
    if limits.pp == 1:
        return "--pp 1"
    if limits.pp is None and limits.max_stages == 1:
        return "--max-stages 1"
    return None


def _check_interleave(limits: Limits, layers: int) -> None:
    """A fixed chunk count must cut the layers into equal rounds, over several stages."""
    v = limits.interleave
    if (limits.schedule is Schedule.INTERLEAVED and v is None
            and max(choices(layers, limits.interleaves), default=1) < 2):
        fits = choices(layers, tuple(range(2, 9)))
        raise PlannerError(
            "bad-option", f"--schedule interleaved: no chunk count up to --max-interleave "
            f"{max(limits.interleaves)} cuts the model's {layers} layers into equal rounds of "
            "two or more (the solver splits every round alike, Megatron-style).",
            [f"use --max-interleave {fits[0]}" if fits else "drop --schedule interleaved"])
    if v is None or v == 1:
        return
    if _one_stage(limits):
        raise PlannerError("bad-option", f"--interleave {v} needs pipelines of several "
                           f"stages, which contradicts {_one_stage(limits)}.",
                           ["drop one of them"])
    if not choices(layers, (v,)):
        fits = choices(layers, tuple(range(1, 9)))
        raise PlannerError(
            "bad-option", f"--interleave {v} cannot cut the model's {layers} layers into {v} "
            "equal rounds of two or more (the solver splits every round alike, "
            "Megatron-style).", [f"use one of --interleave {', '.join(map(str, fits))}"])
    if limits.pp is not None and limits.pp > layers // v:
        raise PlannerError(
            "bad-option", f"--pp {limits.pp} with --interleave {v}: each of the {v} rounds "
            f"has {layers // v} of the model's {layers} layers, too few for a chunk on every "
            "one of its stages.", [f"use --pp {layers // v} or less",
                                   "use a smaller --interleave, or drop it"])


def _check_interleave_batch(limits: Limits, layers: int, batch: int) -> None:
    """Interleaved 1F1B runs a whole multiple of its stages in micro-batches on every
    pipeline: where it is required (--interleave V, --schedule interleaved), the global
    batch must allow that, for --pp stages (every pipeline alike), or for two or more
    (pipelines of several depths may share any larger batch)."""
    v = limits.interleave
    if v is not None and v > 1:
        what, counts = f"--interleave {v}", (v,)
    elif v is None and limits.schedule is Schedule.INTERLEAVED:
        what, counts = "--schedule interleaved", tuple(
            c for c in choices(layers, limits.interleaves) if c > 1)
    else:
        return
    mb = limits.micro_batch or 1  # (the most micro-batches: any other size is no better)
    total, dp = batch // mb, limits.dp or 1
    pp = limits.pp or 2
    if (total % pp == 0 or limits.pp is None) and total >= dp * pp:
        return
    pipes = "every pipeline" if limits.dp is None else f"each of the --dp {dp} pipelines"
    batch_is = (f"the global batch of {batch}" if limits.micro_batch is None else
                f"the {total} micro-batches of --micro-batch {mb} in a global batch of "
                f"{batch}")
    runs = (f"a whole multiple of its {pp} stages" if limits.pp else
            "a whole multiple of its stages, two or more,")
    most = max((layers // c for c in counts), default=1)
    fits = [k for k in range(2, most + 1) if total % k == 0 and total >= dp * k]
    raise PlannerError(
        "bad-option", f"{what}{f' with --pp {pp}' if limits.pp else ''}: interleaved 1F1B "
        f"runs {runs} in micro-batches on {pipes}, which {batch_is} cannot be.",
        [f"use a global batch that is a multiple of {pp * mb}"
         + (f", at least {dp * pp * mb}" if dp > 1 else ""),
         *([f"lower --dp {dp}"] if dp > 1 else []),
         *([f"use {'one of ' if len(fits) > 1 else ''}--pp {', '.join(map(str, fits))}"]
           if fits and limits.pp else []),
         f"drop {what}"])


def pinned_type(name: str, types: list[str]) -> str | None:
    """The device type among `types` that a stage pin names (any case, or a catalog
    alias such as A100-40G for A100-40G-SXM), or None."""
    from cost_models import catalog

    by_lower = {t.lower(): t for t in types}
    if name.lower() in by_lower:
        return by_lower[name.lower()]
    try:
        return by_lower.get(catalog.device(name).name.lower())
    except PlannerError:
        return None


def _resolve_pins(limits: Limits, cluster: ClusterSpec, whole: ClusterSpec) -> Limits:
    """The limits with their stage pins named as the device types of `cluster` (the
    nodes left to use of `whole`); an error for a pin no usable node has, naming the
    excluded nodes that have it."""
    types = sorted({n.device.name for n in cluster.nodes})
    resolved = {}
    for flag, field_name in (("--first-stage", "first_stage"), ("--last-stage", "last_stage")):
        pinned = getattr(limits, field_name)
        if pinned is None:
            continue
        resolved[field_name] = pinned_type(pinned, types)
        if resolved[field_name] is not None:
            continue
        kind = pinned_type(pinned, sorted({n.device.name for n in whole.nodes}))
        left_out = [n.name for n in whole.nodes if n.device.name == kind and n not in
                    cluster.nodes]
        if left_out:
            raise PlannerError("bad-option", f"{flag} {pinned}: only nodes that --exclude "
                               f"leaves out ({', '.join(left_out)}) have that device type.",
                               [f"drop --exclude {left_out[0]}" if len(left_out) == 1 else
                                "use some of those nodes (drop their --exclude)",
                                f"or pin one of {', '.join(types)}"])
        near = closest(pinned, types)
        raise PlannerError("bad-option", f"{flag} {pinned}: no usable node has that device "
                           "type" + (f"; did you mean {near[0]}?" if near else "."),
                           [f"use one of {', '.join(types)}"])
    first, last = resolved.get("first_stage"), resolved.get("last_stage")
    if first and last and first != last and (_one_stage(limits) or not limits.mixed):
        flag = _one_stage(limits) or "--no-mixed"
        raise PlannerError("bad-option", f"--first-stage {limits.first_stage} and --last-stage "
                           f"{limits.last_stage} put two device types in every pipeline, which "
                           f"{flag} rules out.", [f"drop {flag} or one of the pins"])
    return dataclasses.replace(limits, **resolved)


def _fastest_only(cluster: ClusterSpec, dtype: str) -> ClusterSpec:
    fastest = fastest_type(cluster, dtype)
    return dataclasses.replace(cluster, nodes=tuple(n for n in cluster.nodes
                                                    if n.device.name == fastest.name))


def _search(model: ModelGraph, cluster: ClusterSpec, training: TrainingSpec,
            options: SolveOptions, costs: CostModel, seeds: tuple = (),
            progress: Callable[[Progress], None] | None = None,
            table: CostTable | None = None) -> tuple[CostTable, SearchResult]:
    """The search on `table` (else one built for the cluster: a table built for the same
    cluster and options, with what it memoised, serves another search)."""
    if table is None:
        tps = [t for t in options.tps if options.limits.max_tp is None
               or t <= options.limits.max_tp]
        table = build_table(model.layers, cluster, training, costs, tps=tps,
                            micro_batches=options.micro_batches)
    try:
        result = search(table, training.global_batch, limits=options.limits,
                        space=options.space, top_k=options.top_k, gap=options.gap,
                        time_limit=options.time_limit, seeds=seeds, progress=progress)
    except PlannerError as exc:
        if exc.kind != "infeasible":
            raise
        raise diagnose(model.layers, cluster, training, costs, options.limits,
                       options.space, options.exclude) from None
    return table, result


def _plans(result: SearchResult, floor: float, model: ModelGraph, cluster: ClusterSpec,
           training: TrainingSpec, costs: CostModel, wall_time: float) -> list[Plan]:
    """The plans of `result`; `wall_time`: the seconds their report says the solve took."""
    plans = []
    for evaluation in result.best:
        objective = evaluation.step_time
        bound = min(result.bound, objective)
        report = SolverReport(
            status=result.status, objective=objective, best_bound=bound,
            gap=(objective - bound) / objective, wall_time=wall_time,
            lower_bound=floor, explored=result.explored, pruned=result.pruned,
            search_space=result.space)
        plans.append(from_evaluation(evaluation, model=model.spec, training=training,
                                     cluster=cluster, layers=model.layers, costs=costs,
                                     solver=report))
    return plans


def solve(model: ModelGraph, cluster: ClusterSpec, training: TrainingSpec,
          options: SolveOptions | None = None, *, costs: CostModel | None = None,
          progress: Callable[[Progress], None] | None = None) -> list[Plan]:
    """The best `top_k` plans, best first; each carries its solver report, the first
    also the baselines. The best plan on the fastest device type alone is searched
    first: it is a baseline and a good first plan for the full search to beat.
    Ctrl-C stops the search with the best plans found so far (status "interrupted"):
    during the first search, the full one only prices what it found."""
    with paused():  # (it makes no cyclic garbage)
        return _solve(model, cluster, training, options or SolveOptions(), costs, progress)


def _narrower_first(model: ModelGraph, cluster: ClusterSpec, training: TrainingSpec,
                    options: SolveOptions, costs: CostModel, seeds: tuple, start: float
                    ) -> tuple[SearchResult | None, CostTable | None]:
    """With --tp-per-class or --mixed-share-types, the best plans of the default space
    (`options`: one tensor-parallel degree for every class, mixed classes on disjoint
    types) first, in at most two thirds of the time left: a far smaller space whose plans
    are plans of the larger one, so they seed its search, which then returns none slower
    (at 1,024 GPUs the larger search alone stopped at 20.3 s in 10 s, where one degree
    gives 19.5 s; with half the time, the one-degree search stopped at 19.7 s, finding
    19.5 s after 5 s; on the measured-per-node scenario, classes sharing types alone
    stopped at 28.9 s in 60 s, where the default space gives 19.96 s). Returns its
    result (None if no plan is in it) and the cost table, for the larger search to go
    on with."""
    limit = options.time_limit
    if limit is not None:
        limit = max(0.0, limit - (time.perf_counter() - start)) * 2 / 3
    try:
        table, result = _search(model, cluster, training,
                                dataclasses.replace(options, time_limit=limit), costs, seeds)
    except PlannerError as exc:  # (no plan with one degree: the larger search goes on)
        if exc.kind != "infeasible":
            raise
        return None, None
    return result, table


def _solve(model: ModelGraph, cluster: ClusterSpec, training: TrainingSpec,
           options: SolveOptions, costs: CostModel | None,
           progress: Callable[[Progress], None] | None) -> list[Plan]:
    start = time.perf_counter()  # (the report's wall time: the whole solve but baselines)
    if training.sync.local:  # each pipeline keeps its optimizer state whole (`planner.sync`)
        options = dataclasses.replace(options, space=dataclasses.replace(options.space,
                                                                         zeros=(0,)))
    used = _check(model, cluster, training, options)
    options = dataclasses.replace(options, limits=_resolve_pins(options.limits, used, cluster))
    costs = costs or AnalyticalCostModel(cluster)
    alone_cluster = _fastest_only(used, training.dtype)
    alone: list[Plan] = []
    alone_error: PlannerError | None = None  # why the fastest type alone has no plan
    seeds: tuple = ()
    # the default space (one degree per plan, mixed classes on disjoint types): searched
    # first where the options widen it (`_narrower_first`); one type alone has one class
    one_degree = dataclasses.replace(options, limits=dataclasses.replace(
        options.limits, tp_per_class=False, mixed_share_types=False))
    if len(alone_cluster.nodes) == len(used.nodes):
        options = one_degree
    else:
        try:  # a quarter of the time limit at most: the full search is what counts
            _, result = _search(model, alone_cluster, training, dataclasses.replace(
                one_degree, top_k=1, time_limit=options.time_limit and options.time_limit / 4),
                costs)
            alone = _plans(result, 0.0, model, alone_cluster, training, costs,
                           time.perf_counter() - start)
            seeds = tuple((e.config, e.shapes) for e in result.best)
        except PlannerError as exc:  # the baseline says why (memory, or the constraints)
            alone_error = exc
    interrupted = bool(alone) and alone[0].solver.status == "interrupted"
    wider = options.limits.tp_per_class or options.limits.mixed_share_types
    table = first = None
    if wider:
        if not interrupted:
            first, table = _narrower_first(model, used, training, one_degree, costs, seeds,
                                           start)
        if first is not None:
            seeds += tuple((e.config, e.shapes) for e in first.best)
            interrupted = first.status == "interrupted"
        if options.limits.mixed_share_types:  # (its families differ: a table of its own)
            table = None
        if options.limits.tp_per_class:
            seeds = tuple((dataclasses.replace(config, tp=None), shapes)
                          for config, shapes in seeds)  # (every class at its own degree)
    if interrupted:  # the full search prices the seeds and stops
        options = dataclasses.replace(options, time_limit=0.0)
    elif options.time_limit is not None:  # the searches share the limit
        options = dataclasses.replace(options, time_limit=max(
            options.time_limit / (4 if wider else 2),
            options.time_limit - (time.perf_counter() - start)))
    table, result = _search(model, used, training, options, costs, seeds, progress, table)
    if first is not None:  # (its search began with the one-degree one)
        result = dataclasses.replace(result, explored=first.explored + result.explored,
                                     pruned=first.pruned + result.pruned)
    if interrupted and result.status != "optimal":
        result = dataclasses.replace(result, status="interrupted")
    plans = _plans(result, lower_bound(table, training.global_batch), model, cluster,
                   training, costs, time.perf_counter() - start)
    if options.with_baselines:
        def fastest_alone(_: ClusterSpec) -> Plan | None:
            if alone:
                return alone[0]
            if alone_error is not None:
                raise alone_error
            return plans[0] if len(alone_cluster.nodes) == len(used.nodes) else None

        plans[0] = never_slower(plans[0], baseline_plans(
            layers=model.layers, model=model.spec, cluster=used, training=training,
            costs=costs, fastest_alone=fastest_alone, limits=options.limits,
            space=options.space))
    return plans
