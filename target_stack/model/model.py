"""The hybrid model: embeddings, KDA layers with a sparse-attention layer every few layers, a dense
MLP in the first layer and MoE after it, RMSNorm, LM head.  Config-driven, seeded random weights.

``forward`` runs the serving path (Triton KDA kernels, grouped MoE, sparse attention);
``reference`` runs every layer's plain torch reference.  Tests compare the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from target_stack.model.derived import DerivedWeight, stack_rows
from target_stack.model.kda_layer import KDALayer
from target_stack.model.layers import MoE, RMSNorm, SwiGLU, dense_causal_attention, kernel_on, sparse_attention


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
    patch: int = 8  # image encoder: patch side in pixels
    image_layers: int = 2
    max_image_side: int = 64
    kda_backend: str = "auto"  # "triton" | "torch" | "auto" (Triton on a GPU, the torch chunked form on CPU)
    moe_backend: str = "torch"  # "native": the compiled dispatch/expert/combine step (CPU fp32)
    kv_dtype: str = "fp32"  # KV storage of the sparse-attention layers: fp32 | bf16 | int8 | fp8
    kv_dtype_overrides: tuple[tuple[int, str], ...] = ()  # (layer index, kind) pairs
    # the KDA layers' recurrent state in the decode pool: fp32, or bf16 (a reduced-byte state: half the bytes
    # a decode step moves, rounded once per step; a numerics change a person approves, never the default)
    kda_state_dtype: str = "fp32"
    # the one-launch decode inputs, norms and MoE router (ops/kda/decode_inputs.py, ops/norm.py, ops/moe/route.py)
    # on the Triton path (on a GPU; the router for decode-sized batches): with the first two a graph-captured
    # bench-preset decode step on an H200 took 3.76 instead of 4.95 ms at batch 1 (bench/engine_gpu.py,
    # 2026-12-02); bench/decode_ops.py counts the launches they save
    fused_kernels: bool = True
    seed: int = 0

    def kv_dtype_for(self, layer: int) -> str:
        return dict(self.kv_dtype_overrides).get(layer, self.kv_dtype)


PRESETS = {
    "tiny": ModelConfig(),
    "bench": ModelConfig(vocab=32000, dim=2048, layers=16, heads=16, head_k=128, head_v=128, attn_every=4,
                         attn_heads=16, attn_head_dim=128, index_dim=64, block=64, top_k_blocks=32, window=128,
                         mlp_hidden=5632, experts=32, top_k_experts=4, expert_hidden=1024, patch=16,
                         max_image_side=448, kv_dtype="bf16"),
}


class ImageEncoder(torch.nn.Module):
    """Patch embedding then a few pre-norm transformer layers (bidirectional attention, SwiGLU).

    Input: an image [3, H, W] in [0, 1] with H and W multiples of the patch side.  Output: one
    embedding per patch, [H * W / patch**2, dim], spliced in front of the prompt's token embeddings.
    """

    def __init__(self, cfg: ModelConfig, generator: torch.Generator):
        super().__init__()
        self.cfg = cfg
        d, p = cfg.dim, cfg.patch
        self.patch_embed = torch.nn.Parameter(torch.randn(d, 3 * p * p, generator=generator) * (3 * p * p) ** -0.5)
        self.layers = torch.nn.ModuleList()
        for _ in range(cfg.image_layers):
            layer = torch.nn.Module()
            layer.norm1, layer.norm2 = RMSNorm(d), RMSNorm(d)
            layer.w_qkv = torch.nn.Parameter(torch.randn(3 * d, d, generator=generator) * d**-0.5)
            layer.w_o = torch.nn.Parameter(torch.randn(d, d, generator=generator) * d**-0.5)
            layer.mlp = SwiGLU(d, 2 * d, generator)
            self.layers.append(layer)
        self.norm = RMSNorm(d)

    def patches(self, image: torch.Tensor) -> torch.Tensor:
        p = self.cfg.patch
        C, H, W = image.shape
        x = image.reshape(C, H // p, p, W // p, p).permute(1, 3, 0, 2, 4).reshape((H // p) * (W // p), C * p * p)
        return x

    def _run(self, image: torch.Tensor, ref: bool) -> torch.Tensor:
        dtype = torch.float64 if ref else self.patch_embed.dtype
        h = F.linear(self.patches(image.to(dtype)), self.patch_embed.to(dtype))
        heads = self.cfg.attn_heads
        for layer in self.layers:
            x = layer.norm1.reference(h) if ref else layer.norm1(h)
            q, k, v = F.linear(x, layer.w_qkv.to(dtype)).reshape(x.shape[0], 3, heads, -1).unbind(1)
            if ref:
                att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5, dim=-1)
                o = torch.einsum("hqk,khd->qhd", att, v)
            else:
                q, k, v = (t.transpose(0, 1) for t in (q, k, v))
                o = F.scaled_dot_product_attention(q, k, v).transpose(0, 1)
            h = h + F.linear(o.reshape(x.shape[0], -1), layer.w_o.to(dtype))
            x = layer.norm2.reference(h) if ref else layer.norm2(h)
            mlp = layer.mlp
            h = h + F.linear(F.silu(F.linear(x, mlp.w_gate.to(dtype))) * F.linear(x, mlp.w_up.to(dtype)),
                             mlp.w_down.to(dtype))
        return self.norm.reference(h) if ref else self.norm(h)

    @torch.no_grad()
    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self._run(image, ref=False)

    @torch.no_grad()
    def reference(self, image: torch.Tensor) -> torch.Tensor:
        return self._run(image, ref=True).to(self.patch_embed.dtype)


class SparseAttentionLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, generator: torch.Generator):
        super().__init__()
        self.cfg = cfg
        d, h, hd = cfg.dim, cfg.attn_heads, cfg.attn_head_dim
        self.w_qkv = torch.nn.Parameter(torch.randn(3 * h * hd, d, generator=generator) * d**-0.5)
        self.w_idx = torch.nn.Parameter(torch.randn(2 * cfg.index_dim, d, generator=generator) * d**-0.5)
        self.w_o = torch.nn.Parameter(torch.randn(d, h * hd, generator=generator) * (h * hd) ** -0.5)
        # decode: the two-launch Triton attention (ops/sparse_decode.py) always, never, None: on a GPU
        # (set by HybridModel.set_fused_kernels)
        self.fused: bool | None = False
        self._w_in = DerivedWeight(stack_rows)  # [w_qkv; w_idx]: one product where the kernels are on

    def project(self, x: torch.Tensor):
        """q, k, v [T, H, D] and the indexer's query and key [T, Di] for tokens x [T, dim]."""
        cfg = self.cfg
        hd, di = cfg.attn_heads * cfg.attn_head_dim, cfg.index_dim
        if kernel_on(x, self.fused):  # one launch instead of two (a decode step's products are launch-bound)
            q, k, v, iq, ik = F.linear(x, self._w_in((self.w_qkv, self.w_idx))).split([hd, hd, hd, di, di], dim=-1)
        else:
            q, k, v = F.linear(x, self.w_qkv).split(hd, dim=-1)
            iq, ik = F.linear(x, self.w_idx).split(di, dim=-1)
        shape = (x.shape[0], cfg.attn_heads, cfg.attn_head_dim)
        return q.reshape(shape), k.reshape(shape), v.reshape(shape), iq, ik

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # one sequence: [T, dim]
        q, k, v, iq, ik = self.project(x)
        cfg = self.cfg
        o = sparse_attention(q, k, v, iq, ik, cfg.block, cfg.top_k_blocks, cfg.window)
        return F.linear(o.reshape(x.shape[0], -1), self.w_o)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Dense causal attention: equal to forward whenever top-k blocks cover the sequence."""
        q, k, v, _, _ = self.project(x)
        return F.linear(dense_causal_attention(q, k, v).reshape(x.shape[0], -1), self.w_o)


class Block(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, generator: torch.Generator):
        super().__init__()
        self.is_attn = (index + 1) % cfg.attn_every == 0
        self.norm1, self.norm2 = RMSNorm(cfg.dim), RMSNorm(cfg.dim)
        self.mixer = (SparseAttentionLayer(cfg, generator) if self.is_attn
                      else KDALayer(cfg.dim, cfg.heads, cfg.head_k, cfg.head_v, generator, backend=cfg.kda_backend))
        self.ffn = (SwiGLU(cfg.dim, cfg.mlp_hidden, generator) if index == 0
                    else MoE(cfg.dim, cfg.expert_hidden, cfg.experts, cfg.top_k_experts, generator,
                             backend=cfg.moe_backend))

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
        self.image_encoder = ImageEncoder(cfg, gen)
        self.set_fused_kernels(cfg.fused_kernels)

    def set_fused_kernels(self, on: bool) -> None:
        """The Triton norms, MoE router and small-batch experts, KDA decode inputs and decode attention
        (``ModelConfig.fused_kernels``).

        A CUDA graph captured before the switch keeps the kernels it was captured with."""
        for module in self.modules():
            if isinstance(module, RMSNorm | MoE | SparseAttentionLayer):
                module.fused = None if on else False  # on: on a GPU
            if isinstance(module, MoE):
                module.small_batch = None if on else False  # a decode step's experts in two launches, on a GPU
            elif isinstance(module, KDALayer):
                module.fused = bool(on)  # on its Triton path

    def check_tokens(self, tokens: torch.Tensor) -> None:
        if tokens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"tokens must be an integer tensor, got {tokens.dtype}")
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= self.cfg.vocab):
            raise ValueError(f"token ids must be in [0, {self.cfg.vocab})")

    def embed_tokens(self, tokens: torch.Tensor, check: bool = True) -> torch.Tensor:
        """``check=False`` skips the range check (a host sync): decode feeds the sampler's own tokens."""
        if check:
            self.check_tokens(tokens)
        return F.embedding(tokens, self.embed)

    def _run(self, tokens: torch.Tensor, ref: bool, prefix: torch.Tensor | None = None) -> torch.Tensor:
        if tokens.dim() != 2:
            raise ValueError("tokens must be an integer tensor [batch, time]")
        h = self.embed_tokens(tokens)
        if prefix is not None:  # image embeddings [batch, patches, dim] in front of the prompt
            h = torch.cat([prefix.to(h.dtype), h], dim=1)
        for block in self.blocks:
            h = block(h, ref=ref)
        h = self.norm.reference(h) if ref else self.norm(h)
        return F.linear(h, self.lm_head)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, prefix: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [batch, time, vocab] on the serving path (``prefix``: embeddings spliced in front)."""
        return self._run(tokens, ref=False, prefix=prefix)

    @torch.no_grad()
    def reference(self, tokens: torch.Tensor, prefix: torch.Tensor | None = None) -> torch.Tensor:
        return self._run(tokens, ref=True, prefix=prefix)
