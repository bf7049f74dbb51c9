"""`planner profile`: real quick-mode measurements of this machine's CPU, the layer
time attribution, the alpha-beta fit, sampling and its spread (with a fake clock or
made-up samples: nothing here depends on how busy the machine is), profile validation
and the CLI."""

import json
import statistics
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from typer.testing import CliRunner

from cli.main import app
from cost_models.profile import load_profile, noise_warnings, run_profile
from cost_models.profile.comm import _free_port, _mean_seconds, fit_alpha_beta
from cost_models.profile.contention import PROBE_BYTES, overlapped
from cost_models.profile.layers import split_pass
from cost_models.profile.timing import Clock, Samples, sample_seconds
from planner.errors import PlannerError
from planner.models import model_spec
from planner.trace import trace_model

runner = CliRunner()
CPU = torch.device("cpu")
AGREE = (1e-3, 1e-3, 1.1e-3, 1e-3, 1e-3)  # a slow sample now and then: spread 1
DISAGREE = (1e-3, 3e-3, 1e-3, 3e-3, 1e-3)  # the middle half 3x apart


class FakeWork:
    """Work that takes the next of `durations` seconds of a fake clock per call."""

    def __init__(self, durations) -> None:
        self.durations, self.now, self.calls = list(durations), 0.0, 0

    def __call__(self) -> None:
        self.now += self.durations[min(self.calls, len(self.durations) - 1)]
        self.calls += 1

    def timer(self) -> float:
        return self.now


class FixedSamples:
    """A sampler (`timing.sample_seconds`'s stand-in) that times nothing: every
    measurement gets `seconds` (or `repeats` samples of 1 ms); it counts the calls."""

    def __init__(self, seconds=None) -> None:
        self.seconds, self.requests = seconds, []

    def __call__(self, fn, clock, *, repeats: int, budget: float) -> Samples:
        self.requests.append(repeats)
        return Samples(self.seconds or (1e-3,) * repeats)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """One quick profile of the CPU, with gpt-tiny's layers and 2 gloo processes."""
    doc = run_profile(quick=True, model="gpt-tiny", processes=2, devices="cpu")
    path = tmp_path_factory.mktemp("profile") / "cpu.json"
    path.write_text(json.dumps(doc))
    return doc, path


def test_quick_cpu_profile_is_valid_and_measured(profiled):
    doc, path = profiled
    assert load_profile(path) == doc
    assert doc["mode"] == "quick" and doc["software"]["torch"] == torch.__version__
    (cpu,) = doc["devices"]
    assert cpu["kind"] == "cpu" and cpu["memory_bytes"] > 2**30 and cpu["threads"] >= 1
    assert set(cpu["matmul"]) == {"fp32", "bf16", "fp16"}
    for result in cpu["matmul"].values():
        assert result["best_flops"] == max(p["flops"] for p in result["sweep"]) > 0
        for p in result["sweep"]:
            assert p["flops"] == pytest.approx(2 * p["m"] * p["n"] * p["k"] / p["seconds"])
    bandwidth = cpu["memory_bandwidth"]
    assert bandwidth["best"] > 1e8
    assert all(p["bandwidth"] == pytest.approx(p["bytes"] / p["seconds"])
               for p in bandwidth["sweep"])
    for p in [*bandwidth["sweep"], *(p for m in cpu["matmul"].values() for p in m["sweep"])]:
        assert 3 <= len(p["samples"]) <= 5 and p["seconds"] == statistics.median(p["samples"])
        assert p["spread"] == Samples(tuple(p["samples"])).spread >= 1


def test_comm_sweeps_follow_nccl_tests_conventions(profiled):
    comm = profiled[0]["communication"]
    assert comm["backend"] == "gloo" and comm["world_size"] == 2 and comm["device"] == "cpu"
    n = comm["world_size"]
    factors = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "p2p": 1.0}
    for name, factor in factors.items():
        collective = comm["collectives"][name]
        sizes = [p["bytes"] for p in collective["sweep"]]
        assert sizes[0] == 1024 and sizes[-1] == 64 * 2**20 and sizes == sorted(sizes)
        for p in collective["sweep"]:
            assert p["algbw"] == pytest.approx(p["bytes"] / p["seconds"])
            assert p["busbw"] == pytest.approx(p["algbw"] * factor)
        assert collective["alpha"] >= 0 and collective["beta_bandwidth"] > 0


def test_every_traced_layer_is_timed_at_each_micro_batch(profiled):
    layers = profiled[0]["devices"][0]["layers"]
    assert layers["model"] == "gpt-tiny" and layers["dtype"] == "fp32"
    traced = trace_model(model_spec("gpt-tiny"), seq_len=layers["seq_len"], dtype="fp32")
    expected = [(layer.name, layer.signature) for layer in traced.layers]
    steps = {s["micro_batch"]: s["seconds"] for s in layers["steps"]}
    assert set(steps) == {1, 2}
    for batch, step in steps.items():
        rows = [t for t in layers["timings"] if t["micro_batch"] == batch]
        assert [(t["layer"], t["signature"]) for t in rows] == expected
        assert all(t["fwd"] > 0 and t["bwd"] > 0 for t in rows) and step > 0


def test_split_pass_cuts_where_each_layer_begins():
    # layers: 0 = embed; 1 = block; 2 = glue (norm, embed again); 3 = ops at the root only
    embed, block, glue = (0, 2), (1,), (2,)
    forward = [(1.0, True, embed), (2.0, False, embed), (3.0, True, block), (5.0, False, block),
               (6.0, True, glue), (7.0, False, glue), (7.5, True, embed), (8.0, False, embed)]
    clock = Clock(torch.device("cpu"))
    # the parts add up to the pass (0 to 10 s), so a step's layers add up to the step
    assert split_pass(forward, 4, 0.0, 10.0, clock, backward=False) == [3.0, 3.0, 2.0, 2.0]
    # backward: layer 3 first (from the start), then 2 (the embed's second call), 1, 0
    backward = [(11.0, True, embed), (11.5, False, embed), (12.0, True, glue),
                (13.0, True, block), (14.0, False, block), (16.0, True, embed)]
    assert split_pass(backward, 4, 10.0, 20.0, clock, backward=True) == [4.0, 3.0, 2.0, 1.0]


def test_alpha_beta_fit():
    points = [(b, 5e-5 + b / 2e9) for b in (1024, 65536, 2**20, 2**24)]
    alpha, bandwidth = fit_alpha_beta(points)
    assert alpha == pytest.approx(5e-5) and bandwidth == pytest.approx(2e9)
    alpha, bandwidth = fit_alpha_beta([(1000, 1e-6), (2000, 3e-6)])  # intercept < 0
    assert alpha == 0 and bandwidth > 0


def test_the_fit_takes_its_bandwidth_from_the_largest_messages():
    """A gloo all-reduce of 2 ranks over loopback capped at 300 Mbit/s (both directions
    through one token bucket: 150 Mb/s of bus bandwidth), as `benchmarks/sync.py`
    measured it: the 16 KiB message passed within the bucket's burst. A least-squares
    line on relative error through every size gave 184 Mb/s, and priced gpt-tiny's sync
    20% short; the two largest give the link's rate, the smallest the latency."""
    sweep = [(1024, 0.670e-3), (16384, 0.743e-3), (262144, 13.248e-3), (4194304, 224.001e-3),
             (67108864, 3585.119e-3)]
    alpha, bandwidth = fit_alpha_beta(sweep)
    assert bandwidth * 8 == pytest.approx(149.7e6, rel=1e-3)
    assert alpha == pytest.approx(0.670e-3 - 1024 / bandwidth)
    slower, again = fit_alpha_beta([(1024, 1.5e-3), *sweep[1:]])  # a scheduler tick
    assert again == bandwidth and slower == pytest.approx(alpha + 0.83e-3)


def _edit(doc, change):
    doc = json.loads(json.dumps(doc))
    change(doc)
    return json.dumps(doc)


@pytest.mark.parametrize("change, words", [
    (lambda d: d.update(schema_version=2), ["'schema_version' is 2", "schema_version 1"]),
    (lambda d: d.update(kind="cluster"), ["'kind'", "'cluster'", "device-profile"]),
    (lambda d: d["devices"][0]["matmul"]["fp32"].update(best_flops=-1.0),
     ["'devices[0].matmul.fp32.best_flops'", "non-negative"]),
    (lambda d: d["communication"]["collectives"]["p2p"]["sweep"][0].update(seconds=-1e-6),
     ["'communication.collectives.p2p.sweep[0].seconds'"]),
    (lambda d: d["devices"][0].pop("memory_bandwidth"),
     ["'devices[0].memory_bandwidth'", "missing"]),
    (lambda d: d["devices"][0]["matmul"]["fp32"]["sweep"][0].update(spread=-1.0),
     ["'devices[0].matmul.fp32.sweep[0].spread'", "non-negative"]),
    (lambda d: d["devices"][0]["layers"]["steps"][0].update(samples="fast"),
     ["'devices[0].layers.steps[0].samples'", "must be a list"]),
    (lambda d: d["communication"]["contention"].update(compute_slowdown=-0.1),
     ["'communication.contention.compute_slowdown'", "non-negative"]),
    (lambda d: d["communication"]["contention"].pop("collective_alone"),
     ["'communication.contention.collective_alone'", "missing"]),
])
def test_load_profile_rejects_bad_documents(profiled, tmp_path, change, words):
    path = tmp_path / "bad.json"
    path.write_text(_edit(profiled[0], change))
    with pytest.raises(PlannerError) as info:
        load_profile(path)
    assert str(path) in info.value.message
    for word in words:
        assert word in info.value.message


def test_load_profile_rejects_non_json(tmp_path):
    path = tmp_path / "notes.json"
    path.write_text("devices: [cpu]\n")
    with pytest.raises(PlannerError, match="not JSON") as info:
        load_profile(path)
    assert str(path) in info.value.message


def test_cli_writes_a_profile_and_refuses_to_overwrite(tmp_path):
    out = tmp_path / "node[bold].json"  # printed as written, not as Rich markup
    result = runner.invoke(app, ["profile", "--quick", "--no-comm", "-o", str(out)])
    assert result.exit_code == 0, result.output
    doc = load_profile(out)
    assert doc["communication"] is None and doc["devices"][0]["layers"] is None
    assert "fp32" in result.stdout and f"Wrote the profile to {out}" in result.stdout
    if not torch.cuda.is_available():
        assert "no CUDA device: profiling the CPU" in result.stderr
    written = out.read_text()
    again = runner.invoke(app, ["profile", "--quick", "--no-comm", "-o", str(out)])
    assert again.exit_code == 1 and "already exists" in again.output
    assert out.read_text() == written
    forced = runner.invoke(app, ["profile", "--quick", "--no-comm", "--devices", "cpu",
                                 "--json", "--force", "-o", str(out)])
    assert forced.exit_code == 0, forced.output
    assert json.loads(forced.stdout) == load_profile(out) != json.loads(written)


def test_layer_times_name_the_model_as_written(capsys):
    """The model's name (a config.json path, a factory's settings) may hold [..] or
    :name:, which Rich would read as markup in the table's title."""
    from cli.profile_cmd import _render_layers

    _render_layers({"kind": "cpu", "layers": {
        "model": "m[/]:smile:", "seq_len": 8, "dtype": "fp32",
        "timings": [{"layer": "x", "fwd": 1e-3, "bwd": 2e-3}],
        "steps": [{"micro_batch": 1, "seconds": 1e-2}]}})
    assert "Layer times on cpu: m[/]:smile:, seq 8" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("args, words", [
    (["--processes", "1"], "--processes must be at least 2"),
    (["--processes", "1000"], "--processes must be at most 16 (got 1000)"),
    (["--dtype", "fp8"], "Unknown dtype 'fp8'"),
])
def test_cli_rejects_bad_options_before_measuring(args, words):
    result = runner.invoke(app, ["profile", "--quick", *args])
    assert result.exit_code == 1 and words in result.output


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc, a folder that takes no files")
def test_an_output_folder_that_takes_no_files_is_named_before_measuring(monkeypatch):
    """`-o /proc/x.json` passed the checks (the folder exists) and failed after the profile."""
    def measure(**_):
        raise AssertionError("measured before the output path was checked")
    monkeypatch.setattr("cost_models.profile.run_profile", measure)
    result = runner.invoke(app, ["profile", "--quick", "--no-comm", "-o", "/proc/x.json"])
    assert result.exit_code == 1, result.output
    assert "'/proc/x.json' cannot be written: folder '/proc' takes no new files" in result.output


def test_a_bad_model_fails_before_any_measurement():
    ticks = []
    with pytest.raises(PlannerError, match="Unknown model 'gpt-tinyy'"):
        run_profile(quick=True, model="gpt-tinyy", devices="cpu", comm=False,
                    progress=lambda *a: ticks.append(a))
    assert not ticks


def test_samples_time_each_call_after_a_warm_up_and_a_pilot():
    # warm-up 9 ms, pilot 5 ms: neither is a sample; a lone slow sample leaves the
    # spread at 1, two of five move the median's neighbours: spread 3
    work = FakeWork([9e-3, 5e-3, 2e-3, 2e-3, 6e-3, 2e-3, 2e-3])
    samples = sample_seconds(work, Clock(CPU, timer=work.timer), repeats=5, budget=1.0)
    assert samples.seconds == pytest.approx((2e-3, 2e-3, 6e-3, 2e-3, 2e-3))
    assert samples.median == pytest.approx(2e-3) and samples.spread == pytest.approx(1.0)
    assert Samples((2e-3, 6e-3, 2e-3, 6e-3, 2e-3)).spread == pytest.approx(3.0)
    assert Samples((4e-3,)).spread == 1.0 and Samples((4e-3,)).median == 4e-3


def test_samples_stop_at_the_budget_but_not_before_three():
    work = FakeWork([2e-3])  # 2 ms a call: five samples fill a 10 ms budget
    samples = sample_seconds(work, Clock(CPU, timer=work.timer), repeats=50, budget=0.01)
    assert len(samples.seconds) == 5
    slow = FakeWork([0.5])  # a call past the budget still gets three samples
    assert len(sample_seconds(slow, Clock(CPU, timer=slow.timer), repeats=10,
                              budget=0.1).seconds) == 3


def test_short_calls_are_timed_in_batches():
    work = FakeWork([1e-4, 2.5e-4, *([2e-4, 3e-4] * 40)])  # pilot 0.25 ms: batches of 4
    samples = sample_seconds(work, Clock(CPU, timer=work.timer), repeats=3, budget=1.0)
    assert samples.seconds == pytest.approx((2.5e-4,) * 3) and work.calls == 2 + 3 * 4


def test_a_profile_keeps_each_points_samples_their_median_and_spread():
    sampler = FixedSamples(DISAGREE)
    doc = run_profile(quick=True, devices="cpu", comm=False, sample=sampler)
    (cpu,) = doc["devices"]
    points = [*cpu["matmul"]["fp32"]["sweep"], *cpu["memory_bandwidth"]["sweep"]]
    for point in points:
        assert point["samples"] == list(DISAGREE) and point["seconds"] == 1e-3
        assert point["spread"] == pytest.approx(3.0)
    assert len(points) == 4 + 2 and len(sampler.requests) == 3 * 4 + 2


def _quiet(doc: dict) -> dict:
    """`doc` as if the machine had been idle at the start (the load is the test's)."""
    return dict(doc, load_average=[0.0, 0.0, 0.0])


def test_disagreeing_samples_are_warned_about_and_agreeing_ones_not():
    agree = _quiet(run_profile(quick=True, devices="cpu", comm=False,
                               sample=FixedSamples(AGREE)))
    assert noise_warnings(agree) == []
    disagree = _quiet(run_profile(quick=True, devices="cpu", comm=False,
                                  sample=FixedSamples(DISAGREE)))
    lines = noise_warnings(disagree)
    assert len(lines) == 4  # fp32, bf16, fp16 matmul and the memory bandwidth
    assert lines[0] == ("cpu fp32 matmul at 1024×1024×1024: the middle half of 5 samples "
                        "spans 3.0x (716 GFLOP/s .. 2.15 TFLOP/s); the machine may be busy. "
                        "The profile keeps their median.")
    assert lines[3].startswith("cpu memory bandwidth, 256 MiB copies: the middle half of 5 "
                               "samples spans 3.0x (179 GB/s .. 537 GB/s)")


def test_layer_steps_that_disagree_and_a_busy_start_are_warned_about(profiled):
    doc = json.loads(json.dumps(profiled[0]))
    cpu = doc["devices"][0]
    for point in [*cpu["memory_bandwidth"]["sweep"],
                  *(p for m in cpu["matmul"].values() for p in m["sweep"])]:
        point.update(samples=[1e-3] * 5, spread=1.0)
    cpu["layers"]["steps"][0].update(samples=[0.05] * 3, spread=1.0)
    cpu["layers"]["steps"][1].update(samples=[0.1, 0.3, 0.1], spread=2.0)
    cpu["cores"] = 2
    assert noise_warnings(dict(doc, load_average=[1.9, 1.0, 1.0])) == [
        "cpu training step of gpt-tiny at micro-batch 2: the middle half of 3 samples spans "
        "2.0x (100 ms .. 200 ms); the machine may be busy. The profile keeps their fastest."]
    busy = noise_warnings(dict(doc, load_average=[2.0, 1.0, 1.0]))
    assert busy[-1] == ("the machine was busy when the profile started (load average 2.0 on "
                        "2 cores): its figures may be low and differ from run to run; profile "
                        "again when it is idle.")


def test_profiles_without_samples_still_load_and_warn_of_nothing(profiled, tmp_path):
    """Files written before points kept their samples (the fields are optional)."""
    doc = json.loads(json.dumps(profiled[0]))
    for device in doc["devices"]:
        for point in [*device["memory_bandwidth"]["sweep"], *device["layers"]["steps"],
                      *(p for m in device["matmul"].values() for p in m["sweep"])]:
            del point["samples"], point["spread"]
    del doc["communication"]["contention"]  # (and before contention was measured)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    assert noise_warnings(_quiet(load_profile(path))) == []


def test_the_comm_profile_measures_how_computing_and_an_all_reduce_slow_each_other(profiled):
    """Each part timed alone and beside the other (`contention`): the slowdowns are
    their ratios less one, never below 0."""
    contention = profiled[0]["communication"]["contention"]
    assert contention["bytes"] == PROBE_BYTES and contention["matmul_side"] == 256
    for part in ("compute", "collective"):
        alone, beside = contention[f"{part}_alone"], contention[f"{part}_overlapped"]
        assert alone > 0 and beside > 0
        assert contention[f"{part}_slowdown"] == pytest.approx(max(0.0, beside / alone - 1))


class Flight:
    """A collective (`dist.Work`'s stand-in) that lands at the `checks`-th look."""

    def __init__(self, checks: int) -> None:
        self.checks = checks

    def is_completed(self) -> bool:
        self.checks -= 1
        return self.checks <= 0

    def wait(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        done = torch.futures.Future()
        done.set_result(None)
        return done


def test_only_compute_calls_a_collective_was_in_flight_for_count_as_overlapped(
        one_process_group):
    """Two collectives, each in flight for three 1 ms compute calls and landing during
    a fourth of 5 ms, which is no sample: either part of it ran alone."""
    work = FakeWork([1e-3, 1e-3, 1e-3, 5e-3] * 2)
    issued: list[Flight] = []

    def start() -> Flight:
        issued.append(Flight(4))
        return issued[-1]

    both = overlapped(work, start, 2, Clock(CPU, timer=work.timer))
    assert len(issued) == 2 and work.calls == 8
    assert both.compute == pytest.approx(1e-3) and both.collective >= 0


def test_quick_mode_measures_less_than_full(profiled):
    """Counted, not timed: stages, timed points and the samples asked of each (the
    samples are made up, so the full sweep's shapes cost their allocation only)."""
    runs = {}
    for quick in (True, False):
        stages, sampler = [], FixedSamples()
        run_profile(quick=quick, devices="cpu", comm=False, sample=sampler,
                    progress=lambda *stage, heard=stages: heard.append(stage))
        assert [stage[1:] for stage in stages] == [(k, len(stages)) for k in range(len(stages))]
        runs[quick] = len(sampler.requests), sum(sampler.requests)
    assert runs[True] == (3 * 4 + 2, (3 * 4 + 2) * 5)  # 4 shapes of 3 dtypes, 2 copies
    assert runs[True][0] < runs[False][0] and runs[True][1] * 3 < runs[False][1]
    # the real quick profile: 3 timed steps at micro-batches 1 and 2, 5 message sizes
    steps = profiled[0]["devices"][0]["layers"]["steps"]
    assert [(s["micro_batch"], len(s["samples"])) for s in steps] == [(1, 3), (2, 3)]
    assert len(profiled[0]["communication"]["collectives"]["all_reduce"]["sweep"]) == 5


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def test_a_collective_that_slows_down_stops_near_its_budget(one_process_group):
    """Warm-up and pilot calls take 0.1 ms, every later one 10 ms (the machine got busy):
    a call count fixed by the pilot (2,000 for a 0.2 s budget) ran 20 s; now the calls
    stop after the round that passes the budget (a quarter of the pilot's count)."""
    work = FakeWork([1e-4] * 8 + [1e-2])
    mean = _mean_seconds(work, Clock(CPU, timer=work.timer), 0.2, CPU)
    assert work.calls == 2 + 3 + 500 and work.now < 5.0
    assert mean == pytest.approx((work.now - 2e-4) / (work.calls - 2))


def test_cli_announces_each_measurement_and_warns_of_disagreement(monkeypatch):
    real = run_profile

    def fake_profile(**options):
        return _quiet(real(**options, sample=FixedSamples(DISAGREE)))
    monkeypatch.setattr("cost_models.profile.run_profile", fake_profile)
    result = runner.invoke(app, ["profile", "--quick", "--no-comm", "--devices", "cpu"])
    assert result.exit_code == 0, result.output
    err = result.stderr.splitlines()
    assert err[:4] == ["[1/4] cpu: fp32 matmul", "[2/4] cpu: bf16 matmul",
                       "[3/4] cpu: fp16 matmul", "[4/4] cpu: memory bandwidth"]
    assert "warning: cpu fp32 matmul at 1024×1024×1024: the middle half of 5 samples " \
           "spans 3.0x" in result.stderr
    monkeypatch.setattr("cost_models.profile.run_profile", lambda **options: _quiet(
        real(**options, sample=FixedSamples(AGREE))))
    calm = runner.invoke(app, ["profile", "--quick", "--no-comm", "--devices", "cpu"])
    assert calm.exit_code == 0 and "[4/4] cpu: memory bandwidth" in calm.stderr
    assert "warning" not in calm.stderr
