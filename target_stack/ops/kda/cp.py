"""Context-parallel KDA prefill: partitions computed independently, then their states merged.

The KDA state update is affine in the state, so a partition p that starts from state h maps it
to  M_p h + h_local_p,  where h_local_p is its final state from a zero start and M_p (K x K) is
the product of its per-token transforms (I - b k k^T) Diag(exp(g)).  Context parallelism:

1. every partition, independently (here: all partitions as one packed varlen batch), computes
   h_local_p and M_p: one run of the recurrence on values [v, 0] from the state [0, I] ends in
   [h_local_p, M_p], since the update is linear in (v, h);
2. ``_kda_cp_merge_kernel`` chains  h_in_0 = h0,  h_in_{p+1} = M_p h_in_p + h_local_p  with
   ``tl.dot(..., input_precision=merge_precision)``;
3. every partition's output is recomputed from its incoming state h_in_p.

The merge is a long fp32 product chain: at tf32 (Triton's default for fp32 ``tl.dot``) its
error grows with the number of partitions (DESIGN.md, bench/RESULTS.md).  ``merge_precision``
defaults to tf32x3 where tf32 exists and ieee elsewhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from target_stack.ops.kda.chunk import chunk_kda
from target_stack.ops.utils import alloc, block_size, check_kda_inputs, resolve_dot_precision


@triton.jit
def _kda_cp_merge_kernel(
    M, h_local, h0, h_in, ht,
    P,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, MERGE_PRECISION: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_n = tl.program_id(1).to(tl.int64)
    i_h = tl.program_id(2)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_kv = m_k[:, None] & (o_v < V)[None, :]
    off_kv = o_k[:, None] * V + o_v[None, :]
    off_kk = o_k[:, None] * K + o_k[None, :]
    m_kk = m_k[:, None] & m_k[None, :]

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + (i_n * H + i_h) * K * V + off_kv, mask=m_kv, other=0.0).to(tl.float32)
    for p in range(0, P):
        row = (i_n * P + p) * H + i_h
        tl.store(h_in + row * K * V + off_kv, b_h, mask=m_kv)
        b_M = tl.load(M + row * K * K + off_kk, mask=m_kk, other=0.0)
        b_hl = tl.load(h_local + row * K * V + off_kv, mask=m_kv, other=0.0)
        b_h = tl.dot(b_M, b_h, input_precision=MERGE_PRECISION) + b_hl
    tl.store(ht + (i_n * H + i_h) * K * V + off_kv, b_h, mask=m_kv)


def partition_bounds(T: int, num_partitions: int) -> list[int]:
    """Contiguous partition boundaries [0, ..., T]; sizes differ by at most one token."""
    return [(T * p) // num_partitions for p in range(num_partitions + 1)]


def merge_states(
    M: torch.Tensor, h_local: torch.Tensor, initial_state: torch.Tensor | None, merge_precision: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain N x P partition transitions.  M ``[N, P, H, K, K]``, h_local ``[N, P, H, K, V]``.

    Returns (h_in ``[N, P, H, K, V]``: the state entering each partition, final ``[N, H, K, V]``).
    """
    N, P, H, K, V = h_local.shape
    BK = block_size(K)
    BV = min(block_size(V), 32 if BK > 64 else 64)
    h_in = alloc(N, P, H, K, V, dtype=torch.float32, device=h_local.device)
    ht = alloc(N, H, K, V, dtype=torch.float32, device=h_local.device)
    h0 = initial_state.contiguous() if initial_state is not None else None
    _kda_cp_merge_kernel[(triton.cdiv(V, BV), N, H)](
        M.contiguous(), h_local.contiguous(), h0, h_in, ht, P,
        H=H, K=K, V=V, BK=BK, BV=BV, USE_INITIAL_STATE=h0 is not None, MERGE_PRECISION=merge_precision,
    )
    return h_in, ht


def chunk_kda_cp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    num_partitions: int,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    merge_precision: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA prefill with the sequence cut into ``num_partitions`` contiguous partitions.

    Same contract as :func:`chunk_kda` without ``cu_seqlens``: returns ``(o, final_state)``.
    """
    B, T, H, K, V = check_kda_inputs(q, k, v, g, beta, initial_state)
    if isinstance(num_partitions, bool) or not isinstance(num_partitions, int):
        raise ValueError(f"num_partitions must be an int, got {type(num_partitions).__name__}")
    if not 1 <= num_partitions <= T:
        raise ValueError(f"num_partitions must be between 1 and T={T}, got {num_partitions}")
    precision = resolve_dot_precision(merge_precision, q.device, "merge_precision")
    P = num_partitions
    bounds = partition_bounds(T, P)
    # Every (sequence, partition) becomes one sequence of a packed varlen batch.
    cu = torch.tensor([n * T + b for n in range(B) for b in bounds[:-1]] + [B * T],
                      dtype=torch.int32, device=q.device)
    packed = [x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta)]
    pq, pk, pv, pg, pb = packed

    # 1. local final states and transitions in one pass: the state update is linear in
    #    (v, h), so running on [v, 0] from [0, I] ends in [h_local, M].
    eye = torch.eye(K, dtype=torch.float32, device=q.device).expand(B * P, H, K, K)
    start = torch.cat([eye.new_zeros(B * P, H, K, V), eye], dim=-1).contiguous()
    v_aug = torch.cat([pv, pv.new_zeros(1, B * T, H, K)], dim=-1)
    _, end = chunk_kda(pq, pk, v_aug, pg, pb, scale=scale, initial_state=start, output_final_state=True, cu_seqlens=cu)
    h_local, M = end[..., :V], end[..., V:]

    # 2. chain the partitions.
    h_in, ht = merge_states(M.view(B, P, H, K, K), h_local.view(B, P, H, K, V), initial_state, precision)

    # 3. each partition's output from its incoming state.
    o, _ = chunk_kda(pq, pk, pv, pg, pb, scale=scale, initial_state=h_in.view(B * P, H, K, V), cu_seqlens=cu)
    return o.view(B, T, H, V), (ht if output_final_state else None)
