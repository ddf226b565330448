"""Inputs and error metrics shared by KDA tests, probes, the demo and the benchmark."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def make_inputs(
    B: int,
    T: int,
    H: int,
    K: int,
    V: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    decay_shift: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, ...]:
    """Fresh random KDA inputs (q, k, v, g, beta) with fla's test conventions.

    k is L2-normalised, beta in (0, 1), g = logsigmoid(N(decay_shift, 1)): a larger
    ``decay_shift`` means slower forgetting (longer memory), which is where a merge chain's
    rounding error has room to grow.
    """
    # drawn where the generator lives (a CPU generator can serve a GPU run), kept on ``device``
    kw = dict(dtype=torch.float32, device=generator.device if generator is not None else device, generator=generator)
    q = torch.randn(B, T, H, K, **kw)
    k = F.normalize(torch.randn(B, T, H, K, **kw), dim=-1)
    v = torch.randn(B, T, H, V, **kw)
    g = F.logsigmoid(torch.randn(B, T, H, K, **kw) + decay_shift)
    beta = torch.rand(B, T, H, **kw).clamp_min(1e-3)
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v, g, beta))


def default_device() -> str:
    """Where the Triton kernels run here: the GPU when there is one, else the interpreter's CPU."""
    import os

    return "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


DEVICE = default_device()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN or Inf anywhere gives inf."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    return (out64 - ref64).norm().item() / (denom if denom > 0 else 1.0)


def poison_(t: torch.Tensor, value: float = float("nan")) -> torch.Tensor:
    """Fill a tensor with a value no kernel can produce by accident (outputs are poisoned before runs)."""
    return t.fill_(value)
