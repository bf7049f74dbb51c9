"""Cost formulas against hand-computed cases."""

import math

import pytest

from cost_models.comm import Collective, CommGroup, bus_factor, collective_time, p2p_time
from cost_models.compute import (
    DEFAULT_EFFICIENCY,
    gemm_utilization,
    layer_time,
    optimizer_time,
    rate_dtype,
    recompute_repeats_tp,
    recompute_time,
)
from cost_models.memory import GIB, activation_bytes, stage_memory
from planner.models import model_spec
from planner.trace import trace_model
from planner.types import (
    ClusterSpec,
    DeviceSpec,
    GroupSpec,
    Kernel,
    Layer,
    LayerKind,
    LayerTiming,
    LinkSpec,
    MeasuredDevice,
    NodeSpec,
    OpClass,
    OptimizerSpec,
    TrainingSpec,
)
from planner.types.training import Recompute

NVLINK = LinkSpec(name="nvlink", bandwidth=300e9, latency=2e-6)
NET = LinkSpec(name="ib", bandwidth=25e9, latency=5e-6)
GPU = DeviceSpec(name="G", vendor="x", memory=80 * GIB, memory_bandwidth=2e12,
                 peak_flops={"bf16": 312e12, "fp32": 19.5e12}, intra_link=NVLINK)


def cluster(*nodes: NodeSpec, network: LinkSpec = NET, groups=()) -> ClusterSpec:
    return ClusterSpec(name="t", nodes=nodes, network=network, groups=groups)


def node(name: str, devices: int = 8, **kw) -> NodeSpec:
    return NodeSpec(name=name, device=GPU, devices=devices, intra_link=NVLINK, **kw)


S = 2.0**30


def test_ring_all_reduce_in_one_node():
    c = cluster(node("a"))
    t = collective_time(Collective.ALL_REDUCE, S, CommGroup((("a", 8),)), c)
    assert t == pytest.approx(2 * 7 / 8 * S / 300e9 + 2 * 7 * 2e-6)


def test_hierarchical_all_reduce_across_nodes():
    c = cluster(node("a"), node("b"))
    t = collective_time(Collective.ALL_REDUCE, S, CommGroup((("a", 8), ("b", 8))), c)
    hierarchical = (2 * 7 / 8 * S / 300e9 + 14 * 2e-6) + (2 * 1 / 2 * S / 25e9 + 2 * 5e-6)
    flat = 2 * 15 / 16 * S / 25e9 + 30 * 5e-6
    assert t == pytest.approx(min(hierarchical, flat))
    assert t == pytest.approx(hierarchical)


def test_one_rank_per_node_is_a_plain_ring():
    c = cluster(node("a"), node("b"), node("c"), node("d"))
    group = CommGroup.of(["a", "b", "c", "d"])
    t = collective_time(Collective.ALL_GATHER, S, group, c)
    assert t == pytest.approx(3 / 4 * S / 25e9 + 3 * 5e-6)


def test_slowest_link_bounds_a_mixed_group():
    slow = LinkSpec(name="10GbE", bandwidth=1.25e9, latency=20e-6)
    c = cluster(node("a", 1), node("b", 1, nic=slow))
    t = collective_time(Collective.ALL_REDUCE, S, CommGroup.of(["a", "b"]), c)
    assert t == pytest.approx(S / 1.25e9 + 2 * 20e-6)


def test_group_links_and_nics():
    rack = GroupSpec(name="rack", link=LinkSpec(name="rack", bandwidth=50e9, latency=1e-6))
    c = cluster(node("a", groups=("rack",)), node("b", groups=("rack",)), node("c"),
                groups=(rack,))
    assert c.link_between("a", "b").bandwidth == 50e9
    assert c.link_between("a", "c").bandwidth == 25e9
    assert c.link_between("a", "a") is NVLINK


def test_bus_bandwidth_factors_follow_nccl_tests():
    assert bus_factor(Collective.ALL_REDUCE, 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor(Collective.ALL_GATHER, 8) == pytest.approx(7 / 8)
    assert bus_factor(Collective.REDUCE_SCATTER, 4) == pytest.approx(3 / 4)
    assert bus_factor(Collective.BROADCAST, 8) == 1.0


def test_point_to_point():
    assert p2p_time(1e9, NET) == pytest.approx(5e-6 + 1e9 / 25e9)
    assert p2p_time(0, NET) == 0.0


def dense_layer(m_per_sample=4096, k=8192, n=8192, elementwise_bytes=0.0,
                core_bytes=0.0) -> Layer:
    """One GEMM, and optionally a memory-bound elementwise kernel and an attention core's
    memory-bound kernel (`Kernel.core`)."""
    kernels = [Kernel(op_class=OpClass.MATMUL, count=1, flops=2 * m_per_sample * k * n,
                      bwd_flops=4 * m_per_sample * k * n, bytes=2 * m_per_sample * (k + n),
                      bytes_fixed=2 * k * n, gemm=(m_per_sample, k, n))]
    if elementwise_bytes:
        kernels.append(Kernel(op_class=OpClass.ELEMENTWISE, count=1, flops=0, bwd_flops=0,
                              bytes=elementwise_bytes, bytes_fixed=0))
    if core_bytes:
        kernels.append(Kernel(op_class=OpClass.REDUCTION, count=1, flops=0, bwd_flops=0,
                              bytes=core_bytes, bytes_fixed=0, core=True))
    return Layer(index=0, name="l", kind=LayerKind.BLOCK, modules=("l",), params=k * n,
                 param_bytes=2 * k * n, buffer_bytes=0, fwd_flops=2 * m_per_sample * k * n,
                 bwd_flops=4 * m_per_sample * k * n, activation_bytes=100.0,
                 saved_by_class={"matmul": 60.0, "norm": 40.0}, selective_bytes=70.0,
                 replicated_bytes=40.0, input_bytes=10.0, output_bytes=10.0,
                 tp_comm_bytes=0.0, tp_divisor=8, kernels=tuple(kernels), signature="sig")


def test_roofline_of_a_large_gemm():
    layer = dense_layer()
    t = layer_time(layer, GPU, tp=1, micro_batch=2, dtype="bf16")
    util = gemm_utilization(8192, 8192, 8192, units=None)
    assert util == pytest.approx(8192 / (8192 + 32))
    expected = 2 * 2 * 4096 * 8192 * 8192 / (312e12 * 0.75 * util) + DEFAULT_EFFICIENCY.launch
    assert t.fwd == pytest.approx(expected)
    assert t.bwd == pytest.approx(2 * (expected - 5e-6) + 5e-6)
    assert t.source == "roofline"


def test_tensor_parallelism_shards_matmuls():
    layer = dense_layer()
    one = layer_time(layer, GPU, tp=1, micro_batch=1, dtype="bf16")
    two = layer_time(layer, GPU, tp=2, micro_batch=1, dtype="bf16")
    assert two.fwd == pytest.approx((one.fwd - 5e-6) / 2 + 5e-6, rel=1e-3)


def test_memory_bound_kernels_use_bandwidth():
    layer = dense_layer(m_per_sample=1, k=128, n=128, elementwise_bytes=1e9)
    t = layer_time(layer, GPU, tp=1, micro_batch=1, dtype="bf16")
    elementwise = 1e9 / (2e12 * 0.8) + 5e-6
    assert t.fwd > elementwise
    assert t.fwd == pytest.approx(elementwise, rel=0.01)


def test_dtype_without_fast_path_runs_at_fp32():
    assert GPU.flops("fp16") == 19.5e12
    layer = dense_layer()
    fp32 = layer_time(layer, GPU, tp=1, micro_batch=1, dtype="fp32").fwd
    assert fp32 == pytest.approx(layer_time(layer, GPU, tp=1, micro_batch=1, dtype="fp16").fwd)


def test_measured_rates_replace_the_catalog():
    measured = DeviceSpec(name="G@n", vendor="x", memory=GPU.memory,
                          memory_bandwidth=GPU.memory_bandwidth, peak_flops=GPU.peak_flops,
                          intra_link=NVLINK,
                          measured=MeasuredDevice(matmul_flops={"bf16": 100e12},
                                                  memory_bandwidth=1e12))
    layer = dense_layer()
    t = layer_time(layer, measured, tp=1, micro_batch=1, dtype="bf16")
    util = gemm_utilization(4096, 8192, 8192, units=None)
    assert t.fwd == pytest.approx(2 * 4096 * 8192**2 / (100e12 * util) + 5e-6)


def test_a_measured_dtype_is_priced_at_its_measured_rate():
    """What the CLI's "priced at fp32 speed" note is decided by (rate_dtype): a dtype the
    catalog lacks but the profile measured (fp16 on a CPU) runs at its measured rate."""
    cpu = DeviceSpec(name="cpu@n", vendor="x", memory=GPU.memory, memory_bandwidth=1e11,
                     peak_flops={"fp32": 1e12}, intra_link=NVLINK,
                     measured=MeasuredDevice(matmul_flops={"fp32": 50e9, "fp16": 3e9}))
    assert [rate_dtype(cpu, d) for d in ("fp16", "bf16")] == ["fp16", "fp32"]
    assert [rate_dtype(GPU, d) for d in ("bf16", "fp16")] == ["bf16", "fp32"]
    layer = dense_layer()
    fp16 = layer_time(layer, cpu, tp=1, micro_batch=1, dtype="fp16").fwd
    fp32 = layer_time(layer, cpu, tp=1, micro_batch=1, dtype="fp32").fwd
    assert fp16 / fp32 == pytest.approx(50 / 3, rel=0.01)  # not fp32 speed
    assert layer_time(layer, cpu, tp=1, micro_batch=1, dtype="bf16").fwd == fp32


def test_measured_layer_times_are_fitted_linearly():
    timings = (LayerTiming(model="m", layer="sig", seq_len=None, dtype="bf16", micro_batch=1,
                           fwd=0.010, bwd=0.020),
               LayerTiming(model="m", layer="sig", seq_len=None, dtype="bf16", micro_batch=3,
                           fwd=0.026, bwd=0.052))
    device = DeviceSpec(name="G@n", vendor="x", memory=GPU.memory,
                        memory_bandwidth=GPU.memory_bandwidth, peak_flops=GPU.peak_flops,
                        intra_link=NVLINK, measured=MeasuredDevice(layer_times=timings))
    t = layer_time(dense_layer(), device, tp=1, micro_batch=2, dtype="bf16")
    assert (t.fwd, t.bwd, t.source) == (pytest.approx(0.018), pytest.approx(0.036), "measured")
    other_dtype = layer_time(dense_layer(), device, tp=1, micro_batch=2, dtype="fp32")
    assert other_dtype.source == "roofline"


def test_layer_times_measured_at_a_tensor_parallel_degree_are_used_as_measured():
    """A timing measured at tp 2 prices tp 2 as it is; tp 4, unmeasured, scales the tp 1
    timing by the roofline's ratio (as before)."""
    timings = (LayerTiming(model="m", layer="sig", seq_len=None, dtype="bf16", micro_batch=1,
                           fwd=0.010, bwd=0.020),
               LayerTiming(model="m", layer="sig", seq_len=None, dtype="bf16", micro_batch=1,
                           tp=2, fwd=0.007, bwd=0.013))
    device = DeviceSpec(name="G@n", vendor="x", memory=GPU.memory,
                        memory_bandwidth=GPU.memory_bandwidth, peak_flops=GPU.peak_flops,
                        intra_link=NVLINK, measured=MeasuredDevice(layer_times=timings))
    two = layer_time(dense_layer(), device, tp=2, micro_batch=2, dtype="bf16")
    assert (two.fwd, two.bwd, two.source) == (pytest.approx(0.014), pytest.approx(0.026),
                                              "measured")
    four = layer_time(dense_layer(), device, tp=4, micro_batch=1, dtype="bf16")
    one = layer_time(dense_layer(), GPU, tp=1, micro_batch=1, dtype="bf16")
    ratio = layer_time(dense_layer(), GPU, tp=4, micro_batch=1, dtype="bf16").fwd / one.fwd
    assert four.fwd == pytest.approx(0.010 * ratio)


def test_recompute_costs():
    """Selective recompute runs the attention core's forward again (its 2 GB at 80% of
    2 TB/s), not the elementwise kernel's; full runs the whole forward."""
    layer = dense_layer(elementwise_bytes=1e9, core_bytes=2e9)
    fwd = layer_time(layer, GPU, tp=1, micro_batch=1, dtype="bf16").fwd
    assert recompute_time(layer, GPU, tp=1, micro_batch=1, dtype="bf16",
                          policy=Recompute.FULL) == pytest.approx(fwd)
    assert recompute_time(layer, GPU, tp=1, micro_batch=1, dtype="bf16",
                          policy=Recompute.SELECTIVE) == pytest.approx(2e9 / 1.6e12 + 5e-6)
    assert recompute_time(layer, GPU, tp=1, micro_batch=1, dtype="bf16",
                          policy=Recompute.NONE) == 0
    assert (recompute_repeats_tp(Recompute.FULL), recompute_repeats_tp(Recompute.SELECTIVE),
            recompute_repeats_tp(Recompute.NONE)) == (True, False, False)


def test_activation_terms_by_policy():
    """The residual stream (40 of 100 bytes) stays whole on every tp rank; selective
    recompute drops 30 bytes of the attention core, split over tp like the rest."""
    layer = dense_layer()
    assert activation_bytes(layer, recompute=Recompute.NONE, tp=1) == 100
    assert activation_bytes(layer, recompute=Recompute.NONE, tp=2) == 40 + 30  # stream whole
    assert activation_bytes(layer, recompute=Recompute.SELECTIVE, tp=1) == 70
    assert activation_bytes(layer, recompute=Recompute.SELECTIVE, tp=2) == 40 + 15
    assert activation_bytes(layer, recompute=Recompute.FULL, tp=1) == 10
    assert activation_bytes(layer, recompute=Recompute.FULL, tp=2) == 10  # input whole


@pytest.fixture(scope="module")
def llama7b():
    return trace_model(model_spec("llama2-7b"), seq_len=4096)


def test_sixteen_bytes_per_parameter_rule(llama7b):
    training = TrainingSpec(global_batch=8, seq_len=4096)
    params = llama7b.params
    plain = stage_memory(llama7b.layers, device=GPU, training=training)
    assert (plain.weights + plain.gradients + plain.optimizer) / params == pytest.approx(16)
    zero1 = stage_memory(llama7b.layers, device=GPU, training=training, dp=8, zero=1)
    assert (zero1.weights + zero1.gradients + zero1.optimizer) / params == pytest.approx(
        2 + 2 + 12 / 8)
    zero3 = stage_memory(llama7b.layers, device=GPU, training=training, dp=8, zero=3)
    assert (zero3.weights + zero3.gradients + zero3.optimizer) / params == pytest.approx(2)
    tp2 = stage_memory(llama7b.layers, device=GPU, training=training, tp=2)
    # the runtime shards the blocks and replicates the embedding and head
    sharded = sum(layer.params for layer in llama7b.layers if layer.tp_sharded)
    assert 0 < sharded < params
    assert tp2.weights == pytest.approx(plain.weights - sharded * 2 / 2)
    fp32 = stage_memory(llama7b.layers, device=GPU,
                        training=TrainingSpec(global_batch=8, seq_len=4096, dtype="fp32"))
    assert (fp32.weights + fp32.gradients + fp32.optimizer) / params == pytest.approx(16)
    assert fp32.optimizer / params == 8


def test_a_head_tied_to_the_embedding_holds_a_copy_on_its_own_stage():
    """GPT-2 reads its embedding matrix in the head: a stage with the head but not the
    embedding keeps a copy (weights, gradients and optimizer states), the whole model
    counts it once, and the solver's range matrix agrees."""
    from cost_models.cluster import load_cluster
    from cost_models.model import AnalyticalCostModel
    from planner.solver.table import build_table

    graph = trace_model(model_spec("gpt2-small", {"layers": 2}), seq_len=128)
    head, embedding = graph.layers[-1], graph.layers[0]
    tied = 50257 * 768  # the token embedding (the embedding layer also owns positions)
    assert head.tied == ((0, tied),) and embedding.params > tied
    training = TrainingSpec(global_batch=8, seq_len=128)
    alone = stage_memory([head], device=GPU, training=training)
    whole = stage_memory(graph.layers, device=GPU, training=training)
    assert alone.weights == pytest.approx((head.params + tied) * 2)
    assert whole.weights == pytest.approx(graph.params * 2)
    cluster = load_cluster("1x2xA100-80G")
    table = build_table(graph.layers, cluster, training, AnalyticalCostModel(cluster),
                        tps=(1,), micro_batches=(1,))
    held, last = table.range_params(1), len(graph.layers)
    assert held[last - 1, last] == head.params + tied
    assert held[0, last] == pytest.approx(graph.params)


def test_zero_keeps_tied_weights_whole_where_the_runtime_does():
    """The runtime sums a tied weight whose owner and readers sit on different stages
    outside ZeRO's sharding, and ZeRO-3 keeps every tied weight whole: the memory of
    such a stage holds it whole, and the solver's capacity per layer range prices the
    same states as `stage_memory` for every range, ZeRO stage and recompute policy."""
    from cost_models.cluster import load_cluster
    from cost_models.model import AnalyticalCostModel
    from planner.solver.partition import Option, _capacity
    from planner.solver.table import build_table
    from planner.types.model import zero_kept

    graph = trace_model(model_spec("gpt2-small", {"layers": 2}), seq_len=128)
    layers, last = graph.layers, len(graph.layers)
    tied = 50257 * 768
    training = TrainingSpec(global_batch=8, seq_len=128)
    assert zero_kept(layers, range(0, last - 1), 2) == tied  # the head is elsewhere
    assert zero_kept(layers, range(last - 1, last), 1) == tied  # its copy
    assert zero_kept(layers, range(0, last), 2) == 0  # all on one stage: sharded
    assert zero_kept(layers, range(0, last), 3) == tied  # but ZeRO-3 keeps it whole
    assert zero_kept(layers, range(1, last - 1), 3) == 0  # blocks tie nothing
    assert zero_kept(layers, range(0, last - 1), 0) == 0
    first = layers[:last - 1]
    sharded = stage_memory(first, device=GPU, training=training, dp=4, zero=2)
    whole = stage_memory(first, device=GPU, training=training, dp=4, zero=2, kept=tied)
    assert whole.gradients - sharded.gradients == pytest.approx(tied * 2 * 3 / 4)
    assert whole.weights == sharded.weights  # ZeRO-2 does not shard weights

    cluster = load_cluster("1x2xA100-80G")
    table = build_table(layers, cluster, training, AnalyticalCostModel(cluster),
                        tps=(1,), micro_batches=(1,))
    device = cluster.nodes[0].device
    info = table.type(device.name)
    options = tuple(Option(r, z) for r in Recompute for z in (0, 1, 2, 3))
    capacity = _capacity(table, device.name, 1, 1, 4, options)
    for option, most in zip(options, capacity, strict=True):
        for a in range(last):
            for b in range(a + 1, last + 1):
                args = dict(device=device, training=training, dp=4, zero=option.zero,
                            recompute=option.recompute,
                            kept=zero_kept(layers, range(a, b), option.zero))
                one = stage_memory(layers[a:b], in_flight=1, **args)
                two = stage_memory(layers[a:b], in_flight=2, **args)
                per = two.activations - one.activations
                states = one.weights + one.gradients + one.optimizer
                room = info.memory - info.reserve - states - (one.activations - per)
                assert most[a, b] == pytest.approx(room / per, rel=1e-9), (option, a, b)


def test_activations_scale_with_micro_batches_in_flight(llama7b):
    training = TrainingSpec(global_batch=8, seq_len=4096)
    one = stage_memory(llama7b.layers[1:3], device=GPU, training=training, micro_batch=1)
    four = stage_memory(llama7b.layers[1:3], device=GPU, training=training, micro_batch=2,
                        in_flight=2)
    assert four.activations == pytest.approx(4 * one.activations)
    full = stage_memory(llama7b.layers[1:3], device=GPU, training=training,
                        recompute=Recompute.FULL)
    block = llama7b.layers[1]
    assert full.activations == pytest.approx(2 * block.input_bytes + block.activation_bytes)
    assert full.reserve == GIB
    assert math.isclose(one.total, sum(one.terms().values()))


def test_optimizer_step_is_memory_bound():
    t = optimizer_time(1e9, GPU, dtype_bytes=2, optimizer=OptimizerSpec(), state_bytes=12)
    assert t == pytest.approx(1e9 * (2 + 4 + 24) / (2e12 * 0.8))


def test_the_collective_memo_stays_within_its_size_and_prices_alike(monkeypatch):
    """`AnalyticalCostModel` keeps at most COLLECTIVES_KEPT collectives (and groups'
    links) memoised, emptying the memo when full: a search that prices ever new
    groups does not hold them all, and every price equals the formula's."""
    import cost_models.model as model
    from cost_models.cluster import load_cluster

    cluster = load_cluster("4x8xA100-80G,4x8xV100-32G@100Gbps")
    monkeypatch.setattr(model, "COLLECTIVES_KEPT", 5)
    costs = model.AnalyticalCostModel(cluster)
    names = [node.name for node in cluster.nodes]
    groups = [CommGroup(tuple((name, 1 + (i + j) % 4) for j, name in enumerate(names[:k])))
              for i in range(4) for k in range(2, len(names) + 1)]
    for _ in range(2):  # (the second time round, some are memoised and some not)
        for group in groups:
            expected = collective_time(Collective.ALL_REDUCE, 1e8, group, cluster)
            assert costs.collective_time(Collective.ALL_REDUCE, 1e8, group) == expected
            assert len(costs.collectives) <= 5
    assert not costs.memo  # (layers, memory and the rest keep their own)
