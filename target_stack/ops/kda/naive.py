"""Plain torch references for Kimi Delta Attention (KDA).

The recurrence, for every sequence and head (state S is K x V):

    S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T
    o_t = scale * S_t^T q_t

Shapes follow flash-linear-attention: q, k ``[B, T, H, K]``, v ``[B, T, H, V]``,
g ``[B, T, H, K]`` (per-channel log decay), beta ``[B, T, H]`` and states ``[B, H, K, V]``.

Both functions compute in float64 when given float64 inputs and in float32 otherwise; they
are the references every kernel is judged against, so they favour clarity over speed.
"""

from __future__ import annotations

import torch


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def kda_gate(raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """KDA's log decay from the raw gate input ``[..., H, K]``: ``-exp(A_log[h]) * softplus(raw + dt_bias[h, :])``,
    in ``raw``'s dtype (float64 for a reference).  ``A_log`` is ``[H]``, ``dt_bias`` ``[H * K]`` or ``[H, K]``."""
    H, K = raw.shape[-2:]
    x = raw if dt_bias is None else raw + dt_bias.to(raw.dtype).reshape(H, K)
    return -A_log.to(raw.dtype).exp()[:, None] * torch.nn.functional.softplus(x)


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA: the definition, one rank-one update per token."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    cdt = _compute_dtype(q, k, v, g, beta)
    q, k, v, g, beta = (x.to(cdt) for x in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, V)
    if initial_state is not None:
        S = S + initial_state.to(cdt)
    o = q.new_empty(B, T, H, V)
    for t in range(T):
        k_t, b_t = k[:, t], beta[:, t, :, None]
        S = S * g[:, t].exp()[..., None]  # Diag(exp(g_t)) S
        pred = torch.einsum("bhk,bhkv->bhv", k_t, S)  # k_t^T S: what the state recalls for k_t
        S = S + torch.einsum("bhk,bhv->bhkv", k_t, b_t * (v[:, t] - pred))
        o[:, t] = scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S)
    return o, (S if output_final_state else None)


def naive_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    return_values: bool = False,
):
    """Chunked KDA (WY/UT form): the same maths as :func:`naive_recurrent_kda`, chunk by chunk.

    Returns ``(o, final_state)``, and with ``return_values`` also the effective values u'
    ``[B, T, H, V]``: per token, the rank-one update S_t = Diag(exp(g_t)) S_{t-1} + k_t u'_t^T
    (what :class:`~target_stack.engine.replay_ssm.ReplaySSM` records).

    Inside a chunk with cumulative log decay G_i = g_1 + ... + g_i:
      L[i, j] = b_i <k_i, k_j exp(G_i - G_j)>          for j < i
      T       = (I + L)^-1 Diag(b)                     (the UT transform)
      w = T (exp(G) * k),  u = T v,  u' = u - w S      (u' are the effective values)
      o = scale * [(q exp(G)) S + P u'],  P[i, j] = <q_i, k_j exp(G_i - G_j)> for j <= i
      S <- Diag(exp(G_C)) S + (k exp(G_C - G))^T u'
    Every exponent is a difference G_i - G_j with j <= i, so nothing overflows.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    scale = K**-0.5 if scale is None else scale
    cdt = _compute_dtype(q, k, v, g, beta)
    q, k, v, g, beta = (x.to(cdt).transpose(1, 2) for x in (q, k, v, g, beta))  # [B, H, T, ...]
    S = q.new_zeros(B, H, K, V)
    if initial_state is not None:
        S = S + initial_state.to(cdt)
    o = q.new_empty(B, H, T, V)
    values = q.new_empty(B, H, T, V) if return_values else None
    for s in range(0, T, C):
        e = min(s + C, T)
        n = e - s
        qc, kc, vc, bc = q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], beta[:, :, s:e]
        G = g[:, :, s:e].cumsum(2)  # [B, H, n, K]
        # decay[i, j, :] = exp(G_i - G_j), only used where j <= i
        diff = G[:, :, :, None, :] - G[:, :, None, :, :]
        lower = torch.tril(torch.ones(n, n, dtype=torch.bool, device=q.device))
        decay = torch.where(lower[..., None], diff, torch.full_like(diff, float("-inf"))).exp()
        Lkk = torch.einsum("bhik,bhjk,bhijk->bhij", kc, kc, decay) * bc[..., None]
        Lkk = Lkk.tril(-1)
        eye = torch.eye(n, dtype=cdt, device=q.device)
        Tm = torch.linalg.solve_triangular(eye + Lkk, eye.expand_as(Lkk), upper=False) * bc[..., None, :]
        w = Tm @ (G.exp() * kc)
        u = Tm @ vc
        v_new = u - w @ S
        if values is not None:
            values[:, :, s:e] = v_new
        Pqk = torch.einsum("bhik,bhjk,bhijk->bhij", qc, kc, decay)
        o[:, :, s:e] = scale * ((qc * G.exp()) @ S + Pqk @ v_new)
        G_last = G[:, :, -1:]  # [B, H, 1, K]
        S = S * G_last.transpose(-1, -2).exp() + ((G_last - G).exp() * kc).transpose(-1, -2) @ v_new
    final = S if output_final_state else None
    if return_values:
        return o.transpose(1, 2), final, values.transpose(1, 2)
    return o.transpose(1, 2), final
