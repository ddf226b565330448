"""The hybrid model: embeddings, KDA layers with a sparse-attention layer every few layers, a dense
MLP in the first layer and MoE after it, RMSNorm, LM head.  Config-driven, seeded random weights.

``forward`` runs the serving path (Triton KDA kernels, grouped MoE, sparse attention);
``reference`` runs every layer's plain torch reference.  Tests compare the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from target_stack.model.kda_layer import KDALayer
from target_stack.model.layers import MoE, RMSNorm, SwiGLU, dense_causal_attention, sparse_attention


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 256
    dim: int = 64
    layers: int = 4
    heads: int = 2
    head_k: int = 16
    head_v: int = 16
    attn_every: int = 4  # every attn_every-th layer (1-based) is sparse attention instead of KDA
    attn_heads: int = 2
    attn_head_dim: int = 16
    index_dim: int = 8
    block: int = 16
    top_k_blocks: int = 4
    window: int = 16
    mlp_hidden: int = 128
    experts: int = 4
    top_k_experts: int = 2
    expert_hidden: int = 64
    seed: int = 0


PRESETS = {
    "tiny": ModelConfig(),
    "bench": ModelConfig(vocab=32000, dim=2048, layers=16, heads=16, head_k=128, head_v=128, attn_every=4,
                         attn_heads=16, attn_head_dim=128, index_dim=64, block=64, top_k_blocks=32, window=128,
                         mlp_hidden=5632, experts=32, top_k_experts=4, expert_hidden=1024),
}


class SparseAttentionLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, generator: torch.Generator):
        super().__init__()
        self.cfg = cfg
        d, h, hd = cfg.dim, cfg.attn_heads, cfg.attn_head_dim
        self.w_qkv = torch.nn.Parameter(torch.randn(3 * h * hd, d, generator=generator) * d**-0.5)
        self.w_idx = torch.nn.Parameter(torch.randn(2 * cfg.index_dim, d, generator=generator) * d**-0.5)
        self.w_o = torch.nn.Parameter(torch.randn(d, h * hd, generator=generator) * (h * hd) ** -0.5)

    def _split(self, x: torch.Tensor):
        cfg = self.cfg
        q, k, v = F.linear(x, self.w_qkv).split(cfg.attn_heads * cfg.attn_head_dim, dim=-1)
        iq, ik = F.linear(x, self.w_idx).split(cfg.index_dim, dim=-1)
        shape = (x.shape[0], cfg.attn_heads, cfg.attn_head_dim)
        return q.reshape(shape), k.reshape(shape), v.reshape(shape), iq, ik

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # one sequence: [T, dim]
        q, k, v, iq, ik = self._split(x)
        cfg = self.cfg
        o = sparse_attention(q, k, v, iq, ik, cfg.block, cfg.top_k_blocks, cfg.window)
        return F.linear(o.reshape(x.shape[0], -1), self.w_o)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Dense causal attention: equal to forward whenever top-k blocks cover the sequence."""
        q, k, v, _, _ = self._split(x)
        return F.linear(dense_causal_attention(q, k, v).reshape(x.shape[0], -1), self.w_o)


class Block(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, generator: torch.Generator):
        super().__init__()
        self.is_attn = (index + 1) % cfg.attn_every == 0
        self.norm1, self.norm2 = RMSNorm(cfg.dim), RMSNorm(cfg.dim)
        self.mixer = (SparseAttentionLayer(cfg, generator) if self.is_attn
                      else KDALayer(cfg.dim, cfg.heads, cfg.head_k, cfg.head_v, generator))
        self.ffn = (SwiGLU(cfg.dim, cfg.mlp_hidden, generator) if index == 0
                    else MoE(cfg.dim, cfg.expert_hidden, cfg.experts, cfg.top_k_experts, generator))

    def _mix(self, h: torch.Tensor, ref: bool) -> torch.Tensor:
        if self.is_attn:
            f = self.mixer.reference if ref else self.mixer
            return torch.stack([f(seq) for seq in h])
        return self.mixer.reference(h) if ref else self.mixer(h)

    def forward(self, h: torch.Tensor, ref: bool = False) -> torch.Tensor:
        norm = self.norm1.reference if ref else self.norm1
        h = h + self._mix(norm(h), ref)
        norm2 = self.norm2.reference if ref else self.norm2
        ffn = self.ffn.reference if ref and isinstance(self.ffn, MoE) else self.ffn
        return h + ffn(norm2(h))


class HybridModel(torch.nn.Module):
    def __init__(self, cfg: ModelConfig | str = "tiny"):
        super().__init__()
        if isinstance(cfg, str):
            if cfg not in PRESETS:
                raise ValueError(f"unknown preset {cfg!r}; known: {', '.join(PRESETS)}")
            cfg = PRESETS[cfg]
        self.cfg = cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        self.embed = torch.nn.Parameter(torch.randn(cfg.vocab, cfg.dim, generator=gen) * 0.5)
        self.blocks = torch.nn.ModuleList(Block(cfg, i, gen) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.lm_head = torch.nn.Parameter(torch.randn(cfg.vocab, cfg.dim, generator=gen) * cfg.dim**-0.5)

    def _run(self, tokens: torch.Tensor, ref: bool) -> torch.Tensor:
        if tokens.dim() != 2 or tokens.dtype not in (torch.int32, torch.int64):
            raise ValueError("tokens must be an integer tensor [batch, time]")
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= self.cfg.vocab):
            raise ValueError(f"token ids must be in [0, {self.cfg.vocab})")
        h = F.embedding(tokens, self.embed)
        for block in self.blocks:
            h = block(h, ref=ref)
        h = self.norm.reference(h) if ref else self.norm(h)
        return F.linear(h, self.lm_head)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [batch, time, vocab] on the serving path."""
        return self._run(tokens, ref=False)

    @torch.no_grad()
    def reference(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._run(tokens, ref=True)
