"""One configurable transformer for the GPT-2/GPT-3, OPT, Llama, BERT and Mixtral flavors.

The module tree is what pipelines split on: `embed`, `layers` (one module per
block), `head`. Every module runs on any device, meta included, and is
torch.fx traceable (the mixture-of-experts dispatch is a leaf with static
shapes).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from planner.models.configs import TransformerConfig
from planner.models.stack import Stack


def make_norm(cfg: TransformerConfig, dim: int) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=cfg.norm_eps)
    return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.bias)


def rotary_tables(seq: int, dim: int, theta: float, like: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, [seq, dim / 2]."""
    inv_freq = theta ** (-torch.arange(0, dim, 2, device=like.device, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(seq, device=like.device, dtype=torch.float32), inv_freq)
    return angles.cos().to(like.dtype), angles.sin().to(like.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x: [batch, heads, seq, head_dim]."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class TiedTokens(nn.Embedding):
    """A token table the head also projects onto the vocabulary with: initialized N(0,
    0.02) as GPT-2 and Megatron do. PyTorch's N(0, 1) for embeddings made the first
    logits' scale the square root of the width, and the first loss about 85 instead of
    ln(vocabulary)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class Embedding(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        width = cfg.embed_dim or cfg.hidden
        self.tokens = (TiedTokens if cfg.tie_embeddings else nn.Embedding)(cfg.vocab_size, width)
        self.proj_in = nn.Linear(width, cfg.hidden, bias=False) if cfg.embed_dim else None
        self.positions = (nn.Embedding((cfg.max_positions or cfg.seq_len) + cfg.position_offset,
                                       cfg.hidden) if cfg.positions == "learned" else None)
        self.types = nn.Embedding(cfg.type_vocab, cfg.hidden) if cfg.type_vocab else None
        self.norm = make_norm(cfg, cfg.hidden) if cfg.embed_norm else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tokens(tokens)
        if self.proj_in is not None:
            h = self.proj_in(h)
        if self.positions is not None:
            pos = torch.arange(tokens.shape[1], device=tokens.device) + self.cfg.position_offset
            h = h + self.positions(pos)
        if self.types is not None:
            h = h + self.types(torch.zeros_like(tokens))
        if self.norm is not None:
            h = self.norm(h)
        return h


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_heads, self.num_kv_heads = cfg.heads, cfg.kv_heads_
        kv_width = cfg.kv_heads_ * cfg.head_dim
        self.q = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.k = nn.Linear(cfg.hidden, kv_width, bias=cfg.bias)
        self.v = nn.Linear(cfg.hidden, kv_width, bias=cfg.bias)
        self.o = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        d = self.cfg.head_dim
        q = self.q(x).view(b, t, self.num_heads, d).transpose(1, 2)
        k = self.k(x).view(b, t, self.num_kv_heads, d).transpose(1, 2)
        v = self.v(x).view(b, t, self.num_kv_heads, d).transpose(1, 2)
        if self.cfg.positions == "rope":
            cos, sin = rotary_tables(t, d, self.cfg.rope_theta, q)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.cfg.causal,
                                           enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o(y.transpose(1, 2).reshape(b, t, self.cfg.hidden))


class MLP(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.activation = cfg.activation
        self.up = nn.Linear(cfg.hidden, cfg.ffn_dim, bias=cfg.bias)
        self.gate = (nn.Linear(cfg.hidden, cfg.ffn_dim, bias=cfg.bias)
                     if cfg.activation == "swiglu" else None)
        self.down = nn.Linear(cfg.ffn_dim, cfg.hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        act = F.relu if self.activation == "relu" else F.gelu
        return self.down(act(self.up(x)))


class Experts(nn.Module):
    """SwiGLU experts, each on its own rows: [experts, rows, hidden] in and out. A
    module of its own so tensor parallelism can shard its weights along the MLP width
    (`planner.runtime.parallel`)."""

    def __init__(self, experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.w_up = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.w_down = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.w_gate, self.w_up, self.w_down):
            nn.init.normal_(w, std=w.shape[1] ** -0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.bmm(F.silu(torch.bmm(tokens, self.w_gate)) * torch.bmm(tokens, self.w_up),
                         self.w_down)


class MoE(nn.Module):
    """Top-k routed SwiGLU experts with a fixed capacity per expert (tokens over
    capacity are dropped, as in Switch/GShard). Static shapes, so it runs on meta."""

    fx_leaf = True

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.capacity_factor = (cfg.experts, cfg.top_k,
                                                              cfg.capacity_factor)
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = Experts(cfg.experts, cfg.hidden, cfg.ffn_dim)

    def capacity(self, tokens: int) -> int:
        """Rows each expert runs for `tokens` tokens (its share of their top-k picks,
        times the capacity factor)."""
        return max(1, math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, hidden = x.shape, x.shape[-1]
        flat = x.reshape(-1, hidden)
        n, e, k = flat.shape[0], self.num_experts, self.top_k
        capacity = self.capacity(n)
        probs = self.router(flat).float().softmax(dim=-1)
        weight, expert = probs.topk(k, dim=-1)  # [n, k]
        weight = (weight / weight.sum(dim=-1, keepdim=True)).to(x.dtype)
        expert, weight = expert.t().reshape(-1), weight.t().reshape(-1)  # choice-major
        onehot = F.one_hot(expert, e)
        slot = ((onehot.cumsum(dim=0) - 1) * onehot).sum(dim=-1)
        kept = slot < capacity
        dest = torch.where(kept, expert * capacity + slot, e * capacity)
        buffer = flat.new_zeros(e * capacity + 1, hidden).index_add(0, dest, flat.repeat(k, 1))
        out = self.experts(buffer[:-1].view(e, capacity, hidden))
        out = torch.cat((out.reshape(e * capacity, hidden), flat.new_zeros(1, hidden)))[dest]
        out = out * (weight * kept.to(x.dtype)).unsqueeze(-1)
        return out.view(k, n, hidden).sum(dim=0).view(shape)


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.pre_norm = cfg.pre_norm
        self.attn_norm = make_norm(cfg, cfg.hidden)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg, cfg.hidden)
        self.mlp = MoE(cfg) if cfg.experts else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.attn(self.attn_norm(x))
            return x + self.mlp(self.mlp_norm(x))
        x = self.attn_norm(x + self.attn(x))
        return self.mlp_norm(x + self.mlp(x))


class Head(nn.Module):
    """Final norm, optional MLM transform and projection to the vocabulary.
    With tied embeddings the projection reuses `tied.weight` (the token table)."""

    def __init__(self, cfg: TransformerConfig, tied: nn.Embedding | None) -> None:
        super().__init__()
        width = cfg.embed_dim or cfg.hidden
        self.norm = make_norm(cfg, cfg.hidden) if cfg.final_norm and cfg.pre_norm else None
        self.proj_out = nn.Linear(cfg.hidden, width, bias=False) if cfg.embed_dim else None
        self.transform = (nn.Sequential(nn.Linear(width, width), nn.GELU(), make_norm(cfg, width))
                          if cfg.mlm_head else None)
        self.tied = [tied]  # a list, so the shared table is not registered twice
        self.output = None if tied is not None else nn.Linear(width, cfg.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size)) if cfg.mlm_head else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            h = self.norm(h)
        if self.proj_out is not None:
            h = self.proj_out(h)
        if self.transform is not None:
            h = self.transform(h)
        weight = self.tied[0].weight if self.output is None else self.output.weight
        return F.linear(h, weight, self.bias)


class Transformer(Stack):
    """Token ids [batch, seq] -> logits [batch, seq, vocab]; `loss` gives the LM loss."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.head = Head(cfg, self.embed.tokens if cfg.tie_embeddings else None)

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def example_batch(self, batch: int, seq_len: int, device: torch.device | str,
                      generator: torch.Generator | None = None
                      ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Random token ids and next-token targets."""
        shape = (batch, seq_len + 1)
        if torch.device(device).type == "meta":
            ids = torch.zeros(shape, dtype=torch.long, device=device)
        else:
            ids = torch.randint(0, self.cfg.vocab_size, shape, generator=generator).to(device)
        return (ids[:, :-1],), ids[:, 1:]
