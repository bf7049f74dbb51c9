"""Stages wider than their pipeline's chains: a leader hands its tensor-parallel
followers every forward's inputs and every backward's output gradient.

A pipeline's stages may have different tensor-parallel degrees (its stages on
A100s tp 2, on V100s tp 4). torch.distributed.pipelining sends activations along
chains of one rank per stage, so a pipeline runs as many chains as its narrowest
stage has ranks (`Topology.chains`), pairing its stages' ranks index by index. On a
wider stage the ranks past those indices are followers: in no chain, they run no
schedule. The stage's rank of tensor-parallel index 0, its leader, runs chain 0's
schedule on its chunk wrapped in `Leading`, and broadcasts over itself and the
followers (`Following`):

  * before each forward, a header (what to do, the forward's number, each input's
    shape, dtype and requires_grad) and the inputs: the followers run their shards of
    the stage on them, which issues the tensor-parallel collectives the leader's
    forward issues, in the same order;
  * in each backward, first (the stage's output passes through `_Echo`, so its
    backward is the stage's first) a header and the output's gradient: the followers
    run that forward's backward with it;
  * after the schedule's step, "done": the followers leave their loop
    (`Follower.step`) for the step's gradient sums, loss and checkpoint, which every
    rank joins.

Activations are replicated on a stage's tensor-parallel ranks, so the leader's input
and output gradient are every follower's. What a follower's stage sends on (outputs,
input gradients) goes nowhere: the leader's chain carries it. The last stage's
followers need no targets: the loss's gradient arrives as their output's.

torch's metadata inference runs each stage's forward and backward once before the
first step, on stand-in tensors, through the same collectives, so the followers run
it too. Its backward computes input gradients only (`torch.autograd.grad`, no
parameter gradients): `LeadingStage` marks its forward, and the followers compute
its backward the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

FORWARD, BACKWARD, INFER_FORWARD, INFER_BACKWARD, DONE = range(5)


@dataclass(frozen=True)
class Following:
    """A stage's leader (global rank), the group of it and its followers, and the device
    their messages land on (a cuda device without index: the current one)."""

    leader: int
    group: dist.ProcessGroup
    device: torch.device


def _send(following: Following, op: int, index: int, tensors: Sequence[torch.Tensor]) -> None:
    """The leader's side of one message: the header, then the tensors."""
    header = [(op, index, [(tuple(t.shape), t.dtype, t.requires_grad) for t in tensors])]
    dist.broadcast_object_list(header, src=following.leader, group=following.group,
                               device=following.device)
    for tensor in tensors:
        dist.broadcast(tensor.detach().contiguous(), src=following.leader,
                       group=following.group)


def _receive(following: Following) -> tuple[int, int, list[torch.Tensor]]:
    """A follower's side of one message: (op, the forward's number, the tensors)."""
    header: list[Any] = [None]
    dist.broadcast_object_list(header, src=following.leader, group=following.group,
                               device=following.device)
    op, index, metas = header[0]
    tensors = []
    for shape, dtype, requires_grad in metas:
        tensor = torch.empty(shape, dtype=dtype, device=following.device)
        dist.broadcast(tensor, src=following.leader, group=following.group)
        tensors.append(tensor.requires_grad_(requires_grad))
    return op, index, tensors


class _Echo(torch.autograd.Function):
    """The identity, whose backward first hands the gradient to the followers."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, following: Following, index: int,
                op: int) -> torch.Tensor:
        ctx.following, ctx.index, ctx.op = following, index, op
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        _send(ctx.following, ctx.op, ctx.index, (grad,))
        return grad, None, None, None


class Leading(nn.Module):
    """A leader's chunk: each forward sends its inputs to the followers first, and its
    output's gradient follows in the backward (see the module docstring)."""

    def __init__(self, chunk: nn.Module, following: Following) -> None:
        super().__init__()
        self.chunk = chunk
        self.following = following
        self.inferring = False  # set by `LeadingStage` around torch's metadata inference
        self.forwards = 0

    @contextlib.contextmanager
    def inference(self) -> Iterator[None]:
        self.inferring = True
        try:
            yield
        finally:
            self.inferring = False

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if any(a.is_meta for a in args):  # shape propagation on meta runs no collectives
            return self.chunk(*args)
        index, self.forwards = self.forwards, self.forwards + 1
        _send(self.following, INFER_FORWARD if self.inferring else FORWARD, index, args)
        output = self.chunk(*args)
        return _Echo.apply(output, self.following, index,
                           INFER_BACKWARD if self.inferring else BACKWARD)

    def done(self) -> None:
        """Tell the followers the step's forwards and backwards are over."""
        _send(self.following, DONE, -1, ())


class LeadingStage(PipelineStage):
    """A PipelineStage that tells its `Leading` chunk when torch runs it for metadata
    inference (its backward computes only input gradients; the followers must too)."""

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        with self.submod.inference():
            return super()._forward_metadata_inference(*args, **kwargs)


if not hasattr(PipelineStage, "_forward_metadata_inference"):  # pragma: no cover
    raise ImportError("planner.runtime.follow needs torch.distributed.pipelining's "
                      "PipelineStage._forward_metadata_inference (torch 2.13)")


class Follower:
    """This rank's part of its stage when it follows the stage's leader: no schedule of
    its own, it mirrors the leader's forwards and backwards. It reads no data (the
    leader sends its inputs and the loss's gradient), hence not first nor last."""

    is_first = is_last = False

    def __init__(self, chunk: nn.Module, following: Following) -> None:
        self.chunk = chunk
        self.following = following

    def step(self, inputs: tuple | None, targets: Any) -> list[torch.Tensor]:
        """Mirror the leader until its step is done; no losses (the leader has them)."""
        pending: dict[int, tuple[list[torch.Tensor], torch.Tensor]] = {}
        while True:
            op, index, tensors = _receive(self.following)
            if op == DONE:
                return []
            with self._context(op):
                if op in (FORWARD, INFER_FORWARD):
                    pending[index] = (tensors, self.chunk(*tensors))
                    continue
                given, output = pending.pop(index)
                if op == BACKWARD:
                    torch.autograd.backward(output, tensors[0])
                else:  # as torch's metadata inference: input gradients only
                    torch.autograd.grad(output, [t for t in given if t.requires_grad],
                                        tensors[0], allow_unused=True)

    def _context(self, op: int) -> contextlib.AbstractContextManager:
        """torch runs its metadata inference with gradients on and the RNG forked."""
        if op not in (INFER_FORWARD, INFER_BACKWARD):
            return contextlib.nullcontext()
        device = self.following.device
        stack = contextlib.ExitStack()
        cpu = device.type == "cpu"
        stack.enter_context(torch.random.fork_rng(
            devices=[] if cpu else [device], device_type=None if cpu else device.type))
        stack.enter_context(torch.enable_grad())
        return stack
