"""A T5-style encoder-decoder (pre-norm RMS norms, ReLU MLP, relative position biases).

Unlike the original T5, every attention layer that uses relative positions owns
its small bias table (32 buckets x heads), instead of the first layer computing
one bias for the whole stack; pipeline stages then need nothing from each other
but activations. This adds 0.004% parameters to t5-base.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from planner.models.configs import T5Config


def relative_buckets(q_len: int, k_len: int, *, bidirectional: bool, buckets: int,
                     max_distance: int, device: torch.device) -> torch.Tensor:
    """T5's log-spaced relative position buckets, [q_len, k_len]."""
    rel = (torch.arange(k_len, device=device)[None, :]
           - torch.arange(q_len, device=device)[:, None])
    out = torch.zeros_like(rel)
    if bidirectional:
        buckets //= 2
        out = out + (rel > 0).long() * buckets
        rel = rel.abs()
    else:
        rel = -torch.clamp(rel, max=0)
    exact = buckets // 2
    large = exact + (torch.log(rel.float().clamp(min=1) / exact)
                     / math.log(max_distance / exact) * (buckets - exact)).long()
    large = torch.clamp(large, max=buckets - 1)
    return out + torch.where(rel < exact, rel, large)


class T5Attention(nn.Module):
    def __init__(self, cfg: T5Config, *, relative: bool, bidirectional: bool,
                 causal: bool) -> None:
        super().__init__()
        self.cfg, self.bidirectional, self.causal = cfg, bidirectional, causal
        self.num_heads = cfg.heads
        inner = cfg.heads * cfg.head_dim
        self.q = nn.Linear(cfg.hidden, inner, bias=False)
        self.k = nn.Linear(cfg.hidden, inner, bias=False)
        self.v = nn.Linear(cfg.hidden, inner, bias=False)
        self.o = nn.Linear(inner, cfg.hidden, bias=False)
        self.relative = nn.Embedding(cfg.buckets, cfg.heads) if relative else None

    def split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.cfg.heads, self.cfg.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        source = x if memory is None else memory
        q, k, v = self.split(self.q(x)), self.split(self.k(source)), self.split(self.v(source))
        q_len, k_len = x.shape[1], source.shape[1]
        bias = None
        if self.relative is not None:
            buckets = relative_buckets(q_len, k_len, bidirectional=self.bidirectional,
                                       buckets=self.cfg.buckets,
                                       max_distance=self.cfg.max_distance, device=x.device)
            bias = self.relative(buckets).permute(2, 0, 1).unsqueeze(0).to(q.dtype)
            if self.causal:
                future = (torch.arange(k_len, device=x.device)[None, :]
                          > torch.arange(q_len, device=x.device)[:, None])
                bias = bias.masked_fill(future, float("-inf"))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
        b, _, t, _ = y.shape
        return self.o(y.transpose(1, 2).reshape(b, t, self.cfg.heads * self.cfg.head_dim))


class T5MLP(nn.Module):
    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)))


class EncoderBlock(nn.Module):
    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attn = T5Attention(cfg, relative=True, bidirectional=True, causal=False)
        self.mlp_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.mlp = T5MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class DecoderBlock(nn.Module):
    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attn = T5Attention(cfg, relative=True, bidirectional=False, causal=True)
        self.cross_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.cross = T5Attention(cfg, relative=False, bidirectional=True, causal=False)
        self.mlp_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.mlp = T5MLP(cfg)

    def forward(self, y: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        y = y + self.attn(self.attn_norm(y))
        y = y + self.cross(self.cross_norm(y), memory)
        return y + self.mlp(self.mlp_norm(y))


class T5(nn.Module):
    """(source ids, target ids) [batch, seq] -> logits [batch, seq, vocab]."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.encoder = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.layers))
        self.encoder_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.decoder = nn.ModuleList(DecoderBlock(cfg)
                                     for _ in range(cfg.decoder_layers or cfg.layers))
        self.decoder_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = self.embed(source)
        for block in self.encoder:
            x = block(x)
        memory = self.encoder_norm(x)
        y = self.embed(target)
        for block in self.decoder:
            y = block(y, memory)
        y = self.decoder_norm(y) * self.cfg.hidden ** -0.5
        return F.linear(y, self.embed.weight)

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def example_batch(self, batch: int, seq_len: int, device: torch.device | str,
                      generator: torch.Generator | None = None
                      ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        shape = (batch, seq_len)
        if torch.device(device).type == "meta":
            src = tgt = torch.zeros(shape, dtype=torch.long, device=device)
            return (src, tgt), tgt
        src = torch.randint(0, self.cfg.vocab_size, shape, generator=generator).to(device)
        tgt = torch.randint(0, self.cfg.vocab_size, (batch, seq_len + 1),
                            generator=generator).to(device)
        return (src, tgt[:, :-1]), tgt[:, 1:]
