"""RMSNorm, optionally gated, in one Triton launch: the GPU form of the model's norms.

    y = x * rsqrt(mean(x^2) + eps) * w            (over the last dimension, in fp32)
    y = y * sigmoid(gate)                          (gated: the KDA layer's output norm)

written in ``out_dtype`` (default: x's).  In torch the same takes seven to ten launches (the casts
to fp32 and back, the square, the mean, the rsqrt, the products, the gate): a decode step at batch 1
runs one norm per sublayer, each a few microseconds of launches around almost no work, which is
what bounds the step (``bench/decode_ops.py`` counts them).  One program per row; rows up to a few
thousand wide fit one block.  The model keeps its torch form on the CPU (``RMSNorm.forward``,
``KDALayer._output``), and its probes judge both forms against float64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from target_stack.ops.utils import CachedLaunch


@triton.jit
def _rms_norm_kernel(x, w, gate, y, N, eps, BLOCK: tl.constexpr, GATED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    xv = tl.load(x + row * N + offs, mask=m, other=0.0).to(tl.float32)
    wv = tl.load(w + offs, mask=m, other=0.0).to(tl.float32)
    out = xv * tl.rsqrt(tl.sum(xv * xv, axis=0) / N + eps) * wv
    if GATED:
        out = out * tl.sigmoid(tl.load(gate + row * N + offs, mask=m, other=0.0).to(tl.float32))
    tl.store(y + row * N + offs, out.to(y.dtype.element_ty), mask=m)


_launch = CachedLaunch(_rms_norm_kernel)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, gate: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm over the last dimension (times ``sigmoid(gate)``, of x's shape) in one launch."""
    N = x.shape[-1]
    if w.shape != (N,):
        raise ValueError(f"the norm's weight must have shape ({N},), got {tuple(w.shape)}")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    x = x.contiguous()
    gate = gate.contiguous() if gate is not None else None
    y = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    rows = x.numel() // N if N else 0
    if rows:
        key = (N, x.dtype, w.dtype, y.dtype, gate is not None and gate.dtype, x.device)
        BLOCK = triton.next_power_of_2(N)
        _launch((rows, 1, 1), key, (x, w, gate if gate is not None else x, y, N, float(eps)),
                dict(BLOCK=BLOCK, GATED=gate is not None, num_warps=4 if BLOCK >= 1024 else 1))
    return y

