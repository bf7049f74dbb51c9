"""The gradient sync's collective per stage (issue 48, item 2): the cost model names the
faster of a ring and a hierarchical all-reduce, the plan records it per stage
(`StagePlan.grad_sync`), explain shows it, and the runtime runs it (gloo on CPU, two
"nodes" of local processes)."""

import dataclasses
import json
from types import SimpleNamespace
from typing import Any

import pytest

from cost_models.cluster import load_cluster
from cost_models.comm import (
    Collective,
    CommGroup,
    collective_choice,
    collective_time,
    group_links,
)
from cost_models.model import AnalyticalCostModel
from planner.errors import PlannerError
from planner.explain import retrace, traffic
from planner.planfile import plan_json, read_plan
from planner.runtime.layout import rank_layout
from planner.runtime.overlap import Overlapped, _Flight
from planner.runtime.parallel import topology
from planner.runtime.stage import inspect_model
from planner.solver.predict import grad_syncs, sync_and_optimizer
from planner.types import SyncAlgorithm, SyncSpec
from tests.runtime_helpers import tiny_plan
from tests.test_runtime import _check_against_reference, _run

RING, HIERARCHICAL = SyncAlgorithm.RING, SyncAlgorithm.HIERARCHICAL
SLOW = "2x2xcpu@1Gbps"  # two nodes of two CPU "devices", shared memory inside, 1 Gb/s between
GB = 2**30


def _syncs(plan):
    return [s.grad_sync for p in plan.pipelines for s in p.stages]


@pytest.mark.parametrize("cluster, counts, expected", [
    ("2x8xA100-80G@10Gbps", (8, 8), HIERARCHICAL),
    ("2x8xA100-80G@10Gbps", (1, 1), RING),  # one rank per node
    ("1x8xA100-80G", (8,), RING),  # one node
    (SLOW, (2, 2), HIERARCHICAL),
    ("2x2xcpu", (2, 2), RING),  # 100 Gb/s beats shared memory
])
def test_the_cost_model_names_the_faster_all_reduce(cluster, counts, expected):
    spec = load_cluster(cluster)
    group = CommGroup(tuple((node.name, count)
                            for node, count in zip(spec.nodes, counts, strict=True)))
    choice = collective_choice(Collective.ALL_REDUCE, GB, group, *group_links(spec, group))
    assert choice.algorithm is expected
    # the one price of the collective everywhere: the chosen algorithm's
    assert choice.seconds == collective_time(Collective.ALL_REDUCE, GB, group, spec)
    assert AnalyticalCostModel(spec).collective_choice(Collective.ALL_REDUCE, GB,
                                                       group) == choice


def test_a_plan_records_the_faster_sync_per_stage_where_the_runtime_runs_it():
    slow = tiny_plan(SLOW, dp=4)
    assert _syncs(slow) == [HIERARCHICAL] * 4
    # the plan's whole sync is the chosen all-reduce's time
    costs = AnalyticalCostModel(slow.cluster)
    volume = sum(layer.params for layer in retrace(slow).layers) * 4.0
    group = CommGroup((("cpu-0", 2), ("cpu-1", 2)))
    assert sync_and_optimizer(slow, retrace(slow).layers, costs)[0] == pytest.approx(
        costs.collective_choice(Collective.ALL_REDUCE, volume, group).seconds)
    assert _syncs(tiny_plan("2x2xcpu", dp=4)) == [RING] * 4  # a fast network: the ring
    assert _syncs(tiny_plan(SLOW, dp=2, pp=2)) == [RING] * 4  # one replica per node
    # FSDP's own reductions sum a ZeRO stage's gradients
    assert _syncs(tiny_plan(SLOW, dp=4, zero=1)) == [RING] * 4


def test_sums_that_overlap_backward_are_chosen_alike():
    plan = tiny_plan(SLOW, dp=4)
    overlapped = dataclasses.replace(plan, training=dataclasses.replace(
        plan.training, sync=SyncSpec(overlap=True)))
    chosen = grad_syncs(overlapped, retrace(plan).layers, AnalyticalCostModel(plan.cluster))
    assert _syncs(chosen) == [HIERARCHICAL] * 4


def test_plan_files_keep_the_choice_and_old_ones_read_as_ring(tmp_path):
    plan = tiny_plan(SLOW, dp=4)
    path = tmp_path / "plan.json"
    path.write_text(plan_json(plan))
    assert read_plan(path) == plan
    data = json.loads(plan_json(plan))
    for stage in data["pipelines"][0]["stages"]:
        del stage["grad_sync"]
    path.write_text(json.dumps(data))
    assert _syncs(read_plan(path))[0] is RING


@pytest.mark.parametrize("value, zero, needle", [
    ("tree", 0, "grad_sync"),
    ("hierarchical", 1, "pipelines[0].stages[0].grad_sync is hierarchical with zero 1"),
])
def test_a_grad_sync_the_runtime_cannot_run_is_refused(tmp_path, value, zero, needle):
    data = json.loads(plan_json(tiny_plan(SLOW, dp=4)))
    stage = data["pipelines"][0]["stages"][0]
    stage["grad_sync"], stage["zero"] = value, zero
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlannerError) as caught:
        read_plan(path)
    assert needle in caught.value.message


def test_explain_says_where_the_sync_is_hierarchical():
    def rows(plan):
        costs = AnalyticalCostModel(plan.cluster)
        return [r.where for r in traffic(plan, retrace(plan).layers, costs)
                if r.kind == "dp all-reduce"]

    assert [w.endswith(", hierarchical") for w in rows(tiny_plan(SLOW, dp=4))] == [True]
    assert not any("hierarchical" in w for w in rows(tiny_plan("2x2xcpu", dp=4)))


def test_every_rank_makes_the_hierarchys_groups():
    """Ranks 0, 1 on cpu-0 and 2, 3 on cpu-1: each node's pair, the nodes' first ranks."""
    plan = tiny_plan(SLOW, dp=4)
    topo = topology(plan, rank_layout(plan), inspect_model(plan))
    keys = sorted({tuple(sorted(k)) for k in topo.holders.values()})
    assert keys == [((0, 0), (1, 0), (2, 0), (3, 0))]
    assert topo.sum_ranks(keys[0]) == [(0, 1, 2, 3), (0, 1), (2, 3), (0, 2)]
    ring = topology(tiny_plan("2x2xcpu", dp=4), rank_layout(plan), inspect_model(plan))
    assert ring.sum_ranks(keys[0]) == [(0, 1, 2, 3)]


@pytest.mark.slow
@pytest.mark.parametrize("shape", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_hierarchical_sums_of_wider_and_deeper_stages_train_as_one_process(tmp_path, shape):
    """Four replicas two per node of 2x4 CPU "devices": tensor-parallel stages (each tp
    rank sums its shards, and its slice of the parameters the ranks hold whole, in its
    own hierarchy), and two-stage pipelines whose tied token table is summed over the
    embedding's and the head's stages alike."""
    plan = tiny_plan("2x4xcpu@1Gbps", dp=4, **shape)
    assert set(_syncs(plan)) == {HIERARCHICAL}
    _check_against_reference(plan, _run(tmp_path, plan))


@pytest.mark.slow
@pytest.mark.parametrize("dp, sync", [(4, SyncSpec()), (3, SyncSpec()),
                                      (4, SyncSpec(mode="local-sgd", interval=1)),
                                      (4, SyncSpec(overlap=True)), (3, SyncSpec(overlap=True))],
                         ids=["2+2", "2+1", "2+2-local-sgd", "2+2-overlap", "2+1-overlap"])
def test_hierarchical_sums_train_as_one_process(tmp_path, dp, sync):
    """Replicas two per node (and 2 + 1 with three): each sum reduces inside its node,
    all-reduces across the nodes and broadcasts back, every step (and, under local SGD,
    the averaging of the parameters after it; overlapping backward, in buckets of a few
    KiB whose steps go one after the other), and the run matches single-process
    training."""
    plan = tiny_plan(SLOW, dp=dp)
    plan = dataclasses.replace(plan, training=dataclasses.replace(plan.training, sync=sync))
    assert set(_syncs(plan)) == {HIERARCHICAL}
    options = {"bucket_mb": 0.01} if sync.overlap else {}
    summary = _check_against_reference(plan, _run(tmp_path, plan, **options))
    if sync.overlap:  # many buckets, all of them started within backward
        assert all(r["sync_sums"] > 1 and r["sync_started_in_backward"] == r["sync_sums"]
                   for r in summary["ranks"])


class _Work:
    """A collective's handle that completes when the test says."""

    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done

    def get_future(self) -> Any:
        return self

    def then(self, _callback: Any) -> None:
        """(the flight's end time: not looked at here)"""


def test_overlapped_steps_keep_one_order_on_every_group():
    """A hierarchical bucket's k-th collective is issued only after every earlier
    bucket's k-th: each group then sees its reduces, all-reduces across and broadcasts
    in the order the buckets started, whichever completes first on this rank."""
    issued: list[tuple[str, int]] = []

    def flight(name: str) -> _Flight:
        def step(number: int) -> Any:
            def issue(async_op: bool) -> _Work:
                issued.append((name, number))
                return _Work()
            return issue
        return _Flight(bucket=None, flat=None, grads=[], steps=[step(k) for k in range(3)],
                       started=0.0)

    first, second = flight("first"), flight("second")
    overlapped = SimpleNamespace(flights=[first, second])
    first.issue(), second.issue()
    second.work.done = True  # the second bucket's reduce is done, the first's is not
    Overlapped._advance(overlapped)
    assert issued == [("first", 0), ("second", 0)]
    first.work.done = True
    Overlapped._advance(overlapped)
    assert issued[2:] == [("first", 1), ("second", 1)]
    second.work.done = True
    Overlapped._advance(overlapped)  # the second's broadcast waits for the first's
    assert issued[4:] == []
    first.work.done = True
    Overlapped._advance(overlapped)
    assert issued[4:] == [("first", 2), ("second", 2)]
    assert first.all_issued and second.all_issued
