"""The interactive session's core (planner.session): commands in, state and replies out,
driven without a terminal: load -> solve -> what-if -> constrain -> explain -> save,
errors, undo, transcripts and their replay, interruption."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import pytest
import yaml

from cost_models.cluster import load_cluster
from planner.planfile import read_plan
from planner.session import Session, Tracer, read_transcript

CLUSTER = "1x4xA100-80G,1x4xV100-32G@100Gbps"


@pytest.fixture(scope="module")
def tracer():
    return Tracer()  # shared: each test traces gpt-tiny once at most


def start(tracer, *lines, **kw) -> Session:
    session = Session(time_limit=20, tracer=tracer, **kw)
    for line in ("model gpt-tiny", f"cluster {CLUSTER}", "set global-batch 32", *lines):
        reply = session.run(line)
        assert reply.ok, (line, reply.error and reply.error.message)
    return session


def kinds(reply) -> list[str]:
    return [kind for kind, _ in reply.items]


def test_load_solve_whatif_save(tracer, tmp_path):
    session = start(tracer)
    assert session.state.plan is None  # setting up does not solve by itself
    first = session.run("solve")
    assert first.ok and "plan" in kinds(first) and first.data["solved"]
    base = session.state.plan
    assert base.cluster.num_devices == 8
    # a what-if re-solves and compares with the previous plan
    grown = session.run("add 1x4xV100-32G")
    assert grown.ok and {"diff", "plan-summary"} <= set(kinds(grown))
    assert session.state.cluster.num_devices == 12 and session.state.previous is base
    keys = {row["key"] for row in grown.data["diff"]}
    assert {"step_time", "samples_per_s", "device_hours_per_m"} <= keys
    slow = session.run("link network 1Gbps")
    assert slow.ok and session.state.cluster.network.bandwidth == 1e9 / 8
    batch = session.run("set global-batch 64")
    assert batch.ok and session.state.plan.training.global_batch == 64
    assert any(r["key"] == "global_batch" for r in batch.data["diff"])
    constrained = session.run("constrain tp=2 recompute=full")
    assert constrained.ok
    stages = [s for p in session.state.plan.pipelines for s in p.stages]
    assert {s.tp for s in stages} == {2} and {s.recompute.value for s in stages} == {"full"}
    pinned = session.run("pin a100-80g-sxm-0")
    assert pinned.ok
    assert {s.devices.node for p in session.state.plan.pipelines for s in p.stages} == {
        "a100-80g-sxm-0"}
    assert session.run("unconstrain all").ok and session.state.constraints.describe() == []
    explained = session.run("explain")
    assert explained.ok and kinds(explained) == ["explanation"]
    assert explained.data["explanation"]["binding"]
    for line in ("timeline 90", "memory", "traffic", "diff", "show cluster",
                 "show constraints", "show runners-up", "show plan", "models llama",
                 "devices v100", "examples", "help", "help add"):
        assert session.run(line).ok, line
    for width in ("0", "-5", "99999999"):  # (a default width, and a hang at the last)
        assert "timeline width must be between 40 and 2,000" in session.run(
            f"timeline {width}").error.message
    # saving: plan, cluster, report, transcript; nothing half-written
    plan_path, cluster_path = tmp_path / "plan.json", tmp_path / "cluster.yaml"
    assert session.run(f"save plan {plan_path}").ok
    assert read_plan(plan_path).prediction.step_time == session.state.plan.prediction.step_time
    assert session.run(f"save cluster {cluster_path}").ok
    reloaded = load_cluster(str(cluster_path))
    assert reloaded.num_devices == 12 and reloaded.network.bandwidth == 1e9 / 8
    assert yaml.safe_load(cluster_path.read_text())["schema_version"] == 1
    assert session.run(f"save report {tmp_path / 'plan.html'}").ok
    assert session.run(f"save report {tmp_path / 'step.svg'}").ok
    again = session.run(f"save plan {plan_path}")
    assert not again.ok and again.error.kind == "file-exists"
    assert session.run(f"save plan {plan_path} --force").ok
    assert session.run(f"save transcript {tmp_path / 'session.txt'}").ok
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "cluster.yaml", "plan.html", "plan.json", "session.txt", "step.svg"]
    # the equivalent shell commands name the edits
    cli = session.run("cli").items[0][1]
    assert cli[0].startswith("planner solve gpt-tiny --cluster") and "what-if" in cli[1]
    assert "--add 1x4xV100-32G" in cli[1] and "--link network=1Gbps" in cli[1]


def test_max_dp_and_schedule_bound_the_search_and_name_their_flags(tracer):
    session = start(tracer, "constrain max-dp=2 schedule=gpipe", "solve")
    plan = session.state.plan
    assert len(plan.pipelines) <= 2 and {p.schedule.value for p in plan.pipelines} == {"gpipe"}
    command = session.run("cli").items[0][1][0]
    assert "--max-dp 2" in command and "--schedule gpipe" in command


def test_tp_per_class_is_a_switch_with_its_flag(tracer):
    session = start(tracer, "constrain tp-per-class=yes mixed=no", "solve")
    assert session.state.constraints.tp_per_class
    assert session.state.constraints.describe() == ["mixed=no", "tp-per-class=yes"]
    command = session.run("cli").items[0][1][0]
    assert "--tp-per-class" in command and "--no-mixed" in command
    assert session.run("unconstrain tp-per-class").ok
    assert not session.state.constraints.tp_per_class
    reply = session.run("constrain tp-per-class=maybe")
    assert not reply.ok and "tp-per-class must be yes or no" in reply.error.message


def test_transcript_replays_to_the_same_plan(tracer, tmp_path):
    session = start(tracer, "solve", "add 1x4xV100-32G", "constrain max-tp=1")
    path = tmp_path / "t.txt"
    assert session.run(f"save transcript {path}").ok
    lines = read_transcript(path)
    assert lines[0] == "model gpt-tiny" and not any(x.startswith("save transcript")
                                                    for x in lines)
    replayed = Session(time_limit=20, tracer=tracer)
    replies = replayed.run_script(lines)
    assert all(r.ok for r in replies)
    assert replayed.state.plan.prediction.step_time == pytest.approx(
        session.state.plan.prediction.step_time)
    assert replayed.transcript == session.transcript


def test_bad_input_is_one_clear_error_and_changes_nothing(tracer):
    session = start(tracer)
    before = session.state
    cases = {
        "solev": "did you mean 'solve'",
        "set global-batch many": "whole number",
        "set global-batch 0": "between 1 and",
        "set colour blue": "Cannot set",
        "constrain tp=two": "whole number",
        "constrain tq=2": "did you mean 'tp'",
        "constrain zero=7": "0, 1, 2 or 3",
        "constrain schedule=zigzag": "is not one of 1f1b, gpipe, interleaved",
        "exclude nosuch-node": "has no node",
        "remove 3xV100-32G": "Cannot remove 3",
        "link network fast": "bandwidth",
        "add 2xfoo": "Unknown device",
        "model no-such-model": "Unknown",
        "cluster no-such-cluster": "not a file",
        "explain": "No plan yet",
        "diff": "No plan yet",
        "save plan": "save plan|cluster",
        "save report x.txt": "a report is .html",
        "model gpt-tiny --layer 2": "did you mean --layers",
        'model "gpt-tiny': "Cannot read the command",
        "price A100-80G": "Use price TYPE DOLLARS_PER_HOUR",
        "price A100-80G nan": "a price is 0 to 1,000,000 dollars per device-hour",
        "price A100-80G 1e308": "a price is 0 to 1,000,000",  # (an infinite cost table)
        "price H100-80G-SXM 3": "has no H100-80G-SXM devices",
        # accepted, they failed the next solve (nan, inf) or at the solver's limit
        "set time-limit nan": "time-limit must be a positive number of seconds",
        "set time-limit inf": "time-limit must be a positive number of seconds",
        "set global-batch 99999999999999999999999": "global-batch must be between 1 and "
                                                    "1,000,000,000",
        "set seq-len 100000": "seq_len (100000) exceeds the 64 learned positions",
    }
    for line, message in cases.items():
        reply = session.run(line)
        assert not reply.ok, line
        assert message in reply.error.message, (line, reply.error.message)
        assert reply.data["ok"] is False and reply.data["error"]
    assert session.state is before
    assert session.transcript == ["model gpt-tiny", f"cluster {CLUSTER}", "set global-batch 32"]
    assert not session.run("# just a comment").items


def test_failed_resolve_keeps_the_edit_and_undo_goes_back(tracer):
    session = start(tracer, "solve")
    good = session.state.plan
    reply = session.run("constrain tp=8")  # nodes have 4 devices: no plan
    assert reply.ok and not reply.data["solved"] and "warning" in kinds(reply)
    assert session.state.plan is None and session.state.constraints.tp == 8
    assert not session.run("explain").ok
    assert session.run("undo").ok
    assert session.state.plan is good and session.state.constraints.tp is None


def test_auto_solve_off_and_time_limit(tracer):
    session = start(tracer, "solve", "set auto-solve off")
    reply = session.run("remove v100-32g-0")
    assert reply.ok and session.state.plan is None and "plan" not in kinds(reply)
    assert session.run("set time-limit 5").ok and session.state.time_limit == 5
    assert session.run("solve").ok and session.state.plan.cluster.num_devices == 4


def test_interrupting_a_solve_changes_nothing(tracer, monkeypatch):
    session = start(tracer, "solve")
    before, transcript = session.state, list(session.transcript)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("planner.session.solve_plans", interrupted)
    with pytest.raises(KeyboardInterrupt):
        session.run("add 1x4xV100-32G")
    assert session.state is before and session.transcript == transcript


def test_launch_scripts_use_planner_launch_when_it_is_there(tracer, tmp_path, monkeypatch):
    session = start(tracer, "solve")
    if importlib.util.find_spec("planner.launch") is None:
        reply = session.run(f"save launch {tmp_path / 'missing'}")
        assert not reply.ok and "planner launch" in reply.error.message
    else:  # the real renderer
        reply = session.run(f"save launch {tmp_path / 'real'}")
        assert reply.ok, reply.error and reply.error.message
        assert read_plan(tmp_path / "real" / "plan.json").num_devices == \
            session.state.plan.num_devices
    fake = types.ModuleType("planner.launch")
    calls = []

    def render_launch(plan, *, target, hosts=None):
        calls.append((target, hosts))
        return {"launch.sh": "#!/bin/sh\n", "nodes/a.sh": "echo a\n"}

    fake.render_launch = render_launch
    fake.read_hosts = lambda path: {"read": str(path)}
    fake.check_out = importlib.import_module("planner.launch").check_out
    monkeypatch.setitem(sys.modules, "planner.launch", fake)
    monkeypatch.setattr("planner.launch", fake, raising=False)
    out = tmp_path / "launch"
    reply = session.run(f"save launch {out} --target slurm --hosts h.yaml")
    assert reply.ok, reply.error and reply.error.message
    assert calls == [("slurm", {"read": "h.yaml"})]
    assert (out / "nodes" / "a.sh").read_text() == "echo a\n"
    assert os.access(out / "launch.sh", os.X_OK)
    assert not session.run(f"save launch {out}").ok  # files exist
    assert session.run(f"save launch {out} --force").ok and calls[-1] == ("torchrun", None)


def test_names_at_the_terminal_print_as_written_not_as_markup(tracer, tmp_path, monkeypatch):
    """Rich reads [..] as markup and :name: as an emoji: a cluster, node, device type or
    file name holding them crashed `show cluster` and the plan's tables (an internal
    error), the progress line and a mistyped device type at the guided start, or changed
    on screen in the goodbye line."""
    import io

    from rich.console import Console

    from cli import interactive

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, color_system=None, emoji=False,
                      highlight=False, width=150)
    (tmp_path / "lab.yaml").write_text(
        'schema_version: 1\nname: "lab[/]"\nnetwork: 100Gbps\nnodes:\n'
        '  - {name: "n[/]", device: {base: V100-16G, name: "gpu[/]:smile:"}, devices: 2}\n'
        '  - {name: "m:smile:", device: A100-40G-SXM, devices: 2}\n')
    monkeypatch.chdir(tmp_path)
    terminal = interactive.Terminal(Session(time_limit=20, tracer=tracer), console)
    # a progress message holding the model's overrides, and the plan's tables
    assert not terminal.do("model gpt-tiny --set note=x[/]").ok
    for line in ("model gpt-tiny", "cluster lab.yaml", "solve", "show cluster",
                 'save plan "p[bold].json"'):
        assert terminal.do(line).ok, line
    answers = iter(["[/]", "V100-16G", "100Gbps"])
    monkeypatch.setattr(terminal, "ask", lambda *a, **k: next(answers))
    monkeypatch.setattr(terminal, "ask_int", lambda question, default: 1)
    monkeypatch.setattr(terminal, "confirm", lambda question: False)
    assert terminal._build_cluster() == "1x1xV100-16G@100Gbps"
    monkeypatch.setattr(interactive, "console", console)
    interactive._goodbye(terminal.session, "quit", tmp_path / "t[bold].txt")
    text = out.getvalue()
    assert "Cluster lab[/]: network" in text and "n[/]  " in text and "m:smile:  " in text
    assert "gpu[/]:smile:  " in text and "Saved the plan to p[bold].json" in text
    assert "Unknown device '[/]'" in text and "Building gpt-tiny (note=x[/])" in text
    assert f"Saved: p[bold].json. Transcript: {tmp_path / 't[bold].txt'}." in text


def test_the_guided_cluster_question_shows_its_keys(monkeypatch):
    """Its choices' keys, [e] [f] [b] [i], are not Rich markup (they used to vanish)."""
    import io

    from rich.console import Console

    from cli import interactive

    out = io.StringIO()
    console = Console(file=out, color_system=None, emoji=False, highlight=False, width=150)
    terminal = interactive.Terminal(Session(time_limit=20), console)
    answers = iter(["i", "1x1xV100-16G@100Gbps"])
    monkeypatch.setattr(terminal, "ask", lambda *a, **k: next(answers))
    terminal._ask_cluster()
    assert ("2. The cluster. [e] an example, [f] a YAML file, [b] build it by answering "
            "questions, [i] an inline spec.") in out.getvalue()
    assert terminal.session.state.cluster.num_devices == 1


def test_reply_data_is_json(tracer):
    session = start(tracer, "solve")
    for line in ("add 1x4xV100-32G", "explain", "show runners-up", "bogus"):
        json.dumps(session.run(line).data)


# ---------------------------------------------------------------- issue 52: the session


def test_save_launch_into_a_folder_that_cannot_be_written_is_an_error(tracer, tmp_path):
    """It raised NotADirectoryError (or PermissionError), which ended a piped session
    as an internal error. Now it is `save plan`'s (and `planner solve -o`'s) paragraph,
    nothing is written, and the session goes on. (As root, chmod stops no writes: a
    path under a regular file, and /proc, which takes no new files, are refused.)"""
    from planner.errors import PlannerError
    from planner.files import check_writable

    session = start(tracer, "solve")
    blocker = tmp_path / "a-file"
    blocker.write_text("mine\n")
    for folder in (blocker / "launch", Path("/proc/launch")):
        with pytest.raises(PlannerError) as expected:  # what `solve -o FOLDER` says
            check_writable(folder, force=False)
        reply = session.run(f"save launch {folder}")
        assert not reply.ok and reply.error.kind == "bad-path", folder
        assert reply.error.message == expected.value.message
        assert reply.error.remedies == ("choose another path",)
    assert blocker.read_text() == "mine\n" and session.run("show constraints").ok


def test_save_launch_failing_in_a_piped_session_is_an_error_not_an_end(tmp_path):
    from typer.testing import CliRunner

    from cli.main import app

    blocked = tmp_path / "a-file" / "launch"
    (tmp_path / "a-file").write_text("")
    lines = (f"model gpt-tiny\ncluster 1x2xA100-80G\nset global-batch 8\nsolve\n"
             f"save launch {blocked}\nmodels tiny\n")
    going = CliRunner().invoke(app, ["interactive", "--keep-going"], input=lines)
    text = " ".join(going.output.split())
    assert going.exit_code == 1 and "internal error" not in text
    said = (f"error: '{blocked}' cannot be written: '{tmp_path / 'a-file'}' is a file, not a "
            "folder.")
    assert "".join(said.split()) in "".join(text.split())  # (however long paths wrap)
    assert "planner> models tiny Model zoo matching 'tiny'" in text  # the session went on
    stopped = CliRunner().invoke(app, ["interactive"], input=lines)
    assert stopped.exit_code == 1 and "internal error" not in stopped.output
    assert "the transcript stopped at a failing command" in " ".join(stopped.output.split())


def needs_length(tracer) -> Session:
    """A session whose model, a factory's, has no default sequence length."""
    session = Session(time_limit=20, tracer=tracer)
    for line in ("model tests.factories:needs_seq_len", "cluster 1x2xA100-80G",
                 "set global-batch 8"):
        assert session.run(line).ok, line
    return session


def test_a_failed_solve_is_tried_again_after_a_change(tracer):
    """`solve` failed for want of a sequence length, and `set seq-len 16` then re-solved
    nothing."""
    session = needs_length(tracer)
    assert not session.run("solve").ok
    still = session.run("set global-batch 4")  # tried again: still no length
    assert still.ok and not still.data["solved"] and session.state.plan is None
    assert still.items[1][1].startswith("Still no plan: Model 'tests.factories:needs_seq_len' "
                                        "has no default sequence length")
    fixed = session.run("set seq-len 16")
    assert fixed.ok and fixed.data["solved"] and session.state.plan is not None
    assert session.transcript[-2:] == ["set seq-len 16", "solve"]  # replays to the plan
    replayed = Session(time_limit=20, tracer=tracer)
    assert all(r.ok for r in replayed.run_script(session.transcript))
    assert replayed.state.plan.prediction.step_time == session.state.plan.prediction.step_time
    grown = session.run("add 1x2xA100-80G")  # and from then on, as after any solve
    assert grown.ok and grown.data["solved"] and session.transcript[-1] == "add 1x2xA100-80G"
    assert replayed.run("add 1x2xA100-80G").ok
    for line in ("undo", "undo"):  # back over the add, then over the solve, as a replay
        assert session.run(line).ok and replayed.run(line).ok
    assert session.state.seq_len == 16 and session.state.plan is None
    assert replayed.state == session.state


def test_errors_name_the_session_commands_not_the_cli_options(tracer):
    session = needs_length(tracer)
    failed = session.run("solve")
    assert failed.error.remedies[0] == "pass the sequence length with `set seq-len N`"
    assert "--seq-len" not in str(failed.error)
    unknown = session.run("model llama9")
    assert unknown.error.remedies == ("run `models` to list every model",)
    assert session.run("set seq-len 16").ok
    reply = session.run("constrain tp=16")  # nodes of two devices: the re-solve fails
    assert reply.data["error"].startswith("`constrain tp=16` cannot be used")
    assert "try: use one of `constrain tp=1`, 2" in [v for k, v in reply.items if k == "note"]


def test_a_model_without_a_default_length_says_so(tracer):
    session = Session(time_limit=20, tracer=tracer)
    reply = session.run("model tests.factories:needs_seq_len")
    assert "no default sequence length (give one: `set seq-len N`)" in reply.items[0][1]
    assert session.needs_seq_len()
    assert session.run("set seq-len 16").ok and not session.needs_seq_len()
    assert session.run("model gpt-tiny").ok and session.run("set seq-len default").ok
    assert not session.needs_seq_len()
    assert not Session().needs_seq_len()  # (no model yet)


def test_a_whatif_leads_with_the_change_and_shows_the_plan_compactly(tracer):
    """Every what-if printed the whole solve (stages, prediction, solver, baselines) under
    the one line `step time X -> Y`, which scrolled away."""
    import io

    from rich.console import Console

    from cli import interactive

    out = io.StringIO()
    console = Console(file=out, width=150, color_system=None, emoji=False, highlight=False)
    terminal = interactive.Terminal(start(tracer, "solve"), console)
    out.truncate(0)
    reply = terminal.do("add 1x4xV100-32G")
    assert kinds(reply) == ["text", "text", "diff", "plan-summary", "note"]
    text = out.getvalue()
    change = text.index("Against the previous plan: step time")
    assert change < text.index("What changed") < text.index("Pipelines (identical")
    for whole in ("Prediction", "Solver", "Baselines"):
        assert whole not in text, whole
    assert "`show plan`: the whole plan; `explain`: why it looks so." in text
    out.truncate(0)
    terminal.do("show plan")
    assert all(whole in out.getvalue() for whole in ("Pipelines", "Prediction", "Baselines"))


def test_explain_agrees_on_whether_memory_binds(tracer):
    """With ZeRO-1 needed to fit but the fullest device 60% full, explain said both
    "Binding constraint: memory: ZeRO-1 is needed" and "Memory does not bind"."""
    session = Session(time_limit=20, tracer=tracer)
    for line in ("model gpt3-6.7b", "cluster 1x8xA100-40G", "set global-batch 8",
                 "set seq-len 128", "constrain tp=2 zero=1 pp=1", "solve"):
        assert session.run(line).ok, line
    explanation = session.analysis().explanation
    assert explanation.binding.startswith("memory: ZeRO-1 is needed to fit")
    fullest = [r.text for r in explanation.reasons if r.text.startswith("Memory ")]
    assert len(fullest) == 1 and fullest[0].startswith("Memory binds: the fullest device")
    assert "It fits only with ZeRO-1 (above)." in fullest[0]
    share = int(fullest[0].split("%)")[0].rsplit("(", 1)[1])
    assert share < 85  # (binding for the saver, not for a full device)


def guided(tracer):
    """A Terminal over a fresh session, what it printed, and the questions it asks (to
    answer with `answering`)."""
    import io

    from rich.console import Console

    from cli import interactive

    out = io.StringIO()
    console = Console(file=out, width=150, color_system=None, emoji=False, highlight=False)
    return interactive.Terminal(Session(time_limit=20, tracer=tracer), console), out


def answering(asked: list[str], *answers: str):
    """A stand-in for Terminal.ask giving `answers` in turn; `asked` gets each question
    (up to its first parenthesis or comma)."""
    queue = iter(answers)

    def ask(question, **kwargs):
        asked.append(question.split(" (")[0].split(",")[0])
        return next(queue)
    return ask


def test_guided_model_question_checks_the_name_first(tracer, monkeypatch):
    """A mistyped model was found only after the shape question, and its hint named
    `planner models`, not what the question (and the session) take."""
    terminal, out = guided(tracer)
    asked: list[str] = []
    monkeypatch.setattr(terminal, "ask", answering(asked, "llama9", "models tiny", "gpt-tiny",
                                                   "--layers 2"))
    terminal._ask_model()
    assert asked == ["Model", "Model", "Model", "Shape overrides"]
    assert "run `models` to list every model" in out.getvalue()
    assert "Model zoo matching 'tiny'" in out.getvalue()
    model = terminal.session.state.model
    assert model.name == "gpt-tiny" and dict(model.overrides) == {"layers": 2}


def test_guided_network_question_asks_again_alone(tracer, monkeypatch):
    """A mistyped network (`25 Gbit`) threw away every answer of the cluster builder."""
    terminal, out = guided(tracer)
    asked: list[str] = []
    monkeypatch.setattr(terminal, "ask", answering(asked, "A100-80G", "25 Gbit", "25GBIT/s"))
    monkeypatch.setattr(terminal, "ask_int", lambda question, default: 2)
    monkeypatch.setattr(terminal, "confirm", lambda question: False)
    assert terminal._build_cluster() == "2x2xA100-80G-SXM@25GBIT/s"
    assert asked == ["Device type", "Network between nodes", "Network between nodes"]
    assert "did you mean '25 Gbit/s'?" in out.getvalue()


def test_guided_sequence_length_is_required_without_a_default(tracer, monkeypatch):
    """A factory's model with no default sequence length took Enter for one."""
    terminal, out = guided(tracer)
    asked: list[str] = []
    assert terminal.do("model tests.factories:needs_seq_len").ok
    monkeypatch.setattr(terminal, "ask", answering(asked, "", "16", "auto"))
    monkeypatch.setattr(terminal, "ask_int", lambda question, default: 8)
    terminal._ask_training()
    assert asked == ["Sequence length", "Sequence length", "Training dtype"]
    assert "This model has no default sequence length" in out.getvalue()
    assert terminal.session.state.seq_len == 16
