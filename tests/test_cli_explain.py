"""`planner explain`, `planner compare`, `planner what-if`, `planner interactive --replay`
and `planner` alone, through typer's CliRunner: tables, --json, files, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from planner.planfile import read_plan

PLANS = Path(__file__).parent / "data" / "plans"
runner = CliRunner()


def run(*args, input=None):
    return runner.invoke(app, [str(a) for a in args], input=input)


@pytest.fixture()
def plans(tmp_path):
    for name in ("base.json", "tp2-slow-net.json"):
        shutil.copy(PLANS / name, tmp_path / name)
    return tmp_path


def test_explain_tables_and_files(plans):
    html, svg = plans / "plan.html", plans / "step.svg"
    result = run("explain", plans / "base.json", "--html", html, "--svg", svg, "--width", "100")
    assert result.exit_code == 0, result.output
    out = result.stdout
    for text in ("Stages", "Device map", "Memory per device", "Communication per step",
                 "Timeline of one step", "Why this plan", "Binding constraint", "Solver",
                 "Runner-ups and baselines", f"Wrote the HTML report to {html}"):
        assert text in out, text
    assert html.read_text().startswith("<!DOCTYPE html>")
    assert svg.read_text().startswith("<?xml")
    again = run("explain", plans / "base.json", "--svg", svg)
    assert again.exit_code == 1 and "already exists" in again.stderr
    assert run("explain", plans / "base.json", "--svg", svg, "--force").exit_code == 0


def test_explain_json_is_machine_output_only(plans):
    result = run("explain", plans / "base.json", "--json", "--runners-up", "2",
                 "--time-limit", "20", "--all-pipelines")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["kind"] == "explanation" and data["model"] == "gpt-tiny"
    plan = read_plan(plans / "base.json")
    lanes = [lane for lane in data["timeline"]["lanes"] if lane["kind"] == "device"]
    assert len(lanes) == sum(len(p.stages) for p in plan.pipelines)  # one per pipeline
    names = [a["name"] for a in data["explanation"]["alternatives"]]
    assert "runner-up #2" in names and "uniform" in names
    assert len(data["devices"]) == plan.cluster.num_devices


def test_explain_of_a_plan_over_a_devices_memory_says_it_does_not_fit(plans):
    """A stage past its device's memory (a plan edited by hand, here its device's memory,
    or one `estimate` wrote all the same) read "ZeRO-2: everything would fit without it
    (at most 1%)". Explain prices the plan as written: the memory stored in the file is
    not what it shows."""
    data = json.loads((plans / "base.json").read_text())
    data["cluster"]["nodes"][0]["device"]["memory"] = 2**30
    data["pipelines"][0]["stages"][0]["memory"]["activations"] = 0.0  # (not read)
    (plans / "big.json").write_text(json.dumps(data))
    result = run("explain", plans / "big.json", "--json")
    assert result.exit_code == 0, result.output
    explanation = json.loads(result.stdout)["explanation"]
    assert explanation["binding"] == ("memory: pipeline 0 stage 0 does not fit a100-80g-sxm-0 "
                                      "(A100-80G-SXM)")
    memory = [r["text"] for r in explanation["reasons"] if r["kind"] == "memory"]
    assert memory == [
        "ZeRO-2 on 4 of 4 stages: even with it, pipeline 0 stage 0 does not fit "
        "a100-80g-sxm-0 (A100-80G-SXM).",
        "The plan does not fit: pipeline 0 stage 0 holds 1.01 GiB per device on a100-80g-sxm-0 "
        "(A100-80G-SXM), which has 1 GiB (101%); its largest term is reserve (1 GiB). "
        "`planner launch` refuses it."]


@pytest.mark.parametrize("content,message", [
    (None, "does not exist"),
    ("{not json", "not JSON"),
    ('{"kind": "cluster"}', "not a plan file"),
    ('{"kind": "plan", "schema_version": 99}', "schema_version 99;"),
    ('{"kind": "plan", "schema_version": "1"}', "schema_version '1', a str; this planner "
     "reads version 1 (a number)"),
    ('{"kind": "plan", "schema_version": 1, "model": 3}', "not a valid plan"),
])
def test_explain_rejects_bad_plan_files(tmp_path, content, message):
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    result = run("explain", path)
    assert result.exit_code == 1
    assert message in result.stderr and "Traceback" not in result.output


def test_compare_side_by_side(plans):
    result = run("compare", plans / "base.json", plans / "tp2-slow-net.json")
    assert result.exit_code == 0, result.output
    for text in ("step time", "samples/s", "min memory headroom", "tp comm", "tensor parallel",
                 "base", "tp2-slow-net", "(+"):
        assert text in result.stdout, text
    data = json.loads(run("compare", plans / "base.json", plans / "tp2-slow-net.json",
                          "--json", "--price", "A100-80G=2").stdout)
    rows = {r["key"]: r for r in data["rows"]}
    assert rows["step_time"]["verdicts"] == ["", "worse"]
    assert rows["dollars_per_m"]["values"][0] > 0
    only = run("compare", plans / "base.json", plans / "tp2-slow-net.json", "-d")
    assert "sequence length" not in only.stdout and "step time" in only.stdout
    one = run("compare", plans / "base.json")
    assert one.exit_code == 1 and "at least two" in one.stderr
    bad = run("compare", plans / "base.json", plans / "base.json", "--price", "A100")
    assert bad.exit_code == 1 and "TYPE=DOLLARS" in bad.stderr


def test_what_if_adds_nodes_and_writes_files(plans):
    out, cluster = plans / "more.json", plans / "more.yaml"
    result = run("what-if", plans / "base.json", "--add", "1x4xV100-32G", "--link",
                 "network=50Gbps", "-B", "64", "--time-limit", "20", "-o", out,
                 "--cluster-out", cluster)
    assert result.exit_code == 0, result.output
    assert "What if:" in result.stdout and "step time" in result.stdout
    new = read_plan(out)
    assert new.cluster.num_devices == 12 and new.training.global_batch == 64
    assert "v100-32g-1" in cluster.read_text()
    data = json.loads(run("what-if", plans / "base.json", "--remove", "v100-32g-0", "--tp", "2",
                          "--json").stdout)
    assert data["kind"] == "what-if" and data["edits"] == ["remove v100-32g-0"]
    assert data["plan"]["cluster"]["nodes"][0]["name"] == "a100-80g-sxm-0"
    assert {s["tp"] for p in data["plan"]["pipelines"] for s in p["stages"]} == {2}
    for args, message in ((["--remove", "nope"], "has no node 'nope'"),
                          (["--link", "network"], "KEY=VALUE"),
                          (["--link", "wifi=1Gbps"], "Unknown link"),
                          (["--resize", "a100-80g-sxm-0=none"], "whole number"),
                          (["--exclude", "nope"], "has no node"),
                          (["--add", "1x4xA100-80G", "-o", out], "already exists"),
                          # (0 was taken as "unchanged": the plan's own, solved again)
                          (["-s", "0"], "sequence length (seq-len) must be positive (got 0)"),
                          (["-B", "0"], "--global-batch must be between 1 and "
                                        "1,000,000,000 samples per step (got 0)")):
        bad = run("what-if", plans / "base.json", *args)
        assert bad.exit_code == 1, args
        assert message in bad.stderr, (args, bad.stderr)


def test_interactive_replay(plans):
    script = plans / "session.txt"
    script.write_text("# a transcript\nmodel gpt-tiny\ncluster 1x4xA100-80G,1x4xV100-32G\n"
                      "set global-batch 32\nsolve\nadd 1x4xV100-32G\nexplain\n"
                      f"save plan {plans / 'out.json'}\n")
    result = run("interactive", "--replay", script, "--record", plans / "rec.txt")
    assert result.exit_code == 0, result.output
    assert "planner> add 1x4xV100-32G" in result.stdout and "What changed" in result.stdout
    assert read_plan(plans / "out.json").cluster.num_devices == 12
    assert (plans / "rec.txt").read_text().splitlines()[1:] == script.read_text().splitlines()[1:]
    # replaying again: the save fails without --force and stops the script
    again = run("interactive", "--replay", script)
    assert again.exit_code == 1 and "already exists" in " ".join(again.stdout.split())
    data = json.loads(run("interactive", "--replay", script, "--force", "--json").stdout)
    assert [d["ok"] for d in data] == [True] * 7
    assert data[4]["diff"] and data[5]["explanation"]["headline"]
    piped = run("interactive", "--json", input="model gpt-tiny\nbogus\nmodels\n")
    assert piped.exit_code == 1
    assert [d["ok"] for d in json.loads(piped.stdout)] == [True, False]
    going = run("interactive", "--json", "--keep-going", input="bogus\nmodels tiny\n")
    assert [d["ok"] for d in json.loads(going.stdout)] == [False, True]
    missing = run("interactive", "--replay", plans / "nope.txt")
    assert missing.exit_code == 1 and "does not exist" in missing.stderr


def test_planner_alone_without_a_terminal_prints_help():
    result = run()
    assert result.exit_code == 0
    for command in ("interactive", "explain", "compare", "what-if"):
        assert command in result.stdout
    assert run("--version").stdout.startswith("planner ")
    for command in ("interactive", "explain", "compare", "what-if"):
        helped = run(command, "--help")
        assert helped.exit_code == 0 and "Example" in helped.stdout, command


def test_terminal_survives_a_bug_and_ctrl_c(monkeypatch):
    from rich.console import Console

    from cli.interactive import Terminal
    from planner.session import Session

    session = Session()
    console = Console(record=True, width=100, color_system=None)
    terminal = Terminal(session, console)

    def broken(line):
        raise RuntimeError("boom")

    monkeypatch.setattr(session, "run", broken)
    assert terminal._interruptible("solve") is False
    assert "internal error: RuntimeError: boom" in console.export_text()

    def interrupted(line):
        raise KeyboardInterrupt

    monkeypatch.setattr(session, "run", interrupted)
    assert terminal._interruptible("solve") is False
    assert "Interrupted; nothing changed" in console.export_text()


def test_explain_and_compare_refuse_options_that_cannot_apply(plans, tmp_path):
    same = tmp_path / "same.html"
    result = run("explain", plans / "base.json", "--html", same, "--svg", same)
    assert result.exit_code == 1 and "give them different files" in result.stderr
    fixed = tmp_path / "fixed.json"
    made = run("estimate", "gpt-tiny", "--cluster", "1x4xA100-40G", "-B", "8", "--pp", "2",
               "-o", fixed)
    assert made.exit_code == 0, made.output
    result = run("explain", fixed, "--runners-up", "1")
    assert result.exit_code == 1 and "not a search result" in result.stderr
    result = run("compare", plans / "base.json", plans / "tp2-slow-net.json", "--price",
                 "H100=3")
    assert result.exit_code == 1 and "which none of the plans uses" in result.stderr


def test_folders_and_paths_under_files_are_named(plans, tmp_path):
    """A folder given as a plan read "does not exist" (launch) or got Click's boxed error
    (explain, compare, what-if); a path under a file read "Folder ... does not exist"."""
    for args in (["explain", tmp_path], ["compare", tmp_path, plans / "base.json"],
                 ["what-if", tmp_path], ["launch", tmp_path, "--dry-run"]):
        result = run(*args)
        assert result.exit_code == 1, args
        assert f"'{tmp_path}' is a folder, not a plan file" in result.stderr, args
    blocked = plans / "base.json" / "x.html"
    result = run("explain", plans / "base.json", "--html", blocked)
    assert result.exit_code == 1
    assert f"'{plans / 'base.json'}' is a file, not a folder" in result.stderr


@pytest.mark.parametrize("width", ["39", "1000000"])
def test_explain_width_is_bounded(plans, width):
    """A million columns printed megabytes of timeline."""
    result = run("explain", plans / "base.json", "--width", width)
    assert result.exit_code == 1 and "--width must be between 40 and 2,000 columns" in (
        result.stderr)


def test_names_are_printed_as_written_not_as_markup(tmp_path, monkeypatch):
    """Rich reads [..] as markup and :name: as an emoji: a cluster, node, device, model or
    file name holding them used to crash the tables and notes ("closing tag '[/]' has
    nothing to close") or change on screen (the "Wrote ... to r[bold].html" lines printed
    "rx.html")."""
    monkeypatch.chdir(tmp_path)  # short paths: each "Wrote" line fits on one line
    for folder in ("s[", "c["):  # so that "s[/]x.svg" names a file
        Path(folder).mkdir()
    Path("lab.yaml").write_text('schema_version: 1\nname: "lab[/]"\nnetwork: 100Gbps\nnodes:\n'
                                '  - {name: "n[/]", device: {base: V100-16G, name: "v[/]:smile:"}, '
                                'devices: 2}\n'
                                '  - {name: "m:smile:", device: A100-40G-SXM, devices: 2}\n')
    plan = "p[bold].json"
    solved = run("solve", "gpt-tiny", "--cluster", "lab.yaml", "--time-limit", "3", "-o", plan)
    assert solved.exit_code == 0, solved.output
    assert "cluster lab[/]" in solved.stdout and "Wrote the plan to p[bold].json" in solved.stdout
    doc = json.loads(Path(plan).read_text())  # a plan file's text is the user's too
    doc["solver"]["search_space"] = "as [/] written :smile:"
    Path(plan).write_text(json.dumps(doc))
    explained = run("explain", plan, "--html", "r[bold].html", "--svg", "s[/]x.svg")
    assert explained.exit_code == 0, explained.output
    assert "m:smile:" in explained.stdout and "n[/]" in explained.stdout
    assert "v[/]:smile:" in solved.stdout and "v[/]:smile:" in explained.stdout
    assert "search space: as [/] written :smile:" in explained.stdout
    assert "Wrote the HTML report to r[bold].html" in explained.stdout
    assert "Wrote the SVG timeline to s[/]x.svg" in explained.stdout
    edited = run("what-if", plan, "--time-limit", "3", "--remove", "n[/]", "-o", "w[bold].json",
                 "--cluster-out", "c[/]x.yaml")
    assert edited.exit_code == 0, edited.output
    assert "remove n[/]" in edited.stdout and "Wrote the plan to w[bold].json" in edited.stdout
    assert "Wrote the cluster to c[/]x.yaml" in edited.stdout
    launched = run("launch", plan, "--out", "la[bold]x")
    assert launched.exit_code == 0, launched.output
    assert " files to la[bold]x: " in launched.stdout
    assert "(see la[bold]x/README.md)" in launched.stdout
    estimated = run("estimate", "gpt-tiny", "--cluster", "lab.yaml", "--dtype", "bf16", "-o",
                    "e[bold].json")  # (every device a replica: both types used)
    assert estimated.exit_code == 0, estimated.output
    assert "note: v[/]:smile: list no bf16 throughput" in estimated.stderr
    assert "Wrote the plan to e[bold].json" in estimated.stdout
    other = json.loads(Path("e[bold].json").read_text())
    other["model"] = {"source": "factory", "name": "my[/]pkg:build:smile:", "overrides": {}}
    Path("q.json").write_text(json.dumps(other))
    compared = run("compare", "e[bold].json", "q.json", "--price", "A100-40G-SXM=2")
    assert compared.exit_code == 0, compared.output
    assert "(gpt-tiny, my[/]pkg:build:smile:)" in compared.stdout
    assert "no --price for v[/]:smile:" in compared.stderr
    traced = run("trace", "[/]")
    assert traced.exit_code == 1 and "Unknown model '[/]'" in traced.stderr
    traced = run("trace", "tests.factories:named", "--set", 'name="x[/]:smile:"', "--graph",
                 "g[bold].json")
    assert traced.exit_code == 0, traced.output
    assert "tests.factories:named (name=x[/]:smile:): " in traced.stdout
    assert "Wrote the op graph (json) to g[bold].json" in traced.stdout
