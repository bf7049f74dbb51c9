"""benchmarks/launch_e2e.py's check of its emulation: each worker's time computing
per step against what its profile predicts, on synthetic numbers, and its --help
saying what --quick does."""

from __future__ import annotations

import pytest

from benchmarks import launch_e2e
from benchmarks.launch_e2e import (
    BUSY_TOLERANCE,
    QUICK,
    SPREAD_TOLERANCE,
    WorkerBusy,
    disturbances,
    predicted_busy,
    worker_busy,
)


def _workers(*ratios: float) -> list[WorkerBusy]:
    return [WorkerBusy(worker=f"worker-{i}", measured=2.0 * ratio, predicted=2.0)
            for i, ratio in enumerate(ratios)]


def test_an_undisturbed_run_passes():
    """Within BUSY_TOLERANCE of the profiles and close to each other: as profiled
    (the workers of RESULTS.md's run computed about 1.1x their profiles)."""
    assert disturbances(_workers(1.0, 1.0, 1.0)) == []
    assert disturbances(_workers(1.08, 1.14, 1.12)) == []
    assert disturbances(_workers(0.95, 1.05, 1.1)) == []


def test_a_worker_slowed_by_other_work_is_named():
    """Another process on core 1 slows worker-1 and worker-2 alike: each is named with
    its ratio, though they stay close to each other."""
    found = disturbances(_workers(1.02, 1.6, 1.55))
    assert len(found) == 3
    assert found[0].startswith("worker-1 computed 3.200 s per step, 1.60x what its profile "
                               "predicts (2.000 s)")
    assert found[1].startswith("worker-2 computed 3.100 s per step, 1.55x")
    assert "unevenly (worker-0 1.02x, worker-1 1.60x)" in found[2]
    # faster than profiled (the profile itself ran on a disturbed machine) is flagged too
    faster = disturbances(_workers(0.7, 0.75, 0.74))
    assert faster[0].startswith("worker-0 computed 1.400 s per step, 0.70x")


def test_uneven_departures_within_the_tolerance_are_flagged():
    """Each worker within BUSY_TOLERANCE, but their relative speeds (what the plan's
    shares follow) changed by more than SPREAD_TOLERANCE."""
    low, high = 0.85, 0.85 * SPREAD_TOLERANCE * 1.05
    assert high < BUSY_TOLERANCE
    (uneven,) = disturbances(_workers(low, 1.0, high))
    assert "departed from their profiles unevenly" in uneven
    assert disturbances(_workers(low, 1.0, 0.85 * SPREAD_TOLERANCE * 0.99)) == []


def test_predicted_busy_ends_at_each_stages_last_backward():
    """From `planner explain --json`'s timeline: the last backward of each (pipeline,
    stage), for every pipeline a shared lane stands for; sync and links do not count."""
    explanation = {"timeline": {
        "lanes": [{"kind": "device", "pipelines": [0], "stage": 0},
                  {"kind": "link", "pipelines": [0], "stage": 0},
                  {"kind": "device", "pipelines": [0], "stage": 1},
                  {"kind": "device", "pipelines": [1, 2], "stage": 0}],
        "bars": [{"lane": 0, "kind": "fwd", "end": 1.0}, {"lane": 0, "kind": "bwd", "end": 5.0},
                 {"lane": 0, "kind": "sync", "end": 9.0}, {"lane": 1, "kind": "send", "end": 7.0},
                 {"lane": 2, "kind": "bwd", "end": 4.0}, {"lane": 3, "kind": "bwd", "end": 3.5},
                 {"lane": 3, "kind": "optimizer", "end": 9.5}]}}
    predicted = predicted_busy(explanation)
    assert predicted == {(0, 0): 5.0, (0, 1): 4.0, (1, 0): 3.5, (2, 0): 3.5}
    summary = {"ranks": [{"node": "worker-0", "pipeline": 0, "stage": 0, "busy_mean": 6.0},
                         {"node": "worker-2", "pipeline": 2, "stage": 0, "busy_mean": 3.5}]}
    workers = worker_busy(summary, predicted)
    assert [(w.worker, w.ratio) for w in workers] == [("worker-0", pytest.approx(1.2)),
                                                      ("worker-2", 1.0)]


def test_quick_help_says_what_quick_does():
    """--help said 2 repeats while --quick ran 1: the help is made from QUICK."""
    text = " ".join(launch_e2e.parser().format_help().split())
    assert f"--quick {QUICK.repeats} repeat" in text
    assert f"of {QUICK.steps} steps per layout" in text
