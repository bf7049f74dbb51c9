"""Variable-length samples at run time (`planner.runtime.packed`): packed training gives
the losses and parameters of unpacked training, in one process (the packing's
arithmetic) and in distributed runs against single-process training on the same samples
padded to the sequence length."""

import json
import random

import pytest
import torch

from planner.data.packing import PipelineSlots, Work, balanced, naive
from planner.data.profile import Sample, lognormal_lengths, profile_json, summarize
from planner.errors import PlannerError
from planner.planfile import write_plan
from planner.runtime.checkpoint import load_full_model
from planner.runtime.data import Batches
from planner.runtime.packed import (
    PackedLoss,
    ShapedChunk,
    check_packable,
    pack,
    plan_rates,
    step_batch,
)
from planner.runtime.reference import build_reference, train_reference
from planner.runtime.summary import read_losses
from planner.types import Schedule
from tests.data_samples import padded, sample_length, variable
from tests.runtime_helpers import SEQ, run_ranks, tiny_plan

slow = pytest.mark.slow
STEPS = 3


def _slots(*shares: tuple[int, int, float]) -> list[PipelineSlots]:
    """(micro-batches, micro-batch size, speed) per pipeline, sequences of SEQ tokens."""
    return [PipelineSlots(micro_batches=m, speed=speed, budget=size * SEQ, batch_share=m * size,
                          micro_batch=size) for m, size, speed in shares]


@pytest.mark.parametrize("packer", ["balanced", "naive"])
def test_packed_micro_batches_give_the_unpacked_loss_and_gradients(packer):
    plan = tiny_plan("1x2xcpu", dp=1)
    info, model = build_reference(plan, seed=0)
    batch = 12
    samples = list(zip(*variable(0, 0, batch, seq_len=SEQ, seed=3), strict=True))
    lengths = [len(ids) for ids, _ in samples]
    assert len(set(lengths)) > 3  # (the samples do vary)
    slots = _slots((3, 2, 1.0), (2, 3, 2.0))
    work = Work(seq_len=SEQ, quadratic=0.1)
    packing = (balanced(lengths, slots, work) if packer == "balanced"
               else naive(lengths, slots))
    # unpacked: the whole batch padded to the sequence length, the loss's mean
    (ids,), targets = padded(0, 0, batch, seq_len=SEQ, seed=3)
    whole = info.loaded.loss(model(ids), targets)
    whole.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    # packed: every pipeline's micro-batches, each run at its own rows and length
    total = 0.0
    for pipeline, pipeline_slots in enumerate(slots):
        step = step_batch(samples, packing, pipeline, pipeline_slots.budget)
        chunk = ShapedChunk(model, pipeline_slots.budget)
        chunk.expect(step.shapes)
        loss = PackedLoss(loss=info.loaded.loss, scale=1.0, total=step.total)
        for row in range(len(step.shapes)):
            value = loss(chunk(step.inputs[row:row + 1]), step.targets[row:row + 1])
            value.backward()
            total += float(value.detach())
        chunk.check_done()
    assert total == pytest.approx(float(whole.detach()), rel=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_chunk_runs_each_micro_batch_at_its_own_shape_and_pads_it_back():
    seen = []

    class Record(torch.nn.Module):
        def forward(self, x):
            seen.append(tuple(x.shape))
            return x.unsqueeze(-1).float() * 2

    from cost_models.tokens import TokenShape

    chunk = ShapedChunk(Record(), budget=12)
    chunk.expect([TokenShape(rows=2, length=5), TokenShape(rows=3, length=4)])
    first = chunk(torch.arange(12).reshape(1, 12))
    second = chunk(torch.arange(12).reshape(1, 12))
    assert seen == [(2, 5), (3, 4)]
    assert first.shape == (1, 12, 1) and first[0, :10, 0].tolist() == [2.0 * i for i in range(10)]
    assert first[0, 10:, 0].tolist() == [0.0, 0.0]
    assert second[0, :, 0].tolist() == [2.0 * i for i in range(12)]
    chunk.check_done()
    with pytest.raises(RuntimeError, match="beyond the step's micro-batches"):
        chunk(torch.zeros(1, 12, dtype=torch.long))
    chunk.expect([TokenShape(rows=1, length=3)])
    with pytest.raises(RuntimeError, match="0 forwards ran for 1 micro-batch shapes"):
        chunk.check_done()


def test_samples_of_a_hook_and_of_a_profile():
    plan = tiny_plan("1x2xcpu", dp=1)
    info, _ = build_reference(plan, seed=0)
    hooked = Batches(info.loaded, global_batch=5, seed=2, hook="tests.data_samples:variable",
                     vocab=info.vocab, classes=info.classes)
    assert hooked.variable()
    got = hooked.samples(1)
    assert [len(ids) for ids, _ in got] == [sample_length(1, i, seq_len=SEQ, seed=2)
                                            for i in range(5)]
    assert all(ids.dtype == torch.int64 for ids, _ in got)
    stacked = Batches(info.loaded, global_batch=5, seed=2, hook="tests.data_samples:padded",
                      vocab=info.vocab, classes=info.classes)
    assert not stacked.variable()
    assert not Batches(info.loaded, global_batch=5, seed=2).variable()
    lengths = lognormal_lengths(500, median=8, sigma=1.0, low=1, high=200,
                                rng=random.Random(0))
    profile = summarize([Sample(tokens=n) for n in lengths], "t")
    drawn = Batches(info.loaded, global_batch=64, seed=2, vocab=info.vocab,
                    classes=info.classes, lengths=profile)
    assert drawn.variable()
    first, again = drawn.samples(4), drawn.samples(4)
    assert [a.tolist() for a, _ in first] == [b.tolist() for b, _ in again]
    assert all(1 <= len(ids) <= SEQ and torch.equal(ids[1:], wanted[:-1])
               for ids, wanted in first)  # next-token targets, cut to the sequence length
    assert len({len(ids) for ids, _ in first}) > 5
    assert [len(a) for a, _ in drawn.samples(5)] != [len(a) for a, _ in first]


def too_long(step, start, stop, *, seq_len, seed):
    inputs, targets = variable(step, start, stop, seq_len=seq_len, seed=seed)
    inputs[1] = torch.zeros(seq_len + 3, dtype=torch.long)
    targets[1] = torch.zeros(seq_len + 3, dtype=torch.long)
    return inputs, targets


def uneven(step, start, stop, *, seq_len, seed):
    inputs, targets = variable(step, start, stop, seq_len=seq_len, seed=seed)
    targets[2] = targets[2][:-1]
    return inputs, targets


@pytest.mark.parametrize(("hook", "message"), [
    ("too_long", f"sample 1 of step 0 with {SEQ + 3} token ids and {SEQ + 3} targets"),
    ("uneven", "sample 2 of step 0 with"),
])
def test_bad_variable_samples_name_the_sample(hook, message):
    plan = tiny_plan("1x2xcpu", dp=1)
    info, _ = build_reference(plan, seed=0)
    batches = Batches(info.loaded, global_batch=4, seed=0,
                      hook=f"tests.test_data_runtime:{hook}", vocab=info.vocab,
                      classes=info.classes)
    with pytest.raises(PlannerError) as err:
        batches.samples(0)
    assert message in err.value.message


def test_packing_options_are_checked(tmp_path):
    from planner.runtime.__main__ import options_from, parser
    from planner.runtime.train import RunOptions, check_options

    with pytest.raises(PlannerError, match="--packing must be balanced or naive"):
        check_options(RunOptions(plan=tmp_path / "p.json", packing="sorted"))
    with pytest.raises(PlannerError, match=r"--lengths .* or --data .*, not both"):
        check_options(RunOptions(plan=tmp_path / "p.json", lengths=tmp_path / "l.json",
                                 data="tests.data_samples:variable"))
    given = options_from(parser().parse_args(["--plan", "p.json", "--lengths", "l.json",
                                              "--packing", "naive"]))
    assert (str(given.lengths), given.packing) == ("l.json", "naive")


def test_models_that_cannot_run_packed_are_named():
    from planner.models import load_model, model_spec

    plan = tiny_plan("1x2xcpu", dp=1)
    bert = load_model(model_spec("bert-base", {"layers": 1}), seq_len=SEQ, device="meta").module
    with pytest.raises(PlannerError, match="attends both ways"):
        check_packable(plan, bert, following=False)
    gpt = build_reference(plan, seed=0)[0].module
    check_packable(plan, gpt, following=False)
    with pytest.raises(PlannerError, match="differ in tensor-parallel degree"):
        check_packable(plan, gpt, following=True)


def test_the_runtimes_rates_follow_the_plan():
    plan = tiny_plan("1x4xcpu", pp=2, dp=2, shares=[3, 1])
    rates = plan_rates(plan)
    assert [s.micro_batches for s in rates.slots] == [3, 1]
    assert [s.budget for s in rates.slots] == [2 * SEQ, 2 * SEQ]
    # identical pipelines, but the one running three micro-batches shares its pipeline
    # fill over more samples: more samples per second
    assert rates.slots[0].speed > rates.slots[1].speed > 0
    assert 0 < rates.work.quadratic < 1
    lengths = [4, 30, 7, 19, 2, 11, 25, 9]
    assert pack(lengths, rates, "naive") == naive(lengths, list(rates.slots))


# ---- distributed runs ----------------------------------------------------------------------

def _check(plan, run_dir, *, steps=STEPS):
    losses, model = train_reference(plan, steps=steps, optimizer="sgd",
                                    data="tests.data_samples:padded")
    got = read_losses(run_dir)
    assert [got[i + 1] for i in range(steps)] == pytest.approx(losses, rel=1e-5)
    _, trained = build_reference(plan, seed=0)
    load_full_model(run_dir / "checkpoints" / f"step-{steps:08d}", trained)
    expected, found = model.state_dict(), trained.state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(found[name], value, rtol=1e-4, atol=1e-5, msg=name)


def _run(tmp_path, plan, **options):
    path = tmp_path / "plan.json"
    write_plan(plan, path)
    run_dir = tmp_path / "run"
    run_ranks(path, run_dir=run_dir, steps=STEPS, optimizer="sgd",
              data="tests.data_samples:variable", **options)
    return run_dir


@slow
@pytest.mark.parametrize("packing", ["balanced", "naive"])
def test_packed_pipelines_train_like_one_process(tmp_path, packing):
    """Two pipelines of two stages, unequal shares: packed variable-length samples give
    the losses and parameters of single-process training on them padded."""
    plan = tiny_plan("1x4xcpu", pp=2, dp=2, shares=[3, 1])
    _check(plan, _run(tmp_path, plan, packing=packing))


LAYOUTS = {
    "gpipe": lambda: tiny_plan("1x2xcpu", pp=2, schedule=Schedule.GPIPE),
    "single stages": lambda: tiny_plan("1x3xcpu", pp=1, dp=3, shares=[1, 2, 1]),
    "interleaved": lambda: tiny_plan("1x2xcpu", pp=2, interleave=2, micro_batch=2, batch=8),
    "tensor parallel": lambda: tiny_plan("1x4xcpu", tp=2, pp=2),
}


@slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_schedules_and_layouts(tmp_path, layout):
    plan = LAYOUTS[layout]()
    _check(plan, _run(tmp_path, plan))


@slow
def test_synthetic_samples_of_a_data_profile(tmp_path):
    plan = tiny_plan("1x2xcpu", pp=1, dp=2)
    profile = tmp_path / "lengths.json"
    profile.write_text(profile_json(summarize(
        [Sample(tokens=n) for n in lognormal_lengths(400, median=8, sigma=1.0, low=1,
                                                     high=SEQ, rng=random.Random(5))], "t")))
    path = tmp_path / "plan.json"
    write_plan(plan, path)
    run_ranks(path, run_dir=tmp_path / "run", steps=2, optimizer="sgd", lengths=profile)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps_run"] == 2 and all(row["loss"] > 0 for row in summary["losses"])
