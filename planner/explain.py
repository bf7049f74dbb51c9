"""Why a plan looks the way it does: stage timings, the device map, memory by term,
communication per link, the binding constraint, the bottleneck stage, and why
the runner-up plans and baselines lose.

    graph = retrace(plan)                        # the plan's model, traced again
    analysis = analyze(plan, graph.layers)       # everything `planner explain` shows
    analysis.explanation.reasons[0].text

All figures come from the same cost model as the solver (`planner.solver.predict`)
and the step replay (`planner.simulate`); nothing here changes a plan. `planner explain`
prices a plan file as written first (`planner.price.price_file`), so the prediction and
memory shown are the plan's own, not figures stored before it was edited.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cost_models.comm import Collective, CommGroup, group_links, shared_by
from cost_models.model import AnalyticalCostModel, CostModel
from planner.data.loading import plan_loading
from planner.dtypes import dtype_bytes
from planner.price import check_layers, replicas, stage_memory
from planner.solver.predict import (
    Holders,
    lead_broadcast,
    lead_layers,
    pipeline_sends,
    pipeline_times,
    plan_send_sharing,
    stage_timings,
)
from planner.sync import sync_note
from planner.timeline import Timeline, build_timeline, ranges, timeline_dict
from planner.types import (
    CostBreakdown,
    Layer,
    ModelGraph,
    Plan,
    Recompute,
    StagePlan,
    SyncAlgorithm,
)
from planner.units import fmt_bytes, fmt_seconds

TERMS = ("compute", "bubble", "tp_comm", "pp_comm", "dp_comm", "optimizer")
TERM_WORDS = {"compute": "compute", "bubble": "pipeline bubble", "tp_comm": "tensor-parallel "
              "communication", "pp_comm": "pipeline communication", "dp_comm": "gradient sync",
              "optimizer": "optimizer step"}


# ---------------------------------------------------------------- tracing the plan's model

def retrace(plan: Plan, source: str = "") -> ModelGraph:
    """The plan's model traced again (batch 1, the plan's sequence length and dtype),
    checked against the plan's stages (`source`: the plan file, which errors name), its
    layers as the plan's tensor-parallel options run them (`tensor_parallel.as_trained`)."""
    from cost_models.tensor_parallel import as_trained
    from planner.trace.cache import cached_trace

    graph = cached_trace(plan.model, seq_len=plan.training.seq_len, dtype=plan.training.dtype)
    check_layers(plan, graph.layers, source)
    return dataclasses.replace(graph, layers=as_trained(graph.layers, plan.training))


# ---------------------------------------------------------------- tables

@dataclass(frozen=True)
class StageRow:
    pipelines: tuple[int, ...]
    stage: int
    layers: str
    device_type: str
    nodes: tuple[str, ...]
    tp: int
    micro_batch: int
    microbatches: int
    schedule: str  # `PipelinePlan.schedule_note`
    recompute: str
    zero: int
    fwd: float  # seconds per micro-batch, tp communication included
    bwd: float  # recompute included
    recompute_time: float
    tp_time: float
    send: float
    busy_share: float  # busy / the pipeline's slowest stage


@dataclass(frozen=True)
class DeviceRow:
    node: str
    device_type: str
    device: int
    role: str  # "p0 s1 tp0/2", or "idle"


@dataclass(frozen=True)
class MemoryRow:
    pipelines: tuple[int, ...]
    stage: int
    node: str
    device_type: str
    capacity: float
    terms: Mapping[str, float]
    total: float

    @property
    def fraction(self) -> float:
        return self.total / self.capacity if self.capacity else 0.0


@dataclass(frozen=True)
class TrafficRow:
    kind: str  # "pp activations", "tp all-reduce", "tp broadcast", "dp all-reduce",
    # "zero-3 gather"
    where: str
    link: str
    bandwidth: float
    bytes_per_step: float  # bytes a device (pp: one pipeline's stages; dp: a node) sends
    seconds: float  # the cost model's time for that traffic, per step


@dataclass(frozen=True)
class Reason:
    kind: str  # constraint, memory, compute, communication, bubble, idle, balance, bound
    text: str


@dataclass(frozen=True)
class Alternative:
    name: str
    description: str
    step_time: float | None
    slower_by: float | None  # fraction slower than the plan
    why: str


@dataclass(frozen=True)
class Bottleneck:
    pipeline: int
    stage: int
    node: str
    device_type: str
    tp: int
    layers: str
    busy: float  # seconds per micro-batch
    mean_busy: float  # the pipeline's mean stage
    share: float  # of the step time


@dataclass(frozen=True)
class Explanation:
    headline: str
    binding: str  # what limits the plan most, in a few words
    structure: str
    bottleneck: Bottleneck
    reasons: tuple[Reason, ...]
    alternatives: tuple[Alternative, ...]


@dataclass(frozen=True)
class Analysis:
    plan: Plan
    stages: tuple[StageRow, ...]
    devices: tuple[DeviceRow, ...]
    memory: tuple[MemoryRow, ...]
    traffic: tuple[TrafficRow, ...]
    timeline: Timeline
    explanation: Explanation


def _layer_text(stage: StagePlan, names: Sequence[str] | None) -> str:
    parts = []
    for a, b in stage.chunks:
        if names is None:
            parts.append(f"{a}-{b - 1}" if b - a > 1 else str(a))
        else:
            parts.append(names[a] if b - a == 1 else f"{names[a]} .. {names[b - 1]}")
    return " + ".join(parts)


def _classes(plan: Plan, timings: Sequence[Sequence[object]]) -> list[list[int]]:
    """Pipelines with identical stages, timings and micro-batch counts."""
    groups: dict[tuple, list[int]] = {}
    for p, pipe in enumerate(plan.pipelines):
        key = (tuple(timings[p]), pipe.num_microbatches, pipe.micro_batch,
               tuple((s.layers, s.chunks, s.device_type, s.tp, s.recompute, s.zero,
                      s.memory) for s in pipe.stages))
        groups.setdefault(key, []).append(p)
    return list(groups.values())


def stage_rows(plan: Plan, layers: Sequence[Layer], costs: CostModel) -> list[StageRow]:
    timings = stage_timings(plan, layers, costs)
    names = [layer.name for layer in layers]
    rows = []
    for members in _classes(plan, timings):
        rep = plan.pipelines[members[0]]
        busiest = max(t.busy for t in timings[members[0]]) or 1.0
        for s, t in zip(rep.stages, timings[members[0]], strict=True):
            nodes = tuple(sorted({plan.pipelines[m].stages[s.index].devices.node
                                  for m in members}))
            rows.append(StageRow(
                pipelines=tuple(members), stage=s.index, layers=_layer_text(s, names),
                device_type=s.device_type, nodes=nodes, tp=s.tp, micro_batch=rep.micro_batch,
                microbatches=rep.num_microbatches, schedule=rep.schedule_note(),
                recompute=s.recompute.value, zero=s.zero,
                fwd=t.fwd, bwd=t.bwd, recompute_time=t.recompute, tp_time=t.tp_fwd + t.tp_bwd,
                send=t.send, busy_share=t.busy / busiest))
    return rows


def device_map(plan: Plan) -> list[DeviceRow]:
    roles: dict[tuple[str, int], list[str]] = {}
    for p in plan.pipelines:
        for s in p.stages:
            for rank, d in enumerate(s.devices.devices):
                tp = f" tp{rank}/{s.tp}" if s.tp > 1 else ""
                roles.setdefault((s.devices.node, d), []).append(f"p{p.index} s{s.index}{tp}")
    return [DeviceRow(node=n.name, device_type=n.device.name, device=d,
                      role=", ".join(roles.get((n.name, d), ["idle"])))
            for n in plan.cluster.nodes for d in range(n.devices)]


def memory_rows(plan: Plan) -> list[MemoryRow]:
    groups: dict[tuple, list[int]] = {}
    for p, pipe in enumerate(plan.pipelines):
        for s in pipe.stages:
            key = (s.index, s.device_type, s.memory, tuple(
                (x.device_type, x.memory) for x in pipe.stages))
            groups.setdefault(key, []).append(p)
    rows = []
    for (index, kind, memory, _), members in groups.items():
        nodes = list(dict.fromkeys(plan.pipelines[p].stages[index].devices.node
                                   for p in members))
        node = nodes[0] + (f" +{len(nodes) - 1} more" if len(nodes) > 1 else "")
        rows.append(MemoryRow(pipelines=tuple(members), stage=index, node=node, device_type=kind,
                              capacity=plan.cluster.node(nodes[0]).device.memory,
                              terms=memory.terms(), total=memory.total))
    rows.sort(key=lambda r: (r.pipelines[0], r.stage))
    return rows


def traffic(plan: Plan, layers: Sequence[Layer], costs: CostModel) -> list[TrafficRow]:
    """Bytes and seconds per step on each kind of link, as the cost model prices them."""
    cluster = costs.cluster
    rows: list[TrafficRow] = []
    grad = plan.training.optimizer.grad_bytes or float(dtype_bytes(plan.training.dtype))
    weight = float(dtype_bytes(plan.training.dtype))
    # per pair of nodes, per pipeline sending between them: its bytes and seconds
    pp: dict[tuple[str, str], dict[int, list[float]]] = {}
    tp: dict[str, list[float]] = {}
    leads_of: dict[tuple[str, int], list[float]] = {}  # (node, tp): bytes, seconds
    flows = plan_send_sharing(plan)
    for pipe in plan.pipelines:
        mb, m = pipe.micro_batch, pipe.num_microbatches
        for sender, receiver, outputs in pipeline_sends(pipe):
            node, nxt = sender.devices.node, receiver.devices.node
            entry = pp.setdefault((node, nxt), {}).setdefault(pipe.index, [0.0, 0.0])
            # each chunk's output goes on (interleaved, the last stage's back to the
            # first), forward and back (its gradient)
            entry[0] += 2 * sum(layers[i].output_bytes for i in outputs) * mb * m
            # seconds as `predict` prices them: the largest chunk's output, its share
            # of the cards it crosses, for each chunk
            nbytes = max(layers[i].output_bytes for i in outputs) * mb
            shared = costs.p2p_time(nbytes * shared_by(flows, node, nxt), node, nxt)
            entry[1] += 2 * shared * m * len(outputs)
        for s in pipe.stages:
            node = s.devices.node
            held = [layers[j] for j in s.held()]
            if s.tp > 1:
                group = CommGroup(((node, s.tp),))
                per = sum(layer.tp_comm_bytes for layer in held) * mb
                count = 2 * m  # forward and backward all-reduces per micro-batch
                seconds = sum(costs.collective_time(Collective.ALL_REDUCE,
                                                    layer.tp_comm_bytes * mb, group)
                              for layer in held) * count
                entry = tp.setdefault(node, [0.0, 0.0])
                entry[0] = max(entry[0], per * count * 2 * (s.tp - 1) / s.tp)
                entry[1] = max(entry[1], seconds)
        for s, leads in zip(pipe.stages, lead_layers(pipe), strict=True):
            if any(layer is not None for layer in leads):  # (a stage wider than its
                led = leads_of.setdefault((s.devices.node, s.tp), [0.0, 0.0])  # neighbour)
                led[0] = max(led[0], sum(layers[i].output_bytes for i in leads
                                         if i is not None) * mb * m)
                led[1] = max(led[1], m * sum(lead_broadcast(s, i, layers, mb, costs)
                                             for i in leads))
    for (a, b), pipes in pp.items():
        link = cluster.link_between(a, b)
        ways = shared_by(flows, a, b)
        # the pipelines send side by side (sharing the cards): a row is one pipeline's,
        # the most of any
        where = f"{a} -> {b}" + (f", each of {len(pipes)} pipelines" if len(pipes) > 1 else "")
        rows.append(TrafficRow(kind="pp activations", where=where + (
            f", {ways} sends per network card" if ways > 1 else ""), link=link.name,
                               bandwidth=link.bandwidth,
                               bytes_per_step=max(e[0] for e in pipes.values()),
                               seconds=max(e[1] for e in pipes.values())))
    for node, (nbytes, seconds) in tp.items():
        link = cluster.node(node).intra_link
        rows.append(TrafficRow(kind="tp all-reduce", where=f"inside {node}", link=link.name,
                               bandwidth=link.bandwidth, bytes_per_step=nbytes,
                               seconds=seconds))
    for (node, width), (nbytes, seconds) in leads_of.items():
        link = cluster.node(node).intra_link
        rows.append(TrafficRow(
            kind="tp broadcast", where=f"inside {node}: a tp-{width} stage's first rank "
            "to the others (its pipeline's neighbour stage is narrower)", link=link.name,
            bandwidth=link.bandwidth, bytes_per_step=nbytes, seconds=seconds))
    seen: set[tuple] = set()
    holders: dict[int, list[str]] = {}
    stages = [s for p in plan.pipelines for s in p.stages]
    for s in stages:
        holders.setdefault(s.layers[0], [x.devices.node for x in stages
                                          if x.holds(s.layers[0])])
    for s in stages:
        key = (s.layers, s.device_type, s.tp, s.zero)
        if key in seen:
            continue
        seen.add(key)
        params = sum(layers[i].params for i in s.held())
        replicas = [x.devices.node for x in stages
                    if (x.layers, x.device_type, x.tp) == (s.layers, s.device_type, s.tp)]
        layer_text = f"layers {_layer_text(s, None)} ({s.device_type})"  # (its chunks)
        if s.zero < 3:
            group = CommGroup.of(holders[s.layers[0]])
            n = group.size
            if n > 1:
                intra, inter = group_links(cluster, group)
                link = inter.slowest(intra) if inter else intra
                # (the plan's choice, `StagePlan.grad_sync`, where it is not the ring)
                how = ", hierarchical" if s.grad_sync is SyncAlgorithm.HIERARCHICAL else ""
                rows.append(TrafficRow(
                    kind="dp all-reduce", where=f"{layer_text}, {n} replicas on "
                    f"{len(group.members)} node(s){how}", link=link.name if link else "-",
                    bandwidth=link.bandwidth if link else 0.0,
                    bytes_per_step=params * grad * 2 * (n - 1) / n,
                    seconds=costs.collective_time(Collective.ALL_REDUCE, params * grad, group)))
        elif len(replicas) > 1:
            group = CommGroup.of(replicas)
            n = group.size
            intra, inter = group_links(cluster, group)
            link = inter.slowest(intra) if inter else intra
            m = max(p.num_microbatches for p in plan.pipelines)
            nbytes = params / s.tp * weight
            chunks = [sum(layers[i].params for i in range(a, b)) / s.tp * weight
                      for a, b in s.chunks]  # (interleaved, each chunk gathers its own)
            rows.append(TrafficRow(
                kind="zero-3 gather", where=f"{layer_text}, {n} shards", link=link.name
                if link else "-", bandwidth=link.bandwidth if link else 0.0,
                bytes_per_step=3 * m * nbytes * (n - 1) / n,
                seconds=3 * m * sum(costs.collective_time(Collective.ALL_GATHER, c, group)
                                    for c in chunks)))
    return rows


# ---------------------------------------------------------------- the explanation

def structure(plan: Plan) -> str:
    """`4 x (V100-32G > A100-80G-SXM), tp 1, micro-batch 16`."""
    classes: dict[tuple, int] = {}
    for p in plan.pipelines:
        key = tuple(f"{s.device_type}" + (f" x{s.tp}" if s.tp > 1 else "") for s in p.stages)
        classes[key] = classes.get(key, 0) + 1
    shapes = " + ".join(f"{n} x ({' > '.join(k)})" for k, n in classes.items())
    tps = sorted({s.tp for p in plan.pipelines for s in p.stages})
    mbs = sorted({p.micro_batch for p in plan.pipelines})
    return (f"{shapes}; tp {', '.join(map(str, tps))}, micro-batch "
            f"{', '.join(map(str, mbs))}")


def why_slower(best: CostBreakdown, other: CostBreakdown) -> str:
    """Which terms make `other` slower than `best`, largest first."""
    deltas = {t: getattr(other, t) - getattr(best, t) for t in TERMS}
    total = other.step_time - best.step_time
    worse = sorted((t for t in TERMS if deltas[t] > 0), key=lambda t: -deltas[t])
    better = sorted((t for t in TERMS if deltas[t] < 0), key=lambda t: deltas[t])
    if abs(total) <= 1e-9 * best.step_time:
        return "as fast as this plan (a tie in the cost model)"
    if total < 0:
        return ("faster than this plan: outside the constraints it was solved under (or the "
                "search stopped before finding it)")
    words = [f"+{fmt_seconds(deltas[t])} {TERM_WORDS[t]}" for t in worse
             if deltas[t] >= 0.1 * total] or \
            [f"+{fmt_seconds(deltas[t])} {TERM_WORDS[t]}" for t in worse[:1]]
    text = ", ".join(words)
    if better and -deltas[better[0]] >= 0.05 * total:
        text += (f" (it saves {fmt_seconds(-deltas[better[0]])} of "
                 f"{TERM_WORDS[better[0]]})")
    return text


def _shared_card(plan: Plan) -> tuple[str, int] | None:
    """The node whose network card carries the most gradient all-reduces across nodes,
    and how many, if several: those of the stages it holds (each among every stage
    holding its first layer; ZeRO-3 stages only where other classes hold it too), as
    `predict.sync_and_optimizer` charges them."""
    held = Holders(plan)
    charged: dict[str, set[tuple[int, int]]] = {}
    for s in held.stages:
        holders = held.holders(s.layers[0])
        if len(set(holders)) > 1 and (s.zero < 3 or len(holders) > len(held.of(s))):
            charged.setdefault(s.devices.node, set()).add(s.layers)
    if not charged:
        return None
    name = max(sorted(charged), key=lambda n: len(charged[n]))
    return (name, len(charged[name])) if len(charged[name]) > 1 else None


def _memory_without(plan: Plan, pipe_index: int, stage: StagePlan, layers: Sequence[Layer],
                    costs: CostModel, **change: Recompute | int) -> float:
    return stage_memory(plan, plan.pipelines[pipe_index], stage, layers, costs,
                        replicas=replicas(plan)[Holders.key(stage)],
                        **change).total  # type: ignore[arg-type]


def explain(plan: Plan, layers: Sequence[Layer], costs: CostModel | None = None, *,
            runners_up: Sequence[Plan] = (), constraints: Sequence[str] = ()) -> Explanation:
    """The binding constraint, the bottleneck stage, and why the alternatives lose.

    constraints: what the user fixed or bounded, as text ("tp=2"), if known."""
    costs = costs or AnalyticalCostModel(plan.cluster)
    pred = plan.prediction
    step = pred.step_time or 1.0
    timings = stage_timings(plan, layers, costs)
    times = pipeline_times(plan, timings)
    slow = max(range(len(times)), key=lambda i: times[i].total)
    pipe = plan.pipelines[slow]
    busy = [t.busy for t in timings[slow]]
    b = max(range(len(busy)), key=lambda i: busy[i])
    stage = pipe.stages[b]
    names = [layer.name for layer in layers]
    bottleneck = Bottleneck(pipeline=slow, stage=b, node=stage.devices.node,
                            device_type=stage.device_type, tp=stage.tp,
                            layers=_layer_text(stage, names), busy=busy[b],
                            mean_busy=sum(busy) / len(busy),
                            share=pipe.num_microbatches * busy[b] / step)
    reasons: list[Reason] = []
    if constraints:
        reasons.append(Reason("constraint", "You constrained the search: "
                              + ", ".join(constraints) + ". Plans outside these were not "
                              "considered."))
    # memory
    worst = None
    for p in plan.pipelines:
        for s in p.stages:
            cap = plan.cluster.node(s.devices.node).device.memory
            frac = s.memory.total / cap
            if worst is None or frac > worst[0]:
                worst = (frac, p.index, s, cap)
    # The one rule for whether memory binds: the plan does not fit, a memory saver is what
    # makes it fit, or its fullest device is at least 85% full. `memory_binding` says which
    # (empty where none holds); the memory reasons below read it.
    memory_binding = ""
    needed = ""  # the memory saver without which the plan would not fit
    fixed = plan.solver.status == "fixed"  # `planner estimate`: the user chose the layout
    # a plan `estimate` wrote all the same, or one edited by hand: its stored memory is
    # over a device's, whatever the savers would save
    unfit = None
    if worst is not None and worst[0] > 1:
        _, p_index, s, _ = worst
        unfit = (f"pipeline {p_index} stage {s.index} does not fit {s.devices.node} "
                 f"({s.device_type})")
    for saver in ("recompute", "zero"):
        users = [(p, s) for p in plan.pipelines for s in p.stages
                 if (s.recompute is not Recompute.NONE if saver == "recompute" else s.zero > 0)]
        if not users:
            continue
        kinds = sorted({s.recompute.value if saver == "recompute" else f"ZeRO-{s.zero}"
                        for _, s in users})
        what = (f"recompute ({', '.join(kinds)})" if saver == "recompute"
                else " and ".join(kinds))
        where = f"{len(users)} of {sum(len(x.stages) for x in plan.pipelines)} stages"
        headline = f"{what.capitalize() if saver == 'recompute' else what} on {where}"
        if unfit:  # (what it would take without the saver says nothing then)
            reasons.append(Reason("memory", f"{headline}: even with it, {unfit}."))
            continue
        needs = []
        for p, s in users:
            cap = plan.cluster.node(s.devices.node).device.memory
            change = {"recompute": Recompute.NONE} if saver == "recompute" else {"zero": 0}
            needs.append((_memory_without(plan, p.index, s, layers, costs, **change) / cap,
                          p, s, cap))
        frac, p, s, cap = max(needs, key=lambda x: x[0])
        if frac > 1:
            needed = needed or what
            memory_binding = memory_binding or (f"memory: {what} is needed to fit "
                                                f"{s.device_type} (stage {s.index} of pipeline "
                                                f"{p.index})")
            verdict = (f"without it stage {s.index} of pipeline {p.index} ({s.device_type}) "
                       f"would need {fmt_bytes(frac * cap)} of {fmt_bytes(cap)}: it is what "
                       "makes the plan fit")
        elif fixed:
            verdict = (f"you chose it; everything would fit without it (at most {frac:.0%} of a "
                       "device)" + (", and recompute costs time" if saver == "recompute" else ""))
        elif saver == "recompute":
            verdict = (f"everything would fit without it (at most {frac:.0%} of a device), but "
                       "it allows bigger micro-batches or fewer stages, which is faster overall")
        else:
            verdict = (f"everything would fit without it (at most {frac:.0%} of a device); "
                       "sharding also splits the optimizer step, so it costs nothing here")
        reasons.append(Reason("memory", f"{headline}: {verdict}."))
    if worst is not None:
        frac, p_index, s, cap = worst
        term = s.memory.largest()
        largest = f"its largest term is {term} ({fmt_bytes(s.memory.terms()[term])})"
        tight = frac >= 0.85
        if unfit:
            memory_binding = f"memory: {unfit}"
            text = (f"The plan does not fit: pipeline {p_index} stage {s.index} holds "
                    f"{fmt_bytes(s.memory.total)} per device on {s.devices.node} "
                    f"({s.device_type}), which has {fmt_bytes(cap)} ({frac:.0%}); {largest}. "
                    "`planner launch` refuses it.")
        else:
            if tight:
                memory_binding = memory_binding or (f"memory: {s.devices.node} "
                                                    f"({s.device_type}) is {frac:.0%} full")
            text = (f"Memory {'binds' if memory_binding else 'does not bind'}: the fullest "
                    f"device (pipeline {p_index} stage {s.index} on {s.devices.node}, "
                    f"{s.device_type}) holds {fmt_bytes(s.memory.total)} of {fmt_bytes(cap)} "
                    f"({frac:.0%}); {largest}."
                    + (" Fewer stages or bigger micro-batches would not fit." if tight else
                       f" It fits only with {needed} (above)." if needed else ""))
        reasons.append(Reason("memory", text))
    # what the step time is made of
    shares = {t: getattr(pred, t) / step for t in TERMS}
    # the pipelines wait for their input where loading is the longer (`step.fed`): the
    # wait is in the bubble term, and it is what binds
    loading = plan_loading(plan)
    starved = loading if loading is not None and loading.seconds > times[slow].total else None
    loading_binding = ""
    if starved is not None:
        shares["bubble"] -= (starved.seconds - times[slow].total) / step
        loading_binding = (f"data loading on {starved.where} limits the step to "
                           f"{fmt_seconds(starved.seconds)}")
        reasons.append(Reason("loading", (
            f"Data loading on {starved.where} limits the step: it takes in "
            f"{starved.samples:,.0f} samples per step at {starved.rate:,.0f} samples/s "
            f"({fmt_seconds(starved.seconds)}), longer than the slowest pipeline "
            f"({fmt_seconds(times[slow].total)}), so the pipelines wait for their input. "
            "Faster loading (`data_loading` of the node, `input_rate` of its devices in the "
            "cluster spec: docs/clusters.md) or fewer samples read there would shorten it.")))
    top = max(shares, key=shares.__getitem__)
    node = plan.cluster.node(stage.devices.node)
    if top == "compute":
        reasons.append(Reason("compute", (
            f"The step is {shares['compute']:.0%} compute"
            + ("" if starved else ": the plan is compute-bound") + ". Its "
            f"bottleneck is stage {b} of pipeline {slow} ({stage.device_type} on {node.name}, "
            f"layers {bottleneck.layers}), busy {fmt_seconds(busy[b])} per micro-batch, "
            f"{busy[b] / bottleneck.mean_busy:.2f}x its pipeline's mean stage.")))
    else:
        reasons.append(Reason("compute", (
            f"Compute is only {shares['compute']:.0%} of the step; the largest part is "
            f"{TERM_WORDS[top]} ({shares[top]:.0%}). The busiest stage is stage {b} of "
            f"pipeline {slow} ({stage.device_type} on {node.name}, layers "
            f"{bottleneck.layers}), {fmt_seconds(busy[b])} per micro-batch.")))
    comm = {t: shares[t] for t in ("pp_comm", "dp_comm", "tp_comm")}
    worst_comm = max(comm, key=comm.__getitem__)
    if comm[worst_comm] >= 0.15:
        link_hint = {"pp_comm": "faster links between stages", "dp_comm": "a faster network "
                     "between replicas", "tp_comm": "faster intra-node links"}[worst_comm]
        reasons.append(Reason("communication", (
            f"{TERM_WORDS[worst_comm].capitalize()} takes {comm[worst_comm]:.0%} of the step: "
            f"{link_hint} would help (try a what-if on the link bandwidth).")))
    if (note := sync_note(plan)) is not None:
        reasons.append(Reason("sync", note))
    card = _shared_card(plan)
    if card is not None and shares["dp_comm"] > 0:
        name, count = card
        reasons.append(Reason("communication", (
            f"Node {name} takes part in {count} gradient all-reduces across nodes, which "
            f"take turns on its network card (docs/clusters.md): the gradient sync "
            f"({fmt_seconds(pred.dp_comm)}) lasts at least all of them. Fewer stages per "
            "node, or their replicas on the same node, would shorten it.")))
    if shares["bubble"] >= 0.1:
        reasons.append(Reason("bubble", (
            f"Pipeline fill and drain cost {shares['bubble']:.0%} of the step: pipeline "
            f"{slow} runs {pipe.num_microbatches} micro-batch(es) of {pipe.micro_batch} through "
            f"{len(pipe.stages)} stages. A larger global batch or fewer stages would shrink "
            "it.")))
    if len(plan.pipelines) > 1:
        shares_by_type: dict[str, set[int]] = {}
        for p in plan.pipelines:
            shares_by_type.setdefault(" > ".join(s.device_type for s in p.stages),
                                      set()).add(p.batch_share)
        flat = sorted({x for v in shares_by_type.values() for x in v})
        if len(flat) > 1:
            text = "; ".join(f"{k}: {', '.join(map(str, sorted(v)))}"
                             for k, v in shares_by_type.items())
            reasons.append(Reason("balance", "Faster pipelines take more of the batch "
                                  f"(samples per step: {text}) so all finish together."))
        first = min(range(len(times)), key=lambda i: times[i].total)
        if times[first].total < 0.8 * times[slow].total:
            reasons.append(Reason("balance", (
                f"Pipelines finish unevenly: pipeline {first} is done after "
                f"{fmt_seconds(times[first].total)} and waits for pipeline {slow} "
                f"({fmt_seconds(times[slow].total)}); giving faster pipelines more of the batch "
                "(as `planner solve` does) would shorten the step.")))
    idle = plan.cluster.num_devices - plan.num_devices
    if idle > 0:
        used = {s.devices.node for p in plan.pipelines for s in p.stages}
        unused_nodes = [n.name for n in plan.cluster.nodes if n.name not in used]
        where = (f"; unused nodes: {', '.join(unused_nodes[:6])}"
                 + (" ..." if len(unused_nodes) > 6 else "")) if unused_nodes else ""
        why = ("The configuration you fixed leaves them out." if fixed else
               "No plan in the search space that uses them was faster: they are too slow, too "
               "far (network) or too small for their share, or the batch cannot feed more "
               "pipelines.")
        reasons.append(Reason("idle", f"{idle} of {plan.cluster.num_devices} devices are "
                              f"idle{where}. {why}"))
    r = plan.solver
    if r.status not in ("fixed", "pending") and r.lower_bound > 0:
        reasons.append(Reason("bound", (
            f"Solver: {r.status}; no plan in the search space beats "
            f"{fmt_seconds(r.best_bound)} (gap {r.gap:.1%}), and no plan of any shape beats "
            f"{fmt_seconds(r.lower_bound)} (compute alone, perfectly balanced).")))
    binding = memory_binding or loading_binding
    if not binding:
        comm_share = max(shares["pp_comm"], shares["dp_comm"], shares["tp_comm"])
        if constraints:
            binding = "your constraints: " + ", ".join(constraints)
        elif shares["bubble"] >= 0.15:
            binding = (f"the global batch: {pipe.num_microbatches} micro-batch(es) cannot fill "
                       f"{len(pipe.stages)} stages")
        elif comm_share >= 0.25:
            binding = f"communication: {TERM_WORDS[worst_comm]} is {comm_share:.0%} of the step"
        else:
            binding = (f"compute: the {stage.device_type} stage {b} of pipeline {slow} is the "
                       "bottleneck")
    alternatives: list[Alternative] = []
    times = [pred.step_time, *(other.prediction.step_time for other in runners_up)]
    for i, other in enumerate(runners_up, 1):
        o = other.prediction
        # its place among this plan and the runner-ups (this plan's search may have had
        # constraints the new one lacks, or stopped early: then one of them beats it)
        rank = 1 + sum(t < o.step_time or (t == o.step_time and j < i)
                       for j, t in enumerate(times))
        alternatives.append(Alternative(
            name=f"runner-up #{rank}", description=structure(other), step_time=o.step_time,
            slower_by=o.step_time / pred.step_time - 1, why=why_slower(pred, o)))
    for base in plan.baselines:
        if base.prediction is None:
            alternatives.append(Alternative(name=base.name, description=base.description,
                                            step_time=None, slower_by=None, why=base.reason))
            continue
        alternatives.append(Alternative(
            name=base.name, description=base.description, step_time=base.prediction.step_time,
            slower_by=base.prediction.step_time / pred.step_time - 1,
            why=why_slower(pred, base.prediction)))
    headline = (f"{structure(plan)}: {fmt_seconds(pred.step_time)} per step, "
                f"{pred.samples_per_s:,.1f} samples/s; "
                + (f"data-loading-bound on {starved.where}." if starved is not None else
                   ("compute-bound" if top == "compute" else f"{TERM_WORDS[top]}-bound")
                   + f" on stage {b} of pipeline {slow} ({stage.device_type})."))
    return Explanation(headline=headline, binding=binding, structure=structure(plan),
                       bottleneck=bottleneck,
                       reasons=tuple(reasons), alternatives=tuple(alternatives))


def analyze(plan: Plan, layers: Sequence[Layer], costs: CostModel | None = None, *,
            runners_up: Sequence[Plan] = (), constraints: Sequence[str] = (),
            group: bool = True) -> Analysis:
    """Everything `planner explain` shows, from the plan and its model's layers."""
    check_layers(plan, layers)
    costs = costs or AnalyticalCostModel(plan.cluster)
    return Analysis(plan=plan, stages=tuple(stage_rows(plan, layers, costs)),
                    devices=tuple(device_map(plan)), memory=tuple(memory_rows(plan)),
                    traffic=tuple(traffic(plan, layers, costs)),
                    timeline=build_timeline(plan, layers, costs, group=group),
                    explanation=explain(plan, layers, costs, runners_up=runners_up,
                                        constraints=constraints))


def _plain(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float):
        return float(value)
    return value


def analysis_dict(analysis: Analysis) -> dict:
    """The analysis as JSON-able data (the plan itself is not repeated)."""
    from planner.planfile import to_jsonable

    plan = analysis.plan
    return {
        "kind": "explanation", "schema_version": 1,
        "model": plan.model.describe(), "cluster": plan.cluster.name,
        "prediction": to_jsonable(plan.prediction),
        "explanation": _plain(analysis.explanation),
        "stages": _plain(analysis.stages),
        "devices": _plain(analysis.devices),
        "memory": [{**_plain(m), "fraction": m.fraction} for m in analysis.memory],  # type: ignore[dict-item]
        "traffic": _plain(analysis.traffic),
        "timeline": timeline_dict(analysis.timeline),
        "solver": to_jsonable(plan.solver),
        "baselines": to_jsonable(plan.baselines),
    }


def describe_pipelines(members: Sequence[int]) -> str:
    return f"p{members[0]}" if len(members) == 1 else f"p{ranges(members)} (x{len(members)})"


# The stage tables' notation of a pipeline's micro-batches: their column, and a note
# under the table that says what it holds.
MICRO_BATCHES = "micro batches"
MICRO_BATCHES_KEY = "micro batches: per pipeline and step, count x size (samples)"


def micro_batches(count: int, size: int) -> str:
    """`32 x 1`: a pipeline's micro-batches per step, of `size` samples each."""
    return f"{count} x {size}"


__all__ = ["MICRO_BATCHES", "MICRO_BATCHES_KEY", "Analysis", "analysis_dict", "analyze",
           "check_layers", "describe_pipelines", "device_map", "explain", "memory_rows",
           "micro_batches", "retrace", "stage_rows", "structure", "traffic", "why_slower"]
