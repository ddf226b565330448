"""RMSNorm, optionally gated, in one Triton launch: the GPU form of the model's norms.

    y = x * rsqrt(mean(x^2) + eps) * w            (over the last dimension, in fp32)
    y = y * sigmoid(gate)                          (gated: the KDA layer's output norm)
    x = x + residual, stored, then normed          (the residual stream: add and norm in one launch)

written in ``out_dtype`` (default: x's).  In torch the same takes seven to ten launches (the casts
to fp32 and back, the square, the mean, the rsqrt, the products, the gate): a decode step at batch 1
runs one norm per sublayer, each a few microseconds of launches around almost no work, which is
what bounds the step (``bench/decode_ops.py`` counts them).  One program per row; rows up to a few
thousand wide fit one block.  With a residual, the sum is rounded to x's dtype and stored, and the
norm reads that rounded sum: the same bits as torch's ``x + residual`` followed by the norm, in one
launch instead of two (a decode step adds into its residual stream twice per layer;
``RMSNorm.add_forward``).  The model keeps its torch form on the CPU (``RMSNorm.forward``,
``KDALayer._output``), and its probes judge both forms against float64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from target_stack.ops.utils import CachedLaunch, alloc


@triton.jit
def _rms_norm_kernel(x, w, gate, res, h, y, N, G, gs, eps, BLOCK: tl.constexpr, GATED: tl.constexpr,
                     RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    xv = tl.load(x + row * N + offs, mask=m, other=0.0).to(tl.float32)
    if RESIDUAL:  # x + res rounded to x's dtype (as torch's add rounds it), stored, and normed as stored
        hv = (xv + tl.load(res + row * N + offs, mask=m, other=0.0).to(tl.float32)).to(h.dtype.element_ty)
        tl.store(h + row * N + offs, hv, mask=m)
        xv = hv.to(tl.float32)
    wv = tl.load(w + offs, mask=m, other=0.0).to(tl.float32)
    out = xv * tl.rsqrt(tl.sum(xv * xv, axis=0) / N + eps) * wv
    if GATED:
        # the gate's row r is at (r // G) * gs + (r % G) * N: a view into a wider product needs no copy
        # (G = 1 and gs = N: contiguous); shifted here so that the load below reads it as r * N
        gate = gate + (row // G) * (gs - G * N)
        out = out * tl.sigmoid(tl.load(gate + row * N + offs, mask=m, other=0.0).to(tl.float32))
    tl.store(y + row * N + offs, out.to(y.dtype.element_ty), mask=m)


_launch = CachedLaunch(_rms_norm_kernel)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, gate: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None, residual: torch.Tensor | None = None):
    """RMSNorm over the last dimension (times ``sigmoid(gate)``, of x's shape) in one launch.  With
    ``residual`` (x's shape and dtype): ``(norm(x + residual), x + residual)``, the sum in x's dtype."""
    N = x.shape[-1]
    if w.shape != (N,):
        raise ValueError(f"the norm's weight must have shape ({N},), got {tuple(w.shape)}")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must have x's shape {tuple(x.shape)} and dtype {x.dtype}, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    x = x.contiguous()
    groups = (1, N)
    if gate is not None:
        groups = row_groups(gate)
        if groups is None:
            gate = gate.contiguous()
            groups = (1, N)
    res = residual.contiguous() if residual is not None else None
    y = alloc(*x.shape, dtype=out_dtype or x.dtype, device=x.device)  # NaN while poisoning: every element written
    h = alloc(*x.shape, dtype=x.dtype, device=x.device) if res is not None else None
    rows = x.numel() // N if N else 0
    if rows:
        key = (N, *groups, x.dtype, w.dtype, y.dtype, gate is not None and gate.dtype, res is not None, x.device)
        BLOCK = triton.next_power_of_2(N)
        _launch((rows, 1, 1), key, (x, w, gate if gate is not None else x, res if res is not None else x,
                                    h if h is not None else x, y, N, *groups, float(eps)),
                dict(BLOCK=BLOCK, GATED=gate is not None, RESIDUAL=res is not None,
                     num_warps=4 if BLOCK >= 1024 else 1))
    return y if res is None else (y, h)


def row_groups(t: torch.Tensor) -> tuple[int, int] | None:
    """(G, stride) such that row r of ``t`` (its last dimension being a row of N) starts at element
    ``(r // G) * stride + (r % G) * N`` from t's first, or None when t's layout has no such form.

    A contiguous tensor is (1, N).  The gate sliced from a wider projection, ``proj[..., a:a + H * V]``
    viewed as [B, 1, H, V], is (H, proj.shape[-1]): H rows of V side by side, then the next token's."""
    N = t.shape[-1]
    if N > 1 and t.stride(-1) != 1:
        return None
    dims = [(n, st) for n, st in zip(t.shape[:-1], t.stride()[:-1]) if n != 1]
    G, inner = 1, N
    while dims and dims[-1][1] == inner:  # the rows laid end to end
        n, _ = dims.pop()
        G, inner = G * n, inner * n
    if not dims:
        return 1, N
    stride = dims[-1][1]
    span = stride
    for n, st in reversed(dims):  # what is left must be one run of groups at a common stride
        if st != span:
            return None
        span *= n
    return G, stride
