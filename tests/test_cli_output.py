"""What the plan commands print: progress of a long solve on stderr, output that a file
or a pipe gets unwrapped, one micro-batch notation, the search space and the baselines
once, the small-batch warning, and figures worded as they read ("as fast", "1 device",
no "-0.0%")."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from cli.main import app
from cli.render_explain import stage_timing_table
from cli.render_plan import baseline_table, prediction_panel, stage_table
from planner.compare import headline
from planner.planfile import read_plan

ROOT = Path(__file__).parent.parent
PLANS = Path(__file__).parent / "data" / "plans"
CLUSTER = "1x4xA100-40G,1x4xV100-16G@100Gbps"
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def text_of(renderable, width: int = 200) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


@pytest.fixture(autouse=True)
def _no_columns(monkeypatch):
    """COLUMNS would decide the width of piped output: these tests check the default."""
    monkeypatch.delenv("COLUMNS", raising=False)


# ---------------------------------------------------------------- progress (item 8)

class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_lines_come_every_few_seconds_with_elapsed_limit_best_and_gap():
    from cli.progress import SolveProgress
    from planner.solver import Progress

    clock = FakeClock()
    out = io.StringIO()
    progress = SolveProgress(Console(file=out, width=300), 60.0, clock, every=5.0)
    progress.tick()  # nothing is due yet
    clock.now += 4.9
    progress(Progress(explored=200, best=None, bound=1.0))
    progress.tick()
    assert out.getvalue() == ""  # not a line per report: a line every 5 s
    clock.now += 0.1
    progress(Progress(explored=400, best=2.0, bound=1.5))
    for _ in range(3):  # the heartbeat looks again and again: one line
        progress.tick()
    clock.now += 7.0
    progress.tick()
    lines = out.getvalue().splitlines()
    assert lines == ["[5.0 s of the 60 s limit] Searching plans: 400 explored, best 2 s step, "
                     "at most 25.0% from optimal (Ctrl-C stops with it)",
                     "[12 s of the 60 s limit] Searching plans: 400 explored, best 2 s step, "
                     "at most 25.0% from optimal (Ctrl-C stops with it)"]
    # a caller that hands on only the text (`planner.session.solve_plans`)
    progress.update("Searching plans: 600 explored")
    clock.now += 5.0
    progress.tick()
    assert out.getvalue().splitlines()[-1] == ("[17 s of the 60 s limit] Searching plans: "
                                               "600 explored")


def test_the_last_progress_line_says_how_the_search_ended():
    from cli.progress import SolveProgress

    clock = FakeClock()
    out = io.StringIO()
    progress = SolveProgress(Console(file=out, width=300), None, clock)
    clock.now += 3.25
    plan = read_plan(PLANS / "base.json")
    progress.finish(plan)
    assert out.getvalue().strip() == ("[3.2 s, no time limit] Search done: best 724 µs step, "
                                      "at most 0.0% from optimal, 101 explored.")


def test_a_piped_solve_says_on_stderr_where_it_ended(tmp_path):
    result = run("solve", "gpt-tiny", "--cluster", CLUSTER, "-B", "16", "--time-limit", "7",
                 "-o", tmp_path / "plan.json")
    assert result.exit_code == 0, result.output
    plan = read_plan(tmp_path / "plan.json")
    step = re.escape(f"best {format_seconds(plan.solver.objective)} step")
    assert re.search(r"^\[[0-9.]+ s of the 7 s limit\] Search (done|stopped at the time "
                     rf"limit): {step}, at most [0-9.]+% from optimal", result.stderr, re.M), (
        result.stderr)


def test_a_piped_what_if_says_on_stderr_where_it_ended():
    result = run("what-if", PLANS / "base.json", "-B", "64", "--time-limit", "7")
    assert result.exit_code == 0, result.output
    assert re.search(r"^\[[0-9.]+ s of the 7 s limit\] Search .*: best .* step", result.stderr,
                     re.M), result.stderr


def format_seconds(seconds: float) -> str:
    from planner.units import fmt_seconds

    return fmt_seconds(seconds)


# ---------------------------------------------------------------- piped output (item 9)

def test_output_to_a_file_or_a_pipe_is_not_wrapped_at_80_columns(monkeypatch):
    from cli.tables import PIPED_WIDTH, OutputConsole, output_console

    console = output_console()
    console.file = io.StringIO()  # not a terminal
    assert console.width == PIPED_WIDTH
    monkeypatch.setenv("COLUMNS", "120")  # unless the user says otherwise
    assert console.width == 120
    monkeypatch.delenv("COLUMNS")
    # a terminal keeps its width
    terminal = OutputConsole(file=io.StringIO(), force_terminal=True)
    assert terminal.width == Console(file=io.StringIO(), force_terminal=True).width


def test_a_piped_plan_keeps_each_stage_on_one_line():
    """At 80 columns, layer ranges and memory wrapped over three lines."""
    result = run("explain", PLANS / "base.json")
    assert result.exit_code == 0, result.output
    rows = [line for line in result.stdout.splitlines() if line.startswith("p0-3 (x4)")]
    assert any("embedding .. head" in row and "A100-80G-SXM" in row and "340 µs / 359 µs" in row
               for row in rows), result.stdout
    assert "1.01 GiB / 80 GiB (1%)" in result.stdout


def test_stage_tables_share_one_explained_micro_batch_notation():
    """`planner solve` wrote `32x16 of 1` (count x pipelines, of size) where explain wrote
    `32 x 1` (count x size), and neither said which."""
    from cost_models.model import AnalyticalCostModel
    from planner.explain import analyze, retrace

    plan = read_plan(PLANS / "base.json")
    solve_text = text_of(stage_table(plan))
    analysis = analyze(plan, retrace(plan).layers, AnalyticalCostModel(plan.cluster))
    explain_text = text_of(stage_timing_table(analysis))
    pipe = plan.pipelines[0]
    cell = f"{pipe.num_microbatches} x {pipe.micro_batch}"
    for text in (solve_text, explain_text):
        assert re.search(rf"\s{cell}\s", text), text
        assert "micro batches: per pipeline and step, count x size" in text
    # pipelines alike but for their micro-batch counts: each count with its pipelines
    uneven = dataclasses.replace(plan, pipelines=tuple(
        dataclasses.replace(p, num_microbatches=2 if p.index else 1) for p in plan.pipelines))
    assert f"2 x {pipe.micro_batch} (3 pipes), 1 x {pipe.micro_batch} (1 pipe)" in text_of(
        stage_table(uneven))


def test_search_space_is_shown_once(tmp_path):
    out = tmp_path / "plan.json"
    solved = run("solve", "gpt-tiny", "--cluster", CLUSTER, "-B", "16", "--top-k", "2",
                 "--time-limit", "7", "-o", out)
    assert solved.exit_code == 0, solved.output
    assert solved.stdout.count("search space:") == 1
    assert solved.stdout.count("plan #2") == 1
    edited = run("what-if", out, "-B", "32", "--time-limit", "7")
    assert edited.exit_code == 0, edited.output
    assert "search space:" not in edited.stdout and "Solver" in edited.stdout
    assert "search space:" in run("explain", out).stdout


def test_explain_shows_the_baselines_once():
    result = run("explain", PLANS / "base.json")
    assert result.exit_code == 0, result.output
    for name in ("data-parallel", "uniform", "fastest-type"):
        assert sum(line.startswith(name) for line in result.stdout.splitlines()) == 1, name


@pytest.mark.skipif(shutil.which("jq") is None, reason="jq is not installed")
def test_the_readme_trace_json_example_shows_layers():
    """`jq .blocks` printed the number of blocks, not what the README promised."""
    line = next(line for line in (ROOT / "README.md").read_text().splitlines()
                if line.startswith("planner trace") and "| jq" in line)
    command, _, rest = line.partition("| jq ")
    assert "--json" in command
    jq_filter = shlex.split(rest.partition("#")[0])[0]
    traced = run("trace", "gpt-tiny", "--json")
    assert traced.exit_code == 0, traced.output
    shown = subprocess.run(["jq", "-c", jq_filter], input=traced.stdout, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    layers = json.loads(traced.stdout)["layers"]
    assert len(shown) == len(layers) > 1
    assert [json.loads(s)["name"] for s in shown] == [layer["name"] for layer in layers]


# ---------------------------------------------------------------- small batches (item 11)

def with_terms(plan, **terms):
    """`plan` with these step-time terms, and the step they add up to."""
    step = sum({**plan.prediction.terms(), **terms}.values())
    return dataclasses.replace(plan, prediction=dataclasses.replace(
        plan.prediction, step_time=step, **terms))


def test_small_batch_trigger_and_suggested_batch():
    from planner.small_batch import SUGGESTED, TOO_SMALL, small_batch

    plan = read_plan(PLANS / "base.json")  # 97% compute
    assert small_batch(plan) is None
    # half of the step fixed: not yet
    half = with_terms(plan, compute=1.0, bubble=0.5, dp_comm=0.5, optimizer=0.0, tp_comm=0.0,
                      pp_comm=0.0)
    assert small_batch(half) is None
    # 3 s fixed against 1 s that grows with the batch: at k times the batch the fixed part
    # is 3 / (3 + k) = SUGGESTED, k = 9
    starved = with_terms(plan, compute=0.75, pp_comm=0.25, bubble=1.0, dp_comm=2.0,
                         optimizer=0.0, tp_comm=0.0)
    found = small_batch(starved)
    assert found is not None and found.fixed_share == pytest.approx(0.75)
    assert found.fixed_share > TOO_SMALL
    assert found.fixed_terms == ("bubble", "dp_comm")
    exact = 9 * plan.training.global_batch
    assert 3 / (3 + exact / plan.training.global_batch) == pytest.approx(SUGGESTED)
    assert (exact, found.suggested_batch) == (288, 290)  # up to two significant digits
    assert "--global-batch 290" in found.message and "75% of its step" in found.message
    assert "pipeline bubble and gradient sync" in found.message


def test_solve_warns_when_the_batch_is_too_small_for_the_devices():
    """Llama 3 8B with 2 samples on 32 A100s: a pipeline of two micro-batches, whose fill
    and drain and optimizer step are most of the step."""
    result = run("solve", "llama3-8b", "--cluster", "4x8xA100-80G@100Gbps", "-B", "2",
                 "--time-limit", "7", "--seq-len", "512")
    assert result.exit_code == 0, result.output
    assert "warning: The global batch (2) is small for the" in result.stderr, result.stderr
    assert re.search(r"--global-batch \d+", result.stderr)
    roomy = run("solve", "gpt-tiny", "--cluster", CLUSTER, "-B", "64", "--time-limit", "7")
    assert roomy.exit_code == 0 and "warning:" not in roomy.stderr, roomy.stderr


# ---------------------------------------------------------------- wording (item 17)

def test_a_tied_baseline_is_as_fast_not_one_times_faster():
    plan = read_plan(PLANS / "base.json")  # the fastest type alone: this very plan
    text = text_of(baseline_table(plan))
    assert "1.00x" not in text
    assert re.search(r"^fastest-type\s+724 µs\s+as fast\s", text, re.M), text
    from cost_models.model import AnalyticalCostModel
    from planner.compare import speedup
    from planner.explain import analyze, retrace
    from planner.report import report_html

    html = report_html(analyze(plan, retrace(plan).layers, AnalyticalCostModel(plan.cluster)))
    assert "<td>as fast</td>" in html and "1.00x faster" not in html
    assert speedup(1.85) == "1.85x faster" and speedup(1 / 1.2) == "1.20x slower"
    assert speedup(1.004) == speedup(0.996) == "as fast"


def test_one_device_and_one_pipeline_are_singular(tmp_path):
    out = tmp_path / "one.json"
    result = run("solve", "gpt-tiny", "--cluster", "1x1xA100-40G", "-B", "8", "--time-limit",
                 "7", "-o", out)
    assert result.exit_code == 0, result.output
    assert "(1 device)" in result.stdout and "1 pipeline on 1 of 1 device," in result.stdout
    assert "(1 of 1 device used)" in run("explain", out).stdout


def test_float_noise_never_reads_minus_zero_percent():
    plan = read_plan(PLANS / "base.json")
    noisy = dataclasses.replace(plan, prediction=dataclasses.replace(
        plan.prediction, bubble=-1e-19))
    text = text_of(prediction_panel(noisy))
    assert "-0.0%" not in text and re.search(r"bubble\s+0 µs\s+0\.0%", text), text
    from planner.compare import percent_change

    assert percent_change(-1e-6) == percent_change(1e-6) == "0.0%"
    assert percent_change(-0.5) == "-50.0%" and percent_change(0.069) == "+6.9%"
    same = dataclasses.replace(plan, prediction=dataclasses.replace(
        plan.prediction, step_time=plan.prediction.step_time * (1 + 1e-12),
        samples_per_s=plan.prediction.samples_per_s * (1 - 1e-12)))
    assert "-0.0%" not in headline(plan, same)
