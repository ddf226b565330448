"""target_stack model layers with plain torch reference paths: RMSNorm, SwiGLU MLP, MoE, sparse attention.

Each layer's ``forward`` is the serving path; ``reference`` (or a ``*_reference`` function) is the
plain, obviously-correct version that tests and the target's correctness probes compare against.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from target_stack.model.derived import DerivedWeight
from target_stack.ops.moe import (
    device_layout,
    expert_groups,
    grouped_gemm,
    grouped_gemm_weights,
    masked_dense,
    moe_reference,
    sort_pairs,
)
from target_stack.ops.moe.native import HostLayout, moe_dispatch_combine
from target_stack.ops.moe.route import MAX_TOKENS as ROUTE_KERNEL_TOKENS
from target_stack.ops.moe.route import moe_route
from target_stack.ops.moe.small_batch import MAX_TOKENS as SMALL_BATCH_TOKENS
from target_stack.ops.moe.small_batch import small_batch_experts, stack_with_shared
from target_stack.ops.norm import rms_norm
from target_stack.ops.sparse_decode import sparse_decode_attention_kernel


def kernel_on(x: torch.Tensor, flag: bool | None) -> bool:
    """A module's switch for its Triton form: True always, False never, None where ``x`` is on a GPU."""
    return x.is_cuda if flag is None else flag


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.fused: bool | None = False  # the one-launch Triton kernel (ops/norm.py): always, never, None: on a GPU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernel_on(x, self.fused):
            return rms_norm(x, self.weight, self.eps)  # one launch instead of seven
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)

    def add_forward(self, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, this norm of it): a residual stream's add and the next sublayer's norm, in one launch
        where the kernel is on and the two agree in shape and dtype (the same bits as the two ops apart)."""
        if kernel_on(h, self.fused) and h.shape == delta.shape and h.dtype == delta.dtype:
            y, h = rms_norm(h, self.weight, self.eps, residual=delta)
            return h, y
        h = h + delta
        return h, self(h)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        xd = x.double()
        return (xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + self.eps) * self.weight.double()).to(x.dtype)


class SwiGLU(torch.nn.Module):
    """The dense MLP (first layer) and each expert: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int, generator: torch.Generator | None = None):
        super().__init__()
        s = dim**-0.5
        self.w_gate = torch.nn.Parameter(torch.randn(hidden, dim, generator=generator) * s)
        self.w_up = torch.nn.Parameter(torch.randn(hidden, dim, generator=generator) * s)
        self.w_down = torch.nn.Parameter(torch.randn(dim, hidden, generator=generator) * hidden**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, self.w_gate)) * F.linear(x, self.w_up), self.w_down)


def _stack_small(parts: list[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate/up, down) of the experts and the shared expert, from their (w_gate, w_up, w_down) in turn."""
    return stack_with_shared(parts[0::3], parts[1::3], parts[2::3], dtype)


def _stack_experts(parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 [E, H, D], [E, H, D], [E, D, H] from each expert's (w_gate, w_up, w_down) in turn."""
    return tuple(torch.stack([w.float() for w in parts[i::3]]).contiguous() for i in range(3))


def _stack_grouped(parts: list[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouped GEMMs' (gate/up, down) layout in ``dtype``, from the same parts (stacked in the weights'
    own dtype: no fp32 copy of every expert on the way)."""
    return grouped_gemm_weights(*(torch.stack(parts[i::3]) for i in range(3)), dtype)


class MoE(torch.nn.Module):
    """Sigmoid-routed top-k mixture of SwiGLU experts plus one shared expert.

    The layer routes and chooses; the combine forms are the MoE op's (``target_stack/ops/moe``):
    ``forward`` groups tokens by expert (grouped GEMMs on a GPU in bf16, else one matmul chain per
    expert group), or runs the native extension (``backend='native'``); ``forward_static`` never
    synchronises with the host (CUDA-graph decode); ``reference`` is the op's definition.
    """

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int, generator: torch.Generator | None = None,
                 backend: str = "torch"):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={n_experts}], got {top_k}")
        if backend not in ("torch", "native"):
            raise ValueError(f"MoE backend must be 'torch' or 'native', got {backend!r}")
        self.top_k = top_k
        self.backend = backend  # 'native': the compiled dispatch/expert/combine step on CPU fp32 inputs
        self.grouped = True  # False: the per-expert loop even where grouped GEMMs work (a plain-eager baseline)
        self.fused: bool | None = False  # the one-launch router (ops/moe/route.py): always, never, None: on a GPU
        # the two-launch experts of a decode-sized batch (ops/moe/small_batch.py), in forward_static: always,
        # never, None: on a GPU (set with the fused kernels: a graph-captured decode step 0.85x on the H200)
        self.small_batch: bool | None = False
        # and their form (ops/moe/small_batch.py): "token" (a program per token and slot) or "expert" (a program
        # per expert and tile, each expert's rows read once; untimed on a GPU so far, so not the default)
        self.small_batch_form = "token"
        self._small_cache = DerivedWeight(_stack_small)
        self._stacked = DerivedWeight(_stack_experts)
        self._grouped_cache = DerivedWeight(_stack_grouped)
        self._host_layout: HostLayout | None = None
        self.router = torch.nn.Parameter(torch.randn(n_experts, dim, generator=generator) * dim**-0.5)
        self.router_bias = torch.nn.Parameter(torch.zeros(n_experts))
        self.experts = torch.nn.ModuleList(SwiGLU(dim, hidden, generator) for _ in range(n_experts))
        self.shared = SwiGLU(dim, hidden, generator)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]): sigmoid scores, top-k chosen with the bias, normalised."""
        if kernel_on(x, self.fused) and x.shape[0] <= ROUTE_KERNEL_TOKENS:
            return moe_route(x, self.router, self.router_bias, self.top_k)  # one launch instead of eleven
        scores = torch.sigmoid(F.linear(x.float(), self.router.float()))
        _, idx = torch.topk(scores + self.router_bias.float(), self.top_k, dim=-1)
        w = scores.gather(-1, idx)
        return w / w.sum(-1, keepdim=True).clamp_min(1e-9), idx

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert weights as [E, H, D], [E, H, D], [E, D, H] (cached; rebuilt if a weight changes)."""
        return self._stacked(self._parts(self.experts))

    @staticmethod
    def _parts(mods) -> list[torch.Tensor]:
        """Each module's (w_gate, w_up, w_down) in turn: the parts a derived weight is keyed on."""
        return [w for m in mods for w in (m.w_gate, m.w_up, m.w_down)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        w, idx = self.route(x2)
        if self.backend == "native" and x.is_cuda:
            return (self._native_cuda(x2, w, idx) + self.shared(x2).float()).to(x.dtype).reshape(shape)
        if self.backend == "native" and x.device.type == "cpu" and x.dtype == torch.float32:
            # one call per layer, as a fused MoE kernel is: the whole batch's dispatch, experts, combine
            out = moe_dispatch_combine(x2, idx, w, *self.stacked_weights())
            return (out + self.shared(x2).float()).reshape(shape)
        if self.grouped and self._grouped_ok(x2):  # a GPU in bf16: two grouped GEMMs, no host sync
            out = self._grouped(x2, w, idx)
        else:
            order, ends = sort_pairs(idx, len(self.experts))
            out = expert_groups(x2, w, order, ends, self.experts, self.top_k)
        out += self.shared(x2).float()
        return out.to(x.dtype).reshape(shape)

    def _native_cuda(self, x2: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The GPU prefill's MoE over the native extension's host-made layout; the experts run on their
        contiguous groups (grouped GEMMs where they work: a few launches per layer)."""
        if self._host_layout is None:
            self._host_layout = HostLayout()
        order, ends = self._host_layout(idx, len(self.experts))
        if self._grouped_ok(x2):
            offs = ends.to(x2.device, non_blocking=True).to(torch.int32)
            return grouped_gemm(x2, w, order, offs, *self._grouped_weights(x2.dtype), self.top_k)
        # the group ends are already on the host: no device sync before the expert launches
        return expert_groups(x2, w, order, ends.tolist(), self.experts, self.top_k)

    def forward_static(self, x: torch.Tensor) -> torch.Tensor:
        """The MoE with no host synchronisation, for decode steps captured in a CUDA graph: grouped
        GEMMs with device-side offsets where ``torch._grouped_mm`` works (bf16, Hopper), else every
        expert on every token, masked."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        w, idx = self.route(x2)
        if kernel_on(x, self.small_batch) and x2.shape[0] <= SMALL_BATCH_TOKENS:
            # the chosen experts and the shared one in two launches instead of about seventeen
            return small_batch_experts(x2, w, idx, *self._small_weights(x2.dtype), out_dtype=x.dtype,
                                       form=self.small_batch_form).reshape(shape)
        out = self._grouped(x2, w, idx) if self._grouped_ok(x2) else masked_dense(x2, w, idx, *self.stacked_weights())
        out += self.shared(x2).float()
        return out.to(x.dtype).reshape(shape)

    def _small_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts and the shared expert stacked for the small-batch kernels (remade per dtype and
        on any weight change)."""
        return self._small_cache(self._parts([*self.experts, self.shared]), dtype)

    def _grouped_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts laid out for the grouped GEMMs (remade per dtype and on any weight change)."""
        return self._grouped_cache(self._parts(self.experts), dtype)

    def _grouped(self, x2: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        order, offs = device_layout(idx, len(self.experts))
        return grouped_gemm(x2, w, order, offs, *self._grouped_weights(x2.dtype), self.top_k)

    def _grouped_ok(self, x2: torch.Tensor) -> bool:
        """Whether the grouped-GEMM form works here: checked once per device and dtype against the
        masked dense form (a private torch API: verify, never assume)."""
        if not (x2.is_cuda and x2.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")):
            return False
        key = (x2.device, x2.dtype)
        cache = MoE._grouped_support
        if key not in cache:
            try:
                probe = torch.randn(8, x2.shape[-1], device=x2.device, dtype=x2.dtype)
                w, idx = self.route(probe)
                got = self._grouped(probe, w, idx)
                ref = masked_dense(probe, w, idx, *self.stacked_weights())
                cache[key] = bool(((got - ref).norm() / ref.norm().clamp_min(1e-6)) < 2e-2)
            except Exception:  # noqa: BLE001 - unsupported here: the dense form it is
                cache[key] = False
        return cache[key]

    _grouped_support: dict = {}

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        w, idx = self.route(x2)
        out = moe_reference(x2, w, idx, self.experts) + self.shared(x2).float()
        return out.to(x.dtype).reshape(x.shape)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx_q: torch.Tensor, idx_k: torch.Tensor,
                     block: int, top_k: int, window: int) -> torch.Tensor:
    """Causal block-sparse attention for one sequence: q [Tq, H, D], idx_q [Tq, Di] for the last Tq
    of the Tk positions of k, v [Tk, H, D], idx_k [Tk, Di] (Tq < Tk: a prefill after a reused prefix).

    An indexer scores each key block for each query (max over the block of idx_q . idx_k);
    each query attends to its top_k highest-scoring causal blocks plus a local window of
    ``window`` tokens.  With Tk <= top_k * block every causal key is kept: it equals dense.
    """
    Tq, H, D = q.shape
    T = k.shape[0]
    if Tq > T:
        raise ValueError(f"{Tq} queries for {T} keys: queries must be the last positions of the keys")
    nb = math.ceil(T / block)
    pos = torch.arange(T, device=q.device)
    qpos = pos[T - Tq:]
    causal = pos[None, :] <= qpos[:, None]  # [Tq, Tk]
    scores = (idx_q.float() @ idx_k.float().t()).masked_fill(~causal, float("-inf"))  # [Tq, Tk]
    pad = nb * block - T
    blk = F.pad(scores, (0, pad), value=float("-inf")).reshape(Tq, nb, block).amax(-1)  # [Tq, nb]
    keep_blocks = torch.zeros(Tq, nb, dtype=torch.bool, device=q.device)
    k_sel = min(top_k, nb)
    top = torch.topk(blk, k_sel, dim=-1).indices
    keep_blocks.scatter_(1, top, True)
    keep_blocks &= torch.isfinite(blk)
    keep = keep_blocks.repeat_interleave(block, dim=1)[:, :T]
    keep |= (qpos[:, None] - pos[None, :] < window) & causal
    keep &= causal
    att = torch.einsum("qhd,khd->hqk", q.float(), k.float()) / math.sqrt(D)
    att = att.masked_fill(~keep[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(att, dim=-1), v.float()).to(q.dtype)


def sparse_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx_q: torch.Tensor,
                            idx_k: torch.Tensor, lengths: torch.Tensor, block: int, top_k: int,
                            window: int, fused: bool | None = False) -> torch.Tensor:
    """The last row of :func:`sparse_attention` for a batch of sequences of different lengths.

    q [B, H, D] and idx_q [B, Di] belong to each sequence's newest token at position lengths - 1;
    k, v [B, L, H, D] and idx_k [B, L, Di] hold its keys, padded past ``lengths`` (ignored).
    No host synchronisation: a decode step stays capturable in a CUDA graph.  ``fused``: the two-launch
    Triton form (``ops/sparse_decode.py``) always, never, or (None) on a GPU.
    """
    if kernel_on(q, fused):
        return sparse_decode_attention_kernel(q, k, v, idx_q, idx_k, lengths, block, top_k, window)
    B, L, H, D = k.shape
    nb = math.ceil(L / block)
    pos = torch.arange(L, device=q.device)
    valid = pos[None, :] < lengths[:, None]  # [B, L]
    scores = torch.einsum("bd,bld->bl", idx_q.float(), idx_k.float()).masked_fill(~valid, float("-inf"))
    blk = F.pad(scores, (0, nb * block - L), value=float("-inf")).reshape(B, nb, block).amax(-1)
    top = torch.topk(blk, min(top_k, nb), dim=-1).indices
    keep_blocks = torch.zeros(B, nb, dtype=torch.bool, device=q.device).scatter_(1, top, True)
    keep_blocks &= torch.isfinite(blk)
    keep = keep_blocks.repeat_interleave(block, dim=1)[:, :L]
    keep |= (lengths[:, None] - 1 - pos[None, :]) < window
    keep &= valid
    att = torch.einsum("bhd,blhd->bhl", q.float(), k.float()) / math.sqrt(D)
    att = att.masked_fill(~keep[:, None, :], float("-inf"))
    return torch.einsum("bhl,blhd->bhd", torch.softmax(att, dim=-1), v.float()).to(q.dtype)


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The reference: plain causal softmax attention in float64."""
    T, H, D = q.shape
    att = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / math.sqrt(D)
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    att = att.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(att, dim=-1), v.double()).to(q.dtype)
