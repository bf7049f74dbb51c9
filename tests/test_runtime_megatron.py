"""Megatron's tensor-parallel options in the runtime: sequence parallelism, the
vocabulary-parallel embedding, head and loss, and selective recompute train exactly like
one process (gloo, one process per rank; parameters compared after SGD steps)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.multiprocessing as mp

from planner.errors import PlannerError
from planner.planfile import write_plan
from planner.runtime.checkpoint import load_full_model
from planner.runtime.reference import build_reference, train_reference
from planner.runtime.stage import check_options
from planner.runtime.summary import read_losses
from planner.types import Recompute
from tests.runtime_helpers import free_port, on_devices, run_ranks, tiny_plan

STEPS = 3


def _megatron(plan, *, sequence: bool, vocab: bool):
    return dataclasses.replace(plan, training=dataclasses.replace(
        plan.training, sequence_parallel=sequence, vocab_parallel=vocab))


def _check(tmp_path, plan) -> dict:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path, run_dir = tmp_path / "plan.json", tmp_path / "run"
    write_plan(plan, path)
    run_ranks(path, run_dir=run_dir, steps=STEPS, optimizer="sgd")
    losses, model = train_reference(plan, steps=STEPS, lr=1e-3, optimizer="sgd")
    got = read_losses(run_dir)
    assert [got[i + 1] for i in range(STEPS)] == pytest.approx(losses, rel=1e-5)
    _, trained = build_reference(plan, seed=0)
    load_full_model(run_dir / "checkpoints" / f"step-{STEPS:08d}", trained)
    expected, found = model.state_dict(), trained.state_dict()
    assert expected.keys() == found.keys()
    for name, value in expected.items():
        torch.testing.assert_close(found[name], value, rtol=1e-4, atol=1e-5, msg=name)
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow
def test_sequence_and_vocabulary_parallel_stages_with_selective_recompute(tmp_path):
    """tp 2 x pp 2: the embedding's stage and the head's (which holds a copy of the tied
    token table) each split the table by rows, pass sequence slices between them, and
    the loss reduces over the vocabulary slices."""
    plan = _megatron(tiny_plan("1x4xcpu", tp=2, pp=2, recompute=Recompute.SELECTIVE),
                     sequence=True, vocab=True)
    summary = _check(tmp_path, plan)
    per_rank = {r["rank"]: r["params"] for r in summary["ranks"]}
    full = sum(p.numel() for p in build_reference(plan, 0)[1].parameters())
    # the token table is split too now: each tp rank holds half of each stage
    assert per_rank[0] == per_rank[1] and per_rank[2] == per_rank[3]
    assert per_rank[0] + per_rank[2] < full * 0.6
    assert not any("replicated" in note for note in summary["notes"])


@pytest.mark.slow
def test_sequence_parallel_alone_and_vocabulary_parallel_alone(tmp_path):
    """One stage of tp 2 holding the embedding, the blocks and the tied head: sequence
    parallelism with the embedding and head replicated, then the vocabulary split
    without sequence parallelism."""
    base = tiny_plan("1x2xcpu", tp=2, pp=1)
    _check(tmp_path / "sequence", _megatron(base, sequence=True, vocab=False))
    _check(tmp_path / "vocab", _megatron(base, sequence=False, vocab=True))


def test_sequence_parallel_pipelines_need_one_degree():
    plan = on_devices(tiny_plan("1x4xcpu", pp=2), 0, [(0, 1), (2,)])
    with pytest.raises(PlannerError, match=r"degrees \[1, 2\] with training.sequence_parallel"):
        check_options(_megatron(plan, sequence=True, vocab=False))
    check_options(plan)  # (without the options, mixed degrees run)


def _parallel_loss_rank(rank: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from planner.runtime.parallel import ShardedLogitsLoss

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    whole = torch.randn(3, 5, 8, requires_grad=True)
    targets = torch.randint(0, 8, (3, 5))
    targets[0, 0] = -100  # (left out of the mean, as cross_entropy does)
    expected = F.cross_entropy(whole.flatten(0, 1), targets.flatten())
    expected.backward()
    mine = whole.detach()[..., 4 * rank:4 * rank + 4].clone().requires_grad_()
    logits = DTensor.from_local(mine, mesh, [Shard(2)], run_check=False)
    loss = ShardedLogitsLoss(None)(logits, targets)
    loss.backward()
    torch.save({"expected": expected.detach(), "loss": loss.detach(), "grad": mine.grad,
                "whole": whole.grad[..., 4 * rank:4 * rank + 4]}, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow
def test_the_parallel_cross_entropy_is_the_model_loss_over_vocabulary_slices(tmp_path):
    """Each rank holds half of the logits' vocabulary: the loss and each slice's gradient
    are those of cross_entropy over whole logits, the logits never gathered."""
    out = str(tmp_path / "loss")
    mp.start_processes(_parallel_loss_rank, args=(free_port(), out), nprocs=2,
                       start_method="spawn")
    for rank in (0, 1):
        got = torch.load(f"{out}.{rank}")
        torch.testing.assert_close(got["loss"], got["expected"])
        torch.testing.assert_close(got["grad"], got["whole"])
