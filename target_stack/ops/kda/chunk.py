"""Chunked KDA prefill in Triton (forward only).

Five kernels, the usual split of a chunked linear-attention forward:

1. intra-chunk work, all chunks in parallel: ``_kda_cumsum_kernel`` (the within-chunk cumulative
   decay G), ``_kda_intra_block_kernel`` (one 16 x 16 block of the strictly lower matrix
   L[i, j] = <k_i, k_j exp(G_i - G_j)> and of the causal scores P[i, j] = scale <q_i, k_j
   exp(G_i - G_j)> per program: ten blocks per chunk run side by side; off-diagonal blocks as two
   products gated around the decay before block i, diagonal ones exactly, column by column), ``_kda_solve_kernel``
   (the UT transform T = (I + Diag(b) L)^-1 Diag(b) by recursive doubling, w = T (exp(G) k),
   u = T v).  Every exponent is a difference G_i - G_j with j <= i, so no decay can overflow.
2. ``_kda_state_kernel`` (one program per sequence, head and V tile; sequential over chunks):
   stores the state entering each chunk, the effective values u' = u - w S, and advances
   S <- Diag(exp(G_C)) S + (k exp(G_C - G))^T u'.
3. ``_kda_output_kernel`` (all chunks in parallel): o = (scale q exp(G)) S_in + P u'.

Variable-length batches are packed along T and described by ``cu_seqlens`` (as in
flash-linear-attention); chunks never straddle a sequence boundary.  Everything accumulates in
fp32 and every fp32 ``tl.dot`` names its precision (``DOT_PRECISION``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from target_stack.ops.utils import alloc, block_size, check_kda_inputs, interpreting, resolve_dot_precision

#: how the intra kernel builds its diagonal blocks: column by column (True), as one 3-D product (False),
#: or (None) by column on a GPU and as one product in the interpreter (``_diag_block``)
DIAG_BY_COLUMN: bool | None = None

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
def _kda_cumsum_kernel(
    g, gc, cu_seqlens, chunk_seq, chunk_pos,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
):
    """G: the cumulative log decay within each chunk (one program per chunk and head)."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    t0, eos = _chunk_span(cu_seqlens, chunk_seq, chunk_pos, i_c, BT)
    rows = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_tk = ((t0 + rows) < eos)[:, None] & (o_k < K)[None, :]
    off_tk = ((t0 + rows) * H + i_h)[:, None] * K + o_k[None, :]
    b_g = tl.load(g + off_tk, mask=m_tk, other=0.0).to(tl.float32)
    tl.store(gc + off_tk, tl.cumsum(b_g, axis=0), mask=m_tk)


@triton.jit
def _offdiag_block(q, k, gc, Akk, Pqk, scale, t0, eos, i_h, i_i, i_j,
                   H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                   LOWP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Block (i, j), j < i: two products gated around the reference G_r, the cumulative decay just
    before block i (G_i <= G_r <= G_j, so both gates are <= 1)."""
    sub = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    r_i = t0 + i_i * BC + sub
    m_i = r_i < eos
    m_ik = m_i[:, None] & m_k[None, :]
    off_ik = (r_i * H + i_h)[:, None] * K + o_k[None, :]
    g_ref = tl.load(gc + ((t0 + i_i * BC - 1) * H + i_h) * K + o_k, mask=m_k, other=0.0)
    b_qi = tl.load(q + off_ik, mask=m_ik, other=0.0).to(tl.float32)
    b_ki = tl.load(k + off_ik, mask=m_ik, other=0.0).to(tl.float32)
    b_gi = tl.load(gc + off_ik, mask=m_ik, other=0.0)
    gate_i = tl.exp(tl.where(m_ik, b_gi - g_ref[None, :], float("-inf")))
    r_j = t0 + i_j * BC + sub  # block j lies before block i: every row is inside the sequence
    m_jk = (r_j < eos)[:, None] & m_k[None, :]
    off_jk = (r_j * H + i_h)[:, None] * K + o_k[None, :]
    b_kj = tl.load(k + off_jk, mask=m_jk, other=0.0).to(tl.float32)
    b_gj = tl.load(gc + off_jk, mask=m_jk, other=0.0)
    b_kgj = tl.trans(b_kj * tl.exp(tl.where(m_jk, g_ref[None, :] - b_gj, float("-inf"))))
    off_ij = (r_i * H + i_h)[:, None] * BT + i_j * BC + sub[None, :]
    tl.store(Akk + off_ij, _dot(b_ki * gate_i, b_kgj, LOWP, DOT_PRECISION), mask=m_i[:, None])
    tl.store(Pqk + off_ij, _dot(b_qi * gate_i, b_kgj, LOWP, DOT_PRECISION) * scale, mask=m_i[:, None])


@triton.jit
def _diag_block(q, k, gc, Akk, Pqk, scale, t0, eos, i_h, i_i,
                H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                BY_COLUMN: tl.constexpr):
    """Block (i, i), exactly, the exponent masked to rows i >= j before exp() (no exponent is ever
    positive, padding rows never reach exp()).  ``BY_COLUMN`` (a GPU): for each key row j of the block,
    the block's rows times k_j exp(G_i - G_j), reduced over K; on an H200 this took the intra kernel
    from 273 to 179 us at 4096 tokens against building the block from [BC, BC, 8] slices of the
    products, whose 3-D layout the reductions paid for (bench/RESULTS.md, 2026-12-04).  Otherwise (the
    interpreter, where every operation costs alike whatever its size): one [BC, BC, BK] product, which
    runs the KDA probes twice as fast there as the sixteen columns do."""
    sub = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    r_i = t0 + i_i * BC + sub
    m_i = r_i < eos
    m_ik = m_i[:, None] & m_k[None, :]
    off_ik = (r_i * H + i_h)[:, None] * K + o_k[None, :]
    b_q = tl.load(q + off_ik, mask=m_ik, other=0.0).to(tl.float32)
    b_k = tl.load(k + off_ik, mask=m_ik, other=0.0).to(tl.float32)
    b_g = tl.load(gc + off_ik, mask=m_ik, other=0.0)
    if BY_COLUMN:
        b_L = tl.zeros([BC, BC], dtype=tl.float32)
        b_P = tl.zeros([BC, BC], dtype=tl.float32)
        for j in range(0, BC):
            r_j = t0 + i_i * BC + j
            m_jk = m_k & ((r_j + 0 * o_k) < eos)  # (a tensor mask: the interpreter refuses a scalar one)
            b_kj = tl.load(k + (r_j * H + i_h) * K + o_k, mask=m_jk, other=0.0).to(tl.float32)
            b_gj = tl.load(gc + (r_j * H + i_h) * K + o_k, mask=m_jk, other=0.0)
            keep = (m_i & (sub >= j))[:, None] & m_k[None, :]
            b_kgj = tl.exp(tl.where(keep, b_g - b_gj[None, :], float("-inf"))) * b_kj[None, :]
            b_L = tl.where(sub[None, :] == j, tl.sum(b_k * b_kgj, axis=1)[:, None], b_L)
            b_P = tl.where(sub[None, :] == j, tl.sum(b_q * b_kgj, axis=1)[:, None], b_P)
    else:
        keep = ((sub[:, None] >= sub[None, :]) & (m_i[:, None] & m_i[None, :]))[:, :, None] & m_k[None, None, :]
        b_kd = b_k[None, :, :] * tl.exp(tl.where(keep, b_g[:, None, :] - b_g[None, :, :], float("-inf")))
        b_L = tl.sum(b_k[:, None, :] * b_kd, axis=2)
        b_P = tl.sum(b_q[:, None, :] * b_kd, axis=2)
    off_ii = (r_i * H + i_h)[:, None] * BT + i_i * BC + sub[None, :]
    tl.store(Akk + off_ii, b_L, mask=m_i[:, None])
    tl.store(Pqk + off_ii, b_P * scale, mask=m_i[:, None])


@triton.jit
def _kda_intra_block_kernel(
    q, k, gc, Akk, Pqk,
    cu_seqlens, chunk_seq, chunk_pos,
    scale,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    NC: tl.constexpr, LOWP: tl.constexpr, DOT_PRECISION: tl.constexpr, BY_COLUMN: tl.constexpr,
):
    """One [BC, BC] block (i, j), j <= i, of L[i, j] = <k_i, k_j exp(G_i - G_j)> and
    P[i, j] = scale <q_i, k_j exp(G_i - G_j)> per program: grid (chunks, NC (NC + 1) / 2, heads)."""
    i_c = tl.program_id(0)
    i_p = tl.program_id(1)
    i_h = tl.program_id(2)
    i_i = 0
    for r in tl.static_range(1, NC):  # pair index p = i (i + 1) / 2 + j
        i_i += (i_p >= r * (r + 1) // 2).to(tl.int32)
    i_j = i_p - i_i * (i_i + 1) // 2
    t0, eos = _chunk_span(cu_seqlens, chunk_seq, chunk_pos, i_c, BT)
    if t0 + i_i * BC < eos:  # blocks wholly past the sequence end (short last chunk) are skipped
        if i_j < i_i:
            _offdiag_block(q, k, gc, Akk, Pqk, scale, t0, eos, i_h, i_i, i_j, H, K, BT, BC, BK, LOWP, DOT_PRECISION)
        else:
            _diag_block(q, k, gc, Akk, Pqk, scale, t0, eos, i_h, i_i, H, K, BT, BC, BK, BY_COLUMN)


@triton.jit
def _kda_solve_kernel(
    k, v, beta, gc, Akk, w, u, kd,
    cu_seqlens, chunk_seq, chunk_pos,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    LOG2_BT: tl.constexpr, LOWP: tl.constexpr, DOT_PRECISION: tl.constexpr, INV_PRECISION: tl.constexpr,
):
    """The UT transform T = (I + Diag(b) L)^-1 Diag(b) of one chunk and head, then w = T (exp(G) k),
    u = T v, and kd = k exp(G_last - G), the keys decayed to the chunk's end that the sequential
    state kernel needs (computed here, in parallel, instead of inside its loop).  w, u and kd are
    stored in their buffers' dtype: 16-bit for 16-bit inputs, as the products take them anyway."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    t0, eos = _chunk_span(cu_seqlens, chunk_seq, chunk_pos, i_c, BT)
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BT)
    m_t = (t0 + rows) < eos
    o_k = tl.arange(0, BK)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    off_tk = ((t0 + rows) * H + i_h)[:, None] * K + o_k[None, :]
    off_tt = ((t0 + rows) * H + i_h)[:, None] * BT + cols[None, :]
    lower = rows[:, None] > cols[None, :]
    b_b = tl.load(beta + (t0 + rows) * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_L = tl.load(Akk + off_tt, mask=m_t[:, None] & lower, other=0.0) * b_b[:, None]

    # X = (I + L)^-1 by recursive doubling: X holds the inverses of the diagonal s-blocks; the
    # lower-left s-block C of each 2s-block becomes -B^-1 C A^-1 = -(X C X) there.
    b_X = tl.where(rows[:, None] == cols[None, :], 1.0, 0.0)
    s = 1
    for _ in range(LOG2_BT):
        in_pair = (rows[:, None] // (2 * s)) == (cols[None, :] // (2 * s))
        off_diag = (rows[:, None] // s) != (cols[None, :] // s)
        b_C = tl.where(in_pair & off_diag, b_L, 0.0)
        b_XC = tl.dot(b_X, b_C, input_precision=INV_PRECISION)
        b_X = b_X - tl.dot(b_XC, b_X, input_precision=INV_PRECISION)
        s = s * 2
    b_T = b_X * b_b[None, :]  # the UT transform T = (I + L)^-1 Diag(b)

    b_k = tl.load(k + off_tk, mask=m_tk, other=0.0).to(tl.float32)
    b_gc = tl.load(gc + off_tk, mask=m_tk, other=0.0)
    b_kg = tl.where(m_tk, b_k * tl.exp(b_gc), 0.0)
    tl.store(w + off_tk, _dot(b_T, b_kg, LOWP, DOT_PRECISION).to(w.dtype.element_ty), mask=m_tk)
    t_last = tl.minimum(t0 + BT, eos) - 1
    g_last = tl.load(gc + (t_last * H + i_h) * K + o_k, mask=o_k < K, other=0.0)
    b_kd = tl.where(m_tk, b_k * tl.exp(g_last[None, :] - b_gc), 0.0)
    tl.store(kd + off_tk, b_kd.to(kd.dtype.element_ty), mask=m_tk)
    for i_v in range(0, (V + BV - 1) // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        off_tv = ((t0 + rows) * H + i_h)[:, None] * V + o_v[None, :]
        b_v = tl.load(v + off_tv, mask=m_tv, other=0.0).to(tl.float32)
        tl.store(u + off_tv, _dot(b_T, b_v, LOWP, DOT_PRECISION).to(u.dtype.element_ty), mask=m_tv)


@triton.jit
def _kda_state_kernel(
    kd, gc, w, u, v_new, h, h0, ht,
    cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    LOWP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
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
        tl.store(h + ((c0 + i_c) * H + i_h) * K * V + off_kv, b_S.to(h.dtype.element_ty), mask=m_kv)
        m_t = (t0 + rows) < eos
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        off_tk = ((t0 + rows) * H + i_h)[:, None] * K + o_k[None, :]
        off_tv = ((t0 + rows) * H + i_h)[:, None] * V + o_v[None, :]
        b_w = tl.load(w + off_tk, mask=m_tk, other=0.0)
        b_u = tl.load(u + off_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_vn = b_u - _dot(b_w, b_S, LOWP, DOT_PRECISION)
        tl.store(v_new + off_tv, b_vn.to(v_new.dtype.element_ty), mask=m_tv)

        t_last = tl.minimum(t0 + BT, eos) - 1
        g_last = tl.load(gc + (t_last * H + i_h) * K + o_k, mask=m_k, other=0.0)
        b_kd = tl.load(kd + off_tk, mask=m_tk, other=0.0)  # k exp(G_last - G), zero past the end
        b_S = b_S * tl.exp(g_last)[:, None] + _dot(tl.trans(b_kd), b_vn, LOWP, DOT_PRECISION)

    if STORE_FINAL_STATE:
        tl.store(ht + (i_n * H + i_h) * K * V + off_kv, b_S, mask=m_kv)


@triton.jit
def _kda_output_kernel(
    q, gc, Pqk, v_new, h, o,
    cu_seqlens, chunk_seq, chunk_pos,
    scale,
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

    b_q = tl.load(q + off_tk, mask=m_tk, other=0.0).to(tl.float32)
    b_gc = tl.load(gc + off_tk, mask=m_tk, other=0.0)
    b_qg = b_q * tl.exp(b_gc) * scale
    b_S = tl.load(h + (i_c.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                  mask=m_k[:, None] & m_v[None, :], other=0.0)
    b_P = tl.load(Pqk + ((t0 + rows) * H + i_h)[:, None] * BT + rows[None, :],
                  mask=m_t[:, None] & (rows[:, None] >= rows[None, :]), other=0.0)  # only j <= i is written
    b_vn = tl.load(v_new + off_tv, mask=m_tv, other=0.0)
    b_o = _dot(b_qg, b_S, LOWP, DOT_PRECISION) + _dot(b_P, b_vn, LOWP, DOT_PRECISION)
    tl.store(o + off_tv, b_o.to(o.dtype.element_ty), mask=m_tv)


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The three launches of :func:`chunk_kda` on validated inputs and prepared chunk indices.

    No host synchronisation happens here, so a CUDA graph can capture it.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    n_seq = cu_seqlens.numel() - 1
    BT = CHUNK_SIZE
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    # 16-bit inputs: the chunk products take 16-bit operands (fp32 accumulate) and the triangular
    # inverse runs at tf32, as in flash-linear-attention: the output is 16-bit anyway.  fp32 inputs
    # keep fp32 operands at ``precision`` throughout.  The interpreter's 16-bit dot is not
    # trustworthy, so it always takes the fp32 path.
    lowp = q.element_size() == 2 and not interpreting()
    BK = block_size(K)
    BV = min(block_size(V), 32 if BK > 64 else 64)
    if lowp and BK < 64:
        # Small heads in 16 bits take the (64, 64) tiles: with K = V = 16 (16- or 32-wide tiles) the
        # solve kernel's bf16 products read past its shared memory on an H200 with Triton 3.6
        # (compute-sanitizer) and came out wrong; the masks keep the wider tiles exact.
        BK, BV = 64, 64
    chunk_seq, chunk_pos, chunk_offsets = chunks
    NT = chunk_seq.numel()
    f32 = dict(dtype=torch.float32, device=q.device)
    gc = alloc(B, T, H, K, **f32)
    mid = dict(dtype=q.dtype if lowp else torch.float32, device=q.device)  # w, u, kd: what the products take
    w = alloc(B, T, H, K, **mid)
    u = alloc(B, T, H, V, **mid)
    kd = alloc(B, T, H, K, **mid)
    Akk = alloc(B, T, H, BT, **f32)
    Pqk = alloc(B, T, H, BT, **f32)
    BC = 16  # the intra kernel's blocks: 16 x 16, NC (NC + 1) / 2 of them per chunk
    NC = BT // BC
    _kda_cumsum_kernel[(NT, H)](g, gc, cu_seqlens, chunk_seq, chunk_pos, H=H, K=K, BT=BT, BK=BK)
    _kda_intra_block_kernel[(NT, NC * (NC + 1) // 2, H)](
        q, k, gc, Akk, Pqk, cu_seqlens, chunk_seq, chunk_pos, scale,
        H=H, K=K, BT=BT, BC=BC, BK=BK, NC=NC, LOWP=lowp, DOT_PRECISION=precision,
        BY_COLUMN=not interpreting() if DIAG_BY_COLUMN is None else DIAG_BY_COLUMN, num_warps=4,
    )
    _kda_solve_kernel[(NT, H)](
        k, v, beta, gc, Akk, w, u, kd, cu_seqlens, chunk_seq, chunk_pos,
        H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, LOG2_BT=BT.bit_length() - 1,
        LOWP=lowp, DOT_PRECISION=precision, INV_PRECISION="tf32" if lowp else precision, num_warps=4,
    )
    h = alloc(NT, H, K, V, **mid)  # per-chunk entering states and corrected values: read by
    v_new = alloc(B, T, H, V, **mid)  # the output kernel's products only (16-bit for 16-bit inputs)
    ht = alloc(n_seq, H, K, V, **f32) if output_final_state else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    NV = triton.cdiv(V, BV)
    # pipelined: the next chunks' w, u and kd loads in flight during this chunk's products.  On an H200 at
    # 4096 tokens (H=16, K=V=128, bf16) the kernel took 167 us as a while loop, 134 / 109 / 111 us over
    # 2 / 3 / 4 stages; BV=32 and 4 warps stay the fastest (bench/RESULTS.md, 2026-12-03).  fp32 operands
    # take two: three stages of their tiles (72 KB each at K=128) would not fit the shared memory
    _kda_state_kernel[(NV, n_seq, H)](
        kd, gc, w, u, v_new, h, h0, ht, cu_seqlens, chunk_offsets,
        H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
        USE_INITIAL_STATE=h0 is not None, STORE_FINAL_STATE=ht is not None,
        LOWP=lowp, DOT_PRECISION=precision, num_warps=4, num_stages=3 if lowp else 2,
    )
    o = alloc(B, T, H, V, dtype=v.dtype, device=v.device)
    BVO = 64 if lowp else min(block_size(V), 64)  # the output kernel is parallel over chunks: wider V tiles pay
    _kda_output_kernel[(triton.cdiv(V, BVO), NT, H)](
        q, gc, Pqk, v_new, h, o, cu_seqlens, chunk_seq, chunk_pos, scale,
        H=H, K=K, V=V, BT=BT, BK=BK, BV=BVO, LOWP=lowp, DOT_PRECISION=precision, num_warps=8 if lowp else 4,
    )
    return o, ht
