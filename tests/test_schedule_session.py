"""The interactive scheduling session without a terminal, and through the command."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from planner.errors import PlannerError
from planner.schedule.jobs import JobsFile
from planner.schedule.session import Session, State
from planner.schedule.setup import load_setup, parse_gpus
from planner.schedule.simulate import Settings

SAMPLE = Path(__file__).parent / "data" / "gavel-sample"
GPUS = "v100=2,p100=2,k80=4"


@pytest.fixture()
def session():
    jobs = JobsFile(jobs=(), resources={}, throughputs=SAMPLE / "throughputs.json")
    setup = load_setup(jobs, cluster=None, gpus=parse_gpus(GPUS, 4), matrix_path=None,
                       time_limit=1.0)
    return Session(setup, State(jobs=(), policy="max-min-fairness", settings=Settings()))


def test_add_show_what_if_and_undo(session):
    with pytest.raises(PlannerError, match="no jobs to schedule"):
        session.run("show")
    with pytest.raises(PlannerError, match="Nothing to undo"):
        session.run("undo")
    session.run('add name=r profile="ResNet-50 (batch size 64)" steps=20000 min_devices=2')
    session.run("add name=a profile=A3C steps=20000 arrival=10min weight=2")
    assert [j.name for j in session.state.jobs] == ["r", "a"]
    assert session.state.jobs[1].arrival == 600 and session.state.jobs[1].weight == 2
    shown = session.run("show")
    assert shown.kind == "schedule" and shown.simulations[0].metrics.finished == 2
    what = session.run("what-if policy fifo")
    assert what.kind == "what-if" and [s.policy for s in what.simulations] == [
        "max-min-fairness", "fifo"]
    assert session.state.policy == "max-min-fairness"  # nothing kept
    gone = session.run("what-if remove r").simulations[1]
    assert [o.name for o in gone.outcomes] == ["a"]
    session.run("policy min-jct")
    session.run("round 600")
    assert session.state.settings.round_length == 600
    assert [s.policy for s in session.run("compare").simulations][-1] == "fifo"
    session.run("undo")
    session.run("undo")
    assert session.state.policy == "max-min-fairness"
    session.run("remove r")
    assert [j.name for j in session.state.jobs] == ["a"]


@pytest.mark.parametrize(("line", "words"), [
    ("frobnicate", ["Unknown command 'frobnicate'"]),
    ("shwo", ["did you mean show"]),
    ("add name=x profile=A3C", ["neither `steps`"]),
    ("add name=x profile=AAA steps=5", ["profile 'AAA' is not a job type"]),
    ("add name=x model=gpt-tiny global_batch=8 steps=5", ["needs a cluster the planner"]),
    ("add name=x profile=A3C steps=5 colour=red", ["colour", "not a field"]),
    ("add x", ["'x' is not key=value"]),
    ("add name='x", ["Cannot read the command"]),
    ("policy fairest", ["Unknown policy 'fairest'"]),
    ("round -5", ["positive number of seconds"]),
    ("remove nobody", ["no job 'nobody'"]),
    ("what-if show", ["what-if takes a change"]),
])
def test_bad_commands_change_nothing(session, line, words):
    session.run("add name=a profile=A3C steps=100")
    before = session.state
    with pytest.raises(PlannerError) as info:
        session.run(line)
    for word in words:
        assert word in info.value.message, (word, info.value.message)
    assert session.state == before


def test_interactive_command_reads_stdin(tmp_path, monkeypatch):
    monkeypatch.setenv("PLANNER_LEDGER", str(tmp_path / "ledger.sqlite"))
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(f"throughputs: {SAMPLE / 'throughputs.json'}\n"
                    "jobs:\n  - {name: r, profile: A3C, steps: 20000}\n")
    result = CliRunner().invoke(app, ["schedule", str(jobs), "--gpus", GPUS, "-i"],
                                input="jobs\nadd name=q profile=A3C steps=100\nnope\n"
                                      "what-if policy fifo\nshow\nquit\nshow\n")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "1 jobs, policy max-min-fairness" in out and "added q" in out
    assert "Unknown command 'nope'" in result.stderr
    assert "What if: policy fifo" in out and out.count("Schedule on") == 1  # (quit ended it)
