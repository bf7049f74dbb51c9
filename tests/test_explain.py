"""Plan analyses (planner.explain), timelines (planner.timeline) and the HTML report
(planner.report): contents, agreement with the predictions, files that open offline,
and golden renderings of the terminal charts and tables."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest
from rich.console import Console

from cost_models.cluster import load_cluster
from cost_models.comm import Collective, CommGroup
from cost_models.model import AnalyticalCostModel
from planner.errors import PlannerError
from planner.explain import analysis_dict, analyze, check_layers, retrace, why_slower
from planner.models import load_model, model_spec
from planner.planfile import read_plan
from planner.report import report_html
from planner.session import Session
from planner.solver.timing import StageTiming
from planner.solver.uniform import uniform_plan
from planner.timeline import Run, lay_out, text_rows, to_svg
from planner.trace import trace_loaded, trace_model
from planner.types import Schedule, TrainingSpec

DATA = Path(__file__).parent / "data"
GOLDEN = DATA / "golden"
SVG = "{http://www.w3.org/2000/svg}"


def golden(name: str, text: str) -> None:
    """Compare with tests/data/golden/NAME; PLANNER_UPDATE_GOLDEN=1 rewrites it."""
    path = GOLDEN / name
    if os.environ.get("PLANNER_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no golden file {path}; run with PLANNER_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{name} changed; PLANNER_UPDATE_GOLDEN=1 updates it"


@pytest.fixture(scope="module")
def solved():
    """A two-stage heterogeneous plan with its runner-ups, solved once."""
    session = Session(time_limit=20)
    for line in ("model gpt-tiny", "cluster 1x4xA100-80G,1x4xV100-32G@25Gbps",
                 "set global-batch 32", "constrain pp=2", "solve"):
        assert session.run(line).ok, line
    plan = session.state.plan
    graph = session.trace(plan.model, plan.training.seq_len, plan.training.dtype)
    return session, plan, graph


def test_analysis_covers_the_plan(solved):
    session, plan, graph = solved
    a = analyze(plan, graph.layers, runners_up=session.state.runners_up,
                constraints=["pp=2"])
    # every device of the cluster appears once in the device map, used ones by role
    assert len(a.devices) == plan.cluster.num_devices
    used = {(s.devices.node, d) for p in plan.pipelines for s in p.stages
            for d in s.devices.devices}
    assert {(d.node, d.device) for d in a.devices if d.role != "idle"} == used
    # memory rows carry the plan's figures
    totals = {round(s.memory.total) for p in plan.pipelines for s in p.stages}
    assert {round(m.total) for m in a.memory} == totals
    assert all(0 < m.fraction < 1 for m in a.memory)
    # two stages per pipeline: activations cross a link
    assert any(t.kind == "pp activations" and t.bytes_per_step > 0 for t in a.traffic)
    # the timeline has a lane for every stage, and stands for every used device
    lanes = [lane for lane in a.timeline.lanes if lane.kind == "device"]
    assert {lane.stage for lane in lanes} == {0, 1}
    assert {d for lane in lanes for d in lane.devices} == {f"{n}:{d}" for n, d in used}
    assert a.timeline.step_time == pytest.approx(plan.prediction.step_time, rel=0.15)
    e = a.explanation
    assert e.binding and "per step" in e.headline
    assert e.bottleneck.stage in (0, 1) and 0 < e.bottleneck.share <= 1.0 + 1e-9
    assert any(r.kind == "constraint" and "pp=2" in r.text for r in e.reasons)
    names = [alt.name for alt in e.alternatives]
    assert "runner-up #2" in names and {"data-parallel", "uniform"} <= set(names)
    assert all(alt.slower_by is None or alt.slower_by >= -1e-9 for alt in e.alternatives)
    data = json.loads(json.dumps(analysis_dict(a)))
    assert data["kind"] == "explanation" and data["timeline"]["lanes"]


def test_runner_ups_are_ranked_with_the_plan(solved):
    """Runner-ups found by a new search may beat the plan (its search had constraints
    the plan file does not keep, or stopped early): each is named by its place among
    the plan and them, so one that beats it is #1, not #2."""
    session, plan, graph = solved
    worse = session.state.runners_up[0]
    faster = dataclasses.replace(worse, prediction=dataclasses.replace(
        worse.prediction, step_time=plan.prediction.step_time / 2))
    e = analyze(plan, graph.layers, runners_up=[worse, faster]).explanation
    ranked = {alt.name: alt for alt in e.alternatives if alt.name.startswith("runner-up")}
    assert set(ranked) == {"runner-up #1", "runner-up #3"}
    assert ranked["runner-up #1"].slower_by == pytest.approx(-0.5)
    assert ranked["runner-up #1"].why.startswith("faster than this plan")


def test_stage_rows_name_a_schedule_other_than_1f1b(solved):
    _, plan, graph = solved
    gpipe = dataclasses.replace(plan, pipelines=tuple(
        dataclasses.replace(p, schedule=Schedule.GPIPE) for p in plan.pipelines))
    analysis = analyze(gpipe, graph.layers)
    assert all(r.schedule == ", GPipe" for r in analysis.stages)
    assert f"{gpipe.pipelines[0].micro_batch}, GPipe" in report_html(analysis)
    plain = dataclasses.replace(plan, pipelines=tuple(
        dataclasses.replace(p, schedule=Schedule.ONE_F_ONE_B) for p in plan.pipelines))
    assert all(r.schedule == "" for r in analyze(plain, graph.layers).stages)


def test_memory_rows_name_every_node_their_pipelines_use():
    """Identical stages of pipelines on two nodes are one row that says so (it showed
    the first pipeline's node for all of them)."""
    from planner.explain import memory_rows
    from tests.runtime_helpers import tiny_plan

    plan = tiny_plan("2x2xcpu", pp=1, dp=4)
    assert {s.devices.node for p in plan.pipelines for s in p.stages} == {"cpu-0", "cpu-1"}
    (row,) = memory_rows(plan)
    assert row.pipelines == (0, 1, 2, 3) and row.node == "cpu-0 +1 more"


def test_why_slower_names_the_terms(solved):
    _, plan, _ = solved
    p = plan.prediction
    slower = dataclasses.replace(p, step_time=p.step_time * 2, bubble=p.bubble + p.step_time)
    assert "pipeline bubble" in why_slower(p, slower)
    assert "tie" in why_slower(p, p)
    faster = dataclasses.replace(p, step_time=p.step_time / 2, compute=p.compute / 2)
    assert "faster than this plan" in why_slower(p, faster)


def test_a_plan_for_another_model_is_refused(solved):
    _, plan, _ = solved
    other = dataclasses.replace(plan, model=model_spec("gpt-tiny", {"layers": 2}))
    with pytest.raises(PlannerError, match="do not match"):
        retrace(other)
    with pytest.raises(PlannerError, match=r"^mine\.json: The plan.s stage 1 of pipeline 0 holds"):
        retrace(other, "mine.json")  # (the file the plan came from, as explain gives it)
    small = trace_loaded(load_model(model_spec("gpt-tiny", {"layers": 2})), batch=1)
    with pytest.raises(PlannerError, match="changed since the plan was made"):
        check_layers(plan, small.layers)


@pytest.mark.parametrize("schedule,interleave", [(Schedule.GPIPE, 1),
                                                 (Schedule.ONE_F_ONE_B, 1),
                                                 (Schedule.INTERLEAVED, 2)])
def test_timeline_matches_the_closed_form(solved, schedule, interleave):
    _, plan, graph = solved
    costs = AnalyticalCostModel(plan.cluster)
    fixed = uniform_plan(layers=graph.layers, model=plan.model, cluster=plan.cluster,
                         training=plan.training, costs=costs, tp=1, pp=2, dp=2, micro_batch=2,
                         schedule=schedule, interleave=interleave)
    a = analyze(fixed, graph.layers, costs)
    assert a.timeline.step_time == pytest.approx(fixed.prediction.step_time, rel=0.15)
    kinds = {b.kind for b in a.timeline.bars}
    assert {"fwd", "bwd", "sync", "optimizer"} <= kinds
    if interleave > 1:
        assert {b.chunk for b in a.timeline.bars if b.kind == "fwd"} == {0, 1}


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.attrs: list[tuple[str, str | None]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs += attrs


def test_svg_and_html_are_self_contained(solved, tmp_path):
    _, plan, graph = solved
    a = analyze(plan, graph.layers)
    svg = to_svg(a.timeline)
    root = ET.fromstring(svg.split("\n", 1)[1])
    assert root.tag == f"{SVG}svg"
    lanes = root.findall(f"{SVG}g[@class='lane']")
    assert len(lanes) == len(a.timeline.lanes)
    devices = " ".join(g.get("data-devices") or "" for g in lanes)
    for p in plan.pipelines:
        for s in p.stages:
            for d in s.devices.devices:
                assert f"{s.devices.node}:{d}" in devices
    labels = [t.text for t in root.iter(f"{SVG}text")]
    assert any(" s0 " in (t or "") for t in labels) and any(" s1 " in (t or "") for t in labels)
    # every bar is drawn, alone or merged with neighbours too narrow to tell apart
    bars = [e for e in root.iter() if e.get("class") == "bar"]
    assert sum(int(e.get("data-count")) for e in bars) == len(a.timeline.bars)
    for text in (svg, report_html(a)):
        assert not re.search(r"(?:src|href)\s*=", text), "no external references"
        assert "@import" not in text and "url(" not in text
        assert "http" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")
    html = report_html(a)
    parser = _Tags()
    parser.feed(html)
    assert parser.tags[0] == "html" and "svg" in parser.tags
    assert not {"script", "link", "img", "iframe", "object"} & set(parser.tags)
    inline = html[html.index("<svg"):html.index("</svg>") + 6]
    ET.fromstring(inline)  # well-formed
    for row in a.devices:
        assert f"[{row.device}] {row.role}" in html
    if shutil.which("rsvg-convert"):  # a real renderer, offline
        (tmp_path / "t.svg").write_text(svg)
        done = subprocess.run(["rsvg-convert", str(tmp_path / "t.svg"), "-o",
                               str(tmp_path / "t.png")], capture_output=True, timeout=60)
        assert done.returncode == 0 and (tmp_path / "t.png").stat().st_size > 1000


def _synthetic():
    slow = (StageTiming(fwd=1.0, bwd=2.0, send=0.25), StageTiming(fwd=1.5, bwd=3.0))
    fast = (StageTiming(fwd=0.5, bwd=1.0, send=0.25), StageTiming(fwd=0.5, bwd=1.0))
    runs = [Run(pipelines=(0,), stages=slow, microbatches=4, device_types=("V100 x2", "V100"),
                devices=(("v-0:0", "v-0:1"), ("v-1:0",))),
            Run(pipelines=(1, 2), stages=fast, microbatches=8, device_types=("A100", "A100"),
                devices=(("a-0:0", "a-0:2"), ("a-0:1", "a-0:3")))]
    return lay_out(runs, sync=1.0, optimizer=0.5, title="synthetic", predicted=20.0)


def _dense(recomputes: tuple[bool, ...] = ()):
    """64 micro-batches through two balanced stages: bars a few pixels wide."""
    stages = (StageTiming(fwd=1.0, bwd=2.0, send=0.05), StageTiming(fwd=1.0, bwd=2.0))
    run = Run(pipelines=(0,), stages=stages, microbatches=64, device_types=("A100", "V100"),
              devices=(("a-0:0",), ("v-0:0",)), recomputes=recomputes)
    return lay_out([run], sync=8.0, optimizer=2.0, title="dense", predicted=205.0)


def _drawn(svg: str) -> dict[tuple[int, int], list[tuple[float, float, int]]]:
    """(x0, x1, bars it stands for) of every drawn bar, per lane by its y and height."""
    root = ET.fromstring(svg.split("\n", 1)[1])
    lanes: dict[tuple[int, int], list[tuple[float, float, int]]] = {}
    for element in root.iter():
        if element.get("class") != "bar":
            continue
        rects = [element] if element.tag == f"{SVG}rect" else element.findall(f"{SVG}rect")
        x0 = min(float(r.get("x")) for r in rects)
        x1 = max(float(r.get("x")) + float(r.get("width")) for r in rects)
        y0 = min(float(r.get("y")) for r in rects)
        y1 = max(float(r.get("y")) + float(r.get("height")) for r in rects)
        lanes.setdefault((round(y0), round(y1 - y0)), []).append(
            (x0, x1, int(element.get("data-count"))))
    return lanes


def test_svg_merges_bars_too_narrow_to_tell_apart():
    """At 64 micro-batches a lane was a solid strip of 128 bars a few pixels wide:
    bars narrower than MIN_BAR_PX merge with neighbours closer than MIN_GAP_PX into
    one striped block, so no two narrow bars touch; every bar is still counted, and
    warm-up, drain, sync and optimizer stay bars of their own."""
    from planner.timeline import MIN_BAR_PX, MIN_GAP_PX

    timeline = _dense()
    svg = to_svg(timeline)
    lanes = _drawn(svg)
    assert sum(count for drawn in lanes.values() for *_, count in drawn) == len(timeline.bars)
    device_lanes = [drawn for (_, height), drawn in lanes.items() if height == 20]
    assert len(device_lanes) == 2
    for drawn in device_lanes:
        assert len(drawn) <= 8, "a few blocks, not 128 slivers"
    for drawn in lanes.values():
        drawn.sort()
        for (a0, a1, _), (b0, b1, _) in itertools.pairwise(drawn):
            if a1 - a0 < MIN_BAR_PX and b1 - b0 < MIN_BAR_PX:
                assert b0 - a1 >= MIN_GAP_PX - 1e-6
    root = ET.fromstring(svg.split("\n", 1)[1])
    merged = [g for g in root.iter(f"{SVG}g") if g.get("class") == "bar"]
    steady = [g for g in merged if g.get("data-kind") == "fwd bwd"]
    assert len(steady) == 2  # one per stage: its stripes are forward over backward
    assert [r.get("fill") for r in steady[0].findall(f"{SVG}rect")] == ["#4c78a8", "#54a24b"]
    tip = steady[0].find(f"{SVG}title").text
    assert "forward" in tip and "backward" in tip and "micro-batches" in tip
    golden("timeline_dense.svg", svg)


def test_one_set_of_names_and_recompute_only_where_a_stage_recomputes(solved):
    """The SVG legend said "backward (with recompute)" without recompute, and the
    report's second legend and the terminal chart used other names: every legend
    now lists `timeline.legend`, whose backward mentions recompute only if a stage
    recomputes; bar tooltips say it on those stages only."""
    from cli.render_explain import gantt
    from planner.report import MEMORY_COLORS
    from planner.timeline import legend

    def svg_legend(svg: str) -> list[str]:
        root = ET.fromstring(svg.split("\n", 1)[1])
        return [g.find(f"{SVG}text").text for g in root.iter(f"{SVG}g")
                if g.get("class") == "legend"]

    def terminal_legend(timeline) -> list[str]:
        console = Console(width=200, color_system=None, record=True)
        console.print(gantt(timeline, 200))
        entries = console.export_text().splitlines()[-1].strip().split("   ")
        assert entries[-2:] == ["· idle", "Fn, Bn: micro-batch n"]
        return [entry[2:] for entry in entries[:-2]]  # (after its fill character)

    plain, some = _dense(), _dense(recomputes=(False, True))
    names = [name for _, name in legend(plain)]
    assert names == ["forward", "backward", "activation send", "gradient send",
                     "gradient sync", "optimizer step"]
    assert "recompute" not in to_svg(plain)
    assert svg_legend(to_svg(plain))[:len(names)] == names == terminal_legend(plain)
    some_names = [name for _, name in legend(some)]
    assert some_names[1] == "backward (with recompute where a stage recomputes)"
    assert svg_legend(to_svg(some))[:len(names)] == some_names == terminal_legend(some)
    tips = [t.text for t in ET.fromstring(to_svg(some).split("\n", 1)[1]).iter(f"{SVG}title")]
    assert any("backward (with recompute)" in t for t in tips)
    assert [lane.recompute for lane in some.lanes if lane.kind == "device"] == [False, True]
    everywhere = _dense(recomputes=(True, True))
    assert legend(everywhere)[1] == ("bwd", "backward (with recompute)")
    # the report's legends: the timeline's names and the memory terms, nothing else
    _, plan, graph = solved
    analysis = analyze(plan, graph.layers)
    html = report_html(analysis)

    class Legends(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.depth = 0
            self.texts: list[str] = []

        def handle_starttag(self, tag, attrs):
            if self.depth or ("class", "legend") in attrs:
                self.depth += 1

        def handle_endtag(self, tag):
            self.depth = max(0, self.depth - 1)

        def handle_data(self, data):
            if self.depth and data.strip():
                self.texts.append(data.strip())

    parser = Legends()
    parser.feed(html)
    timeline_names = {name for _, name in legend(analysis.timeline)}
    assert timeline_names <= set(parser.texts)
    assert {t for t in parser.texts if not t.startswith("striped")} <= (
        timeline_names | set(MEMORY_COLORS))


def test_memory_bars_carry_their_figures(solved):
    """Memory bars had only colours (figures in hover text): each is labelled used /
    capacity, terms wide enough carry their size, and a stage over its device's memory
    is marked at the capacity."""
    from planner.explain import MemoryRow
    from planner.report import BAR_PX, memory_bar
    from planner.units import fmt_bytes

    _, plan, graph = solved
    analysis = analyze(plan, graph.layers)
    html = report_html(analysis)
    bars = re.findall(r'<svg class="bar".*?</svg>', html)
    for m in analysis.memory:
        caption = f"{fmt_bytes(m.total)} / {fmt_bytes(m.capacity)} ({m.fraction:.0%})"
        assert any(f">{caption}</text>" in bar for bar in bars), caption
    gib = 2.0 ** 30
    row = MemoryRow(pipelines=(0,), stage=1, node="v-0", device_type="V100-16G",
                    capacity=16 * gib, terms={"weights": 6 * gib, "gradients": 6 * gib,
                                              "optimizer": 0.1 * gib, "activations": 8 * gib,
                                              "reserve": 0.0}, total=20.1 * gib)
    svg = ET.fromstring(memory_bar(row))
    texts = [t.text for t in svg.iter("text")]
    assert "20.1 GiB / 16 GiB (126%)" in texts
    assert {"6 GiB", "8 GiB"} <= set(texts) and fmt_bytes(0.1 * gib) not in texts
    (limit,) = svg.iter("line")
    assert float(limit.get("x1")) == pytest.approx(BAR_PX * 16 / 20.1, abs=0.01)
    caption = next(t for t in svg.iter("text") if t.get("class") == "caption")
    assert caption.get("fill") == "#cc0000"


def test_step_time_by_cause_is_drawn(solved):
    """Step time by cause was a bare table: each cause has a bar as long as its share
    of the step, beside its seconds and share as text."""
    from planner.explain import TERM_WORDS
    from planner.report import BAR_PX

    _, plan, graph = solved
    html = report_html(analyze(plan, graph.layers))
    section = html[html.index("Step time by cause"):]
    section = section[:section.index("</table>")]
    pred = plan.prediction
    rows = re.findall(r"<tr><td>(.*?)</td>.*?(<svg.*?</svg>)", section)
    assert [cause for cause, _ in rows] == [TERM_WORDS[k] for k in pred.terms()]
    for (cause, bar), value in zip(rows, pred.terms().values(), strict=True):
        svg = ET.fromstring(bar)
        drawn = [r for r in svg.iter("rect") if r.find("title") is not None]
        width = sum(float(r.get("width")) for r in drawn)
        assert width == pytest.approx(BAR_PX * value / pred.step_time, abs=0.02), cause
        if value > 0:
            assert cause in drawn[0].find("title").text


def test_gantt_text_golden():
    timeline = _synthetic()
    # the slow pipeline by the closed form: (m - 1) * 4.5 + (3 + 4.5) + 2 * 0.25, then
    # sync and optimizer
    assert timeline.step_time == pytest.approx(3 * 4.5 + 7.5 + 0.5 + 1.5)
    text = "\n".join(f"{label:<22}|" + "".join(t for t, _ in segments)
                     for label, segments in text_rows(timeline, 72)) + "\n"
    golden("gantt.txt", text)


def test_rich_gantt_and_compare_golden():
    from cli.render_explain import compare_table, gantt
    from planner.compare import compare

    console = Console(width=100, color_system=None, record=True, force_terminal=False)
    console.print(gantt(_synthetic(), 100), soft_wrap=True)
    plans = [read_plan(DATA / "plans" / "base.json"),
             read_plan(DATA / "plans" / "tp2-slow-net.json")]
    console.print(compare_table(compare(plans), ["base", "tp2-slow-net"], title="compare"))
    golden("gantt_and_compare.txt", console.export_text())


def test_explain_says_when_gradient_all_reduces_share_a_network_card():
    """Pipelines laid out one per node put each stage's replicas on both nodes: the two
    stages' gradient all-reduces cross the same cards at once, one after the other,
    and the predicted sync is their sum; explain says so. On one node nothing crosses
    a card, and it says nothing."""
    graph = trace_model(model_spec("mlp"), dtype="fp16")  # (no tied weights)
    training = TrainingSpec(global_batch=8, dtype="fp16")

    def reasons(cluster_text: str) -> tuple[list[str], float, list[float]]:
        cluster = load_cluster(cluster_text)
        costs = AnalyticalCostModel(cluster)
        plan = uniform_plan(layers=graph.layers, model=graph.spec, cluster=cluster,
                            training=training, costs=costs, tp=1, pp=2, dp=2, micro_batch=1)
        group = CommGroup.of([s.devices.node for s in plan.pipelines[0].stages[:1]]
                             + [plan.pipelines[1].stages[0].devices.node])
        each = [costs.collective_time(Collective.ALL_REDUCE, sum(
            graph.layers[i].params for i in s.held()) * 2, group)
            for s in plan.pipelines[0].stages]
        texts = [r.text for r in analyze(plan, graph.layers, costs).explanation.reasons]
        return texts, plan.prediction.dp_comm, each

    texts, sync, each = reasons("2x2xA100-40G@1Gbps")
    shared = [t for t in texts if "network card" in t]
    assert len(shared) == 1 and "2 gradient all-reduces across nodes" in shared[0]
    assert sync == pytest.approx(sum(each))
    assert not [t for t in reasons("1x4xA100-40G")[0] if "network card" in t]
