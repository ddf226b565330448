"""The one-launch RMSNorm (gated and not) against float64, in fp32, on fresh random inputs (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

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
