"""Process groups, device meshes, tensor parallelism, FSDP2 and gradient averaging.

Groups. Every rank creates every group the plan needs, in one deterministic
order (torch requires all ranks to take part in creating each group):
  * per pipeline its chains, the "pp" groups torch.distributed.pipelining sends
    activations along: one per tensor-parallel index of its narrowest stage, each
    pairing the stages' ranks of that index (`Topology.chains`); a wider stage's
    ranks past those indices follow its first rank (`follow.py`), over a group of
    their own;
  * per stage group (a stage and its replicas: the stages of other pipelines with
    the same layers, device type and tp) a 2-D DeviceMesh (dp x tp): "tp" is the
    stage's tensor-parallel group (DTensor), "dp" its ZeRO group (FSDP2);
  * per set of stages holding the same parameters, a group for summing their
    gradients (pipelines may split layers differently, and a head tied to the
    embedding shares its weight with the first stage, so these sets need not form
    a mesh): one per tensor-parallel index where the stages share a tp degree,
    else one of their first ranks (`GradientSum`). A pipeline's stages may differ
    in degree (GPipe or 1F1B; an interleaved schedule needs one degree). Where the
    stages' plan says their gradient sync is hierarchical (`StagePlan.grad_sync`, the
    faster priced where replicas share nodes and a slow network joins the nodes), each
    sum also gets a group of its ranks on each node and one of the nodes' first ranks:
    it reduces inside each node, all-reduces across the nodes, broadcasts back inside
    each node (`Hierarchy`).

Gradients. Each pipeline's loss for a micro-batch is the model's (mean) loss
times micro_batch / global_batch, so the losses of all micro-batches of all
pipelines add up to the mean loss over the global batch. Summing each
parameter's gradient over every stage holding it therefore gives exactly the
full-batch gradient: the average over pipelines weighted by their batch share.
FSDP2 reduce-scatters with a divide factor of 1 (a sum) for the same reason.

ZeRO: stages with zero >= 1 and at least two replicas, none of them with followers
(`follow.py`: they do not mirror FSDP's gathers and reductions yet), are wrapped with
FSDP2's fully_shard over their "dp" mesh dimension: zero 1 and 2 keep parameters
gathered from the first forward to the end of backward (reshard_after_forward=
False: gradients and optimizer states sharded, as ZeRO-2), zero 3 reshards after
every forward. FSDP issues one all-gather per forward when resharding, so zero 3
needs every replica to run the same number of micro-batches; otherwise it runs
as zero 2 and the run summary says so. Parameters that stages outside the
replica set also hold (tied weights, other pipelines' different splits) are kept
out of FSDP and summed with the other holders like any unsharded parameter; so are,
under ZeRO-3, the weights several layers of the stage read (a head tied to the token
table beside it), which a gather around one layer's forward would leave sharded for
the other.

Tensor parallelism (tp > 1): Megatron-style DTensor plans for the zoo's
transformer blocks (q, k, v, MLP up/gate column-parallel; attention output and
MLP down row-parallel; heads divided among the shards; each branch's input
replicated once, so its backward all-reduces one gradient, as Megatron's fused
projections do and as the trace prices it) and MLP blocks; the
embedding, head and other layers are replicated on the tp group (correct, not
sharded). In a mixture-of-experts block every expert is split along its MLP width
the same way (`_ShardedExperts`): the routing runs whole on every rank, each rank
runs its slice of every expert on the dispatched rows, and the experts' output
is all-reduced (forward) as their input's gradient is (backward), rows of all
experts at once (`trace.layers` prices these all-reduces).
A user's layer may define `tensor_parallel_plan() -> {submodule: "colwise" |
"rowwise"}`.

The plan's tensor-parallel options (`stage.TensorParallelOptions`), on zoo transformers:
  * sequence parallelism (Korthikanti et al. 2022): between blocks every tp rank holds
    its slice of the sequence; each block's norms run on the slice (torch's
    `SequenceParallel`), its attention and MLP all-gather their input and
    reduce-scatter their output (row-parallel projections to a sequence slice; a
    mixture-of-experts block slices its all-reduced output), and the residual adds and
    dropout run on the slice. The embedding slices its output, the head gathers its
    input (after its final norm, on the slice, where vocabulary parallelism splits it),
    so the stages of a pipeline pass each other sequence slices, chain by chain.
  * vocabulary parallelism (Megatron's vocabulary-parallel embedding and parallel
    cross-entropy): the token table (the head's too, tied or not) is split by rows;
    the lookup is all-reduced, the head's logits come out split over the vocabulary
    (a DTensor), and the loss (`ShardedLogitsLoss`) reduces each token's maximum, sum
    of exponentials and target logit over the ranks instead of gathering the logits.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from planner.errors import PlannerError
from planner.runtime.follow import Following
from planner.runtime.layout import Layout
from planner.runtime.stage import (
    TP_OPTIONS,
    ChunkModule,
    ModelInfo,
    TensorParallelOptions,
    stage_param_names,
)
from planner.types import Plan, StagePlan, SyncAlgorithm

StageKey = tuple[int, int]  # (pipeline, stage)


def replica_key(stage: StagePlan) -> tuple:
    return stage.chunks, stage.device_type, stage.tp


@dataclass
class Topology:
    """Who holds what, computed the same way on every rank."""

    plan: Plan
    layout: Layout
    replicas: dict[tuple, list[StageKey]]  # replica key -> stages, by ascending rank
    holders: dict[str, list[StageKey]]  # parameter name -> stages holding it
    params: dict[StageKey, frozenset[str]]

    def stage(self, key: StageKey) -> StagePlan:
        return self.plan.pipelines[key[0]].stages[key[1]]

    def ranks(self, key: StageKey) -> tuple[int, ...]:
        return self.layout.stage_ranks(*key)

    def chain(self, pipeline: int, tp_rank: int) -> tuple[int, ...]:
        """The ranks of a pipeline's stages (stage order) at one tensor-parallel index
        (below `chains`)."""
        return tuple(self.ranks((pipeline, s.index))[tp_rank]
                     for s in self.plan.pipelines[pipeline].stages)

    def chains(self, pipeline: int) -> int:
        """How many chains a pipeline runs: its narrowest stage's tp (`follow.py`)."""
        return min(s.tp for s in self.plan.pipelines[pipeline].stages)

    def following(self, key: StageKey) -> tuple[int, ...]:
        """A stage's leader (its first rank) and followers (its ranks in no chain),
        leader first; () where every rank of the stage is in a chain."""
        ranks, chains = self.ranks(key), self.chains(key[0])
        return (ranks[0], *ranks[chains:]) if len(ranks) > chains else ()

    def replicas_of(self, key: StageKey) -> list[StageKey]:
        return self.replicas[replica_key(self.stage(key))]

    def sum_groups(self, keys: Sequence[StageKey]) -> list[tuple[int, ...]]:
        """The rank groups that sum the gradients of parameters these stages hold: one
        per tensor-parallel index where they share a tp degree, else the first ranks
        of the stages (see `GradientSum`)."""
        tps = {self.stage(k).tp for k in keys}
        indices = range(next(iter(tps))) if len(tps) == 1 else range(1)
        return [tuple(sorted(self.ranks(k)[t] for k in keys)) for t in indices]

    def hierarchical(self, keys: Sequence[StageKey]) -> bool:
        """Whether these stages sum their gradients hierarchically: where every one of
        them says so (`StagePlan.grad_sync`; a stage's sum is its replicas', and a tie's
        takes the ring unless both ends say otherwise)."""
        return all(self.stage(k).grad_sync is SyncAlgorithm.HIERARCHICAL for k in keys)

    def by_node(self, ranks: Sequence[int]) -> list[tuple[int, ...]]:
        """The ranks of a sum grouped by node, each node's ascending, nodes in order of
        their first rank: a hierarchical sum's first level; the first rank of each
        node sums across the nodes."""
        nodes: dict[str, list[int]] = {}
        for rank in sorted(ranks):
            nodes.setdefault(self.layout.of(rank).node, []).append(rank)
        return [tuple(found) for found in nodes.values()]

    def sum_ranks(self, keys: Sequence[StageKey]) -> list[tuple[int, ...]]:
        """Every group summing these stages' gradients needs: `sum_groups`, and for a
        hierarchical sum each node's ranks and the nodes' first ranks (`Hierarchy`)."""
        out = []
        for ranks in self.sum_groups(keys):
            out.append(ranks)
            if self.hierarchical(keys):
                nodes = self.by_node(ranks)
                out += [node for node in nodes if len(node) > 1]
                if len(nodes) > 1:
                    out.append(tuple(node[0] for node in nodes))
        return out

    def sum_group(self, keys: Sequence[StageKey], ranks: tuple[int, ...], rank: int,
                  by_ranks: dict[tuple[int, ...], dist.ProcessGroup]
                  ) -> dist.ProcessGroup | Hierarchy:
        """What sums these stages' gradients over `ranks` on `rank` (one of them), from
        the groups `sum_ranks` made: their group, or their `Hierarchy`."""
        if not self.hierarchical(keys):
            return by_ranks[ranks]
        nodes = self.by_node(ranks)
        mine = next(node for node in nodes if rank in node)
        across = tuple(node[0] for node in nodes)
        local = by_ranks[mine] if len(mine) > 1 else None
        return Hierarchy(ranks=ranks, leader=mine[0], local=local, back=local,
                         across=by_ranks[across] if rank in across and len(nodes) > 1
                         else None)


@dataclass(frozen=True)
class Hierarchy:
    """A gradient sum over `ranks` on several nodes in three steps (`StagePlan.grad_sync`
    hierarchical, `all_reduce_sum`): reduced inside each node to its first rank
    (`leader`) over `local` (this rank's node's ranks of the sum; None where it is alone
    there), all-reduced among the nodes' first ranks over `across` (None on the other
    ranks), broadcast back inside each node over `back` (the same ranks as `local`; a
    group of its own where the sums run asynchronously, `overlap.sync_groups`, so that
    every group's collectives keep one order on every rank). Exactly the ring's sum, up
    to the order of the additions."""

    ranks: tuple[int, ...]
    leader: int
    local: dist.ProcessGroup | None
    across: dist.ProcessGroup | None
    back: dist.ProcessGroup | None

    def steps(self, flat: torch.Tensor) -> list[functools.partial]:
        """Its collectives on `flat` in order, each to be issued once the one before has
        completed (they take `async_op`)."""
        out = []
        if self.local is not None:
            out.append(functools.partial(dist.reduce, flat, dst=self.leader,
                                         op=dist.ReduceOp.SUM, group=self.local))
        if self.across is not None:
            out.append(functools.partial(dist.all_reduce, flat, op=dist.ReduceOp.SUM,
                                         group=self.across))
        if self.local is not None:
            out.append(functools.partial(dist.broadcast, flat, src=self.leader,
                                         group=self.back))
        return out


def all_reduce_sum(flat: torch.Tensor, group: dist.ProcessGroup | Hierarchy) -> None:
    """Sum `flat` over `group` in place: one all-reduce, or a `Hierarchy`'s three steps."""
    if not isinstance(group, Hierarchy):
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        return
    for step in group.steps(flat):
        step()


def check_degrees(plan: Plan) -> None:
    """An error naming the first pipeline that interleaves chunks on stages of different
    tensor-parallel degrees: a follower mirrors one chunk (`follow.py`), and torch's
    interleaved schedule runs several per rank."""
    for p in plan.pipelines:
        tps = sorted({s.tp for s in p.stages})
        if len(tps) > 1 and (p.interleave > 1 or any(len(s.chunks) > 1 for s in p.stages)):
            raise PlannerError(
                "unsupported-plan", f"Pipeline {p.index} interleaves several chunks per "
                f"stage on stages of different tensor-parallel degrees {tps}; the runtime "
                "runs such a pipeline with GPipe or plain 1F1B only.",
                ["plan it again with --interleave 1", "solve with a fixed --tp"])


def topology(plan: Plan, layout: Layout, info: ModelInfo) -> Topology:
    check_degrees(plan)
    params: dict[StageKey, frozenset[str]] = {}
    holders: dict[str, list[StageKey]] = {}
    replicas: dict[tuple, list[StageKey]] = {}
    for p in plan.pipelines:
        for s in p.stages:
            key = (p.index, s.index)
            params[key] = stage_param_names(info, s)
            for name in params[key]:
                holders.setdefault(name, []).append(key)
            replicas.setdefault(replica_key(s), []).append(key)
    for key, stages in replicas.items():
        stages.sort(key=lambda k: layout.stage_ranks(*k))
        tp = plan.pipelines[stages[0][0]].stages[stages[0][1]].tp
        for t in range(1, tp):
            if [layout.stage_ranks(*k)[t] for k in stages] != sorted(
                    layout.stage_ranks(*k)[t] for k in stages):
                raise PlannerError(
                    "unsupported-plan", f"The replicas of the stage holding layers {key[0]} "
                    "interleave their devices so that no rank order fits every tensor-"
                    "parallel shard.", ["give each stage consecutive devices"])
    return Topology(plan=plan, layout=layout, replicas=replicas, holders=holders,
                    params=params)


def written_by_others(topo: Topology, key: StageKey) -> frozenset[str]:
    """Parameters of stage `key` that a checkpoint takes from other stages: those whose
    holders mix tensor-parallel degrees, where the first holder's degree is not this
    stage's."""
    tp = topo.stage(key).tp
    return frozenset(name for name in topo.params[key]
                     if topo.stage(min(topo.holders[name])).tp != tp)


@dataclass
class Groups:
    """This rank's meshes and groups (see the module docstring)."""

    stage_mesh: DeviceMesh  # ("dp", "tp")
    chain: tuple[int, ...]  # global ranks of my pipeline's stages at my tp index
    pp: dist.ProcessGroup | None  # my chain's group (None and () on a follower)
    following: Following | None = None  # where I lead or follow: my stage's ring
    by_ranks: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)

    @property
    def follows(self) -> bool:
        """Whether this rank follows its stage's leader (in no chain)."""
        return self.pp is None

    @property
    def tp(self) -> int:
        return self.stage_mesh.size(1)

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.stage_mesh["tp"]

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.stage_mesh["dp"]


def build_groups(topo: Topology, rank: int, device_type: str) -> Groups:
    """Create every group on every rank (same order), and this rank's meshes."""
    plan, layout = topo.plan, topo.layout
    wanted: list[tuple[int, ...]] = []
    for p in plan.pipelines:  # pipeline chains
        for t in range(topo.chains(p.index)):
            wanted.append(tuple(sorted(topo.chain(p.index, t))))
    for p in plan.pipelines:  # tensor-parallel groups, leaders and followers
        for s in p.stages:
            wanted.append(topo.ranks((p.index, s.index)))
            if topo.following((p.index, s.index)):
                wanted.append(topo.following((p.index, s.index)))
    for stages in topo.replicas.values():  # replica (ZeRO) groups
        tp = topo.stage(stages[0]).tp
        for t in range(tp):
            wanted.append(tuple(topo.ranks(k)[t] for k in stages))
    holder_sets = sorted({tuple(sorted(keys)) for keys in topo.holders.values()})
    for keys in holder_sets:  # gradient sums
        wanted.extend(topo.sum_ranks(keys))
    by_ranks: dict[tuple[int, ...], dist.ProcessGroup] = {}
    created: set[tuple[int, ...]] = set()  # on every rank alike, member or not: new_group
    for ranks in wanted:                   # is collective, its calls must match
        key = tuple(sorted(ranks))
        if key not in created:
            created.add(key)
            group = dist.new_group(list(key))
            if rank in key:
                by_ranks[key] = group
    me = layout.of(rank)
    mine = (me.pipeline, me.stage)
    stage_ranks = topo.ranks(mine)
    tp_group = by_ranks[tuple(sorted(stage_ranks))]
    chain = (topo.chain(me.pipeline, me.tp_rank)
             if me.tp_rank < topo.chains(me.pipeline) else ())
    ring = topo.following(mine)  # (my stage's other chains' ranks neither lead nor follow)
    ring = ring if rank in ring else ()
    following = (Following(leader=ring[0], group=by_ranks[tuple(sorted(ring))],
                           device=torch.device(device_type))  # (cuda: the current one)
                 if ring else None)
    replicas = topo.replicas_of(mine)
    dp_group = by_ranks[tuple(sorted(topo.ranks(k)[me.tp_rank] for k in replicas))]
    stage_mesh = DeviceMesh.from_group(
        [dp_group, tp_group], device_type, mesh=[list(topo.ranks(k)) for k in replicas],
        mesh_dim_names=("dp", "tp"))
    return Groups(stage_mesh=stage_mesh, chain=chain,
                  pp=by_ranks[tuple(sorted(chain))] if chain else None,
                  following=following, by_ranks=by_ranks)


# --- tensor parallelism -----------------------------------------------------------------

def _styles(plan: dict[str, str]) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {path: ColwiseParallel() if style == "colwise" else RowwiseParallel()
            for path, style in plan.items()}


class _ShardedExperts(ParallelStyle):
    """Tensor parallelism for `Experts` (a ParallelStyle): gate and up weights split
    along the MLP width (column-parallel), down weights along it too (row-parallel);
    the rows come in replicated and go out summed over the ranks."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import (
            DTensor,
            Replicate,
            Shard,
            distribute_module,
            distribute_tensor,
        )

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for weight, dim in (("w_gate", 2), ("w_up", 2), ("w_down", 1)):
                if hasattr(mod, weight):
                    sharded = distribute_tensor(getattr(mod, weight), mesh, [Shard(dim)],
                                                src_data_rank=self.src_data_rank)
                    mod.register_parameter(weight, nn.Parameter(sharded))

        def rows_in(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            # replicated rows; backward all-reduces their gradient's partial sums
            return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                         for x in inputs)

        def rows_out(mod: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
            return output.redistribute(mesh, [Replicate()]).to_local()  # all-reduce

        return distribute_module(module, mesh, partition, rows_in, rows_out)


def _transformer_block(unit: nn.Module, tp: int, where: str, sequence: bool = False
                       ) -> dict | None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    from planner.models.transformer import MLP, Attention, Block

    if not isinstance(unit, Block) or not isinstance(unit.attn, Attention):
        return None
    cfg = unit.attn.cfg
    kv = cfg.kv_heads_
    if cfg.heads % tp or kv % tp:
        raise PlannerError("unsupported-plan", f"{where}: tp {tp} must divide the attention "
                           f"heads ({cfg.heads}) and key/value heads ({kv}).",
                           ["solve with a smaller --tp"])
    if cfg.ffn_dim % tp:  # (the MLP's or every expert's width)
        raise PlannerError("unsupported-plan", f"{where}: tp {tp} must divide the MLP "
                           f"width {cfg.ffn_dim}.", ["solve with a smaller --tp"])
    plan: dict = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise",
                  "attn.o": "rowwise"}
    if isinstance(unit.mlp, MLP):
        plan.update({"mlp.up": "colwise", "mlp.down": "rowwise"})
        if unit.mlp.gate is not None:
            plan["mlp.gate"] = "colwise"
    # each shard runs heads / tp heads; the attention reads its sizes from its config
    unit.attn.cfg = dataclasses.replace(cfg, hidden=cfg.hidden // tp, heads=cfg.heads // tp,
                                        kv_heads=kv // tp if cfg.kv_heads else None)
    unit.attn.num_heads, unit.attn.num_kv_heads = cfg.heads // tp, kv // tp
    styles = _styles(plan)
    # one replicated input per branch, so the backward sums the column-parallel
    # projections' partial gradients (q, k, v; gate, up) in one all-reduce, not one each
    styles["attn"] = _replicated_input()
    if isinstance(unit.mlp, MLP):
        styles["mlp"] = _replicated_input()
    else:
        styles["mlp.experts"] = _ShardedExperts()
    if sequence:  # (the module docstring's sequence parallelism)
        styles.update({"attn_norm": SequenceParallel(use_local_output=True),
                       "mlp_norm": SequenceParallel(use_local_output=True),
                       "attn": _replicated_input(Shard(1)),
                       "attn.o": RowwiseParallel(output_layouts=Shard(1))})
        if isinstance(unit.mlp, MLP):
            styles["mlp"] = _replicated_input(Shard(1))
            styles["mlp.down"] = RowwiseParallel(output_layouts=Shard(1))
        else:  # the experts' output comes whole: each rank keeps its slice
            styles["mlp"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                use_local_input=True, output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),))
    return styles


def _replicated_input(given: object = None) -> ParallelStyle:
    """A module's input made whole on every rank (from a sequence slice `given`, an
    all-gather), as one DTensor its branches share."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import PrepareModuleInput

    return PrepareModuleInput(input_layouts=(given or Replicate(),),
                              desired_input_layouts=(Replicate(),))


def _embedding(unit: nn.Module, mesh: DeviceMesh, options: TensorParallelOptions) -> bool:
    """Vocabulary and sequence parallelism on a zoo transformer's embedding (the module
    docstring); whether `unit` is one."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleOutput,
        RowwiseParallel,
        parallelize_module,
    )

    from planner.models.transformer import Embedding

    if not isinstance(unit, Embedding):
        return False
    if options.vocab:  # rows of the table per rank; the lookups summed (all-reduce)
        parallelize_module(unit, mesh, {"tokens": RowwiseParallel(input_layouts=Replicate(),
                                                                  output_layouts=Replicate())})
        unit.tokens.weight.register_hook(_by_rows)
    if options.sequence:  # each rank keeps its slice of the sequence
        parallelize_module(unit, mesh, PrepareModuleOutput(output_layouts=(Replicate(),),
                                                           desired_output_layouts=(Shard(1),)))
    return True


def _head(unit: nn.Module, mesh: DeviceMesh, options: TensorParallelOptions) -> bool:
    """Vocabulary and sequence parallelism on a zoo transformer's head (the module
    docstring); whether `unit` is one."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        PrepareModuleOutput,
        parallelize_module,
    )

    from planner.models.transformer import Head

    if not isinstance(unit, Head):
        return False
    given = Shard(1) if options.sequence else Replicate()
    if not options.vocab:
        if options.sequence:  # the whole sequence for the head every rank runs whole
            parallelize_module(unit, mesh, PrepareModuleInput(
                input_layouts=(given,), desired_input_layouts=(Replicate(),),
                use_local_output=True))
        return True
    table = unit.tied[0] if unit.output is None else unit.output
    if not isinstance(table.weight, DTensor):  # (a tied table the embedding split: as it is)
        _split_rows(table, "weight", mesh)
    if unit.bias is not None:
        _split_rows(unit, "bias", mesh)
    if options.sequence and unit.norm is not None:  # the final norm on the slice, then whole
        parallelize_module(unit, mesh, {"norm": PrepareModuleOutput(
            output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),),
            use_local_output=False)})

    def replicate(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for key, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                module.register_parameter(key, nn.Parameter(
                    DTensor.from_local(param.detach(), mesh, [Replicate()], run_check=False)))

    def hidden_in(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        hidden = DTensor.from_local(inputs[0], mesh, [given], run_check=False)
        gather = options.sequence and unit.norm is None
        return (hidden.redistribute(mesh, [Replicate()]) if gather else hidden,)

    distribute_module(unit, mesh, replicate, hidden_in)
    return True


def _by_rows(grad: torch.Tensor) -> torch.Tensor:
    """A token table's gradient split by rows as the table is: torch's vocabulary-parallel
    lookup gives it whole on every rank (each rank's slice, no communication)."""
    from torch.distributed.tensor import Shard

    return grad.redistribute(grad.device_mesh, [Shard(0)])


def _split_rows(module: nn.Module, name: str, mesh: DeviceMesh) -> None:
    """`module`'s parameter `name` split by rows (its vocabulary) over `mesh`."""
    from torch.distributed.tensor import Shard, distribute_tensor

    module.register_parameter(name, nn.Parameter(
        distribute_tensor(getattr(module, name).detach(), mesh, [Shard(0)])))


@dataclass(frozen=True)
class ShardedLogitsLoss:
    """The model's loss, or where its logits come split over the vocabulary (a DTensor
    sharded on the last dimension: vocabulary parallelism) Megatron's parallel
    cross-entropy: the mean over tokens (targets of -100 left out, as cross_entropy
    does) of log(sum exp(logits)) - logit of the target, each rank reducing its slice's
    maximum, sum of exponentials and target logit over the tensor-parallel group
    (`_VocabParallelCrossEntropy`), no rank gathering the logits."""

    model_loss: object  # (logits, targets) -> loss, the model's own

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        split = isinstance(logits, DTensor) and any(
            isinstance(p, Shard) and p.dim in (-1, logits.ndim - 1) for p in logits.placements)
        if not split:
            return self.model_loss(logits, targets)
        mesh = logits.device_mesh
        _, offset = compute_local_shape_and_global_offset(logits.shape, mesh, logits.placements)
        local = logits.to_local().flatten(0, -2).float()
        flat = targets.reshape(-1).to(local.device)
        losses = _VocabParallelCrossEntropy.apply(local, flat, offset[-1], mesh.get_group())
        kept = flat != -100
        return (losses * kept).sum() / kept.sum().clamp(min=1)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits split over the vocabulary (`ShardedLogitsLoss`):
    forward all-reduces three numbers a token, backward none (softmax minus the target's
    one-hot, on each rank's slice)."""

    @staticmethod
    def forward(ctx: object, logits: torch.Tensor, targets: torch.Tensor, start: int,
                group: dist.ProcessGroup) -> torch.Tensor:
        peak = logits.max(dim=-1).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - peak.unsqueeze(-1)
        exps = shifted.exp()
        total = exps.sum(dim=-1)
        dist.all_reduce(total, group=group)
        here = (targets >= start) & (targets < start + logits.shape[-1])
        index = (targets - start).clamp(0, logits.shape[-1] - 1)
        target = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) * here
        dist.all_reduce(target, group=group)
        ctx.save_for_backward(exps / total.unsqueeze(-1), index, here)
        return total.log() - target

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple:
        softmax, index, here = ctx.saved_tensors
        out = softmax.clone()
        out.scatter_add_(-1, index.unsqueeze(-1), -here.to(out.dtype).unsqueeze(-1))
        return out * grad.unsqueeze(-1), None, None, None


def apply_tensor_parallel(units: Iterable[tuple[str, nn.Module]], mesh: DeviceMesh
                          ) -> list[str]:
    """Shard each unit over `mesh` (see the module docstring); returns notes on units
    left replicated."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from planner.models.mlp import MLPBlock

    tp = mesh.size()
    notes = []
    for path, unit in units:
        where = f"layer {path}"
        styles = None
        options = getattr(unit, TP_OPTIONS, TensorParallelOptions())
        custom = getattr(unit, "tensor_parallel_plan", None)
        if callable(custom):
            styles = _styles(custom())
        elif isinstance(unit, MLPBlock):
            styles = {"linear": ColwiseParallel(output_layouts=Replicate())}
        elif _embedding(unit, mesh, options) or _head(unit, mesh, options):
            if options.vocab:
                continue
        else:
            styles = _transformer_block(unit, tp, where, options.sequence)
        if styles is None:
            if any(True for _ in unit.parameters()):
                notes.append(f"{where} ({type(unit).__name__}) is replicated on its {tp} "
                             "tensor-parallel ranks")
            continue
        parallelize_module(unit, mesh, styles)
    return notes


# --- FSDP2 ------------------------------------------------------------------------------

def fsdp_ignored(topo: Topology, key: StageKey, root: nn.Module) -> set[nn.Parameter]:
    """Parameters of stage `key` that stages outside its replica set also hold."""
    replicas = set(topo.replicas_of(key))
    return {param for name, param in root.named_parameters()
            if set(topo.holders[name]) != replicas}


def apply_fsdp(chunks: Sequence[ChunkModule], mesh: DeviceMesh, *, reshard: bool,
               ignored: set[nn.Parameter]) -> None:
    from torch.distributed.fsdp import fully_shard

    for chunk in chunks:
        for unit in chunk.units():
            if any(p not in ignored for p in unit.parameters()):
                fully_shard(unit, mesh=mesh, reshard_after_forward=reshard,
                            ignored_params=ignored)
        fully_shard(chunk, mesh=mesh, reshard_after_forward=reshard, ignored_params=ignored)
        for module in chunk.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                # a plain sum (see the module docstring), as SUM collectives: gloo has no
                # pre-multiplied sum
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)


def fsdp_managed(chunks: Sequence[ChunkModule], ignored: set[nn.Parameter]) -> set[int]:
    """ids of the parameters FSDP manages: every chunk parameter it was not told to
    ignore (fully_shard replaced them with sharded DTensor parameters)."""
    return {id(p) for chunk in chunks for p in chunk.parameters() if p not in ignored}


# --- gradient sums ----------------------------------------------------------------------

def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _full(grad: torch.Tensor) -> torch.Tensor:
    """The whole gradient of a parameter (gathered over its tensor-parallel ranks)."""
    from torch.distributed.tensor import DTensor

    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _shard(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of a whole gradient, laid out as `like` (no communication)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(like, DTensor):
        return full
    mesh = like.device_mesh
    whole = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return whole.redistribute(mesh, like.placements).to_local()


@dataclass
class _Bucket:
    """Parameters whose gradients one set of stages sums. `group` sums them; with
    `gather`, the set mixes tensor-parallel degrees: each stage gathers its whole
    gradients (`tp_group`), its first rank sums them with the other stages' first ranks
    (`group`, None on the other ranks) and hands the sum back to its tp ranks (`source`
    broadcasts it), which keep their shards. With `slices` > 1 the parameters are
    replicated on the stage's tp ranks: each sums its `index`-th slice of them (`group`:
    the stages' ranks of that index) and the tp group gathers the slices (`order`: the
    tp group's rank of each index), so the stage moves them once, not once per rank."""

    params: list[nn.Parameter]
    group: dist.ProcessGroup | Hierarchy | None
    gather: bool = False
    tp_group: dist.ProcessGroup | None = None
    source: int = 0
    slices: int = 1
    index: int = 0
    order: tuple[int, ...] = ()


class GradientSum:
    """Sums the gradients of unsharded parameters over the stages holding them, one
    flat all-reduce per set of holders, sets in one global order (no deadlock). Each
    stage moves its parameters' gradients once, as the planner prices it: where the
    holders share a tensor-parallel degree each tp rank sums its shards and a slice of
    the parameters the ranks hold whole; where the degrees differ, each stage's first
    rank sums the whole gradients."""

    def __init__(self, root: nn.Module, topo: Topology, groups: Groups, rank: int,
                 skip: set[int]) -> None:
        me = topo.layout.of(rank)
        mine = topo.ranks((me.pipeline, me.stage))
        held: dict[tuple[StageKey, ...], list[nn.Parameter]] = {}
        for name, param in sorted(root.named_parameters()):
            keys = tuple(sorted(topo.holders[name]))
            if id(param) not in skip and param.requires_grad and len(keys) > 1:
                held.setdefault(keys, []).append(param)
        tp_group = groups.by_ranks[tuple(sorted(mine))]
        self.buckets: list[_Bucket] = []
        for keys, params in sorted(held.items()):
            found = topo.sum_groups(keys)
            if len({topo.stage(k).tp for k in keys}) > 1:  # (one group: the first ranks)
                first = (topo.sum_group(keys, found[0], rank, groups.by_ranks)
                         if rank in found[0] else None)
                self.buckets.append(_Bucket(params, first, gather=True, tp_group=tp_group,
                                            source=mine[0]))
                continue
            group = topo.sum_group(keys, next(r for r in found if rank in r), rank,
                                   groups.by_ranks)
            sharded = [p for p in params if len(mine) == 1 or _sharded(p)]
            if sharded:
                self.buckets.append(_Bucket(sharded, group))
            if len(sharded) < len(params):
                self.buckets.append(_Bucket(
                    [p for p in params if not _sharded(p)], group, tp_group=tp_group,
                    slices=len(mine), index=me.tp_rank,
                    order=tuple(sorted(mine).index(r) for r in mine)))

    def __call__(self) -> None:
        for bucket in self.buckets:
            sum_bucket(bucket)


def sum_bucket(bucket: _Bucket) -> None:
    """Sum one bucket's gradients over its holders (see `_Bucket`), in place."""
    flat, grads = flat_gradients(bucket)
    if bucket.slices > 1:
        flat = _sum_in_slices(flat, bucket)
    elif bucket.group is not None:
        all_reduce_sum(flat, bucket.group)
    if bucket.gather and dist.get_world_size(bucket.tp_group) > 1:
        dist.broadcast(flat, src=bucket.source, group=bucket.tp_group)
    write_gradients(bucket, flat, grads)


def flat_gradients(bucket: _Bucket) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A bucket's gradients (zeros where a parameter got none) in one flat tensor, and
    each as summed (whole where `gather`, else this rank's part)."""
    for p in bucket.params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [_full(p.grad) if bucket.gather else _local(p.grad) for p in bucket.params]
    return torch.cat([g.reshape(-1) for g in grads]), grads


def write_gradients(bucket: _Bucket, flat: torch.Tensor, grads: list[torch.Tensor]) -> None:
    """Each parameter's part of a summed flat tensor back into its gradient."""
    offset = 0
    for p, g in zip(bucket.params, grads, strict=True):
        value = flat[offset:offset + g.numel()].view_as(g)
        _local(p.grad).copy_(_shard(value, p.grad) if bucket.gather else value)
        offset += g.numel()


def _sharded(param: nn.Parameter) -> bool:
    """Whether tensor parallelism shards the parameter (else each tp rank holds it whole)."""
    from torch.distributed.tensor import DTensor, Shard

    return isinstance(param, DTensor) and any(isinstance(p, Shard) for p in param.placements)


def _sum_in_slices(flat: torch.Tensor, bucket: _Bucket) -> torch.Tensor:
    """The sum of a flat gradient every tp rank holds whole: each rank sums its slice
    across the stages, then the tp group gathers the slices."""
    size = -(-flat.numel() // bucket.slices)
    padded = torch.nn.functional.pad(flat, (0, size * bucket.slices - flat.numel()))
    part = padded.view(bucket.slices, size)[bucket.index].clone()
    all_reduce_sum(part, bucket.group)
    parts = [torch.empty_like(part) for _ in range(bucket.slices)]
    dist.all_gather(parts, part, group=bucket.tp_group)
    return torch.cat([parts[i] for i in bucket.order])[:flat.numel()]
