"""The one-launch RMSNorm (gated and not) against float64, in fp32, on fresh random inputs (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from target_stack.model.layers import RMSNorm
from target_stack.ops.kda.testing import DEVICE, rel_err
from target_stack.ops.norm import rms_norm, row_groups


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


@pytest.mark.parametrize("layout", ["slice", "slice_transposed", "sliced_rows"])
def test_a_gate_read_in_place_from_a_wider_product(layout, gen):
    """The KDA layer's gate is a slice of one product of its stacked projections: the kernel reads its rows
    where they lie (``row_groups``), and gives what the same gate copied out gives."""
    B, H, V, wide = 3, 4, 24, 150
    proj = (torch.randn(B, 1, wide, generator=gen) * 4).to(DEVICE)
    x = (torch.randn(B, 1, H, V, generator=gen) * 3).to(DEVICE)
    gate = proj[..., 10:10 + H * V].reshape(B, 1, H, V)
    if layout == "slice_transposed":  # [B, H, 1, V]: the same rows, the unit dimension moved
        x, gate = x.transpose(1, 2), gate.transpose(1, 2)
    elif layout == "sliced_rows":  # every row the first half of a wider row: groups of one
        x, gate = x[:, 0], (torch.randn(B, H, 2 * V, generator=gen) * 4).to(DEVICE)[..., :V]
    w = (torch.rand(V, generator=gen) + 0.5).to(DEVICE)
    assert row_groups(gate) is not None and not gate.is_contiguous()
    y = rms_norm(x, w, 1e-6, gate=gate)
    assert rel_err(y, ref64(x, w, 1e-6, gate.contiguous())) < 1e-6
    assert torch.equal(y, rms_norm(x, w, 1e-6, gate=gate.contiguous()))


def test_row_groups_names_the_layouts_it_can_read_and_no_other():
    t = torch.empty(2, 3, 4, 8)
    assert row_groups(t) == (1, 8)  # contiguous
    p = torch.empty(5, 1, 100)
    assert row_groups(p[..., 4:36].reshape(5, 1, 4, 8)) == (4, 100)  # 4 rows side by side, then the next token's
    assert row_groups(torch.empty(2, 3, 50)[..., :8]) == (1, 50)  # every row apart
    assert row_groups(torch.empty(8, 4).t()) is None  # the row's own elements strided
    assert row_groups(torch.empty(4, 6, 8)[:, ::2]) == (1, 16)  # every other row
    assert row_groups(torch.empty(4, 6, 8).transpose(0, 1)) is None  # the outer dimensions out of order
