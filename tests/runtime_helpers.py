"""Helpers for the runtime tests: small plans for gpt-tiny on CPU "devices", and
running a plan's ranks as local processes (gloo).

Processes come from a forkserver that imports torch and the runtime once per test
session, so each run costs process start-up, not a torch import per rank.
"""

from __future__ import annotations

import dataclasses
import json
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


def on_devices(plan: Plan, pipeline: int, devices: Sequence[tuple[int, ...]]) -> Plan:
    """`plan` with pipeline `pipeline`'s stages on these devices of their nodes, each
    stage's tensor-parallel degree its device count."""
    p = plan.pipelines[pipeline]
    stages = tuple(dataclasses.replace(s, tp=len(d), devices=dataclasses.replace(
        s.devices, devices=tuple(d))) for s, d in zip(p.stages, devices, strict=True))
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


def tp_block_bytes(flavor: str, shape: dict, *, seq: int, batch: int, out: Path
                   ) -> dict[str, float]:
    """What rank 0 of a 2-way tensor-parallel group moves and keeps in one forward and
    backward of the first block of `flavor` (fp32), as the runtime shards it: the
    bytes it all-reduces ("all-reduced") and the bytes of the activations autograd
    saves for the backward ("saved": each storage once, parameters left out; "saved
    whole": the same without tensor parallelism)."""
    mp.start_processes(_tp_block_rank, args=(flavor, shape, seq, batch, str(out), free_port()),
                       nprocs=2, start_method="forkserver")
    return json.loads(out.read_text())


def _saved_bytes(block: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The block's output and the bytes of what autograd saves in its forward."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    weights = {local(p).untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = local(t).untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = block(x)
    return y, sum(seen.values())


def _tp_block_rank(rank: int, flavor: str, shape: dict, seq: int, batch: int, out: str,
                   port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.utils._python_dispatch import TorchDispatchMode

    from planner.models import load_model, model_spec
    from planner.runtime.parallel import _transformer_block
    from planner.runtime.stage import materialize

    class AllReduces(TorchDispatchMode):
        """Sums the bytes of the all-reduces DTensor's collectives issue."""

        def __init__(self) -> None:
            super().__init__()
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(t is DTensor for t in types):
                return NotImplemented  # let DTensor turn it into plain ops and collectives
            if "all_reduce" in str(func):
                self.bytes += args[0].numel() * args[0].element_size()
            return func(*args, **(kwargs or {}))

    def block() -> torch.nn.Module:
        loaded = load_model(model_spec(flavor, shape), seq_len=seq, device="meta")
        return next(m for m in materialize(loaded.module, 0).modules()
                    if type(m).__name__ == "Block")

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        torch.manual_seed(0)
        x = torch.randn(batch, seq, shape["hidden"], requires_grad=True)
        _, whole = _saved_bytes(block(), x)
        sharded = block()
        parallelize_module(sharded, init_device_mesh("cpu", (2,)),
                           _transformer_block(sharded, 2, "block"))
        counter = AllReduces()
        with counter:
            y, saved = _saved_bytes(sharded, x)
            y.sum().backward()
        if rank == 0:
            Path(out).write_text(json.dumps({"all-reduced": counter.bytes, "saved": saved,
                                             "saved whole": whole}))
    finally:
        dist.destroy_process_group()
