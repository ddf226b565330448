"""The KDA layer's decode-step inputs in one Triton launch: short convolution, SiLU, q/k L2 norms, gates.

For one token per sequence, from the layer's three projections of it (``pre = W_qkv x``, ``f = W_f x``,
``b = W_b x``) and the convolution tails in the slot pool, this computes what the decode kernel takes::

    window  = [tail_0, tail_1, tail_2, pre]              per channel, the last CONV inputs
    q, k, v = silu(sum_j window_j * conv_w[:, j])        q and k then L2-normalised per head
    g       = -exp(A_log) * softplus(f + dt_bias)        the per-channel log decay, fp32
    beta    = sigmoid(b)                                  fp32

and shifts the tails in place (``[tail_1, tail_2, pre]``).  In torch this is ~22 launches per layer
(the gather of the tails, concatenation, unfold, products, sum, SiLU, two normalisations, the gates,
the write-back), each a few microseconds around almost no work: one program per (sequence, head)
does it all in fp32.  Slot 0 is the null slot: rows that point at it (padding) read zero tails and
write nothing.  ``KDALayer._inputs`` is the same maths in torch (the CPU path and the prefill).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from target_stack.ops.utils import CachedLaunch

CONV = 4  # the convolution's width: three tail inputs and the token's own


@triton.jit
def _conv_silu(pre, sp, pool, cw, row, slot, ch, m, C: tl.constexpr):
    """The convolution over one head's channels ``ch`` and the tail shift; returns silu(conv) in fp32."""
    cur = tl.load(pre + row * sp + ch, mask=m, other=0.0).to(tl.float32)
    live = m & (ch * 0 + slot > 0)  # the null slot: zero tails, nothing written
    t0 = tl.load(pool + (slot * 3 + 0) * C + ch, mask=live, other=0.0)
    t1 = tl.load(pool + (slot * 3 + 1) * C + ch, mask=live, other=0.0)
    t2 = tl.load(pool + (slot * 3 + 2) * C + ch, mask=live, other=0.0)
    acc = (t0.to(tl.float32) * tl.load(cw + ch * 4 + 0, mask=m, other=0.0).to(tl.float32)
           + t1.to(tl.float32) * tl.load(cw + ch * 4 + 1, mask=m, other=0.0).to(tl.float32)
           + t2.to(tl.float32) * tl.load(cw + ch * 4 + 2, mask=m, other=0.0).to(tl.float32)
           + cur * tl.load(cw + ch * 4 + 3, mask=m, other=0.0).to(tl.float32))
    tl.store(pool + (slot * 3 + 0) * C + ch, t1, mask=live)
    tl.store(pool + (slot * 3 + 1) * C + ch, t2, mask=live)
    tl.store(pool + (slot * 3 + 2) * C + ch, cur.to(pool.dtype.element_ty), mask=live)
    return acc * tl.sigmoid(acc)


@triton.jit
def _decode_inputs_kernel(pre, f, b, pool, slots, cw, dt_bias, a_log, q, k, v, g, beta, sp, sf, sb,
                          H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                          BV: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(slots + row).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    bq = _conv_silu(pre, sp, pool, cw, row, slot, h * K + o_k, m_k, C)
    bk = _conv_silu(pre, sp, pool, cw, row, slot, H * K + h * K + o_k, m_k, C)
    bv = _conv_silu(pre, sp, pool, cw, row, slot, 2 * H * K + h * V + o_v, m_v, C)
    # F.normalize: x / max(||x||, 1e-12)
    bq = bq / tl.maximum(tl.sqrt(tl.sum(bq * bq, axis=0)), 1e-12)
    bk = bk / tl.maximum(tl.sqrt(tl.sum(bk * bk, axis=0)), 1e-12)
    tl.store(q + (row * H + h) * K + o_k, bq.to(q.dtype.element_ty), mask=m_k)
    tl.store(k + (row * H + h) * K + o_k, bk.to(k.dtype.element_ty), mask=m_k)
    tl.store(v + (row * H + h) * V + o_v, bv.to(v.dtype.element_ty), mask=m_v)
    bf = (tl.load(f + row * sf + h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
          + tl.load(dt_bias + h * K + o_k, mask=m_k, other=0.0).to(tl.float32))
    softplus = tl.where(bf > 20.0, bf, tl.log(1.0 + tl.exp(bf)))  # torch's threshold
    decay = -tl.exp(tl.load(a_log + h).to(tl.float32)) * softplus
    tl.store(g + (row * H + h) * K + o_k, decay, mask=m_k)
    tl.store(beta + row * H + h, tl.sigmoid(tl.load(b + row * sb + h).to(tl.float32)))


_launch = CachedLaunch(_decode_inputs_kernel)


def kda_decode_inputs(pre: torch.Tensor, f: torch.Tensor, b: torch.Tensor, conv_pool: torch.Tensor,
                      slots: torch.Tensor, conv_w: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
                      heads: int, head_k: int, head_v: int):
    """(q, k, v [N, 1, H, K|V] in pre's dtype, g [N, 1, H, K] fp32, beta [N, 1, H] fp32) for one decode step.

    ``pre`` [N, C] (or [N, 1, C]), ``f`` [N, H*K], ``b`` [N, H] (each row contiguous, the rows may lie
    apart: slices of one wider product are read in place); ``conv_pool`` [slots, CONV-1, C], updated in
    place at ``slots`` (int [N]; 0: padding, read as zeros, never written); ``conv_w`` [C, CONV],
    ``dt_bias`` [H*K], ``a_log`` [H]."""
    H, K, V = heads, head_k, head_v
    N, C = slots.shape[0], H * (2 * K + V)
    pre, f, b = pre.reshape(N, C), f.reshape(N, H * K), b.reshape(N, H)
    if conv_pool.shape[1:] != (CONV - 1, C) or not conv_pool.is_contiguous():
        raise ValueError(f"conv_pool must be a contiguous [slots, {CONV - 1}, {C}] tensor, got "
                         f"{tuple(conv_pool.shape)}")
    if conv_w.shape != (C, CONV):
        raise ValueError(f"conv_w must be [{C}, {CONV}], got {tuple(conv_w.shape)}")
    # the rows of pre, f and b may be strided (views of one product of the layer's concatenated weights)
    pre, f, b = (t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous() for t in (pre, f, b))
    conv_w = conv_w.contiguous()
    strides = tuple(t.stride(0) if N > 1 else t.shape[1] for t in (pre, f, b))
    dev = pre.device
    q = torch.empty(N, 1, H, K, dtype=pre.dtype, device=dev)
    k = torch.empty_like(q)
    v = torch.empty(N, 1, H, V, dtype=pre.dtype, device=dev)
    g = torch.empty(N, 1, H, K, dtype=torch.float32, device=dev)
    beta = torch.empty(N, 1, H, dtype=torch.float32, device=dev)
    if N:
        key = (N, H, K, V, strides, pre.dtype, f.dtype, b.dtype, conv_pool.dtype, conv_w.dtype, slots.dtype, dev)
        BK, BV = triton.next_power_of_2(K), triton.next_power_of_2(V)
        _launch((N, H, 1), key, (pre, f, b, conv_pool, slots, conv_w, dt_bias, a_log, q, k, v, g, beta, *strides),
                dict(H=H, K=K, V=V, C=C, BK=BK, BV=BV, num_warps=1 if max(BK, BV) <= 128 else 4))
    return q, k, v, g, beta
