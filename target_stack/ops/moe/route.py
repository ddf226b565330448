"""The MoE router in two Triton launches: scores, top-k choice and normalised weights.

    scores = sigmoid(x @ router^T)                      (fp32, [T, E])
    idx    = top-k of (scores + bias)                   (the bias steers the choice only)
    w      = scores[idx] / sum(scores[idx])             (the weights use the unbiased scores)

In torch this is eleven launches per MoE layer (the casts of x, the router and the bias to fp32, the
product, the sigmoid, the add, the top-k, the gather, the sum, the clamp, the division): a decode step at
batch 1 runs one router per MoE layer around almost no work, which is what bounds it
(``bench/decode_ops.py`` counts them). The product is split over the model dimension: one program per
(token, slice of BD model dimensions) reads its [E, BD] slice of the router and writes E partial scores in
fp32, so a batch of one token still spreads the router's bytes over many multiprocessors (one program per
token read all of it alone: 17 us per layer on the H200, 4 us now for the two launches,
``bench/decode_profile.py``). Then one program per token sums its partials in a fixed order (the same scores
every run: no atomics), and picks the k largest by repeated arg-max (ties: the lower expert id, as
``torch.topk`` on a sorted order does in practice). Each token re-reads the router, so the layer uses this
form for decode-sized batches only (``MAX_TOKENS``); a prefill's matmul form reads it once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from target_stack.ops.utils import CachedLaunch, alloc

MAX_TOKENS = 512  # above this a prefill's batched matmul reads the router once and wins


@triton.jit
def _scores_kernel(x, router, part, D, E: tl.constexpr, BE: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    n_s = tl.num_programs(1)
    o_e = tl.arange(0, BE)
    m_e = o_e < E
    o_d = s * BD + tl.arange(0, BD)
    m_d = o_d < D
    xv = tl.load(x + t * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    wv = tl.load(router + o_e[:, None] * D + o_d[None, :], mask=m_e[:, None] & m_d[None, :], other=0.0)
    tl.store(part + (t * n_s + s) * BE + o_e, tl.sum(wv.to(tl.float32) * xv[None, :], axis=1))


@triton.jit
def _pick_kernel(part, bias, w_out, idx_out, S, E: tl.constexpr, BE: tl.constexpr, BS: tl.constexpr,
                 TOPK: tl.constexpr, BK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    o_e = tl.arange(0, BE)
    m_e = o_e < E
    o_s = tl.arange(0, BS)
    acc = tl.zeros([BE], dtype=tl.float32)
    for s0 in range(0, S, BS):  # the partials in slice order: the same sum every run
        m_s = (s0 + o_s) < S
        acc += tl.sum(tl.load(part + (t * S + s0 + o_s[:, None]) * BE + o_e[None, :], mask=m_s[:, None], other=0.0),
                      axis=0)
    scores = tl.sigmoid(acc)
    pick = tl.where(m_e, scores + tl.load(bias + o_e, mask=m_e, other=0.0).to(tl.float32), float("-inf"))
    o_k = tl.arange(0, BK)
    ids = tl.zeros([BK], dtype=tl.int64)
    ws = tl.zeros([BK], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        best = tl.argmax(pick, axis=0)
        ids = tl.where(o_k == j, best.to(tl.int64), ids)
        ws = tl.where(o_k == j, tl.sum(tl.where(o_e == best, scores, 0.0), axis=0), ws)
        pick = tl.where(o_e == best, float("-inf"), pick)
    ws = ws / tl.maximum(tl.sum(ws, axis=0), 1e-9)
    tl.store(w_out + t * TOPK + o_k, ws, mask=o_k < TOPK)
    tl.store(idx_out + t * TOPK + o_k, ids, mask=o_k < TOPK)


_scores = CachedLaunch(_scores_kernel)
_pick = CachedLaunch(_pick_kernel)


def moe_route(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, top_k: int) -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k] int64) for x [T, D], router [E, D], bias [E], in two launches."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, D], got shape {tuple(x.shape)}")
    T, D = x.shape
    E = router.shape[0]
    if router.shape != (E, D) or bias.shape != (E,):
        raise ValueError(f"router must be [E, {D}] and bias [E], got {tuple(router.shape)} and {tuple(bias.shape)}")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be in [1, E={E}], got {top_k}")
    x, router, bias = x.contiguous(), router.contiguous(), bias.contiguous()
    w = alloc(T, top_k, dtype=torch.float32, device=x.device)
    idx = alloc(T, top_k, dtype=torch.int64, device=x.device)
    if T:
        BE = max(triton.next_power_of_2(E), 2)
        BD = max(16, min(triton.next_power_of_2(D), 4096 // BE))  # an [E, BD] slice of the router per program
        S = triton.cdiv(D, BD)
        part = alloc(T, S, BE, dtype=torch.float32, device=x.device)
        key = (D, E, top_k, x.dtype, router.dtype, bias.dtype, x.device)
        _scores((T, S, 1), key, (x, router, part, D), dict(E=E, BE=BE, BD=BD, num_warps=4 if BE * BD >= 2048 else 1))
        _pick((T, 1, 1), key, (part, bias, w, idx, S),
              dict(E=E, BE=BE, BS=min(triton.next_power_of_2(S), max(1, 4096 // BE)), TOPK=top_k,
                   BK=max(triton.next_power_of_2(top_k), 2), num_warps=1 if BE <= 64 else 4))
    return w, idx
