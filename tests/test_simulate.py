"""The event-driven simulator (planner.simulate) and its agreement with the closed form."""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from itertools import pairwise

import pytest

from planner.simulate import Event, Simulation, simulate
from planner.solver.timing import StageTiming, pipeline_time
from planner.types import Schedule

GPIPE, ONE_F_ONE_B, INTERLEAVED = Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED


def balanced(num_stages: int, f: float = 1.0, b: float = 2.0, send: float = 0.0
             ) -> list[StageTiming]:
    """Stages alike, every link's send alike (the last stage's: the interleaved
    wrap-around, which the other schedules ignore)."""
    return [StageTiming(fwd=f, bwd=b, send=send if num_stages > 1 else 0.0)
            for s in range(num_stages)]


def random_stages(rng: random.Random, num_stages: int, spread: float, send_frac: float,
                  proportional: bool = False) -> list[StageTiming]:
    """Stage times within ±spread of (1, 2), sends up to send_frac of the stage's time
    (the last stage's: the interleaved wrap-around)."""
    stages = []
    for _ in range(num_stages):
        f = rng.uniform(1 - spread, 1 + spread)
        b = 2 * f if proportional else 2 * rng.uniform(1 - spread, 1 + spread)
        send = rng.uniform(0, send_frac) * (f + b) if num_stages > 1 else 0.0
        stages.append(StageTiming(fwd=f, bwd=b, send=send))
    return stages


def rel_err(closed: float, simulated: float) -> float:
    return (closed - simulated) / simulated


# ---- exact cases -------------------------------------------------------------------------


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("mult", [1, 2, 4])
def test_balanced_without_sends_is_textbook(num_stages, mult):
    for m in (1, num_stages * mult, num_stages * mult + 1):
        stages = balanced(num_stages)
        expected = (m + num_stages - 1) * 3.0
        for schedule in (ONE_F_ONE_B, GPIPE):
            sim = simulate([stages], [m], schedule=schedule)
            assert sim.step_time == pytest.approx(expected, abs=1e-12)
        assert pipeline_time(stages, m).total == pytest.approx(expected, abs=1e-12)


def test_hand_computed_unbalanced_one_f_one_b():
    # stage 0: F0 [0,1] F1 [1,2]            B0 [3.1,5.1] B1 [5.2,7.2]
    # stage 1:     F0 [1,1.7] B0 [1.7,3.1] F1 [3.1,3.8] B1 [3.8,5.2]
    stages = [StageTiming(fwd=1.0, bwd=2.0), StageTiming(fwd=0.7, bwd=1.4)]
    sim = simulate([stages], [2])
    assert sim.step_time == pytest.approx(7.2)
    # the closed form charges the bottleneck's second forward, which the simulator overlaps
    # with stage 1's first forward and backward
    assert pipeline_time(stages, 2).total == pytest.approx(8.1)


def test_gpipe_matches_closed_form_exactly():
    # GPipe runs a forward pipeline, then a backward one, each paced by its slowest
    # compute or send: (m-1) * (max(max f, max c) + max(max b, max c)) + sum + 2 sum c,
    # for any stages, micro-batch counts and sends, slower than compute included
    rng = random.Random(11)
    for _ in range(300):
        num_stages = rng.randint(2, 6)
        m = rng.randint(1, 4 * num_stages)
        stages = random_stages(rng, num_stages, 0.3, rng.choice([0.2, 1.0]))
        sim = simulate([stages], [m], schedule=GPIPE)
        closed = pipeline_time(stages, m, schedule=GPIPE).total
        assert sim.step_time == pytest.approx(closed, rel=1e-12)


def test_gpipe_send_slower_than_forward_paces_both_pipelines():
    # forward: 1 s per stage, backward 2 s, send 1.5 s: the forward pipeline runs at the
    # send's pace (1.5 s), the backward at its compute's (2 s)
    stages = balanced(4, send=1.5)
    closed = pipeline_time(stages, 32, schedule=GPIPE)
    assert closed.period == pytest.approx(3.5)
    assert closed.total == pytest.approx(31 * 3.5 + 4 * 3.0 + 2 * 3 * 1.5)
    assert simulate([stages], [32], schedule=GPIPE).step_time == pytest.approx(closed.total)


def test_interleaved_balanced_is_megatron_bubble():
    # Megatron's interleaved 1F1B: bubble (S-1) * (f+b) / v, plus one hop per virtual stage
    # each way in the fill, the wrap-around's too
    for num_stages in (2, 3, 4, 8):
        for v in (2, 3, 4):
            for m in (num_stages, 2 * num_stages, 4 * num_stages):
                for send in (0.0, 0.05):
                    stages = balanced(num_stages, send=send)
                    sim = simulate([stages], [m], schedule=INTERLEAVED, interleave=v)
                    hops = 2 * (num_stages * v - 1) * send if num_stages > 1 else 0.0
                    expected = m * 3.0 + (num_stages - 1) * 3.0 / v + hops
                    assert sim.step_time == pytest.approx(expected, abs=1e-9)


def test_interleave_one_is_one_f_one_b():
    rng = random.Random(3)
    stages = random_stages(rng, 4, 0.3, 0.2)
    a = simulate([stages], [8], schedule=INTERLEAVED, interleave=1)
    b = simulate([stages], [8], schedule=ONE_F_ONE_B)
    assert a == b
    # m need not be a multiple of S then
    simulate([stages], [7], schedule=INTERLEAVED, interleave=1)


# ---- agreement with the closed form ------------------------------------------------------


def test_one_f_one_b_near_balanced_agrees_with_closed_form():
    """Within 2% while stages are within ±3% and sends within 2% of a stage's time (see the
    xfail below for the wide case)."""
    rng = random.Random(7)
    worst = 0.0
    for _ in range(200):
        num_stages = rng.randint(2, 6)
        m = rng.randint(num_stages, 4 * num_stages)
        stages = random_stages(rng, num_stages, 0.03, 0.02)
        sim = simulate([stages], [m])
        worst = max(worst, abs(rel_err(pipeline_time(stages, m).total, sim.step_time)))
    assert worst < 0.02


def test_one_f_one_b_closed_form_is_never_below_the_simulation():
    """Stage s holds S-s micro-batches, so every window of stages s..u paces a period
    by its round trip over u-s+1 (timing.round_trip): with all windows, not only the
    whole pipeline's, the closed form does not promise a step the schedule cannot
    run, even with a slow link between two heavy stages."""
    assert min(_unbalanced_errors(300, 8)) > -1e-9
    pair = [StageTiming(fwd=0.1, bwd=0.2, send=0.05), StageTiming(fwd=0.1, bwd=0.2)]
    assert pipeline_time(pair, 64).period == pytest.approx((0.3 + 0.3 + 2 * 0.05) / 2)
    assert rel_err(pipeline_time(pair, 64).total, simulate([pair], [64]).step_time) == \
        pytest.approx(0.0, abs=0.005)


@pytest.mark.xfail(strict=True, reason=(
    "closed form vs simulated 1F1B, stages ±30%, sends <= 20%: up to 12% too high. It "
    "charges (m-1) full periods after a fill of every stage, but a bottleneck early in "
    "the pipeline overlaps its warm-up forwards with the fill (worst at m = S)"))
def test_one_f_one_b_unbalanced_with_sends_agrees_with_closed_form():
    assert max(map(abs, _unbalanced_errors(200, 4))) < 0.02


def _unbalanced_errors(count: int, most: int) -> list[float]:
    """Closed form vs simulation of 1F1B pipelines of 2-6 stages within ±30% of each
    other, sends up to 20% of a stage, S to most*S micro-batches."""
    rng = random.Random(5)
    errors = []
    for _ in range(count):
        num_stages = rng.randint(2, 6)
        m = rng.randint(num_stages, most * num_stages)
        stages = random_stages(rng, num_stages, 0.3, 0.2)
        errors.append(rel_err(pipeline_time(stages, m).total, simulate([stages], [m]).step_time))
    return errors


def test_interleaved_balanced_agrees_with_closed_form():
    for num_stages in (2, 4):
        stages = balanced(num_stages)
        m = num_stages
        sim = simulate([stages], [m], schedule=INTERLEAVED, interleave=2)
        closed = pipeline_time(stages, m, schedule=INTERLEAVED, interleave=2).total
        assert abs(rel_err(closed, sim.step_time)) < 0.02


def test_interleaved_closed_form_is_never_below_the_simulation():
    """Each chunk's gradient crosses a link before its sender's next backward, so long
    sends stretch the period beyond the link's load v * c: with the period at least
    bwd + v * send per stage, the closed form promises no step the schedule cannot
    run, whatever the stages' balance, the links' speeds and the chunk count (with
    the link's load alone, a balanced pipeline of 14 stages and 4 chunks whose sends
    take a fifth of a stage came out 13% too fast). Stages whose backward is not the
    same multiple of their forward can still come out up to 6% fast: their fill runs
    closer to GPipe's, paced by the largest forward and the largest backward."""
    worst = {True: 0.0, False: 0.0}
    for proportional in (True, False):
        rng = random.Random(11)
        for _ in range(120):
            num_stages, v = rng.randint(2, 8), rng.choice([2, 3, 4])
            m = num_stages * rng.randint(1, 4)
            stages = random_stages(rng, num_stages, rng.choice([0.0, 0.3]),
                                   rng.choice([0.0, 0.05, 0.1, 0.3]), proportional)
            sim = simulate([stages], [m], schedule=INTERLEAVED, interleave=v)
            closed = pipeline_time(stages, m, schedule=INTERLEAVED, interleave=v).total
            worst[proportional] = min(worst[proportional], rel_err(closed, sim.step_time))
    assert worst[True] > -1e-9
    assert -0.06 < worst[False] < -0.01
    ring = [StageTiming(fwd=1 / 3, bwd=2 / 3, send=0.2) for _ in range(14)]  # (wrap-around too)
    closed = pipeline_time(ring, 56, schedule=INTERLEAVED, interleave=4)
    assert closed.period == pytest.approx(2 / 3 + 4 * 0.2)
    assert 0 < rel_err(closed.total, simulate([ring], [56], schedule=INTERLEAVED,
                                              interleave=4).step_time) < 0.08


# ---- several pipelines, sync and optimizer -----------------------------------------------


def test_step_is_slowest_pipeline_plus_sync_and_optimizer():
    rng = random.Random(2)
    pipelines = [random_stages(rng, 3, 0.3, 0.1), random_stages(rng, 2, 0.3, 0.1),
                 random_stages(rng, 4, 0.3, 0.1)]
    counts = [6, 9, 4]
    sim = simulate(pipelines, counts, sync=0.25, optimizer=0.5)
    alone = [simulate([p], [m]).step_time for p, m in zip(pipelines, counts, strict=True)]
    assert sim.pipeline_times == pytest.approx(alone)
    assert sim.step_time == pytest.approx(max(alone) + 0.25 + 0.5)
    end = max(alone)
    syncs = [e for e in sim.events if e.kind == "sync"]
    steps = [e for e in sim.events if e.kind == "optimizer"]
    assert len(syncs) == len(steps) == 3 + 2 + 4  # one each per device
    assert all(e.start == pytest.approx(end) and e.end == pytest.approx(end + 0.25)
               for e in syncs)
    assert all(e.end == pytest.approx(sim.step_time) for e in steps)


# ---- event sanity ------------------------------------------------------------------------


def check_events(sim: Simulation, pipelines: list[list[StageTiming]], counts: list[int],
                 v: int) -> None:
    events = sim.events
    assert list(events) == sorted(events, key=lambda e: e.start)
    assert all(e.end >= e.start for e in events)
    compute = [e for e in events if e.kind in ("fwd", "bwd", "sync", "optimizer")]
    by_device: dict[tuple[int, int], list[Event]] = defaultdict(list)
    for e in compute:
        by_device[(e.pipeline, e.stage)].append(e)
    for evs in by_device.values():
        evs.sort(key=lambda e: (e.start, e.end))
        for a, b in pairwise(evs):
            assert a.end <= b.start + 1e-12, (a, b)
    by_link: dict[tuple[int, int, str], list[Event]] = defaultdict(list)
    for e in events:
        if e.kind in ("send", "send-grad"):
            by_link[(e.pipeline, e.stage, e.kind)].append(e)
    for evs in by_link.values():
        for a, b in pairwise(evs):
            assert a.end <= b.start + 1e-12, (a, b)

    for p, (stages, m) in enumerate(zip(pipelines, counts, strict=True)):
        num = len(stages)
        ops = Counter((e.kind, e.stage, e.chunk, e.microbatch) for e in events
                      if e.pipeline == p and e.kind in ("fwd", "bwd"))
        assert set(ops.values()) == {1}
        assert len(ops) == 2 * num * v * m
        op = {(e.kind, e.chunk * num + e.stage, e.microbatch): e for e in events
              if e.pipeline == p and e.kind in ("fwd", "bwd")}
        for _, s, chunk, i in ops:
            assert s < num and 0 <= chunk < v and 0 <= i < m
        hops = {(e.kind, e.stage, e.chunk, e.microbatch): e for e in events
                if e.pipeline == p and e.kind in ("send", "send-grad")}
        last = num * v - 1
        for k in range(last + 1):
            s = k % num
            for i in range(m):
                fwd, bwd = op[("fwd", k, i)], op[("bwd", k, i)]
                assert fwd.end <= bwd.start + 1e-12
                assert fwd.end - fwd.start == pytest.approx(stages[s].fwd / v)
                assert bwd.end - bwd.start == pytest.approx(stages[s].bwd / v)
                if k < last:  # activation to k+1
                    hop = hops[("send", s, k // num, i)]
                    assert fwd.end <= hop.start + 1e-12
                    assert hop.end <= op[("fwd", k + 1, i)].start + 1e-12
                if k > 0:  # gradient to k-1 over boundary (k-1) % num
                    hop = hops[("send-grad", (k - 1) % num, k // num, i)]
                    assert bwd.end <= hop.start + 1e-12
                    assert hop.end <= op[("bwd", k - 1, i)].start + 1e-12
        for (_, boundary, _, _), hop in hops.items():
            if boundary < num - 1:
                assert hop.end - hop.start == pytest.approx(stages[boundary].send)
        backward_ends = [e.end for e in events if e.pipeline == p and e.kind == "bwd"]
        assert sim.pipeline_times[p] == pytest.approx(max(backward_ends))


@pytest.mark.parametrize("schedule,v", [(GPIPE, 1), (ONE_F_ONE_B, 1), (INTERLEAVED, 2),
                                        (INTERLEAVED, 3)])
def test_events_are_consistent(schedule, v):
    rng = random.Random(13)
    for _ in range(10):
        pipelines = [random_stages(rng, rng.randint(1, 5), 0.3, 0.3) for _ in range(2)]
        counts = [len(p) * rng.randint(1, 3) for p in pipelines]
        sim = simulate(pipelines, counts, schedule=schedule, interleave=v, sync=0.1,
                       optimizer=0.2)
        check_events(sim, pipelines, counts, v)


def test_slow_link_carries_one_transfer_at_a_time():
    stages = [StageTiming(fwd=1.0, bwd=1.0, send=3.0), StageTiming(fwd=1.0, bwd=1.0)]
    m = 6
    for schedule in (GPIPE, ONE_F_ONE_B):
        sim = simulate([stages], [m], schedule=schedule)
        assert sim.step_time >= m * 3.0  # each direction carries m transfers, one at a time
        check_events(sim, [stages], [m], 1)
    # GPipe: activation i arrives at 1 + 3(i+1); stage 1 runs F5 [19, 20], then B5..B0
    # [20, 26]; the gradients queue on the link from 21 and the last arrives at 21 + 18;
    # stage 0 runs B0 [39, 40].
    sim = simulate([stages], [m], schedule=GPIPE)
    arrivals = [e.end for e in sim.events if e.kind == "send"]
    assert arrivals == pytest.approx([1.0 + 3.0 * (i + 1) for i in range(m)])
    assert sim.step_time == pytest.approx(40.0)


def device_order(sim: Simulation, stage: int) -> list[tuple[str, int | None, int | None]]:
    return [(e.kind, e.microbatch, e.chunk) for e in sim.events
            if e.pipeline == 0 and e.stage == stage and e.kind in ("fwd", "bwd")]


def test_schedule_orders():
    num, m = 4, 8
    stages = balanced(num, send=0.1)
    gpipe = simulate([stages], [m], schedule=GPIPE)
    for s in range(num):
        assert device_order(gpipe, s) == ([("fwd", i, 0) for i in range(m)]
                                          + [("bwd", i, 0) for i in reversed(range(m))])
    one = simulate([stages], [m])
    for s in range(num):
        order = device_order(one, s)
        warmup = num - s - 1
        assert [k for k, _, _ in order[:warmup + 1]] == ["fwd"] * (warmup + 1)
        assert order[warmup + 1] == ("bwd", 0, 0)
        assert [i for k, i, _ in order if k == "bwd"] == list(range(m))

    v = 2
    inter = simulate([stages], [m], schedule=INTERLEAVED, interleave=v)
    for s in range(num):
        order = device_order(inter, s)
        warmup = 2 * (num - s - 1) + (v - 1) * num
        first_bwd = next(n for n, (k, _, _) in enumerate(order) if k == "bwd")
        assert first_bwd == warmup + 1  # warm-up, then one forward before each backward
        forwards = [(i, j) for k, i, j in order if k == "fwd"]
        # Megatron's table: groups of S micro-batches, chunk 0 then chunk 1 within a group
        assert forwards[:2 * num] == [(i, 0) for i in range(num)] + [(i, 1) for i in range(num)]
        assert order[first_bwd] == ("bwd", 0, v - 1)


# ---- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize("pipelines,counts,kwargs,message", [
    ([balanced(4)], [6], {"schedule": INTERLEAVED, "interleave": 2}, "multiple of"),
    ([balanced(2)], [0], {}, "at least 1 micro-batch"),
    ([[]], [4], {}, "no stages"),
    ([], [], {}, "at least one pipeline"),
    ([balanced(2)], [4, 4], {}, "micro-batch counts; give one per pipeline"),
    ([balanced(2)], [4], {"schedule": INTERLEAVED, "interleave": 0}, "interleave"),
    ([balanced(2)], [4], {"sync": -1.0}, ">= 0"),
    ([[StageTiming(fwd=-1.0, bwd=1.0)]], [4], {}, "negative"),
])
def test_bad_input_raises(pipelines, counts, kwargs, message):
    with pytest.raises(ValueError, match=message):
        simulate(pipelines, counts, **kwargs)


def test_the_simulator_imports_on_its_own():
    """`planner.simulate` reads the solver's timing; imported first, it must not run
    into the solver importing it back."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import planner.simulate"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
