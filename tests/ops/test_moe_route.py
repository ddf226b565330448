"""The one-launch MoE router against float64, in fp32, on fresh random inputs (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from target_stack.model.layers import MoE
from target_stack.ops.kda.testing import DEVICE, rel_err
from target_stack.ops.moe.route import moe_route


def _check(x, router, bias, top_k, w, idx):
    """idx is a top-k of the biased float64 scores (up to fp32 rounding), w the unbiased ones there, normalised."""
    scores = torch.sigmoid(x.double() @ router.double().t())
    pick = scores + bias.double()
    T, E = scores.shape
    assert w.shape == idx.shape == (T, top_k) and w.dtype == torch.float32 and idx.dtype == torch.int64
    assert ((idx >= 0) & (idx < E)).all() and all(len(set(row)) == top_k for row in idx.tolist())
    chosen = torch.zeros(T, E, dtype=torch.bool, device=x.device).scatter_(1, idx, True)
    lowest_chosen = pick.masked_fill(~chosen, float("inf")).amin(1)
    highest_left = pick.masked_fill(chosen, float("-inf")).amax(1)
    assert (lowest_chosen >= highest_left - 1e-6).all()  # no expert left out that beats a chosen one
    assert (pick.gather(1, idx).diff(dim=1) <= 1e-6).all()  # in descending order, as torch.topk gives them
    ref = scores.gather(1, idx)
    assert rel_err(w, ref / ref.sum(1, keepdim=True)) < 1e-6


# the product is split over D in slices of 4096 // E (a power of two): one slice, sixteen, a ragged last one
# (1000 = 7 * 128 + 104), and more slices than the second launch sums in one step (4096 / 16 = 256 > 16)
@pytest.mark.parametrize("T,D,E,top_k", [(1, 2048, 32, 4), (5, 96, 6, 2), (64, 200, 4, 4), (3, 64, 17, 1),
                                         (3, 1000, 17, 3), (2, 4096, 200, 8)])
def test_the_router_picks_the_top_k_and_normalises_their_scores(T, D, E, top_k, gen):
    x = (torch.randn(T, D, generator=gen) * 2).to(DEVICE)
    router = (torch.randn(E, D, generator=gen) * D**-0.5).to(DEVICE)
    bias = (torch.randn(E, generator=gen) * 0.1).to(DEVICE)
    w, idx = moe_route(x, router, bias, top_k)
    _check(x, router, bias, top_k, w, idx)


def test_the_bias_steers_the_choice_and_not_the_weights(gen):
    T, D, E = 8, 64, 8
    x = torch.randn(T, D, generator=gen).to(DEVICE)
    router = (torch.randn(E, D, generator=gen) * D**-0.5).to(DEVICE)
    bias = torch.zeros(E, device=DEVICE)
    bias[5] = 10.0  # expert 5 always chosen first, its weight still its own score's share
    w, idx = moe_route(x, router, bias, 2)
    assert (idx[:, 0] == 5).all()
    _check(x, router, bias, 2, w, idx)


def test_the_layer_takes_the_kernel_when_fused_and_agrees_with_its_torch_form(gen):
    moe = MoE(64, 32, n_experts=8, top_k=2, generator=gen).to(DEVICE)
    with torch.no_grad():
        moe.router_bias.copy_(torch.randn(8, generator=gen) * 0.05)
    x = torch.randn(6, 64, generator=gen).to(DEVICE)
    moe.fused = False
    w_torch, idx_torch = moe.route(x)
    moe.fused = True
    w_kernel, idx_kernel = moe.route(x)
    _check(x, moe.router, moe.router_bias, 2, w_kernel, idx_kernel)
    same = (idx_torch == idx_kernel).all(1)  # a near-tie may order two experts differently; everything else agrees
    assert same.float().mean() >= 0.5 and rel_err(w_kernel[same], w_torch[same]) < 1e-5
    assert rel_err(moe.forward_static(x[:, None]).squeeze(1), moe.reference(x)) < 1e-4


def test_bad_shapes_are_refused(gen):
    x = torch.randn(2, 16, generator=gen).to(DEVICE)
    with pytest.raises(ValueError, match="x must be"):
        moe_route(x[None], torch.randn(4, 16), torch.zeros(4), 2)
    with pytest.raises(ValueError, match="router must be"):
        moe_route(x, torch.randn(4, 8).to(DEVICE), torch.zeros(4).to(DEVICE), 2)
    with pytest.raises(ValueError, match="top_k must be"):
        moe_route(x, torch.randn(4, 16).to(DEVICE), torch.zeros(4).to(DEVICE), 5)
    w, idx = moe_route(x[:0], torch.randn(4, 16).to(DEVICE), torch.zeros(4).to(DEVICE), 2)
    assert w.shape == idx.shape == (0, 2)
