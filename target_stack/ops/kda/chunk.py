"""Chunked KDA prefill in Triton (forward only).

Four kernels, the usual split of a chunked linear-attention forward:

1. intra-chunk work, all chunks in parallel:
   - ``_kda_diag_token_kernel`` (a GPU) or ``_kda_diag_block_kernel`` (the interpreter): the diagonal
     16 x 16 blocks of the strictly lower matrix L[i, j] = <k_i, k_j exp(G_i - G_j)> and of the causal
     scores P[i, j] = scale <q_i, k_j exp(G_i - G_j)>, exactly (G: the cumulative log decay within the
     chunk; exp(G_i - G_j) does not factor into a product of two bounded terms there);
   - ``_kda_solve_kernel``: G in registers, the off-diagonal blocks of L and P as tensor-core products
     gated around a block boundary, the UT transform T = (I + Diag(b) L)^-1 Diag(b) by recursive
     doubling, w = T (exp(G) k), u = T v, and what the later kernels need of G.
   Every exponent is a difference G_i - G_j with j <= i, so no decay can overflow.
2. ``_kda_state_kernel`` (one program per sequence, head and V tile; sequential over chunks):
   stores the state entering each chunk, the effective values u' = u - w S, and advances
   S <- Diag(exp(G_C)) S + (k exp(G_C - G))^T u'.
3. ``_kda_output_kernel`` (all chunks in parallel): o = (scale q exp(G)) S_in + P u'.  Or (``FUSE_OUTPUT``)
   the state kernel computes it per chunk from the S_in and u' it holds, and neither goes to memory.

Variable-length batches are packed along T and described by ``cu_seqlens`` (as in
flash-linear-attention); chunks never straddle a sequence boundary.  Everything accumulates in
fp32 and every fp32 ``tl.dot`` names its precision (``DOT_PRECISION``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from target_stack.ops.utils import alloc, block_size, check_kda_inputs, interpreting, resolve_dot_precision

#: how the diagonal blocks are built: a program per token (True, ``_kda_diag_token_kernel``), a program per
#: block as one 3-D product (False, ``_kda_diag_block_kernel``), or (None) by token on a GPU and by block in
#: the interpreter
DIAG_BY_TOKEN: bool | None = None

#: the output computed inside the recurrence (True: ``_kda_state_kernel`` writes o and never stores the
#: per-chunk states or corrected values, one launch and their round trip through memory fewer, on a
#: sequential kernel that gets two more products per chunk) or by ``_kda_output_kernel`` in parallel over
#: chunks (False: the default until a GPU shows the fused form faster; ``python -m target_stack.bench kda``
#: times both side by side)
FUSE_OUTPUT = False

#: launch shapes: heads and warps of a diagonal-token program; warps and key-slice width of a solve program.
#: On an H200 at 4096 tokens (H=16, K=V=128, bf16; bench/RESULTS.md, 2026-12-04): the token kernel took 59 us
#: at 2 heads and 1 warp (the sweep's 30 shapes: 404-672 us for the whole prefill); the solve took 4 warps
#: and 64-wide slices (338 us prefill) before 128-wide (401), 8 warps (434) or a register cap (361-410).
#: Warps of the state program, and value tile and warps of an output program for 16-bit inputs (fp32 inputs
#: take min(V, 64) and 4 warps): on an H100 (2026-12-06b) 4 output warps took the prefill at 4096 / 32768
#: tokens to 328.7 / 2460.7 us from 336.5 / 2486.2 at 8, and 2 or 8 state warps were slower than 4
LAUNCH = {"diag_heads": 2, "diag_warps": 1, "solve_warps": 4, "solve_keys": 64,
          "state_warps": 4, "output_bv": 64, "output_warps": 4}

CHUNK_SIZE = 64


@triton.jit
def _dot(a, b, LOWP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """a @ b: on 16-bit operands when the inputs were 16-bit (LOWP), else fp32 at DOT_PRECISION."""
    if LOWP:
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), input_precision=DOT_PRECISION)
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=DOT_PRECISION)
    return out


@triton.jit
def _chunk_span(cu_seqlens, chunk_seq, chunk_pos, i_c, BT: tl.constexpr):
    """First token of packed chunk ``i_c`` and the end of its sequence (chunks never cross one)."""
    i_n = tl.load(chunk_seq + i_c).to(tl.int64)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    return bos + tl.load(chunk_pos + i_c).to(tl.int64) * BT, eos


@triton.jit
def _kda_diag_token_kernel(
    q, k, g, Akd, Pqk,
    cu_seqlens, chunk_seq, chunk_pos,
    scale,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr,
):
    """The diagonal 16 x 16 blocks, one token (row) and BH heads per program: grid (chunks, BT, heads / BH).

    Row t of its block holds L[t, j] = <k_t, k_j exp(G_t - G_j)> for j < t and P[t, j] = scale <q_t, k_j
    exp(G_t - G_j)> for j <= t: a loop over only the keys at or before t, newest first, in which
    G_t - G_j is the running sum of the raw log decays g over (j, t].  No cumulative decay is read, no
    exponent is ever positive, and no work is spent on the block's upper triangle."""
    i_c = tl.program_id(0)
    i_r = tl.program_id(1)
    i_hg = tl.program_id(2)
    t0, eos = _chunk_span(cu_seqlens, chunk_seq, chunk_pos, i_c, BT)
    t = t0 + i_r
    if t < eos:
        o_h = i_hg * BH + tl.arange(0, BH)
        o_k = tl.arange(0, BK)
        m_h = o_h < H
        m_hk = m_h[:, None] & (o_k < K)[None, :]
        off_t = (t * H + o_h)[:, None] * K + o_k[None, :]
        b_q = tl.load(q + off_t, mask=m_hk, other=0.0).to(tl.float32)
        b_k = tl.load(k + off_t, mask=m_hk, other=0.0).to(tl.float32)
        b_gap = tl.zeros([BH, BK], dtype=tl.float32)  # G_t - G_j: the sum of g over (j, t]
        i_s = i_r % BC  # the row's place in its block: keys j = t - n for n = 0 .. i_s
        for n in range(0, i_s + 1):
            j = t - n
            off_j = (j * H + o_h)[:, None] * K + o_k[None, :]
            b_kgj = tl.load(k + off_j, mask=m_hk, other=0.0).to(tl.float32) * tl.exp(b_gap)
            b_gap += tl.load(g + off_j, mask=m_hk, other=0.0).to(tl.float32)
            b_P = tl.sum(b_q * b_kgj, axis=1) * scale
            b_L = tl.sum(b_k * b_kgj, axis=1)
            tl.store(Pqk + (t * H + o_h) * BT + (i_r - n), b_P.to(Pqk.dtype.element_ty), mask=m_h)
            # (a tensor mask: the interpreter of older Tritons refuses a scalar condition in one)
            tl.store(Akd + (t * H + o_h) * BC + (i_s - n), b_L, mask=m_h & ((n + 0 * o_h) > 0))


@triton.jit
def _kda_diag_block_kernel(
    q, k, g, Akd, Pqk,
    cu_seqlens, chunk_seq, chunk_pos,
    scale,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
):
    """The same diagonal blocks, one block and head per program as one [BC, BC, BK] product (the
    interpreter's form: there every operation costs alike whatever its size, and this form runs the same
    prefill about six times faster than the token form, 0.45 against 2.6 s for 119 tokens and 2 heads).
    G_i - G_j is a difference of the block's own cumulative sums of g, masked to j <= i before exp()."""
    i_c = tl.program_id(0)
    i_i = tl.program_id(1)
    i_h = tl.program_id(2)
    t0, eos = _chunk_span(cu_seqlens, chunk_seq, chunk_pos, i_c, BT)
    if t0 + i_i * BC < eos:
        sub = tl.arange(0, BC)
        o_k = tl.arange(0, BK)
        m_k = o_k < K
        r_i = t0 + i_i * BC + sub
        m_i = r_i < eos
        m_ik = m_i[:, None] & m_k[None, :]
        off_ik = (r_i * H + i_h)[:, None] * K + o_k[None, :]
        b_q = tl.load(q + off_ik, mask=m_ik, other=0.0).to(tl.float32)
        b_k = tl.load(k + off_ik, mask=m_ik, other=0.0).to(tl.float32)
        b_g = tl.cumsum(tl.load(g + off_ik, mask=m_ik, other=0.0).to(tl.float32), axis=0)
        keep = ((sub[:, None] >= sub[None, :]) & (m_i[:, None] & m_i[None, :]))[:, :, None] & m_k[None, None, :]
        b_kd = b_k[None, :, :] * tl.exp(tl.where(keep, b_g[:, None, :] - b_g[None, :, :], float("-inf")))
        b_L = tl.sum(b_k[:, None, :] * b_kd, axis=2)
        b_P = tl.sum(b_q[:, None, :] * b_kd, axis=2) * scale
        row = (r_i * H + i_h)[:, None]
        tl.store(Akd + row * BC + sub[None, :], b_L, mask=m_i[:, None] & (sub[:, None] > sub[None, :]))
        tl.store(Pqk + row * BT + i_i * BC + sub[None, :], b_P.to(Pqk.dtype.element_ty),
                 mask=m_i[:, None] & (sub[:, None] >= sub[None, :]))


@triton.jit
def _kda_solve_kernel(
    q, k, v, g, beta, Akd, Pqk, w, u, kd, qg, glast,
    cu_seqlens, chunk_seq, chunk_pos,
    scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NC: tl.constexpr,
    LOG2_BT: tl.constexpr, LOG2_BC: tl.constexpr, LOWP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    INV_PRECISION: tl.constexpr,
):
    """Everything else of one chunk and head that is parallel over chunks, in three passes:

    1. over slices of BK key channels (G, the cumulative log decay, is per channel, so a slice needs no
       other): G in registers (never stored); the off-diagonal blocks of L and P, for each block row b
       one product gated around G just before block b (G_i <= G_r <= G_j, so both gates are <= 1),
       summed over the slices; and what the later kernels read instead of G: kd = k exp(G_last - G) and
       G_last (the state kernel), qg = scale q exp(G) (the output kernel), k exp(G) (kept in ``w``);
    2. the diagonal blocks from ``Akd``, then the UT transform T = (I + Diag(b) L)^-1 Diag(b);
    3. w = T (exp(G) k) over the same slices, u = T v over slices of BV value channels.

    Only [BT, BK] slices and the [BT, BT] matrices are ever live.  w, u, kd and qg are stored in their
    buffers' dtype: 16-bit for 16-bit inputs, as the products take them anyway."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    t0, eos = _chunk_span(cu_seqlens, chunk_seq, chunk_pos, i_c, BT)
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BT)
    m_t = (t0 + rows) < eos
    last = (rows == tl.minimum(eos - t0, BT) - 1)[:, None]  # the chunk's last token
    off_tt = ((t0 + rows) * H + i_h)[:, None] * BT + cols[None, :]

    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    b_P = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, (K + BK - 1) // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        off_tk = ((t0 + rows) * H + i_h)[:, None] * K + o_k[None, :]
        b_gc = tl.cumsum(tl.load(g + off_tk, mask=m_tk, other=0.0).to(tl.float32), axis=0)
        b_k = tl.load(k + off_tk, mask=m_tk, other=0.0).to(tl.float32)
        b_q = tl.load(q + off_tk, mask=m_tk, other=0.0).to(tl.float32)
        for b in tl.static_range(1, NC):
            if t0 + b * BC < eos:  # block rows wholly past the sequence end (a short last chunk) are skipped
                g_ref = tl.sum(tl.where(rows[:, None] == b * BC - 1, b_gc, 0.0), axis=0)
                in_b = m_t & (rows // BC == b)
                gate = tl.exp(tl.where(in_b[:, None] & m_k[None, :], b_gc - g_ref[None, :], float("-inf")))
                before = (rows < b * BC)[:, None] & m_k[None, :]
                b_kgt = tl.trans(b_k * tl.exp(tl.where(before, g_ref[None, :] - b_gc, float("-inf"))))
                b_A += _dot(b_k * gate, b_kgt, LOWP, DOT_PRECISION)
                b_P += _dot(b_q * gate, b_kgt, LOWP, DOT_PRECISION)
        b_eg = tl.where(m_tk, tl.exp(b_gc), 0.0)
        tl.store(w + off_tk, (b_k * b_eg).to(w.dtype.element_ty), mask=m_tk)  # k exp(G), until pass 3
        tl.store(qg + off_tk, (b_q * b_eg * scale).to(qg.dtype.element_ty), mask=m_tk)
        g_last = tl.sum(tl.where(last, b_gc, 0.0), axis=0)
        tl.store(glast + (i_c.to(tl.int64) * H + i_h) * K + o_k, g_last, mask=m_k)
        b_kd = tl.where(m_tk, b_k * tl.exp(g_last[None, :] - b_gc), 0.0)
        tl.store(kd + off_tk, b_kd.to(kd.dtype.element_ty), mask=m_tk)
    cross = m_t[:, None] & ((cols // BC)[None, :] < (rows // BC)[:, None])
    tl.store(Pqk + off_tt, (b_P * scale).to(Pqk.dtype.element_ty), mask=cross)

    b_b = tl.load(beta + (t0 + rows) * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_L = b_A * b_b[:, None]  # Diag(b) L off the diagonal blocks

    # X = (I + L)^-1 by recursive doubling: X holds the inverses of the diagonal s-blocks; the
    # lower-left s-block C of each 2s-block becomes -B^-1 C A^-1 = -(X C X) there.  The levels inside
    # the diagonal BC-blocks run on all NC of them at once as [NC, BC, BC] products, straight from ``Akd``.
    o_n = tl.arange(0, NC)
    sub = tl.arange(0, BC)
    r_d = (o_n * BC)[:, None] + sub[None, :]  # [NC, BC]: the chunk row of each block row
    m_d = (t0 + r_d) < eos
    b_bd = tl.load(beta + (t0 + r_d) * H + i_h, mask=m_d, other=0.0).to(tl.float32)
    b_Ld = tl.load(Akd + ((t0 + r_d) * H + i_h)[:, :, None] * BC + sub[None, None, :],
                   mask=m_d[:, :, None] & (sub[:, None] > sub[None, :])[None, :, :], other=0.0) * b_bd[:, :, None]
    b_Xd = tl.where((sub[:, None] == sub[None, :])[None, :, :], 1.0, 0.0) + tl.zeros([NC, BC, BC], dtype=tl.float32)
    s = 1
    for _ in range(LOG2_BC):
        in_pair = (sub[:, None] // (2 * s)) == (sub[None, :] // (2 * s))
        off_diag = (sub[:, None] // s) != (sub[None, :] // s)
        b_C = tl.where((in_pair & off_diag)[None, :, :], b_Ld, 0.0)
        b_XC = tl.dot(b_Xd, b_C, input_precision=INV_PRECISION)
        b_Xd = b_Xd - tl.dot(b_XC, b_Xd, input_precision=INV_PRECISION)
        s = s * 2
    same = (o_n[:, None] == o_n[None, :])[:, None, :, None]  # [NC, 1, NC, 1]: block row == block column
    b_X = tl.reshape(tl.where(same, b_Xd[:, :, None, :], 0.0), [BT, BT])
    for _ in range(LOG2_BT - LOG2_BC):
        in_pair = (rows[:, None] // (2 * s)) == (cols[None, :] // (2 * s))
        off_diag = (rows[:, None] // s) != (cols[None, :] // s)
        b_C = tl.where(in_pair & off_diag, b_L, 0.0)
        b_XC = tl.dot(b_X, b_C, input_precision=INV_PRECISION)
        b_X = b_X - tl.dot(b_XC, b_X, input_precision=INV_PRECISION)
        s = s * 2
    b_T = b_X * b_b[None, :]  # the UT transform T = (I + L)^-1 Diag(b)
    if LOWP:
        b_T = b_T.to(tl.bfloat16)  # what its products take, converted once

    tl.debug_barrier()  # pass 1's k exp(G) in ``w``, written by other threads of this program
    for i_k in range(0, (K + BK - 1) // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        off_tk = ((t0 + rows) * H + i_h)[:, None] * K + o_k[None, :]
        b_kg = tl.load(w + off_tk, mask=m_tk, other=0.0)
        tl.debug_barrier()  # every thread has read its part of the slice before any overwrites it
        tl.store(w + off_tk, _dot(b_T, b_kg, LOWP, DOT_PRECISION).to(w.dtype.element_ty), mask=m_tk)
    for i_v in range(0, (V + BV - 1) // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        off_tv = ((t0 + rows) * H + i_h)[:, None] * V + o_v[None, :]
        b_v = tl.load(v + off_tv, mask=m_tv, other=0.0).to(tl.float32)
        tl.store(u + off_tv, _dot(b_T, b_v, LOWP, DOT_PRECISION).to(u.dtype.element_ty), mask=m_tv)


@triton.jit
def _causal_scores(Pqk, t0, i_h, m_t, H: tl.constexpr, BT: tl.constexpr):
    """A chunk's [BT, BT] block of P (scale <q_i, k_j exp(G_i - G_j)>) as the output reads it: j <= i only,
    the part the intra-chunk kernels write.  The output kernel's read, and the state kernel's where the
    output is fused."""
    rows = tl.arange(0, BT)
    return tl.load(Pqk + ((t0 + rows) * H + i_h)[:, None] * BT + rows[None, :],
                   mask=m_t[:, None] & (rows[:, None] >= rows[None, :]), other=0.0)  # only j <= i is written


@triton.jit
def _kda_state_kernel(
    kd, glast, w, u, v_new, h, h0, ht, qg, Pqk, o,
    cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, FUSE_OUTPUT: tl.constexpr,
    LOWP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """The recurrence over one sequence's chunks for one head and V tile.  Without FUSE_OUTPUT it stores
    each chunk's entering state (``h``) and corrected values (``v_new``) for ``_kda_output_kernel``; with
    it, it computes that chunk's output tile itself from the same two, which then never leave registers."""
    i_v = tl.program_id(0)
    i_n = tl.program_id(1).to(tl.int64)
    i_h = tl.program_id(2)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)

    rows = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    off_kv = o_k[:, None] * V + o_v[None, :]

    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_S += tl.load(h0 + (i_n * H + i_h) * K * V + off_kv, mask=m_kv, other=0.0).to(tl.float32)

    # a counted loop (not ``while``): Triton software-pipelines it, so the next chunk's w, u and kd
    # loads are in flight while this chunk's products run
    for i_c in range(0, tl.cdiv(eos - bos, BT)):
        t0 = bos + i_c * BT
        if not FUSE_OUTPUT:
            tl.store(h + ((c0 + i_c) * H + i_h) * K * V + off_kv, b_S.to(h.dtype.element_ty), mask=m_kv)
        m_t = (t0 + rows) < eos
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        off_tk = ((t0 + rows) * H + i_h)[:, None] * K + o_k[None, :]
        off_tv = ((t0 + rows) * H + i_h)[:, None] * V + o_v[None, :]
        b_w = tl.load(w + off_tk, mask=m_tk, other=0.0)
        b_u = tl.load(u + off_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_vn = b_u - _dot(b_w, b_S, LOWP, DOT_PRECISION)
        if FUSE_OUTPUT:  # o = (scale q exp(G)) S_in + P u' from the S_in and u' in registers
            b_qg = tl.load(qg + off_tk, mask=m_tk, other=0.0)
            b_P = _causal_scores(Pqk, t0, i_h, m_t, H, BT)
            b_o = _dot(b_qg, b_S, LOWP, DOT_PRECISION) + _dot(b_P, b_vn, LOWP, DOT_PRECISION)
            tl.store(o + off_tv, b_o.to(o.dtype.element_ty), mask=m_tv)
        else:
            tl.store(v_new + off_tv, b_vn.to(v_new.dtype.element_ty), mask=m_tv)

        g_last = tl.load(glast + ((c0 + i_c) * H + i_h) * K + o_k, mask=m_k, other=0.0)  # G at the chunk's end
        b_kd = tl.load(kd + off_tk, mask=m_tk, other=0.0)  # k exp(G_last - G), zero past the end
        b_S = b_S * tl.exp(g_last)[:, None] + _dot(tl.trans(b_kd), b_vn, LOWP, DOT_PRECISION)

    if STORE_FINAL_STATE:
        tl.store(ht + (i_n * H + i_h) * K * V + off_kv, b_S, mask=m_kv)


@triton.jit
def _kda_output_kernel(
    qg, Pqk, v_new, h, o,
    cu_seqlens, chunk_seq, chunk_pos,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    LOWP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_c = tl.program_id(1)
    i_h = tl.program_id(2)
    t0, eos = _chunk_span(cu_seqlens, chunk_seq, chunk_pos, i_c, BT)

    rows = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_t = (t0 + rows) < eos
    m_k = o_k < K
    m_v = o_v < V
    m_tk = m_t[:, None] & m_k[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    off_tk = ((t0 + rows) * H + i_h)[:, None] * K + o_k[None, :]
    off_tv = ((t0 + rows) * H + i_h)[:, None] * V + o_v[None, :]

    b_qg = tl.load(qg + off_tk, mask=m_tk, other=0.0)  # scale q exp(G)
    b_S = tl.load(h + (i_c.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                  mask=m_k[:, None] & m_v[None, :], other=0.0)
    b_P = _causal_scores(Pqk, t0, i_h, m_t, H, BT)
    b_vn = tl.load(v_new + off_tv, mask=m_tv, other=0.0)
    b_o = _dot(b_qg, b_S, LOWP, DOT_PRECISION) + _dot(b_P, b_vn, LOWP, DOT_PRECISION)
    tl.store(o + off_tv, b_o.to(o.dtype.element_ty), mask=m_tv)


def chunk_tiles(K: int, V: int, lowp: bool) -> tuple[int, int]:
    """(BK, BV): the key tile (the whole head) and the value tile of the solve and state kernels."""
    BK = block_size(K)
    BV = min(block_size(V), 32 if BK > 64 else 64)
    if lowp and BK < 64:
        # Small heads in 16 bits take the (64, 64) tiles: with K = V = 16 (16- or 32-wide tiles) the
        # solve kernel's bf16 products read past its shared memory on an H200 with Triton 3.6
        # (compute-sanitizer) and came out wrong; the masks keep the wider tiles exact.
        BK, BV = 64, 64
    if lowp and V <= 32:
        # Narrow values under wide keys too: K = 64 or 128 with V = 32 in 16 bits came out wrong on an H100
        # with Triton 3.6 (rel. error ~1; fp32, and V >= 64, right) on 32-wide value tiles, while K = V = 32
        # on the (64, 64) tiles was right (bench/RESULTS.md, 2026-12-05c): such values take a 64-wide tile
        BV = 64
    return BK, BV


def solve_tiles(BK: int, BV: int, lowp: bool) -> tuple[int, int]:
    """(key slice, value slice) of the solve kernel's products T (exp(G) k) and T v.

    16-bit inputs take slices at least 64 wide on both: 16-bit products on 32-wide key slices came out wrong
    on an H200 with Triton 3.6 (and read out of bounds), and so did T v on 32-wide value slices of fp16
    values (K = 96, 128 or 256 with V >= 64: rel. error 5-10 on an H200, an illegal memory access on an
    H100, while bf16 on the same tiles was right; bench/RESULTS.md, 2026-12-05e).  The masks keep the wider
    slices exact, and bf16 runs faster on them (the solve at 4096 / 32768 tokens, H=16, K=V=128: 123 / 932 us
    against 127 / 967 us on an H100); the state kernel keeps its own narrower, faster value tile."""
    BKS = max(min(BK, LAUNCH["solve_keys"]), 64 if lowp else 16)
    return BKS, max(BV, 64) if lowp else BV


def state_tile(BV: int, V: int, rows: int, device: torch.device) -> int:
    """The state kernel's value tile: ``chunk_tiles``' BV, halved down to 16 while the launch's ``rows``
    (sequence, head) pairs times its value tiles would leave SMs without a program.  The recurrence walks
    the chunks one after another, so at a few long sequences its programs are all the parallelism the
    prefill's longest kernel has; narrower tiles double them at the cost of reading each chunk's w and kd
    twice as often (from L2).  At one sequence of 4096 / 32768 tokens, H=16, K=V=128, bf16 on an H100:
    BV=16 (128 programs) took the prefill to 335.8 / 2480.7 us from 344.7 / 2549.7 us at BV=32 (64
    programs); BV=64 was slower (380.7 / 2809.4 us; bench/RESULTS.md, 2026-12-06b).  Values narrower than
    64 keep their tile (``chunk_tiles`` widens some of them for a Triton fault)."""
    if interpreting() or device.type != "cuda" or V < 64:
        return BV
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    while BV > 16 and rows * triton.cdiv(V, BV) < sms:
        BV //= 2
    return BV


def state_stages(BT: int, BK: int, BV: int, dtype: torch.dtype, budget: int = 160 * 1024,
                 fused: bool = False) -> int:
    """Pipeline stages of the state kernel: 3 for 16-bit tiles, 2 for fp32, fewer where the stages' w, kd
    and u tiles would not leave the products' own scratch room in the shared memory (228 KB a block on an
    H100 or H200).  bf16 at K = 256 took 3 and asked for 237568 bytes of 232448 (H100, 2026-12-05).  With the
    output fused (``fused``) a stage also holds the chunk's qg and P tiles."""
    bits = torch.finfo(dtype).bits
    per_stage = (2 * BT * BK + BT * BV + ((BT * BK + BT * BT) if fused else 0)) * bits // 8
    return max(1, min(3 if bits == 16 else 2, budget // per_stage))


def prepare_chunks(cu_seqlens: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chunk_seq, chunk_pos, chunk_offsets): the sequence and position of every chunk, and the
    index of each sequence's first chunk."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    seq, pos, offsets = [], [], [0]
    for n, length in enumerate(lens):
        nc = triton.cdiv(length, chunk_size)
        seq += [n] * nc
        pos += range(nc)
        offsets.append(offsets[-1] + nc)
    dev = cu_seqlens.device
    as_t = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
    return as_t(seq), as_t(pos), as_t(offsets)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    dot_precision: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA prefill.  Returns ``(o [B, T, H, V] in v's dtype, final_state [N, H, K, V] fp32)``.

    With ``cu_seqlens`` (int, ``[N + 1]``) the batch must be 1 and holds N packed sequences;
    ``initial_state`` then has one state per sequence.  ``dot_precision`` sets the fp32
    ``tl.dot`` precision of the chunk kernels (None: tf32x3 where tf32 exists, else ieee).
    """
    if cu_seqlens is not None:
        if q.dim() != 4 or q.shape[0] != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1, got q of shape {tuple(q.shape)}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError("cu_seqlens must be a 1-D integer tensor [N + 1] of sequence offsets")
        n_seq = cu_seqlens.numel() - 1
    B, T, H, K, V = check_kda_inputs(q, k, v, g, beta, initial_state,
                                     state_batch=None if cu_seqlens is None else n_seq)
    if cu_seqlens is None:
        n_seq = B
        cu_seqlens = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=q.device)
    else:
        cl = cu_seqlens.tolist()
        if cl[0] != 0 or cl[-1] != T or any(b < a for a, b in zip(cl, cl[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 to T={T}, got {cl}")
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
    precision = resolve_dot_precision(dot_precision, q.device, "dot_precision")
    scale = K**-0.5 if scale is None else float(scale)
    chunks = prepare_chunks(cu_seqlens, CHUNK_SIZE)
    return chunk_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunks, precision)


def chunk_kda_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor,
    chunks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    precision: str,
    fuse_output: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The launches of :func:`chunk_kda` on validated inputs and prepared chunk indices; ``fuse_output``
    (None: ``FUSE_OUTPUT``) computes the output inside the recurrence.

    No host synchronisation happens here, so a CUDA graph can capture it.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    n_seq = cu_seqlens.numel() - 1
    BT = CHUNK_SIZE
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    # 16-bit inputs: the chunk products take bf16 operands (fp32 accumulate) and the triangular
    # inverse runs at tf32, as in flash-linear-attention: the output is 16-bit anyway.  fp32 inputs
    # keep fp32 operands at ``precision`` throughout.  The interpreter's 16-bit dot is not
    # trustworthy, so it always takes the fp32 path.  fp16 inputs keep bf16 intermediates too (the
    # products are bf16's either way), and the solve's slices of their values are 64 wide (``solve_tiles``).
    lowp = q.element_size() == 2 and not interpreting()
    BK, BV = chunk_tiles(K, V, lowp)
    chunk_seq, chunk_pos, chunk_offsets = chunks
    NT = chunk_seq.numel()
    f32 = dict(dtype=torch.float32, device=q.device)
    mid = dict(dtype=torch.bfloat16 if lowp else torch.float32, device=q.device)  # what the products take
    BC = 16  # the diagonal blocks: 16 x 16, NC of them per chunk
    NC = BT // BC
    Akd = alloc(B, T, H, BC, **f32)  # the diagonal blocks of L (fp32: the inverse's input)
    Pqk = alloc(B, T, H, BT, **mid)  # P: only j <= i is written
    if not interpreting() if DIAG_BY_TOKEN is None else DIAG_BY_TOKEN:
        BH = min(block_size(H, 1), LAUNCH["diag_heads"])
        _kda_diag_token_kernel[(NT, BT, triton.cdiv(H, BH))](
            q, k, g, Akd, Pqk, cu_seqlens, chunk_seq, chunk_pos, scale,
            H=H, K=K, BT=BT, BC=BC, BK=BK, BH=BH, num_warps=LAUNCH["diag_warps"],
        )
    else:
        _kda_diag_block_kernel[(NT, NC, H)](
            q, k, g, Akd, Pqk, cu_seqlens, chunk_seq, chunk_pos, scale, H=H, K=K, BT=BT, BC=BC, BK=BK,
        )
    w = alloc(B, T, H, K, **mid)
    u = alloc(B, T, H, V, **mid)
    kd = alloc(B, T, H, K, **mid)
    qg = alloc(B, T, H, K, **mid)
    glast = alloc(NT, H, K, **f32)
    BKS, BVS = solve_tiles(BK, BV, lowp)
    _kda_solve_kernel[(NT, H)](
        q, k, v, g, beta, Akd, Pqk, w, u, kd, qg, glast, cu_seqlens, chunk_seq, chunk_pos, scale,
        H=H, K=K, V=V, BT=BT, BC=BC, BK=BKS, BV=BVS, NC=NC, LOG2_BT=BT.bit_length() - 1, LOG2_BC=BC.bit_length() - 1,
        LOWP=lowp, DOT_PRECISION=precision, INV_PRECISION="tf32" if lowp else precision,
        num_warps=LAUNCH["solve_warps"],
    )
    fuse = FUSE_OUTPUT if fuse_output is None else fuse_output
    if not fuse:
        h = alloc(NT, H, K, V, **mid)  # per-chunk entering states and corrected values: read by
        v_new = alloc(B, T, H, V, **mid)  # the output kernel's products only (16-bit for 16-bit inputs)
    else:
        h = v_new = None  # the state kernel writes the output itself: neither is ever stored
    o = alloc(B, T, H, V, dtype=v.dtype, device=v.device)
    ht = alloc(n_seq, H, K, V, **f32) if output_final_state else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    BV = state_tile(BV, V, n_seq * H, q.device)
    NV = triton.cdiv(V, BV)
    # pipelined: the next chunks' w, u and kd loads in flight during this chunk's products.  On an H200 at
    # 4096 tokens (H=16, K=V=128, bf16) the kernel took 167 us as a while loop, 134 / 109 / 111 us over
    # 2 / 3 / 4 stages with 4 warps (bench/RESULTS.md, 2026-12-03; the value tile: ``state_tile``).  fp32
    # operands take two: three stages of their tiles (72 KB each at K=128) would not fit the shared memory
    _kda_state_kernel[(NV, n_seq, H)](
        kd, glast, w, u, v_new, h, h0, ht, qg, Pqk, o, cu_seqlens, chunk_offsets,
        H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
        USE_INITIAL_STATE=h0 is not None, STORE_FINAL_STATE=ht is not None, FUSE_OUTPUT=fuse,
        LOWP=lowp, DOT_PRECISION=precision, num_warps=LAUNCH["state_warps"],
        num_stages=state_stages(BT, BK, BV, mid["dtype"], fused=fuse),
    )
    if fuse:
        return o, ht
    BVO = LAUNCH["output_bv"] if lowp else min(block_size(V), 64)  # parallel over chunks: wider V tiles pay
    _kda_output_kernel[(triton.cdiv(V, BVO), NT, H)](
        qg, Pqk, v_new, h, o, cu_seqlens, chunk_seq, chunk_pos,
        H=H, K=K, V=V, BT=BT, BK=BK, BV=BVO, LOWP=lowp, DOT_PRECISION=precision,
        num_warps=LAUNCH["output_warps"] if lowp else 4,
    )
    return o, ht
