"""The MoE's serving forms in torch, over a flattened batch ``x2`` [T, D] with routing weights ``w``
and expert ids ``idx`` [T, k].  A (token, expert) pair ``p`` is token ``p // k``'s ``p % k``-th choice.

Every form returns float32 [T, D] without the shared expert (the layer adds it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F


def sort_pairs(idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """The pairs sorted by expert (stable) and each expert group's end, as host ints (one sync)."""
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=num_experts).cumsum(0).tolist()


def expert_groups(x2: torch.Tensor, w: torch.Tensor, order: torch.Tensor, ends: list[int],
                  experts: Sequence[Callable[[torch.Tensor], torch.Tensor]], top_k: int) -> torch.Tensor:
    """sum_k w[t, k] expert_k(x[t]) with the pairs already sorted by expert: ``order`` holds the pair
    indices, ``ends`` (host ints) where each expert's group ends.  One matmul chain per expert over its
    contiguous group, never a loop over tokens."""
    tok = order // top_k
    xs = x2[tok]
    ws = w.reshape(-1)[order, None]
    out = torch.zeros(x2.shape[0], x2.shape[1], device=x2.device, dtype=torch.float32)
    for e, (a, b) in enumerate(zip([0, *ends], ends, strict=False)):
        if b > a:
            out.index_add_(0, tok[a:b], experts[e](xs[a:b]).float() * ws[a:b])
    return out


def masked_dense(x2: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                 w_down: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, masked by the routing weights (zero off the top-k): no host
    synchronisation, and each expert's weights read once (the bytes of the grouped form once a batch
    touches most experts).  Weights [E, H, D], [E, H, D], [E, D, H]."""
    wg, wu, wd = (t.to(x2.dtype) for t in (w_gate, w_up, w_down))
    dense_w = torch.zeros(x2.shape[0], wg.shape[0], device=x2.device).scatter_(1, idx, w)
    act = F.silu(torch.einsum("td,ehd->teh", x2, wg)) * torch.einsum("td,ehd->teh", x2, wu)
    return torch.einsum("teh,edh->td", act * dense_w.to(x2.dtype)[..., None], wd).float()


def device_layout(idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs sorted by expert and the group ends (int32), both made on the device: no host sync."""
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=idx.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    return order, torch.cumsum(counts, 0, dtype=torch.int32)


def grouped_gemm_weights(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' weights laid out for :func:`grouped_gemm`: gate and up side by side [E, D, 2H], down [E, H, D]."""
    gate_up = torch.cat([w_gate, w_up], dim=1).transpose(1, 2).contiguous().to(dtype)
    return gate_up, w_down.transpose(1, 2).contiguous().to(dtype)


def grouped_gemm(x2: torch.Tensor, w: torch.Tensor, order: torch.Tensor, offs: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor, top_k: int) -> torch.Tensor:
    """Two grouped GEMMs (``torch._grouped_mm``) over pairs sorted by expert (``order``, device) with
    group ends ``offs`` (device int32), then the weighted combine."""
    tok = order // top_k
    h = torch._grouped_mm(x2[tok], gate_up, offs=offs)
    g, u = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(g) * u, down, offs=offs)
    out = torch.zeros(x2.shape[0], x2.shape[1], device=x2.device, dtype=torch.float32)
    return out.index_add_(0, tok, y.float() * w.reshape(-1)[order, None])
