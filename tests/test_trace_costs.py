"""FLOPs, bytes and saved activations of traced ops against closed-form formulas."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from planner.models import model_spec
from planner.trace import trace_model, trace_module
from planner.types import OpClass


def kernels(graph, op_class):
    return [k for layer in graph.layers for k in layer.kernels if k.op_class is op_class]


class Wrap(nn.Module):
    """Wraps a module in a one-block ModuleList so it forms one layer."""

    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_linear_flops_and_bytes():
    b, s, i, o = 2, 8, 64, 32
    g = trace_module(Wrap(nn.Linear(i, o), nn.Linear(o, o)), (torch.zeros(b, s, i),))
    first = g.layers[0].kernels
    (mm,) = [k for k in first if k.op_class is OpClass.MATMUL]
    assert mm.flops == 2 * s * i * o  # per sample
    assert mm.gemm == (s, i, o)
    assert mm.bytes == 4 * (s * i + s * o)  # fp32 input read + output written
    assert mm.bytes_fixed == 4 * (i * o + o)  # weight and bias, once per micro-batch
    # The input needs no gradient, so only the weight gradient is computed...
    assert mm.bwd_flops == mm.flops
    # ...while the second linear also back-propagates into its input.
    (mm2,) = [k for k in g.layers[1].kernels if k.op_class is OpClass.MATMUL]
    assert mm2.bwd_flops == 2 * mm2.flops


class Attn(nn.Module):
    def __init__(self, heads: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(heads * dim, 3 * heads * dim)
        self.heads, self.dim = heads, dim

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.proj(x).view(b, s, 3, self.heads, self.dim).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_attention_is_a_fused_kernel():
    b, s, h, d = 2, 16, 4, 8
    g = trace_module(Wrap(Attn(h, d)), (torch.zeros(b, s, h * d),), dtype="bf16")
    (att,) = kernels(g, OpClass.ATTENTION)
    assert att.flops == 4 * h * s * s * d  # QK^T and AV, per sample
    assert att.bwd_flops == 2.5 * att.flops  # flash backward recomputes QK^T
    assert att.bytes == 4 * h * s * d * 2  # q, k, v read, out written (bf16)
    # flash attention keeps q, k, v (one projection output here), out and the
    # fp32 log-sum-exp: never the s x s scores.
    saved = g.layers[0].saved_by_class[OpClass.ATTENTION.value]
    assert saved == 3 * h * s * d * 2 + h * s * d * 2 + h * s * 4


def test_conv_flops_and_gradients():
    b, c, o, k, hw = 3, 3, 8, 3, 16
    g = trace_module(Wrap(nn.Conv2d(c, o, k, padding=1), nn.Conv2d(o, o, k, padding=1)),
                     (torch.zeros(b, c, hw, hw),))
    first, second = (next(x for x in layer.kernels if x.op_class is OpClass.CONV)
                     for layer in g.layers)
    assert first.flops == 2 * hw * hw * o * c * k * k
    assert first.gemm == (hw * hw, c * k * k, o)
    assert first.bwd_flops == first.flops  # images need no gradient
    assert second.bwd_flops == 2 * second.flops


def test_transformer_block_matches_closed_form():
    """A pre-norm GPT block: 24 s h^2 + 4 s^2 h forward FLOPs, and the 34 s h bytes
    of saved activations of Korthikanti et al. (2022) without dropout masks (flash
    attention keeps no s^2 scores), plus the fp32 norm statistics and log-sum-exp."""
    s, h, heads = 64, 128, 4
    g = trace_model(model_spec("gpt-tiny"), seq_len=s)
    block = g.layers[1]
    assert block.fwd_flops == 24 * s * h * h + 4 * s * s * h
    matmul = sum(k.flops for k in block.kernels if k.op_class is OpClass.MATMUL)
    attention = sum(k.flops for k in block.kernels if k.op_class is OpClass.ATTENTION)
    assert block.bwd_flops == 2 * matmul + 2.5 * attention
    assert block.activation_bytes == 34 * s * h + 2 * 2 * s * 4 + heads * s * 4
    assert block.params == 12 * h * h + 13 * h
    assert block.output_bytes == s * h * 2  # the bf16 hidden state
    assert block.tp_comm_bytes == 2 * s * h * 2  # two row-parallel all-reduces
    assert block.tp_divisor == heads


def test_layers_of_a_decoder():
    g = trace_model(model_spec("gpt-tiny"))
    assert [layer.kind.value for layer in g.layers] == ["embedding"] + ["block"] * 4 + ["head"]
    assert [layer.name for layer in g.layers[1:5]] == [f"layers.{i}" for i in range(4)]
    assert len({layer.signature for layer in g.layers[1:5]}) == 1
    assert g.repeated_groups() == {g.layers[1].signature: [1, 2, 3, 4]}
    assert sum(layer.params for layer in g.layers) == 867_072
    # tied embeddings: the table belongs to the embedding layer, the head reuses it
    assert g.layers[0].params == 512 * 128 + 64 * 128
    assert g.layers[-1].params == 2 * 128


def test_encoder_decoder_has_glue_and_wider_boundaries():
    g = trace_model(model_spec("t5-base", {"layers": 2, "hidden": 64, "heads": 2,
                                           "head_dim": 32, "ffn": 128, "vocab": 100}),
                    seq_len=32)
    kinds = [layer.kind.value for layer in g.layers]
    assert kinds == ["embedding", "block", "block", "glue", "block", "block", "head"]
    hidden = 32 * 64 * 2
    # decoder blocks receive the encoder output as well as their own hidden state
    assert [layer.output_bytes for layer in g.layers[:-1]] == [
        hidden, hidden, hidden, 2 * hidden, 2 * hidden, hidden]


def test_resnet_blocks_and_stem():
    g = trace_model(model_spec("resnet50"))
    assert len(g.layers) == 18
    assert g.layers[0].kind.value == "embedding" and g.layers[-1].kind.value == "head"
    assert g.layers[1].output_bytes == 256 * 56 * 56 * 2


class Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x, skip=None):
        y = self.linear(x)
        return y if skip is None else y + skip


class Skip(nn.Module):
    """Block 0's output is read again by block 2: it crosses two boundaries."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Mix() for _ in range(3))

    def forward(self, x):
        a = self.blocks[0](x)
        b = self.blocks[1](a)
        return self.blocks[2](b, a)


def test_boundaries_count_skip_connections():
    g = trace_module(Skip(), (torch.zeros(4, 16),))
    assert [layer.output_bytes for layer in g.layers] == [16 * 4, 2 * 16 * 4, 0]


def test_plain_sequential_user_model():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 4))
    g = trace_module(model, (torch.zeros(2, 8),))
    assert len(g.layers) == 3
    assert sum(layer.params for layer in g.layers) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name, overrides", [
    ("gpt-tiny", {}),
    ("t5-base", {"layers": 2, "hidden": 64, "heads": 2, "head_dim": 32, "ffn": 128,
                 "vocab": 100}),
    ("mixtral-8x7b", {"layers": 3, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 96,
                      "vocab": 100}),
    ("resnet50", {"blocks": (2, 2, 1, 1), "width": 8}),
])
def test_copying_repeated_blocks_equals_replaying_them(name, overrides):
    from planner.models import load_model
    from planner.trace import trace_loaded

    seq = 16 if name != "resnet50" else None
    fast = trace_loaded(load_model(model_spec(name, overrides), seq_len=seq))
    slow = trace_loaded(load_model(model_spec(name, overrides), seq_len=seq), reuse=False)
    assert fast.layers == slow.layers
    assert fast.graph.number_of_nodes() == slow.graph.number_of_nodes()


@pytest.mark.parametrize("name, overrides", [
    ("gpt2-small", {}), ("llama2-7b", {"layers": 2}), ("opt-350m", {"layers": 2}),
    ("bert-large", {"layers": 2}), ("vit-l", {})])
def test_training_flops_follow_six_n_t(name, overrides):
    from planner.trace.summary import flop_check

    check = flop_check(trace_model(model_spec(name, overrides)))
    assert check is not None
    assert check.ratio == pytest.approx(1.0, abs=0.006)


def test_llama3_70b_traces_with_80_blocks():
    from planner.trace.summary import count_blocks

    g = trace_model(model_spec("llama3-70b"), seq_len=4096)
    assert count_blocks(g) == 80
    assert g.params == 70_553_706_496
    assert len(g.repeated_groups()) == 1


def test_tensor_parallelism_covers_the_layers_the_runtime_shards():
    """The runtime shards transformer and MLP blocks and replicates the rest on a
    tensor-parallel group: the trace marks which, and a replicated layer costs every
    rank its whole time and parameters."""
    from cost_models.compute import roofline_time
    from cost_models.memory import stage_memory
    from planner.types import TrainingSpec
    from tests.test_cost_formulas import GPU

    gpt = trace_model(model_spec("gpt2-small", {"layers": 2}), seq_len=128)
    assert [layer.tp_sharded for layer in gpt.layers] == [False, True, True, False]
    assert gpt.layers[0].tp_comm_bytes == 0 and gpt.layers[1].tp_comm_bytes > 0
    head = gpt.layers[-1]
    one, two = (roofline_time(head, GPU, tp=tp, micro_batch=1, dtype="bf16") for tp in (1, 2))
    assert two == one
    training = TrainingSpec(global_batch=8, seq_len=128)
    assert stage_memory([head], device=GPU, training=training, tp=2).weights == \
        stage_memory([head], device=GPU, training=training, tp=1).weights
    mlp = trace_model(model_spec("mlp-small"))
    assert mlp.layers[1].tp_sharded and mlp.layers[1].tp_comm_bytes > 0  # gathered output
    resnet = trace_model(model_spec("resnet50"))
    assert not any(layer.tp_sharded for layer in resnet.layers)
    from planner.errors import PlannerError
    from planner.solver.table import check_tp_divides

    with pytest.raises(PlannerError, match="shards none of this model's layers"):
        check_tp_divides(resnet.layers, 2, (1, 2))


def test_the_residual_streams_cheap_ops_run_whole_on_every_tp_rank():
    """The runtime's tensor-parallel plans return replicated outputs (no sequence
    parallelism), so every rank of a block's group adds the residual and runs the cheap
    ops after it on the whole activations: those kernels (the two residual adds of a
    GPT-2 block among them, none of its matmuls) take as long at tp 8 as alone, and
    the block's time is the split kernels' eighth plus theirs."""
    from cost_models.compute import DEFAULT_EFFICIENCY, _kernel_time, roofline_time
    from tests.test_cost_formulas import GPU

    gpt = trace_model(model_spec("gpt2-small", {"layers": 2}), seq_len=128)
    block = gpt.layers[1]
    whole = [k for k in block.kernels if k.whole]
    adds = [k for k in whole if k.op_class is OpClass.ELEMENTWISE]
    assert adds and sum(k.count for k in adds) >= 2
    assert not any(k.op_class in (OpClass.MATMUL, OpClass.ATTENTION) for k in whole)

    def seconds(kernels, tp):
        return sum(_kernel_time(k, mb=4, tp=tp, backward=False, device=GPU, dtype="bf16",
                                eff=DEFAULT_EFFICIENCY) for k in kernels)

    assert seconds(whole, 8) == seconds(whole, 1) > 0
    split = [k for k in block.kernels if not k.whole]
    assert roofline_time(block, GPU, tp=8, micro_batch=4, dtype="bf16").fwd == \
        pytest.approx(seconds(split, 8) + seconds(whole, 1))
    assert seconds(split, 8) < seconds(split, 1)


def test_mixture_of_experts_blocks_are_split_over_tp_ranks_with_their_experts():
    """The runtime splits a mixture-of-experts block's attention and every expert over
    its tensor-parallel group: the trace prices the attention's all-reduce and the
    experts' rows (every expert's capacity, all-reduced at once), and tp must divide
    the heads and the experts' width, not the number of experts (the router stays
    whole)."""
    from cost_models.memory import stage_memory
    from planner.errors import PlannerError
    from planner.solver.table import check_tp_divides
    from planner.types import TrainingSpec
    from tests.test_cost_formulas import GPU

    s, h, experts = 32, 64, 6
    moe = trace_model(model_spec("mixtral-8x7b", {"layers": 2, "hidden": h, "heads": 4,
                                                  "kv_heads": 4, "ffn": 128, "vocab": 100,
                                                  "experts": experts}), seq_len=s)
    block = moe.layers[1]
    assert [layer.tp_sharded for layer in moe.layers] == [False, True, True, False]
    rows = experts * math.ceil(1.0 * s * 2 / experts)  # capacity factor 1, top-2
    assert block.tp_comm_bytes == (s + rows) * h * 2  # bf16
    assert block.tp_divisor == 4
    check_tp_divides(moe.layers, 4, (1, 2, 4))
    with pytest.raises(PlannerError, match="divide by 4"):
        check_tp_divides(moe.layers, 8, (1, 2, 4, 8))
    training = TrainingSpec(global_batch=8, seq_len=s)
    assert stage_memory([block], device=GPU, training=training, tp=2).weights == \
        stage_memory([block], device=GPU, training=training, tp=1).weights / 2
    # every rank runs the router and the dispatch around the experts whole; the experts'
    # projections, activation and product (rows x ffn each) are split
    router, = (k for k in block.kernels if k.whole and k.op_class is OpClass.MATMUL)
    assert router.gemm[2] == experts
    inner = [k for k in block.kernels if not k.whole and k.op_class is OpClass.MATMUL
             and k.gemm[0] == rows]
    assert sorted(k.gemm[2] for k in inner) == [h, 128]  # down; gate and up (one kernel)
    assert sum(k.bytes for k in block.kernels if not k.whole
               and k.op_class is OpClass.ELEMENTWISE) >= 5 * rows * 128 * 2  # silu, mul
    assert any(k.whole and k.op_class is OpClass.ELEMENTWISE for k in block.kernels)


def test_an_mlp_blocks_activation_runs_whole_after_its_gathered_matmul():
    """The runtime's plan for an MLP block gathers its column-parallel linear's output
    (`ColwiseParallel(output_layouts=Replicate())`), so every rank runs the GELU on the
    whole output: its kernels take as long at tp 4 as alone, the matmul's a quarter,
    and what the GELU saves stays whole."""
    from cost_models.compute import DEFAULT_EFFICIENCY, _kernel_time
    from tests.test_cost_formulas import GPU

    block = trace_model(model_spec("mlp", {"layers": 2})).layers[1]
    whole = [k for k in block.kernels if k.whole]
    assert whole and not any(k.op_class is OpClass.MATMUL for k in whole)
    assert any(k.op_class is OpClass.MATMUL and not k.whole for k in block.kernels)

    def seconds(kernels, tp):
        return sum(_kernel_time(k, mb=4, tp=tp, backward=False, device=GPU, dtype="bf16",
                                eff=DEFAULT_EFFICIENCY) for k in kernels)

    assert seconds(whole, 4) == seconds(whole, 1) > 0
    assert block.replicated_bytes == pytest.approx(block.activation_bytes)
