"""Sync modes that change the optimization (the plan's `training.sync`, `SyncSpec`):
local SGD, periodic model averaging and DiLoCo.

Between syncs each pipeline trains on its own share:
  * its loss is the mean over its own share (each micro-batch's weighs micro_batch /
    batch_share, not micro_batch / global_batch: `loss_weight`), so its gradient is
    its own batch's mean;
  * its stages still sum, every step, the gradients of the parameters several of them
    hold (a head tied to the embedding is one weight on two stages), over groups of
    their own (`within_pipelines`);
  * its optimizer steps on them.

Every `interval` steps, after the optimizer step, the holders of each parameter agree on
it (`Averaging`), each holder weighing w_h = u_p / (the sum of u over the holders),
u_p its pipeline's batch share (work-weighted: a pipeline that ran more samples counts
more; the plan gives faster pipelines larger shares, so every pipeline's H local steps
take about as long and its local work follows its capacity) or 1 (`average`):

  * local-sgd: the parameters become sum_h w_h * theta_h, work-weighted (local SGD; for
    plain SGD with H = 1 exactly the every-step update); each pipeline keeps its own
    optimizer state;
  * average:   the same with one weight per pipeline, whatever its share (what torch's
    PeriodicModelAverager does to its replicas);
  * diloco:    every holder keeps the parameters of the last sync (the outer ones); the
    pseudo-gradient sum_h w_h * (theta_outer - theta_h), work-weighted, goes to an outer
    SGD with Nesterov momentum (--outer-lr 0.7, --outer-momentum 0.9: Douillard et al.
    2023), and the parameters restart from the outer ones it updates. The outer state
    is checkpointed (`outer_state`).

The sums use `parallel.GradientSum`'s buckets over every holder (those every-step sync
sums gradients with, hierarchical where the plan's stages say so): the weighted values
are put where the gradients go, summed, and taken back.

Checkpoints hold one copy of each parameter, so they are written right after a sync:
--checkpoint-every must be a multiple of the interval, and the final checkpoint (or a
stop's) syncs first where the last step was not a sync. Between syncs each pipeline
keeps its own optimizer state; a checkpoint keeps one pipeline's for each parameter.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from planner.errors import PlannerError
from planner.runtime.parallel import GradientSum, Groups, Topology, sum_bucket
from planner.types import Plan, SyncSpec


def loss_weight(plan: Plan, pipeline: int) -> float:
    """What a micro-batch's loss is multiplied by, per sample of the micro-batch: over
    the global batch every step, over the pipeline's own share between syncs."""
    sync = plan.training.sync
    return 1.0 / (plan.pipelines[pipeline].batch_share if sync.local
                  else plan.training.global_batch)


def reported_loss(plan: Plan, pipeline: int) -> float:
    """What this pipeline's summed micro-batch losses are multiplied by so that the
    pipelines' add up to the mean over the global batch (the loss the run reports)."""
    return loss_weight(plan, pipeline) ** -1 / plan.training.global_batch


def check_checkpoints(sync: SyncSpec, every: int) -> None:
    """An error where periodic checkpoints would fall between syncs."""
    if sync.local and every % sync.interval:
        raise PlannerError(
            "bad-option", f"--checkpoint-every {every} falls between the plan's syncs "
            f"(training.sync {sync.describe()}: every {sync.interval} steps); a checkpoint "
            "holds one copy of each parameter, so it is taken right after a sync.",
            [f"give --checkpoint-every a multiple of {sync.interval}"])


def within_pipelines(topo: Topology, groups: Groups, rank: int) -> tuple[Topology, Groups]:
    """The topology and groups of sums within each pipeline: every parameter's holders
    narrowed to its pipeline's stages, with groups of their own created on every rank
    in one order (new_group is collective)."""
    pipelines = range(len(topo.plan.pipelines))
    wanted: dict[tuple[int, ...], None] = {}
    for p in pipelines:
        for keys in sorted({tuple(sorted(k for k in keys if k[0] == p))
                            for keys in topo.holders.values()}):
            if len(keys) > 1:
                wanted.update(dict.fromkeys(topo.sum_ranks(keys)))
    mine = {}
    for ranks in wanted:
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine[ranks] = group
    me = topo.layout.of(rank).pipeline
    narrowed = dataclasses.replace(topo, holders={
        name: [k for k in keys if k[0] == me] for name, keys in topo.holders.items()})
    return narrowed, dataclasses.replace(groups, by_ranks={**groups.by_ranks, **mine})


def holder_weights(plan: Plan, topo: Topology, root: nn.Module, pipeline: int
                   ) -> dict[int, float]:
    """Per parameter (by id), this rank's weight among its holders (module docstring)."""
    sync = plan.training.sync

    def unit(p: int) -> float:
        return 1.0 if sync.mode == "average" else float(plan.pipelines[p].batch_share)

    return {id(param): unit(pipeline) / sum(unit(p) for p, _ in topo.holders[name])
            for name, param in root.named_parameters()}


class Averaging:
    """Every `interval` steps, the holders agree on each parameter (module docstring)."""

    def __init__(self, plan: Plan, across: GradientSum, root: nn.Module,
                 weights: dict[int, float], outer_lr: float, outer_momentum: float) -> None:
        """across: the every-step `GradientSum` (its buckets hold every parameter other
        stages hold too); weights: `holder_weights`."""
        self.sync = plan.training.sync
        self.across, self.weights = across, weights
        self.params = dict(root.named_parameters())
        self.outer: dict[str, torch.Tensor] = {}
        self.outer_optimizer: torch.optim.Optimizer | None = None
        if self.sync.mode == "diloco":
            self.outer = {name: p.detach().clone() for name, p in self.params.items()}
            values = list(self.outer.values())
            self.outer_optimizer = torch.optim.SGD(
                values, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0,
                foreach=False if len({type(v) for v in values}) > 1 else None)
            for value in values:  # (zeros: the first step's momentum is its gradient)
                self.outer_optimizer.state[value]["momentum_buffer"] = torch.zeros_like(value)

    def due(self, step: int) -> bool:
        """Whether the holders agree after step `step` (counted from 1)."""
        return step % self.sync.interval == 0

    def __call__(self) -> float:
        """Agree now (a collective); the seconds it took."""
        began = time.perf_counter()
        if self.sync.mode == "diloco":
            self._sum(lambda name, p: self.outer[name] - p.detach())
            for name, p in self.params.items():
                self.outer[name].grad, p.grad = p.grad, None
            self.outer_optimizer.step()
            with torch.no_grad():
                for name, p in self.params.items():
                    self.outer[name].grad = None
                    p.copy_(self.outer[name])
        else:
            self._sum(lambda name, p: p.detach())
            with torch.no_grad():
                for p in self.params.values():
                    p.copy_(p.grad)
                    p.grad = None
        return time.perf_counter() - began

    def _sum(self, value: Callable[[str, nn.Parameter], torch.Tensor]) -> None:
        """Each parameter's `value` weighted and summed over its holders, where its
        gradient goes (a parameter no other stage holds: its value)."""
        for name, p in self.params.items():
            p.grad = value(name, p) * self.weights[id(p)]
        for bucket in self.across.buckets:
            sum_bucket(bucket)

    def outer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """DiLoCo's outer parameters and momentum, by parameter name, for checkpoints
        (loaded in place); empty otherwise."""
        if self.outer_optimizer is None:
            return {}
        state = self.outer_optimizer.state
        return {"params": dict(self.outer),
                "momentum": {name: state[value]["momentum_buffer"]
                             for name, value in self.outer.items()}}
