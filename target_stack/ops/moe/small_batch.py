"""The MoE's experts for a decode-sized batch in two Triton launches: every chosen expert and the
shared expert, SwiGLU and the weighted combine.

    act[t, j] = w[t, j] * silu(W_gate[e] x[t]) * (W_up[e] x[t])      e = idx[t, j]; j = k: the shared expert, w = 1
    out[t]    = sum_j W_down[e] act[t, j]

A decode step at batch 1 runs, per MoE layer, a dozen launches around a few matrix-vector products in
torch: the pairs' layout, the gathers, two grouped GEMMs, the activation, the combine, and the shared
expert's three products and its activation (``bench/decode_ops.py`` counts them).  Here one program per
(token, expert slot, tile of the hidden size) reads its expert's gate and up rows once and writes the
scaled activation; then one program per (token, tile of the model dimension) reads the down rows of the
token's k + 1 experts and sums.  Every program re-reads its experts' weights, so the layer uses this form
for small batches only (``MAX_TOKENS``): at a larger batch the grouped GEMMs read each expert once.

The expert weights are stacked with the shared expert last (:func:`stack_with_shared`), in the dtype of
the activations; accumulation is fp32.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from target_stack.ops.utils import CachedLaunch, alloc, interpreting

MAX_TOKENS = 16  # above this the grouped GEMMs read each expert's weights once and win

#: the expert form's (BH, BD) of its gate/up kernel, (BD, BH) of its down kernel and their warps: a first
#: guess, NOT yet timed on a GPU (bench/small_batch_tiles.py times it and a few neighbours beside the token form)
EXPERT_TILES = (32, 128, 64, 128, 4, 4)


@triton.jit
def _swiglu(g, u):
    """SiLU of the gate times the up projection."""
    return g * tl.sigmoid(g) * u


@triton.jit
def _gate_up_kernel(x, w, idx, w_gu, act, D, H, E, TOPK: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)  # a (token, slot) pair; slot TOPK is the shared expert
    i_h = tl.program_id(1)
    t = p // (TOPK + 1)
    j = p % (TOPK + 1)
    routed = j < TOPK
    e = tl.where(routed, tl.load(idx + t * TOPK + j, mask=routed, other=0), E).to(tl.int64)
    scale = tl.where(routed, tl.load(w + t * TOPK + j, mask=routed, other=0.0).to(tl.float32), 1.0)
    o_h = i_h * BH + tl.arange(0, BH)
    m_h = o_h < H
    acc_g = tl.zeros([BH], dtype=tl.float32)
    acc_u = tl.zeros([BH], dtype=tl.float32)
    for d0 in range(0, D, BD):
        o_d = d0 + tl.arange(0, BD)
        m_d = o_d < D
        xv = tl.load(x + t * D + o_d, mask=m_d, other=0.0).to(tl.float32)
        m = m_h[:, None] & m_d[None, :]
        rows = (e * 2 * H + o_h[:, None]) * D + o_d[None, :]  # [gate; up] of expert e: [2H, D]
        acc_g += tl.sum(tl.load(w_gu + rows, mask=m, other=0.0).to(tl.float32) * xv[None, :], axis=1)
        acc_u += tl.sum(tl.load(w_gu + rows + H * D, mask=m, other=0.0).to(tl.float32) * xv[None, :], axis=1)
    a = _swiglu(acc_g, acc_u) * scale
    tl.store(act + p * H + o_h, a, mask=m_h)


@triton.jit
def _down_kernel(act, idx, w_down, out, D, H, E, TOPK: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    i_d = tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    acc = tl.zeros([BD], dtype=tl.float32)
    for j in tl.static_range(TOPK + 1):
        if j < TOPK:  # noqa: SIM108 - a static branch: the shared slot loads no id
            e = tl.load(idx + t * TOPK + j).to(tl.int64)
        else:
            e = t * 0 + E  # the shared expert (an int64 scalar, as the loaded ids are)
        for h0 in range(0, H, BH):
            o_h = h0 + tl.arange(0, BH)
            m_h = o_h < H
            a = tl.load(act + (t * (TOPK + 1) + j) * H + o_h, mask=m_h, other=0.0)
            wd = tl.load(w_down + (e * D + o_d[:, None]) * H + o_h[None, :], mask=m_d[:, None] & m_h[None, :],
                         other=0.0)
            acc += tl.sum(wd.to(tl.float32) * a[None, :], axis=1)
    tl.store(out + t * D + o_d, acc.to(out.dtype.element_ty), mask=m_d)  # rounded once, to the output's dtype


@triton.jit
def _pair_experts(idx, e, R, E, TOPK: tl.constexpr, RP: tl.constexpr):
    """The (token, slot) pairs r < R (slot TOPK: the shared expert E) and which of them expert ``e`` serves."""
    r = tl.arange(0, RP)
    t = r // (TOPK + 1)
    j = r % (TOPK + 1)
    routed = (j < TOPK) & (r < R)
    ids = tl.where(routed, tl.load(idx + t * TOPK + j, mask=routed, other=-1).to(tl.int64), E)
    return r, t, j, routed, (ids == e) & (r < R)


@triton.jit
def _gate_up_by_expert_kernel(x, w, idx, w_gu, act, R, D, H, E, TOPK: tl.constexpr, RP: tl.constexpr,
                              BH: tl.constexpr, BD: tl.constexpr, LOWP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One program per (expert, hidden tile): its gate and up rows read once for every pair it serves."""
    e = tl.program_id(0).to(tl.int64)  # E: the shared expert
    i_h = tl.program_id(1)
    r, t, j, routed, hit = _pair_experts(idx, e, R, E, TOPK, RP)
    if tl.sum(hit.to(tl.int32), axis=0) > 0:  # an expert no token chose reads nothing
        scale = tl.where(routed, tl.load(w + t * TOPK + j, mask=routed & hit, other=0.0).to(tl.float32), 1.0)
        o_h = i_h * BH + tl.arange(0, BH)
        m_h = o_h < H
        acc_g = tl.zeros([RP, BH], dtype=tl.float32)
        acc_u = tl.zeros([RP, BH], dtype=tl.float32)
        for d0 in range(0, D, BD):
            o_d = d0 + tl.arange(0, BD)
            m_d = o_d < D
            xs = tl.load(x + t[:, None] * D + o_d[None, :], mask=hit[:, None] & m_d[None, :], other=0.0)  # [RP, BD]
            rows = (e * 2 * H + o_h[None, :]) * D + o_d[:, None]  # [BD, BH]: the gate rows, transposed
            m = m_d[:, None] & m_h[None, :]
            wg = tl.load(w_gu + rows, mask=m, other=0.0)
            wu = tl.load(w_gu + rows + H * D, mask=m, other=0.0)
            if LOWP:  # 16-bit activations and weights of one dtype: the product takes them as they are
                acc_g += tl.dot(xs, wg, input_precision=DOT_PRECISION)
                acc_u += tl.dot(xs, wu, input_precision=DOT_PRECISION)
            else:
                xs = xs.to(tl.float32)
                acc_g += tl.dot(xs, wg.to(tl.float32), input_precision=DOT_PRECISION)
                acc_u += tl.dot(xs, wu.to(tl.float32), input_precision=DOT_PRECISION)
        a = _swiglu(acc_g, acc_u) * scale[:, None]
        tl.store(act + r[:, None] * H + o_h[None, :], a, mask=hit[:, None] & m_h[None, :])


@triton.jit
def _down_by_expert_kernel(act, idx, w_down, part, R, D, H, E, TOPK: tl.constexpr, RP: tl.constexpr,
                           BD: tl.constexpr, BH: tl.constexpr, LOWP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One program per (expert, model-dimension tile): its down rows read once, each pair's product stored
    in the pair's own row of ``part`` (summed per token by ``_sum_pairs_kernel``: no atomics)."""
    e = tl.program_id(0).to(tl.int64)
    i_d = tl.program_id(1)
    r, t, j, routed, hit = _pair_experts(idx, e, R, E, TOPK, RP)
    if tl.sum(hit.to(tl.int32), axis=0) > 0:
        o_d = i_d * BD + tl.arange(0, BD)
        m_d = o_d < D
        acc = tl.zeros([RP, BD], dtype=tl.float32)
        for h0 in range(0, H, BH):
            o_h = h0 + tl.arange(0, BH)
            m_h = o_h < H
            a = tl.load(act + r[:, None] * H + o_h[None, :], mask=hit[:, None] & m_h[None, :], other=0.0)  # [RP, BH]
            wd = tl.load(w_down + (e * D + o_d[None, :]) * H + o_h[:, None], mask=m_h[:, None] & m_d[None, :],
                         other=0.0)  # [BH, BD]: the down rows, transposed
            if LOWP:
                acc += tl.dot(a.to(wd.dtype), wd, input_precision=DOT_PRECISION)
            else:
                acc += tl.dot(a, wd.to(tl.float32), input_precision=DOT_PRECISION)
        tl.store(part + r[:, None] * D + o_d[None, :], acc, mask=hit[:, None] & m_d[None, :])


@triton.jit
def _sum_pairs_kernel(part, out, D, PAIRS: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    m_d = o_d < D
    acc = tl.zeros([BD], dtype=tl.float32)
    for j in tl.static_range(PAIRS):  # in slot order: the same sum on every run
        acc += tl.load(part + (t * PAIRS + j) * D + o_d, mask=m_d, other=0.0)
    tl.store(out + t * D + o_d, acc.to(out.dtype.element_ty), mask=m_d)


_gate_up = CachedLaunch(_gate_up_kernel)
_down = CachedLaunch(_down_kernel)
_gate_up_by_expert = CachedLaunch(_gate_up_by_expert_kernel)
_down_by_expert = CachedLaunch(_down_by_expert_kernel)
_sum_pairs = CachedLaunch(_sum_pairs_kernel)


def stack_with_shared(gates: list[torch.Tensor], ups: list[torch.Tensor], downs: list[torch.Tensor],
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout :func:`small_batch_experts` reads, from each expert's gate [H, D], up [H, D] and down
    [D, H] weights with the shared expert last: gate and up rows as [E + 1, 2H, D] and the down weights
    as [E + 1, D, H], in ``dtype`` (stacked in the weights' own dtype: no wider copy on the way)."""
    gu = torch.stack([torch.cat([g, u]) for g, u in zip(gates, ups, strict=True)])
    return gu.to(dtype).contiguous(), torch.stack(list(downs)).to(dtype).contiguous()


def small_batch_experts(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, w_gu: torch.Tensor,
                        w_down: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                        tiles: tuple[int, int, int, int] | None = None, form: str = "token") -> torch.Tensor:
    """sum_j w[t, j] expert_{idx[t, j]}(x[t]) + shared(x[t]) for x [T, D] ([T, D] in ``out_dtype``:
    accumulated in fp32 and rounded once, so a layer that wants its activations' dtype pays no
    conversion launch), routing w, idx [T, k], and the weights of :func:`stack_with_shared` (the
    shared expert last).  ``tiles``: (BH, BD) of the gate/up kernel and (BD, BH) of the down kernel,
    powers of two, optionally followed by each kernel's warps (a launch-parameter sweep; None:
    :func:`default_tiles`, or :data:`EXPERT_TILES` for the expert form).

    ``form``: "token" (two launches; each (token, slot) pair's program reads its expert's rows) or "expert"
    (three launches; one program per (expert, tile) reads that expert's rows once for every pair it
    serves, as tensor-core products over the pairs, its down products summed per token in slot order by a
    third launch).  At a few tokens the pairs share experts (16 tokens choosing 4 of 32 touch about 29
    distinct experts for 80 pairs), which the token form reads again for each.  In 16 bits the expert form
    rounds the activations to the weights' dtype before the down product; fp32 is exact (ieee products)."""
    if x.dim() != 2 or w.shape != idx.shape or w.dim() != 2 or w.shape[0] != x.shape[0]:
        raise ValueError(f"x must be [T, D] and w, idx [T, k]: got {tuple(x.shape)}, {tuple(w.shape)}, "
                         f"{tuple(idx.shape)}")
    T, D = x.shape
    E1, H2, D_ = w_gu.shape
    E, H, top_k = E1 - 1, H2 // 2, w.shape[1]
    if D_ != D or H2 % 2 or w_down.shape != (E1, D, H):
        raise ValueError(f"weights must be [E+1, 2H, {D}] and [E+1, {D}, H]: got {tuple(w_gu.shape)} and "
                         f"{tuple(w_down.shape)}")
    if form not in ("token", "expert"):
        raise ValueError(f"form must be 'token' or 'expert', got {form!r}")
    by_expert = form == "expert"
    tiles = tuple(tiles or (EXPERT_TILES if by_expert else default_tiles(T, D, H, multiprocessors(x.device))))
    if len(tiles) not in (4, 6) or any(b < 1 or b & (b - 1) for b in tiles):
        raise ValueError(f"tiles must be 4 or 6 powers of two (BH, BD, BD, BH[, warps, warps]), got {tiles}")
    if by_expert and min(tiles[:4]) < 16:
        raise ValueError(f"the expert form's tiles are tensor-core products: each at least 16, got {tiles}")
    BH, BD, BDo, BHo, W1, W2 = tiles if len(tiles) == 6 else (*tiles, 4, 4)
    x, w, idx = x.contiguous(), w.contiguous(), idx.contiguous()
    act = alloc(T * (top_k + 1), H, dtype=torch.float32, device=x.device)
    out = alloc(T, D, dtype=out_dtype, device=x.device)
    if T and by_expert:
        R = T * (top_k + 1)
        lowp = x.dtype == w_gu.dtype == w_down.dtype and x.element_size() == 2 and not interpreting()
        ce = dict(TOPK=top_k, RP=max(16, triton.next_power_of_2(R)), LOWP=lowp, DOT_PRECISION="ieee")
        part = alloc(R, D, dtype=torch.float32, device=x.device)
        key = ("expert", T, D, H, E, top_k, x.dtype, w_gu.dtype, w_down.dtype, idx.dtype, out_dtype, tiles, x.device)
        _gate_up_by_expert((E1, triton.cdiv(H, BH), 1), key, (x, w, idx, w_gu, act, R, D, H, E),
                           dict(ce, BH=BH, BD=BD, num_warps=W1))
        _down_by_expert((E1, triton.cdiv(D, BDo), 1), key, (act, idx, w_down, part, R, D, H, E),
                        dict(ce, BD=BDo, BH=BHo, num_warps=W2))
        BS = min(1024, triton.next_power_of_2(D))
        _sum_pairs((T, triton.cdiv(D, BS), 1), key, (part, out, D), dict(PAIRS=top_k + 1, BD=BS, num_warps=4))
    elif T:
        key = (T, D, H, E, top_k, x.dtype, w_gu.dtype, idx.dtype, out_dtype, tiles, x.device)
        _gate_up((T * (top_k + 1), triton.cdiv(H, BH), 1), key, (x, w, idx, w_gu, act, D, H, E),
                 dict(TOPK=top_k, BH=BH, BD=BD, num_warps=W1))
        _down((T, triton.cdiv(D, BDo), 1), key, (act, idx, w_down, out, D, H, E),
              dict(TOPK=top_k, BD=BDo, BH=BHo, num_warps=W2))
    return out


def default_tiles(T: int, D: int, H: int, sms: int = 132) -> tuple[int, int, int, int, int, int]:
    """(BH, BD) of the gate/up kernel, (BD, BH) of the down kernel, and their warps, for T tokens on a GPU of
    ``sms`` multiprocessors.

    The gate/up kernel runs T (k + 1) H / BH programs, enough at any T with 8 hidden units of up to 1024
    model dimensions per step.  The down kernel runs only T D / BD programs, and its tile is what a small
    batch is bound by: about four programs per multiprocessor (BD = T D / 4 sms, 4 to 64), each reading
    up to 4096 weights a step.  On the H200 (132 SMs, the bench preset's layer; bench/small_batch_tiles.py,
    bench/RESULTS.md 2026-12-04e) this took the layer from 81 to 26 us at one token, and it was the best of
    17 tilings, or within 3% of it, at 1, 2, 4, 8 and 16 tokens."""
    bd_down = max(4, min(64, _pow2_floor(T * D // (4 * max(sms, 1)))))
    bd_down = min(bd_down, triton.next_power_of_2(D))
    return (min(8, triton.next_power_of_2(H)), min(1024, triton.next_power_of_2(D)),
            bd_down, max(min(4096 // bd_down, triton.next_power_of_2(H)), 16), 4, 4)


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessor count (132 where there is none to ask: the interpreter's tiles are not timed)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132
