"""Class-balanced partitions over heterogeneous pipelines (`planner partition`): sizes
proportional to capacity within one sample, every class within the tolerance of its
share (Pearson's chi-squared test), and the index files a data hook reads."""

import json
import math
import random

import pytest
from typer.testing import CliRunner

from cli.main import app
from planner.data.shards import (
    chi_squared,
    chi_squared_survival,
    largest_remainders,
    make_partition,
    partition_files,
    read_partition,
)
from planner.errors import PlannerError

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def _labels(count: int, weights: dict[str, float], seed: int) -> list[str]:
    rng = random.Random(seed)
    names, shares = zip(*weights.items(), strict=True)
    return rng.choices(names, weights=shares, k=count)


@pytest.mark.parametrize(("count", "shares", "seed"), [
    (1000, [24, 8], 0), (2001, [3, 5, 7], 1), (997, [1, 1, 1, 1], 2), (5000, [13, 2, 9], 3),
    (300, [7, 3], 4)])
def test_sizes_proportional_to_capacity_within_one_sample(count, shares, seed):
    labels = _labels(count, {"cat": 0.5, "dog": 0.3, "eel": 0.15, "owl": 0.05}, seed)
    partition = make_partition(labels, shares, tolerance=0.5, seed=seed, source="t")
    assert sum(s.size for s in partition.shards) == count
    assert sorted(i for s in partition.shards for i in s.samples) == list(range(count))
    for shard, share in zip(partition.shards, shares, strict=True):
        assert abs(shard.size - count * share / sum(shares)) < 1


@pytest.mark.parametrize("seed", range(5))
def test_every_class_within_the_tolerance_and_the_chi_squared_test(seed):
    labels = _labels(4000, {"a": 0.6, "b": 0.25, "c": 0.1, "d": 0.05}, seed)
    shares = [24, 8, 16]
    partition = make_partition(labels, shares, tolerance=0.01, seed=seed, source="t")
    overall = {c: n / 4000 for c, n in partition.classes.items()}
    for shard in partition.shards:
        for label, share in overall.items():
            assert abs(shard.classes.get(label, 0) / shard.size - share) <= 0.01
            # dealing keeps each class within two samples of its exact part
            exact = partition.classes[label] * shard.size / 4000
            assert abs(shard.classes.get(label, 0) - exact) < 2
    table = [[s.classes.get(c, 0) for c in partition.classes] for s in partition.shards]
    statistic, degrees = chi_squared(table)
    assert (statistic, degrees) == (pytest.approx(partition.chi_squared), 6)
    # independence of shard and class is not rejected: far from it (p near 1)
    assert partition.p_value > 0.99
    # the classes as drawn: a random split of the same sizes spreads them far less evenly
    rng = random.Random(seed)
    order = list(range(4000))
    rng.shuffle(order)
    sizes = [s.size for s in partition.shards]
    cuts = [sum(sizes[:p]) for p in range(len(sizes) + 1)]
    random_table = [[sum(labels[i] == c for i in order[cuts[p]:cuts[p + 1]])
                     for c in partition.classes] for p in range(len(sizes))]
    assert chi_squared(random_table)[0] > 10 * statistic


def test_chi_squared_by_hand_and_its_tail():
    statistic, degrees = chi_squared([[10, 20], [30, 40]])
    expected = [[30 * 40 / 100, 30 * 60 / 100], [70 * 40 / 100, 70 * 60 / 100]]  # rows x cols
    by_hand = sum((o - e) ** 2 / e for row, erow in zip([[10, 20], [30, 40]], expected,
                                                        strict=True)
                  for o, e in zip(row, erow, strict=True))
    assert (statistic, degrees) == (pytest.approx(by_hand), 1)
    # the 5% critical values of the chi-squared table, and closed forms
    assert chi_squared_survival(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert chi_squared_survival(18.307038053275146, 10) == pytest.approx(0.05, rel=1e-9)
    assert chi_squared_survival(2.0, 2) == pytest.approx(math.exp(-1))  # exp(-x / 2)
    assert chi_squared_survival(0.0, 3) == 1.0


def test_largest_remainders():
    assert largest_remainders(10, [1, 1, 1]) == [4, 3, 3]
    assert largest_remainders(100, [24, 8, 16]) == [50, 17, 33]
    assert sum(largest_remainders(997, [5, 3, 11, 2])) == 997


def test_a_tolerance_too_tight_for_small_shards_names_the_shard_and_class():
    labels = ["a"] * 7 + ["b"] * 3
    with pytest.raises(PlannerError) as err:
        make_partition(labels, [1, 1, 1], tolerance=0.01, seed=0, source="t")
    assert "Pipeline " in err.value.message and "beyond the tolerance 1.00%" in err.value.message


def test_labels_for_all_samples_or_none():
    with pytest.raises(PlannerError, match="sample 2 has no label"):
        make_partition(["a", "b", None, "a"], [1, 1], tolerance=0.5, seed=0, source="t")
    unlabelled = make_partition([None] * 9, [2, 1], tolerance=0.5, seed=0, source="t")
    assert [s.size for s in unlabelled.shards] == [6, 3]


def test_index_files_and_what_a_hook_reads(tmp_path):
    labels = _labels(100, {"x": 0.7, "y": 0.3}, 9)
    partition = make_partition(labels, [3, 1], tolerance=0.1, seed=9, source="t")
    for name, text in partition_files(partition).items():
        (tmp_path / name).write_text(text)
    again = read_partition(tmp_path)
    assert again == partition
    # samples 0-2 of each step from pipeline 0's shard, sample 3 from pipeline 1's; over
    # an epoch each shard is read through
    first = [again.indices(step, 0, 3) for step in range(25)]
    assert sorted(i for step in first for i in step) == sorted(partition.shards[0].samples)
    second = [again.indices(step, 3, 4) for step in range(25)]
    assert sorted(i for step in second for i in step) == sorted(partition.shards[1].samples)
    assert again.indices(4, 2, 4) == [partition.shards[0].samples[14],
                                      partition.shards[1].samples[4]]
    assert again.indices(30, 0, 1) == [partition.shards[0].samples[90 % 75]]  # wrapped
    with pytest.raises(PlannerError, match="outside the global batch of 4"):
        again.indices(0, 2, 5)
    (tmp_path / "pipeline-1.txt").write_text("1\n2\n")
    with pytest.raises(PlannerError, match="holds 2 samples; the partition says 25"):
        read_partition(tmp_path)


def test_cli_partition_from_shares_and_from_a_plan(tmp_path):
    samples = tmp_path / "s.jsonl"
    labels = _labels(600, {"cat": 0.8, "dog": 0.2}, 5)
    samples.write_text("".join(json.dumps({"tokens": 10 + i % 7, "label": label}) + "\n"
                               for i, label in enumerate(labels)))
    out = tmp_path / "parts"
    result = run("partition", samples, "--shares", "24,8", "--out", out)
    assert result.exit_code == 0, result.output
    assert "pipeline 0: 24 a step -> 450 samples" in result.output
    assert "chi-squared" in result.output
    assert read_partition(out).shards[1].size == 150
    again = run("partition", samples, "--shares", "24,8", "--out", out)
    assert again.exit_code == 1 and "already exists" in again.output
    assert run("partition", samples, "--shares", "24,8", "--out", out, "--force").exit_code == 0
    neither = run("partition", samples, "--out", tmp_path / "x")
    assert neither.exit_code == 1 and "--plan PLAN or --shares" in neither.output
    bad = run("partition", samples, "--shares", "24,x", "--out", tmp_path / "x")
    assert bad.exit_code == 1 and "whole numbers" in bad.output

    from planner.planfile import write_plan
    from tests.runtime_helpers import tiny_plan

    plan = tiny_plan("1x4xcpu", pp=2, dp=2, shares=[3, 1])
    write_plan(plan, tmp_path / "plan.json")
    made = run("partition", samples, "--plan", tmp_path / "plan.json", "--out",
               tmp_path / "from-plan", "--json")
    assert made.exit_code == 0, made.output
    assert [s["share"] for s in json.loads(made.output)["shards"]] == [6, 2]
