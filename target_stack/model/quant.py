"""Quantisation for target_stack: W8A8 linear layers and INT8 / FP8 (e4m3) KV-cache storage.

W8A8: per-token symmetric int8 activations, per-output-channel symmetric int8 weights, an int32
accumulation, scales applied after.  KV: per-(token, head) scales stored beside the values.
Common-practice tolerances (issue 6): W8A8 output mean relative difference < 0.05 against the
unquantised layer; FP8 KV after dequantisation within atol 1e-3, rtol 0.1; INT8 KV within half a
scale step.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # float8_e4m3fn


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over the last dimension: (q int8, scale fp32 [..., 1]); x ~= q * scale."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-8)
    scale = amax / 127.0
    q = torch.round(x.float() / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_weight_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8 for a [out, in] weight: (q int8, scale fp32 [out])."""
    q, scale = quantize_per_token_int8(w)
    return q, scale.squeeze(-1)


def int8_matmul(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """int8 [M, K] x int8 [N, K]^T -> int32 [M, N], accumulated exactly.

    On a GPU: the int8 tensor-core product (``torch._int_mm``, which takes more than 16 rows and K and N
    multiples of 8: a short batch is padded with zero rows), else float64 (exact: every partial sum is an
    integer below 2**53 for K up to 5e11); CUDA has no int32 matmul.  On a CPU: int32."""
    if a.is_cuda:
        (M, K), N = a.shape, b_t.shape[0]
        if hasattr(torch, "_int_mm") and K % 8 == 0 and N % 8 == 0:
            padded = a if M > 16 else torch.cat([a, a.new_zeros(17 - M, K)])
            return torch._int_mm(padded.contiguous(), b_t.t().contiguous())[:M]
        return (a.double() @ b_t.double().t()).to(torch.int32)
    return (a.to(torch.int32) @ b_t.to(torch.int32).t()).to(torch.int32)


class W8A8Linear(torch.nn.Module):
    """A linear layer with int8 weights and per-token int8 activations."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        q, s = quantize_weight_int8(weight.detach())
        self.register_buffer("qweight", q)
        self.register_buffer("wscale", s)
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.out_features, self.in_features = weight.shape

    @classmethod
    def from_linear(cls, lin: torch.nn.Linear) -> W8A8Linear:
        return cls(lin.weight, lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xq, xs = quantize_per_token_int8(x.reshape(-1, shape[-1]))
        acc = int8_matmul(xq, self.qweight)
        y = acc.float() * xs * self.wscale[None, :]
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


def quantize_kv(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KV storage for x [..., heads, head_dim]: ('int8' | 'fp8' | 'bf16' | 'fp32') -> (values, scales or None).

    Scales are per (token, head): shape [..., heads, 1], fp32.
    """
    if kind == "fp32":
        return x.float(), None
    if kind == "bf16":
        return x.to(torch.bfloat16), None
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-8)
    if kind == "int8":
        scale = amax / 127.0
        return torch.round(x.float() / scale).clamp_(-127, 127).to(torch.int8), scale
    if kind == "fp8":
        scale = amax / FP8_MAX
        return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
    raise ValueError(f"KV storage kind must be fp32, bf16, int8 or fp8, got {kind!r}")


def dequantize_kv(values: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if scale is None:
        return values.to(dtype)
    return (values.float() * scale).to(dtype)
