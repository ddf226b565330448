"""The MoE's definition: every expert on every token, weighted by the routing weights (zero off the
chosen top-k) and summed.  Slow and obviously right; it runs in the inputs' dtype (float64 included)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def moe_reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  experts: Sequence[Callable[[torch.Tensor], torch.Tensor]]) -> torch.Tensor:
    """sum_k weights[t, k] * experts[ids[t, k]](x[t]) for x [T, D], weights and ids [T, k]; float32 or wider."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    # scatter_add_: an expert named in two slots counts twice, as the sum says (scatter_ would keep one)
    dense = torch.zeros(x.shape[0], len(experts), dtype=dtype, device=x.device).scatter_add_(1, ids, weights.to(dtype))
    every = torch.stack([e(x).to(dtype) for e in experts], dim=1)  # [T, E, D]
    return (every * dense[..., None]).sum(1)
