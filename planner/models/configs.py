"""The zoo families' shape configurations, apart from the modules that build them.

They hold no torch: the zoo's flavors, their overrides and checks (`planner.models.zoo`)
and plan files' model checks then work without importing torch, which alone takes
about a second (a solve that reads its trace from the cache imports none).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int | None = None  # grouped-query attention; None = heads
    ffn: int | None = None  # None = 4 * hidden
    seq_len: int = 2048  # default training sequence length
    max_positions: int | None = None  # learned positions; None = seq_len
    position_offset: int = 0  # OPT stores two extra position rows
    positions: str = "learned"  # "learned" | "rope"
    rope_theta: float = 10000.0
    norm: str = "layernorm"  # "layernorm" | "rmsnorm"
    norm_eps: float = 1e-5
    activation: str = "gelu"  # "gelu" | "relu" | "swiglu"
    causal: bool = True
    pre_norm: bool = True
    final_norm: bool = True
    tie_embeddings: bool = True
    bias: bool = True
    embed_dim: int | None = None  # OPT-350M: embeddings narrower than hidden
    type_vocab: int = 0  # BERT segment embeddings
    embed_norm: bool = False  # BERT: layer norm after the embeddings
    mlm_head: bool = False  # BERT: dense + act + norm before the tied decoder
    experts: int = 0  # > 0: mixture-of-experts MLP (Mixtral style)
    top_k: int = 2
    capacity_factor: float = 1.0

    @property
    def ffn_dim(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def kv_heads_(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def validate(self) -> list[str]:
        """Problems with the shapes, as messages naming the field."""
        problems = []
        for name in ("vocab_size", "hidden", "layers", "heads", "seq_len"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive (got {getattr(self, name)})")
        if self.ffn is not None and self.ffn <= 0:
            problems.append(f"ffn must be positive (got {self.ffn})")
        if self.heads > 0 and self.hidden % self.heads:
            problems.append(f"heads ({self.heads}) must divide hidden ({self.hidden})")
        if self.kv_heads is not None and (self.kv_heads <= 0 or self.heads % self.kv_heads):
            problems.append(f"kv_heads ({self.kv_heads}) must be positive and divide "
                            f"heads ({self.heads})")
        if self.positions == "rope" and self.heads > 0 and self.head_dim % 2:
            problems.append(f"rotary positions need an even head size (hidden/heads = "
                            f"{self.hidden}/{self.heads})")
        if self.max_positions is not None and self.max_positions <= 0:
            problems.append(f"max_positions must be positive (got {self.max_positions})")
        elif self.positions == "learned" and self.seq_len > (self.max_positions
                                                             or self.seq_len):
            problems.append(f"seq_len ({self.seq_len}) exceeds the {self.max_positions} "
                            f"learned positions (raise max_positions)")
        if self.experts < 0 or (self.experts and not 0 < self.top_k <= self.experts):
            problems.append(f"top_k ({self.top_k}) must be between 1 and experts "
                            f"({self.experts})")
        if not 0 < self.capacity_factor < math.inf:  # NaN too
            problems.append(f"capacity_factor must be a positive, finite number (got "
                            f"{self.capacity_factor})")
        return problems


@dataclass(frozen=True, kw_only=True)
class T5Config:
    vocab_size: int = 32128
    hidden: int = 768
    layers: int = 12  # encoder layers; the decoder has as many
    decoder_layers: int | None = None
    heads: int = 12
    head_dim: int = 64
    ffn: int = 3072
    seq_len: int = 512  # source length; the target has the same length
    buckets: int = 32
    max_distance: int = 128
    norm_eps: float = 1e-6

    def validate(self) -> list[str]:
        return [f"{name} must be positive (got {getattr(self, name)})"
                for name in ("vocab_size", "hidden", "layers", "heads", "head_dim", "ffn",
                             "seq_len")
                if getattr(self, name) <= 0]


@dataclass(frozen=True, kw_only=True)
class ViTConfig:
    image_size: int = 224
    patch: int = 16
    hidden: int = 1024
    layers: int = 24
    heads: int = 16
    ffn: int = 4096
    classes: int = 1000
    channels: int = 3

    @property
    def seq_len(self) -> int:
        return (self.image_size // self.patch) ** 2 + 1

    def block_config(self) -> TransformerConfig:
        return TransformerConfig(vocab_size=1, hidden=self.hidden, layers=self.layers,
                                 heads=self.heads, ffn=self.ffn, seq_len=self.seq_len,
                                 norm_eps=1e-6, causal=False, positions="none")

    def validate(self) -> list[str]:
        problems = [f"{name} must be positive (got {getattr(self, name)})"
                    for name in ("image_size", "patch", "hidden", "layers", "heads", "ffn",
                                 "classes")
                    if getattr(self, name) <= 0]
        if not problems and self.image_size % self.patch:
            problems.append(f"patch ({self.patch}) must divide image_size ({self.image_size})")
        if not problems and self.hidden % self.heads:
            problems.append(f"heads ({self.heads}) must divide hidden ({self.hidden})")
        return problems


@dataclass(frozen=True, kw_only=True)
class ResNetConfig:
    blocks: tuple[int, int, int, int] = (3, 4, 6, 3)
    width: int = 64
    classes: int = 1000
    image_size: int = 224

    def validate(self) -> list[str]:
        problems = [f"{name} must be positive (got {getattr(self, name)})"
                    for name in ("width", "classes", "image_size") if getattr(self, name) <= 0]
        if any(b <= 0 for b in self.blocks):
            problems.append(f"every stage needs at least one block (got {self.blocks})")
        return problems


@dataclass(frozen=True, kw_only=True)
class MLPConfig:
    inputs: int = 1024
    hidden: int = 4096
    layers: int = 8
    classes: int = 1000

    def validate(self) -> list[str]:
        return [f"{name} must be positive (got {getattr(self, name)})"
                for name in ("inputs", "hidden", "layers", "classes")
                if getattr(self, name) <= 0]
