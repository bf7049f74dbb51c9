"""Helpers for the runtime tests: small plans for gpt-tiny on CPU "devices", and
running a plan's ranks as local processes (gloo).

Processes come from a forkserver that imports torch and the runtime once per test
session, so each run costs process start-up, not a torch import per rank.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from planner.types import Plan

SEQ = 32  # gpt-tiny's sequence length in these tests (its own is 64)


@lru_cache(maxsize=4)
def _traced(overrides: tuple = ()) -> Any:
    from planner.models import load_model, model_spec
    from planner.trace import trace_loaded

    return trace_loaded(load_model(model_spec("gpt-tiny", dict(overrides)), seq_len=SEQ),
                        dtype="fp32")


def tiny_plan(cluster: str, *, tp: int = 1, pp: int = 1, dp: int = 1, micro_batch: int = 2,
              batch: int = 8, shares: Sequence[int] | None = None, shape: tuple = (),
              **kw: Any) -> Plan:
    """A uniform plan for gpt-tiny (fp32, sequence 32; `shape`: (key, value) overrides
    of its shape), with uneven micro-batch counts per pipeline if `shares` is given."""
    from cost_models.cluster import load_cluster
    from cost_models.model import AnalyticalCostModel
    from planner.solver.uniform import uniform_plan
    from planner.types import TrainingSpec

    spec = load_cluster(cluster)
    graph = _traced(shape)
    training = TrainingSpec(global_batch=batch, seq_len=SEQ, dtype="fp32")
    plan = uniform_plan(layers=graph.layers, model=graph.spec, cluster=spec, training=training,
                        costs=AnalyticalCostModel(spec), tp=tp, pp=pp, dp=dp,
                        micro_batch=micro_batch, **kw)
    if shares:
        pipes = [dataclasses.replace(p, batch_share=m * micro_batch, num_microbatches=m)
                 for p, m in zip(plan.pipelines, shares, strict=True)]
        plan = dataclasses.replace(plan, pipelines=tuple(pipes))
    return plan


def solver_plan(cluster: str, *, batch: int = 8, zeros: Sequence[int] = (0, 1, 2, 3),
                **limits: Any) -> Plan:
    """The solver's plan for gpt-tiny (fp32, sequence 32) under these limits and ZeRO
    stages."""
    from cost_models.cluster import load_cluster
    from planner.solver import Limits, SolveOptions, Space, solve
    from planner.types import TrainingSpec

    training = TrainingSpec(global_batch=batch, seq_len=SEQ, dtype="fp32")
    options = SolveOptions(limits=Limits(**limits), space=Space(zeros=tuple(zeros)),
                           with_baselines=False)
    return solve(_traced(), load_cluster(cluster), training, options)[0]


def resplit(plan: Plan, pipeline: int, bounds: Sequence[tuple[int, int]]) -> Plan:
    """`plan` with pipeline `pipeline`'s stages holding other layer ranges."""
    graph = _traced()
    p = plan.pipelines[pipeline]
    stages = tuple(dataclasses.replace(
        s, layers=(a, b), chunks=((a, b),),
        modules=tuple(m for layer in graph.layers[a:b] for m in layer.modules))
        for s, (a, b) in zip(p.stages, bounds, strict=True))
    pipes = list(plan.pipelines)
    pipes[pipeline] = dataclasses.replace(p, stages=stages)
    return dataclasses.replace(plan, pipelines=tuple(pipes))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(index: int, plan_path: str, nodes: list[tuple[int, int]], port: int,
          options: dict) -> None:
    torch.set_num_threads(1)
    node_rank = next(n for n, (first, count) in enumerate(nodes)
                     if first <= index < first + count)
    first, count = nodes[node_rank]
    env = dict(os.environ, RANK=str(index), WORLD_SIZE=str(sum(c for _, c in nodes)),
               LOCAL_RANK=str(index - first), LOCAL_WORLD_SIZE=str(count),
               GROUP_RANK=str(node_rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from planner.runtime.train import RunOptions, run

    run(RunOptions(plan=Path(plan_path), **options), env)


def run_ranks(plan_path: Path, **options: Any) -> None:
    """Run every rank of the plan as a local process (what torchrun would start)."""
    from planner.planfile import read_plan
    from planner.runtime.layout import rank_layout

    layout = rank_layout(read_plan(plan_path))
    nodes = [(n.first_rank, n.nproc) for n in layout.nodes]
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed.pipelining",
                                    "torch.distributed.fsdp", "torch.distributed.tensor.parallel",
                                    "torch.distributed.checkpoint", "planner.runtime.train"])
    options.setdefault("timeout", 120.0)
    mp.start_processes(_rank, args=(str(plan_path), nodes, free_port(), options),
                       nprocs=layout.world_size, start_method="forkserver")
