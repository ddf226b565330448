"""Block-sparse decode attention in two Triton launches: the GPU form of ``sparse_decode_attention``.

For each sequence b of a decode batch (its newest token at position lengths[b] - 1, keys padded past
lengths[b]):

1. ``_select_blocks_kernel`` (one program per sequence): the indexer score of every key,
   idx_q[b] . idx_k[b, l], its maximum over each key block, and the blocks to keep: the top_k highest
   (ties: the lower block index), never one without a valid key.
2. ``_attend_kernel`` (one program per sequence and head): softmax(q . k / sqrt(D)) v over the keys of
   the kept blocks and of the last ``window`` positions, online over one key block at a time; a block
   that is neither kept nor in the window is skipped, never read.

In torch the same takes about thirty launches per layer (the scores, the block maxima, the top-k, the
scatter, the masks, the two einsums, the softmax, the casts), each a few microseconds around little
work at decode sizes (``bench/decode_ops.py`` counts them).  Everything accumulates in fp32; the output
is written in q's dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from target_stack.ops.utils import alloc


@triton.jit
def _select_blocks_kernel(idx_q, idx_k, lengths, keep, L, NB, top_k, s_iq, DI: tl.constexpr, BLOCK: tl.constexpr,
                          BL: tl.constexpr, BDI: tl.constexpr, BNB: tl.constexpr, BM: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    n_len = tl.load(lengths + b).to(tl.int64)
    o_l = tl.arange(0, BL)
    o_d = tl.arange(0, BDI)
    m_d = o_d < DI
    b_iq = tl.load(idx_q + b * s_iq + o_d, mask=m_d, other=0.0).to(tl.float32)
    o_n = tl.arange(0, BNB)
    blk = tl.full([BNB], float("-inf"), dtype=tl.float32)
    for n in range(0, NB):
        pos = n * BLOCK + o_l
        m_l = (o_l < BLOCK) & (pos < n_len) & (pos < L)
        b_ik = tl.load(idx_k + (b * L + pos)[:, None] * DI + o_d[None, :], mask=m_l[:, None] & m_d[None, :],
                       other=0.0).to(tl.float32)
        s = tl.where(m_l, tl.sum(b_ik * b_iq[None, :], axis=1), float("-inf"))
        blk = tl.where(o_n == n, tl.max(s, axis=0), blk)
    # rank of each block: how many blocks beat it (higher, or equal with a lower index)
    rank = tl.zeros([BNB], dtype=tl.int32)
    for m0 in range(0, NB, BM):
        o_m = m0 + tl.arange(0, BM)
        blk_m = tl.sum(tl.where(o_n[None, :] == o_m[:, None], blk[None, :], 0.0), axis=1)
        blk_m = tl.where(o_m < NB, blk_m, float("-inf"))
        beats = (blk_m[None, :] > blk[:, None]) | ((blk_m[None, :] == blk[:, None]) & (o_m[None, :] < o_n[:, None]))
        rank += tl.sum((beats & (o_m < NB)[None, :]).to(tl.int32), axis=1)
    kept = (rank < top_k) & (blk > float("-inf"))
    tl.store(keep + b * NB + o_n, kept.to(tl.float32), mask=o_n < NB)


@triton.jit
def _attend_kernel(q, k, v, keep, lengths, o, L, NB, window, sm_scale, s_q, H: tl.constexpr, D: tl.constexpr,
                   BLOCK: tl.constexpr, BL: tl.constexpr, BD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    n_len = tl.load(lengths + b).to(tl.int64)
    o_l = tl.arange(0, BL)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_q = tl.load(q + b * s_q + h * D + o_d, mask=m_d, other=0.0).to(tl.float32) * sm_scale
    m_run = tl.full([1], -1.0e30, dtype=tl.float32)
    l_run = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([BD], dtype=tl.float32)
    for n in range(0, NB):
        first = n * BLOCK
        kept = tl.load(keep + b * NB + n) > 0.5
        in_window = first + BLOCK - 1 >= n_len - window
        if (kept | in_window) & (first < n_len):
            pos = first + o_l
            kept_l = tl.load(keep + b * NB + n + 0 * o_l) > 0.5  # (as a vector: the interpreter broadcasts no scalar)
            m_l = (o_l < BLOCK) & (pos < n_len) & (pos < L) & (kept_l | (n_len - 1 - pos < window))
            off = ((b * L + pos) * H + h)[:, None] * D + o_d[None, :]
            m_ld = m_l[:, None] & m_d[None, :]
            b_k = tl.load(k + off, mask=m_ld, other=0.0).to(tl.float32)
            s = tl.where(m_l, tl.sum(b_k * b_q[None, :], axis=1), float("-inf"))
            m_new = tl.maximum(m_run, tl.max(s, axis=0))
            p = tl.exp(s - m_new)
            alpha = tl.exp(m_run - m_new)
            b_v = tl.load(v + off, mask=m_ld, other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * b_v, axis=0)
            l_run = l_run * alpha + tl.sum(p, axis=0)
            m_run = m_new
    tl.store(o + (b * H + h) * D + o_d, (acc / l_run).to(o.dtype.element_ty), mask=m_d)


def sparse_decode_attention_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx_q: torch.Tensor,
                                   idx_k: torch.Tensor, lengths: torch.Tensor, block: int, top_k: int,
                                   window: int) -> torch.Tensor:
    """:func:`target_stack.model.layers.sparse_decode_attention` in two launches (same arguments and result)."""
    B, L, H, D = k.shape
    Di = idx_k.shape[-1]
    if q.shape != (B, H, D) or v.shape != k.shape or idx_q.shape != (B, Di) or idx_k.shape != (B, L, Di):
        raise ValueError(f"shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, idx_q "
                         f"{tuple(idx_q.shape)}, idx_k {tuple(idx_k.shape)} (want [B, H, D], [B, L, H, D] x2, "
                         "[B, Di], [B, L, Di])")
    if lengths.shape != (B,) or block < 1 or top_k < 1 or window < 1:
        raise ValueError(f"lengths must be [B]={B}, block, top_k and window at least 1; got lengths "
                         f"{tuple(lengths.shape)}, block {block}, top_k {top_k}, window {window}")
    # q and idx_q may be read in place where each sequence's row is contiguous (slices of one projection);
    # the cached keys are gathered contiguous anyway
    q = q if q.stride(-1) == 1 and q.stride(1) == D else q.contiguous()
    idx_q = idx_q if idx_q.stride(-1) == 1 else idx_q.contiguous()
    k, v, idx_k = (t.contiguous() for t in (k, v, idx_k))
    NB = math.ceil(L / block)
    keep = alloc(B, NB, dtype=torch.float32, device=q.device)
    o = alloc(B, H, D, dtype=q.dtype, device=q.device)
    if B == 0:
        return o
    BL = max(triton.next_power_of_2(block), 16)
    BNB = max(triton.next_power_of_2(NB), 16)
    _select_blocks_kernel[(B,)](idx_q, idx_k, lengths, keep, L, NB, top_k, idx_q.stride(0), DI=Di, BLOCK=block, BL=BL,
                                BDI=max(triton.next_power_of_2(Di), 16), BNB=BNB, BM=min(BNB, 32), num_warps=4)
    _attend_kernel[(B, H)](q, k, v, keep, lengths, o, L, NB, window, 1.0 / math.sqrt(D), q.stride(0), H=H, D=D,
                           BLOCK=block, BL=BL, BD=max(triton.next_power_of_2(D), 16), num_warps=4)
    return o
