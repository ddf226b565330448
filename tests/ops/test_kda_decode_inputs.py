"""The one-launch decode inputs of the KDA layer against its torch form (``KDALayer._inputs``), in fp32,
on fresh random inputs (interpreter on CPU): the convolution over the pooled tails, the norms, the gates,
the tail shift, and the null slot."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from target_stack.model.kda_layer import CONV, KDALayer
from target_stack.ops.kda.decode_inputs import kda_decode_inputs
from target_stack.ops.kda.testing import DEVICE, rel_err


def test_decode_inputs_equal_the_layers_torch_form_and_shift_the_tails(gen):
    H, K, V, dim = 3, 16, 24, 40
    layer = KDALayer(dim, H, K, V, generator=gen).to(DEVICE)
    with torch.no_grad():
        layer.dt_bias.copy_(torch.randn(H * K, generator=gen) * 3)  # softplus on both sides of its threshold
        layer.dt_bias[:4] = 25.0
    C = H * (2 * K + V)
    pool = torch.randn(6, CONV - 1, C, generator=gen).to(DEVICE)
    pool[0] = float("nan")  # the null slot, poisoned: read as zeros, never written
    before = pool.clone()
    slots = torch.tensor([4, 0, 1, 5], device=DEVICE)
    x = torch.randn(4, 1, dim, generator=gen).to(DEVICE)
    with torch.no_grad():
        hist = torch.where((slots > 0)[:, None, None], before[slots].nan_to_num(), 0.0)
        want, full = layer._inputs(x, hist)
        got = kda_decode_inputs(F.linear(x, layer.w_qkv), F.linear(x, layer.w_f), F.linear(x, layer.w_b), pool,
                                slots, layer.conv, layer.dt_bias, layer.A_log, H, K, V)
    for name, a, b in zip(("q", "k", "v", "g", "beta"), got, want, strict=True):
        assert a.shape == b.shape, name
        assert rel_err(a, b) < 1e-6, name
    for row, slot in ((0, 4), (2, 1), (3, 5)):  # the tails shifted by one: [tail_1, tail_2, this token's input]
        assert torch.equal(pool[slot], full[row, 1:])
    assert pool[0].isnan().all() and torch.equal(pool[2:4], before[2:4])


def test_the_pooled_decode_step_through_the_fused_inputs_equals_the_torch_step(gen):
    """KDALayer.decode_pooled on the Triton path (fused inputs, decode kernel, fused output norm) against its
    torch path over three steps, the pools carried by each."""
    H, K, V, dim = 2, 16, 16, 32
    layer = KDALayer(dim, H, K, V, generator=gen, backend="triton").to(DEVICE)
    layer.fused = True
    C = H * (2 * K + V)
    pools = {}
    for backend in ("triton", "torch"):
        conv = torch.zeros(4, CONV - 1, C, device=DEVICE)
        kda = torch.zeros(4, H, K, V, device=DEVICE)
        conv[1:] = torch.randn(3, CONV - 1, C, generator=torch.Generator().manual_seed(7)).to(DEVICE)
        kda[1:] = torch.randn(3, H, K, V, generator=torch.Generator().manual_seed(8)).to(DEVICE) * 0.1
        pools[backend] = (conv, kda)
    slots = torch.tensor([3, 0, 1], device=DEVICE)
    outs = {"triton": [], "torch": []}
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 1, dim, generator=gen).to(DEVICE)
            for backend in ("triton", "torch"):
                layer.backend = backend
                outs[backend].append(layer.decode_pooled(x, *pools[backend], slots))
    assert rel_err(torch.cat(outs["triton"]), torch.cat(outs["torch"])) < 1e-5
    for a, b in zip(pools["triton"], pools["torch"], strict=True):
        assert rel_err(a[1:], b[1:]) < 1e-5 and not a[0].any()  # the null slot stays zero


def test_slices_of_one_product_are_read_in_place(gen):
    """pre, f and b as slices of one product of the stacked weights (what the fused decode step passes):
    the same inputs as from three separate products, and the tails shifted the same."""
    H, K, V, dim = 2, 16, 8, 24
    layer = KDALayer(dim, H, K, V, generator=gen).to(DEVICE)
    C = H * (2 * K + V)
    x = torch.randn(3, 1, dim, generator=gen).to(DEVICE)
    slots = torch.tensor([2, 0, 1], device=DEVICE)
    pool = torch.randn(3, CONV - 1, C, generator=gen).to(DEVICE)
    pool_split = pool.clone()
    with torch.no_grad():
        pre, f, gate, b = F.linear(x, layer.input_weight()).split([C, H * K, H * V, H], dim=-1)
        assert not pre.is_contiguous() and not f.is_contiguous() and not b.is_contiguous()
        got = kda_decode_inputs(pre, f, b, pool, slots, layer.conv, layer.dt_bias, layer.A_log, H, K, V)
        want = kda_decode_inputs(F.linear(x, layer.w_qkv), F.linear(x, layer.w_f), F.linear(x, layer.w_b),
                                 pool_split, slots, layer.conv, layer.dt_bias, layer.A_log, H, K, V)
    for name, a, c in zip(("q", "k", "v", "g", "beta"), got, want, strict=True):
        assert rel_err(a, c) < 1e-6, name
    assert rel_err(gate, F.linear(x, layer.w_g)) < 1e-6
    assert torch.equal(pool, pool_split)


def test_the_stacked_weights_follow_an_in_place_change(gen):
    """input_weight is a cache: a weight written in place (a probe, a loaded checkpoint) is in the next step."""
    layer = KDALayer(16, 2, 8, 8, generator=gen).to(DEVICE)
    first = layer.input_weight()
    assert layer.input_weight() is first  # unchanged weights: the same tensor, no copy per step
    with torch.no_grad():
        layer.w_g.mul_(-1.0)
    stacked = layer.input_weight()
    assert stacked is not first
    assert torch.equal(stacked, torch.cat([layer.w_qkv, layer.w_f, layer.w_g, layer.w_b]))
