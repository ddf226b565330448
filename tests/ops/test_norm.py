"""The one-launch RMSNorm (gated and not) against float64, in fp32, on fresh random inputs (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from target_stack.model.layers import RMSNorm
from target_stack.ops.kda.testing import DEVICE, rel_err
from target_stack.ops.norm import rms_norm


def ref64(x, w, eps, gate=None):
    xd = x.double()
    y = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + eps) * w.double()
    return y * torch.sigmoid(gate.double()) if gate is not None else y


@pytest.mark.parametrize("shape", [(3, 5, 64), (7, 48), (2, 1, 4, 130)])
@pytest.mark.parametrize("gated", [False, True])
def test_the_kernel_is_rmsnorm_in_fp32(shape, gated, gen):
    x = (torch.randn(*shape, generator=gen) * 3 + 0.5).to(DEVICE)
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(DEVICE)
    gate = torch.randn(*shape, generator=gen).to(DEVICE) * 4 if gated else None
    y = rms_norm(x, w, 1e-6, gate=gate)
    assert y.shape == x.shape and y.dtype == x.dtype and torch.isfinite(y).all()  # every element written
    assert rel_err(y, ref64(x, w, 1e-6, gate)) < 1e-6


def test_it_writes_the_dtype_asked_and_refuses_mismatched_shapes(gen):
    x = torch.randn(4, 32, generator=gen).to(DEVICE)
    w = torch.rand(32, generator=gen).to(DEVICE) + 0.5
    y = rms_norm(x, w, 1e-5, out_dtype=torch.float64)
    assert y.dtype == torch.float64 and rel_err(y, ref64(x, w, 1e-5)) < 1e-6
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(x, w[:16], 1e-5)
    with pytest.raises(ValueError, match="gate must have x's shape"):
        rms_norm(x, w, 1e-5, gate=x[:2])
    assert rms_norm(x[:0], w, 1e-5).shape == (0, 32)


# Triton's interpreter rounds fp32 -> bf16 toward zero (fp_downcast_rounding too), torch to nearest even: the
# bf16 bits are checked where the kernel is compiled
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    torch.device(DEVICE).type != "cuda", reason="the interpreter truncates fp32 -> bf16; torch rounds to nearest"))])
def test_the_residual_sum_is_stored_rounded_and_normed_as_stored(dtype, gen):
    """(norm(x + r), x + r) in one launch: the same bits as torch's add in x's dtype followed by the kernel."""
    x = (torch.randn(3, 5, 96, generator=gen) * 2).to(DEVICE).to(dtype)
    r = torch.randn(3, 5, 96, generator=gen).to(DEVICE).to(dtype)
    w = (torch.rand(96, generator=gen) + 0.5).to(DEVICE)
    y, total = rms_norm(x, w, 1e-6, residual=r)
    assert total.dtype == y.dtype == dtype and torch.equal(total, x + r)
    assert torch.equal(y, rms_norm(x + r, w, 1e-6))
    assert rel_err(y, ref64(x + r, w, 1e-6)) < (1e-6 if dtype == torch.float32 else 1e-2)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        rms_norm(x, w, 1e-6, residual=r.float() if dtype != torch.float32 else r.double())


@pytest.mark.parametrize("fused", [False, True])
def test_the_modules_add_and_norm_equals_the_add_then_the_norm(fused, gen):
    norm = RMSNorm(64).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=gen) + 0.5)
    norm.fused = fused
    h, delta = torch.randn(2, 1, 64, generator=gen).to(DEVICE), torch.randn(2, 1, 64, generator=gen).to(DEVICE)
    total, y = norm.add_forward(h, delta)
    assert torch.equal(total, h + delta) and torch.equal(y, norm(h + delta))
    # a stream and an update of different dtypes take the torch add (its promotion), not the kernel
    total, y = norm.add_forward(h, delta.double())
    assert total.dtype == torch.float64 and torch.equal(y, norm(h + delta.double()))
