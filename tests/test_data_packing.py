"""Data-aware steps: a micro-batch priced by its tokens (`cost_models.tokens`), packing
a step's variable-length samples (`planner.data.packing`) and replaying packed steps
(`planner.data.steps`, the simulator's per-micro-batch timings)."""

import itertools
import random

import pytest

from cost_models.tokens import (
    TokenShape,
    linear_factor,
    quadratic_share,
    token_budget,
    token_factor,
)
from planner.data.loading import Feed
from planner.data.packing import (
    PipelineSlots,
    Work,
    balanced,
    equal_runs,
    lpt,
    naive,
)
from planner.data.profile import lognormal_lengths
from planner.data.steps import PipelineRates, PlanRates, replay, scaled
from planner.errors import PlannerError
from planner.simulate import simulate
from planner.solver.timing import StageTiming
from planner.types import DeviceSpec, Kernel, Layer, LayerKind, LinkSpec, OpClass, Schedule

GPU = DeviceSpec(name="G", vendor="x", memory=80 * 2**30, memory_bandwidth=2e12,
                 peak_flops={"bf16": 312e12}, intra_link=LinkSpec(name="nvlink",
                                                                  bandwidth=300e9, latency=0))
WORK = Work(seq_len=1024, quadratic=0.2)


# ---- pricing by tokens --------------------------------------------------------------------

def test_token_factor_by_hand():
    # 2 of 4 rows at a quarter of the length: half the rows, and per row a quarter of the
    # linear work plus a sixteenth of the quadratic
    shape = TokenShape(rows=2, length=1024)
    assert token_factor(shape, micro_batch=4, seq_len=4096, quadratic=0.25) == pytest.approx(
        0.5 * (0.75 * 0.25 + 0.25 * 0.0625))
    assert token_factor(TokenShape(rows=4, length=4096), micro_batch=4, seq_len=4096,
                        quadratic=0.3) == pytest.approx(1.0)
    assert linear_factor(shape, micro_batch=4, seq_len=4096) == pytest.approx(2048 / 16384)
    assert token_budget(micro_batch=4, seq_len=4096) == 16384


def _layer(matmul_flops: float, core_flops: float) -> Layer:
    kernels = (Kernel(op_class=OpClass.MATMUL, count=1, flops=matmul_flops,
                      bwd_flops=2 * matmul_flops, bytes=0.0, bytes_fixed=0.0),
               Kernel(op_class=OpClass.ATTENTION, count=1, flops=core_flops,
                      bwd_flops=2.5 * core_flops, bytes=0.0, bytes_fixed=0.0, core=True))
    return Layer(index=0, name="block", kind=LayerKind.BLOCK, modules=("b",), params=1,
                 param_bytes=2, buffer_bytes=0, fwd_flops=matmul_flops + core_flops,
                 bwd_flops=2 * matmul_flops + 2.5 * core_flops, activation_bytes=0.0,
                 saved_by_class={}, selective_bytes=0.0, input_bytes=0.0, output_bytes=0.0,
                 tp_comm_bytes=0.0, tp_divisor=1, kernels=kernels, signature="s")


def test_quadratic_share_by_hand():
    # the roofline: matmuls at 75% of the peak, attention cores at 55%, 5 us per launch
    layer = _layer(3e12, 1e12)
    matmul = 3e12 / (312e12 * 0.75) + 5e-6
    core = 1e12 / (312e12 * 0.55) + 5e-6
    assert quadratic_share([layer, layer], GPU, tp=1, dtype="bf16") == pytest.approx(
        core / (matmul + core))
    assert quadratic_share([_layer(3e12, 0.0)], GPU, tp=1, dtype="bf16") == pytest.approx(
        5e-6 / (matmul + 5e-6))  # (a core kernel of no FLOPs still pays its launch)


def test_quadratic_share_of_a_traced_transformer_grows_with_the_sequence():
    from planner.models import model_spec
    from planner.trace import trace_model

    shares = []
    for seq in (128, 1024):
        graph = trace_model(model_spec("gpt2-small"), seq_len=seq, dtype="bf16")
        blocks = [layer for layer in graph.layers if layer.kind is LayerKind.BLOCK]
        shares.append(quadratic_share(blocks, GPU, tp=1, dtype="bf16"))
    assert 0 < shares[0] < shares[1] < 1


def test_a_stage_scaled_to_a_packed_micro_batch_by_hand():
    timing = StageTiming(fwd=1.0, bwd=2.5, tp_fwd=0.2, tp_bwd=0.5, recompute=0.3, send=0.1)
    shape = TokenShape(rows=3, length=512)
    out = scaled(timing, 0.4, shape, micro_batch=2, seq_len=1024)
    compute = 1.5 * (0.6 * 0.5 + 0.4 * 0.25)
    moved = 3 * 512 / 2048
    assert out.fwd == pytest.approx(0.8 * compute + 0.2 * moved)
    assert out.bwd == pytest.approx(2.0 * compute + 0.5 * moved)
    assert (out.tp_fwd, out.tp_bwd) == pytest.approx((0.2 * moved, 0.5 * moved))
    assert out.recompute == pytest.approx(0.3 * compute)
    assert out.send == pytest.approx(0.1 * moved)
    same = scaled(timing, 0.4, TokenShape(rows=2, length=1024), micro_batch=2, seq_len=1024)
    assert (same.fwd, same.bwd, same.tp_fwd, same.recompute, same.send) == pytest.approx(
        (timing.fwd, timing.bwd, timing.tp_fwd, timing.recompute, timing.send))


# ---- packing ------------------------------------------------------------------------------

def _slots(*specs: tuple[int, float, int]) -> list[PipelineSlots]:
    """(micro-batches, speed, micro-batch size) per pipeline, sequences of 1024 tokens."""
    return [PipelineSlots(micro_batches=m, speed=speed, budget=size * 1024,
                          batch_share=m * size, micro_batch=size) for m, speed, size in specs]


def _check_packing(packing, lengths, slots):
    seen = sorted(i for p in range(len(slots)) for i in packing.samples(p))
    assert seen == list(range(len(lengths)))  # every sample once
    for batches, pipeline in zip(packing.pipelines, slots, strict=True):
        assert len(batches) == pipeline.micro_batches
        for batch in batches:
            assert batch.samples, "an empty micro-batch"
            assert batch.length == max(lengths[i] for i in batch.samples)
            assert batch.shape.tokens <= pipeline.budget


def _work(packing, pipeline: int) -> float:
    return sum(WORK.of(batch.shape) for batch in packing.pipelines[pipeline])


def _lengths(count: int, seed: int) -> list[int]:
    return lognormal_lengths(count, median=120, sigma=1.0, low=2, high=1024,
                             rng=random.Random(seed))


@pytest.mark.parametrize("seed", range(6))
def test_every_sample_packed_once_within_budgets(seed):
    slots = _slots((8, 1.0, 4), (8, 1.0, 4), (4, 0.5, 4))
    lengths = _lengths(sum(s.batch_share for s in slots), seed)
    for packing in (naive(lengths, slots), balanced(lengths, slots, WORK)):
        _check_packing(packing, lengths, slots)


def test_naive_follows_the_plan_shares_in_order():
    slots = _slots((2, 1.0, 2), (1, 1.0, 3))
    lengths = [5, 9, 2, 7, 1, 3, 8]
    packing = naive(lengths, slots)
    assert [[b.samples for b in p] for p in packing.pipelines] == [
        [(0, 1), (2, 3)], [(4, 5, 6)]]
    assert [b.length for b in packing.pipelines[0]] == [9, 7]
    with pytest.raises(PlannerError, match="shares add up to 7 samples; the step has 8"):
        naive([*lengths, 4], slots)


def test_lpt_stays_within_one_job_of_the_speed_shares():
    rng = random.Random(1)
    works = [rng.lognormvariate(0, 1) for _ in range(200)]
    slots = _slots((5, 1.0, 1), (5, 2.0, 1), (5, 1.0, 1))
    taken = lpt(works, [1] * len(works), slots)
    assert sorted(i for t in taken for i in t) == list(range(200))
    finish = [sum(works[i] for i in t) / s.speed for t, s in zip(taken, slots, strict=True)]
    ideal = sum(works) / sum(s.speed for s in slots)
    # LPT on uniform machines: no machine ends later than the ideal plus its last job
    assert max(finish) <= ideal + max(works) / min(s.speed for s in slots)
    assert all(len(t) >= s.micro_batches for t, s in zip(taken, slots, strict=True))


def test_lpt_gives_every_pipeline_its_micro_batches_even_when_one_is_far_faster():
    slots = _slots((3, 100.0, 1), (3, 1.0, 1))
    taken = lpt([1.0] * 6, [1] * 6, slots)
    assert [len(t) for t in taken] == [3, 3]


def test_equal_runs_keep_the_heaviest_run_within_one_sample_of_the_mean():
    for seed in range(5):
        ordered = sorted(_lengths(300, seed), reverse=True)
        runs = equal_runs(ordered, 12, WORK, budget=8 * 1024)
        assert runs is not None and len(runs) == 12
        assert runs[0][0] == 0 and runs[-1][1] == 300
        assert all(a[1] == b[0] for a, b in itertools.pairwise(runs))
        works = [WORK.of(TokenShape(rows=b - a, length=ordered[a])) for a, b in runs]
        padded = sum(works)
        heaviest_sample = WORK.of(TokenShape(rows=1, length=ordered[0]))
        assert max(works) <= padded / 12 + heaviest_sample
        assert all((b - a) * ordered[a] <= 8 * 1024 for a, b in runs)


def test_equal_runs_say_when_the_budget_cannot_hold_the_samples():
    assert equal_runs([1024, 1024, 1024], 2, WORK, budget=1024) is None


def test_balanced_work_matches_pipeline_speeds():
    slots = _slots((4, 1.0, 8), (4, 3.0, 8))
    lengths = _lengths(64, 7)
    packing = balanced(lengths, slots, WORK)
    _check_packing(packing, lengths, slots)
    finish = [_work(packing, p) / s.speed for p, s in enumerate(slots)]
    heaviest = WORK.of(TokenShape(rows=1, length=max(lengths)))
    assert abs(finish[0] - finish[1]) <= heaviest  # within about one sample's work
    assert _work(packing, 1) > 2 * _work(packing, 0)


def test_a_step_whose_padding_would_overflow_a_budget_is_packed_naively():
    # the fast pipeline takes the long sample and two short ones: one micro-batch of three
    # rows padded to 1024 tokens would hold 3,072, over its budget of 2,048
    slots = _slots((1, 10.0, 2), (1, 1.0, 2))
    lengths = [1024, 100, 100, 100]
    assert balanced(lengths, slots, WORK) == naive(lengths, slots)


def test_samples_too_long_or_too_few_are_errors_naming_them():
    slots = _slots((2, 1.0, 1), (2, 1.0, 1))
    with pytest.raises(PlannerError, match="Sample 2 of the step has 2048 tokens"):
        balanced([5, 6, 2048, 7], slots, WORK)
    with pytest.raises(PlannerError, match="3 samples cannot fill the plan's 4 micro-batches"):
        naive([5, 6, 7], slots)


# ---- replaying packed steps ----------------------------------------------------------------

def _rates(*, pipelines: int = 2, stages: int = 2, micro_batches: int = 4,
           micro_batch: int = 2) -> PlanRates:
    stage = StageTiming(fwd=1.0, bwd=2.0, send=0.05)
    one = PipelineRates(stages=(stage,) * stages, quadratic=(0.2,) * stages,
                        micro_batch=micro_batch, micro_batches=micro_batches,
                        batch_share=micro_batch * micro_batches,
                        schedule=Schedule.ONE_F_ONE_B, interleave=1,
                        feed=Feed(node="n", device_type="gpu",
                                  samples=micro_batch * micro_batches))
    return PlanRates(seq_len=1024, pipelines=(one,) * pipelines, sync=0.3, optimizer=0.1)


def test_full_length_samples_replay_as_the_plan():
    rates = _rates()
    lengths = [1024] * 16
    step = replay(rates, naive(lengths, rates.slots()))
    plain = simulate([p.stages for p in rates.pipelines], [4, 4], sync=0.3, optimizer=0.1)
    assert step.step_time == pytest.approx(plain.step_time)


def test_simulator_with_equal_micro_batch_timings_is_the_plain_one():
    stages = [StageTiming(fwd=1.0, bwd=2.0, send=0.1), StageTiming(fwd=1.5, bwd=2.5, send=0.2)]
    for schedule in (Schedule.ONE_F_ONE_B, Schedule.GPIPE):
        plain = simulate([stages], [4], schedule=schedule)
        own = simulate([stages], [4], schedule=schedule, microbatch_timings=[[stages] * 4])
        assert own.events == plain.events
    with pytest.raises(ValueError, match="for each of its 4 micro-batches"):
        simulate([stages], [4], microbatch_timings=[[stages] * 3])


def test_one_heavy_micro_batch_holds_up_the_pipeline():
    light, heavy = StageTiming(fwd=1.0, bwd=2.0), StageTiming(fwd=4.0, bwd=8.0)
    even = simulate([[light, light]], [4], microbatch_timings=[[[light, light]] * 4])
    skewed = simulate([[light, light]], [4], microbatch_timings=[
        [[heavy, heavy], [light, light], [light, light], [light, light]]])
    assert skewed.step_time > even.step_time + 9.0 - 1e-9  # the heavy one's extra, at least


def test_balanced_packing_beats_naive_on_heavy_tailed_lengths():
    rates = _rates(pipelines=4, stages=2, micro_batches=8, micro_batch=2)
    slots, work = rates.slots(), rates.work()
    rng = random.Random(11)
    naive_time = balanced_time = 0.0
    for _ in range(10):
        lengths = lognormal_lengths(64, median=128, sigma=1.0, low=4, high=1024, rng=rng)
        naive_step = replay(rates, naive(lengths, slots))
        balanced_step = replay(rates, balanced(lengths, slots, work))
        naive_time += naive_step.step_time
        balanced_time += balanced_step.step_time
        assert 0 <= balanced_step.idle < 1 and 0 <= naive_step.idle < 1
    assert naive_time > 1.3 * balanced_time


# ---- plans chosen for the data -------------------------------------------------------------

def test_plans_ranked_by_their_expected_step_on_the_data(tmp_path):
    from cost_models.cluster import load_cluster
    from cost_models.model import AnalyticalCostModel
    from planner.data.choose import on_data, rank_for_data
    from planner.data.profile import Sample, summarize
    from planner.solver import SolveOptions, solve
    from planner.types import TrainingSpec
    from tests.runtime_helpers import _traced

    graph = _traced()
    cluster = load_cluster("1x2xA100-80G,1x2xV100-32G@10Gbps")
    training = TrainingSpec(global_batch=32, seq_len=graph.seq_len, dtype="fp16")
    plans = solve(graph, cluster, training, SolveOptions(top_k=4, with_baselines=False))
    assert len(plans) >= 2
    costs = AnalyticalCostModel(cluster)
    lengths = lognormal_lengths(2000, median=4, sigma=1.0, low=1, high=graph.seq_len,
                                rng=random.Random(2))
    profile = summarize([Sample(tokens=n) for n in lengths], "t")
    ranked = rank_for_data(plans, graph.layers, costs, profile, draws=8)
    assert sorted(c.plan.prediction.step_time for c in ranked) == sorted(
        p.prediction.step_time for p in plans)  # the same plans, ranked again
    expected = [c.expected for c in ranked]
    assert expected == sorted(expected)
    for candidate in ranked:
        # short samples: far below the plan's step for full-length ones; the expected
        # bottleneck of drawn steps at least the step of mean-length samples
        assert candidate.expected < candidate.plan.prediction.step_time
        assert candidate.mean_step <= candidate.expected <= candidate.slowest
        assert 0 <= candidate.idle < 1
    again = on_data(ranked[0].plan, graph.layers, costs, profile, draws=8)
    assert again == ranked[0]  # the same draws for the same seed


def test_solve_with_a_data_profile_shows_the_ranking(tmp_path):
    from typer.testing import CliRunner

    from cli.main import app
    from planner.data.profile import Sample, profile_json, summarize

    path = tmp_path / "profile.json"
    lengths = lognormal_lengths(500, median=8, sigma=1.0, low=1, high=64,
                                rng=random.Random(3))
    path.write_text(profile_json(summarize([Sample(tokens=n) for n in lengths], "t")))
    result = CliRunner().invoke(app, ["solve", "gpt-tiny", "-c", "1x2xA100-80G,1x2xV100-32G",
                                      "-B", "16", "--data-profile", str(path),
                                      "--time-limit", "20"])
    assert result.exit_code == 0, result.output
    assert "On the data" in result.output and "expected step" in result.output
    missing = CliRunner().invoke(app, ["solve", "gpt-tiny", "-c", "1x2xA100-80G", "-B", "16",
                                       "--data-profile", str(tmp_path / "none.json")])
    assert missing.exit_code == 1 and "Cannot read data profile" in missing.output
