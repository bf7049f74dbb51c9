"""The runtime's parts that need no processes: rank layout, environment checks, the
model chain check, deterministic initialization and data slicing."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from planner.errors import PlannerError
from planner.planfile import write_plan
from planner.runtime.data import Batches
from planner.runtime.env import validate_environment
from planner.runtime.layout import rank_layout
from planner.runtime.parallel import topology
from planner.runtime.reference import build_reference, train_reference
from planner.runtime.stage import build_stage, inspect_model
from planner.types import DeviceGroup
from tests.runtime_helpers import on_devices, tiny_plan


def _env(**values):
    base = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    base.update({k: str(v) for k, v in values.items()})
    return base


def test_ranks_follow_nodes_in_cluster_order_then_device_index():
    plan = tiny_plan("1x2xcpu,1x3xcpu", pp=2, dp=2)
    # move pipeline 0's first stage to the second node, device 2: ranks follow devices
    p0 = plan.pipelines[0]
    s0 = dataclasses.replace(p0.stages[0], devices=DeviceGroup(node="cpu-1", devices=(2,)))
    plan = dataclasses.replace(plan, pipelines=(
        dataclasses.replace(p0, stages=(s0, *p0.stages[1:])), *plan.pipelines[1:]))
    layout = rank_layout(plan)
    assert [(n.name, n.node_rank, n.devices, n.first_rank) for n in layout.nodes] == [
        ("cpu-0", 0, (1,), 0), ("cpu-1", 1, (0, 1, 2), 1)]
    assert [(s.node, s.device, s.pipeline, s.stage) for s in layout.slots] == [
        ("cpu-0", 1, 0, 1), ("cpu-1", 0, 1, 0), ("cpu-1", 1, 1, 1), ("cpu-1", 2, 0, 0)]
    assert layout.stage_ranks(0, 0) == (3,)


def test_a_device_used_twice_is_a_plan_error():
    plan = tiny_plan("1x4xcpu", pp=2, dp=2)
    p1 = plan.pipelines[1]
    clash = dataclasses.replace(p1.stages[0], devices=plan.pipelines[0].stages[0].devices)
    plan = dataclasses.replace(plan, pipelines=(
        plan.pipelines[0], dataclasses.replace(p1, stages=(clash, p1.stages[1]))))
    with pytest.raises(PlannerError, match="Device 0 of node cpu-0 is used by pipeline 0"):
        rank_layout(plan)


def _with_stage(plan, pipeline, stage, **change):
    p = plan.pipelines[pipeline]
    stages = list(p.stages)
    stages[stage] = dataclasses.replace(stages[stage], **change)
    pipelines = list(plan.pipelines)
    pipelines[pipeline] = dataclasses.replace(p, stages=tuple(stages))
    return dataclasses.replace(plan, pipelines=tuple(pipelines))


def test_layer_errors_name_the_pipeline_and_stage_at_fault():
    """A pipeline that runs past the model's end is named, not the others (the model
    used to be taken as long as the longest pipeline); a chunk that holds no layers is
    named by its stage."""
    plan = tiny_plan("1x6xcpu", pp=2, dp=3)
    last = plan.pipelines[0].stages[1]
    end = last.chunks[-1][1]
    longer = _with_stage(plan, 0, 1, chunks=((last.chunks[0][0], end + 3),),
                         layers=(last.layers[0], end + 3))
    with pytest.raises(PlannerError, match=f"Pipeline 0 runs layers 0-{end + 2}, where most "
                       f"pipelines run 0-{end - 1}"):
        rank_layout(longer)
    first = plan.pipelines[1].stages[0]
    empty = _with_stage(plan, 1, 0, chunks=((0, 0), *first.chunks))
    with pytest.raises(PlannerError, match=r"Pipeline 1 stage 0 has a chunk \[0, 0\) that "
                       "holds no layers"):
        rank_layout(empty)


def test_a_pipeline_of_mixed_degrees_chains_the_ranks_of_its_narrowest_stage():
    plan = on_devices(tiny_plan("1x4xcpu", pp=2), 0, [(0,), (1, 2, 3)])
    topo = topology(plan, rank_layout(plan), inspect_model(plan))
    assert topo.chains(0) == 1 and topo.chain(0, 0) == (0, 1)
    # the wide stage's first rank leads (in the chain), the others follow it
    assert topo.following((0, 0)) == () and topo.following((0, 1)) == (1, 2, 3)
    plan = on_devices(plan, 0, [(0, 1), (2,)])
    topo = topology(plan, rank_layout(plan), inspect_model(plan))
    assert topo.following((0, 0)) == (0, 1) and topo.following((0, 1)) == ()


def test_an_interleaved_pipeline_of_mixed_degrees_is_refused_by_name():
    plan = on_devices(tiny_plan("1x3xcpu", pp=2, interleave=2), 0, [(0,), (1, 2)])
    with pytest.raises(PlannerError, match=r"Pipeline 0 interleaves .* degrees \[1, 2\]") as e:
        topology(plan, rank_layout(plan), inspect_model(plan))
    assert "plan it again with --interleave 1" in e.value.remedies


def test_environment_matching_the_plan_places_the_rank():
    plan = tiny_plan("1x4xcpu", pp=2, dp=2)
    layout = rank_layout(plan)
    place = validate_environment(plan, layout, _env(RANK=3, LOCAL_RANK=3))
    assert (place.slot.pipeline, place.slot.stage, place.backend) == (1, 1, "gloo")
    assert place.device == torch.device("cpu")


def test_environment_mismatch_lists_expected_and_found():
    plan = tiny_plan("1x4xcpu", pp=2, dp=2)
    layout = rank_layout(plan)
    with pytest.raises(PlannerError) as info:
        validate_environment(plan, layout, _env(WORLD_SIZE=2, LOCAL_WORLD_SIZE=2, RANK=1))
    message = info.value.message
    assert info.value.kind == "bad-environment"
    assert "WORLD_SIZE: expected 4 (one rank per device the plan uses), found 2" in message
    assert "LOCAL_WORLD_SIZE (--nproc-per-node) on node cpu-0: expected 4, found 2" in message
    assert "RANK of local rank 0 on node cpu-0: expected 0, found 1" in message
    with pytest.raises(PlannerError, match="PLANNER_NODE: expected one of cpu-0, found 'gpu'"):
        validate_environment(plan, layout, _env(PLANNER_NODE="gpu"))
    with pytest.raises(PlannerError, match="not started by torchrun"):
        validate_environment(plan, layout, {})
    # (torch raised ValueError on these)
    for port, found in (("abc", "expected an integer, found 'abc'"),
                        ("99999", "expected a TCP port (1-65535), found 99999")):
        with pytest.raises(PlannerError, match=re.escape(f"MASTER_PORT: {found}")):
            validate_environment(plan, layout, _env(MASTER_PORT=port))


@pytest.mark.parametrize("change, needle", [
    # an infinite timeout and a seed past 64 bits were tracebacks on every rank
    ({"timeout": float("inf")}, "--timeout must be positive seconds, at most 604,800"),
    ({"seed": 10**20}, "--seed must be between 0 and 2**63 - 1"),
    ({"run_dir": Path(__file__)}, "is a file, not a folder"),
    ({"run_dir": Path(__file__) / "sub"}, "is a file, not a folder"),
])
def test_run_options_out_of_range_are_named(tmp_path, change, needle):
    from planner.runtime.train import RunOptions, run

    options = dataclasses.replace(RunOptions(plan=tmp_path / "plan.json"), **change)
    with pytest.raises(PlannerError, match=re.escape(needle)):
        run(options, env={})


def test_gpu_plans_check_the_device_count_and_type():
    plan = tiny_plan("1x2xA100-80G", pp=2)
    layout = rank_layout(plan)
    env = _env(WORLD_SIZE=2, LOCAL_WORLD_SIZE=2)
    with pytest.raises(PlannerError, match=r"CUDA devices on node a100-80g-sxm-0: expected 2 "
                       r"visible .*found 0"):
        validate_environment(plan, layout, env, cuda_count=lambda: 0)
    with pytest.raises(PlannerError, match="expected A100-80G-SXM, found 'NVIDIA V100'"):
        validate_environment(plan, layout, env, cuda_count=lambda: 2,
                             cuda_name=lambda i: "NVIDIA V100")
    place = validate_environment(plan, layout, env, cuda_count=lambda: 2,
                                 cuda_name=lambda i: "NVIDIA A100-SXM4-80GB")
    assert (place.device, place.backend) == (torch.device("cuda", 0), "nccl")
    cpu = validate_environment(plan, layout, env, cpu=True)
    assert cpu.backend == "gloo" and "running on the CPU" in cpu.notes[0]


def test_the_runtime_command_reports_a_mismatch_and_exits_1(tmp_path, monkeypatch, capsys):
    from planner.runtime.__main__ import main

    plan = tiny_plan("1x4xcpu", pp=2, dp=2)
    write_plan(plan, tmp_path / "plan.json")
    for key, value in _env(WORLD_SIZE=3).items():
        monkeypatch.setenv(key, value)
    assert main(["--plan", str(tmp_path / "plan.json"), "--run-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: The environment of rank 0 does not match the plan: "
                          "WORLD_SIZE: expected 4")
    assert "Traceback" not in err


def test_ranks_that_never_meet_are_one_clear_error(tmp_path, monkeypatch, capsys):
    """Rank 0 of a 4-rank plan alone: the rendezvous times out with a message naming
    the address and what to check, not a torch traceback; bad options fail at once."""
    from planner.runtime.__main__ import main
    from tests.runtime_helpers import free_port

    plan = tiny_plan("1x4xcpu", pp=2, dp=2)
    write_plan(plan, tmp_path / "plan.json")
    for key, value in _env(MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)
    args = ["--plan", str(tmp_path / "plan.json"), "--run-dir", str(tmp_path), "--cpu"]
    assert main([*args, "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: Rank 0 could not meet the plan's other 3 rank(s) at ")
    assert "--timeout" in err and "Traceback" not in err
    for bad, needle in (("--lr=-1", "--lr must be a positive"),
                        ("--warmup=-1", "--warmup must be 0 or more")):
        assert main([*args, bad]) == 1
        assert needle in capsys.readouterr().err


def test_resuming_a_finished_run_leaves_it_alone(tmp_path, monkeypatch):
    """--resume with no steps left is an error that keeps the run's summary (it used to
    run zero steps and overwrite summary.json with an empty one)."""
    from planner.runtime.train import RunOptions, run
    from tests.runtime_helpers import free_port

    plan = tiny_plan("1x1xcpu", micro_batch=2, batch=4)
    write_plan(plan, tmp_path / "plan.json")
    env = _env(WORLD_SIZE=1, LOCAL_WORLD_SIZE=1, MASTER_PORT=free_port())
    options = RunOptions(plan=tmp_path / "plan.json", run_dir=tmp_path / "run", steps=2,
                         optimizer="sgd", cpu=True, timeout=60.0)
    run(options, env)
    summary = (tmp_path / "run" / "summary.json").read_text()
    with pytest.raises(PlannerError, match=r"Nothing to resume: .* is at step 2"):
        run(dataclasses.replace(options, resume=True), env)
    assert (tmp_path / "run" / "summary.json").read_text() == summary


def test_a_model_whose_layers_do_not_chain_is_refused():
    from cost_models.cluster import load_cluster
    from cost_models.model import AnalyticalCostModel
    from planner.models import load_model, model_spec
    from planner.solver.uniform import uniform_plan
    from planner.trace import trace_loaded
    from planner.types import TrainingSpec

    graph = trace_loaded(load_model(model_spec("tests.runtime_data:residual_model")),
                         dtype="fp32")
    spec = load_cluster("1x2xcpu")
    plan = uniform_plan(layers=graph.layers, model=graph.spec, cluster=spec,
                        training=TrainingSpec(global_batch=4, dtype="fp32"),
                        costs=AnalyticalCostModel(spec), tp=1, pp=2)
    with pytest.raises(PlannerError, match=r"does not take layer \d's output unchanged"):
        inspect_model(plan)


def test_a_stage_module_the_model_lacks_is_named_with_its_stage():
    plan = tiny_plan("1x2xcpu", pp=2)
    p0 = plan.pipelines[0]
    s1 = dataclasses.replace(p0.stages[1], modules=("layers.2", "layers.9", "head"))
    plan = dataclasses.replace(plan, pipelines=(dataclasses.replace(p0, stages=(
        p0.stages[0], s1)),))
    with pytest.raises(PlannerError, match=r"Pipeline 0 stage 1 names module 'layers\.9', "
                       "which model gpt-tiny does not have"):
        inspect_model(plan)


def test_a_stage_gets_the_whole_models_values_and_its_tied_weight():
    plan = tiny_plan("1x2xcpu", pp=2)
    info = inspect_model(plan)
    assert "embed.tokens.weight" in info.uses[-1]  # the head reads the token table
    head_stage = plan.pipelines[0].stages[1]
    built = build_stage(info, head_stage, seed=0)
    assert built.extras == ("embed.tokens",)
    _, whole = build_reference(plan, seed=0)
    full = whole.state_dict()
    mine = built.root.state_dict()
    assert "embed.tokens.weight" in mine and "layers.3.attn.q.weight" in mine
    assert "layers.0.attn.q.weight" not in mine
    for name, value in mine.items():
        assert torch.equal(value, full[name]), name


def test_pipelines_take_consecutive_slices_of_one_global_batch():
    plan = tiny_plan("1x2xcpu", pp=2)
    loaded = inspect_model(plan).loaded
    batches = Batches(loaded, global_batch=8, seed=3)
    whole, targets = batches.get(5, 0, 8)
    part, part_targets = batches.get(5, 2, 6)
    assert torch.equal(part[0], whole[0][2:6]) and torch.equal(part_targets, targets[2:6])
    other, _ = Batches(loaded, global_batch=8, seed=3).get(6, 0, 8)
    assert not torch.equal(other[0], whole[0])


def test_a_data_hook_with_wrong_rows_is_reported(tmp_path):
    plan = tiny_plan("1x2xcpu", pp=2)
    loaded = inspect_model(plan).loaded
    good = Batches(loaded, global_batch=8, seed=0, hook="tests.runtime_data:tokens")
    inputs, targets = good.get(0, 0, 4)
    assert inputs[0].shape == (4, 32) and targets.shape == (4, 32)
    bad = Batches(loaded, global_batch=8, seed=0, hook="tests.runtime_data:residual_model")
    with pytest.raises(PlannerError, match=r"Data hook 'tests\.runtime_data:residual_model'"):
        bad.get(0, 0, 4)
    with pytest.raises(PlannerError, match="data hook"):
        Batches(loaded, global_batch=8, seed=0, hook="tests.nowhere:fn")
    # batches unlike the model's own inputs failed deep in the model, on every rank
    for hook, needle in (("floats", "input 0 as torch.float32 where the model takes "
                                    "torch.int64"),
                         ("lists", "input 0 as list, not a tensor"),
                         ("no_targets", "the targets as NoneType, not a tensor"),
                         ("longer", "input 0 of shape (4, 39) where the model takes (4, 32)")):
        wrong = Batches(loaded, global_batch=8, seed=0, hook=f"tests.runtime_data:{hook}")
        with pytest.raises(PlannerError, match=re.escape(
                f"Data hook 'tests.runtime_data:{hook}' returned {needle}")):
            wrong.get(0, 0, 4)


def test_a_data_hooks_token_ids_outside_the_vocabulary_are_named():
    """Ids past the embedding table (or negative) failed inside it with an IndexError on
    every rank; the model's input is checked against the table it indexes."""
    info = inspect_model(tiny_plan("1x2xcpu", pp=2))
    assert info.vocab == {0: 512}  # gpt-tiny's token table, indexed by input 0
    for hook, needle in (("past_vocab", "token id 600"), ("negative_ids", "token id -3")):
        batches = Batches(info.loaded, global_batch=8, seed=0, vocab=info.vocab,
                          hook=f"tests.runtime_data:{hook}")
        with pytest.raises(PlannerError, match=re.escape(
                f"Data hook 'tests.runtime_data:{hook}' returned input 0 with {needle}, "
                "outside the model's vocabulary of 512 (ids 0-511)")):
            batches.get(0, 0, 4)
    good = Batches(info.loaded, global_batch=8, seed=0, vocab=info.vocab,
                   hook="tests.runtime_data:tokens")
    assert good.get(0, 0, 4)[0][0].max() < 512


def test_a_data_hooks_targets_outside_the_output_classes_are_named():
    """Targets past the classes of the model's output failed inside the loss (cross-entropy)
    on every rank; integer targets are checked against the output's last dimension, and
    -100, the index cross-entropy skips, is accepted."""
    info = inspect_model(tiny_plan("1x2xcpu", pp=2))
    assert info.classes == 512  # gpt-tiny's logits: one per token of its vocabulary
    for hook, needle in (("past_classes", "target 600"), ("negative_targets", "target -1")):
        batches = Batches(info.loaded, global_batch=8, seed=0, vocab=info.vocab,
                          classes=info.classes, hook=f"tests.runtime_data:{hook}")
        with pytest.raises(PlannerError, match=re.escape(
                f"Data hook 'tests.runtime_data:{hook}' returned {needle}, outside the 512 "
                "classes of the model's output (0-511, or -100 for a position the loss "
                "skips)")) as caught:
            batches.get(0, 0, 4)
        assert caught.value.kind == "bad-data"
    skipped = Batches(info.loaded, global_batch=8, seed=0, vocab=info.vocab,
                      classes=info.classes, hook="tests.runtime_data:ignored_targets")
    _, targets = skipped.get(0, 0, 4)
    assert (targets == -100).any()
    assert torch.isfinite(info.loaded.loss(torch.randn(4, 32, 512), targets))


def test_a_data_hooks_narrow_integers_are_widened_to_what_the_model_takes():
    """int32 token ids and int16 targets (numpy tokenizers, compact data files) failed in
    cross-entropy, which takes int64 only, on every rank: the batch comes back in the
    model's own integer dtypes, the same values."""
    info = inspect_model(tiny_plan("1x2xcpu", pp=2))
    batches = Batches(info.loaded, global_batch=8, seed=0, vocab=info.vocab,
                      classes=info.classes, hook="tests.runtime_data:narrow")
    (ids,), targets = batches.get(0, 0, 4)
    (wide,), wide_targets = Batches(info.loaded, global_batch=8, seed=0,
                                    hook="tests.runtime_data:tokens").get(0, 0, 4)
    assert ids.dtype == targets.dtype == torch.int64
    assert torch.equal(ids, wide) and torch.equal(targets, wide_targets)
    assert torch.isfinite(info.loaded.loss(torch.randn(4, 32, 512), targets))


def test_the_single_process_reference_checks_a_data_hook_like_the_runtime():
    """The reference (what a distributed run is compared against) fed a bad hook's ids to
    the embedding and died in an IndexError; it checks them as the runtime does."""
    plan = tiny_plan("1x2xcpu", pp=2)
    for hook, needle in (("past_vocab", "input 0 with token id 600"),
                         ("past_classes", "target 600")):
        with pytest.raises(PlannerError, match=re.escape(
                f"Data hook 'tests.runtime_data:{hook}' returned {needle}, outside")) as caught:
            train_reference(plan, steps=1, data=f"tests.runtime_data:{hook}")
        assert caught.value.kind == "bad-data"


def test_an_existing_run_is_not_restarted_from_scratch(tmp_path):
    from planner.runtime.checkpoint import complete_steps

    (tmp_path / "checkpoints" / "step-00000004").mkdir(parents=True)
    assert complete_steps(tmp_path) == []  # no .metadata: an interrupted save
    (tmp_path / "checkpoints" / "step-00000004" / ".metadata").write_bytes(b"")
    (tmp_path / "checkpoints" / "step-00000002").mkdir()
    (tmp_path / "checkpoints" / "step-00000002" / ".metadata").write_bytes(b"")
    assert complete_steps(Path(tmp_path)) == [2, 4]


def test_tensor_parallelism_splits_the_experts_of_a_mixture_of_experts_block():
    """A mixture-of-experts block is sharded like a dense one, its experts along their
    MLP width (which tp must divide, as the trace's tp_divisor says); the router stays
    whole."""
    from planner.models import load_model, model_spec
    from planner.runtime.parallel import _ShardedExperts, _transformer_block
    from planner.trace import trace_loaded

    def block(ffn: int, flavor: str = "mixtral-8x7b") -> tuple:
        shape = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 4, "ffn": ffn,
                 "vocab": 100}
        loaded = load_model(model_spec(flavor, shape), seq_len=16, device="meta")
        return loaded, next(m for m in loaded.module.modules() if type(m).__name__ == "Block")

    loaded, moe = block(96)
    assert trace_loaded(loaded).layers[1].tp_divisor == 4  # heads 4, experts' width 96
    styles = _transformer_block(moe, 2, "layer 1")
    assert isinstance(styles.pop("mlp.experts"), _ShardedExperts)
    assert sorted(styles) == ["attn", "attn.k", "attn.o", "attn.q", "attn.v"]
    with pytest.raises(PlannerError, match="MLP width 66"):
        _transformer_block(block(66)[1], 4, "layer 1")
    _, dense = block(96, "llama3-8b")
    assert "mlp.down" in _transformer_block(dense, 2, "layer 1")
