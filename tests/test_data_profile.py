"""Data profiles (`planner data-profile`): reading samples, the summary, the file and the
lengths drawn from it."""

import json
import random
import statistics

import pytest
from typer.testing import CliRunner

from cli.main import app
from planner.data.profile import (
    Sample,
    draw_lengths,
    hook_samples,
    lognormal_lengths,
    profile_json,
    read_profile,
    read_samples,
    summarize,
)
from planner.errors import PlannerError
from tests.data_samples import sample_length

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_summary_of_known_lengths():
    lengths = [1, 2, 3, 4, 10, 20, 30, 40, 100, 1000]
    profile = summarize([Sample(tokens=n) for n in lengths], "hand")
    assert profile.count == 10 and profile.total_tokens == 1210
    assert profile.mean == 121.0
    assert profile.std == pytest.approx(statistics.pstdev(lengths))
    assert (profile.min, profile.max) == (1, 1000)
    assert profile.mean_square == pytest.approx(sum(n * n for n in lengths) / 10)
    # linear between order statistics: the median is halfway between 10 and 20
    assert profile.quantile(0.5) == pytest.approx(15.0)
    assert profile.quantile(0.0) == 1 and profile.quantile(1.0) == 1000
    assert profile.quantile(0.9) == pytest.approx(100 + 0.1 * 900)
    assert profile.top_share == pytest.approx(1000 / 1210)  # the longest 1%: one sample
    assert sum(profile.histogram.counts) == 10
    edges = profile.histogram.edges
    assert edges[0] == 1 and edges[-1] == 1001 and list(edges) == sorted(set(edges))
    for n in lengths:  # each length counted in the bin that holds it
        at = max(i for i, e in enumerate(edges[:-1]) if e <= n)
        assert edges[at] <= n < edges[at + 1]


def test_image_tokens_count_in_the_length_and_labels_are_counted():
    samples = [Sample(tokens=10, image_tokens=576, label="cat"), Sample(tokens=30, label="dog"),
               Sample(tokens=5, label="cat")]
    profile = summarize(samples, "mm")
    assert profile.total_tokens == 621 and profile.max == 586
    assert (profile.image_samples, profile.image_tokens) == (1, 576)
    assert profile.labels == {"cat": 2, "dog": 1}


def test_jsonl_samples_in_every_form(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('12\n{"tokens": 7, "label": "a"}\n\n{"length": 3, "image_tokens": 4}\n'
                    '{"input_ids": [5, 6, 7], "label": 2}\n')
    assert read_samples(path) == [Sample(tokens=12), Sample(tokens=7, label="a"),
                                  Sample(tokens=3, image_tokens=4),
                                  Sample(tokens=3, label="2")]


@pytest.mark.parametrize(("line", "named"), [
    ("{oops", "s.jsonl:2: not JSON"),
    ('{"tokens": 3, "lenght": 4}', "s.jsonl:2: unknown field(s) lenght"),
    ('{"tokens": 3, "length": 4}', "one of the fields tokens, length or input_ids"),
    ('{"tokens": -1}', "s.jsonl:2: tokens must be a whole number"),
    ('{"tokens": 2.5}', "tokens must be a whole number"),
    ('{"tokens": 3, "image_tokens": true}', "image_tokens must be a whole number"),
    ('{"tokens": 3, "label": [1]}', "label must be a string or an integer"),
    ('"many"', "the sample must be a whole number"),
])
def test_bad_samples_name_the_line_and_field(tmp_path, line, named):
    path = tmp_path / "s.jsonl"
    path.write_text(f"5\n{line}\n")
    with pytest.raises(PlannerError) as err:
        read_samples(path)
    assert named in err.value.message


def test_no_samples_and_empty_samples_are_errors():
    with pytest.raises(PlannerError, match="no samples"):
        summarize([], "none")
    with pytest.raises(PlannerError, match="a sample has no tokens"):
        summarize([Sample(tokens=0)], "empty")


def test_profile_file_round_trip_and_bad_files(tmp_path):
    profile = summarize([Sample(tokens=n, label="x") for n in (3, 9, 27, 81)], "t")
    path = tmp_path / "p.json"
    path.write_text(profile_json(profile))
    assert read_profile(path) == profile
    data = json.loads(profile_json(profile))
    for change, message in (({"kind": "plan"}, "is not a data profile"),
                            ({"schema_version": 9}, "schema_version 9"),
                            ({"quantiles": [5, 1, *data["quantiles"][2:]]},
                             "quantile table"),
                            ({"colour": 1}, "colour")):
        path.write_text(json.dumps({**data, **change}))
        with pytest.raises(PlannerError) as err:
            read_profile(path)
        assert message in err.value.message
    path.write_text("{")
    with pytest.raises(PlannerError, match="not JSON"):
        read_profile(path)


def test_lengths_drawn_from_a_profile_follow_its_distribution():
    rng = random.Random(3)
    data = lognormal_lengths(20_000, median=300, sigma=1.0, low=8, high=8192, rng=rng)
    profile = summarize([Sample(tokens=n) for n in data], "lognormal")
    drawn = sorted(draw_lengths(profile, 20_000, random.Random(4)))
    for level in (0.1, 0.5, 0.9, 0.99):
        got = drawn[int(level * (len(drawn) - 1))]
        assert got == pytest.approx(profile.quantile(level), rel=0.06)
    assert statistics.mean(drawn) == pytest.approx(profile.mean, rel=0.03)
    assert min(drawn) >= profile.min and max(drawn) <= profile.max


def test_lognormal_lengths_are_heavy_tailed_and_clipped():
    data = lognormal_lengths(5_000, median=100, sigma=1.0, low=4, high=2000,
                             rng=random.Random(0))
    assert min(data) >= 4 and max(data) <= 2000
    assert statistics.median(data) == pytest.approx(100, rel=0.1)
    assert statistics.mean(data) > 1.4 * statistics.median(data)  # e^(sigma^2 / 2) = 1.65


def test_a_data_hooks_samples_are_its_counted_targets():
    samples = hook_samples("tests.data_samples:variable", steps=2, global_batch=5,
                           seq_len=64, seed=1)
    assert [s.tokens for s in samples] == [sample_length(step, i, seq_len=64, seed=1)
                                           for step in range(2) for i in range(5)]
    # stacked and padded: the targets the loss skips do not count
    stacked = hook_samples("tests.data_samples:padded", steps=2, global_batch=5, seq_len=64,
                           seed=1)
    assert stacked == samples


def test_cli_profiles_a_file_and_keeps_what_exists(tmp_path):
    samples = tmp_path / "s.jsonl"
    samples.write_text("\n".join(json.dumps({"tokens": n, "label": "ab"[n % 2]})
                                 for n in range(1, 200)))
    out = tmp_path / "p.json"
    result = run("data-profile", samples, "-o", out)
    assert result.exit_code == 0, result.output
    assert "199 samples, 19,900 tokens" in result.output
    assert "p50 100" in result.output and "labels: 2 classes: a 99, b 100" in result.output
    assert read_profile(out).count == 199
    again = run("data-profile", samples, "-o", out)
    assert again.exit_code == 1 and "already exists" in again.output
    assert run("data-profile", samples, "-o", out, "--force").exit_code == 0
    printed = run("data-profile", samples, "--json")
    assert json.loads(printed.output)["kind"] == "data-profile"


def test_cli_profiles_a_data_hook_and_asks_for_its_batch(tmp_path):
    result = run("data-profile", "tests.data_samples:variable", "-B", 4, "--steps", 3,
                 "--seq-len", 128)
    assert result.exit_code == 0, result.output
    assert "12 samples" in result.output
    missing = run("data-profile", "tests.data_samples:variable")
    assert missing.exit_code == 1 and "--global-batch" in missing.output
    unknown = run("data-profile", "tests.data_samples:nothing", "-B", 2)
    assert unknown.exit_code == 1 and "nothing" in unknown.output
