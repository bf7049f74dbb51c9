"""Variable-length samples at run time: each step's samples packed into each pipeline's
micro-batches (`planner.data.packing`), every micro-batch run at its own rows and length.

Samples come as one token tensor per sample (a data hook that returns lists, or
synthetic samples whose lengths a data profile gives: `Batches.samples`). Every rank
packs the step alike from the samples' lengths (a pure function of them and of the
pipelines' rates, which rank 0 prices once and sends to all), so no rank waits on
another to know its micro-batches.

torch.distributed.pipelining sends every micro-batch in buffers of one shape, fixed at
the first step. A pipeline's micro-batches therefore travel flattened, each in a row of
the pipeline's token budget (its micro-batch size times the plan's sequence length, what
its memory was priced for): micro-batch j's r_j samples padded to L_j tokens fill the
first r_j L_j entries, the rest is zeros. Each stage chunk is wrapped (`ShapedChunk`) to
run on its micro-batch's own (r_j, L_j) only and to pad its output back into the row, so
compute and attention run on the micro-batch's own tokens. torch runs each stage once
before its first step to learn the buffers' shapes; that run uses the plan's own
micro-batch (micro_batch rows of seq_len tokens).

Loss: samples are padded on the right and the targets there are the index the loss
skips; a causal model's real tokens never see the padding. Each micro-batch's loss (the
model's mean over the targets it counts) is weighed by its counted targets over the
whole step's, so the step's loss is the mean over every counted target of the global
batch, as unpacked training computes it (`PackedLoss`).

The zoo's causal transformers without experts run packed (GPT, OPT, Llama): a
bidirectional model (BERT) would attend to the padding, and an experts layer's capacity
depends on the tokens of its micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from cost_models.tokens import TokenShape
from planner.data.packing import Packing, PipelineSlots, Work, balanced, naive
from planner.errors import PlannerError
from planner.runtime.data import IGNORED_TARGET, Batches
from planner.types import Plan

if TYPE_CHECKING:
    from planner.runtime.stage import ModelInfo

PACKINGS = ("balanced", "naive")


@dataclass(frozen=True, kw_only=True)
class Rates:
    """What every rank packs with: the pipelines as the packer sees them and its work."""

    slots: tuple[PipelineSlots, ...]
    work: Work


def check_packable(plan: Plan, model: nn.Module, *, following: bool) -> None:
    """An error where the plan's model or layout cannot run packed samples (see the
    module docstring)."""
    from planner.models.transformer import Transformer

    config = getattr(model, "cfg", None)
    if not isinstance(model, Transformer) or config is None:
        raise PlannerError("unsupported-model", f"Model {plan.model.describe()} cannot run "
                           "variable-length samples packed: only the zoo's transformers take "
                           "them (token ids, padded on the right).",
                           ["give samples of the plan's sequence length, stacked"])
    if not config.causal or config.experts:
        why = ("it attends both ways, so its tokens would see the padding" if not config.causal
               else "its experts' capacity depends on the tokens of each micro-batch")
        raise PlannerError("unsupported-model", f"Model {plan.model.describe()} cannot run "
                           f"variable-length samples packed: {why}, and the losses would "
                           "differ from unpacked training.",
                           ["give samples of the plan's sequence length, stacked"])
    if following:
        raise PlannerError("unsupported-plan", "Variable-length samples do not run yet on a "
                           "pipeline whose stages differ in tensor-parallel degree (a wider "
                           "stage's followers run no schedule of their own).",
                           ["plan with one tensor-parallel degree per pipeline"])


def plan_rates(plan: Plan) -> Rates:
    """The packer's view of the plan's pipelines, priced by the cost model."""
    from cost_models.model import AnalyticalCostModel
    from planner.data.steps import plan_rates as priced
    from planner.explain import retrace

    rates = priced(plan, retrace(plan).layers, AnalyticalCostModel(plan.cluster))
    return Rates(slots=tuple(rates.slots()), work=rates.work())


def shared_rates(plan: Plan, rank: int) -> Rates:
    """`plan_rates` priced on rank 0 and sent to every rank, so all pack alike."""
    made = [plan_rates(plan) if rank == 0 else None]
    dist.broadcast_object_list(made, src=0)
    return made[0]


def pack(lengths: Sequence[int], rates: Rates, packing: str) -> Packing:
    """A step of samples of these lengths packed as `packing` says (`PACKINGS`)."""
    if packing == "naive":
        return naive(lengths, rates.slots)
    return balanced(lengths, rates.slots, rates.work)


class ShapedChunk(nn.Module):
    """A stage chunk run on each micro-batch's own rows and length: its input is a row of
    the pipeline's token budget (flattened), its output padded back into one. The step's
    shapes are given before the schedule runs (`expect`), in the order of the chunk's
    forwards."""

    def __init__(self, chunk: nn.Module, budget: int) -> None:
        super().__init__()
        self.chunk = chunk
        self.budget = budget
        self.shapes: list[TokenShape] = []
        self.done = 0

    def expect(self, shapes: Sequence[TokenShape]) -> None:
        self.shapes, self.done = list(shapes), 0

    def check_done(self) -> None:
        """An error where the schedule ran other forwards than the shapes given."""
        if self.done != len(self.shapes):
            raise RuntimeError(f"packed stage chunk: {self.done} forwards ran for "
                               f"{len(self.shapes)} micro-batch shapes")

    def forward(self, flat: torch.Tensor) -> torch.Tensor:
        if self.done >= len(self.shapes):
            raise RuntimeError("packed stage chunk: a forward beyond the step's micro-batches")
        shape = self.shapes[self.done]
        self.done += 1
        tokens = shape.tokens
        rest = flat.shape[2:]
        out = self.chunk(flat[:, :tokens].reshape(shape.rows, shape.length, *rest))
        out = out.reshape(1, tokens, *out.shape[2:])
        if tokens == self.budget:
            return out
        return torch.cat((out, out.new_zeros(1, self.budget - tokens, *out.shape[2:])), dim=1)


@dataclass(kw_only=True)
class PackedLoss:
    """The loss of one packed micro-batch: the model's (a mean over the targets it counts,
    on the counted positions only) times its counted targets over the step's (`total`,
    set before each step's schedule runs), times the fixed fp16 loss scale where there is
    one."""

    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # the model's
    scale: float
    total: int = 1

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        counted = target != IGNORED_TARGET
        count = int(counted.sum())
        if not count:  # (a micro-batch of samples whose targets are all skipped)
            return output.sum() * 0.0
        value = self.loss(output[counted].unsqueeze(0), target[counted].unsqueeze(0))
        return value * (count * self.scale / self.total)


@dataclass(frozen=True, kw_only=True)
class StepBatch:
    """One rank's packed step: its pipeline's micro-batches flattened into rows of the
    budget (inputs and targets), their shapes, and the step's counted targets."""

    inputs: torch.Tensor
    targets: torch.Tensor
    shapes: tuple[TokenShape, ...]
    total: int


def step_batch(samples: Sequence[tuple[torch.Tensor, torch.Tensor]], packing: Packing,
               pipeline: int, budget: int) -> StepBatch:
    """The pipeline's micro-batches of `samples` (token ids and targets, 1-D) as packed:
    row j holds micro-batch j's samples, each padded on the right to the micro-batch's
    length (ids 0, targets the skipped index), one after the other."""
    batches = packing.pipelines[pipeline]
    inputs = torch.zeros(len(batches), budget, dtype=torch.long)
    targets = torch.full((len(batches), budget), IGNORED_TARGET, dtype=torch.long)
    for row, batch in enumerate(batches):
        for k, sample in enumerate(batch.samples):
            ids, wanted = samples[sample]
            at = k * batch.length
            inputs[row, at:at + len(ids)] = ids
            targets[row, at:at + len(wanted)] = wanted
    total = sum(int((wanted != IGNORED_TARGET).sum()) for _, wanted in samples)
    return StepBatch(inputs=inputs, targets=targets, total=max(total, 1),
                     shapes=tuple(batch.shape for batch in batches))


def packed_step(batches: Batches, step: int, rates: Rates, packing: str, pipeline: int
                ) -> StepBatch:
    """Step `step`'s samples packed, this rank's pipeline's share of them."""
    samples = batches.samples(step)
    lengths = [len(ids) for ids, _ in samples]
    budget = rates.slots[pipeline].budget
    return step_batch(samples, pack(lengths, rates, packing), pipeline, budget)


@dataclass(kw_only=True)
class PackedFeed:
    """One rank's packed steps: it packs each step, hands its chunks their micro-batches'
    shapes and the loss the step's counted targets (`prepare`), and checks that the
    schedule ran them all (`finish`). The schedule's first step runs each stage once
    more before its micro-batches, at the plan's micro-batch shape (torch learns the
    buffers' shapes from it), which `started` tells."""

    batches: Batches
    rates: Rates
    packing: str
    pipeline: int
    chunks: list[ShapedChunk]
    loss: PackedLoss
    planned: TokenShape
    started: bool = False

    def prepare(self, step: int, *, first: bool, last: bool, device: torch.device
                ) -> tuple[tuple[torch.Tensor, ...] | None, torch.Tensor | None]:
        """This rank's inputs (first stage) and targets (last stage) of step `step`."""
        batch = packed_step(self.batches, step, self.rates, self.packing, self.pipeline)
        self.loss.total = batch.total
        shapes = batch.shapes if self.started else (self.planned, *batch.shapes)
        for chunk in self.chunks:
            chunk.expect(shapes)
        inputs = (batch.inputs.to(device),) if first else None
        return inputs, batch.targets.to(device) if last else None

    def finish(self) -> None:
        for chunk in self.chunks:
            chunk.check_done()
        self.started = True


def packed_feed(plan: Plan, info: ModelInfo, batches: Batches, chunks: Sequence[nn.Module], *,
                pipeline: int, rank: int, packing: str, loss_scale: float, following: bool
                ) -> PackedFeed | None:
    """The packed feed where the samples vary in length (`Batches.variable`), else None.
    Every rank calls it (rank 0 prices the pipelines for all)."""
    if not batches.variable():
        return None
    check_packable(plan, info.module, following=following)
    rates = shared_rates(plan, rank)
    mine = plan.pipelines[pipeline]
    budget = rates.slots[pipeline].budget
    return PackedFeed(batches=batches, rates=rates, packing=packing, pipeline=pipeline,
                      chunks=[ShapedChunk(chunk, budget) for chunk in chunks],
                      loss=PackedLoss(loss=info.loaded.loss, scale=loss_scale),
                      planned=TokenShape(rows=mine.micro_batch, length=plan.training.seq_len))
