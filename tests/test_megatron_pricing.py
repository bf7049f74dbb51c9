"""Megatron-accurate pricing (issue 47): vocabulary-parallel embedding and loss, sequence
parallelism, Megatron's selective recompute, full recompute's collectives, Megatron's
even split, and shape-aware GEMM efficiency; each against hand computation."""

import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from cost_models import catalog
from cost_models.cluster import clashing_device, cluster_to_dict, load_cluster, parse_cluster
from cost_models.comm import Collective, CommGroup, collective_time
from cost_models.compute import gemm_utilization, layer_time
from cost_models.memory import activation_bytes, stage_memory
from cost_models.model import AnalyticalCostModel
from cost_models.tensor_parallel import as_trained, tp_comm_time
from planner.errors import PlannerError
from planner.models import model_spec
from planner.solver.table import build_table
from planner.solver.uniform import even_bounds, megatron_bounds, uniform_plan
from planner.trace import trace_model
from planner.types import LayerKind, NodeSpec, OpClass, Recompute, TrainingSpec
from planner.types.model import params_per_rank

SEQ, HIDDEN, HEADS, VOCAB = 64, 128, 4, 512  # gpt-tiny
FP32 = 4


@pytest.fixture(scope="module")
def tiny():
    return trace_model(model_spec("gpt-tiny"), seq_len=SEQ, dtype="fp32")


def test_selective_recompute_drops_the_attention_cores_output_and_statistics(tiny):
    """Megatron's selective recompute runs the attention core again: a fused core keeps
    Q, K and V (its inputs) and frees its output (s x h) and log-sum-exp (heads x s,
    fp32) per sample."""
    block = tiny.layers[1]
    assert block.kind is LayerKind.BLOCK
    freed = SEQ * HIDDEN * FP32 + HEADS * SEQ * 4
    assert block.activation_bytes - block.selective_bytes == pytest.approx(freed)
    core = [k for k in block.kernels if k.core]
    assert [k.op_class for k in core] == [OpClass.ATTENTION] and core[0].count == 1
    assert not any(k.core for layer in (tiny.layers[0], tiny.layers[-1]) for k in layer.kernels)


def test_the_trace_marks_what_vocabulary_and_sequence_parallelism_can_split(tiny):
    embedding, *blocks, head = tiny.layers
    assert (embedding.vocab_layer, head.vocab_layer) == (True, True)
    assert not any(b.vocab_layer for b in blocks)
    assert all(layer.sequence_layer for layer in tiny.layers)
    assert not any(layer.sequence_parallel for layer in tiny.layers)
    assert (embedding.tp_sharded, head.tp_sharded) == (False, False)  # replicated by default
    # an MLP's blocks have no sequence, and nothing of it is a vocabulary
    mlp = trace_model(model_spec("mlp-small"), dtype="fp32")
    assert not any(layer.vocab_layer or layer.sequence_layer for layer in mlp.layers)
    assert as_trained(mlp.layers, TrainingSpec(global_batch=8, sequence_parallel=True,
                                               vocab_parallel=True)) == mlp.layers


def test_as_trained_splits_the_vocabulary_and_the_sequence(tiny):
    none = as_trained(tiny.layers, TrainingSpec(global_batch=8))
    assert none == tiny.layers
    vocab = as_trained(tiny.layers, TrainingSpec(global_batch=8, vocab_parallel=True))
    embedding, head = vocab[0], vocab[-1]
    assert embedding.tp_sharded and head.tp_sharded
    # one all-reduce of the hidden states per micro-batch: half in each pass
    assert embedding.tp_comm_bytes == pytest.approx(SEQ * HIDDEN * FP32 / 2)
    assert head.tp_comm_bytes == pytest.approx(SEQ * HIDDEN * FP32 / 2)
    assert vocab[1:-1] == tiny.layers[1:-1]
    both = as_trained(tiny.layers, TrainingSpec(global_batch=8, vocab_parallel=True,
                                                sequence_parallel=True))
    for layer in both:
        assert layer.sequence_parallel and layer.replicated_bytes == 0
        assert not any(k.whole for k in layer.kernels)
    # without vocabulary parallelism the replicated embedding and head are not split
    sp = as_trained(tiny.layers, TrainingSpec(global_batch=8, sequence_parallel=True))
    assert not sp[0].sequence_parallel and not sp[-1].sequence_parallel
    assert all(layer.sequence_parallel for layer in sp[1:-1])


def test_sequence_parallelism_divides_every_activation_by_tp(tiny):
    """Korthikanti et al.: 34sbh/t instead of sbh(10 + 24/t); full recompute keeps 1/t
    of each layer's input."""
    block = tiny.layers[1]
    sp = as_trained([block], TrainingSpec(global_batch=8, sequence_parallel=True))[0]
    whole = block.replicated_bytes
    assert 0 < whole < block.activation_bytes
    assert activation_bytes(block, recompute=Recompute.NONE, tp=4) == pytest.approx(
        whole + (block.activation_bytes - whole) / 4)
    assert activation_bytes(sp, recompute=Recompute.NONE, tp=4) == pytest.approx(
        block.activation_bytes / 4)
    assert activation_bytes(sp, recompute=Recompute.SELECTIVE, tp=4) == pytest.approx(
        block.selective_bytes / 4)
    assert activation_bytes(block, recompute=Recompute.FULL, tp=4) == block.input_bytes
    assert activation_bytes(sp, recompute=Recompute.FULL, tp=4) == block.input_bytes / 4


def test_sequence_parallel_traffic_is_a_reduce_scatter_and_an_all_gather(tiny):
    """Ring model: reduce-scatter + all-gather = (n-1)/n S/B + (n-1) alpha each, the
    all-reduce's 2(n-1)/n S/B + 2(n-1) alpha."""
    cluster = load_cluster("1x8xA100-80G-SXM")
    group = CommGroup(((cluster.nodes[0].name, 8),))
    block = tiny.layers[1]
    sp = as_trained([block], TrainingSpec(global_batch=8, sequence_parallel=True))[0]
    calls = []

    def collective(kind, nbytes, grp):
        calls.append((kind, nbytes))
        return collective_time(kind, nbytes, grp, cluster)

    seconds = tp_comm_time(sp, 2, group, collective)
    assert calls == [(Collective.REDUCE_SCATTER, 2 * block.tp_comm_bytes),
                     (Collective.ALL_GATHER, 2 * block.tp_comm_bytes)]
    link = cluster.nodes[0].intra_link
    size = 2 * block.tp_comm_bytes
    assert seconds == pytest.approx(2 * (7 / 8 * size / link.bandwidth + 7 * link.latency))
    calls.clear()
    assert tp_comm_time(block, 2, group, collective) == pytest.approx(seconds)
    assert calls == [(Collective.ALL_REDUCE, size)]


def test_vocabulary_parallelism_splits_the_head_and_its_tied_table(tiny):
    """gpt-tiny ties its head to the embedding: a stage holding the head keeps a copy of
    the token table, whole when the head is replicated, 1/tp of it when split."""
    head = tiny.layers[-1]
    (owner, table), = head.tied
    assert owner == 0 and table == VOCAB * HIDDEN
    split = as_trained(tiny.layers, TrainingSpec(global_batch=8, vocab_parallel=True))[-1]
    assert params_per_rank([head], 4) == pytest.approx(head.params + table)
    assert params_per_rank([split], 4) == pytest.approx((head.params + table) / 4)
    cluster = load_cluster("1x4xA100-80G-SXM")
    training = TrainingSpec(global_batch=8, seq_len=SEQ, dtype="fp32", vocab_parallel=True)
    layers = as_trained(tiny.layers, training)
    costs = AnalyticalCostModel(cluster)
    cost_table = build_table(layers, cluster, training, costs, tps=(4,), micro_batches=(1,))
    n = len(layers)
    assert cost_table.range_params(4)[n - 1, n] == pytest.approx(params_per_rank([split], 4))
    # the head's vocabulary-wide work divides by tp (a device without a unit count: no
    # wave quantization, which keeps gpt-tiny's small GEMMs from speeding up), and one
    # cost model prices the layer whole and split apart
    device = dataclasses.replace(cluster.nodes[0].device, compute_units=None)
    whole = costs.layer_time(head, device, tp=4, micro_batch=64, dtype="fp32")
    shared = costs.layer_time(split, device, tp=4, micro_batch=64, dtype="fp32")
    assert shared.fwd < whole.fwd / 2


def test_zero_keeps_a_split_tied_table_whole_per_rank(tiny):
    """ZeRO leaves a tied token table whose readers sit on other stages unsharded; split
    over the vocabulary, each tp rank keeps its quarter of it whole: the head's own
    parameters shard over dp, the table's share does not."""
    from planner.types.model import zero_kept

    layers = as_trained(tiny.layers, TrainingSpec(global_batch=8, vocab_parallel=True))
    head = layers[-1]
    (_, table), = head.tied
    kept = zero_kept(layers, {head.index}, 1)
    assert kept == table
    device = catalog.device("A100-80G-SXM")
    memory = stage_memory([head], device=device, training=TrainingSpec(global_batch=8),
                          tp=4, dp=2, zero=1, kept=kept)
    assert memory.optimizer == pytest.approx(head.params / 4 * 12 / 2 + table / 4 * 12)
    assert memory.weights == pytest.approx((head.params + table) / 4 * 2)


def test_full_recompute_runs_the_tensor_parallel_collectives_again(tiny):
    cluster = load_cluster("1x4xA100-80G-SXM")
    training = TrainingSpec(global_batch=8, seq_len=SEQ, dtype="fp32")
    table = build_table(tiny.layers, cluster, training, AnalyticalCostModel(cluster),
                        tps=(4,), micro_batches=(2,))
    costs = table.costs("A100-80G-SXM", 4, 2)
    compute_only = AnalyticalCostModel(cluster)
    device = cluster.nodes[0].device
    for i, layer in enumerate(tiny.layers):
        again = compute_only.recompute_time(layer, device, tp=4, micro_batch=2, dtype="fp32",
                                            policy=Recompute.FULL)
        assert costs.recompute[Recompute.FULL][i] == pytest.approx(again + costs.tp_fwd[i])
        assert costs.recompute[Recompute.SELECTIVE][i] == pytest.approx(
            compute_only.recompute_time(layer, device, tp=4, micro_batch=2, dtype="fp32",
                                        policy=Recompute.SELECTIVE))
    assert costs.tp_fwd[1] > 0
    plan = uniform_plan(layers=tiny.layers, model=tiny.spec, cluster=cluster,
                        training=training, costs=AnalyticalCostModel(cluster), tp=4, pp=1,
                        micro_batch=2, recompute=Recompute.FULL)
    none = uniform_plan(layers=tiny.layers, model=tiny.spec, cluster=cluster,
                        training=training, costs=AnalyticalCostModel(cluster), tp=4, pp=1,
                        micro_batch=2, recompute=Recompute.NONE)
    extra = plan.prediction.step_time - none.prediction.step_time
    expected = 4 * sum(costs.recompute[Recompute.FULL])  # 4 micro-batches of 2
    assert extra == pytest.approx(expected, rel=1e-6)


def test_megatron_splits_blocks_evenly_with_the_embedding_first_and_the_head_last(tiny):
    """24 blocks over 4 stages: 6 each, the embedding with the first and the head with
    the last; counting them as layers (26 over 4) gave two stages 7 layers and the
    third 6 blocks beside the first's 5."""
    layers = [dataclasses.replace(tiny.layers[1], index=i) for i in range(24)]
    model = [tiny.layers[0], *layers, tiny.layers[-1]]
    assert megatron_bounds(model, 4) == [(0, 7), (7, 13), (13, 19), (19, 26)]
    assert even_bounds(26, 4) == [(0, 6), (6, 13), (13, 20), (20, 26)]
    # fewer blocks than parts: every layer counts
    assert megatron_bounds(tiny.layers, 5) == even_bounds(len(tiny.layers), 5)
    # estimate: 8 blocks over 4 stages, 2 each (the layers split evenly gave 1, 3, 3, 1)
    eight = trace_model(model_spec("gpt-tiny", {"layers": 8}), seq_len=SEQ, dtype="fp32")
    cluster = load_cluster("1x4xA100-80G-SXM")
    training = TrainingSpec(global_batch=8, seq_len=SEQ, dtype="fp32")
    plan = uniform_plan(layers=eight.layers, model=eight.spec, cluster=cluster,
                        training=training, costs=AnalyticalCostModel(cluster), tp=1, pp=4,
                        micro_batch=1)
    assert [s.layers for s in plan.pipelines[0].stages] == [(0, 3), (3, 5), (5, 7), (7, 10)]


def test_gemm_efficiency_counts_tile_and_wave_quantization():
    """2048 x 3200 outputs on an A100's 108 SMs: 256 x 128 tiles make 8 x 25 = 200, two
    waves of 108 (216 issued); 128 x 128 make 400 in four (432): both use 200/216 of the
    units. A 1024 x 768 output: 128 x 128 tiles make 48, one wave of 108."""
    a100 = catalog.device("A100-80G-SXM")
    assert (a100.compute_units, a100.gemm_efficiency) == (108, 0.859)
    util = gemm_utilization(2048, 25600, 3200, units=108)
    assert util == pytest.approx(200 / 216 * 25600 / 25632)
    assert gemm_utilization(1024, 4096, 768, units=108) == pytest.approx(
        48 / 108 * 4096 / 4128)
    # without a unit count, 128 x 128 tile padding alone (as before)
    assert gemm_utilization(1000, 4096, 768, units=None) == pytest.approx(
        1000 / 1024 * 4096 / 4128)
    layer = _gemm_layer(2048, 25600, 3200)
    t = layer_time(layer, a100, tp=1, micro_batch=1, dtype="bf16")
    flops = 2 * 2048 * 25600 * 3200
    assert t.fwd == pytest.approx(flops / (312e12 * 0.859 * util) + 5e-6)


def _gemm_layer(m: int, k: int, n: int):
    from planner.types import Kernel, Layer

    kernel = Kernel(op_class=OpClass.MATMUL, count=1, flops=2 * m * k * n,
                    bwd_flops=4 * m * k * n, bytes=2 * m * (k + n), bytes_fixed=2 * k * n,
                    gemm=(m, k, n))
    return Layer(index=0, name="g", kind=LayerKind.BLOCK, modules=("g",), params=k * n,
                 param_bytes=2 * k * n, buffer_bytes=0, fwd_flops=kernel.flops,
                 bwd_flops=kernel.bwd_flops, activation_bytes=0.0, saved_by_class={},
                 selective_bytes=0.0, input_bytes=0.0, output_bytes=0.0, tp_comm_bytes=0.0,
                 tp_divisor=0, kernels=(kernel,), signature="g")


def test_a_custom_device_takes_its_bases_gemm_figures_or_its_own(tmp_path):
    text = """\
schema_version: 1
name: t
network: 100Gbps
nodes:
  - name: a
    device: {base: A100-80G-SXM, name: Mine}
    devices: 2
  - name: b
    device: {name: Other, memory: 24GiB, memory_bandwidth: 900GB/s,
             peak_flops: {fp32: 25TFLOPS}, compute_units: 64, gemm_efficiency: 0.7}
    devices: 2
"""
    import yaml

    cluster = parse_cluster(yaml.safe_load(text), "t.yaml")
    mine, other = cluster.nodes[0].device, cluster.nodes[1].device
    assert (mine.compute_units, mine.gemm_efficiency) == (108, 0.859)
    assert (other.compute_units, other.gemm_efficiency) == (64, 0.7)
    again = parse_cluster(cluster_to_dict(cluster), "again")
    assert again.nodes[1].device == other
    bad = yaml.safe_load(text.replace("gemm_efficiency: 0.7", "gemm_efficiency: 7"))
    with pytest.raises(PlannerError, match="gemm_efficiency"):
        parse_cluster(bad, "t.yaml")


def test_a_plan_file_from_before_the_gemm_figures_is_not_a_clashing_device():
    """A cluster read from an older plan file carries a catalog device without GEMM
    figures; nodes of the catalog's own (what-if --add) are the same type."""
    v100 = catalog.device("V100-32G")
    older = dataclasses.replace(v100, compute_units=None, gemm_efficiency=None,
                                sources={"peak_flops": "x"})
    nodes = [NodeSpec(name=n, device=d, devices=4, intra_link=v100.intra_link)
             for n, d in (("old", older), ("new", v100))]
    assert clashing_device(nodes) is None
    faster = dataclasses.replace(v100, memory_bandwidth=2 * v100.memory_bandwidth)
    nodes.append(NodeSpec(name="odd", device=faster, devices=4, intra_link=v100.intra_link))
    assert "different figures" in clashing_device(nodes)


def test_the_runtime_recomputes_only_the_attention_core():
    """Selective recompute on a zoo block: the same gradients, and what backward keeps
    drops by exactly the attention core's output (2 x 16 x 32 fp32) and log-sum-exp
    (2 x 4 heads x 16 fp32), what the trace prices (the first test)."""
    from planner.models.configs import TransformerConfig
    from planner.models.transformer import Block
    from planner.runtime.stage import apply_recompute

    cfg = TransformerConfig(vocab_size=16, hidden=32, layers=1, heads=4, seq_len=16)
    torch.manual_seed(0)
    plain = Block(cfg)
    selective = Block(cfg)
    selective.load_state_dict(plain.state_dict())
    apply_recompute(selective, Recompute.SELECTIVE)
    x = torch.randn(2, 16, 32)

    def run(block):
        saved = []

        def pack(t):
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = block(x.clone().requires_grad_())
        out.square().sum().backward()
        return sum(saved), [p.grad.clone() for p in block.parameters()]

    kept, grads = run(plain)
    kept_selective, grads_selective = run(selective)
    for a, b in zip(grads, grads_selective, strict=True):
        torch.testing.assert_close(a, b)
    assert kept - kept_selective == 2 * 16 * 32 * 4 + 2 * 4 * 16 * 4


def test_the_runtime_runs_sequence_and_vocabulary_parallel_plans_of_one_degree():
    from planner.runtime.stage import check_options
    from tests.runtime_helpers import on_devices, tiny_plan

    plan = tiny_plan("1x4xcpu", tp=2, pp=2)
    mixed = on_devices(tiny_plan("1x4xcpu", pp=2), 0, [(0,), (1, 2)])
    for key, flag in (("sequence_parallel", "--sequence-parallel"),
                      ("vocab_parallel", "--vocab-parallel")):
        check_options(dataclasses.replace(plan, training=dataclasses.replace(
            plan.training, **{key: True})))  # (tests/test_runtime_megatron.py runs them)
        with pytest.raises(PlannerError) as err:
            check_options(dataclasses.replace(mixed, training=dataclasses.replace(
                mixed.training, **{key: True})))
        assert f"training.{key}" in err.value.message and flag in err.value.remedies[1]


def test_estimate_prices_sequence_and_vocabulary_parallelism(tmp_path):
    runner = CliRunner()
    args = ["estimate", "gpt-tiny", "--cluster", "1x4xA100-80G-SXM", "--tp", "4", "-B", "8",
            "--dtype", "bf16", "--json"]
    plain = json.loads(runner.invoke(app, args).stdout)
    result = runner.invoke(app, [*args, "--sequence-parallel", "--vocab-parallel"])
    assert result.exit_code == 0, result.output
    both = json.loads(result.stdout)
    assert both["training"]["sequence_parallel"] and both["training"]["vocab_parallel"]
    assert not plain["training"]["sequence_parallel"]
    memory = [p["pipelines"][0]["stages"][0]["memory"] for p in (plain, both)]
    graph = trace_model(model_spec("gpt-tiny"), dtype="bf16")
    for stage, options in zip(memory, ({}, {"sequence_parallel": True,
                                            "vocab_parallel": True}), strict=True):
        layers = as_trained(graph.layers, TrainingSpec(global_batch=8, **options))
        assert stage["activations"] == pytest.approx(sum(
            activation_bytes(layer, recompute=Recompute.NONE, tp=4) for layer in layers))
        assert stage["weights"] == pytest.approx(2 * params_per_rank(layers, 4))
    assert memory[1]["weights"] < memory[0]["weights"]  # the token table split too


def test_one_cost_model_prices_a_layer_and_its_sequence_parallel_form_apart(tiny):
    cluster = load_cluster("1x4xA100-80G-SXM")
    costs = AnalyticalCostModel(cluster)
    device = cluster.nodes[0].device
    block = tiny.layers[1]
    sp = as_trained([block], TrainingSpec(global_batch=8, sequence_parallel=True))[0]
    whole = costs.layer_time(block, device, tp=4, micro_batch=4, dtype="fp32")
    split = costs.layer_time(sp, device, tp=4, micro_batch=4, dtype="fp32")
    assert split.fwd < whole.fwd
    assert split == layer_time(sp, device, tp=4, micro_batch=4, dtype="fp32")
    training = TrainingSpec(global_batch=8, seq_len=SEQ, dtype="fp32")
    kw = dict(tp=4, dp=1, zero=0, recompute=Recompute.NONE, micro_batch=4, in_flight=1)
    assert (costs.memory([sp], device, training, **kw).activations
            < costs.memory([block], device, training, **kw).activations)
    assert stage_memory([sp], device=device, training=training, tp=4, micro_batch=4) == (
        costs.memory([sp], device, training, **kw))


def test_megatrons_blocking_exchanges_cost_their_stated_formula():
    """benchmarks/fidelity.py's `megatron_exchanges`: m x 2v x (B / N + all-gather of B)
    per step, B a micro-batch's fp16 hidden states sent 1/t per GPU over the node's
    N = 8 x 200 Gb/s (scatter/gather) and all-gathered over NVLink 3 (a ring of t);
    under sequence parallelism each GPU's slice goes as it is; no pipeline, no
    exchanges."""
    from benchmarks import fidelity

    row = fidelity.Published(
        name="test", hidden=4096, layers=8, heads=32, gpus=64, tp=8, pp=4, batch=32,
        micro_batch=2, recompute=Recompute.FULL, sequence_parallel=False, interleave=2,
        seconds=1.0, stack="Megatron-LM", source="test")
    assert (row.dp, row.microbatches) == (2, 8)
    hidden = fidelity.SEQ * 2 * 4096 * 2
    nic = 5e-6 + hidden / 200e9  # 1600 Gb/s a node, its link's 5 us
    # NVLink 3 at NCCL's bus bandwidth measured for 32 MiB (the catalog's bus_rates), slower
    # than its alpha-beta line there (230 GB/s a GPU, 10.8 us a step)
    gather = 7 / 8 * hidden / 138.49e9
    assert gather > 7 / 8 * hidden / 230e9 + 7 * 10.8e-6
    assert fidelity.megatron_exchanges(row) == pytest.approx(8 * 2 * 2 * (nic + gather))
    sliced = dataclasses.replace(row, sequence_parallel=True)
    assert fidelity.megatron_exchanges(sliced) == pytest.approx(8 * 2 * 2 * nic)
    assert fidelity.megatron_exchanges(dataclasses.replace(row, pp=1, gpus=16)) == 0.0


def test_fidelity_rows_sync_gradients_as_megatron_ran_them():
    """run_table_1.sh's DDP column: PyTorch's DDP (the four smallest rows) all-reduces
    buckets as the last micro-batch's backward makes them, so an 18B step's sync hides
    behind its 1.7 s backward; Megatron's own DDP (the others) all-reduces after the
    schedule, all of it in the step."""
    from benchmarks import fidelity

    assert [r.name for r in fidelity.ROWS if r.overlap_sync] == [
        "1.7B (2021)", "3.6B (2021)", "7.5B (2021)", "18B (2021)"]
    row = next(r for r in fidelity.ROWS if r.name == "18B (2021)")
    efficiency = fidelity.attention(0.12)
    ran = fidelity.price(row, efficiency)
    after = fidelity.price(dataclasses.replace(row, overlap_sync=False), efficiency)
    # what the overlapped step still pays is its last bucket's all-reduce (`step.exposed`)
    assert 0.0 < ran.dp_comm < after.dp_comm / 100
    assert ran.seconds == pytest.approx(after.seconds - after.dp_comm + ran.dp_comm)
